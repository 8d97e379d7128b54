"""Gap-Aware SGD and DC-ASGD against a float64 reference written out from the papers' rules.

The reference keeps every version (so its theta_base is exact) and applies the optimizer's
documented fallback, the running estimate ``tau * D_hat``, exactly where the optimizer's bounded
history cannot give the version.
"""

from __future__ import annotations

import pytest
import torch

from diloco_lightning.master.aggregation import round_step
from diloco_lightning.outer import DelayCompensated, GapAware, build_outer_optimizer

from test_outer import assert_states_equal, clone, floating, make_deltas, make_state, staleness_sequence


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one intra-op thread (conftest.py)


def _real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


class RefStaleSGD:
    """float64: g' from the rule, then SGD with Nesterov momentum; D and C the averages of the steps."""

    def __init__(self, state, lr, rule, momentum=0.0, history=0, beta=0.9, lam=1.0):
        self.lr, self.rule, self.m, self.history, self.beta, self.lam = lr, rule, momentum, history, beta, lam
        self.p = {k: _real(v.to(torch.complex128 if v.is_complex() else torch.float64)).clone()
                  for k, v in floating(state).items()}
        zeros = lambda: {k: torch.zeros_like(v) for k, v in self.p.items()}  # noqa: E731
        self.D, self.C, self.buf = zeros(), zeros(), zeros()
        self.versions = [clone(self.p)]
        self.t = 0

    def diff(self, k, tau):
        if tau == 0 or self.t == 0:
            return None
        v = self.t - tau
        if self.history and tau <= self.history and v >= 0:
            return self.p[k] - self.versions[v][k]
        return self.D[k] * tau / (1 - self.beta ** self.t)

    def step(self, delta, tau):
        new = {}
        for k, p in self.p.items():
            g = _real(delta[k].to(torch.complex128 if delta[k].is_complex() else torch.float64))
            diff = self.diff(k, tau)
            if diff is not None and self.rule == "gap":
                c_hat = self.C[k] / (1 - self.beta ** self.t)
                gap = diff.abs()
                g = g * torch.where(gap > c_hat, c_hat / gap, torch.ones_like(gap))
            elif diff is not None:
                g = g + self.lam * g * g * diff / (g * g).mean()
            if self.m:
                self.buf[k] = self.m * self.buf[k] + g
                u = g + self.m * self.buf[k]
            else:
                u = g
            step = -self.lr * u
            new[k] = p + step
            self.D[k] = self.beta * self.D[k] + (1 - self.beta) * step
            self.C[k] = self.beta * self.C[k] + (1 - self.beta) * step.abs()
        self.p = new
        self.t += 1
        self.versions.append(clone(self.p))


def _check(state, ref):
    for k, v in ref.p.items():
        torch.testing.assert_close(_real(state[k]).double(), v, rtol=2e-5, atol=2e-6, msg=k)


@pytest.mark.parametrize("rule", ["gap", "dc"])
@pytest.mark.parametrize("history, momentum", [(0, 0.0), (16, 0.0), (5, 0.0), (16, 0.5), (0, 0.9)])
def test_matches_the_reference(rule, history, momentum):
    """Exact theta_base while the history has it (history 16 covers every tau here; 5 does not,
    so the estimate takes over for the older bases), the estimate otherwise."""
    state = make_state(complex_key=True)
    n = 40
    deltas = make_deltas(state, n, scale=0.05)
    taus = staleness_sequence(n)
    kwargs = {"momentum": momentum, "history": history, "beta": 0.8}
    if rule == "gap":
        opt = GapAware(state, lr=0.7, **kwargs)
    else:
        opt = DelayCompensated(state, lr=0.7, lam=0.2, **kwargs)
    ref = RefStaleSGD(state, 0.7, rule, lam=0.2, **kwargs)
    for delta, tau in zip(deltas, taus):
        assert opt.step(state, delta, staleness=tau) is True
        ref.step(delta, tau)
    _check(state, ref)
    assert torch.equal(state["position_ids"], torch.arange(11))
    assert opt.steps_taken == n


