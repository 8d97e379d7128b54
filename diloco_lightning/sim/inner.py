"""One simulated worker: its model, its inner optimizer and data, and what it does in a phase.

:class:`InnerLoop` takes one inner step the way Lightning's automatic optimization takes it for
the product's worker (``zero_grad``; forward under the trainer's precision; ``backward``; the
gradient norm clipped over the optimizer's parameters in ``param_groups`` order, as
``Trainer(gradient_clip_val=...)`` does; ``optimizer.step()``; ``scheduler.step()``), without a
``Trainer``. :class:`SimWorker` runs a phase as :class:`~diloco_lightning.worker.DiLoCoWorker`
does between two boundaries: install a global version in place
(:func:`~diloco_lightning.worker.params.copy_into`), keep an FP32 anchor of it, take
``inner_steps`` steps, export ``anchor - local`` in FP32 (DiLoCo, Douillard et al. 2023, arXiv
2311.08105). The inner optimizer's state, the learning-rate schedule and the data stream go on
from phase to phase, as in the product.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from diloco_lightning.deltafile import synced_keys
from diloco_lightning.worker.params import copy_into

__all__ = ["PRECISIONS", "InnerLoop", "SimWorker", "precision_context"]

#: the trainer precisions the simulator reproduces (``16-mixed`` needs a GradScaler: not simulated)
PRECISIONS = ("32-true", "bf16-true", "bf16-mixed")


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """What Lightning wraps a training step in: nothing for ``32-true`` and ``bf16-true`` (whose
    weights are bf16 already; Lightning also makes bf16 the default dtype inside the step, which
    changes nothing for a model that gives every tensor it creates a dtype, as the product's Llama
    does, and is not done here: the default dtype is process-wide and workers run in threads), or
    bf16 autocast (``bf16-mixed``)."""
    if precision in ("32-true", "bf16-true"):
        return contextlib.nullcontext()
    if precision == "bf16-mixed":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise ValueError(f"precision {precision!r} is not simulated; use one of {', '.join(PRECISIONS)}")


class InnerLoop:
    """One worker's inner steps (see the module docstring).

    Args:
        loss_fn: ``batch -> loss`` (a scalar tensor), the training step's loss.
        optimizer: the inner optimizer (e.g. ``lit_module.build_inner_optimizer``'s).
        scheduler: stepped after every optimizer step (None: none).
        batches: the worker's training stream (an iterator of batches).
        gradient_clip_val: clip the global gradient norm to this (None: no clipping).
        precision: one of :data:`PRECISIONS`.
        device: where the batches go (the model's device).
        count_tokens: ``batch -> int`` tokens trained on (for ``num_tokens`` and results).
    """

    def __init__(
        self,
        loss_fn: Callable[[Any], Tensor],
        optimizer: torch.optim.Optimizer,
        batches: Iterator[Any],
        *,
        scheduler: Any = None,
        gradient_clip_val: float | None = None,
        precision: str = "32-true",
        device: torch.device | str = "cpu",
        count_tokens: Callable[[Any], int] | None = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is not simulated; use one of {', '.join(PRECISIONS)}")
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.batches = batches
        self.gradient_clip_val = gradient_clip_val
        self.precision = precision
        self.device = torch.device(device)
        self.count_tokens = count_tokens
        self.tokens = 0

    def _clipped(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def step(self) -> Tensor:
        """One inner step; returns the (detached) loss."""
        batch = next(self.batches)
        if self.device.type != "cpu":
            batch = batch.to(self.device, non_blocking=True) if isinstance(batch, Tensor) else batch
        if self.count_tokens is not None:
            self.tokens += int(self.count_tokens(batch))
        self.optimizer.zero_grad(set_to_none=True)
        with precision_context(self.precision, self.device):
            loss = self.loss_fn(batch)
        loss.backward()
        if self.gradient_clip_val is not None:
            torch.nn.utils.clip_grad_norm_(self._clipped(), self.gradient_clip_val)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return loss.detach()


class SimWorker:
    """One worker of a simulated run (see the module docstring).

    Args:
        index: the worker's index (``node_id`` is ``w<index>`` unless given).
        params: ``name -> tensor`` to install into and export from
            (:func:`~diloco_lightning.worker.params.module_state` of its model).
        inner: its :class:`InnerLoop`.
        inner_steps: H, inner steps per phase (the first phase's with Dynamic Local Updates: the
            engine gives each later phase its own, :meth:`phase`'s ``inner_steps``).
        max_steps: a cap on its inner steps (the trailing steps that would not fill a phase, which
            never reach the master, are not run; None: no cap, the engine's ``max_time`` decides).
        speed: inner steps per unit of simulated time.
        log_every: record the loss at step 1, every ``log_every`` steps and at the last step (the
            product's ``progress.jsonl``).
    """

    def __init__(
        self,
        index: int,
        params: Mapping[str, Tensor],
        inner: InnerLoop,
        *,
        inner_steps: int,
        max_steps: int | None,
        speed: float = 1.0,
        log_every: int = 10,
        node_id: str | None = None,
    ) -> None:
        self.index = index
        self.node_id = node_id or f"w{index}"
        self.params = dict(params)
        self.synced = synced_keys(self.params)
        self.inner = inner
        self.inner_steps = int(inner_steps)
        self.max_steps = None if max_steps is None or max_steps < 0 else int(max_steps)
        self.speed = float(speed)
        self.log_every = max(1, int(log_every))
        self.steps = 0  # inner steps taken
        self.boundaries = 0  # phases exported
        self.losses: list[tuple[int, float]] = []  # (step, loss): the progress file's lines
        self.compute_seconds = 0.0
        self.last_loss = float("nan")
        self._tokens_after = [0]  # tokens trained on after each phase (num_tokens of its delta)
        self.planned = 0  # inner steps of the phases begun (computed or not)
        self.phase_lengths: list[int] = []  # H of each phase begun

    @property
    def phases(self) -> int | None:
        """The phases of ``inner_steps`` this worker exports in all under its step cap (None: no cap)."""
        return None if self.max_steps is None else self.max_steps // self.inner_steps

    def fits(self, steps: int) -> bool:
        """Whether a phase of ``steps`` more inner steps stays within ``max_steps``."""
        return self.max_steps is None or self.planned + steps <= self.max_steps

    def begin_phase(self, steps: int) -> None:
        """A phase of ``steps`` inner steps begins (its steps count against ``max_steps``)."""
        self.planned += steps
        self.phase_lengths.append(steps)

    def install(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Copy ``state`` into the params in place; returns the FP32 anchor (CPU) it becomes."""
        copy_into(self.params, {k: v for k, v in state.items() if k in self.params}, what="a global version",
                  required=self.synced)
        return {k: _fp32(state[k]) for k in self.synced}

    def phase(self, base: Mapping[str, Tensor], *, inner_steps: int | None = None) -> dict[str, Tensor]:
        """Install ``base``, take ``inner_steps`` (default :attr:`inner_steps`) steps, return the
        pseudo-gradient ``anchor - local`` (CPU FP32)."""
        t0 = time.perf_counter()
        anchor = self.install(base)
        pending: list[tuple[int, Tensor]] = []
        n = self.inner_steps if inner_steps is None else int(inner_steps)
        last_step = None if self.phases is None else self.phases * self.inner_steps
        loss = None
        for _ in range(n):
            loss = self.inner.step()
            self.steps += 1
            s = self.steps
            if s == 1 or s % self.log_every == 0 or s == self.max_steps or s == last_step:
                pending.append((s, loss))
        self.losses.extend((s, float(v)) for s, v in pending)  # one device sync per phase
        if loss is not None:
            self.last_loss = float(loss)
        with torch.no_grad():
            delta = {k: anchor[k] - _fp32(self.params[k]) for k in self.synced}
        self.boundaries += 1
        self._tokens_after.append(self.inner.tokens)
        self.compute_seconds += time.perf_counter() - t0
        return delta

    def tokens_at(self, boundary: int) -> int:
        """Tokens trained on up to ``boundary`` (0 before the first phase)."""
        return self._tokens_after[boundary]


def _fp32(t: Tensor) -> Tensor:
    """A CPU FP32 (complex64) copy of ``t``'s values, as the product's anchor and snapshot are."""
    target = torch.complex64 if t.is_complex() else torch.float32
    t = t.detach()
    if t.device.type == "cpu" and t.dtype == target:
        return t.clone()
    return t.to("cpu", target)
