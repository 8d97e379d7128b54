"""The guard on ``huggingface_hub``'s shared HTTP client (used by :mod:`diloco_lightning.hub.hf_http`).

``huggingface_hub`` retries some calls on its own (``http_backoff``: preupload, tree
pages, downloads; up to 5 times, sleeping 1-8 s). So that its retries do not multiply
ours, a pass-through wrapper is put around the transport of its shared HTTP client: while
one of our calls runs (a context variable, so other users of the client are untouched) a
retryable status or a network error is raised at once as ``TransientError`` (with the
server's ``Retry-After``), which ``huggingface_hub`` does not retry and ``hf_http`` does; the
wrapper also gives those calls a timeout (``timeout=``; the shared client has none). On a
``huggingface_hub`` whose client cannot be wrapped, its own retries stay (bounded: at most
``6 * (max_retries + 1)`` requests per call). httpx (``huggingface_hub >= 1.0``) and requests
(older) clients are both wrapped.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diloco_lightning.util.errors import DiLoCoError
from diloco_lightning.hub.hf_stream import is_requests_session
from diloco_lightning.hub.pacing import retry_after

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504}) | frozenset(range(500, 600))


class TransientError(DiLoCoError):
    """A retryable failure (429, 5xx, timeout, connection error) seen under our guard."""

    def __init__(self, reason: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.retry_after = retry_after


# ----------------------------------------------------------------------------- guard on the shared client


@dataclass(frozen=True)
class GuardOptions:
    timeout: float | None


GUARD: contextvars.ContextVar[GuardOptions | None] = contextvars.ContextVar("diloco_hf_guard", default=None)
_GUARD_LOCK = threading.Lock()
#: the clients already guarded (weakly held: a client that goes away is forgotten)
_GUARDED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _guarded_send(request: Any, send: Callable[[], Any], transient_exc: tuple[type[BaseException], ...]) -> Any:
    """``send()`` the request under the guard (httpx and requests alike): a network error in
    ``transient_exc`` or a 429/5xx answer (closed) raises ``TransientError``."""
    try:
        response = send()
    except transient_exc as e:
        raise TransientError(f"{type(e).__name__} on {request.method} {request.url}: {e}") from e
    if response.status_code in RETRY_STATUS:
        wait = retry_after(response.headers)
        with contextlib.suppress(Exception):
            response.close()
        raise TransientError(f"HTTP {response.status_code} on {request.method} {request.url}", response.status_code, wait)
    return response


def _make_guard_transport(httpx_mod: Any, inner: Any) -> Any:
    base = httpx_mod.BaseTransport
    transient_exc = (httpx_mod.TimeoutException, httpx_mod.NetworkError, httpx_mod.RemoteProtocolError)

    class _GuardTransport(base):  # type: ignore[misc, valid-type]
        """Pass-through unless a diloco call is running: then 429/5xx and network errors raise
        ``TransientError`` (which ``huggingface_hub`` does not retry), and a timeout is set."""

        _diloco_guard = True

        def __init__(self, inner_transport: Any) -> None:
            self._inner = inner_transport

        def handle_request(self, request: Any) -> Any:
            opts = GUARD.get()
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
            opts = GUARD.get()
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


def ensure_guard() -> None:
    """Wrap the transport(s) of ``huggingface_hub``'s shared client once (see the module docstring)."""
    from huggingface_hub.utils import get_session

    guard_client(get_session())


def _guarded(client: Any) -> bool:
    try:
        return client in _GUARDED
    except TypeError:  # not weakly referable: never marked
        return False


def _mark_guarded(client: Any) -> None:
    with contextlib.suppress(TypeError):
        _GUARDED.add(client)


def guard_client(client: Any) -> None:
    """Wrap the transport(s) of ``client`` (a ``requests.Session``: ``huggingface_hub < 1.0``; an
    ``httpx`` client: 1.0 and later) once: while a call of ours runs (``GUARD`` set), a retryable
    answer or a network error raises ``TransientError``."""
    if _guarded(client):
        return
    with _GUARD_LOCK:
        if _guarded(client):
            return
        try:
            mod = importlib.import_module(type(client).__module__.split(".")[0])
            if is_requests_session(client):
                for prefix, adapter in list(client.adapters.items()):
                    if not getattr(adapter, "_diloco_guard", False):
                        client.adapters[prefix] = _make_requests_guard_adapter(mod, adapter)
                _mark_guarded(client)
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
        _mark_guarded(client)


def plain_transient_types() -> tuple[type[BaseException], ...]:
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


# the names these had before (tests/test_hf_stream.py imports them)
_GUARD, _GuardOptions, _TransientError = GUARD, GuardOptions, TransientError
