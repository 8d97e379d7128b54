"""How long a worker's inner phases are: a fixed H, or Dynamic Local Updates; its measured speed; the throttle.

**Dynamic Local Updates (DyLU).** Liu et al. 2024 ("Asynchronous Local-SGD Training for Language
Modeling", arXiv 2401.09135, section 4) give each worker a number of inner steps proportional
to its speed, so that slow and fast workers finish an inner phase in about the same wall time
and their deltas arrive at a similar cadence (a slow worker's delta is then no staler than a
fast one's). With ``inner_steps="auto"`` each worker applies, at every boundary, the rule of
:func:`dylu_inner_steps`::

    H_i = clamp(round(H_max * v_i / max_j v_j), H_min, H_max)

``v_i`` is this worker's measured step rate (inner optimizer steps per second of its own
compute: waits for the master and the boundaries themselves are left out, see
:class:`StepClock`), ``max_j v_j`` the fastest rate among this worker and the live peers'
heartbeats (``nodes/<node>/claim.json``, :class:`~diloco_lightning.wire.claims.NodeReport`),
``H_max`` is ``dylu_steps`` (the fastest worker's H) and ``H_min`` ``dylu_min_steps`` (default
``H_max / 16``, at least 1). The variant with a time target (``dylu_seconds = T``) needs no
peers: ``H_i = clamp(floor(v_i * T), H_min, H_max)``. Our variant rounds to the nearest step
(the paper's floor would give the fastest worker's near-equals ``H_max - 1`` for measurement
noise) and bounds H below, so a peer that reports an absurd speed can shorten this worker's
phases to ``H_min`` and no further. Until the worker has measured itself (its first phase),
H is ``H_max``.

The rule is decided at boundaries only, on the worker's rank 0, and handed to every rank with
the boundary's result, so the ranks of a DDP worker always agree on where the next boundary is.
Deltas then carry different amounts of work: ``weighting="tokens"`` on the master weights each
one by its ``num_tokens``.

**Throttle** (``throttle``, a test knob): seconds slept after each inner step, to make one
worker of a real multi-process run slower than the others (stragglers, DyLU, the adaptive
deadline) on a machine whose workers are otherwise equal.

:func:`dylu_inner_steps` and :class:`StepClock` are pure (the clock is injectable): the
simulator calls them as they are.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from diloco_lightning.wire.claims import NodeReport

__all__ = ["AUTO", "Pacing", "StepClock", "dylu_inner_steps", "default_dylu_min_steps", "resolve_throttle"]

#: the value of ``inner_steps`` that turns Dynamic Local Updates on
AUTO = "auto"
#: the step intervals a worker's speed is measured over (the latest ones)
RATE_WINDOW = 64


def default_dylu_min_steps(max_steps: int) -> int:
    """``H_min`` when ``dylu_min_steps`` is not given: ``H_max / 16``, at least 1."""
    return max(1, int(max_steps) // 16)


def dylu_inner_steps(
    own_rate: float | None,
    peer_rates: Iterable[float | None] = (),
    *,
    max_steps: int,
    min_steps: int | None = None,
    seconds: float | None = None,
) -> int:
    """H for this worker's next inner phase (see the module docstring for the rule).

    Args:
        own_rate: this worker's inner steps per second (None or not positive: not measured yet,
            which gives ``max_steps``).
        peer_rates: the live peers' reported step rates; None, non-finite or non-positive ones
            are ignored.
        max_steps: ``H_max``, the fastest worker's H.
        min_steps: ``H_min`` (None: :func:`default_dylu_min_steps`).
        seconds: a target wall time per inner phase instead of the fastest peer.
    """
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be an integer >= 1, got {max_steps!r}")
    low = default_dylu_min_steps(max_steps) if min_steps is None else min(int(min_steps), max_steps)
    if low < 1:
        raise ValueError(f"min_steps must be >= 1, got {min_steps!r}")
    if own_rate is None or not math.isfinite(own_rate) or own_rate <= 0:
        return max_steps
    if seconds is not None:
        h = math.floor(own_rate * seconds)
    else:
        fastest = max([own_rate] + [r for r in peer_rates if r is not None and math.isfinite(r) and r > 0])
        h = round(max_steps * own_rate / fastest)
    return max(low, min(max_steps, int(h)))


class StepClock:
    """A worker's compute speed: the intervals between consecutive inner steps, the latest
    :data:`RATE_WINDOW` of them, except an interval that holds a boundary (:meth:`restart`: the
    export, an install, a lockstep wait are not the worker's speed). The throttle's sleep is part
    of a step (it stands for a slower machine)."""

    def __init__(self, window: int = RATE_WINDOW, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._intervals: deque[float] = deque(maxlen=max(1, int(window)))
        self._last: float | None = None
        self.phase_seconds = 0.0  #: compute seconds of the phase in progress
        self.phase_steps = 0

    def step(self, now: float | None = None) -> None:
        """An inner optimizer step ended."""
        now = self.clock() if now is None else now
        if self._last is not None and now >= self._last:
            dt = now - self._last
            self._intervals.append(dt)
            self.phase_seconds += dt
        self._last = now
        self.phase_steps += 1

    def restart(self, now: float | None = None) -> None:
        """A boundary ended: the next interval starts now, and a new phase begins."""
        self._last = self.clock() if now is None else now
        self.phase_seconds = 0.0
        self.phase_steps = 0

    def rate(self) -> float | None:
        """Inner steps per second over the window (None before two steps)."""
        total = sum(self._intervals)
        if not self._intervals or total <= 0:
            return None
        return len(self._intervals) / total


def resolve_throttle(throttle: Any, node_index: int | None = None, argname: str = "throttle") -> float:
    """This worker's throttle: a number of seconds >= 0, or a per-worker list (``throttle[index % len]``)."""
    value = throttle
    if isinstance(throttle, Sequence) and not isinstance(throttle, (str, bytes)):
        if not throttle:
            raise ValueError(f"{argname} must be a number or a non-empty list of numbers, got {throttle!r}")
        for i, v in enumerate(throttle):
            resolve_throttle(v, None, f"{argname}[{i}]")
        value = throttle[(node_index or 0) % len(throttle)]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{argname} must be a number of seconds >= 0 (or a per-worker list), got {throttle!r}")
    return float(value)


class Pacing:
    """The length of a worker's inner phases and its measured speed (see the module docstring).

    Every rank of a worker holds one: :meth:`after_step` (sleep the throttle, time the step) after
    each inner optimizer step, :meth:`due` to decide a boundary. On rank 0 the worker
    (:class:`~diloco_lightning.worker.DiLoCoWorker`) calls :meth:`end_phase` at each boundary,
    which decides the next phase's H; the adapters give it to the other ranks with the
    boundary's result (:attr:`inner_steps` is plain state).

    Args:
        inner_steps: H (an int >= 1), ``"auto"`` (Dynamic Local Updates) or None (the caller
            decides boundaries; the worker only measures).
        dylu_steps, dylu_min_steps, dylu_seconds: the DyLU rule's ``H_max``, ``H_min`` and time
            target (:func:`dylu_inner_steps`).
        throttle: seconds slept after each inner step.
        clock: for the step intervals (tests, the simulator).
        sleep: how the throttle sleeps (the simulator advances its own clock instead).
        fragments: F (Streaming DiLoCo, ``diloco_lightning/wire/fragments.py``): a boundary every
            ``H / F`` steps, each syncing one fragment (a fixed H, a multiple of F).
    """

    def __init__(
        self,
        inner_steps: int | str | None = None,
        *,
        dylu_steps: int = 100,
        dylu_min_steps: int | None = None,
        dylu_seconds: float | None = None,
        throttle: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], Any] = time.sleep,
        fragments: int = 1,
    ) -> None:
        self.auto = inner_steps == AUTO
        if not (inner_steps is None or self.auto or (isinstance(inner_steps, int) and not isinstance(inner_steps, bool)
                                                     and inner_steps >= 1)):
            raise ValueError(f"inner_steps must be an integer >= 1 or 'auto', got {inner_steps!r}")
        if isinstance(dylu_steps, bool) or not isinstance(dylu_steps, int) or dylu_steps < 1:
            raise ValueError(f"dylu_steps must be an integer >= 1, got {dylu_steps!r}")
        if dylu_min_steps is not None and (isinstance(dylu_min_steps, bool) or not isinstance(dylu_min_steps, int)
                                           or not 1 <= dylu_min_steps <= dylu_steps):
            raise ValueError(f"dylu_min_steps must be an integer in [1, dylu_steps={dylu_steps}], got {dylu_min_steps!r}")
        if dylu_seconds is not None and (isinstance(dylu_seconds, bool) or not isinstance(dylu_seconds, (int, float))
                                         or not math.isfinite(dylu_seconds) or dylu_seconds <= 0):
            raise ValueError(f"dylu_seconds must be a number of seconds > 0 or None, got {dylu_seconds!r}")
        self.throttle = resolve_throttle(throttle)
        self.fixed: int | None = None if (inner_steps is None or self.auto) else int(inner_steps)  # type: ignore[arg-type]
        self.dylu_steps = dylu_steps
        self.dylu_min_steps = dylu_min_steps
        self.dylu_seconds = None if dylu_seconds is None else float(dylu_seconds)
        #: H of the phase in progress (None: the caller decides boundaries)
        self.inner_steps: int | None = dylu_steps if self.auto else self.fixed
        self.clock = StepClock(clock=clock)
        self._sleep = sleep
        if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
            raise ValueError(f"fragments must be an integer >= 1, got {fragments!r}")
        if fragments > 1 and (self.auto or (self.fixed is not None and self.fixed % fragments)):
            raise ValueError(f"with fragments={fragments}, inner_steps must be a fixed multiple of {fragments}, "
                             f"got {inner_steps!r}")
        #: F: a boundary every H / F steps (one fragment each)
        self.fragments = fragments
        self.tokens_per_second: float | None = None

    # ------------------------------------------------------------------ every rank

    def after_step(self) -> None:
        """An inner optimizer step ended: sleep the throttle, then time it."""
        if self.throttle > 0:
            self._sleep(self.throttle)
        self.clock.step()

    def due(self, step: int, last: int) -> bool:
        """Whether optimizer step ``step`` ends a phase that began after step ``last`` (the last
        boundary). A fixed H keeps the boundaries on multiples of H (``step // H > last // H``:
        gradient accumulation and a resume never fire one twice); DyLU counts from ``last``."""
        h = self.inner_steps
        if h is None:
            return False
        if self.fragments > 1:
            h = max(1, h // self.fragments)
        if self.auto:
            return step - last >= h
        return step // h > last // h

    # ------------------------------------------------------------------ rank 0, at a boundary

    def end_phase(self, num_tokens: int | None, peer_rates: Iterable[float | None] = ()) -> int | None:
        """A boundary: note the phase's tokens per second and decide the next phase's H (DyLU).
        Returns the H now in effect. :meth:`resume` once the boundary is over."""
        seconds = self.clock.phase_seconds
        if num_tokens is not None and seconds > 0:
            self.tokens_per_second = num_tokens / seconds
        if self.auto:
            self.inner_steps = dylu_inner_steps(
                self.clock.rate(), peer_rates, max_steps=self.dylu_steps, min_steps=self.dylu_min_steps,
                seconds=self.dylu_seconds,
            )
        return self.inner_steps

    def resume(self) -> None:
        """The boundary is over: the next phase's compute starts now (its waits were not compute)."""
        self.clock.restart()

    def report(self, local_step: int | None = None) -> NodeReport:
        """What the next heartbeat says about this worker."""
        return NodeReport(step_rate=self.clock.rate(), tokens_per_second=self.tokens_per_second,
                          local_step=local_step, inner_steps=self.inner_steps)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {"inner_steps": self.inner_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume a DyLU worker with the H it had (a fixed H stays the configured one)."""
        h = state.get("inner_steps") if isinstance(state, Mapping) else None
        if self.auto and isinstance(h, int) and not isinstance(h, bool) and h >= 1:
            self.inner_steps = max(1, min(self.dylu_steps, h))
