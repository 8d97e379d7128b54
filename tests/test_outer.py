"""Outer optimizers against independent references (torch.optim, the papers' algorithms written out)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from diloco_lightning.outer import (
    CGAD,
    OUTER_OPTIMIZERS,
    PACGAD,
    AdamDecay,
    DelayedNesterov,
    NesterovOuterOptimizer,
    OuterOptimizer,
    PolyNesterov,
    StalenessSGD,
    build_outer_optimizer,
    cgad_gate,
)

ALL_NAMES = sorted(OUTER_OPTIMIZERS)
FRAGMENTS = {"attn": ["layers.0.attn", "layers.1.attn"], "rest": ["embed.weight", "norm.", "scalar"]}


# ----------------------------------------------------------------------------- fixtures and helpers
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one intra-op thread (conftest.py)


def make_state(*, complex_key: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """Several tensors of different shapes, a 0-d tensor, an int buffer (and a complex tensor)."""
    gen = torch.Generator().manual_seed(seed)
    state = {
        "embed.weight": torch.randn(37, 8, generator=gen),
        "layers.0.attn.q": torch.randn(8, 8, generator=gen),
        "layers.1.attn.q": torch.randn(8, 8, generator=gen),
        "norm.weight": torch.randn(8, generator=gen),
        "scalar": torch.randn((), generator=gen),
    }
    state = {k: v.to(dtype) for k, v in state.items()}
    state["position_ids"] = torch.arange(11)
    if complex_key:
        state["norm.freqs"] = torch.randn(5, 3, dtype=torch.complex64, generator=gen)
    return state


def make_deltas(state: dict, steps: int, *, seed: int = 1, scale: float = 0.1) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        delta = {}
        for key, value in state.items():
            if value.is_complex():
                delta[key] = scale * torch.randn(value.shape, dtype=torch.complex64, generator=gen)
            elif value.is_floating_point():
                delta[key] = scale * torch.randn(value.shape, generator=gen)
            else:
                delta[key] = torch.zeros_like(value)  # integer keys never move
        out.append(delta)
    return out


def floating(state: dict) -> dict:
    return {k: v for k, v in state.items() if v.is_floating_point() or v.is_complex()}


def clone(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def build(name: str, state: dict, **extra) -> OuterOptimizer:
    options = {"lr": 0.05, **extra}
    if name == "delayed_nesterov":
        options.setdefault("buffer_size", 3)
    if name == "pa_cgad":
        options.setdefault("fragments", FRAGMENTS)
    return build_outer_optimizer(name, state, **options)


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def staleness_sequence(n: int) -> list[int]:
    return [(3 * i + i * i) % 13 for i in range(n)]


def ref_cgad_gate(tau: float, alpha: float = 0.2, tau_cut: float = 32) -> float:
    if tau > tau_cut:
        return 0.0
    return 0.5 * (1 + math.cos(math.pi * tau / tau_cut)) * math.exp(-alpha * tau)


class RefAdam:
    """Gated, bias-corrected Adam in float64, written out from the CGAD paper's formulas."""

    def __init__(self, state, lr, betas=(0.9, 0.999), eps=1e-8):
        self.lr, (self.b1, self.b2), self.eps = lr, betas, eps
        self.p = {k: v.to(torch.complex128 if v.is_complex() else torch.float64) for k, v in floating(state).items()}
        self.m = {k: torch.zeros_like(v) for k, v in self.p.items()}
        self.v = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in self.p.items()}
        self.t = 0

    def step(self, delta, gate):
        if gate == 0.0:
            return False
        self.t += 1
        for k in self.p:
            g = gate * delta[k].to(self.p[k].dtype)
            self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * g
            self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * (g * g.conj()).real
            m_hat = self.m[k] / (1 - self.b1**self.t)
            v_hat = self.v[k] / (1 - self.b2**self.t)
            self.p[k] = self.p[k] - self.lr * m_hat / (v_hat.sqrt() + self.eps)
        return True


def true_buffer(sd: dict, family: str, key: str, scales: str) -> torch.Tensor:
    """A buffer as the math defines it: stored tensor times its per-key scale."""
    return sd[scales][sd["keys"].index(key)] * sd[f"{family}/{key}"]


def assert_close_to_ref(state: dict, ref: dict, rtol=2e-5, atol=2e-6):
    for key, value in ref.items():
        torch.testing.assert_close(state[key].to(value.dtype), value, rtol=rtol, atol=atol, msg=key)


# ----------------------------------------------------------------------------- gates
@pytest.mark.parametrize(
    "tau, expected", [(0, 1.0), (4, 0.432), (8, 0.172), (16, 0.0204), (24, 0.00121), (32, 0.0), (33, 0.0), (1000, 0.0)]
)
def test_cgad_gate_values(tau, expected):
    assert cgad_gate(tau) == pytest.approx(expected, rel=5e-3, abs=0)
    assert CGAD(make_state(), lr=0.1).gate(tau) == cgad_gate(tau)


def test_gates_of_every_optimizer():
    state = make_state()
    assert build("nesterov", state).gate(7) == 1.0
    assert build("delayed_nesterov", state).gate(7) == 1.0
    assert build("adam", state).gate(7) == 1.0
    assert build("poly_nesterov", state).gate(8) == pytest.approx(1 / 3)
    assert build("adam_decay", state).gate(5) == pytest.approx(math.exp(-1.0))
    assert build("adam_decay", state, alpha=0.5).gate(2) == pytest.approx(math.exp(-1.0))
    assert build("pa_cgad", state).gate(4) == cgad_gate(4)
    assert cgad_gate(16, alpha=0.0, tau_cut=64) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert cgad_gate(31.5) == pytest.approx(ref_cgad_gate(31.5))
    for name in ALL_NAMES:
        with pytest.raises(ValueError, match="staleness"):
            build(name, state).gate(-1)


# ----------------------------------------------------------------------------- Nesterov
@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_nesterov_matches_torch_sgd(momentum):
    state = make_state(complex_key=True)
    deltas = make_deltas(state, 40)
    params = {k: v.clone().requires_grad_(True) for k, v in floating(state).items()}
    sgd = torch.optim.SGD(params.values(), lr=0.7, momentum=momentum, nesterov=momentum > 0, foreach=False)
    opt = NesterovOuterOptimizer(state, lr=0.7, momentum=momentum)
    for i, delta in enumerate(deltas):
        for k, p in params.items():
            p.grad = delta[k].clone()
        sgd.step()
        assert opt.step(state, delta, staleness=i % 5) is True
    assert torch.equal(state["position_ids"], torch.arange(11))
    for k, p in params.items():
        torch.testing.assert_close(state[k], p.detach(), rtol=1e-5, atol=1e-5, msg=k)
    if momentum:
        buffers = opt.state_dict()
        assert buffers.keys() == params.keys()  # Speedtronic's format: momentum tensors only
        for k, p in params.items():
            torch.testing.assert_close(buffers[k], sgd.state[p]["momentum_buffer"], rtol=1e-5, atol=1e-5)


def test_nesterov_state_dict_is_speedtronic_format():
    state = make_state(complex_key=True)
    opt = NesterovOuterOptimizer(state, lr=0.7)
    opt.step(state, make_deltas(state, 1)[0])
    sd = opt.state_dict()
    assert set(sd) == set(floating(state))
    assert sd["norm.freqs"].dtype == torch.complex64 and sd["scalar"].dtype == torch.float32
    sd["scalar"].add_(100.0)  # a clone: the optimizer is unaffected
    assert opt.state_dict()["scalar"].abs().item() < 100
    loaded = {k: v.to(torch.bfloat16) if not v.is_complex() else v for k, v in sd.items()}
    opt.load_state_dict(loaded)
    after = opt.state_dict()
    assert after["embed.weight"].dtype == torch.float32
    assert torch.equal(after["embed.weight"], loaded["embed.weight"].float())
    assert after["embed.weight"].data_ptr() != loaded["embed.weight"].data_ptr()
    with pytest.raises(ValueError, match="nope"):
        opt.load_state_dict({"nope": torch.zeros(3)})
    with pytest.raises(ValueError, match="scalar"):
        opt.load_state_dict({"scalar": torch.zeros(3)})


