"""The end of a worker's training: its last delta on the hub, the node marked finished, and the
run's global model in the user's hands.

:func:`finish_training` (``DiLoCoWorker.finish``, called by both adapters when training ends
normally) does, in order:

1. **delivers** every exported inner phase (the last boundary's delta included), waiting at most
   ``final_wait`` seconds (``WorkerOptions.final_wait``; None: ``wait_timeout``);
2. **marks the node finished** on the hub: the claim it leaves says ``finished`` and its last
   delta's ``local_step`` (:meth:`~diloco_lightning.worker.claim.ClaimKeeper.finish`), what a
   master with ``until_finished`` waits for;
3. with ``final_install`` (the default), **installs the newest global version that contains the
   last delta**: one whose manifest ledger holds this node's last ``local_step`` (the ledger is
   read as :mod:`diloco_lightning.worker.rebase` reads it), loaded and verified as every install is
   (SHA-256, fingerprint, the run key's signature in a signed run). It waits for it at most the
   time left of ``final_wait``, saying so in one line. The local weights are kept, with one line
   saying why, when the wait ends, when the master is gone (the manifest names a lease epoch and
   the hub holds no live lease: a master stopped cleanly releases it), when SIGTERM comes, or when
   the install fails. A worker whose model already holds that exact version (lockstep, or an async
   install of it at the last boundary, with no step trained since) installs nothing again. A last
   delta the master refused (too stale, out of a norm bound) is in no version: once it is gone from
   the hub (a master deletes what it refused with its next publication) and still not in the
   ledger, the newest version is installed without it, a line saying so; a master that publishes
   nothing more leaves the wait to its bound.

The steps trained after the last boundary (a ``max_steps`` that is not a multiple of
``inner_steps``) are in no delta: a final install replaces them by the global version, and a line
says so.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from diloco_lightning.hub.base import Hub
from diloco_lightning.util import faults
from diloco_lightning.wire.manifest import Manifest
from diloco_lightning.worker.results import InstallResult
from diloco_lightning.worker.sync import WorkerStopped

__all__ = ["finish_training", "master_gone"]

# ``worker`` below is the :class:`~diloco_lightning.worker.core.DiLoCoWorker` that calls in (typed Any:
# core imports this module, and a layer never imports back, not even for typing); what is used of it is
# public: its parts ``installer`` (``read_manifest``, ``check_global``, ``install_exact``), ``waits``
# and ``heartbeat``, its ``progress``, ``hub``, ``options`` and ``flush``

log = logging.getLogger(__name__)

#: seconds between two looks (one listing of the node's deltas) for a last delta the master refused
REFUSAL_LOOK = 5.0


def master_gone(hub: Hub, manifest: Manifest | None, now: float | None = None) -> bool:
    """Whether the master that published ``manifest`` is gone: the manifest names its lease epoch
    (a master with a lease) and the hub holds no live lease (released by a clean stop, expired, or
    unreadable). A master without a lease is never taken for gone (the wait's bound ends it)."""
    if manifest is None or not isinstance(manifest.master, dict) or manifest.master.get("epoch") is None:
        return False
    try:
        lease = hub.read_lease()
    except Exception as e:  # noqa: BLE001 - cannot tell: keep waiting (the wait is bounded)
        log.debug("could not read the lease on %s: %s", hub.url, e)
        return False
    return lease is None or lease.unreadable is not None or lease.expired(time.time() if now is None else now)


def _refused(worker: Any, last: int) -> bool:
    """Whether the master refused this node's delta ``last`` (too stale, a norm bound ...): it is gone
    from the hub (a master deletes what it processed with its next publication) and the ledger,
    read after the listing (the publication comes before the deletion), still lacks it."""
    try:
        if worker.hub.list_node_deltas(worker.node_id, after=last - 1):
            return False
        manifest = worker.installer.read_manifest()
    except Exception as e:  # noqa: BLE001 - cannot tell: keep waiting (the wait is bounded)
        log.debug("node %s: could not look for its last delta: %s", worker.node_id, e)
        return False
    return manifest is not None and manifest.ledger.get(worker.node_id, -1) < last


def finish_training(worker: Any, *, trailing_steps: int = 0) -> InstallResult | None:
    """The end of ``worker``'s training (module docstring); the install made, or None when the model
    keeps its weights (``trailing_steps``: optimizer steps trained since the last boundary)."""
    if not worker.started:
        return None
    opts = worker.options
    wait = float(opts.wait_timeout if opts.final_wait is None else opts.final_wait)
    node, url = worker.node_id, worker.hub.url
    deadline = time.monotonic() + wait
    faults.point("worker.finishing")
    try:
        delivered = worker.flush(wait)
    except WorkerStopped:
        delivered = False
    last = worker.progress.boundaries + worker.progress.offset() if worker.progress.boundaries else None
    if delivered:
        worker.heartbeat.finish(last)
    if not opts.final_install:
        return None
    if not delivered:
        log.warning("node %s: keeping the local weights: %d inner phase(s) did not reach %s within %g s, so no global "
                    "version can contain them", node, worker.pending_phases, url, wait)
        return None
    try:
        return _install_final(worker, last, deadline, trailing_steps)
    except WorkerStopped:
        log.warning("node %s: stopped (SIGTERM) while waiting for the final global version; keeping the local weights",
                    node)
    except Exception as e:  # noqa: BLE001 - the training is done: the user keeps the local model, told why
        log.error("node %s: could not install the final global version from %s (%s: %s); keeping the local weights",
                  node, url, type(e).__name__, e)
    return None


def _install_final(worker: Any, last: int | None, deadline: float, trailing_steps: int) -> InstallResult | None:
    node, url = worker.node_id, worker.hub.url
    what = "the newest global version" if last is None else f"the global version that contains its last delta " \
                                                            f"(local_step {last})"
    said = False
    next_look = time.monotonic() + max(worker.poll_interval, REFUSAL_LOOK)
    while True:
        try:
            manifest = worker.installer.read_manifest()
        except WorkerStopped:
            raise
        except Exception as e:  # noqa: BLE001 - an unsigned manifest in a signed run is refused too: wait for an authentic one
            if time.monotonic() >= deadline:
                raise
            log.debug("node %s: reading the manifest for the final install failed: %s", node, e)
            manifest = None
        if manifest is not None and (last is None or manifest.ledger.get(node, -1) >= last):
            break
        if manifest is not None and last is not None and time.monotonic() >= next_look:
            next_look = time.monotonic() + max(worker.poll_interval, REFUSAL_LOOK)
            if _refused(worker, last):
                log.warning("node %s: the master refused its last delta (local_step %d: not in the ledger, gone from "
                            "%s; its log says why); installing the newest global version without it", node, last, url)
                manifest = worker.installer.read_manifest()
                assert manifest is not None  # a hub never goes back to no manifest
                trailing_steps = trailing_steps or 1  # the model is not that version: install it
                break
        if master_gone(worker.hub, manifest):
            log.warning("node %s: the master of %s is gone (no live lease) before publishing %s; keeping the local "
                        "weights", node, url, what)
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("node %s: %s was not published on %s within final_wait; keeping the local weights", node, what,
                        url)
            return None
        if not said:
            log.info("node %s: training done; waiting up to %.0f s for %s on %s (final_install)", node, left, what, url)
            said = True
        worker.waits.pause(min(worker.poll_interval, left), what)
    if manifest.outer_step == worker.outer_step and not trailing_steps:
        log.info("node %s: the model holds global version %d, the run's newest with every delta of this node",
                 node, manifest.outer_step)
        return None
    if trailing_steps:
        log.info("node %s: the %d step(s) trained after the last boundary are in no delta; the global version "
                 "replaces them (choose max_steps a multiple of inner_steps)", node, trailing_steps)
    installer = worker.installer
    installer.check_global(manifest)
    result = installer.install_exact(manifest.outer_step, manifest, max(deadline, time.monotonic() + 1.0))
    log.info("node %s: installed the final global version %d from %s: the model now holds the run's global weights",
             node, result.outer_step, url)
    return result
