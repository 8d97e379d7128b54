"""Atomic file writes and SHA-256 of files.

Every file this package writes goes through :func:`atomic_write`: a temporary file
in the destination folder, fsync, ``os.replace``, fsync of the folder. A reader sees
the old file or the new one, never a half-written one, and a file another process
has memory-mapped is never rewritten in place (``os.replace`` makes a new inode).

Temporary files and folders carry their owner in their name (:func:`owner_tag`:
``dl-<host>-<pid>``), so what a killed process left behind can be swept
(:func:`sweep_temporaries`) without ever touching a live writer's file: a temporary of
this host whose process is gone is removed at once, one of another host (or of an old
version, without a tag) only once it has not changed for ``max_age`` seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger(__name__)

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
            if not (name.startswith(".") and (name.endswith(".tmp") or name.endswith(".part"))):
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


def atomic_write_bytes(dest: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(dest, lambda p: None if p.write_bytes(data) else None)


def atomic_write_json(dest: str | os.PathLike, obj: object) -> Path:
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    return atomic_write_bytes(dest, text.encode("utf-8"))


def read_at_most(path: str | os.PathLike, limit: int) -> bytes:
    """The first ``limit`` bytes of a file (all of a shorter one): what a reader of hub documents
    takes of a file any writer may have made of any size (``FileNotFoundError`` if absent)."""
    with open(path, "rb") as f:
        out = bytearray()
        while len(out) < limit and (chunk := f.read(min(_CHUNK, limit - len(out)))):
            out += chunk
    return bytes(out)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