def test_poly_nesterov_matches_torch_sgd_on_scaled_delta():
    state = make_state(complex_key=True)
    deltas = make_deltas(state, 30)
    params = {k: v.clone().requires_grad_(True) for k, v in floating(state).items()}
    sgd = torch.optim.SGD(params.values(), lr=0.5, momentum=0.9, nesterov=True, foreach=False)
    opt = PolyNesterov(state, lr=0.5, momentum=0.9)
    for delta, tau in zip(deltas, staleness_sequence(len(deltas))):
        for k, p in params.items():
            p.grad = delta[k] * (1 + tau) ** -0.5
        sgd.step()
        assert opt.step(state, delta, staleness=tau)
    for k, p in params.items():
        torch.testing.assert_close(state[k], p.detach(), rtol=1e-5, atol=1e-5, msg=k)
    sd = opt.state_dict()
    for k, p in params.items():  # the true buffer is momentum_scale * momentum/<key>
        torch.testing.assert_close(
            true_buffer(sd, "momentum", k, "momentum_scales"), sgd.state[p]["momentum_buffer"], rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("momentum, power", [(0.0, 1.0), (0.5, 1.0), (0.9, 1.0), (0.0, 2.0), (0.9, 0.25)])
def test_staleness_sgd_matches_torch_sgd_on_scaled_delta(momentum, power):
    """Zhang et al.'s lr / staleness (power 1, no momentum) and its momentum variants: torch's SGD
    fed grad = g * (1 + tau) ** -power, Nesterov when there is momentum."""
    state = make_state(complex_key=True)
    deltas = make_deltas(state, 30)
    params = {k: v.clone().requires_grad_(True) for k, v in floating(state).items()}
    sgd = torch.optim.SGD(params.values(), lr=0.8, momentum=momentum, nesterov=momentum > 0, foreach=False)
    opt = StalenessSGD(state, lr=0.8, momentum=momentum, power=power)
    for delta, tau in zip(deltas, staleness_sequence(len(deltas))):
        for k, p in params.items():
            p.grad = delta[k] * (1 + tau) ** -power
        sgd.step()
        assert opt.step(state, delta, staleness=tau)
    for k, p in params.items():
        torch.testing.assert_close(state[k], p.detach(), rtol=1e-5, atol=1e-5, msg=k)
    sd = opt.state_dict()
    if momentum == 0.0:  # no momentum: no buffer at all, nothing but the state
        assert sd == {"optimizer": "staleness_sgd"}
    else:
        for k, p in params.items():
            torch.testing.assert_close(
                true_buffer(sd, "momentum", k, "momentum_scales"), sgd.state[p]["momentum_buffer"], rtol=1e-5, atol=1e-5
            )


def test_staleness_sgd_with_negative_momentum_is_the_nesterov_formula():
    """torch's SGD refuses a negative momentum: the reference is the formula, in float64."""
    state = make_state()
    p = {k: v.double() for k, v in floating(state).items()}
    buf = {k: torch.zeros_like(v) for k, v in p.items()}
    opt = StalenessSGD(state, lr=0.6, momentum=-0.4, power=1.0)
    for delta, tau in zip(make_deltas(state, 20), staleness_sequence(20)):
        for k in p:
            g = delta[k].double() / (1 + tau)
            buf[k] = -0.4 * buf[k] + g
            p[k] = p[k] - 0.6 * (g + -0.4 * buf[k])
        opt.step(state, delta, staleness=tau)
    for k in p:
        torch.testing.assert_close(state[k].double(), p[k], rtol=1e-5, atol=1e-6, msg=k)
    with pytest.raises(ValueError, match="momentum"):
        StalenessSGD(state, lr=0.6, momentum=-1.0)
    with pytest.raises(ValueError, match="momentum"):
        build_outer_optimizer("nesterov", state, lr=0.6, momentum=-0.4)


def test_staleness_sgd_contains_poly_and_nesterov():
    """power 0.5 with momentum 0.9 is Poly and power 0 is DiLoCo's Nesterov, bit for bit."""
    for other, options in (("poly_nesterov", {"power": 0.5, "momentum": 0.9}), ("nesterov", {"power": 0.0, "momentum": 0.9})):
        a, b = make_state(), make_state()
        opt_a = build_outer_optimizer("staleness_sgd", a, lr=0.3, **options)
        opt_b = build_outer_optimizer(other, b, lr=0.3, momentum=0.9)
        for delta, tau in zip(make_deltas(a, 12), staleness_sequence(12)):
            opt_a.step(a, delta, staleness=tau)
            opt_b.step(b, delta, staleness=tau)
        assert_states_equal(a, b)
    assert StalenessSGD(make_state(), lr=1.0).gate(8) == pytest.approx(1 / 9)
    assert StalenessSGD(make_state(), lr=1.0, power=2).gate(3) == pytest.approx(1 / 16)


@pytest.mark.parametrize("name", ["nesterov", "adam", "cgad", "adam_decay", "poly_nesterov", "staleness_sgd"])
def test_keys_missing_from_a_delta_are_untouched_like_params_without_grad(name):
    """torch.optim skips a parameter whose grad is None (buffers and step count included)."""
    state = make_state()
    deltas = make_deltas(state, 24)
    params = {k: v.clone().requires_grad_(True) for k, v in floating(state).items()}
    if "adam" in name or name == "cgad":  # torch.optim.Adam fed grad = gate(tau) * delta
        ref, opt = torch.optim.Adam(params.values(), lr=0.01, foreach=False), build(name, state, lr=0.01)
    else:
        ref, opt = (
            torch.optim.SGD(params.values(), lr=0.3, momentum=0.9, nesterov=True, foreach=False),
            build(name, state, lr=0.3, **({"momentum": 0.9} if name == "staleness_sgd" else {})),
        )
    keys = sorted(params)
    for i, (tau, delta) in enumerate(zip(staleness_sequence(24), deltas)):
        carried = {k: delta[k] for j, k in enumerate(keys) if (i + j) % 3 != 0}
        gate = opt.gate(tau)
        for k, p in params.items():
            p.grad = carried[k] * gate if k in carried else None
        ref.step()
        assert opt.step(state, carried, staleness=tau)
    for k, p in params.items():
        torch.testing.assert_close(state[k], p.detach(), rtol=1e-5, atol=1e-5, msg=k)


# ----------------------------------------------------------------------------- Adam family
def test_adam_matches_torch_adam():
    state = make_state()
    deltas = make_deltas(state, 40)
    params = {k: v.clone().requires_grad_(True) for k, v in floating(state).items()}
    adam = torch.optim.Adam(params.values(), lr=0.01, betas=(0.9, 0.95), eps=1e-6, foreach=False)
    opt = build_outer_optimizer("adam", state, lr=0.01, betas=(0.9, 0.95), eps=1e-6)
    for i, delta in enumerate(deltas):
        for k, p in params.items():
            p.grad = delta[k].clone()
        adam.step()
        assert opt.step(state, delta, staleness=i)  # staleness is ignored by plain Adam
    assert torch.equal(state["position_ids"], torch.arange(11))
    for k, p in params.items():
        torch.testing.assert_close(state[k], p.detach(), rtol=1e-5, atol=1e-6, msg=k)
    sd = opt.state_dict()
    assert sd["step"] == 40
    for k, p in params.items():
        assert sd["steps"][sd["keys"].index(k)] == 40
        torch.testing.assert_close(true_buffer(sd, "exp_avg", k, "exp_avg_scales"), adam.state[p]["exp_avg"])
        torch.testing.assert_close(true_buffer(sd, "exp_avg_sq", k, "exp_avg_sq_scales"), adam.state[p]["exp_avg_sq"])


@pytest.mark.parametrize(
    "taus",
    [
        [0] * 12,
        [32] * 5,
        [33] * 5,
        [0, 3, 7, 32, 1, 15, 40, 2, 31, 5, 0, 24, 16, 8, 4, 33, 0],
        [31, 31, 0, 1, 31, 0, 2],
    ],
    ids=["zero", "tau_cut", "beyond", "varying", "tiny-gates"],
)
def test_cgad_matches_scalar_rederivation(taus):
    state = make_state(complex_key=True)
    before = clone(state)
    deltas = make_deltas(state, len(taus))
    ref = RefAdam(state, lr=0.02)
    opt = CGAD(state, lr=0.02)
    for tau, delta in zip(taus, deltas):
        expected = ref.step(delta, ref_cgad_gate(tau))
        assert opt.step(state, delta, staleness=tau) is expected
    assert opt.state_dict()["step"] == ref.t
    if ref.t == 0:
        assert_states_equal(state, before)
    assert_close_to_ref(state, ref.p)
    sd = opt.state_dict()
    for k in ref.m:
        expected = ref.m[k].to(torch.complex64 if ref.m[k].is_complex() else torch.float32)
        torch.testing.assert_close(true_buffer(sd, "exp_avg", k, "exp_avg_scales"), expected, rtol=1e-5, atol=1e-8)


def test_adam_decay_matches_scalar_rederivation():
    state = make_state(complex_key=True)
    taus = [0, 3, 50, 7, 1, 0, 120, 2, 9]
    deltas = make_deltas(state, len(taus))
    ref = RefAdam(state, lr=0.03, betas=(0.8, 0.99), eps=1e-7)
    opt = AdamDecay(state, lr=0.03, betas=(0.8, 0.99), eps=1e-7, alpha=0.1)
    for tau, delta in zip(taus, deltas):
        assert opt.step(state, delta, staleness=tau) is ref.step(delta, math.exp(-0.1 * tau))
    assert_close_to_ref(state, ref.p)


def test_fully_gated_step_is_a_noop():
    state = make_state(complex_key=True)
    deltas = make_deltas(state, 4)
    opt = CGAD(state, lr=0.1)
    assert opt.step(state, deltas[0], staleness=2)
    snapshot_state, snapshot_opt = clone(state), opt.state_dict()
    for tau in (32, 33, 10_000):
        assert opt.step(state, deltas[1], staleness=tau) is False
        assert opt.step(state, {k: v * opt.gate(tau) for k, v in deltas[1].items()}, staleness=tau, gated=True) is False
    assert_states_equal(state, snapshot_state)
    assert_states_equal(opt.state_dict(), snapshot_opt)
    with pytest.raises(ValueError, match="staleness"):
        opt.step(state, deltas[2], staleness=-1)
    with pytest.raises(ValueError, match="staleness"):
        opt.step(state, deltas[2], staleness=-1, gated=True)
    assert_states_equal(state, snapshot_state)


@pytest.mark.parametrize("name", ["cgad", "adam_decay", "poly_nesterov", "pa_cgad"])
def test_gated_true_path(name):
    """gated=True: the caller multiplied by gate(tau); the result equals the ungated call."""
    state_a, taus = make_state(), [0, 5, 2, 9, 1, 30, 3]
    state_b = clone(state_a)
    deltas = make_deltas(state_a, len(taus))
    opt_a, opt_b = build(name, state_a), build(name, state_b)
    for tau, delta in zip(taus, deltas):
        gate = opt_a.gate(tau)
        assert opt_a.step(state_a, delta, staleness=tau)
        assert opt_b.step(state_b, {k: v * gate for k, v in delta.items()}, staleness=tau, gated=True)
    for k in floating(state_a):
        torch.testing.assert_close(state_a[k], state_b[k], rtol=1e-4, atol=1e-5, msg=k)


# ----------------------------------------------------------------------------- Delayed Nesterov
@pytest.mark.parametrize(
    "buffer_size, activation, beta",
    [(3, 0.0, 0.9), (4, 0.1, 0.9), (1, 0.0, 0.9), (4, 0.5, 0.9), (3, 0.0, 0.0)],
    ids=["N3", "N4-c0.1", "N1", "N4-c0.5-negative-k", "beta0"],
)
def test_delayed_nesterov_matches_algorithm_3(buffer_size, activation, beta):
    state = make_state(complex_key=True)
    deltas = make_deltas(state, 13)
    lr, n, c = 0.4, buffer_size, activation
    theta = {k: v.to(torch.complex128 if v.is_complex() else torch.float64) for k, v in floating(state).items()}
    m = {k: torch.zeros_like(v) for k, v in theta.items()}
    acc = {k: torch.zeros_like(v) for k, v in theta.items()}
    opt = DelayedNesterov(state, lr=lr, momentum=beta, buffer_size=n, activation=c)
    for t, delta in enumerate(deltas):  # Liu et al. 2024, Algorithm 3, one arrival per iteration
        for k in theta:
            g = delta[k].to(theta[k].dtype)
            acc[k] = acc[k] + g
            if (t + 1) % n == 0:
                m[k] = beta * m[k] + acc[k] / n
                theta[k] = theta[k] - lr * ((1 - c * n + c) * beta * m[k] + g / n)
                acc[k] = torch.zeros_like(acc[k])
            else:
                theta[k] = theta[k] - lr * (c * beta * m[k] + g / n)
        assert opt.step(state, delta, staleness=t % 3)
    assert_close_to_ref(state, theta, rtol=1e-5, atol=1e-5)
    sd = opt.state_dict()
    assert sd["step"] == len(deltas)
    for k in theta:  # the accumulator holds beta*m + A/N; m itself is kept only when c > 0
        q = true_buffer(sd, "accumulator", k, "accumulator_scales")
        torch.testing.assert_close(q.to(m[k].dtype), beta * m[k] + acc[k] / n, rtol=1e-5, atol=1e-6)
        if c:
            torch.testing.assert_close(
                true_buffer(sd, "momentum", k, "momentum_scales").to(m[k].dtype), m[k], rtol=1e-5, atol=1e-6
            )
        else:
            assert f"momentum/{k}" not in sd


def test_delayed_nesterov_with_buffer_size_1_is_nesterov():
    state_a = make_state(complex_key=True)
    state_b = clone(state_a)
    dn = DelayedNesterov(state_a, lr=0.7, momentum=0.9, buffer_size=1)
    nesterov = NesterovOuterOptimizer(state_b, lr=0.7, momentum=0.9)
    for delta in make_deltas(state_a, 10):
        dn.step(state_a, delta)
        nesterov.step(state_b, delta)
    for k in floating(state_a):
        torch.testing.assert_close(state_a[k], state_b[k], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- PA-CGAD
def test_pacgad_matches_per_fragment_rederivation():
    state = make_state()
    frag_keys = {"attn": ["layers.0.attn.q", "layers.1.attn.q"], "rest": ["embed.weight", "norm.weight", "scalar"]}
    schedule = [
        ("attn", 0),
        ("rest", 1),
        ("attn", 3),
        (None, 0),
        ("rest", 2),
        ("attn", 0),
        ("attn", 1),
        ("rest", 0),
        (None, 6),
    ]
    deltas = make_deltas(state, len(schedule))
    refs = {f: RefAdam({k: state[k] for k in keys}, lr=0.02) for f, keys in frag_keys.items()}
    opt = PACGAD(state, lr=0.02, fragments=FRAGMENTS)
    clock, updated_at = 0, {f: 0 for f in frag_keys}
    for (fragment, tau), full in zip(schedule, deltas):
        carried = [fragment] if fragment else list(frag_keys)
        delta = {k: full[k] for f in carried for k in frag_keys[f]}
        applied = False
        for f in carried:
            age = clock - updated_at[f]
            applied |= refs[f].step(delta, ref_cgad_gate(max(tau, age)))
        assert opt.step(state, delta, staleness=tau, fragment=fragment) is applied
        clock += 1
        for f in carried:
            updated_at[f] = clock
    sd = opt.state_dict()
    for f, ref in refs.items():
        assert_close_to_ref(state, ref.p)
        assert {sd["steps"][sd["keys"].index(k)] for k in frag_keys[f]} == {ref.t}


def test_pacgad_age_gates_and_freezes_a_stale_fragment():
    state = make_state()
    opt = PACGAD(state, lr=0.02, tau_cut=4, fragments=FRAGMENTS)
    attn = {k: torch.ones_like(v) for k, v in state.items() if ".attn." in k}
    rest = {k: torch.ones_like(v) for k, v in state.items() if k in ("embed.weight", "norm.weight", "scalar")}
    for _ in range(4):
        assert opt.step(state, attn, fragment="attn")
    assert opt.age("rest") == 4 and opt.fragment_gate("rest", 0) == 0.0
    before = clone(state)
    assert opt.step(state, rest, staleness=0, fragment="rest") is False
    assert_states_equal(state, before)
    with pytest.raises(ValueError, match="layers.0.attn.q"):
        opt.step(state, attn, fragment="rest")
    with pytest.raises(ValueError, match="unknown fragment"):
        opt.step(state, attn, fragment="mlp")


def test_pacgad_single_fragment_is_cgad():
    state_a = make_state(complex_key=True)
    state_b = clone(state_a)
    pa, cgad = PACGAD(state_a, lr=0.05), CGAD(state_b, lr=0.05)
    for tau, delta in zip([0, 4, 40, 2, 1], make_deltas(state_a, 5)):
        assert pa.step(state_a, delta, staleness=tau) is cgad.step(state_b, delta, staleness=tau)
    assert_states_equal(state_a, state_b)


def test_pacgad_fragments_must_cover_each_key_once():
    state = make_state()
    with pytest.raises(ValueError, match="norm.weight"):
        PACGAD(state, lr=0.1, fragments={"a": ["embed.weight", "layers.", "scalar"]})
    with pytest.raises(ValueError, match="more than one fragment"):
        PACGAD(state, lr=0.1, fragments={"a": ["layers."], "b": ["layers.0", "embed.weight", "norm.weight", "scalar"]})
    # "layers.1" is a prefix of "layers.1.*" keys only, never of "layers.10.*"
    assert (
        PACGAD(
            {"layers.1.w": torch.zeros(1), "layers.10.w": torch.zeros(1)},
            lr=0.1,
            fragments=[["layers.1"], ["layers.10"]],
        ).fragment_of("layers.10.w")
        == "1"
    )


# ----------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("name", ALL_NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_state_is_fp32_math_rounded_once(name, dtype):
    """A bf16/fp16 state equals an FP32 state run through the same math and rounded after each step."""
    low = make_state(dtype=dtype)
    ref = {k: v.float() if v.is_floating_point() else v.clone() for k, v in low.items()}
    opt_low, opt_ref = build(name, low), build(name, ref)
    deltas = make_deltas(low, 9)
    for tau, delta in zip(staleness_sequence(9), deltas):
        delta = {k: v.to(dtype) if v.is_floating_point() else v for k, v in delta.items()}  # bf16 deltas too
        assert opt_low.step(low, delta, staleness=tau) == opt_ref.step(ref, delta, staleness=tau)
        for v in floating(ref).values():
            v.copy_(v.to(dtype))
    for k, v in floating(low).items():
        assert v.dtype == dtype
        assert torch.equal(v.float(), ref[k]), k
    assert_states_equal(opt_low.state_dict(), opt_ref.state_dict())


@pytest.mark.parametrize("name", ALL_NAMES)
def test_temporaries_in_small_batches_give_the_same_result(name, monkeypatch):
    """Converting a bf16 state/delta in small chunks and batches (scratch area) changes nothing."""
    import diloco_lightning.outer.work as work  # the scratch area and its chunks live there

    whole = make_state(dtype=torch.bfloat16)
    batched = clone(whole)
    opt_whole, opt_batched = build(name, whole), build(name, batched)
    for tau, delta in zip(staleness_sequence(5), make_deltas(whole, 5)):
        delta = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in delta.items()}
        opt_whole.step(whole, delta, staleness=tau)
        monkeypatch.setattr(work, "TEMP_BUDGET_BYTES", 1)  # one unit per batch
        monkeypatch.setattr(work, "CHUNK_BYTES", 256)  # 64 floats: tensors are cut into chunks
        opt_batched.step(batched, delta, staleness=tau)
        monkeypatch.undo()
    assert_states_equal(whole, batched)
    assert_states_equal(opt_whole.state_dict(), opt_batched.state_dict())


@pytest.mark.parametrize("name", ["nesterov", "cgad", "delayed_nesterov"])
def test_float64_state_keeps_its_precision(name):
    state64 = make_state(dtype=torch.float64, complex_key=True)
    state64["norm.freqs"] = state64["norm.freqs"].to(torch.complex128)
    state32 = {
        k: v.float() if v.is_floating_point() else v.to(torch.complex64) if v.is_complex() else v.clone()
        for k, v in state64.items()
    }
    opt64, opt32 = build(name, state64), build(name, state32)
    for delta in make_deltas(state32, 6):
        opt64.step(state64, delta)
        opt32.step(state32, delta)
    assert state64["embed.weight"].dtype == torch.float64
    for k in floating(state32):
        torch.testing.assert_close(state64[k], state32[k].to(state64[k].dtype), rtol=1e-5, atol=1e-5)
    # the update is added in float64: the state did not collapse onto float32 values
    assert not torch.equal(state64["embed.weight"], state64["embed.weight"].float().double())


@pytest.mark.parametrize("name", ALL_NAMES)
def test_non_contiguous_state_and_delta(name):
    state = make_state()
    base = torch.randn(8, 16)
    state["layers.0.attn.q"] = base[:, ::2]  # a strided view of something else
    reference = {k: v.contiguous().clone() for k, v in state.items()}
    opt, opt_ref = build(name, state), build(name, reference)
    for tau, delta in zip([0, 2, 1, 5], make_deltas(state, 4)):
        strided = dict(delta)
        strided["embed.weight"] = delta["embed.weight"].t().contiguous().t()
        assert not strided["embed.weight"].is_contiguous() and not state["layers.0.attn.q"].is_contiguous()
        opt.step(state, strided, staleness=tau)
        opt_ref.step(reference, delta, staleness=tau)
    for k in floating(state):
        assert torch.equal(state[k], reference[k]), k
    assert torch.equal(base[:, ::2], state["layers.0.attn.q"])  # updated in place, through the view


# ----------------------------------------------------------------------------- state_dict hand-over
@pytest.mark.parametrize("name", ALL_NAMES)
def test_state_dict_round_trip_continues_bit_exactly(name):
    state = make_state(complex_key=name != "pa_cgad")
    deltas = make_deltas(state, 12)
    taus = staleness_sequence(12)
    opt = build(name, state)
    for tau, delta in zip(taus[:7], deltas[:7]):
        opt.step(state, delta, staleness=tau)
    # hand over: tensors as they would be saved (safetensors), the rest through JSON
    sd = opt.state_dict()
    tensors = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    meta = json.loads(json.dumps({k: v for k, v in sd.items() if not isinstance(v, torch.Tensor)}))
    options = json.loads(json.dumps(opt.options))
    state2 = clone(state)
    opt2 = build_outer_optimizer(opt.name, state2, **options)
    assert opt2.name == opt.name and opt2.options == opt.options
    opt2.load_state_dict({**tensors, **meta})
    for tau, delta in zip(taus[7:], deltas[7:]):
        assert opt.step(state, delta, staleness=tau) == opt2.step(state2, delta, staleness=tau)
    assert_states_equal(state, state2)
    assert_states_equal(opt.state_dict(), opt2.state_dict())


@pytest.mark.parametrize("name", ALL_NAMES)
def test_load_empty_state_dict_restarts_from_scratch(name):
    state = make_state()
    opt = build(name, state)
    for delta in make_deltas(state, 3):
        opt.step(state, delta, staleness=1)
    opt.load_state_dict({})
    assert_states_equal(opt.state_dict(), build(name, state).state_dict())


def test_load_state_dict_validates_before_changing_anything():
    state = make_state()
    opt = CGAD(state, lr=0.1)
    opt.step(state, make_deltas(state, 1)[0])
    good = opt.state_dict()
    with pytest.raises(ValueError, match="exp_avg/scalar"):
        opt.load_state_dict({**good, "exp_avg/scalar": torch.zeros(2)})
    with pytest.raises(ValueError, match="delayed_nesterov"):
        opt.load_state_dict({**good, "optimizer": "delayed_nesterov"})
    with pytest.raises(ValueError, match="step"):
        opt.load_state_dict({**good, "step": -1})
    assert_states_equal(opt.state_dict(), good)
    opt.load_state_dict({})  # a fresh start
    assert_states_equal(opt.state_dict(), CGAD(state, lr=0.1).state_dict())


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("name", ALL_NAMES)
def test_missing_key_or_shape_mismatch_names_the_key_and_changes_nothing(name):
    state = make_state()
    opt = build(name, state)
    delta = make_deltas(state, 1)[0]
    opt.step(state, delta, staleness=1)
    snapshot_state, snapshot_opt = clone(state), opt.state_dict()
    bad_key = {**delta, "layers.9.mlp": torch.zeros(3)}
    with pytest.raises(ValueError, match="layers.9.mlp"):
        opt.step(state, bad_key)
    bad_shape = dict(delta)
    bad_shape["norm.weight"] = torch.zeros(9)  # after keys that would otherwise be updated
    with pytest.raises(ValueError, match="norm.weight"):
        opt.step(state, bad_shape)
    with pytest.raises(ValueError, match="staleness"):
        opt.step(state, delta, staleness=-2)
    assert_states_equal(state, snapshot_state)
    assert_states_equal(opt.state_dict(), snapshot_opt)


def test_non_floating_keys_are_skipped_and_deltas_converted():
    state = make_state()
    state_ref = clone(state)
    opt, opt_ref = CGAD(state, lr=0.1), CGAD(state_ref, lr=0.1)
    delta = make_deltas(state, 1)[0]
    low = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in delta.items()}
    low["position_ids"] = torch.ones(11, dtype=torch.long)  # an integer delta is ignored
    opt.step(state, low, staleness=3)
    opt_ref.step(state_ref, {k: v.float() if v.is_floating_point() else v for k, v in low.items()}, staleness=3)
    assert torch.equal(state["position_ids"], torch.arange(11))
    assert_states_equal(state, state_ref)
    assert "exp_avg/position_ids" not in opt.state_dict()


