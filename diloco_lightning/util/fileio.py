"""Atomic file writes and SHA-256 of files.

Every file this package writes goes through :func:`atomic_write`: a temporary file
in the destination folder, fsync, ``os.replace``, fsync of the folder. A reader sees
the old file or the new one, never a half-written one, and a file another process
has memory-mapped is never rewritten in place (``os.replace`` makes a new inode).

Temporary files and folders carry their owner in their name (:func:`owner_tag`:
``dl-<host>-<pid>``), so what a killed process left behind can be swept
(:func:`sweep_temporaries`) without ever touching a live writer's file: a temporary of
this host whose process is gone is removed at once, one of another host (or of an old
version, without a tag) only once it has not changed for ``max_age`` seconds. A hub's folders
are swept through folder descriptors (:func:`sweep_temporaries_at`), never through a link.

A file any writer may have made is opened so that it can neither stall nor flood the reader:
:func:`read_document` (a small document: a manifest, a lease, a claim) refuses, before reading a
byte, anything that is not a regular file or is over its bound (a :class:`RefusedFile` stand-in),
and :func:`open_regular` (a delta) anything that is not a regular file; neither ever blocks on a
FIFO or reads a device.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from diloco_lightning.util.errors import DiLoCoError
from diloco_lightning.util.heldfile import is_held, reopen

log = logging.getLogger(__name__)

_CHUNK = 8 << 20


def write_all(fd: int, data) -> int:
    """Write every byte of ``data`` (any buffer) to the descriptor ``fd`` (``os.write`` may write
    less than asked); the number written."""
    view = memoryview(data).cast("B")
    total = len(view)
    while view:
        view = view[os.write(fd, view):]
    return total


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, wait for nothing
_sync_file_range: Callable[[int, int, int, int], int] | None | bool = False  # False: not looked up yet


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` of ``fd`` to disk now, without
    waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; elsewhere nothing). No durability
    promise: the ``fsync`` that makes the file durable still comes, and finds the bytes already
    written instead of writing a whole file then (100 MB: ~0.05 s of the master's round here).
    Never raises."""
    global _sync_file_range
    if _sync_file_range is False:
        _sync_file_range = None
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _sync_file_range = fn
        except (OSError, AttributeError, ImportError):  # not Linux (or no glibc): the fsync writes everything
            pass
    if _sync_file_range is not None and nbytes > 0:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # type: ignore[operator]


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


_HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"
_OWNED_RE = re.compile(r"dl-([A-Za-z0-9]{1,32})-([0-9]{1,10})-")


def owner_tag() -> str:
    """``dl-<host>-<pid>-``: put in temporary names so a sweeper can tell whose they are."""
    return f"dl-{_HOST}-{os.getpid()}-"


def temp_prefix(dest_name: str) -> str:
    """The prefix of a temporary file for ``dest_name`` (hidden, owner-tagged)."""
    return f".{dest_name}.{owner_tag()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def is_dead_or_old(name: str, mtime: float, max_age: float, now: float) -> bool:
    """Whether the temporary ``name`` (changed last at ``mtime``) may be swept: its owner is a process of
    this host that is gone, or (another host's, or untagged) it is older than ``max_age`` seconds."""
    m = _OWNED_RE.search(name)
    if m is not None and m.group(1) == _HOST:
        return not _pid_alive(int(m.group(2)))  # this host: the process decides, whatever the age
    return now - mtime > max_age


def is_temporary(name: str) -> bool:
    """Whether ``name`` is a temporary file's (``.<name>...tmp`` / ``.part``): what a sweep looks at."""
    return name.startswith(".") and (name.endswith(".tmp") or name.endswith(".part"))


def sweep_temporaries_at(dir_fd: int, where: str, max_age: float) -> list[str]:
    """:func:`sweep_temporaries` of the folder open as ``dir_fd`` (``where`` names it in what is
    returned), not recursive: every name is listed, looked at and removed relative to the descriptor,
    so nothing outside that folder is ever touched, whatever a writer swaps for a link meanwhile (a
    link itself is removed, never what it points to). Returns the removed paths."""
    removed: list[str] = []
    now = time.time()
    with os.scandir(dir_fd) as it:
        names = [e.name for e in it if is_temporary(e.name)]
    for name in names:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode) or not is_dead_or_old(name, st.st_mtime, max_age, now):
                continue
            os.unlink(name, dir_fd=dir_fd)
            removed.append(os.path.join(where, name))
        except FileNotFoundError:
            continue
        except OSError as e:
            log.debug("could not sweep %s: %s", os.path.join(where, name), e)
    return removed


