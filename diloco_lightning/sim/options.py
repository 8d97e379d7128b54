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

from diloco_lightning.sim.churn import PREEMPT_LAWS
from diloco_lightning.util.options import OptionError, check_choice, check_number, option

__all__ = ["DELAY_PER", "LATE", "PRECISIONS", "SPEED_LAWS", "SimOptions", "phase_end"]

#: the trainer precisions the simulator reproduces (``16-mixed`` needs a GradScaler: not simulated)
PRECISIONS = ("32-true", "bf16-true", "bf16-mixed")

#: ``worker``: a distribution ``delay`` is drawn once per worker (the product's draw); ``delta``:
#: a fresh draw for every delta
DELAY_PER = ("worker", "delta")
#: ``sim.speed_law``'s laws: ``lognormal`` (``exp(sigma * N(0, 1))``, median 1) and ``uniform``
#: (in ``[low, high]``)
SPEED_LAWS = ("lognormal", "uniform")
#: ``sim.late``: what synchronous rounds (``sim.barrier``) do with a delta from an older version
LATE = ("apply", "drop")
_LAW_KEYS = {"lognormal": {"law", "sigma", "seed"}, "uniform": {"law", "low", "high", "seed"}}


def _number(v: Any, low: float = 0.0, strict: bool = True) -> bool:
    return (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            and (v > low if strict else v >= low))


