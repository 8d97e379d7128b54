"""How a worker waits: bounded by ``wait_timeout``, said out loud at growing intervals, retried
on hub errors every ``poll_interval``, and ended at once by :meth:`Waits.stop` (SIGTERM)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, TypeVar

from diloco_lightning.util.waiting import Patience
from diloco_lightning.worker.sync import WaitTimeoutError, WorkerError, WorkerStopped

__all__ = ["Waits"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Waits:
    """The waits of one worker (``worker`` gives ``node_id``, ``hub``, ``wait_timeout``, ``poll_interval``)."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self._stop = threading.Event()

    def deadline(self, timeout: float | None = None) -> float:
        return time.monotonic() + (self._worker.wait_timeout if timeout is None else timeout)

    def stop(self) -> None:
        self._stop.set()

    def pause(self, seconds: float, waiting_for: str) -> None:
        """Sleep ``seconds`` unless stopped (then ``WorkerStopped`` naming what was awaited)."""
        if self._stop.wait(seconds):
            w = self._worker
            raise WorkerStopped(f"node {w.node_id}: stopped while waiting for {waiting_for} on {w.hub.url}")

    def patience(self, what: str) -> Patience:
        w = self._worker
        return Patience(what, w.hub.url, limit=w.wait_timeout, say=lambda line: log.info("node %s: %s", w.node_id, line))

    def retry(self, what: str, fn: Callable[[], T], deadline: float) -> T:
        """``fn()``, retried every ``poll_interval`` on hub errors until ``deadline`` (``WaitTimeoutError``)."""
        w = self._worker
        first = True
        patience = self.patience(f"the hub to answer ({what})")
        while True:
            try:
                return fn()
            except (WorkerError, ValueError):
                raise
            except Exception as e:
                if time.monotonic() >= deadline:
                    raise WaitTimeoutError(
                        f"node {w.node_id}: could not {what} on {w.hub.url} within {w.wait_timeout:g} s "
                        f"(last error: {type(e).__name__}: {e})"
                    ) from e
                if first:
                    log.warning("node %s: cannot %s on %s (%s: %s); retrying", w.node_id, what, w.hub.url,
                                type(e).__name__, e)
                    first = False
                patience.tick(f"; last error: {type(e).__name__}: {e}")
                self.pause(w.poll_interval, f"the hub to answer ({what})")
