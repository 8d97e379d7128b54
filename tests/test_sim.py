"""The in-process simulator (``launch=sim``, ``diloco_lightning.sim``).

* the schedule's staleness, by hand: a quadratic model whose pseudo-gradient is known in closed
  form (``c * (base - target)``), so the final global state of each schedule (lockstep in rounds,
  lockstep in arrivals, async on a clock with two speeds, a burn-in) is computed independently;
* the delay laws (shape, the heavy tail past tau_cut, the caps);
* ``python train.py recipe=tiny launch=sim``: real Hydra, results.json with a real run's keys;
* against the product: the same recipe and seed as a real multi-process run (``launch=local``,
  lockstep, folder hub), every published version equal within float tolerance (see
  docs/simulator.md for why not bit for bit).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco_lightning.master.config import MasterConfig
from diloco_lightning.util.options import OptionError
from diloco_lightning.sim import InnerLoop, SimMaster, SimOptions, SimWorker, Simulator
from diloco_lightning.worker.sync import draw_delay
from speed import default_first
from support.env import repo_env
from support.sim import simulate_keeping_versions

ROOT = Path(__file__).resolve().parents[1]
FAST = ["data.max_bytes=1000000", "data.seq_len=64", "data.vocab_size=1024", "trainer.log_every_n_steps=4"]

# ----------------------------------------------------------------------------- the schedule, by hand

N, ETA, H = 5, 0.3, 2
TARGET = torch.linspace(-1.0, 1.0, N)
C = 1.0 - (1.0 - ETA) ** H  # H SGD steps on 0.5 |w - target|^2 from x: delta = C (x - target)


def _quad_workers(k: int, phases: int, speeds=None) -> list[SimWorker]:
    out = []
    for i in range(k):
        w = torch.nn.Parameter(torch.zeros(N))
        inner = InnerLoop(lambda _b, w=w: 0.5 * ((w - TARGET) ** 2).sum(), torch.optim.SGD([w], lr=ETA),
                          itertools.repeat(None))
        out.append(SimWorker(i, {"w": w}, inner, inner_steps=H, max_steps=H * phases,
                             speed=(speeds or [1.0] * k)[i]))
    return out


def _simulate(k: int, phases: int, *, aggregation: str, sync: str = "lockstep", delay=0, speeds=None, parallel=1,
              **opts):
    workers = _quad_workers(k, phases, speeds)
    config = MasterConfig(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0, aggregation=aggregation,
                          norm_ratio=None, norm_global_ratio=None)
    master = SimMaster({"w": torch.zeros(N)}, config)
    applied: list[tuple[str, int]] = []
    sim = Simulator(workers, master, sync=sync, delay=delay, options=SimOptions(speeds=speeds, **opts),
                    on_version=lambda rec: applied.extend((a, None) for a in rec["applied"]), parallel=parallel)
    result = sim.run()
    return result, [a for a, _ in applied], master


def _reference(schedule: list[list[tuple[str, int]]]) -> torch.Tensor:
    """Versions by hand: each step applies the mean of its deltas, each ``C * (V[base] - target)``."""
    versions = [torch.zeros(N, dtype=torch.float64)]
    t = TARGET.double()
    for step in schedule:
        mean = sum(C * (versions[base] - t) for _, base in step) / len(step)
        versions.append(versions[-1] - mean)
    return versions[-1]


def _check(result, schedule, applied):
    assert applied == [ident for step in schedule for ident, _ in step]
    assert result.outer_steps == len(schedule)
    torch.testing.assert_close(result.final_state["w"].double(), _reference(schedule), rtol=1e-5, atol=1e-6)


def test_lockstep_arrival_counts_staleness_in_arrivals():
    """K=2, delay 1 in arrivals: outer step s applies a delta started from version max(0, s - 1)."""
    result, applied, _ = _simulate(2, 3, aggregation="arrival", delay=1)
    schedule = [[("w0/1", 0)], [("w1/1", 0)], [("w0/2", 1)], [("w1/2", 2)], [("w0/3", 3)], [("w1/3", 4)]]
    _check(result, schedule, applied)
    assert result.staleness_histogram == {"0": 1, "1": 5}


def test_lockstep_round_counts_staleness_in_rounds():
    """K=2, delay 1 in rounds: round s is every worker's delta s+1, started from version max(0, s - 1)."""
    result, applied, master = _simulate(2, 3, aggregation="round", delay=1)
    schedule = [[("w0/1", 0), ("w1/1", 0)], [("w0/2", 0), ("w1/2", 0)], [("w0/3", 1), ("w1/3", 1)]]
    _check(result, schedule, applied)
    assert [r["staleness_histogram"] for r in master.records] == [{"0": 2}, {"1": 2}, {"1": 2}]


