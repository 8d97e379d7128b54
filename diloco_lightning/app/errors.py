"""How a run ends when it does not finish: the exceptions the command line turns into one line.

* :class:`RunError`: a worker exited with an error or was killed (the message names it and
  carries its log's last lines), or the run ran past ``launch.timeout``;
* :class:`Interrupted`: Ctrl-C or SIGTERM stopped the run before its work was done
  (status ``128 + signal``).
"""

from __future__ import annotations

import contextlib
import signal
import threading

from diloco_lightning.util.errors import DiLoCoError

__all__ = ["RunError", "Interrupted", "Signal", "terminate_as_exception"]


class RunError(DiLoCoError, RuntimeError):
    """A run that failed: a worker exited with an error or was killed (the message names it and carries
    its log's last lines), or the run ran past ``launch.timeout``."""


class Interrupted(DiLoCoError):
    """Ctrl-C or SIGTERM stopped the run before its work was done; ``exit_code`` is ``128 + signal``."""

    def __init__(self, signum: int, message: str) -> None:
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(message)


class Signal(BaseException):
    """Raised in the main thread by the SIGTERM handler of :func:`terminate_as_exception`."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def terminate_as_exception():
    """While the block runs (main thread), SIGTERM raises :class:`Signal` like Ctrl-C raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise Signal(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
