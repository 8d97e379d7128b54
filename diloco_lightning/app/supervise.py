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

Not supervised here: a worker under ``torchrun`` (its elastic agent restarts it: ``--max-restarts``)
and ``launch=submitit`` (SLURM requeues a job).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from diloco_lightning.util.options import OptionError, check_number, option

__all__ = ["SuperviseOptions", "Restarts", "EXIT_CONFIG", "EXIT_USER", "EXIT_HUB_AWAY", "exit_status", "describe_exit",
           "supervised", "supervise_worker"]

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

    @classmethod
    def names(cls) -> list[str]:
        return [f for f in cls.__dataclass_fields__]

    def validate(self) -> "SuperviseOptions":
        check_number(self, "restarts", low=0, integer=True)
        check_number(self, "backoff", low=0.0)
        check_number(self, "max_backoff", low=0.0)
        check_number(self, "reset_after", low=0.0)
        if self.max_backoff < self.backoff:
            raise OptionError("max_backoff", f"must be at least backoff ({self.backoff:g}), got {self.max_backoff:g}")
        return self


def exit_status(e: BaseException) -> int | None:
    """The exit status of a worker process that ``e`` ended: :data:`EXIT_HUB_AWAY` for a hub or master that
    stayed away, :data:`EXIT_CONFIG` / :data:`EXIT_USER` for what its user fixes, None for a bug (the
    traceback is kept, status 1: a crash, restarted)."""
    from diloco_lightning.app.cli import _is_config_error, is_user_error
    from diloco_lightning.hub.base import HubUnavailableError
    from diloco_lightning.worker.sync import WaitTimeoutError

    if isinstance(e, (HubUnavailableError, WaitTimeoutError)):
        return EXIT_HUB_AWAY
    if _is_config_error(e):
        return EXIT_CONFIG
    if is_user_error(e):
        return EXIT_USER
    return None


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


def supervised(cfg: Any) -> bool:
    """Whether this ``role=worker`` command supervises its worker: restarts allowed, and not under torchrun
    (its elastic agent restarts the ranks) or in a DDP rank Lightning started."""
    if int(cfg.supervise.restarts) <= 0:
        return False
    if "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return False
    return int(cfg.trainer.devices) == 1


def supervise_worker(cfg: Any, *, say: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """``train.py role=worker``, supervised: the worker runs as a child process
    (``python -m diloco_lightning.app.worker``, its output on this command's) and is restarted after a
    crash (this module's docstring). Returns its summary; a user error ends with the worker's own lines
    (``SystemExit``: 2 for a configuration error, else 1); spent restarts end in a
    :class:`~diloco_lightning.app.errors.RunError`."""
    import json

    from omegaconf import OmegaConf

    from diloco_lightning.app.build import node_id, run_dir
    from diloco_lightning.app.errors import RunError, Signal, terminate_as_exception
    from diloco_lightning.app.worker import _refuse_a_running_node_id, worker_command
    from diloco_lightning.hub.base import HubUnavailableError

    speak = say or (lambda line: print(line, file=sys.stderr, flush=True))
    options = SuperviseOptions(**{k: cfg.supervise[k] for k in SuperviseOptions.names()}).validate()
    index = int(cfg.node_index)
    nid = node_id(index)
    # what the worker refuses first (a missing hub, a node id another live worker holds) is refused here, as an
    # unsupervised worker's: the command's own lines, and no run folder left
    try:
        _refuse_a_running_node_id(cfg, nid)
    except HubUnavailableError as e:  # an outage is not the user's to fix: the worker (restarted as needed) waits
        speak(f"[supervise] worker {nid}: the hub is unreachable now ({type(e).__name__}); starting the worker anyway")
    out = run_dir(cfg) / "nodes" / nid
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "worker-config.yaml"
    OmegaConf.save(cfg, config_path, resolve=True)
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    policy = Restarts(options, f"worker {nid}")
    proc: subprocess.Popen | None = None
    try:
        with terminate_as_exception():
            while True:
                policy.started()
                proc = subprocess.Popen(worker_command(config_path, index), env=env)
                code = proc.wait()
                proc = None
                if code == 0:
                    return json.loads((out / "summary.json").read_text())
                if code in (EXIT_CONFIG, EXIT_USER):  # the worker said what to fix; no restart fixes it
                    raise SystemExit(EXIT_CONFIG if code == EXIT_CONFIG else 1)
                delay = policy.decide(code)
                if delay is None:
                    raise RunError(f"worker {nid} {describe_exit(code)}; {policy.spent(code)}. Its output is above")
                speak(policy.line(code, delay))
                time.sleep(delay)
    except (KeyboardInterrupt, Signal):
        if proc is not None and proc.poll() is None:  # SIGTERM to this command only: the worker stops cleanly too
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise
