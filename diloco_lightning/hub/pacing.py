"""When a remote hub may be written to: a commit budget per repository, and the server's ``Retry-After``.

The Hugging Face Hub limits how often one repository may be committed to (a free account:
"the rate limit for repository commits (128 per hour)", in its 429 answer). Every worker
upload and every master publication is a commit, so a run that commits faster than that
meets 429s, and a writer retrying into them only makes it worse. A :class:`CommitBudget`
counts this process's commits to one repository and says how long to wait before the next
one stays within the budget:

* at most ``per_hour`` commits in any sliding hour (a log of the last hour's commit times:
  exact, so the budget is never exceeded however the commits bunch up);
* spread out: a token bucket of ``burst`` tokens refilled at ``per_hour / 3600`` per second,
  so a writer that could commit every few seconds commits every ``3600 / per_hour`` seconds
  (28 s at 128 an hour) after its first ``burst``, instead of spending the hour's budget in
  minutes and then waiting the rest of the hour;
* and never before a pause the server asked for (:meth:`CommitBudget.block`: a 429's
  ``Retry-After``) has passed.

A writer that asks :meth:`CommitBudget.wait` and finds it positive holds its work back: the
worker merges the delta into the next one (``worker/uploader.py``'s rule for a delta that
could not be sent: nothing is lost, the sum of two pseudo-gradients is the cumulative one),
the master keeps gathering its round. Only successful commits are counted (a refused
compare-and-swap is retried at once: delaying it would let the head move again).

:func:`retry_after` reads how long a server asked a client to wait: ``Retry-After`` in
seconds or as an HTTP date (RFC 9110, 10.2.3), or the Hub's ``RateLimit: "api";r=0;t=<s>``.
"""

from __future__ import annotations

import email.utils
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = ["CommitBudget", "retry_after", "DEFAULT_COMMITS_PER_HOUR"]

#: the Hugging Face Hub's limit for a free account, per repository
DEFAULT_COMMITS_PER_HOUR = 128.0
_RATELIMIT_RE = re.compile(r"r\s*=\s*(\d+)\s*;\s*t\s*=\s*(\d+)")
_SECONDS_RE = re.compile(r"\d{1,9}(\.\d{1,6})?")
#: a Retry-After further away than this is not believed (a broken clock or header): a day
_MAX_RETRY_AFTER = 86400.0


def retry_after(headers: Any, *, now: Callable[[], float] = time.time) -> float | None:
    """Seconds the server asked the client to wait (None if it did not say): ``Retry-After`` as a
    number of seconds or an HTTP date (relative to ``now``, never negative), else the Hub's
    ``RateLimit`` header when it says no requests are left (``r=0``). Values beyond a day are
    capped there."""
    try:
        value = headers.get("Retry-After")
        ratelimit = headers.get("RateLimit")
    except Exception:  # noqa: BLE001 - headers of any shape: no advice
        return None
    text = str(value).strip() if value is not None else ""
    if text:
        if _SECONDS_RE.fullmatch(text):
            return min(float(text), _MAX_RETRY_AFTER)
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            when = None
        if when is not None and when.tzinfo is not None:
            return min(max(0.0, when.timestamp() - now()), _MAX_RETRY_AFTER)
    m = _RATELIMIT_RE.search(str(ratelimit or ""))
    if m and m.group(1) == "0":
        return min(float(m.group(2)), _MAX_RETRY_AFTER)
    return None


