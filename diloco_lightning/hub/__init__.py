"""Hubs: where workers and the master meet. ``open_hub(url)`` picks the transport registered for the
URL's scheme (:mod:`diloco_lightning.hub.transports`: a new one is one file and one registration).

* ``file:///abs/path`` or a plain path: a folder (local disk or a shared network filesystem).
* ``hf://org/repo``: a Hugging Face Hub model repository (``endpoint=``, ``token=``, ``revision=``),
  or, with ``layout="per_node"``, that repository for the master and one per node.
* ``s3://bucket/prefix``: AWS S3 or an S3-compatible store (``endpoint_url=``, ``region=``); needs
  ``pip install 'diloco-lightning[s3]'``.
"""

from __future__ import annotations

import os

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
from diloco_lightning.hub.transports import TRANSPORTS, register_transport, transport_for

__all__ = [
    "open_hub",
    "TRANSPORTS",
    "register_transport",
    "transport_for",
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
    return transport_for(text).from_url(text, **options)
