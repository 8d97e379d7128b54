"""The folder hub's files, read, listed, created, replaced, locked and removed without ever
following a symbolic link.

Any writer of a hub folder can swap a node folder, ``nodes/`` or ``global/`` for a symbolic link to
elsewhere, at any moment. So every operation on a hub path goes through a folder descriptor opened
one component at a time with ``O_DIRECTORY | O_NOFOLLOW`` from the hub's own folder
(:meth:`HubFolder.open_dir`; a missing folder is made with ``mkdir`` relative to its parent's
descriptor, then opened the same way), and names the file relative to it (``dir_fd``): a component
that is a link is a :class:`HubLinkError` naming it, never a step outside. A write, a rename or a
lock then fails with it (a ``HubError``); a read (:meth:`HubFolder.read_document`) returns a
``RefusedFile`` stand-in, as for a special file, and a listing (:meth:`HubFolder.open_or_skip`)
skips the folder with a warning naming the link. Only the hub's folder itself is opened as the user
gave it (it may be a link).

* :meth:`HubFolder.replace_bytes` writes a document (the manifest, the lease, a claim): a temporary
  file, fsync, ``rename`` over the old one, all relative to the folder's descriptor.

* :meth:`HubFolder.place_new` writes a temporary file (``fileio.temp_prefix``: it carries its
  owner), then places it with ``link(tmp, dest)``, which fails if ``dest`` exists: a file placed
  this way is never overwritten, even by two writers racing. On a filesystem without hard links
  it falls back to check-then-rename (one writer per path).
* :meth:`HubFolder.write_temp` copies a file (``sendfile``, else a plain copy) or bytes, fsynced;
  with ``link``, it hard-links a file that never changes again instead, when both are on one
  filesystem.
* :meth:`HubFolder.sweep` removes the temporary files of dead writers in ``global/`` and every node
  folder, each folder opened the same way: a link where a folder should be (``global/``, ``nodes/``,
  a node folder, even one swapped for a link after the listing) is skipped with a warning naming it,
  and nothing outside the hub is ever looked at or removed.
* :meth:`HubFolder.locked` is the exclusive ``flock`` on ``global/.lock`` that publications and
  deletions of global files take (and on a node's ``.claim.lock`` for its claim); it dies with its
  process. The lock file is opened ``O_NOFOLLOW | O_NONBLOCK``: a link, a FIFO or any file but a
  regular one is a ``HubError`` naming it, never followed nor waited on.

:class:`~diloco_lightning.hub.local.FileHub` is built on it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Iterator

from diloco_lightning.util import faults
from diloco_lightning.util.fileio import (
    RefusedFile, file_kind, read_document, sweep_temporaries_at, temp_prefix, write_all,
)
from diloco_lightning.util.warnonce import WarnOnce
from diloco_lightning.hub.base import HubError
from diloco_lightning.wire.names import GLOBAL_DIR, NODE_ID_RE, NODES_DIR

__all__ = ["HubFolder", "HubLinkError"]

log = logging.getLogger(__name__)

_LOCK_NAME = ".lock"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC


class HubLinkError(HubError):
    """A symbolic link (or anything but a folder) where a folder of the hub should be: ``where`` is its
    hub path, ``st`` its ``lstat`` (None if it went meanwhile)."""

    def __init__(self, message: str, where: str, st: os.stat_result | None) -> None:
        super().__init__(message)
        self.where = where
        self.st = st


class HubFolder:
    """The hub folder ``root`` (``url`` in messages), written only through folder descriptors."""

    def __init__(self, root: Path, url: str) -> None:
        self.root = root
        self.url = url
        self._warned = WarnOnce(log)  # bounded: the links are any hub writer's

    def open_child(self, fd: int, name: str, where: str) -> int:
        """A descriptor of the folder ``name`` in the open folder ``fd`` (``where``: its hub path, for
        messages), never through a symbolic link: :class:`HubLinkError` naming it if it is one (or is
        not a folder), ``FileNotFoundError`` if it is missing."""
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            try:
                st: os.stat_result | None = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                st = None
            kind = "a symbolic link" if st is None else file_kind(st.st_mode)
            raise HubLinkError(f"{where} on {self.url} is {kind}, not a folder of the hub: refusing to go through it",
                               where, st) from None

    def open_dir(self, parts: list[str], *, create: bool) -> int:
        """A descriptor of the folder ``root/<parts...>``, opened one component at a time from the
        hub's own folder without following symbolic links (:class:`HubLinkError`, a ``HubError``
        naming the component, if one is met; ``FileNotFoundError`` if one is missing and not
        ``create``). ``create``: a missing folder is made (``mkdir`` relative to its parent's
        descriptor), then opened the same way. The hub's folder itself is opened as the user gave it
        (it may be a link)."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        try:
            for i, part in enumerate(parts):
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                nfd = self.open_child(fd, part, "/".join(parts[: i + 1]))
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def open_or_skip(self, parts: list[str], doing: str) -> int | None:
        """:meth:`open_dir` for a reader: None where the folder is missing, or (with a warning naming
        it, once) where a component is a symbolic link or not a folder."""
        try:
            return self.open_dir(parts, create=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except HubLinkError as e:
            self._warned.warn(f"{doing}:{e.where}", "not %s %s on %s: %s is a symbolic link or not a folder",
                              doing, "/".join(parts), self.url, e.where)
            return None

    def read_document(self, hub_path: str, max_bytes: int, *, name: str) -> bytes | None:
        """``fileio.read_document`` of ``hub_path`` through folder descriptors (None if absent). A
        symbolic link anywhere below the hub's folder is refused like a special file: a
        ``RefusedFile`` stand-in naming it, read from nowhere."""
        *folders, leaf = hub_path.split("/")
        try:
            dfd = self.open_dir(folders, create=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except HubLinkError as e:
            if e.st is None:  # gone meanwhile
                return None
            return RefusedFile(name, e.st, f"{name} is reached through {e.where}, {file_kind(e.st.st_mode)}, "
                                           "not a folder of the hub")
        try:
            return read_document(leaf, max_bytes, name=name, dir_fd=dfd)
        except (FileNotFoundError, NotADirectoryError):
            return None
        finally:
            os.close(dfd)

    def stat(self, hub_path: str) -> os.stat_result | None:
        """``lstat`` of ``hub_path`` through folder descriptors: None if absent, ``HubLinkError`` if a
        folder on the way is a symbolic link."""
        *folders, leaf = hub_path.split("/")
        try:
            dfd = self.open_dir(folders, create=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return os.stat(leaf, dir_fd=dfd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        finally:
            os.close(dfd)

    def open_file(self, hub_path: str) -> int:
        """A read-only descriptor of the file ``hub_path``, every folder on the way opened without
        following a link (:class:`HubLinkError`), the file itself neither a link (``OSError`` ELOOP)
        nor waited on (non-blocking open: a FIFO opens at once; the caller checks ``fstat``).
        ``FileNotFoundError`` if it is missing."""
        *folders, leaf = hub_path.split("/")
        dfd = self.open_dir(folders, create=False)
        try:
            fd = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def is_file(self, hub_path: str) -> bool:
        """Whether ``hub_path`` is a regular file, every folder on the way a real one (see :meth:`stat`)."""
        st = self.stat(hub_path)
        return st is not None and stat.S_ISREG(st.st_mode)

    def replace_bytes(self, hub_path: str, data: bytes) -> None:
        """Write ``data`` as ``hub_path`` atomically (a temporary file, fsync, ``rename`` over it, fsync
        of the folder), every step relative to the folder's descriptor: never through a symbolic link
        (``HubLinkError`` naming it), a reader sees the old file or the new one."""
        *folders, name = hub_path.split("/")
        dfd = self.open_dir(folders, create=True)
        tmp = f"{temp_prefix(name)}{secrets.token_hex(4)}.tmp"
        try:
            self.write_temp(data, dfd, tmp, link=False)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            with contextlib.suppress(OSError):
                os.fsync(dfd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            os.close(dfd)

    @staticmethod
    def copy_into(src: str | os.PathLike, out_fd: int) -> None:
        with open(src, "rb") as inp:
            size = os.fstat(inp.fileno()).st_size
            sent = 0
            try:
                while sent < size:
                    n = os.sendfile(out_fd, inp.fileno(), sent, min(size - sent, 1 << 30))
                    if n == 0:
                        break
                    sent += n
            except OSError as e:  # sendfile unsupported between these files: plain copy
                if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                inp.seek(sent)
                with os.fdopen(os.dup(out_fd), "wb", closefd=True) as out:
                    out.seek(sent)
                    shutil.copyfileobj(inp, out, 8 << 20)

    def write_temp(self, src: str | os.PathLike | bytes, dfd: int, tmp: str, *, link: bool) -> None:
        """Create ``tmp`` in the folder ``dfd`` holding ``src`` (a file, or bytes), fsynced; never
        through a symbolic link. ``link``: hard-link the file instead of copying it when both are
        on one filesystem (``src`` must then never change again)."""
        if link and not isinstance(src, bytes):
            try:
                os.link(src, tmp, dst_dir_fd=dfd, follow_symlinks=False)
                fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
                try:
                    os.fsync(fd)  # durable before the manifest names it, as a copy would be
                finally:
                    os.close(fd)
                return
            except OSError as e:  # another filesystem, or no hard links: copy
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dfd)
        try:
            if isinstance(src, bytes):
                write_all(fd, src)
            else:
                self.copy_into(src, fd)
            os.fsync(fd)
        finally:
            os.close(fd)

    def place_new(self, src: str | os.PathLike, hub_path: str, *, link: bool = False) -> bool:
        """Copy ``src`` to ``hub_path`` if nothing is there; atomic, never overwrites, never through
        a symbolic link. False if ``hub_path`` existed. ``link``: hard-link ``src`` instead of
        copying it when both are on one filesystem (``src`` must then never change again)."""
        *folders, name = hub_path.split("/")
        dfd = self.open_dir(folders, create=True)
        tmp = f"{temp_prefix(name)}{secrets.token_hex(4)}.tmp"
        try:
            self.write_temp(src, dfd, tmp, link=link)
            faults.point("hub.placing")
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                return False
            except OSError as e:  # filesystems without hard links: check-then-rename (single writer per path)
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                try:
                    os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    return False
                except FileNotFoundError:
                    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            with contextlib.suppress(OSError):
                os.fsync(dfd)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
            os.close(dfd)

    def unlink(self, hub_path: str) -> None:
        """Remove ``hub_path``, never through a symbolic link (a missing file is fine)."""
        *folders, name = hub_path.split("/")
        try:
            dfd = self.open_dir(folders, create=False)
        except FileNotFoundError:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)  # a link itself is removed, never what it points to
        finally:
            os.close(dfd)

    def sweep(self, max_age: float) -> list[str]:
        """Remove the temporary files of dead writers (``fileio.sweep_temporaries_at``) in ``global/``
        and every node folder, each opened without following a symbolic link (see the module
        docstring). Returns the removed paths."""
        removed: list[str] = []
        fd = self.open_or_skip([GLOBAL_DIR], "sweeping")
        if fd is not None:
            try:
                removed += sweep_temporaries_at(fd, os.path.join(self.root, GLOBAL_DIR), max_age)
            finally:
                os.close(fd)
        nodes_fd = self.open_or_skip([NODES_DIR], "sweeping")
        if nodes_fd is None:
            return removed
        try:
            with os.scandir(nodes_fd) as it:
                names = [e.name for e in it if NODE_ID_RE.fullmatch(e.name) is not None
                         and (e.is_dir(follow_symlinks=False) or e.is_symlink())]
            for name in names:
                where = f"{NODES_DIR}/{name}"
                try:
                    fd = self.open_child(nodes_fd, name, where)
                except FileNotFoundError:  # removed since the listing
                    continue
                except HubLinkError:
                    self._warned.warn(f"sweeping:{where}", "not sweeping %s on %s: it is a symbolic link or not a folder",
                                      where, self.url)
                    continue
                try:
                    removed += sweep_temporaries_at(fd, os.path.join(self.root, NODES_DIR, name), max_age)
                finally:
                    os.close(fd)
        finally:
            os.close(nodes_fd)
        return removed

    @contextlib.contextmanager
    def locked(self, folder: list[str] | None = None, name: str = _LOCK_NAME) -> Iterator[None]:
        """The exclusive ``flock`` on ``<folder>/<name>`` (default ``global/.lock``), created if missing;
        it dies with its process. The folder is opened as by :meth:`open_dir` and the lock file with
        ``O_NOFOLLOW | O_NONBLOCK``: a symbolic link, a FIFO or any file but a regular one there is a
        ``HubError`` naming it, never followed nor waited on."""
        parts = [GLOBAL_DIR] if folder is None else folder
        where = "/".join([*parts, name])
        dfd = self.open_dir(parts, create=True)
        try:
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | _NONBLOCK | _CLOEXEC, 0o644, dir_fd=dfd)
            except OSError as e:  # ELOOP: a link; ENXIO: a socket; EISDIR: a folder
                if isinstance(e, FileNotFoundError):
                    raise
                try:
                    kind = file_kind(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
                except OSError:
                    kind = "unusable"
                raise HubError(f"refusing the lock {where} on {self.url}: it is {kind}, not a regular file ({e.strerror})") from None
        finally:
            os.close(dfd)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise HubError(f"refusing the lock {where} on {self.url}: it is {file_kind(mode)}, not a regular file")
            os.set_blocking(fd, True)
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock
