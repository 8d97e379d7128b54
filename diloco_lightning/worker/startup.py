"""How a worker starts: a fresh start (with the run's bootstrap), or a restart settled against the hub.

:func:`fresh_start` numbers a new worker's deltas after anything the hub has of its node and
installs its first version; :func:`bootstrap` offers this model's weights as
``nodes/<node_id>/init.safetensors`` when the hub has no global yet and waits for a master to
publish outer step 0. :func:`settle_restart` is a resumed worker's start: nothing installed,
nothing sent twice (the module docstring of ``worker/core.py`` says why), and
:func:`settle_residual` decides what it still owes of its checkpoint's error-feedback residual,
given what the hub already has of this node (``worker/restart.py`` reads that).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import TYPE_CHECKING

from diloco_lightning.encoding.feedback import ErrorFeedback
from diloco_lightning.util.fileio import owner_tag
from diloco_lightning.wire.manifest import Manifest
from diloco_lightning.wire.statefile import save_weights_file
from diloco_lightning.worker.install import check_global, install_exact
from diloco_lightning.worker.restart import drop_delivered, hub_seen_high, is_authentic
from diloco_lightning.worker.results import InstallResult
from diloco_lightning.worker.sync import WaitTimeoutError
from diloco_lightning.worker.uploader import Job

if TYPE_CHECKING:  # the worker calls these; a runtime import would be a cycle
    from diloco_lightning.worker.core import DiLoCoWorker

__all__ = ["hub_seen_high_of", "bootstrap", "fresh_start", "settle_restart",
           "settle_residual"]

log = logging.getLogger(__name__)


def hub_seen_high_of(w: DiLoCoWorker, authenticate: bool = True) -> int:
    """The highest ``local_step`` the hub has (or had) of worker ``w``'s node: its deltas (only
    authentic ones when ``authenticate``) and the manifest's ledger (``worker/restart.py``)."""
    synced = {k: w.params[k] for k in w.synced}
    check = (lambda ref: is_authentic(w.hub, ref, w.node_id, synced, w.signing_key)) if authenticate else None
    return hub_seen_high(w.hub, w.node_id, w._read_manifest, check)


def bootstrap(w: DiLoCoWorker, deadline: float) -> Manifest:
    """No global on the hub yet: offer ``w``'s weights and wait (up to ``deadline``) for outer step 0."""
    with tempfile.TemporaryDirectory(prefix=f"diloco-init-{w.node_id}-{owner_tag()}", dir=w._spool_parent) as tmp:
        path = os.path.join(tmp, "init.safetensors")
        tensors = {k: t.detach().cpu() for k, t in w.params.items()}
        md = {"format": "diloco-init/1", "node_id": w.node_id, "model_fingerprint": w.fingerprint}
        if w.signing_key is not None:  # a master of a signed run adopts only a signed offer
            md["signature"] = w.signing_key.sign(md, tensors)
        save_weights_file(path, tensors, metadata=md)
        del tensors
        hub_path = w._waits.retry("offer the initial weights", lambda: w.hub.upload_init(path, w.node_id), deadline)
    log.info("node %s: no global version on %s yet; offered %s, waiting for a master to publish outer step 0",
             w.node_id, w.hub.url, hub_path)
    patience = w._waits.patience("a master to publish outer step 0")
    while True:
        m = w._waits.retry("read the manifest", w._read_manifest, deadline)
        if m is not None:
            check_global(w, m)
            return m
        if time.monotonic() >= deadline:
            raise WaitTimeoutError(
                f"node {w.node_id}: no master published outer step 0 on {w.hub.url} within "
                f"{w.wait_timeout:g} s (is a master running on this hub?)"
            )
        patience.tick(" (is a master running on this hub?)")
        w._waits.pause(w.poll_interval, "a master to publish outer step 0")


def settle_residual(feedback: ErrorFeedback, job: Job | None, first: int, step_offset: int, seen: int,
                    node_id: str) -> None:
    """A resumed worker's residual, given that the hub has this node's deltas up to ``seen``.

    The checkpoint's residual is owed to the first delta sent after it (``first``: the next
    boundary's ``local_step``, or the held ``job``'s if earlier); if the hub has that one, it was
    sent before the crash with the residual in it: it is owed no more (zero, not twice).
    Otherwise, if the checkpoint's doubtful upload landed, the residual of its content is owed
    (recomputed: the encoding is deterministic).
    """
    if job is not None and job.fresh is not None:
        first = min(first, job.fresh.boundary + step_offset)
    if seen >= first:
        if feedback.residual is not None:
            log.info("node %s: the checkpoint's error-feedback residual went out with delta_%d before the restart; "
                     "starting from zero", node_id, first)
        feedback.forget()
    elif job is not None and job.doubt is not None and job.doubt[0] <= seen:
        feedback.absorb(job.doubt[1].materialize())


def fresh_start(w: DiLoCoWorker, manifest: Manifest | None, deadline: float) -> InstallResult:
    """Start worker ``w`` without a checkpoint, bootstrap the run if the hub has no global
    (``manifest`` None), and install the newest version (async) or version ``boundaries - delay``
    (lockstep).

    A node the hub already knows (an authentic delta of it, or its ledger entry: an earlier life
    of this node delivered work, then died before it wrote a checkpoint, or lost it) is
    *restarting*, not starting fresh: the training loop replays its inner phases from the start,
    the very work the hub has, so the boundaries up to that step are not sent again
    (``delivered_until``, as after a checkpoint older than the last upload), and numbering goes on
    from there. Numbering the replayed work after the hub's deltas instead would apply it twice."""
    seen = w._waits.retry("read what the hub has of this node", lambda: hub_seen_high_of(w), deadline)
    if seen >= 0:
        w.delivered_until = max(w.delivered_until, seen)
        first = w.boundaries + 1 + w.step_offset
        if seen >= first:
            log.warning(
                "node %s: restarting without a checkpoint; the hub already has this node's work up to delta_%d, so "
                "the inner steps replayed up to boundary %d are not sent again (keep a checkpoint of the worker to "
                "resume without replaying them)", w.node_id, seen, seen - w.step_offset,
            )
    if manifest is None:
        manifest = bootstrap(w, deadline)
    target = manifest.outer_step if w.sync == "async" else max(0, w.boundaries - w.delay)
    return install_exact(w, target, manifest, deadline)


def settle_restart(w: DiLoCoWorker, deadline: float) -> None:
    """Start worker ``w`` resumed from its checkpoint (``load_anchor_state``): read what the hub has
    of its node, so replayed boundaries it already has are not sent again, and settle the
    checkpoint's residual and undelivered work accordingly (the model keeps its restored weights)."""
    seen = w._waits.retry("read what the hub has of this node", lambda: hub_seen_high_of(w), deadline)
    w.delivered_until = seen
    if seen >= w.boundaries + 1 + w.step_offset:
        log.warning(
            "node %s: the hub already has this node's progress up to delta_%d, past this checkpoint (next delta "
            "delta_%d): the inner steps replayed up to boundary %d will not be sent again",
            w.node_id, seen, w.boundaries + 1 + w.step_offset, seen - w.step_offset,
        )
    outbox = w._outbox
    settle_residual(w._feedback, outbox.jobs.get(None), w.boundaries + 1 + w.step_offset, w.step_offset, seen,
                    w.node_id)
    jobs, outbox.jobs = outbox.jobs, {}
    for job in jobs.values():
        outbox.hold(drop_delivered(job, seen, w.step_offset, w.node_id))
