"""``launch=submitit``: the run as SLURM jobs, one for the master and one per worker.

    pip install submitit
    python train.py recipe=llama1b_tau8 launch=submitit launch.submitit.partition=gpu \\
        hub=hf hub.url=hf://org/llama1b-tau8

The launching process (a login node) prepares the data once, saves the run's config, submits
the jobs through submitit (``sbatch``) and watches them: it prints the master's rounds and the
workers' progress as a local run does, and when every worker is done it stops the master (a
final round) and writes ``results.json`` and the summary. A worker job that ends without
finishing (cancelled, preempted, timed out, its node lost) is submitted again and resumes from
its checkpoint (up to ``RESUBMITS`` times per worker); a worker that fails is an error naming its
log. Each job runs exactly what ``role=all`` runs locally (``python -m
diloco_lightning.app.worker --config <run_dir>/config.yaml --node-index i``, and ``python -m
diloco_lightning.app.slurm master --config ...``), so a SLURM run and a local one differ only in
where the parts execute. The run folder must be on a filesystem the compute nodes see (or use
an ``hf://`` hub and a shared ``run_root``). A multi-GPU worker is a job with
``gpus_per_node > 1`` whose command is wrapped in ``torchrun``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from diloco_lightning.app.errors import RunError

log = logging.getLogger(__name__)

__all__ = ["run_submitit", "RESUBMITS", "main"]

#: times a worker job that ended unfinished (cancelled, preempted, timed out) is submitted again
RESUBMITS = 3
#: SLURM states of a job that ended without finishing its work (it resumes when submitted again)
UNFINISHED = ("CANCELLED", "PREEMPTED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "REVOKED")
_POLL = 2.0
#: seconds the worker jobs may take to end after the master job ended by itself (``until_finished``: it ends
#: once every worker marked its claim finished, a moment before their jobs exit)
_WORKER_GRACE = 120.0


def _submitit():
    import shutil

    try:
        import submitit
    except ImportError:
        raise RunError("launch=submitit needs the submitit package: pip install submitit (or use launch=local)") from None
    if shutil.which("sbatch") is None:
        raise RunError("launch=submitit submits SLURM jobs, but sbatch is not on PATH: run it where SLURM is (a login "
                       "node), or use launch=local")
    return submitit


def _state(job) -> str:
    """The job's SLURM state: squeue's while it lists the job, else submitit's (sacct)."""
    out = subprocess.run(["squeue", "-h", "-j", str(job.job_id), "-o", "%T"], capture_output=True, text=True)
    state = out.stdout.strip().split("\n")[0].strip() if out.returncode == 0 else ""
    if state:
        return state
    if job.paths.result_pickle.exists():
        return "COMPLETED" if _job_result(job)[0] else "FAILED"
    return "UNKNOWN"  # gone from squeue without a result: submitit's own state would ask sacct (often off)


def _job_result(job) -> tuple[bool, str]:
    """(succeeded, what it said): the command's outcome from submitit's result file (a job that
    ended without one, killed or cancelled, did not succeed: its stderr's tail is what it said)."""
    if not job.paths.result_pickle.exists():
        try:
            return False, job.paths.stderr.read_text(errors="replace")[-3000:]
        except OSError:
            return False, ""
    try:
        job.result()
        return True, ""
    except Exception as e:  # noqa: BLE001 - submitit raises the job's failure with its stderr
        return False, str(e)[-3000:]


