"""The simulator's communication, churn and synchronous rounds with a quorum, against schedules worked by hand.

The quadratic model of ``tests/test_sim.py``: 5 FP32 weights, so a delta and a version are 20
bytes each; H = 2 SGD steps on ``0.5 |w - T|^2`` from ``x`` give the delta ``C (x - T)``; outer SGD
with lr 1 and no momentum applies the mean of a step's deltas. Every test writes down, by hand,
when each transfer starts and ends, when each version is published, and from which version each
applied delta was computed; the simulator must produce exactly that schedule, those times and
(to float tolerance) those weights.
"""

from __future__ import annotations

import math

import pytest
import torch

from test_sim import C, N, TARGET, _quad_workers

from diloco_lightning.master.config import MasterConfig
from diloco_lightning.sim import SimMaster, SimOptions, Simulator
from diloco_lightning.sim.churn import Churn
from diloco_lightning.sim.links import Link
from diloco_lightning.util.options import OptionError


def _run(k, phases, *, aggregation, sync, speeds=None, delay=0, delta_dtype=torch.float32, **opts):
    workers = _quad_workers(k, phases, speeds)
    config = MasterConfig(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0, aggregation=aggregation,
                          norm_ratio=None, norm_global_ratio=None)
    master = SimMaster({"w": torch.zeros(N)}, config)
    sim = Simulator(workers, master, sync=sync, delay=delay, options=SimOptions(speeds=speeds, **opts),
                    delta_dtype=delta_dtype)
    return sim, sim.run()


def _d(v):
    """The delta of a phase computed from version ``v`` (a tensor)."""
    return C * (v - TARGET)


def _applied(sim):
    return [a for r in sim.master.records for a in r.get("applied", [])]


# ----------------------------------------------------------------------------- links


def test_a_link_takes_latency_plus_bytes_over_bandwidth_and_one_transfer_at_a_time():
    link = Link(latency=0.5, bandwidth=10.0)
    assert link.upload(1.0, 20) == (1.0, 3.5)  # 0.5 + 20 / 10
    assert link.upload(2.0, 20) == (3.5, 6.0)  # after the first
    assert link.download(2.0, 10) == (2.0, 3.5)  # the other direction is free
    traced = Link(bandwidth=[[0, 10.0], [2, 5.0]])  # 10 bytes/unit until t=2, 5 after
    assert traced.end_of(1.0, 20) == pytest.approx(1.0 + 1.0 + 10 / 5)  # 10 bytes by t=2, then 10 at 5/unit
    assert Link().end_of(3.0, 10**9) == 3.0 and Link().instant and not link.instant


def test_link_options_are_checked_naming_the_option():
    assert SimOptions(bandwidth=[[0, 5], [10, 2]]).validate(4).bandwidth_of(3) == [[0.0, 5.0], [10.0, 2.0]]
    assert SimOptions(bandwidth=[1.0, None, [[0, 2], [5, 1]]]).validate(3).bandwidth_of(1) is None
    assert SimOptions(latency=[0, 1.5]).validate(2).latency_of(1) == 1.5
    for opts, name in [({"bandwidth": 0}, "bandwidth"), ({"bandwidth": [1.0, 2.0]}, "bandwidth"),
                       ({"bandwidth": [[1, 5]]}, "bandwidth"), ({"latency": -1}, "latency"),
                       ({"master_time": -0.1}, "master_time"), ({"late": "later"}, "late"),
                       ({"preempt": {"rate": 0.1}}, "preempt"), ({"preempt": [[[5, 3]], None, None]}, "preempt"),
                       ({"deadline": 0}, "deadline")]:
        with pytest.raises(OptionError) as e:
            SimOptions(**opts).validate(3)
        assert e.value.option == name


# ----------------------------------------------------------------------------- lockstep with communication


