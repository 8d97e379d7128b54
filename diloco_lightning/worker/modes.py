"""What a worker does at a boundary after exporting its delta, in each sync mode.

``async`` (:func:`async_boundary`): hand the delta to the outbox, and install the newest global
version the background fetcher prefetched, if any (with fragments: only the boundary's fragment,
from the newest version, when that version updated it). Never waits, except for the fragments'
backpressure (``worker/outbox.py``).

``lockstep`` (:func:`lockstep_boundary`): queue delta r (uploaded once version r-1 exists), then
wait for version ``r - delay`` and install exactly it: every delta's staleness is exactly
``delay`` (the synchronous DiLoCo of Douillard et al. 2023, with a fixed delay).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from diloco_lightning.worker.install import check_global, install_exact, install_fragment
from diloco_lightning.worker.results import InstallResult
from diloco_lightning.worker.sync import WaitTimeoutError
from diloco_lightning.worker.uploader import Job, Part, UploadReport

if TYPE_CHECKING:  # the worker calls these; a runtime import would be a cycle
    from diloco_lightning.worker.core import DiLoCoWorker

__all__ = ["async_boundary", "lockstep_boundary"]

log = logging.getLogger(__name__)


def async_boundary(w: DiLoCoWorker, part: Part | None, fragment: str | None,
                   reports: list[UploadReport]) -> tuple[InstallResult | None, float]:
    """Boundary of an ``async`` worker ``w``: hold ``part`` (None: a replayed boundary, nothing to
    send), pump the outbox, install what was prefetched. Returns (the install, seconds waited)."""
    assert w._fetcher is not None  # start() made it (async)
    if part is not None:
        w._outbox.hold(Job(fresh=part))
    w._outbox.pump()
    wait = w._outbox.backpressure(reports)
    installed = None
    got = w._fetcher.take()
    if fragment is not None:
        # the newest version is kept and installed one fragment at a time (worker/fragstate.py)
        if got is not None:
            w._frags.keep(got[0], got[1])
            w._fetcher.set_floor(got[0].outer_step)
        w._newest_seen = max(w._newest_seen, got[2] if got is not None else w._fetcher.newest_seen)
        picked = w._frags.take(fragment, w.synced)
        if picked is not None:
            installed = install_fragment(w, fragment, picked[0].outer_step, picked[0], picked[1])
    elif got is not None:
        m, state, newest = got
        installed = w.install_state(m.outer_step, state, newest=newest)
    else:
        w._newest_seen = max(w._newest_seen, w._fetcher.newest_seen)
    w._fetcher.trigger()
    return installed, wait


def lockstep_boundary(w: DiLoCoWorker, part: Part | None, r: int,
                      fragment: str | None = None) -> tuple[InstallResult, float, list[UploadReport]]:
    """Boundary r of a ``lockstep`` worker ``w``: queue delta r (uploaded once version r-1 exists, so
    a master with a quorum of all workers applies exactly one delta per worker per round), then wait
    for version ``r - delay`` and install exactly it. Every delta r then has base ``r - 1 - delay``
    and is applied at outer step ``r - 1``: staleness exactly ``delay`` (``r - 1`` for the first
    ``delay`` boundaries, which start from version 0). Returns (the install, seconds waited, the
    upload reports collected meanwhile)."""
    t0 = time.perf_counter()
    deadline = w._waits.deadline()
    reports: list[UploadReport] = []
    if part is not None:
        w._outbox.uploader.submit(Job(fresh=part), not_before=r - 1)
    target = max(0, r - w.delay)
    first = True
    patience = w._waits.patience(f"global version {target} (lockstep boundary {r}, delay {w.delay})")
    while True:
        w._outbox.collect_into(reports)
        m = None
        try:
            m = w._read_manifest()
        except Exception as e:
            if first:
                log.warning("node %s: cannot read the manifest (%s: %s); retrying", w.node_id, type(e).__name__, e)
                first = False
        if m is not None and m.outer_step >= target:
            check_global(w, m)
            wait = time.perf_counter() - t0
            return install_exact(w, target, m, deadline, fragment), wait, reports
        if time.monotonic() >= deadline:
            raise WaitTimeoutError(
                f"node {w.node_id}: lockstep boundary {r} waited {w.wait_timeout:g} s for global version "
                f"{target} (delay {w.delay}); the hub has {m.outer_step if m is not None else 'none'}"
                f"{' and this node could not upload its deltas' if w.totals['upload_failures_total'] else ''}. "
                f"Is the master running, with min_deltas equal to the number of workers?"
            )
        patience.tick(f"; the hub has {m.outer_step if m is not None else 'no version'}")
        w._waits.pause(w.poll_interval, f"global version {target}")
