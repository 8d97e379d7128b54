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

import concurrent.futures
import contextlib
import hashlib
import logging
import math
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any, List

from diloco_lightning.util import faults
from diloco_lightning.util.fileio import UnreadDocument, atomic_path, is_dead_or_old, owner_tag
from diloco_lightning.hub.base import HubAuthError, HubError, HubFileTooLargeError, HubNotFoundError, HubUnavailableError
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


class S3Store(S3Client):
    """Objects under ``s3://bucket/prefix``, addressed by their path below the prefix. Thread-safe
    (one boto3 client, which is). See the module docstring; the options are ``S3Hub``'s."""

    #: keys per ListObjectsV2 page (S3's maximum; tests lower it to exercise pagination)
    list_page_size = 1000

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
            self.conditional_multipart = self._probe_multipart(key)
        finally:
            if created:
                with contextlib.suppress(Exception):
                    self.client.delete_object(Bucket=self.bucket, Key=key)

    def _probe_multipart(self, key: str) -> bool:
        upload_id = self._mpu_start(key, "probe multipart")
        try:
            part = self._mpu_part(key, upload_id, 1, b"4", "probe multipart")
            faults.point("s3.probing")  # crash tests: a killed probe leaves its object and this upload
            self._mpu_complete(key, upload_id, [part], "probe multipart")
        except Precondition:
            return True
        except (HubAuthError, HubNotFoundError, HubUnavailableError):
            raise
        except HubError as e:
            reason = str(e)
        else:
            reason = "it completed over an existing object"
        finally:
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        log.warning(
            "%s (%s): CompleteMultipartUpload ignores 'If-None-Match: *' (%s); files up to 5 GiB go up in one "
            "conditional PutObject, larger ones are refused", self.url, self.endpoint_url, reason,
        )
        return False

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
            created = self._put_multipart(local, path, size, what)
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

    def _part_size_for(self, size: int) -> int:
        return max(self.part_size, math.ceil(math.ceil(size / _MAX_PARTS) / MiB) * MiB)

    def _mpu_start(self, key: str, what: str) -> str:
        extra = {"ChecksumAlgorithm": "CRC32"} if self._part_checksums else {}
        return self.call(what, self.client.create_multipart_upload, Bucket=self.bucket, Key=key, **extra)["UploadId"]

    def _mpu_part(self, key: str, upload_id: str, number: int, body: bytes, what: str) -> dict:
        extra = {"ChecksumAlgorithm": "CRC32"} if self._part_checksums else {}
        r = self.call(what, self.client.upload_part, Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number,
                      Body=body, **extra)
        part = {"ETag": r["ETag"], "PartNumber": number}
        if r.get("ChecksumCRC32"):
            part["ChecksumCRC32"] = r["ChecksumCRC32"]
        return part

    def _mpu_complete(self, key: str, upload_id: str, parts: list[dict], what: str) -> None:
        """Complete with ``If-None-Match: *``: the object appears only if nothing is there."""
        self.call(what, self.client.complete_multipart_upload, Bucket=self.bucket, Key=key, UploadId=upload_id,
                  MultipartUpload={"Parts": parts}, IfNoneMatch="*")

    def _put_multipart(self, local: Path, path: str, size: int, what: str) -> bool:
        key, part_size = self.key(path), self._part_size_for(size)
        n_parts = math.ceil(size / part_size)
        upload_id = self._mpu_start(key, f"{what}: start {path}")
        done = False

        def send(number: int) -> dict:
            with open(local, "rb") as f:
                f.seek((number - 1) * part_size)
                chunk = f.read(part_size)
            return self._mpu_part(key, upload_id, number, chunk, f"{what}: part {number}/{n_parts} of {path}")

        try:
            with concurrent.futures.ThreadPoolExecutor(min(_PART_CONCURRENCY, n_parts), "diloco-s3-part") as pool:
                futures = [pool.submit(send, i) for i in range(1, n_parts + 1)]
                try:
                    parts = [f.result() for f in futures]
                except BaseException:
                    for f in futures:
                        f.cancel()
                    raise
            try:
                self._mpu_complete(key, upload_id, parts, f"{what}: complete {path}")
                done = True
                return True
            except (Precondition, Missing):  # 404 NoSuchUpload: a completion whose answer was lost
                return False
        finally:
            if not done:
                with contextlib.suppress(Exception):
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)

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
        if _MULTIPART_ETAG_RE.fullmatch(etag) and etag == _multipart_etag(local, self._part_size_for(size)):
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
                    removed.append(key[len(self._root):])
        kw = {"Bucket": self.bucket, "Prefix": self._root}
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
                        removed.append(f"{key[len(self._root):]} (incomplete upload)")
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
                if isinstance(key, str) and key.startswith(self._root):
                    out.append((key[len(self._root):], size if isinstance(size, int) else None, obj.get("ETag")))
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
                    failed += [f"{str(e.get('Key', ''))[len(self._root):]} ({e.get('Code')})" for e in errors]
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


def _multipart_etag(path: Path, part_size: int) -> str:
    """The ETag S3 gives a multipart upload of ``path`` in ``part_size`` parts: MD5 of the parts' MD5s, ``-N``."""
    digests = []
    with open(path, "rb") as f:
        while True:
            part = hashlib.md5(usedforsecurity=False)
            left = part_size
            while left > 0 and (chunk := f.read(min(_CHUNK, left))):
                part.update(chunk)
                left -= len(chunk)
            if left == part_size:
                break
            digests.append(part.digest())
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"
