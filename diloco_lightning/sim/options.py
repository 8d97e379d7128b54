"""The simulator's options: one definition (:class:`SimOptions`), one validation.

``train.py launch=sim`` composes these fields into its ``sim`` section
(``diloco_lightning.app.config``) with the help text written here; the engine
(:class:`~diloco_lightning.sim.engine.Simulator`) takes them as one object. What the simulated
run *is* (the model, the data, the inner optimizer, ``inner_steps``, ``sync``, ``delay``,
``delta_dtype``, the outer optimizer, ``aggregation``) comes from the same options as a real run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from diloco_lightning.options import OptionError, check_choice, check_number, option

__all__ = ["DELAY_PER", "SimOptions"]

#: ``worker``: a distribution ``delay`` is drawn once per worker (the product's draw); ``delta``:
#: a fresh draw for every delta
DELAY_PER = ("worker", "delta")


@dataclass
class SimOptions:
    """How the simulator schedules the workers and what it records (besides the run's own options)."""

    speeds: list[float] | None = option(
        None, "per-worker speeds, inner steps per unit of simulated time (null: all 1); a phase of H steps lasts H / speed"
    )
    delay_per: str = option("worker", "a distribution delay is drawn once per worker (the product's draw) | per delta")
    quorum: int | None = option(
        None, "aggregation=round: deltas that close a round (null: every worker; lockstep always takes one per worker)"
    )
    burn_in: int = option(0, "lockstep: outer steps applied with staleness 0 before the delays start")
    max_delay: int = option(256, "the largest delay drawn (a distribution's draws are capped here; older versions are dropped)")
    parallel: int | None = option(
        None, "workers whose phases run at the same time, one thread each (null: min(workers, CPU cores) on a CPU, "
        "1 on a GPU); the results do not depend on it"
    )
    save_weights: bool = option(False, "write the final global weights to <run_dir>/global.safetensors")
    speed_jitter: float = option(
        0.0, "each phase lasts H / speed times exp(speed_jitter * N(0, 1)), drawn per worker and phase from the seed "
        "(0: phases last exactly H / speed)"
    )
    join_at: list[float | None] | None = option(
        None, "sync=async: per worker, the simulated time it joins the run, starting from the newest version (null: 0)"
    )
    leave_at: list[float | None] | None = option(
        None, "sync=async: per worker, the simulated time it leaves the run; a phase not finished by then is lost "
        "(null: never)"
    )

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def validate(self, workers: int | None = None) -> SimOptions:
        """Raise :class:`~diloco_lightning.options.OptionError` naming the first option out of range."""
        if self.speeds is not None:
            speeds = list(self.speeds)
            ok = all(not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0
                     for v in speeds)
            if not ok or not speeds:
                raise OptionError("speeds", f"must be a list of numbers > 0, got {self.speeds!r}")
            if workers is not None and len(speeds) not in (1, workers):
                raise OptionError("speeds", f"must give one speed per worker ({workers}) or one for all, got {len(speeds)}")
        check_choice(self, "delay_per", DELAY_PER)
        check_number(self, "quorum", low=1, integer=True, optional=True)
        check_number(self, "burn_in", low=0, integer=True)
        check_number(self, "max_delay", low=0, integer=True)
        check_number(self, "parallel", low=1, integer=True, optional=True)
        if not isinstance(self.save_weights, bool):
            raise OptionError("save_weights", f"must be True or False, got {self.save_weights!r}")
        check_number(self, "speed_jitter", low=0.0)
        for name in ("join_at", "leave_at"):
            times = getattr(self, name)
            if times is None:
                continue
            ok = all(v is None or (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)
                     for v in list(times))
            if not ok:
                raise OptionError(name, f"must be a list of times >= 0 or null, one per worker, got {times!r}")
            if workers is not None and len(list(times)) != workers:
                raise OptionError(name, f"must give one time (or null) per worker ({workers}), got {len(list(times))}")
        return self

    def membership(self, index: int) -> tuple[float, float]:
        """Worker ``index``'s (join time, leave time): (0, inf) unless ``join_at`` / ``leave_at`` say otherwise."""
        def at(times: Any, default: float) -> float:
            if times is None or index >= len(list(times)) or list(times)[index] is None:
                return default
            return float(list(times)[index])

        return at(self.join_at, 0.0), at(self.leave_at, math.inf)

    def changes_membership(self) -> bool:
        """Whether a worker joins late or leaves."""
        return any(v is not None and v > 0 for v in list(self.join_at or [])) or any(
            v is not None for v in list(self.leave_at or []))

    def speed(self, index: int) -> float:
        """Worker ``index``'s speed."""
        if not self.speeds:
            return 1.0
        speeds: list[Any] = list(self.speeds)
        return float(speeds[index % len(speeds)])
