"""HTTP plumbing of the Hugging Face Hub transport (``diloco_lightning.hub.hf``): one call,
retried or mapped to the hub's errors, and the requests that read or commit at a known head.

Errors: 401/403 -> ``HubAuthError`` (the message says to check the token, never shows
it), 404 -> ``HubNotFoundError``, 409/412 -> the CAS conflict of the operation. Only
429, 5xx, timeouts and connection errors are retried, with jittered exponential backoff
(``max_retries``, ``retry_base_delay``, ``retry_max_delay``); nothing else is.

``huggingface_hub``'s own retries are kept from multiplying ours by a guard on its shared HTTP
client: :mod:`diloco_lightning.hub.hf_guard`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import re
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from diloco_lightning.util.fileio import temp_prefix
from diloco_lightning.hub.base import (
    HubAuthError,
    HubError,
    HubFileTooLargeError,
    HubNotFoundError,
    HubUnavailableError,
)
from diloco_lightning.hub.hf_guard import GUARD, RETRY_STATUS, GuardOptions, TransientError, ensure_guard, plain_transient_types
from diloco_lightning.hub.hf_stream import iter_body, read_capped, stream_get
from diloco_lightning.hub.pacing import CommitBudget
from diloco_lightning.hub.pacing import retry_after as asked_wait
from diloco_lightning.wire.manifest import MAX_MANIFEST_BYTES
from diloco_lightning.wire.names import validate_hub_path

log = logging.getLogger(__name__)

__all__ = ["COMMIT_RE", "EntryMissing", "HFRequests", "HubUnavailableError", "Precondition"]

COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_CHUNK = 8 << 20
#: a hub document (manifest, lease, claim) is read up to one byte past the largest one, the manifest:
#: a larger file is refused by its size, its first bytes standing for it, never read whole
SMALL_READ_LIMIT = MAX_MANIFEST_BYTES + 1

class EntryMissing(HubNotFoundError):
    """404 on a file or folder of an existing repository; ``commit`` is the revision's head if the Hub said."""

    def __init__(self, msg: str, commit: str | None = None) -> None:
        super().__init__(msg)
        self.commit = commit


class Precondition(HubError):
    """409/412 on a commit: the branch head is not the ``parent_commit`` we gave."""


def _git_blob_sha1(path: str | os.PathLike) -> str:
    size = os.path.getsize(path)
    h = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _norm_etag(value: str | None) -> str | None:
    if not value:
        return None
    value = value.strip()
    value = value.removeprefix("W/")
    return value.strip('"').lower() or None



# ----------------------------------------------------------------------------- requests of one repository


