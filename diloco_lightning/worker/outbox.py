"""A worker's exported work that is not yet on the hub: what it holds, and when it hands it over.

The training thread exports a :class:`~diloco_lightning.worker.jobs.Part` at each boundary;
the :class:`Outbox` holds it as a :class:`~diloco_lightning.worker.jobs.Job` until the
background :class:`~diloco_lightning.worker.uploader.Uploader` is free (and the hub's commit
budget allows an upload), takes back what failed (merged into the next delta: nothing is lost),
counts what was delivered in the worker's totals, and blocks when it must (a flush, a whole
cycle of fragment deltas held). See ``worker/uploader.py`` for the delivery rules.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from typing import Any

from diloco_lightning.hub import Hub
from diloco_lightning.worker.sync import WaitTimeoutError, WorkerError
from diloco_lightning.worker.jobs import Job, Part, UploadReport, merge_jobs
from diloco_lightning.worker.uploader import Uploader, retry_pause
from diloco_lightning.worker.waits import Waits

__all__ = ["Outbox"]

log = logging.getLogger(__name__)


def _part_of(job: Job) -> Part:
    """The part that names a job's place (its fresh content, else its doubtful attempt)."""
    if job.fresh is not None:
        return job.fresh
    assert job.doubt is not None  # a job that is not empty has fresh content or a doubtful attempt
    return job.doubt[1]


