"""A process's start-up timeline: named moments on the way to its first training step.

Production code marks them (``timeline.mark("hub_open")``); each mark is a DEBUG log line, and when
``DILOCO_TIMELINE`` names a file the process also appends ``<unix time> <pid> <name>`` to it (one
``write`` per line, so several processes can share the file). ``benchmarks/restart_time.py`` reads
it to say where a restarted worker's time goes. Free when nobody asked: no import, no I/O.

Marks of a worker (``train.py role=worker``, in order): ``cli`` (the command's module is imported),
``config`` (composed and checked), ``node_checked`` (the hub read for a live claim), ``imports``
(torch and Lightning imported), ``data``, ``model``, ``trainer`` (built), ``checkpoint_loaded`` (a
resumed fit: the checkpoint is read), ``train_start``, ``hub_open``, ``claimed``, ``global_installed``
(or the hub settled, after a checkpoint), ``worker_started``, ``first_step``.
"""

from __future__ import annotations

import logging
import os
import time

__all__ = ["ENV", "mark"]

ENV = "DILOCO_TIMELINE"

log = logging.getLogger(__name__)


def mark(name: str) -> None:
    """Note that this process reached ``name`` now (see the module docstring)."""
    now = time.time()
    log.debug("timeline: %s", name)
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{now:.6f} {os.getpid()} {name}\n".encode())
        finally:
            os.close(fd)
    except OSError as e:  # a benchmark's file: never the run's problem
        log.debug("timeline: cannot write %s: %s", path, e)