def test_tied_weights_are_updated_once():
    shared = torch.randn(6, 4)
    state = {"embed.weight": shared, "lm_head.weight": shared}
    single = {"embed.weight": shared.clone()}
    opt, opt_single = NesterovOuterOptimizer(state, lr=0.7), NesterovOuterOptimizer(single, lr=0.7)
    delta = torch.randn(6, 4)
    opt.step(state, {"embed.weight": delta, "lm_head.weight": delta})
    opt_single.step(single, {"embed.weight": delta})
    assert torch.equal(shared, single["embed.weight"])


def test_build_outer_optimizer_errors_list_valid_choices():
    state = make_state()
    with pytest.raises(
        ValueError, match="nesterov.*cgad|adam, adam_decay, cgad, delayed_nesterov, nesterov, pa_cgad, poly_nesterov"
    ):
        build_outer_optimizer("sgd", state, lr=0.1)
    with pytest.raises(
        ValueError,
        match=r"\['momentum_typo'\].*valid options: lr, betas=\(0.9, 0.999\), eps=1e-08, alpha=0.2, tau_cut=32",
    ):
        build_outer_optimizer("cgad", state, lr=0.1, momentum_typo=0.9)
    with pytest.raises(ValueError, match="alpha"):
        build_outer_optimizer("adam", state, lr=0.1, alpha=0.2)
    with pytest.raises(ValueError, match=r"requires option\(s\) \['buffer_size'\]"):
        build_outer_optimizer("delayed_nesterov", state, lr=0.1)
    with pytest.raises(ValueError, match=r"requires option\(s\) \['lr'\]"):
        build_outer_optimizer("nesterov", state)