class HFRequests:
    """The requests to one Hugging Face repository (held by :class:`~diloco_lightning.hub.hf.HFHub` as
    ``http``): each call retried or mapped to the hub's errors (module docstring), the repository's
    creation (or check) before the first write, reads at a known head and commits with
    ``parent_commit`` within the repository's :class:`~diloco_lightning.hub.pacing.CommitBudget`.

    ``create``: create the repository if missing (``private=`` for a new one); False: check that it
    exists; None: neither (no request). Done at open when the Hub answers, else before the first
    write (:meth:`ensure_open`): an outage is never a reason to exit."""

    def __init__(
        self,
        repo_id: str,
        *,
        endpoint: str,
        revision: str,
        token: str | bool | None,
        url: str,
        max_retries: int,
        retry_base_delay: float,
        retry_max_delay: float,
        max_cas_attempts: int,
        timeout: float | None,
        commit_budget: CommitBudget,
        create: bool | None,
        private: bool | None,
    ) -> None:
        from huggingface_hub import HfApi

        self.repo_id, self.endpoint, self.revision, self.url = repo_id, endpoint, revision, url
        self.max_retries, self.max_cas_attempts = max_retries, max_cas_attempts
        self.retry_base_delay, self.retry_max_delay = retry_base_delay, retry_max_delay
        self.commit_budget = commit_budget
        self._token = token  # never logged, never put in a message
        self._guard_opts = GuardOptions(None if timeout is None else float(timeout))
        self._plain_transient = plain_transient_types()
        #: no request before this time.monotonic() (the last 429/503 Retry-After)
        self._pause_until = 0.0
        self.api = HfApi(endpoint=endpoint, token=token, library_name="diloco_lightning")
        #: the repository's creation (or existence check) still to do: before the first write when the
        #: Hub could not be reached at open
        self._open_pending: tuple[str, Callable[[], Any]] | None = None
        if create:
            self._open_pending = ("create the repository", lambda: self.api.create_repo(
                repo_id, private=private, exist_ok=True))
        elif create is not None:
            self._open_pending = ("open the repository", lambda: self.api.repo_info(repo_id, revision=revision))

    @property
    def opening(self) -> str | None:
        """What :meth:`ensure_open` still has to do (None: nothing)."""
        return None if self._open_pending is None else self._open_pending[0]

    def ensure_open(self) -> None:
        """Create (or check) the repository if that could not be done at open: before any write.
        Raises ``HubUnavailableError`` while the Hub is unreachable (the caller's wait retries)."""
        pending = self._open_pending
        if pending is None:
            return
        self.call(pending[0], pending[1])
        self._open_pending = None

    def _scrub(self, text: str) -> str:
        tok = self._token
        if isinstance(tok, str) and tok:
            text = text.replace(tok, "<token>")
        return text

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        """The pause before retry ``attempt``: ``min(max, base * 2**(attempt-1))`` jittered to 50-100 %,
        and never shorter than the server's ``Retry-After``."""
        d = min(self.retry_max_delay, self.retry_base_delay * (2 ** (attempt - 1)))
        d = d * (0.5 + 0.5 * random.random())
        if retry_after is not None:
            d = max(d, retry_after)
        return d

    def call(self, what: str, fn: Callable[..., Any], *args: Any, budget: CommitBudget | None = None,
              **kwargs: Any) -> Any:
        """Run one ``huggingface_hub`` call; retry 429/5xx/timeouts/connection errors; map the rest.

        A ``Retry-After`` is honoured: the retry waits at least that long, and when the server asks
        for more than ``retry_max_delay`` the call does not wait inside: it raises
        ``HubUnavailableError`` with ``retry_after`` at once, for a caller that can do something
        better meanwhile (a worker merges its deltas, a master keeps gathering its round). A 429 on
        a commit (``budget``) also pauses that repository's :class:`CommitBudget`."""
        from huggingface_hub.errors import HfHubHTTPError

        try:
            from huggingface_hub.errors import OfflineModeIsEnabled
        except ImportError:  # pragma: no cover - old huggingface_hub
            OfflineModeIsEnabled = ()  # type: ignore[assignment,misc]

        attempt = 0
        while True:
            self._wait_for_server(what)
            ensure_guard()
            token = GUARD.set(self._guard_opts)
            try:
                return fn(*args, **kwargs)
            except TransientError as e:
                reason, retry_after, status = str(e), e.retry_after, e.status
            except OfflineModeIsEnabled as e:  # type: ignore[misc]
                raise HubError(f"{what} on {self.url}: HF_HUB_OFFLINE is set; unset it to use an hf:// hub") from e
            except HfHubHTTPError as e:
                response: Any = getattr(e, "response", None)
                status = getattr(response, "status_code", None)
                if status not in RETRY_STATUS:
                    raise self._map_http_error(e, status, what) from e
                reason, retry_after = f"HTTP {status}", asked_wait(getattr(response, "headers", {}))
            except self._plain_transient as e:  # only reached when the guard is absent
                reason, retry_after, status = f"{type(e).__name__}: {e}", None, None
            finally:
                GUARD.reset(token)
            attempt += 1
            reason = self._scrub(reason)
            delay = self.backoff(attempt, retry_after)
            if budget is not None and status == 429:
                budget.block(delay)  # the repository's commits wait too, not only this one
            if retry_after is not None and status in (429, 503):  # no request of ours before the server's time
                self._pause_until = max(self._pause_until, time.monotonic() + retry_after)
            if retry_after is not None and retry_after > self.retry_max_delay:
                raise HubUnavailableError(
                    f"{what} on {self.url} ({self.endpoint}): {reason}, the server asks to wait {retry_after:.0f}s "
                    "before trying again", retry_after=retry_after,
                )
            if attempt > self.max_retries:
                raise HubUnavailableError(
                    f"{what} on {self.url} ({self.endpoint}) failed after {attempt} attempt(s): {reason}",
                    retry_after=retry_after,
                )
            log.warning("%s on %s: %s; retry %d/%d in %.2fs", what, self.url, reason, attempt, self.max_retries, delay)
            time.sleep(delay)

    def _wait_for_server(self, what: str) -> None:
        """Honour the last ``Retry-After`` (429/503) before sending anything: sleep it when short, else
        raise at once without a request (the caller waits, see :meth:`call`)."""
        left = self._pause_until - time.monotonic()
        if left > self.retry_max_delay:
            raise HubUnavailableError(
                f"{what} on {self.url} ({self.endpoint}): the Hub asked to wait; {left:.0f}s left of its Retry-After",
                retry_after=left,
            )
        if left > 0:
            time.sleep(left)

    def _map_http_error(self, e: Exception, status: int | None, what: str) -> HubError:
        from huggingface_hub.errors import (
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        server = self._scrub(str(getattr(e, "server_message", None) or "")).strip()
        detail = f" (server said: {server[:300]})" if server else ""
        if status in (401, 403):
            return HubAuthError(
                f"{what} on {self.url} ({self.endpoint}): HTTP {status}, not authorized. Check the token (token= or "
                f"$HF_TOKEN): it must be valid and have {'write' if status == 403 else 'read/write'} access to "
                f"{self.repo_id}; a private or missing repository also answers 401{detail}"
            )
        if status == 404 or isinstance(e, (RepositoryNotFoundError, RevisionNotFoundError)):
            if isinstance(e, RevisionNotFoundError):
                return HubNotFoundError(f"{what}: revision {self.revision!r} of {self.url} not found on {self.endpoint}")
            if isinstance(e, RepositoryNotFoundError):
                return HubNotFoundError(
                    f"{what}: repository {self.repo_id} not found on {self.endpoint} (open it with create=True to create it)"
                )
            response: Any = getattr(e, "response", None)
            commit = None
            with contextlib.suppress(Exception):
                commit = response.headers.get("X-Repo-Commit")
            return EntryMissing(f"{what}: not found on {self.url}{detail}", commit)
        if status in (409, 412):
            return Precondition(f"{what} on {self.url}: HTTP {status}, the branch head moved{detail}")
        return HubError(f"{what} on {self.url} ({self.endpoint}) failed: HTTP {status}{detail}")

    def _headers(self) -> dict[str, str]:
        from huggingface_hub.utils import build_hf_headers

        return build_hf_headers(token=self._token, library_name="diloco_lightning")

    def file_url(self, hub_path: str, revision: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo_id, hub_path, revision=revision, endpoint=self.endpoint)

    def _get_small(self, hub_path: str, revision: str) -> tuple[bytes, str | None]:
        from huggingface_hub.utils import get_session, hf_raise_for_status

        session: Any = get_session()  # requests.Session or an httpx client (hf_stream.py)
        with stream_get(session, self.file_url(hub_path, revision), self._headers()) as r:
            hf_raise_for_status(r)
            # SMALL_READ_LIMIT module comment
            return read_capped(r, SMALL_READ_LIMIT, _CHUNK), r.headers.get("X-Repo-Commit")

    def head_commit(self) -> str:
        info = self.call("read the branch head", self.api.repo_info, self.repo_id, revision=self.revision)
        if not isinstance(info.sha, str) or not COMMIT_RE.fullmatch(info.sha):
            raise HubError(f"{self.url}: the Hub gave no commit id for revision {self.revision!r}")
        return info.sha

    def read_head_file(self, hub_path: str) -> tuple[bytes | None, str]:
        """``hub_path``'s content (None if absent) and the head commit it was read at, consistently."""
        try:
            data, commit = self.call(f"read {hub_path}", self._get_small, hub_path, self.revision)
        except EntryMissing as e:
            data, commit = None, e.commit
        if commit and COMMIT_RE.fullmatch(commit):
            return data, commit
        commit = self.head_commit()  # no X-Repo-Commit: resolve the head, then read at it
        try:
            data, _ = self.call(f"read {hub_path}", self._get_small, hub_path, commit)
        except EntryMissing:
            data = None
        return data, commit

    def paths_present(self, paths: Iterable[str], revision: str) -> set[str]:
        from huggingface_hub.hf_api import RepoFile

        paths = sorted(set(paths))
        present: set[str] = set()
        for i in range(0, len(paths), 200):
            batch = paths[i : i + 200]
            infos = self.call("check files", self.api.get_paths_info, self.repo_id, batch, revision=revision)
            present.update(x.path for x in infos if isinstance(x, RepoFile))
        return present

    def commit(self, operations: list, parent: str, message: str) -> str:
        """One ``create_commit`` with ``parent_commit``, within the repository's commit budget: a
        wait up to ``retry_max_delay`` is slept here, a longer one is the caller's
        (``HubUnavailableError`` with ``retry_after``; nothing was sent)."""
        budget = self.commit_budget
        wait = budget.wait()
        if wait > self.retry_max_delay:
            raise HubUnavailableError(
                f"commit ({message}) on {self.url}: the commit budget of this repository "
                f"({budget.per_hour or 0:g} an hour; commits_per_hour=) or the Hub's Retry-After allows the next "
                f"commit in {wait:.0f}s", retry_after=wait,
            )
        if wait > 0:
            log.info("commit (%s) on %s: waiting %.1fs for the commit budget", message, self.url, wait)
            budget.acquire()
        info = self.call(
            f"commit ({message})",
            self.api.create_commit,
            self.repo_id,
            operations=operations,
            commit_message=message,
            revision=self.revision,
            parent_commit=parent,
            budget=budget,
        )
        budget.record()
        return getattr(info, "oid", None) or ""

    def swap(self, path: str, new: bytes | None, *, parse: Callable[[bytes | None], Any], target: Any, expected: Any,
             conflict: Callable[[Any], HubError], message: str, name: str) -> None:
        """Replace the document ``path`` by ``new`` (None: delete it) in one commit whose parent is the head it
        was read at, iff what it holds (``parse(bytes or None)``) equals ``expected``, else raise
        ``conflict(what it holds)``; nothing to do when it holds ``target`` already (an earlier attempt of ours
        landed). A moved head is read again (``max_cas_attempts``); ``name`` is the operation, for the error
        when every attempt found the head moved."""
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        self.ensure_open()
        for attempt in range(self.max_cas_attempts):
            data, head = self.read_head_file(path)
            current = parse(data)
            if current == target and (target is not None or data is None):
                return  # already in place (nothing to change, or an earlier attempt of ours landed)
            if current != expected:
                raise conflict(current)
            op = (CommitOperationDelete(path_in_repo=path) if new is None
                  else CommitOperationAdd(path_in_repo=path, path_or_fileobj=new))
            try:
                self.commit([op], head, message)
                return
            except Precondition:
                self.cas_pause(attempt)
        raise HubError(f"{name}: gave up after {self.max_cas_attempts} attempts; the head of {self.url} kept moving")

    def cas_pause(self, attempt: int) -> None:
        time.sleep(random.uniform(0, min(1.0, 0.02 * (2 ** min(attempt, 6)))))

    def stream_to(self, hub_path: str, revision: str, dest: Path, max_bytes: int | None = None) -> None:
        from huggingface_hub.utils import get_session, hf_raise_for_status

        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(dest.name), suffix=".part", dir=dest.parent)
        os.close(fd)
        try:
            headers = {**self._headers(), "Accept-Encoding": "identity"}
            session: Any = get_session()  # requests.Session or an httpx client (hf_stream.py)
            with stream_get(session, self.file_url(hub_path, revision), headers) as r:
                hf_raise_for_status(r)
                length = r.headers.get("Content-Length")
                expected = int(length) if length and length.isdigit() and len(length) <= 18 else None
                if max_bytes is not None and expected is not None and expected > max_bytes:
                    raise HubFileTooLargeError(
                        f"{hub_path} on {self.url} is {expected} bytes, more than the {max_bytes} allowed (not downloaded)"
                    )
                linked = None
                for h in [*getattr(r, "history", []), r]:
                    linked = linked or _norm_etag(h.headers.get("X-Linked-Etag"))
                etag = None if getattr(r, "history", None) else _norm_etag(r.headers.get("ETag"))
                sha256 = hashlib.sha256()
                sha1 = hashlib.sha1(b"blob %d\0" % expected) if expected is not None else None
                n = 0
                with open(tmp, "wb") as f:
                    for chunk in iter_body(r, _CHUNK):
                        n += len(chunk)
                        if max_bytes is not None and n > max_bytes:
                            raise HubFileTooLargeError(
                                f"{hub_path} on {self.url} is more than the {max_bytes} bytes allowed (download stopped)"
                            )
                        f.write(chunk)
                        sha256.update(chunk)
                        if sha1 is not None:
                            sha1.update(chunk)
                    f.flush()
                    os.fsync(f.fileno())
            if expected is not None and n != expected:
                raise TransientError(f"download of {hub_path} truncated: {n} of {expected} bytes")
            if linked and len(linked) == 64 and sha256.hexdigest() != linked:
                raise TransientError(f"download of {hub_path}: sha256 does not match the Hub's ({linked[:12]}...)")
            if etag and len(etag) == 40 and sha1 is not None and sha1.hexdigest() != etag:
                raise TransientError(f"download of {hub_path}: git oid does not match the Hub's ETag ({etag[:12]}...)")
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def put_new(self, local_file: str | os.PathLike, hub_path: str, what: str, delete: Iterable[str] = ()) -> bool:
        """Commit ``local_file`` as ``hub_path`` unless it exists. True if written (or the same
        bytes are already there: an earlier attempt of ours), False if another file is there.
        ``delete``: files removed in the same commit (those still there at its parent)."""
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        self.ensure_open()

        delete = sorted({validate_hub_path(p) for p in delete} - {hub_path})

        local = Path(local_file)
        if not local.is_file():
            raise FileNotFoundError(f"{what}: local file {local} does not exist")
        op = CommitOperationAdd(path_in_repo=hub_path, path_or_fileobj=str(local))
        for attempt in range(self.max_cas_attempts):
            try:
                meta = self.call(f"check {hub_path}", self.api.get_hf_file_metadata, url=self.file_url(hub_path, self.revision))
            except EntryMissing as e:
                head = e.commit if e.commit and COMMIT_RE.fullmatch(e.commit) else None
                if head is None:  # no X-Repo-Commit: resolve the head, then check at it
                    head = self.head_commit()
                    if hub_path in self.paths_present([hub_path], head):
                        return self._same_file(hub_path, local, head)
            else:
                return self._same_file(hub_path, local, None, etag=meta.etag)
            ops: list[Any] = [op]
            if delete:
                ops += [CommitOperationDelete(path_in_repo=p) for p in sorted(self.paths_present(delete, head))]
            try:
                self.commit(ops, head, f"{what}: {hub_path}" + (f" (and delete {len(ops) - 1})" if len(ops) > 1 else ""))
                return True
            except Precondition:
                log.debug("%s: the head of %s moved; checking %s again", what, self.url, hub_path)
                self.cas_pause(attempt)
        raise HubError(f"{what}: gave up after {self.max_cas_attempts} attempts; the head of {self.url} kept moving")

    def _same_file(self, hub_path: str, local: Path, revision: str | None, etag: str | None = None) -> bool:
        if etag is None:
            with contextlib.suppress(HubError):
                meta = self.call(
                    f"check {hub_path}", self.api.get_hf_file_metadata, url=self.file_url(hub_path, revision or self.revision)
                )
                etag = meta.etag
        etag = _norm_etag(etag)
        if etag and len(etag) == 64:
            from diloco_lightning.util.fileio import sha256_file

            return sha256_file(local) == etag
        if etag and len(etag) == 40:
            return _git_blob_sha1(local) == etag
        return False

    def tree(self, folder: str, recursive: bool, revision: str | None = None) -> list[tuple[str, int | None, str | None]]:
        """``(path, size, blob id)`` of the files under ``folder`` (at ``revision``, default the branch)."""
        from huggingface_hub.hf_api import RepoFile

        def run() -> list[tuple[str, int | None, str | None]]:
            items = self.api.list_repo_tree(self.repo_id, path_in_repo=folder, recursive=recursive,
                                             revision=revision or self.revision)
            return [(x.path, x.size, getattr(x, "blob_id", None)) for x in items if isinstance(x, RepoFile)]

        try:
            return self.call(f"list {folder}/", run)
        except EntryMissing:
            return []
