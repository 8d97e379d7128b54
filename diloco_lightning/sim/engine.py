"""The simulator: K workers' inner loops and a master in one process, on a simulated clock.

A research tool as much as a test of the product ("test an outer optimizer under controlled
staleness in minutes"): the workers are :class:`~diloco_lightning.sim.inner.SimWorker` (any
model, any inner optimizer), the master is :class:`~diloco_lightning.sim.master.SimMaster`
(the product's gate, checks, round mean and outer optimizers), and the schedule is an event
queue on a simulated clock: worker ``k`` runs a phase of ``inner_steps`` steps in
``inner_steps / speed_k`` units of time, and events are processed in time order, ties by the
order they were queued (so by worker index at equal speeds). Nothing else decides the order, so
a run is a pure function of its options and seeds. This module is the workers' phases; it holds
the parts: :class:`~diloco_lightning.sim.clock.EventQueue` (the clock),
:class:`~diloco_lightning.sim.transfers.Transfers` (uploads, the master's rounds, publications,
downloads), :class:`~diloco_lightning.sim.delays.Delays` (the staleness lockstep imposes),
:class:`~diloco_lightning.sim.starts.PhaseStarts` (what a phase starts from) and
:class:`~diloco_lightning.sim.evaluations.Evaluations`.

Staleness, as the product's ``sync`` modes define it:

* ``lockstep``, ``aggregation="round"`` (the product's lockstep with a quorum of every worker):
  round ``s`` is the ``(s+1)``-th delta of every worker; worker ``k``'s delta ``r`` was computed
  from version ``max(0, r - 1 - tau)``, applied with staleness ``tau`` counted in rounds. A worker
  waits at boundary ``r`` for the version its next delta starts from; delta ``r`` is uploaded once
  version ``r - 1`` exists, as the product's are.
* ``lockstep``, ``aggregation="arrival"``: every delta is one outer step; the delta applied at
  outer step ``s`` was computed from version ``max(0, s - tau)``: ``tau`` counted in arrivals,
  imposed (workers never wait), the clock ordering the arrivals.
* ``async``: no imposed delay. A worker starts each phase from the newest version it holds and
  its delta is applied when the clock brings it (K - 1 arrivals stale at equal speeds). In round
  mode a round closes every ``quorum`` deltas (or at ``deadline``). With ``barrier`` the rounds
  are synchronous: after its delta a worker waits for a version newer than its phase's; a delta
  from an older version is applied where it arrives (``late="apply"``) or its phase is given up
  when the newer version is published (``late="drop"``: the worker starts over from it).

``tau`` is the ``delay`` option (:mod:`~diloco_lightning.sim.delays`): an int, a per-worker
list, or a distribution drawn once per worker or once per delta, capped at ``max_delay``; during
the first ``burn_in`` outer steps it is 0.

Phases are computed by a runner (:mod:`diloco_lightning.sim.runners`: batched, equal to the
unbatched ones to float tolerance, on threads, or one at a time); arrival-mode lockstep learns a
phase's version only when its delta arrives, and computes it then.

The clock: ``speed_jitter`` multiplies each phase's duration by a log-normal factor drawn from
the seed, worker and phase; traces change speeds over time. Churn
(:mod:`diloco_lightning.sim.churn`): a worker is down during intervals (``join_at``,
``leave_at``, preemptions from a trace or a seeded law); a phase a down interval interrupts is
lost and never computed, and the worker comes back with the state of its last finished phase
(lockstep: it computes that round's phase again and the round waits; async: from the newest
version). A budget (``max_time``): a worker begins a phase only if it ends by ``max_time``; a
lockstep round some worker could not finish in time is not applied. Evaluations are then taken at
given simulated times (``eval_times``: the newest published version at each), with the tokens
of the deltas delivered by then, so runs line up on one time axis.

Fragments (Streaming DiLoCo, ``diloco_lightning/wire/fragments.py``): a phase is the ``H / F``
steps between two boundaries and its delta carries one fragment, so every schedule above counts
boundaries (lockstep: round ``s`` is every worker's ``(s+1)``-th boundary); the staleness the
master applies is the fragment's own, as the product's master counts it.

A synchronous warm-up (``sync_warmup``): each worker's first ``sync_warmup`` inner steps are
phases of one step, so every step is synced before the DiLoCo phases of H begin.

Dynamic Local Updates (``dylu``): each worker chooses the H of its next phase when it begins it,
with the product's rule (:func:`~diloco_lightning.worker.pacing.dylu_inner_steps`), fed by the
rates a heartbeat would carry (each worker's steps per unit of time over its last finished phase;
the peers' of the workers still live).

The pseudo-gradient is encoded as a real worker encodes it (``delta_dtype``, with its
error-feedback residual) and decoded as the master decodes it, before the master sees it.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from diloco_lightning.encoding import EncodingSpec
from diloco_lightning.encoding.feedback import ErrorFeedback
from diloco_lightning.sim.churn import Churn
from diloco_lightning.sim.clock import EventQueue
from diloco_lightning.sim.delays import Delays
from diloco_lightning.sim.evaluations import Evaluations
from diloco_lightning.sim.inner import SimWorker, check_fragments
from diloco_lightning.sim.master import SimMaster
from diloco_lightning.sim.options import SimOptions, phase_end
from diloco_lightning.sim.rebase import SimOwnDeltas
from diloco_lightning.sim.result import SimResult, as_received
from diloco_lightning.sim.runners import choose_runner
from diloco_lightning.sim.starts import PhaseStarts
from diloco_lightning.sim.transfers import Transfers
from diloco_lightning.sim.trend import Trend
from diloco_lightning.util.options import OptionError
from diloco_lightning.worker.options import SYNC_MODES, feedback_of, resolve_encoding
from diloco_lightning.worker.pacing import dylu_inner_steps

__all__ = ["SimResult", "Simulator", "as_received"]

log = logging.getLogger(__name__)

_PHASE_END, _JOIN, _LOST = 0, 1, 2


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
        error_feedback_decay: SparseLoCo's beta on each worker's residual (1: none).
        evaluate: ``state -> loss`` of a global version (None: no evaluation).
        eval_points: outer steps after which to evaluate (the first version at or past each).
        on_version: called with each version's record (progress lines, metrics files).
        parallel: workers whose phases may be computed at the same time, each on its own thread
            (1: one after the other in this thread); batched, the groups of workers stacked and
            computed side by side, each on a thread. The results do not depend on it.
        seed: seeds ``speed_jitter``'s draws.
        eval_times: simulated times at which to evaluate the newest published version (instead
            of ``eval_points``; the ones past the end are taken on the final state).
        rebase: the product's ``diloco.rebase`` (async workers, no fragments): as ``options.rebase``,
            with the product's fallback scales when the outer step publishes none.
        lookahead: the product's ``diloco.lookahead``: each own delta a start lacks stands for one
            delta of every worker (sim/rebase.py; only where the workers rebase).
        reset_inner_optimizer: clear a worker's inner optimizer state when its phase starts from a
            version its last phase did not (the product's ``diloco.reset_inner_optimizer``).
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
        error_feedback_decay: float = 1.0,
        evaluate: Callable[[Mapping[str, Tensor]], float] | None = None,
        eval_points: Sequence[int] = (),
        on_version: Callable[[dict[str, Any]], None] | None = None,
        parallel: int = 1,
        seed: int = 0,
        eval_times: Sequence[float] = (),
        dylu: Mapping[str, Any] | None = None,
        rebase: bool = False,
        reset_inner_optimizer: bool = False,
        lookahead: bool = False,
    ) -> None:
        if sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {SYNC_MODES}, got {sync!r}")
        if not workers:
            raise ValueError("workers: a simulation needs at least one worker")
        self.workers = list(workers)
        n = len(self.workers)
        self.master = master
        self.sync = sync
        self.options = (options or SimOptions()).validate(n)
        if isinstance(delta_dtype, EncodingSpec):
            spec, feedback = delta_dtype, feedback_of(delta_dtype, error_feedback)
        else:
            spec, feedback = resolve_encoding(delta_dtype, error_feedback=error_feedback)
        self.encoding = spec
        self.dylu: dict[str, Any] | None = None
        if dylu is not None:
            self.dylu = {"max_steps": int(dylu["max_steps"]), "min_steps": dylu.get("min_steps"),
                         "seconds": dylu.get("seconds")}
        check_fragments(self.workers, self.master.plan, self.dylu is not None)
        self.sync_warmup = int(self.options.sync_warmup)
        if self.sync_warmup:
            h = self.workers[0].phase_steps
            why = [what for what, bad in (("no fragments", master.plan is not None),
                                          ("a fixed H (not inner_steps=auto)", self.dylu is not None),
                                          (f"a multiple of H = {h}", self.sync_warmup % h != 0)) if bad]
            if why:
                raise OptionError("sync_warmup", f"needs {', '.join(why)}, got {self.sync_warmup}")
        #: sim.rebase: each worker's own deltas, to start its phases from (sim/rebase.py)
        # or the product's diloco.rebase (``rebase``: an async worker's rule, with its fallback scales)
        self.rebase = (SimOwnDeltas.build(master.opt, n, master.plan is not None, fallback=not self.options.rebase,
                                          lookahead=lookahead)
                       if self.options.rebase or rebase else None)
        if self.options.lookahead_trend or self.options.lookahead_momentum:
            name = "lookahead_trend" if self.options.lookahead_trend else "lookahead_momentum"
            if master.plan is not None:
                raise OptionError(name, "is not composed with fragments (a phase installs one fragment)")
            if self.options.lookahead_momentum and self.master.opt.lookahead(1.0) is None:
                raise OptionError("lookahead_momentum", f"needs an outer step with momentum; this run's is "
                                  f"{self.master.opt.name} {dict(self.master.opt.options)}")
            self.master.trend = Trend(self.options.lookahead_trend or 8, momentum=self.options.lookahead_momentum)
        self.starts = PhaseStarts(self.workers, master, rebase=self.rebase, exact=sync != "async",
                                  reset_inner_optimizer=bool(reset_inner_optimizer),
                                  sync_inner_state=self.options.sync_inner_state)
        if self.options.sync_inner_state:
            why = [what for what, bad in (("diloco.sync=lockstep", sync != "lockstep"),
                                          ("master.aggregation=round", master.config.aggregation != "round"),
                                          ("delay 0", delay not in (0, None)), ("no fragments", master.plan is not None))
                   if bad]
            if why:
                raise OptionError("sync_inner_state", f"needs synchronous rounds: {', '.join(why)}")
        self.max_time = self.options.max_time
        if self.max_time is None and any(w.max_steps is None for w in self.workers):
            raise ValueError("a worker without max_steps needs a time budget (options.max_time), or the run never ends")
        self.arrival = master.config.aggregation == "arrival"
        self.seed = int(seed)
        if self.options.changes_membership() and sync != "async":
            raise ValueError("join_at / leave_at need sync='async' (lockstep's imposed delays expect every worker's "
                             "every delta)")
        if self.options.barrier and (sync != "async" or self.arrival):
            raise OptionError("barrier", "synchronous rounds with a quorum need diloco.sync=async and "
                              "master.aggregation=round")
        self.churn = Churn(n, join_at=self.options.join_at, leave_at=self.options.leave_at, preempt=self.options.preempt)
        self.quorum = n if sync == "lockstep" else (self.options.quorum or n)
        #: the staleness lockstep imposes (the ``delay`` option resolved for the workers)
        self.delays = Delays(delay, self.workers, self.options)
        if sync == "async" and delay not in (0, None):
            log.warning("sync=async: the delay option is ignored (the clock makes the staleness), as in the product")
        # the clock and the workers
        self.clock = EventQueue()
        self._up = [False] * n  # up and taking part (not down, not done)
        self._active = [False] * n  # computing a phase or about to (for DyLU's peers and pruning)
        self._begun = [0] * n  # phases begun per worker (a lost one is begun again)
        self._phase: dict[tuple[int, int], tuple[float, int]] = {}  # (worker, r) -> (start, steps)
        self._rate: list[float | None] = [None] * n  # steps per unit of time, last finished phase
        self._base: list[int] = [0] * n  # the version each worker's current phase started from
        self._lost: dict[tuple[int, int], float] = {}  # phases that will be lost -> when
        self._token: dict[tuple[int, int], int] = {}  # (worker, r) -> the phase's token (its events carry it)
        self._over = False  # the run has ended: nothing begins any more
        self._idle: list[Any] = [None] * n  # what an idle worker waits for ("newer", base) / ("room",) / None
        self.lost_phases = 0
        self.abandoned_phases = 0
        self._use = [{"compute": 0.0, "lost": 0.0, "down": 0.0} for _ in range(n)]
        self.evaluations = Evaluations(evaluate, master, self.clock, points=eval_points, times=eval_times,
                                       stop_above=self.options.stop_above)
        #: the hub and the master: uploads, rounds, publications, downloads (sim/transfers.py)
        self.transfers = Transfers(
            self.workers, master, self.options, self.clock, self, self.evaluations, encoding=spec,
            feedback=[ErrorFeedback(spec, enabled=feedback, decay=error_feedback_decay) for _ in self.workers],
            sync=sync, quorum=self.quorum, rebase=self.rebase, on_version=on_version)
        # how the phases are computed, and why they are not batched (None: they are)
        self.runner, self.batched_reason = choose_runner(self.workers, self.options.batched, parallel,
                                                         known_at_delivery=self._base_known_at_delivery)

    @property
    def _base_known_at_delivery(self) -> bool:
        """Lockstep in arrival mode: a phase starts from the version ``delay`` outer steps before
        the one its delta is applied to, known only when it arrives."""
        return self.sync == "lockstep" and self.arrival

    @property
    def _abandonable(self) -> bool:
        """A phase may be given up before it ends (synchronous rounds that drop late deltas)."""
        return self.options.barrier and self.options.late == "drop"

    # ------------------------------------------------------------------ delays

    def delay_of(self, index: int, r: int, applied_at: int) -> int:
        """The staleness imposed on worker ``index``'s ``r``-th delta, applied at outer step ``applied_at``."""
        return self.delays.of(index, r, applied_at)

    def _base_of(self, k: int, r: int) -> int:
        """The version worker ``k``'s delta ``r`` starts from."""
        if self.sync == "async":
            return self._base[k]
        applied_at = r - 1 if not self.arrival else self.master.outer_step
        return max(0, applied_at - self.delay_of(k, r, applied_at))

    # ------------------------------------------------------------------ the clock

    def begin(self, k: int, t: float) -> None:
        """Worker ``k``, holding the version its next phase starts from, begins it at ``t`` (if it is
        up and its step cap and the time budget leave it one: a phase that would end after
        ``max_time`` is not run)."""
        if self._over:
            return
        w = self.workers[k]
        self._idle[k] = None
        back = self.churn.up_at(k, t)
        if back > t:  # down now: it comes back later (or never)
            self._up[k] = self._active[k] = False
            if math.isfinite(back) and (self.max_time is None or back < self.max_time):
                self.clock.push(back, _JOIN, k)
            return
        steps = self.next_inner_steps(k)
        r = self._begun[k] + 1
        end = self._end_of(k, r, t, steps)
        over = self.max_time is not None and end > self.max_time * (1 + 1e-12)
        if not w.fits(steps) or over:
            self._up[k] = self._active[k] = False  # done
            return
        self._up[k] = self._active[k] = True
        self._begun[k] = r
        w.begin_phase(steps)
        self._phase[(k, r)] = (t, steps)
        self._base[k] = self.transfers.held[k]
        token = self._token[(k, r)] = self.clock.ticket()  # a phase begun again under the same number is another one
        down = self.churn.next_down(k, t)
        if down < end:  # preempted (or gone) before it ends: lost, never computed
            self._lost[(k, r)] = down
            self.clock.push(down, _LOST, k, (r, token))
            return
        if not self._base_known_at_delivery and not self._abandonable:
            self._give(k, r)
        self.clock.push(end, _PHASE_END, k, (r, token))

    def _give(self, k: int, r: int) -> None:
        """Hand phase ``r`` of worker ``k`` (its version known) to the runner."""
        base = self._base_of(k, r)
        self.runner.begin(k, r, (base, self.starts.state(k, base), self.starts.args(k, base), self._phase[(k, r)][1]))

    def next_inner_steps(self, k: int) -> int:
        """Inner steps of worker ``k``'s next phase: its ``phase_steps`` (H, or H / F with
        fragments), or DyLU's rule on the measured rates; one step while the worker is in its
        synchronous warm-up (``sync_warmup``)."""
        if self.workers[k].planned < self.sync_warmup:
            return 1
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

    def run(self) -> SimResult:
        started = time.perf_counter()
        clock, transfers, evals = self.clock, self.transfers, self.evaluations
        try:
            evals.after_step(transfers.tokens_in)
            evals.until(0.0, inclusive=False, visible=transfers.visible, tokens=transfers.tokens_in)
            for k in range(len(self.workers)):
                self.begin(k, 0.0)
            transfers.start()  # the first round's deadline
            while clock and not evals.stopped_early:
                t, kind, k, data = clock.pop()
                # the versions published before t
                evals.until(t, inclusive=False, visible=transfers.visible, tokens=transfers.tokens_in)
                clock.now = t
                if kind in (_PHASE_END, _LOST):
                    r, token = data
                    if self._token.get((k, r)) != token:
                        continue  # a phase given up (late="drop"): begun again since
                    if kind == _PHASE_END:
                        self._phase_end(k, r, t)
                    else:
                        self._lose(k, r, t)
                elif kind == _JOIN:
                    self._join(k, t)
                else:
                    transfers.handle(kind, k, data, t)
        finally:
            self.runner.close()
            self._over = True  # nothing begins any more
        # the master drains what is pending at the end; under a time budget a lockstep round that
        # some worker could not finish is not applied (the product's master would still wait)
        transfers.drain(close=not self.arrival and not evals.stopped_early
                        and not (self.sync == "lockstep" and self.max_time is not None))
        # the points past the last event are taken on the final state
        evals.final(visible=transfers.visible, tokens=transfers.tokens_in)
        end = self.clock.now if self.max_time is None else max(self.clock.now, float(self.max_time))
        for k, use in enumerate(self._use):
            use["down"] = self.churn.down_time(k, end)
        return SimResult(
            outer_steps=self.master.outer_step, final_state=self.master.state, records=self.master.records,
            eval_curve=evals.curve, sim_time=self.clock.now, wall_seconds=time.perf_counter() - started,
            inner_steps=sum(w.steps for w in self.workers), bytes_sent=transfers.bytes_sent, deltas=transfers.deltas,
            staleness_histogram=dict(sorted(transfers.histogram.items(), key=lambda kv: int(kv[0]))),
            eval_times=list(evals.times), lost_phases=self.lost_phases, eval_tokens=list(evals.tokens),
            time_use=[dict(u) for u in self._use], comm=transfers.comm_summary(), stopped_early=evals.stopped_early,
        )

    # ------------------------------------------------------------------ the workers' events

    def _phase_end(self, k: int, r: int, t: float) -> None:
        start, steps = self._phase[(k, r)]
        if t > start:
            self._rate[k] = steps / (t - start)  # what its next heartbeat reports
        self._use[k]["compute"] += t - start
        if self._abandonable:
            self._give(k, r)  # it can no longer be given up
        self.transfers.hand_in(k, r, t)
        if self.sync == "lockstep" and not self.arrival:
            # the worker waits for the version its next delta starts from
            self.transfers.need(k, max(0, r - self.delay_of(k, r + 1, r)), t)
        elif self.options.barrier:
            self._wait_newer(k, self._base[k], t)
        elif self._blocked(k):
            self._idle[k] = ("room",)  # fragments: a whole cycle of deltas is held (the product's backpressure)
        else:
            self.begin(k, t)  # async, or arrival lockstep: never waits

    def _lose(self, k: int, r: int, t: float) -> None:
        """Worker ``k`` went down at ``t`` during its phase ``r``: the phase is lost."""
        start, steps = self._phase.pop((k, r))
        self._lost.pop((k, r), None)
        self.lost_phases += 1
        self._use[k]["lost"] += t - start
        self._undo(k, steps)
        self._up[k] = self._active[k] = False
        back = self.churn.up_at(k, t)
        log.info("worker %s went down at %.1f: its phase %d is lost%s", self.workers[k].node_id, t, r,
                 "" if math.isinf(back) else f" (back at {back:.1f})")
        if math.isfinite(back) and (self.max_time is None or back < self.max_time):
            self.clock.push(back, _JOIN, k)

    def _undo(self, k: int, steps: int) -> None:
        """A phase of worker ``k`` that will never be computed: its steps and its number are free again."""
        w = self.workers[k]
        self._begun[k] -= 1
        w.planned -= steps
        w.phase_lengths.pop()

    def _join(self, k: int, t: float) -> None:
        """Worker ``k`` (re)joins at ``t``: it gets the version its next phase starts from, then begins."""
        self._up[k] = True
        if self.sync == "lockstep" and not self.arrival:
            self.transfers.need(k, self._base_of(k, self._begun[k] + 1), t)
        elif self.sync == "async":
            self._idle[k] = ("join",)
            self.transfers.fetch(k, t)
            if self._idle[k] == ("join",) and not self.transfers.links[k].downloading(t):
                self.begin(k, t)  # holds the newest already
        else:
            self.begin(k, t)

    def _wait_newer(self, k: int, base: int, t: float) -> None:
        """Synchronous rounds: worker ``k`` begins once it holds a version newer than ``base``."""
        if self.transfers.held[k] > base:
            self.begin(k, t)
        else:
            self._idle[k] = ("newer", base)

    # ------------------------------------------------------------------ what the transfers ask (transfers.Phases)

    def holds(self, k: int, v: int, t: float) -> None:
        """Worker ``k`` has downloaded version ``v`` at ``t``."""
        idle = self._idle[k]
        if self.sync == "lockstep":
            if not self._base_known_at_delivery:
                self.begin(k, t)
        elif idle is not None and idle[0] == "newer" and v > idle[1]:
            self.begin(k, t)
        elif idle == ("join",) and not self.transfers.links[k].downloading(t):
            self.begin(k, t)

    def new_version(self, v: int, t: float) -> None:
        """Asynchronously, version ``v`` is published at ``t``: each live worker's fetcher downloads it,
        and with ``late="drop"`` phases from older versions are given up."""
        for k in range(len(self.workers)):
            if self._up[k]:
                self.transfers.fetch(k, t)
        if not self._abandonable:
            return
        for (k, r), (start, steps) in list(self._phase.items()):
            if self._base[k] < v and (k, r) not in self._lost and self._begun[k] == r and self._idle[k] is None \
                    and self._up[k]:
                self._token.pop((k, r))
                self._phase.pop((k, r))
                self.abandoned_phases += 1
                self._use[k]["lost"] += t - start
                self._undo(k, steps)
                self._idle[k] = ("newer", self._base[k])
                if self.transfers.held[k] > self._base[k]:
                    self.begin(k, t)

    def _blocked(self, k: int) -> bool:
        w = self.workers[k]
        return self.sync == "async" and w.plan is not None and self.transfers.queued(k) >= w.plan.count

    def unblock(self, k: int, t: float) -> None:
        """Worker ``k``'s outbox has room again at ``t``: a worker held back by it begins."""
        if self._idle[k] == ("room",) and not self._blocked(k):
            self.begin(k, t)

    def delta_of(self, k: int, r: int) -> tuple[int, dict[str, Tensor]]:
        """Worker ``k``'s phase ``r``, computed (now if its version was known only at delivery):
        ``(the version it started from, its delta)``."""
        if self._base_known_at_delivery:
            b = self._base_of(k, r)
            d = self.runner.now(k, self.starts.state(k, b), self.starts.args(k, b), self._phase[(k, r)][1])
        else:
            b, d = self.runner.result(k, r)
        self._phase.pop((k, r), None)
        return b, d

    def oldest_needed(self) -> int:
        """The oldest version a worker may still start a phase from."""
        s = self.master.outer_step
        held, visible = self.transfers.held, self.transfers.visible
        if self.sync == "async":  # a worker that is down downloads the newest version when it comes back
            keep = min([min(b, h) for b, h, a in zip(self._base, held, self._up) if a] + [visible])
        else:
            keep = s - self.delays.largest()
        if self.sync == "lockstep" and not self.arrival:
            keep -= 1  # a round's deltas start from version (round - tau)
        return keep
