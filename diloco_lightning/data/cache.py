"""Cache directory and atomic file writes (several workers may build the same cache at once)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["default_cache_dir", "atomic_path"]

#: Environment variable that overrides the default cache location.
CACHE_ENV = "DILOCO_CACHE_DIR"


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` if given, else ``$DILOCO_CACHE_DIR``, else ``$XDG_CACHE_HOME/diloco_lightning``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "diloco_lightning"


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``final``; on success rename it over ``final``.

    Readers therefore see either no file or a complete one. Concurrent builders each
    write their own temporary file and the last rename wins (contents are identical).
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
