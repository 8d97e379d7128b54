"""Hubs: where workers and the master meet. ``open_hub(url)`` picks the transport.

* ``file:///abs/path`` or a plain path: a folder (local disk or a shared network filesystem).
* ``hf://org/repo``: a Hugging Face Hub model repository (``endpoint=``, ``token=``, ``revision=``),
  or, with ``layout="per_node"``, that repository for the master and one per node.
* ``s3://bucket/prefix``: AWS S3 or an S3-compatible store (``endpoint_url=``, ``region=``); needs
  ``pip install 'diloco-lightning[s3]'``.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

from diloco_lightning.hub.base import (
    ClaimConflictError,
    DeltaExistsError,
    DeltaRef,
    Hub,
    HubAuthError,
    HubError,
    HubNotFoundError,
    HubUnavailableError,
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
    "HubUnavailableError",
    "DeltaExistsError",
    "PublishConflictError",
    "LeaseConflictError",
    "ClaimConflictError",
]


def open_hub(url: str | os.PathLike | Hub, **options) -> Hub:
    """Open the hub at ``url``.

    Options (all transports): ``cache_dir=`` (downloads; default ``$DILOCO_CACHE_DIR`` (or the older ``$DILOCO_CACHE``) or
    ``~/.cache/diloco_lightning``, one folder per hub URL).

    ``file://`` / a plain path: ``create=`` (create the folder, default True).

    ``hf://org/repo``: ``endpoint=`` (default the Hub's), ``token=`` (default ``HF_TOKEN``
    / the cached login; never logged), ``revision=`` (an existing branch, default
    ``main``), ``create=`` (create the repo if missing, default True), ``private=``,
    ``max_retries=``, ``retry_base_delay=``, ``retry_max_delay=`` (jittered exponential
    backoff on 5xx, 429, timeouts and connection errors only; a ``Retry-After`` is honoured),
    ``timeout=`` (seconds per HTTP call, default 120), ``max_cas_attempts=`` (re-reads when
    only ``nodes/`` moved under a publication), ``commits_per_hour=`` / ``commit_burst=``
    (the commit budget per repository, default 128 an hour: :mod:`diloco_lightning.hub.pacing`),
    ``layout=`` (``"shared"``: one repository, the default; ``"per_node"``: the master's
    repository plus one per node, ``node_repo=`` naming them, default ``"{repo}-{node}"``:
    :mod:`diloco_lightning.hub.hf_nodes`).

    ``s3://bucket/prefix`` (boto3; credentials from its standard chain, never from options):
    ``endpoint_url=`` (MinIO, R2, ...; default boto3's: AWS, or ``$AWS_ENDPOINT_URL_S3``),
    ``region=``, ``addressing_style=`` (``path`` / ``virtual`` / ``auto``), ``max_retries=``,
    ``retry_base_delay=``, ``retry_max_delay=`` (as for hf://; botocore's own retries are
    off), ``timeout=`` (seconds per connect/read, default 60),
    ``multipart_threshold=`` / ``part_size=`` (bytes; default 64 MiB / 32 MiB),
    ``check_conditional_writes=`` (probe at open that the store honours ``If-None-Match`` /
    ``If-Match``, default True). See :mod:`diloco_lightning.hub.s3`.
    """
    if isinstance(url, Hub):
        if options:
            raise ValueError(f"open_hub: options {sorted(options)} given with an already open hub")
        return url
    text = os.fspath(url)
    if not isinstance(text, str):
        raise TypeError(f"open_hub: expected a URL or path string, got {text!r}")
    if text.startswith("hf://"):
        from diloco_lightning.hub.hf import HFHub
        from diloco_lightning.hub.hf_nodes import LAYOUTS, HFNodesHub

        repo_id = text[len("hf://") :].strip("/")
        layout = options.pop("layout", None) or "shared"
        if layout not in LAYOUTS:
            raise ValueError(f"open_hub: layout must be one of {list(LAYOUTS)}, got {layout!r}")
        if layout == "per_node":
            return HFNodesHub(repo_id, **options)
        if options.pop("node_repo", None) is not None:
            raise ValueError("open_hub: node_repo applies to layout='per_node' only")
        return HFHub(repo_id, **options)
    if text.startswith("s3://"):
        from diloco_lightning.hub.s3 import S3_OPTIONS, S3Hub, parse_s3_url

        bucket, prefix = parse_s3_url(text)
        # options meant for other transports are accepted when unset (None), as for the folder hub
        unknown = sorted(k for k, v in options.items() if k not in S3_OPTIONS and v is not None)
        if unknown:
            raise ValueError(
                f"open_hub: option(s) {unknown} do not apply to the S3 hub {text!r} (it takes {sorted(S3_OPTIONS)})"
            )
        return S3Hub(bucket, prefix, **{k: v for k, v in options.items() if k in S3_OPTIONS})
    if text.lower().startswith("file:"):
        parsed = urlparse(text)
        if not text.lower().startswith("file://"):
            raise ValueError(f"open_hub: malformed file URL {text!r}; use file:///abs/path")
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"open_hub: file URL {text!r} names host {parsed.netloc!r}; use file:///abs/path")
        if parsed.query or parsed.fragment:
            raise ValueError(f"open_hub: file URL {text!r} has a query or fragment; use file:///abs/path")
        path = Path(unquote(parsed.path))
        if not path.is_absolute():
            raise ValueError(f"open_hub: file URL {text!r} has no absolute path; use file:///abs/path")
    elif "://" in text:
        raise ValueError(
            f"open_hub: unsupported URL scheme in {text!r}; use file:///abs/path, a plain path, hf://org/repo or "
            "s3://bucket/prefix"
        )
    elif not text:
        raise ValueError("open_hub: empty hub URL")
    else:
        path = Path(text)
    from diloco_lightning.hub.local import FileHub

    # options meant for remote transports are accepted when unset (None), so one config serves both
    unknown = sorted(k for k, v in options.items() if k not in _FILE_OPTIONS and v is not None)
    if unknown:
        raise ValueError(f"open_hub: option(s) {unknown} do not apply to the folder hub {text!r} (it takes {sorted(_FILE_OPTIONS)})")
    return FileHub(path, **{k: v for k, v in options.items() if k in _FILE_OPTIONS})


_FILE_OPTIONS = frozenset({"cache_dir", "create"})
