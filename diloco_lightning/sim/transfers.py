"""What travels on the simulated clock: deltas up to the master, versions down to the workers.

The :class:`~diloco_lightning.sim.engine.Simulator`'s half that is the hub and the master (the
other half, ``engine.py``, is the clock and the workers' phases); it is a base class of the
simulator and shares its state. Every duration comes from the workers' links
(:mod:`diloco_lightning.sim.links`: ``latency + bytes / bandwidth``) and from two options of the
hub and the master:

* **uploads** (:meth:`Transfers.hand_in`): a finished phase's delta goes to its worker's outbox,
  as the product's uploader takes it: one upload in flight per worker. Asynchronously a delta that
  is ready while the previous one is still uploading is **merged** into the next upload (the sum
  of the pseudo-gradients, the older ``base_outer_step``, the tokens added: the product's merge);
  with fragments nothing is merged and at most F deltas are held (then the worker's next boundary
  waits: the product's backpressure). In lockstep a delta ``r`` is uploaded once version
  ``r - 1`` is published (the product's gated upload), in boundary order. The upload's bytes are
  what the worker's encoding puts on the wire for those keys (the encoded size depends only on
  the keys' shapes for every encoding here, so it is measured once per key set);
* **the master**: a delta reaches it ``listing_delay`` after its upload ends (the hub's listing
  lag and the master's polling); there it is computed if it was not already
  (:mod:`diloco_lightning.sim.runners`), encoded with the worker's error feedback, decoded, and
  checked, gated and applied by the product's code (:class:`~diloco_lightning.sim.master.SimMaster`):
  one outer step per delta (arrival) or per round (a round closes with ``quorum`` deltas, or at
  the ``deadline`` after the previous version with at least one; in synchronous rounds,
  ``barrier``, a round that reaches its quorum closes after every delta arriving at that same
  instant, as a master's listing takes every delta present: workers of equal speed tie, and the
  one handled fourth would otherwise be refused as late or pushed to the next round). Each outer step takes the
  master ``master_time``, one after the other: version ``v`` is *published* at
  ``max(closed, previous published) + master_time``;
* **downloads** (:meth:`Transfers.need`, :meth:`Transfers.fetch`): asynchronously each worker's
  fetcher downloads the newest published version whenever it has none in flight (the product's
  background prefetch) and the worker installs, at a boundary, the newest one downloaded by
  then; in lockstep a worker downloads exactly the version its next phase starts from, when its
  boundary needs it and it is published (the product's ``install_exact``), and waits for it.

With no latency, no bandwidth limit, no listing delay and no master time every transfer is
instant and handled at once, in the order the events come: the schedule is then exactly the one
without communication.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from diloco_lightning.encoding.feedback import encode_delta
from diloco_lightning.sim.links import Link, state_bytes, wire_bytes
from diloco_lightning.sim.result import as_received

if TYPE_CHECKING:  # the simulator's state this half reads (engine.py sets it)
    from diloco_lightning.encoding import EncodingSpec
    from diloco_lightning.encoding.feedback import ErrorFeedback
    from diloco_lightning.sim.inner import SimWorker
    from diloco_lightning.sim.master import SimMaster
    from diloco_lightning.sim.options import SimOptions
    from diloco_lightning.sim.rebase import SimOwnDeltas
    from diloco_lightning.sim.runners import PhaseRunner

__all__ = ["Item", "Transfers"]

log = logging.getLogger(__name__)

# event kinds of the hub's half (the clock's own are in engine.py)
_UPLOADED, _ARRIVE, _PUBLISHED, _DOWNLOADED, _PUMP, _DEADLINE, _QUORUM = 10, 11, 12, 13, 14, 15, 16


@dataclass
class Item:
    """One upload: the phases (boundaries) of one worker whose deltas it carries (more than one:
    merged), and the version its uploads must wait for (lockstep's gate; -1: none)."""

    phases: list[int]
    gate: int = -1
    tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Transfers:
    """The hub's and the master's half of the simulator (see the module docstring)."""

    def _init_transfers(self, n: int) -> None:
        """The state of this half, for ``n`` workers."""
        self.links = [Link(self.options.latency_of(k), self.options.bandwidth_of(k)) for k in range(n)]
        self._version_bytes = state_bytes(self.master.state)
        self._wire_size: dict[str | None, int] = {}
        self._outbox: list[list[Item]] = [[] for _ in range(n)]
        self._waiting: dict[int, list[int]] = {}  # version -> lockstep workers waiting for it
        self._visible = 0  # the newest published version
        self._published_at: dict[int, float] = {0: 0.0}
        self._master_free = 0.0
        self._overdue = False  # the open round passed its deadline with no delta
        self.time_uploading = [0.0] * n
        self.time_downloading = [0.0] * n
        self.bytes_down = 0
        self.histogram: dict[str, int] = {}
        self.bytes_sent = 0
        self.deltas = 0
        self._tokens_in = 0  # tokens of the deltas delivered to the master


    # ------------------------------------------------------------------ uploads

    def hand_in(self, k: int, r: int, t: float) -> None:
        """Worker ``k``'s phase ``r`` ended at ``t``: its delta joins the outbox."""
        box = self._outbox[k]
        gate = r - 1 if (self.sync == "lockstep" and not self.arrival) else -1
        merge = self.sync == "async" and self.workers[k].plan is None
        if merge and box:
            box[-1].phases.append(r)  # still uploading the previous one: merged into the next upload
        else:
            box.append(Item([r], gate))
        self.pump(k, t)

    def pump(self, k: int, t: float) -> None:
        """Start worker ``k``'s next upload if its link is free and the next item's gate is open."""
        link, box = self.links[k], self._outbox[k]
        while box and not link.uploading(t) and self._visible >= box[0].gate:
            item = box.pop(0)
            nbytes = self._upload_bytes(k, item.phases[0])
            start, end = link.upload(t, nbytes)
            self.time_uploading[k] += end - start
            self._after(end, _UPLOADED, k, item)
        self._unblock(k, t)

    def _upload_bytes(self, k: int, r: int) -> int:
        """What worker ``k``'s delta of boundary ``r`` puts on the wire: the encoding's size for its keys."""
        w = self.workers[k]
        name = None if w.plan is None else w.plan.fragment_at(r)
        if name not in self._wire_size:
            synced = {kk: w.params[kk] for kk in w.synced}
            shapes = synced if w.plan is None or name is None else w.plan.substate(name, synced)
            zero = {kk: torch.zeros(tuple(t.shape), dtype=torch.float32) for kk, t in shapes.items()}
            self._wire_size[name] = wire_bytes(encode_delta(zero, self.encoding, error_feedback=False)[0])
        return self._wire_size[name]

    def _uploaded(self, k: int, item: Item, t: float) -> None:
        self._after(t + self.options.listing_delay, _ARRIVE, k, item)
        self.pump(k, t)

    # ------------------------------------------------------------------ the master

    def _arrive(self, k: int, item: Item, t: float) -> None:
        """Worker ``k``'s upload reaches the master at ``t``: compute its phases, apply or fold it in."""
        w = self.workers[k]
        s = self.master.outer_step
        base, delta, tokens = -1, None, 0
        for r in item.phases:
            if self._base_known_at_delivery:
                b = self._base_of(k, r)
                d = self.runner.now(k, self._start(k, b), self._phase_args(k, b), self._phase[(k, r)][1])
            else:
                b, d = self.runner.result(k, r)
            self._phase.pop((k, r), None)
            base = b if base < 0 else base
            delta = d if delta is None else {kk: delta[kk] + d[kk] for kk in delta}
            tokens += w.delta_tokens(r) or 0
        assert delta is not None
        wire = self._feedback[k].encode(delta)
        del delta
        self.bytes_sent += wire_bytes(wire)
        self.deltas += 1
        received = as_received(wire)
        fragment = None
        if w.plan is not None:  # the fragment's own staleness, from its header (as the product's master)
            fragment, tau = self.master.fragment_staleness(*w.headers.pop(item.phases[0]))
        else:
            tau = s - base
        ident = f"{w.node_id}/{item.phases[-1]}"
        self._tokens_in += tokens
        if self.rebase is not None:
            self.rebase.sent(k, ident, received)
        if self.options.late == "drop" and self.options.barrier and tau > 0:
            self.master.refuse("late")  # a round it was not part of closed without it
            self._refused(ident)
        elif self.arrival:
            rec = self.master.arrive(ident, received, tau, num_tokens=tokens or None, now=t, fragment=fragment)
            if rec is not None:
                self._count(tau)
                self._publish(rec)
            else:
                self._refused(ident)
        else:
            if self.master.add(ident, received, tau, num_tokens=tokens or None, fragment=fragment):
                self._count(tau)
            else:
                self._refused(ident)
            if self._overdue and self.master.open_deltas:
                self._publish(self.master.close_round(t))
            elif self.master.open_deltas >= self.quorum:
                if self.options.barrier:  # after the events already due at t: the deltas arriving with it
                    self._push(t, _QUORUM, -1, self.master.outer_step)
                else:
                    self._publish(self.master.close_round(t))
        self._prune()

    def _refused(self, ident: str) -> None:
        if self.rebase is not None:
            self.rebase.refused(ident)

    def _deadline(self, v: int, t: float) -> None:
        """The round after version ``v`` reached its deadline: close it with what it has (or with its first delta)."""
        if self.master.outer_step != v:
            return  # closed already
        if self.master.open_deltas:
            self._publish(self.master.close_round(t))
        else:
            self._overdue = True

    def _quorum(self, v: int, t: float) -> None:
        """The round after version ``v`` reached its quorum at ``t``: close it with every delta it has."""
        if self.master.outer_step == v and self.master.open_deltas:
            self._publish(self.master.close_round(t))

    def _publish(self, rec: dict[str, Any]) -> None:
        """The master has taken an outer step: version ``outer_step`` is published after ``master_time``."""
        v = self.master.outer_step
        if self.rebase is not None:
            self.rebase.published(v, self.master.applied_factors)
        at = max(self.now, self._master_free) + self.options.master_time
        self._master_free = at
        rec["time"] = at
        self._published_at[v] = at
        self._overdue = False
        self._emit(rec)
        self._evaluate_due()
        self._after(at, _PUBLISHED, -1, v)

    def _published(self, v: int, t: float) -> None:
        """Version ``v`` is on the hub at ``t``: the workers waiting for it download it, gated uploads go."""
        self._visible = max(self._visible, v)
        for k in sorted(self._gated_on(v)):
            self._push(t, _PUMP, k, None)  # after the events already due now, as a poll would see it
        for k in self._waiting.pop(v, []):
            self.need(k, v, t)
        if self.sync == "async":
            for k in range(len(self.workers)):
                if self._up[k]:
                    self.fetch(k, t)
            self._on_new_version(v, t)
        if self.options.deadline is not None and not self.arrival:
            self._push(t + self.options.deadline, _DEADLINE, -1, v)

    def _gated_on(self, v: int) -> set[int]:
        return {k for k, box in enumerate(self._outbox) if box and box[0].gate == v}

    # ------------------------------------------------------------------ downloads

    def need(self, k: int, target: int, t: float) -> None:
        """Lockstep: worker ``k`` needs exactly version ``target`` to begin its next phase."""
        if self._held[k] == target:
            self._begin(k, t)
        elif self._visible >= target:
            self._download(k, target, t)
        else:
            self._waiting.setdefault(target, []).append(k)

    def fetch(self, k: int, t: float) -> None:
        """Asynchronously: worker ``k``'s fetcher downloads the newest published version, if newer."""
        if self.links[k].downloading(t) or self._visible <= max(self._held[k], self._fetching[k]):
            return
        self._download(k, self._visible, t)

    def _download(self, k: int, v: int, t: float) -> None:
        self._fetching[k] = v
        start, end = self.links[k].download(t, self._version_bytes)
        self.time_downloading[k] += end - start
        self.bytes_down += self._version_bytes
        self._after(end, _DOWNLOADED, k, v)

    def _downloaded(self, k: int, v: int, t: float) -> None:
        self._held[k] = v if self.sync == "lockstep" else max(self._held[k], v)
        self._fetching[k] = -1
        if self.sync == "async":
            self.fetch(k, t)  # a newer one was published meanwhile
        self._holds(k, v, t)

    # ------------------------------------------------------------------ records and evaluations

    def _count(self, tau: int) -> None:
        self.histogram[str(tau)] = self.histogram.get(str(tau), 0) + 1

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
        """Evaluate the newest published version at each of ``eval_times`` before ``t`` (or at it)."""
        while self.evaluate is not None and self._eval_at and (self._eval_at[0] < t or (inclusive and self._eval_at[0] <= t)):
            at = self._eval_at.pop(0)
            s = self._visible
            if self._last_eval is None or self._last_eval[0] != s:  # an unchanged version is not evaluated twice
                state = self.master.state if s == self.master.outer_step else self.master.versions[s]
                self._last_eval = (s, float(self.evaluate(state)))
            self.eval_curve.append([s, self._last_eval[1]])
            self.eval_times.append(at)
            self.eval_tokens.append(self._tokens_in)
            self._check_stop(s, self._last_eval[1])

    def _prune(self) -> None:
        """Drop the versions no worker can start from any more (nor an evaluation read)."""
        s = self.master.outer_step
        if self.sync == "async":  # a worker that is down downloads the newest version when it comes back
            keep = min([min(b, h) for b, h, a in zip(self._base, self._held, self._up) if a] + [self._visible])
        elif self._per_delta:
            keep = s - self.options.max_delay
        else:
            keep = s - max(self._worker_delay)
        if self.sync == "lockstep" and not self.arrival:
            keep -= 1  # a round's deltas start from version (round - tau)
        self.master.prune(max(0, min(keep, self._visible)))

    # ------------------------------------------------------------------ the event loop's part

    def _after(self, at: float, kind: int, k: int, data: Any) -> None:
        """Handle an event of this half at ``at``: at once when that is now (an instant transfer)."""
        if at <= self.now:
            self._handle(kind, k, data, self.now)
        else:
            self._push(at, kind, k, data)

    def _handle(self, kind: int, k: int, data: Any, t: float) -> None:
        if kind == _UPLOADED:
            self._uploaded(k, data, t)
        elif kind == _ARRIVE:
            self._arrive(k, data, t)
        elif kind == _PUBLISHED:
            self._published(data, t)
        elif kind == _DOWNLOADED:
            self._downloaded(k, data, t)
        elif kind == _PUMP:
            self.pump(k, t)
        elif kind == _DEADLINE:
            self._deadline(data, t)
        elif kind == _QUORUM:
            self._quorum(data, t)
        else:  # pragma: no cover - a kind of the clock's half
            raise AssertionError(f"unknown event kind {kind}")

    @staticmethod
    def handles(kind: int) -> bool:
        return kind >= _UPLOADED

    def comm_summary(self) -> dict[str, Any]:
        """What the communication cost, per worker (for ``results.json``)."""
        return {"upload_bytes": {("whole" if n is None else n): b for n, b in self._wire_size.items()},
                "version_bytes": self._version_bytes, "bytes_down": self.bytes_down,
                "time_uploading": list(self.time_uploading), "time_downloading": list(self.time_downloading),
                "upload_seconds_per_delta": [None if math.isinf(x) else x for x in
                                             (link.seconds(max(self._wire_size.values() or [0])) for link in self.links)]}

    # ------------------------------------------------------------------ what the clock's half (engine.py) provides

    workers: list[SimWorker]
    master: SimMaster
    options: SimOptions
    runner: PhaseRunner
    encoding: EncodingSpec
    sync: str
    arrival: bool
    now: float
    quorum: int
    on_version: Callable[[dict[str, Any]], None] | None
    evaluate: Callable[[Mapping[str, Tensor]], float] | None
    eval_points: list[int]
    eval_curve: list[list[float]]
    eval_times: list[float]
    eval_tokens: list[int]
    _eval_at: list[float]
    _last_eval: tuple[int, float] | None
    _feedback: list[ErrorFeedback]
    _phase: dict[tuple[int, int], tuple[float, int]]
    _held: list[int]
    _fetching: list[int]
    _up: list[bool]
    _base: list[int]
    _per_delta: bool
    _worker_delay: list[int]
    _heap: list[tuple[float, int, int, int, Any]]
    stopped_early: bool
    rebase: SimOwnDeltas | None

    @property
    def _base_known_at_delivery(self) -> bool:  # pragma: no cover - engine.py
        raise NotImplementedError

    def _base_of(self, k: int, r: int) -> int:  # pragma: no cover - engine.py
        raise NotImplementedError

    def _start(self, k: int, base: int) -> Mapping[str, Tensor]:  # pragma: no cover - engine.py
        raise NotImplementedError

    def _phase_args(self, k: int, base: int) -> dict[str, Any]:  # pragma: no cover - engine.py
        raise NotImplementedError

    def _begin(self, k: int, t: float) -> None:  # pragma: no cover - engine.py
        raise NotImplementedError

    def _holds(self, k: int, v: int, t: float) -> None:  # pragma: no cover - engine.py
        raise NotImplementedError

    def _on_new_version(self, v: int, t: float) -> None:  # pragma: no cover - engine.py
        raise NotImplementedError

    def _unblock(self, k: int, t: float) -> None:  # pragma: no cover - engine.py
        raise NotImplementedError

    def _push(self, t: float, kind: int, k: int, data: Any = None) -> None:  # pragma: no cover - engine.py
        raise NotImplementedError
