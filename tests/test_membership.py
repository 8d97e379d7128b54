"""Membership, quorum, the adaptive deadline and Dynamic Local Updates: the rules (exact numbers),
the heartbeat's untrusted values, and the real master / worker / adapters following them on a
real folder hub. (Real processes killed and started: tests/test_elastic.py.)"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from diloco_lightning.wire.delta import write_delta
from diloco_lightning.hub.local import FileHub
from diloco_lightning.master import MasterOuterLoop
from diloco_lightning.master.config import MasterConfig
from diloco_lightning.master.membership import Membership
from diloco_lightning.master.quorum import ArrivalDeadline, deadline_from_offsets, quorum_count, quorum_size
from diloco_lightning.wire.claims import ClaimError, NodeClaim, NodeReport
from diloco_lightning.util.options import OptionError
from diloco_lightning.worker import DiLoCoWorker, WorkerOptions
from diloco_lightning.worker.pacing import Pacing, StepClock, dylu_inner_steps


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _claim(node, t, ttl=10.0, holder="h:1:a", epoch=1, **info):
    return NodeClaim(node, holder, epoch, t, t, t + ttl, dict(info))


# ----------------------------------------------------------------------------- quorum


def test_quorum_is_a_count_or_a_fraction_of_the_live_nodes():
    assert [quorum_size(3, live) for live in (0, 1, 10)] == [3, 3, 3]  # an int keeps its meaning
    assert [quorum_size(0.75, live) for live in (0, 1, 2, 3, 4, 8)] == [1, 1, 2, 3, 3, 6]
    assert [quorum_size(1.0, live) for live in (0, 1, 4)] == [1, 1, 4]
    assert quorum_size(0.5, 3) == 2
    # a count counts deltas; a fraction counts distinct nodes (two deltas of one fast node are one node)
    assert quorum_count(2, ["a", "a", "b"]) == 3 and quorum_count(0.5, ["a", "a", "b"]) == 2


@pytest.mark.parametrize("value", [0.75, 1.0, 1, 4])
def test_min_deltas_accepts_counts_and_fractions(value):
    assert MasterConfig(min_deltas=value, max_wait="auto").validate().min_deltas == value


@pytest.mark.parametrize("option, value", [
    ("min_deltas", 0), ("min_deltas", 1.5), ("min_deltas", -0.5), ("min_deltas", "3"), ("min_deltas", True),
    ("min_deltas", math.nan), ("max_wait", "soon"), ("max_wait", -1.0), ("node_timeout", 0.0),
])
def test_bad_quorum_options_name_the_option(option, value):
    with pytest.raises(OptionError) as e:
        MasterConfig(**{option: value}).validate()
    assert e.value.option == option


# ----------------------------------------------------------------------------- deadline


def test_deadline_is_median_plus_k_mad_within_its_bounds():
    offs = [1.0, 1.0, 2.0, 2.0, 3.0]  # median 2, MAD 1
    assert deadline_from_offsets(offs, cap=100.0) == pytest.approx(2 + 3 * 1.4826)
    assert deadline_from_offsets(offs, cap=100.0, resolution=0.5) == pytest.approx(2.5 + 3 * 1.4826)
    assert deadline_from_offsets(offs, cap=5.0) == 5.0  # never beyond the cap (the node timeout)
    assert deadline_from_offsets([0.1] * 8, cap=100.0, floor=0.4) == 0.4  # never below the poll resolution
    assert deadline_from_offsets([1.0, 2.0, 3.0], cap=42.0) == 42.0  # too little history: the cap
    # one straggler among a dozen fast arrivals moves neither the median nor the MAD
    fast = [0.1, 0.2, 0.15, 0.12, 0.18, 0.11, 0.16, 0.14, 0.13, 0.17, 0.19, 0.1]
    assert deadline_from_offsets(fast + [40.0], cap=100.0) < 0.4
    assert deadline_from_offsets([math.nan, -1.0, 1.0, 1.0, 1.0, 1.0], cap=9.0) == 1.0  # junk offsets ignored


def test_deadline_learns_from_the_nodes_it_cut_off():
    """History: a, b, c arrive within 0.2 s of a round's first delta. A newcomer d arrives 0.6 s after:
    the deadline (~0.5 s) cuts it off, so from the rounds alone its offset would never be seen and the
    deadline could only shrink. d's late delta is measured against the round it missed (0.6 s, not its
    offset in the next round), and the deadline widens until d makes it. A true straggler, missing four
    rounds in a row, is not waited for."""
    dl = ArrivalDeadline()
    dl.offsets.extend([0.1, 0.2] * 4)
    waits = []
    for r in range(8):
        dl.arrived("a", r)
        dl.arrived("b", r + 0.1)
        dl.arrived("c", r + 0.2)
        w = dl.deadline(cap=30.0, resolution=0.05)
        waits.append(w)
        if w >= 0.6:
            dl.arrived("d", r + 0.6)
            dl.closed("abcd", r + 0.6)
            continue
        dl.closed("abcd", r + w)  # applied without d
        n = len(dl.offsets)
        dl.arrived("d", r + 0.6)  # d's delta opens the next round ...
        assert dl.offsets[-1] == pytest.approx(0.6) and len(dl.offsets) == n + 1  # ... measured against round r
        dl.closed("d", r + 0.6)
    assert waits[0] < 0.6 and waits[-1] >= 0.6
    assert waits[0] == pytest.approx(0.15 + 3 * 1.4826 * 0.05 + 0.05)  # median 0.15, MAD 0.05, + the resolution

    straggler = ArrivalDeadline()
    for r in range(16):
        for i, node in enumerate("abc"):
            straggler.arrived(node, r + 0.05 * i)
        straggler.closed("abcs", r + 0.3)
        if r % 4 == 3:  # s delivers once per 4 rounds: 3.9 s after the first round it missed
            straggler.arrived("s", r + 0.9)
            assert straggler.offsets[-1] == pytest.approx(3.9)
            straggler.closed("s", r + 0.9)
    assert straggler.deadline(cap=30.0, resolution=0.05) == pytest.approx(0.1 + 3 * 1.4826 * 0.05 + 0.05)  # not 3.9


# ----------------------------------------------------------------------------- DyLU


def test_dylu_gives_each_worker_steps_in_proportion_to_its_speed():
    assert dylu_inner_steps(1.0, [4.0, 4.0, 4.0], max_steps=100) == 25  # the 4x straggler
    assert dylu_inner_steps(4.0, [1.0, 4.0], max_steps=100) == 100  # the fastest keeps H_max
    assert dylu_inner_steps(2.0, [3.0], max_steps=100) == 67  # rounded, not floored
    assert dylu_inner_steps(None, [4.0], max_steps=100) == 100  # not measured yet
    assert dylu_inner_steps(3.3, [], max_steps=100, seconds=10.0) == 33  # a time target: no peers needed
    assert dylu_inner_steps(30.0, [], max_steps=100, seconds=10.0) == 100  # at most H_max
    # a peer that claims an absurd speed shortens the phase to H_min (H_max / 16) and no further
    assert dylu_inner_steps(1.0, [1e6], max_steps=100) == 6
    assert dylu_inner_steps(1.0, [1e6], max_steps=100, min_steps=20) == 20
    assert dylu_inner_steps(1.0, [math.nan, math.inf, -5.0, None, 0.0], max_steps=100) == 100  # junk ignored


def test_step_clock_measures_compute_not_boundaries():
    clock = FakeClock(0.0)
    pace = Pacing("auto", dylu_steps=8, throttle=0.0, clock=clock)
    for _ in range(4):
        clock.t += 0.5
        pace.after_step()
    assert pace.clock.rate() == pytest.approx(2.0)  # 3 intervals of 0.5 s
    assert pace.end_phase(num_tokens=600, peer_rates=[8.0]) == 2  # 8 * 2 / 8
    assert pace.tokens_per_second == pytest.approx(600 / 1.5)
    clock.t += 100.0  # a long lockstep wait inside the boundary ...
    pace.resume()
    clock.t += 0.5
    pace.after_step()
    assert pace.clock.rate() == pytest.approx(2.0)  # ... is not the worker's speed
    report = pace.report(local_step=7)
    assert report == NodeReport(step_rate=pytest.approx(2.0), tokens_per_second=pytest.approx(400.0), local_step=7,
                                inner_steps=2)


def test_boundaries_fixed_or_dynamic():
    fixed = Pacing(4)
    assert [s for s in range(1, 13) if fixed.due(s, s - 1)] == [4, 8, 12]
    assert not fixed.due(9, 8) and fixed.due(12, 9)  # multiples of H: accumulation/resume fire once
    dyn = Pacing("auto", dylu_steps=8)
    assert dyn.due(8, 0) and not dyn.due(7, 0)
    dyn.inner_steps = 3
    assert dyn.due(11, 8) and not dyn.due(10, 8)
    dyn.load_state_dict({"inner_steps": 999})
    assert dyn.inner_steps == 8  # bounded by dylu_steps
    assert Pacing(None).due(100, 0) is False  # the caller decides


def test_throttle_sleeps_after_every_step():
    slept = []
    pace = Pacing(4, throttle=0.25, sleep=slept.append)
    for _ in range(3):
        pace.after_step()
    assert slept == [0.25, 0.25, 0.25]
    opts = WorkerOptions(throttle=[0.0, 0.0, 0.0, 0.3])
    assert [opts.resolved_throttle(f"w{i}") for i in range(4)] == [0.0, 0.0, 0.0, 0.3]
    for bad in (-1.0, [0.1, "x"], [], math.inf, True):
        with pytest.raises(OptionError, match="throttle"):
            WorkerOptions(throttle=bad).validate()
    with pytest.raises(OptionError, match="inner_steps"):
        WorkerOptions(inner_steps="sometimes").validate()
    WorkerOptions(inner_steps="auto", dylu_steps=50, dylu_seconds=2.0).validate()


# ----------------------------------------------------------------------------- heartbeats are untrusted


def test_heartbeat_values_are_bounded_and_typed():
    good = {"step_rate": 3.5, "tokens_per_second": 12000.0, "local_step": 42, "inner_steps": 25, "future": [1]}
    report, problems = NodeReport.from_info(good)
    assert report == NodeReport(3.5, 12000.0, 42, 25) and problems == []
    evil = {"step_rate": 1e300, "tokens_per_second": -5.0, "local_step": 10**40, "inner_steps": 0}
    report, problems = NodeReport.from_info(evil)
    assert report == NodeReport() and len(problems) == 4
    for junk in ("fast", True, [1], {"a": 1}, math.nan, math.inf, "9" * 5000):
        report, problems = NodeReport.from_info({"step_rate": junk, "local_step": junk, "inner_steps": 2})
        assert report == NodeReport(inner_steps=2) and len(problems) == 2
        assert all(len(p) < 200 for p in problems)  # a megabyte of junk is not echoed into the log
    assert NodeReport.from_info({"local_step": 3.0})[0].local_step is None  # an integer field takes integers only
    assert NodeReport.from_info([1, 2])[0] == NodeReport()
    # NaN does not survive parsing any more (a claim with it is unreadable, util/jsondoc.py)
    with pytest.raises(ClaimError, match="NaN is not JSON"):
        NodeClaim.from_json(_claim("w0", 1.0).to_json().replace('"info": {}', '"info": {"step_rate": NaN}'),
                            node_id="w0")


def test_membership_follows_heartbeats_on_the_masters_clock(tmp_path, caplog):
    hub = FileHub(tmp_path / "hub")
    mono, wall = FakeClock(50.0), FakeClock(1000.0)
    ms = Membership(hub, poll_interval=0.0, clock=mono, wall=wall)
    hub.write_claim("w0", _claim("w0", 1000.0, step_rate=2.0), expected=None)
    hub.write_claim("w1", _claim("w1", 1000.0, step_rate="fast"), expected=None)
    # a claim left by a worker killed long ago (its renewed_at an hour old): never live
    hub.write_claim("w9", _claim("w9", 1000.0 - 3600.0), expected=None)
    with caplog.at_level("INFO", logger="diloco_lightning"):
        ms.refresh(force=True)
    assert ms.live() == ["w0", "w1"]
    assert ms.reports()["w0"].step_rate == 2.0 and ms.reports()["w1"].step_rate is None
    assert "node w1: ignoring part of its heartbeat: step_rate='fast'" in caplog.text
    assert ms.refresh_interval() == pytest.approx(2.5)  # a quarter of the 10 s ttl
    # w0 beats (its renewed_at changes), w1 does not; the workers' clocks are compared for change only
    mono.t += 6.0
    hub.write_claim("w0", _claim("w0", 1000.0 + 5.0, step_rate=2.0), expected=hub.read_claim("w0"))
    ms.refresh(force=True)
    mono.t += 5.0
    with caplog.at_level("INFO", logger="diloco_lightning"):
        ms.refresh(force=True)
    assert ms.live() == ["w0"]  # w1: 11 s without a heartbeat, timeout 10 s
    assert "node w1 left the quorum: nothing heard for 11 s (timeout 10 s)" in caplog.text
    # a delta counts as a sign of life too
    ms.heard("w1")
    assert ms.live() == ["w0", "w1"]
    # a released claim (a worker that ended cleanly) leaves at once
    hub.write_claim("w0", None, expected=hub.read_claim("w0"))
    ms.refresh(force=True)
    assert ms.live() == ["w1"]
    # node_timeout overrides the claims' own ttl
    strict = Membership(hub, node_timeout=2.0, poll_interval=0.0, clock=mono, wall=FakeClock(1003.0))
    strict.refresh(force=True)
    assert strict.live() == []  # w1's heartbeat is 3 s old by its own clock, above 2 s


def test_a_huge_claimed_ttl_is_bounded():
    mono = FakeClock(0.0)
    ms = Membership(None, poll_interval=0.0, clock=mono, wall=FakeClock(0.0))
    ms.observe({"w0": NodeClaim("w0", "h:1:a", 1, 0.0, 0.0, 1e300, {})})
    mono.t = 86400.0 + 1
    assert ms.live() == []  # at most a day, whatever the claim says


# ----------------------------------------------------------------------------- the real master


def _offer(hub, tmp_path, node, step, base, value=1.0):
    path = tmp_path / f"{node}_{step}.safetensors"
    write_delta(path, {"w": torch.full((4,), value)}, node_id=node, local_step=step, base_outer_step=base, num_tokens=100)
    hub.upload_delta(path, node, step)


def test_master_quorum_follows_the_live_nodes(tmp_path):
    root = tmp_path / "hub"
    hub = FileHub(root)
    master = MasterOuterLoop(FileHub(root), {"w": torch.zeros(4)}, node_state_dir=tmp_path / "m", poll_interval=0.01,
                             min_deltas=1.0, outer_lr=1.0, outer_momentum=0.0, norm_ratio=None)
    master.sync_once()  # outer step 0
    now = time.time()
    for n in ("w0", "w1", "w2"):
        hub.write_claim(n, _claim(n, now, ttl=60.0), expected=None)
    _offer(hub, tmp_path, "w0", 1, 0)
    _offer(hub, tmp_path, "w1", 1, 0)
    master.sync_once()
    m = master.last_metrics
    assert m["waiting"] and (m["live_nodes"], m["quorum"]) == (3, 3) and master.outer_step == 0
    hub.write_claim("w2", None, expected=hub.read_claim("w2"))  # w2 ends cleanly: 2 live, the quorum is 2
    master.membership._read_at = None  # the next round reads the claims (no waiting for the refresh interval)
    assert master.sync_once() and master.outer_step == 1
    assert sorted(master.last_metrics["applied"]) == ["w0/1", "w1/1"] and master.last_metrics["quorum"] == 2
    # w2's late delta (base 0, now stale by 1) is still read, checked and gated like any other
    _offer(hub, tmp_path, "w2", 1, 0)
    master.sync_once()
    assert master.last_metrics["waiting"]  # 1 of 2 live (w2 is not live: its claim is gone)
    _offer(hub, tmp_path, "w0", 2, 1)
    assert master.sync_once() and master.outer_step == 2
    assert master.last_metrics["staleness_histogram"] == {"0": 1, "1": 1}
    assert master.ledger == {"w0": 2, "w1": 1, "w2": 1}


def test_master_auto_deadline_applies_below_the_quorum(tmp_path):
    root = tmp_path / "hub"
    hub = FileHub(root)
    master = MasterOuterLoop(FileHub(root), {"w": torch.zeros(4)}, node_state_dir=tmp_path / "m", poll_interval=0.01,
                             min_deltas=1.0, max_wait="auto", norm_ratio=None)
    master.sync_once()
    now = time.time()
    for n in ("w0", "w1"):
        hub.write_claim(n, _claim(n, now, ttl=3.0), expected=None)
    master.rounds.deadline.offsets.extend([0.2] * 8)  # arrivals so far came within 0.2 s of each other
    _offer(hub, tmp_path, "w0", 1, 0)
    master.sync_once()
    assert master.last_metrics["waiting"] and master.last_metrics["deadline"] == pytest.approx(0.21)
    time.sleep(0.25)  # w1 is live (its claim fresh) but late: the deadline applies w0's delta alone
    assert master.sync_once() and master.outer_step == 1 and master.last_metrics["applied"] == ["w0/1"]
    _offer(hub, tmp_path, "w1", 1, 0)  # w1 arrives 0.3 s late: measured against the round it missed
    master.sync_once()
    assert max(master.rounds.deadline.offsets) >= 0.25


# ----------------------------------------------------------------------------- the real worker


def test_worker_reports_its_speed_and_takes_its_h_from_the_peers(tmp_path):
    root = tmp_path / "hub"
    hub = FileHub(root)
    master = MasterOuterLoop(FileHub(root), {"w": torch.zeros(4)}, node_state_dir=tmp_path / "m", poll_interval=0.01)
    master.sync_once()
    hub.write_claim("fast", _claim("fast", time.time(), ttl=60.0, step_rate=8.0), expected=None)
    clock = FakeClock(0.0)
    pace = Pacing("auto", dylu_steps=16, clock=clock)
    params = {"w": torch.zeros(4)}
    worker = DiLoCoWorker(FileHub(root), "slow", params, poll_interval=0.01, wait_timeout=10, pacing=pace, claim_ttl=60)
    worker.start()
    for _ in range(17):
        clock.t += 0.5  # 2 steps a second, a quarter of the fast peer's 8
        pace.after_step()
    params["w"] += 1.0
    result = worker.boundary(num_tokens=1000)
    assert result.inner_steps == 4  # 16 * 2 / 8
    assert result.metrics()["diloco/inner_steps"] == 4.0
    deadline = time.monotonic() + 5
    while not hub.read_claim("slow").info.get("step_rate") and time.monotonic() < deadline:
        time.sleep(0.02)  # the first report is sent at once, not half a ttl later
    info = hub.read_claim("slow").info
    assert info == {"step_rate": 2.0, "tokens_per_second": 125.0, "local_step": 1, "inner_steps": 4}
    worker.close()
    assert json.loads((root / "nodes" / "fast" / "claim.json").read_text())["holder"] == "h:1:a"  # untouched


# ----------------------------------------------------------------------------- the adapters


def _fast_peer(root):
    FileHub(root).write_claim("fast", _claim("fast", time.time(), ttl=60.0, step_rate=1000.0), expected=None)


def test_lightning_callback_with_dylu_and_throttle(tmp_path):
    """A throttled worker (at most 50 steps/s) among peers reporting 1000 steps/s: after its first phase
    (dylu_steps, while it measures itself) its phases shrink to dylu_min_steps; every step slept."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    from diloco_lightning import DiLoCo

    root = tmp_path / "hub"
    master = MasterOuterLoop(FileHub(root), None, node_state_dir=tmp_path / "m", poll_interval=0.02, norm_ratio=None)
    master.start()
    _fast_peer(root)
    steps: list[int] = []

    class Boundaries(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if diloco.metrics.get("diloco/boundary", 0) > len(steps):
                steps.append(trainer.global_step)

    diloco = DiLoCo(root, "w1", inner_steps="auto", dylu_steps=8, dylu_min_steps=2, throttle=0.02, sync="async",
                    poll_interval=0.01, wait_timeout=60.0, verbose=False)
    t0 = time.perf_counter()
    trainer = L.Trainer(accelerator="cpu", max_steps=16, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[diloco, Boundaries()])
    trainer.fit(BoringModel())
    elapsed = time.perf_counter() - t0
    master.stop()
    assert steps == [8, 10, 12, 14, 16]
    assert diloco.metrics["diloco/inner_steps"] == 2.0 and diloco.pacing.inner_steps == 2
    assert elapsed >= 16 * 0.02
    assert diloco.state_dict()["pacing"] == {"inner_steps": 2}  # a resume keeps its H


def test_accelerate_adapter_with_dylu(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from torch import nn

    from diloco_lightning.adapters.accelerate import DiLoCo

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    root = tmp_path / "hub"
    master = MasterOuterLoop(FileHub(root), None, node_state_dir=tmp_path / "m", poll_interval=0.02, norm_ratio=None)
    master.start()
    _fast_peer(root)
    acc = Accelerator(cpu=True)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    boundaries = []
    try:
        with DiLoCo(acc, model, root, "w1", inner_steps="auto", dylu_steps=8, dylu_min_steps=2, throttle=0.02,
                    poll_interval=0.01, wait_timeout=60.0, verbose=False) as diloco:
            for i in range(16):
                loss = model(torch.randn(2, 4)).pow(2).mean()
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
                if diloco.step(num_tokens=2) is not None:
                    boundaries.append(i + 1)
            state = diloco.state_dict()
    finally:
        master.stop()
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert boundaries == [8, 10, 12, 14, 16]
    assert state["pacing"] == {"inner_steps": 2} and state["last_boundary"] == 16
