"""What ``train.py`` runs: a whole run on this machine, one worker, or one master.

``role=all`` (default): :mod:`diloco_lightning.app.local` (or one SLURM job per worker with
``launch=submitit``: :mod:`diloco_lightning.app.slurm`). ``role=worker`` / ``role=master`` run
one part against a shared hub (``hub=hf hub.url=hf://org/run``) for multi-machine runs; a
multi-GPU worker is one ``torchrun`` (or SLURM) job running ``train.py role=worker ...``. Workers
are supervised (``supervise.*``, :mod:`diloco_lightning.app.supervise`): one that crashed is
restarted from its checkpoint, with back-off.

Before anything heavy starts, :func:`run` refuses a run this machine cannot hold
(:mod:`diloco_lightning.app.resources`), unless the run is already finished.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig

from diloco_lightning.app.build import recipe_name, resolve_run_dir, run_dir
from diloco_lightning.app.config import validate
from diloco_lightning.app.console import configure_console
from diloco_lightning.app.errors import Interrupted, RunError

__all__ = ["run", "run_master", "Interrupted", "RunError"]

log = logging.getLogger(__name__)


def run_master(cfg: DictConfig) -> int:
    """``role=master`` (:func:`diloco_lightning.app.serving.run_master`; imported when used, so a
    configuration error is reported before torch is imported)."""
    from diloco_lightning.app.serving import run_master as serve

    return serve(cfg)


def _quiet_hub_logs() -> None:
    """The console shows one line per round (the master's progress line): the hub's own INFO lines
    (one per publication, the lease) would repeat it."""
    for name in ("diloco_lightning.hub", "diloco_lightning.master.lease", "botocore", "boto3", "urllib3", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)


def run(cfg: DictConfig) -> dict[str, Any] | None:
    """Validate, refuse what this machine cannot run, then dispatch on ``cfg.role``."""
    validate(cfg)  # before anything imports torch: a configuration error is reported in about a second
    from diloco_lightning.app.local import finished_results, run_all

    resolve_run_dir(cfg)
    configure_console(whole_run=cfg.role == "all")
    finished = cfg.role == "all" and cfg.launch.kind in ("local", "sim", "submitit") and finished_results(cfg, run_dir(cfg)) is not None
    if cfg.launch.check_resources and not finished:  # a finished run starts nothing: run_all only says so
        from diloco_lightning.app.resources import check_resources

        check_resources(cfg, label=recipe_name())
    _quiet_hub_logs()
    if cfg.launch.kind == "sim":
        from diloco_lightning.app.sim import run_sim

        return run_sim(cfg)
    if cfg.launch.kind == "submitit" and cfg.role == "all":
        from diloco_lightning.app.slurm import run_submitit

        return run_submitit(cfg)
    if cfg.role == "worker":
        from diloco_lightning.app.worker import run_worker, supervise_worker, supervised

        return supervise_worker(cfg) if supervised(cfg) else run_worker(cfg)
    if cfg.role == "master":
        code = run_master(cfg)
        if code:
            raise SystemExit(code)
        return None
    return run_all(cfg)
