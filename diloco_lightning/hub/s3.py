"""The S3 transport (``s3://bucket/prefix``), through boto3: AWS S3 and S3-compatible stores.

Hub path ``p`` is the object ``<prefix>/p`` of ``bucket``. Credentials come from boto3's
standard chain (environment, ``AWS_PROFILE`` / config files, instance or container roles);
they are never put in a message or a log line. Requests, retries, error mapping and multipart
uploads are in :mod:`diloco_lightning.hub.s3_store`.

What the store must support (probed when the hub is opened, unless ``check_conditional_writes=False``):

* ``PutObject`` with ``If-None-Match: *`` (create only if absent) and ``If-Match: <etag>``
  (replace only if unchanged), answering 412 when the condition fails (409
  ``ConditionalRequestConflict`` under contention is retried). A store that ignores either
  header is refused at open with a ``HubError`` that says so: without them nothing below holds.
* ``CompleteMultipartUpload`` with ``If-None-Match: *``, for files above ``multipart_threshold``.
  A store that ignores it there gets every file up to 5 GiB in one conditional ``PutObject``
  instead, and a larger file is refused (never uploaded unguarded).
* Strongly consistent reads and listings after a write (AWS S3 since 2020, MinIO, R2);
  ``ListObjectsV2``, ``GetObject``, ``DeleteObject``.

How each rule of ``diloco_lightning.hub.base`` is kept:

* Deltas and ``init.safetensors`` are created with ``If-None-Match: *``, so a delta is never
  overwritten, even by writers racing (``DeltaExistsError``); a retried upload whose own
  bytes are already there counts as done.
* ``publish``: every check of ``check_publication``; the manifest is read (bytes and ETag) and
  its ``outer_step`` compared (``PublishConflictError`` before anything is uploaded); one
  listing of ``global/`` checks that the files the manifest names exist and the new ones do
  not; the new files go up under their unique names with ``If-None-Match: *``; a second listing
  checks that none vanished; then ``global/manifest.json`` is replaced with ``If-Match: <ETag
  read>`` (``If-None-Match: *`` on a fresh hub): that one conditional PUT is the atomic point.
  A lost swap is ``PublishConflictError`` and the uploaded files are removed (those the current
  manifest does not name). Deletions follow the swap, as on the folder hub; a failed deletion
  is logged and left to garbage collection (the new version is already live). A crash before
  the swap leaves the old version plus orphans in ``global/`` (``list_global()`` minus the
  manifest's files, collected by a later publication); after it, the new version. There is no
  lock: a garbage collection of ``global/`` running beside a publication is caught by the second
  listing, except in the moment between that listing and the swap (the master only ever
  deletes files older than the version it just published).
* Mirrors (``compat="speedtronic"``: ``global/latest.safetensors``, ``global/step_count.json``)
  follow the swap, in order: the weights copied on the store from the file just uploaded (no
  second upload), then the metadata put. S3 has no multi-object transaction: a reader may see
  the new manifest before the mirrors, never mirrors ahead of the manifest; a failure is logged
  and the next publication writes them again.
* The lease uses the same conditional writes on ``global/lease.json``; releasing it writes an
  empty object (read back as "no lease") instead of deleting it, so no conditional DELETE is
  needed. A CAS whose answer was lost is recognised by reading back exactly the bytes written.
  Node claims (``nodes/<node_id>/claim.json``, :mod:`diloco_lightning.wire.claims`) work the same
  way; listings skip them.
* Listing: one paginated ``ListObjectsV2`` of ``<prefix>/nodes/`` (sizes go into ``DeltaRef``),
  filtered by the ledger here. A ``StartAfter`` cannot skip what the ledger covers: keys sort
  as text, so ``delta_10`` sorts before ``delta_9``, and a step with more digits than the
  ledger's can sort anywhere before it (``delta_100`` < ``delta_25``); a listing that started
  after ``delta_<ledger>`` would miss new deltas, and none that starts later than ``delta_1``
  is complete. What keeps the listing short is the master deleting processed deltas with each
  publication (one ``DeleteObjects`` request per 1000 files after the swap). One listing of all of
  ``nodes/`` is also fewer requests than one per node.
* ``download`` streams into ``cache_dir/<hub path>`` (temporary file + ``os.replace``, length
  checked; botocore validates the store's checksum when there is one), so two nodes'
  same-named files never share a cache file and a partial file is never seen. Immutable files
  are reused from the cache (a delta's only if its size matches the listing); the mutable ones
  (manifest, lease, ``init.safetensors``) are fetched every time.

What a crash can leave behind besides orphans: incomplete multipart uploads (invisible, but
stored), a ``global/.probe-dl-<host>-<pid>-*`` object of the conditional-write probe (not a valid
global name: listings skip it), ``.tmp`` files in the cache. :meth:`S3Hub.sweep` (the master's,
at start and with garbage collection) removes them: a probe's once its process of this host is
gone (or it is ``max_age`` old), any other incomplete upload once initiated ``max_age`` ago; an
``AbortIncompleteMultipartUpload`` lifecycle rule on the bucket is still the belt to these braces.

A store that cannot be reached when the hub is opened (an outage) does not stop the process: the
probe is then run before its first write, and until it passes every write raises
``HubUnavailableError``, which every caller's wait retries and reports.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from diloco_lightning.util import faults
from diloco_lightning.util.warnonce import WarnOnce
from diloco_lightning.hub.s3_claims import S3Claims
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
from diloco_lightning.hub.s3_store import HubUnavailableError, Missing, Precondition, S3Store, TooLarge, parse_s3_url
from diloco_lightning.wire.manifest import Lease, Manifest, ManifestError
from diloco_lightning.wire.names import (
    GLOBAL_DIR,
    LEASE_PATH,
    MANIFEST_PATH,
    MIRROR_PATHS,
    NODES_DIR,
    RESERVED_GLOBAL_PATHS,
    InvalidNameError,
    delta_path,
    init_path,
    parse_claim_path,
    parse_delta_path,
    parse_init_path,
    validate_global_path,
    validate_hub_path,
)

log = logging.getLogger(__name__)

__all__ = ["S3Hub", "S3_OPTIONS", "HubUnavailableError", "parse_s3_url"]


class S3Hub(Hub):
    """A hub under ``s3://bucket/prefix``. See the module docstring for what the store must
    support and how each guarantee is kept.

    Options: ``endpoint_url`` (a MinIO/R2/... endpoint; default boto3's: AWS, or
    ``$AWS_ENDPOINT_URL_S3`` / ``$AWS_ENDPOINT_URL``), ``region`` (default boto3's), ``addressing_style`` (``path``,
    ``virtual`` or ``auto``; MinIO usually needs ``path``), ``cache_dir``, ``max_retries``
    (retries of one request on 5xx/throttling/timeouts, default 5), ``retry_base_delay`` /
    ``retry_max_delay`` (seconds; backoff ``min(max, base * 2**n)`` jittered to 50-100 %),
    ``timeout`` (seconds per connect/read, default 60), ``multipart_threshold`` (files larger
    than this go up in parts, default 64 MiB), ``part_size`` (default 32 MiB, at least 5 MiB;
    raised when a file would need more than 10,000 parts; at most 4 parts are in memory at
    once), ``check_conditional_writes`` (probe the store at open, default True: a few requests
    on a scratch object ``global/.probe-<random>``, removed afterwards; credentials that may
    not write under ``global/``, e.g. a worker's restricted to ``nodes/``, need False).
    """

    scheme = "s3"
    url_forms = ("s3://bucket/prefix",)
    creatable = False  # a bucket is never created (a prefix needs no creating)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "S3Hub":
        """``s3://bucket/prefix``; the options of :class:`S3Hub` (others given as None are ignored)."""
        bucket, prefix = parse_s3_url(url)
        return cls(bucket, prefix, **own_options(cls, "the S3 hub", url, options))

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        addressing_style: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        max_retries: int | None = None,
        retry_base_delay: float | None = None,
        retry_max_delay: float | None = None,
        timeout: float | None = 60.0,
        multipart_threshold: int | None = None,
        part_size: int | None = None,
        check_conditional_writes: bool = True,
    ) -> None:
        self.store = S3Store(
            bucket, prefix, endpoint_url=endpoint_url, region=region, addressing_style=addressing_style,
            max_retries=max_retries, retry_base_delay=retry_base_delay, retry_max_delay=retry_max_delay,
            timeout=timeout, multipart_threshold=multipart_threshold, part_size=part_size,
        )
        self.url = self.store.url
        self.endpoint_url = self.store.endpoint_url
        self.cache_dir = (
            Path(cache_dir) if cache_dir is not None else default_cache_dir(f"{self.endpoint_url}|{self.url}")
        )
        self._warned = WarnOnce(log)  # bounded: the names are any hub writer's
        self.claims = S3Claims(self.store, self._warned, self._ensure_probed)
        #: the conditional-write probe still to pass before this handle's first write (None: passed or not asked)
        self._probe_lock = threading.Lock()
        self._probe_pending = bool(check_conditional_writes)
        if check_conditional_writes:
            try:
                self._ensure_probed()
            except HubUnavailableError as e:  # the store is down: never a reason to exit; checked before any write
                log.warning("cannot reach %s to check its conditional writes (%s); they are checked before this "
                            "process's first write", self.url, e)

    def _ensure_probed(self) -> None:
        """Run the conditional-write probe if it has not passed yet (before any write: without the
        store's conditional writes nothing here holds). Raises ``HubUnavailableError`` while the store
        is unreachable (the caller's wait retries), ``HubError`` when the store lacks them."""
        if not self._probe_pending:
            return
        with self._probe_lock:
            if self._probe_pending:
                self.store.check_conditional_writes(GLOBAL_DIR)
                self._probe_pending = False

    def _fault(self, label: str) -> None:
        faults.point(label, self)  # crash points for tests (diloco_lightning.util.faults)

    # ------------------------------------------------------------------ workers

    def upload_delta(self, local_file: str | os.PathLike, node_id: str, local_step: int) -> str:
        hub_path = delta_path(node_id, local_step)
        self._ensure_probed()
        if not self.store.put_new(local_file, hub_path, "upload delta"):
            raise DeltaExistsError(f"{hub_path} already exists on {self.url}; deltas are never rewritten")
        return hub_path

    def upload_init(self, local_file: str | os.PathLike, node_id: str) -> str:
        hub_path = init_path(node_id)
        self._ensure_probed()
        if not self.store.put_new(local_file, hub_path, "offer initial weights"):
            log.info("%s already offered on %s; keeping the first one", hub_path, self.url)
        return hub_path

    # ------------------------------------------------------------------ listing

    def list_deltas(self, after: Mapping[str, int] | None = None) -> list[DeltaRef]:
        after = after or {}
        out: list[DeltaRef] = []
        for path, size, etag in self.store.list(NODES_DIR, recursive=True):
            ident = parse_delta_path(path)
            if ident is None:
                if parse_init_path(path) is None and parse_claim_path(path) is None:
                    self._warned.warn(path, "ignoring %s on %s: not a delta path", path, self.url)
                continue
            if ident.local_step > after.get(ident.node_id, -1):
                out.append(DeltaRef(ident.node_id, ident.local_step, path, size, etag))
        out.sort()
        return out

    def list_inits(self) -> list[str]:
        return sorted({n for n in (parse_init_path(p) for p, _, _ in self.store.list(NODES_DIR, recursive=True)) if n})

    def list_global(self) -> list[str]:
        out = []
        for path, _, _ in self.store.list(GLOBAL_DIR, recursive=False):
            try:
                out.append(validate_global_path(path))
            except InvalidNameError:
                continue  # .probe-* objects
        return sorted(out)

    # ------------------------------------------------------------------ reading

    def download(self, hub_path: str, *, max_bytes: int | None = None) -> Path:
        hub_path = validate_hub_path(hub_path)
        dest = self.cache_dir / hub_path
        mutable = hub_path in RESERVED_GLOBAL_PATHS or hub_path in MIRROR_PATHS or parse_init_path(hub_path) is not None
        if not mutable and dest.is_file():
            if max_bytes is not None and dest.stat().st_size > max_bytes:
                raise HubFileTooLargeError(f"{hub_path} on {self.url} is more than the {max_bytes} bytes allowed")
            return dest  # hub files are immutable and cached copies complete (atomic rename)
        try:
            self.store.fetch(hub_path, dest, max_bytes)
        except Missing:
            raise HubNotFoundError(f"{hub_path} not found on {self.url}") from None
        return dest

    def download_delta(self, ref: DeltaRef) -> Path:
        dest = self.cache_dir / validate_hub_path(ref.path)
        if ref.size is not None and dest.is_file() and dest.stat().st_size != ref.size:
            log.info("cached %s is %d bytes, the hub lists %d; fetching it again", ref.path, dest.stat().st_size,
                     ref.size)
            with contextlib.suppress(FileNotFoundError):
                dest.unlink()
        return self.download(ref.path)

    def _manifest(self, data: bytes) -> Manifest:
        if isinstance(data, TooLarge):  # malformed, as any document over its size: replaced by the master
            raise ManifestError(data.reason)
        return Manifest.from_json(data, source=f"{self.url}/{MANIFEST_PATH}")

    def read_manifest_bytes(self) -> bytes | None:
        data, _ = self.store.read_small(MANIFEST_PATH)
        return data

    def read_manifest(self) -> Manifest | None:
        data = self.read_manifest_bytes()
        return None if data is None else self._manifest(data)

    # ------------------------------------------------------------------ publishing

    def _global_paths(self) -> set[str]:
        return {p for p, _, _ in self.store.list(GLOBAL_DIR, recursive=False)}

    def _publish(self, pub: Publication) -> None:
        manifest, files, mirrors = pub.manifest, pub.files, pub.mirrors
        expected_outer_step, expected_digest = pub.expected_outer_step, pub.expected_digest
        delete = list(dict.fromkeys(pub.delete))
        self._ensure_probed()
        data = manifest.to_json().encode()
        current, etag = self.store.read_small(MANIFEST_PATH)
        if current == data:
            log.info("outer_step %d is already published on %s (an earlier attempt landed)", manifest.outer_step,
                     self.url)
            self._write_mirrors(mirrors, manifest, files)
            self._delete_after_swap(delete)
            return
        if expected_digest is not None:  # replacing a manifest that is malformed or not authentic
            if current is None or hashlib.sha256(current).hexdigest() != expected_digest:
                raise PublishConflictError(expected_outer_step, None, "the manifest being replaced changed")
        else:
            found = None if current is None else self._manifest(current).outer_step
            if found != expected_outer_step:
                raise PublishConflictError(expected_outer_step, found)
        present = self._global_paths()
        missing = [p for p in manifest.files() if p not in files and p not in present]
        if missing:
            raise HubError(f"manifest names {missing} but they are neither uploaded now nor on {self.url}")
        taken = sorted(p for p in files if p in present)
        if taken:
            raise HubError(f"{taken} already exists on {self.url}; global file names must be unique")
        written: list[str] = []
        swapped = False
        try:
            for hub_path, src in files.items():
                if not self.store.put_new(src, hub_path, f"publish outer_step {manifest.outer_step}"):
                    raise HubError(f"{hub_path} already exists on {self.url}; global file names must be unique")
                written.append(hub_path)
                self._fault(f"file:{hub_path}")
            self._fault("files")
            self._fault("locked")
            # a garbage collection beside this publication may have removed a file since the first listing
            gone = [p for p in manifest.files() if p not in self._global_paths()]
            if gone:
                raise HubError(f"manifest names {gone} but they vanished from {self.url} before the swap")
            try:
                self.store.cas_put(MANIFEST_PATH, data, etag)
            except Precondition as e:
                try:
                    now = None if e.current is None else self._manifest(e.current)
                except ManifestError:
                    now = None
                if now is not None:  # a later version may name what landed here (an answer lost, then superseded)
                    written = [p for p in written if p not in set(now.files())]
                raise PublishConflictError(expected_outer_step, None if now is None else now.outer_step) from None
            swapped = True
            self._fault("manifest")
        finally:
            if not swapped:
                for hub_path in written:
                    try:
                        self.store.delete(hub_path)
                    except Exception as e:  # noqa: BLE001 - best effort: an orphan is collected later
                        log.warning("could not remove %s of an unpublished version from %s: %s", hub_path, self.url, e)
        log.info("published outer_step %d on %s (%d file(s), %d deletion(s))", manifest.outer_step, self.url,
                 len(files), len(delete))
        self._write_mirrors(mirrors, manifest, files)
        self._delete_after_swap(delete)

    def _write_mirrors(self, mirrors: Mapping[str, str | os.PathLike | bytes], manifest: Manifest,
                       files: Mapping[str, str | os.PathLike]) -> None:
        """The mirrors, after the swap and in order (see the module docstring). A mirror made from
        a file of this publication is copied from it on the store. A failure is logged, not raised
        (the version is live), and the later mirrors are not written."""
        uploaded = {os.fspath(src): hub_path for hub_path, src in files.items()}
        what = f"publish outer_step {manifest.outer_step}"
        for hub_path, src in mirrors.items():
            try:
                origin = None if isinstance(src, bytes) else uploaded.get(os.fspath(src))
                if origin is not None:
                    self.store.copy(origin, hub_path, what)
                else:
                    self.store.put(hub_path, src, what)
            except (HubError, OSError) as e:
                log.warning("could not replace %s on %s (%s); the next publication writes it again", hub_path, self.url, e)
                return
            self._fault(f"mirror:{hub_path}")

    def _delete_after_swap(self, paths: list[str]) -> None:
        """The deletions of a publication, after its swap, in batches (``S3Store.delete_many``): a
        failure is logged (the files are left to a later garbage collection), never raised, since the
        new version is already live. The crash points ``delete:<path>`` follow each batch."""
        for i in range(0, len(paths), 1000):
            batch = paths[i : i + 1000]
            try:
                self.store.delete_many(batch)
            except HubError as e:
                log.warning("published, but could not delete some of %d file(s) from %s (left for garbage "
                            "collection): %s", len(batch), self.url, e)
            for hub_path in batch:
                self._fault(f"delete:{hub_path}")
        self._fault("deleted")

    def delete(self, paths: Iterable[str]) -> None:
        paths = list(dict.fromkeys(validate_hub_path(p) for p in paths))
        for hub_path in paths:
            if hub_path in RESERVED_GLOBAL_PATHS:
                raise InvalidNameError(f"refusing to delete {hub_path!r}")
        self.store.delete_many(paths)

    # ------------------------------------------------------------------ lease

    def _lease(self, data: bytes | None) -> Lease | None:
        if isinstance(data, TooLarge):
            return Lease.unreadable_stand_in(data, f"{self.url}/{LEASE_PATH}", data.reason)
        return None if not data else Lease.from_hub_bytes(data, source=f"{self.url}/{LEASE_PATH}")

    def read_lease(self) -> Lease | None:
        data, _ = self.store.read_small(LEASE_PATH)
        return self._lease(data)

    def write_lease(self, lease: Lease | None, *, expected: Lease | None) -> None:
        self._ensure_probed()
        self.store.swap(
            LEASE_PATH, b"" if lease is None else lease.to_json().encode(), parse=self._lease, target=lease,
            expected=expected, unreadable="an unreadable lease",
            conflict=lambda found: LeaseConflictError(f"lease changed on {self.url}: expected {expected}, found {found}"),
        )

    # ------------------------------------------------------------------ common

    def sweep(self, max_age: float) -> list[str]:
        """The cache's temporaries (base ``Hub.sweep``), and on the store the probe objects and incomplete
        multipart uploads killed processes left (:meth:`S3Store.sweep`)."""
        removed = super().sweep(max_age)
        try:
            removed += self.store.sweep(GLOBAL_DIR, max_age)
        except HubError as e:  # e.g. credentials that may not list or delete there: the cache is swept anyway
            log.info("could not sweep %s: %s", self.url, e)
        return removed

    def close(self) -> None:
        self.store.close()

    def __repr__(self) -> str:
        return f"S3Hub({self.url!r}, endpoint_url={self.endpoint_url!r})"


#: the options ``open_hub("s3://...", **options)`` passes on: the keyword arguments of ``S3Hub``
S3_OPTIONS = frozenset(inspect.signature(S3Hub.__init__).parameters) - {"self", "bucket", "prefix"}
