"""benchmarks/scaling.py's plan and arithmetic, which docs/scaling.md rests on: G per seed against one worker
and data-parallel, every tuned arm's grid extended until its best point is interior, seeds at the tuned point,
the equal-tokens arm at one worker's tuned lr, a curve's point at the setting's own value being the main
grid's run. No training: results are written by hand."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from support.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def scaling():
    yield from load_benchmark("scaling")


def _args(root: Path, **kw) -> argparse.Namespace:
    base = dict(setting="quick", k="2", arms="one,dp,sgd,one_tokens", curves="", seeds=3, jobs=1, root=str(root),
                plan=False, report=False, out=None)
    return argparse.Namespace(**{**base, **kw})


def _done(sc, j: dict, loss: float) -> None:
    d = sc.root / "runs" / j["id"]
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.json").write_text(json.dumps({"eval_loss": loss, "diverged": False}))


def test_g_is_the_share_of_data_parallels_gain_per_seed(scaling):
    g, half, n = scaling.gain({0: 3.0, 1: 3.0}, {0: 2.0, 1: 2.5}, {0: 2.5, 1: 2.75})
    assert (g, n) == (0.5, 2) and half == 0.0
    assert scaling.gain({0: 3.0}, {0: 2.0}, {0: 3.5})[0] == -0.5  # worse than one worker: negative
    assert scaling.gain({0: 3.0}, {0: 2.0}, {0: math.inf})[0] == -math.inf  # a diverged seed


def test_each_arms_grid_brackets_its_best_point_then_its_seeds_run_there(scaling, tmp_path):
    sc = scaling.Scaling(_args(tmp_path))
    jobs = sc.tuning_jobs()
    by_arm = {a: [j for j in jobs if j["arm"] == a] for a in ("one", "dp", "sgd")}
    assert all(len(v) == 3 for v in by_arm.values())  # 3 points each, seed 0
    assert all(j["seed"] == 0 for j in jobs) and sc.seed_jobs() == []  # no seeds before the tuning is done
    for arm, js in by_arm.items():  # the smallest value wins everywhere: one more point below
        for j in js:
            _done(sc, j, 2.0 + j["i"])
    grown = sc.grid("sgd", 2)
    assert len(grown) == 4 and grown[0] == by_arm["sgd"][0]["i"] - 1
    _done(sc, sc.job("sgd", 2, grown[0], 0), 5.0)  # the new point loses: the grid is settled, its best interior
    assert sc.best("sgd", 2) == grown[1]
    seeds = [j for j in sc.seed_jobs() if j["arm"] == "sgd"]
    assert [(j["i"], j["seed"]) for j in seeds] == [(grown[1], s) for s in range(3)]


def test_the_equal_tokens_arm_is_one_worker_k_times_longer_at_its_tuned_lr(scaling, tmp_path):
    sc = scaling.Scaling(_args(tmp_path))
    for j in sc.tuning_jobs():
        if j["arm"] == "one":
            _done(sc, j, {-1: 3.0, 0: 2.0, 1: 2.5}[j["i"]])  # the middle lr wins
    tokens = [j for j in sc.seed_jobs() if j["arm"] == "one_tokens"]
    assert len(tokens) == 3 and all(j["i"] == 0 and j["k"] == 2 for j in tokens)
    steps = scaling.SETTINGS["quick"]["steps"]
    assert all(f"trainer.max_steps={2 * steps}" in j["overrides"] for j in tokens)
    assert all("workers=1" in j["overrides"] and "outer=fedavg" in j["overrides"] for j in tokens)


def test_a_curves_point_at_the_settings_own_value_is_the_main_grids_run(scaling, tmp_path):
    sc = scaling.Scaling(_args(tmp_path, curves="h"))
    own = scaling.SETTINGS["quick"]["h"]
    assert sc.curve_extra("h", own) == ()
    assert sc.curve_extra("h", own + 1) == (f"diloco.inner_steps={own + 1}",)
    assert sc.curve_extra_of("one", "h", own + 1) == ()  # one worker's run takes no H
    assert sc.curve_extra_of("dp", "steps", 8) != ()  # but it does take the run's length
