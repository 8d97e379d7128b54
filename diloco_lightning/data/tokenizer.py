"""Tokenizers: a locally trained byte-level BPE (cached), raw bytes, or a user's ``tokenizer.json``.

All tokenizers expose the same small interface: ``encode``, ``encode_batch``, ``decode``,
``vocab_size``, ``eos_id`` (document separator, may be ``None``) and ``fingerprint``
(stable hash of the vocabulary; workers and master can compare it to make sure they
speak the same token ids).
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from diloco_lightning.data.cache import atomic_path, default_cache_dir
from diloco_lightning.data.corpus import CorpusFile, corpus_key, iter_texts

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "EOS_TOKEN",
    "ByteTokenizer",
    "BPETokenizer",
    "train_bpe",
    "load_or_train_bpe",
    "load_tokenizer",
]

#: Vocabulary size of the default BPE tokenizer (== the ``tiny`` model preset's vocab).
DEFAULT_VOCAB_SIZE = 4096
#: Document separator appended after every document.
EOS_TOKEN = "<|endoftext|>"
# End-of-document tokens recognised in user tokenizers, in order of preference.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
_BPE_FORMAT = "bpe-v1"  # bump when training settings change, to invalidate caches


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus ``<|endoftext|>`` = 256. No training, no files."""

    vocab_size = 257
    eos_id = 256
    fingerprint = "byte-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class BPETokenizer:
    """Wraps a ``tokenizers.Tokenizer``; never adds special tokens implicitly (no BOS)."""

    def __init__(self, tok, path: Path | None = None) -> None:
        self._tok = tok
        self.path = path
        self.eos_id: int | None = next(
            (i for i in (tok.token_to_id(t) for t in _EOS_CANDIDATES) if i is not None), None
        )
        self.fingerprint = hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> BPETokenizer:
        from tokenizers import Tokenizer

        path = Path(path)
        return cls(Tokenizer.from_file(str(path)), path)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # encode_batch_fast skips offset tracking (less memory); tokenizers >= 0.21.
        fn = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in fn(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` atomically."""
        with atomic_path(Path(path)) as tmp:
            self._tok.save(str(tmp))

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, path={self.path})"


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> BPETokenizer:
    """Train a GPT-2-style byte-level BPE (all 256 bytes in the alphabet, so no unknowns).

    The result may have fewer than ``vocab_size`` tokens if the corpus runs out of merges.
    """
    _check_vocab_size(vocab_size)
    return _train_bpe(texts, vocab_size)


def _check_vocab_size(vocab_size: int) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 257 <= vocab_size <= 2**31:
        raise ValueError(f"vocab_size must be an int >= 257 (256 bytes + {EOS_TOKEN}), got {vocab_size!r}")


def _train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return BPETokenizer(tok)


def load_or_train_bpe(
    files: Sequence[CorpusFile],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    cache_dir: str | os.PathLike | None = None,
) -> BPETokenizer:
    """The BPE tokenizer for ``files``: loaded from cache, or trained once and cached.

    Cache file: ``<cache_dir>/tokenizers/bpe-<vocab>-<hash>.json`` where the hash covers
    the corpus file names + sizes, the vocab size and the training-format version.
    """
    if not files:
        raise ValueError("files: empty corpus, nothing to train a tokenizer on")
    _check_vocab_size(vocab_size)
    key = hashlib.sha256(f"{_BPE_FORMAT}|{corpus_key(files)}|{vocab_size}".encode()).hexdigest()[:16]
    path = default_cache_dir(cache_dir) / "tokenizers" / f"bpe-{vocab_size}-{key}.json"
    if path.exists():
        log.debug("loading cached tokenizer %s", path)
        return BPETokenizer.from_file(path)
    t0 = time.perf_counter()
    tok = train_bpe(iter_texts(files), vocab_size)
    tok.save(path)
    tok.path = path
    log.info("trained BPE tokenizer (vocab %d) in %.1fs -> %s", tok.vocab_size, time.perf_counter() - t0, path)
    return tok


def load_tokenizer(
    spec: str | os.PathLike,
    files: Sequence[CorpusFile] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    cache_dir: str | os.PathLike | None = None,
) -> ByteTokenizer | BPETokenizer:
    """``"byte"``, ``"bpe"`` (trained on ``files``, cached) or a path to a ``tokenizer.json``."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "bpe":
        if files is None:
            raise ValueError("tokenizer: 'bpe' needs a text corpus to train on")
        return load_or_train_bpe(files, vocab_size, cache_dir)
    path = Path(os.fspath(spec)).expanduser()
    if not path.is_file():
        raise ValueError(f"tokenizer: expected 'bpe', 'byte' or a tokenizer.json path, got {spec!r} (no such file)")
    return BPETokenizer.from_file(path)
