"""benchmarks/sim_stragglers.py's plan, which docs/stragglers.md's tables rest on: the time-varying
speeds (seeded, the straggler scenario's compute in expectation), the families each arm is tuned in,
and what the overlapped and late-applying synchronous arms and the rho = 1 link ask the simulator
for. No training: results are written by hand."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from support.benchmarks import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def harness():
    yield from load_benchmark("sim_stragglers")


def _mean_speed(trace: list[list[float]], end: float) -> float:
    total = 0.0
    for i, (t, v) in enumerate(trace):
        t1 = trace[i + 1][0] if i + 1 < len(trace) else end
        total += v * (min(t1, end) - t)
    return total / end


def test_varying_speeds_are_seeded_spells_of_full_and_quarter_speed(harness):
    law = harness.SCENARIOS["varying"]["varying"]
    a = harness.varying_trace(0, 1, 160.0, **law)
    assert a == harness.varying_trace(0, 1, 160.0, **law)  # the seed's: every arm of a seed sees the same
    assert a != harness.varying_trace(1, 1, 160.0, **law) and a != harness.varying_trace(0, 2, 160.0, **law)
    assert a[0][0] == 0.0 and all(t0 < t1 < 160.0 for (t0, _), (t1, _) in zip(a, a[1:]))
    assert {v for _, v in a} <= {1.0, 0.25}
    assert all(v0 != v1 for (_, v0), (_, v1) in zip(a, a[1:]))  # it alternates
    # in expectation 30 / 40 of the time at 1 and 10 / 40 at 1/4: 0.8125 a worker, 3.25 for four,
    # the straggler scenario's [1, 1, 1, 1/4]
    long = [_mean_speed(harness.varying_trace(s, 0, 20_000.0, **law), 20_000.0) for s in range(3)]
    assert sum(long) / 3 == pytest.approx(0.8125, abs=0.02)
    assert sum(harness.SCENARIOS["straggler"]["speeds"]) / harness.K == 0.8125
    four = sum(_mean_speed(harness.varying_trace(0, k, 160.0, **law), 160.0) for k in range(harness.K))
    assert harness.varying_compute(0) == pytest.approx(four)


def test_the_varying_scenario_gives_every_worker_its_trace(harness):
    ov, speeds = harness.scenario_overrides("varying", 2)
    traces = json.loads(next(o for o in ov if o.startswith("sim.traces="))[len("sim.traces="):])
    law = harness.SCENARIOS["varying"]["varying"]
    assert speeds == [1.0] * harness.K
    assert traces == [harness.varying_trace(2, k, 160.0, **law) for k in range(harness.K)]


def test_families_new_scenarios_and_arms_are_tuned_in_staleness_sgd(harness):
    assert harness.families_of("straggler", "async") == ["nesterov", "sgd"]
    assert harness.families_of("straggler", "sync_overlap") == ["sgd"]
    assert harness.families_of("straggler", "sync_q3_apply") == ["sgd"]
    assert harness.families_of("varying", "sync_dylu") == ["sgd"]
    assert harness.families_of("xdc1", "async") == ["sgd"]
    assert harness.families_of("xdc1", "async_rebase") == ["sgd"]  # the rebase needs a momentum-free step
    assert "sim.rebase=true" in harness.job("xdc1", "async_rebase", "sgd", 1.0, 0)["overrides"]
    assert harness.families_of("xdc", "sync") == ["nesterov", "sgd"]
    assert harness.families_of("xdc_r1", "sync") == ["nesterov"]  # the sweep: xdc's lrs in the first family
    assert harness.FAMILIES["sgd"] == ("staleness_sgd", (0.125, 0.25, 0.5, 1.0, 2.0))


def test_overlapped_and_late_applying_sync_arms_on_the_rho_1_link(harness):
    over = harness.job("xdc1", "sync_overlap", "sgd", 0.5, 1)["overrides"]
    assert "diloco.sync=lockstep" in over and "diloco.delay=1" in over
    assert "outer=staleness_sgd" in over and "outer.lr=0.5" in over and "seed=1" in over
    bw = next(o for o in over if o.startswith("sim.bandwidth="))
    # rho = 1: the FP32 delta's upload takes one phase's compute (H units at speed 1)
    assert float(bw.split("=")[1]) == pytest.approx(harness.delta_bytes() / harness.H, rel=1e-5)
    late = harness.job("xdc1", "sync_q3_apply", "sgd", 0.5, 0)["overrides"]
    assert {"sim.barrier=true", "sim.quorum=3", "sim.late=apply"} <= set(late)
    # twice a fast worker's round: compute H plus the upload and the download (rho H each)
    assert f"sim.deadline={2 * (harness.H + 2 * harness.H):g}" in late
    strag = harness.job("straggler", "sync_q3_apply", "sgd", 0.5, 0)["overrides"]
    assert f"sim.deadline={2 * harness.H:g}" in strag and not any(o.startswith("sim.bandwidth") for o in strag)


def test_the_new_cells_tune_on_one_five_point_grid_each(harness, tmp_path):
    args = argparse.Namespace(out=str(tmp_path), scenarios=["varying", "xdc1"], arms=None, retry_failed=False)
    st = harness.Study(args)
    todo, settled = st.tuning_jobs()
    cells = {(j["scenario"], j["arm"], j["family"]) for j in todo}
    assert cells == {("varying", a, "sgd") for a in harness.SCENARIO_ARMS["varying"]} | {
        ("xdc1", a, "sgd") for a in harness.SCENARIO_ARMS["xdc1"]}
    assert len(todo) == 5 * len(cells) and not settled
    assert "sync_drop" not in harness.SCENARIO_ARMS["varying"]  # no worker is slow on average: it would be `sync`


def test_seeds_run_at_the_tuned_lr_and_more_seeds_on_request(harness, tmp_path):
    def args(**kw):
        return argparse.Namespace(**{"out": str(tmp_path), "scenarios": ["varying"], "arms": ["sync"],
                                     "retry_failed": False, **kw})

    st = harness.Study(args())
    for lr, loss in zip(harness.FAMILIES["sgd"][1], (3.7, 3.1, 2.9, 2.8, 3.0)):  # 1.0 wins, inside the grid
        d = tmp_path / "runs" / harness.job("varying", "sync", "sgd", lr, 0)["id"]
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"eval_loss": loss}))
    assert st.best("varying", "sync") == ("sgd", 1.0)
    assert [(j["lr"], j["seed"]) for j in st.seed_jobs(sweep=False)] == [(1.0, 1), (1.0, 2)]
    five = harness.Study(args(seeds=5))
    assert [j["seed"] for j in five.seed_jobs(sweep=False)] == [1, 2, 3, 4]
    assert {j["id"] for j in five.seed_jobs(sweep=False)} >= {j["id"] for j in st.seed_jobs(sweep=False)}


def test_a_scenario_tuned_as_another_keeps_its_own_family(harness, tmp_path):
    """A scenario tuned as another (the sweep's ``xdc_r1`` as ``xdc``) takes the other's best lr in the
    families it runs in (``poly_nesterov``), even where the other's best family is another."""
    st = harness.Study(argparse.Namespace(out=str(tmp_path), scenarios=["xdc"], arms=["sync"], retry_failed=False))
    for fam, losses in (("nesterov", (3.5, 3.2, 3.1, 3.3, 3.4)), ("sgd", (3.4, 3.0, 2.9, 3.0, 3.2))):
        for lr, loss in zip(harness.FAMILIES[fam][1], losses):
            d = tmp_path / "runs" / harness.job("xdc", "sync", fam, lr, 0)["id"]
            d.mkdir(parents=True)
            (d / "results.json").write_text(json.dumps({"eval_loss": loss}))
    assert st.best("xdc", "sync") == ("sgd", 0.5)
    assert st.best("xdc_r1", "sync") == ("nesterov", 0.4)
