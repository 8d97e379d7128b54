"""What a run prints, and where the rest of its log goes.

The whole-run job (``role=all``, ``launch=sim``, ``launch=submitit``) prints its own lines on
stdout (the run, one per outer round, the workers' progress, the summary); on the console the
library adds only its warnings and what a wait is waiting for (a master waiting for workers
says so from its first minute). Everything else the library logs at INFO (data preparation,
membership, the lease) goes to ``<run_dir>/train.log``, opened once the run has passed its
start-up checks, so a refused command leaves no run folder behind. ``role=worker`` and
``role=master`` are their machine's main job: their INFO lines (a worker's one line per sync)
stay on the console.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

__all__ = ["configure_console", "log_to_file", "drop_unused_run_dir", "WAIT_LOGGERS"]

#: loggers whose INFO lines say what a wait is waiting for: the console keeps them
WAIT_LOGGERS = ("diloco_lightning.master.serve", "diloco_lightning.util.waiting")
_FULL = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_MARK = "_diloco_console"


class _ConsoleFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.startswith(WAIT_LOGGERS)


class _ConsoleFormat(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.WARNING:
            return f"{record.levelname.lower()}: {text}"
        return text


def _drop_ours(root: logging.Logger) -> None:
    for h in list(root.handlers):
        if getattr(h, _MARK, False):
            root.removeHandler(h)
            h.close()


def configure_console(whole_run: bool) -> None:
    """The console of this process: quiet (warnings and waits only, plain lines) for a whole-run
    job, every INFO line with time and source for one worker or master."""
    root = logging.getLogger()
    _drop_ours(root)
    handler = logging.StreamHandler()
    if whole_run:
        handler.addFilter(_ConsoleFilter())
        handler.setFormatter(_ConsoleFormat())
    else:
        handler.setFormatter(logging.Formatter(_FULL))
    setattr(handler, _MARK, True)
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def log_to_file(path: Path) -> None:
    """Every INFO line of this process also goes to ``path`` (appended: a resumed run keeps its log)."""
    root = logging.getLogger()
    for h in root.handlers:
        if isinstance(h, logging.FileHandler) and Path(h.baseFilename) == path.resolve():
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(_FULL))
    setattr(handler, _MARK, True)
    root.addHandler(handler)


def drop_unused_run_dir(run_dir: Path, run_root: Path | None = None) -> bool:
    """Remove ``run_dir`` when it holds nothing but what Hydra wrote before the job ran (its
    ``hydra/`` folder) and the log of the refused start (``train.log``): what a command refused at
    start-up leaves. ``run_root`` goes too when that
    leaves it empty. True when something was removed."""
    try:
        if run_dir.resolve() == Path.cwd().resolve():
            return False  # a command whose output dir is the working folder (diloco-master) made no run folder
        entries = {p.name for p in run_dir.iterdir()}
    except OSError:
        return False
    if "hydra" not in entries or not entries <= {"hydra", "train.log"}:
        return False  # only a folder Hydra made for this job, holding nothing else
    shutil.rmtree(run_dir, ignore_errors=True)
    if run_root is not None:
        try:
            run_root.rmdir()  # only when empty
        except OSError:
            pass
    return True
