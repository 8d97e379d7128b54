"""What travels on the simulated clock: deltas up to the master, versions down to the workers.

The part of the :class:`~diloco_lightning.sim.engine.Simulator` that is the hub and the master
(``engine.py`` is the clock and the workers' phases). The simulator holds one :class:`Transfers`;
the two share only the :class:`~diloco_lightning.sim.clock.EventQueue` and ask each other through
small interfaces: the transfers call the simulator's :class:`Phases` methods (a worker may begin,
holds a version, a phase's delta), the simulator calls :meth:`Transfers.hand_in`,
:meth:`Transfers.need`, :meth:`Transfers.fetch` and :meth:`Transfers.handle`. Every duration comes from the workers' links
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from diloco_lightning.encoding.feedback import encode_delta
from diloco_lightning.sim.clock import EventQueue
from diloco_lightning.sim.links import Link, state_bytes, wire_bytes
from diloco_lightning.sim.result import as_received

if TYPE_CHECKING:
    from diloco_lightning.encoding import EncodingSpec
    from diloco_lightning.encoding.feedback import ErrorFeedback
    from diloco_lightning.sim.evaluations import Evaluations
    from diloco_lightning.sim.inner import SimWorker
    from diloco_lightning.sim.master import SimMaster
    from diloco_lightning.sim.options import SimOptions
    from diloco_lightning.sim.rebase import SimOwnDeltas

__all__ = ["Item", "Phases", "Transfers"]

log = logging.getLogger(__name__)

# event kinds of the transfers (the clock's own, in engine.py, are below 10)
_UPLOADED, _ARRIVE, _PUBLISHED, _DOWNLOADED, _PUMP, _DEADLINE, _QUORUM = 10, 11, 12, 13, 14, 15, 16


@dataclass
class Item:
    """One upload: the phases (boundaries) of one worker whose deltas it carries (more than one:
    merged), and the version its uploads must wait for (lockstep's gate; -1: none)."""

    phases: list[int]
    gate: int = -1
    tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class Phases(Protocol):
    """What the transfers ask of the workers' side (the :class:`~diloco_lightning.sim.engine.Simulator`)."""

    def begin(self, k: int, t: float) -> None:
        """Worker ``k`` holds the version its next phase starts from (lockstep): it may begin it at ``t``."""

    def holds(self, k: int, v: int, t: float) -> None:
        """Worker ``k`` has downloaded version ``v`` at ``t``."""

    def unblock(self, k: int, t: float) -> None:
        """Worker ``k``'s outbox has room again at ``t`` (fragments' backpressure)."""

    def new_version(self, v: int, t: float) -> None:
        """Asynchronously: version ``v`` is published at ``t``."""

    def delta_of(self, k: int, r: int) -> tuple[int, dict[str, Tensor]]:
        """Worker ``k``'s phase ``r``, computed: ``(the version it started from, its delta)``."""
        ...

    def oldest_needed(self) -> int:
        """The oldest version a worker may still start a phase from (or an evaluation read)."""
        ...


class Transfers:
    """The hub and the master (see the module docstring): ``links`` (each worker's), ``held`` (the
    version each worker holds), ``visible`` (the newest published), and what the communication cost
    (``bytes_sent``, ``deltas``, ``histogram``, ``tokens_in``; :meth:`comm_summary`)."""

    def __init__(self, workers: Sequence[SimWorker], master: SimMaster, options: SimOptions, clock: EventQueue,
                 phases: Phases, evaluations: Evaluations, *, encoding: EncodingSpec, feedback: Sequence[ErrorFeedback],
                 sync: str, quorum: int, rebase: SimOwnDeltas | None = None,
                 on_version: Callable[[dict[str, Any]], None] | None = None) -> None:
        n = len(workers)
        self.workers = workers
        self.master = master
        self.options = options
        self.clock = clock
        self.phases = phases
        self.evaluations = evaluations
        self.encoding = encoding
        self.feedback = list(feedback)  # each worker's error feedback (what its encoding dropped)
        self.sync = sync
        self.arrival = master.config.aggregation == "arrival"
        self.quorum = quorum
        self.rebase = rebase
        self.on_version = on_version
        self.links = [Link(options.latency_of(k), options.bandwidth_of(k)) for k in range(n)]
        self.held = [0] * n  # the version each worker holds (downloaded; lockstep: installed)
        self.fetching = [-1] * n  # the version each worker's fetcher is downloading (-1: none)
        self.visible = 0  # the newest published version
        self._version_bytes = state_bytes(master.state)
        self._wire_size: dict[str | None, int] = {}
        self._outbox: list[list[Item]] = [[] for _ in range(n)]
        self._waiting: dict[int, list[int]] = {}  # version -> lockstep workers waiting for it
        self._published_at: dict[int, float] = {0: 0.0}
        self._master_free = 0.0
        self._overdue = False  # the open round passed its deadline with no delta
        self.time_uploading = [0.0] * n
        self.time_downloading = [0.0] * n
        self.bytes_down = 0
        self.histogram: dict[str, int] = {}
        self.bytes_sent = 0
        self.deltas = 0
        self.tokens_in = 0  # tokens of the deltas delivered to the master

    def start(self) -> None:
        """The run begins: the first round's deadline, if any."""
        if self.options.deadline is not None and not self.arrival:
            self.clock.push(self.options.deadline, _DEADLINE, -1, 0)

    def queued(self, k: int) -> int:
        """Deltas of worker ``k`` waiting to be uploaded or uploading (its outbox)."""
        return len(self._outbox[k])

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
        while box and not link.uploading(t) and self.visible >= box[0].gate:
            item = box.pop(0)
            nbytes = self._upload_bytes(k, item.phases[0])
            start, end = link.upload(t, nbytes)
            self.time_uploading[k] += end - start
            self._after(end, _UPLOADED, k, item)
        self.phases.unblock(k, t)

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
            b, d = self.phases.delta_of(k, r)
            base = b if base < 0 else base
            delta = d if delta is None else {kk: delta[kk] + d[kk] for kk in delta}
            tokens += w.delta_tokens(r) or 0
        assert delta is not None
        wire = self.feedback[k].encode(delta)
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
        self.tokens_in += tokens
        if self.rebase is not None:
            self.rebase.sent(k, ident, received)
        if self.options.late == "drop" and self.options.barrier and tau > 0:
            self.master.refuse("late")  # a round it was not part of closed without it
            self._refused(ident)
        elif self.arrival:
            rec = self.master.arrive(ident, received, tau, num_tokens=tokens or None, now=t, fragment=fragment)
            if rec is not None:
                self._count(tau)
                self.publish(rec)
            else:
                self._refused(ident)
        else:
            if self.master.add(ident, received, tau, num_tokens=tokens or None, fragment=fragment):
                self._count(tau)
            else:
                self._refused(ident)
            if self._overdue and self.master.open_deltas:
                self.publish(self.master.close_round(t))
            elif self.master.open_deltas >= self.quorum:
                if self.options.barrier:  # after the events already due at t: the deltas arriving with it
                    self.clock.push(t, _QUORUM, -1, self.master.outer_step)
                else:
                    self.publish(self.master.close_round(t))
        self._prune()

    def _refused(self, ident: str) -> None:
        if self.rebase is not None:
            self.rebase.refused(ident)

    def _count(self, tau: int) -> None:
        self.histogram[str(tau)] = self.histogram.get(str(tau), 0) + 1

    def _deadline(self, v: int, t: float) -> None:
        """The round after version ``v`` reached its deadline: close it with what it has (or with its first delta)."""
        if self.master.outer_step != v:
            return  # closed already
        if self.master.open_deltas:
            self.publish(self.master.close_round(t))
        else:
            self._overdue = True

    def _quorum(self, v: int, t: float) -> None:
        """The round after version ``v`` reached its quorum at ``t``: close it with every delta it has."""
        if self.master.outer_step == v and self.master.open_deltas:
            self.publish(self.master.close_round(t))

    def publish(self, rec: dict[str, Any]) -> None:
        """The master has taken an outer step: version ``outer_step`` is published after ``master_time``."""
        v = self.master.outer_step
        if self.rebase is not None:
            self.rebase.published(v, self.master.applied_factors)
        at = max(self.clock.now, self._master_free) + self.options.master_time
        self._master_free = at
        rec["time"] = at
        self._published_at[v] = at
        self._overdue = False
        self._emit(rec)
        self.evaluations.after_step(self.tokens_in)
        self._after(at, _PUBLISHED, -1, v)

    def _emit(self, rec: dict[str, Any]) -> None:
        if self.on_version is not None:
            self.on_version(rec)

    def _published(self, v: int, t: float) -> None:
        """Version ``v`` is on the hub at ``t``: the workers waiting for it download it, gated uploads go."""
        self.visible = max(self.visible, v)
        for k in sorted({k for k, box in enumerate(self._outbox) if box and box[0].gate == v}):  # gated on v
            self.clock.push(t, _PUMP, k, None)  # after the events already due now, as a poll would see it
        for k in self._waiting.pop(v, []):
            self.need(k, v, t)
        if self.sync == "async":
            self.phases.new_version(v, t)
        if self.options.deadline is not None and not self.arrival:
            self.clock.push(t + self.options.deadline, _DEADLINE, -1, v)

    def _prune(self) -> None:
        """Drop the versions no worker can start from any more (nor an evaluation read)."""
        self.master.prune(max(0, min(self.phases.oldest_needed(), self.visible)))

    def drain(self, *, close: bool) -> None:
        """The run has ended: the master closes its open round (``close``), every version is visible,
        and the master's pending record (deltas it refused after its last step) is emitted."""
        if close and self.master.open_deltas:
            self.publish(self.master.close_round(self.clock.now))
        self.visible = self.master.outer_step
        pending = self.master.pending_record()
        if pending is not None:
            self._emit(pending)

    # ------------------------------------------------------------------ downloads

    def need(self, k: int, target: int, t: float) -> None:
        """Lockstep: worker ``k`` needs exactly version ``target`` to begin its next phase."""
        if self.held[k] == target:
            self.phases.begin(k, t)
        elif self.visible >= target:
            self._download(k, target, t)
        else:
            self._waiting.setdefault(target, []).append(k)

    def fetch(self, k: int, t: float) -> None:
        """Asynchronously: worker ``k``'s fetcher downloads the newest published version, if newer."""
        if self.links[k].downloading(t) or self.visible <= max(self.held[k], self.fetching[k]):
            return
        self._download(k, self.visible, t)

    def _download(self, k: int, v: int, t: float) -> None:
        self.fetching[k] = v
        start, end = self.links[k].download(t, self._version_bytes)
        self.time_downloading[k] += end - start
        self.bytes_down += self._version_bytes
        self._after(end, _DOWNLOADED, k, v)

    def _downloaded(self, k: int, v: int, t: float) -> None:
        self.held[k] = v if self.sync == "lockstep" else max(self.held[k], v)
        self.fetching[k] = -1
        if self.sync == "async":
            self.fetch(k, t)  # a newer one was published meanwhile
        self.phases.holds(k, v, t)

    # ------------------------------------------------------------------ the event loop's part

    def _after(self, at: float, kind: int, k: int, data: Any) -> None:
        """Handle an event of the transfers at ``at``: at once when that is now (an instant transfer)."""
        if at <= self.clock.now:
            self.handle(kind, k, data, self.clock.now)
        else:
            self.clock.push(at, kind, k, data)

    def handle(self, kind: int, k: int, data: Any, t: float) -> None:
        """An event of the transfers (a kind of 10 or more) at ``t``."""
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
        else:  # pragma: no cover - a kind of the clock's
            raise AssertionError(f"unknown event kind {kind}")

    def comm_summary(self) -> dict[str, Any]:
        """What the communication cost, per worker (for ``results.json``)."""
        return {"upload_bytes": {("whole" if n is None else n): b for n, b in self._wire_size.items()},
                "version_bytes": self._version_bytes, "bytes_down": self.bytes_down,
                "time_uploading": list(self.time_uploading), "time_downloading": list(self.time_downloading),
                "upload_seconds_per_delta": [None if math.isinf(x) else x for x in
                                             (link.seconds(max(self._wire_size.values() or [0])) for link in self.links)]}