@pytest.mark.parametrize(
    "name, bad",
    [
        ("nesterov", {"lr": -1.0}),
        ("nesterov", {"lr": float("nan")}),
        ("nesterov", {"momentum": 1.0}),
        ("poly_nesterov", {"momentum": -0.1}),
        ("staleness_sgd", {"power": -1.0}),
        ("staleness_sgd", {"momentum": 1.0}),
        ("cgad", {"betas": (1.0, 0.9)}),
        ("cgad", {"betas": (0.9,)}),
        ("adam", {"eps": 0.0}),
        ("cgad", {"alpha": -0.2}),
        ("cgad", {"tau_cut": 0}),
        ("adam_decay", {"alpha": float("inf")}),
        ("delayed_nesterov", {"buffer_size": 0}),
        ("delayed_nesterov", {"buffer_size": 2.5}),
        ("delayed_nesterov", {"activation": 2.0}),
        ("pa_cgad", {"fragments": {"a": []}}),
    ],
)
def test_bad_option_values_name_the_option(name, bad):
    opt_name = next(iter(bad)).split("[")[0]
    with pytest.raises(ValueError, match=opt_name if opt_name != "fragments" else "fragments"):
        build(name, make_state(), **bad)


def test_options_are_json_and_rebuild_the_same_optimizer():
    state = make_state()
    for name in ALL_NAMES:
        opt = build(name, state)
        again = build_outer_optimizer(name, state, **json.loads(json.dumps(opt.options)))
        assert type(again) is type(opt) and again.options == opt.options and again.name == name