def test_lockstep_waits_for_every_upload_the_master_and_every_download():
    """2 workers, lockstep delay 0, H = 2 at speed 1; 20-byte deltas and versions; latency 0.5;
    w0 20 bytes/unit (a transfer: 1.5), w1 10 bytes/unit (2.5); listing delay 0.25; master 0.25.
    Round 1: phases end at 2; uploads end at 3.5 (w0) and 4.5 (w1); the master sees them at 3.75 and
    4.75, closes the round at 4.75, publishes v1 at 5.0; w0 downloads it by 6.5, w1 by 7.5.
    Round 2: phases 6.5-8.5 and 7.5-9.5; uploads end at 10.0 and 12.0; seen at 10.25 and 12.25; v2
    at 12.5; downloads end at 14.0 and 15.0. Round 3: phases end at 16.0 and 17.0, uploads at
    17.5 and 19.5, seen at 19.75, v3 at 20.0 (and downloaded: what each worker ends with). The
    weights are synchronous DiLoCo's."""
    sim, result = _run(2, 3, aggregation="round", sync="lockstep", latency=0.5, bandwidth=[20.0, 10.0],
                       listing_delay=0.25, master_time=0.25)
    assert [r["time"] for r in sim.master.records] == [5.0, 12.5, 20.0]
    v = torch.zeros(N)
    for _ in range(3):
        v = v - _d(v)
    torch.testing.assert_close(result.final_state["w"], v)
    # the last boundary downloads v3 too (what the worker ends with)
    assert result.comm["time_uploading"] == [4.5, 7.5] and result.comm["time_downloading"] == [4.5, 7.5]
    assert result.comm["bytes_down"] == 6 * 20 and result.bytes_sent == 6 * 20
    assert [u["compute"] for u in result.time_use] == [6.0, 6.0]


def test_lockstep_delay_one_overlaps_the_upload_but_downloads_at_the_boundary():
    """The same links, delay 1 (each delta from the version before the previous round's): a worker
    uploads in the background and needs, at boundary r, version r - 1. w0: phase 1 0-2 (v0), phase
    2 begins at once (v0 held); upload 1 2-3.5. w1: upload 1 2-4.5. v1 at 5.0. Boundary 2 at 4
    (w0) needs v1: download 5.0-6.5, phase 3 6.5-8.5. w1: boundary 2 at 4, download 5.0-7.5,
    phase 3 7.5-9.5. Uploads of delta 2 wait for v1 (gated): w0 5.0-6.5, w1 5.0-7.5; seen 6.75 and
    7.75; v2 at 8.0 (from v0, staleness 1)."""
    sim, result = _run(2, 3, aggregation="round", sync="lockstep", delay=1, latency=0.5, bandwidth=[20.0, 10.0],
                       listing_delay=0.25, master_time=0.25)
    times = [r["time"] for r in sim.master.records]
    assert times[:2] == [5.0, 8.0]
    assert [r["staleness_histogram"] for r in sim.master.records][:2] == [{"0": 2}, {"1": 2}]


# ----------------------------------------------------------------------------- async: merged uploads, prefetch


def test_async_overlaps_merges_what_is_ready_and_installs_what_it_downloaded():
    """One worker, async, arrival mode, H = 2 at speed 1, latency 3 (every transfer takes 3), 6 phases.
    t=2 phase 1 ends: upload [1] 2-5. t=4 phase 2 ends (uploader busy: held). t=5 [1] arrives (v0,
    staleness 0) -> v1; download v1 5-8; upload [2] 5-8. t=6 phase 3 ends (held). t=8 v1 downloaded,
    [2] arrives (v0, staleness 1) -> v2, download v2 8-11, upload [3] 8-11; phase 4 ends (held).
    t=10 phase 5 ends: merged with 4. t=11 v2 downloaded, [3] arrives (v0, staleness 2) -> v3,
    upload [4+5] 11-14; t=12 phase 6 ends (held). t=14 [4+5] arrives (base v0, the older of its
    two: staleness 3) -> v4; upload [6] 14-17; t=17 [6] arrives (v1, staleness 3) -> v5. Phases 1-4
    started from v0, 5-6 from v1 (downloaded at 8); phase 7 would have started from v2."""
    sim, result = _run(1, 6, aggregation="arrival", sync="async", latency=3.0)
    assert [r["time"] for r in sim.master.records] == [5.0, 8.0, 11.0, 14.0, 17.0]
    assert _applied(sim) == ["w0/1", "w0/2", "w0/3", "w0/5", "w0/6"]
    assert [list(r["staleness_histogram"]) for r in sim.master.records] == [["0"], ["1"], ["2"], ["3"], ["3"]]
    v0 = torch.zeros(N)
    v1 = v0 - _d(v0)
    v2 = v1 - _d(v0)
    v3 = v2 - _d(v0)
    v4 = v3 - (_d(v0) + _d(v1))
    v5 = v4 - _d(v1)
    torch.testing.assert_close(result.final_state["w"], v5)
    assert result.deltas == 5 and result.bytes_sent == 5 * 20 and result.sim_time == 17.0


