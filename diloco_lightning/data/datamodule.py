"""``TextDataModule``: one DiLoCo worker's training shard plus the shared held-out split."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from diloco_lightning.data.corpus import DEFAULT_STDLIB_BYTES, CorpusFile, stdlib_corpus, text_corpus
from diloco_lightning.data.dataset import (
    STREAM_KEYS,
    HeldOutDataset,
    ShardedTokenDataset,
    check_int,
    stream_state,
    held_out_start,
)
from diloco_lightning.data.tokenizer import DEFAULT_VOCAB_SIZE, ByteTokenizer, load_tokenizer
from diloco_lightning.data.tokens import build_token_file, check_token_dtype, dtype_for_vocab, open_tokens

log = logging.getLogger(__name__)

__all__ = ["TextDataModule"]


class TextDataModule(L.LightningDataModule):
    """Tokenized text for one worker (``node_rank`` of ``num_nodes``), with exact resume.

    Data source (at most one of ``text_files`` / ``token_file``):

    * default: the Python standard library's own sources (nothing to download),
      ``max_bytes`` of it (default 16 MB), with a BPE tokenizer trained on it on first use;
    * ``text_files``: glob pattern(s) of UTF-8 text files (one document per file);
    * ``token_file``: a flat pre-tokenized file of ``token_dtype`` ids (``"uint16"`` or
      ``"uint32"``), memory-mapped; give ``tokenizer`` (a ``tokenizer.json`` or ``"byte"``)
      or ``vocab_size``.

    ``tokenizer``: ``"bpe"`` (default for text: byte-level BPE of ``vocab_size`` trained
    locally and cached), ``"byte"`` (UTF-8 bytes, vocab 257) or a ``tokenizer.json`` path.
    Tokenizer and tokenized corpus are cached under ``cache_dir`` (default
    ``$DILOCO_CACHE_DIR`` or ``~/.cache/diloco_lightning``), written atomically.

    The last ``val_fraction`` of the tokens is held out (identical on every node);
    ``val_windows`` scores only its first N windows (the same set whatever the batch size); the rest
    is split into disjoint interleaved shards (see ``ShardedTokenDataset``). The training
    stream is infinite: stop with ``Trainer(max_steps=...)`` and validate with an integer
    ``val_check_interval`` plus ``check_val_every_n_epoch=None`` (``limit_val_batches``
    caps the held-out batches evaluated).

    Resume: ``state_dict()`` stores the number of training samples the Trainer actually
    consumed (counted in ``on_before_batch_transfer``, so Lightning's one-batch prefetch is
    not counted), and Lightning saves it in checkpoints; after ``load_state_dict`` the
    next ``train_dataloader()`` starts exactly at the next unseen batch. Construction is
    cheap; the tokenizer/cache is built in ``prepare_data``/``setup`` (or on first use).
    """

    def __init__(
        self,
        *,
        text_files: str | Sequence[str] | None = None,
        token_file: str | os.PathLike | None = None,
        token_dtype: str | None = None,
        tokenizer: str | os.PathLike | None = None,
        vocab_size: int | None = None,
        max_bytes: int | None = None,
        seq_len: int = 256,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        val_windows: int | None = None,
        val_fraction: float = 0.01,
        node_rank: int = 0,
        num_nodes: int = 1,
        seed: int = 0,
        num_workers: int = 0,
        cache_dir: str | os.PathLike | None = None,
    ) -> None:
        super().__init__()
        for name, value, minimum in (
            ("seq_len", seq_len, 1), ("batch_size", batch_size, 1), ("num_nodes", num_nodes, 1),
            ("node_rank", node_rank, 0), ("seed", seed, 0), ("num_workers", num_workers, 0),
        ):
            check_int(name, value, minimum)
        optional = (("val_batch_size", val_batch_size, 1), ("val_windows", val_windows, 1), ("max_bytes", max_bytes, 1),
                    ("vocab_size", vocab_size, 2))
        for name, given, minimum in optional:
            if given is not None:
                check_int(name, given, minimum)
        if node_rank >= num_nodes:
            raise ValueError(f"node_rank must be < num_nodes={num_nodes}, got {node_rank}")
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        if text_files is not None and token_file is not None:
            raise ValueError("text_files and token_file are exclusive: give at most one")
        if isinstance(text_files, (list, tuple)) and not text_files:
            raise ValueError("text_files: empty list of patterns")
        if token_file is not None:
            if token_dtype is None:
                raise ValueError("token_dtype is required with token_file ('uint16' or 'uint32')")
            check_token_dtype(token_dtype)
            if tokenizer == "bpe":
                raise ValueError("tokenizer: 'bpe' needs text; with token_file use a tokenizer.json, 'byte' or None")
            if tokenizer is None and vocab_size is None:
                raise ValueError("vocab_size is required with token_file when no tokenizer is given")
        elif token_dtype is not None:
            raise ValueError("token_dtype only applies to token_file")
        if tokenizer is None and token_file is None:
            tokenizer = "bpe"
        if tokenizer not in (None, "bpe", "byte") and not Path(os.fspath(tokenizer)).expanduser().is_file():
            raise ValueError(f"tokenizer: expected 'bpe', 'byte' or a tokenizer.json path, got {tokenizer!r} (no file)")
        if tokenizer == "bpe" and vocab_size is not None and vocab_size < 257:
            raise ValueError(f"vocab_size must be >= 257 for a byte-level BPE, got {vocab_size}")
        if tokenizer == "byte" and vocab_size is not None and vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(f"vocab_size must be >= {ByteTokenizer.vocab_size} for 'byte', got {vocab_size}")

        self.text_files = text_files
        self.token_file = None if token_file is None else Path(token_file)
        self.token_dtype = token_dtype
        self.tokenizer_spec = tokenizer
        self._vocab_size_arg = vocab_size
        self.max_bytes = max_bytes
        self.seq_len, self.batch_size = seq_len, batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.val_windows = val_windows
        self.val_fraction = float(val_fraction)
        self.node_rank, self.num_nodes, self.seed = node_rank, num_nodes, seed
        self.num_workers = num_workers
        self.cache_dir = cache_dir
        # Plain str/int/float only: checkpoints must load with torch.load(weights_only=True).
        fspath = lambda v: None if v is None else os.fspath(v)  # noqa: E731
        self.save_hyperparameters(
            {
                "text_files": (
                    fspath(text_files) if text_files is None or isinstance(text_files, (str, os.PathLike))
                    else [fspath(t) for t in text_files]
                ),
                "token_file": fspath(token_file), "token_dtype": token_dtype,
                "tokenizer": fspath(tokenizer),
                "vocab_size": vocab_size, "max_bytes": max_bytes, "seq_len": seq_len, "batch_size": batch_size,
                "val_batch_size": val_batch_size, "val_windows": val_windows, "val_fraction": float(val_fraction), "node_rank": node_rank,
                "num_nodes": num_nodes, "seed": seed, "num_workers": num_workers, "cache_dir": fspath(cache_dir),
            }
        )

        self._corpus: list[CorpusFile] | None = None
        self._tokenizer = None
        self._token_path: Path | None = None
        self._train_ds: ShardedTokenDataset | None = None
        self._val_ds: HeldOutDataset | None = None
        self._position = 0  # training samples consumed by the Trainer (see on_before_batch_transfer)

    # -- sources ------------------------------------------------------------------------

    def corpus(self) -> list[CorpusFile]:
        """The text corpus (stdlib or ``text_files``); ValueError for a token_file source."""
        if self.token_file is not None:
            raise ValueError("token_file: a pre-tokenized source has no text corpus")
        if self._corpus is None:
            if self.text_files is None:
                self._corpus = stdlib_corpus(self.max_bytes or DEFAULT_STDLIB_BYTES)
            else:
                self._corpus = text_corpus(self.text_files, self.max_bytes)
        return self._corpus

    @property
    def tokenizer(self):
        """The tokenizer (built/trained on first access); ``None`` for a bare token_file."""
        if self._tokenizer is None and self.tokenizer_spec is not None:
            files = self.corpus() if self.tokenizer_spec == "bpe" else None
            self._tokenizer = load_tokenizer(
                self.tokenizer_spec, files, self._vocab_size_arg or DEFAULT_VOCAB_SIZE, self.cache_dir
            )
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Embedding size for the model: every token id is below it.

        For ``"bpe"`` this is the requested size (the trained tokenizer may be smaller),
        so it is known without training; otherwise ``max(tokenizer size, vocab_size)``.
        """
        if self.tokenizer_spec == "bpe":
            return self._vocab_size_arg or DEFAULT_VOCAB_SIZE
        if self.tokenizer_spec is None:
            assert self._vocab_size_arg is not None  # required with token_file and no tokenizer (__init__)
            return self._vocab_size_arg
        return max(self.tokenizer.vocab_size, self._vocab_size_arg or 0)

    @property
    def token_path(self) -> Path:
        """Flat token file used for training (built and cached on first access)."""
        if self._token_path is None:
            if self.token_file is not None:
                open_tokens(self.token_file, self.token_dtype)  # validates existence and size
                self._token_path = self.token_file
            else:
                self._token_path = build_token_file(self.corpus(), self.tokenizer, self.cache_dir)
        return self._token_path

    @property
    def _dtype(self) -> str:
        if self.token_file is not None:
            return check_token_dtype(self.token_dtype).name
        return dtype_for_vocab(self.tokenizer.vocab_size).name

    # -- Lightning hooks ----------------------------------------------------------------

    def prepare_data(self) -> None:
        _ = self.token_path  # builds tokenizer and token cache once per machine

    def setup(self, stage: str | None = None) -> None:
        if self._val_ds is not None:
            return
        n_tokens = len(open_tokens(self.token_path, self._dtype))
        split = held_out_start(n_tokens, self.seq_len, self.val_fraction)
        self._val_ds = HeldOutDataset(self.token_path, self._dtype, seq_len=self.seq_len, start=split, limit=self.val_windows)
        self._split = split
        log.info(
            "data: %d tokens (%d train, %d held out), node %d/%d, seq_len %d",
            n_tokens, split, n_tokens - split, self.node_rank, self.num_nodes, self.seq_len,
        )

    def train_dataset(self) -> ShardedTokenDataset:
        """A fresh training stream positioned at the next unconsumed sample."""
        self.setup()
        ds = ShardedTokenDataset(
            self.token_path, self._dtype, seq_len=self.seq_len, node_rank=self.node_rank,
            num_nodes=self.num_nodes, seed=self.seed, end=self._split, batch_size=self.batch_size,
        )
        ds.position = self._position = self.position
        self._train_ds = ds
        return ds

    def val_dataset(self) -> HeldOutDataset:
        self.setup()
        assert self._val_ds is not None
        return self._val_ds

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_dataset(), batch_size=self.batch_size, num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(), persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self.val_dataset(), batch_size=self.val_batch_size, shuffle=False, num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(), persistent_workers=self.num_workers > 0,
        )

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = self.trainer
        if trainer is not None and trainer.training:
            first = batch[0] if isinstance(batch, (tuple, list)) else batch
            self._position += int(first.shape[0])
        return batch

    # -- state --------------------------------------------------------------------------

    @property
    def position(self) -> int:
        """Training samples consumed so far on this node (the resume point)."""
        if self.trainer is None and self._train_ds is not None:
            return self._train_ds.position  # used without a Trainer: what the stream yielded
        return self._position

    def state_dict(self) -> dict[str, Any]:
        return stream_state(self, self.position)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        position = state_dict["position"]
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"position must be an int >= 0, got {position!r}")
        for key in STREAM_KEYS:
            if key in state_dict and state_dict[key] != getattr(self, key):
                log.warning("data state saved with %s=%r, this run uses %r", key, state_dict[key], getattr(self, key))
        self._position = position
        if self._train_ds is not None:
            self._train_ds.position = position
