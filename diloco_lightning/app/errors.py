"""How a run ends when it does not finish: the exceptions the command line turns into one line.

* :class:`RunError`: a worker exited with an error or was killed (the message names it and
  carries its log's last lines), or the run ran past ``launch.timeout``;
* :class:`Interrupted`: Ctrl-C or SIGTERM stopped the run before its work was done
  (status ``128 + signal``).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

from diloco_lightning.util.errors import DiLoCoError

__all__ = ["RunError", "Interrupted", "Signal", "terminate_as_exception", "is_user_error", "short_message"]


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


def is_user_error(e: BaseException) -> bool:
    """Whether ``e`` is something the user fixes (a value, a path, a machine), not a bug."""
    from hydra.errors import CompactHydraException
    from omegaconf.errors import MissingMandatoryValue

    from diloco_lightning.app.config import ConfigError
    from diloco_lightning.hub.base import HubError
    from diloco_lightning.wire.manifest import ManifestError
    from diloco_lightning.wire.names import InvalidNameError
    from diloco_lightning.app.resources import ResourceError

    kinds: tuple[type[BaseException], ...] = (
        ConfigError, CompactHydraException, MissingMandatoryValue, HubError, ManifestError, InvalidNameError, ResourceError,
    )
    if isinstance(e, kinds):
        return True
    mod = sys.modules
    for module, name in (("diloco_lightning.worker.sync", "WorkerError"), ("diloco_lightning.app.errors", "RunError")):
        cls = getattr(mod.get(module), name, None)
        if cls is not None and isinstance(e, cls):
            return True
    return False


def is_config_error(e: BaseException) -> bool:
    from hydra.errors import CompactHydraException
    from omegaconf.errors import MissingMandatoryValue

    from diloco_lightning.app.config import ConfigError
    from diloco_lightning.master.config import MasterConfigError

    if isinstance(e, MasterConfigError):  # the hub's run does not match: not a bad value, no key to look up
        return False
    return isinstance(e, (ConfigError, CompactHydraException, MissingMandatoryValue))


def short_message(e: BaseException) -> str:
    """One line out of an exception's text (Hydra's multi-line composition errors included)."""
    from hydra.errors import CompactHydraException
    from omegaconf.errors import OmegaConfBaseException

    text = str(e)
    if isinstance(e, CompactHydraException) and isinstance(e.__cause__, OmegaConfBaseException):
        cause = str(e.__cause__)
        if cause not in text:
            text += "\n" + cause
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i].rstrip()
        i += 1
        if line.startswith("Available options in"):
            names = []
            while i < len(lines) and lines[i][:1] in ("\t", " ") and lines[i].strip():
                names.append(lines[i].strip())
                i += 1
            out.append(f"{line} {', '.join(names)}")
        elif line.startswith("Config search path"):
            while i < len(lines) and lines[i][:1] in ("\t", " "):
                i += 1
        elif line.strip() and line[:1] not in ("\t", " "):
            out.append(line.strip())
    seen: list[str] = []
    for part in out:
        if part not in seen:
            seen.append(part)
    joined = " ".join(p if p.endswith((".", ":", "?")) else p + "." for p in seen[:-1])
    last = seen[-1] if seen else type(e).__name__
    return (joined + " " + last).strip()
