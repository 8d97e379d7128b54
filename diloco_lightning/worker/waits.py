"""How a worker waits: bounded by ``wait_timeout``, said out loud at growing intervals, retried
on hub errors every ``poll_interval``, and ended at once by :meth:`Waits.stop` (SIGTERM)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

from diloco_lightning.util.waiting import Patience
from diloco_lightning.worker.sync import WaitTimeoutError, WorkerError, WorkerStopped

__all__ = ["Waits"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class Waits:
    """The waits of worker ``node_id`` on the hub at ``url``: each at most ``wait_timeout`` seconds,
    retried every ``poll_interval``."""

    def __init__(self, node_id: str, url: str, *, wait_timeout: float, poll_interval: float) -> None:
        self.node_id, self.url = node_id, url
        self.wait_timeout, self.poll_interval = wait_timeout, poll_interval
        self._stop = threading.Event()

    def deadline(self, timeout: float | None = None) -> float:
        return time.monotonic() + (self.wait_timeout if timeout is None else timeout)

    def stop(self) -> None:
        self._stop.set()

    def pause(self, seconds: float, waiting_for: str) -> None:
        """Sleep ``seconds`` unless stopped (then ``WorkerStopped`` naming what was awaited)."""
        if self._stop.wait(seconds):
            raise WorkerStopped(f"node {self.node_id}: stopped while waiting for {waiting_for} on {self.url}")

    def patience(self, what: str) -> Patience:
        node = self.node_id
        return Patience(what, self.url, limit=self.wait_timeout, say=lambda line: log.info("node %s: %s", node, line))

    def retry(self, what: str, fn: Callable[[], T], deadline: float) -> T:
        """``fn()``, retried every ``poll_interval`` on hub errors until ``deadline`` (``WaitTimeoutError``)."""
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
                        f"node {self.node_id}: could not {what} on {self.url} within {self.wait_timeout:g} s "
                        f"(last error: {type(e).__name__}: {e})"
                    ) from e
                if first:
                    log.warning("node %s: cannot %s on %s (%s: %s); retrying", self.node_id, what, self.url,
                                type(e).__name__, e)
                    first = False
                patience.tick(f"; last error: {type(e).__name__}: {e}")
                self.pause(self.poll_interval, f"the hub to answer ({what})")
