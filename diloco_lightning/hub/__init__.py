"""Hubs: where workers and the master meet. ``open_hub(url)`` picks the transport.

* ``file:///abs/path`` or a plain path: a folder (local disk or a shared network filesystem).
* ``hf://org/repo``: a Hugging Face Hub model repository (``endpoint=``, ``token=``, ``revision=``).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from diloco_lightning.hub.base import (
    DeltaExistsError,
    DeltaRef,
    Hub,
    HubAuthError,
    HubError,
    HubNotFoundError,
    LeaseConflictError,
    PublishConflictError,
)

__all__ = [
    "open_hub",
    "Hub",
    "DeltaRef",
    "HubError",
    "HubAuthError",
    "HubNotFoundError",
    "DeltaExistsError",
    "PublishConflictError",
    "LeaseConflictError",
]


def open_hub(url: str | os.PathLike | Hub, **options) -> Hub:
    """Open the hub at ``url``.

    Options (all transports): ``cache_dir=`` (downloads). ``hf://`` also takes
    ``endpoint=``, ``token=``, ``revision=`` (default ``main``), ``create=`` (create
    the repo if missing, default True), ``private=``, ``max_retries=``.
    ``file://`` also takes ``create=`` (default True).
    """
    if isinstance(url, Hub):
        if options:
            raise ValueError(f"open_hub: options {sorted(options)} given with an already open hub")
        return url
    text = os.fspath(url)
    if text.startswith("hf://"):
        from diloco_lightning.hub.hf import HFHub

        repo_id = text[len("hf://") :].strip("/")
        return HFHub(repo_id, **options)
    if text.startswith("file://"):
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"open_hub: file URL {text!r} names host {parsed.netloc!r}; use file:///abs/path")
        path = Path(unquote(parsed.path))
    elif "://" in text:
        raise ValueError(f"open_hub: unsupported URL scheme in {text!r}; use file:///abs/path, a plain path or hf://org/repo")
    else:
        path = Path(text)
    from diloco_lightning.hub.local import FileHub

    return FileHub(path, **options)
