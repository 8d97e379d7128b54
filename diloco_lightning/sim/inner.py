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

With fragments (Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512;
``diloco_lightning/wire/fragments.py``) a phase is ``inner_steps / F`` steps between two boundaries,
as the product's worker has them: the ``r``-th boundary exports fragment ``plan.fragment_at(r)``
against that fragment's own anchor, and that same fragment is then installed from the version
the next phase starts from: always in lockstep (the product installs exactly version
``r - delay``), and in ``async`` only when that version updated the fragment since the anchor's
base (:meth:`~diloco_lightning.worker.fragstate.FragmentBook.updated`, the product's rule). The
anchor's bases and the tokens per fragment are the product's
:class:`~diloco_lightning.worker.fragstate.FragmentBook`.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from diloco_lightning.sim.options import PRECISIONS
from diloco_lightning.wire.delta import synced_keys
from diloco_lightning.wire.fragments import build_plan
from diloco_lightning.worker.fragstate import FragmentBook
from diloco_lightning.worker.params import copy_into

__all__ = ["PRECISIONS", "InnerLoop", "SimWorker", "average_optimizer_states", "check_fragments", "precision_context"]

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


@torch.no_grad()
def average_optimizer_states(optimizers: "list[torch.optim.Optimizer]") -> None:
    """Set every optimizer's state to the optimizers' mean, entry by entry (``sim.sync_inner_state``).

    The optimizers are the same kind over the same model (their ``param_groups`` align parameter by
    parameter, as K workers' do). Floating-point tensors (AdamW's ``exp_avg`` / ``exp_avg_sq``, Muon's
    momentum) become the mean over the optimizers that hold the entry, in FP32, cast back; the rest (a
    step count) must already agree. A parameter no optimizer has state for yet is left alone."""
    if len(optimizers) < 2:
        return
    lists = [[p for g in o.param_groups for p in g["params"]] for o in optimizers]
    if len({len(x) for x in lists}) != 1:
        raise ValueError("sync_inner_state: the workers' optimizers hold different numbers of parameters")
    for params in zip(*lists):
        states = [o.state[p] for o, p in zip(optimizers, params) if p in o.state and o.state[p]]
        if not states:
            continue
        if len(states) != len(optimizers):
            raise ValueError("sync_inner_state: some workers have inner state for a parameter and some do not")
        for key, first in list(states[0].items()):
            if torch.is_tensor(first) and first.is_floating_point() and key != "step":
                mean = torch.stack([s[key].float() for s in states]).mean(0)
                for s in states:
                    s[key].copy_(mean.to(s[key].dtype))
            elif any((torch.is_tensor(s[key]) and not torch.equal(s[key], first)) or
                     (not torch.is_tensor(s[key]) and s[key] != first) for s in states):
                raise ValueError(f"sync_inner_state: the workers' {key!r} differ ({[s[key] for s in states]})")


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
        module: the model the loss is computed with (None: unknown), and
        module_loss: ``(module, batch) -> loss``, the same loss as ``loss_fn(batch)`` computed
            with ``module``: with both, the batched simulator can compute it with another
            worker's parameters (:mod:`diloco_lightning.sim.batched`); ``loss_fn`` may then be None.
    """

    def __init__(
        self,
        loss_fn: Callable[[Any], Tensor] | None,
        optimizer: torch.optim.Optimizer,
        batches: Iterator[Any],
        *,
        scheduler: Any = None,
        gradient_clip_val: float | None = None,
        precision: str = "32-true",
        device: torch.device | str = "cpu",
        count_tokens: Callable[[Any], int] | None = None,
        module: torch.nn.Module | None = None,
        module_loss: Callable[[torch.nn.Module, Any], Tensor] | None = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} is not simulated; use one of {', '.join(PRECISIONS)}")
        if (module is None) != (module_loss is None):
            raise ValueError("module and module_loss go together: give both or neither")
        if loss_fn is None:
            if module is None or module_loss is None:
                raise ValueError("loss_fn: give a loss function, or module and module_loss")
            loss_fn = functools.partial(module_loss, module)
        self.loss_fn = loss_fn
        self.module = module
        self.module_loss = module_loss
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
        batch = self.next_batch()
        self.optimizer.zero_grad(set_to_none=True)
        with precision_context(self.precision, self.device):
            loss = self.loss_fn(batch)
        loss.backward()
        self.update()
        return loss.detach()

    def next_batch(self) -> Any:
        """The next training batch, on the device, its tokens counted."""
        batch = next(self.batches)
        if self.device.type != "cpu":
            batch = batch.to(self.device, non_blocking=True) if isinstance(batch, Tensor) else batch
        if self.count_tokens is not None:
            self.tokens += int(self.count_tokens(batch))
        return batch

    def update(self) -> None:
        """The step after the backward pass (the gradients are in the parameters' ``.grad``):
        clip, ``optimizer.step()``, ``scheduler.step()``."""
        if self.gradient_clip_val is not None:
            torch.nn.utils.clip_grad_norm_(self._clipped(), self.gradient_clip_val)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()


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
        fragments: the ``fragments`` option (None or 1: none); ``inner_steps`` must be a multiple of F.
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
        fragments: Any = None,
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
        #: the fragments (None: every phase exports every synced key)
        self.plan = build_plan(fragments, {k: self.params[k] for k in self.synced})
        if self.plan is not None and self.inner_steps % self.plan.count:
            raise ValueError(f"fragments={self.plan.count} needs inner_steps to be a multiple of {self.plan.count}, "
                             f"got inner_steps={self.inner_steps}")
        #: per fragment: the anchor's (base_outer_step, fragment outer steps) and tokens since its last delta
        self.book = FragmentBook(self.plan)
        self._anchors: dict[str, dict[str, Tensor]] = {}  # per fragment: its FP32 anchor
        #: boundary -> (base_outer_step, the fragment header entries) of its delta (fragments only)
        self.headers: dict[int, tuple[int, dict[str, str]]] = {}
        self._num_tokens: dict[int, int | None] = {}  # boundary -> tokens its fragment's delta covers
        self._anchor: dict[str, Tensor] = {}  # the open phase's FP32 anchor (no fragments)
        self._pending: list[tuple[int, Tensor]] = []  # the open phase's (step, loss) lines to record
        self._last: Tensor | None = None  # the open phase's last loss

    @property
    def phase_steps(self) -> int:
        """Inner steps between two boundaries: H, or H / F with fragments."""
        return self.inner_steps // (self.plan.count if self.plan is not None else 1)

    @property
    def phases(self) -> int | None:
        """The phases (boundaries) of :attr:`phase_steps` this worker exports in all under its
        step cap (None: no cap)."""
        return None if self.max_steps is None else self.max_steps // self.phase_steps

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

    def phase(self, base: Mapping[str, Tensor], *, version: int = 0, steps: Mapping[str, int] | None = None,
              exact: bool = True, inner_steps: int | None = None, reset: bool = False) -> dict[str, Tensor]:
        """Install ``base``, take a phase's steps (``inner_steps``, default :attr:`phase_steps`),
        return the pseudo-gradient ``anchor - local`` (CPU FP32).

        With fragments: ``base`` is global version ``version``, whose fragments' outer step counts
        are ``steps``; the first phase installs all of it, a later one the fragment of the last
        boundary (``exact``: always, as lockstep does; else only when ``base`` updated it), and
        the delta returned is the next boundary's fragment's (its header: :attr:`headers`).

        The same as :meth:`open_phase`, ``inner_steps`` times :meth:`inner.step() <InnerLoop.step>`
        and :meth:`record_step`, then :meth:`close_phase`: the batched simulator
        (:mod:`diloco_lightning.sim.batched`) takes the steps of several workers' phases at once
        between the same two calls."""
        t0 = time.perf_counter()
        n = self.open_phase(base, version=version, steps=steps, exact=exact, inner_steps=inner_steps, reset=reset)
        for _ in range(n):
            self.record_step(self.inner.step())
        self.compute_seconds += time.perf_counter() - t0
        return self.close_phase()

    def open_phase(self, base: Mapping[str, Tensor], *, version: int = 0, steps: Mapping[str, int] | None = None,
                   exact: bool = True, inner_steps: int | None = None, reset: bool = False) -> int:
        """Install ``base`` (see :meth:`phase`) and return the inner steps the phase takes.
        ``reset``: the phase installs a version the last one did not start from, and the worker
        clears its inner optimizer's state after an install (``reset_inner_optimizer``, as the
        product's adapters do)."""
        if reset:
            self.inner.optimizer.state.clear()
        if self.plan is None:
            self._anchor = self.install(base)
        else:
            self._install_fragments(base, version, steps, exact)
        self._pending = []
        return self.phase_steps if inner_steps is None else int(inner_steps)

    def record_step(self, loss: Tensor) -> None:
        """One inner step of the open phase was taken, with this (detached) loss."""
        self.steps += 1
        s = self.steps
        last = None if self.phases is None else self.phases * self.phase_steps
        if s == 1 or s % self.log_every == 0 or s == self.max_steps or s == last:
            self._pending.append((s, loss))
        self._last = loss

    def close_phase(self) -> dict[str, Tensor]:
        """End the open phase: its pseudo-gradient (see :meth:`phase`)."""
        self.losses.extend((s, float(v)) for s, v in self._pending)  # one device sync per phase
        self._pending = []
        if self._last is not None:
            self.last_loss = float(self._last)
            self._last = None
        tokens = self.inner.tokens - self._tokens_after[-1]
        with torch.no_grad():
            if self.plan is None:
                anchor, self._anchor = self._anchor, {}
                delta = {k: anchor[k] - _fp32(self.params[k]) for k in self.synced}
            else:
                delta = self._export(self.boundaries + 1, tokens)
        self.boundaries += 1
        self._tokens_after.append(self.inner.tokens)
        return delta

    def _install_fragments(self, base: Mapping[str, Tensor], version: int, steps: Mapping[str, int] | None,
                           exact: bool) -> None:
        plan = self.plan
        assert plan is not None
        if self.boundaries == 0:  # the start: the whole version (the product's first install)
            anchor = self.install(base)
            self.book.rebase_all(version, steps, "the simulator")
            self._anchors = {n: plan.substate(n, anchor) for n in plan.names}
            return
        name = plan.fragment_at(self.boundaries)  # the fragment the last boundary synced
        if not (exact or self.book.updated(name, steps)):
            return
        assert steps is not None
        src = plan.substate(name, base)
        with torch.no_grad():
            for k, dst in plan.substate(name, self.params).items():
                dst.copy_(src[k])
        buffers = {k: v for k, v in base.items() if k in self.params and k not in self.synced}
        if buffers:  # integer buffers travel with every install
            copy_into(self.params, buffers, what="a global version")
        self._anchors[name] = {k: _fp32(v) for k, v in src.items()}
        self.book.base[name] = (version, int(steps[name]))

    def _export(self, r: int, tokens: int) -> dict[str, Tensor]:
        """Boundary ``r``: fragment ``plan.fragment_at(r)``'s ``anchor - local``; its anchor moves to the local values."""
        plan = self.plan
        assert plan is not None
        name = plan.fragment_at(r)
        local = {k: _fp32(v) for k, v in plan.substate(name, self.params).items()}
        anchor = self._anchors[name]
        delta = {k: anchor[k] - local[k] for k in local}
        self._anchors[name] = local
        base, fbase = self.book.base[name]
        self.headers[r] = (base, {"fragment": name, "fragments": str(plan.count), "base_fragment_step": str(fbase)})
        self._num_tokens[r] = self.book.tokens(name, tokens if self.inner.count_tokens is not None else None)
        return delta

    def tokens_at(self, boundary: int) -> int:
        """Tokens trained on up to ``boundary`` (0 before the first phase)."""
        return self._tokens_after[boundary]

    def delta_tokens(self, boundary: int) -> int | None:
        """The ``num_tokens`` of boundary ``boundary``'s delta: the tokens of its phase, or with
        fragments those since its fragment's last delta (the product's count)."""
        if self.plan is not None:
            return self._num_tokens.pop(boundary, None) or None
        return (self.tokens_at(boundary) - self.tokens_at(boundary - 1)) or None


def _fp32(t: Tensor) -> Tensor:
    """A CPU FP32 (complex64) copy of ``t``'s values, as the product's anchor and snapshot are."""
    target = torch.complex64 if t.is_complex() else torch.float32
    t = t.detach()
    if t.device.type == "cpu" and t.dtype == target:
        return t.clone()
    return t.to("cpu", target)


def check_fragments(workers: list[SimWorker], plan: Any, dylu: bool) -> None:
    """The workers split the model as the master does (``plan``, its fragment plan); no DyLU with
    fragments (as the product). Error feedback is per key, so each fragment keeps its own residual."""
    ours = FragmentBook(plan).digests()
    for w in workers:
        if w.book.digests() != ours:
            raise ValueError(f"worker {w.node_id} splits the model into "
                             f"{'no' if w.plan is None else w.plan.count} fragments, the master into "
                             f"{'none' if ours is None else len(ours)}: give both the same fragments")
    if ours is not None and dylu:
        raise ValueError(f"fragments={len(ours)} cannot be combined with Dynamic Local Updates (dylu): the "
                         f"boundaries every H / F steps are the fragments' schedule")