def test_async_master_time_publishes_one_step_after_the_other():
    """Two workers, async arrival, instant links, the master 1 unit per outer step: both deltas arrive
    at 2 (v0), v1 is published at 3 and v2 at 4; phases 2 begin at 2 from v0 (nothing newer is out)
    and arrive at 4 with staleness 2 and 3 (the master is at outer step 2, then 3)."""
    sim, result = _run(2, 2, aggregation="arrival", sync="async", master_time=1.0)
    assert [r["time"] for r in sim.master.records] == [3.0, 4.0, 5.0, 6.0]
    assert [list(r["staleness_histogram"]) for r in sim.master.records] == [["0"], ["1"], ["2"], ["3"]]


# ----------------------------------------------------------------------------- churn


def test_lockstep_preemption_loses_the_phase_and_the_round_waits():
    """Lockstep, 2 workers, H = 2, instant links; w1 is down on [3, 6]. Round 1: v1 at 2. Both begin
    phase 2 at 2; w1's is interrupted at 3 (lost, not computed); back at 6 it computes phase 2 again
    from v1 (6-8): v2 at 8 (w0 waited from 4). Phase 3: 8-10, v3 at 10: synchronous DiLoCo's weights."""
    sim, result = _run(2, 3, aggregation="round", sync="lockstep", preempt=[None, [[3, 6]]])
    assert [r["time"] for r in sim.master.records] == [2.0, 8.0, 10.0]
    assert result.lost_phases == 1 and [w.steps for w in sim.workers] == [6, 6]
    assert result.time_use[1] == {"compute": 6.0, "lost": 1.0, "down": 3.0}
    v = torch.zeros(N)
    for _ in range(3):
        v = v - _d(v)
    torch.testing.assert_close(result.final_state["w"], v)


def test_async_preemption_comes_back_from_the_newest_version():
    """Async arrival, 2 workers, H = 2, instant links; w1 is down on [3, 6]. t=2: w0/1 (v0) -> v1, w0
    begins from v1; w1/1 (v0) -> v2, w1 begins from v2, and loses that phase at 3. t=4: w0/2 (v1)
    -> v3. t=6: w1 comes back (its return was queued at 3, before w0's phase end: ties go by queue
    order) and begins from the newest version, v3; w0/3 (v3) -> v4. t=8: w1/2 (v3, staleness 1) -> v5, w0/4 (v4, 1)
    -> v6."""
    sim, result = _run(2, 4, aggregation="arrival", sync="async", preempt=[None, [[3, 6]]], max_time=8)
    assert _applied(sim) == ["w0/1", "w1/1", "w0/2", "w0/3", "w1/2", "w0/4"]
    assert [list(r["staleness_histogram"]) for r in sim.master.records] == [["0"], ["1"], ["1"], ["0"], ["1"], ["1"]]
    assert result.lost_phases == 1 and result.time_use[1]["lost"] == 1.0


def test_a_seeded_preemption_law_loses_its_expected_share_of_time():
    churn = Churn(4, preempt={"rate": 0.01, "down": 10.0, "seed": 3})
    again = Churn(4, preempt={"rate": 0.01, "down": 10.0, "seed": 3})
    horizon = 200_000.0
    shares = [churn.down_time(k, horizon) / horizon for k in range(4)]
    assert shares == [again.down_time(k, horizon) / horizon for k in range(4)]  # the same draws
    assert len(set(shares)) == 4  # each worker its own
    expected = 0.01 * 10 / (1 + 0.01 * 10)  # r d / (1 + r d) = 0.0909
    assert all(abs(s - expected) < 0.01 for s in shares)
    assert churn.up_at(0, churn.next_down(0, 0.0)) > churn.next_down(0, 0.0)


# ----------------------------------------------------------------------------- synchronous rounds with a quorum


