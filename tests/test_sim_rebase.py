"""``sim.rebase``: a simulated worker starts each phase from its base version minus its own deltas
that version does not contain yet (``diloco_lightning/sim/rebase.py``).

* the starts by hand, exactly: a delta applied (subtracted from older bases, forgotten once every
  base contains it), one refused (never subtracted), one not applied yet (the last scale), one in a
  round the master refused;
* a whole arrival-mode run against the rule computed by hand on the quadratic model;
* round mode: the same run on threads, and a different one without the rebase;
* what it refuses: a step that is not momentum-free SGD, fragments;
* the start is the product worker's subtraction (``worker/rebase.py: rebase_start``), and the old
  name ``OwnDeltas`` still imports.
"""

from __future__ import annotations

import pytest
import torch

from diloco_lightning.master.config import MasterConfig
from diloco_lightning.sim import SimMaster, SimOptions, Simulator
from diloco_lightning.sim.rebase import SimOwnDeltas
from diloco_lightning.outer import build_outer_optimizer
from diloco_lightning.util.options import OptionError

from test_sim import C, N, TARGET, _quad_workers


def _t(*xs: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(xs)}


def test_starts_by_hand():
    own = SimOwnDeltas(2, lr=2.0)
    v0, v1, v2 = _t(8.0, 8.0), _t(4.0, 4.0), _t(2.0, 2.0)
    a, b, c, e = _t(1.0, 0.0), _t(0.0, 16.0), _t(0.0, 1.0), _t(64.0, 64.0)
    assert own.start(0, 0, v0, floor=0) is v0  # nothing sent yet: the version itself, not a copy
    own.sent(0, "w0/1", a)
    own.sent(1, "w1/1", _t(32.0, 32.0))  # the other worker's: never in worker 0's starts
    own.published(1, {"w0/1": 0.25, "w1/1": 0.25})  # applied by version 1, scale lr * 0.25 = 0.5
    own.sent(0, "w0/2", b)
    own.refused("w0/2")  # refused: never counts
    own.sent(0, "w0/3", c)  # not applied yet: the last scale, 0.5
    assert torch.equal(own.start(0, 0, v0, floor=0)["w"], torch.tensor([8.0 - 0.5, 8.0 - 0.5]))
    assert torch.equal(v0["w"], torch.tensor([8.0, 8.0]))  # the version is left as it was
    assert torch.equal(own.start(0, 1, v1, floor=0)["w"], torch.tensor([4.0, 4.0 - 0.5]))  # w0/1 is in version 1
    assert own.held(0) == 2
    own.published(2, {"w0/3": 0.125})  # applied by version 2 with scale 0.25
    assert torch.equal(own.start(0, 0, v0, floor=0)["w"], torch.tensor([7.5, 8.0 - 0.25]))  # older bases still need w0/1
    assert own.start(0, 2, v2, floor=1) is v2  # both in version 2; w0/1 applied by the floor: forgotten
    assert own.held(0) == 1
    own.sent(0, "w0/4", e)
    own.published(3, {})  # the round holding w0/4 was refused (a null round): w0/4 never counts
    assert own.start(0, 2, v2, floor=2) is v2 and own.held(0) == 0
    assert torch.equal(own.start(1, 0, v0, floor=0)["w"], torch.tensor([-8.0, -8.0]))  # worker 1's own: 8 - 0.5 * 32
    again = SimOwnDeltas(2, lr=1.0)
    again.load_state_dict(own.state_dict())
    assert torch.equal(again.start(1, 0, v0, floor=0)["w"], torch.tensor([-8.0, -8.0])) and again.lr == 2.0


def _reference_arrival(k: int, phases: int, tau: int, lr: float) -> torch.Tensor:
    """Arrival lockstep by hand: outer step s applies worker s % k's delta (round robin), computed from
    version b = max(0, s - tau) minus lr * gate * its own deltas applied at the steps in [b, s)
    (staleness_sgd's gate 1 / (1 + tau_j)), measured from that start."""
    t = TARGET.double()
    versions = [torch.zeros(N, dtype=torch.float64)]
    applied: list[tuple[int, torch.Tensor]] = []  # (staleness, delta) per step
    for s in range(k * phases):
        b = max(0, s - tau)
        start = versions[b].clone()
        for j in range(b, s):
            if j % k == s % k:
                start -= lr / (1 + applied[j][0]) * applied[j][1]
        delta = C * (start - t)
        applied.append((s - b, delta))
        versions.append(versions[-1] - lr / (1 + s - b) * delta)
    return versions[-1]


def _arrival_run(rebase: bool, delay: int = 5, lr: float = 0.8) -> torch.Tensor:
    config = MasterConfig(outer_optimizer="staleness_sgd", outer_lr=lr, outer_options={"momentum": 0.0},
                          aggregation="arrival", norm_ratio=None, norm_global_ratio=None)
    master = SimMaster({"w": torch.zeros(N)}, config)
    Simulator(_quad_workers(2, 6), master, delay=delay, options=SimOptions(rebase=rebase)).run()
    return master.state["w"].double()


