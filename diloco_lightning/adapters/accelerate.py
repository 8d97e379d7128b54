"""DiLoCo for a plain Accelerate training loop, shaped like ``accelerate.local_sgd.LocalSGD``::

    from diloco_lightning.adapters.accelerate import DiLoCo

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    diloco = DiLoCo(accelerator, model, hub="file:///shared/run", node_id="w0", inner_steps=500)
    accelerator.load_state("ckpt")            # optional resume: after DiLoCo(...), which registers itself
    with diloco:                              # connects; installs the global weights on a fresh start
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                diloco.step()                 # after each optimizer.step(); exports every inner_steps steps
            if want_checkpoint:
                accelerator.save_state("ckpt")  # includes the anchor (registered for checkpointing)

Unlike ``LocalSGD`` there is no ``no_sync()``: DDP inside one worker stays synchronous, and
the worker is the whole DDP group (rank 0 exports, uploads and decides installs; the decision
and the installed weights are broadcast; an error on rank 0 is raised on every rank).
``step()`` counts only real optimizer steps (``accelerator.sync_gradients``), so gradient
accumulation gives one export per ``inner_steps`` optimizer steps. ``inner_steps="auto"`` is
Dynamic Local Updates (:mod:`diloco_lightning.worker.pacing`: each phase's H from this worker's
measured speed and the peers'), ``throttle`` a sleep after each step (a test knob). The work is done by
:class:`~diloco_lightning.worker.DiLoCoWorker`; see it for the options.

The main process prints one line per sync and a line at growing intervals while it waits for
a master (``verbose=False``: quiet). SIGTERM ends a wait for the master at once; the next
``step()`` (a single process) or the next boundary (several processes) uploads what is
pending (at most 20 s) and exits with status 143 (128 + SIGTERM).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from diloco_lightning.hub.base import Hub
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.adapters.shared import (
    SIGTERM_EXIT, SIGTERM_FLUSH_SECONDS, SigtermWatch, broadcast_params, WorkerStart, adapter_options, PhaseLoss,
    ensure_console_logging, sent_text, seed_this_node, run_on_rank0, sum_tokens_over_ranks
)
from diloco_lightning.worker.core import BoundaryResult, DiLoCoWorker
from diloco_lightning.worker.options import WorkerOptions, takes_options
from diloco_lightning.worker.params import module_state
from diloco_lightning.worker.sync import WorkerStopped

log = logging.getLogger(__name__)

__all__ = ["DiLoCo"]

_STATE_VERSION = 1


class DiLoCo:
    """DiLoCo worker for an Accelerate loop (see the module docstring).

    Args:
        accelerator: the ``accelerate.Accelerator``.
        model: the prepared model (it is unwrapped to find the tensors).
        hub, node_id, inner_steps, options, **option_values, node_index, hub_options, create,
            signing_key: as for :class:`diloco_lightning.DiLoCo` (the Lightning callback): the worker's
            :class:`~diloco_lightning.worker.options.WorkerOptions` passed whole (``options=``) or as
            keywords (``inner_steps=500, sync="lockstep"`` ...), each one's meaning written there. At
            the end of the ``with`` block (:meth:`finish`), ``final_install`` installs the newest
            global version holding the last delta.
        optimizer: the optimizer(s) whose state ``reset_inner_optimizer`` clears after an install.
        enabled: False makes every call a no-op (like ``LocalSGD(enabled=False)``).
        log_fn: called on the main process with each boundary's metrics dict (e.g. ``accelerator.log``).
        verbose: print a line per sync and while waiting (main process); False: quiet.
        seed_per_node: reseed from the process's seed and ``node_id`` at :meth:`start`, as the
            Lightning callback does at the start of ``fit`` (default True).
    """

    @takes_options
    def __init__(
        self,
        accelerator: Any,
        model: torch.nn.Module,
        hub: str | os.PathLike | Hub,
        node_id: str,
        inner_steps: int | str | None = None,
        *,
        options: WorkerOptions | None = None,
        node_index: int | None = None,
        optimizer: Any = None,
        hub_options: Mapping[str, Any] | None = None,
        create: bool = False,
        signing_key: RunKey | str | bytes | None = None,
        enabled: bool = True,
        log_fn: Callable[[dict[str, float]], Any] | None = None,
        verbose: bool = True,
        seed_per_node: bool = True,
        **option_values: Any,
    ) -> None:
        self._start = WorkerStart(hub, node_id, adapter_options(inner_steps, options, option_values),
                                  node_index=node_index, hub_options=hub_options, signing_key=signing_key, create=create)
        start = self._start
        self.node_id, self.delay, self.options, self.pacing = start.node_id, start.delay, start.options, start.pacing
        if self.options.reset_inner_optimizer and optimizer is None:
            raise ValueError("DiLoCo: reset_inner_optimizer=True needs optimizer= (the optimizer(s) to reset)")
        if log_fn is not None and not callable(log_fn):
            raise ValueError("DiLoCo: log_fn must be callable or None")
        dist_type = str(getattr(accelerator, "distributed_type", "NO"))
        if any(s in dist_type.upper() for s in ("DEEPSPEED", "FSDP", "MEGATRON", "XLA")):
            raise ValueError(
                f"DiLoCo: distributed type {dist_type} shards or hides the parameters; use plain DDP (MULTI_GPU/"
                "MULTI_CPU) or a single process inside each DiLoCo worker"
            )
        self.accelerator = accelerator
        self.model = model
        self.hub = hub
        self.enabled = bool(enabled)
        self.optimizers = [] if optimizer is None else (list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])
        self.log_fn = log_fn
        if not isinstance(seed_per_node, bool):
            raise ValueError(f"DiLoCo: seed_per_node must be True or False, got {seed_per_node!r}")
        self.create, self.seed_per_node = create, seed_per_node
        self.verbose = bool(verbose)
        self._loss = PhaseLoss()
        if self.verbose:
            ensure_console_logging()
        self._sigterm = SigtermWatch(self._start.request_stop)
        self.num_steps = 0
        self._last_boundary = 0  # num_steps at the last boundary
        self.worker: DiLoCoWorker | None = None
        self._running = False
        self.metrics: dict[str, float] = {}
        self._restored: Mapping[str, Any] | None = None
        self._tokens: int | None = 0
        self._params = module_state(accelerator.unwrap_model(model))
        if self.enabled:
            accelerator.register_for_checkpointing(self)

    # ------------------------------------------------------------------ process group

    @property
    def _main(self) -> bool:
        return bool(self.accelerator.is_main_process)

    @property
    def _world(self) -> int:
        return int(self.accelerator.num_processes)

    @staticmethod
    def _broadcast(obj: Any) -> Any:
        from accelerate.utils import broadcast_object_list

        box = [obj]
        broadcast_object_list(box, from_process=0)
        return box[0]

    def _rank0(self, fn: Callable[[], Any]) -> Any:
        return run_on_rank0(
            fn, is_main=self._main, world_size=self._world, broadcast=self._broadcast, where="the main process"
        )

    def _after_install(self, installed: bool) -> None:
        if not installed:
            return
        if self._world > 1:
            broadcast_params(self._params)
        if self.options.reset_inner_optimizer:
            for opt in self.optimizers:
                inner = getattr(opt, "optimizer", opt)
                inner.state.clear()

    # ------------------------------------------------------------------ SIGTERM

    def _exit_on_sigterm(self, why: str) -> None:
        log.warning("DiLoCo %s: %s (SIGTERM); uploading what is pending (at most %g s), then exiting with status %d",
                    self.node_id, why.removeprefix(f"node {self.node_id}: "), SIGTERM_FLUSH_SECONDS, SIGTERM_EXIT)
        self.close(flush=True, timeout=min(float(self.options.wait_timeout), SIGTERM_FLUSH_SECONDS))
        raise SystemExit(SIGTERM_EXIT)

    # ------------------------------------------------------------------ context manager

    def start(self) -> None:
        """Connect (and install the global weights on a fresh start); ``__enter__`` calls it."""
        if not self.enabled or self._running:
            return
        if self.seed_per_node:
            seed_this_node(self.node_id)  # each node shuffles its data its own way (before the loop iterates it)

        def start() -> bool:
            restored = self._restored or {}
            try:
                installed = self._start.start(self._params, stop=self._sigterm.received,
                                              counters=restored.get("worker"), anchor=restored.get("anchor"),
                                              stopped=lambda: self._sigterm.received)
            finally:
                self.worker = self._start.worker
            return installed is not None

        self._sigterm.install()
        try:
            installed = self._rank0(start)
        except WorkerStopped as e:
            self._running = True
            self._exit_on_sigterm(str(e))
        self._running = True
        self._restored = None
        self._after_install(installed)

    def __enter__(self) -> "DiLoCo":
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        self.close(flush=exc_type is None)

    def finish(self) -> bool:
        """The end of training (``__exit__`` without an error calls it): deliver the last delta, mark
        this node finished on the hub and, with ``final_install`` (default), install the newest global
        version that contains the last delta, on every process (``worker/final.py``). True when it
        installed one; False when the model keeps its local weights (a line says why)."""
        if not self.enabled or not self._running:
            return False
        worker = self.worker  # the main process's
        trailing = self.num_steps - self._last_boundary

        def finish() -> bool:
            return worker is not None and worker.finish(trailing_steps=trailing) is not None

        installed = bool(self._rank0(finish))
        self._after_install(installed)
        return installed

    def close(self, flush: bool = True, timeout: float | None = None) -> bool:
        """Upload what is pending (``flush``) and stop the worker's threads."""
        self._running = False
        self._sigterm.uninstall()
        worker, self.worker = self.worker, None
        if worker is None:
            return True
        try:
            return worker.close(flush=flush, timeout=timeout)
        finally:
            self.metrics.update(worker.totals)
            if worker.anchor is not None:  # a later save_state (or a new `with`) continues from here
                self._restored = {"worker": worker.state_dict(), "anchor": worker.anchor_state(timeout=0)}

    # ------------------------------------------------------------------ training

    def step(self, num_tokens: int | None = None, loss: Any = None) -> BoundaryResult | None:
        """Call after each ``optimizer.step()``; every ``inner_steps`` real optimizer steps, a
        boundary (export, upload in the background, install a newer global). ``num_tokens``:
        tokens of this step on this process (summed over processes and steps into the header);
        ``loss``: this step's training loss (optional; the phase's mean is reported in the node's
        heartbeat, where the master watches for divergence)."""
        if not self.enabled:
            return None
        if not getattr(self.accelerator, "sync_gradients", True):
            return None  # an accumulation micro-step: the optimizer did not step
        if not self._running:  # used without `with`: start at the first step (on every process)
            self.start()
        if self._sigterm.received and self._world == 1:
            self._exit_on_sigterm(f"stopped at step {self.num_steps}")
        self.num_steps += 1
        self._loss.add(loss)
        self.pacing.after_step()
        if num_tokens is None:
            self._tokens = None
        elif self._tokens is not None:
            self._tokens += int(num_tokens)
        if not self.pacing.due(self.num_steps, self._last_boundary):
            return None
        self._last_boundary = self.num_steps
        tokens, self._tokens = self._tokens, 0
        train_loss = self._loss.take()
        if self._world > 1:
            tokens = sum_tokens_over_ranks(
                tokens, self.accelerator.device, lambda t: self.accelerator.reduce(t, reduction="sum")
            )

        result: list[BoundaryResult] = []
        worker = self.worker  # the main process's (None on the others, which never call boundary())

        def boundary() -> tuple[bool, int | None]:
            if self._sigterm.received:
                raise WorkerStopped(f"node {self.node_id}: stopped at step {self.num_steps}")
            assert worker is not None
            result.append(worker.boundary(num_tokens=tokens, train_loss=train_loss))
            return result[0].installed is not None, result[0].inner_steps

        installed, h = False, None
        try:
            installed, h = self._rank0(boundary)
        except WorkerStopped as e:
            self._exit_on_sigterm(str(e))
        if h is not None:
            self.pacing.inner_steps = h  # decided on the main process (DyLU); every process agrees
        self._after_install(installed)
        if not result or worker is None:
            return None
        metrics = result[0].metrics()
        self.metrics.update(metrics)
        self.metrics.update(worker.totals)
        if self.log_fn is not None:
            self.log_fn(metrics)
        if self.verbose:
            r = result[0]
            line = f"DiLoCo {self.node_id} | step {self.num_steps} | sync {r.boundary} | outer_step {r.outer_step}"
            if r.installed is not None:
                line += f" | installed {r.installed.outer_step} (staleness {r.installed.staleness})"
            sent = float(worker.totals.get("bytes_uploaded_total", 0))
            line += f" | {sent_text(metrics.get('diloco/upload_bytes'), sent, r.pending_phases)}"
            if self.pacing.auto:
                line += f" | next H {self.pacing.inner_steps}"
            if r.wait_seconds:
                line += f" | waited {r.wait_seconds:.2f} s"
            log.info("%s", line)
        return result[0]

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Counters and (main process) the anchor and anything undelivered; saved by
        ``accelerator.save_state`` (this object is registered for checkpointing)."""
        out: dict[str, Any] = {"version": _STATE_VERSION, "num_steps": self.num_steps, "worker": None, "anchor": None,
                               "last_boundary": self._last_boundary, "pacing": self.pacing.state_dict()}
        if self.worker is not None:
            out["worker"] = self.worker.state_dict()
            if self.worker.anchor is not None:
                out["anchor"] = self.worker.anchor_state()
        elif self._restored is not None:
            out["worker"] = self._restored.get("worker")
            out["anchor"] = self._restored.get("anchor")
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (``accelerator.load_state``); must happen before ``with``/``start()``."""
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            raise ValueError("not a diloco_lightning.adapters.accelerate.DiLoCo state")
        if self.worker is not None:
            raise RuntimeError(
                "DiLoCo.load_state_dict: the worker is already running; call accelerator.load_state() before "
                "entering the `with DiLoCo(...)` block"
            )
        self.num_steps = int(state.get("num_steps", 0))
        last = state.get("last_boundary")
        h = self.pacing.inner_steps or 1
        self._last_boundary = int(last) if isinstance(last, int) else self.num_steps - self.num_steps % h
        self.pacing.load_state_dict(state.get("pacing") or {})
        self._restored = {"worker": state.get("worker"), "anchor": state.get("anchor")}
