"""The Hugging Face Hub transport (``hf://org/repo``), through ``huggingface_hub.HfApi``.

One model repository (branch ``revision``, default ``main``) holds the hub layout of
SPEC.md. Workers commit deltas to it while the master publishes, so the branch head
moves all the time; every write is a ``create_commit`` with ``parent_commit`` as the
compare-and-swap:

* ``upload_delta`` / ``upload_init``: read the head H and check the path is absent at H
  (one ``HEAD .../resolve``, whose answer carries ``X-Repo-Commit`` even on 404), then
  commit the file with ``parent_commit=H``. On 412 (the head moved) check again and
  retry: a delta is never overwritten (``DeltaExistsError``; the same bytes already
  there count as done, which makes a retried upload idempotent).
* ``publish``: read ``global/manifest.json`` and the head H in one ``GET .../resolve``; if
  its ``outer_step`` is not the expected one, ``PublishConflictError`` and no commit.
  Else ONE commit with parent H carries the weights, the optimizer state, the new
  manifest and the deletions (filtered against H by ``paths-info``, so deleting a file
  that is already gone cannot fail the commit). On 412, re-read: if the manifest still
  has the expected ``outer_step`` (only worker commits happened) retry on the new head
  (bounded, jittered); else ``PublishConflictError``. The commit is the single atomic
  point: a crash before it leaves the old version, after it the new one.
* ``write_lease``: the same scheme on ``global/lease.json``.
* Listing reads the repo tree of ``nodes/`` (or ``global/``) only; nothing is downloaded.
* ``download`` streams ``GET .../resolve`` into ``cache_dir / hub_path`` (temp file +
  ``os.replace``, length and ETag checked), so two nodes' same-named files never share
  a cache file and two processes sharing the cache never see a partial one. Hub files
  are immutable, so a cached copy is reused; the mutable ones (manifest, lease,
  ``init.safetensors``) are always fetched again. Files named by the last manifest read
  are fetched at the commit that manifest was read at (a later publication deleting
  them cannot pull them away mid-download).

Errors: 401/403 -> ``HubAuthError`` (the message says to check the token, never shows
it), 404 -> ``HubNotFoundError``, 409/412 -> the CAS conflict of the operation. Only
429, 5xx, timeouts and connection errors are retried, with jittered exponential backoff
(``max_retries``, ``retry_base_delay``, ``retry_max_delay``); nothing else is.

``huggingface_hub`` retries some calls on its own (``http_backoff``: preupload, tree
pages, downloads; up to 5 times, sleeping 1-8 s). So that its retries do not multiply
ours, a pass-through wrapper is put around the transport of its shared HTTP client: while
one of this module's calls runs (a context variable, so other users of the client are
untouched) a retryable status or a network error is raised at once as
``_TransientError``, which ``huggingface_hub`` does not retry and this module does; the
wrapper also gives those calls a timeout (``timeout=``; the shared client has none). On a
``huggingface_hub`` whose client cannot be wrapped, its own retries stay (bounded:
at most ``6 * (max_retries + 1)`` requests per call).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib
import logging
import os
import random
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_lightning.fileio import temp_prefix
from diloco_lightning import faults
from diloco_lightning.hub.base import (
    ClaimConflictError,
    DeltaExistsError,
    DeltaRef,
    Hub,
    HubAuthError,
    HubError,
    HubFileTooLargeError,
    HubNotFoundError,
    LeaseConflictError,
    check_publication,
    PublishConflictError,
    default_cache_dir,
)
from diloco_lightning.manifest import Lease, Manifest
from diloco_lightning.nodeclaim import ClaimError, NodeClaim
from diloco_lightning.names import (
    GLOBAL_DIR,
    LEASE_PATH,
    MANIFEST_PATH,
    NODES_DIR,
    InvalidNameError,
    claim_path,
    delta_path,
    init_path,
    parse_claim_path,
    parse_delta_path,
    parse_init_path,
    validate_global_path,
    validate_hub_path,
)

log = logging.getLogger(__name__)

__all__ = ["HFHub", "HubUnavailableError"]

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504}) | frozenset(range(500, 600))
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_REPO_PART_RE = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9][A-Za-z0-9._-]{0,95}(?<![.-])")
_CHUNK = 8 << 20


class HubUnavailableError(HubError):
    """A remote hub kept answering 429/5xx or timing out after every retry."""


class _TransientError(Exception):
    """A retryable failure (429, 5xx, timeout, connection error) seen under our guard."""

    def __init__(self, reason: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.retry_after = retry_after


class _EntryMissing(HubNotFoundError):
    """404 on a file or folder of an existing repository; ``commit`` is the revision's head if the Hub said."""

    def __init__(self, msg: str, commit: str | None = None) -> None:
        super().__init__(msg)
        self.commit = commit


