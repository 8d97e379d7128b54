"""Supervised workers: a worker process that crashed is restarted, with back-off, from its checkpoint.

``train.py`` (role=all, ``launch=local``) watches its worker processes, and ``train.py role=worker``
runs its worker as a child process it watches (:func:`supervise_worker`), so a run survives a
crash without an outside scheduler. How a worker process ended decides (:meth:`Restarts.decide`):

* **status 0**: it finished; nothing to do.
* **a configuration or other user error** (:data:`EXIT_CONFIG`, :data:`EXIT_USER`: the worker said
  what to fix in one or two lines, :func:`exit_status`): never restarted, since no restart fixes it.
* **anything else** is a crash and is restarted: killed by a signal (``kill -9``, the out-of-memory
  killer), an exception (status 1, with its traceback in the log), or a hub or master that stayed
  away past ``diloco.wait_timeout`` (:data:`EXIT_HUB_AWAY`: a worker rides out shorter outages by
  itself). The restarted process resumes from its last checkpoint (``nodes/<node>/checkpoints``) and
  settles with the hub (deltas already delivered are not sent again).

Restarts wait ``backoff`` seconds, doubled after each one up to ``max_backoff``, and stop after
``restarts`` of them (the run then fails as an unsupervised one does, with the worker's log tail); a
worker that ran ``reset_after`` seconds since its last start has its count and pause reset. Each
restart is one line on the command's output.

**A warm spare** (``spare``, :class:`Spare`): once a worker has run ``spare_after`` seconds, the
supervisor starts its replacement ahead of need: a process that imports torch, Lightning and this
package (most of a restart's time: 4-9 s on two shared cores, ``benchmarks/restart_time.py``), then
waits on its standard input, touching neither the hub, the checkpoint nor the data. A restart hands
it the go (one line) instead of starting a process: it resumes from the checkpoint at once, and the
next spare is started ``spare_after`` seconds later. A spare that died is replaced by a fresh start.

Not supervised here: a worker under ``torchrun`` (its elastic agent restarts it: ``--max-restarts``)
and ``launch=submitit`` (SLURM requeues a job).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from diloco_lightning.util.options import OptionError, check_number, option

__all__ = ["SuperviseOptions", "Restarts", "Spare", "EXIT_CONFIG", "EXIT_USER", "EXIT_HUB_AWAY", "SPARE_FLAG", "describe_exit"]

log = logging.getLogger(__name__)

#: a worker's exit status for a configuration error (the CLI's), never restarted
EXIT_CONFIG = 2
#: a worker's exit status for another error its user fixes (a missing hub, a refused token, a node id another
#: live worker holds): never restarted
EXIT_USER = 3
#: a worker's exit status when the hub or the master stayed away past ``diloco.wait_timeout`` (EX_TEMPFAIL):
#: restarted
EXIT_HUB_AWAY = 75


@dataclass
class SuperviseOptions:
    """``supervise.*``: how a run's worker processes are restarted after a crash (this module's docstring)."""

    restarts: int = option(
        3, "times a crashed worker process is restarted from its checkpoint (killed by a signal, an exception, a hub "
        "away past diloco.wait_timeout), with back-off; 0: a crash ends the run. A configuration error is never retried"
    )
    backoff: float = option(2.0, "seconds before the first restart of a worker; doubled after each one")
    max_backoff: float = option(60.0, "the longest pause before a restart")
    reset_after: float = option(
        600.0, "seconds a restarted worker must run for its restart count and back-off to start again from zero"
    )
    spare: bool = option(
        True, "keep a warm spare of each supervised worker (role=worker and role=all): a process with torch and Lightning "
        "imported, waiting, that a restart wakes instead of starting one (no import time); it holds no hub, data or "
        "model until then"
    )
    spare_after: float = option(30.0, "seconds a worker runs before its warm spare is started (the start-ups never compete)")

    @classmethod
    def names(cls) -> list[str]:
        return [f for f in cls.__dataclass_fields__]

    def validate(self) -> "SuperviseOptions":
        check_number(self, "restarts", low=0, integer=True)
        check_number(self, "backoff", low=0.0)
        check_number(self, "max_backoff", low=0.0)
        check_number(self, "reset_after", low=0.0)
        check_number(self, "spare_after", low=0.0)
        if self.max_backoff < self.backoff:
            raise OptionError("max_backoff", f"must be at least backoff ({self.backoff:g}), got {self.max_backoff:g}")
        return self


def describe_exit(code: int) -> str:
    """``was killed by SIGKILL (...)`` / ``exited with status 1``: how a process ended, in words."""
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        hint = " (the kernel's out-of-memory killer sends SIGKILL: see `dmesg`)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    if code == EXIT_HUB_AWAY:
        return f"exited with status {code} (the hub or the master stayed away past diloco.wait_timeout)"
    return f"exited with status {code}"


class Restarts:
    """The restart policy of one supervised process: :meth:`started` at each start, :meth:`decide` when
    it ended with a status other than 0."""

    def __init__(self, options: SuperviseOptions, label: str) -> None:
        self.options, self.label = options, label
        self.count = 0  #: restarts since the last reset
        self.total = 0  #: restarts of this process, all told
        self._started = time.monotonic()

    def started(self) -> None:
        self._started = time.monotonic()

    def decide(self, code: int) -> float | None:
        """The pause before restarting a process that ended with ``code``, and the restart counted; None
        when it is not restarted (a user error, or ``restarts`` spent)."""
        if code in (0, EXIT_CONFIG, EXIT_USER):
            return None
        o = self.options
        if time.monotonic() - self._started >= o.reset_after:
            self.count = 0
        if self.count >= o.restarts:
            return None
        delay = min(o.backoff * 2 ** self.count, o.max_backoff)
        self.count += 1
        self.total += 1
        return delay

    def line(self, code: int, delay: float) -> str:
        """The one line a restart prints."""
        return (f"[supervise] {self.label} {describe_exit(code)}; restarting it in {delay:.3g} s from its checkpoint "
                f"(restart {self.count} of {self.options.restarts}; supervise.restarts=... to change)")

    def spent(self, code: int) -> str | None:
        """Why a crashed process was not restarted, when its restarts are spent (None otherwise)."""
        if code in (0, EXIT_CONFIG, EXIT_USER) or self.options.restarts == 0:
            return None
        return f"restarted {self.total} time(s), the limit (supervise.restarts={self.options.restarts})"


#: the worker command's flag that makes it a spare (``python -m diloco_lightning.app.worker ... --spare``)
SPARE_FLAG = "--spare"
#: the line a spare waits for
GO = b"go\n"


class Spare:
    """A warm spare of one worker (this module's docstring): ``command`` plus :data:`SPARE_FLAG`, started
    by :meth:`prepare`, woken by :meth:`take`, ended by :meth:`close`. ``popen``: ``subprocess.Popen``'s
    other arguments (environment, output)."""

    def __init__(self, command: list[str], **popen: Any) -> None:
        self.command = [*command, SPARE_FLAG]
        self.popen = popen
        self._proc: subprocess.Popen | None = None
        self._life = time.monotonic()  # when the worker's current life began (now: it is started with its Spare)
        self._spared = False  # whether that life has had its spare started

    def keep(self, after: float) -> None:
        """Start the spare once the worker's current life has run ``after`` seconds; once per life (a spare
        that died is not started again before the next life: :meth:`take` begins one)."""
        if not self._spared and time.monotonic() - self._life >= after:
            self._spared = True
            self.prepare()

    @property
    def ready(self) -> bool:
        """Whether a spare is running (it may still be importing: it then goes as soon as it is done)."""
        return self._proc is not None and self._proc.poll() is None

    def prepare(self) -> None:
        """Start a spare unless one is running."""
        if not self.ready:
            self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, **self.popen)

    def take(self) -> subprocess.Popen | None:
        """The spare, told to go (it is the worker from now on), or None when there is none alive (the caller
        starts a process). Either way a new life of the worker begins."""
        proc, self._proc = self._proc, None
        self._life, self._spared = time.monotonic(), False
        if proc is None or proc.poll() is not None:
            return None
        try:
            assert proc.stdin is not None
            proc.stdin.write(GO)
            proc.stdin.close()
        except (BrokenPipeError, OSError):  # it died just now
            _end(proc)
            return None
        return proc

    def close(self) -> None:
        """End the spare, if any (its input closed: it leaves at once, or after its imports)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            _end(proc)


def _end(proc: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
