"""When and how the simulator computes a worker's phase: one by one, on threads, or batched.

A phase depends only on the version it starts from and its worker's own state (inner optimizer,
schedule, data position), so it can be computed at any time between the moment that version is
known (the phase *begins*: :meth:`PhaseRunner.begin`) and the moment its delta is needed (it
reaches the master: :meth:`PhaseRunner.result`), as long as each worker's phases are computed in
order. The runners differ only in when they compute, never in what:

* :class:`PhaseRunner`: when the delta is needed, one phase at a time;
* :class:`ThreadRunner`: at once, on a thread of the worker's own (``parallel > 1``: the workers'
  phases overlap on the cores; torch releases the GIL inside its ops);
* :class:`BatchedRunner`: when a delta is needed, that phase together with every other worker's
  phase that has begun and not been computed, as one batched step per inner step
  (:class:`~diloco_lightning.sim.batched.StackedWorkers`).

A phase whose base is only known when its delta arrives (lockstep in arrival mode: it starts from
the version ``delay`` outer steps before the one it is applied to) is computed then, alone
(:meth:`PhaseRunner.now`), whatever the runner. A phase that will be lost (its worker leaves or
is preempted before it ends: known when it begins) is never given to a runner, so a worker's state
stays that of its last finished phase, as a restarted worker's checkpoint has it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from torch import Tensor

from diloco_lightning.sim.batched import StackedWorkers, why_not_batched
from diloco_lightning.sim.inner import SimWorker
from diloco_lightning.util.options import OptionError

__all__ = ["BatchedRunner", "PhaseRunner", "ThreadRunner", "choose_runner"]

#: a phase to compute: (its base version's index, the version's state, SimWorker.phase's options, inner steps)
Job = tuple[int, Mapping[str, Tensor], dict[str, Any], int]


class PhaseRunner:
    """Computes each phase when its delta is needed (see the module docstring)."""

    def __init__(self, workers: Sequence[SimWorker]) -> None:
        self.workers = list(workers)
        self._jobs: dict[tuple[int, int], Job] = {}
        self.batches: list[int] = []  # phases per computation (a histogram of the batch sizes)

    def begin(self, k: int, r: int, job: Job) -> None:
        """Worker ``k``'s phase ``r`` begins from a known version."""
        self._jobs[(k, r)] = job

    def result(self, k: int, r: int) -> tuple[int, dict[str, Tensor]]:
        """``(base, delta)`` of worker ``k``'s phase ``r`` (begun), computed by now."""
        base, state, options, steps = self._jobs.pop((k, r))
        self.batches.append(1)
        return base, self.workers[k].phase(state, inner_steps=steps, **options)

    def now(self, k: int, state: Mapping[str, Tensor], options: dict[str, Any], steps: int) -> dict[str, Tensor]:
        """A phase of worker ``k`` whose base is only known now, computed now."""
        self.batches.append(1)
        return self.workers[k].phase(state, inner_steps=steps, **options)

    def close(self) -> None:
        """The run is over (threads stop)."""


class ThreadRunner(PhaseRunner):
    """Computes each phase as soon as it begins, on its worker's own thread."""

    def __init__(self, workers: Sequence[SimWorker]) -> None:
        super().__init__(workers)
        self._pools = [ThreadPoolExecutor(1, thread_name_prefix=f"sim-{w.node_id}") for w in self.workers]
        self._ahead: dict[tuple[int, int], tuple[int, Future]] = {}

    def begin(self, k: int, r: int, job: Job) -> None:
        base, state, options, steps = job
        self._ahead[(k, r)] = (base, self._pools[k].submit(self.workers[k].phase, state, inner_steps=steps, **options))

    def result(self, k: int, r: int) -> tuple[int, dict[str, Tensor]]:
        base, future = self._ahead.pop((k, r))
        self.batches.append(1)
        return base, future.result()

    def close(self) -> None:
        for pool in self._pools:
            pool.shutdown(wait=True, cancel_futures=True)


