"""``launch=sim`` honours or refuses every worker option the product has, and every evaluation scores
the same held-out windows whatever the training batch size (the scaling issue's measurement defects)."""

from __future__ import annotations

import itertools

import pytest
import torch
from hydra import compose, initialize_config_dir

from diloco_lightning.app.build import Evaluator, build_datamodule, build_module, val_windows
from diloco_lightning.app.config import CONFIG_DIR, ConfigError, register_configs, validate
from diloco_lightning.app.sim import SIM_WORKER_OPTIONS, sim_rebase
from diloco_lightning.master.config import MasterConfig
from diloco_lightning.sim import InnerLoop, SimMaster, SimOptions, SimWorker, Simulator
from diloco_lightning.worker.options import WorkerOptions
from diloco_lightning.worker.params import module_state

register_configs()
SMALL = ["recipe=tiny", "launch=sim", "data.tokenizer=byte", "data.max_bytes=300000", "data.seq_len=32",
         "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.ffn_hidden=64"]


def _compose(*overrides: str):
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return compose("train", overrides=list(overrides))


def test_the_table_names_every_worker_option_once():
    assert sorted(SIM_WORKER_OPTIONS) == sorted(WorkerOptions.names())
    assert {v.split(":")[0] for v in SIM_WORKER_OPTIONS.values()} <= {"honoured", "refused", "no hub"}


def test_a_throttle_is_refused_naming_the_sims_own_knob():
    with pytest.raises(ConfigError) as ei:
        validate(_compose(*SMALL, "diloco.throttle=0.1"))
    assert ei.value.key == "diloco.throttle" and "sim.speeds" in str(ei.value)
    validate(_compose(*SMALL))  # the default (no throttle) passes


def test_the_products_rebase_is_the_sims_where_the_product_uses_it():
    assert sim_rebase(_compose(*SMALL, "diloco=async"))  # the product's async default
    assert not sim_rebase(_compose(*SMALL, "diloco=async", "diloco.rebase=false"))
    assert not sim_rebase(_compose(*SMALL, "diloco=lockstep"))  # a lockstep worker installs exact versions
    assert not sim_rebase(_compose(*SMALL, "diloco=async", "diloco.fragments=2", "diloco.inner_steps=4"))
    assert sim_rebase(_compose(*SMALL, "diloco=lockstep", "sim.rebase=true"))


def _sim_master(outer: str = "fedavg", aggregation: str = "round", **config) -> SimMaster:
    """A simulated master on a 4-vector, its norm checks off (the tests' deltas are not a model's)."""
    return SimMaster({"w": torch.zeros(4)}, MasterConfig(outer_optimizer=outer, aggregation=aggregation, norm_ratio=None,
                                                         norm_global_ratio=None, **config))


def _adam_workers(k: int, phases: int, h: int) -> list[SimWorker]:
    out = []
    target = torch.linspace(-1.0, 1.0, 4)
    for i in range(k):
        w = torch.nn.Parameter(torch.zeros(4))
        inner = InnerLoop(lambda _b, w=w: 0.5 * ((w - target) ** 2).sum(), torch.optim.Adam([w], lr=0.1),
                          itertools.repeat(None))
        out.append(SimWorker(i, {"w": w}, inner, inner_steps=h, max_steps=h * phases))
    return out


@pytest.mark.parametrize("reset", [False, True])
def test_reset_inner_optimizer_clears_the_state_at_each_new_version(reset):
    """Round mode, 3 phases of 2 steps: each phase starts from a new version, so with the reset each
    worker's Adam ends with the last phase's 2 steps (its state cleared twice after the first), without it 6."""
    workers = _adam_workers(2, phases=3, h=2)
    master = _sim_master("nesterov", "round", outer_lr=1.0, outer_momentum=0.0)
    sim = Simulator(workers, master, sync="lockstep", options=SimOptions(), reset_inner_optimizer=reset)
    sim.run()
    for w in workers:
        (state,) = w.inner.optimizer.state.values()
        assert int(state["step"]) == (2 if reset else 6)


