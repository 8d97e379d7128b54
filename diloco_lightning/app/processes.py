"""A role=all run's worker processes on this machine: each started (``train.py role=worker`` on the
saved configuration, its output in ``nodes/<node>/worker.log``), restarted in place after a crash (its
warm spare told to go when it has one, ``supervise.spare``: app/supervise.py), and stopped with
SIGTERM (each uploads what is pending first)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

from diloco_lightning.app.build import node_id
from diloco_lightning.app.supervise import Spare
from diloco_lightning.app.worker import worker_command, worker_env

__all__ = ["process_env", "restart_worker", "spawn", "start_worker", "stop_workers"]


def start_worker(config_path: Path, rdir: Path, index: int, threads: int, device: str | None,
                  procs: list[subprocess.Popen], logs: list[tuple[Any, Path]]) -> None:
    """Start worker ``index`` (``train.py role=worker`` on the saved config), its output in
    ``nodes/<node>/worker.log``; appended to ``procs`` and ``logs`` as soon as it exists (an
    interrupted start stops the ones already started)."""
    log_path = rdir / "nodes" / node_id(index) / "worker.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fh = open(log_path, "ab")
    logs.append((fh, log_path))
    procs.append(spawn(config_path, index, threads, device, fh))


def process_env(threads: int, device: str | None) -> dict[str, str]:
    env = worker_env(OMP_NUM_THREADS=str(threads))
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    return env


def spawn(config_path: Path, index: int, threads: int, device: str | None, fh: Any) -> subprocess.Popen:
    return subprocess.Popen(worker_command(config_path, index), env=process_env(threads, device), stdout=fh,
                            stderr=subprocess.STDOUT)


def restart_worker(config_path: Path, rdir: Path, index: int, threads: int, device: str | None,
                    procs: list[subprocess.Popen], logs: list[tuple[Any, Path]], line: str,
                    spare: Spare | None = None) -> None:
    """Start worker ``index`` again (it resumes from its checkpoint), in place in ``procs``: its warm
    spare told to go when it has one (``supervise.spare``), else a new process; its log goes on, after
    ``line`` (the restart's)."""
    fh, log_path = logs[index]
    fh.write(f"\n{line}\n".encode())
    fh.flush()
    woken = spare.take() if spare is not None else None
    procs[index] = woken or spawn(config_path, index, threads, device, fh)


def stop_workers(procs: list[subprocess.Popen], timeout: float = 40.0) -> None:
    """SIGTERM to each live worker: it uploads what is pending and exits (status 143); killed
    after ``timeout`` seconds."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