class _Jobs:
    """The run's jobs: submitted through one executor, resubmitted when they end unfinished."""

    def __init__(self, cfg: DictConfig, rdir: Path, config_path: Path) -> None:
        from diloco_lightning.app.config import to_container

        submitit = _submitit()
        self.submitit, self.cfg, self.config_path = submitit, cfg, config_path
        opts = to_container(cfg.launch.submitit)
        self.gpus = int(opts.pop("gpus_per_node", 1 if cfg.trainer.accelerator in ("gpu", "cuda") else 0) or 0)
        self.executor = submitit.AutoExecutor(folder=str(rdir / "slurm"), cluster="slurm")
        params = {k: v for k, v in opts.items() if v is not None}
        params.setdefault("timeout_min", max(1, int(-(-float(cfg.launch.timeout) // 60))))  # submitit's default is 5 min
        partition = params.pop("partition", None)
        self.executor.update_parameters(
            gpus_per_node=self.gpus, tasks_per_node=1, nodes=1, slurm_job_name=f"diloco-{cfg.run_id}"[:64],
            **({"slurm_partition": partition} if partition else {}), **params,
        )
        self.resubmits = [0] * int(cfg.workers)

    def _submit(self, cmd: list[str]):
        return self.executor.submit(self.submitit.helpers.CommandFunction(cmd))

    def master(self):
        """The master's job: CPU only (it needs no GPU: the outer step runs on CPU buffers)."""
        self.executor.update_parameters(gpus_per_node=0)
        try:
            return self._submit([sys.executable, "-m", "diloco_lightning.app.slurm", "master", "--config",
                                 str(self.config_path)])
        finally:
            self.executor.update_parameters(gpus_per_node=self.gpus)

    def worker(self, i: int):
        from diloco_lightning.app.worker import worker_command

        cmd = worker_command(self.config_path, i)
        if self.gpus > 1:
            cmd = ["torchrun", f"--nproc_per_node={self.gpus}", "-m", "diloco_lightning.app.worker"] + cmd[3:]
        return self._submit(cmd)


def run_submitit(cfg: DictConfig) -> dict[str, Any]:
    """Run the whole run as SLURM jobs (see the module docstring); returns the results."""
    from diloco_lightning.app.build import Evaluator, build_datamodule, node_id, open_run_hub, run_dir
    from diloco_lightning.app.console import log_to_file
    from diloco_lightning.app.launches import Launches
    from diloco_lightning.app.local import finish_run, finished_message, finished_results, print_round

    _submitit()  # before anything is made: missing submitit is one line
    logging.getLogger("submitit").setLevel(logging.ERROR)  # its sacct retries where accounting is off
    rdir = run_dir(cfg)
    done = finished_results(cfg, rdir)
    if done is not None:
        print(finished_message(cfg, rdir, done), flush=True)
        return done
    hub = open_run_hub(cfg)  # a folder hub is created here, before the master job opens it; a missing one refused
    rdir.mkdir(parents=True, exist_ok=True)
    log_to_file(rdir / "train.log")
    launches = Launches(rdir)
    print(f"run {cfg.run_id} on SLURM: 1 master job and {cfg.workers} worker jobs; {cfg.trainer.max_steps} steps per "
          f"worker; job logs in {rdir / 'slurm'}", flush=True)
    dm = build_datamodule(cfg)
    dm.prepare_data()  # the tokenizer and token cache, once, before the jobs read them
    config_path = rdir / "config.yaml"
    OmegaConf.save(cfg, config_path, resolve=True)
    jobs = _Jobs(cfg, rdir, config_path)
    master_job = jobs.master()
    workers = [jobs.worker(i) for i in range(cfg.workers)]
    print(f"[slurm] submitted master job {master_job.job_id}, worker jobs "
          + ", ".join(f"{node_id(i)}={j.job_id}" for i, j in enumerate(workers)), flush=True)
    metrics = rdir / "master" / "metrics.jsonl"
    seen = _line_count(metrics)  # rounds of earlier launches are not this launch's
    rounds: list[dict] = []
    outcome = "failed"
    master_done: float | None = None  # when the master job was first seen COMPLETED
    try:
        while True:
            seen = _print_new_rounds(metrics, seen, rounds, print_round)
            states = [_state(j) for j in workers]
            for i, (job, state) in enumerate(zip(workers, states)):
                if state in UNFINISHED or (state == "FAILED" and _exit_143(job)):
                    how = state if state in UNFINISHED else "by SIGTERM (cancelled or preempted; status 143)"
                    if jobs.resubmits[i] >= RESUBMITS:
                        raise RunError(f"worker {node_id(i)} ended {how} {RESUBMITS + 1} times; see {rdir / 'slurm'}")
                    jobs.resubmits[i] += 1
                    workers[i] = jobs.worker(i)
                    print(f"[slurm] worker {node_id(i)} job {job.job_id} ended {how}; submitted again as job "
                          f"{workers[i].job_id} (it resumes from its checkpoint)", flush=True)
                elif state in ("FAILED", "OUT_OF_MEMORY") or (state == "COMPLETED" and not _job_result(job)[0]):
                    raise RunError(f"worker {node_id(i)} job {job.job_id} {state.lower()}: {_job_result(job)[1]}")
            if all(s == "COMPLETED" for s in [_state(j) for j in workers]):
                break
            master_state = _state(master_job)
            if master_state == "COMPLETED" and master_done is None:
                # until_finished: the master ends once every worker marked its claim finished, a moment
                # before their jobs end (the final install, the process exit); wait for them, bounded
                master_done = time.monotonic()
            if master_state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "UNKNOWN", "COMPLETED") or (
                    master_done is not None and time.monotonic() - master_done > _WORKER_GRACE):
                raise RunError(f"the master job {master_job.job_id} ended {master_state} before the workers: "
                               f"{_job_result(master_job)[1] or 'see ' + str(rdir / 'slurm')}")
            time.sleep(_POLL)
        # the workers are done: the master's final round (SIGTERM drains what is pending), then results
        subprocess.run(["scancel", "--signal=TERM", "--full", str(master_job.job_id)], capture_output=True)
        deadline = time.monotonic() + 120
        while _state(master_job) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") and time.monotonic() < deadline:
            time.sleep(_POLL)
        _print_new_rounds(metrics, seen, rounds, print_round)
        outcome = "finished"
        return finish_run(cfg, rdir, hub, dm, Evaluator(cfg, dm), launches, rounds, [])
    except BaseException:
        for job in [master_job, *workers]:
            if _state(job) in ("PENDING", "RUNNING", "CONFIGURING"):
                subprocess.run(["scancel", "--signal=TERM", "--full", str(job.job_id)], capture_output=True)
        raise
    finally:
        if outcome != "finished":
            launches.end(outcome, max_steps=int(cfg.trainer.max_steps))


def _exit_143(job) -> bool:
    """A job whose command ended with 143 (SIGTERM: preempted or cancelled, its work not done)."""
    return "143" in _job_result(job)[1]


def _line_count(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


def _print_new_rounds(path: Path, seen: int, rounds: list[dict], show) -> int:
    from diloco_lightning.app.local import is_round

    try:
        lines = path.read_text().splitlines()
    except OSError:
        return seen
    for line in lines[seen:]:
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if isinstance(m, dict) and is_round(m):
            rounds.append(m)
            show(m)
    return len(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m diloco_lightning.app.slurm master --config <run_dir>/config.yaml``: the run's master
    as a SLURM job (serves rounds until SIGTERM, then drains; exit status of ``serve_command``)."""
    import argparse

    from diloco_lightning.app.console import configure_console
    from diloco_lightning.app.serving import run_master

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("role", choices=["master"])
    ap.add_argument("--config", required=True)
    args = ap.parse_args(argv)
    configure_console(whole_run=False)
    cfg = OmegaConf.load(args.config)
    assert isinstance(cfg, DictConfig), f"{args.config} must hold a mapping"
    cfg.role = "master"
    return run_master(cfg)


if __name__ == "__main__":
    sys.exit(main())