def test_the_products_rebase_runs_with_a_momentum_step_at_the_product_workers_fallback_scale():
    """``diloco.rebase`` with Nesterov 0.9 (no published scales): the product's worker subtracts each own
    delta not yet in its base times 1 / nodes; the simulator's rebase does the same instead of refusing."""
    workers = _adam_workers(2, phases=4, h=2)
    master = _sim_master("nesterov", "arrival", outer_lr=0.7, outer_momentum=0.9)
    sim = Simulator(workers, master, sync="lockstep", delay=2, options=SimOptions(), rebase=True)
    assert sim.rebase is not None and sim.rebase.lr is None
    sim.run()
    with pytest.raises(Exception, match="rebase"):  # sim.rebase keeps its strict meaning
        Simulator(_adam_workers(2, 4, 2), _sim_master("nesterov", "arrival", outer_lr=0.7, outer_momentum=0.9),
                  sync="lockstep", options=SimOptions(rebase=True))


def test_lookahead_multiplies_each_missing_own_delta_by_the_workers_with_a_delta_applied():
    """The simulator's rebase with ``lookahead``: a delta not applied yet counts with the worker's last
    scale times the workers with a delta applied (this one included), as the product's ledger does."""
    from diloco_lightning.sim.rebase import SimOwnDeltas

    own = SimOwnDeltas(3, lr=1.0, lookahead=True)
    for w in range(3):
        own.sent(w, f"d{w}", {"a": torch.full((1,), float(w + 1))})
    own.published(1, {"d0": 1 / 3, "d1": 1 / 3, "d2": 1 / 3})
    own.sent(0, "e0", {"a": torch.full((1,), 6.0)})  # in flight: last scale 1/3, times 3 workers
    start = own.start(0, base=1, state={"a": torch.zeros(1)}, floor=0)
    assert torch.allclose(start["a"], torch.full((1,), -6.0), atol=0, rtol=1e-6)
    plain = SimOwnDeltas(3, lr=1.0)
    for w in range(3):
        plain.sent(w, f"d{w}", {"a": torch.full((1,), float(w + 1))})
    plain.published(1, {"d0": 1 / 3, "d1": 1 / 3, "d2": 1 / 3})
    plain.sent(0, "e0", {"a": torch.full((1,), 6.0)})
    assert torch.allclose(plain.start(0, base=1, state={"a": torch.zeros(1)}, floor=0)["a"], torch.full((1,), -2.0))


def test_launch_sim_honours_diloco_lookahead_where_the_workers_rebase(tmp_path):
    """``diloco.lookahead=true`` reaches the simulator's rebase (async workers), and ``results.json`` says so;
    two async workers in round mode end differently with it than without."""
    from diloco_lightning.app.sim import run_sim

    losses = {}
    for la in (False, True):
        cfg = _compose(*SMALL, "diloco=async", "workers=2", "master.aggregation=round", "outer=fedavg",
                       "diloco.inner_steps=2", "trainer.max_steps=8", "data.batch_size=2", "data.val_windows=4",
                       f"diloco.lookahead={str(la).lower()}", f"run_root={tmp_path}", f"run_id=la{la}")
        validate(cfg)
        res = run_sim(cfg)
        assert res["sim"]["lookahead"] is la and res["sim"]["rebase"] is True
        losses[la] = res["eval_loss"]
    assert losses[True] != losses[False]


def test_the_held_out_set_is_the_same_windows_whatever_the_batch_size(tmp_path):
    """The fixed set: 64 windows by default, scored the same at training batch 8 and 32 (the old
    evaluation read 8 batches of the training batch size: 64 windows against 256)."""
    losses = []
    for batch in (8, 32):
        cfg = _compose(*SMALL, f"data.batch_size={batch}", f"data.cache_dir={tmp_path}")
        assert val_windows(cfg) == 64
        dm = build_datamodule(cfg)
        dm.prepare_data()
        dm.setup("validate")
        assert len(dm.val_dataset()) == 64
        state = {k: v.clone() for k, v in module_state(build_module(cfg, dm.vocab_size)).items()}
        losses.append(Evaluator(cfg, dm).loss(state))
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    old = _compose(*SMALL, "data.val_batches=3", f"data.cache_dir={tmp_path}")
    assert val_windows(old) == 24  # the old key keeps working: batches of data.val_batch_size (8)


