"""The framework-free DiLoCo worker (the Lightning and Accelerate adapters are thin shells).

:class:`DiLoCoWorker` is given the tensors of a model (named parameters and persistent
buffers, the ones to install into) and, at every boundary (every ``inner_steps`` optimizer
steps, decided by the adapter), does:

1. **export**: a CPU FP32 copy of every floating parameter (``snapshot``; pinned and
   non-blocking when the model is on CUDA). The pseudo-gradient ``anchor - snapshot`` is
   computed, encoded (``delta_dtype``, with error feedback: ``encoding/feedback.py``), written and
   uploaded by the background uploader, so the training thread pays for one copy of the
   weights and nothing else.
2. **anchor moves** to the snapshot (the next delta covers only the next inner phase), or to
   the global version installed at this boundary.
3. **install** a newer global version, in place (``param.data.copy_``: optimizer and DDP
   references stay valid). ``async``: the newest one, prefetched by a background thread;
   ``lockstep``: exactly version ``r - delay`` at the r-th boundary, waiting for it.

Nothing is lost: a delta that cannot be uploaded (hub down, upload still running) is merged
into the next one (cumulative, with the older ``base_outer_step``), and the worker's
checkpoint state (:meth:`anchor_state`) carries the anchor, anything not yet delivered and the
error-feedback residual (what the encoding of the deltas sent so far dropped).
See ``diloco_lightning/worker/uploader.py`` for the delivery rules.

Nothing is sent twice either, across the worker's own crashes. A delta's ``local_step`` is
the last boundary it covers plus the node's ``step_offset`` (checkpointed). A worker resumed
from a checkpoint older than its last upload (killed after a delta reached the hub, before the
next checkpoint) replays the inner steps since the checkpoint. At start it reads what the
hub has seen of this node: the highest *authentic* delta it holds for the node (its header
checked, its signature too in a signed run: a file someone else put there does not count)
and the manifest's ledger, read again *after* the listing (a delta the master processed and
deleted meanwhile is in the ledger by then). Every replayed boundary up to that step was
delivered before the crash: its pseudo-gradient is not sent again (the anchor moves on as
usual), and undelivered work from the checkpoint that the hub already covers is dropped.
A worker restarted *without* a checkpoint replays nothing: it installs the global (which holds
what it delivered) and resumes at the hub's step, its boundary count set to it
(:attr:`DiLoCoWorker.resumed_boundaries`: the Lightning adapter moves the trainer on by that many
phases), so every boundary it trains from there is sent (issue 38).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

import torch

from diloco_lightning.util import faults, timeline
from diloco_lightning.encoding.feedback import ErrorFeedback
from diloco_lightning.util.fileio import make_owned_dir, sweep_owned_dirs
from diloco_lightning.wire.fragments import FragmentPlan
from diloco_lightning.hub.versions import read_verified_manifest
from diloco_lightning.hub import Hub, open_hub
from diloco_lightning.wire.names import validate_node_id
from diloco_lightning.wire.signing import RunKey, load_run_key
from diloco_lightning.worker import checkpoint
from diloco_lightning.worker.export import export_part
from diloco_lightning.worker.fragstate import FragmentBook
from diloco_lightning.worker.heartbeat import Heartbeat
from diloco_lightning.worker.install import Installer
from diloco_lightning.worker.modes import AsyncMode, LockstepMode
from diloco_lightning.worker.options import DELTA_DTYPES, SYNC_MODES, WorkerOptions, parse_delta_dtype, takes_options
from diloco_lightning.worker.pacing import Pacing
from diloco_lightning.worker.outbox import Outbox
from diloco_lightning.worker.params import LocalModel, module_state
from diloco_lightning.worker.progress import Progress
from diloco_lightning.worker.rebase import WorkerOwnDeltas
from diloco_lightning.worker.results import BoundaryResult, InstallResult
from diloco_lightning.worker.waits import Waits
from diloco_lightning.worker.startup import Startup
from diloco_lightning.worker.sync import GlobalFetcher, WaitTimeoutError, WorkerError
from diloco_lightning.worker.jobs import Part, UploadReport
from diloco_lightning.worker.uploader import Uploader

log = logging.getLogger(__name__)

__all__ = ["DiLoCoWorker", "BoundaryResult", "InstallResult", "UploadReport", "WorkerError", "WaitTimeoutError",
           "SYNC_MODES", "DELTA_DTYPES", "parse_delta_dtype", "module_state"]

#: spool folders of dead workers (of another host, or without an owner tag) are removed once this old
SPOOL_MAX_AGE = 24 * 3600.0
#: files in the download cache that no process of this host owns are removed once unchanged this long
CACHE_MAX_AGE = 3600.0


class DiLoCoWorker:
    """One DiLoCo worker (see the module docstring).

    Args:
        hub: a :class:`~diloco_lightning.hub.Hub` or a URL for ``open_hub`` (with ``hub_options``).
        node_id: this worker's name on the hub (``[A-Za-z0-9._-]``, 1-64 characters).
        params: ``name -> tensor`` to sync and install into (use :func:`module_state`); the
            floating ones travel in deltas, integer buffers are only installed.
        options: the worker's :class:`~diloco_lightning.worker.options.WorkerOptions`, passed whole
            (each option's meaning and default is written there). Instead of ``options``, its fields
            may be given as keywords (``DiLoCoWorker(hub, "w0", params, sync="lockstep", delay=2)``;
            the signature lists them, an unknown one is a ``TypeError`` naming the valid ones).
        node_index: this worker's index for a list/distribution ``delay`` (default: the number
            ending ``node_id``).
        signing_key: a :class:`~diloco_lightning.wire.signing.RunKey`, key text/bytes, or None to
            take ``DILOCO_RUN_KEY`` / ``DILOCO_RUN_KEY_FILE`` from the environment (unsigned
            when neither is set).
        hub_options: options for ``open_hub`` when ``hub`` is a URL.
        spool_dir: where delta files are written before upload (default: a temporary folder).
        claim: claim ``node_id`` on the hub at start (``nodes/<node_id>/claim.json``), so a second
            live worker with the same id refuses to start (:mod:`diloco_lightning.worker.claim`);
            the heartbeat runs every ``claim_ttl / 2``.
        pacing: the :class:`~diloco_lightning.worker.pacing.Pacing` the adapter drives (inner
            steps, Dynamic Local Updates, the throttle; see ``WorkerOptions.pacing``): at each
            boundary the worker asks it for the next phase's H (``BoundaryResult.inner_steps``)
            and reports its speed in the claim's heartbeat. None: a plain one (the caller decides
            boundaries; only tokens per second and the last local step are reported).

    The options are checked by :meth:`WorkerOptions.validate` (an ``OptionError``, a ``ValueError``,
    naming the option).
    """

    @takes_options
    def __init__(
        self,
        hub: Hub | str | os.PathLike,
        node_id: str,
        params: Mapping[str, torch.Tensor],
        options: WorkerOptions | None = None,
        *,
        node_index: int | None = None,
        signing_key: RunKey | str | bytes | None = None,
        hub_options: Mapping[str, Any] | None = None,
        spool_dir: str | os.PathLike | None = None,
        claim: bool = True,
        pacing: Pacing | None = None,
        **option_values: Any,
    ) -> None:
        self.node_id = validate_node_id(node_id)
        self.options = WorkerOptions.given(options, option_values, who="DiLoCoWorker").validate(self.node_id, node_index)
        opts = self.options
        self.sync = opts.sync
        self.delay = opts.resolved_delay(self.node_id, node_index)
        self.encoding, self.error_feedback = opts.encoding, opts.feedback
        self.error_feedback_decay = float(opts.error_feedback_decay)
        self.delta_dtype = self.encoding.name
        self.wait_timeout = float(opts.wait_timeout)
        self.poll_interval = float(opts.poll_interval)
        self.model = LocalModel.of(params, opts.fragments)
        self.pacing = _pacing(pacing, self.model.plan)
        self.signing_key = load_run_key(signing_key)
        self.hub = open_hub(hub, **dict(hub_options or {}))
        self._spool_parent = spool_dir
        #: what this worker has done (checkpointed): worker/progress.py
        self.progress = Progress(self.node_id, FragmentBook(self.model.plan))
        #: the encoding and its residual; the uploader owns it once started (worker/uploader.py)
        self._feedback = ErrorFeedback(self.encoding, self.error_feedback, self.error_feedback_decay)
        self._uploader: Uploader | None = None  # also the outbox's (attached at start)
        self._fetcher: GlobalFetcher | None = None
        self._mode: AsyncMode | LockstepMode | None = None  # what a boundary does after its export (at start)
        self._spool: str | None = None
        self._started = False
        self._closed = False
        #: every wait of this worker: bounded, said out loud, ended by :meth:`request_stop` (worker/waits.py)
        self.waits = Waits(self.node_id, self.hub.url, wait_timeout=self.wait_timeout, poll_interval=self.poll_interval)
        #: exported work not yet handed to the uploader, and the hand-over (worker/outbox.py)
        self._outbox = Outbox(self.hub, self.node_id, self.progress.totals, self.waits, poll_interval=self.poll_interval,
                              wait_timeout=self.wait_timeout, fragments=self.model.plan.count if self.model.plan else None)

        def prefetch_from(outer_step: int) -> None:  # a whole version installed: the prefetcher looks above it
            if self._fetcher is not None:
                self._fetcher.set_floor(outer_step)

        #: installs global versions into the params; its ``read_manifest()`` reads the hub's manifest,
        #: refused (``UnauthenticatedVersionError``) if a signed run's is not signed (worker/install.py)
        self.installer = Installer(self.hub, self.model, self.progress, signing_key=self.signing_key, waits=self.waits,
                                   read_manifest=functools.partial(read_verified_manifest, self.hub, self.signing_key),
                                   on_whole_install=prefetch_from)
        self._startup = Startup(self.installer, spool_dir)
        #: this node's claim on its id and its heartbeat's reports (``claim=False``: no claim; worker/heartbeat.py)
        self.heartbeat = Heartbeat(self.hub, self.node_id, self.pacing, ttl=opts.claim_ttl, signing_key=self.signing_key,
                                   claim=claim)

    # ------------------------------------------------------------------ properties

    @property
    def started(self) -> bool:
        return self._started

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return self.model.params

    @property
    def fingerprint(self) -> str:
        return self.model.fingerprint

    @property
    def plan(self) -> FragmentPlan | None:
        """The fragments (Streaming DiLoCo; ``diloco_lightning/wire/fragments.py``), None: one delta of every key."""
        return self.model.plan

    @property
    def boundaries(self) -> int:
        return self.progress.boundaries

    @property
    def outer_step(self) -> int | None:
        """The outer step of the anchor's base (None before the start)."""
        return self.progress.outer_step

    @property
    def totals(self) -> dict[str, Any]:
        """Running totals (uploads, bytes, installs, waits), kept across a resume."""
        return self.progress.totals

    @property
    def resumed_boundaries(self) -> int:
        """Boundaries a start without a checkpoint skipped to resume at the hub's step (0 otherwise):
        the node's earlier life delivered them, so the caller's training loop should move on by that
        many phases (the Lightning adapter advances the trainer's step) rather than train them again
        (``worker/startup.py``, :meth:`Startup.fresh`)."""
        return self.progress.resumed

    @property
    def next_local_step(self) -> int:
        """The ``local_step`` of the next delta this worker sends (boundaries replayed after a
        restart, whose deltas the hub already has, send nothing)."""
        return self.progress.next_local_step()

    @property
    def pending_phases(self) -> int:
        """Inner phases exported but not yet known to be on the hub (queued, in flight, or held)."""
        return self._outbox.pending_phases

    @property
    def anchor(self) -> dict[str, torch.Tensor] | None:
        return self.progress.anchor

    @property
    def fragment_base(self) -> dict[str, tuple[int, int]]:
        """Per fragment: (base_outer_step, the fragment's outer step count) of its anchor (empty without fragments)."""
        return self.progress.frags.base

    # ------------------------------------------------------------------ start

    def request_stop(self) -> None:
        """End every blocking wait (bootstrap, lockstep, hub retries) with ``WorkerStopped``: what an
        adapter calls on SIGTERM. Uploading what is pending (``flush``, ``close``) still runs."""
        self.waits.stop()

    def start(self) -> InstallResult | None:
        """Connect to the hub and get the starting weights (idempotent; ``boundary`` calls it).

        Fresh start: with no global on the hub, offer this model's weights as
        ``nodes/<node_id>/init.safetensors`` and wait for outer step 0; then install the newest
        version (async) or version 0 (lockstep). After :meth:`load_anchor_state` (a resume) the
        model keeps its restored weights and nothing is installed; boundaries replayed since the
        checkpoint whose deltas the hub already has are not sent again (module docstring).
        """
        if self._closed:
            raise WorkerError("this worker is closed")
        if self._started:
            return None
        deadline = self.waits.deadline()
        self.heartbeat.acquire(self.waits, deadline)  # before anything is offered or sent
        sweep_owned_dirs(self._spool_parent, "diloco-", SPOOL_MAX_AGE)
        try:  # what an earlier life killed mid-download left in the download cache
            swept = self.hub.sweep_cache(CACHE_MAX_AGE)
            if swept:
                log.info("node %s: removed %d file(s) dead processes left in %s", self.node_id, len(swept),
                         self.hub.cache_dir)
        except OSError as e:
            log.debug("node %s: could not sweep %s: %s", self.node_id, self.hub.cache_dir, e)
        manifest = self.waits.retry("read the manifest", self.installer.read_manifest, deadline)
        if manifest is not None:
            self.installer.check_global(manifest)
        installed = None
        if self.progress.restored:
            self._startup.settle_restart(deadline, self._outbox, self._feedback)
        else:
            installed = self._startup.fresh(manifest, deadline, lockstep_delay=self.delay if self.sync == "lockstep" else None)
        timeline.mark("global_installed")
        self._spool = make_owned_dir(self._spool_parent, f"diloco-{self.node_id}-")
        plan = self.model.plan
        uploader = self._uploader = Uploader(
            self.hub, self.node_id, step_offset=self.progress.step_offset, spool_dir=self._spool,
            feedback=self._feedback, model_fingerprint=self.fingerprint, signing_key=self.signing_key,
            hub_high_step=self._startup.hub_seen_high, persistent=self.sync == "lockstep",
            retry_interval=self.poll_interval, read_manifest=self.installer.read_manifest,
            fragments=plan.count if plan is not None else 1,
        )
        self.progress.hand_offset_to(lambda: uploader.step_offset)
        self._outbox.attach(uploader)
        if self.sync == "async":
            # an async start installed a version (or restored an anchor with its outer step): the floor
            assert self.outer_step is not None
            self._fetcher = GlobalFetcher(
                self.hub, self.node_id, self.fingerprint, poll_interval=self.poll_interval, floor=self.outer_step,
                signing_key=self.signing_key,
            )
            self._mode = AsyncMode(self.installer, self._outbox, self._fetcher,  # rebase: worker/rebase.py
                                   WorkerOwnDeltas(self.node_id, lookahead=self.options.lookahead)
                                   if self.options.rebase and plan is None else None)
        else:
            self._mode = LockstepMode(self.installer, self._outbox, self.waits, self.delay)
        self._started = True
        if self._outbox.jobs:
            self._outbox.pump()
        log.info("node %s: started at outer_step %s (next local_step %d, sync=%s%s)", self.node_id, self.outer_step,
                 self.next_local_step, self.sync, f", delay={self.delay}" if self.sync == "lockstep" else "")
        return installed

    # ------------------------------------------------------------------ boundary

    def boundary(self, num_tokens: int | None = None, train_loss: float | None = None) -> BoundaryResult:
        """End an inner phase: export ``anchor - local``, hand it to the uploader, install a
        newer global (see the module docstring). Optional: ``num_tokens`` trained on since the last
        boundary (in the delta header), ``train_loss`` (in the heartbeat: the master watches it)."""
        if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0):
            raise ValueError(f"num_tokens must be a non-negative integer or None, got {num_tokens!r}")
        self.heartbeat.note_loss(train_loss)
        self.heartbeat.check()  # another process took this node id over: never send under it
        self.start()
        progress = self.progress
        t0 = time.perf_counter()
        r = progress.boundaries + 1
        reports = self._outbox.collect()
        fragment = self.plan.fragment_at(r) if self.plan is not None else None
        base = progress.outer_step if fragment is None else progress.frags.base[fragment][0]
        assert base is not None  # start() installed or restored a version
        part: Part | None = export_part(self.model, progress, progress.frags.tokens(fragment, num_tokens), fragment)
        faults.point("worker.exported")
        progress.boundaries = r
        inner_steps = self.heartbeat.end_phase(num_tokens, r + progress.offset(),
                                               int(self.totals.get("phases_replayed_total", 0)))
        if progress.delivered(r):  # reached the hub before a crash (module docstring)
            log.warning("node %s: boundary %d was delivered before the restart (delta_%d on the hub): this replay of it "
                        "is dropped, not sent again (reported as replayed)", self.node_id, r, r + progress.offset())
            self.totals["phases_replayed_total"] += 1
            part = None
        assert self._mode is not None  # made at start
        installed, wait, more = self._mode.boundary(part, r, fragment, reports)
        reports += more
        self.pacing.resume()
        seconds = time.perf_counter() - t0
        self.totals["wait_seconds_total"] += wait
        self.totals["boundaries_total"] += 1
        self.totals["boundary_seconds_total"] += seconds
        assert progress.outer_step is not None  # set at start, never unset
        return BoundaryResult(
            boundary=r,
            base_outer_step=base,
            outer_step=progress.outer_step,
            installed=installed,
            uploads=reports,
            pending_phases=self.pending_phases,
            wait_seconds=wait,
            seconds=seconds,
            inner_steps=inner_steps,
        )

    # ------------------------------------------------------------------ flush / close

    def flush(self, timeout: float | None = None) -> bool:
        """Upload everything exported so far, retrying failures; True when nothing is left."""
        if not self._started:
            return not self._outbox.jobs
        deadline = self.waits.deadline(timeout)
        self._outbox.collect()
        if self.pending_phases:
            log.info("node %s: waiting (up to %g s) for %d inner phase(s) to reach %s", self.node_id,
                     self.wait_timeout if timeout is None else timeout, self.pending_phases, self.hub.url)
        try:
            self._outbox.deliver_pending(deadline, [], "flush")
        except WaitTimeoutError:
            return False
        return True

    def finish(self, *, trailing_steps: int = 0) -> InstallResult | None:
        """The end of training (``worker/final.py``): deliver what is pending, mark this node finished
        on the hub and, with ``final_install``, install the newest global version holding its last
        delta (None: the model keeps its weights, a line says why). Then :meth:`close`."""
        from diloco_lightning.worker.final import finish_training

        return finish_training(self, trailing_steps=trailing_steps)

    def close(self, flush: bool = True, timeout: float | None = None) -> bool:
        """Stop the background threads (after a :meth:`flush` when ``flush``); True when every
        exported phase reached the hub."""
        if self._closed:
            return True
        ok = True
        if self._started:
            if flush:
                ok = self.flush(timeout)
            else:
                self._outbox.collect()
                ok = self._outbox.idle
            if not ok:
                log.error(
                    "node %s: closing with %d inner phase(s) not uploaded to %s (they are in the last checkpoint's "
                    "DiLoCo state if one was saved after they were exported)",
                    self.node_id, self.pending_phases, self.hub.url,
                )
            self._outbox.uploader.close(timeout=5.0)
            self.progress.take_offset_back()
            if self._fetcher is not None:
                self._fetcher.close(timeout=5.0)
            if self._spool is not None:
                shutil.rmtree(self._spool, ignore_errors=True)
        self.heartbeat.release()
        self._closed = True
        return ok

    def __enter__(self) -> "DiLoCoWorker":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close(flush=exc[0] is None)

    # ------------------------------------------------------------------ state (worker/progress.py, checkpoint.py)

    def state_dict(self) -> dict[str, Any]:
        """Small counters (no tensors): :meth:`Progress.state_dict`."""
        return self.progress.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (before :meth:`start`)."""
        if self._started:
            raise WorkerError("load_state_dict must be called before the worker starts")
        self.progress.load_state_dict(state)

    def anchor_state(self, timeout: float | None = None) -> dict[str, Any]:
        """The anchor (CPU FP32) and whatever is not yet on the hub, for a checkpoint.

        An upload in flight is recorded as a doubtful delta, not waited for (a restarted worker asks
        the hub whether it landed: ``checkpoint.settle_uploads``); in lockstep and with fragments the
        checkpoint waits for it, up to ``timeout`` (default ``wait_timeout``). Failed uploads are not
        retried here (a hub outage never blocks checkpointing beyond one attempt).
        """
        if self.progress.anchor is None:
            raise WorkerError("the worker has no anchor yet (call start() first)")
        in_flight = None
        if self._started:
            in_flight, feedback = checkpoint.settle_uploads(
                self._outbox, self.wait_timeout if timeout is None else timeout, self.node_id)
        else:
            feedback = self._uploader.feedback_state() if self._uploader is not None else self._feedback.state_dict()
        return checkpoint.anchor_state(self.progress, self.model, self._outbox, feedback, in_flight)

    def load_anchor_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`anchor_state` (before :meth:`start`): the first delta after resume is
        then the true pseudo-gradient of the interrupted inner phase."""
        if self._started:
            raise WorkerError("load_anchor_state must be called before the worker starts")
        checkpoint.load_anchor_state(self.progress, self.model, self._outbox, self._feedback, state)


def _pacing(pacing: Pacing | None, plan: FragmentPlan | None) -> Pacing:
    """The adapter's ``pacing``, or a plain one (the caller decides boundaries)."""
    if pacing is not None and not isinstance(pacing, Pacing):
        raise ValueError(f"pacing must be a Pacing or None, got {type(pacing).__name__}")
    pacing = pacing if pacing is not None else Pacing(None)
    if plan is not None and pacing.auto:
        raise ValueError(f"fragments={plan.count} cannot be combined with inner_steps='auto' (Dynamic Local "
                         f"Updates) yet: give a fixed inner_steps, a multiple of the fragment count")
    return pacing
