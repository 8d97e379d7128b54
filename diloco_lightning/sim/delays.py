"""The staleness the simulator imposes in lockstep: the ``delay`` option, per worker or per delta.

``delay`` is an int, a per-worker list, or a distribution drawn once per worker
(:func:`~diloco_lightning.worker.sync.resolve_delay`, the product's draw) or, with
``delay_per="delta"``, once per delta (:func:`~diloco_lightning.worker.sync.draw_delay`), capped
at ``max_delay``; during the first ``burn_in`` outer steps it is 0.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from diloco_lightning.worker.sync import draw_delay, resolve_delay

if TYPE_CHECKING:
    from diloco_lightning.sim.inner import SimWorker
    from diloco_lightning.sim.options import SimOptions

__all__ = ["Delays"]


class Delays:
    """The ``delay`` option resolved for the workers: ``per_delta`` (drawn for each delta) or
    ``per_worker`` (each worker's one delay, capped at ``max_delay``)."""

    def __init__(self, delay: Any, workers: Sequence[SimWorker], options: SimOptions) -> None:
        self.spec = delay
        self.burn_in = options.burn_in
        self.max_delay = options.max_delay
        self.per_delta = isinstance(delay, Mapping) and options.delay_per == "delta"
        self.seed = delay.get("seed", 0) if isinstance(delay, Mapping) else 0
        self.per_worker = [min(resolve_delay(delay, w.node_id, w.index), self.max_delay) if not self.per_delta else 0
                           for w in workers]

    def of(self, index: int, r: int, applied_at: int) -> int:
        """The staleness imposed on worker ``index``'s ``r``-th delta, applied at outer step ``applied_at``."""
        if applied_at < self.burn_in:
            return 0
        if self.per_delta:
            tau = draw_delay(self.spec, random.Random(f"{self.seed}:{index}:{r}"))
            return min(tau, self.max_delay)
        return self.per_worker[index]

    def fixed(self, index: int) -> int | None:
        """Worker ``index``'s one delay (None: drawn per delta)."""
        return None if self.per_delta else self.per_worker[index]

    def largest(self) -> int:
        """The largest delay any delta can have (how far back a version may still be started from)."""
        return self.max_delay if self.per_delta else max(self.per_worker)
