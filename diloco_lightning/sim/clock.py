"""The simulated clock: an event queue in time order, ties in the order the events were queued.

Both parts of the :class:`~diloco_lightning.sim.engine.Simulator` push onto one
:class:`EventQueue` (the workers' phases, :mod:`~diloco_lightning.sim.transfers`' uploads,
publications and downloads); nothing else decides the order, so a run is a pure function of its
options and seeds.
"""

from __future__ import annotations

import heapq
from typing import Any

__all__ = ["EventQueue"]


class EventQueue:
    """Events ``(time, kind, worker, data)`` popped in time order, ties by the order they were pushed;
    ``now`` is the time of the event being handled."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self.now = 0.0

    def push(self, t: float, kind: int, k: int, data: Any = None) -> None:
        """Queue an event of ``kind`` for worker ``k`` (-1: none) at ``t``."""
        heapq.heappush(self._heap, (t, self.ticket(), kind, k, data))

    def pop(self) -> tuple[float, int, int, Any]:
        """The next event: ``(time, kind, worker, data)``."""
        t, _, kind, k, data = heapq.heappop(self._heap)
        return t, kind, k, data

    def ticket(self) -> int:
        """A number no event or ticket had before (increasing: an event's place among equal times)."""
        self._seq += 1
        return self._seq

    def clear(self) -> None:
        """Drop every queued event (the run ends)."""
        self._heap.clear()

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def state_dict(self) -> dict[str, Any]:
        """The queue, its counter and the time (the events' data as they are: objects, not copies)."""
        return {"events": list(self._heap), "seq": self._seq, "now": self.now}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._heap = list(sd["events"])
        heapq.heapify(self._heap)
        self._seq = int(sd["seq"])
        self.now = float(sd["now"])
