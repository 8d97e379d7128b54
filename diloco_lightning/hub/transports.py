"""Transports: each URL scheme of a hub maps to the one :class:`~diloco_lightning.hub.base.Hub` class
that serves it, and callers ask that class's capabilities, never the scheme.

A transport is one file holding one ``Hub`` subclass that declares

* ``scheme``: the URL scheme it serves (``"file"`` also serves a plain path, whose scheme is ``""``);
* ``url_forms``: how its URLs are written (the error for an unknown scheme lists every transport's);
* its capabilities, as class attributes: ``creatable`` (``open_hub(create=True)`` creates a
  missing hub), ``rate_limited_writes``, ``private_downloads`` (see :class:`~diloco_lightning.hub.base.Hub`);
* ``from_url(url, **options)``: the hub at ``url``, refusing options that are not its own;

plus one registration, :func:`register_transport`. The built-in transports (a folder, ``hf://``,
``s3://``) are registered here, on first use; :func:`~diloco_lightning.hub.open_hub` opens a
URL through :func:`transport_for`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping

from diloco_lightning.hub.base import Hub
from diloco_lightning.hub.options import scheme_of

__all__ = ["TRANSPORTS", "known_url", "register_transport", "scheme_of", "transport_for", "unregister_transport", "url_forms"]

_registry: dict[str, type[Hub]] = {}
_loaded = False
_lock = threading.RLock()  # the first use may come from several threads at once


def _builtins() -> dict[str, type[Hub]]:
    """The registry, with the built-in transports registered first (on first use: importing
    ``diloco_lightning.hub`` stays light)."""
    global _loaded
    with _lock:
        if not _loaded:
            from diloco_lightning.hub.hf import HFHub
            from diloco_lightning.hub.hf_nodes import HFNodesHub
            from diloco_lightning.hub.local import FileHub
            from diloco_lightning.hub.s3 import S3Hub

            HFHub.layouts.setdefault("per_node", HFNodesHub)  # hf://'s other layout (open_hub's layout=)
            _loaded = True
            for cls in (FileHub, HFHub, S3Hub):
                register_transport(cls)
    return _registry


class _Transports(Mapping[str, "type[Hub]"]):
    """The read-only view :data:`TRANSPORTS`."""

    def __getitem__(self, scheme: str) -> type[Hub]:
        return _builtins()[scheme]

    def __iter__(self) -> Iterator[str]:
        return iter(_builtins())

    def __len__(self) -> int:
        return len(_builtins())

    def __repr__(self) -> str:
        return f"TRANSPORTS({dict(_builtins())!r})"


#: Registry scheme -> transport class (read-only; :func:`register_transport` adds one).
TRANSPORTS: Mapping[str, type[Hub]] = _Transports()


def register_transport(cls: type[Hub], *, replace: bool = False) -> type[Hub]:
    """Register ``cls`` as the transport of ``cls.scheme`` (returns ``cls``: usable as a decorator).

    Raises:
        ValueError: ``cls`` declares no scheme, or the scheme is taken (unless ``replace``).
    """
    scheme = getattr(cls, "scheme", None)
    if not isinstance(scheme, str) or not scheme or scheme != scheme.lower() or "://" in scheme:
        raise ValueError(f"register_transport: {cls.__name__} must declare a lower-case scheme, got {scheme!r}")
    if not callable(getattr(cls, "from_url", None)):
        raise ValueError(f"register_transport: {cls.__name__} has no from_url(url, **options)")
    registry = _builtins()
    if scheme in registry and registry[scheme] is not cls and not replace:
        raise ValueError(f"register_transport: scheme {scheme!r} is already {registry[scheme].__name__}'s")
    registry[scheme] = cls
    return cls


def unregister_transport(scheme: str) -> None:
    """Forget the transport of ``scheme`` (a test's toy transport); an unknown scheme is ignored."""
    _builtins().pop(scheme, None)


def url_forms() -> str:
    """Every registered transport's URL forms, as one phrase (``"a, b or c"``)."""
    forms = [form for cls in _builtins().values() for form in cls.url_forms]
    return forms[0] if len(forms) == 1 else ", ".join(forms[:-1]) + " or " + forms[-1]


def transport_for(url: str | os.PathLike) -> type[Hub]:
    """The transport class serving ``url`` (a plain path: the folder's).

    Raises:
        ValueError: an unknown scheme, in one line listing the URL forms of every registered transport.
    """
    text = os.fspath(url)
    scheme = scheme_of(text) or "file"
    # schemes are matched as written (``file`` in any case: RFC 8089's)
    cls = _builtins().get(scheme) if scheme == "file" or text.startswith(scheme + "://") else None
    if cls is None:
        raise ValueError(f"open_hub: unsupported URL scheme in {text!r}; use {url_forms()}")
    return cls


def known_url(url: str | os.PathLike) -> bool:
    """Whether a registered transport serves ``url`` (what :func:`transport_for` would not refuse)."""
    try:
        transport_for(url)
    except ValueError:
        return False
    return True
