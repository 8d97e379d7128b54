"""The outer state's layout and precision: Adam's naive m and v, bf16 and 8-bit blockwise buffers.

References: ``torch.optim.Adam`` fed ``gate * g`` (the naive layout in FP32), bitsandbytes'
dynamic map and ``quantize_blockwise`` (the 8-bit code book and codes), and, for one step in low
precision, the FP32 step from the same (decoded) buffers stored back to nearest.
"""

from __future__ import annotations

import pytest
import torch

from diloco_lightning.outer import build_outer_optimizer
from diloco_lightning.outer.blockwise import BLOCK, blocks, dequantize_, dynamic_map, quantize_

from test_outer import assert_states_equal, clone, floating, make_deltas, make_state, staleness_sequence


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one intra-op thread (conftest.py)


ADAM = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-6}


# ----------------------------------------------------------------------------- the 8-bit code book
@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_and_codes_are_bitsandbytes(signed):
    bnb_f = pytest.importorskip("bitsandbytes.functional")
    book = dynamic_map(signed)
    assert torch.equal(book, bnb_f.create_dynamic_map(signed=signed))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * BLOCK + 17, generator=g) * torch.logspace(-6, 0, 3 * BLOCK + 17)
    x = x if signed else x.abs()
    codes, amax = torch.empty(x.shape, dtype=torch.uint8), torch.empty(blocks(x.numel()))
    quantize_(codes, amax, x, signed)
    ref_codes, ref_state = bnb_f.quantize_blockwise(x, code=book, blocksize=BLOCK)
    assert torch.equal(amax, ref_state.absmax)
    normed = x / amax.repeat_interleave(BLOCK)[: x.numel()]
    nearest = (normed.unsqueeze(1) - book.unsqueeze(0)).abs().argmin(1)
    assert torch.equal(book[codes.long()], book[nearest])  # ours: the nearest code
    # bitsandbytes' kernel searches the book approximately: the same code, or a neighbour (~1 % of values)
    assert (codes.long() - ref_codes.flatten().long()).abs().max() <= 1
    assert (codes == ref_codes.flatten()).float().mean() > 0.97


def test_blockwise_keeps_each_value_within_half_a_code_of_its_block():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5 * BLOCK, generator=g)
    codes, amax = torch.empty(x.shape, dtype=torch.uint8), torch.empty(5)
    quantize_(codes, amax, x, True)
    back = dequantize_(torch.empty(x.shape), codes, amax, True)
    book = dynamic_map(True)
    gaps = (book[1:] - book[:-1]).max()
    assert ((back - x).abs().view(5, BLOCK) <= amax.unsqueeze(1) * gaps / 2 + 1e-7).all()
    block_max = back.view(5, BLOCK).abs().amax(1)
    assert (block_max <= amax).all() and (block_max >= 0.99 * amax).all()  # +1 is a code, -1 is -0.993


# ----------------------------------------------------------------------------- the naive layout
@pytest.mark.parametrize("name", ["cgad", "adam_decay", "adam"])
def test_naive_layout_is_torch_adam_fed_the_gated_delta(name):
    state = make_state()
    deltas = make_deltas(state, 30)
    params = {k: v.clone().requires_grad_(True) for k, v in floating(state).items()}
    ref = torch.optim.Adam(params.values(), lr=ADAM["lr"], betas=ADAM["betas"], eps=ADAM["eps"], foreach=False)
    opt = build_outer_optimizer(name, state, state_layout="naive", **ADAM)
    assert opt.options["state_layout"] == "naive"
    for delta, tau in zip(deltas, staleness_sequence(30)):
        gate = opt.gate(tau)
        for k, p in params.items():
            p.grad = delta[k] * gate
        ref.step()
        assert opt.step(state, delta, staleness=tau)
    for k, p in params.items():
        torch.testing.assert_close(state[k], p.detach(), rtol=2e-5, atol=2e-6, msg=k)
        sd = opt.state_dict()  # m and v themselves, no scales
        torch.testing.assert_close(sd[f"exp_avg/{k}"], ref.state[p]["exp_avg"], rtol=2e-5, atol=1e-8)
    assert "exp_avg_scales" not in opt.state_dict() and opt.state_dict()["state_layout"] == "naive"


def test_naive_and_scaled_layouts_are_the_same_math():
    """Complex keys too (v = b2 v + (1 - b2) |g|^2, as the SPEC has it: not torch's per-component v)."""
    a, b = make_state(complex_key=True), make_state(complex_key=True)
    naive = build_outer_optimizer("cgad", a, state_layout="naive", **ADAM)
    scaled = build_outer_optimizer("cgad", b, **ADAM)
    for delta, tau in zip(make_deltas(a, 25), staleness_sequence(25)):
        naive.step(a, delta, staleness=tau)
        scaled.step(b, delta, staleness=tau)
    for k in floating(a):
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_layouts_do_not_load_each_other():
    state = make_state()
    naive = build_outer_optimizer("cgad", state, state_layout="naive", **ADAM)
    scaled = build_outer_optimizer("cgad", state, **ADAM)
    with pytest.raises(ValueError, match="state_layout='naive'"):
        scaled.load_state_dict(naive.state_dict())
    with pytest.raises(ValueError, match="state_layout"):
        naive.load_state_dict(scaled.state_dict())
    with pytest.raises(ValueError, match="state_layout"):
        build_outer_optimizer("cgad", state, state_layout="packed", **ADAM)


