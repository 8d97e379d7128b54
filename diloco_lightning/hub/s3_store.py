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

Requests: only 5xx (but 501), 408/429, ``SlowDown`` and other throttling codes, 409
``ConditionalRequestConflict`` (S3 under concurrent conditional writes), timeouts, connection
errors, short reads and checksum mismatches are retried, with jittered exponential backoff
``min(retry_max_delay, retry_base_delay * 2**n)`` scaled by a uniform 50-100 %. botocore's own
retries are switched off (``total_max_attempts=1``): they would multiply ours. 403 and
credential errors become ``HubAuthError`` (saying what to check, never the credentials),
``NoSuchBucket`` ``HubNotFoundError``, 404 on an object ``Missing``, 412 ``Precondition``.

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
import random
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, List

from diloco_lightning.fileio import atomic_path
from diloco_lightning.hub.base import HubAuthError, HubError, HubFileTooLargeError, HubNotFoundError, HubUnavailableError

log = logging.getLogger(__name__)

__all__ = ["S3Store", "Precondition", "Missing", "HubUnavailableError", "parse_s3_url"]

MiB = 1 << 20
MAX_PUT = 5 << 30  # the largest single PutObject S3 accepts
MIN_PART = 5 * MiB  # the smallest part S3 accepts (all but the last)
_MAX_PARTS = 10_000
_PART_CONCURRENCY = 4
_DELETE_BATCH = 1000  # the most keys one DeleteObjects takes
SMALL_LIMIT = 16 * MiB  # a "small" object (manifest, lease) above this is refused, never read into memory
_CHUNK = 8 * MiB
_RETRY_STATUS = frozenset({408, 429}) | (frozenset(range(500, 600)) - {501})  # 501 NotImplemented is final
_RETRY_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled", "TooManyRequests",
    "TooManyRequestsException", "RequestLimitExceeded", "BandwidthLimitExceeded", "RequestTimeout",
    "RequestTimeoutException", "InternalError", "ServiceUnavailable", "ConditionalRequestConflict", "OperationAborted",
})
_AUTH_CODES = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired",
    "AllAccessDisabled", "AccountProblem", "InvalidSecurity", "RequestTimeTooSkewed", "InvalidClientTokenId",
})
_BUCKET_RE = re.compile(r"(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._-]{1,253}[A-Za-z0-9]")
_PREFIX_PART_RE = re.compile(r"(?!\.{1,2}$)[A-Za-z0-9._=+-]{1,255}")
_MD5_ETAG_RE = re.compile(r"[0-9a-f]{32}")
_MULTIPART_ETAG_RE = re.compile(r"[0-9a-f]{32}-[0-9]+")
ADDRESSING_STYLES = ("auto", "path", "virtual")


class _Transient(Exception):
    """A retryable failure seen by our own checks (a short read)."""


class Precondition(HubError):
    """412 on a conditional write: the object is not in the state the write required.
    ``current``: the object's bytes read back after the refusal (``cas_put``), else None."""

    def __init__(self, msg: str, current: bytes | None = None) -> None:
        super().__init__(msg)
        self.current = current


class Missing(HubNotFoundError):
    """404 on an object (or a multipart upload id) of an existing bucket."""


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket[/prefix]`` -> ``(bucket, prefix)`` (prefix without slashes at either end)."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ValueError(f"not an S3 URL: {url!r}; expected s3://bucket/prefix")
    rest = url[len("s3://"):]
    if any(c in rest for c in "?#\\") or any(ord(c) < 0x21 or ord(c) > 0x7E for c in rest):
        raise ValueError(
            f"S3 URL {url!r}: no query, fragment, spaces or non-ASCII characters; expected s3://bucket/prefix"
        )
    bucket, _, prefix = rest.partition("/")
    if _BUCKET_RE.fullmatch(bucket) is None:
        raise ValueError(f"S3 URL {url!r}: invalid bucket name {bucket!r} (3-255 characters of [A-Za-z0-9._-])")
    prefix = prefix.strip("/")
    if prefix and not all(_PREFIX_PART_RE.fullmatch(p) for p in prefix.split("/")):
        raise ValueError(
            f"S3 URL {url!r}: invalid prefix {prefix!r}: folders of [A-Za-z0-9._=+-], no empty, '.' or '..' parts"
        )
    return bucket, prefix


