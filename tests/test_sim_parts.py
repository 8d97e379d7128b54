"""The simulator's parts on their own: the clock (sim/clock.py), the imposed delays (sim/delays.py),
the evaluations (sim/evaluations.py) and what a phase starts from (sim/starts.py)."""

from __future__ import annotations

import torch

from diloco_lightning.master.config import MasterConfig
from diloco_lightning.sim import SimMaster, SimOptions
from diloco_lightning.sim.clock import EventQueue
from diloco_lightning.sim.delays import Delays
from diloco_lightning.sim.evaluations import Evaluations
from diloco_lightning.sim.starts import PhaseStarts
from diloco_lightning.worker.sync import resolve_delay


def _master() -> SimMaster:
    config = MasterConfig(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0, norm_ratio=None,
                          norm_global_ratio=None)
    return SimMaster({"w": torch.zeros(3)}, config)


def test_the_clock_pops_in_time_order_ties_in_push_order_and_round_trips():
    clock = EventQueue()
    clock.push(2.0, 0, 1, "late")
    clock.push(1.0, 0, 2, "first")
    clock.push(1.0, 10, 0, "second")
    assert clock.ticket() == 4 and len(clock) == 3  # a ticket counts as one more push
    again = EventQueue()
    again.load_state_dict(clock.state_dict())
    for q in (clock, again):
        assert [q.pop() for _ in range(3)] == [(1.0, 0, 2, "first"), (1.0, 10, 0, "second"), (2.0, 0, 1, "late")]
        assert not q
    clock.push(0.5, 1, 0)
    clock.clear()
    assert not clock and clock.ticket() == 6


class _W:
    def __init__(self, index: int) -> None:
        self.index, self.node_id = index, f"w{index}"


def test_delays_per_worker_per_delta_and_burn_in():
    workers = [_W(i) for i in range(3)]
    fixed = Delays([0, 2, 5], workers, SimOptions(max_delay=4, burn_in=2))
    assert fixed.per_worker == [0, 2, 4] and fixed.largest() == 4  # capped at max_delay
    assert [fixed.of(i, 1, 1) for i in range(3)] == [0, 0, 0]  # within burn_in
    assert [fixed.of(i, 5, 3) for i in range(3)] == [0, 2, 4] and fixed.fixed(1) == 2
    spec = {"distribution": "uniform", "low": 0, "high": 6, "seed": 3}
    drawn = Delays(spec, workers, SimOptions(max_delay=256))
    assert drawn.per_worker == [resolve_delay(spec, w.node_id, w.index) for w in workers]
    per_delta = Delays(spec, workers, SimOptions(delay_per="delta", max_delay=3))
    assert per_delta.per_delta and per_delta.fixed(0) is None and per_delta.largest() == 3
    draws = [per_delta.of(1, r, 10) for r in range(40)]
    assert draws == [per_delta.of(1, r, 10) for r in range(40)] and max(draws) <= 3 and len(set(draws)) > 1


def test_evaluations_at_points_at_times_stop_and_round_trip():
    master = _master()
    clock = EventQueue()
    seen: list[float] = []

    def evaluate(state) -> float:
        seen.append(float(state["w"].sum()))
        return 10.0 - len(seen)

    evals = Evaluations(evaluate, master, clock, points=[0, 0, 2])
    evals.after_step(tokens=0)
    assert evals.curve == [[0, 9.0]] and evals.points == [2]
    evals.after_step(tokens=5)  # outer step 0 again: nothing due
    assert len(evals.curve) == 1
    clock.now = 4.0
    evals.final(visible=0, tokens=7)  # the final version was evaluated already
    assert evals.curve == [[0, 9.0]]
    timed = Evaluations(evaluate, master, clock, times=[1.0, 3.0, 3.0, 8.0])
    timed.until(3.0, inclusive=False, visible=0, tokens=2)
    assert timed.curve == [[0, 8.0]] and timed.times == [1.0] and timed.tokens == [2]
    timed.until(3.0, inclusive=True, visible=0, tokens=3)  # the same version: not evaluated again
    assert timed.curve == [[0, 8.0], [0, 8.0]] and len(seen) == 2
    copy = Evaluations(evaluate, master, clock)
    copy.load_state_dict(timed.state_dict())
    assert copy.state_dict() == timed.state_dict()
    clock.push(9.0, 0, 0)
    stopping = Evaluations(evaluate, master, clock, times=[0.0], stop_above=1.0)
    master.outer_step = 1  # a version after 0 whose loss is above stop_above ends the run
    master.versions[1] = master.state
    stopping.until(1.0, inclusive=False, visible=1, tokens=0)
    assert stopping.stopped_early and not clock and stopping.pending_times == []


def test_phase_starts_reset_and_round_trip():
    master = _master()

    class Worker:
        plan = None

    starts = PhaseStarts([Worker(), Worker()], master, rebase=None, reset_inner_optimizer=True,
                         sync_inner_state=False, exact=True)
    assert torch.equal(starts.state(0, 0)["w"], torch.zeros(3))
    assert starts.args(0, 0) == {"reset": True} and starts.args(0, 0) == {"reset": False}
    again = PhaseStarts([Worker(), Worker()], master, rebase=None, reset_inner_optimizer=True,
                        sync_inner_state=False, exact=True)
    again.load_state_dict(starts.state_dict())
    assert again.args(0, 0) == {"reset": False} and again.args(1, 0) == {"reset": True}