def _is_trace(v: Any, *, start: bool = False) -> bool:
    """Whether ``v`` is a list of ``[time, value]`` change points (times increasing, values > 0;
    ``start``: the first at time 0)."""
    try:
        points = [(t, x) for t, x in v]
    except (TypeError, ValueError):
        return False
    times = [t for t, _ in points]
    return (bool(points) and all(_number(t, strict=False) and _number(x) for t, x in points)
            and all(b > a for a, b in zip(times, times[1:])) and (not start or times[0] == 0))


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
        None, "workers whose phases run at the same time, one thread each (batched: groups of workers stacked, one "
        "thread per group); null: min(workers, CPU cores) on a CPU, 1 on a GPU; the results do not depend on it"
    )
    batched: bool | None = option(
        None, "take the workers' inner steps as one batched step over stacked parameters where they share a model "
        "shape (docs/simulator.md; equal to the unbatched steps to float tolerance): null = on a GPU where possible "
        "(on a CPU it measured no faster), true = wherever possible (an error says why not), false = never"
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

    bandwidth: Any = option(
        None, "each worker's link to the hub, bytes per unit of simulated time in each direction: a number for every "
        "worker, or one entry per worker (a number, null: unlimited, or a trace [[0, b0], [t1, b1], ...]); null: "
        "unlimited (docs/simulator.md, Communication)"
    )
    latency: Any = option(0.0, "units of simulated time every upload and download takes besides its bytes: a number, "
                               "or one per worker")
    master_time: float = option(0.0, "units of simulated time the master takes per outer step (a version is "
                                     "published that long after its round closes, one step after the other)")
    listing_delay: float = option(0.0, "a delta reaches the master this long after its upload ends (the hub's "
                                       "listing lag and the master's polling)")
    preempt: Any = option(
        None, "workers that go down and come back: per worker null or a list of [down, up] times (up null: gone), or a "
        "law {rate: r per unit of up time, down: d, law: fixed | exponential, seed: s}; a phase a preemption "
        "interrupts is lost"
    )
    sync_inner_state: bool = option(
        False, "synchronous rounds (diloco.sync=lockstep, delay 0, aggregation=round, no fragments): at every sync "
        "each worker's inner optimizer state (AdamW's exp_avg / exp_avg_sq, Muon's momentum) becomes the workers' "
        "average, as the weights do (a simulator lever: the product's workers do not do it; it would send the "
        "optimizer state, 2 model-sized tensors for AdamW, beside each delta, and receive their average)"
    )
    sync_warmup: int = option(
        0, "each worker's first this many inner steps are phases of one step (every step synced, as data-parallel "
        "with the workers' AdamW steps averaged), then phases of H: a synchronous warm-up before the first DiLoCo "
        "phase (a simulator lever: the product's workers do not do it; a multiple of H; no fragments; 0: off)"
    )
    lookahead_trend: int = option(
        0, "each phase starts where the global is predicted to be when its delta lands: its base plus the master's "
        "mean movement per delta over its last this many versions, times the deltas a delta lacks on average (its "
        "mean staleness), less the worker's own ones the rebase subtracts (sim/trend.py; DANA's look-ahead; a "
        "simulator lever: the product's workers do not do it; 0: off)"
    )
    lookahead_momentum: bool = option(
        False, "each phase starts where the outer step's own momentum will carry the global before its delta lands: "
        "its base plus what the momentum adds over the versions a delta lacks on average (DANA's look-ahead; "
        "sim/trend.py; needs an outer step with momentum; a simulator lever)"
    )
    barrier: bool = option(False, "synchronous rounds with a quorum (diloco.sync=async, aggregation=round): after its "
                                  "delta a worker waits for a version newer than its phase's; rounds close with "
                                  "sim.quorum deltas (or at sim.deadline)")
    late: str = option("apply", "barrier: a delta from an older version is applied in the round it reaches (apply), or "
                                "its phase is given up when a newer version is published (drop)")
    deadline: float | None = option(None, "aggregation=round: a round also closes this long after the previous "
                                          "version was published, with the deltas it has (at least one)")
    rebase: bool = option(
        False, "each worker starts a phase from its base version minus its own deltas that version does not contain "
        "yet, each times the scale the master's step gave it, and anchors the phase there (sim/rebase.py; needs a "
        "momentum-free SGD outer step and no fragments; the product's async worker: diloco.rebase)"
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
        if self.batched is not None and not isinstance(self.batched, bool):
            raise OptionError("batched", f"must be true, false or null, got {self.batched!r}")
        if not isinstance(self.rebase, bool):
            raise OptionError("rebase", f"must be true or false, got {self.rebase!r}")
        if not isinstance(self.sync_inner_state, bool):
            raise OptionError("sync_inner_state", f"must be true or false, got {self.sync_inner_state!r}")
        if not isinstance(self.save_weights, bool):
            raise OptionError("save_weights", f"must be True or False, got {self.save_weights!r}")
        check_number(self, "sync_warmup", low=0, integer=True)
        check_number(self, "lookahead_trend", low=0, integer=True)
        if not isinstance(self.lookahead_momentum, bool):
            raise OptionError("lookahead_momentum", f"must be true or false, got {self.lookahead_momentum!r}")
        if self.lookahead_momentum and self.lookahead_trend:
            raise OptionError("lookahead_momentum", "is another prediction than lookahead_trend: choose one")
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
        self._validate_comm(workers)
        self._validate_churn(workers)
        return self

    def _validate_comm(self, workers: int | None) -> None:
        for name in ("bandwidth", "latency"):
            value = getattr(self, name)
            single = not isinstance(value, (list, tuple)) or (name == "bandwidth" and _is_trace(value, start=True))
            entries = None if single else list(value)
            if entries is not None and workers is not None and len(entries) != workers:
                raise OptionError(name, f"must give one entry per worker ({workers}) or one number for all, got "
                                        f"{len(entries)}")
            for i, v in enumerate(entries if entries is not None else [value]):
                where = f"worker {i}: " if entries is not None else ""
                if name == "latency":
                    if not _number(v, strict=False):
                        raise OptionError(name, f"{where}must be a number >= 0, got {v!r}")
                elif v is not None and not _number(v) and not _is_trace(v, start=True):
                    raise OptionError(name, f"{where}must be a number > 0, null (unlimited) or a trace "
                                            f"[[0, b0], [t1, b1], ...] (times increasing from 0, bandwidths > 0), "
                                            f"got {v!r}")
        for name in ("master_time", "listing_delay"):
            check_number(self, name, low=0.0)
        check_number(self, "deadline", low=0.0, strict=True, optional=True)
        check_choice(self, "late", LATE)
        if not isinstance(self.barrier, bool):
            raise OptionError("barrier", f"must be true or false, got {self.barrier!r}")

    def _validate_churn(self, workers: int | None) -> None:
        p = self.preempt
        if p is None:
            return
        if isinstance(p, Mapping):
            law = dict(p)
            extra = sorted(set(law) - {"rate", "down", "law", "seed"})
            if extra or not _number(law.get("rate"), strict=False) or not _number(law.get("down")):
                raise OptionError("preempt", f"a law is {{rate: r >= 0, down: d > 0, law: fixed | exponential, "
                                             f"seed: s}}, got {p!r}")
            if law.get("law", "fixed") not in PREEMPT_LAWS or isinstance(law.get("seed", 0), bool) or \
                    not isinstance(law.get("seed", 0), int):
                raise OptionError("preempt", f"law must be one of {list(PREEMPT_LAWS)} and seed an integer, got {p!r}")
            return
        entries = list(p) if isinstance(p, (list, tuple)) else None
        if entries is None or (workers is not None and len(entries) != workers):
            raise OptionError("preempt", f"must be a law {{rate, down, seed}} or one entry per worker "
                                         f"({workers}), got {p!r}")
        for i, trace in enumerate(entries):
            if trace is None:
                continue
            try:
                spans = [(d, u) for d, u in trace]
            except (TypeError, ValueError):
                raise OptionError("preempt", f"worker {i}: must be a list of [down, up] pairs, got {trace!r}") from None
            if not all(_number(d, strict=False) and (u is None or (_number(u) and u > d)) for d, u in spans):
                raise OptionError("preempt", f"worker {i}: each pair is [down, up] with 0 <= down < up (up null: "
                                             f"gone for good), got {trace!r}")

    def latency_of(self, index: int) -> float:
        """Worker ``index``'s latency per transfer."""
        v = self.latency
        return float(list(v)[index] if isinstance(v, (list, tuple)) else v)

    def bandwidth_of(self, index: int) -> float | list[list[float]] | None:
        """Worker ``index``'s bandwidth: a number, a trace, or None (unlimited)."""
        v = self.bandwidth
        if isinstance(v, (list, tuple)) and not _is_trace(v, start=True):
            v = list(v)[index]
        if v is None:
            return None
        if isinstance(v, (list, tuple)):
            return [[float(t), float(b)] for t, b in v]
        return float(v)

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