def test_async_clock_with_two_speeds():
    """No imposed delay: w1 runs at half speed; the clock (ties by queue order) decides the staleness.
    In units of w0's phase (H = 2 steps at speed 1): t=1 w0/1 (v0, tau 0); t=2 w1/1 (v0, tau 1) then w0/2 (v1, tau 1); t=3 w0/3 (v3, tau 0);
    t=4 w1/2 (v2, tau 2); t=6 w1/3 (v5, tau 0)."""
    result, applied, master = _simulate(2, 3, aggregation="arrival", sync="async", speeds=[1.0, 0.5])
    schedule = [[("w0/1", 0)], [("w1/1", 0)], [("w0/2", 1)], [("w0/3", 3)], [("w1/2", 2)], [("w1/3", 5)]]
    _check(result, schedule, applied)
    assert [r["time"] / H for r in master.records] == [1.0, 2.0, 2.0, 3.0, 4.0, 6.0]
    assert result.sim_time == 6.0 * H


def test_async_equal_speeds_staleness_is_workers_minus_one():
    result, _, _ = _simulate(3, 4, aggregation="arrival", sync="async")
    assert result.staleness_histogram == {"0": 1, "1": 1, "2": 10}


def test_a_worker_leaves_and_one_joins():
    """async, arrivals, phases of H at speed 1: w2 leaves at 2.5 H (its phase due at 3 H is lost), w3 joins at
    1.5 H from the newest version (v3). By hand (ties by queue order): t=1: w0/1, w1/1, w2/1 (all from v0);
    t=2: w0/2 (v1), w1/2 (v2), w2/2 (v3); t=2.5: w3/1 (v3); t=3: w0/3 (v4), w1/3 (v5), w2/3 lost; t=3.5: w3/2 (v7);
    t=4: w0/4 (v8), w1/4 (v9); t=4.5: w3/3 (v10); t=5.5: w3/4 (v13)."""
    result, applied, master = _simulate(4, 4, aggregation="arrival", sync="async", join_at=[None, None, None, 1.5 * H],
                                        leave_at=[None, None, 2.5 * H, None])
    schedule = [[("w0/1", 0)], [("w1/1", 0)], [("w2/1", 0)], [("w0/2", 1)], [("w1/2", 2)], [("w2/2", 3)], [("w3/1", 3)],
                [("w0/3", 4)], [("w1/3", 5)], [("w3/2", 7)], [("w0/4", 8)], [("w1/4", 9)], [("w3/3", 10)], [("w3/4", 13)]]
    _check(result, schedule, applied)
    assert result.lost_phases == 1 and result.sim_time == 5.5 * H
    assert [r["time"] / H for r in master.records][5:8] == [2.0, 2.5, 3.0]


