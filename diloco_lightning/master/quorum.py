"""When a round is applied: the quorum (a count, or a fraction of the live nodes) and the
adaptive deadline. Pure rules, on whatever clock the caller passes (the master's monotonic
clock, or the simulator's).

**Quorum** (``min_deltas``). An integer is a count of accepted deltas, as it always was. A
float in ``(0, 1]`` is a fraction of the live nodes (:mod:`diloco_lightning.master.membership`):
the round is applied once ``ceil(fraction * live)`` distinct nodes (at least one) have a delta
in it (:func:`quorum_size`, :func:`quorum_count`). ``1.0`` waits for every live node
(synchronous DiLoCo that follows the live workers); ``0.75`` for three of four.

**Deadline** (``max_wait``). A number is a fixed wait: seconds after a round's first accepted
delta before it is applied below the quorum. ``"auto"`` derives the wait from the arrival
offsets seen so far (:class:`ArrivalDeadline`), as hivemind#676 proposes: for each round, the
offset of every later node's delta from the round's first one; the wait is

    W = clamp(median(o) + k * 1.4826 * MAD(o) + resolution, floor, cap)

over the latest ``window`` offsets (``k = 3``: for normally spread arrivals, all but about one
in a thousand are inside; 1.4826 * MAD estimates the standard deviation without letting a
straggler's huge offsets inflate it). ``resolution`` is the master's poll interval (it sees an
arrival only at its next poll). ``floor`` is that resolution; ``cap`` the time after which a
silent node leaves the live set anyway (its node timeout): no deadline waits longer than it
takes to drop a node that is gone. Before ``min_history`` offsets are known the wait is the
cap.

Offsets are censored by the deadline itself: a node that missed a round cut short never shows
its offset in that round, so a deadline learned from the rounds alone could only shrink. So
the nodes that were live but absent when a round was applied are remembered, and when such a
node's next delta arrives, its offset is taken against the round it missed: a worker that
arrived just after the cut widens the next deadline; a true straggler's few large offsets stay
beyond ``median + k * MAD`` (they are a minority), and the master does not wait for it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "AUTO",
    "ArrivalDeadline",
    "deadline_from_offsets",
    "is_fraction",
    "quorum_count",
    "quorum_size",
]

#: ``max_wait="auto"``: the adaptive deadline
AUTO = "auto"
#: MADs above the median offset (``W = median + K * 1.4826 * MAD``)
K = 3.0
#: offsets the deadline is taken over (the latest ones)
WINDOW = 64
#: offsets needed before the deadline adapts (before: the cap)
MIN_HISTORY = 4
#: nodes remembered as having missed a round (bounded memory; the oldest are forgotten)
MAX_MISSED = 4096
_MAD_TO_SIGMA = 1.4826


def is_fraction(min_deltas: Any) -> bool:
    """Whether ``min_deltas`` is a fraction of the live nodes (a float) rather than a count (an int)."""
    return isinstance(min_deltas, float)


def quorum_size(min_deltas: int | float, live: int) -> int:
    """How many the round needs: ``min_deltas`` deltas (an int), or ``ceil(min_deltas * live)``
    distinct nodes, at least 1 (a float in ``(0, 1]``; ``live`` is the number of live nodes)."""
    if is_fraction(min_deltas):
        # the epsilon keeps 0.75 * 4 == 3, not 4 after rounding error
        return max(1, math.ceil(float(min_deltas) * max(0, int(live)) - 1e-9))
    return int(min_deltas)


def quorum_count(min_deltas: int | float, nodes: Iterable[str]) -> int:
    """What counts toward the quorum among the round's deltas (``nodes``: one entry per accepted
    delta): every delta for a count, distinct nodes for a fraction of the live nodes."""
    nodes = list(nodes)
    return len(set(nodes)) if is_fraction(min_deltas) else len(nodes)


def deadline_from_offsets(
    offsets: Iterable[float],
    *,
    cap: float,
    floor: float = 0.0,
    resolution: float = 0.0,
    k: float = K,
    min_history: int = MIN_HISTORY,
) -> float:
    """``clamp(median + k * 1.4826 * MAD + resolution, floor, cap)`` of ``offsets`` (seconds);
    ``cap`` when fewer than ``min_history`` are known (see the module docstring)."""
    xs = [float(o) for o in offsets if math.isfinite(o) and o >= 0]
    cap = max(float(cap), float(floor))
    if len(xs) < max(1, min_history):
        return cap
    med = statistics.median(xs)
    mad = statistics.median(abs(x - med) for x in xs)
    return min(cap, max(float(floor), med + k * _MAD_TO_SIGMA * mad + resolution))


class ArrivalDeadline:
    """The arrival offsets behind ``max_wait="auto"`` (see the module docstring).

    Call :meth:`arrived` for each accepted delta (with the time it was accepted), :meth:`closed`
    when the round is applied (with the nodes that were live then), and read :meth:`deadline`
    for the wait after the open round's first delta. Times are seconds on any one clock.
    """

    def __init__(self, *, window: int = WINDOW, k: float = K, min_history: int = MIN_HISTORY) -> None:
        self.offsets: deque[float] = deque(maxlen=max(1, int(window)))
        self.k = float(k)
        self.min_history = int(min_history)
        self.opened_at: float | None = None  #: when the open round's first delta arrived
        self._in_round: set[str] = set()
        self._missed: dict[str, float] = {}  # node -> opening time of the round it missed

    def arrived(self, node: str, now: float) -> None:
        """A delta of ``node`` was accepted at ``now``."""
        missed = self._missed.pop(node, None)
        if self.opened_at is None:
            self.opened_at = now
            self._in_round = {node}
            if missed is not None:
                self.offsets.append(max(0.0, now - missed))
            return
        if node in self._in_round:
            return  # a node's second delta in one round says nothing about arrival spread
        self._in_round.add(node)
        self.offsets.append(max(0.0, now - (missed if missed is not None else self.opened_at)))

    def closed(self, live: Iterable[str], now: float | None = None) -> None:
        """The open round was applied; ``live``: the nodes live then. The absent ones are
        remembered, so their next arrival is measured against this round (uncensored)."""
        if self.opened_at is not None:
            for node in sorted(set(live) - self._in_round):
                self._missed.setdefault(node, self.opened_at)
            while len(self._missed) > MAX_MISSED:
                self._missed.pop(next(iter(self._missed)))
        self.opened_at = None
        self._in_round = set()

    def forget(self, node: str) -> None:
        """``node`` left the live set: its next arrival (if ever) is not an offset of a missed round."""
        self._missed.pop(node, None)

    def deadline(self, *, cap: float, floor: float = 0.0, resolution: float = 0.0) -> float:
        """Seconds after the open round's first delta before it is applied below the quorum."""
        return deadline_from_offsets(self.offsets, cap=cap, floor=floor, resolution=resolution, k=self.k,
                                     min_history=self.min_history)

    def waited(self, now: float) -> float:
        """Seconds since the open round's first delta (0 when no round is open)."""
        return 0.0 if self.opened_at is None else max(0.0, now - self.opened_at)

    def state_dict(self) -> dict[str, Any]:
        return {"offsets": list(self.offsets)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        offs = state.get("offsets") if isinstance(state, Mapping) else None
        if isinstance(offs, list):
            self.offsets.clear()
            self.offsets.extend(float(o) for o in offs[-(self.offsets.maxlen or 1):]
                                if isinstance(o, (int, float)) and not isinstance(o, bool) and math.isfinite(o) and o >= 0)