def test_one_worker_with_fedavg_is_one_worker_alone():
    """``workers=1 outer=fedavg`` (the scaling benchmark's ``one`` arm) is plain training: its global
    model after 3 phases is the same worker's 6 Adam steps without DiLoCo, up to the rounding of
    ``anchor - (anchor - local)``; the default outer step of the old recipes (lr 0.5) is not."""
    def run(lr: float) -> torch.Tensor:
        (worker,) = _adam_workers(1, phases=3, h=2)
        master = _sim_master("nesterov", "round", outer_lr=lr, outer_momentum=0.0)
        Simulator([worker], master, sync="lockstep", options=SimOptions()).run()
        return master.state["w"]

    w = torch.nn.Parameter(torch.zeros(4))
    opt, target = torch.optim.Adam([w], lr=0.1), torch.linspace(-1.0, 1.0, 4)
    for _ in range(6):
        opt.zero_grad()
        (0.5 * ((w - target) ** 2).sum()).backward()
        opt.step()
    torch.testing.assert_close(run(1.0), w.detach(), rtol=0, atol=1e-6)
    assert (run(0.5) - w.detach()).abs().max() > 0.05


def test_a_single_worker_run_says_when_it_is_not_one_worker_alone():
    from diloco_lightning.app.build import single_worker_note

    assert single_worker_note(_compose(*SMALL, "workers=1", "outer=fedavg")) is None
    assert single_worker_note(_compose(*SMALL, "workers=2", "outer=nesterov")) is None
    note = single_worker_note(_compose(*SMALL, "workers=1", "outer=nesterov"))
    assert note is not None and "not one worker alone" in note and "outer=fedavg" in note
    assert "lr 0.5" in single_worker_note(_compose(*SMALL, "workers=1", "outer=staleness_sgd", "outer.lr=0.5"))


def _target_workers(k: int, phases: int, h: int) -> list[SimWorker]:
    """K Adam workers, each pulled to its own target (so their inner states differ)."""
    out = []
    for i in range(k):
        w = torch.nn.Parameter(torch.zeros(4))
        target = torch.linspace(-1.0, 1.0, 4) * (i + 1)
        inner = InnerLoop(lambda _b, w=w, t=target: 0.5 * ((w - t) ** 2).sum(), torch.optim.Adam([w], lr=0.1),
                          itertools.repeat(None))
        out.append(SimWorker(i, {"w": w}, inner, inner_steps=h, max_steps=h * phases))
    return out


def test_average_optimizer_states_is_the_mean_entry_by_entry():
    from diloco_lightning.sim.inner import average_optimizer_states

    ws = _target_workers(3, phases=1, h=3)
    for w in ws:
        for _ in range(3):
            w.inner.step()
    states = [next(iter(w.inner.optimizer.state.values())) for w in ws]
    want = {key: torch.stack([s[key] for s in states]).mean(0) for key in ("exp_avg", "exp_avg_sq")}
    average_optimizer_states([w.inner.optimizer for w in ws])
    for s in states:
        for key, v in want.items():
            torch.testing.assert_close(s[key], v, rtol=0, atol=0)
        assert int(s["step"]) == 3