def test_speed_jitter_is_drawn_from_the_seed():
    def run(seed):
        workers = _quad_workers(3, 6)
        master = SimMaster({"w": torch.zeros(N)}, MasterConfig(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0,
                                                               aggregation="arrival", norm_ratio=None, norm_global_ratio=None))
        sim = Simulator(workers, master, sync="async", options=SimOptions(speed_jitter=0.5), seed=seed)
        return sim, sim.run()

    (a, ra), (_, rb), (_, rc) = run(3), run(3), run(4)
    assert torch.equal(ra.final_state["w"], rb.final_state["w"]) and ra.sim_time == rb.sim_time
    assert ra.sim_time != rc.sim_time
    assert a.duration(1, 2) == H * math.exp(0.5 * random.Random("3:speed:1:2").gauss(0.0, 1.0))
    assert ra.staleness_histogram != {"0": 1, "1": 1, "2": 16}  # equal speeds would give K - 1 after the start


def test_membership_needs_async_and_one_time_per_worker():
    with pytest.raises(ValueError, match="sync='async'"):
        _simulate(2, 2, aggregation="arrival", sync="lockstep", leave_at=[None, 1.0])
    with pytest.raises(OptionError, match="leave_at"):
        SimOptions(leave_at=[1.0]).validate(2)
    with pytest.raises(OptionError, match="join_at"):
        SimOptions(join_at=[-1.0, None]).validate(2)


@pytest.mark.parametrize("sync,aggregation,speeds", [("lockstep", "round", None), ("async", "arrival", [1.0, 0.5, 0.7]),
                                                     ("async", "round", [1.0, 0.3, 0.7])])
def test_phases_on_threads_give_the_same_run(sync, aggregation, speeds):
    one, applied1, m1 = _simulate(3, 5, aggregation=aggregation, sync=sync, delay=1, speeds=speeds)
    par, applied2, m2 = _simulate(3, 5, aggregation=aggregation, sync=sync, delay=1, speeds=speeds, parallel=3)
    assert applied1 == applied2 and torch.equal(one.final_state["w"], par.final_state["w"])
    assert [r["staleness_histogram"] for r in m1.records] == [r["staleness_histogram"] for r in m2.records]


def _encoded_run(delta_dtype, error_feedback=None, phases=12):
    workers = _quad_workers(2, phases)
    config = MasterConfig(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0, aggregation="arrival",
                          norm_ratio=None, norm_global_ratio=None)
    master = SimMaster({"w": torch.zeros(N)}, config)
    sim = Simulator(workers, master, sync="lockstep", delay=0, delta_dtype=delta_dtype, error_feedback=error_feedback)
    return sim.run(), sim


def test_deltas_go_through_the_workers_encoding_and_error_feedback():
    """The simulator sends what a worker sends: the encoded delta (bytes of the encoding) with the
    worker's error-feedback residual, decoded as the master decodes it."""
    exact, _ = _encoded_run("float32")
    int8, sim8 = _encoded_run("int8")
    assert sim8.encoding.name == "int8" and all(f.enabled for f in sim8.transfers.feedback)
    # one int8 code per value and one FP32 scale per (here: the only) block, against 4 bytes a value
    assert int8.bytes_sent == int8.deltas * (N + 4) and exact.bytes_sent == exact.deltas * 4 * N
    torch.testing.assert_close(int8.final_state["w"], exact.final_state["w"], atol=2e-2, rtol=0)
    # error feedback: for each worker, what reached the master plus the residual it still owes is
    # exactly the sum of its true pseudo-gradients (nothing lost); without feedback the drop is lost
    for feedback in (True, False):
        workers = _quad_workers(2, 10)
        master = SimMaster({"w": torch.zeros(N)}, MasterConfig(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0,
                                                               aggregation="arrival", norm_ratio=None, norm_global_ratio=None))
        true = {w.node_id: torch.zeros(N) for w in workers}
        got = {w.node_id: torch.zeros(N) for w in workers}
        for w in workers:
            def phase(version, _orig=w.phase, _id=w.node_id, **kw):
                d = _orig(version, **kw)
                true[_id] += d["w"]
                return d
            w.phase = phase
        arrive = master.arrive

        def arrive_and_count(ident, received, *a, **kw):
            got[ident.split("/")[0]] += received["w"]
            return arrive(ident, received, *a, **kw)
        master.arrive = arrive_and_count
        sim = Simulator(workers, master, sync="lockstep", delay=0, delta_dtype="topk", error_feedback=feedback)
        sim.run()
        for k, w in enumerate(workers):
            residual = sim.transfers.feedback[k].residual
            if feedback:
                torch.testing.assert_close(got[w.node_id] + residual["w"], true[w.node_id], atol=1e-6, rtol=0)
            else:
                assert residual is None and float((got[w.node_id] - true[w.node_id]).abs().max()) > 1e-3


