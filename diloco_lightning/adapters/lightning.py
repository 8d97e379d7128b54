"""``diloco_lightning.DiLoCo``: asynchronous DiLoCo as one Lightning callback.

Add it to an unmodified ``Trainer``; nothing else changes::

    trainer = L.Trainer(max_steps=10_000, callbacks=[DiLoCo(hub="file:///shared/run", node_id="w0", inner_steps=500)])

What it does (the work itself is :class:`~diloco_lightning.worker.DiLoCoWorker`'s):

* ``on_train_start``: connects to the hub. A fresh run installs the newest global version
  (offering this model's weights as ``nodes/<node_id>/init.safetensors`` first when nothing
  is published yet, and waiting for outer step 0); a resumed run keeps its checkpoint weights
  and restores the anchor from the checkpoint.
* Boundaries are keyed on ``trainer.global_step`` (optimizer steps) with a last-synced guard:
  a boundary fires once when ``global_step // inner_steps`` grows, so gradient accumulation
  (several batches per step) and resume never fire it twice. ``inner_steps="auto"``: Dynamic
  Local Updates (:mod:`diloco_lightning.worker.pacing`): each phase's H is decided at the
  boundary before it from this worker's measured speed and the peers' (every rank gets it
  with the boundary's result), and a boundary fires ``H`` optimizer steps after the last one.
  ``throttle``: seconds slept after each optimizer step (a test knob for stragglers).
* Checkpoints: counters in ``state_dict()``, the anchor and any undelivered delta under
  ``checkpoint["diloco_worker"]`` (``on_save_checkpoint``), so the first delta after a resume is
  the true pseudo-gradient of the interrupted phase.
* Each node sees its own data: ``setup`` reseeds ``torch``, ``random`` and ``numpy`` from the
  process's seed and ``node_id`` (``seed_per_node``), so two nodes running one script shuffle
  differently.
* DDP inside one worker: rank 0 owns the worker (exports, uploads, decides installs); the
  decision is broadcast and the installed weights are broadcast from rank 0, so every rank
  installs the same version at the same step; an error on rank 0 is broadcast and raised on
  every rank instead of leaving them waiting. FSDP, DeepSpeed and model-parallel strategies
  are refused in ``setup`` (their parameters are sharded: the anchor would be a shard).
* Says what it does: the progress bar shows ``outer_step``, ``stale`` (versions the installed
  one is behind the newest seen) and ``sent_MB`` (short names: a bar cuts its line at the
  terminal's width); rank zero prints one line per sync and a line at growing intervals while
  it waits for a master (``verbose=False``: quiet;
  a script that configured no logging gets a stderr handler on the ``diloco_lightning`` logger,
  as Lightning does for its own).
* SIGTERM (``timeout``, SLURM, Kubernetes): a wait for the master ends at once, what is pending
  is uploaded (at most 20 s), and the process exits with status 143 (128 + SIGTERM) instead of
  Lightning's 0, since the training is not done. The node's id is claimed on the hub at start
  (``nodes/<node_id>/claim.json``): a second live worker with the same ``node_id`` refuses to start.
* Logs, at every boundary, through the trainer's loggers (``diloco/`` prefix): ``outer_step``,
  ``installed_outer_step`` and ``install_staleness`` (versions between the one installed and the
  newest seen), ``delta_norm``, ``upload_bytes``, ``upload_seconds``, ``wait_seconds``
  (lockstep), ``upload_failures``, ``boundary_seconds`` (time the training thread spent).
  ``callback.metrics`` holds the last values and running totals.

* The end of ``fit`` (``on_train_end``): the last delta is delivered, the node's claim is left
  saying it finished, and (``final_install``, the default) the newest global version that contains
  the last delta is installed, so the module holds the run's global model
  (``diloco_lightning/worker/final.py``).

The trailing partial phase after the last boundary is in no delta (choose ``max_steps`` a
multiple of ``inner_steps``); a final install replaces it by the global version.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from diloco_lightning.util import timeline
from diloco_lightning.hub.base import Hub
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.adapters.shared import (
    SIGTERM_EXIT, SIGTERM_FLUSH_SECONDS, SigtermWatch, broadcast_params, WorkerStart, adapter_options, PhaseLoss,
    ensure_console_logging, sent_text, seed_this_node, run_on_rank0
)
from diloco_lightning.adapters.skip_ahead import skip_ahead
from diloco_lightning.adapters.tokens import PhaseTokens, count_tokens
from diloco_lightning.worker.core import DiLoCoWorker
from diloco_lightning.worker.options import WorkerOptions, takes_options
from diloco_lightning.worker.params import module_state
from diloco_lightning.worker.sync import WorkerStopped

log = logging.getLogger(__name__)

__all__ = ["DiLoCo", "count_tokens"]

CHECKPOINT_KEY = "diloco_worker"
#: what the progress bar shows: the outer step installed, its staleness (versions behind the newest
#: seen), megabytes sent in all
BAR_NAMES = ("outer_step", "stale", "sent_MB")
_SHARDED = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy", "XLAFSDPStrategy")


class DiLoCo(Callback):
    """Asynchronous DiLoCo worker as a Lightning callback (see the module docstring).

    Args:
        hub: a hub URL (``file:///abs/path``, a plain path, ``hf://org/repo``, ``s3://bucket/prefix``: any
            registered transport's, :data:`~diloco_lightning.hub.TRANSPORTS`), or an open :class:`~diloco_lightning.hub.Hub`.
        node_id: this worker's name on the hub (1-64 characters of ``[A-Za-z0-9._-]``).
        inner_steps: H, optimizer steps between two exports, or ``"auto"`` (Dynamic Local Updates);
            required unless ``options`` is given.
        options: the worker's :class:`~diloco_lightning.worker.options.WorkerOptions`, passed whole
            (``DiLoCo(hub, "w0", options=WorkerOptions(inner_steps=500, sync="lockstep"))``).
        **option_values: instead of ``options``, any :class:`~diloco_lightning.worker.options.WorkerOptions`
            field as a keyword (``sync``, ``delay``, ``delta_dtype``, ``topk``, ``fragments``, ``rebase``,
            ``wait_timeout``, ``final_install`` ...: each one's meaning and default are written there, and
            the signature lists them); an unknown one is a ``TypeError`` naming the valid ones.
        node_index: this worker's index for a list/distribution ``delay`` or ``throttle`` (default:
            the number ending ``node_id``).
        hub_options: options for ``open_hub`` (``token=``, ``endpoint=``, ``cache_dir=`` ...).
        create: create the hub (a folder, an ``hf://`` repository) if it does not exist. False
            (default): a hub that does not exist is an error naming the fix, the rule
            ``diloco-master`` follows, so a misspelt hub is never created and waited on.
        signing_key: run key for signed deltas; None takes ``DILOCO_RUN_KEY`` /
            ``DILOCO_RUN_KEY_FILE`` from the environment (unsigned when neither is set).
        token_counter: ``None`` (guess with :func:`count_tokens`), ``False`` (no
            ``num_tokens`` in headers) or ``callable(batch) -> int | Tensor``.
        log_prefix: prefix of the logged metric names.
        verbose: print a line per sync and while waiting (rank zero); False: quiet.
        seed_per_node: reseed ``torch``, ``random`` and ``numpy`` at the start of ``fit`` with a
            seed derived from the process's seed and ``node_id``
            (:func:`~diloco_lightning.adapters.shared.node_seed`), so two nodes running one script
            with one ``seed_everything`` shuffle their data (and draw dropout) differently; a
            node gets the same seed on every launch. False keeps the script's seed (then shard
            or seed the data per node yourself: identical data on two nodes makes their deltas
            identical, and the master warns about it).
    """

    @takes_options
    def __init__(
        self,
        hub: str | os.PathLike | Hub,
        node_id: str,
        inner_steps: int | str | None = None,
        *,
        options: WorkerOptions | None = None,
        node_index: int | None = None,
        hub_options: Mapping[str, Any] | None = None,
        create: bool = False,
        signing_key: RunKey | str | bytes | None = None,
        token_counter: Callable[[Any], Any] | bool | None = None,
        log_prefix: str = "diloco/",
        verbose: bool = True,
        seed_per_node: bool = True,
        **option_values: Any,
    ) -> None:
        super().__init__()
        self._first_step_seen = False  # the first training step of this fit (a timeline mark)
        self._start = WorkerStart(hub, node_id, adapter_options(inner_steps, options, option_values),
                                  node_index=node_index, hub_options=hub_options, signing_key=signing_key, create=create)
        start = self._start
        self.node_id, self.delay, self.options, self.pacing = start.node_id, start.delay, start.options, start.pacing
        self._tokens = PhaseTokens(token_counter)  # the phase's tokens, in the delta header
        if not isinstance(log_prefix, str):
            raise ValueError(f"DiLoCo: log_prefix must be a string, got {log_prefix!r}")
        self.hub = hub
        if not isinstance(seed_per_node, bool):
            raise ValueError(f"DiLoCo: seed_per_node must be True or False, got {seed_per_node!r}")
        self.create, self.seed_per_node = create, seed_per_node
        self.log_prefix = log_prefix
        self.verbose = bool(verbose)
        if self.verbose:
            ensure_console_logging()
        self._sigterm = SigtermWatch(self._start.request_stop)
        self._bar: dict[str, float] = {}

        self.worker: DiLoCoWorker | None = None
        self.metrics: dict[str, float] = {}
        self._last_synced_step: int | None = None
        self._last_seen_step: int | None = None  # the optimizer step of the last batch (throttle, speed)
        self._restored_sync_step: int | None = None
        self._restored_counters: dict[str, Any] | None = None
        self._restored_anchor: dict[str, Any] | None = None
        #: this fit restored a checkpoint with a DiLoCo anchor / its training started (``on_fit_end``)
        self._loaded_this_fit = False
        self._trained_this_fit = False
        self._loss = PhaseLoss()  # the phase's mean training loss goes in the heartbeat
        self._params: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------ identity and state

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(node_id=self.node_id)

    @override
    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"last_synced_step": self._last_synced_step, "pacing": self.pacing.state_dict()}
        if self.worker is not None:
            out["worker"] = self.worker.state_dict()
        elif self._restored_counters is not None and "worker" in self._restored_counters:
            out["worker"] = self._restored_counters["worker"]
        return out

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_counters = dict(state_dict)
        self._restored_sync_step = state_dict.get("last_synced_step")
        self.pacing.load_state_dict(state_dict.get("pacing") or {})

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.worker is not None and self.worker.anchor is not None:
            checkpoint[CHECKPOINT_KEY] = self.worker.anchor_state()
        elif self._restored_anchor is not None:  # saved again before training started
            checkpoint[CHECKPOINT_KEY] = self._restored_anchor

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._restored_anchor = checkpoint.get(CHECKPOINT_KEY)
        self._loaded_this_fit = self._restored_anchor is not None
        timeline.mark("checkpoint_loaded")
        if self._restored_anchor is None and trainer.is_global_zero:
            log.warning(
                "DiLoCo: this checkpoint has no DiLoCo anchor (it was saved without the callback); the worker "
                "installs the hub's global weights instead of resuming its inner phase"
            )

    # ------------------------------------------------------------------ setup / start

    def _seed_node(self) -> None:
        """Each node sees its own data: reseed from ``node_id`` (``adapters/shared.py: node_seed``)."""
        if self.seed_per_node:
            seed = seed_this_node(self.node_id)
            log.debug("DiLoCo %s: seeded this node with %d (from the process's seed and node_id)", self.node_id, seed)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._seed_node()  # before the data is iterated, after the model was built
            self._loaded_this_fit = self._trained_this_fit = False
        names = {cls.__name__ for cls in type(trainer.strategy).__mro__}
        sharded = sorted(names.intersection(_SHARDED))
        if sharded:
            raise ValueError(
                f"DiLoCo does not support the sharded strategy {type(trainer.strategy).__name__} (each rank holds only "
                "a shard of the parameters, so no rank can export the pseudo-gradient or install a global version). "
                "Use strategy='ddp' (or a single device) inside each DiLoCo worker."
            )

    def _rank0(self, trainer: Trainer, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0; every rank gets its (picklable) result or raises its error."""
        return run_on_rank0(
            fn,
            is_main=trainer.is_global_zero,
            world_size=trainer.world_size,
            broadcast=lambda result: trainer.strategy.broadcast(result, src=0),
            where="rank 0",
        )

    def _broadcast_params(self, trainer: Trainer) -> None:
        if trainer.world_size > 1:
            assert self._params is not None  # found in setup
            broadcast_params(self._params)

    def _after_install(self, trainer: Trainer, installed: bool) -> None:
        if not installed:
            return
        self._broadcast_params(trainer)
        if self.options.reset_inner_optimizer:
            for opt in trainer.optimizers:
                opt.state.clear()

    def _stopped(self, e: WorkerStopped) -> SIGTERMException:
        log.warning("%s (SIGTERM)", e)
        return SIGTERMException(SIGTERM_EXIT)

    def _show(self, step: int, metrics: dict[str, float]) -> None:
        """The progress-bar values, and (verbose) one line for this sync."""
        p = self.log_prefix
        worker = self.worker
        if worker is None:
            return
        staleness = metrics.get(p + "install_staleness", self._bar.get(BAR_NAMES[1], 0.0))
        sent = float(worker.totals.get("bytes_uploaded_total", 0)) / 1e6
        # short names: a progress bar cuts its line at the terminal's width
        self._bar = dict(zip(BAR_NAMES, (float(worker.outer_step or 0), float(staleness), sent)))
        if self.verbose and metrics:
            parts = [f"DiLoCo {self.node_id} | step {step} | sync {int(metrics.get(p + 'boundary', 0))}",
                     f"outer_step {worker.outer_step}"]
            if p + "installed_outer_step" in metrics:
                parts.append(f"installed {int(metrics[p + 'installed_outer_step'])} (staleness {int(staleness)})")
            parts.append(sent_text(metrics.get(p + "upload_bytes"), sent * 1e6, worker.pending_phases))
            if self.pacing.auto:
                parts.append(f"next H {self.pacing.inner_steps}")
            if metrics.get(p + "wait_seconds"):
                parts.append(f"waited {metrics[p + 'wait_seconds']:.2f} s")
            if metrics.get(p + "upload_failures"):
                parts.append(f"{int(metrics[p + 'upload_failures'])} upload failure(s), kept for the next delta")
            log.info("%s", " | ".join(parts))

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        timeline.mark("train_start")
        self._trained_this_fit = True
        self._first_step_seen = False
        self._sigterm.install()
        self._params = module_state(pl_module)
        # a resumed fit continues the checkpoint's boundary count; any other fit counts from its first step
        restored, self._restored_sync_step = self._restored_sync_step, None
        self._last_synced_step = trainer.global_step if restored is None else restored
        self._last_seen_step = trainer.global_step
        self._tokens.reset()

        def start() -> tuple[bool, int]:
            if self.worker is not None:
                self.worker.close(flush=True)
            assert self._params is not None  # found in setup
            try:
                installed = self._start.start(self._params, stop=self._sigterm.received,
                                              counters=(self._restored_counters or {}).get("worker"),
                                              anchor=self._restored_anchor, stopped=lambda: self._sigterm.received)
            finally:
                self.worker = self._start.worker
            if installed is not None:
                self.metrics[self.log_prefix + "installed_outer_step"] = float(installed.outer_step)
            resumed = self.worker.resumed_boundaries if self.worker is not None else 0
            return installed is not None, resumed

        try:
            installed, resumed = self._rank0(trainer, start)
        except WorkerStopped as e:
            raise self._stopped(e) from None
        self._restored_anchor = None
        if resumed and restored is None:
            self._skip_ahead(trainer, pl_module, resumed)
        self._after_install(trainer, installed)
        if trainer.is_global_zero:
            self._show(trainer.global_step, {})
        timeline.mark("worker_started")

    def _skip_ahead(self, trainer: Trainer, pl_module: LightningModule, boundaries: int) -> None:
        """A restart without a checkpoint resumed at the hub's step (``boundaries`` phases its earlier
        life delivered): the trainer moves on by those phases (``adapters/skip_ahead.py``)."""
        if not skip_ahead(trainer, pl_module, self.pacing, boundaries):
            return
        self._last_synced_step = self._last_seen_step = trainer.global_step
        if trainer.is_global_zero:
            log.warning("DiLoCo %s: restarted without a checkpoint; the hub has this node's first %d phase(s): the "
                        "trainer resumes at step %d instead of training them again", self.node_id, boundaries,
                        trainer.global_step)

    # ------------------------------------------------------------------ boundaries

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._first_step_seen:
            self._first_step_seen = True
            timeline.mark("first_step")
        self._tokens.add(batch)
        self._loss.add(outputs.get("loss") if isinstance(outputs, Mapping) else outputs)
        step = trainer.global_step
        if self._last_seen_step is None or step > self._last_seen_step:  # an optimizer step, not an accumulation
            self._last_seen_step = step
            self.pacing.after_step()
        last = self._last_synced_step if self._last_synced_step is not None else 0
        if not self.pacing.due(step, last):
            self._log_bar(pl_module)
            return
        self._last_synced_step = step
        tokens = self._tokens.take(trainer.world_size, trainer.strategy.root_device,
                                   lambda t: trainer.strategy.reduce(t, reduce_op="sum"))
        loss = self._loss.take()

        worker = self.worker  # rank 0's (None on the other ranks, which never call boundary())

        def boundary() -> tuple[bool, dict[str, float], int | None]:
            assert worker is not None
            result = worker.boundary(num_tokens=tokens, train_loss=loss)
            metrics = result.metrics(self.log_prefix)
            return result.installed is not None, metrics, result.inner_steps

        try:
            installed, metrics, next_h = self._rank0(trainer, boundary)
        except WorkerStopped as e:
            raise self._stopped(e) from None
        if next_h is not None:
            self.pacing.inner_steps = next_h  # rank 0 decided (DyLU); every rank agrees on the next boundary
        self._after_install(trainer, installed)
        if trainer.is_global_zero:
            self.metrics.update(metrics)
            if worker is not None:
                self.metrics.update(worker.totals)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
            self._show(step, metrics)
        self._log_bar(pl_module)

    def _log_bar(self, pl_module: LightningModule) -> None:
        if self._bar:
            pl_module.log_dict(self._bar, prog_bar=True, logger=False, on_step=True, on_epoch=False, rank_zero_only=True)

    # ------------------------------------------------------------------ end

    def _close(self, flush: bool, timeout: float | None = None) -> None:
        worker, self.worker = self.worker, None
        if worker is None:
            return
        try:
            worker.close(flush=flush, timeout=timeout)
        finally:
            if worker is not None:
                self.metrics.update(worker.totals)
            # a checkpoint saved after training (or the next fit() with this callback) continues from here
            if worker.anchor is not None:
                self._restored_anchor = worker.anchor_state(timeout=0)
                self._restored_counters = {"last_synced_step": self._last_synced_step, "worker": worker.state_dict()}

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # the run's global model in the user's hands (worker/final.py): last delta delivered, the node
        # marked finished, the newest global version holding it installed (final_install)
        worker = self.worker  # rank 0's
        trailing = trainer.global_step - (self._last_synced_step or 0)

        def finish() -> bool:
            return worker is not None and worker.finish(trailing_steps=trailing) is not None

        installed = self._rank0(trainer, finish)
        self._after_install(trainer, installed)
        self._close(flush=True)

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A fit resumed from a checkpoint saved at the end of training (its process was killed after it,
        e.g. while the last deltas waited out a hub outage) trains nothing: Lightning skips the training
        hooks. What that checkpoint had not delivered is sent now, and the global installed, as at the
        end of training."""
        if self._loaded_this_fit and not self._trained_this_fit:
            self._loaded_this_fit = False
            log.info("DiLoCo %s: resumed at the end of training (step %d): delivering what the checkpoint had not "
                     "sent", self.node_id, trainer.global_step)
            self.on_train_start(trainer, pl_module)
            self.on_train_end(trainer, pl_module)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        sigterm = isinstance(exception, SIGTERMException)
        code = None
        if isinstance(exception, SIGTERMException):
            if not exception.code:
                exception.code = SIGTERM_EXIT  # Lightning exits 0 on SIGTERM; the training is not done
            code = exception.code
        pending = self.worker.pending_phases if self.worker is not None else 0
        worker = self.worker
        self._close(flush=True, timeout=min(self.options.wait_timeout, SIGTERM_FLUSH_SECONDS if sigterm else 30.0))
        if sigterm and trainer.is_global_zero:
            left = worker.pending_phases if worker is not None else 0
            done = (f"{pending - left} pending inner phase(s) uploaded" + (f", {left} not" if left else "")
                    if pending else "nothing was pending")
            log.warning("DiLoCo %s: SIGTERM at step %d: %s; exiting with status %s", self.node_id, trainer.global_step,
                        done, code)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._sigterm.uninstall()
        self._close(flush=False)
