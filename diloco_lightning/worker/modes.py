"""What a worker does at a boundary after exporting its delta, in each sync mode.

``async`` (:class:`AsyncMode`): hand the delta to the outbox, and install the newest global version
the background fetcher prefetched, if any (with fragments: only the boundary's fragment, from the
newest version, when that version updated it); with ``rebase``, minus this worker's own deltas that
version does not contain yet (``worker/rebase.py``). Never waits, except for the fragments'
backpressure (``worker/outbox.py``).

``lockstep`` (:class:`LockstepMode`): queue delta r (uploaded once version r-1 exists), then wait
for version ``r - delay`` and install exactly it: every delta's staleness is exactly ``delay`` (the
synchronous DiLoCo of Douillard et al. 2023, with a fixed delay).

Both take the boundary's ``part`` (None: a replayed boundary whose delta the hub has, nothing to
send), its number ``r`` and its ``fragment``, and return ``(the install, seconds waited, the upload
reports collected meanwhile)``.
"""

from __future__ import annotations

import logging
import time

from diloco_lightning.util.errors import ConfigError
from diloco_lightning.worker.install import Installer
from diloco_lightning.worker.outbox import Outbox
from diloco_lightning.worker.rebase import WorkerOwnDeltas
from diloco_lightning.worker.results import InstallResult
from diloco_lightning.worker.sync import GlobalFetcher, WaitTimeoutError
from diloco_lightning.worker.jobs import Job, Part, UploadReport
from diloco_lightning.worker.waits import Waits

__all__ = ["AsyncMode", "LockstepMode"]

log = logging.getLogger(__name__)


class AsyncMode:
    """Boundaries of an ``async`` worker: ``fetcher`` prefetches the newest version in the background;
    ``own``: the worker's deltas it rebases onto (None: no rebase)."""

    def __init__(self, installer: Installer, outbox: Outbox, fetcher: GlobalFetcher,
                 own: WorkerOwnDeltas | None = None) -> None:
        self.installer, self.outbox, self.fetcher, self.own = installer, outbox, fetcher, own

    def boundary(self, part: Part | None, r: int, fragment: str | None,
                 reports: list[UploadReport]) -> tuple[InstallResult | None, float, list[UploadReport]]:
        """Hold ``part``, pump the outbox, install what was prefetched."""
        progress, fetcher = self.installer.progress, self.fetcher
        if part is not None and self.own is not None and fragment is None:
            assert part.anchor is not None and part.snapshot is not None  # a fresh part: anchor - snapshot
            self.own.sent(r + progress.offset(), part.anchor, part.snapshot, part.wait)
        if part is not None:
            self.outbox.hold(Job(fresh=part))
        self.outbox.pump()
        wait = self.outbox.backpressure(reports)
        installed = None
        got = fetcher.take()
        if fragment is not None:
            # the newest version is kept and installed one fragment at a time (worker/fragstate.py)
            if got is not None:
                progress.frags.keep(got[0], got[1])
                fetcher.set_floor(got[0].outer_step)
            progress.saw(got[2] if got is not None else fetcher.newest_seen)
            picked = progress.frags.take(fragment, self.installer.model.synced)
            if picked is not None:
                installed = self.installer.install_fragment(fragment, picked[0].outer_step, picked[0], picked[1])
        elif got is not None:
            m, state, newest = got
            start = state if self.own is None else self.own.start(m, state)
            installed = self.installer.install_state(m.outer_step, start, newest=newest)
        else:
            progress.saw(fetcher.newest_seen)
        fetcher.trigger()
        return installed, wait, []


class LockstepMode:
    """Boundaries of a ``lockstep`` worker of staleness ``delay``."""

    def __init__(self, installer: Installer, outbox: Outbox, waits: Waits, delay: int) -> None:
        self.installer, self.outbox, self.waits, self.delay = installer, outbox, waits, delay

    def boundary(self, part: Part | None, r: int, fragment: str | None,
                 reports: list[UploadReport]) -> tuple[InstallResult, float, list[UploadReport]]:
        """Queue delta r (uploaded once version r-1 exists, so a master with a quorum of all workers
        applies exactly one delta per worker per round), then wait for version ``r - delay`` and
        install exactly it. Every delta r then has base ``r - 1 - delay`` and is applied at outer
        step ``r - 1``: staleness exactly ``delay`` (``r - 1`` for the first ``delay`` boundaries,
        which start from version 0)."""
        installer, waits = self.installer, self.waits
        node_id = installer.progress.node_id
        t0 = time.perf_counter()
        deadline = waits.deadline()
        collected: list[UploadReport] = []
        if part is not None:
            self.outbox.uploader.submit(Job(fresh=part), not_before=r - 1)
        target = max(0, r - self.delay)
        first = True
        patience = waits.patience(f"global version {target} (lockstep boundary {r}, delay {self.delay})")
        while True:
            self.outbox.collect_into(collected)
            m = None
            try:
                m = installer.read_manifest()
            except ConfigError:
                raise  # a configuration no retry fixes
            except Exception as e:
                if first:
                    log.warning("node %s: cannot read the manifest (%s: %s); retrying", node_id, type(e).__name__, e)
                    first = False
            if m is not None and m.outer_step >= target:
                installer.check_global(m)
                wait = time.perf_counter() - t0
                return installer.install_exact(target, m, deadline, fragment), wait, collected
            if time.monotonic() >= deadline:
                failures = installer.progress.totals["upload_failures_total"]
                raise WaitTimeoutError(
                    f"node {node_id}: lockstep boundary {r} waited {waits.wait_timeout:g} s for global version "
                    f"{target} (delay {self.delay}); the hub has {m.outer_step if m is not None else 'none'}"
                    f"{' and this node could not upload its deltas' if failures else ''}. "
                    f"Is the master running, with min_deltas equal to the number of workers?"
                )
            patience.tick(f"; the hub has {m.outer_step if m is not None else 'no version'}")
            waits.pause(waits.poll_interval, f"global version {target}")
