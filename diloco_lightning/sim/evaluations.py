"""The simulator's evaluations of the global model: at outer steps or at simulated times.

:class:`Evaluations` evaluates the master's versions where the run asks (``eval_points``: the
first version at or past each outer step; ``eval_times``: the newest published version at each
simulated time), records ``[outer step, loss]`` with the time and the tokens delivered by then,
and ends the run (it empties the :class:`~diloco_lightning.sim.clock.EventQueue`) at an
evaluation above ``stop_above``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from diloco_lightning.sim.clock import EventQueue

if TYPE_CHECKING:
    from diloco_lightning.sim.master import SimMaster

__all__ = ["Evaluations"]

log = logging.getLogger(__name__)


class Evaluations:
    """The run's evaluations (see the module docstring): ``curve`` (``[outer step, loss]``), ``times``
    and ``tokens`` (each point's simulated time and delivered tokens), ``stopped_early``."""

    def __init__(self, evaluate: Callable[[Mapping[str, Tensor]], float] | None, master: SimMaster, clock: EventQueue,
                 *, points: Sequence[int] = (), times: Sequence[float] = (), stop_above: float | None = None) -> None:
        self.evaluate = evaluate
        self.master = master
        self.clock = clock
        self.points = sorted(set(int(p) for p in points))  # outer steps still to evaluate after
        self.pending_times = sorted(set(float(t) for t in times))  # simulated times still to evaluate at
        self.stop_above = stop_above
        self.curve: list[list[float]] = []
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.last: tuple[int, float] | None = None  # (outer step, loss) of the last evaluation at a time
        self.stopped_early = False  # an evaluation above stop_above ended the run

    def after_step(self, tokens: int) -> None:
        """The master has taken an outer step: evaluate it if an ``eval_points`` entry is due."""
        s = self.master.outer_step
        if self.evaluate is None or not self.points or self.points[0] > s:
            return
        while self.points and self.points[0] <= s:
            self.points.pop(0)
        self.curve.append([s, float(self.evaluate(self.master.state))])
        self.times.append(self.clock.now)
        self.tokens.append(tokens)
        self._check_stop(s, self.curve[-1][1])

    def until(self, t: float, *, inclusive: bool, visible: int, tokens: int) -> None:
        """Evaluate version ``visible`` (the newest published) at each of the times before ``t`` (or at it)."""
        while self.evaluate is not None and self.pending_times and (
                self.pending_times[0] < t or (inclusive and self.pending_times[0] <= t)):
            at = self.pending_times.pop(0)
            s = visible
            if self.last is None or self.last[0] != s:  # an unchanged version is not evaluated twice
                state = self.master.state if s == self.master.outer_step else self.master.versions[s]
                self.last = (s, float(self.evaluate(state)))
            self.curve.append([s, self.last[1]])
            self.times.append(at)
            self.tokens.append(tokens)
            self._check_stop(s, self.last[1])  # empties pending_times when it stops the run

    def final(self, *, visible: int, tokens: int) -> None:
        """The run has ended: the times past its last event (on the final state), or the final version
        if the last evaluation was not of it."""
        if self.pending_times:
            self.until(float("inf"), inclusive=True, visible=visible, tokens=tokens)
        elif not self.curve or self.curve[-1][0] != self.master.outer_step:
            if self.evaluate is not None:
                self.curve.append([self.master.outer_step, float(self.evaluate(self.master.state))])
                self.times.append(self.clock.now)
                self.tokens.append(tokens)

    def _check_stop(self, step: int, loss: float) -> None:
        """End the run (no more events) at an evaluation after version 0 above ``stop_above``."""
        limit = self.stop_above
        if limit is not None and step > 0 and not (loss <= limit):
            log.info("outer step %d: eval loss %s above stop_above=%s: the run stops here", step, loss, limit)
            self.stopped_early = True
            self.clock.clear()
            self.pending_times = []

    def state_dict(self) -> dict[str, Any]:
        return {"points": list(self.points), "pending_times": list(self.pending_times), "curve": [list(p) for p in self.curve],
                "times": list(self.times), "tokens": list(self.tokens), "last": self.last,
                "stopped_early": self.stopped_early}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.points = list(sd["points"])
        self.pending_times = list(sd["pending_times"])
        self.curve = [list(p) for p in sd["curve"]]
        self.times = list(sd["times"])
        self.tokens = list(sd["tokens"])
        self.last = None if sd["last"] is None else (int(sd["last"][0]), float(sd["last"][1]))
        self.stopped_early = bool(sd["stopped_early"])
