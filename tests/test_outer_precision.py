"""``state_dtype="bfloat16"``: the outer optimizers' buffers in bf16, against an FP32 reference.

The reference for one step: an FP32 optimizer loaded with the same (bf16) buffers takes the same
step; the bf16 optimizer's state must be exactly that step's, and its buffers exactly the FP32
buffers rounded to nearest even (or, with stochastic rounding, one of the two bf16 neighbours,
unbiased). Both kernel paths (torch's fused kernels and the public formulas) are checked, and a
master publishing bf16 buffers hands over to another bit-exactly.
"""

from __future__ import annotations

import pytest
import torch

from diloco_lightning.outer import OUTER_OPTIMIZERS, build_outer_optimizer, kernels
from diloco_lightning.outer.precision import stochastic_round_

OPTIONS = {
    "nesterov": {"lr": 0.7, "momentum": 0.9},
    "fedavg": {},  # its defaults: lr 1, momentum 0
    "poly_nesterov": {"lr": 0.7, "momentum": 0.9},
    "staleness_sgd": {"lr": 0.7, "momentum": 0.5},
    "gap_aware": {"lr": 0.7, "momentum": 0.5, "history": 2},
    "dc_asgd": {"lr": 0.7, "lam": 2.0},
    "delayed_nesterov": {"lr": 0.5, "momentum": 0.9, "buffer_size": 3, "activation": 0.1},
    "cgad": {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-5},
    "adam_decay": {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-5},
    "adam": {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-5},
    "pa_cgad": {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-5},
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: one intra-op thread (conftest.py)


def _state(seed: int = 0, big: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"w": torch.randn(33, 7, generator=g), "b": torch.randn(7, generator=g), "steps": torch.tensor(3)}
    if big:  # split into chunks by the work area (more than 1M FP32 values): chunked rounding
        out["big"] = torch.randn(1100, 1000, generator=g)
    return out


def _deltas(state: dict, n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(v.shape, generator=g) * 0.01 for k, v in state.items() if v.is_floating_point()}
            for _ in range(n)]


def _fp32_copy(sd: dict) -> dict:
    return {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}


@pytest.mark.parametrize("public", [False, True], ids=["fused", "public"])
@pytest.mark.parametrize("name", sorted(OUTER_OPTIMIZERS))
def test_bf16_step_is_the_fp32_step_rounded_to_nearest(name, public):
    kernels.use_public_kernels(public)
    try:
        state = _state(big=name in ("cgad", "delayed_nesterov") and not public)
        opt = build_outer_optimizer(name, state, state_dtype="bfloat16", **OPTIONS[name])
        assert opt.options["state_dtype"] == "bfloat16" and opt.state_dtype == torch.bfloat16
        for i, delta in enumerate(_deltas(state, 4)):
            ref_state = {k: v.clone() for k, v in state.items()}
            ref = build_outer_optimizer(name, ref_state, **OPTIONS[name])
            ref.load_state_dict(_fp32_copy(opt.state_dict()))
            ref.step(ref_state, delta, staleness=i)
            opt.step(state, delta, staleness=i)
            got, want = opt.state_dict(), ref.state_dict()
            # a gap-aware version history stays FP32 (the gap is a small difference of two states)
            history = [k for k in got if k.startswith("history/")]
            buffers = [k for k, v in got.items() if isinstance(v, torch.Tensor) and k not in history]
            assert buffers, "the optimizer has buffers"
            for k in buffers:
                assert got[k].dtype == torch.bfloat16
                assert torch.equal(got[k], want[k].to(torch.bfloat16)), (name, k, i)
            for k in history:
                assert got[k].dtype == torch.float32 and torch.equal(got[k], want[k]), (name, k, i)
            tensors = set(buffers) | set(history)
            assert {k: v for k, v in got.items() if k not in tensors} == {k: v for k, v in want.items() if k not in tensors}
            for k in state:
                assert torch.equal(state[k], ref_state[k]), (name, k, i)
    finally:
        kernels.use_public_kernels(False)


def test_bf16_buffers_stay_close_to_fp32_over_many_steps():
    """Round-to-nearest error does not build up: 50 CGAD steps, relative error of the state's change."""
    s32, s16 = _state(), _state()
    o32 = build_outer_optimizer("cgad", s32, **OPTIONS["cgad"])
    o16 = build_outer_optimizer("cgad", s16, state_dtype="bf16", **OPTIONS["cgad"])
    start = {k: v.clone() for k, v in s32.items()}
    for i, d in enumerate(_deltas(s32, 50)):
        o32.step(s32, d, staleness=i % 5)
        o16.step(s16, d, staleness=i % 5)
    for k in ("w", "b"):
        moved = (s32[k] - start[k]).norm()
        assert (s16[k] - s32[k]).norm() < 0.02 * moved, k


