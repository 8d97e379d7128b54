"""The folder hub's files, created and removed without ever following a symbolic link.

Any writer of a hub folder can swap a node folder (or ``global/``) for a symbolic link to
elsewhere, at any moment. So :meth:`HubFolder.place_new` and :meth:`HubFolder.unlink` create and
remove files relative to folder descriptors opened one component at a time with ``O_NOFOLLOW``
from the hub's own folder (:meth:`HubFolder.open_dir`): a component that is a link makes the
operation fail (``HubError``), never reach outside.

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
  deletions of global files take; it dies with its process.

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
from pathlib import Path
from typing import Iterator

from diloco_lightning.util import faults
from diloco_lightning.util.fileio import sweep_temporaries_at, temp_prefix
from diloco_lightning.util.warnonce import WarnOnce
from diloco_lightning.hub.base import HubError
from diloco_lightning.wire.names import GLOBAL_DIR, NODE_ID_RE, NODES_DIR

__all__ = ["HubFolder"]

log = logging.getLogger(__name__)

_LOCK_NAME = ".lock"


class HubFolder:
    """The hub folder ``root`` (``url`` in messages), written only through folder descriptors."""

    def __init__(self, root: Path, url: str) -> None:
        self.root = root
        self.url = url
        self._warned = WarnOnce(log)  # bounded: the links are any hub writer's

    def open_dir(self, parts: list[str], *, create: bool) -> int:
        """A descriptor of the folder ``root/<parts...>``, opened one component at a time
        without following symbolic links (``HubError`` if one is met)."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in parts:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                try:
                    nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise HubError(f"refusing {'/'.join(parts)} on {self.url}: {part!r} is a symbolic link or not a folder") from None
                    raise
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

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
                view = memoryview(src)
                while view:
                    view = view[os.write(fd, view):]
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

    def _open_to_sweep(self, parts: list[str]) -> int | None:
        """:meth:`open_dir` for a sweep: None (with a warning naming it, once) where a component is a
        symbolic link or not a folder, or where the folder is missing."""
        try:
            return self.open_dir(parts, create=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except HubError:
            where = "/".join(parts)
            self._warned.warn(f"sweep:{where}", "not sweeping %s on %s: it is a symbolic link or not a folder",
                              where, self.url)
            return None

    def sweep(self, max_age: float) -> list[str]:
        """Remove the temporary files of dead writers (``fileio.sweep_temporaries_at``) in ``global/``
        and every node folder, each opened without following a symbolic link (see the module
        docstring). Returns the removed paths."""
        removed: list[str] = []
        fd = self._open_to_sweep([GLOBAL_DIR])
        if fd is not None:
            try:
                removed += sweep_temporaries_at(fd, os.path.join(self.root, GLOBAL_DIR), max_age)
            finally:
                os.close(fd)
        nodes_fd = self._open_to_sweep([NODES_DIR])
        if nodes_fd is None:
            return removed
        try:
            with os.scandir(nodes_fd) as it:
                names = [e.name for e in it if NODE_ID_RE.fullmatch(e.name) is not None
                         and (e.is_dir(follow_symlinks=False) or e.is_symlink())]
            for name in names:
                try:
                    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=nodes_fd)
                except FileNotFoundError:  # removed since the listing
                    continue
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    where = f"{NODES_DIR}/{name}"
                    self._warned.warn(f"sweep:{where}", "not sweeping %s on %s: it is a symbolic link or not a folder",
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
    def locked(self) -> Iterator[None]:
        (self.root / GLOBAL_DIR).mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / GLOBAL_DIR / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock
