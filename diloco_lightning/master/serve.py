"""The one loop that serves a master: rounds every ``poll_interval``, backoff after failures,
the lease's standby, waits said out loud, signals, the final round.

``diloco-master``, ``train.py role=master`` and ``MasterOuterLoop.start()`` (the background
thread of ``train.py``'s whole-run mode and of library users) all run :func:`serve`; they
differ only in where lines go (``say``), whether SIGINT/SIGTERM stop it (main thread only),
and whether it ends by stopping the master (a command does; the thread is stopped by
``MasterOuterLoop.stop()``).

With ``until_finished`` (``MasterConfig``) the loop also ends, status 0, once every worker it knows
has finished and its last delta is applied (:mod:`diloco_lightning.master.finish`), saying where
the final model is and the ``diloco-export`` command that writes it out.

A configuration error (:class:`~diloco_lightning.util.errors.ConfigError`: a ``MasterConfigError``
when the hub's run was made with another optimizer or model) is never retried: it ends the loop
and is raised to the caller. Any other failed round is reported and retried after
``poll_interval * 2**(failures - 1)`` seconds, at
most ``retry_max_delay``, jittered to 50-100 % (a fleet of masters never retries in step).
"""

from __future__ import annotations

import logging
import math
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from diloco_lightning.master.metrics import format_progress
from diloco_lightning.util.waiting import Patience

__all__ = ["ServeReport", "backoff_delay", "serve"]

log = logging.getLogger(__name__)


def backoff_delay(failures: int, base: float, cap: float) -> float:
    """The pause after ``failures`` failed rounds in a row: exponential from ``base``, at most
    ``max(cap, base)``, jittered to 50-100 %."""
    delay = min(base * 2 ** min(failures - 1, 16), max(cap, base))
    return delay * random.uniform(0.5, 1.0)


@dataclass
class ServeReport:
    """How :func:`serve` ended."""

    rounds: int = 0  #: rounds that applied deltas
    reached: bool = False  #: ``max_rounds`` or ``max_seconds`` was reached
    signals: list[int] = field(default_factory=list)  #: SIGINT / SIGTERM received
    drained: bool = True  #: the final round (if any) succeeded
    finished: bool = False  #: ``until_finished``: every worker finished and its last delta is applied

    @property
    def exit_code(self) -> int:
        """0 when done, 128 + signal when stopped before its work was done, 1 when draining failed."""
        if not self.drained:
            return 1
        if self.signals and not self.reached:
            return 128 + int(self.signals[0])  # a scheduler must not read a stopped master as a finished one
        return 0


def _where(master: Any) -> str:
    root = master.hub.local_root
    return str(root) if root is not None else master.hub.url


def serve(
    master: Any,
    *,
    stop: threading.Event | None = None,
    max_rounds: int | None = None,
    max_seconds: float | None = None,
    say: Callable[[str], Any] | None = None,
    on_round: Callable[[dict], Any] | None = None,
    handle_signals: bool = False,
    finish: bool = False,
    drain_on_exit: bool = True,
) -> ServeReport:
    """Serve ``master`` (a :class:`~diloco_lightning.master.MasterOuterLoop`) until ``stop`` is
    set, ``max_rounds`` / ``max_seconds`` are reached, or (``handle_signals``) SIGINT/SIGTERM.

    ``say`` receives the progress lines (default: this module's logger at INFO); ``on_round``
    each eventful round's metrics. ``finish``: end with ``master.stop()``, with a final round
    when a signal stopped it and ``drain_on_exit``.
    """
    if max_rounds is not None and (isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 0):
        raise ValueError(f"max_rounds must be an integer >= 0 or None, got {max_rounds!r}")
    if max_seconds is not None and (isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float))
                                    or not math.isfinite(max_seconds) or max_seconds <= 0):
        raise ValueError(f"max_seconds must be a number of seconds > 0 or None, got {max_seconds!r}")
    stop = stop if stop is not None else threading.Event()
    speak = say or (lambda line: log.info("%s", line))
    report = ServeReport()

    def on_signal(signum, _frame):
        report.signals.append(signum)
        stop.set()

    previous = _install_handlers(on_signal) if handle_signals else {}
    lines = _Lines(speak, _where(master))
    failures = 0
    deadline = time.monotonic() + float(max_seconds) if max_seconds is not None else None
    try:
        while not stop.is_set():
            failures, delay = _attempt(master, failures, speak if say is not None else None)
            m = master.last_metrics or {}
            lines.standby(bool(m.get("standby")), m)
            if _eventful(m):
                if say is not None:
                    speak(f"[master] {format_progress(m)}")
                if on_round is not None:
                    on_round(m)
                if m.get("accepted"):
                    report.rounds += 1 if m.get("aggregation") == "round" else int(m.get("published", 0))
                lines.waiting(None)
            elif not m.get("standby") and failures == 0:
                lines.waiting(_waiting_for(master, m), at_once=not master.has_state)
            if (max_rounds is not None and report.rounds >= int(max_rounds)) or \
                    (deadline is not None and time.monotonic() >= deadline):
                report.reached = True
                break
            if failures == 0 and _run_over(master, speak):
                report.reached = report.finished = True
                break
            stop.wait(delay)
    finally:
        if finish:
            _finish(master, report, speak, drain=bool(report.signals and drain_on_exit))
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return report


