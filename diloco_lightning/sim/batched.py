"""K workers' inner steps as one step over stacked parameters (the batched simulator).

K small models stepped one after the other pay K times every operator's fixed cost (on a GPU, a
kernel launch each; on a CPU, the dispatcher and the autograd graph), for arithmetic that K
workers of one model shape do identically. :class:`StackedWorkers` keeps each parameter of the K
workers in one ``(K, *shape)`` tensor (what ``torch.func.stack_module_state`` builds, kept rather
than copied), makes every worker's own parameters *views* of their row, and takes an inner step
of any subset of the workers as one batched forward and backward pass: ``torch.func.vmap`` over
``torch.func.functional_call`` of the first worker's module with each worker's rows (the "model
ensembling" recipe), the losses summed, one ``backward()`` filling each stacked tensor's
gradient.

What follows the backward pass is each worker's own: its gradients are views of its rows of
those gradients, and its :meth:`InnerLoop.update <diloco_lightning.sim.inner.InnerLoop.update>` clips
them (the product's global-norm clipping over its parameter groups), takes **its own inner
optimizer's step** (the product's AdamW, fused, with its state and step count; 8-bit AdamW too)
and steps its learning-rate schedule. These are elementwise over each worker's tensors, so one
call per worker does the same arithmetic as a call over the stacked state would, without a
second implementation of the optimizer to keep equal to the product's; they cost a few
operators per worker against the hundreds of a forward and backward pass. Because every
worker's parameters are views of the stacked tensor, installing a version, exporting a delta,
or an unbatched step of one worker (:meth:`SimWorker.phase
<diloco_lightning.sim.inner.SimWorker.phase>`) work on the same storage unchanged.

**What it computes is the unbatched step to float tolerance, not bit for bit**: the batched
matrix products and the vmapped reductions may add in another order than K separate calls
(``tests/test_sim_batched.py`` states the tolerance and why). Everything else (data order, the
optimizer, clipping, the schedule, the installs and the deltas) is the unbatched code itself.

What cannot be batched (:func:`why_not_batched` says which, and the simulator then steps the
workers one by one): workers without a ``module`` and ``module_loss`` (an :class:`InnerLoop`
built from a bare ``loss_fn``), models of different parameter names, shapes, dtypes or devices,
parameters of more than one dtype, parameters not trained (``requires_grad`` off or outside the
optimizer's groups), modules with buffers (a batched forward would share the first worker's),
and trainer precisions or clipping that differ between workers. A model that draws random
numbers in its forward (dropout) fails in ``vmap``; run it with ``sim.batched=false``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from diloco_lightning.sim.inner import InnerLoop, SimWorker, precision_context

__all__ = ["StackedWorkers", "why_not_batched"]

#: the performance note vmap prints for operators without a batching rule (attention's backward on
#: a CPU): the fallback runs them once per worker, as the unbatched step does
_NO_RULE = r"There is a performance drop because we have not yet implemented the batching rule"


class _ModuleLoss(nn.Module):
    """``module_loss(module, batch)`` as a module's forward, for ``functional_call``."""

    def __init__(self, module: nn.Module, module_loss: Any) -> None:
        super().__init__()
        self.module = module
        self._module_loss = module_loss

    def forward(self, batch: Any) -> Tensor:
        return self._module_loss(self.module, batch)