class _Precondition(HubError):
    """409/412 on a commit: the branch head is not the ``parent_commit`` we gave."""


# ----------------------------------------------------------------------------- guard on the shared client


@dataclass(frozen=True)
class _GuardOptions:
    timeout: float | None


_GUARD: contextvars.ContextVar[_GuardOptions | None] = contextvars.ContextVar("diloco_hf_guard", default=None)
_GUARD_LOCK = threading.Lock()


_RATELIMIT_RE = re.compile(r"r\s*=\s*(\d+)\s*;\s*t\s*=\s*(\d+)")


def _retry_after(headers: Any) -> float | None:
    """Seconds the server asked us to wait: ``Retry-After``, or the Hub's ``RateLimit: "api";r=0;t=N``."""
    try:
        value = headers.get("Retry-After")
        ratelimit = headers.get("RateLimit")
    except Exception:
        return None
    if value and str(value).strip().isdigit():
        return float(str(value).strip())
    m = _RATELIMIT_RE.search(str(ratelimit or ""))
    if m and m.group(1) == "0":
        return float(m.group(2))
    return None


def _guarded_send(request: Any, send: Callable[[], Any], transient_exc: tuple[type[BaseException], ...]) -> Any:
    """``send()`` the request under the guard (httpx and requests alike): a network error in
    ``transient_exc`` or a 429/5xx answer (closed) raises ``_TransientError``."""
    try:
        response = send()
    except transient_exc as e:
        raise _TransientError(f"{type(e).__name__} on {request.method} {request.url}: {e}") from e
    if response.status_code in _RETRY_STATUS:
        retry_after = _retry_after(response.headers)
        with contextlib.suppress(Exception):
            response.close()
        raise _TransientError(
            f"HTTP {response.status_code} on {request.method} {request.url}", response.status_code, retry_after
        )
    return response


def _make_guard_transport(httpx_mod: Any, inner: Any) -> Any:
    base = httpx_mod.BaseTransport
    transient_exc = (httpx_mod.TimeoutException, httpx_mod.NetworkError, httpx_mod.RemoteProtocolError)

    class _GuardTransport(base):  # type: ignore[misc, valid-type]
        """Pass-through unless a diloco call is running: then 429/5xx and network errors raise
        ``_TransientError`` (which ``huggingface_hub`` does not retry), and a timeout is set."""

        _diloco_guard = True

        def __init__(self, inner_transport: Any) -> None:
            self._inner = inner_transport

        def handle_request(self, request: Any) -> Any:
            opts = _GUARD.get()
            if opts is None:
                return self._inner.handle_request(request)
            t = request.extensions.get("timeout")
            if opts.timeout is not None and (not t or all(v is None for v in t.values())):
                request.extensions["timeout"] = {k: opts.timeout for k in ("connect", "read", "write", "pool")}
            return _guarded_send(request, lambda: self._inner.handle_request(request), transient_exc)

        def close(self) -> None:
            self._inner.close()

    return _GuardTransport(inner)


def _make_requests_guard_adapter(requests_mod: Any, inner: Any) -> Any:
    """The same guard for ``huggingface_hub < 1.0``, whose shared session is a ``requests.Session``."""
    transient_exc = (requests_mod.Timeout, requests_mod.ConnectionError)

    class _GuardAdapter(requests_mod.adapters.BaseAdapter):  # type: ignore[misc, name-defined]
        _diloco_guard = True

        def __init__(self, inner_adapter: Any) -> None:
            super().__init__()
            self._inner = inner_adapter

        def send(self, request: Any, stream: bool = False, timeout: Any = None, **kwargs: Any) -> Any:
            opts = _GUARD.get()
            if opts is None:
                return self._inner.send(request, stream=stream, timeout=timeout, **kwargs)
            if timeout is None:
                timeout = opts.timeout
            return _guarded_send(
                request, lambda: self._inner.send(request, stream=stream, timeout=timeout, **kwargs), transient_exc
            )

        def close(self) -> None:
            self._inner.close()

    return _GuardAdapter(inner)


def _is_requests_session(session: Any) -> bool:
    return type(session).__module__.split(".")[0] == "requests"