def test_registry_names():
    assert ALL_NAMES == ["adam", "adam_decay", "cgad", "dc_asgd", "delayed_nesterov", "fedavg", "gap_aware", "nesterov", "pa_cgad",
                         "poly_nesterov", "staleness_sgd"]
    assert OUTER_OPTIMIZERS["cgad"] is CGAD and OUTER_OPTIMIZERS["poly_nesterov"] is PolyNesterov


@pytest.mark.parametrize("name", ["nesterov", "cgad", "adam_decay", "adam", "delayed_nesterov", "poly_nesterov", "pa_cgad",
                                  "staleness_sgd"])
def test_public_kernels_match_the_fused_ones(name):
    """The private fused kernels sit behind a known-answer check with a public fallback
    (outer/kernels.py): both give the same steps."""
    from diloco_lightning.outer import kernels

    g = torch.Generator().manual_seed(3)
    state0 = {"w": torch.randn(64, 33, generator=g), "b": torch.randn(33, generator=g), "i": torch.tensor(4)}
    deltas = [{k: torch.randn(v.shape, generator=g) * 0.1 for k, v in state0.items() if v.is_floating_point()}
              for _ in range(6)]
    opts = {"lr": 0.05} if name not in ("delayed_nesterov",) else {"lr": 0.05, "buffer_size": 2}
    results = []
    for public in (False, True):
        kernels.use_public_kernels(public)
        try:
            state = {k: v.clone() for k, v in state0.items()}
            opt = build_outer_optimizer(name, state, **opts)
            for i, d in enumerate(deltas):
                opt.step(state, d, staleness=i % 3)
            results.append(state)
        finally:
            kernels.use_public_kernels(False)
    assert kernels.fused_kernels_in_use().get("adam" if "adam" in name or "cgad" in name else "sgd") is True
    for k in state0:
        assert torch.allclose(results[0][k], results[1][k], rtol=1e-5, atol=1e-6), k


