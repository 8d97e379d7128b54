"""Where the tokenizer and token files are cached; written atomically (several workers may
build the same cache at once: each writes its own temporary file and the last rename wins, with
identical contents)."""

from __future__ import annotations

import os
from pathlib import Path

from diloco_lightning.util.fileio import CACHE_ENV, atomic_path, cache_root

__all__ = ["default_cache_dir", "atomic_path", "CACHE_ENV"]


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` if given, else :func:`~diloco_lightning.util.fileio.cache_root` (``$DILOCO_CACHE_DIR``)."""
    return Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
