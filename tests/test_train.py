"""``train.py`` end to end: real Hydra, a real master, real worker processes, a folder hub.

The runs are shortened (few steps, a small corpus) but otherwise exactly what a user runs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# Small and fast: 2 workers, H=8, a 1 MB slice of the stdlib, short sequences.
FAST = ["data.max_bytes=1000000", "data.seq_len=64", "data.vocab_size=1024", "trainer.log_every_n_steps=4"]


def _train(tmp_path: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["DILOCO_CACHE_DIR"] = str(tmp_path / "cache")  # tokenizer/token cache: private to the test
    env["DILOCO_CACHE"] = str(tmp_path / "hubcache")
    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"run_root={tmp_path / 'runs'}", *FAST]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_multirun_trains_and_summarizes(tmp_path):
    """`python train.py -m recipe=tiny outer=nesterov,cgad`: two jobs, each trains (loss goes down),
    writes results.json; the summary command gives one row per outer optimizer and a PNG."""
    proc = _train(tmp_path, "-m", "recipe=tiny", "outer=nesterov,cgad", "trainer.max_steps=32")
    sweep = tmp_path / "runs" / "multirun"
    results = sorted(sweep.rglob("results.json"))
    assert len(results) == 2, proc.stdout[-2000:]
    by_outer = {}
    for p in results:
        r = json.loads(p.read_text())
        by_outer[r["outer"]] = r
        assert r["workers"] == 2 and r["inner_steps"] == 8 and r["tau"] == "0"
        assert r["outer_steps"] == 4  # 32 steps / H=8, one round per boundary (quorum of both workers)
        assert r["deltas_accepted"] == 8 and r["deltas_rejected"] == 0
        assert r["bytes_sent"] > 0 and r["tokens"] == 2 * 32 * 8 * 64
        curve = r["train_curve"]
        assert curve[0][1] > curve[-1][1] + 0.5, curve  # the loss goes down
        assert math.isfinite(r["eval_loss"]) and r["eval_loss"] < r["chance_loss"] and not r["diverged"]
        assert r["recipe"] == "tiny"
        # the global model evaluated along the run (outer steps 0 .. 4), ending at the final eval loss
        steps = [s for s, _ in r["eval_curve"]]
        assert steps[0] == 0 and steps[-1] == 4 and steps == sorted(steps)
        assert r["eval_curve"][-1][1] == r["eval_loss"] and r["eval_curve"][0][1] > r["eval_loss"]
        # run folders derive from the command line, never from timestamps
        assert f"outer={r['outer']}," in p.parent.name and "recipe=tiny" in p.parent.name
    assert set(by_outer) == {"nesterov", "cgad"}
    assert "done in" in proc.stdout and "[master] outer_step 4" in proc.stdout

    out = subprocess.run(
        [sys.executable, "-m", "diloco_lightning.summarize", str(sweep)], capture_output=True, text=True, check=True
    ).stdout
    rows = [l for l in out.splitlines() if l.startswith("| nesterov") or l.startswith("| cgad")]
    assert len(rows) == 2 and all(" | 0 | fixed | " in r and " | 1 | " in r for r in rows), out
    assert (sweep / "summary.md").is_file() and (sweep / "summary.csv").is_file()
    assert (sweep / "loss_tau0.png").stat().st_size > 1000


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_resume_continues_run_and_data_position(tmp_path):
    """A finished run prints the exact command that trains it further, and that command, pasted as
    printed, resumes the same run (raising trainer.max_steps does not change the run's identity):
    every worker from its checkpoint (data position, DiLoCo counters, anchor), the master from the
    hub's published state; results.json counts the whole run, the last launch's figures beside."""
    _train(tmp_path, "recipe=tiny", "trainer.max_steps=16")
    (run,) = (tmp_path / "runs").iterdir()
    assert "recipe=tiny" in run.name and "max_steps" not in run.name
    first = json.loads((run / "results.json").read_text())
    assert first["outer_steps"] == 2 and first["launches"] == 1
    ckpt = torch.load(run / "nodes" / "w0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 16

    again = _train(tmp_path, "recipe=tiny", "trainer.max_steps=16")
    assert f"run {run.name} is already finished" in again.stdout and "[master]" not in again.stdout
    lines = again.stdout.splitlines()
    printed = lines[[i for i, line in enumerate(lines) if "raise trainer.max_steps" in line][0] + 1].strip()
    assert "trainer.max_steps=32" in printed and "run_id" not in printed, printed
    env = dict(os.environ, DILOCO_CACHE_DIR=str(tmp_path / "cache"), DILOCO_CACHE=str(tmp_path / "hubcache"))
    proc = subprocess.run(printed, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run.name]  # the same run, not a new one
    second = json.loads((run / "results.json").read_text())
    assert second["outer_steps"] == 4  # continued from outer step 2, not restarted
    assert second["deltas_rejected"] == 0 and second["max_steps"] == 32
    # whole-run counters, the last launch's beside them
    assert second["launches"] == 2 and second["deltas_accepted"] == 8
    last = second["last_launch"]
    assert last["deltas_accepted"] == 4 and last["from_step"] == 16
    assert second["tokens"] == 2 * 32 * 8 * 64 and last["tokens"] == 2 * 16 * 8 * 64
    assert second["wall_seconds"] > last["wall_seconds"] > 0
    assert abs(second["tokens_per_second"] - second["tokens"] / second["wall_seconds"]) < 1e-6
    assert all(w["deltas_sent"] == 4 and w["launch"]["deltas_sent"] == 2 for w in second["workers_summary"])
    ckpt = torch.load(run / "nodes" / "w0" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 32
    dm_state = ckpt["TextDataModule"]
    assert dm_state["position"] == 32 * 8  # samples consumed: 16 before the stop + 16 after, none repeated
    log = (run / "nodes" / "w0" / "worker.log").read_text()
    assert "Restoring states from the checkpoint" in log or "Restored all states" in log

    # the same command again: the run is finished; it says so and keeps its results
    before = (run / "results.json").read_bytes()
    third = subprocess.run(printed, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert f"run {run.name} is already finished" in third.stdout and "trainer.max_steps=64" in third.stdout
    assert "[master]" not in third.stdout  # nothing was started
    assert (run / "results.json").read_bytes() == before
    assert second["recipe"] == "tiny" and math.isfinite(second["final_train_loss"])


@pytest.mark.slow
def test_trains_on_an_s3_bucket(tmp_path, s3_endpoint, s3_bucket):
    """`python train.py recipe=tiny hub.url=s3://bucket/run hub.endpoint_url=...` against the loopback S3 server:
    the master and the worker processes meet only through the bucket."""
    import boto3

    proc = _train(tmp_path, "recipe=tiny", "run_id=s3", f"hub.url=s3://{s3_bucket}/run", f"hub.endpoint_url={s3_endpoint}",
                  "trainer.max_steps=16", "launch.eval_points=0")
    r = json.loads((tmp_path / "runs" / "s3" / "results.json").read_text())
    assert r["outer_steps"] == 2 and r["deltas_accepted"] == 4 and r["deltas_rejected"] == 0, proc.stdout[-2000:]
    assert math.isfinite(r["eval_loss"]) and f"hub s3://{s3_bucket}/run" in proc.stdout
    keys = [o["Key"] for o in boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
            .list_objects_v2(Bucket=s3_bucket, Prefix="run/").get("Contents", [])]
    assert "run/global/manifest.json" in keys and not (tmp_path / "runs" / "s3" / "hub").exists()


@pytest.mark.slow
def test_trains_on_the_hub_with_a_repository_per_node(tmp_path):
    """`hub=hf hub.layout=per_node` against the loopback Hub: the master's repository and one per worker."""
    from support.hf_server import FakeHubServer

    with FakeHubServer() as server:
        proc = _train(tmp_path, "recipe=tiny", "run_id=hfnodes", "hub=hf", "hub.url=hf://org/run", "hub.create=true",
                      "hub.layout=per_node", f"hub.endpoint_url={server.endpoint}", "trainer.max_steps=16",
                      "launch.eval_points=0")
        repos = sorted(server.repos)
        master_files = server.files("org/run")
        w0_files = server.files("org/run-w0")
    r = json.loads((tmp_path / "runs" / "hfnodes" / "results.json").read_text())
    assert r["outer_steps"] == 2 and r["deltas_accepted"] == 4 and r["deltas_rejected"] == 0, proc.stdout[-2000:]
    assert repos == ["org/run", "org/run-w0", "org/run-w1"]
    assert "global/manifest.json" in master_files and not any(p.startswith("nodes/") for p in master_files)
    assert any(p.startswith("nodes/w0/") for p in w0_files) and not any(p.startswith("global/") for p in w0_files)
