"""benchmarks/study.py's tuning rule, which every table of docs/study.md rests on: a >= 5-point log
grid per cell, extended past an edge that wins until the best lr is interior; seeds at the tuned lr;
a diverged run counted as such. No training: results are written by hand."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from support.benchmarks import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def study():
    yield from load_benchmark("study")


def _args(root: Path, **kw) -> argparse.Namespace:
    base = dict(quick=False, small=True, full=False, only="arr8", methods="sgd", root=str(root), out=None,
                retry_failed=False, jobs=1, plan=False, report=False)
    return argparse.Namespace(**{**base, **kw})


def _done(st, j: dict, loss: float, diverged: bool = False) -> None:
    d = st.root / "runs" / j["id"]
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.json").write_text(json.dumps({"eval_loss": loss, "diverged": diverged}))


def test_the_grid_grows_past_a_winning_edge_until_the_best_lr_is_interior(study, tmp_path):
    st = study.Study(_args(tmp_path))
    first = st.grid("arr8", "sgd")
    assert len(first) == 5 and first == list(range(first[0], first[0] + 5))
    assert [j["block"] for j in st.tuning_jobs()] == ["tune"] * 5
    for i, k in enumerate(first):  # the largest lr wins: one more point above
        _done(st, study.job("arr8", "sgd", k, 0), 3.0 - 0.1 * i)
    assert st.grid("arr8", "sgd") == [*first, first[-1] + 1] and st.best_k("arr8", "sgd") is None
    _done(st, study.job("arr8", "sgd", first[-1] + 1, 0), 9.0, diverged=True)
    assert st.best_k("arr8", "sgd") == first[-1]
    assert st.loss(study.job("arr8", "sgd", first[-1] + 1, 0)) == float("inf")
    seeds = st.seed_jobs()
    assert [(j["k"], j["seed"]) for j in seeds] == [(first[-1], 1), (first[-1], 2)]


def test_every_planned_run_is_a_distinct_train_py_composition(study, tmp_path):
    st = study.Study(_args(tmp_path, only=None, methods=None))
    jobs = st.all_jobs()
    assert len({j["id"] for j in jobs}) == len(jobs) > 0
    assert {j["setting"] for j in jobs} == set(study.PLAN)
    assert all(any(o.startswith("outer.lr=") for o in j["overrides"]) for j in jobs)
    cgad = [j for j in jobs if j["method"] == "cgad"]
    assert cgad and all("outer.options.state_layout=naive" in j["overrides"] for j in cgad)
    cfg = study._compose(st.common + jobs[0]["overrides"] + ["run_id=x", f"run_root={tmp_path}"])
    assert cfg.trainer.max_steps == 96 and cfg.diloco.inner_steps == 4


def test_the_rebase_control_gets_five_seeds_once_tuned(study, tmp_path):
    st = study.Study(_args(tmp_path, only="arr6"))
    assert st.close_jobs() == []  # nothing before its tuning is done
    ks = st.grid("arr6", "sgd")
    for i, k in enumerate(ks):  # the middle point wins
        _done(st, study.job("arr6", "sgd", k, 0), 3.0 + abs(i - 2) * 0.1)
    best = ks[2]
    assert [(j["k"], j["seed"]) for j in st.seed_jobs()] == [(best, 1), (best, 2)]
    assert [(j["k"], j["seed"], j["block"]) for j in st.close_jobs()] == [(best, 3, "close"), (best, 4, "close")]


def test_the_precision_block_plans_its_own_long_heavy_tailed_runs(study, tmp_path):
    st = study.Study(_args(tmp_path, small=False, only="long", methods=None))
    assert st.plan == {}
    jobs = st.long_jobs()
    assert len(jobs) == 2 * 3 * 2 * len(study.SEEDS)  # methods x outer states x beta2 x seeds
    cfg = study._compose(st.common + jobs[0]["overrides"] + ["run_id=x", f"run_root={tmp_path}"])
    # 1000+ outer steps: 4 workers x 504 / 2 deltas, each its own outer step, past tau_cut = 32
    assert cfg.trainer.max_steps * 4 // cfg.diloco.inner_steps >= 1000
    assert cfg.master.aggregation == "arrival" and cfg.diloco.delay.distribution == "pareto"
