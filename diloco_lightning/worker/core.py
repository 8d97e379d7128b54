"""The framework-free DiLoCo worker (the Lightning and Accelerate adapters are thin shells).

:class:`DiLoCoWorker` is given the tensors of a model (named parameters and persistent
buffers, the ones to install into) and, at every boundary (every ``inner_steps`` optimizer
steps, decided by the adapter), does:

1. **export**: a CPU FP32 copy of every floating parameter (``snapshot``; pinned and
   non-blocking when the model is on CUDA). The pseudo-gradient ``anchor - snapshot`` is
   computed, encoded (``delta_dtype``, with error feedback: ``compression.py``), written and
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
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import torch

from diloco_lightning import faults
from diloco_lightning.compression import ErrorFeedback
from diloco_lightning.deltafile import (
    model_fingerprint,
    synced_keys,
)
from diloco_lightning.fileio import make_owned_dir, owner_tag, sweep_owned_dirs
from diloco_lightning.fragments import FragmentPlan, build_plan, fragment_count
from diloco_lightning.globals import read_verified_manifest
from diloco_lightning.hub import Hub, HubNotFoundError, open_hub
from diloco_lightning.manifest import Manifest
from diloco_lightning.names import validate_node_id
from diloco_lightning.signing import RunKey, load_run_key
from diloco_lightning.statefile import save_weights_file
from diloco_lightning.worker.claim import ClaimKeeper
from diloco_lightning.worker.checkpoint import (
    STATE_VERSION,
    pack_residual,
    pack_unsent,
    step_offset_of,
    unpack_residual,
    unpack_unsent,
)
from diloco_lightning.worker.options import DELTA_DTYPES, SYNC_MODES, parse_delta_dtype, resolve_encoding
from diloco_lightning.worker.pacing import Pacing
from diloco_lightning.worker.params import copy_into, module_state
from diloco_lightning.worker.results import BoundaryResult, InstallResult
from diloco_lightning.worker.waits import Waits
from diloco_lightning.worker.restart import drop_delivered, hub_high_step, hub_seen_high, is_authentic
from diloco_lightning.worker.sync import (
    GlobalFetcher,
    WaitTimeoutError,
    WorkerError,
    load_version,
    resolve_delay,
)
from diloco_lightning.worker.uploader import (
    Job,
    Part,
    Uploader,
    UploadReport,
    merge_jobs,
)

log = logging.getLogger(__name__)

__all__ = [
    "DiLoCoWorker",
    "BoundaryResult",
    "InstallResult",
    "UploadReport",
    "WorkerError",
    "WaitTimeoutError",
    "SYNC_MODES",
    "DELTA_DTYPES",
    "parse_delta_dtype",
    "module_state",
]

#: spool folders of dead workers (of another host, or without an owner tag) are removed once this old
SPOOL_MAX_AGE = 24 * 3600.0


class DiLoCoWorker:
    """One DiLoCo worker (see the module docstring).

    Args:
        hub: a :class:`~diloco_lightning.hub.Hub` or a URL for ``open_hub`` (with ``hub_options``).
        node_id: this worker's name on the hub (``[A-Za-z0-9._-]``, 1-64 characters).
        params: ``name -> tensor`` to sync and install into (use :func:`module_state`); the
            floating ones travel in deltas, integer buffers are only installed.
        sync: ``"async"`` (install the newest version at each boundary, never wait) or
            ``"lockstep"`` (at boundary r, wait for version ``r - delay`` and install exactly it;
            the first ``delay`` boundaries install version 0).
        delay: lockstep delay: an int, a per-node list, or a seeded distribution
            (:func:`~diloco_lightning.worker.sync.resolve_delay`).
        node_index: this worker's index for a list/distribution ``delay`` (default: the number
            ending ``node_id``).
        delta_dtype: the encoding on the wire: ``"float32"`` (default), ``"bfloat16"``,
            ``"float16"``, ``"int8"``, ``"int4"`` or ``"topk"`` (``docs/encoding.md``; the worker
            computes in FP32 and encodes once).
        topk: ``delta_dtype="topk"``: the fraction of each tensor's entries sent.
        topk_values: ``delta_dtype="topk"``: ``"int8"`` or ``"int4"`` values.
        error_feedback: add what the encoding dropped to the next delta (None: on for int8, int4
            and topk, off for the float casts); the residual is part of :meth:`anchor_state`.
        signing_key: a :class:`~diloco_lightning.signing.RunKey`, key text/bytes, or None to
            take ``DILOCO_RUN_KEY`` / ``DILOCO_RUN_KEY_FILE`` from the environment (unsigned
            when neither is set).
        wait_timeout: seconds a blocking wait may last (bootstrap, lockstep, the final flush)
            before ``WaitTimeoutError``; keep it below a DDP process-group timeout.
        poll_interval: seconds between manifest reads while waiting, and of the async prefetcher.
        spool_dir: where delta files are written before upload (default: a temporary folder).
        claim: claim ``node_id`` on the hub at start (``nodes/<node_id>/claim.json``), so a second
            live worker with the same id refuses to start (:mod:`diloco_lightning.worker.claim`).
        claim_ttl: seconds the claim lives without a heartbeat (None: 60 on a folder hub, 900 on
            ``hf://``); the heartbeat runs every ``claim_ttl / 2``.
        pacing: the :class:`~diloco_lightning.worker.pacing.Pacing` the adapter drives (inner
            steps, Dynamic Local Updates, the throttle; see ``WorkerOptions.pacing``): at each
            boundary the worker asks it for the next phase's H (``BoundaryResult.inner_steps``)
            and reports its speed in the claim's heartbeat. None: a plain one (the caller decides
            boundaries; only tokens per second and the last local step are reported).
    """

    def __init__(
        self,
        hub: Hub | str | os.PathLike,
        node_id: str,
        params: Mapping[str, torch.Tensor],
        *,
        sync: str = "async",
        delay: Any = 0,
        node_index: int | None = None,
        delta_dtype: Any = "float32",
        topk: float = 0.01,
        topk_values: str = "int8",
        error_feedback: bool | None = None,
        signing_key: RunKey | str | bytes | None = None,
        hub_options: Mapping[str, Any] | None = None,
        wait_timeout: float = 1200.0,
        poll_interval: float = 1.0,
        spool_dir: str | os.PathLike | None = None,
        claim: bool = True,
        claim_ttl: float | None = None,
        pacing: Pacing | None = None,
        fragments: Any = None,
    ) -> None:
        self.node_id = validate_node_id(node_id)
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
        self.sync = sync
        self.delay = resolve_delay(delay, node_id, node_index)
        self.delta_dtype = parse_delta_dtype(delta_dtype)
        self.encoding, self.error_feedback = resolve_encoding(delta_dtype, topk, topk_values, error_feedback)
        for name, value in (("wait_timeout", wait_timeout), ("poll_interval", poll_interval)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.wait_timeout = float(wait_timeout)
        self.poll_interval = float(poll_interval)
        if not isinstance(params, Mapping) or not params:
            raise ValueError("params must be a non-empty mapping name -> tensor (e.g. module_state(model))")
        for k, t in params.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"params[{k!r}] is a {type(t).__name__}, not a tensor")
        self.params: dict[str, torch.Tensor] = dict(params)
        self.synced = synced_keys(self.params)
        if not self.synced:
            raise ValueError("params has no floating-point tensor to sync")
        self.fingerprint = model_fingerprint(self.params)
        #: the fragments (Streaming DiLoCo; ``diloco_lightning/fragments.py``), None: one delta of every key
        self.plan: FragmentPlan | None = build_plan(fragments, {k: self.params[k] for k in self.synced})
        if self.plan is not None and self.error_feedback:
            raise ValueError(f"fragments={fragment_count(fragments)} cannot be combined with error feedback yet "
                             f"(delta_dtype={self.encoding.name}): pass error_feedback=False or a float delta_dtype")
        self._pin = any(t.device.type == "cuda" for t in self.params.values()) and torch.cuda.is_available()
        self.signing_key = load_run_key(signing_key)
        self.hub = open_hub(hub, **dict(hub_options or {}))
        self._spool_parent = spool_dir

        # progress (checkpointed)
        self.boundaries = 0
        self.outer_step: int | None = None  # outer_step of the anchor's base
        self._anchor: dict[str, torch.Tensor] | None = None
        self.step_offset = 0  # local_step = boundary + step_offset (delta_<r> is the r-th boundary's in a clean run)
        #: exported work not yet handed to the uploader: one merged job (key None) without fragments; with
        #: fragments one job per boundary (its key), never merged, sent in boundary order (see :meth:`_hold`)
        self._jobs: dict[int | None, Job] = {}
        #: per fragment: (base_outer_step, the fragment's outer step count) of its anchor
        self.fragment_base: dict[str, tuple[int, int]] = {}
        #: per fragment: tokens trained on since its last delta
        self._frag_tokens: dict[str, int | None] = {n: 0 for n in (self.plan.names if self.plan else ())}
        #: fragments: the newest prefetched version, whose fragments are installed one by one
        self._latest: tuple[Manifest, dict[str, torch.Tensor]] | None = None
        #: the encoding and its residual; the uploader owns it once started (worker/uploader.py)
        self._feedback = ErrorFeedback(self.encoding, self.error_feedback)
        self._restored = False  # anchor and counters came from this node's checkpoint
        #: the highest local_step the hub had seen of this node when it resumed from a checkpoint:
        #: replayed boundaries up to it were delivered before the crash (never sent again)
        self.delivered_until = -1
        # totals (not part of the model's state, but kept across resume)
        self.totals = {
            "deltas_uploaded_total": 0,
            "bytes_uploaded_total": 0,
            "phases_delivered_total": 0,
            "upload_failures_total": 0,
            "uploads_paced_total": 0,  # boundaries whose delta was held back for the hub's commit budget
            "installs_total": 0,
            "wait_seconds_total": 0.0,
            "boundaries_total": 0,
            "boundary_seconds_total": 0.0,  # training-thread time spent in boundary() (waits included)
        }
        self._uploader: Uploader | None = None
        self._fetcher: GlobalFetcher | None = None
        self._spool: str | None = None
        self._started = False
        self._closed = False
        self._newest_seen = -1
        self._waits = Waits(self)
        if pacing is not None and not isinstance(pacing, Pacing):
            raise ValueError(f"pacing must be a Pacing or None, got {type(pacing).__name__}")
        self.pacing = pacing if pacing is not None else Pacing(None)
        if self.plan is not None and self.pacing.auto:
            raise ValueError(f"fragments={self.plan.count} cannot be combined with inner_steps='auto' (Dynamic Local "
                             f"Updates) yet: give a fixed inner_steps, a multiple of the fragment count")
        self._reported = False
        self._claim_keeper = (
            ClaimKeeper(self.hub, self.node_id, ttl=claim_ttl, watch_peers=self.pacing.auto and self.pacing.dylu_seconds is None)
            if claim else None
        )
        if self._claim_keeper is not None:
            self._claim_keeper.set_info(self.pacing.report().to_info())

    # ------------------------------------------------------------------ properties

    @property
    def started(self) -> bool:
        return self._started

    def _offset(self) -> int:
        return self._uploader.step_offset if self._uploader is not None else self.step_offset

    @property
    def next_local_step(self) -> int:
        """The ``local_step`` of the next delta this worker sends (boundaries replayed after a
        restart, whose deltas the hub already has, send nothing)."""
        return max(self.boundaries + 1 + self._offset(), self.delivered_until + 1)

    def _read_manifest(self) -> Manifest | None:
        """The hub's manifest, refused (``UnauthenticatedVersionError``) if a signed run's is not signed."""
        return read_verified_manifest(self.hub, self.signing_key)

    @property
    def pending_phases(self) -> int:
        """Inner phases exported but not yet known to be on the hub (queued, in flight, or held)."""
        held = sum(j.phases for j in self._jobs.values())
        return held + (self._uploader.queued_phases if self._uploader is not None else 0)

    @property
    def anchor(self) -> dict[str, torch.Tensor] | None:
        return self._anchor

    # ------------------------------------------------------------------ start

    def request_stop(self) -> None:
        """End every blocking wait (bootstrap, lockstep, hub retries) with ``WorkerStopped``: what an
        adapter calls on SIGTERM. Uploading what is pending (``flush``, ``close``) still runs."""
        self._waits.stop()

    def _hub_high_step(self) -> int:
        return hub_high_step(self.hub, self.node_id)

    def _hub_seen_high(self, authenticate: bool = True) -> int:
        synced = {k: self.params[k] for k in self.synced}
        check = (lambda ref: is_authentic(self.hub, ref, self.node_id, synced, self.signing_key)) if authenticate else None
        return hub_seen_high(self.hub, self.node_id, self._read_manifest, check)

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
        deadline = self._waits.deadline()
        if self._claim_keeper is not None and self._claim_keeper.claim is None and self._claim_keeper.supported:
            # before anything is offered or sent: a second live worker with this node_id stops here
            self._waits.retry("claim the node id", self._claim_keeper.acquire, deadline)
        sweep_owned_dirs(self._spool_parent, "diloco-", SPOOL_MAX_AGE)
        manifest = self._waits.retry("read the manifest", self._read_manifest, deadline)
        if manifest is not None:
            self._check_fingerprint(manifest)
        installed = None
        if self._restored:
            seen = self._waits.retry("read what the hub has of this node", self._hub_seen_high, deadline)
            self.delivered_until = seen
            if seen >= self.boundaries + 1 + self.step_offset:
                log.warning(
                    "node %s: the hub already has this node's progress up to delta_%d, past this checkpoint (next delta "
                    "delta_%d): the inner steps replayed up to boundary %d will not be sent again",
                    self.node_id, seen, self.boundaries + 1 + self.step_offset, seen - self.step_offset,
                )
            self._settle_residual(seen)
            jobs, self._jobs = self._jobs, {}
            for job in jobs.values():
                self._hold(drop_delivered(job, seen, self.step_offset, self.node_id))
        else:
            # a fresh start numbers its deltas after anything the hub has (or had) of this node
            seen = self._waits.retry("read what the hub has of this node", lambda: self._hub_seen_high(False), deadline)
            self.step_offset = max(self.step_offset, seen - self.boundaries)
            if manifest is None:
                manifest = self._bootstrap(deadline)
            target = manifest.outer_step if self.sync == "async" else max(0, self.boundaries - self.delay)
            installed = self._install_exact(target, manifest, deadline)
        self._spool = make_owned_dir(self._spool_parent, f"diloco-{self.node_id}-")
        self._uploader = Uploader(
            self.hub,
            self.node_id,
            step_offset=self.step_offset,
            spool_dir=self._spool,
            feedback=self._feedback,
            model_fingerprint=self.fingerprint,
            signing_key=self.signing_key,
            hub_high_step=self._hub_high_step,
            persistent=self.sync == "lockstep",
            retry_interval=self.poll_interval,
            read_manifest=self._read_manifest,
            fragments=self.plan.count if self.plan is not None else 1,
        )
        if self.sync == "async":
            self._fetcher = GlobalFetcher(
                self.hub, self.node_id, self.fingerprint, poll_interval=self.poll_interval, floor=self.outer_step,
                signing_key=self.signing_key,
            )
        self._started = True
        if self._jobs:
            self._pump()
        log.info("node %s: started at outer_step %s (next local_step %d, sync=%s%s)", self.node_id, self.outer_step,
                 self.next_local_step, self.sync, f", delay={self.delay}" if self.sync == "lockstep" else "")
        return installed

    def _settle_residual(self, seen: int) -> None:
        """A resumed worker's residual, given that the hub has this node's deltas up to ``seen``.

        The checkpoint's residual is owed to the first delta sent after it (``first``); if the hub
        has that one, it was sent before the crash with the residual in it: it is owed no more
        (zero, not twice). Otherwise, if the checkpoint's doubtful upload landed, the residual of
        its content is owed (recomputed: the encoding is deterministic).
        """
        job = self._jobs.get(None)
        first = self.boundaries + 1 + self.step_offset
        if job is not None and job.fresh is not None:
            first = min(first, job.fresh.boundary + self.step_offset)
        if seen >= first:
            if self._feedback.residual is not None:
                log.info("node %s: the checkpoint's error-feedback residual went out with delta_%d before the restart; "
                         "starting from zero", self.node_id, first)
            self._feedback.forget()
        elif job is not None and job.doubt is not None and job.doubt[0] <= seen:
            self._feedback.absorb(job.doubt[1].materialize())

    def _check_fingerprint(self, manifest: Manifest) -> None:
        if manifest.model_fingerprint != self.fingerprint:
            raise WorkerError(
                f"the global on {self.hub.url} (outer_step {manifest.outer_step}) has model fingerprint "
                f"{manifest.model_fingerprint}, this model has {self.fingerprint}: the hub holds another model "
                f"(different parameter names, shapes or dtypes)"
            )
        theirs = [f["keys_sha256"] for f in manifest.fragments] if manifest.fragments else None
        ours = [self.plan.digest(n) for n in self.plan.names] if self.plan is not None else None
        if theirs != ours:
            def say(x: list[str] | None) -> str:
                return "no fragments" if x is None else f"{len(x)} fragments"
            raise WorkerError(
                f"the run on {self.hub.url} syncs {say(theirs)}, this worker {say(ours)}"
                f"{' split another way' if theirs and ours and len(theirs) == len(ours) else ''}: "
                f"give the worker the master's fragments option (diloco.fragments)"
            )

    def _bootstrap(self, deadline: float) -> Manifest:
        with tempfile.TemporaryDirectory(prefix=f"diloco-init-{self.node_id}-{owner_tag()}", dir=self._spool_parent) as tmp:
            path = os.path.join(tmp, "init.safetensors")
            tensors = {k: t.detach().cpu() for k, t in self.params.items()}
            md = {"format": "diloco-init/1", "node_id": self.node_id, "model_fingerprint": self.fingerprint}
            if self.signing_key is not None:  # a master of a signed run adopts only a signed offer
                md["signature"] = self.signing_key.sign(md, tensors)
            save_weights_file(path, tensors, metadata=md)
            del tensors
            hub_path = self._waits.retry("offer the initial weights", lambda: self.hub.upload_init(path, self.node_id), deadline)
        log.info("node %s: no global version on %s yet; offered %s, waiting for a master to publish outer step 0",
                 self.node_id, self.hub.url, hub_path)
        patience = self._waits.patience("a master to publish outer step 0")
        while True:
            m = self._waits.retry("read the manifest", self._read_manifest, deadline)
            if m is not None:
                self._check_fingerprint(m)
                return m
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(
                    f"node {self.node_id}: no master published outer step 0 on {self.hub.url} within "
                    f"{self.wait_timeout:g} s (is a master running on this hub?)"
                )
            patience.tick(" (is a master running on this hub?)")
            self._waits.pause(self.poll_interval, "a master to publish outer step 0")

    # ------------------------------------------------------------------ install

    def _anchor_copy(self, t: torch.Tensor) -> torch.Tensor:
        target = torch.complex64 if t.is_complex() else torch.float32
        out = t.detach()
        if out.device.type != "cpu" or out.dtype != target:
            out = out.to("cpu", target)
        if self._pin:
            out = out.pin_memory()
        return out

    def install_state(self, outer_step: int, state: Mapping[str, torch.Tensor], *, newest: int | None = None,
                      fragment_steps: Mapping[str, int] | None = None) -> InstallResult:
        """Copy a global state into the params in place; the anchor becomes its FP32 copy.
        ``fragment_steps``: with fragments, each fragment's outer step count at that version."""
        t0 = time.perf_counter()
        if self.plan is not None:
            if fragment_steps is None or set(fragment_steps) != set(self.plan.names):
                raise WorkerError(f"global version {outer_step} on {self.hub.url} does not say its fragments' outer steps")
            self.fragment_base = {n: (outer_step, int(fragment_steps[n])) for n in self.plan.names}
        try:
            kept = copy_into(self.params, {k: v for k, v in state.items() if k in self.params},
                             what=f"global version {outer_step}", required=self.synced)
        except ValueError as e:
            raise WorkerError(str(e)) from None
        for k in kept:
            log.warning("node %s: global version %d has no %r (an integer buffer); keeping the local one",
                        self.node_id, outer_step, k)
        self._anchor = {k: self._anchor_copy(state[k]) for k in self.synced}
        previous, self.outer_step = self.outer_step, outer_step
        self._newest_seen = max(self._newest_seen, outer_step, -1 if newest is None else newest)
        self.totals["installs_total"] += 1
        if self._fetcher is not None:
            self._fetcher.set_floor(outer_step)
        return InstallResult(outer_step, self._newest_seen - outer_step, previous, time.perf_counter() - t0)

    def _install_exact(self, target: int, manifest: Manifest, deadline: float, fragment: str | None = None) -> InstallResult:
        """Install version ``target`` (``manifest`` is current and at least ``target``); only
        ``fragment``'s keys when given."""
        while True:
            try:
                m, state = load_version(self.hub, manifest, target, signing_key=self.signing_key)
                if fragment is not None:
                    return self._install_fragment(fragment, target, manifest, state, newest=manifest.outer_step)
                return self.install_state(target, state, newest=manifest.outer_step,
                                          fragment_steps=manifest.fragment_steps_at(target) if self.plan else None)
            except HubNotFoundError:  # collected while being read: re-read the manifest
                if time.monotonic() >= deadline:
                    raise
                manifest = self._waits.retry("read the manifest", self._read_manifest, deadline)

    def _install_fragment(self, fragment: str, outer_step: int, manifest: Manifest, state: Mapping[str, torch.Tensor],
                          *, newest: int | None = None) -> InstallResult:
        """Copy fragment ``fragment``'s keys of version ``outer_step`` (and the integer buffers) into
        the params; that fragment's anchor becomes their FP32 copy, its base that version."""
        assert self.plan is not None
        t0 = time.perf_counter()
        self._check_fingerprint(manifest)
        steps = manifest.fragment_steps_at(outer_step)
        if steps is None or fragment not in steps:
            raise WorkerError(f"global version {outer_step} on {self.hub.url} does not say its fragments' outer steps")
        keys = self.plan.keys[fragment]
        synced = set(self.synced)
        sub = {k: state[k] for k in keys if k in state}
        sub.update({k: v for k, v in state.items() if k in self.params and k not in synced})
        try:
            copy_into(self.params, sub, what=f"global version {outer_step}", required=list(keys))
        except ValueError as e:
            raise WorkerError(str(e)) from None
        self._anchor = {**(self._anchor or {}), **{k: self._anchor_copy(state[k]) for k in keys}}
        self.fragment_base[fragment] = (outer_step, int(steps[fragment]))
        previous = self.outer_step
        self.outer_step = outer_step if previous is None else max(previous, outer_step)
        self._newest_seen = max(self._newest_seen, outer_step, -1 if newest is None else newest)
        self.totals["installs_total"] += 1
        return InstallResult(outer_step, self._newest_seen - outer_step, previous, time.perf_counter() - t0)

    def _install_latest(self, fragment: str) -> InstallResult | None:
        """Async with fragments: install ``fragment`` from the newest prefetched version when that
        version updated it since this worker's anchor of it. The fragment's tensors are dropped from
        the kept version either way (they are of no more use), so it is freed once every fragment
        had its turn."""
        assert self._fetcher is not None and self.plan is not None
        got = self._fetcher.take()
        if got is not None:
            m, state, newest = got
            self._latest = (m, dict(state))
            self._fetcher.set_floor(m.outer_step)
            self._newest_seen = max(self._newest_seen, newest)
        else:
            self._newest_seen = max(self._newest_seen, self._fetcher.newest_seen)
        if self._latest is None:
            return None
        m, state = self._latest
        installed = None
        steps = m.fragment_steps_at(m.outer_step) or {}
        if fragment in steps and steps[fragment] > self.fragment_base[fragment][1] and all(
            k in state for k in self.plan.keys[fragment]
        ):
            installed = self._install_fragment(fragment, m.outer_step, m, state)
        for k in self.plan.keys[fragment]:
            state.pop(k, None)
        if not any(k in state for k in self.synced):
            self._latest = None
        return installed

    # ------------------------------------------------------------------ boundary

    def _hold(self, job: Job | None, *, older: bool = False) -> None:
        """Keep ``job`` for a later upload, merged with what is held (``older``: it came before what
        is held, e.g. a failed upload coming back).

        With fragments nothing is merged: each boundary's delta is its own job, and jobs go to the hub
        in boundary order. Merging a fragment's held delta with its next one would let another
        fragment's later delta reach the hub first, and a delta at ``local_step`` s must mean that
        every boundary up to s is on the hub (what a restarted worker relies on not to send a
        replayed boundary twice, or to lose one). At most ``F`` jobs are held (one cycle of the
        fragments, about one model's worth of memory): beyond that the boundary waits for the
        uploads (:meth:`_backpressure`)."""
        if job is None or job.empty:
            return
        part = job.fresh if job.fresh is not None else job.doubt[1]  # type: ignore[index]
        key = None if part.fragment is None else part.boundary
        held = self._jobs.pop(key, None)
        merged = merge_jobs(job, held) if older else merge_jobs(held, job)
        if merged is not None and not merged.empty:
            self._jobs[key] = merged

    def _backpressure(self, reports: list[UploadReport]) -> float:
        """Fragments: while a whole cycle of fragments (``F`` deltas) is held, wait for the uploads
        (retrying failures; a hub outage longer than ``inner_steps`` steps of training stops the
        training here, up to ``wait_timeout``). Returns the seconds waited."""
        if self.plan is None or len(self._jobs) < self.plan.count:
            return 0.0
        assert self._uploader is not None
        t0 = time.perf_counter()
        deadline = self._waits.deadline()
        patience = self._waits.patience(f"the upload of {len(self._jobs)} held fragment delta(s) to {self.hub.url}")
        while len(self._jobs) >= self.plan.count:
            failed = any(not rep.ok for rep in self._collect_into(reports))
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(
                    f"node {self.node_id}: could not upload its held fragment deltas to {self.hub.url} within "
                    f"{self.wait_timeout:g} s"
                )
            if failed:
                time.sleep(min(max(self.poll_interval, self._commit_wait()), max(0.0, deadline - time.monotonic())))
                patience.tick()
            self._pump(force=True)
            self._uploader.wait_idle(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
        return time.perf_counter() - t0

    def _take_next(self) -> Job:
        """The held job to upload next: a doubtful one first (nothing new is attempted before it is
        resolved), else the oldest boundary's, so the deltas of a node reach the hub in increasing
        ``local_step`` across fragments (the master's high-water mark)."""
        def order(key: int | None) -> tuple[bool, int]:
            job = self._jobs[key]
            return job.doubt is None, job.fresh.boundary if job.fresh is not None else job.doubt[1].boundary  # type: ignore[index]
        return self._jobs.pop(min(self._jobs, key=order))

    def _fragment_tokens(self, fragment: str | None, num_tokens: int | None) -> int | None:
        """The tokens a fragment's delta covers: those since that fragment's last delta."""
        if fragment is None:
            return num_tokens
        for name, n in self._frag_tokens.items():
            self._frag_tokens[name] = None if n is None or num_tokens is None else n + num_tokens
        tokens, self._frag_tokens[fragment] = self._frag_tokens[fragment], 0
        return tokens

    def _export(self, num_tokens: int | None, fragment: str | None = None) -> Part:
        """Snapshot the local weights (CPU FP32) and move the anchor onto them (``fragment``'s only)."""
        snap: dict[str, torch.Tensor] = {}
        event = None
        keys = self.synced if fragment is None or self.plan is None else self.plan.keys[fragment]
        with torch.no_grad():
            for k in keys:
                t = self.params[k].detach()
                target = torch.complex64 if t.is_complex() else torch.float32
                if t.device.type == "cuda":
                    buf = torch.empty(t.shape, dtype=target, pin_memory=self._pin)
                    buf.copy_(t, non_blocking=True)
                elif t.dtype == target:
                    buf = t.clone(memory_format=torch.contiguous_format)
                else:
                    buf = t.to(dtype=target, memory_format=torch.contiguous_format)
                snap[k] = buf
            if self._pin:
                event = torch.cuda.Event()
                event.record()
        if fragment is not None:
            base, fbase = self.fragment_base[fragment]
            anchor = self._anchor or {}
            part = Part(base, num_tokens, 1, anchor={k: anchor[k] for k in keys}, snapshot=snap, event=event,
                        boundary=self.boundaries + 1, fragment=fragment, base_fragment_step=fbase)
            self._anchor = {**anchor, **snap}  # a new dict: the part's own anchor dict is never touched
            return part
        part = Part(self.outer_step, num_tokens, 1, anchor=self._anchor, snapshot=snap, event=event,
                    boundary=self.boundaries + 1)
        self._anchor = snap
        return part

    def _replayed(self, boundary: int) -> bool:
        """Whether this boundary's delta reached the hub before a crash (see the module docstring)."""
        if boundary + self._offset() > self.delivered_until:
            return False
        log.info("node %s: boundary %d was delivered before the restart (delta_%d on the hub); not sending it again",
                 self.node_id, boundary, boundary + self._offset())
        return True

    def _collect(self) -> list[UploadReport]:
        reports = self._uploader.collect() if self._uploader is not None else []
        for rep in reports:
            self.totals["phases_delivered_total"] += rep.recovered_phases
            if rep.ok:
                if rep.local_step is not None:
                    self.totals["deltas_uploaded_total"] += 1
                    self.totals["bytes_uploaded_total"] += rep.nbytes
                    self.totals["phases_delivered_total"] += rep.phases
            else:
                self.totals["upload_failures_total"] += 1
                if rep.remaining is not None:
                    log.warning(
                        "node %s: delta upload failed (%s); %d inner phase(s) kept and merged into the next delta "
                        "(%d failure(s) so far)",
                        self.node_id, rep.error, rep.remaining.phases, self.totals["upload_failures_total"],
                    )
                    self._hold(rep.remaining, older=True)
                else:
                    log.warning("node %s: delta upload failed (%s); retrying it (%d failure(s) so far)",
                                self.node_id, rep.error, self.totals["upload_failures_total"])
        return reports

    def _pump(self, force: bool = False) -> None:
        """Hand what is unsent to the uploader when it is free, unless the hub's commit budget asks
        to wait (``Hub.commit_wait``): then it stays held and the next boundary's delta is merged
        into it, instead of the upload meeting the hub's rate limit. ``force`` (a flush) sends
        anyway: the transport then waits for the budget itself."""
        if self._jobs and not self._uploader.busy:
            if not force:
                wait = self._commit_wait()
                if wait > 0:
                    self.totals["uploads_paced_total"] += 1
                    log.debug("node %s: the commit budget of %s allows the next upload in %.1fs; %d phase(s) held and "
                              "merged with the next delta", self.node_id, self.hub.url, wait,
                              sum(j.phases for j in self._jobs.values()))
                    return
            self._uploader.submit(self._take_next())

    def _commit_wait(self) -> float:
        try:
            return max(0.0, float(self.hub.commit_wait(self.node_id)))
        except Exception as e:  # noqa: BLE001 - pacing is advice: never a reason to lose a boundary
            log.debug("node %s: no commit budget from %s: %s", self.node_id, self.hub.url, e)
            return 0.0

    def boundary(self, num_tokens: int | None = None) -> BoundaryResult:
        """End an inner phase: export ``anchor - local``, hand it to the uploader, install a
        newer global (see the module docstring). ``num_tokens``: tokens trained on since the last
        boundary (optional; goes in the delta header)."""
        if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0):
            raise ValueError(f"num_tokens must be a non-negative integer or None, got {num_tokens!r}")
        if self._claim_keeper is not None:
            self._claim_keeper.check()  # another process took this node id over: never send under it
        self.start()
        t0 = time.perf_counter()
        r = self.boundaries + 1
        reports = self._collect()
        fragment = self.plan.fragment_at(r) if self.plan is not None else None
        base = self.outer_step if fragment is None else self.fragment_base[fragment][0]
        part = self._export(self._fragment_tokens(fragment, num_tokens), fragment)
        faults.point("worker.exported")
        self.boundaries = r
        inner_steps = self._pace(num_tokens)
        wait = 0.0
        if self._replayed(r):
            part = None
        if self.sync == "async":
            if part is not None:
                self._hold(Job(fresh=part))
            self._pump()
            wait = self._backpressure(reports)
            installed = None
            got = None if fragment is not None else self._fetcher.take()
            if fragment is not None:
                installed = self._install_latest(fragment)
            elif got is not None:
                m, state, newest = got
                installed = self.install_state(m.outer_step, state, newest=newest)
            else:
                self._newest_seen = max(self._newest_seen, self._fetcher.newest_seen)
            self._fetcher.trigger()
        else:
            installed, wait, more = self._lockstep(part, r, fragment)
            reports += more
        self.pacing.resume()
        seconds = time.perf_counter() - t0
        self.totals["wait_seconds_total"] += wait
        self.totals["boundaries_total"] += 1
        self.totals["boundary_seconds_total"] += seconds
        return BoundaryResult(
            boundary=r,
            base_outer_step=base,
            outer_step=self.outer_step,
            installed=installed,
            uploads=reports,
            pending_phases=self.pending_phases,
            wait_seconds=wait,
            seconds=seconds,
            inner_steps=inner_steps,
        )

    def _pace(self, num_tokens: int | None) -> int | None:
        """The phase that just ended: decide the next one's H (Dynamic Local Updates, from the
        peers' last heartbeats) and report this worker's speed in its own heartbeat (at once the
        first time, so the others learn a newcomer's speed early)."""
        keeper = self._claim_keeper
        peers = keeper.peer_reports() if keeper is not None and keeper.watch_peers else {}
        h = self.pacing.end_phase(num_tokens, [p.step_rate for p in peers.values()])
        if keeper is not None:
            keeper.set_info(self.pacing.report(self.boundaries + self._offset()).to_info(), urgent=not self._reported)
            self._reported = True
        return h

    def _deliver_pending(self, deadline: float, reports: list[UploadReport], what: str) -> None:
        """Block until everything handed over so far is on the hub (retrying failures)."""
        while True:
            failed = any(not rep.ok for rep in self._collect_into(reports))
            if not self._jobs and not self._uploader.busy:
                return
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(
                    f"node {self.node_id}: could not upload its pending delta(s) to {self.hub.url} within "
                    f"{self.wait_timeout:g} s ({what})"
                )
            if failed:  # not before the hub's commit budget or Retry-After allows the next attempt
                pause = max(self.poll_interval, self._commit_wait())
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            self._pump(force=True)
            self._uploader.wait_idle(min(self.poll_interval, max(0.0, deadline - time.monotonic())))

    def _collect_into(self, reports: list[UploadReport]) -> list[UploadReport]:
        got = self._collect()
        reports.extend(got)
        return got

    def _lockstep(self, part: Part | None, r: int, fragment: str | None = None) -> tuple[InstallResult, float, list[UploadReport]]:
        """Boundary r in lockstep: queue delta r (uploaded once version r-1 exists, so a master
        with a quorum of all workers applies exactly one delta per worker per round), then wait
        for version ``r - delay`` and install exactly it. Every delta r then has base
        ``r - 1 - delay`` and is applied at outer step ``r - 1``: staleness exactly ``delay``
        (``r - 1`` for the first ``delay`` boundaries, which start from version 0)."""
        t0 = time.perf_counter()
        deadline = self._waits.deadline()
        reports: list[UploadReport] = []
        if part is not None:
            self._uploader.submit(Job(fresh=part), not_before=r - 1)
        target = max(0, r - self.delay)
        first = True
        patience = self._waits.patience(f"global version {target} (lockstep boundary {r}, delay {self.delay})")
        while True:
            self._collect_into(reports)
            m = None
            try:
                m = self._read_manifest()
            except Exception as e:
                if first:
                    log.warning("node %s: cannot read the manifest (%s: %s); retrying", self.node_id, type(e).__name__, e)
                    first = False
            if m is not None and m.outer_step >= target:
                self._check_fingerprint(m)
                wait = time.perf_counter() - t0
                return self._install_exact(target, m, deadline, fragment), wait, reports
            if time.monotonic() >= deadline:
                raise WaitTimeoutError(
                    f"node {self.node_id}: lockstep boundary {r} waited {self.wait_timeout:g} s for global version "
                    f"{target} (delay {self.delay}); the hub has {m.outer_step if m is not None else 'none'}"
                    f"{' and this node could not upload its deltas' if self.totals['upload_failures_total'] else ''}. "
                    f"Is the master running, with min_deltas equal to the number of workers?"
                )
            patience.tick(f"; the hub has {m.outer_step if m is not None else 'no version'}")
            self._waits.pause(self.poll_interval, f"global version {target}")

    # ------------------------------------------------------------------ flush / close

    def flush(self, timeout: float | None = None) -> bool:
        """Upload everything exported so far, retrying failures; True when nothing is left."""
        if not self._started:
            return not self._jobs
        deadline = self._waits.deadline(timeout)
        self._collect()
        if self.pending_phases:
            log.info("node %s: waiting (up to %g s) for %d inner phase(s) to reach %s", self.node_id,
                     self.wait_timeout if timeout is None else timeout, self.pending_phases, self.hub.url)
        try:
            self._deliver_pending(deadline, [], "flush")
        except WaitTimeoutError:
            return False
        return True

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
                self._collect()
                ok = not self._jobs and not self._uploader.busy
            if not ok:
                log.error(
                    "node %s: closing with %d inner phase(s) not uploaded to %s (they are in the last checkpoint's "
                    "DiLoCo state if one was saved after they were exported)",
                    self.node_id, self.pending_phases, self.hub.url,
                )
            self._uploader.close(timeout=5.0)
            self.step_offset = self._uploader.step_offset
            if self._fetcher is not None:
                self._fetcher.close(timeout=5.0)
            if self._spool is not None:
                shutil.rmtree(self._spool, ignore_errors=True)
        if self._claim_keeper is not None:
            self._claim_keeper.release()
        self._closed = True
        return ok

    def __enter__(self) -> "DiLoCoWorker":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close(flush=exc[0] is None)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """Small counters (no tensors)."""
        return {
            "version": STATE_VERSION,
            "node_id": self.node_id,
            "boundaries": self.boundaries,
            "outer_step": self.outer_step,
            "next_local_step": self.boundaries + 1 + self._offset(),
            "step_offset": self._offset(),
            "totals": dict(self.totals),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._started:
            raise WorkerError("load_state_dict must be called before the worker starts")
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a DiLoCo worker state (version {STATE_VERSION}): {state!r:.200}")
        same_node = state.get("node_id") == self.node_id
        if not same_node:
            log.warning("node %s: ignoring the delivery counters of node %s's checkpoint", self.node_id, state.get("node_id"))
        self.boundaries = int(state["boundaries"])
        if state.get("outer_step") is not None:
            self.outer_step = int(state["outer_step"])
        if same_node:
            self.step_offset = max(self.step_offset, step_offset_of(state))
            for k, v in (state.get("totals") or {}).items():
                if k in self.totals:
                    self.totals[k] = type(self.totals[k])(v)

    def anchor_state(self, timeout: float | None = None) -> dict[str, Any]:
        """The anchor (CPU FP32) and whatever is not yet on the hub, for a checkpoint.

        Waits (up to ``timeout``, default ``wait_timeout``) for an upload in flight to finish, so
        the checkpoint records exactly what is still undelivered; failed uploads are not retried
        here (a hub outage never blocks checkpointing beyond one attempt).
        """
        if self._anchor is None:
            raise WorkerError("the worker has no anchor yet (call start() first)")
        busy = False
        if self._started:
            busy = not self._uploader.wait_idle(self.wait_timeout if timeout is None else timeout)
            self._collect()
            if busy:
                log.warning("node %s: an upload is still running at checkpoint time; if this process dies now, "
                            "the phases it carries are not in the checkpoint", self.node_id)
        if self._pin:
            torch.cuda.synchronize()
        unsent = pack_unsent(self._jobs.get(None))
        feedback = self._uploader.feedback_state() if self._uploader is not None else self._feedback.state_dict()
        extra: dict[str, Any] = {}
        if self.plan is not None:  # per fragment: its anchor's base, its undelivered work
            extra["fragment_bases"] = {n: list(b) for n, b in self.fragment_base.items()}
            extra["unsent_fragments"] = [pack_unsent(j) for n, j in sorted((k, j) for k, j in self._jobs.items()
                                                                          if k is not None)]
        return {
            **extra,
            "version": STATE_VERSION,
            "node_id": self.node_id,
            "outer_step": self.outer_step,
            "boundaries": self.boundaries,
            "next_local_step": self.boundaries + 1 + self._offset(),
            "step_offset": self._offset(),
            "anchor": dict(self._anchor),
            "unsent": unsent,
            "residual": pack_residual(feedback),
        }

    def load_anchor_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`anchor_state` (before :meth:`start`): the first delta after resume is
        then the true pseudo-gradient of the interrupted inner phase."""
        if self._started:
            raise WorkerError("load_anchor_state must be called before the worker starts")
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION or "anchor" not in state:
            raise ValueError("not a DiLoCo anchor state")
        anchor = state["anchor"]
        missing = [k for k in self.synced if k not in anchor]
        extra = [k for k in anchor if k not in self.synced]
        if missing or extra:
            raise WorkerError(
                f"the checkpoint's DiLoCo anchor does not fit this model: missing {missing[:5]}, unexpected {extra[:5]}"
            )
        for k in self.synced:
            if tuple(anchor[k].shape) != tuple(self.params[k].shape):
                raise WorkerError(
                    f"the checkpoint's DiLoCo anchor has shape {list(anchor[k].shape)} for {k!r}, "
                    f"the model has {list(self.params[k].shape)}"
                )
        bases = state.get("fragment_bases")
        if (self.plan is None) != (bases is None) or (
            bases is not None and set(bases) != set(self.plan.names)  # type: ignore[union-attr]
        ):
            raise WorkerError(
                f"the checkpoint's DiLoCo state was written with {'no' if bases is None else len(bases)} fragments, "
                f"this worker has {'none' if self.plan is None else self.plan.count}: resume with the same fragments"
            )
        self._anchor = {k: self._anchor_copy(anchor[k]) for k in self.synced}
        if bases is not None:
            self.fragment_base = {str(n): (int(b[0]), int(b[1])) for n, b in bases.items()}
        self.outer_step = int(state["outer_step"])
        self.boundaries = int(state.get("boundaries", self.boundaries))
        if state.get("node_id") != self.node_id:
            log.warning("node %s: restoring the anchor of node %s's checkpoint (its undelivered deltas stay with it)",
                        self.node_id, state.get("node_id"))
            return
        self._restored = True
        try:
            self._feedback.load_state_dict(unpack_residual(state.get("residual"), {k: self.params[k] for k in self.synced}))
        except ValueError as e:
            raise WorkerError(f"the checkpoint's DiLoCo error-feedback residual does not fit this model: {e}") from None
        self.step_offset = step_offset_of(state)
        job = unpack_unsent(state.get("unsent"), boundaries=self.boundaries, step_offset=self.step_offset)
        self._hold(job)
        for packed in state.get("unsent_fragments") or []:
            self._hold(unpack_unsent(packed, boundaries=self.boundaries, step_offset=self.step_offset))
