"""The boto3 client of one ``s3://bucket/prefix``: its options, retried requests, errors mapped.

:class:`S3Client` is the part of :class:`~diloco_lightning.hub.s3_store.S3Store` (the conditional
writes, multipart uploads, listing and deletion the hub needs) that talks to S3: it parses the URL,
checks the options, makes one boto3 client (thread-safe, in a session of its own) and runs every
request through :meth:`S3Client.call`.

Requests: only 5xx (but 501), 408/429, ``SlowDown`` and other throttling codes, 409
``ConditionalRequestConflict`` (S3 under concurrent conditional writes), timeouts, connection
errors, short reads and checksum mismatches are retried, with jittered exponential backoff
``min(retry_max_delay, retry_base_delay * 2**n)`` scaled by a uniform 50-100 %. botocore's own
retries are switched off (``total_max_attempts=1``): they would multiply ours. 403 and
credential errors become ``HubAuthError`` (saying what to check, never the credentials),
``NoSuchBucket`` ``HubNotFoundError``, 404 on an object ``Missing``, 412 ``Precondition``.
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import time
from collections.abc import Callable
from typing import Any

from diloco_lightning.util.errors import DiLoCoError
from diloco_lightning.hub.base import HubAuthError, HubError, HubNotFoundError, HubUnavailableError

log = logging.getLogger(__name__)

__all__ = ["S3Client", "Precondition", "Missing", "Transient", "HubUnavailableError", "parse_s3_url"]

MiB = 1 << 20
MAX_PUT = 5 << 30  # the largest single PutObject S3 accepts
MIN_PART = 5 * MiB  # the smallest part S3 accepts (all but the last)
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
ADDRESSING_STYLES = ("auto", "path", "virtual")


class Transient(DiLoCoError):
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


class S3Client:
    """Requests to the objects under ``s3://bucket/prefix``, addressed by their path below the prefix.
    Thread-safe (one boto3 client, which is). See the module docstring; the options are ``S3Hub``'s."""

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
        #: the keys' common beginning (the prefix and a "/", or nothing)
        self.root = f"{self.prefix}/" if self.prefix else ""
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
        #: whether boto3 computes a checksum of every part (else the store's uploads send their MD5)
        self.part_checksums = getattr(self.client.meta.config, "request_checksum_calculation", None) != "when_required"

    def key(self, path: str) -> str:
        return self.root + path

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
            except Transient as e:
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
                    f"{self.bucket}/{self.root}*")
            return HubAuthError(f"{where}: HTTP {status}, not authorized ({detail}); {hint}")
        if status == 404 or code in ("NoSuchKey", "NoSuchUpload", "NotFound"):
            return Missing(f"{where}: not found ({detail})")
        if status == 301 or code in ("PermanentRedirect", "AuthorizationHeaderMalformed"):
            return HubError(f"{where}: HTTP {status} ({detail}); the bucket is probably in another region: pass region=")
        return HubError(f"{where} failed: HTTP {status} ({detail})")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
