"""The simulator: K workers' inner loops and a master in one process, on a simulated clock.

A research tool as much as a test of the product ("test an outer optimizer under controlled
staleness in minutes"): the workers are :class:`~diloco_lightning.sim.inner.SimWorker` (any
model, any inner optimizer), the master is :class:`~diloco_lightning.sim.master.SimMaster`
(the product's gate, checks, round mean and outer optimizers), and the schedule is an event
queue on a simulated clock: worker ``k`` runs a phase of ``inner_steps`` steps in
``inner_steps / speed_k`` units of time, and events (a phase ends, a delta is uploaded) are
processed in time order, ties by the order they were queued (so by worker index at equal
speeds). Nothing else decides the order, so a run is a pure function of its options and seeds.

Staleness, as the product's ``sync`` modes define it:

* ``lockstep``, ``aggregation="round"`` (the product's lockstep with a quorum of every worker):
  round ``s`` (outer step ``s``) is the ``(s+1)``-th delta of every worker; worker ``k``'s delta
  ``r`` was computed from version ``max(0, r - 1 - tau)``, so it is applied with staleness
  ``tau`` counted in rounds (``r - 1`` for the first ``tau`` rounds, whose deltas start from
  version 0). A worker waits at boundary ``r`` for the version its next delta starts from, and
  a delta ``r`` is uploaded once version ``r - 1`` exists, as the product's are.
* ``lockstep``, ``aggregation="arrival"``: every delta is one outer step; the delta applied at
  outer step ``s`` was computed from version ``max(0, s - tau)``: staleness ``tau`` counted in
  arrivals. The clock orders the arrivals (round-robin over the workers at equal speeds); the
  delay is imposed, not caused by the clock (workers never wait).
* ``async``: no imposed delay. A worker starts each phase from the newest version and its delta
  is applied when the clock brings it: the staleness is what the speeds make it (K - 1 in
  arrival mode at equal speeds). In round mode a round closes every ``quorum`` deltas.

``tau`` is the ``delay`` option: an int, a per-worker list, or a distribution drawn once per
worker (:func:`~diloco_lightning.worker.sync.resolve_delay`, the product's draw) or, with
``delay_per="delta"``, once per delta (:func:`~diloco_lightning.worker.sync.draw_delay`),
capped at ``max_delay``; during the first ``burn_in`` outer steps it is 0.

A phase depends only on the version it starts from and the worker's own state (inner optimizer,
schedule, data position), so it can be computed whenever that version is known: with
``parallel > 1`` each worker computes its next phase on a thread of its own as soon as it begins
(round-mode lockstep and async; arrival-mode lockstep learns the version only when the delta is
applied), while the master and the other workers go on. torch releases the GIL inside its ops
and each worker's ops are exactly the sequential ones, so the results do not depend on
``parallel``. Phases are otherwise computed when their delta is applied.

Membership and a noisy clock (``sync="async"``): ``join_at`` / ``leave_at`` let a worker start
late (from the newest version at that time) or stop (a phase not finished when it leaves is
lost: the master never sees it), and ``speed_jitter`` multiplies each phase's duration by a
log-normal factor drawn from the seed, worker and phase. The quorum of a round (``quorum``)
stays what it was: rounds close every ``quorum`` deltas, whoever sends them. Every published
version and every evaluation carries its simulated time, so loss can be read against time.

Fragments (Streaming DiLoCo, ``diloco_lightning/wire/fragments.py``; the workers' and the master's
``fragments`` must agree): a phase is then the ``H / F`` steps between two boundaries and its
delta carries one fragment (:class:`~diloco_lightning.sim.inner.SimWorker`), so every schedule
above counts boundaries where it counted phases (lockstep: round ``s`` is every worker's
``(s+1)``-th boundary, one fragment each). The staleness the master applies is the fragment's
own (its outer steps since the delta's base, as the product's master counts it), which is what
the histogram records; the imposed delay is still counted in versions.

A budget of simulated time (``max_time``, :mod:`diloco_lightning.sim.options` for the units): a
worker begins a phase only if it would end by ``max_time``, so each keeps working as long as the
budget allows, as ``trainer.max_time`` makes a real worker. Lockstep's rounds wait for the
slowest worker as always; a round that some worker could not finish in time is not applied (the
product's lockstep master would still be waiting for it). Evaluations are then taken at given
simulated times (``eval_times``: the newest version at each), so runs of different speeds and
modes line up on one time axis; each also records the tokens of the deltas delivered by then.

Dynamic Local Updates (``dylu``): each worker chooses the H of its next phase when it begins it,
with the product's rule (:func:`~diloco_lightning.worker.pacing.dylu_inner_steps`), fed by the
step rates a heartbeat would carry: each worker's rate over its last finished phase in simulated
time (``H / duration``, jitter and trace included; none before its first phase ends), the peers'
those of the workers still live. Deltas then carry different numbers of tokens; the master's
``weighting="tokens"`` weights them by it.

The pseudo-gradient is encoded as a real worker encodes it (``delta_dtype``: a float cast, int8,
int4 or top-k, with the worker's error-feedback residual: :class:`~diloco_lightning.encoding.feedback.
ErrorFeedback`, one per worker) and decoded as the master decodes it, before the master sees it.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from diloco_lightning.sim.inner import SimWorker
from diloco_lightning.sim.master import SimMaster
from diloco_lightning.sim.options import SimOptions, phase_end
from diloco_lightning.worker.options import SYNC_MODES, feedback_of, resolve_encoding
from diloco_lightning.worker.fragstate import FragmentBook
from diloco_lightning.worker.pacing import dylu_inner_steps
from diloco_lightning.worker.sync import draw_delay, resolve_delay
from diloco_lightning.encoding.feedback import ErrorFeedback, decode_delta
from diloco_lightning.encoding import EncodingSpec

__all__ = ["SimResult", "Simulator", "as_received"]

log = logging.getLogger(__name__)

_PHASE_END, _UPLOAD, _JOIN = 0, 1, 2


def as_received(wire: Mapping[str, Any]) -> dict[str, Tensor]:
    """What the master adds to its sum from what a worker put on the wire: the tensors themselves,
    or, for an encoded value (``diloco_lightning.encoding.EncodedTensor``), its FP32 decoding."""
    return decode_delta(wire)


def _wire_bytes(wire: Mapping[str, Any]) -> int:
    total = 0
    for v in wire.values():
        if isinstance(v, Tensor):
            total += v.numel() * v.element_size()
        else:  # an encoded tensor: its parts
            total += v.nbytes
    return total


@dataclass
class SimResult:
    """What a simulated run produced (the product turns it into ``results.json``)."""

    outer_steps: int
    final_state: dict[str, Tensor]
    records: list[dict[str, Any]]  # one per published version (and refusals in between)
    eval_curve: list[list[float]]
    sim_time: float
    wall_seconds: float
    inner_steps: int  # inner steps taken, all workers
    bytes_sent: int
    deltas: int
    staleness_histogram: dict[str, int] = field(default_factory=dict)
    eval_times: list[float] = field(default_factory=list)  # simulated time of each eval_curve point
    lost_phases: int = 0  # phases in flight when their worker left
    eval_tokens: list[int] = field(default_factory=list)  # tokens delivered to the master by each eval_curve point
    stopped_early: bool = False  # an evaluation was above options.stop_above: the run stopped there


class Simulator:
    """See the module docstring.

    Args:
        workers: the workers, in index order.
        master: the master (its ``config.aggregation`` chooses round or arrival mode).
        sync: ``"lockstep"`` (imposed delays) or ``"async"`` (the clock's staleness).
        delay: the ``delay`` option (int, list, or a distribution mapping; its ``seed`` key, if
            any, seeds the draws).
        options: :class:`SimOptions` (speeds are read from the workers).
        delta_dtype: the workers' ``delta_dtype`` (the wire encoding: a name such as ``"int4"``,
            a float torch dtype, or an :class:`~diloco_lightning.encoding.EncodingSpec`).
        error_feedback: each worker keeps what its encoding dropped and adds it to its next delta
            (None: on for the lossy encodings, as in a real run).
        evaluate: ``state -> loss`` of a global version (None: no evaluation).
        eval_points: outer steps after which to evaluate (the first version at or past each).
        on_version: called with each version's record (progress lines, metrics files).
        parallel: workers whose phases may be computed at the same time, each on its own thread
            (1: one after the other in this thread); the results are the same.
        seed: seeds ``speed_jitter``'s draws.
        eval_times: simulated times at which to evaluate the newest version (instead of
            ``eval_points``; the ones past the end are taken on the final state).
        dylu: Dynamic Local Updates: ``{"max_steps": H_max, "min_steps": H_min or None,
            "seconds": a target time per phase or None}`` (None: every phase has the worker's
            ``inner_steps``).
    """

    def __init__(
        self,
        workers: Sequence[SimWorker],
        master: SimMaster,
        *,
        sync: str = "lockstep",
        delay: Any = 0,
        options: SimOptions | None = None,
        delta_dtype: torch.dtype | str | EncodingSpec = torch.float32,
        error_feedback: bool | None = None,
        evaluate: Callable[[Mapping[str, Tensor]], float] | None = None,
        eval_points: Sequence[int] = (),
        on_version: Callable[[dict[str, Any]], None] | None = None,
        parallel: int = 1,
        seed: int = 0,
        eval_times: Sequence[float] = (),
        dylu: Mapping[str, Any] | None = None,
    ) -> None:
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
        if not workers:
            raise ValueError("workers: a simulation needs at least one worker")
        self.workers = list(workers)
        self.master = master
        self.sync = sync
        self.options = (options or SimOptions()).validate(len(self.workers))
        if isinstance(delta_dtype, EncodingSpec):
            spec, feedback = delta_dtype, feedback_of(delta_dtype, error_feedback)
        else:
            spec, feedback = resolve_encoding(delta_dtype, error_feedback=error_feedback)
        self.encoding = spec
        self._feedback = [ErrorFeedback(spec, enabled=feedback) for _ in self.workers]
        self.dylu: dict[str, Any] | None = None
        if dylu is not None:
            self.dylu = {"max_steps": int(dylu["max_steps"]), "min_steps": dylu.get("min_steps"),
                         "seconds": dylu.get("seconds")}
        self._check_fragments(feedback)
        self.max_time = self.options.max_time
        if self.max_time is None and any(w.max_steps is None for w in self.workers):
            raise ValueError("a worker without max_steps needs a time budget (options.max_time), or the run never ends")
        self.evaluate = evaluate
        self.eval_points = sorted(set(int(p) for p in eval_points))
        self.on_version = on_version
        self.arrival = master.config.aggregation == "arrival"
        self.seed = int(seed)
        self._membership = [self.options.membership(w.index) for w in self.workers]
        if self.options.changes_membership() and sync != "async":
            raise ValueError("join_at / leave_at need sync='async' (lockstep's imposed delays expect every worker's "
                             "every delta)")
        self._active = [False] * len(self.workers)  # joined and not gone
        self.lost_phases = 0
        self.eval_times: list[float] = []
        self.eval_tokens: list[int] = []
        self._eval_at = sorted(set(float(t) for t in eval_times))
        self._last_eval: tuple[int, float] | None = None  # (outer step, loss) of the last evaluation
        self.stopped_early = False  # an evaluation above options.stop_above ended the run
        self._rate: list[float | None] = [None] * len(self.workers)  # steps per unit of time, last finished phase
        self._phase: dict[tuple[int, int], tuple[float, int]] = {}  # (worker, r) -> (start, steps)
        self._tokens_in = 0  # tokens of the deltas delivered to the master
        self.quorum = len(self.workers) if sync == "lockstep" else (self.options.quorum or len(self.workers))
        self._delay_spec = delay
        self._per_delta = isinstance(delay, Mapping) and self.options.delay_per == "delta"
        self._seed = delay.get("seed", 0) if isinstance(delay, Mapping) else 0
        self._worker_delay = [min(resolve_delay(delay, w.node_id, w.index), self.options.max_delay)
                              if not self._per_delta else 0 for w in self.workers]
        if sync == "async" and delay not in (0, None):
            log.warning("sync=async: the delay option is ignored (the clock makes the staleness), as in the product")
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._held: dict[int, list[tuple[int, int]]] = {}  # version -> (worker, r) uploads waiting for it
        self._waiting: dict[int, list[int]] = {}  # version -> workers waiting to start their next phase
        self._base: list[int] = [0] * len(self.workers)  # async: the version each worker's phase started from
        self._published_at: dict[int, float] = {0: 0.0}
        self.histogram: dict[str, int] = {}
        self.eval_curve: list[list[float]] = []
        self.bytes_sent = 0
        self.deltas = 0
        self.now = 0.0
        self._begun = [0] * len(self.workers)  # phases begun per worker
        self._ahead: dict[tuple[int, int], tuple[int, Future]] = {}  # (worker, r) -> (base, its phase computing)
        prefetch = parallel > 1 and not (sync == "lockstep" and self.arrival)
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"sim-{w.node_id}") for w in self.workers] if prefetch else None

    def _check_fragments(self, feedback: bool) -> None:
        """The workers split the model as the master does; no error feedback and no DyLU with
        fragments (as the product)."""
        ours = FragmentBook(self.master.plan).digests()
        for w in self.workers:
            if w.book.digests() != ours:
                raise ValueError(f"worker {w.node_id} splits the model into "
                                 f"{'no' if w.plan is None else w.plan.count} fragments, the master into "
                                 f"{'none' if ours is None else len(ours)}: give both the same fragments")
        if ours is not None and feedback:
            raise ValueError(f"fragments={len(ours)} cannot be combined with error feedback yet "
                             f"(delta_dtype={self.encoding.name}): pass error_feedback=False or a float delta_dtype")
        if ours is not None and self.dylu is not None:
            raise ValueError(f"fragments={len(ours)} cannot be combined with Dynamic Local Updates (dylu): the "
                             f"boundaries every H / F steps are the fragments' schedule")

    # ------------------------------------------------------------------ delays

    def delay_of(self, index: int, r: int, applied_at: int) -> int:
        """The staleness imposed on worker ``index``'s ``r``-th delta, applied at outer step ``applied_at``."""
        if applied_at < self.options.burn_in:
            return 0
        if self._per_delta:
            tau = draw_delay(self._delay_spec, random.Random(f"{self._seed}:{index}:{r}"))
            return min(tau, self.options.max_delay)
        return self._worker_delay[index]

    # ------------------------------------------------------------------ the clock

    def _push(self, t: float, kind: int, k: int, r: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, k, r))

    def _begin(self, k: int, t: float) -> None:
        """Worker ``k`` starts its next phase at ``t`` (if its step cap, its membership and the
        time budget leave it one: a phase that would end after ``max_time`` is not run)."""
        w = self.workers[k]
        steps = self.next_inner_steps(k)
        r = self._begun[k] + 1
        end = self._end_of(k, r, t, steps)
        over = self.max_time is not None and end > self.max_time * (1 + 1e-12)
        if not w.fits(steps) or t >= self._membership[k][1] or over:
            self._active[k] = False
            return
        self._active[k] = True
        self._begun[k] = r
        w.begin_phase(steps)
        self._phase[(k, r)] = (t, steps)
        self._base[k] = self.master.outer_step
        if self._threads is not None:
            base = self._base_of(k, r)
            self._ahead[(k, r)] = (base, self._threads[k].submit(w.phase, self.master.versions[base],
                                                                       inner_steps=steps, **self._phase_args(k, base)))
        self._push(end, _PHASE_END, k, r)

    def next_inner_steps(self, k: int) -> int:
        """Inner steps of worker ``k``'s next phase: its ``phase_steps`` (H, or H / F with
        fragments), or DyLU's rule on the measured rates."""
        if self.dylu is None:
            return self.workers[k].phase_steps
        peers = [self._rate[j] for j in range(len(self.workers)) if j != k and self._active[j]]
        return dylu_inner_steps(self._rate[k], peers, max_steps=self.dylu["max_steps"],
                                min_steps=self.dylu["min_steps"], seconds=self.dylu["seconds"])

    def _end_of(self, k: int, r: int, start: float, steps: int) -> float:
        w = self.workers[k]
        work = float(steps)
        if self.options.speed_jitter > 0:
            work *= math.exp(self.options.speed_jitter * random.Random(f"{self.seed}:speed:{k}:{r}").gauss(0.0, 1.0))
        return phase_end(start, work, w.speed, self.options.trace(w.index))

    def duration(self, k: int, r: int, start: float = 0.0, steps: int | None = None) -> float:
        """Simulated time of worker ``k``'s phase ``r`` of ``steps`` steps (default its ``phase_steps``)
        begun at ``start``: the time its speed (and trace) takes to integrate to ``steps``, times
        the jitter's draw."""
        return self._end_of(k, r, start, self.workers[k].phase_steps if steps is None else steps) - start

    def _phase_args(self, k: int, base: int) -> dict[str, Any]:
        """What worker ``k``'s phase starting from version ``base`` is given besides that version,
        with fragments: its number, its fragments' outer step counts, and whether the fragment due
        is installed whatever they say (lockstep installs exactly its target version, async only
        what updated the fragment)."""
        if self.workers[k].plan is None:
            return {}
        return {"version": base, "steps": self.master.version_steps.get(base), "exact": self.sync != "async"}

    def _base_of(self, k: int, r: int) -> int:
        """The version worker ``k``'s delta ``r`` starts from."""
        if self.sync == "async":
            return self._base[k]
        applied_at = r - 1 if not self.arrival else self.master.outer_step
        return max(0, applied_at - self.delay_of(k, r, applied_at))

    def run(self) -> SimResult:
        started = time.perf_counter()
        try:
            self._evaluate_due()
            self._evaluate_times(0.0, inclusive=False)
            for w in self.workers:
                joins = self._membership[w.index][0]
                if joins > 0:
                    self._push(joins, _JOIN, w.index)
                else:
                    self._begin(w.index, 0.0)
            while self._heap and not self.stopped_early:
                t, _, kind, k, r = heapq.heappop(self._heap)
                self._evaluate_times(t, inclusive=False)  # the versions published before t
                self.now = t
                if kind == _PHASE_END:
                    self._phase_end(k, r, t)
                elif kind == _JOIN:
                    self._begin(k, t)
                else:
                    self._deliver(k, r, t)
        finally:
            for pool in self._threads or []:
                pool.shutdown(wait=True, cancel_futures=True)
        # the master drains what is pending at the end; under a time budget a lockstep round that
        # some worker could not finish is not applied (the product's master would still wait)
        if (not self.arrival and self.master.open_deltas and not self.stopped_early
                and not (self.sync == "lockstep" and self.max_time is not None)):
            self._publish(self.master.close_round(self.now))
        pending = self.master.pending_record()
        if pending is not None:
            self._emit(pending)
        if self._eval_at:
            self._evaluate_times(math.inf, inclusive=True)  # the points past the last event: the final state
        elif not self.eval_curve or self.eval_curve[-1][0] != self.master.outer_step:
            if self.evaluate is not None:
                self.eval_curve.append([self.master.outer_step, float(self.evaluate(self.master.state))])
                self.eval_times.append(self.now)
                self.eval_tokens.append(self._tokens_in)
        return SimResult(
            outer_steps=self.master.outer_step, final_state=self.master.state, records=self.master.records,
            eval_curve=self.eval_curve, sim_time=self.now, wall_seconds=time.perf_counter() - started,
            inner_steps=sum(w.steps for w in self.workers), bytes_sent=self.bytes_sent, deltas=self.deltas,
            staleness_histogram=dict(sorted(self.histogram.items(), key=lambda kv: int(kv[0]))),
            eval_times=list(self.eval_times), lost_phases=self.lost_phases, eval_tokens=list(self.eval_tokens),
            stopped_early=self.stopped_early,
        )

    def _phase_end(self, k: int, r: int, t: float) -> None:
        start, steps = self._phase[(k, r)]
        if t > start:
            self._rate[k] = steps / (t - start)  # what its next heartbeat reports
        if t > self._membership[k][1]:  # the worker left before this phase ended: it is lost
            self.lost_phases += 1
            self._active[k] = False
            ahead = self._ahead.pop((k, r), None)
            if ahead is not None:
                ahead[1].result()  # let its thread finish (its result goes nowhere)
            log.info("worker %s left at %.1f: its phase %d (due at %.1f) is lost", self.workers[k].node_id,
                     self._membership[k][1], r, t)
            return
        if self.sync == "lockstep" and not self.arrival:
            # delta r is uploaded once version r - 1 exists (the product's gated upload)
            if self.master.outer_step >= r - 1:
                self._deliver(k, r, t)
            else:
                self._held.setdefault(r - 1, []).append((k, r))
            # the worker waits for the version its next delta starts from
            target = max(0, r - self.delay_of(k, r + 1, r))
            if self.master.outer_step >= target:
                self._begin(k, t)
            else:
                self._waiting.setdefault(target, []).append(k)
            return
        self._deliver(k, r, t)
        self._begin(k, t)  # async, or arrival lockstep: never waits

    # ------------------------------------------------------------------ deliveries

    def _deliver(self, k: int, r: int, t: float) -> None:
        """Worker ``k``'s delta ``r`` reaches the master at ``t``: compute its phase, apply or fold it in."""
        w = self.workers[k]
        s = self.master.outer_step
        ahead = self._ahead.pop((k, r), None)
        if ahead is not None:
            base, future = ahead
            delta = future.result()
        else:
            base = self._base_of(k, r)
            delta = w.phase(self.master.versions[base], inner_steps=self._phase[(k, r)][1], **self._phase_args(k, base))
        self._phase.pop((k, r), None)
        wire = self._feedback[k].encode(delta)
        del delta
        self.bytes_sent += _wire_bytes(wire)
        self.deltas += 1
        received = as_received(wire)
        fragment = None
        if w.plan is not None:  # the fragment's own staleness, from its header (as the product's master)
            fragment, tau = self.master.fragment_staleness(*w.headers.pop(r))
        else:
            tau = s - base
        ident = f"{w.node_id}/{r}"
        tokens = w.delta_tokens(r)
        self._tokens_in += tokens or 0
        if self.arrival:
            rec = self.master.arrive(ident, received, tau, num_tokens=tokens, now=t, fragment=fragment)
            if rec is not None:
                self._count(tau)
                self._publish(rec)
        else:
            if self.master.add(ident, received, tau, num_tokens=tokens, fragment=fragment):
                self._count(tau)
            if self.master.open_deltas >= self.quorum:
                self._publish(self.master.close_round(t))
        self._prune()

    def _count(self, tau: int) -> None:
        self.histogram[str(tau)] = self.histogram.get(str(tau), 0) + 1

    def _publish(self, rec: dict[str, Any]) -> None:
        v = self.master.outer_step
        self._published_at[v] = self.now
        self._emit(rec)
        self._evaluate_due()
        for k, r in self._held.pop(v, []):
            self._push(self.now, _UPLOAD, k, r)
        for k in self._waiting.pop(v, []):
            self._begin(k, self.now)

    def _emit(self, rec: dict[str, Any]) -> None:
        if self.on_version is not None:
            self.on_version(rec)

    def _evaluate_due(self) -> None:
        s = self.master.outer_step
        if self.evaluate is None or not self.eval_points or self.eval_points[0] > s:
            return
        while self.eval_points and self.eval_points[0] <= s:
            self.eval_points.pop(0)
        self.eval_curve.append([s, float(self.evaluate(self.master.state))])
        self.eval_times.append(self.now)
        self.eval_tokens.append(self._tokens_in)
        self._check_stop(s, self.eval_curve[-1][1])

    def _check_stop(self, step: int, loss: float) -> None:
        """End the run (no more events) at an evaluation after version 0 above ``options.stop_above``."""
        limit = self.options.stop_above
        if limit is not None and step > 0 and not (loss <= limit):
            log.info("outer step %d: eval loss %s above stop_above=%s: the run stops here", step, loss, limit)
            self.stopped_early = True
            self._heap.clear()
            self._eval_at = []

    def _evaluate_times(self, t: float, *, inclusive: bool) -> None:
        """Evaluate the newest version at each of ``eval_times`` before ``t`` (or at it)."""
        while self.evaluate is not None and self._eval_at and (self._eval_at[0] < t or (inclusive and self._eval_at[0] <= t)):
            at = self._eval_at.pop(0)
            s = self.master.outer_step
            if self._last_eval is None or self._last_eval[0] != s:  # an unchanged version is not evaluated twice
                self._last_eval = (s, float(self.evaluate(self.master.state)))
            self.eval_curve.append([s, self._last_eval[1]])
            self.eval_times.append(at)
            self.eval_tokens.append(self._tokens_in)
            self._check_stop(s, self._last_eval[1])

    def _prune(self) -> None:
        """Drop the versions no worker can start from any more."""
        s = self.master.outer_step
        if self.sync == "async":  # a worker that has not joined starts from the newest version
            keep = min([b for b, active in zip(self._base, self._active) if active] or [s])
        elif self._per_delta:
            keep = s - self.options.max_delay
        else:
            keep = s - max(self._worker_delay)
        if self.sync == "lockstep" and not self.arrival:
            keep -= 1  # a round's deltas start from version (round - tau)
        self.master.prune(max(0, keep))