def test_burn_in_and_per_delta_draws():
    """Per-delta delays from a law, 0 during the burn-in; each delta's staleness is its own draw."""
    spec = {"distribution": "choice", "values": [0, 1, 2], "seed": 7}
    result, applied, master = _simulate(2, 6, aggregation="arrival", delay=spec, delay_per="delta", burn_in=4)
    taus = [int(next(iter(r["staleness_histogram"]))) for r in master.records]
    assert taus[:4] == [0, 0, 0, 0]
    for s, (ident, tau) in enumerate(zip(applied, taus)):
        if s >= 4:
            node, r = ident.split("/")
            assert tau == min(s, draw_delay(spec, random.Random(f"7:{node[1:]}:{r}")))


def test_round_mode_refused_deltas_make_null_rounds():
    """CGAD's gate is 0 at tau_cut: every delta of a round at that staleness is refused (too_stale);
    the version counter still moves (a null round) so lockstep goes on."""
    workers = _quad_workers(2, 4)
    config = MasterConfig(outer_optimizer="cgad", outer_options={"tau_cut": 2}, outer_lr=0.1, norm_ratio=None)
    master = SimMaster({"w": torch.zeros(N)}, config)
    result = Simulator(workers, master, sync="lockstep", delay=2).run()
    assert result.outer_steps == 4
    assert [r["null_round"] for r in master.records] == [False, False, True, True]
    assert master.records[2]["rejected_by_reason"] == {"too_stale": 2}
    assert master.records[2]["update_norm"] == 0.0 and master.records[1]["update_norm"] > 0


# ----------------------------------------------------------------------------- delay laws


def test_delay_laws_shape_and_heavy_tail():
    rng = random.Random(0)
    n = 40_000
    geo = [draw_delay({"distribution": "geometric", "mean": 3}, rng) for _ in range(n)]
    assert abs(statistics.mean(geo) - 3) < 0.1 and abs(geo.count(0) / n - 0.25) < 0.01
    par = [draw_delay({"distribution": "pareto", "shape": 1.5, "scale": 4}, rng) for _ in range(n)]
    tail = sum(x >= 32 for x in par) / n
    assert abs(tail - 9 ** -1.5) < 0.005  # P(tau >= 32) = (1 + 32/4)^-1.5: the tail passes tau_cut = 32
    assert statistics.median(par) == 2 and max(par) > 200
    capped = [draw_delay({"distribution": "pareto", "max": 64}, rng) for _ in range(n)]
    assert max(capped) == 64
    uni = [draw_delay({"distribution": "uniform", "low": 2, "high": 5}, rng) for _ in range(n)]
    assert set(uni) == {2, 3, 4, 5} and abs(statistics.mean(uni) - 3.5) < 0.05
    with pytest.raises(ValueError, match="mean"):
        draw_delay({"distribution": "geometric"}, rng)
    with pytest.raises(ValueError, match="unknown distribution"):
        draw_delay({"distribution": "zipf"}, rng)


def test_per_worker_draw_is_the_products():
    """With delay_per=worker a distribution is drawn once per worker by the product's resolve_delay."""
    from diloco_lightning.worker import resolve_delay

    spec = {"distribution": "uniform", "high": 6, "seed": 3}
    workers = _quad_workers(4, 1)
    master = SimMaster({"w": torch.zeros(N)}, MasterConfig(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0))
    sim = Simulator(workers, master, delay=spec)
    assert sim.delays.per_worker == [resolve_delay(spec, f"w{i}", i) for i in range(4)]


