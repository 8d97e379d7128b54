"""A local path that holds the file it names open (issue 42: a hub file swapped between a check and a read).

The folder hub returns its files in place (no copy). A path alone is a race: a hub writer can
rename another file over it, or put a symbolic link (to a FIFO, to a file outside the hub) or a
linked folder in its place, between the hub's checks (a regular file, within its size bound, no
link on the way) and the reader's ``open``. A :class:`HeldFile` is that path plus the descriptor
the checks were made on: :func:`reopen` gives a reader a fresh descriptor of that same inode
(its own file offset), whatever the path names by then. ``fileio.open_regular``, which every
reader of a hub file goes through, uses it; a plain path opens as before.

The descriptor is closed by :func:`release` (``Hub.release``), or when the path object is
garbage-collected. Paths derived from a held one (``parent``, ``/``) are plain paths.
"""

from __future__ import annotations

import errno
import os
import weakref
from pathlib import Path

__all__ = ["HeldFile", "held_fd", "is_held", "reopen", "release"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class _Held:
    """The open descriptor of a :class:`HeldFile`, closed once (explicitly or at garbage collection)."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd
        self._finalizer = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        self.fd = None
        self._finalizer()


class HeldFile(type(Path())):  # type: ignore[misc]  # PosixPath (WindowsPath): a path with one more attribute
    """A path and the open descriptor of the file it named when it was checked (the module docstring)."""

    _held: _Held | None = None

    @classmethod
    def holding(cls, path: str | os.PathLike, fd: int) -> "HeldFile":
        """``path``, holding ``fd`` (owned from now on: closed by :func:`release` or with the path)."""
        p = cls(path)
        p._held = _Held(fd)
        return p


def is_held(path: object) -> bool:
    """Whether ``path`` was returned holding a file (even if released since: then it opens nothing)."""
    return getattr(path, "_held", None) is not None


def held_fd(path: object) -> int | None:
    """The descriptor ``path`` holds (None: a plain path, or one released)."""
    held = getattr(path, "_held", None)
    return None if held is None else held.fd


def reopen(path: HeldFile) -> int:
    """A new descriptor (read-only, its own offset) of the inode ``path`` holds, never of what the
    path names now. ``OSError`` (``EBADF``) if it was released."""
    fd = held_fd(path)
    if fd is None:
        raise OSError(errno.EBADF, "the held file was released", os.fspath(path))
    try:  # /proc/self/fd/N opens the inode itself (Linux): an independent file offset
        new = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | _CLOEXEC)
    except OSError:
        new = os.dup(fd)  # no /proc: the same open file (shared offset; readers seek before they read)
        os.lseek(new, 0, os.SEEK_SET)
        return new
    a, b = os.fstat(new), os.fstat(fd)
    if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):  # not the held inode (cannot happen with a real /proc)
        os.close(new)
        new = os.dup(fd)
        os.lseek(new, 0, os.SEEK_SET)
    return new


def release(path: object) -> None:
    """Close the descriptor ``path`` holds, if any (idempotent)."""
    held = getattr(path, "_held", None)
    if held is not None:
        held.close()