def sweep_temporaries(folder: str | os.PathLike, max_age: float, *, recursive: bool = False) -> list[str]:
    """Remove temporary files (``.<name>...tmp`` / ``.part``) under ``folder`` whose owner is
    dead or that are older than ``max_age`` seconds (see the module docstring). Symbolic links
    are never followed. Returns the removed paths."""
    removed: list[str] = []
    now = time.time()
    for root, dirs, files in os.walk(os.fspath(folder), followlinks=False):
        if not recursive:
            dirs.clear()
        for name in files:
            if not is_temporary(name):
                continue
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
                if is_dead_or_old(name, st.st_mtime, max_age, now):
                    os.unlink(path)
                    removed.append(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                log.debug("could not sweep %s: %s", path, e)
    return removed


def sweep_stale_files(folder: str | os.PathLike, max_age: float) -> list[str]:
    """Remove the files under ``folder`` (a download cache) unchanged for ``max_age`` seconds, and the
    folders left empty: copies a killed process downloaded and never released. Symbolic links are
    never followed. Returns the removed paths."""
    removed: list[str] = []
    now = time.time()
    for root, _dirs, files in os.walk(os.fspath(folder), topdown=False, followlinks=False):
        for name in files:
            path = os.path.join(root, name)
            try:
                if now - os.lstat(path).st_mtime > max_age:
                    os.unlink(path)
                    removed.append(path)
            except OSError:
                continue
        if root != os.fspath(folder):
            with contextlib.suppress(OSError):
                os.rmdir(root)  # only when empty
    return removed


def make_owned_dir(parent: str | os.PathLike | None, prefix: str) -> str:
    """A fresh folder ``<parent>/<prefix>dl-<host>-<pid>-XXXX`` (``tempfile.mkdtemp``)."""
    return tempfile.mkdtemp(prefix=prefix + owner_tag(), dir=parent)


def sweep_owned_dirs(parent: str | os.PathLike | None, prefix: str, max_age: float) -> list[str]:
    """Remove folders made by :func:`make_owned_dir` (or older untagged ones starting with
    ``prefix``) whose owner is dead, or unchanged for ``max_age`` seconds."""
    parent = os.fspath(parent) if parent is not None else tempfile.gettempdir()
    removed: list[str] = []
    now = time.time()
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for e in entries:
        if not e.name.startswith(prefix):
            continue
        try:
            if not e.is_dir(follow_symlinks=False):
                continue
            if is_dead_or_old(e.name, e.stat(follow_symlinks=False).st_mtime, max_age, now):
                shutil.rmtree(e.path, ignore_errors=True)
                removed.append(e.path)
        except OSError:
            continue
    return removed


#: The one environment variable that moves every cache of the package (tokenizer, token files,
#: hub downloads). ``DILOCO_CACHE`` (older name, hub downloads only) is still honoured.
CACHE_ENV = "DILOCO_CACHE_DIR"


def cache_root() -> Path:
    """``$DILOCO_CACHE_DIR``, else ``$XDG_CACHE_HOME/diloco_lightning`` (``~/.cache/...``), else, where
    that cannot be created (a read-only home), ``<tmp>/diloco_lightning``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                        "diloco_lightning")
    if not os.path.isdir(root) and not os.access(os.path.dirname(root) or ".", os.W_OK):
        root = os.path.join(tempfile.gettempdir(), "diloco_lightning")
    return Path(root)


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``dest``; on success fsync it and ``os.replace`` it onto ``dest``.

    On an exception the temporary file is removed and ``dest`` is untouched.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(dest.name), suffix=".tmp", dir=dest.parent)
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


def copy_checked(src: str | os.PathLike, dest: str | os.PathLike, sha256: str | None = None) -> Path:
    """Copy ``src`` to ``dest`` atomically, hashing the bytes as they are copied: read through
    :func:`open_regular` (a held hub file is the file copied, whatever its path names now), and with
    ``sha256`` a copy of any other bytes raises ``OSError`` (EIO) and leaves ``dest`` as it was."""
    def write(tmp: Path) -> None:
        h = hashlib.sha256()
        with open_regular(src) as f, open(tmp, "wb") as out:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                out.write(chunk)
        if sha256 is not None and h.hexdigest() != sha256:
            raise OSError(errno.EIO, f"SHA-256 {h.hexdigest()[:12]}... is not the {str(sha256)[:12]}... promised",
                          os.fspath(src))

    return atomic_write(dest, write)


def atomic_write_bytes(dest: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(dest, lambda p: None if p.write_bytes(data) else None)


def atomic_write_json(dest: str | os.PathLike, obj: object) -> Path:
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    return atomic_write_bytes(dest, text.encode("utf-8"))


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``"a FIFO"``)."""
    for test, kind in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return f"a file of mode {mode:o}"


class UnreadDocument(bytes):
    """A hub document refused unread, on any transport: not its content but a short text naming it
    (``text``: its path and what identifies this version of it), so that two reads of the same file
    compare equal and hash alike (a compare-and-swap over it works as over any bytes), and that no
    parser takes it for a document (it starts with a NUL byte). ``reason`` says what is wrong with it.
    The readers of documents check for it first: a refused manifest is a malformed one (replaced), a
    refused lease an expired one, a refused claim no claim."""

    reason: str

    def __new__(cls, text: str, reason: str) -> "UnreadDocument":
        self = super().__new__(cls, f"\0{text}".encode())
        self.reason = reason
        return self


class RefusedFile(UnreadDocument):
    """What :func:`read_document` returns for a file it refused unread (not a regular file, or over its
    bound), named by its path, kind, size, inode and last change."""

    def __new__(cls, name: str, st: os.stat_result, reason: str) -> "RefusedFile":
        return super().__new__(cls, f"{name}: {file_kind(st.st_mode)}, {st.st_size} bytes, inode {st.st_ino}, "
                                    f"changed {st.st_mtime_ns}", reason)  # type: ignore[return-value]


_DOCUMENT_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def read_document(path: str | os.PathLike, max_bytes: int, *, name: str | None = None, dir_fd: int | None = None) -> bytes:
    """A small document any writer may have made (a hub's manifest, lease, claim): the bytes of a
    regular file of at most ``max_bytes``, read up to one byte past it (a file that grew since it was
    looked at is then refused by its parser). Anything else is refused before a byte is read, with a
    :class:`RefusedFile` stand-in: a symbolic link (never followed), a FIFO (never waited on: opened
    non-blocking), a device (``/dev/zero`` is never read), a file over ``max_bytes`` (by its size).
    ``name`` names the file in the reason (default: ``path``); ``dir_fd``: ``path`` is relative to that
    open folder (a hub's folder opened without following links). ``FileNotFoundError`` if absent."""
    name = os.fspath(path) if name is None else name
    try:
        fd = os.open(path, _DOCUMENT_FLAGS, dir_fd=dir_fd)
    except OSError as e:  # ELOOP: a symbolic link; ENXIO: a socket; ...
        if isinstance(e, FileNotFoundError):
            raise
        st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)  # FileNotFoundError if it went meanwhile
        if stat.S_ISREG(st.st_mode):
            raise
        return RefusedFile(name, st, f"{name} is {file_kind(st.st_mode)}, not a regular file")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return RefusedFile(name, st, f"{name} is {file_kind(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            return RefusedFile(name, st, f"{name} is {st.st_size} bytes, more than the {max_bytes} it may have")
        os.set_blocking(fd, True)
        out = bytearray()
        while len(out) <= max_bytes and (chunk := os.read(fd, min(_CHUNK, max_bytes + 1 - len(out)))):
            out += chunk
        return bytes(out)
    finally:
        os.close(fd)


class NotRegularFileError(DiLoCoError, OSError):
    """:func:`open_regular` met a FIFO, a device, a folder or a socket."""


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """``open(path, "rb")`` for a file any writer may have made (a delta read in place): what is not a
    regular file (a FIFO, ``/dev/zero``) raises :class:`NotRegularFileError` at once, never blocks the
    reader nor feeds it without end. The open file is the one checked (no race between a check and
    the open). A :class:`~diloco_lightning.util.heldfile.HeldFile` (the folder hub's downloads) opens the
    file its checks were made on, whatever its path names now (a file renamed over it, a link)."""
    if is_held(path):  # never by its path, even once released (EBADF then)
        fd = reopen(path)  # type: ignore[arg-type]
    else:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(errno.EINVAL, f"{file_kind(mode)}, not a regular file", os.fspath(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in 8 MiB chunks (:func:`open_regular`: a held hub file is the one read)."""
    h = hashlib.sha256()
    with open_regular(path) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