class CommitBudget:
    """This process's commits to one repository: see the module docstring.

    Args:
        per_hour: commits allowed in any hour (None or 0: no budget; only :meth:`block` pauses).
        burst: commits that may follow each other without spacing (default ``min(8, per_hour)``).
        window: the budget's period in seconds (3600; tests shorten it).
        clock: monotonic seconds (tests).
    """

    def __init__(
        self,
        per_hour: float | None = DEFAULT_COMMITS_PER_HOUR,
        burst: int | None = None,
        *,
        window: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if per_hour is not None and (isinstance(per_hour, bool) or not per_hour >= 0):
            raise ValueError(f"commits_per_hour must be a number >= 0 or None, got {per_hour!r}")
        if not window > 0:
            raise ValueError(f"window must be > 0 seconds, got {window!r}")
        self.per_hour = float(per_hour) if per_hour else None
        limit = int(self.per_hour) if self.per_hour else 0
        if burst is not None and (isinstance(burst, bool) or not isinstance(burst, int) or burst < 1):
            raise ValueError(f"commit_burst must be an integer >= 1, got {burst!r}")
        self.burst = max(1, min(8, limit)) if burst is None else burst
        if self.per_hour is not None and self.per_hour < 1:
            raise ValueError(f"commits_per_hour must be at least 1 (or 0/None: no budget), got {per_hour!r}")
        self.window = float(window)
        self.clock = clock
        self._lock = threading.Lock()
        self._log: deque[float] = deque()  # times of the commits of the last window
        now = clock()
        self._tokens = float(self.burst)
        self._refilled = now
        self._blocked_until = now
        #: commits counted, and seconds the server asked to pause (for metrics and logs)
        self.commits = 0
        self.blocks = 0

    @property
    def limited(self) -> bool:
        return self.per_hour is not None

    def _refill(self, now: float) -> None:
        if self.per_hour is not None:
            rate = self.per_hour / self.window
            self._tokens = min(float(self.burst), self._tokens + (now - self._refilled) * rate)
        self._refilled = now
        while self._log and self._log[0] <= now - self.window:
            self._log.popleft()

    def wait(self) -> float:
        """Seconds until a commit stays within the budget (0.0: now)."""
        with self._lock:
            now = self.clock()
            self._refill(now)
            wait = max(0.0, self._blocked_until - now)
            if self.per_hour is not None:
                if self._tokens < 1.0:
                    wait = max(wait, (1.0 - self._tokens) * self.window / self.per_hour)
                if len(self._log) >= int(self.per_hour):
                    wait = max(wait, self._log[len(self._log) - int(self.per_hour)] + self.window - now)
            return wait

    def acquire(self, sleep: Callable[[float], Any] = time.sleep, max_wait: float | None = None) -> float:
        """Block until a commit stays within the budget; returns the seconds slept. With
        ``max_wait``, return after at most that long even if the budget is not free yet."""
        slept = 0.0
        while True:
            w = self.wait()
            if w <= 0 or (max_wait is not None and slept >= max_wait):
                return slept
            if max_wait is not None:
                w = min(w, max_wait - slept)
            sleep(w)
            slept += w

    def record(self) -> None:
        """A commit was made (counted against the budget)."""
        with self._lock:
            now = self.clock()
            self._refill(now)
            self._tokens = max(0.0, self._tokens - 1.0) if self.per_hour is not None else self._tokens
            self._log.append(now)
            self.commits += 1

    def block(self, seconds: float) -> None:
        """The server asked for a pause (a 429's ``Retry-After``): no commit before it has passed."""
        with self._lock:
            self._blocked_until = max(self._blocked_until, self.clock() + max(0.0, float(seconds)))
            self.blocks += 1

    def in_window(self) -> int:
        """Commits counted in the last window."""
        with self._lock:
            self._refill(self.clock())
            return len(self._log)

    def state_dict(self) -> dict[str, Any]:
        """The budget's state with times relative to now (a monotonic clock is per process)."""
        with self._lock:
            now = self.clock()
            self._refill(now)
            return {"per_hour": self.per_hour, "burst": self.burst, "tokens": self._tokens,
                    "ages": [now - t for t in self._log], "blocked_for": max(0.0, self._blocked_until - now)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock:
            now = self.clock()
            self._tokens = min(float(self.burst), max(0.0, float(state.get("tokens", self.burst))))
            self._refilled = now
            self._log = deque(sorted(now - float(a) for a in state.get("ages", []) if 0 <= float(a) < self.window))
            self._blocked_until = now + max(0.0, float(state.get("blocked_for", 0.0)))

    def __repr__(self) -> str:
        return f"CommitBudget(per_hour={self.per_hour}, burst={self.burst})"
