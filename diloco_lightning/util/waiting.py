"""Saying that a wait is still going on: what it waits for, on which hub, for how long.

A worker waiting for a master, or a master waiting for workers, must never be silent:
:class:`Patience` emits one line after ``first`` seconds, then at doubling intervals
(10 s, 20 s, 40 s, ... up to one every ``cap`` seconds), so a short wait says nothing and a
long one is never more than ``cap`` seconds without news.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

__all__ = ["Patience", "format_duration"]


def format_duration(seconds: float) -> str:
    """``42 s``, ``3 min 20 s``, ``1 h 05 min``."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s" if s % 60 else f"{s // 60} min"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


class Patience:
    """Reports a wait at growing intervals (see the module docstring).

    Args:
        what: what is awaited (``"global version 3"``).
        where: where (a hub URL).
        log: the logger the lines go to (at INFO), unless ``say`` is given.
        say: a callable taking the line (e.g. ``print``) instead of ``log``.
        first: seconds before the first line.
        cap: the longest interval between two lines.
        limit: when the wait gives up (seconds from the start), said in each line; None: never.
    """

    def __init__(
        self,
        what: str,
        where: str,
        *,
        log: logging.Logger | None = None,
        say: Callable[[str], object] | None = None,
        first: float = 10.0,
        cap: float = 600.0,
        limit: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not first > 0 or not cap >= first:
            raise ValueError(f"Patience: need 0 < first <= cap, got first={first!r}, cap={cap!r}")
        self.what, self.where = what, where
        self._say = say if say is not None else (log or logging.getLogger(__name__)).info
        self.first, self.cap, self.limit = float(first), float(cap), limit
        self._clock = clock
        self.started = clock()
        self._next = self.first
        self.lines = 0

    @property
    def elapsed(self) -> float:
        return self._clock() - self.started

    def tick(self, detail: str = "") -> bool:
        """Emit the line if one is due; True if it did. ``detail`` is appended (``"; hub has 2"``)."""
        elapsed = self.elapsed
        if elapsed < self._next:
            return False
        self._next += min(self._next, self.cap)  # the interval doubles up to `cap`
        gives_up = f" (gives up after {format_duration(self.limit)})" if self.limit is not None else ""
        self._say(f"still waiting for {self.what} on {self.where}: {format_duration(elapsed)} so far{detail}{gives_up}")
        self.lines += 1
        return True