@pytest.mark.parametrize("sync_state,parallel", [(False, 1), (True, 1), (True, 2)])
def test_sync_inner_state_starts_each_round_from_the_workers_mean_state(sync_state, parallel):
    """2 workers, 2 rounds of 2 Adam steps, outer SGD lr 1: the simulator's result equals the same
    steps by hand, where before round 2 each worker's Adam moments become their mean (or are kept)."""
    from diloco_lightning.sim.inner import average_optimizer_states

    targets = [torch.linspace(-1.0, 1.0, 4) * (i + 1) for i in range(2)]
    ps = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    opts = [torch.optim.Adam([p], lr=0.1) for p in ps]

    def steps():
        for p, o, t in zip(ps, opts, targets):
            for _ in range(2):
                o.zero_grad()
                (0.5 * ((p - t) ** 2).sum()).backward()
                o.step()

    steps()
    with torch.no_grad():
        mean = sum(p.detach() for p in ps) / 2
        for p in ps:
            p.copy_(mean)
    if sync_state:
        average_optimizer_states(opts)
    steps()
    want = sum(p.detach() for p in ps) / 2

    workers = _target_workers(2, phases=2, h=2)
    master = _sim_master("fedavg", "round", outer_lr=1.0)
    Simulator(workers, master, sync="lockstep", options=SimOptions(sync_inner_state=sync_state), parallel=parallel).run()
    torch.testing.assert_close(master.state["w"], want, rtol=0, atol=1e-6)


def test_sync_inner_state_needs_synchronous_rounds():
    master = _sim_master("fedavg", "arrival", outer_lr=1.0)
    with pytest.raises(Exception, match="sync_inner_state"):
        Simulator(_target_workers(2, 2, 2), master, sync="lockstep",
                  options=SimOptions(sync_inner_state=True))
    with pytest.raises(Exception, match="sync_inner_state"):
        validate(_compose(*SMALL, "sim.sync_inner_state=maybe"))


