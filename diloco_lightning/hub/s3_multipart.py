"""Multipart uploads of the S3 store (:class:`~diloco_lightning.hub.s3_store.S3Store`): a large file goes
up in parts, at most four in memory at once, and the object appears only when the completion's
``If-None-Match: *`` holds, so a delta is never overwritten; an upload that fails is aborted."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import logging
import math
from pathlib import Path

from diloco_lightning.util import faults
from diloco_lightning.hub.base import HubAuthError, HubError, HubNotFoundError, HubUnavailableError
from diloco_lightning.hub.s3_client import Missing, MiB, Precondition, S3Client

log = logging.getLogger(__name__)

__all__ = ["MultipartUpload", "multipart_etag"]

_MAX_PARTS = 10_000
_PART_CONCURRENCY = 4
_CHUNK = 8 * MiB


class MultipartUpload:
    """Multipart uploads through ``s3`` in parts of ``part_size`` bytes (raised for a file that would need
    more than 10,000)."""

    def __init__(self, s3: S3Client, part_size: int) -> None:
        self.s3 = s3
        self.part_size = part_size

    def part_size_for(self, size: int) -> int:
        """The part size for a file of ``size`` bytes: ``part_size``, raised so that it takes at most 10,000 parts."""
        return max(self.part_size, math.ceil(math.ceil(size / _MAX_PARTS) / MiB) * MiB)

    def start(self, key: str, what: str) -> str:
        extra = {"ChecksumAlgorithm": "CRC32"} if self.s3.part_checksums else {}
        return self.s3.call(what, self.s3.client.create_multipart_upload, Bucket=self.s3.bucket, Key=key, **extra)["UploadId"]

    def part(self, key: str, upload_id: str, number: int, body: bytes, what: str) -> dict:
        extra = {"ChecksumAlgorithm": "CRC32"} if self.s3.part_checksums else {}
        r = self.s3.call(what, self.s3.client.upload_part, Bucket=self.s3.bucket, Key=key, UploadId=upload_id, PartNumber=number,
                      Body=body, **extra)
        part = {"ETag": r["ETag"], "PartNumber": number}
        if r.get("ChecksumCRC32"):
            part["ChecksumCRC32"] = r["ChecksumCRC32"]
        return part

    def complete(self, key: str, upload_id: str, parts: list[dict], what: str) -> None:
        """Complete with ``If-None-Match: *``: the object appears only if nothing is there."""
        self.s3.call(what, self.s3.client.complete_multipart_upload, Bucket=self.s3.bucket, Key=key, UploadId=upload_id,
                  MultipartUpload={"Parts": parts}, IfNoneMatch="*")

    def probe(self, key: str) -> bool:
        """Whether the store honours ``If-None-Match: *`` on CompleteMultipartUpload, tried on the existing
        object ``key`` (the conditional-write probe's scratch object); a warning says what follows if not."""
        upload_id = self.start(key, "probe multipart")
        try:
            part = self.part(key, upload_id, 1, b"4", "probe multipart")
            faults.point("s3.probing")  # crash tests: a killed probe leaves its object and this upload
            self.complete(key, upload_id, [part], "probe multipart")
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
                self.s3.client.abort_multipart_upload(Bucket=self.s3.bucket, Key=key, UploadId=upload_id)
        log.warning(
            "%s (%s): CompleteMultipartUpload ignores 'If-None-Match: *' (%s); files up to 5 GiB go up in one "
            "conditional PutObject, larger ones are refused", self.s3.url, self.s3.endpoint_url, reason,
        )
        return False

    def put(self, local: Path, path: str, size: int, what: str) -> bool:
        """Upload ``local`` as ``path`` in parts, completed with ``If-None-Match: *``: True if it created the
        object, False if one was there (or the completion's answer was lost: the caller compares)."""
        key, part_size = self.s3.key(path), self.part_size_for(size)
        n_parts = math.ceil(size / part_size)
        upload_id = self.start(key, f"{what}: start {path}")
        done = False

        def send(number: int) -> dict:
            with open(local, "rb") as f:
                f.seek((number - 1) * part_size)
                chunk = f.read(part_size)
            return self.part(key, upload_id, number, chunk, f"{what}: part {number}/{n_parts} of {path}")

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
                self.complete(key, upload_id, parts, f"{what}: complete {path}")
                done = True
                return True
            except (Precondition, Missing):  # 404 NoSuchUpload: a completion whose answer was lost
                return False
        finally:
            if not done:
                with contextlib.suppress(Exception):
                    self.s3.client.abort_multipart_upload(Bucket=self.s3.bucket, Key=key, UploadId=upload_id)


def multipart_etag(path: Path, part_size: int) -> str:
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