def test_an_arrival_run_is_the_rule_by_hand():
    """K = 2, 5 arrivals late: each delta's base misses 2 or 3 of its own worker's deltas."""
    torch.testing.assert_close(_arrival_run(True), _reference_arrival(2, 6, 5, 0.8), rtol=1e-5, atol=1e-6)
    off = _arrival_run(False)
    assert float((off - _reference_arrival(2, 6, 5, 0.8)).abs().max()) > 1e-3  # the rebase changed the run
    # with no delay every base holds every own delta: the rebase changes nothing, bit for bit
    assert torch.equal(_arrival_run(True, delay=0), _arrival_run(False, delay=0))


def test_round_mode_on_threads_is_the_same_run():
    config = MasterConfig(outer_optimizer="staleness_sgd", outer_lr=0.8, outer_options={"momentum": 0.0},
                          norm_ratio=None, norm_global_ratio=None)
    finals = []
    for parallel in (1, 3):
        master = SimMaster({"w": torch.zeros(N)}, config)
        Simulator(_quad_workers(3, 5), master, delay=2, options=SimOptions(rebase=True), parallel=parallel).run()
        finals.append(master.state["w"])
    assert torch.equal(finals[0], finals[1])
    plain = SimMaster({"w": torch.zeros(N)}, config)
    Simulator(_quad_workers(3, 5), plain, delay=2).run()
    assert not torch.equal(plain.state["w"], finals[0])


def test_async_with_instant_transfers_is_unchanged():
    """Asynchronously each worker's own delta is in the version it starts from when transfers are
    instant (it is applied and published before the worker's next phase begins): nothing to rebase."""
    config = MasterConfig(outer_optimizer="staleness_sgd", outer_lr=0.8, outer_options={"momentum": 0.0},
                          aggregation="arrival", norm_ratio=None, norm_global_ratio=None)
    finals = []
    for rebase in (False, True):
        master = SimMaster({"w": torch.zeros(N)}, config)
        Simulator(_quad_workers(3, 5, speeds=[1.0, 0.7, 0.4]), master, sync="async",
                  options=SimOptions(rebase=rebase, speeds=[1.0, 0.7, 0.4])).run()
        finals.append(master.state["w"])
    assert torch.equal(finals[0], finals[1])


def test_what_it_refuses():
    state = {"w": torch.zeros(N)}
    for name, options in (("cgad", {}), ("nesterov", {"momentum": 0.9}), ("gap_aware", {})):
        master = SimMaster(state, MasterConfig(outer_optimizer=name, outer_options=options, aggregation="arrival"))
        with pytest.raises(OptionError, match="rebase.*momentum-free SGD"):
            Simulator(_quad_workers(2, 2), master, options=SimOptions(rebase=True))
    with pytest.raises(OptionError, match="rebase.*fragments"):
        SimOwnDeltas.build(build_outer_optimizer("staleness_sgd", state, lr=0.5), 2, fragments=True)
    with pytest.raises(OptionError, match="rebase"):
        SimOptions(rebase="yes").validate(2)


def test_the_start_is_the_product_workers_subtraction_and_the_old_names_import():
    """The same deltas and scales give the product's worker and the simulator the same start, bit for
    bit, in FP32 and in bf16 (accumulated in FP32, rounded once)."""
    from diloco_lightning.sim import rebase as sim_rebase
    from diloco_lightning.wire.manifest import Manifest
    from diloco_lightning.worker import rebase as worker_rebase

    assert sim_rebase.OwnDeltas is SimOwnDeltas and worker_rebase.OwnDeltas is worker_rebase.WorkerOwnDeltas
    g = torch.Generator().manual_seed(0)
    deltas = [{"w": torch.randn(64, generator=g)} for _ in range(3)]
    for dtype in (torch.float32, torch.bfloat16):
        version = {"w": torch.randn(64, generator=g).to(dtype)}
        sim = SimOwnDeltas(1, lr=0.5)
        worker = worker_rebase.WorkerOwnDeltas("w0")
        for i, d in enumerate(deltas):
            sim.sent(0, f"w0/{i}", d)
            worker.sent(i, d)
        sim.published(1, {"w0/0": 0.25, "w0/1": 0.25, "w0/2": 0.25})  # scale 0.5 * 0.25 each
        m = Manifest(0, "global/weights_000000000_x.safetensors", "0" * 64, "0" * 64, ledger={},
                     master={"holder": "test", "delta_scales": {"w0": 0.125}}).validate()
        a, b = sim.start(0, 0, version, floor=0)["w"], worker.start(m, version)["w"]
        assert a.dtype == dtype and torch.equal(a, b)
        want = version["w"].to(torch.float32, copy=True)
        for d in deltas:  # in FP32, in order, rounded to the version's dtype once at the end
            want.sub_(d["w"], alpha=0.125)
        assert torch.equal(a, want.to(dtype))
