"""Named crash points: the one seam through which crash tests reach production code.

Production code marks the moments where a crash matters (``faults.point("worker.uploaded")``).
Nothing happens unless a test asked for it, in one of two ways:

* ``DILOCO_FAULTS="label[:n][,label[:n]...]"`` in a process's environment: the process kills
  itself with SIGKILL (a real ``kill -9``: no cleanup, no flush of Python buffers beyond
  stdout/stderr) the n-th time (default 1) it reaches ``label``. This is how subprocess
  tests crash a worker or a master at an exact point.
* :func:`set_hook`: a callable receiving every label reached in this process (for
  in-process tests that raise at a point), or :func:`install` to hook the points of one
  object only (one master or one hub among several in a test process).

Labels (each documented where it is used): the master's round ``listed``, ``downloaded``,
``stepped``, ``staged``, ``published``, ``saved``, ``swapped``; a hub's publication
``file:<hub path>``, ``files``, ``locked``, ``manifest`` (``committed`` on the Hugging Face
Hub), ``delete:<hub path>``, ``deleted``; ``worker.exported`` (a boundary's pseudo-gradient
was taken, nothing sent yet), ``worker.uploading`` (the delta file is written, the upload
starts), ``worker.uploaded`` (the hub holds the delta; the worker has not recorded it yet, and
no checkpoint after it was written), ``worker.finishing`` (training is over, its last checkpoint
written; the final flush starts), ``hub.placing`` (the folder hub has copied a file to a
temporary name beside its destination and not yet linked it into place), ``s3.probing`` (the S3
conditional-write probe has its scratch object and an incomplete multipart upload of it).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import weakref
from typing import Any, Callable

__all__ = ["ENV", "install", "point", "set_hook"]

ENV = "DILOCO_FAULTS"

_lock = threading.Lock()
_hook: Callable[[str], None] | None = None
_owned: "weakref.WeakKeyDictionary[Any, Callable[[str], None]]" = weakref.WeakKeyDictionary()
_plan: dict[str, int] | None = None
_seen: dict[str, int] = {}


def _parse(text: str) -> dict[str, int]:
    plan: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        label, _, n = item.partition(":")
        plan[label] = int(n) if n else 1
    return plan


def set_hook(hook: Callable[[str], None] | None) -> None:
    """Call ``hook(label)`` at every point reached in this process (None: stop)."""
    global _hook
    _hook = hook


def install(owner: Any, hook: Callable[[str], None] | None) -> None:
    """Call ``hook(label)`` at the points ``owner`` reaches (None: stop)."""
    if hook is None:
        _owned.pop(owner, None)
    else:
        _owned[owner] = hook


def point(label: str, owner: Any = None) -> None:
    """A crash point (see the module docstring); free when no test asked for one."""
    global _plan
    if _hook is not None:
        _hook(label)
    if owner is not None and _owned:
        hook = _owned.get(owner)
        if hook is not None:
            hook(label)
    if _plan is None:
        _plan = _parse(os.environ.get(ENV, ""))
    if not _plan or label not in _plan:
        return
    with _lock:
        _seen[label] = _seen.get(label, 0) + 1
        hit = _seen[label] == _plan[label]
    if hit:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
