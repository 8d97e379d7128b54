"""The one loop that serves a master: rounds every ``poll_interval``, backoff after failures,
the lease's standby, waits said out loud, signals, the final round.

``diloco-master``, ``train.py role=master`` and ``MasterOuterLoop.start()`` (the background
thread of ``train.py``'s whole-run mode and of library users) all run :func:`serve`; they
differ only in where lines go (``say``), whether SIGINT/SIGTERM stop it (main thread only),
and whether it ends by stopping the master (a command does; the thread is stopped by
``MasterOuterLoop.stop()``).

A failed round is reported and retried after ``poll_interval * 2**(failures - 1)`` seconds, at
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

    previous: dict[int, Any] = {}
    if handle_signals and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    where = _where(master)
    waiting: tuple[str, Patience] | None = None
    failures = 0
    deadline = time.monotonic() + float(max_seconds) if max_seconds is not None else None
    standby_shown = False
    try:
        while not stop.is_set():
            delay = float(master.config.poll_interval)
            try:
                master.sync_once()
                failures = 0
            except Exception as e:  # noqa: BLE001 - reported, retried with backoff
                failures += 1
                delay = backoff_delay(failures, delay, master.config.retry_max_delay)
                # a hub that asked for a pause (429 Retry-After, a spent commit budget) gets it
                delay = max(delay, float(getattr(e, "retry_after", None) or 0.0))
                if say is None:  # the library's thread: the log is the only place it shows, traceback included
                    log.error("master round failed (%d in a row); retrying in %.1fs", failures, delay, exc_info=True)
                else:
                    log.debug("master round failed", exc_info=True)
                    speak(f"[master] round failed ({type(e).__name__}: {e}); retrying in {delay:.1f}s ({failures} in a row)")
            m = master.last_metrics or {}
            if m.get("standby"):
                if not standby_shown:
                    speak("[master] standing by: another master holds the lease")
                    standby_shown = True
            else:
                standby_shown = False
            eventful = m and (m.get("published") or m.get("rejected") or m.get("adopted") is not None or m.get("conflict"))
            if eventful:
                if say is not None:
                    speak(f"[master] {format_progress(m)}")
                if on_round is not None:
                    on_round(m)
                if m.get("accepted"):
                    report.rounds += 1 if m.get("aggregation") == "round" else int(m.get("published", 0))
                waiting = None
            elif not m.get("standby") and failures == 0:
                if not master.has_state:
                    what = "a worker's initial weights (nodes/<node_id>/init.safetensors) or a published version"
                elif m.get("paced"):
                    what = f"the commit budget of the hub ({m.get('pending', 0)} delta(s) pending)"
                elif m.get("waiting"):
                    q = m.get("quorum") or master.config.min_deltas
                    unit = "nodes" if isinstance(master.config.min_deltas, float) else "deltas"
                    what = f"the quorum of {q} {unit} ({m.get('pending', 0)} pending, {m.get('live_nodes', 0)} live)"
                else:
                    what = f"deltas from the workers (outer_step {master.outer_step} is published)"
                if waiting is None or waiting[0] != what:
                    waiting = (what, Patience(what, where, say=lambda line: speak(f"[master] {line}")))
                    if not master.has_state:  # the start of a run: say it at once, not only after 10 s
                        speak(f"[master] waiting for {what} on {where}")
                waiting[1].tick()
            if max_rounds is not None and report.rounds >= int(max_rounds):
                report.reached = True
                break
            if deadline is not None and time.monotonic() >= deadline:
                report.reached = True
                break
            stop.wait(delay)
    finally:
        if finish:
            if report.signals and drain_on_exit:
                speak("[master] stopping: final round ...")
            try:
                master.stop(drain=bool(report.signals and drain_on_exit))
            except Exception as e:  # noqa: BLE001
                report.drained = False
                speak(f"[master] the final round failed: {type(e).__name__}: {e}")
            m = master.last_metrics or {}
            if report.signals and m.get("published"):
                speak(f"[master] {format_progress(m)}")
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return report
