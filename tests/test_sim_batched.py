"""The batched simulator (``sim.batched``, ``diloco_lightning/sim/batched.py``) against the unbatched one.

The same configuration is simulated twice in this process, batched and unbatched, on the product's
model, data, AdamW, clipping and schedule (``app/sim.py: build_simulator``): every published
version and every logged inner loss must agree.

**The tolerance: ``atol=1e-6, rtol=1e-5`` on the weights, the losses within ``1e-5``.** What
differs between the two is only the forward and backward arithmetic: ``vmap`` turns each worker's
matrix products into one batched product and its reductions (the loss's mean) into batched
reductions, which a BLAS may add in another order (cuBLAS picks its algorithm by the batch size;
MKL here gives products equal bit for bit, measured: the weights of every version identical, a
logged loss off by one unit in the last place, from the mean of the cross-entropy). Data order,
clipping, the optimizer step, the schedule, installs and deltas are the unbatched code itself.
A last-bit difference in a gradient moves an AdamW step by at most about the inner lr times the
relative change of ``m / sqrt(v)`` (1e-7 relative at FP32), so after a few phases the weights
(of order 0.02-1) differ by far less than ``1e-6``; a wrong schedule in the batched path (a step
of the wrong worker, a missed step, a phase from the wrong version, one worker's gradient in
another's update) moves them by the inner lr, ``3e-3``, or more.
"""

from __future__ import annotations

import copy
import itertools
import os

import pytest
from speed import default_first
import torch

from diloco_lightning.master.config import MasterConfig
from diloco_lightning.sim import InnerLoop, SimMaster, SimOptions, SimWorker, Simulator
from diloco_lightning.sim.batched import StackedWorkers, why_not_batched
from diloco_lightning.util.options import OptionError
from support.sim import simulate_keeping_versions

SMALL = ["recipe=tiny", "data.tokenizer=byte", "data.max_bytes=300000", "data.seq_len=32", "data.batch_size=4",
         "data.val_batches=2", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
         "model.ffn_hidden=64", "optim.warmup_steps=4", "launch.eval_points=0", "trainer.log_every_n_steps=2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("batched-cache")
    old = os.environ.get("DILOCO_CACHE_DIR")
    os.environ["DILOCO_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("DILOCO_CACHE_DIR")
    else:
        os.environ["DILOCO_CACHE_DIR"] = old


def _simulate(hydra_configs, tmp_path, batched, *overrides):
    from hydra import compose, initialize_config_dir

    from diloco_lightning.app.build import build_datamodule
    from diloco_lightning.app.config import validate
    with initialize_config_dir(str(hydra_configs), version_base=None):
        cfg = validate(compose("train", overrides=[*SMALL, *overrides, f"sim.batched={batched}",
                                                  f"run_root={tmp_path}", "run_id=b"]))
    build_datamodule(cfg).prepare_data()
    return simulate_keeping_versions(cfg)


def _same_run(a, b):
    (sa, ra), (sb, rb) = a, b
    assert ra.outer_steps == rb.outer_steps > 0
    assert [r["applied"] for r in sa.master.records] == [r["applied"] for r in sb.master.records]
    assert [r["staleness_histogram"] for r in sa.master.records] == [r["staleness_histogram"] for r in sb.master.records]
    worst = 0.0
    for v in range(1, ra.outer_steps + 1):
        for k, t in sa.master.versions[v].items():
            torch.testing.assert_close(sb.master.versions[v][k], t, rtol=1e-5, atol=1e-6)
            worst = max(worst, float((sb.master.versions[v][k] - t).abs().max()))
    for wa, wb in zip(sa.workers, sb.workers):
        assert [s for s, _ in wa.losses] == [s for s, _ in wb.losses] and wa.phase_lengths == wb.phase_lengths
        torch.testing.assert_close(torch.tensor([v for _, v in wb.losses]), torch.tensor([v for _, v in wa.losses]),
                                   rtol=1e-5, atol=1e-5)
        assert wa.inner.tokens == wb.inner.tokens
    return worst


@pytest.mark.parametrize("overrides,sizes", default_first([
    # lockstep rounds, delays 0 and 1: every phase of a round computed in one batch of 3
    (["workers=3", "diloco.delay=[0,1,0]", "trainer.max_steps=24", "outer=cgad"], {"3"}),
    # async with a straggler: the fast workers' phases batched together, the straggler's joins every 4th
    (["workers=3", "diloco.sync=async", "master.aggregation=arrival", "sim.speeds=[1,1,0.25]", "sim.max_time=64",
      "trainer.max_steps=64", "outer=nesterov", "outer.lr=0.3"], {"2", "3"}),
    # DyLU: phases of different lengths share their common steps
    (["workers=3", "diloco.sync=async", "sim.quorum=2", "sim.speeds=[1,0.5,0.25]", "sim.max_time=48",
      "trainer.max_steps=48", "diloco.inner_steps=auto", "diloco.dylu_steps=8", "master.weighting=tokens"], None),
]))
def test_batched_equals_unbatched(hydra_configs, cache, tmp_path, overrides, sizes):
    plain = _simulate(hydra_configs, tmp_path / "plain", "false", *overrides)
    batched = _simulate(hydra_configs, tmp_path / "batched", "true", *overrides)
    assert plain[0].batched_reason == "sim.batched=false" and batched[0].batched_reason is None
    assert set(plain[0].runner.batches) == {1}
    if sizes is not None:
        assert {str(n) for n in batched[0].runner.batches} - {"1"} == sizes
    worst = _same_run(plain, batched)
    print(f"largest |batched - unbatched| over the published weights: {worst:.3g}")  # pytest -s shows it


def test_auto_batches_on_a_gpu_only_and_says_why_not(hydra_configs, cache, tmp_path):
    sim, _ = _simulate(hydra_configs, tmp_path / "a", "null", "workers=2", "trainer.max_steps=8")
    assert "CPU" in sim.batched_reason and sim.runner.batches == [1, 1]
    sim, _ = _simulate(hydra_configs, tmp_path / "a2", "true", "workers=2", "trainer.max_steps=8")
    assert sim.batched_reason is None and sim.runner.batches == [2]
    sim, _ = _simulate(hydra_configs, tmp_path / "b", "null", "workers=2", "trainer.max_steps=8",
                       "master.aggregation=arrival", "diloco.delay=1")
    assert "arrival" in sim.batched_reason and set(sim.runner.batches) == {1}
    with pytest.raises(OptionError) as e:
        _simulate(hydra_configs, tmp_path / "c", "true", "workers=2", "trainer.max_steps=8",
                  "master.aggregation=arrival", "diloco.delay=1")
    assert e.value.option == "batched" and "arrival" in str(e.value)


# ----------------------------------------------------------------------------- what cannot be batched


def _linear_worker(i, width=3, buffer=False, frozen=False):
    torch.manual_seed(i)
    net = torch.nn.Linear(width, 1)
    if buffer:
        net.register_buffer("scale", torch.ones(1))
    if frozen:
        net.bias.requires_grad_(False)
    params = [p for p in net.parameters() if p.requires_grad]
    inner = InnerLoop(None, torch.optim.AdamW(params, lr=0.1), itertools.repeat(torch.ones(2, width)), module=net,
                      module_loss=lambda m, x: (m(x) ** 2).mean())
    return SimWorker(i, dict(net.named_parameters()), inner, inner_steps=2, max_steps=4)


def test_why_not_batched_names_the_reason():
    assert why_not_batched([_linear_worker(0), _linear_worker(1)]) is None
    assert "single" in why_not_batched([_linear_worker(0)])
    assert "differs" in why_not_batched([_linear_worker(0), _linear_worker(1, width=4)])
    assert "buffers" in why_not_batched([_linear_worker(0, buffer=True), _linear_worker(1, buffer=True)])
    assert "does not step" in why_not_batched([_linear_worker(0, frozen=True), _linear_worker(1, frozen=True)])
    bare = [SimWorker(i, {"w": torch.nn.Parameter(torch.zeros(2))},
                      InnerLoop(lambda _b: torch.zeros(()), torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1),
                                itertools.repeat(None)), inner_steps=1, max_steps=1) for i in range(2)]
    assert "module_loss" in why_not_batched(bare)
    with pytest.raises(ValueError, match="module and module_loss go together"):
        InnerLoop(None, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1), iter(()), module=torch.nn.Linear(1, 1))