def test_the_gap_penalises_a_coordinate_by_the_typical_steps_it_moved():
    """Coordinate 0 moved 4 typical steps since the base: its delta enters at 1/4; coordinate 1
    moved back and forth (no gap): unchanged."""
    state = {"w": torch.zeros(2)}
    opt = GapAware(state, lr=1.0, history=8, beta=0.0)  # beta 0: C is the last step's size
    for sign in (1.0, 1.0, 1.0, 1.0):
        opt.step(state, {"w": torch.tensor([-1.0, sign * (-1.0 if opt.steps_taken % 2 else 1.0)])})
    assert state["w"].tolist() == [4.0, 0.0]
    before = state["w"].clone()
    opt.step(state, {"w": torch.tensor([-2.0, -2.0])}, staleness=4)
    assert (state["w"] - before).tolist() == [0.5, 2.0]


def test_fresh_deltas_are_plain_sgd():
    a, b = make_state(), make_state()
    opt = GapAware(a, lr=0.4, history=3)
    ref = build_outer_optimizer("staleness_sgd", b, lr=0.4)
    for delta in make_deltas(a, 6):
        opt.step(a, delta, staleness=0)
        ref.step(b, delta, staleness=0)
    for k in floating(a):
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["gap_aware", "dc_asgd"])
@pytest.mark.parametrize("history", [0, 4])
def test_state_dict_round_trip_continues_bit_exactly(name, history):
    state = make_state(complex_key=True)
    deltas = make_deltas(state, 20)
    taus = staleness_sequence(20)
    opt = build_outer_optimizer(name, state, lr=0.5, history=history)
    for d, tau in zip(deltas[:10], taus[:10]):
        opt.step(state, d, staleness=tau)
    sd = opt.state_dict()
    assert ("history_since" in sd) == bool(history)
    assert sum(k.startswith("history/") for k in sd) == (4 * len(floating(state)) if history else 0)
    twin_state = clone(state)
    twin = build_outer_optimizer(name, twin_state, **opt.options)
    twin.load_state_dict(sd)
    for d, tau in zip(deltas[10:], taus[10:]):
        opt.step(state, d, staleness=tau)
        twin.step(twin_state, d, staleness=tau)
    assert_states_equal(state, twin_state)
    assert_states_equal(opt.state_dict(), twin.state_dict())


def test_memory_is_what_the_docs_say():
    """Estimate only: the drift buffer (and Gap-Aware's step size); momentum 0 keeps no momentum buffer."""
    state = {"w": torch.zeros(10, 10)}
    assert sorted(k for k in GapAware(state, lr=1.0).state_dict() if "/" in k) == ["drift/w", "step_size/w"]
    assert sorted(k for k in DelayCompensated(state, lr=1.0).state_dict() if "/" in k) == ["drift/w"]
    opt = GapAware(state, lr=1.0, history=3, momentum=0.5)
    for _ in range(5):
        opt.step(state, {"w": torch.ones(10, 10)})
    sd = opt.state_dict()
    assert sorted(k for k in sd if k.startswith("history/")) == ["history/2/w", "history/3/w", "history/4/w"]
    assert sd["history_since"] == [["w", 2]]


def test_a_round_mean_is_corrected_with_the_round_staleness():
    """The master's rounds step a gap-aware optimizer with the round's largest staleness."""
    a, b = {"w": torch.zeros(4)}, {"w": torch.zeros(4)}
    opt_a, opt_b = GapAware(a, lr=1.0, history=4), GapAware(b, lr=1.0, history=4)
    for i in range(4):
        d = {"w": torch.tensor([-1.0, 1.0, -0.5, 0.0]) * (i + 1)}
        round_step(opt_a, "gap_aware", legacy=False, tau_max=min(i, 2))(a, d)
        opt_b.step(b, d, staleness=min(i, 2))
    assert torch.equal(a["w"], b["w"])


def test_bad_options_name_themselves():
    state = make_state()
    for bad in ({"history": -1}, {"beta": 1.0}, {"momentum": 1.0}, {"lr": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            GapAware(state, **{"lr": 0.1, **bad})
    with pytest.raises(ValueError, match="lam"):
        DelayCompensated(state, lr=0.1, lam=-1.0)
    opt = GapAware(state, lr=0.1)
    with pytest.raises(ValueError, match="history"):
        opt.load_state_dict({"optimizer": "gap_aware", "history/0/scalar": torch.zeros(())})