def _ensure_guard() -> None:
    """Wrap the transport(s) of ``huggingface_hub``'s shared client once (see the module docstring)."""
    from huggingface_hub.utils import get_session

    client = get_session()
    if getattr(client, "_diloco_guarded", False):
        return
    with _GUARD_LOCK:
        if getattr(client, "_diloco_guarded", False):
            return
        try:
            mod = importlib.import_module(type(client).__module__.split(".")[0])
            if _is_requests_session(client):
                for prefix, adapter in list(client.adapters.items()):
                    if not getattr(adapter, "_diloco_guard", False):
                        client.adapters[prefix] = _make_requests_guard_adapter(mod, adapter)
                client._diloco_guarded = True
                return
            base = getattr(mod, "BaseTransport", None)
            transport = getattr(client, "_transport", None)
            if base is not None and isinstance(transport, base):
                client._transport = _make_guard_transport(mod, transport)
                mounts = getattr(client, "_mounts", None)
                if isinstance(mounts, dict):
                    for key, value in list(mounts.items()):
                        if isinstance(value, base) and not getattr(value, "_diloco_guard", False):
                            mounts[key] = _make_guard_transport(mod, value)
            else:
                log.debug("huggingface_hub client %s cannot be guarded; its own retries stay", type(client).__name__)
        except Exception as e:  # never fail an operation because the guard could not be installed
            log.debug("could not guard the huggingface_hub client: %s", e)
        with contextlib.suppress(Exception):
            client._diloco_guarded = True


def _plain_transient_types() -> tuple[type[BaseException], ...]:
    """Network exceptions of the HTTP library ``huggingface_hub`` uses (when the guard is absent)."""
    out: list[type[BaseException]] = []
    for name, attrs in (
        ("httpx2", ("TimeoutException", "NetworkError", "RemoteProtocolError")),
        ("httpx", ("TimeoutException", "NetworkError", "RemoteProtocolError")),
        ("requests", ("Timeout", "ConnectionError")),
    ):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        out.extend(getattr(mod, a) for a in attrs if isinstance(getattr(mod, a, None), type))
    return tuple(out)


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


# ----------------------------------------------------------------------------- the hub


