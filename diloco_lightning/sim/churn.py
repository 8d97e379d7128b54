"""Workers that vanish and come back (preemption, spot instances), on the simulated clock.

Each worker is *down* during a list of intervals ``[down, up)`` (``up`` may be infinite: it never
comes back) and up otherwise. They come from, all together:

* ``join_at`` (down on ``[0, join)``) and ``leave_at`` (down from ``leave`` on);
* ``preempt`` as a trace: one entry per worker, null or a list of ``[down, up]`` pairs (``up``
  null: gone for good);
* ``preempt`` as a law, ``{rate: r, down: d, seed: s, law: fixed | exponential}``: for each worker
  a Poisson process of preemptions, ``r`` per unit of up time (exponential gaps, mean ``1 / r``),
  each lasting ``d`` units (``law: exponential``: exponential with mean ``d``), drawn from
  ``random.Random("<s>:preempt:<k>")``: the same worker gets the same draws in every run of the
  same seed, whatever else changes. A rate per hour ``R`` with one unit standing for ``u`` seconds
  is ``r = R * u / 3600``. The expected share of time down is ``r d / (1 + r d)``.

A phase that a down interval interrupts is lost: its worker does not compute it (the engine knows
when it begins), and comes back with the state of its last finished phase (what its checkpoint
at the last boundary holds), from the version it installs when it comes back.
"""

from __future__ import annotations

import math
import random
from typing import Any

__all__ = ["Churn", "PREEMPT_LAWS"]

#: the laws of a preemption's duration
PREEMPT_LAWS = ("fixed", "exponential")


class Churn:
    """The down intervals of every worker (see the module docstring).

    Args:
        workers: how many.
        join_at / leave_at: per worker, a time or None (the ``sim`` options).
        preempt: the ``preempt`` option (None, a per-worker trace, or a law).
    """

    def __init__(self, workers: int, *, join_at: list[Any] | None = None, leave_at: list[Any] | None = None,
                 preempt: Any = None) -> None:
        self.workers = int(workers)
        self._fixed: list[list[tuple[float, float]]] = [[] for _ in range(self.workers)]
        for k in range(self.workers):
            join = _at(join_at, k)
            if join is not None and join > 0:
                self._fixed[k].append((0.0, float(join)))
            leave = _at(leave_at, k)
            if leave is not None:
                self._fixed[k].append((float(leave), math.inf))
        self.law: dict[str, Any] | None = None
        if isinstance(preempt, dict):
            self.law = {"rate": float(preempt["rate"]), "down": float(preempt["down"]),
                        "seed": int(preempt.get("seed", 0)), "law": str(preempt.get("law", "fixed"))}
        elif preempt is not None:
            for k, trace in enumerate(list(preempt)):
                for down, up in trace or []:
                    self._fixed[k].append((float(down), math.inf if up is None else float(up)))
        self._rng = [random.Random(f"{self.law['seed']}:preempt:{k}") if self.law else None for k in range(self.workers)]
        self._drawn: list[list[tuple[float, float]]] = [[] for _ in range(self.workers)]
        self._drawn_to = [0.0] * self.workers  # the law's draws cover [0, this) (the last interval's end)

    @property
    def active(self) -> bool:
        """Whether any worker is ever down."""
        return self.law is not None or any(self._fixed)

    def _draw_until(self, k: int, t: float) -> None:
        law, rng = self.law, self._rng[k]
        if law is None or rng is None or law["rate"] <= 0:
            return
        while self._drawn_to[k] <= t:
            down = self._drawn_to[k] + rng.expovariate(law["rate"])
            length = law["down"] if law["law"] == "fixed" else rng.expovariate(1.0 / law["down"])
            self._drawn[k].append((down, down + length))
            self._drawn_to[k] = down + length

    def intervals(self, k: int, until: float) -> list[tuple[float, float]]:
        """Worker ``k``'s down intervals that begin before ``until``, merged and sorted."""
        self._draw_until(k, until)
        spans = sorted([s for s in self._fixed[k] + self._drawn[k] if s[0] < until])
        merged: list[tuple[float, float]] = []
        for down, up in spans:
            if merged and down <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], up))
            else:
                merged.append((down, up))
        return merged

    def up_at(self, k: int, t: float) -> float:
        """``t`` if worker ``k`` is up at ``t``, else when it comes back (inf: never)."""
        for down, up in self.intervals(k, t + 1e-9):
            if down <= t < up:
                return up
        return t

    def next_down(self, k: int, t: float) -> float:
        """The first time at or after ``t`` at which worker ``k`` goes down (inf: never)."""
        fixed = [down for down, _ in self._fixed[k] if down >= t]
        first = min(fixed) if fixed else math.inf
        if self.law is not None and self.law["rate"] > 0:
            while True:
                self._draw_until(k, t)
                later = [down for down, _ in self._drawn[k] if down >= t]
                if later:
                    return min(first, min(later))
                t_next = self._drawn_to[k]  # the last drawn interval ends past t: draw past its end
                self._draw_until(k, t_next)
        return first

    def down_time(self, k: int, until: float) -> float:
        """How long worker ``k`` is down in ``[0, until)``."""
        return sum(max(0.0, min(up, until) - down) for down, up in self.intervals(k, until))


def _at(times: list[Any] | None, k: int) -> float | None:
    if times is None or k >= len(times) or times[k] is None:
        return None
    return float(times[k])
