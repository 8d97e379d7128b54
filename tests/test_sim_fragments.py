"""The simulator with Streaming DiLoCo fragments (``diloco.fragments``, ``launch=sim``).

* by hand: a model of two independent quadratics, one per fragment, whose pseudo-gradient is
  known in closed form, so each version of a 2-fragment lockstep run (one fragment per round,
  each installed from its own target version) is computed independently of the product's code;
* ``fragments=1`` is no fragmentation, bit for bit;
* PA-CGAD's age gate: in lockstep at delay 0 each fragment's deltas are gated on ``a_f = F - 1``;
* against the product (slow): ``recipe=tiny`` with ``diloco.fragments=2``, PA-CGAD, lockstep
  delays 0 and 2, run for real (master + 2 worker processes, folder hub) and on the simulator:
  every published version and every logged inner loss agree.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from diloco_lightning.master.config import MasterConfig
from diloco_lightning.outer.gates import cgad_gate
from diloco_lightning.sim import InnerLoop, SimMaster, SimOptions, SimWorker, Simulator
from test_sim import _versions_match, token_cache  # noqa: F401 - the fixture is used by name

N, ETA = 3, 0.3
TARGET = {"a.0.w": torch.tensor([1.0, -2.0, 0.5]), "a.1.w": torch.tensor([-1.0, 3.0, 2.0])}


def _workers(k: int, h: int, boundaries: int, fragments) -> list[SimWorker]:
    """Two blocks (``a.0``, ``a.1``: fragments 0 and 1), each SGD on ``0.5 |w - target|^2``."""
    out = []
    for i in range(k):
        params = {n: torch.nn.Parameter(torch.zeros(N)) for n in TARGET}

        def loss(_batch, p=params):
            return sum(0.5 * ((p[n] - TARGET[n]) ** 2).sum() for n in TARGET)
        inner = InnerLoop(loss, torch.optim.SGD(list(params.values()), lr=ETA), itertools.repeat(None))
        out.append(SimWorker(i, params, inner, inner_steps=h, max_steps=(h // (fragments or 1)) * boundaries,
                             fragments=fragments))
    return out


def _run(fragments, *, k=2, h=4, boundaries=6, delay=0, outer="nesterov", aggregation="round", sync="lockstep"):
    workers = _workers(k, h, boundaries, fragments)
    config = MasterConfig(outer_optimizer=outer, outer_lr=0.7 if outer == "nesterov" else 0.05,
                          outer_momentum=0.0, aggregation=aggregation, norm_ratio=None, norm_global_ratio=None,
                          fragments=fragments)
    master = SimMaster({n: torch.zeros(N) for n in TARGET}, config)
    sim = Simulator(workers, master, sync=sync, delay=delay, options=SimOptions())
    sim.master.prune = lambda keep_from: None  # keep every version
    return sim.run(), master, workers


@pytest.mark.parametrize("delay", [0, 1, 3])
def test_two_fragments_lockstep_by_hand(delay):
    """Boundary r (every H/2 = 2 steps) sends fragment r mod 2 and installs it from version r - delay;
    round s applies the mean of both workers' (s+1)-th deltas to that fragment alone."""
    h, boundaries = 4, 6
    result, master, _ = _run(2, h=h, boundaries=boundaries, delay=delay)
    assert result.outer_steps == boundaries
    c = 1.0 - (1.0 - ETA) ** (h // 2)  # H/2 SGD steps from x: x moves by c (x - target)
    names = {"0": "a.0.w", "1": "a.1.w"}
    t = {f: TARGET[n].double() for f, n in names.items()}
    versions = [{f: torch.zeros(N, dtype=torch.float64) for f in names}]
    # the worker's local value of each fragment, and its anchor (the installed global value)
    local = {f: versions[0][f].clone() for f in names}
    anchor = {f: versions[0][f].clone() for f in names}
    taus = []
    counts = {f: [0] for f in names}  # per version: the fragment's outer step count
    base = {f: (0, 0) for f in names}  # the anchor's (version, count)
    for r in range(1, boundaries + 1):
        # H/2 steps on both fragments (both workers are identical: same data, same start)
        for f in names:
            local[f] = local[f] - c * (local[f] - t[f])
        f = str(r % 2)
        delta = anchor[f] - local[f]
        anchor[f] = local[f].clone()
        s = r - 1  # the round it joins: applied to version s
        taus.append(counts[f][s] - base[f][1])
        new = {g: versions[s][g].clone() for g in names}
        new[f] = new[f] - 0.7 * delta  # nesterov, momentum 0, lr 0.7: the mean of two equal deltas
        versions.append(new)
        for g in names:
            counts[g].append(counts[g][s] + (1 if g == f else 0))
        target = max(0, r - delay)  # installed: fragment f of version r - delay
        local[f] = versions[target][f].clone()
        anchor[f] = versions[target][f].clone()
        base[f] = (target, counts[f][target])
    for v in range(1, boundaries + 1):
        for f, n in names.items():
            torch.testing.assert_close(master.versions[v][n].double(), versions[v][f], rtol=1e-5, atol=1e-6)
        assert master.version_steps[v] == {g: counts[g][v] for g in names}
    expect: dict[str, int] = {}
    for tau in taus:
        expect[str(tau)] = expect.get(str(tau), 0) + 2
    assert result.staleness_histogram == dict(sorted(expect.items(), key=lambda kv: int(kv[0])))


@pytest.mark.parametrize("sync,aggregation", [("lockstep", "round"), ("lockstep", "arrival"), ("async", "round")])
def test_one_fragment_is_no_fragments_bit_for_bit(sync, aggregation):
    a, ma, _ = _run(None, outer="pa_cgad", delay=1, sync=sync, aggregation=aggregation)
    b, mb, _ = _run(1, outer="pa_cgad", delay=1, sync=sync, aggregation=aggregation)
    assert mb.plan is None and a.outer_steps == b.outer_steps
    for v in ma.versions:
        for n in TARGET:
            assert torch.equal(ma.versions[v][n], mb.versions[v][n])


def test_pa_cgad_gates_each_fragment_on_its_age():
    """Lockstep, delay 0, F = 2: tau is 0, but a fragment's deltas arrive when it is one outer step
    old (the other fragment was updated in between): PA-CGAD gates them on a_f = 1, CGAD on tau = 0.
    Adam's first step is ``lr * g / (|g| + eps)``: with eps = 1e6 (and lr = 1e6) it is ``g`` to 1e-6,
    so the gate shows in the update. Round 0 (fragment 1, every age 0) is the same for both; round 1
    (fragment 0, whose deltas do not depend on round 0 in this separable model) is scaled by gate(1)."""
    runs = {}
    for outer in ("cgad", "pa_cgad"):
        workers = _workers(2, 4, 2, 2)
        config = MasterConfig(outer_optimizer=outer, outer_options={"lr": 1e6, "eps": 1e6}, norm_ratio=None,
                              norm_global_ratio=None, fragments=2)
        master = SimMaster({n: torch.zeros(N) for n in TARGET}, config)
        sim = Simulator(workers, master, sync="lockstep", options=SimOptions())
        sim.master.prune = lambda keep_from: None
        result = sim.run()
        assert result.staleness_histogram == {"0": 4}
        runs[outer] = master.versions
    cg, pa = runs["cgad"], runs["pa_cgad"]
    # boundary 1 syncs fragment 1 (a.1), boundary 2 fragment 0 (a.0): one fragment per round
    torch.testing.assert_close(pa[1]["a.1.w"], cg[1]["a.1.w"])
    assert not cg[1]["a.0.w"].any() and torch.equal(cg[2]["a.1.w"], cg[1]["a.1.w"])
    torch.testing.assert_close(pa[2]["a.0.w"], cg[2]["a.0.w"] * cgad_gate(1.0), rtol=1e-4, atol=1e-6)
    assert cgad_gate(1.0) < 0.9  # the age gate is a visible factor, not rounding


def test_async_two_speeds_with_fragments():
    """async, arrival mode, two speeds: every boundary's delta is delivered and applied, each outer
    step updating exactly one fragment (the counts of the last version add up to the steps), and
    each worker's fragment anchors carry the counts of the versions they were installed from."""
    workers = _workers(2, 4, 6, 2)
    workers[1].speed = 0.5
    config = MasterConfig(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.0, aggregation="arrival",
                          norm_ratio=None, norm_global_ratio=None, fragments=2)
    master = SimMaster({n: torch.zeros(N) for n in TARGET}, config)
    sim = Simulator(workers, master, sync="async", options=SimOptions())
    sim.master.prune = lambda keep_from: None  # keep every version
    result = sim.run()
    assert result.deltas == 12 and result.outer_steps == 12
    assert sum(master.version_steps[result.outer_steps].values()) == 12
    for w in workers:
        for name, (version, count) in w.book.base.items():
            assert count == master.version_steps[version][name]


def test_fragment_options_must_agree():
    workers = _workers(2, 4, 2, 2)
    config = MasterConfig(outer_optimizer="nesterov", norm_ratio=None, norm_global_ratio=None)
    master = SimMaster({n: torch.zeros(N) for n in TARGET}, config)
    with pytest.raises(ValueError, match="fragments"):
        Simulator(workers, master)
    with pytest.raises(ValueError, match="multiple of 2"):
        _workers(1, 3, 2, 2)
    config = MasterConfig(outer_optimizer="nesterov", norm_ratio=None, norm_global_ratio=None, fragments=2)
    with pytest.raises(ValueError, match="Dynamic Local Updates"):  # the product refuses it too (app/checks.py)
        Simulator(_workers(2, 4, 2, 2), SimMaster({n: torch.zeros(N) for n in TARGET}, config),
                  dylu={"max_steps": 4})


@pytest.mark.parametrize("decay", [1.0, 0.8])
def test_error_feedback_with_fragments_keeps_one_residual_per_fragment(decay):
    """ctopk with error feedback, 2 fragments: each worker's residual holds both fragments' keys, and per
    key what the master received plus the residual owed is every pseudo-gradient (decay 1), or the
    residual follows e = decay * e + delta - sent exactly (decay < 1)."""
    from diloco_lightning.encoding import EncodingSpec

    workers = _workers(2, 4, 8, 2)
    config = MasterConfig(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.0, norm_ratio=None,
                          norm_global_ratio=None, fragments=2)
    master = SimMaster({n: torch.zeros(N) for n in TARGET}, config)
    spec = EncodingSpec("ctopk", chunk=16, chunk_k=1, topk_values="int2")  # 1 of the 3 values of each key
    true = {w.node_id: {n: torch.zeros(N) for n in TARGET} for w in workers}
    got = {w.node_id: {n: torch.zeros(N) for n in TARGET} for w in workers}
    owed = {w.node_id: {n: torch.zeros(N) for n in TARGET} for w in workers}
    for w in workers:
        orig = w.phase

        def phase(state, _orig=orig, _id=w.node_id, **kw):
            d = _orig(state, **kw)
            for n, t in d.items():
                true[_id][n] += t
                owed[_id][n] = decay * owed[_id][n] + t  # SparseLoCo's buffer before the send
            return d
        w.phase = phase
    add = master.add

    def add_and_count(ident, received, *a, **kw):
        node = ident.split("/")[0]
        for n, t in received.items():
            got[node][n] += t
            owed[node][n] -= t
        return add(ident, received, *a, **kw)
    master.add = add_and_count
    sim = Simulator(workers, master, sync="lockstep", delay=0, delta_dtype=spec, error_feedback=True,
                    error_feedback_decay=decay)
    result = sim.run()
    assert result.outer_steps == 8
    for k, w in enumerate(workers):
        residual = sim.transfers.feedback[k].residual
        assert residual is not None and sorted(residual) == sorted(TARGET)  # one per fragment's key
        for n in TARGET:
            torch.testing.assert_close(residual[n], owed[w.node_id][n], atol=1e-6, rtol=0)
            if decay == 1.0:
                torch.testing.assert_close(got[w.node_id][n] + residual[n], true[w.node_id][n], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_matches_the_product_with_fragments(tmp_path, token_cache):  # noqa: F811
    """recipe=tiny, fragments=2, PA-CGAD, lockstep: worker 0 at delay 0, worker 1 at delay 2."""
    worst = _versions_match(tmp_path, token_cache, "frag2", "diloco.delay=[0,2]", "diloco.fragments=2", "outer=pa_cgad",
                            rounds=3, fragments=2)
    print(f"largest |sim - product| over the published weights: {worst:.3g}")
    assert worst <= 1e-6


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_train_py_launch_sim_with_fragments(tmp_path):
    """``python train.py recipe=tiny launch=sim diloco.fragments=4 outer=pa_cgad``: a boundary every
    H / 4 = 2 steps, one round each; lockstep delay 4 rounds (one H of latency) gives every fragment
    delta staleness 1 of its fragment's outer steps once the first 4 rounds (from version 0) are past."""
    from test_sim import _train

    proc = _train(tmp_path, tmp_path / "cache", "recipe=tiny", "launch=sim", "diloco.fragments=4", "outer=pa_cgad",
                  "diloco.delay=4", "trainer.max_steps=16", "data.tokenizer=byte", "model.d_model=32",
                  "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden=64", "run_id=f",
                  "launch.eval_points=1")
    assert "outer_step 8" in proc.stdout
    res = json.loads((tmp_path / "runs" / "f" / "results.json").read_text())
    assert res["outer_steps"] == 8 and res["deltas_accepted"] == 16 and res["deltas_rejected"] == 0
    assert res["sim"]["staleness_histogram"] == {"0": 8, "1": 8} and math.isfinite(res["eval_loss"])
    assert [w["deltas_sent"] for w in res["workers_summary"]] == [8, 8]