class BatchedRunner(PhaseRunner):
    """Computes a needed phase together with every other begun one (see the module docstring).

    ``groups``: the workers are split into that many groups of consecutive workers, each stacked
    on its own and computed on a thread of its own (on a CPU: one group per core, each batched
    computation on one intra-op thread, so the cores are used without OpenMP threads that spin
    against each other on a shared machine; on a GPU: one group)."""

    def __init__(self, workers: Sequence[SimWorker], groups: int = 1) -> None:
        super().__init__(workers)
        n = max(1, min(int(groups), len(self.workers) // 2))  # a group of one has nothing to batch
        bounds = [round(i * len(self.workers) / n) for i in range(n + 1)]
        self._group_of: list[int] = []
        self.stacked: list[StackedWorkers] = []
        for g in range(n):
            members = self.workers[bounds[g]:bounds[g + 1]]
            self.stacked.append(StackedWorkers(members))
            self._group_of += [g] * len(members)
        self._pools = [ThreadPoolExecutor(1, thread_name_prefix=f"sim-batch{g}") for g in range(n)] if n > 1 else None
        self._queue: list[deque[tuple[int, Job]]] = [deque() for _ in self.workers]  # per worker: (r, job), in order
        self._done: dict[tuple[int, int], tuple[int, dict[str, Tensor]]] = {}

    def begin(self, k: int, r: int, job: Job) -> None:
        self._queue[k].append((r, job))

    def result(self, k: int, r: int) -> tuple[int, dict[str, Tensor]]:
        while (k, r) not in self._done:
            heads: list[list[tuple[int, int, Job]]] = [[] for _ in self.stacked]
            for j, q in enumerate(self._queue):
                if q:
                    heads[self._group_of[j]].append((j, *q.popleft()))
            assert any(heads), f"phase {r} of worker {k} was never begun"
            work = [(g, h) for g, h in enumerate(heads) if h]
            if self._pools is None or len(work) == 1:
                done = [self._compute(g, h) for g, h in work]
            else:
                futures = [self._pools[g].submit(self._compute, g, h) for g, h in work]
                done = [f.result() for f in futures]
            for part in done:
                self._done.update(part)
        return self._done.pop((k, r))

    def _compute(self, g: int, heads: list[tuple[int, int, Job]]) -> dict[tuple[int, int], tuple[int, dict[str, Tensor]]]:
        """The phases ``heads`` (distinct workers of group ``g``), as one batch (a single one plainly)."""
        self.batches.append(len(heads))
        if len(heads) == 1:  # nothing to batch it with: the plain step
            j, r, (base, state, options, steps) = heads[0]
            return {(j, r): (base, self.workers[j].phase(state, inner_steps=steps, **options))}
        deltas = self.stacked[g].run([(self.workers[j], state, options, steps) for j, _, (_, state, options, steps)
                                      in heads])
        return {(j, r): (base, delta) for (j, r, (base, *_)), delta in zip(heads, deltas)}

    def close(self) -> None:
        for pool in self._pools or []:
            pool.shutdown(wait=True, cancel_futures=True)


def _on_gpu(workers: Sequence[SimWorker]) -> bool:
    first = next(iter(workers[0].params.values()), None)
    return first is not None and first.device.type == "cuda"


def choose_runner(workers: Sequence[SimWorker], batched: bool | None, parallel: int, *,
                  known_at_delivery: bool) -> tuple[PhaseRunner, str | None]:
    """The runner of a run, and why its phases are not batched (None: they are): batched where the
    workers allow it and ``batched`` is True (required: an error says why not) or None on a GPU (on a
    CPU the batched step measured no faster, docs/simulator.md), else on threads (``parallel > 1``),
    else one by one. ``known_at_delivery``: the phases' versions are known only when their deltas
    arrive (lockstep in arrival mode)."""
    reason = None if batched is False else why_not_batched(workers)
    if reason is None and known_at_delivery:
        reason = "lockstep in arrival mode computes each phase when its delta arrives"
    if batched is False:
        reason = "sim.batched=false"
    elif batched is None and reason is None and not _on_gpu(workers):
        reason = "on a CPU the batched step is not faster (docs/simulator.md): sim.batched=true batches anyway"
    if batched is True and reason is not None:
        raise OptionError("batched", f"the phases cannot be batched: {reason} (sim.batched=null batches where it can)")
    if reason is None:
        return BatchedRunner(workers, groups=parallel), None
    if parallel > 1 and not known_at_delivery:
        return ThreadRunner(workers), reason
    return PhaseRunner(workers), reason