# ----------------------------------------------------------------------------- low precision, one step at a time
@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("layout", ["scaled", "naive"])
def test_a_low_precision_step_is_the_fp32_step_stored_back(dtype, layout):
    """Each step: an FP32 optimizer loaded with the decoded buffers takes the same step; the state
    is exactly its state, the buffers exactly its buffers stored back (bf16 to nearest, 8-bit codes)."""
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(2 * BLOCK + 9, generator=g), "b": torch.randn(7, generator=g), "n": torch.tensor(3)}
    opt = build_outer_optimizer("cgad", state, state_dtype=dtype, state_layout=layout, **ADAM)
    assert opt.options["state_dtype"] == dtype
    for i, delta in enumerate(make_deltas(state, 5, scale=0.01)):
        ref_state = clone(state)
        ref = build_outer_optimizer("cgad", ref_state, state_layout=layout, **ADAM)
        ref.load_state_dict(opt.state_dict())  # decoded into FP32
        ref.step(ref_state, delta, staleness=i)
        opt.step(state, delta, staleness=i)
        assert_states_equal(state, ref_state)
        want = build_outer_optimizer("cgad", clone(state), state_dtype=dtype, state_layout=layout, **ADAM)
        want.load_state_dict(ref.state_dict())  # the FP32 buffers stored back
        assert_states_equal(opt.state_dict(), want.state_dict())


def test_int8_state_round_trips_and_converts():
    state = make_state()
    deltas = make_deltas(state, 12)
    opt = build_outer_optimizer("adam_decay", state, state_dtype="int8", state_layout="naive", **ADAM)
    for d in deltas[:6]:
        opt.step(state, d, staleness=2)
    sd = opt.state_dict()
    assert sd["exp_avg/embed.weight"].dtype == torch.uint8 and sd["exp_avg.absmax/embed.weight"].dtype == torch.float32
    twin_state = clone(state)
    twin = build_outer_optimizer("adam_decay", twin_state, **opt.options)
    twin.load_state_dict(sd)
    for d in deltas[6:]:
        opt.step(state, d, staleness=1)
        twin.step(twin_state, d, staleness=1)
    assert_states_equal(state, twin_state)
    fp32 = build_outer_optimizer("adam_decay", clone(state), state_layout="naive", **ADAM)
    fp32.load_state_dict(opt.state_dict())  # decoded
    assert fp32.state_dict()["exp_avg/embed.weight"].dtype == torch.float32
    nesterov = build_outer_optimizer("nesterov", clone(state), lr=0.5, state_dtype="int8")
    nesterov.step(state, deltas[0])
    nsd = nesterov.state_dict()  # Speedtronic's format, and the 8-bit maxima beside
    assert nsd["embed.weight"].dtype == torch.uint8 and "momentum.absmax/embed.weight" in nsd
    again = build_outer_optimizer("nesterov", clone(state), lr=0.5, state_dtype="int8")
    again.load_state_dict(nsd)
    assert_states_equal(again.state_dict(), nsd)
    with pytest.raises(ValueError, match="absmax"):
        twin.load_state_dict({k: v for k, v in sd.items() if not k.startswith("exp_avg.absmax/")})
    with pytest.raises(ValueError, match="stochastic_rounding"):
        build_outer_optimizer("cgad", state, state_dtype="int8", stochastic_rounding=True, **ADAM)


# ----------------------------------------------------------------------------- what the precision does
def test_precision_stats_see_a_bf16_v_that_cannot_decay_and_an_8_bit_floor():
    """v = 1 and a zero delta: with beta2 = 0.999 the decay 1 -> 0.999 is below bf16's half ulp, so
    every v stays (stuck); with 0.95 it moves. In 8 bits, a value 1e-9 of its block's maximum is 0."""
    for beta2, stuck in ((0.999, 1.0), (0.95, 0.0)):
        state = {"w": torch.zeros(64)}
        opt = build_outer_optimizer("adam", state, lr=0.1, betas=(0.9, beta2), state_dtype="bf16", state_layout="naive")
        opt.track_precision = True
        opt.load_state_dict({"optimizer": "adam", "step": 10, "state_layout": "naive", "keys": ["w"], "steps": [10],
                             "exp_avg_sq/w": torch.ones(64), "exp_avg/w": torch.zeros(64)})
        opt.step(state, {"w": torch.zeros(64)})
        assert opt.precision_stats["exp_avg_sq"]["stuck"] == stuck
    state = {"w": torch.zeros(BLOCK)}
    opt = build_outer_optimizer("adam", state, lr=0.1, betas=(0.0, 0.0), state_dtype="int8", state_layout="naive")
    opt.track_precision = True
    delta = torch.full((BLOCK,), 1e-5)
    delta[0] = 1.0  # v = g^2: 1 against 1e-10
    opt.step(state, {"w": delta})
    assert opt.precision_stats["exp_avg_sq"]["floor"] == pytest.approx((BLOCK - 1) / BLOCK)
    assert opt.precision_stats["exp_avg"]["floor"] == 0.0  # m = g: 1e-5 of the block is still a code
