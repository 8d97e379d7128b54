"""``launch=submitit``: one SLURM job per worker, the master in the launching process.

    pip install submitit
    python train.py recipe=llama1b_tau8 launch=submitit launch.submitit.partition=gpu \\
        hub=hf hub.url=hf://org/llama1b-tau8

Each job runs ``python -m diloco_lightning.app.worker --config <run_dir>/config.yaml
--node-index i``, exactly what ``role=all`` runs locally, so a SLURM run and a local
run of the same recipe differ only in where the workers execute. The run folder must be
on a filesystem the compute nodes see (or use an ``hf://`` hub and a shared
``run_root``). A multi-GPU worker is a job with ``gpus_per_node > 1`` whose command
is wrapped in ``torchrun``; Lightning's own DDP launcher is never used under ``-m``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


def run_submitit(cfg: DictConfig) -> dict[str, Any] | None:
    try:
        import submitit
    except ImportError:
        raise RuntimeError("launch=submitit needs the submitit package: pip install submitit") from None
    from diloco_lightning.app.build import build_master, open_run_hub, run_dir
    from diloco_lightning.app.config import to_container
    from diloco_lightning.app.local import print_round
    from diloco_lightning.app.worker import worker_command

    rdir = run_dir(cfg)
    rdir.mkdir(parents=True, exist_ok=True)
    config_path = rdir / "config.yaml"
    OmegaConf.save(cfg, config_path, resolve=True)
    opts = to_container(cfg.launch.submitit)
    gpus = int(opts.pop("gpus_per_node", 1) or 0)
    executor = submitit.AutoExecutor(folder=str(rdir / "slurm"))
    params = {k: v for k, v in opts.items() if v is not None}
    partition = params.pop("partition", None)
    executor.update_parameters(
        gpus_per_node=gpus, tasks_per_node=1, nodes=1, slurm_job_name=f"diloco-{cfg.run_id}"[:64],
        **({"slurm_partition": partition} if partition else {}), **params,
    )
    hub = open_run_hub(cfg)
    master = build_master(cfg, hub, on_round=print_round)
    master.start()
    jobs = []
    with executor.batch():
        for i in range(cfg.workers):
            cmd = worker_command(config_path, i)
            if gpus > 1:
                cmd = ["torchrun", f"--nproc_per_node={gpus}", "-m", "diloco_lightning.app.worker"] + cmd[3:]
            jobs.append(executor.submit(submitit.helpers.CommandFunction(cmd)))
    log.info("submitted %d worker jobs: %s", len(jobs), [j.job_id for j in jobs])
    try:
        while not all(j.done() for j in jobs):
            time.sleep(10)
        for j in jobs:
            j.result()  # raises with the job's stderr if it failed
    finally:
        master.stop(drain=True)
        hub.close()
    return None