@pytest.mark.parametrize("name,options,gate_tau", [("staleness_sgd", {"lr": 0.7, "momentum": 0.5}, 3),
                                                   ("poly_nesterov", {"lr": 0.3, "momentum": 0.9}, 2),
                                                   ("nesterov", {"lr": 0.7, "momentum": 0.9}, 0)])
def test_lookahead_is_what_the_momentum_adds_over_the_next_steps(name, options, gate_tau):
    """DANA's look-ahead: ``lookahead(n)`` equals the state's movement over n more steps that apply
    zero deltas (only the momentum moves it), after gated steps that left a scaled buffer behind."""
    from diloco_lightning.outer import build_outer_optimizer

    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g)}
    opt = build_outer_optimizer(name, state, **options)
    for tau in (0, gate_tau, 1):
        opt.step(state, {k: torch.randn(v.shape, generator=g) for k, v in state.items()}, tau)
    ahead = opt.lookahead(3)
    before = {k: v.clone() for k, v in state.items()}
    for _ in range(3):
        opt.step(state, {k: torch.zeros_like(v) for k, v in state.items()}, 0)
    for k in state:
        torch.testing.assert_close(before[k] + ahead[k], state[k], rtol=1e-5, atol=1e-6)
    assert opt.lookahead(0)["w"].abs().max() == 0


def test_lookahead_is_none_without_momentum():
    from diloco_lightning.outer import build_outer_optimizer

    state = {"w": torch.zeros(3)}
    assert build_outer_optimizer("staleness_sgd", state, lr=1.0).lookahead(4) is None
    assert build_outer_optimizer("fedavg", state).lookahead(4) is None
    assert build_outer_optimizer("adam", state, lr=0.01).lookahead(4) is None
