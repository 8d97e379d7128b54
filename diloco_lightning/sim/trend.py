"""The master's predicted movement, to start a phase where the global will be (``sim.lookahead_trend``,
``sim.lookahead_momentum``).

Why: a phase from version ``b`` whose delta is applied ``tau`` deltas later was computed at a point
that lacks those ``tau`` deltas. The rebase (:mod:`~diloco_lightning.sim.rebase`) supplies the
worker's own ones; the others' are not known when the phase begins. Their sum is predicted from
what the master did just before: DANA's look-ahead (Hakimi et al. 2019) for a momentum-free step,
the eager update of arXiv 2502.12996 with the master's mean in place of the worker's own delta.

The prediction published with version ``b`` (what a master would put in its manifest)::

    step_per_delta_b = (version_b - version_{b-W}) / (deltas applied by versions b-W+1 .. b)
    lacking_b        = mean over those deltas of tau (versions) x the mean deltas per version

and a phase from version ``b`` starts from

    start = rebase(version_b) + max(0, lacking_b - own) x step_per_delta_b

``own``: the worker's own deltas the rebase subtracted (0 without it), so nothing counts twice.
``W`` (``window``) versions, fewer at the start; before the first step the prediction is zero.

With ``momentum`` the prediction is instead what the outer step's own momentum will add over the
next ``lacking_b / (deltas per version)`` versions whatever they apply
(:meth:`~diloco_lightning.outer.base.OuterOptimizer.lookahead`): DANA's look-ahead proper, exact
for the momentum's share and silent about the deltas to come.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from diloco_lightning.outer.base import OuterOptimizer

__all__ = ["Trend"]


class Trend:
    """See the module docstring. Fed by the master at every published version
    (:meth:`published`); :meth:`start` moves a phase's start by the prediction of its base."""

    def __init__(self, window: int = 8, *, momentum: bool = False) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = int(window)
        self.momentum = bool(momentum)
        self._steps: deque[tuple[dict[str, Tensor], int, float]] = deque()  # (movement, deltas, sum of tau)
        #: per version: (the movement per delta, the deltas lacked), or with ``momentum`` (the whole movement, None)
        self._predictions: dict[int, tuple[dict[str, Tensor] | None, float | None]] = {0: (None, 0.0)}

    def published(self, version: int, before: Mapping[str, Tensor], after: Mapping[str, Tensor],
                  taus: list[int], opt: OuterOptimizer | None = None) -> None:
        """Version ``version`` (``after``) was made from ``before`` by a step of ``opt`` that applied
        deltas of staleness ``taus`` (none: a null round)."""
        # the movement itself only feeds the trend; DANA's prediction needs the staleness alone
        move = {} if self.momentum else \
            {k: after[k].float() - before[k].float() for k in after if after[k].is_floating_point()}
        self._steps.append((move, len(taus), float(sum(taus))))
        if len(self._steps) > self.window:
            self._steps.popleft()
        deltas = sum(n for _, n, _ in self._steps)
        if deltas == 0:
            self._predictions[version] = (None, 0.0)
            return
        per_version = deltas / len(self._steps)
        lacking = sum(t for _, _, t in self._steps) / deltas * per_version
        if self.momentum:
            ahead = None if opt is None else opt.lookahead(lacking / per_version)
            self._predictions[version] = (ahead, None)
            return
        total = {k: torch.stack([m[k] for m, _, _ in self._steps]).sum(0) for k in move}
        self._predictions[version] = ({k: v / deltas for k, v in total.items()}, lacking)

    def start(self, base: int, state: Mapping[str, Tensor], own: int) -> Mapping[str, Tensor]:
        """``state`` (version ``base``, rebased by ``own`` deltas) moved by the prediction of the
        others' deltas it lacks; ``state`` itself when there is none."""
        step, lacking = self._predictions[base]
        n = 1.0 if lacking is None else lacking - own
        if step is None or n <= 0:
            return state
        with torch.no_grad():
            return {k: (v + n * step[k].to(v.device)).to(v.dtype) if k in step else v for k, v in state.items()}

    def prune(self, keep_from: int) -> None:
        """Forget the predictions of versions below ``keep_from``."""
        for v in [v for v in self._predictions if v < keep_from]:
            del self._predictions[v]

    def state_dict(self) -> dict[str, Any]:
        def copy(d: Mapping[str, Tensor] | None) -> dict[str, Tensor] | None:
            return None if d is None else {k: v.clone() for k, v in d.items()}

        return {"window": self.window, "momentum": self.momentum,
                "steps": [(copy(m), n, t) for m, n, t in self._steps],
                "predictions": {v: (copy(p), lack) for v, (p, lack) in self._predictions.items()}}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        if int(sd["window"]) != self.window or bool(sd["momentum"]) != self.momentum:
            raise ValueError(f"state_dict: window {sd['window']}, momentum {sd['momentum']}; this run's: "
                             f"window {self.window}, momentum {self.momentum}")
        self._steps = deque((dict(m), int(n), float(t)) for m, n, t in sd["steps"])
        self._predictions = {int(v): (None if p is None else dict(p), None if lack is None else float(lack))
                             for v, (p, lack) in sd["predictions"].items()}