def test_state_dict_round_trip_and_build_from_options():
    state = _state()
    opt = build_outer_optimizer("adam_decay", state, state_dtype="bfloat16", stochastic_rounding=True, **OPTIONS["adam_decay"])
    deltas = _deltas(state, 6)
    for d in deltas[:3]:
        opt.step(state, d, staleness=1)
    sd = opt.state_dict()
    assert sd["rounding_step"] == 3
    twin_state = {k: v.clone() for k, v in state.items()}
    twin = build_outer_optimizer(opt.name, twin_state, **opt.options)  # the options say bf16 + stochastic
    twin.load_state_dict(sd)
    assert twin.state_dtype == torch.bfloat16
    for d in deltas[3:]:
        opt.step(state, d, staleness=2)
        twin.step(twin_state, d, staleness=2)
    assert all(torch.equal(state[k], twin_state[k]) for k in state)  # the same stochastic rounding after a resume
    a, b = opt.state_dict(), twin.state_dict()
    assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
    # an FP32 optimizer loads a bf16 state exactly, and a bf16 one rounds an FP32 state to nearest
    fp32 = build_outer_optimizer("adam_decay", {k: v.clone() for k, v in state.items()}, **OPTIONS["adam_decay"])
    fp32.load_state_dict({k: v for k, v in a.items() if k != "rounding_step"})
    assert fp32.state_dict()["exp_avg/w"].dtype == torch.float32
    assert torch.equal(fp32.state_dict()["exp_avg/w"], a["exp_avg/w"].float())


def test_nesterov_keeps_speedtronic_state_format_with_bf16():
    state = _state()
    opt = build_outer_optimizer("nesterov", state, state_dtype="bfloat16", **OPTIONS["nesterov"])
    opt.step(state, _deltas(state, 1)[0])
    sd = opt.state_dict()
    assert set(sd) == {"w", "b"} and all(v.dtype == torch.bfloat16 for v in sd.values())


def test_stochastic_rounding_is_unbiased_between_neighbours():
    x = torch.full((200_000,), 1.0 + 2**-9)  # a quarter of the way from 1 to the next bf16 value (1 + 2**-7)
    x[:100_000] = -x[:100_000]
    r = stochastic_round_(x.clone(), torch.Generator().manual_seed(0)).to(torch.bfloat16).float()
    lo, hi = 1.0, 1.0 + 2**-7
    assert set(r[100_000:].unique().tolist()) == {lo, hi}
    assert set(r[:100_000].unique().tolist()) == {-lo, -hi}
    frac_up = (r[100_000:] == hi).float().mean().item()
    assert abs(frac_up - 0.25) < 0.01
    assert abs(r[100_000:].mean().item() - (1.0 + 2**-9)) < 1e-4  # unbiased
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, 3.0])
    out = stochastic_round_(special.clone(), torch.Generator().manual_seed(1))
    assert out[0] == float("inf") and out[1] == float("-inf") and out[2].isnan() and out[3] == 0 and out[4] == 3.0


def test_bad_precision_options_name_themselves():
    with pytest.raises(ValueError, match="state_dtype"):
        build_outer_optimizer("cgad", _state(), lr=0.1, state_dtype="fp8")
    with pytest.raises(ValueError, match="stochastic_rounding"):
        build_outer_optimizer("cgad", _state(), lr=0.1, stochastic_rounding=True)


def test_master_publishes_bf16_outer_state_and_a_new_master_continues_bit_exact(tmp_path):
    """A master with ``state_dtype=bfloat16`` publishes bf16 buffers; another master adopts them
    (after the first one is gone) and continues exactly as one optimizer would have."""
    from diloco_lightning.wire.delta import model_fingerprint, write_delta
    from diloco_lightning.hub.versions import load_outer_state
    from diloco_lightning.hub.local import FileHub
    from diloco_lightning.master import MasterOuterLoop

    def s0():
        return {"w": torch.zeros(64, 3), "b": torch.zeros(3)}

    opts = {"lr": 0.05, "betas": (0.9, 0.95), "eps": 1e-5, "state_dtype": "bfloat16", "stochastic_rounding": True}
    g = torch.Generator().manual_seed(3)
    deltas = [{"w": torch.randn(64, 3, generator=g), "b": torch.randn(3, generator=g)} for _ in range(4)]
    ref_state = s0()
    ref = build_outer_optimizer("cgad", ref_state, **opts)
    for d in deltas:
        ref.step(ref_state, d, staleness=0)

    def master(name):
        return MasterOuterLoop(FileHub(tmp_path / "hub", create=True, cache_dir=tmp_path / f"c{name}"), s0(),
                               node_state_dir=tmp_path / name, outer_optimizer="cgad", outer_options=opts,
                               lease=False, norm_ratio=None, norm_global_ratio=None, poll_interval=0.01)

    hub = FileHub(tmp_path / "hub", create=True, cache_dir=tmp_path / "cw")
    m1 = master("m1")
    assert m1.sync_once()
    m = m1
    for i, d in enumerate(deltas):
        p = tmp_path / f"d{i}.safetensors"
        write_delta(p, d, node_id="a", local_step=i, base_outer_step=i, model_fingerprint=model_fingerprint(s0()))
        hub.upload_delta(p, "a", i)
        if i == 2:
            m = master("m2")  # a new master takes over from the published (bf16) outer state
        assert m.sync_once(force=True)
    m2 = m
    manifest = hub.read_manifest()
    assert manifest.optimizer["options"]["state_dtype"] == "bfloat16"
    published = load_outer_state(hub, manifest)["optimizer"]
    assert published["exp_avg/w"].dtype == torch.bfloat16
    snap = m2.snapshot()[1]
    assert all(torch.equal(snap[k], ref_state[k]) for k in ref_state)
