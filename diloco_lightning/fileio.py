"""Atomic file writes and SHA-256 of files.

Every file this package writes goes through :func:`atomic_write`: a temporary file
in the destination folder, fsync, ``os.replace``, fsync of the folder. A reader sees
the old file or the new one, never a half-written one, and a file another process
has memory-mapped is never rewritten in place (``os.replace`` makes a new inode).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Callable, Iterator

_CHUNK = 8 << 20


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a folder so a rename inside it survives a power cut (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``dest``; on success fsync it and ``os.replace`` it onto ``dest``.

    On an exception the temporary file is removed and ``dest`` is untouched.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        fd = os.open(tmp_path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp_path, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise
    fsync_dir(dest.parent)


def atomic_write(dest: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)`` then publish ``tmp_path`` as ``dest`` atomically."""
    with atomic_path(dest) as tmp:
        write(tmp)
    return Path(dest)


def atomic_write_bytes(dest: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(dest, lambda p: p.write_bytes(data))


def atomic_write_json(dest: str | os.PathLike, obj: object) -> Path:
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    return atomic_write_bytes(dest, text.encode("utf-8"))


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
