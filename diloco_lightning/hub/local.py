"""The folder hub (``file:///abs/path`` or a plain path): the embedded default.

Also right for a shared network filesystem whose ``rename`` is atomic and which
honours ``flock`` (NFSv4, Lustre, local disks).

* Deltas are placed with ``link(tmp, dest)``, which fails if ``dest`` exists: a delta
  can never be overwritten, even by two writers racing.
* ``publish`` writes the new global files under unique names, then, holding an
  exclusive ``flock`` on ``global/.lock``, compares the current manifest's
  ``outer_step`` with the expected one and swaps ``global/manifest.json`` with one
  ``os.replace``. A crash before the swap leaves the old version (plus, after a
  ``kill -9``, orphan files: ``list_global()`` minus the manifest's files, which a
  later publication can pass in ``delete``); after it, the new one. The lock dies with
  its process, so a killed master never leaves the hub locked. Deleting global files
  takes the same lock, and the manifest's files are checked under it just before the
  swap, so a concurrent garbage collection can never leave a manifest naming a
  missing file.
* ``download`` returns files in place (every file is immutable once visible) and
  refuses symbolic links and anything resolving outside the hub folder.
* ``FileHub.fault`` is a test hook called between the writes of a publication.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping
from urllib.parse import quote

from diloco_lightning.fileio import atomic_write_bytes, fsync_dir
from diloco_lightning.hub.base import (
    ClaimConflictError,
    DeltaExistsError,
    DeltaRef,
    Hub,
    HubError,
    HubNotFoundError,
    LeaseConflictError,
    PublishConflictError,
    check_publication,
    default_cache_dir,
)
from diloco_lightning.manifest import Lease, Manifest
from diloco_lightning.nodeclaim import MAX_CLAIM_BYTES, ClaimError, NodeClaim
from diloco_lightning.names import (
    CLAIM_NAME,
    GLOBAL_DIR,
    LEASE_PATH,
    MANIFEST_PATH,
    NODE_ID_RE,
    NODES_DIR,
    RESERVED_GLOBAL_PATHS,
    InvalidNameError,
    claim_path,
    delta_path,
    init_path,
    parse_delta_path,
    validate_global_path,
    validate_hub_path,
)

log = logging.getLogger(__name__)

_LOCK_NAME = ".lock"


class FileHub(Hub):
    """A hub in a folder. See the module docstring for the guarantees."""

    def __init__(self, root: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None, create: bool = True) -> None:
        root = Path(root).expanduser()
        if not root.is_absolute():
            root = Path.cwd() / root
        self.root = root
        if create:
            (root / NODES_DIR).mkdir(parents=True, exist_ok=True)
            (root / GLOBAL_DIR).mkdir(parents=True, exist_ok=True)
        elif not root.is_dir():
            raise HubNotFoundError(f"hub folder {root} does not exist (create=False)")
        # RFC 3986 allows '=', ',' and '+' in a path: keep them readable (runs/recipe=tiny/hub)
        self.url = "file://" + quote(str(root), safe="/=,+:@~!$&'()*;")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(self.url)
        self._warned: set[str] = set()
        self._warned_lock = threading.Lock()
        #: test hook: called with a label between the writes of a publication, in this order:
        #: "file:<hub path>" after each uploaded file, "files" after all of them, "locked" once the
        #: lock is held (before the compare), "manifest" after the manifest swap (lock still held),
        #: "delete:<hub path>" after each deletion, "deleted" at the end. Raising from it (or
        #: killing the process) simulates a crash at that point.
        self.fault: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ helpers

    def _abs(self, hub_path: str) -> Path:
        return self.root / validate_hub_path(hub_path)

    def _fault(self, label: str) -> None:
        if self.fault is not None:
            self.fault(label)

    def _warn_once(self, key: str, msg: str, *args) -> None:
        with self._warned_lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(msg, *args)

    def _place_new(self, src: str | os.PathLike, dest: Path) -> bool:
        """Copy ``src`` to ``dest`` if ``dest`` does not exist; atomic, never overwrites. False if it existed."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        os.close(fd)
        try:
            shutil.copyfile(src, tmp)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, dest)
            except FileExistsError:
                return False
            except OSError as e:  # filesystems without hard links: check-then-rename (single writer per path)
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise
                if dest.exists():
                    return False
                os.replace(tmp, dest)
            fsync_dir(dest.parent)
            return True
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        (self.root / GLOBAL_DIR).mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / GLOBAL_DIR / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock

    # ------------------------------------------------------------------ workers

    def upload_delta(self, local_file: str | os.PathLike, node_id: str, local_step: int) -> str:
        hub_path = delta_path(node_id, local_step)
        if not self._place_new(local_file, self.root / hub_path):
            raise DeltaExistsError(f"{hub_path} already exists on {self.url}; deltas are never rewritten")
        return hub_path

    def upload_init(self, local_file: str | os.PathLike, node_id: str) -> str:
        hub_path = init_path(node_id)
        if not self._place_new(local_file, self.root / hub_path):
            log.info("%s already offered; keeping the first one", hub_path)
        return hub_path

    # ------------------------------------------------------------------ listing

    def _node_dirs(self) -> Iterator[os.DirEntry]:
        try:
            entries = list(os.scandir(self.root / NODES_DIR))
        except FileNotFoundError:
            return
        for e in entries:
            if not e.is_dir(follow_symlinks=False):
                continue
            if NODE_ID_RE.fullmatch(e.name) is None:
                self._warn_once(e.name, "ignoring %s/%s on %s: not a valid node id", NODES_DIR, e.name, self.url)
                continue
            yield e

    def list_deltas(self, after: Mapping[str, int] | None = None) -> list[DeltaRef]:
        after = after or {}
        out: list[DeltaRef] = []
        for nd in self._node_dirs():
            floor = after.get(nd.name, -1)
            try:
                entries = list(os.scandir(nd.path))
            except FileNotFoundError:  # removed while listing
                continue
            for f in entries:
                if f.name.startswith(".") or f.name in ("init.safetensors", CLAIM_NAME):
                    continue
                hub_path = f"{NODES_DIR}/{nd.name}/{f.name}"
                ident = parse_delta_path(hub_path)
                if ident is None:
                    self._warn_once(hub_path, "ignoring %s on %s: not a delta path", hub_path, self.url)
                    continue
                if ident.local_step <= floor or not f.is_file(follow_symlinks=False):
                    continue
                try:
                    size = f.stat(follow_symlinks=False).st_size
                except FileNotFoundError:  # collected between scandir and stat
                    continue
                out.append(DeltaRef(ident.node_id, ident.local_step, hub_path, size))
        out.sort()
        return out

    def list_inits(self) -> list[str]:
        return sorted(nd.name for nd in self._node_dirs() if os.path.isfile(os.path.join(nd.path, "init.safetensors")))

    def list_global(self) -> list[str]:
        try:
            names = os.listdir(self.root / GLOBAL_DIR)
        except FileNotFoundError:
            return []
        out = []
        for name in sorted(names):
            try:
                out.append(validate_global_path(f"{GLOBAL_DIR}/{name}"))
            except InvalidNameError:
                continue  # .lock, temporary files
        return out

    # ------------------------------------------------------------------ reading

    def download(self, hub_path: str) -> Path:
        """The file itself (no copy): hub files are immutable once visible. Refuses a symlink
        or anything that resolves outside the hub folder."""
        p = self._abs(hub_path)
        if p.is_symlink() or p.parent.is_symlink():
            raise HubError(f"refusing {hub_path} on {self.url}: it is a symbolic link")
        if not p.is_file():
            raise HubNotFoundError(f"{hub_path} not found on {self.url}")
        if not p.resolve().is_relative_to(self.root.resolve()):
            raise HubError(f"refusing {hub_path} on {self.url}: it resolves outside the hub folder")
        return p

    def read_manifest(self) -> Manifest | None:
        try:
            text = (self.root / MANIFEST_PATH).read_bytes()
        except FileNotFoundError:
            return None
        return Manifest.from_json(text, source=f"{self.url}/{MANIFEST_PATH}")

    # ------------------------------------------------------------------ publishing

    def publish(
        self,
        manifest: Manifest,
        files: Mapping[str, str | os.PathLike],
        *,
        expected_outer_step: int | None,
        delete: Iterable[str] = (),
    ) -> None:
        # every check first: a bad publication writes nothing
        files, delete = check_publication(
            manifest, files, expected_outer_step=expected_outer_step, delete=delete, source=self.url
        )
        for p in manifest.files():
            if p not in files and not (self.root / p).is_file():
                raise HubError(f"manifest names {p} but it is neither uploaded now nor on {self.url}")
        written: list[Path] = []
        ok = False
        try:
            for hub_path, src in files.items():
                dest = self.root / hub_path
                if not self._place_new(src, dest):
                    raise HubError(f"{hub_path} already exists on {self.url}; global file names must be unique")
                written.append(dest)
                self._fault(f"file:{hub_path}")
            self._fault("files")
            with self._locked():
                self._fault("locked")
                current = self.read_manifest()
                found = None if current is None else current.outer_step
                if found != expected_outer_step:
                    raise PublishConflictError(expected_outer_step, found)
                # deletions of global files take the lock too, so this check cannot go stale
                gone = [p for p in manifest.files() if not (self.root / p).is_file()]
                if gone:
                    raise HubError(f"manifest names {gone} but they vanished from {self.url} before the swap")
                atomic_write_bytes(self.root / MANIFEST_PATH, manifest.to_json().encode())
                ok = True
                self._fault("manifest")
        finally:
            if not ok:
                for p in written:
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
        log.info("published outer_step %d on %s (%d file(s), %d deletion(s))", manifest.outer_step, self.url, len(files), len(delete))
        for hub_path in delete:
            self.delete([hub_path])
            self._fault(f"delete:{hub_path}")
        self._fault("deleted")

    def delete(self, paths: Iterable[str]) -> None:
        paths = [validate_hub_path(p) for p in paths]
        for hub_path in paths:
            if hub_path in RESERVED_GLOBAL_PATHS:
                raise InvalidNameError(f"refusing to delete {hub_path!r}")
        # global files are removed under the publication lock: a publication never swaps in
        # a manifest naming a file that a concurrent garbage collection just removed
        in_global = any(p.startswith(GLOBAL_DIR + "/") for p in paths)
        with self._locked() if in_global else contextlib.nullcontext():
            for hub_path in paths:
                with contextlib.suppress(FileNotFoundError):
                    (self.root / hub_path).unlink()

    # ------------------------------------------------------------------ lease

    def read_lease(self) -> Lease | None:
        try:
            text = (self.root / LEASE_PATH).read_bytes()
        except FileNotFoundError:
            return None
        return Lease.from_json(text, source=f"{self.url}/{LEASE_PATH}")

    def write_lease(self, lease: Lease | None, *, expected: Lease | None) -> None:
        with self._locked():
            current = self.read_lease()
            if current != expected:
                raise LeaseConflictError(f"lease changed on {self.url}: expected {expected}, found {current}")
            if lease is None:
                with contextlib.suppress(FileNotFoundError):
                    (self.root / LEASE_PATH).unlink()
            else:
                atomic_write_bytes(self.root / LEASE_PATH, lease.to_json().encode())

    # ------------------------------------------------------------------ node claims

    def _claim_file(self, node_id: str) -> Path:
        p = self.root / claim_path(node_id)
        if p.parent.is_symlink():
            raise HubError(f"refusing {NODES_DIR}/{node_id} on {self.url}: it is a symbolic link")
        return p

    def _read_claim_file(self, node_id: str) -> NodeClaim | None:
        p = self._claim_file(node_id)
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return None
        except OSError as e:  # ELOOP: a symbolic link
            self._warn_once(str(p), "ignoring the claim %s on %s: %s", claim_path(node_id), self.url, e)
            return None
        try:
            data = os.read(fd, MAX_CLAIM_BYTES + 1)
        finally:
            os.close(fd)
        try:
            return NodeClaim.from_json(data, node_id=node_id, source=f"{self.url}/{claim_path(node_id)}")
        except ClaimError as e:
            self._warn_once(f"{p}:{len(data)}", "ignoring an unreadable claim: %s", e)
            return None

    def read_claim(self, node_id: str) -> NodeClaim | None:
        return self._read_claim_file(node_id)

    def write_claim(self, node_id: str, claim: NodeClaim | None, *, expected: NodeClaim | None) -> None:
        if claim is not None and claim.node_id != node_id:
            raise ValueError(f"write_claim: a claim for {claim.node_id!r} written as {node_id!r}'s")
        p = self._claim_file(node_id)
        text = None if claim is None else claim.to_json().encode()
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p.parent / ".claim.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            current = self._read_claim_file(node_id)
            if current != expected:
                raise ClaimConflictError(f"claim on {node_id!r} changed on {self.url}: expected {expected}, found {current}")
            if text is None:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            else:
                atomic_write_bytes(p, text)
        finally:
            os.close(fd)  # releases the flock