@pytest.mark.parametrize("warmup", [0, 2, 4])
def test_sync_warmup_syncs_every_step_of_the_first_steps_then_every_h(warmup):
    """2 Adam workers pulled to different targets, 6 steps, H = 2, outer SGD lr 1: the simulator's
    result equals the same steps by hand, where the weights become the workers' mean after each of
    the first ``warmup`` steps and after every second step from then on."""
    targets = [torch.linspace(-1.0, 1.0, 4) * (i + 1) for i in range(2)]
    ps = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    opts = [torch.optim.Adam([p], lr=0.1) for p in ps]
    step = 0
    while step < 6:
        n = 1 if step < warmup else 2
        for p, o, t in zip(ps, opts, targets):
            for _ in range(n):
                o.zero_grad()
                (0.5 * ((p - t) ** 2).sum()).backward()
                o.step()
        step += n
        with torch.no_grad():
            mean = sum(p.detach() for p in ps) / 2
            for p in ps:
                p.copy_(mean)
    workers = _target_workers(2, phases=3, h=2)
    master = _sim_master("fedavg", "round", outer_lr=1.0)
    result = Simulator(workers, master, sync="lockstep", options=SimOptions(sync_warmup=warmup)).run()
    torch.testing.assert_close(master.state["w"], ps[0].detach(), rtol=0, atol=1e-6)
    assert result.outer_steps == warmup + (6 - warmup) // 2
    assert [w.phase_lengths for w in workers] == [[1] * warmup + [2] * ((6 - warmup) // 2)] * 2


def test_sync_warmup_is_refused_where_it_means_nothing():
    master = _sim_master("fedavg", "round", outer_lr=1.0)
    with pytest.raises(Exception, match="sync_warmup.*multiple of H = 2"):
        Simulator(_target_workers(2, 3, 2), master, sync="lockstep", options=SimOptions(sync_warmup=3))
    with pytest.raises(ConfigError) as ei:
        validate(_compose(*SMALL, "sim.sync_warmup=-1"))
    assert ei.value.key == "sim.sync_warmup"


def test_the_trend_predicts_the_others_deltas_from_the_masters_mean_movement_per_delta():
    """sim/trend.py's formula by hand: movement per delta over the last W versions, times the deltas
    a base lacks (mean staleness x deltas per version), less the worker's own rebased ones."""
    from diloco_lightning.sim.trend import Trend

    t = Trend(window=2)
    v = [{"w": torch.tensor([0.0, 0.0])}, {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([3.0, 2.0])},
         {"w": torch.tensor([3.0, 6.0])}]
    t.published(1, v[0], v[1], [4])  # a round of one delta, tau 4
    t.published(2, v[1], v[2], [2, 6])  # a round of two
    t.published(3, v[2], v[3], [8, 8, 2])  # the window (2 versions) now holds versions 2 and 3
    state = {"w": torch.tensor([10.0, 10.0]), "step": torch.tensor(7)}
    # window: movement (2, 4) over 5 deltas; mean tau (2 + 6 + 8 + 8 + 2) / 5 = 5.2 versions x 2.5 deltas a version
    per_delta, lacking = torch.tensor([2.0, 4.0]) / 5, 5.2 * 2.5
    out = t.start(3, state, own=1)
    torch.testing.assert_close(out["w"], state["w"] + (lacking - 1) * per_delta)
    assert out["step"] is state["step"]  # integer keys are left alone
    torch.testing.assert_close(t.start(1, state, own=0)["w"], state["w"] + 4 * torch.tensor([1.0, 2.0]))
    assert t.start(0, state, own=0) is state  # nothing is known before the first step
    assert t.start(1, state, own=9) is state  # the rebase already supplied more than the deltas lacked
    t.prune(2)
    with pytest.raises(KeyError):
        t.start(1, state, own=0)


def test_the_look_ahead_predictions_are_refused_where_they_mean_nothing():
    master = _sim_master("staleness_sgd", "arrival", outer_lr=1.0)
    with pytest.raises(Exception, match="lookahead_momentum.*needs an outer step with momentum"):
        Simulator(_target_workers(2, 2, 2), master, sync="lockstep",
                  options=SimOptions(lookahead_momentum=True))
    with pytest.raises(ConfigError) as ei:
        validate(_compose(*SMALL, "sim.lookahead_trend=8", "sim.lookahead_momentum=true"))
    assert ei.value.key == "sim.lookahead_momentum"


@pytest.mark.parametrize("option", ["lookahead_trend", "lookahead_momentum"])
def test_a_look_ahead_start_moves_the_phases_by_the_masters_prediction(option):
    """2 workers, 8 arrivals imposed, staleness-scaled SGD with momentum 0.5: the run with the
    prediction differs from the run without, and the master published a prediction per version."""
    def run(on: bool):
        master = _sim_master("staleness_sgd", "arrival", outer_lr=0.5, outer_momentum=0.5)
        opts = SimOptions(**({option: 4 if option == "lookahead_trend" else True} if on else {}))
        Simulator(_target_workers(2, phases=6, h=2), master, sync="lockstep", delay=3, options=opts).run()
        return master

    off, on = run(False), run(True)
    assert off.trend is None and on.trend is not None
    assert (off.state["w"] - on.state["w"]).abs().max() > 1e-4


def test_the_trend_round_trips_its_state():
    from diloco_lightning.sim.trend import Trend

    t = Trend(window=2)
    for v in range(1, 4):
        t.published(v, {"w": torch.full((2,), float(v - 1))}, {"w": torch.full((2,), float(v * v))}, [v])
    u = Trend(window=2)
    u.load_state_dict(t.state_dict())
    state = {"w": torch.zeros(2)}
    t.published(4, {"w": torch.full((2,), 9.0)}, {"w": torch.full((2,), 20.0)}, [2, 3])
    u.published(4, {"w": torch.full((2,), 9.0)}, {"w": torch.full((2,), 20.0)}, [2, 3])
    for v in (3, 4):
        torch.testing.assert_close(t.start(v, state, own=1)["w"], u.start(v, state, own=1)["w"], rtol=0, atol=0)
    with pytest.raises(ValueError, match="window"):
        Trend(window=3).load_state_dict(t.state_dict())
