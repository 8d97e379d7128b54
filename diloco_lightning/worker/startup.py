"""How a worker starts: a fresh start (with the run's bootstrap), or a restart settled against the hub.

:meth:`Startup.fresh` numbers a new worker's deltas after anything the hub has of its node and
installs its first version; :meth:`Startup.bootstrap` offers this model's weights as
``nodes/<node_id>/init.safetensors`` when the hub has no global yet and waits for a master to
publish outer step 0. :meth:`Startup.settle_restart` is a resumed worker's start: nothing installed,
nothing sent twice (the module docstring of ``worker/core.py`` says why), and :func:`settle_residual`
decides what it still owes of its checkpoint's error-feedback residual, given what the hub already
has of this node (``worker/restart.py`` reads that).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence

from diloco_lightning.encoding.feedback import ErrorFeedback
from diloco_lightning.util.fileio import owner_tag
from diloco_lightning.wire.manifest import Manifest
from diloco_lightning.wire.statefile import save_weights_file
from diloco_lightning.worker.install import Installer
from diloco_lightning.worker.outbox import Outbox
from diloco_lightning.worker.restart import drop_delivered, hub_seen_high, is_authentic
from diloco_lightning.worker.results import InstallResult
from diloco_lightning.worker.sync import WaitTimeoutError
from diloco_lightning.worker.jobs import Job

__all__ = ["Startup", "settle_residual"]

log = logging.getLogger(__name__)


def settle_residual(feedback: ErrorFeedback, job: Job | None, first: int, step_offset: int, seen: int,
                    node_id: str, keys: Sequence[str] | None = None) -> None:
    """A resumed worker's residual (of ``keys``: a fragment's; None: every key), given that the hub
    has this node's deltas up to ``seen``.

    The checkpoint's residual is owed to the first delta sent after it (``first``: the next
    boundary's ``local_step`` that carries these keys, or the held ``job``'s if earlier); if the
    hub has that one, it was sent before the crash with the residual in it: it is owed no more
    (zero, not twice). Otherwise, if the checkpoint's doubtful upload landed, the residual of its
    content is owed (recomputed: the encoding is deterministic).
    """
    if job is not None and job.fresh is not None:
        first = min(first, job.fresh.boundary + step_offset)
    if seen >= first:
        owed = feedback.residual or {}
        if any(k in owed for k in (keys if keys is not None else owed)):
            log.info("node %s: the checkpoint's error-feedback residual%s went out with delta_%d before the restart; "
                     "starting from zero", node_id, "" if keys is None else " of a fragment", first)
        feedback.forget(keys)
    elif job is not None and job.doubt is not None and job.doubt[0] <= seen:
        feedback.absorb(job.doubt[1].materialize())


class Startup:
    """A worker's start (see the module docstring): its ``installer`` (hub, model, progress, waits)
    and ``spool_parent`` (where the offered initial weights are written)."""

    def __init__(self, installer: Installer, spool_parent: str | os.PathLike | None) -> None:
        self.installer = installer
        self.spool_parent = spool_parent

    def hub_seen_high(self, authenticate: bool = True) -> int:
        """The highest ``local_step`` the hub has (or had) of this node: its deltas (only authentic
        ones when ``authenticate``) and the manifest's ledger (``worker/restart.py``)."""
        inst = self.installer
        node_id, synced = inst.progress.node_id, {k: inst.model.params[k] for k in inst.model.synced}
        check = (lambda ref: is_authentic(inst.hub, ref, node_id, synced, inst.signing_key)) if authenticate else None
        return hub_seen_high(inst.hub, node_id, inst.read_manifest, check)

    def bootstrap(self, deadline: float) -> Manifest:
        """No global on the hub yet: offer this model's weights and wait (up to ``deadline``) for outer step 0."""
        inst = self.installer
        hub, waits, node_id = inst.hub, inst.waits, inst.progress.node_id
        with tempfile.TemporaryDirectory(prefix=f"diloco-init-{node_id}-{owner_tag()}", dir=self.spool_parent) as tmp:
            path = os.path.join(tmp, "init.safetensors")
            tensors = {k: t.detach().cpu() for k, t in inst.model.params.items()}
            md = {"format": "diloco-init/1", "node_id": node_id, "model_fingerprint": inst.model.fingerprint}
            if inst.signing_key is not None:  # a master of a signed run adopts only a signed offer
                md["signature"] = inst.signing_key.sign(md, tensors)
            save_weights_file(path, tensors, metadata=md)
            del tensors
            hub_path = waits.retry("offer the initial weights", lambda: hub.upload_init(path, node_id), deadline)
        log.info("node %s: no global version on %s yet; offered %s, waiting for a master to publish outer step 0",
                 node_id, hub.url, hub_path)
        return self._wait_for_manifest(
            0, deadline, "a master to publish outer step 0", lambda m: " (is a master running on this hub?)",
            lambda m: f"node {node_id}: no master published outer step 0 on {hub.url} within "
                      f"{waits.wait_timeout:g} s (is a master running on this hub?)")

    def fresh(self, manifest: Manifest | None, deadline: float, *, lockstep_delay: int | None) -> InstallResult:
        """Start without a checkpoint, bootstrap the run if the hub has no global (``manifest`` None),
        and install the newest version (async: ``lockstep_delay`` None) or version ``boundaries - delay``
        (lockstep).

        A node the hub already knows (an authentic delta of it, or its ledger entry: an earlier life
        of this node delivered work, then died before it wrote a checkpoint, or lost it) is
        *restarting*, not starting fresh, and it **resumes at the hub's step**: its boundary count
        becomes the hub's highest ``local_step`` of it (``seen``), so its next delta is
        ``delta_<seen + 1>`` and every boundary it trains from here is sent. Nothing it trains is a
        replay: it starts from the global it installs (which holds the work it delivered), not from
        the weights of the earlier life. :attr:`Progress.resumed` says how many boundaries it
        skipped, so an adapter moves its trainer on to them (``adapters/lightning.py``: its
        ``max_steps`` then counts the whole run, as after a checkpoint) rather than training them
        again. (Until issue 38 the count started at 0 and the first ``seen`` boundaries were not sent,
        on the assumption that the training loop replays them: a loop that went on instead, or a
        trainer that started from the installed global, lost that work.)"""
        progress = self.installer.progress
        seen = self.installer.waits.retry("read what the hub has of this node", self.hub_seen_high, deadline)
        if seen >= 0:
            progress.delivered_until = max(progress.delivered_until, seen)
            first = progress.boundaries + 1 + progress.step_offset
            if seen >= first:
                skipped = seen - progress.step_offset - progress.boundaries
                progress.boundaries += skipped
                progress.resumed = skipped
                log.warning(
                    "node %s: restarting without a checkpoint; the hub already has this node's work up to delta_%d, so "
                    "it resumes at boundary %d (next delta delta_%d) from the global it installs; the phase in progress "
                    "when the earlier life died is trained again (keep a checkpoint of the worker to keep it)",
                    progress.node_id, seen, progress.boundaries, seen + 1,
                )
        if manifest is None:
            manifest = self.bootstrap(deadline)
        if lockstep_delay is None:
            return self.installer.install_exact(manifest.outer_step, manifest, deadline)
        target = max(0, progress.boundaries - lockstep_delay)
        if manifest.outer_step < target:  # a resumed lockstep node: the version of its boundary may be on its way
            manifest = self.wait_for_version(target, deadline)
        return self.installer.install_exact(target, manifest, deadline)

    def wait_for_version(self, target: int, deadline: float) -> Manifest:
        """The manifest once the hub has version ``target`` (a lockstep node resumed at the hub's step
        while the master publishes its last delta)."""
        inst = self.installer
        return self._wait_for_manifest(
            target, deadline, f"global version {target} (the resumed lockstep boundary)",
            lambda m: f"; the hub has {m.outer_step if m is not None else 'no version'}",
            lambda m: f"node {inst.progress.node_id}: resumed at boundary {inst.progress.boundaries}, it waited "
                      f"{inst.waits.wait_timeout:g} s for global version {target} on {inst.hub.url}; the hub has "
                      f"{m.outer_step if m is not None else 'none'} (is the master running?)")

    def _wait_for_manifest(self, target: int, deadline: float, what: str, hint: Callable[[Manifest | None], str],
                           timeout: Callable[[Manifest | None], str]) -> Manifest:
        """Read the manifest every poll until the hub has version ``target`` or later (checked as a
        global of this model), one patience line now and then (``what``, ``hint``); past ``deadline``
        a :class:`WaitTimeoutError` with ``timeout``'s message."""
        inst = self.installer
        waits = inst.waits
        patience = waits.patience(what)
        while True:
            m = waits.retry("read the manifest", inst.read_manifest, deadline)
            if m is not None and m.outer_step >= target:
                inst.check_global(m)
                return m
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(timeout(m))
            patience.tick(hint(m))
            waits.pause(waits.poll_interval, what)

    def settle_restart(self, deadline: float, outbox: Outbox, feedback: ErrorFeedback) -> None:
        """Start resumed from a checkpoint (``load_anchor_state``): read what the hub has of this node,
        so replayed boundaries it already has are not sent again, and settle the checkpoint's residual
        (``feedback``) and undelivered work (in ``outbox``) accordingly (the model keeps its restored
        weights)."""
        progress = self.installer.progress
        node_id = progress.node_id
        seen = self.installer.waits.retry("read what the hub has of this node", self.hub_seen_high, deadline)
        progress.delivered_until = seen
        first = progress.boundaries + 1 + progress.step_offset
        if seen >= first:
            log.warning(
                "node %s: the hub already has this node's progress up to delta_%d, past this checkpoint (next delta "
                "delta_%d): the inner steps replayed up to boundary %d will not be sent again",
                node_id, seen, first, seen - progress.step_offset,
            )
        plan = self.installer.model.plan
        if plan is None:
            settle_residual(feedback, outbox.jobs.get(None), first, progress.step_offset, seen, node_id)
        else:  # each fragment's residual is owed to that fragment's next delta
            held = {}
            for j in outbox.jobs.values():
                part = j.fresh if j.fresh is not None else (j.doubt[1] if j.doubt is not None else None)
                if part is not None:
                    held[part.fragment] = j
            for name in plan.names:
                r = progress.boundaries + 1
                while plan.fragment_at(r) != name:
                    r += 1
                settle_residual(feedback, held.get(name), r + progress.step_offset, progress.step_offset, seen,
                                node_id, progress.frags.keys(name))
        jobs, outbox.jobs = outbox.jobs, {}
        for job in jobs.values():
            outbox.hold(drop_delivered(job, seen, progress.step_offset, node_id))