def _layout(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return list(module.named_parameters())


def why_not_batched(workers: Sequence[SimWorker]) -> str | None:
    """Why these workers' inner steps cannot be taken as one batched step (None: they can)."""
    if len(workers) < 2:
        return "a single worker (nothing to batch)"
    first = workers[0].inner
    if first.module is None or first.module_loss is None:
        return "the workers' InnerLoop has no module and module_loss"
    ref = [(n, tuple(p.shape), p.dtype, p.device) for n, p in _layout(first.module)]
    if not ref:
        return "the model has no parameters"
    if len({d for _, _, d, _ in ref}) > 1:
        return "the model's parameters have more than one dtype"
    for w in workers:
        inner = w.inner
        if inner.module is None or inner.module_loss is None:
            return f"worker {w.node_id}'s InnerLoop has no module and module_loss"
        if [(n, tuple(p.shape), p.dtype, p.device) for n, p in _layout(inner.module)] != ref:
            return f"worker {w.node_id}'s model differs from worker {workers[0].node_id}'s (names, shapes, dtypes or devices)"
        if any(True for _ in inner.module.buffers()):
            return "the model has buffers (a batched forward would use one worker's)"
        if (inner.precision, inner.gradient_clip_val, inner.device) != (first.precision, first.gradient_clip_val,
                                                                        first.device):
            return "the workers' precision, gradient clipping or device differ"
        stepped = {id(p) for g in inner.optimizer.param_groups for p in g["params"]}
        params = [p for _, p in _layout(inner.module)]
        if any(not p.requires_grad or id(p) not in stepped for p in params) or len(stepped) != len(params):
            return f"worker {w.node_id}'s optimizer does not step exactly the model's parameters"
    return None


def _stack(batches: Sequence[Any]) -> Any:
    """The workers' batches stacked along a new first dimension (tensors, or tuples / lists / dicts of them)."""
    first = batches[0]
    if isinstance(first, Tensor):
        return torch.stack(list(batches))
    if isinstance(first, (tuple, list)):
        return type(first)(_stack([b[i] for b in batches]) for i in range(len(first)))
    if isinstance(first, Mapping):
        return {k: _stack([b[k] for b in batches]) for k in first}
    raise TypeError(f"cannot stack batches of type {type(first).__name__} for the batched simulator")


class StackedWorkers:
    """The workers' parameters stacked, and their inner steps taken together (see the module docstring).

    Building it moves every worker's parameter values into the stacked tensor (the workers' own
    parameters become views of it); the workers go on working unbatched as before.
    """

    def __init__(self, workers: Sequence[SimWorker]) -> None:
        reason = why_not_batched(workers)
        if reason is not None:
            raise ValueError(f"these workers cannot be batched: {reason}")
        self.workers = list(workers)
        first = self.workers[0].inner
        assert first.module is not None and first.module_loss is not None
        layout = _layout(first.module)
        self.names = [name for name, _ in layout]
        #: name -> the workers' values of that parameter, stacked: (K, *shape), a leaf of its own
        self.stacked: dict[str, Tensor] = {}
        self._params: list[list[nn.Parameter]] = [[p for _, p in _layout(w.inner.module)]  # type: ignore[arg-type]
                                                  for w in self.workers]
        with torch.no_grad():
            for i, name in enumerate(self.names):
                stacked = torch.stack([mine[i].detach() for mine in self._params])
                for k, mine in enumerate(self._params):
                    mine[i].data = stacked[k]
                self.stacked[name] = stacked.requires_grad_(True)
        self._net = _ModuleLoss(first.module, first.module_loss)
        self._loss = torch.func.vmap(self._one_loss)
        self.steps = 0  # batched steps taken
        self.seconds = 0.0

    def _one_loss(self, params: dict[str, Tensor], batch: Any) -> Tensor:
        return torch.func.functional_call(self._net, params, (batch,))

    def _rows(self, index: Sequence[int]) -> dict[str, Tensor]:
        """The stacked parameters of the workers ``index`` (slices when they are consecutive)."""
        k, first = len(self.workers), index[0]
        if list(index) == list(range(first, first + len(index))):
            if len(index) == k:
                return dict(self.stacked)
            return {n: t[first:first + len(index)] for n, t in self.stacked.items()}
        at = torch.tensor(list(index), device=next(iter(self.stacked.values())).device)
        return {n: t[at] for n, t in self.stacked.items()}

    def step(self, index: Sequence[int]) -> list[Tensor]:
        """One inner step of each worker in ``index`` (positions in :attr:`workers`, increasing),
        together; returns their (detached) losses."""
        t0 = time.perf_counter()
        inners: list[InnerLoop] = [self.workers[k].inner for k in index]
        batch = _stack([inner.next_batch() for inner in inners])
        rows = self._rows(index)
        params = {f"module.{name}": t for name, t in rows.items()}
        for t in self.stacked.values():
            t.grad = None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_RULE)
            with precision_context(inners[0].precision, inners[0].device):
                losses = self._loss(params, batch)
            losses.sum().backward()
        grads = [self.stacked[name].grad for name in self.names]
        for k, inner in zip(index, inners):
            for g, p in zip(grads, self._params[k]):
                assert g is not None
                p.grad = g[k]
            inner.update()
            for p in self._params[k]:
                p.grad = None
        for t in self.stacked.values():
            t.grad = None
        self.steps += 1
        self.seconds += time.perf_counter() - t0
        out = losses.detach()
        return [out[i] for i in range(len(index))]

    def run(self, jobs: Sequence[tuple[SimWorker, Mapping[str, Tensor], dict[str, Any], int | None]]
            ) -> list[dict[str, Tensor]]:
        """Phases of distinct workers, together: ``(worker, base, phase options, inner_steps)``
        each (as :meth:`SimWorker.phase <diloco_lightning.sim.inner.SimWorker.phase>` takes them);
        returns their deltas in the same order. Phases of different lengths share the steps they
        have in common; the longer ones go on in a smaller batch."""
        t0 = time.perf_counter()
        position = {id(w): k for k, w in enumerate(self.workers)}
        order = sorted(range(len(jobs)), key=lambda j: position[id(jobs[j][0])])
        left = {}
        for j in order:
            w, base, options, steps = jobs[j]
            left[j] = w.open_phase(base, inner_steps=steps, **options)
        while any(left.values()):
            active = [j for j in order if left[j] > 0]
            losses = self.step([position[id(jobs[j][0])] for j in active])
            for j, loss in zip(active, losses):
                jobs[j][0].record_step(loss)
                left[j] -= 1
        deltas = [jobs[j][0].close_phase() for j in range(len(jobs))]
        share = (time.perf_counter() - t0) / max(1, len(jobs))
        for w, *_ in jobs:
            w.compute_seconds += share
        return deltas
