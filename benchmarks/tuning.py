"""A tuning grid that brackets its optimum: extend past an edge that wins until the best is interior.

A study that reports a row tuned on a grid whose best point is an edge has not tuned it: the optimum may
lie beyond. ``bracket`` grows the grid one point at a time past the winning edge (down when every
point diverged), from the losses of the runs done so far, so a resumable study simply runs what it
returns until it says the grid is settled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

P = TypeVar("P", int, float)


def bracket(points: Sequence[P], loss: Callable[[P], float], below: Callable[[P], P], above: Callable[[P], P],
            max_extend: int) -> tuple[list[P], bool]:
    """The grid so far and whether it is settled.

    ``loss(p)`` is nan for a point not yet run and inf for one that diverged. The grid is settled when
    its best point (ties to the smaller) is interior, or after ``max_extend`` added points. While a
    point is not yet run the grid is returned as it is, unsettled: run its missing points and ask again.
    """
    pts = list(points)
    while True:
        losses = [loss(p) for p in pts]
        if any(math.isnan(x) for x in losses):
            return pts, False
        if len(pts) - len(points) >= max_extend:
            return pts, True
        best = min(range(len(pts)), key=lambda i: (losses[i], pts[i]))
        if not any(math.isfinite(x) for x in losses) or best == 0:
            pts.insert(0, below(pts[0]))
        elif best == len(pts) - 1:
            pts.append(above(pts[-1]))
        else:
            return pts, True
