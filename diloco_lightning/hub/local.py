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
* Mirrors (``compat="speedtronic"``: ``global/latest.safetensors`` and ``step_count.json``) are
  written under temporary names (the weights hard-linked to the staged file) before the lock,
  then renamed over their fixed names, in order, under the lock right after the manifest swap.
* ``download`` returns files in place (every file is immutable once visible) and
  refuses symbolic links (the file, or a folder on the way), anything but a regular file
  (a FIFO, a device) and anything resolving outside the hub folder.
* The manifest, the lease and the claims are read with ``fileio.read_document``: a link, a
  FIFO, a device or a file over its bound is refused before a byte is read (never followed,
  waited on or read whole): a malformed manifest (replaced by the master), an expired lease,
  no claim, each with a warning naming the file.
* Nothing is ever read, listed, written, renamed, locked or deleted through a symbolic link
  (:mod:`diloco_lightning.hub.folder`: folder descriptors opened one component at a time with
  ``O_NOFOLLOW`` from the hub's folder), so ``global/``, ``nodes/`` or a node folder swapped for a
  link to elsewhere (by any writer, at any moment) makes a write fail with a ``HubError`` naming
  the link, a read refused as an unreadable file and a listing skip it, each with a warning; never
  reach outside.
* Temporary files carry their owner (``fileio.owner_tag``); :meth:`FileHub.sweep` removes
  those of dead writers (and untagged ones past an age), never a live writer's.
* ``FileHub.fault`` is a test hook called between the writes of a publication.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Any, Iterable, Mapping
from urllib.parse import quote, unquote, urlparse

from diloco_lightning.util import faults
from diloco_lightning.util.fileio import RefusedFile, file_kind, temp_prefix
from diloco_lightning.util.heldfile import HeldFile
from diloco_lightning.util.heldfile import release as release_held
from diloco_lightning.util.warnonce import WarnOnce
from diloco_lightning.hub.base import (
    DeltaExistsError,
    DeltaRef,
    Hub,
    HubError,
    HubFileTooLargeError,
    HubNotFoundError,
    LeaseConflictError,
    PublishConflictError,
    Publication,
    default_cache_dir,
    own_options,
)
from diloco_lightning.hub.folder import HubFolder, HubLinkError
from diloco_lightning.hub.folder_claims import FolderClaims
from diloco_lightning.wire.manifest import MAX_LEASE_BYTES, MAX_MANIFEST_BYTES, Lease, Manifest, ManifestError
from diloco_lightning.wire.names import (
    CLAIM_NAME,
    GLOBAL_DIR,
    LEASE_PATH,
    MANIFEST_PATH,
    NODE_ID_RE,
    NODES_DIR,
    RESERVED_GLOBAL_PATHS,
    InvalidNameError,
    delta_path,
    init_path,
    parse_delta_path,
    validate_global_path,
    validate_hub_path,
)

log = logging.getLogger(__name__)



class FileHub(Hub):
    """A hub in a folder. See the module docstring for the guarantees."""

    scheme = "file"
    url_forms = ("file:///abs/path", "a plain path")
    private_downloads = False  # files are returned in place: any writer of the folder can change them

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "FileHub":
        """``file:///abs/path`` or a plain path; options ``cache_dir``, ``create`` (others given as None
        are ignored: one configuration serves every transport)."""
        if url.lower().startswith("file:"):
            parsed = urlparse(url)
            if not url.lower().startswith("file://"):
                raise ValueError(f"open_hub: malformed file URL {url!r}; use file:///abs/path")
            if parsed.netloc not in ("", "localhost"):
                raise ValueError(f"open_hub: file URL {url!r} names host {parsed.netloc!r}; use file:///abs/path")
            if parsed.query or parsed.fragment:
                raise ValueError(f"open_hub: file URL {url!r} has a query or fragment; use file:///abs/path")
            path = Path(unquote(parsed.path))
            if not path.is_absolute():
                raise ValueError(f"open_hub: file URL {url!r} has no absolute path; use file:///abs/path")
        elif not url:
            raise ValueError("open_hub: empty hub URL")
        else:
            path = Path(url)
        return cls(path, **own_options(cls, "the folder hub", url, options))

    def __init__(self, root: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None, create: bool = True) -> None:
        root = Path(root).expanduser()
        if not root.is_absolute():
            root = Path.cwd() / root
        self.root = root
        self.local_root = root
        if create:
            root.mkdir(parents=True, exist_ok=True)  # the hub's folder itself is the user's: it may be a link
        elif not root.is_dir():
            raise HubNotFoundError(f"hub folder {root} does not exist (create=False)")
        # RFC 3986 allows '=', ',' and '+' in a path: keep them readable (runs/recipe=tiny/hub)
        self.url = "file://" + quote(str(root), safe="/=,+:@~!$&'()*;")
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(self.url)
        self._warned = WarnOnce(log)
        # every read, listing, write, removal and lock goes through it: never through a symbolic link
        self._folder = HubFolder(root, self.url)
        self.claims = FolderClaims(self._folder, self._warned, self._node_ids)
        if create:
            for sub in (NODES_DIR, GLOBAL_DIR):
                try:
                    os.close(self._folder.open_dir([sub], create=True))
                except HubLinkError as e:  # every operation through it fails or is refused, naming it
                    log.warning("%s", e)

    # ------------------------------------------------------------------ helpers

    def _abs(self, hub_path: str) -> Path:
        return self.root / validate_hub_path(hub_path)

    def _fault(self, label: str) -> None:
        faults.point(label, self)  # crash points for tests (diloco_lightning.util.faults)

    def _warn_once(self, key: str, msg: str, *args) -> None:
        self._warned.warn(key, msg, *args)  # bounded: the names are any hub writer's

    def _stage_mirrors(self, mirrors: Mapping[str, str | os.PathLike | bytes]) -> list[tuple[str, str]]:
        """Each mirror written (linked when it is a file) under a temporary name in ``global/``:
        ``[(hub path, temporary name)]``, renamed into place by :meth:`_install_mirrors`."""
        out: list[tuple[str, str]] = []
        if not mirrors:
            return out
        dfd = self._folder.open_dir([GLOBAL_DIR], create=True)
        try:
            for hub_path, src in mirrors.items():
                tmp = f"{temp_prefix(hub_path.rsplit('/', 1)[-1])}{secrets.token_hex(4)}.tmp"
                self._folder.write_temp(src, dfd, tmp, link=True)
                out.append((hub_path, tmp))
        except BaseException:
            self._drop_temps(out)
            raise
        finally:
            os.close(dfd)
        return out

    def _install_mirrors(self, staged: list[tuple[str, str]]) -> None:
        """Rename the staged mirrors over their fixed names, in order (called under the lock,
        right after the manifest): a reader sees the old file or the new one, never a part. The
        version is published already, so a failure is logged, not raised, and the later mirrors
        are not written (the metadata never advertises weights that failed to land)."""
        if not staged:
            return
        dfd = self._folder.open_dir([GLOBAL_DIR], create=True)
        try:
            for hub_path, tmp in staged:
                try:
                    os.replace(tmp, hub_path.rsplit("/", 1)[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
                except OSError as e:
                    log.warning("could not replace %s on %s (%s); the next publication writes it again", hub_path, self.url, e)
                    return
                self._fault(f"mirror:{hub_path}")
            with contextlib.suppress(OSError):
                os.fsync(dfd)
        finally:
            os.close(dfd)

    def _drop_temps(self, staged: list[tuple[str, str]]) -> None:
        if not staged:
            return
        with contextlib.suppress(OSError, HubError):
            dfd = self._folder.open_dir([GLOBAL_DIR], create=False)
            try:
                for _, tmp in staged:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp, dir_fd=dfd)
            finally:
                os.close(dfd)


    # ------------------------------------------------------------------ workers

    def upload_delta(self, local_file: str | os.PathLike, node_id: str, local_step: int) -> str:
        hub_path = delta_path(node_id, local_step)
        if not self._folder.place_new(local_file, hub_path):
            raise DeltaExistsError(f"{hub_path} already exists on {self.url}; deltas are never rewritten")
        return hub_path

    def upload_init(self, local_file: str | os.PathLike, node_id: str) -> str:
        hub_path = init_path(node_id)
        if not self._folder.place_new(local_file, hub_path):
            log.info("%s already offered; keeping the first one", hub_path)
        return hub_path

    # ------------------------------------------------------------------ listing

    def _node_ids(self) -> list[str]:
        """The valid node ids under ``nodes/`` that are folders (a symbolic link is skipped with a
        warning naming it: nothing below it is ever looked at)."""
        nodes_fd = self._folder.open_or_skip([NODES_DIR], "listing")
        if nodes_fd is None:
            return []
        out: list[str] = []
        try:
            with os.scandir(nodes_fd) as it:
                for e in it:
                    if e.is_symlink():
                        self._warn_once(f"link:{e.name}", "ignoring %s/%s on %s: it is a symbolic link", NODES_DIR, e.name,
                                        self.url)
                        continue
                    if not e.is_dir(follow_symlinks=False):
                        continue
                    if NODE_ID_RE.fullmatch(e.name) is None:
                        self._warn_once(e.name, "ignoring %s/%s on %s: not a valid node id", NODES_DIR, e.name, self.url)
                        continue
                    out.append(e.name)
        finally:
            os.close(nodes_fd)
        return out

    def list_deltas(self, after: Mapping[str, int] | None = None) -> list[DeltaRef]:
        after = after or {}
        out: list[DeltaRef] = []
        for node in self._node_ids():
            floor = after.get(node, -1)
            # each folder opened from the hub's own, never through a link (one swapped in since the listing)
            dfd = self._folder.open_or_skip([NODES_DIR, node], "listing")
            if dfd is None:  # removed while listing, or a link now
                continue
            try:
                with os.scandir(dfd) as it:
                    for f in it:
                        if f.name.startswith(".") or f.name in ("init.safetensors", CLAIM_NAME):
                            continue
                        hub_path = f"{NODES_DIR}/{node}/{f.name}"
                        ident = parse_delta_path(hub_path)
                        if ident is None:
                            self._warn_once(hub_path, "ignoring %s on %s: not a delta path", hub_path, self.url)
                            continue
                        if ident.local_step <= floor or not f.is_file(follow_symlinks=False):
                            continue
                        try:
                            st = f.stat(follow_symlinks=False)
                        except FileNotFoundError:  # collected between scandir and stat
                            continue
                        out.append(DeltaRef(ident.node_id, ident.local_step, hub_path, st.st_size,
                                            f"{st.st_ino}-{st.st_mtime_ns}"))
            finally:
                os.close(dfd)
        out.sort()
        return out

    def list_inits(self) -> list[str]:
        out = []
        for node in self._node_ids():
            try:
                if self._folder.is_file(init_path(node)):
                    out.append(node)
            except HubError:  # the node folder became a symbolic link meanwhile
                continue
        return sorted(out)

    def list_global(self) -> list[str]:
        dfd = self._folder.open_or_skip([GLOBAL_DIR], "listing")
        if dfd is None:
            return []
        try:
            names = os.listdir(dfd)
        finally:
            os.close(dfd)
        out = []
        for name in sorted(names):
            try:
                out.append(validate_global_path(f"{GLOBAL_DIR}/{name}"))
            except InvalidNameError:
                continue  # .lock, temporary files
        return out

    # ------------------------------------------------------------------ reading

    def download(self, hub_path: str, *, max_bytes: int | None = None) -> Path:
        """The file itself (no copy): hub files are immutable once visible. Refuses a symlink (there or
        in place of a folder on the way), anything but a regular file (a FIFO, a device) and a file
        over ``max_bytes``. The path returned holds the file those checks were made on open
        (:class:`~diloco_lightning.util.heldfile.HeldFile`): a reader (``fileio.open_regular``) reads
        that file, even if a hub writer renames another file (or a link) over the path meanwhile;
        :meth:`release` closes it."""
        p = self._abs(hub_path)
        try:
            fd = self._folder.open_file(hub_path)  # every folder on the way opened without following a link
        except HubLinkError as e:
            raise HubError(f"refusing {hub_path} on {self.url}: {e.where} is a symbolic link or not a folder") from None
        except (FileNotFoundError, NotADirectoryError):
            raise HubNotFoundError(f"{hub_path} not found on {self.url}") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise HubError(f"refusing {hub_path} on {self.url}: it is a symbolic link") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise HubError(f"refusing {hub_path} on {self.url}: it is {file_kind(st.st_mode)}, not a regular file")
            if max_bytes is not None and st.st_size > max_bytes:
                raise HubFileTooLargeError(
                    f"{hub_path} on {self.url} is {st.st_size} bytes, more than the {max_bytes} allowed")
        except BaseException:
            os.close(fd)
            raise
        return HeldFile.holding(p, fd)

    def release(self, local_path: str | os.PathLike) -> None:
        """Downloads are the hub's own files, returned in place: the file held open is closed."""
        release_held(local_path)

    def _read_document(self, hub_path: str, max_bytes: int) -> bytes | None:
        """``fileio.read_document`` of ``hub_path`` through folder descriptors (None if absent): a link
        (there or in place of a folder on the way), a FIFO, a device or a file over ``max_bytes`` is a
        ``RefusedFile`` stand-in, read from nowhere."""
        return self._folder.read_document(hub_path, max_bytes, name=f"{self.url}/{hub_path}")

    def read_manifest_bytes(self) -> bytes | None:
        """The manifest as stored, read up to one byte past the largest manifest; a file that is not
        a regular one or is over that size is refused unread, a ``RefusedFile`` standing for it (a
        replacement compares its digest)."""
        return self._read_document(MANIFEST_PATH, MAX_MANIFEST_BYTES)

    def read_manifest(self) -> Manifest | None:
        data = self.read_manifest_bytes()
        if isinstance(data, RefusedFile):  # malformed, as any document over its size: replaced by the master
            raise ManifestError(data.reason)
        return None if data is None else Manifest.from_json(data, source=f"{self.url}/{MANIFEST_PATH}")

    # ------------------------------------------------------------------ publishing

    def _publish(self, pub: Publication) -> None:
        # every check first (Hub.publish made the transport-independent ones): a bad publication writes nothing
        manifest, files, mirrors, delete = pub.manifest, pub.files, pub.mirrors, pub.delete
        expected_outer_step, expected_digest = pub.expected_outer_step, pub.expected_digest
        for p in manifest.files():
            if p not in files and not self._folder.is_file(p):
                raise HubError(f"manifest names {p} but it is neither uploaded now nor on {self.url}")
        written: list[str] = []
        staged_mirrors: list[tuple[str, str]] = []
        ok = False
        try:
            for hub_path, src in files.items():
                # the master's staged files never change: linked, not copied, when they can be
                if not self._folder.place_new(src, hub_path, link=True):
                    raise HubError(f"{hub_path} already exists on {self.url}; global file names must be unique")
                written.append(hub_path)
                self._fault(f"file:{hub_path}")
            staged_mirrors = self._stage_mirrors(mirrors)
            self._fault("files")
            with self._folder.locked():
                self._fault("locked")
                if expected_digest is not None:
                    raw = self.read_manifest_bytes()
                    digest = None if raw is None else hashlib.sha256(raw).hexdigest()
                    if digest is None or not hmac.compare_digest(digest, expected_digest):
                        raise PublishConflictError(expected_outer_step, None, "the manifest being replaced changed")
                else:
                    current = self.read_manifest()
                    found = None if current is None else current.outer_step
                    if found != expected_outer_step:
                        raise PublishConflictError(expected_outer_step, found)
                # deletions of global files take the lock too, so this check cannot go stale
                gone = [p for p in manifest.files() if not self._folder.is_file(p)]
                if gone:
                    raise HubError(f"manifest names {gone} but they vanished from {self.url} before the swap")
                self._folder.replace_bytes(MANIFEST_PATH, manifest.to_json().encode())  # never through a link
                ok = True
                self._fault("manifest")
                self._install_mirrors(staged_mirrors)
        finally:
            if not ok:
                for p in written:
                    with contextlib.suppress(OSError, HubError):
                        self._folder.unlink(p)
            self._drop_temps(staged_mirrors)
        log.info("published outer_step %d on %s (%d file(s), %d deletion(s))", manifest.outer_step, self.url, len(files), len(delete))
        for hub_path in delete:
            try:
                self.delete([hub_path])
            except (OSError, HubError) as e:  # the version is published: a failed deletion is garbage for later
                log.warning("could not delete %s from %s: %s", hub_path, self.url, e)
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
        with self._folder.locked() if in_global else contextlib.nullcontext():
            for hub_path in paths:
                self._folder.unlink(hub_path)

    def sweep(self, max_age: float) -> list[str]:
        """Temporary files of dead writers in ``global/``, every node folder and the cache; never
        through a symbolic link (:meth:`HubFolder.sweep`)."""
        return self._folder.sweep(max_age) + super().sweep(max_age)

    # ------------------------------------------------------------------ lease

    def read_lease(self) -> Lease | None:
        text = self._read_document(LEASE_PATH, MAX_LEASE_BYTES)
        if text is None:
            return None
        if isinstance(text, RefusedFile):  # a link, a FIFO, a device, a file over its size: expired
            return Lease.unreadable_stand_in(text, f"{self.url}/{LEASE_PATH}", text.reason)
        return Lease.from_hub_bytes(text, source=f"{self.url}/{LEASE_PATH}")

    def write_lease(self, lease: Lease | None, *, expected: Lease | None) -> None:
        with self._folder.locked():
            current = self.read_lease()
            if current != expected:
                raise LeaseConflictError(f"lease changed on {self.url}: expected {expected}, found {current}")
            if lease is None:
                self._folder.unlink(LEASE_PATH)  # never through a symbolic link
            else:
                self._folder.replace_bytes(LEASE_PATH, lease.to_json().encode())  # never through a link