def _install_handlers(handler: Callable) -> dict[int, Any]:
    """SIGINT and SIGTERM to ``handler`` (from the main thread only: Python allows no other); the
    handlers they replace, to be put back."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
    return previous


def _attempt(master: Any, failures: int, speak: Callable[[str], Any] | None) -> tuple[int, float]:
    """One round; the failures in a row after it and the pause before the next one. A failure is
    logged with its traceback when nobody hears ``speak`` (the library's thread), else said in a line."""
    from diloco_lightning.util.errors import ConfigError

    delay = float(master.config.poll_interval)
    try:
        master.sync_once()
        return 0, delay
    except ConfigError:
        raise  # a configuration (this master's, or the hub's run it does not match) no retry can change
    except Exception as e:  # noqa: BLE001 - reported, retried with backoff
        failures += 1
        delay = backoff_delay(failures, delay, master.config.retry_max_delay)
        # a hub that asked for a pause (429 Retry-After, a spent commit budget) gets it
        delay = max(delay, float(getattr(e, "retry_after", None) or 0.0))
        if speak is None:
            log.error("master round failed (%d in a row); retrying in %.1fs", failures, delay, exc_info=True)
        else:
            log.debug("master round failed", exc_info=True)
            speak(f"[master] round failed ({type(e).__name__}: {e}); retrying in {delay:.1f}s ({failures} in a row)")
        return failures, delay


def _run_over(master: Any, speak: Callable[[str], Any]) -> bool:
    """``until_finished``: whether the run is over (every worker finished, its last delta applied);
    then the lines saying where the final model is and how to export it (master/finish.py)."""
    if not getattr(master.config, "until_finished", False) or not master.has_state:
        return False
    done = master.run_over()
    if done is None:
        return False
    from diloco_lightning.master.finish import final_model_lines

    for line in final_model_lines(done, master.outer_step, _where(master), master.hub.url):
        speak(f"[master] {line}")
    return True


def _eventful(m: dict) -> bool:
    """Whether a round's metrics are worth a line: it published, refused, adopted or conflicted."""
    return bool(m and (m.get("published") or m.get("rejected") or m.get("adopted") is not None or m.get("conflict")))


def _waiting_for(master: Any, m: dict) -> str:
    """What an uneventful round waited for, in words."""
    if not master.has_state:
        return "a worker's initial weights (nodes/<node_id>/init.safetensors) or a published version"
    if m.get("paced"):
        return f"the commit budget of the hub ({m.get('pending', 0)} delta(s) pending)"
    if m.get("waiting"):
        q = m.get("quorum") or master.config.min_deltas
        unit = "nodes" if isinstance(master.config.min_deltas, float) else "deltas"
        return f"the quorum of {q} {unit} ({m.get('pending', 0)} pending, {m.get('live_nodes', 0)} live)"
    return f"deltas from the workers (outer_step {master.outer_step} is published)"


class _Lines:
    """The lines said between events: standing by (once per spell), and what the master waits for
    (through :class:`Patience`: after a while, then less and less often)."""

    def __init__(self, speak: Callable[[str], Any], where: str) -> None:
        self.speak, self.where = speak, where
        self._standby_shown = False
        self._waiting: tuple[str, Patience] | None = None

    def standby(self, standing_by: bool, m: dict | None = None) -> None:
        """Standing by (once per spell; with ``warm_standby``, the outer step held loaded), and the round
        that ends a spell by taking the lease over."""
        m = m or {}
        if standing_by and not self._standby_shown:
            warm = m.get("warm")
            self.speak("[master] standing by: another master holds the lease"
                       + (f"; outer_step {warm} held warm" if warm is not None else ""))
        elif not standing_by and self._standby_shown and m.get("took_over") is not None:
            self.speak(f"[master] took over the lease (epoch {m['took_over']}) at outer_step {m.get('outer_step')}"
                       + (", state held warm" if m.get("adopted") is None else f", adopted outer_step {m['adopted']}"))
        self._standby_shown = standing_by

    def waiting(self, what: str | None, at_once: bool = False) -> None:
        """Waiting for ``what`` (None: an event ended the wait). ``at_once``: the start of a run,
        said now rather than only after 10 s."""
        if what is None:
            self._waiting = None
            return
        if self._waiting is None or self._waiting[0] != what:
            self._waiting = (what, Patience(what, self.where, say=lambda line: self.speak(f"[master] {line}")))
            if at_once:
                self.speak(f"[master] waiting for {what} on {self.where}")
        self._waiting[1].tick()


def _finish(master: Any, report: ServeReport, speak: Callable[[str], Any], drain: bool) -> None:
    """Stop ``master``, with a final round when ``drain`` (a signal stopped the loop)."""
    if drain:
        speak("[master] stopping: final round ...")
    try:
        master.stop(drain=drain)
    except Exception as e:  # noqa: BLE001
        report.drained = False
        speak(f"[master] the final round failed: {type(e).__name__}: {e}")
    m = master.last_metrics or {}
    if report.signals and m.get("published"):
        speak(f"[master] {format_progress(m)}")
