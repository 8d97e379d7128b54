"""A run's launches: a run stopped (Ctrl-C, SIGTERM, a failure) and started again by the same
command is one run, so the counters of ``results.json`` are the whole run's, and the last
launch's stand beside them under ``last_launch``, named as such.

* ``<run_dir>/launches.json``: one entry per launch of the whole-run job (its start, seconds,
  how it ended, the steps it was asked for), written when it ends, so the run's wall time is
  the sum over its launches (a launch killed with SIGKILL is not counted: it never ended).
* the master's ``metrics.jsonl`` is appended by every launch: the run's accepted and rejected
  deltas are its sum; the launch's are the rounds it printed.
* workers checkpoint their tokens and upload totals: a worker's summary gives the whole run's
  and the amount at this launch's start.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable

from diloco_lightning.util.jsondoc import dumps_json

__all__ = ["LAUNCHES_FILE", "EXTENDING_KEYS", "Launches", "round_counts", "read_jsonl", "resume_command", "invoked_as"]

#: keys that extend a run rather than make another one: a run's id leaves them out (outside a sweep)
EXTENDING_KEYS = ("trainer.max_steps", "trainer.max_time", "launch.timeout")

LAUNCHES_FILE = "launches.json"


class Launches:
    """The launches of the run in ``run_dir`` (``launches.json``)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LAUNCHES_FILE
        self.started = time.time()
        self._t0 = time.perf_counter()

    def previous(self) -> list[dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return []
        return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []

    def seconds(self) -> float:
        """This launch's seconds so far."""
        return time.perf_counter() - self._t0

    def whole_seconds(self) -> float:
        """The run's seconds: its ended launches' and this one's."""
        return sum(float(d.get("wall_seconds") or 0.0) for d in self.previous()) + self.seconds()

    def end(self, outcome: str, **extra: Any) -> None:
        """Record this launch (``outcome``: finished, interrupted, failed)."""
        entry = {"started": self.started, "wall_seconds": self.seconds(), "outcome": outcome, **extra}
        self.path.write_text(dumps_json(self.previous() + [entry], indent=2))


def round_counts(rounds: Iterable[dict[str, Any]]) -> tuple[int, int]:
    """``(accepted, rejected)`` summed over round metrics."""
    accepted = rejected = 0
    for r in rounds:
        accepted += int(r.get("accepted", 0) or 0)
        rejected += sum(int(v) for v in (r.get("rejected_by_reason") or {}).values())
    return accepted, rejected


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file (the master's ``metrics.jsonl``, across launches; a worker's
    ``progress.jsonl``); unreadable lines skipped, a missing file empty."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict):
            out.append(d)
    return out


def resume_command(overrides: list[str], prog: str, **changes: Any) -> str:
    """The command line that runs ``prog`` with ``overrides``, ``changes`` applied (``key=value``
    replaced or added), quoted for a POSIX shell: what a user pastes to resume."""
    import shlex

    from diloco_lightning.app.overrides import plain_override

    out = [plain_override(o) for o in overrides if o.lstrip("+~").split("=", 1)[0] not in changes]
    out += [f"{k}={v}" for k, v in changes.items()]
    return " ".join([prog] + [shlex.quote(o) for o in out])


def invoked_as() -> str:
    """How this command was started, as a user would type it again (``python train.py``, ``diloco-train``)."""
    import os
    import sys

    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else "diloco-train"
    return f"python {argv0}" if argv0.endswith(".py") else os.path.basename(argv0)
