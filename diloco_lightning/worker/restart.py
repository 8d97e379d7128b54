"""What the hub already holds of a node: how a worker numbers its deltas and resumes without
sending any progress twice (see ``worker/core.py``'s docstring for the whole argument).

* :func:`hub_seen_high`: the highest ``local_step`` the hub has seen of the node, its highest
  *authentic* delta there or the manifest's ledger, read again after the listing (a delta the
  master processed and deleted meanwhile is in the ledger by then);
* :func:`is_authentic`: whether a delta on the hub is one this node wrote (its header names it;
  in a signed run its signature, checked by streaming, is the run key's);
* :func:`drop_delivered`: the undelivered work of a checkpoint that the hub already covers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from diloco_lightning.wire.delta import DeltaFileError, max_delta_bytes, read_delta_header
from diloco_lightning.hub.base import DeltaRef, Hub
from diloco_lightning.wire.manifest import Manifest
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.wire.layout import LayoutError, read_layout
from diloco_lightning.worker.jobs import Job

__all__ = ["hub_seen_high", "is_authentic", "drop_delivered"]

log = logging.getLogger(__name__)


def is_authentic(hub: Hub, ref: DeltaRef, node_id: str, synced: Mapping[str, torch.Tensor],
                 signing_key: RunKey | None) -> bool:
    """Whether ``ref`` is a delta ``node_id`` really wrote (its header names it; in a signed run its
    signature is the run key's). Downloads at most the honest size of a delta of ``synced``."""
    path = hub.download(ref.path, max_bytes=max_delta_bytes(synced))
    try:
        header = read_delta_header(path)
        if header.node_id != node_id or header.local_step != ref.local_step:
            return False
        if signing_key is not None:
            layout = read_layout(path)
            return signing_key.verify_file(layout.metadata.get("signature"), path, layout)
        return True
    except (DeltaFileError, LayoutError, OSError):
        return False
    finally:
        hub.release(path)


def hub_seen_high(hub: Hub, node_id: str, read_manifest: Callable[[], Manifest | None],
                  authentic: Callable[[DeltaRef], bool] | None = None) -> int:
    """The highest ``local_step`` the hub has seen of ``node_id``: its highest delta on the hub that
    ``authentic`` accepts (every one when None), or the ledger (what the master accepted and may
    have deleted since). The ledger is read again after the listing, so a delta processed and
    deleted in between is not missed."""
    before = read_manifest()
    floor = before.ledger.get(node_id, -1) if before is not None else -1
    refs = sorted(hub.list_node_deltas(node_id, floor), reverse=True)
    after = read_manifest()
    high = max(floor, after.ledger.get(node_id, -1) if after is not None else -1)
    for ref in refs:
        if ref.local_step <= high:
            break
        if authentic is None or authentic(ref):
            return ref.local_step
        log.warning("node %s: %s on %s is not a delta of this node (ignored)", node_id, ref.path, hub.url)
    return high


def drop_delivered(job: Job | None, seen: int, step_offset: int, node_id: str) -> Job | None:
    """``job`` (a checkpoint's undelivered work) without what the hub already holds: a doubtful
    upload at or below step ``seen``, fresh content whose last boundary maps to a step at or below it."""
    if job is None:
        return None
    doubt, fresh = job.doubt, job.fresh
    if doubt is not None and doubt[0] <= seen:
        log.info("node %s: the checkpoint's doubtful delta_%d is on the hub; not sending it again", node_id, doubt[0])
        doubt = None
    if fresh is not None and fresh.boundary + step_offset <= seen:
        log.info("node %s: the checkpoint's undelivered %d phase(s) are on the hub; not sending them again",
                 node_id, fresh.phases)
        fresh = None
    return None if doubt is None and fresh is None else Job(fresh=fresh, doubt=doubt)