class Outbox:
    """The held jobs of one worker, and its hand-over to the uploader.

    ``totals`` is the worker's counter dict (updated in place); ``fragments``: the fragment count
    (None: no fragments, one merged job). The uploader is attached at start (:meth:`attach`).
    """

    def __init__(self, hub: Hub, node_id: str, totals: MutableMapping[str, Any], waits: Waits, *,
                 poll_interval: float, wait_timeout: float, fragments: int | None = None) -> None:
        self.hub = hub
        self.node_id = node_id
        self.totals = totals
        self.waits = waits
        self.poll_interval = poll_interval
        self.wait_timeout = wait_timeout
        self.fragments = fragments
        #: exported work not yet handed to the uploader: one merged job (key None) without fragments; with
        #: fragments one job per boundary (its key), never merged, sent in boundary order (see :meth:`hold`)
        self.jobs: dict[int | None, Job] = {}
        self._uploader: Uploader | None = None
        #: failed uploads since the last delivery: the retry pause doubles with it, and only the 1st,
        #: 2nd, 4th, 8th ... failure in a row is logged as a warning (a hub that keeps refusing is no storm)
        self.failures_in_row = 0

    def attach(self, uploader: Uploader) -> None:
        self._uploader = uploader

    @property
    def uploader(self) -> Uploader:
        # only called once the worker started (it attaches the uploader in start())
        assert self._uploader is not None, "the worker is not started"
        return self._uploader

    @property
    def pending_phases(self) -> int:
        """Inner phases exported but not yet known to be on the hub (queued, in flight, or held)."""
        held = sum(j.phases for j in self.jobs.values())
        return held + (self._uploader.queued_phases if self._uploader is not None else 0)

    @property
    def idle(self) -> bool:
        """Nothing held and nothing being uploaded."""
        return not self.jobs and not self.uploader.busy

    def hold(self, job: Job | None, *, older: bool = False) -> None:
        """Keep ``job`` for a later upload, merged with what is held (``older``: it came before what
        is held, e.g. a failed upload coming back).

        With fragments nothing is merged: each boundary's delta is its own job, and jobs go to the hub
        in boundary order. Merging a fragment's held delta with its next one would let another
        fragment's later delta reach the hub first, and a delta at ``local_step`` s must mean that
        every boundary up to s is on the hub (what a restarted worker relies on not to send a
        replayed boundary twice, or to lose one). At most ``F`` jobs are held (one cycle of the
        fragments, about one model's worth of memory): beyond that the boundary waits for the
        uploads (:meth:`backpressure`)."""
        if job is None or job.empty:
            return
        part = _part_of(job)
        key = None if part.fragment is None else part.boundary
        held = self.jobs.pop(key, None)
        merged = merge_jobs(job, held) if older else merge_jobs(held, job)
        if merged is not None and not merged.empty:
            self.jobs[key] = merged

    def take_next(self) -> Job:
        """The held job to upload next: a doubtful one first (nothing new is attempted before it is
        resolved), else the oldest boundary's, so the deltas of a node reach the hub in increasing
        ``local_step`` across fragments (the master's high-water mark)."""
        def order(key: int | None) -> tuple[bool, int]:
            job = self.jobs[key]
            return job.doubt is None, _part_of(job).boundary
        return self.jobs.pop(min(self.jobs, key=order))

    def collect(self) -> list[UploadReport]:
        """The uploader's reports since the last call, counted in the totals; a failed upload's
        phases are held again (merged into the next delta)."""
        reports = self._uploader.collect() if self._uploader is not None else []
        fatal = None
        for rep in reports:
            self.totals["phases_delivered_total"] += rep.recovered_phases
            if rep.ok:
                self.failures_in_row = 0
                if rep.local_step is not None:
                    self.totals["deltas_uploaded_total"] += 1
                    self.totals["bytes_uploaded_total"] += rep.nbytes
                    self.totals["phases_delivered_total"] += rep.phases
                continue
            self.totals["upload_failures_total"] += 1
            self.failures_in_row += 1
            fatal = fatal or rep.fatal
            n = self.failures_in_row
            say = log.warning if n & (n - 1) == 0 else log.debug  # the 1st, 2nd, 4th, 8th ... in a row
            if rep.remaining is not None:
                say("node %s: delta upload failed (%s); %d inner phase(s) kept and merged into the next delta "
                    "(%d failure(s) in a row, %d in all)",
                    self.node_id, rep.error or rep.fatal, rep.remaining.phases, n, self.totals["upload_failures_total"])
                self.hold(rep.remaining, older=True)
            else:
                say("node %s: delta upload failed (%s); retrying it (%d failure(s) in a row, %d in all)",
                    self.node_id, rep.error, n, self.totals["upload_failures_total"])
        if fatal is not None:
            raise WorkerError(fatal)
        return reports

    def retry_pause(self) -> float:
        """Seconds before the next attempt after a failure: the poll interval doubling with each failure
        in a row (up to 30 s), and no sooner than the hub's commit budget or Retry-After allows."""
        return max(retry_pause(self.poll_interval, self.failures_in_row), self.commit_wait())

    def collect_into(self, reports: list[UploadReport]) -> list[UploadReport]:
        got = self.collect()
        reports.extend(got)
        return got

    def pump(self, force: bool = False) -> None:
        """Hand what is unsent to the uploader when it is free, unless the hub's commit budget asks
        to wait (``Hub.commit_wait``): then it stays held and the next boundary's delta is merged
        into it, instead of the upload meeting the hub's rate limit. ``force`` (a flush) sends
        anyway: the transport then waits for the budget itself."""
        if self.jobs and not self.uploader.busy:
            if not force:
                wait = self.commit_wait()
                if wait > 0:
                    self.totals["uploads_paced_total"] += 1
                    log.debug("node %s: the commit budget of %s allows the next upload in %.1fs; %d phase(s) held and "
                              "merged with the next delta", self.node_id, self.hub.url, wait,
                              sum(j.phases for j in self.jobs.values()))
                    return
            self.uploader.submit(self.take_next())

    def commit_wait(self) -> float:
        try:
            return max(0.0, float(self.hub.commit_wait(self.node_id)))
        except Exception as e:  # noqa: BLE001 - pacing is advice: never a reason to lose a boundary
            log.debug("node %s: no commit budget from %s: %s", self.node_id, self.hub.url, e)
            return 0.0

    def deliver_pending(self, deadline: float, reports: list[UploadReport], what: str) -> None:
        """Block until everything handed over so far is on the hub (retrying failures)."""
        while True:
            failed = any(not rep.ok for rep in self.collect_into(reports))
            if self.idle:
                return
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(
                    f"node {self.node_id}: could not upload its pending delta(s) to {self.hub.url} within "
                    f"{self.wait_timeout:g} s ({what})"
                )
            if failed:  # a doubling pause, and not before the hub's commit budget or Retry-After allows
                time.sleep(min(self.retry_pause(), max(0.0, deadline - time.monotonic())))
            self.pump(force=True)
            self.uploader.wait_idle(min(self.poll_interval, max(0.0, deadline - time.monotonic())))

    def backpressure(self, reports: list[UploadReport]) -> float:
        """Fragments: while a whole cycle of fragments (``F`` deltas) is held, wait for the uploads
        (retrying failures; a hub outage longer than ``inner_steps`` steps of training stops the
        training here, up to ``wait_timeout``). Returns the seconds waited."""
        if self.fragments is None or len(self.jobs) < self.fragments:
            return 0.0
        t0 = time.perf_counter()
        deadline = self.waits.deadline()
        patience = self.waits.patience(f"the upload of {len(self.jobs)} held fragment delta(s) to {self.hub.url}")
        while len(self.jobs) >= self.fragments:
            failed = any(not rep.ok for rep in self.collect_into(reports))
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(
                    f"node {self.node_id}: could not upload its held fragment deltas to {self.hub.url} within "
                    f"{self.wait_timeout:g} s"
                )
            if failed:
                time.sleep(min(self.retry_pause(), max(0.0, deadline - time.monotonic())))
                patience.tick()
            self.pump(force=True)
            self.uploader.wait_idle(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
        return time.perf_counter() - t0
