"""One ``s3://bucket/prefix`` through boto3: retried requests and conditional writes.

:class:`S3Store` is what ``diloco_lightning.hub.s3.S3Hub`` is built on (and what any later
hub file with a compare-and-swap reuses): objects are named by their path under the prefix,
and it offers exactly the primitives the hub needs:

* ``put_new``: create an object from a local file only if nothing is there
  (``If-None-Match: *`` on ``PutObject``, or on ``CompleteMultipartUpload`` above
  ``multipart_threshold``). A 412 is compared with the local file (size, then the ETag as an
  MD5 or a multipart MD5 with our part size, else the bytes): the same bytes mean an earlier
  attempt landed and its answer was lost, which counts as created.
* ``read_small`` / ``cas_put``: the bytes and ETag of a small mutable object, and a write
  guarded by ``If-Match: <that ETag>`` (``If-None-Match: *`` when it was absent). A refused
  write whose object now holds exactly the bytes written is an earlier attempt of ours.
* ``list`` (paginated ``ListObjectsV2``, one retried request per page), ``fetch`` (a streamed
  ``GetObject`` into a temporary file, length checked), ``delete``, ``delete_many`` (one
  ``DeleteObjects`` per 1000 objects, falling back to ``DeleteObject`` on a store without it).
* ``check_conditional_writes``: the probe run when a hub is opened (see ``S3Hub``).

Requests (retries, backoff, errors mapped to ``HubError`` subclasses) are
:class:`~diloco_lightning.hub.s3_client.S3Client`'s, the base class: see its module.

Multipart uploads send at most ``_PART_CONCURRENCY`` parts at a time (that many parts in
memory), each retried on its own; they declare CRC32 part checksums up front and list them at
completion, as boto3's transfer manager does (none with
``AWS_REQUEST_CHECKSUM_CALCULATION=when_required``, for stores that reject botocore's default
checksums). A failed or refused upload is aborted; one cut short by ``kill -9`` stays invisible
until the bucket's ``AbortIncompleteMultipartUpload`` lifecycle rule removes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, List

from diloco_lightning.util.fileio import UnreadDocument, atomic_path, is_dead_or_old, owner_tag
from diloco_lightning.hub.base import HubAuthError, HubError, HubFileTooLargeError, HubNotFoundError, HubUnavailableError
from diloco_lightning.hub.s3_multipart import MultipartUpload, multipart_etag
from diloco_lightning.hub.s3_client import (  # noqa: F401 - re-exported: the store's names, importable from here
    ADDRESSING_STYLES,
    MAX_PUT,
    MIN_PART,
    Missing,
    MiB,
    Precondition,
    S3Client,
    Transient,
    parse_s3_url,
)

log = logging.getLogger(__name__)

__all__ = ["S3Store", "Precondition", "Missing", "HubUnavailableError", "TooLarge", "parse_s3_url"]

_MAX_PARTS = 10_000
_PART_CONCURRENCY = 4
_DELETE_BATCH = 1000  # the most keys one DeleteObjects takes
SMALL_LIMIT = 16 * MiB  # a "small" object (manifest, lease) above this is refused, never read into memory
#: the name the conditional-write probe's scratch object starts with (in ``global/``)
PROBE_PREFIX = ".probe-"
_CHUNK = 8 * MiB
_MD5_ETAG_RE = re.compile(r"[0-9a-f]{32}")
_MULTIPART_ETAG_RE = re.compile(r"[0-9a-f]{32}-[0-9]+")


class TooLarge(UnreadDocument):
    """What :meth:`S3Store.read_small` returns for an object above :data:`SMALL_LIMIT`, whose body is
    never read (:class:`~diloco_lightning.util.fileio.UnreadDocument`), named by its path, size and
    ETag; a plain ``HubError`` here once made every round of a master raise."""

    def __new__(cls, path: str, url: str, size: int, etag: str | None) -> "TooLarge":
        return super().__new__(cls, f"{path} on {url}: {size} bytes, ETag {etag}",  # type: ignore[return-value]
                               f"{path} on {url} is {size} bytes, more than the {SMALL_LIMIT} a hub document is read up to")


class S3Store:
    """Objects under ``s3://bucket/prefix``, addressed by their path below the prefix. Thread-safe
    (one boto3 client, which is). See the module docstring; the options are ``S3Hub``'s: the
    multipart ones here, the others its :class:`~diloco_lightning.hub.s3_client.S3Client`'s (``s3``)."""

    #: keys per ListObjectsV2 page (S3's maximum; tests lower it to exercise pagination)
    list_page_size = 1000

    def __init__(self, bucket: str, prefix: str = "", *, multipart_threshold: int | None = None,
                 part_size: int | None = None, **client_options: Any) -> None:
        self.multipart_threshold = 64 * MiB if multipart_threshold is None else int(multipart_threshold)
        self.part_size = 32 * MiB if part_size is None else int(part_size)
        #: the requests: the boto3 client, retries, errors
        self.s3 = S3Client(bucket, prefix, **client_options)
        if self.multipart_threshold < 0:
            raise ValueError(f"S3 hub: multipart_threshold must be >= 0, got {multipart_threshold!r}")
        if not MIN_PART <= self.part_size <= MAX_PUT:
            raise ValueError(f"S3 hub: part_size must be between 5 MiB and 5 GiB (S3's limits), got {part_size!r}")
        self.bucket, self.prefix, self.url, self.endpoint_url = self.s3.bucket, self.s3.prefix, self.s3.url, self.s3.endpoint_url
        self.client, self.call, self.key = self.s3.client, self.s3.call, self.s3.key
        #: False when the store ignores If-None-Match on CompleteMultipartUpload (set by the probe):
        #: files up to 5 GiB then go up in one conditional PutObject, larger ones are refused
        self.conditional_multipart = True
        #: False once the store refused DeleteObjects (then one DeleteObject per object)
        self.batch_delete = True
        #: large files go up in parts (conditionally completed)
        self.multipart = MultipartUpload(self.s3, self.part_size)

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        """The pause before retry ``attempt`` (:meth:`S3Client.backoff`)."""
        return self.s3.backoff(attempt, retry_after)

    def close(self) -> None:
        self.s3.close()

    # ------------------------------------------------------------------ the store's capabilities

    def _unsupported(self, what: str) -> HubError:
        return HubError(
            f"{self.url} ({self.endpoint_url}) does not honour conditional writes: {what}. The s3:// hub needs a store "
            "that supports PutObject with 'If-None-Match: *' (create only if absent) and 'If-Match: <etag>' (replace "
            "only if unchanged), answering 412 Precondition Failed when the condition does not hold (e.g. AWS S3, "
            "recent MinIO, Cloudflare R2); without them deltas could be overwritten and two masters could both "
            "publish. Use such a store, or a folder or hf:// hub"
        )

    def check_conditional_writes(self, scratch_dir: str) -> None:
        """Raise ``HubError`` unless the store honours ``If-None-Match`` and ``If-Match`` on
        PutObject; set :attr:`conditional_multipart`. Works on a scratch object
        ``<scratch_dir>/.probe-dl-<host>-<pid>-<random>`` (owner-tagged: what a process killed
        during the probe leaves, object or multipart upload, is swept: :meth:`sweep_probes`),
        removed afterwards."""
        key = self.key(f"{scratch_dir}/{PROBE_PREFIX}{owner_tag()}{uuid.uuid4().hex}")

        def refused(header: str, **cond: str) -> bool:
            """Whether a PutObject with ``cond`` was refused with 412; other refusals: unsupported."""
            try:
                self.call("probe conditional writes", self.client.put_object, Bucket=self.bucket, Key=key, Body=b"1",
                          **cond)
            except Precondition:
                return True
            except (HubAuthError, HubNotFoundError, HubUnavailableError):
                raise
            except HubError as e:
                raise self._unsupported(f"a PutObject with '{header}' was refused ({e})") from None
            return False

        created = False
        try:
            if refused("If-None-Match: *", IfNoneMatch="*"):
                raise self._unsupported("a PutObject with 'If-None-Match: *' on a new object was refused with 412")
            created = True
            if not refused("If-None-Match: *", IfNoneMatch="*"):
                raise self._unsupported("a second PutObject with 'If-None-Match: *' on an existing object succeeded")
            if not refused("If-Match", IfMatch='"' + "0" * 32 + '"'):
                raise self._unsupported("a PutObject with 'If-Match: <another etag>' succeeded")
            self.conditional_multipart = self.multipart.probe(key)
        finally:
            if created:
                with contextlib.suppress(Exception):
                    self.client.delete_object(Bucket=self.bucket, Key=key)

    # ------------------------------------------------------------------ small objects with compare-and-swap

    def read_small(self, path: str) -> tuple[bytes | None, str | None]:
        """The bytes and ETag of a small object (at most 16 MiB), or (None, None) if absent. A larger
        object is not read: its stand-in is a :class:`TooLarge` (its ETag the object's)."""

        def get() -> tuple[bytes, str | None]:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key(path))
            with contextlib.closing(r["Body"]) as body:
                size = int(r.get("ContentLength") or 0)
                if size > SMALL_LIMIT:
                    return TooLarge(path, self.url, size, r.get("ETag")), r.get("ETag")
                data = body.read(SMALL_LIMIT + 1)
            if len(data) != size:
                raise Transient(f"read of {path} returned {len(data)} of {size} bytes")
            return data, r.get("ETag")

        try:
            return self.call(f"read {path}", get)
        except Missing:
            return None, None

    def cas_put(self, path: str, data: bytes, expected_etag: str | None) -> str | None:
        """Write ``data`` as ``path`` iff the object's ETag is still ``expected_etag`` (None: iff
        it is absent); return the new ETag. Raises ``Precondition`` (with the bytes now there) if
        the object changed, unless it now holds exactly ``data`` (this write landed, its answer was lost)."""
        cond = {"IfMatch": expected_etag} if expected_etag else {"IfNoneMatch": "*"}
        try:
            r = self.call(f"write {path}", self.client.put_object, Bucket=self.bucket, Key=self.key(path), Body=data,
                          **cond)
            return r.get("ETag")
        except (Precondition, Missing) as e:  # 404: an If-Match on an object that was removed
            now, etag = self.read_small(path)
            if now == data:
                return etag
            raise Precondition(str(e), current=now) from None

    # ------------------------------------------------------------------ mirrors (replaced, never conditional)

    def swap(self, path: str, new: bytes, *, parse: Callable[[bytes | None], Any], target: Any, expected: Any,
             conflict: Callable[[Any], HubError], unreadable: str = "an unreadable document") -> None:
        """Replace the small object ``path`` by ``new`` (a conditional PUT on the ETag read: :meth:`cas_put`) iff
        what it holds (``parse(bytes or None)``) equals ``expected``, else raise ``conflict(what it holds)``
        (``unreadable`` when what another writer put there meanwhile does not parse); nothing to do when it
        holds ``target`` already (an earlier attempt of ours landed)."""
        data, etag = self.read_small(path)
        current = parse(data)
        if current == target and (target is not None or not data):
            return  # nothing to change (or an earlier attempt of ours landed)
        if current != expected:
            raise conflict(current)
        try:
            self.cas_put(path, new, etag)
        except Precondition as e:
            try:
                found: Any = parse(e.current)
            except ValueError:  # a ManifestError (a lease that does not parse)
                found = unreadable
            raise conflict(found) from None

    def put(self, path: str, src: str | os.PathLike | bytes, what: str) -> None:
        """Write ``path`` from bytes or a local file (at most 5 GiB), replacing what is there: only
        for the fixed-name mirrors, whose writer is the master holding the lease."""
        if isinstance(src, bytes):
            self.call(f"{what}: write {path}", self.client.put_object, Bucket=self.bucket, Key=self.key(path), Body=src)
            return
        local = Path(src)
        if local.stat().st_size > MAX_PUT:
            raise HubError(f"{what}: {local} is over the 5 GiB of one PutObject")

        def put() -> None:
            with open(local, "rb") as f:
                self.client.put_object(Bucket=self.bucket, Key=self.key(path), Body=f)

        self.call(f"{what}: write {path}", put)

    def copy(self, src: str, dest: str, what: str) -> None:
        """Copy the object ``src`` to ``dest`` on the store itself (nothing goes through this
        machine; multipart copy above boto3's threshold), replacing ``dest``."""
        self.call(
            f"{what}: copy {src} to {dest}", self.client.copy, {"Bucket": self.bucket, "Key": self.key(src)}, self.bucket,
            self.key(dest),
        )

    # ------------------------------------------------------------------ objects that never change

    def put_new(self, local_file: str | os.PathLike, path: str, what: str) -> bool:
        """Create ``path`` from ``local_file`` unless it exists. True if created (or the same bytes
        are there: an earlier attempt of ours), False if another file is there."""
        local = Path(local_file)
        if not local.is_file():
            raise FileNotFoundError(f"{what}: local file {local} does not exist")
        size = local.stat().st_size
        if size > self.multipart_threshold and (self.conditional_multipart or size > MAX_PUT):
            if not self.conditional_multipart:
                raise HubError(
                    f"{what}: {local} is {size} bytes, over the 5 GiB of one PutObject, and {self.endpoint_url} ignores "
                    "'If-None-Match' on multipart uploads, so it could overwrite an existing file; refused"
                )
            created = self.multipart.put(local, path, size, what)
        else:

            def put() -> None:
                with open(local, "rb") as f:
                    self.client.put_object(Bucket=self.bucket, Key=self.key(path), Body=f, IfNoneMatch="*")

            try:
                self.call(f"{what}: upload {path}", put)
                created = True
            except Precondition:
                created = False
        return created or self._same_file(path, local, size)

    def _same_file(self, path: str, local: Path, size: int) -> bool:
        """Whether ``path`` holds exactly the bytes of ``local``: the size, then the ETag where it is
        an MD5 (single upload) or a multipart MD5 with our part size, else the bytes themselves."""
        try:
            head = self.call(f"check {path}", self.client.head_object, Bucket=self.bucket, Key=self.key(path))
        except Missing:
            return False
        if int(head.get("ContentLength", -1)) != size:
            return False
        etag = str(head.get("ETag") or "").strip().removeprefix("W/").strip('"').lower()
        if _MD5_ETAG_RE.fullmatch(etag) and etag == _file_md5(local):
            return True
        if _MULTIPART_ETAG_RE.fullmatch(etag) and etag == multipart_etag(local, self.multipart.part_size_for(size)):
            return True
        try:  # an ETag that is not a plain or multipart MD5 of ours (SSE-KMS, another part size ...)
            return self.call(f"compare {path}", self._same_bytes, path, local)
        except Missing:
            return False

    def _same_bytes(self, path: str, local: Path) -> bool:
        r = self.client.get_object(Bucket=self.bucket, Key=self.key(path))
        with contextlib.closing(r["Body"]) as body, open(local, "rb") as f:
            while chunk := body.read(_CHUNK):
                if f.read(len(chunk)) != chunk:
                    return False  # stops at the first difference: a real conflict usually differs in the header
            return not f.read(1)

    # ------------------------------------------------------------------ litter of killed processes

    def sweep(self, scratch_dir: str, max_age: float) -> list[str]:
        """What killed processes left on the store: probe objects of ``scratch_dir`` and incomplete
        multipart uploads under the prefix. A probe's (its key carries its owner) goes when its
        process of this host is gone, or, of another host, once ``max_age`` old; any other
        incomplete upload (a delta's or a version's, cut short by ``kill -9``: invisible, but
        stored and billed) once initiated more than ``max_age`` ago. Returns what was removed."""
        now = time.time()
        removed: list[str] = []
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.key(f"{scratch_dir}/{PROBE_PREFIX}")}
        page = self.call(f"list {scratch_dir}/{PROBE_PREFIX}*", self.client.list_objects_v2, **kw)
        for obj in page.get("Contents") or []:
            key = str(obj.get("Key") or "")
            if is_dead_or_old(key.rsplit("/", 1)[-1], now - _age(obj.get("LastModified"), now), max_age, now):
                with contextlib.suppress(HubError):
                    self.call(f"delete {key}", self.client.delete_object, Bucket=self.bucket, Key=key)
                    removed.append(key[len(self.s3.root):])
        kw = {"Bucket": self.bucket, "Prefix": self.s3.root}
        while True:
            try:
                page = self.call("list incomplete multipart uploads", self.client.list_multipart_uploads, **kw)
            except HubError as e:  # a store without the call: nothing to sweep there
                log.debug("%s: cannot list multipart uploads: %s", self.url, e)
                break
            for up in page.get("Uploads") or []:
                key, upload_id = str(up.get("Key") or ""), up.get("UploadId")
                name = key.rsplit("/", 1)[-1]
                started = now - _age(up.get("Initiated"), now)
                stale = (is_dead_or_old(name, started, max_age, now) if name.startswith(PROBE_PREFIX)
                         else now - started > max_age)
                if stale and upload_id:
                    with contextlib.suppress(HubError):
                        self.call(f"abort the upload of {key}", self.client.abort_multipart_upload, Bucket=self.bucket,
                                  Key=key, UploadId=upload_id)
                        removed.append(f"{key[len(self.s3.root):]} (incomplete upload)")
            if not page.get("IsTruncated"):
                break
            kw["KeyMarker"], kw["UploadIdMarker"] = page.get("NextKeyMarker"), page.get("NextUploadIdMarker")
            if not kw["KeyMarker"]:
                break
        return removed

    # ------------------------------------------------------------------ listing, reading, deleting

    def list(self, folder: str, *, recursive: bool) -> list[tuple[str, int | None, str | None]]:
        """``(path, size, ETag)`` of the objects under ``folder/`` (only those directly in it unless
        ``recursive``). The ETag is an object's version token: it changes whenever the object does."""
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.key(folder + "/"), "MaxKeys": self.list_page_size}
        if not recursive:
            kw["Delimiter"] = "/"
        out: list[tuple[str, int | None, str | None]] = []
        while True:
            page = self.call(f"list {folder}/", self.client.list_objects_v2, **kw)
            for obj in page.get("Contents") or []:
                key, size = obj.get("Key"), obj.get("Size")
                if isinstance(key, str) and key.startswith(self.s3.root):
                    out.append((key[len(self.s3.root):], size if isinstance(size, int) else None, obj.get("ETag")))
            if not page.get("IsTruncated"):
                return out
            if not page.get("NextContinuationToken"):
                raise HubError(f"list {folder}/ on {self.url}: a truncated page without a continuation token")
            kw["ContinuationToken"] = page["NextContinuationToken"]

    def fetch(self, path: str, dest: Path, max_bytes: int | None = None) -> None:
        """Stream ``path`` into ``dest`` (temporary file + ``os.replace``, length checked); retried.
        A file larger than ``max_bytes`` is refused before its body is read (``HubFileTooLargeError``)."""

        def get() -> None:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key(path))
            expected, n = r.get("ContentLength"), 0
            if max_bytes is not None and expected is not None and int(expected) > max_bytes:
                with contextlib.suppress(Exception):
                    r["Body"].close()
                raise HubFileTooLargeError(f"{path} is {expected} bytes, more than the {max_bytes} allowed (not downloaded)")
            with contextlib.closing(r["Body"]) as body, atomic_path(dest) as tmp:
                with open(tmp, "wb") as f:
                    while chunk := body.read(_CHUNK):
                        n += len(chunk)
                        if max_bytes is not None and n > max_bytes:
                            raise HubFileTooLargeError(f"{path} is more than the {max_bytes} bytes allowed (download stopped)")
                        f.write(chunk)
                if expected is not None and n != int(expected):
                    raise Transient(f"download of {path} truncated: {n} of {expected} bytes")

        self.call(f"download {path}", get)

    def delete(self, path: str) -> None:
        """Remove ``path``; an absent object is not an error."""
        with contextlib.suppress(Missing):
            self.call(f"delete {path}", self.client.delete_object, Bucket=self.bucket, Key=self.key(path))

    def delete_many(self, paths: List[str]) -> None:  # noqa: UP006 - ``list`` is a method of this class
        """Remove ``paths`` (absent objects are no error) with one ``DeleteObjects`` request per 1000 of
        them instead of one ``DeleteObject`` each (a round of N deltas: one request, not N). A store
        without ``DeleteObjects`` (Google Cloud Storage's XML API) gets one request per object from then
        on. Raises ``HubError`` naming what could not be removed."""
        failed: List[str] = []  # noqa: UP006 - ``list`` is a method of this class
        for i in range(0, len(paths), _DELETE_BATCH):
            batch = paths[i : i + _DELETE_BATCH]
            if self.batch_delete and len(batch) > 1:
                try:
                    r = self.call(f"delete {len(batch)} objects", self.client.delete_objects, Bucket=self.bucket,
                                  Delete={"Objects": [{"Key": self.key(p)} for p in batch], "Quiet": True})
                except (HubAuthError, HubUnavailableError):
                    raise
                except HubError as e:  # NotImplemented, MalformedXML ...: this store deletes one object at a time
                    log.warning("%s (%s): DeleteObjects refused (%s); deleting one object per request", self.url,
                                self.endpoint_url, e)
                    self.batch_delete = False
                else:
                    errors = [e for e in r.get("Errors") or [] if e.get("Code") != "NoSuchKey"]
                    failed += [f"{str(e.get('Key', ''))[len(self.s3.root):]} ({e.get('Code')})" for e in errors]
                    continue
            for path in batch:
                try:
                    self.delete(path)
                except HubError as e:
                    failed.append(f"{path} ({e})")
        if failed:
            raise HubError(f"could not delete {len(failed)} object(s) from {self.url}: {', '.join(failed[:5])}"
                           + (" ..." if len(failed) > 5 else ""))


def _age(when: Any, now: float) -> float:
    """Seconds since an S3 timestamp (a datetime; 0 when the store gave none)."""
    try:
        return max(0.0, now - float(when.timestamp()))
    except (AttributeError, TypeError, ValueError, OverflowError):
        return 0.0


def _file_md5(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
