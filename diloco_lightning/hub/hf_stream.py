"""A streamed GET through ``huggingface_hub``'s shared HTTP client, whichever library that is.

``huggingface_hub`` 0.34-0.x (the lower end of the pinned range, ``huggingface_hub>=0.34``)
shares a ``requests.Session``; 1.0 and later an ``httpx`` client. The ``hf://`` transport reads
small documents with a cap and downloads deltas with a size bound through whichever it is given:
:func:`stream_get` opens the response, :func:`iter_body` yields its body a chunk at a time, and
:func:`read_capped` keeps at most ``limit`` bytes of it (the rest is never read). Both branches
are tested against the loopback Hub server with a real client of each library
(tests/test_hf_stream.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, ContextManager

__all__ = ["is_requests_session", "iter_body", "read_capped", "stream_get"]


def is_requests_session(session: Any) -> bool:
    """Whether ``session`` is a ``requests`` session (``huggingface_hub < 1.0``)."""
    return type(session).__module__.split(".")[0] == "requests"


def stream_get(session: Any, url: str, headers: Mapping[str, str]) -> ContextManager[Any]:
    """A context manager over the streamed response to ``GET url`` (redirects followed); closed on exit."""
    if is_requests_session(session):  # huggingface_hub < 1.0
        return contextlib.closing(session.get(url, headers=dict(headers), stream=True, allow_redirects=True))
    return session.stream("GET", url, headers=dict(headers), follow_redirects=True)  # httpx


def iter_body(response: Any, chunk: int) -> Iterator[bytes]:
    """The response's body, ``chunk`` bytes (at most) at a time, as it arrives."""
    if hasattr(response, "iter_bytes"):  # httpx
        return response.iter_bytes(chunk)
    return response.iter_content(chunk)  # requests


def read_capped(response: Any, limit: int, chunk: int = 1 << 16) -> bytes:
    """At most ``limit`` bytes of the body: reading stops once it has them (a body of gigabytes
    costs ``limit`` bytes of memory, and the rest is not transferred further than one chunk)."""
    data = bytearray()
    for part in iter_body(response, chunk):
        data += part[: limit - len(data)]
        if len(data) >= limit:
            break
    return bytes(data)