def test_stacked_views_are_the_workers_parameters():
    """Stacking keeps each worker's values; installs and unbatched steps write the stacked storage."""
    workers = [_linear_worker(i) for i in range(3)]
    before = [{k: v.detach().clone() for k, v in w.params.items()} for w in workers]
    stacked = StackedWorkers(workers)
    for k, w in enumerate(workers):
        for name, t in w.params.items():
            assert torch.equal(t, before[k][name]) and torch.equal(stacked.stacked[name][k], t)
    workers[1].install({"weight": torch.full((1, 3), 2.0), "bias": torch.zeros(1)})
    assert torch.equal(stacked.stacked["weight"][1], torch.full((1, 3), 2.0))
    workers[2].phase({k: v.detach().clone() for k, v in workers[2].params.items()})  # unbatched, on the views
    assert torch.equal(stacked.stacked["bias"][2], workers[2].params["bias"])
    # one batched step of workers 0 and 2 (not consecutive) equals their plain steps from the same state
    twins = [_linear_worker(i) for i in range(3)]
    for w, t in zip(workers, twins):
        with torch.no_grad():
            for name, p in t.params.items():
                p.copy_(w.params[name])
        t.inner.optimizer.load_state_dict(copy.deepcopy(w.inner.optimizer.state_dict()))  # its own moments
    losses = stacked.step([0, 2])
    for k, loss in zip([0, 2], losses):
        assert torch.allclose(twins[k].inner.step(), loss)
        for name in ("weight", "bias"):
            torch.testing.assert_close(workers[k].params[name], twins[k].params[name])
    assert torch.equal(workers[1].params["weight"], torch.full((1, 3), 2.0))  # not in the batch: untouched


def test_plain_workers_run_unbatched_and_batched_true_refuses_them():
    def workers():
        return [SimWorker(i, {"w": w}, InnerLoop(lambda _b, w=w: (w ** 2).sum(), torch.optim.SGD([w], lr=0.1),
                                                 itertools.repeat(None)), inner_steps=2, max_steps=4)
                for i, w in enumerate(torch.nn.Parameter(torch.ones(2)) for _ in range(2))]

    def master():
        return SimMaster({"w": torch.ones(2)}, MasterConfig(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0))

    sim = Simulator(workers(), master(), options=SimOptions())
    assert "module_loss" in sim.batched_reason and sim.run().outer_steps == 2
    with pytest.raises(OptionError, match="module_loss"):
        Simulator(workers(), master(), options=SimOptions(batched=True))
