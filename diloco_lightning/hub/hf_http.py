"""HTTP plumbing of the Hugging Face Hub transport (``diloco_lightning.hub.hf``): one call,
retried or mapped to the hub's errors, and the requests that read or commit at a known head.

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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diloco_lightning.fileio import temp_prefix
from diloco_lightning.hub.base import (
    HubAuthError,
    HubError,
    HubFileTooLargeError,
    HubNotFoundError,
    HubUnavailableError,
)
from diloco_lightning.hub.pacing import CommitBudget, retry_after

log = logging.getLogger(__name__)

__all__ = ["HFRequests", "HubUnavailableError"]

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504}) | frozenset(range(500, 600))
_COMMIT_RE = re.compile(r"[0-9a-f]{40}")
_CHUNK = 8 << 20

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


def _retry_after(headers: Any) -> float | None:
    """Seconds the server asked us to wait (``Retry-After`` in seconds or as an HTTP date, or the
    Hub's ``RateLimit: "api";r=0;t=N``); see :func:`diloco_lightning.hub.pacing.retry_after`."""
    return retry_after(headers)


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



# ----------------------------------------------------------------------------- requests of one repository


class HFRequests:
    """The requests of :class:`~diloco_lightning.hub.hf.HFHub` (a mixin: it reads the hub's
    ``repo_id``, ``revision``, ``endpoint``, ``url``, ``_token``, ``_api``, ``_guard_opts``,
    ``_plain_transient`` and the retry options)."""

    url: str
    repo_id: str
    revision: str
    endpoint: str
    max_retries: int
    retry_base_delay: float
    retry_max_delay: float
    _token: str | bool | None
    _api: Any
    _guard_opts: _GuardOptions
    _plain_transient: tuple[type[BaseException], ...]
    commit_budget: CommitBudget

    def _scrub(self, text: str) -> str:
        tok = self._token
        if isinstance(tok, str) and tok:
            text = text.replace(tok, "<token>")
        return text

    def _backoff(self, attempt: int, retry_after: float | None = None) -> float:
        """The pause before retry ``attempt``: ``min(max, base * 2**(attempt-1))`` jittered to 50-100 %,
        and never shorter than the server's ``Retry-After``."""
        d = min(self.retry_max_delay, self.retry_base_delay * (2 ** (attempt - 1)))
        d = d * (0.5 + 0.5 * random.random())
        if retry_after is not None:
            d = max(d, retry_after)
        return d

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, budget: CommitBudget | None = None,
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
            OfflineModeIsEnabled = ()  # type: ignore[assignment]

        attempt = 0
        while True:
            _ensure_guard()
            token = _GUARD.set(self._guard_opts)
            try:
                return fn(*args, **kwargs)
            except _TransientError as e:
                reason, retry_after, status = str(e), e.retry_after, e.status
            except OfflineModeIsEnabled as e:  # type: ignore[misc]
                raise HubError(f"{what} on {self.url}: HF_HUB_OFFLINE is set; unset it to use an hf:// hub") from e
            except HfHubHTTPError as e:
                response = getattr(e, "response", None)
                status = getattr(response, "status_code", None)
                if status not in _RETRY_STATUS:
                    raise self._map_http_error(e, status, what) from e
                reason, retry_after = f"HTTP {status}", _retry_after(getattr(response, "headers", {}))
            except self._plain_transient as e:  # only reached when the guard is absent
                reason, retry_after, status = f"{type(e).__name__}: {e}", None, None
            finally:
                _GUARD.reset(token)
            attempt += 1
            reason = self._scrub(reason)
            delay = self._backoff(attempt, retry_after)
            if budget is not None and status == 429:
                budget.block(delay)  # the repository's commits wait too, not only this one
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
        info = self._call(
            f"commit ({message})",
            self._api.create_commit,
            self.repo_id,
            operations=operations,
            commit_message=message,
            revision=self.revision,
            parent_commit=parent,
            budget=budget,
        )
        budget.record()
        return getattr(info, "oid", None) or ""

    def _cas_pause(self, attempt: int) -> None:
        time.sleep(random.uniform(0, min(1.0, 0.02 * (2 ** min(attempt, 6)))))

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