def test_quorum_rounds_drop_the_straggler():
    """Barrier rounds of 2 of 3 workers, late deltas dropped; speeds [1, 1, 1/4], H = 2, a budget of 13:
    the fast two close a round at 2, 4, 6 and 8; the straggler's phase (8 units) begun at 0, 2 and 4
    is given up at each new version and begun again from it; the one it would begin at 6 would end
    past the budget. It never delivers; each round is the mean of two deltas from its version."""
    sim, result = _run(3, 4, aggregation="round", sync="async", speeds=[1.0, 1.0, 0.25], barrier=True, quorum=2,
                       late="drop", max_time=13)
    assert [r["time"] for r in sim.master.records] == [2.0, 4.0, 6.0, 8.0]
    assert all(r["staleness_histogram"] == {"0": 2} for r in sim.master.records)
    assert sim.workers[2].steps == 0 and sim.abandoned_phases == 3 and result.time_use[2]["lost"] == 6.0
    v = torch.zeros(N)
    for _ in range(4):
        v = v - _d(v)
    torch.testing.assert_close(result.final_state["w"], v)


def test_quorum_rounds_with_a_deadline_apply_late_deltas():
    """Barrier rounds of 2 of 2 with a deadline of 3 after each version, late deltas applied;
    speeds [1, 1/4], H = 2. t=2 w0/1 arrives; the deadline closes round 1 at 3 with it alone (v1);
    w0 begins from v1 at 3, its delta 2 arrives at 5; the deadline closes round 2 at 6 (v2). w0's
    phase 3 (from v2) and w1's phase 1 (from v0) end at 8: w1/1 arrives first (staleness 2), w0/3
    completes the round (staleness 0): v3 is their mean, at 8."""
    sim, result = _run(2, 3, aggregation="round", sync="async", speeds=[1.0, 0.25], barrier=True, quorum=2,
                       deadline=3.0, max_time=8)
    assert [r["time"] for r in sim.master.records] == [3.0, 6.0, 8.0]
    assert [r["staleness_histogram"] for r in sim.master.records] == [{"0": 1}, {"0": 1}, {"2": 1, "0": 1}]
    v0 = torch.zeros(N)
    v1 = v0 - _d(v0)
    v2 = v1 - _d(v1)
    v3 = v2 - (_d(v0) + _d(v2)) / 2
    torch.testing.assert_close(result.final_state["w"], v3)


@pytest.mark.parametrize("late", ["drop", "apply"])
def test_a_quorum_round_takes_every_delta_arriving_at_the_same_instant(late):
    """Barrier rounds of 2 of 3 equal workers (speed 1, H = 2, a budget of 6): the three deltas of a
    round arrive together at 2, 4 and 6, and a master's listing takes them all, so each round is the
    mean of three deltas from its version, every one fresh; none is refused as late, no phase is
    given up, and no delta is pushed into the next round (which a round closed at the second arrival
    of the instant would do)."""
    sim, result = _run(3, 3, aggregation="round", sync="async", speeds=[1.0, 1.0, 1.0], barrier=True, quorum=2,
                       late=late, max_time=6)
    assert [r["time"] for r in sim.master.records] == [2.0, 4.0, 6.0]
    assert all(r["staleness_histogram"] == {"0": 3} for r in sim.master.records)
    assert sim.abandoned_phases == 0 and [w.steps for w in sim.workers] == [6, 6, 6]
    v = torch.zeros(N)
    for _ in range(3):
        v = v - _d(v)  # the mean of three equal deltas
    torch.testing.assert_close(result.final_state["w"], v)


def test_quorum_of_every_worker_is_lockstep():
    lock, a = _run(3, 4, aggregation="round", sync="lockstep", speeds=[1.0, 0.5, 0.7])
    barrier, b = _run(3, 4, aggregation="round", sync="async", speeds=[1.0, 0.5, 0.7], barrier=True)
    assert [r["time"] for r in lock.master.records] == [r["time"] for r in barrier.master.records]
    assert torch.equal(a.final_state["w"], b.final_state["w"])


def test_barrier_needs_async_rounds():
    with pytest.raises(OptionError, match="barrier"):
        _run(2, 1, aggregation="round", sync="lockstep", barrier=True)
    with pytest.raises(OptionError, match="barrier"):
        _run(2, 1, aggregation="arrival", sync="async", barrier=True)


def test_no_communication_options_is_the_schedule_without_communication():
    plain, a = _run(3, 5, aggregation="arrival", sync="async", speeds=[1.0, 0.5, 0.7])
    zero, b = _run(3, 5, aggregation="arrival", sync="async", speeds=[1.0, 0.5, 0.7], latency=0.0, bandwidth=None,
                   master_time=0.0, listing_delay=0.0)
    assert _applied(plain) == _applied(zero) and torch.equal(a.final_state["w"], b.final_state["w"])
    assert math.isclose(a.sim_time, b.sim_time)
