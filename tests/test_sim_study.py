"""What the staleness study needs from the simulator: stopping a diverged run, the outer state's
precision in each version's record, and the gap-aware step fed the round's staleness."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from diloco_lightning.master.config import MasterConfig
from diloco_lightning.sim import SimMaster, SimOptions, Simulator

from support.env import repo_env
from test_sim import N, ROOT, _quad_workers


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("sim-study-token-cache")


def test_a_run_stops_at_an_evaluation_above_stop_above():
    workers = _quad_workers(2, 8)
    config = MasterConfig(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0, aggregation="arrival",
                          norm_ratio=None, norm_global_ratio=None)
    master = SimMaster({"w": torch.zeros(N)}, config)
    losses = iter([5.6, 3.0, 9.0, 1.0, 1.0, 1.0])  # version 0 above the limit does not count
    sim = Simulator(workers, master, delay=1, evaluate=lambda _s: next(losses), eval_points=[0, 4, 8, 12, 16],
                    options=SimOptions(stop_above=5.5))
    result = sim.run()
    assert result.stopped_early and result.outer_steps == 8
    assert [p for p, _ in result.eval_curve] == [0, 4, 8]
    assert result.eval_curve[-1][1] == 9.0
    unstopped = Simulator(_quad_workers(2, 8), SimMaster({"w": torch.zeros(N)}, config), delay=1).run()
    assert not unstopped.stopped_early and unstopped.outer_steps == 16


def test_low_precision_outer_state_is_recorded_per_version():
    config = MasterConfig(outer_optimizer="adam_decay", outer_lr=0.01, aggregation="arrival", norm_ratio=None,
                          outer_options={"state_layout": "naive", "state_dtype": "bfloat16", "betas": (0.9, 0.999)})
    master = SimMaster({"w": torch.zeros(N)}, config)
    Simulator(_quad_workers(2, 3), master, delay=1).run()
    stats = [r["outer_state"] for r in master.records]
    assert len(stats) == 6 and set(stats[0]) == {"exp_avg", "exp_avg_sq"}
    assert all(0.0 <= v[k] <= 1.0 for s in stats for v in s.values() for k in ("floor", "stuck"))
    fp32 = SimMaster({"w": torch.zeros(N)}, MasterConfig(outer_optimizer="adam", outer_lr=0.01, aggregation="arrival"))
    Simulator(_quad_workers(2, 3), fp32, delay=1).run()
    assert all("outer_state" not in r for r in fp32.records)


def test_round_mode_corrects_a_gap_aware_step_with_the_round_staleness():
    """Lockstep rounds at delay 2: the same final state as stepping the optimizer by hand on the
    rounds' means with their staleness (min(round, 2))."""
    from diloco_lightning.outer import GapAware
    from test_sim import C, TARGET

    config = MasterConfig(outer_optimizer="gap_aware", outer_lr=1.0, outer_options={"history": 4},
                          norm_ratio=None, norm_global_ratio=None)
    master = SimMaster({"w": torch.zeros(N)}, config)
    Simulator(_quad_workers(2, 5), master, delay=2).run()
    state = {"w": torch.zeros(N)}
    ref = GapAware(state, lr=1.0, history=4)
    versions = [state["w"].clone()]
    for r in range(5):
        base = versions[max(0, r - 2)]
        ref.step(state, {"w": C * (base - TARGET)}, staleness=min(r, 2))
        versions.append(state["w"].clone())
    torch.testing.assert_close(master.state["w"], state["w"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_gpu_study_script_reduced_cpu_mode(tmp_path, token_cache):
    """benchmarks/gpu_study.sh --cpu: the GPU study's plan, reduced, on the CPU; results flushed per run;
    without a GPU the real one refuses in one line."""
    out = tmp_path / "gpu"
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_study.sh"), "--cpu", str(out)], cwd=tmp_path,
                          env=repo_env(tmp_path, cache=token_cache), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(out.glob("runs/*/results.json"))]
    assert len(results) == 4  # adam_decay, cgad x naive bf16, naive 8-bit; seed 0
    assert all(r["outer_steps"] == 24 and r["sim"]["outer_state_dtype"] in ("bf16", "int8") for r in results)
    assert all(v["outer_state"]["exp_avg_sq"].keys() == {"floor", "stuck"} for r in results
               for v in r["sim"]["versions"] if v["accepted"])
    lines = (out / "summary.md").read_text().splitlines()
    rows = [r for r in lines if r.startswith(("| adam_decay |", "| cgad |"))]
    assert len(rows) == 4
    pairs = [r for r in lines if r.startswith("| cgad − adam_decay, ")]  # paired by seed, one per state
    assert len(pairs) == 2 and all(r.split(" | ")[1] != "—" for r in pairs)
    log = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert len(log) == 4 and not any(x.get("error") for x in log)
    gpu = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_study.sh"), str(tmp_path / "g")], cwd=tmp_path,
                         env={**repo_env(tmp_path, cache=token_cache), "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True,
                         timeout=600)
    assert gpu.returncode == 2 and "no CUDA device" in gpu.stderr
