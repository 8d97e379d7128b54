"""``launch=submitit`` for real: a one-node SLURM cluster from Debian's packages (the
``slurm_cluster`` fixture), ``python train.py recipe=tiny launch=submitit`` against it end to end.
Also: without submitit, or without SLURM, the command ends in one line naming the fix."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from support.env import repo_env

ROOT = Path(__file__).resolve().parents[1]
FAST = ["data.max_bytes=1000000", "data.seq_len=64", "data.vocab_size=1024", "trainer.log_every_n_steps=4"]
SMALL_JOBS = ["launch.submitit.gpus_per_node=0", "launch.submitit.cpus_per_task=1", "launch.submitit.mem_gb=2"]


@pytest.mark.slow
def test_a_run_on_slurm_writes_results_and_resumes_a_cancelled_worker(tmp_path, slurm_cluster):
    """Jobs submitted (a master and 2 workers, each a SLURM job); worker w1's job is cancelled
    mid-run (scancel) and the launcher submits it again: it resumes from its checkpoint; the run
    ends with results.json and the summary."""
    cmd = [sys.executable, str(ROOT / "train.py"), "recipe=tiny", "launch=submitit", *SMALL_JOBS, "trainer.max_steps=48",
           f"run_root={tmp_path / 'runs'}", *FAST]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=repo_env(tmp_path, base=slurm_cluster.env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600
        job = None
        while job is None and time.monotonic() < deadline and proc.poll() is None:
            found = [re.search(r"w1=(\d+)", line) for line in lines if "[slurm] submitted" in line]
            job = found[0].group(1) if found and found[0] else None
            time.sleep(1)
        assert job, "".join(lines)
        states = {name: state for _, name, state in slurm_cluster.jobs()}
        assert states and all(n.startswith("diloco-") for n in states), states
        (run,) = (tmp_path / "runs").iterdir()
        progress = run / "nodes" / "w1" / "progress.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:  # cancel w1 once it checkpointed a boundary
            steps = [json.loads(x)["step"] for x in progress.read_text().splitlines()] if progress.exists() else []
            if steps and max(steps) >= 12:
                break
            time.sleep(1)
        subprocess.run(["scancel", job], env=slurm_cluster.env, check=True)
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    out = "".join(lines)
    assert proc.returncode == 0, out[-6000:]
    assert re.search(f"worker w1 job {job} ended .*; submitted again as job", out), out[-4000:]
    assert "sacct" not in out and "Traceback" not in out
    assert "done in" in out and "[master] outer_step" in out
    results = json.loads((run / "results.json").read_text())
    assert results["workers"] == 2 and results["max_steps"] == 48 and results["outer_steps"] >= 4
    summary = json.loads((run / "nodes" / "w1" / "summary.json").read_text())
    assert summary["steps"] == 48 and summary["launch"]["from_step"] >= 8  # resumed, not restarted
    ckpt = torch.load(run / "nodes" / "w1" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 48
    assert list((run / "slurm").glob("*_log.out"))  # submitit's job logs


def test_submitit_missing_is_one_line(tmp_path):
    """Without submitit importable: one line naming the fix, no run folder."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "submitit.py").write_text("raise ImportError('no submitit here')\n")
    env = repo_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(ROOT)])
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "recipe=tiny", "launch=submitit",
                           f"run_root={tmp_path / 'runs'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and 1 <= len(lines) <= 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "launch=submitit needs the submitit package: pip install submitit" in lines[0]
    assert not (tmp_path / "runs").exists()
