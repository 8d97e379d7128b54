"""Flat token files: a headerless array of uint16/uint32 ids, read through ``numpy.memmap``.

The same format serves the cache of a tokenized text corpus and a user's pre-tokenized
data (e.g. nanoGPT's ``train.bin``), so the training path only ever sees token files.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from diloco_lightning.data.cache import atomic_path, default_cache_dir
from diloco_lightning.data.corpus import CorpusFile, corpus_key, iter_texts

log = logging.getLogger(__name__)

__all__ = ["TOKEN_DTYPES", "dtype_for_vocab", "check_token_dtype", "build_token_file", "open_tokens"]

TOKEN_DTYPES = ("uint16", "uint32")
_TOKENS_FORMAT = "tokens-v1"
_ENCODE_CHUNK_BYTES = 4_000_000  # text handed to the (parallel) Rust encoder per call


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def check_token_dtype(token_dtype: object) -> np.dtype:
    """Validate a token dtype name; ValueError names ``token_dtype``."""
    name = np.dtype(token_dtype).name if isinstance(token_dtype, (np.dtype, type)) else token_dtype
    if name not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype must be one of {TOKEN_DTYPES}, got {token_dtype!r}")
    return np.dtype(name)


def build_token_file(files: Sequence[CorpusFile], tokenizer, cache_dir: str | os.PathLike | None = None) -> Path:
    """Tokenize ``files`` (documents joined by ``tokenizer.eos_id``) into a cached token file.

    Path: ``<cache_dir>/tokens/<hash>.<dtype>.bin``; the hash covers the corpus (names +
    sizes) and the tokenizer fingerprint, so a different tokenizer never reuses stale ids.
    Written through a temporary file and renamed (atomic). Returns the path.
    """
    if not files:
        raise ValueError("files: empty corpus, nothing to tokenize")
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    key = hashlib.sha256(f"{_TOKENS_FORMAT}|{corpus_key(files)}|{tokenizer.fingerprint}".encode()).hexdigest()[:20]
    path = default_cache_dir(cache_dir) / "tokens" / f"{key}.{dtype.name}.bin"
    if path.exists():
        log.debug("using cached token file %s", path)
        return path
    t0 = time.perf_counter()
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    if not eos:
        log.warning("tokenizer has no end-of-text token: documents are concatenated without a separator")
    n_tokens = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as out:

        def flush(batch: list[str]) -> int:
            ids = [i for doc in tokenizer.encode_batch(batch) for i in (*doc, *eos)]
            np.asarray(ids, dtype=dtype).tofile(out)
            return len(ids)

        batch, batch_bytes = [], 0
        for text in iter_texts(files):
            batch.append(text)
            batch_bytes += len(text)
            if batch_bytes >= _ENCODE_CHUNK_BYTES:
                n_tokens += flush(batch)
                batch, batch_bytes = [], 0
        if batch:
            n_tokens += flush(batch)
    if n_tokens == 0:
        path.unlink()
        raise ValueError("files: the corpus produced no tokens (empty or non-UTF-8 files?)")
    log.info("tokenized %d files -> %d tokens in %.1fs -> %s", len(files), n_tokens, time.perf_counter() - t0, path)
    return path


def open_tokens(path: str | os.PathLike, token_dtype: object) -> np.memmap:
    """Read-only memory map of a flat token file; ValueError on a missing/ragged file."""
    dtype = check_token_dtype(token_dtype)
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"token_file: no such file {str(path)!r}")
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise ValueError(f"token_file: size {size} of {str(path)!r} is not a positive multiple of {dtype.name}")
    return np.memmap(path, dtype=dtype, mode="r")
