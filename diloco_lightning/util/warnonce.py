"""Warnings about names a hub writer chose, each logged once, in bounded memory.

A transport warns once about each file it ignores (``nodes/junk`` is not a node id, ``nodes/a/x``
is not a delta path, a claim is unreadable), and the master and the workers once about each part
of a heartbeat they ignore. Any hub writer chooses these names: a set of every name warned about
grew with them for good (80,000 junk names left a master 40 MiB larger). :class:`WarnOnce`
remembers at most ``cap`` names, the first ones; a warning about a further name is counted
instead, and one of them is logged at most every ``interval`` seconds with the count of those left
out since the last one, so the log still says that junk keeps coming, and how much.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

__all__ = ["WarnOnce", "DEFAULT_CAP"]

#: names remembered per warner (a few hundred KB at most): far more than an honest run has junk
DEFAULT_CAP = 4096


class WarnOnce:
    """``warn(key, msg, *args)``: ``logger.warning(msg, *args)`` the first time ``key`` is seen (see
    the module docstring for what happens past ``cap`` keys). Thread-safe."""

    def __init__(self, logger: logging.Logger, cap: int | None = None, interval: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        cap = DEFAULT_CAP if cap is None else cap  # read here: a test lowers it
        if cap < 1:
            raise ValueError(f"WarnOnce: cap must be at least 1, got {cap!r}")
        self.logger, self.cap, self.interval, self.clock = logger, int(cap), float(interval), clock
        self._keys: set[str] = set()
        self._lock = threading.Lock()
        self._left_out = 0  # warnings past the cap since the last one logged
        self._noted_at: float | None = None

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def warn(self, key: str, msg: str, *args: Any) -> bool:
        """Log the warning unless ``key`` was warned about (or, past the cap, one was logged within
        ``interval`` seconds); True when it was logged."""
        with self._lock:
            if key in self._keys:
                return False
            if len(self._keys) < self.cap:
                self._keys.add(key)
                left_out = None
            else:
                self._left_out += 1
                now = self.clock()
                if self._noted_at is not None and now - self._noted_at < self.interval:
                    return False
                self._noted_at, left_out, self._left_out = now, self._left_out - 1, 0
        if left_out is None:
            self.logger.warning(msg, *args)
        else:
            self.logger.warning(msg + " (%d more warning(s) about other names left out before this one; past %d names, "
                                "at most one is logged every %.0f s)", *args, left_out, self.cap, self.interval)
        return True
