"""The simulator's options: one definition (:class:`SimOptions`), one validation.

``train.py launch=sim`` composes these fields into its ``sim`` section
(``diloco_lightning.app.config``) with the help text written here; the engine
(:class:`~diloco_lightning.sim.engine.Simulator`) takes them as one object. What the simulated
run *is* (the model, the data, the inner optimizer, ``inner_steps``, ``sync``, ``delay``,
``delta_dtype``, the outer optimizer, ``aggregation``) comes from the same options as a real run.

**Simulated time.** One unit is the time a speed-1 worker takes for one inner step: a phase of
``H`` steps of worker ``k`` lasts the time its speed takes to integrate to ``H`` (``H / speed``
at a constant speed). A worker's speed is ``speeds[k]`` (1 if not given), times a draw of
``speed_law`` (once per worker, seeded), changed over time by its ``traces[k]``, and each phase's
duration is multiplied by ``speed_jitter``'s draw. ``max_time`` is a budget in these units, as
``trainer.max_time`` is in a real run: every worker keeps starting phases while the phase would
end by ``max_time`` (a phase that would end later is not run), so fast workers do more steps
than slow ones; ``trainer.max_steps`` stays a cap on each worker's steps.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from diloco_lightning.util.options import OptionError, check_choice, check_number, option

__all__ = ["DELAY_PER", "SPEED_LAWS", "SimOptions", "phase_end"]

#: ``worker``: a distribution ``delay`` is drawn once per worker (the product's draw); ``delta``:
#: a fresh draw for every delta
DELAY_PER = ("worker", "delta")
#: ``sim.speed_law``'s laws: ``lognormal`` (``exp(sigma * N(0, 1))``, median 1) and ``uniform``
#: (in ``[low, high]``)
SPEED_LAWS = ("lognormal", "uniform")
_LAW_KEYS = {"lognormal": {"law", "sigma", "seed"}, "uniform": {"law", "low", "high", "seed"}}


def _number(v: Any, low: float = 0.0, strict: bool = True) -> bool:
    return (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            and (v > low if strict else v >= low))


def phase_end(start: float, work: float, speed: float, trace: Any = None) -> float:
    """When a phase of ``work`` inner steps that starts at ``start`` ends: the time at which
    ``speed(t)`` integrated from ``start`` reaches ``work``. ``speed(t)`` is ``speed`` until the
    first change point of ``trace`` (a list of ``[time, speed]``, times increasing), then the
    speed of the latest change point at or before ``t``."""
    points = [(float(t), float(v)) for t, v in (trace or [])]
    t, v, left = float(start), float(speed), float(work)
    for at, new in points:
        if at <= t:
            v = new
            continue
        if v * (at - t) >= left:
            break
        left -= v * (at - t)
        t, v = at, new
    return t + left / v


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

    max_time: float | None = option(
        None, "a budget of simulated time (units: one inner step of a speed-1 worker): every worker starts phases "
        "while they end by max_time (a phase that would end later is not run; trainer.max_steps stays a cap); "
        "evaluations spread evenly over it (null: trainer.max_steps alone)"
    )
    speed_law: dict[str, Any] | None = option(
        None, "per-worker speeds drawn once from a seeded law, times speeds: {law: lognormal, sigma: 0.5, seed: 0} "
        "(exp(sigma N(0,1))) or {law: uniform, low: 0.25, high: 1, seed: 0} (null: no draw)"
    )
    stop_above: float | None = option(
        None, "stop the run at an evaluation after version 0 whose eval loss is above this or not finite (a "
        "diverged run: a sweep stops paying for it; results.json's sim.stopped_early says so; null: never)"
    )
    traces: list[Any] | None = option(
        None, "per worker, null or a list of [time, speed] change points (times increasing): the worker's speed "
        "from each time on (before the first: its speed); a phase lasts until the speed integrates to H"
    )

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def validate(self, workers: int | None = None) -> SimOptions:
        """Raise :class:`~diloco_lightning.util.options.OptionError` naming the first option out of range."""
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
        check_number(self, "max_time", low=0.0, strict=True, optional=True)
        check_number(self, "stop_above", low=0.0, strict=True, optional=True)
        if self.speed_law is not None:
            law = dict(self.speed_law) if isinstance(self.speed_law, Mapping) else None
            kind = (law or {}).get("law")
            if law is None or kind not in SPEED_LAWS:
                raise OptionError("speed_law", f"must be a mapping with law: one of {list(SPEED_LAWS)}, got {self.speed_law!r}")
            extra = sorted(set(law) - _LAW_KEYS[kind])
            if extra:
                raise OptionError("speed_law", f"law {kind} takes {sorted(_LAW_KEYS[kind])}, not {extra}")
            seed = law.get("seed", 0)
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise OptionError("speed_law", f"seed must be an integer, got {seed!r}")
            if kind == "lognormal" and not _number(law.get("sigma"), strict=False):
                raise OptionError("speed_law", f"lognormal needs sigma >= 0, got {law.get('sigma')!r}")
            if kind == "uniform" and not (_number(law.get("low")) and _number(law.get("high"))
                                          and law["low"] <= law["high"]):
                raise OptionError("speed_law", f"uniform needs 0 < low <= high, got low={law.get('low')!r} "
                                  f"high={law.get('high')!r}")
        if self.traces is not None:
            traces = list(self.traces)
            if workers is not None and len(traces) != workers:
                raise OptionError("traces", f"must give one trace (or null) per worker ({workers}), got {len(traces)}")
            for i, trace in enumerate(traces):
                if trace is None:
                    continue
                try:
                    points = [(t, v) for t, v in trace]
                except (TypeError, ValueError):
                    raise OptionError("traces", f"worker {i}: must be a list of [time, speed] pairs, got {trace!r}") from None
                times = [t for t, _ in points]
                if not all(_number(t, strict=False) and _number(v) for t, v in points) or any(
                        b <= a for a, b in zip(times, times[1:])):
                    raise OptionError("traces", f"worker {i}: times >= 0 increasing, speeds > 0; got {trace!r}")
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
        """Worker ``index``'s speed (before its trace): ``speeds[index]`` times ``speed_law``'s draw."""
        base = 1.0
        if self.speeds:
            speeds: list[Any] = list(self.speeds)
            base = float(speeds[index % len(speeds)])
        law = dict(self.speed_law) if self.speed_law is not None else None
        if law is None:
            return base
        rng = random.Random(f"{law.get('seed', 0)}:speed_law:{index}")
        if law["law"] == "lognormal":
            return base * math.exp(float(law["sigma"]) * rng.gauss(0.0, 1.0))
        return base * rng.uniform(float(law["low"]), float(law["high"]))

    def trace(self, index: int) -> list[list[float]] | None:
        """Worker ``index``'s speed changes (None: none)."""
        if not self.traces or index >= len(list(self.traces)) or list(self.traces)[index] is None:
            return None
        return [[float(t), float(v)] for t, v in list(self.traces)[index]]