# ----------------------------------------------------------------------------- the product's command


@pytest.fixture(scope="module")
def token_cache(tmp_path_factory) -> Path:
    """One tokenizer/token cache for this file's runs (the tokenizer is trained once)."""
    return tmp_path_factory.mktemp("sim-token-cache")


def _train(tmp_path: Path, cache: Path, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"run_root={tmp_path / 'runs'}", *FAST]
    proc = subprocess.run(cmd, cwd=tmp_path, env=repo_env(tmp_path, cache=cache), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


#: what run_all (launch=local) writes in results.json
REAL_KEYS = {"run_id", "recipe", "outer", "outer_lr", "tau", "regime", "delays", "precision", "seed", "workers",
             "inner_steps", "max_steps", "outer_steps", "final_train_loss", "eval_loss", "chance_loss", "diverged",
             "wall_seconds", "tokens", "tokens_per_second", "bytes_sent", "deltas_accepted", "deltas_rejected",
             "train_curve", "eval_curve", "workers_summary"}


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_train_py_launch_sim_end_to_end(tmp_path, token_cache):
    proc = _train(tmp_path, token_cache, "recipe=tiny", "launch=sim", "trainer.max_steps=16", "master.aggregation=arrival",
                  "diloco.delay=1", "outer.state_dtype=bfloat16", "run_id=s", "sim.save_weights=true")
    assert "on the simulator" in proc.stdout and "outer_step 4" in proc.stdout
    rdir = tmp_path / "runs" / "s"
    res = json.loads((rdir / "results.json").read_text())
    assert REAL_KEYS <= set(res) and res["launch"] == "sim"
    assert res["outer_steps"] == 4 and res["deltas_accepted"] == 4 and res["sim"]["staleness_histogram"] == {"0": 1, "1": 3}
    assert res["sim"]["outer_state_dtype"] == "bfloat16" and math.isfinite(res["eval_loss"])
    assert [v["outer_step"] for v in res["sim"]["versions"]] == [1, 2, 3, 4]
    assert all(v["update_rms_over_lr"] > 0 for v in res["sim"]["versions"])
    lines = (rdir / "master" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["outer_step"] for x in lines] == [1, 2, 3, 4]
    assert (rdir / "nodes" / "w1" / "progress.jsonl").is_file() and (rdir / "global.safetensors").is_file()
    assert not (rdir / "hub").exists()


@pytest.mark.slow  # a whole run: CI's slow run
def test_the_sparseloco_preset_trains_as_its_docs_say(tmp_path, token_cache):
    """``python train.py recipe=tiny compression=sparseloco`` (docs/encoding.md), on the simulator: every
    delta accepted, at more than 100x fewer bytes than FP32 (the model's own size, from its weights)."""
    from safetensors import safe_open

    _train(tmp_path, token_cache, "recipe=tiny", "compression=sparseloco", "launch=sim", "trainer.max_steps=16",
           "run_id=sp", "sim.save_weights=true")
    rdir = tmp_path / "runs" / "sp"
    res = json.loads((rdir / "results.json").read_text())
    assert res["deltas_accepted"] > 0 and res["deltas_rejected"] == 0 and math.isfinite(res["eval_loss"])
    with safe_open(str(rdir / "global.safetensors"), "pt") as f:
        fp32 = 4 * sum(f.get_slice(k).get_shape().numel() if hasattr(f.get_slice(k).get_shape(), "numel")
                       else math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert res["bytes_sent"] / res["deltas_accepted"] < fp32 / 100, (res["bytes_sent"], fp32)


@pytest.mark.parametrize("override,key", default_first([("sim.speeds=[1,0]", "sim.speeds"), ("sim.leave_at=[null,4]", "sim.leave_at"),
                                                        ("diloco.fragments=3", "diloco.fragments")]))
def test_sim_config_errors_name_the_key(tmp_path, token_cache, override, key):
    cmd = [sys.executable, str(ROOT / "train.py"), "recipe=tiny", "launch=sim", override, f"run_root={tmp_path}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=repo_env(tmp_path, cache=token_cache), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and key in proc.stderr and len(proc.stderr.strip().splitlines()) <= 2


# ----------------------------------------------------------------------------- against the product


def _versions_match(tmp_path: Path, cache: Path, run_id: str, *overrides: str, rounds: int = 3,
                    fragments: int = 1) -> float:
    """Run the recipe for real (master + 2 worker processes, lockstep, folder hub), then simulate the
    same saved configuration in this process; compare every published version. Returns the
    largest absolute difference. With ``fragments`` F, ``rounds`` of H steps are ``F * rounds``
    outer steps (a boundary every H / F steps)."""
    from omegaconf import OmegaConf

    from diloco_lightning.hub.versions import load_global
    from diloco_lightning.hub import open_hub
    from diloco_lightning.worker.sync import load_version

    _train(tmp_path, cache, "recipe=tiny", f"run_id={run_id}", f"trainer.max_steps={8 * rounds}", "trainer.num_threads=1",
           "launch.eval_points=0", f"master.keep_globals={rounds * fragments + 1}",  # keep every version to compare
           *overrides)
    rdir = tmp_path / "runs" / run_id
    cfg = OmegaConf.load(rdir / "config.yaml")
    cfg.launch.kind = "sim"
    old = os.environ.get("DILOCO_CACHE_DIR")
    os.environ["DILOCO_CACHE_DIR"] = str(cache)
    try:
        sim, result = simulate_keeping_versions(cfg)  # one thread per op, as each real worker ran
    finally:
        if old is None:
            os.environ.pop("DILOCO_CACHE_DIR")
        else:
            os.environ["DILOCO_CACHE_DIR"] = old
    hub = open_hub(str(rdir / "hub"))
    manifest, _ = load_global(hub)
    assert manifest.outer_step == result.outer_steps == rounds * fragments
    worst = 0.0
    for v in range(1, rounds * fragments + 1):
        _, real = load_version(hub, manifest, v)
        for k, t in real.items():
            torch.testing.assert_close(sim.master.versions[v][k], t, rtol=1e-5, atol=1e-6)
            worst = max(worst, float((sim.master.versions[v][k] - t).abs().max()))
    for w in sim.workers:  # the inner loops too: the workers' logged losses
        real_curve = [json.loads(x) for x in (rdir / "nodes" / w.node_id / "progress.jsonl").read_text().splitlines()]
        assert [r["step"] for r in real_curve] == [s for s, _ in w.losses]
        torch.testing.assert_close(torch.tensor([r["loss"] for r in real_curve]), torch.tensor([v for _, v in w.losses]),
                                   rtol=1e-5, atol=1e-6)
    return worst


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_matches_the_product_with_delays_0_and_2(tmp_path, token_cache):
    """Worker 0 at delay 0, worker 1 at delay 2 (lockstep), CGAD: staleness 0, 1 and 2 in 3 rounds."""
    worst = _versions_match(tmp_path, token_cache, "hetero", "diloco.delay=[0,2]")
    print(f"largest |sim - product| over the published weights: {worst:.3g}")  # pytest -s shows it
    assert worst <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0, 2])
def test_matches_the_product_fixed_delay(tmp_path, token_cache, delay):
    worst = _versions_match(tmp_path, token_cache, f"fixed{delay}", f"diloco.delay={delay}", rounds=5)
    print(f"delay {delay}: largest |sim - product| over the published weights: {worst:.3g}")
    if delay == 0:
        assert worst == 0.0  # two deltas, gate 1: the round sum does not depend on their order