class S3Store:
    """Objects under ``s3://bucket/prefix``, addressed by their path below the prefix. Thread-safe
    (one boto3 client, which is). See the module docstring; the options are ``S3Hub``'s."""

    #: keys per ListObjectsV2 page (S3's maximum; tests lower it to exercise pagination)
    list_page_size = 1000

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        addressing_style: str | None = None,
        max_retries: int | None = None,
        retry_base_delay: float | None = None,
        retry_max_delay: float | None = None,
        timeout: float | None = 60.0,
        multipart_threshold: int | None = None,
        part_size: int | None = None,
    ) -> None:
        try:
            import boto3
            import botocore
            from botocore.config import Config
        except ImportError:
            raise HubError(
                "the s3:// hub needs boto3: pip install 'diloco-lightning[s3]' (or pip install boto3)"
            ) from None
        if not isinstance(bucket, str) or "/" in bucket:
            raise ValueError(f"S3 hub: bucket must be a bucket name (no '/'), got {bucket!r}")
        self.bucket, self.prefix = parse_s3_url(f"s3://{bucket}/{prefix or ''}")
        self.url = f"s3://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self._root = f"{self.prefix}/" if self.prefix else ""
        if endpoint_url is not None and not re.match(r"https?://[^/\s]+", str(endpoint_url)):
            raise ValueError(f"S3 hub: endpoint_url {endpoint_url!r} must be an http:// or https:// URL")
        if addressing_style is not None and addressing_style not in ADDRESSING_STYLES:
            raise ValueError(f"S3 hub: addressing_style must be one of {ADDRESSING_STYLES}, got {addressing_style!r}")
        self.max_retries = 5 if max_retries is None else int(max_retries)
        self.retry_base_delay = 0.5 if retry_base_delay is None else float(retry_base_delay)
        self.retry_max_delay = 30.0 if retry_max_delay is None else float(retry_max_delay)
        if self.max_retries < 0 or self.retry_base_delay < 0 or self.retry_max_delay < 0:
            raise ValueError("S3 hub: max_retries, retry_base_delay and retry_max_delay must be >= 0")
        if timeout is not None and not float(timeout) > 0:
            raise ValueError(f"S3 hub: timeout must be a positive number of seconds, got {timeout!r}")
        self.multipart_threshold = 64 * MiB if multipart_threshold is None else int(multipart_threshold)
        self.part_size = 32 * MiB if part_size is None else int(part_size)
        if self.multipart_threshold < 0:
            raise ValueError(f"S3 hub: multipart_threshold must be >= 0, got {multipart_threshold!r}")
        if not MIN_PART <= self.part_size <= MAX_PUT:
            raise ValueError(f"S3 hub: part_size must be between 5 MiB and 5 GiB (S3's limits), got {part_size!r}")
        config = Config(
            retries={"total_max_attempts": 1, "mode": "standard"},  # every retry is ours (see call)
            connect_timeout=None if timeout is None else float(timeout),
            read_timeout=None if timeout is None else float(timeout),
            max_pool_connections=32,
            s3={"addressing_style": addressing_style} if addressing_style else None,
            user_agent_extra="diloco_lightning",
        )
        # a session of its own: boto3's default session is not thread-safe (the client is)
        self._session = boto3.session.Session(region_name=region)
        self.client = self._session.client("s3", endpoint_url=endpoint_url, config=config)
        self.endpoint_url = self.client.meta.endpoint_url
        put_args = self.client.meta.service_model.operation_model("PutObject").input_shape.members
        if "IfMatch" not in put_args or "IfNoneMatch" not in put_args:
            raise HubError(
                f"the s3:// hub needs boto3 >= 1.36 (conditional writes); this is botocore {botocore.__version__}"
            )
        self._part_checksums = getattr(self.client.meta.config, "request_checksum_calculation", None) != "when_required"
        #: False when the store ignores If-None-Match on CompleteMultipartUpload (set by the probe):
        #: files up to 5 GiB then go up in one conditional PutObject, larger ones are refused
        self.conditional_multipart = True
        #: False once the store refused DeleteObjects (then one DeleteObject per object)
        self.batch_delete = True

    def key(self, path: str) -> str:
        return self._root + path

    # ------------------------------------------------------------------ requests, retries, errors

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        d = min(self.retry_max_delay, self.retry_base_delay * (2 ** (attempt - 1)))
        d *= 0.5 + 0.5 * random.random()
        if retry_after is not None:
            d = max(d, min(retry_after, self.retry_max_delay))
        return d

    def _scrub(self, text: str) -> str:
        """``text`` without any part of the credentials (defence in depth: S3 messages hold none)."""
        with contextlib.suppress(Exception):
            creds = self._session.get_credentials()  # resolved (and cached) when the client was made
            if creds is not None:
                frozen = creds.get_frozen_credentials()
                for secret in (frozen.secret_key, frozen.token, frozen.access_key):
                    if secret:
                        text = text.replace(secret, "<redacted>")
        return text

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one request (or the read of one streamed answer); retry only what a retry can fix."""
        from botocore import exceptions as bx

        attempt = 0
        while True:
            retry_after = None
            try:
                return fn(*args, **kwargs)
            except _Transient as e:
                reason = str(e)
            except bx.ClientError as e:
                err = e.response.get("Error", {}) or {}
                meta = e.response.get("ResponseMetadata", {}) or {}
                status, code = meta.get("HTTPStatusCode"), str(err.get("Code") or "")
                if status not in _RETRY_STATUS and code not in _RETRY_CODES:
                    raise self._map_error(what, status, code, str(err.get("Message") or "")) from e
                reason = f"HTTP {status} {code}".strip()
                value = str((meta.get("HTTPHeaders") or {}).get("retry-after") or "").strip()
                retry_after = float(value) if value.isdigit() else None
            except (bx.NoCredentialsError, bx.PartialCredentialsError, bx.CredentialRetrievalError) as e:
                raise HubAuthError(
                    f"{what} on {self.url}: no usable AWS credentials ({type(e).__name__}). Set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run where an instance/container role applies"
                ) from None
            except bx.SSLError as e:
                raise HubError(
                    f"{what} on {self.url} ({self.endpoint_url}): TLS error: {self._scrub(str(e))}; for a private "
                    "certificate authority set AWS_CA_BUNDLE"
                ) from e
            except (bx.HTTPClientError, bx.ConnectionError, bx.IncompleteReadError, bx.FlexibleChecksumError,
                    bx.ChecksumError) as e:
                reason = f"{type(e).__name__}: {e}"
            attempt += 1
            reason = self._scrub(reason)
            if attempt > self.max_retries:
                raise HubUnavailableError(
                    f"{what} on {self.url} ({self.endpoint_url}) failed after {attempt} attempt(s): {reason}"
                )
            delay = self.backoff(attempt, retry_after)
            log.warning("%s on %s: %s; retry %d/%d in %.2fs", what, self.url, reason, attempt, self.max_retries, delay)
            time.sleep(delay)

    def _map_error(self, what: str, status: int | None, code: str, message: str) -> HubError:
        detail = self._scrub(f"{code}: {message}" if message else code)[:300]
        where = f"{what} on {self.url} ({self.endpoint_url})"
        if status == 412 or code == "PreconditionFailed":
            return Precondition(f"{where}: precondition failed ({detail})")
        if code == "NoSuchBucket":
            return HubNotFoundError(f"{where}: bucket {self.bucket!r} does not exist (create it first, or check the "
                                    "URL, endpoint_url and region)")
        if status in (401, 403) or code in _AUTH_CODES:
            hint = ("the machine's clock is off; fix the time" if code == "RequestTimeTooSkewed" else
                    "check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the role): they "
                    "must be valid and allow s3:GetObject, s3:PutObject, s3:DeleteObject and s3:ListBucket on "
                    f"{self.bucket}/{self._root}*")
            return HubAuthError(f"{where}: HTTP {status}, not authorized ({detail}); {hint}")
        if status == 404 or code in ("NoSuchKey", "NoSuchUpload", "NotFound"):
            return Missing(f"{where}: not found ({detail})")
        if status == 301 or code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
            return HubError(f"{where}: HTTP {status} ({detail}); the bucket is probably in another region: pass region=")
        return HubError(f"{where} failed: HTTP {status} ({detail})")

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
        ``<scratch_dir>/.probe-<random>``, removed afterwards."""
        key = self.key(f"{scratch_dir}/.probe-{uuid.uuid4().hex}")

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
        """The bytes and ETag of a small object (at most 16 MiB), or (None, None) if absent."""

        def get() -> tuple[bytes, str | None]:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key(path))
            with contextlib.closing(r["Body"]) as body:
                size = int(r.get("ContentLength") or 0)
                if size > SMALL_LIMIT:
                    raise HubError(f"{path} on {self.url} is {size} bytes; refusing to read more than {SMALL_LIMIT}")
                data = body.read(SMALL_LIMIT + 1)
            if len(data) != size:
                raise _Transient(f"read of {path} returned {len(data)} of {size} bytes")
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
                    raise _Transient(f"download of {path} truncated: {n} of {expected} bytes")

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

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


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