class HFHub(Hub):
    """A hub in a Hugging Face model repository. See the module docstring for the guarantees.

    Options: ``endpoint`` (default ``$HF_ENDPOINT`` or https://huggingface.co), ``token``
    (default: ``huggingface_hub``'s, e.g. ``$HF_TOKEN``), ``cache_dir``, ``revision``
    (a branch, default ``main``; it must exist), ``create`` (create the repository if
    missing, default True), ``private`` (for a created repository), ``max_retries``
    (retries of one HTTP call on 429/5xx/timeouts, default 5), ``retry_base_delay`` /
    ``retry_max_delay`` (seconds; backoff ``min(max, base * 2**n)``, jittered to 50-100 %),
    ``timeout`` (seconds per connect/read/write, default 120), ``max_cas_attempts``
    (rounds of re-read + commit when the head keeps moving, default 20).
    """

    def __init__(
        self,
        repo_id: str,
        *,
        endpoint: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
        revision: str | None = None,
        create: bool = True,
        private: bool | None = None,
        max_retries: int | None = None,
        retry_base_delay: float | None = None,
        retry_max_delay: float | None = None,
        timeout: float | None = 120.0,
        max_cas_attempts: int | None = None,
    ) -> None:
        from huggingface_hub import HfApi, constants

        self.repo_id = self._check_repo_id(repo_id)
        self.revision = revision or "main"
        if not isinstance(self.revision, str) or not self.revision.strip() or self.revision != self.revision.strip():
            raise ValueError(f"HFHub: revision {self.revision!r} must be a branch name")
        self.endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
        if not re.match(r"https?://", self.endpoint):
            raise ValueError(f"HFHub: endpoint {self.endpoint!r} must start with http:// or https://")
        self.url = f"hf://{self.repo_id}"
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(
            f"{self.endpoint}/{self.repo_id}@{self.revision}"
        )
        self.max_retries = 5 if max_retries is None else int(max_retries)
        self.retry_base_delay = 0.5 if retry_base_delay is None else float(retry_base_delay)
        self.retry_max_delay = 30.0 if retry_max_delay is None else float(retry_max_delay)
        self.max_cas_attempts = 20 if max_cas_attempts is None else int(max_cas_attempts)
        if self.max_retries < 0 or self.retry_base_delay < 0 or self.retry_max_delay < 0 or self.max_cas_attempts < 1:
            raise ValueError("HFHub: max_retries, retry delays must be >= 0 and max_cas_attempts >= 1")
        self._token = token  # never logged, never put in a message
        self._guard_opts = _GuardOptions(None if timeout is None else float(timeout))
        self._api = HfApi(endpoint=self.endpoint, token=token, library_name="diloco_lightning")
        self._pins: dict[str, str] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._plain_transient = _plain_transient_types()
        if create:
            self._call("create the repository", self._api.create_repo, self.repo_id, private=private, exist_ok=True)
        else:
            self._call("open the repository", self._api.repo_info, self.repo_id, revision=self.revision)

    @staticmethod
    def _check_repo_id(repo_id: object) -> str:
        if not isinstance(repo_id, str):
            raise TypeError(f"HFHub: repo id must be a string like 'org/repo', got {repo_id!r}")
        parts = repo_id.split("/")
        if len(parts) != 2 or not all(_REPO_PART_RE.fullmatch(p) for p in parts):
            raise ValueError(
                f"invalid Hugging Face repo id {repo_id!r}: expected 'org/name' (letters, digits, '-', '_', '.';"
                " no '--' or '..'), as in hf://org/name"
            )
        return repo_id

    # ------------------------------------------------------------------ HTTP plumbing

    def _scrub(self, text: str) -> str:
        tok = self._token
        if isinstance(tok, str) and tok:
            text = text.replace(tok, "<token>")
        return text

    def _backoff(self, attempt: int, retry_after: float | None = None) -> float:
        d = min(self.retry_max_delay, self.retry_base_delay * (2 ** (attempt - 1)))
        d = d * (0.5 + 0.5 * random.random())
        if retry_after is not None:
            d = max(d, min(retry_after, self.retry_max_delay))
        return d

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one ``huggingface_hub`` call; retry 429/5xx/timeouts/connection errors; map the rest."""
        from huggingface_hub.errors import HfHubHTTPError

        try:
            from huggingface_hub.errors import OfflineModeIsEnabled
        except ImportError:  # pragma: no cover - old huggingface_hub
            OfflineModeIsEnabled = ()  # type: ignore[assignment]

        attempt = 0
        while True:
            _ensure_guard()
            token = _GUARD.set(self._guard_opts)
            try:
                return fn(*args, **kwargs)
            except _TransientError as e:
                reason, retry_after = str(e), e.retry_after
            except OfflineModeIsEnabled as e:  # type: ignore[misc]
                raise HubError(f"{what} on {self.url}: HF_HUB_OFFLINE is set; unset it to use an hf:// hub") from e
            except HfHubHTTPError as e:
                response = getattr(e, "response", None)
                status = getattr(response, "status_code", None)
                if status not in _RETRY_STATUS:
                    raise self._map_http_error(e, status, what) from e
                reason, retry_after = f"HTTP {status}", _retry_after(getattr(response, "headers", {}))
            except self._plain_transient as e:  # only reached when the guard is absent
                reason, retry_after = f"{type(e).__name__}: {e}", None
            finally:
                _GUARD.reset(token)
            attempt += 1
            reason = self._scrub(reason)
            if attempt > self.max_retries:
                raise HubUnavailableError(
                    f"{what} on {self.url} ({self.endpoint}) failed after {attempt} attempt(s): {reason}"
                )
            delay = self._backoff(attempt, retry_after)
            log.warning("%s on %s: %s; retry %d/%d in %.2fs", what, self.url, reason, attempt, self.max_retries, delay)
            time.sleep(delay)

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
            response = getattr(e, "response", None)
            commit = None
            with contextlib.suppress(Exception):
                commit = response.headers.get("X-Repo-Commit")
            return _EntryMissing(f"{what}: not found on {self.url}{detail}", commit)
        if status in (409, 412):
            return _Precondition(f"{what} on {self.url}: HTTP {status}, the branch head moved{detail}")
        return HubError(f"{what} on {self.url} ({self.endpoint}) failed: HTTP {status}{detail}")

    def _headers(self) -> dict[str, str]:
        from huggingface_hub.utils import build_hf_headers

        return build_hf_headers(token=self._token, library_name="diloco_lightning")

    def _file_url(self, hub_path: str, revision: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo_id, hub_path, revision=revision, endpoint=self.endpoint)

    def _fault(self, label: str) -> None:
        faults.point(label, self)  # crash points for tests (diloco_lightning.faults)

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(msg, *args)

    # ------------------------------------------------------------------ reads at the head

    def _get_small(self, hub_path: str, revision: str) -> tuple[bytes, str | None]:
        from huggingface_hub.utils import get_session, hf_raise_for_status

        session = get_session()
        url = self._file_url(hub_path, revision)
        if _is_requests_session(session):  # huggingface_hub < 1.0
            r = session.get(url, headers=self._headers(), allow_redirects=True)
        else:  # httpx / httpx2
            r = session.get(url, headers=self._headers(), follow_redirects=True)
        hf_raise_for_status(r)
        return r.content, r.headers.get("X-Repo-Commit")

    def _head_commit(self) -> str:
        info = self._call("read the branch head", self._api.repo_info, self.repo_id, revision=self.revision)
        if not isinstance(info.sha, str) or not _COMMIT_RE.fullmatch(info.sha):
            raise HubError(f"{self.url}: the Hub gave no commit id for revision {self.revision!r}")
        return info.sha

    def _read_head_file(self, hub_path: str) -> tuple[bytes | None, str]:
        """``hub_path``'s content (None if absent) and the head commit it was read at, consistently."""
        try:
            data, commit = self._call(f"read {hub_path}", self._get_small, hub_path, self.revision)
        except _EntryMissing as e:
            data, commit = None, e.commit
        if commit and _COMMIT_RE.fullmatch(commit):
            return data, commit
        commit = self._head_commit()  # no X-Repo-Commit: resolve the head, then read at it
        try:
            data, _ = self._call(f"read {hub_path}", self._get_small, hub_path, commit)
        except _EntryMissing:
            data = None
        return data, commit

    def _paths_present(self, paths: Iterable[str], revision: str) -> set[str]:
        from huggingface_hub.hf_api import RepoFile

        paths = sorted(set(paths))
        present: set[str] = set()
        for i in range(0, len(paths), 200):
            batch = paths[i : i + 200]
            infos = self._call("check files", self._api.get_paths_info, self.repo_id, batch, revision=revision)
            present.update(x.path for x in infos if isinstance(x, RepoFile))
        return present

    def _commit(self, operations: list, parent: str, message: str) -> str:
        info = self._call(
            f"commit ({message})",
            self._api.create_commit,
            self.repo_id,
            operations=operations,
            commit_message=message,
            revision=self.revision,
            parent_commit=parent,
        )
        return getattr(info, "oid", None) or ""

    def _cas_pause(self, attempt: int) -> None:
        time.sleep(random.uniform(0, min(1.0, 0.02 * (2 ** min(attempt, 6)))))

    # ------------------------------------------------------------------ workers

    def _put_new(self, local_file: str | os.PathLike, hub_path: str, what: str) -> bool:
        """Commit ``local_file`` as ``hub_path`` unless it exists. True if written (or the same
        bytes are already there: an earlier attempt of ours), False if another file is there."""
        from huggingface_hub import CommitOperationAdd

        local = Path(local_file)
        if not local.is_file():
            raise FileNotFoundError(f"{what}: local file {local} does not exist")
        op = CommitOperationAdd(path_in_repo=hub_path, path_or_fileobj=str(local))
        for attempt in range(self.max_cas_attempts):
            try:
                meta = self._call(f"check {hub_path}", self._api.get_hf_file_metadata, url=self._file_url(hub_path, self.revision))
            except _EntryMissing as e:
                head = e.commit if e.commit and _COMMIT_RE.fullmatch(e.commit) else None
                if head is None:  # no X-Repo-Commit: resolve the head, then check at it
                    head = self._head_commit()
                    if hub_path in self._paths_present([hub_path], head):
                        return self._same_file(hub_path, local, head)
            else:
                return self._same_file(hub_path, local, None, etag=meta.etag)
            try:
                self._commit([op], head, f"{what}: {hub_path}")
                return True
            except _Precondition:
                log.debug("%s: the head of %s moved; checking %s again", what, self.url, hub_path)
                self._cas_pause(attempt)
        raise HubError(f"{what}: gave up after {self.max_cas_attempts} attempts; the head of {self.url} kept moving")

    def _same_file(self, hub_path: str, local: Path, revision: str | None, etag: str | None = None) -> bool:
        if etag is None:
            with contextlib.suppress(HubError):
                meta = self._call(
                    f"check {hub_path}", self._api.get_hf_file_metadata, url=self._file_url(hub_path, revision or self.revision)
                )
                etag = meta.etag
        etag = _norm_etag(etag)
        if etag and len(etag) == 64:
            from diloco_lightning.fileio import sha256_file

            return sha256_file(local) == etag
        if etag and len(etag) == 40:
            return _git_blob_sha1(local) == etag
        return False

    def upload_delta(self, local_file: str | os.PathLike, node_id: str, local_step: int) -> str:
        hub_path = delta_path(node_id, local_step)
        if not self._put_new(local_file, hub_path, "upload delta"):
            raise DeltaExistsError(f"{hub_path} already exists on {self.url}; deltas are never rewritten")
        return hub_path

    def upload_init(self, local_file: str | os.PathLike, node_id: str) -> str:
        hub_path = init_path(node_id)
        if not self._put_new(local_file, hub_path, "offer initial weights"):
            log.info("%s already offered on %s; keeping the first one", hub_path, self.url)
        return hub_path

    # ------------------------------------------------------------------ listing

    def _tree(self, folder: str, recursive: bool) -> list[tuple[str, int | None, str | None]]:
        from huggingface_hub.hf_api import RepoFile

        def run() -> list[tuple[str, int | None, str | None]]:
            items = self._api.list_repo_tree(self.repo_id, path_in_repo=folder, recursive=recursive, revision=self.revision)
            return [(x.path, x.size, getattr(x, "blob_id", None)) for x in items if isinstance(x, RepoFile)]

        try:
            return self._call(f"list {folder}/", run)
        except _EntryMissing:
            return []

    def _node_files(self) -> list[tuple[str, int | None, str | None]]:
        return self._tree(NODES_DIR, recursive=True)

    def list_deltas(self, after: Mapping[str, int] | None = None) -> list[DeltaRef]:
        after = after or {}
        out: list[DeltaRef] = []
        for path, size, blob in self._node_files():
            ident = parse_delta_path(path)
            if ident is None:
                if parse_init_path(path) is None and parse_claim_path(path) is None:
                    self._warn_once(path, "ignoring %s on %s: not a delta path", path, self.url)
                continue
            if ident.local_step <= after.get(ident.node_id, -1):
                continue
            out.append(DeltaRef(ident.node_id, ident.local_step, path, size, blob))
        out.sort()
        return out

    def list_inits(self) -> list[str]:
        return sorted({n for n in (parse_init_path(p) for p, _, _ in self._node_files()) if n is not None})

    def list_global(self) -> list[str]:
        out = []
        for path, _, _ in self._tree(GLOBAL_DIR, recursive=False):
            try:
                out.append(validate_global_path(path))
            except InvalidNameError:
                continue
        return sorted(out)

    # ------------------------------------------------------------------ reading

    def _stream_to(self, hub_path: str, revision: str, dest: Path, max_bytes: int | None = None) -> None:
        from huggingface_hub.utils import get_session, hf_raise_for_status

        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(dest.name), suffix=".part", dir=dest.parent)
        os.close(fd)
        try:
            headers = {**self._headers(), "Accept-Encoding": "identity"}
            session = get_session()
            url = self._file_url(hub_path, revision)
            if _is_requests_session(session):  # huggingface_hub < 1.0
                cm = contextlib.closing(session.get(url, headers=headers, stream=True, allow_redirects=True))
            else:  # httpx / httpx2
                cm = session.stream("GET", url, headers=headers, follow_redirects=True)
            with cm as r:
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
                chunks = r.iter_bytes(_CHUNK) if hasattr(r, "iter_bytes") else r.iter_content(_CHUNK)
                with open(tmp, "wb") as f:
                    for chunk in chunks:
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
                raise _TransientError(f"download of {hub_path} truncated: {n} of {expected} bytes")
            if linked and len(linked) == 64 and sha256.hexdigest() != linked:
                raise _TransientError(f"download of {hub_path}: sha256 does not match the Hub's ({linked[:12]}...)")
            if etag and len(etag) == 40 and sha1 is not None and sha1.hexdigest() != etag:
                raise _TransientError(f"download of {hub_path}: git oid does not match the Hub's ETag ({etag[:12]}...)")
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def download(self, hub_path: str, *, max_bytes: int | None = None) -> Path:
        hub_path = validate_hub_path(hub_path)
        dest = self.cache_dir / hub_path
        mutable = hub_path in (MANIFEST_PATH, LEASE_PATH) or parse_init_path(hub_path) is not None
        if not mutable and dest.is_file():
            if max_bytes is not None and dest.stat().st_size > max_bytes:
                raise HubFileTooLargeError(f"{hub_path} on {self.url} is more than the {max_bytes} bytes allowed")
            return dest  # hub files are immutable and cached copies are complete (atomic rename)
        with self._lock:
            pinned = self._pins.get(hub_path)
        for revision in ([pinned] if pinned else []) + [self.revision]:
            try:
                self._call(f"download {hub_path}", self._stream_to, hub_path, revision, dest, max_bytes)
                return dest
            except _EntryMissing:
                continue
        raise HubNotFoundError(f"{hub_path} not found on {self.url}")

    def read_manifest_bytes(self) -> bytes | None:
        data, _ = self._read_head_file(MANIFEST_PATH)
        return data

    def read_manifest(self) -> Manifest | None:
        data, commit = self._read_head_file(MANIFEST_PATH)
        if data is None:
            return None
        manifest = Manifest.from_json(data, source=f"{self.url}/{MANIFEST_PATH}@{commit[:12]}")
        with self._lock:
            self._pins = {p: commit for p in manifest.files()}
        return manifest

    # ------------------------------------------------------------------ publishing

    def publish(
        self,
        manifest: Manifest,
        files: Mapping[str, str | os.PathLike],
        *,
        expected_outer_step: int | None,
        delete: Iterable[str] = (),
        expected_digest: str | None = None,
    ) -> None:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        # the same transport-independent checks as every hub (nothing written on failure)
        files, delete = check_publication(
            manifest, files, expected_outer_step=expected_outer_step, delete=delete, source=self.url,
            expected_digest=expected_digest,
        )
        delete = sorted(set(delete))
        text = manifest.to_json()
        named = manifest.files()
        data = text.encode()
        big = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(src)) for p, src in sorted(files.items())]
        need = [p for p in named if p not in files]
        message = f"publish outer_step {manifest.outer_step}"
        for attempt in range(self.max_cas_attempts):
            current_bytes, head = self._read_head_file(MANIFEST_PATH)
            if current_bytes is not None and current_bytes == data:
                log.info("%s: outer_step %d is already on %s (an earlier attempt landed)", message, manifest.outer_step, self.url)
                self._set_pins(named, head)
                return
            if expected_digest is not None:
                digest = None if current_bytes is None else hashlib.sha256(current_bytes).hexdigest()
                if digest != expected_digest:
                    raise PublishConflictError(expected_outer_step, None, "the manifest being replaced changed")
            else:
                current = None if current_bytes is None else Manifest.from_json(current_bytes, source=f"{self.url}/{MANIFEST_PATH}")
                found = None if current is None else current.outer_step
                if found != expected_outer_step:
                    raise PublishConflictError(expected_outer_step, found)
            present = self._paths_present([*need, *delete, *files], head)
            missing = [p for p in need if p not in present]
            if missing:
                raise HubError(f"manifest names {missing} but they are neither uploaded now nor on {self.url}")
            taken = sorted(p for p in files if p in present)
            if taken:
                raise HubError(f"{taken} already exist on {self.url}; global file names must be unique")
            ops = [*big, CommitOperationAdd(path_in_repo=MANIFEST_PATH, path_or_fileobj=data)]
            ops += [CommitOperationDelete(path_in_repo=p) for p in delete if p in present]
            # upload everything that must be uploaded first (LFS/Xet content on the real Hub); the commit
            # below is then the single atomic step
            self._call("upload publication files", self._api.preupload_lfs_files, self.repo_id,
                       additions=[op for op in ops if isinstance(op, CommitOperationAdd)], revision=self.revision,
                       free_memory=False)
            self._fault("files")
            self._fault("locked")
            try:
                commit = self._commit(ops, head, message)
            except _Precondition:
                log.info("%s: the head of %s moved (worker commits?); re-reading the manifest", message, self.url)
                self._cas_pause(attempt)
                continue
            self._set_pins(named, commit)
            self._fault("committed")
            self._fault("manifest")
            self._fault("deleted")
            return
        raise HubError(f"{message}: gave up after {self.max_cas_attempts} attempts; the head of {self.url} kept moving")

    def _set_pins(self, paths: Iterable[str], commit: str | None) -> None:
        if commit and _COMMIT_RE.fullmatch(commit):
            with self._lock:
                self._pins = {p: commit for p in paths}

    def delete(self, paths: Iterable[str]) -> None:
        from huggingface_hub import CommitOperationDelete

        paths = sorted({validate_hub_path(p) for p in paths})
        for p in paths:
            if p in (MANIFEST_PATH, LEASE_PATH):
                raise InvalidNameError(f"refusing to delete {p!r}")
        if not paths:
            return
        for attempt in range(self.max_cas_attempts):
            head = self._head_commit()
            present = self._paths_present(paths, head)
            if not present:
                return
            try:
                self._commit([CommitOperationDelete(path_in_repo=p) for p in sorted(present)], head, f"delete {len(present)} file(s)")
                return
            except _Precondition:
                self._cas_pause(attempt)
        raise HubError(f"delete: gave up after {self.max_cas_attempts} attempts; the head of {self.url} kept moving")

    # ------------------------------------------------------------------ lease

    def _parse_lease(self, data: bytes | None) -> Lease | None:
        return None if data is None else Lease.from_hub_bytes(data, source=f"{self.url}/{LEASE_PATH}")

    def read_lease(self) -> Lease | None:
        data, _ = self._read_head_file(LEASE_PATH)
        return self._parse_lease(data)

    def write_lease(self, lease: Lease | None, *, expected: Lease | None) -> None:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        for attempt in range(self.max_cas_attempts):
            data, head = self._read_head_file(LEASE_PATH)
            current = self._parse_lease(data)
            if current == lease:
                return  # already in place (nothing to change, or an earlier attempt of ours landed)
            if current != expected:
                raise LeaseConflictError(f"lease changed on {self.url}: expected {expected}, found {current}")
            if lease is None:
                ops = [CommitOperationDelete(path_in_repo=LEASE_PATH)]
            else:
                ops = [CommitOperationAdd(path_in_repo=LEASE_PATH, path_or_fileobj=lease.to_json().encode())]
            try:
                self._commit(ops, head, "lease" if lease is None else f"lease: {lease.holder} epoch {lease.epoch}")
                return
            except _Precondition:
                self._cas_pause(attempt)
        raise HubError(f"write_lease: gave up after {self.max_cas_attempts} attempts; the head of {self.url} kept moving")

    # ------------------------------------------------------------------ node claims

    def _parse_claim(self, data: bytes | None, node_id: str) -> NodeClaim | None:
        if data is None:
            return None
        try:
            return NodeClaim.from_json(data, node_id=node_id, source=f"{self.url}/{claim_path(node_id)}")
        except ClaimError as e:
            self._warn_once(f"{claim_path(node_id)}:{len(data)}", "ignoring an unreadable claim: %s", e)
            return None

    def read_claim(self, node_id: str) -> NodeClaim | None:
        data, _ = self._read_head_file(claim_path(node_id))
        return self._parse_claim(data, node_id)

    def list_claims(self) -> dict[str, NodeClaim]:
        return self._claims_from_listing(self._node_files(), self.read_claim)

    def write_claim(self, node_id: str, claim: NodeClaim | None, *, expected: NodeClaim | None) -> None:
        """The scheme of :meth:`write_lease` on ``nodes/<node_id>/claim.json`` (one commit per write:
        the keeper renews at most once per half ``ttl``, well inside the Hub's commit rate limits)."""
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        if claim is not None and claim.node_id != node_id:
            raise ValueError(f"write_claim: a claim for {claim.node_id!r} written as {node_id!r}'s")
        path = claim_path(node_id)
        for attempt in range(self.max_cas_attempts):
            data, head = self._read_head_file(path)
            current = self._parse_claim(data, node_id)
            if current == claim and (claim is not None or data is None):
                return  # already in place (an earlier attempt of ours landed)
            if current != expected:
                raise ClaimConflictError(f"claim on {node_id!r} changed on {self.url}: expected {expected}, found {current}")
            if claim is None:
                ops = [CommitOperationDelete(path_in_repo=path)]
            else:
                ops = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=claim.to_json().encode())]
            try:
                self._commit(ops, head, f"claim {node_id}: " + ("released" if claim is None else f"{claim.holder} epoch {claim.epoch}"))
                return
            except _Precondition:
                self._cas_pause(attempt)
        raise HubError(f"write_claim: gave up after {self.max_cas_attempts} attempts; the head of {self.url} kept moving")

    def __repr__(self) -> str:
        return f"HFHub({self.url!r}, endpoint={self.endpoint!r}, revision={self.revision!r})"
