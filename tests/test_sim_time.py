"""The simulator's clock: a budget of simulated time, Dynamic Local Updates, drawn speeds and traces.

Schedules worked out by hand on a quadratic (each worker's phase of H SGD steps on
``0.5 |w - target|^2`` from ``x`` exports ``C_H (x - target)``, ``C_H = 1 - (1 - eta)^H``), one
inner step of a speed-1 worker lasting one unit of simulated time.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from diloco_lightning.app.config import CONFIG_DIR, ConfigError, register_configs, validate

from diloco_lightning.master.config import MasterConfig
from diloco_lightning.util.options import OptionError
from diloco_lightning.sim import InnerLoop, SimMaster, SimOptions, SimWorker, Simulator
from diloco_lightning.worker.pacing import dylu_inner_steps
from support.env import repo_env

register_configs()
ROOT = Path(__file__).resolve().parents[1]
N, ETA = 5, 0.3
TARGET = torch.linspace(-1.0, 1.0, N)


def C(h: int) -> float:
    return 1.0 - (1.0 - ETA) ** h


def _workers(speeds, h: int, max_steps: int | None = None) -> list[SimWorker]:
    out = []
    for i, v in enumerate(speeds):
        w = torch.nn.Parameter(torch.zeros(N))
        inner = InnerLoop(lambda _b, w=w: 0.5 * ((w - TARGET) ** 2).sum(), torch.optim.SGD([w], lr=ETA),
                          itertools.repeat(None), count_tokens=lambda _b: 1)
        out.append(SimWorker(i, {"w": w}, inner, inner_steps=h, max_steps=max_steps, speed=v))
    return out


def _sim(speeds, h, *, sync="async", aggregation="arrival", max_steps=None, weighting="equal", dylu=None,
         eval_times=(), **opts):
    workers = _workers(speeds, h, max_steps)
    config = MasterConfig(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0, aggregation=aggregation,
                          norm_ratio=None, norm_global_ratio=None, weighting=weighting)
    master = SimMaster({"w": torch.zeros(N)}, config)
    applied: list[str] = []
    sim = Simulator(workers, master, sync=sync, options=SimOptions(**opts), dylu=dylu, eval_times=eval_times,
                    evaluate=lambda state: float(state["w"].sum()),
                    on_version=lambda rec: applied.extend(rec["applied"]))
    return sim, sim.run(), applied, master


def _versions(schedule, weights=None) -> torch.Tensor:
    """By hand: each step applies the (weighted) mean of its deltas ``C_h (V[base] - target)``."""
    versions = [torch.zeros(N, dtype=torch.float64)]
    t = TARGET.double()
    for step in schedule:
        ws = [1.0] * len(step) if weights is None else weights.pop(0)
        mean = sum(w * C(h) * (versions[base] - t) for w, (_, base, h) in zip(ws, step)) / sum(ws)
        versions.append(versions[-1] - mean)
    return versions[-1]


def test_time_budget_runs_every_phase_that_ends_in_time():
    """speeds [1, 1/2], H = 2, async arrivals, max_time = 9, no step cap. w0's phases end at 2, 4, 6, 8
    (the one from 8 would end at 10: not run), w1's at 4, 8 (the next at 12: not run). In time order,
    ties by queue order: t=2 w0/1 (v0); t=4 w1/1 (v0), w0/2 (v1); t=6 w0/3 (v3); t=8 w1/2 (v2), w0/4 (v4).
    Evaluations at 0, 3, 6, 9 see the versions published by then (6: v4, published at 6)."""
    sim, result, applied, master = _sim([1.0, 0.5], 2, max_time=9.0, eval_times=[0.0, 3.0, 6.0, 9.0])
    schedule = [[("w0/1", 0, 2)], [("w1/1", 0, 2)], [("w0/2", 1, 2)], [("w0/3", 3, 2)], [("w1/2", 2, 2)], [("w0/4", 4, 2)]]
    assert applied == [a for step in schedule for a, _, _ in step]
    torch.testing.assert_close(result.final_state["w"].double(), _versions(schedule), rtol=1e-5, atol=1e-6)
    assert [r["time"] for r in master.records] == [2.0, 4.0, 4.0, 6.0, 8.0, 8.0]
    assert result.deltas == 6 and result.sim_time == 8.0 and [w.steps for w in sim.workers] == [8, 4]
    assert result.eval_times == [0.0, 3.0, 6.0, 9.0]
    assert [s for s, _ in result.eval_curve] == [0, 1, 4, 6]
    assert result.eval_tokens == [0, 2, 8, 12]  # one token per step: the tokens of the deltas delivered by then
    # a step cap still binds: 3 phases of w0 at most
    sim, result, applied, _ = _sim([1.0, 0.5], 2, max_time=9.0, max_steps=6)
    assert [w.steps for w in sim.workers] == [6, 4] and result.deltas == 5


def test_lockstep_under_a_time_budget_waits_for_the_slowest():
    """Lockstep rounds (delay 0), speeds [1, 1/4], H = 2: every round lasts 8 (the slow worker's phase).
    max_time = 17: rounds close at 8 and 16; nobody starts a phase at 16 (18 > 17, 24 > 17). max_time = 20:
    w0's phase 16 -> 18 runs but w1's cannot: the round is never complete and is not applied."""
    sim, result, applied, master = _sim([1.0, 0.25], 2, sync="lockstep", aggregation="round", max_time=17.0)
    schedule = [[("w0/1", 0, 2), ("w1/1", 0, 2)], [("w0/2", 1, 2), ("w1/2", 1, 2)]]
    assert [r["time"] for r in master.records] == [8.0, 16.0] and result.outer_steps == 2
    torch.testing.assert_close(result.final_state["w"].double(), _versions(schedule), rtol=1e-5, atol=1e-6)
    assert [w.steps for w in sim.workers] == [4, 4]
    sim, result, _, master = _sim([1.0, 0.25], 2, sync="lockstep", aggregation="round", max_time=20.0)
    assert result.outer_steps == 2 and result.deltas == 5 and [w.steps for w in sim.workers] == [6, 4]
    torch.testing.assert_close(result.final_state["w"].double(), _versions(schedule), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("min_steps,seconds", [(None, None), (4, None), (None, 4.0)])
def test_dylu_sets_each_workers_h_with_the_pacing_rule(min_steps, seconds):
    """speeds [1, 1, 1, 1/4], H_max = 8, async arrivals, max_time 64. Every first phase has H_max (no rate
    measured yet); then each worker's H is the product's rule (worker/pacing.py) on its own last phase's
    rate and the live peers': the slow worker's 1/4 against the fast ones' 1."""
    dylu = {"max_steps": 8, "min_steps": min_steps, "seconds": seconds}
    sim, result, _, _ = _sim([1.0, 1.0, 1.0, 0.25], 8, dylu=dylu, max_time=64.0)

    def rule(own):
        return dylu_inner_steps(own, [1.0, 1.0, 1.0], max_steps=8, min_steps=min_steps, seconds=seconds)

    expected = []
    for speed in (1.0, 1.0, 1.0, 0.25):  # by hand: phases while they end by 64
        hs, t = [8], 8 / speed
        while t + rule(speed) / speed <= 64:
            hs.append(rule(speed))
            t += rule(speed) / speed
        expected.append(hs)
    assert [w.phase_lengths for w in sim.workers] == expected
    if min_steps is None and seconds is None:
        assert expected == [[8] * 8] * 3 + [[8, 2, 2, 2, 2]]
    assert sum(w.steps for w in sim.workers) == sum(map(sum, expected))


def test_dylu_in_lockstep_with_token_weighting():
    """Lockstep rounds, speeds [1, 1/4], DyLU H_max = 8, weighting=tokens (one token per step). Round 1:
    both H = 8 from v0 (ends at 32). Then w0 keeps 8 (rate 1, the fastest) and w1 takes round(8 * 1/4) = 2:
    both end at 40, and round 2 is (8 C_8 + 2 C_2) / 10 (v1 - target)."""
    sim, result, _, master = _sim([1.0, 0.25], 8, sync="lockstep", aggregation="round", weighting="tokens",
                                  dylu={"max_steps": 8}, max_time=40.0)
    assert [w.phase_lengths for w in sim.workers] == [[8, 8], [8, 2]]
    assert [r["time"] for r in master.records] == [32.0, 40.0]
    schedule = [[("w0/1", 0, 8), ("w1/1", 0, 8)], [("w0/2", 1, 8), ("w1/2", 1, 2)]]
    expected = _versions(schedule, weights=[[8.0, 8.0], [8.0, 2.0]])
    torch.testing.assert_close(result.final_state["w"].double(), expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(expected.float(), _versions(schedule).float())  # equal weights would differ


def test_a_trace_changes_phase_durations():
    """One worker, H = 2, speed 1, then 1/2 from t = 3, then 2 from t = 7: phases 0 -> 2; 2 -> 3 (1 step) and
    3 -> 5 (1 step at 1/2); 5 -> 7 (1 step) and 7 -> 7.5; 7.5 -> 8.5."""
    sim, result, _, master = _sim([1.0], 2, max_steps=8, traces=[[[3.0, 0.5], [7.0, 2.0]]])
    assert [r["time"] for r in master.records] == [2.0, 5.0, 7.5, 8.5]
    assert sim.duration(0, 2, start=2.0) == 3.0 and sim.duration(0, 1, start=8.0, steps=4) == 2.0
    # with a time budget of 7.6 the fourth phase (to 8.5) is not run
    _, result, _, _ = _sim([1.0], 2, traces=[[[3.0, 0.5], [7.0, 2.0]]], max_time=7.6)
    assert result.deltas == 3 and result.sim_time == 7.5


def test_drawn_speeds_are_seeded_per_worker():
    law = {"law": "lognormal", "sigma": 0.5, "seed": 3}
    opts = SimOptions(speeds=[2.0], speed_law=law).validate(3)
    assert [opts.speed(i) for i in range(3)] == [2.0 * math.exp(0.5 * random.Random(f"3:speed_law:{i}").gauss(0.0, 1.0))
                                                 for i in range(3)]
    assert [opts.speed(i) for i in range(3)] != [SimOptions(speed_law={**law, "seed": 4}).speed(i) for i in range(3)]
    uni = SimOptions(speed_law={"law": "uniform", "low": 0.25, "high": 1.0, "seed": 0}).validate(8)
    assert all(0.25 <= uni.speed(i) <= 1.0 for i in range(8)) and len({uni.speed(i) for i in range(8)}) == 8


@pytest.mark.parametrize("opts,option", [
    ({"max_time": 0}, "max_time"), ({"max_time": float("nan")}, "max_time"), ({"max_time": "1h"}, "max_time"),
    ({"speed_law": {"law": "gamma"}}, "speed_law"), ({"speed_law": {"law": "lognormal", "sigma": -1}}, "speed_law"),
    ({"speed_law": {"law": "uniform", "low": 2, "high": 1}}, "speed_law"),
    ({"speed_law": {"law": "lognormal", "sigma": 1, "mu": 0}}, "speed_law"),
    ({"speed_law": {"law": "lognormal", "sigma": 1, "seed": 0.5}}, "speed_law"),
    ({"traces": [None]}, "traces"), ({"traces": [None, [[2, 1.0], [1, 2.0]]]}, "traces"),
    ({"traces": [None, [[1, 0.0]]]}, "traces"), ({"traces": [None, [1, 2]]}, "traces"),
])
def test_bad_clock_values_are_refused_naming_the_option(opts, option):
    with pytest.raises(OptionError) as e:
        SimOptions(**opts).validate(2)
    assert e.value.option == option and len(str(e.value).splitlines()) == 1


FAST = ["recipe=tiny", "launch=sim", "data.tokenizer=byte", "data.max_bytes=300000", "data.seq_len=32",
        "data.batch_size=4", "data.val_batches=2", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
        "model.n_kv_heads=1", "model.ffn_hidden=64", "trainer.log_every_n_steps=4"]


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_train_py_time_budget_dylu_law_and_trace(tmp_path):
    """train.py launch=sim composes the clock's options (a law, a trace, a time budget) and DyLU, and
    results.json tells what happened: evaluations evenly over the budget, each worker's H per phase."""
    cmd = [sys.executable, str(ROOT / "train.py"), *FAST, "workers=2", "sim.speeds=[1,0.25]", "sim.max_time=24",
           "sim.speed_law={law: uniform, low: 1, high: 1, seed: 0}", "sim.traces=[null,[[16,0.5]]]",
           "diloco.sync=async", "master.aggregation=arrival", "diloco.inner_steps=auto", "diloco.dylu_steps=4",
           "trainer.max_steps=100", "launch.eval_points=3", f"run_root={tmp_path / 'runs'}", "run_id=t"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=repo_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "runs" / "t" / "results.json").read_text())
    sim = res["sim"]
    # w0: 6 phases of 4 (to 24); w1: 4 steps at 1/4 (to 16, rate 1/4: H = round(4 * 1/4) = 1), 1 step at 1/2
    # (16 -> 18, rate 1/2: H = 2), 2 steps (18 -> 22); the next would end at 26
    assert sim["phase_steps"] == [[4] * 6, [4, 1, 2]] and sim["max_time"] == 24
    assert [t for t, _ in sim["eval_curve_time"]] == [0.0, 8.0, 16.0, 24.0] and sim["sim_time"] == 24.0
    assert sim["traces"] == [None, [[16.0, 0.5]]] and sim["speeds"] == [1.0, 0.25]
    assert res["deltas_accepted"] == 9 and sim["eval_curve_tokens"][-1][0] == res["tokens"] == 31 * 4 * 32


@pytest.mark.parametrize("override,key", [("sim.max_time=0", "sim.max_time"),
                                          ("sim.speed_law={law: gamma}", "sim.speed_law"),
                                          ("sim.traces=[[[1,-1]]]", "sim.traces")])
def test_config_refuses_bad_clock_values_in_one_line(override, key):
    """Through the real Hydra composition and the product's checks (what train.py prints in one line)."""
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        cfg = compose("train", overrides=["recipe=tiny", "launch=sim", override])
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert e.value.key == key and len(str(e.value).splitlines()) == 1


def test_a_run_with_no_step_cap_needs_a_time_budget():
    """Without max_steps and without max_time a worker would start phases forever: refused up front."""
    workers = _workers([1.0, 1.0], 2, None)
    config = MasterConfig(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0, norm_ratio=None,
                          norm_global_ratio=None)
    with pytest.raises(ValueError, match="needs a time budget"):
        Simulator(workers, SimMaster({"w": torch.zeros(N)}, config), sync="async", options=SimOptions())
