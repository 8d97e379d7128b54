"""The pseudo-gradient encodings (diloco_lightning.encoding), against a plain reference.

The reference below is written out from docs/encoding.md with NumPy float32 scalars and Python
loops over blocks, one value at a time: codes, scales, packed bytes and top-k positions must be
equal to it bit for bit. The other tests cover every shape class (0-d, empty, shorter than a
block, not a multiple of it, complex, several chunks), device independence (strides, threads,
CUDA when present), error feedback, decode_add_, files on disk and malformed parts.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diloco_lightning.encoding import kernels
from diloco_lightning.encoding import (
    CHUNK,
    PAGE_SIZE,
    EncodedTensor,
    EncodingError,
    EncodingSpec,
    check_layout,
    decode,
    decode_add_,
    encode,
    encode_with_residual,
    expected_parts,
    part_name,
    split_part_name,
    topk_count,
    validate_parts,
)

F32 = np.float32
LEVELS = {"int8": 127, "int4": 7}
QUANTIZED = [
    EncodingSpec("int8"),
    EncodingSpec("int4"),
    EncodingSpec("int8", block_size=16),
    EncodingSpec("int4", block_size=16),
    EncodingSpec("topk", topk=0.1, topk_values="int8", block_size=16),
    EncodingSpec("topk", topk=0.3, topk_values="int4", block_size=16),
]
#: the chunked top-k (its own reference and hostile inputs: tests/test_chunked.py); the generic properties here
CTOPK = [
    EncodingSpec("ctopk", chunk=16, chunk_k=3, topk_values="int2"),
    EncodingSpec("ctopk", chunk=64, chunk_k=2, topk_values="sign"),
    EncodingSpec("ctopk", chunk=4096, chunk_k=64, topk_values="int2"),
    EncodingSpec("ctopk", chunk=256, chunk_k=8, topk_values="int8"),
]
ALL_SPECS = [EncodingSpec(n) for n in ("float32", "bfloat16", "float16")] + QUANTIZED + CTOPK
SHAPES = [(), (0,), (3, 0, 5), (1,), (3,), (15,), (16,), (17,), (127,), (129,), (5, 7), (2, 3, 33), (64, 16)]


def spec_id(spec: EncodingSpec) -> str:
    if spec.name == "ctopk":
        return f"ctopk-c{spec.chunk}-k{spec.chunk_k}-{spec.topk_values}"
    return spec.name + (f"-{spec.topk_values}-{spec.topk}" if spec.name == "topk" else "") + f"-b{spec.block_size}"


def sample(shape, *, complex=False, seed=0, dtype=torch.float32) -> torch.Tensor:
    """Deltas with outliers, exact zeros, a zero block and repeated magnitudes (ties for top-k)."""
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * (2 if complex else 1)
    x = torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen)) * 1e-3
    x[torch.rand(n, generator=gen) < 0.05] = 0.0
    x[torch.rand(n, generator=gen) < 0.1] = 2e-3 * torch.sign(torch.randn(1, generator=gen))
    x[16:32] = 0.0
    x = x.view(*shape, 2) if complex else x.view(shape)
    return torch.view_as_complex(x) if complex else x.to(dtype)


# ----------------------------------------------------------------------------- the reference


def ref_blocks(x: list[np.float32], name: str, block: int) -> tuple[list[int], list[np.float32]]:
    """Codes and scales, one block and one value at a time (docs/encoding.md, "Quantization")."""
    codes, scales = [], []
    for b0 in range(0, len(x), block):
        blk = x[b0 : b0 + block]
        amax = max(abs(v) for v in blk)
        if amax < 2.0**-100:
            scales.append(F32(0.0))
            codes += [0] * len(blk)
            continue
        s = F32(amax) / F32(LEVELS[name])  # float32 division
        scales.append(s)
        codes += [int(np.rint(F32(v) / s)) for v in blk]  # np.rint: round half to even
    return codes, scales


def ref_pack(codes: list[int], name: str) -> np.ndarray:
    if name == "int8":
        return np.array(codes, dtype=np.int8)
    padded = codes + [0] * (len(codes) % 2)
    return np.array([(padded[i] + 8) | ((padded[i + 1] + 8) << 4) for i in range(0, len(padded), 2)], dtype=np.uint8)


def ref_encode(t: torch.Tensor, spec: EncodingSpec) -> dict[str, np.ndarray]:
    real = torch.view_as_real(t) if t.is_complex() else t
    x = [F32(v) for v in real.reshape(-1).to(torch.float32).tolist()]
    if spec.name == "ctopk":
        from test_chunked import ref_encode as ref_ctopk

        return ref_ctopk(x, spec)
    if spec.name != "topk":
        codes, scales = ref_blocks(x, spec.name, spec.block_size)
        return {"q": ref_pack(codes, spec.name), "scale": np.array(scales, dtype=np.float32)}
    n, k = len(x), topk_count(len(x), spec.topk)
    keep = sorted(sorted(range(n), key=lambda i: (-abs(x[i]), i))[:k])  # largest first, ties: lowest position
    codes, scales = ref_blocks([x[i] for i in keep], spec.topk_values, spec.block_size)
    count = [0] * (-(-n // PAGE_SIZE))
    for i in keep:
        count[i // PAGE_SIZE] += 1
    return {
        "q": ref_pack(codes, spec.topk_values),
        "scale": np.array(scales, dtype=np.float32),
        "idx": np.array([i % PAGE_SIZE for i in keep], dtype=np.uint16).view(np.int16),
        "count": np.array(count, dtype=np.int32),
    }


def ref_decode(parts: dict[str, np.ndarray], spec: EncodingSpec, n: int) -> np.ndarray:
    if spec.name == "ctopk":
        from test_chunked import ref_decode as ref_ctopk

        return ref_ctopk(parts, spec, n)
    name = spec.topk_values if spec.name == "topk" else spec.name
    q = parts["q"]
    if name == "int4":
        q = [int(b) & 15 if i % 2 == 0 else int(b) >> 4 for b in q for i in (0, 1)]
        q = [c - 8 for c in q]
    m = len(parts["idx"]) if spec.name == "topk" else n
    vals = [F32(int(q[i])) * parts["scale"][i // spec.block_size] for i in range(m)]
    if spec.name != "topk":
        return np.array(vals, dtype=np.float32)
    out = np.zeros(n, dtype=np.float32)
    pos = [p * PAGE_SIZE + i for p, c in enumerate(parts["count"]) for i in range(int(c))]  # page of each kept value
    offsets = parts["idx"].view(np.uint16)
    for j, v in enumerate(vals):
        out[(pos[j] // PAGE_SIZE) * PAGE_SIZE + int(offsets[j])] = v
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """Exact bit pattern (tells -0.0 from 0.0)."""
    t = t.detach().cpu().contiguous()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def assert_same_parts(a: EncodedTensor, b: EncodedTensor) -> None:
    assert a.parts.keys() == b.parts.keys()
    for p in a.parts:
        assert a.parts[p].dtype == b.parts[p].dtype, p
        assert torch.equal(bits(a.parts[p]), bits(b.parts[p])), p


# ----------------------------------------------------------------------------- spec and names


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"name": "int2"}, "name"),
        ({"name": "int8", "block_size": 100}, "block_size"),
        ({"name": "int8", "block_size": 8}, "block_size"),
        ({"name": "int8", "block_size": 8192}, "block_size"),
        ({"name": "int8", "block_size": True}, "block_size"),
        ({"name": "int8", "block_size": 128.0}, "block_size"),
        ({"name": "topk", "topk": 0.0}, "topk"),
        ({"name": "topk", "topk": 1.5}, "topk"),
        ({"name": "topk", "topk": float("nan")}, "topk"),
        ({"name": "topk", "topk": True}, "topk"),
        ({"name": "topk", "topk_values": "int2"}, "topk_values"),
    ],
)
def test_spec_rejects_bad_arguments(kwargs, argument):
    with pytest.raises(ValueError, match=f"^{argument} must"):
        EncodingSpec(**kwargs)


def test_spec_metadata_round_trip_and_untrusted_headers():
    for spec in ALL_SPECS + [EncodingSpec("topk", topk=0.07, topk_values="int4", block_size=4096)]:
        md = spec.to_metadata()
        assert all(isinstance(v, str) for v in md.values())
        back = EncodingSpec.from_metadata(md)
        assert back.to_metadata() == md and back.name == spec.name
    assert EncodingSpec.from_metadata({}) == EncodingSpec("float32")
    bad = [
        ({"encoding": "int3"}, "name"),
        ({"encoding": "int8", "encoding_block_size": "1" * 5000}, "encoding_block_size"),
        ({"encoding": "int8", "encoding_block_size": "-128"}, "encoding_block_size"),
        ({"encoding": "int8", "encoding_block_size": "100"}, "block_size"),
        ({"encoding": "topk", "encoding_topk": "nan"}, "encoding_topk"),
        ({"encoding": "topk", "encoding_topk": "1e-999"}, "encoding_topk"),
        ({"encoding": "topk", "encoding_topk": "0." + "1" * 100}, "encoding_topk"),
        ({"encoding": "topk", "encoding_topk": "x"}, "encoding_topk"),
        ({"encoding": "topk", "encoding_topk_values": "fp4"}, "topk_values"),
    ]
    for md, argument in bad:
        with pytest.raises(ValueError, match=argument):
            EncodingSpec.from_metadata(md)


def test_part_names_and_topk_count():
    assert part_name("layers.0.w", "q") == "layers.0.w"
    assert part_name("layers.0.w", "scale") == "layers.0.w::scale"
    for name in ("w", "w::scale", "a.b::idx", "a::b::count"):
        key, part = split_part_name(name)
        assert part_name(key, part) == name
    assert split_part_name("a::b::count") == ("a::b", "count")
    assert [topk_count(n, 0.01) for n in (0, 1, 49, 50, 51, 320, 16_097_280)] == [0, 1, 1, 1, 1, 3, 160_973]
    assert topk_count(100, 0.07) == 7 and topk_count(250, 0.01) == 2 and topk_count(350, 0.01) == 4  # ties to even
    assert topk_count(10, 1.0) == 10


# ----------------------------------------------------------------------------- bit-exact against the reference


@pytest.mark.parametrize("spec", QUANTIZED, ids=spec_id)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(spec, shape):
    t = sample(shape, seed=len(shape) + sum(shape))
    enc = encode(t, spec)
    ref = ref_encode(t, spec)
    assert enc.parts.keys() == ref.keys()
    for p, want in ref.items():
        got = enc.parts[p]
        assert got.dtype == {np.int8: torch.int8, np.uint8: torch.uint8, np.float32: torch.float32,
                             np.int16: torch.int16, np.int32: torch.int32}[want.dtype.type], p
        assert np.array_equal(got.numpy().view(np.uint8), want.view(np.uint8)), p  # bytes, so -0.0 != 0.0
    dec = decode(enc)
    assert dec.shape == t.shape and dec.dtype == torch.float32
    assert np.array_equal(dec.reshape(-1).numpy(), ref_decode(ref, spec, t.numel()))


def test_matches_reference_across_pages_and_chunks():
    # several chunks and top-k pages, and a tail that is neither a block nor a pair
    t = sample((CHUNK + 3 * PAGE_SIZE // 2 + 37,), seed=3)
    for spec in (EncodingSpec("int4"), EncodingSpec("topk", topk=0.002, topk_values="int4")):
        enc, ref = encode(t, spec), ref_encode(t, spec)
        for p in ref:
            assert np.array_equal(enc.parts[p].numpy().view(np.uint8), ref[p].view(np.uint8)), (spec.name, p)
        assert np.array_equal(decode(enc).numpy(), ref_decode(ref, spec, t.numel()))


def test_topk_matches_reference_when_magnitudes_are_alike():
    # an Adam-like update (every entry about +-lr) puts most magnitudes into the threshold's
    # radix bin; subnormals and zeros share the lowest bin
    gen = torch.Generator().manual_seed(4)
    x = torch.sign(torch.randn(3000, generator=gen)) * 1e-3 * (1 + 1e-3 * torch.rand(3000, generator=gen))
    x[::7] = 1e-3
    x[::11] = 0.0
    x[5:40] = torch.tensor(1e-40) * torch.arange(35)
    for fraction in (0.01, 0.2, 0.8, 0.95, 1.0):
        spec = EncodingSpec("topk", topk=fraction, block_size=16)
        enc, ref = encode(x, spec), ref_encode(x, spec)
        for p in ref:
            assert np.array_equal(enc.parts[p].numpy().view(np.uint8), ref[p].view(np.uint8)), (fraction, p)


def test_rounding_is_half_to_even():
    # amax 127 -> scale exactly 1.0, so x / s is x: the .5 cases round to the even neighbour
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -126.5])
    assert encode(x, EncodingSpec("int8", block_size=16)).parts["q"].tolist() == [127, 0, 2, 2, 0, -2, -2, 4, 126, -126]


# ----------------------------------------------------------------------------- shapes, dtypes, error bounds


@pytest.mark.parametrize("spec", ALL_SPECS, ids=spec_id)
@pytest.mark.parametrize("complex_", [False, True], ids=["real", "complex"])
def test_every_shape_class(spec, complex_):
    for shape in SHAPES:
        t = sample(shape, complex=complex_, seed=7)
        enc, res = encode_with_residual(t, spec)
        parts = {p: (x.dtype, tuple(x.shape)) for p, x in enc.parts.items()}
        assert parts == expected_parts(shape, spec, complex=complex_), shape
        validate_parts(enc.parts, shape, spec, complex=complex_)
        dec = decode(enc)
        assert dec.shape == t.shape and dec.dtype == (torch.complex64 if complex_ else torch.float32)
        assert torch.equal(res, t - dec), shape  # the residual is exactly what decoding loses
        assert enc.nbytes == sum(math.prod(s) * torch.empty(0, dtype=d).element_size() for d, s in parts.values())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_input_dtypes_encode_their_fp32_value(dtype):
    t = sample((3, 100), dtype=torch.float64) * (1 + 1e-9)  # float64 values between two FP32 ones
    t = t.to(dtype)
    for spec in ALL_SPECS:
        enc, res = encode_with_residual(t, spec)
        want_enc, want_res = encode_with_residual(t.to(torch.float32), spec)
        assert_same_parts(enc, want_enc)
        assert torch.equal(bits(res), bits(want_res))


def _positions(enc: EncodedTensor) -> np.ndarray:
    """Top-k positions decoded the plain way: page j repeated count[j] times, plus the offsets."""
    count = enc.parts["count"].numpy()
    pages = np.repeat(np.arange(count.size), count)
    return pages * PAGE_SIZE + enc.parts["idx"].numpy().view(np.uint16)


@pytest.mark.parametrize("spec", QUANTIZED, ids=spec_id)
def test_round_trip_error_bounds(spec):
    t = sample((1000,), seed=11)
    enc = encode(t, spec)
    x, dec = t.numpy(), decode(enc).numpy()
    block = spec.block_size
    if spec.name == "topk":  # dropped entries are no larger than any kept one, and decode to 0
        pos, k = _positions(enc), topk_count(x.size, spec.topk)
        dropped = np.ones(x.size, dtype=bool)
        dropped[pos] = False
        assert pos.size == k and (np.abs(x[dropped]) <= np.sort(np.abs(x))[-k]).all() and (dec[dropped] == 0).all()
        x, dec = x[pos], dec[pos]
    scale = enc.parts["scale"].numpy()
    per_value = np.repeat(scale, block)[: x.size]
    amax = np.repeat(np.maximum.reduceat(np.abs(x), np.arange(0, x.size, block)), block)[: x.size]
    # |x - fl(q*s)| <= s/2, plus the roundings of x/s and q*s (a few ulps of the block's absmax)
    assert (np.abs(x - dec) <= per_value / 2 + amax * 2.0**-21).all()


def test_cast_error_bounds():
    x = sample((1000,), seed=11).numpy()
    for name, rel in (("float32", 0.0), ("bfloat16", 2.0**-8), ("float16", 2.0**-11)):
        d = decode(encode(torch.from_numpy(x), EncodingSpec(name))).numpy()
        normal = np.abs(x) > 6.2e-5  # float16 is coarser in its subnormal range
        assert (np.abs(d - x)[normal] <= rel * np.abs(x)[normal]).all(), name


def test_zero_and_tiny_blocks_have_zero_scales_and_no_nan():
    x = torch.zeros(300)
    x[128:256] = 1e-35  # a block of tiny values: below 2^-100, stored as zeros
    x[256] = 3.0
    for spec in QUANTIZED + [EncodingSpec("topk", topk=1.0)]:
        enc, res = encode_with_residual(x, spec)
        dec = decode(enc)
        assert torch.isfinite(dec).all() and torch.isfinite(enc.parts["scale"]).all()
        assert dec[:256].abs().max() == 0 and dec[256] == 3.0
        assert torch.equal(res, x - dec)
    enc = encode(torch.zeros(40), EncodingSpec("int8", block_size=16))
    assert enc.parts["scale"].tolist() == [0.0] * 3 and enc.parts["q"].abs().sum() == 0


def test_topk_ties_keep_the_lowest_positions():
    x = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0, 3.0, -2.0])
    enc = encode(x, EncodingSpec("topk", topk=0.5, block_size=16))  # k = 4: 3.0 then three of the five 2.0s
    assert _positions(enc).tolist() == [1, 2, 4, 6]
    # threshold 0: every non-zero entry, then zeros by lowest position
    z = torch.zeros(2 * PAGE_SIZE + 10)
    z[PAGE_SIZE + 5] = -1.0
    enc = encode(z, EncodingSpec("topk", topk=3 / z.numel()))
    assert _positions(enc).tolist() == [0, 1, PAGE_SIZE + 5] and enc.parts["count"].tolist() == [2, 1, 0]


def _topk_cases(n: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen) * 1e-3
    ties = (torch.randn(n, generator=gen) * 3).round()  # few magnitudes: ties at the threshold
    ties[::7] = -0.0
    alike = 1e-3 * torch.sign(torch.randn(n, generator=gen))  # Adam-like: every magnitude equal
    run, stride = kernels.SAMPLE_RUN, kernels.SAMPLE_STRIDE
    misled = torch.randn(n, generator=gen) * 1e-6  # the sampled runs hold the largest entries: a guess too high
    for start in range(0, n // run * run, run * stride):
        misled[start : start + run] *= 1e6
    tail = x.clone()
    tail[-5000:] *= 100  # the largest at the end, in the last (short) chunk
    return {"gaussian": x, "ties": ties, "alike": alike, "misled": misled, "tail": tail}


def test_topk_sampled_threshold_gives_the_radix_select_bits(monkeypatch):
    """The one-pass top-k (a threshold guessed from a sample, then checked) keeps exactly the set of
    the radix select, or gives up and leaves it to it: the same bits either way."""
    n = CHUNK + 12345
    taken = {}
    for name, x in _topk_cases(n).items():
        for i, fraction in enumerate((1e-4, 0.01, 0.03) if name != "alike" else (0.01,)):  # alike: the slow radix path
            spec = EncodingSpec("topk", topk=fraction, topk_values=("int8", "int4")[i % 2])
            k = topk_count(n, fraction)
            taken[name, fraction] = kernels._kth_from_sample(kernels._Magnitudes(x), k) is not None
            enc, res = encode_with_residual(x, spec)
            with monkeypatch.context() as m:
                m.setattr(kernels, "_kth_from_sample", lambda mags, k: None)
                ref, ref_res = encode_with_residual(x, spec)
            for p in ref.parts:
                assert torch.equal(enc.parts[p], ref.parts[p]), (name, fraction, p)
            assert torch.equal(res.view(torch.int32), ref_res.view(torch.int32)), (name, fraction)
    assert taken["gaussian", 0.01] and taken["ties", 0.01] and taken["tail", 0.03]  # the one-pass path runs
    assert not taken["alike", 0.01] and not taken["misled", 0.01]  # too many candidates / too few: given up


def test_topk_sampled_threshold_refuses_nan_and_inf_outside_the_sample():
    n = 2 * CHUNK + 77
    for bad in (float("nan"), float("inf"), -float("inf")):
        for where in (kernels.SAMPLE_RUN + 3, CHUNK + 1, n - 1):  # none of them in a sampled run
            x = torch.randn(n)
            x[where] = bad
            with pytest.raises(ValueError, match="NaN or inf"):
                encode(x, EncodingSpec("topk", topk=0.01))


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_casts_refuse_a_non_finite_value_in_any_chunk(name):
    """The casts check each chunk's largest and smallest value: a NaN, an infinity of either sign or
    (float16, bfloat16) a value beyond the dtype's range is refused wherever it is."""
    spec = EncodingSpec(name)
    too_big = {"float32": float("inf"), "bfloat16": 3.4e38, "float16": 7e4}[name]  # rounds to inf in the dtype
    base = torch.randn(2 * CHUNK + 3, generator=torch.Generator().manual_seed(0))
    for i, bad in enumerate((float("nan"), float("inf"), -float("inf"), too_big, -too_big)):
        for where in (0, CHUNK - 1, CHUNK, 2 * CHUNK + 2):
            x = base.clone()
            x[where] = bad
            with pytest.raises(ValueError, match="NaN or inf"):
                (encode_with_residual if (i + where) % 2 else encode)(x, spec)
    x = base.clone()
    x[CHUNK + 5] = -0.0
    enc, res = encode_with_residual(x, spec)
    assert torch.equal(decode(enc), x.to(getattr(torch, name)).float()) and torch.equal(res, x - decode(enc))


@pytest.mark.parametrize("spec", ALL_SPECS, ids=spec_id)
def test_non_finite_values_are_refused(spec):
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.ones(200)
        x[150] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            encode(x, spec)
    with pytest.raises(ValueError, match="floating point or complex"):
        encode(torch.arange(4), spec)
    if spec.name == "float16":
        with pytest.raises(ValueError, match="range"):
            encode(torch.tensor([1e6]), spec)


# ----------------------------------------------------------------------------- same bits everywhere


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("spec", ALL_SPECS, ids=spec_id)
def test_same_bits_whatever_the_layout_threads_and_device(spec):
    base = sample((96, 70), seed=5)
    want = encode(base, spec)
    layouts = [
        base.t().contiguous().t(),  # same values, column-major strides
        torch.stack([base, base]).select(0, 1),  # a view at an offset
        torch.zeros(96, 140)[:, ::2].copy_(base),  # strided columns
    ]
    for t in layouts:
        assert_same_parts(encode(t, spec), want)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert_same_parts(encode(base, spec), want)
    finally:
        torch.set_num_threads(threads)
    for device in DEVICES[1:]:  # CUDA when present: the same bits as the CPU, both ways
        on_dev = encode(base.to(device), spec)
        assert all(p.device.type == device for p in on_dev.parts.values())
        assert_same_parts(EncodedTensor(spec, on_dev.shape, False, {p: x.cpu() for p, x in on_dev.parts.items()}), want)
        assert torch.equal(bits(decode(on_dev)), bits(decode(want)))
        out = sample((96, 70), seed=6)
        out_dev = out.to(device)
        decode_add_(out, want, 0.3)
        decode_add_(out_dev, want, 0.3)
        assert torch.equal(bits(out_dev), bits(out))
        _, res_dev = encode_with_residual(base.to(device), spec)
        assert torch.equal(bits(res_dev), bits(encode_with_residual(base, spec)[1]))


# ----------------------------------------------------------------------------- error feedback, decode_add_


@pytest.mark.parametrize("spec", QUANTIZED + CTOPK + [EncodingSpec("bfloat16")], ids=spec_id)
def test_error_feedback_sends_everything_eventually(spec):
    gen = torch.Generator().manual_seed(1)
    deltas = [torch.randn(40, 33, generator=gen) * 1e-2 for _ in range(6)]
    residual = torch.zeros(40, 33)
    sent = torch.zeros(40, 33, dtype=torch.float64)
    for delta in deltas:
        enc, residual = encode_with_residual(delta + residual, spec)
        sent += decode(enc).double()
    total = sum(d.double() for d in deltas)
    # sum of what was sent + what is still owed == sum of the true deltas (to FP32 rounding)
    torch.testing.assert_close(sent + residual.double(), total, rtol=0, atol=1e-7)
    # and the total sent is closer to the truth than without error feedback (losses add up there)
    plain = sum(decode(encode(d, spec)).double() for d in deltas)
    assert 0 < (sent - total).norm() < (plain - total).norm()


@pytest.mark.parametrize("spec", ALL_SPECS, ids=spec_id)
def test_residual_into_a_given_buffer_or_the_input_itself(spec):
    for complex_ in (False, True):
        t = sample((CHUNK + 77,) if not complex_ else (5, 9), complex=complex_, seed=12)
        want_enc, want = encode_with_residual(t, spec)
        buf = torch.full_like(want, 7.0)
        enc, res = encode_with_residual(t, spec, out=buf)
        assert res is buf and torch.equal(bits(buf), bits(want))
        assert_same_parts(enc, want_enc)
        x = t.clone()
        enc, res = encode_with_residual(x, spec, out=x)  # the error-feedback buffer, updated in place
        assert res is x and torch.equal(bits(x), bits(want))
        assert_same_parts(enc, want_enc)
    t = torch.randn(4, 6)
    bad = (torch.zeros(4, 6, dtype=torch.float64), torch.zeros(24), torch.zeros(6, 4).t(), torch.zeros(4, 6).bfloat16())
    for out in bad:
        with pytest.raises(ValueError, match="out must be"):
            encode_with_residual(t, spec, out=out)


@pytest.mark.parametrize("spec", ALL_SPECS, ids=spec_id)
def test_decode_add_equals_out_plus_alpha_decode(spec):
    for shape, complex_ in (((), False), ((0,), False), ((3, 45), False), ((7, 9), True), ((CHUNK + 1000,), False)):
        t = sample(shape, complex=complex_, seed=2)
        enc = encode(t, spec)
        dec = decode(enc)
        for alpha in (1.0, 0.37, -2.0, 0):
            out = sample(shape, complex=complex_, seed=9)
            want = out + alpha * dec
            assert decode_add_(out, enc, alpha) is out
            assert torch.equal(bits(out), bits(want)), (shape, alpha)


def test_decode_add_refuses_a_bad_out_or_alpha():
    enc = encode(torch.randn(4, 6), EncodingSpec("int8"))
    for out in (torch.zeros(4, 6, dtype=torch.float64), torch.zeros(24), torch.zeros(6, 4).t(),
                torch.zeros(4, 6, dtype=torch.complex64)):
        with pytest.raises(ValueError, match="out must be"):
            decode_add_(out, enc)
    for alpha in (float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="alpha"):
            decode_add_(torch.zeros(4, 6), enc, alpha)


@pytest.mark.parametrize("spec", [EncodingSpec("int8"), EncodingSpec("int4"), EncodingSpec("bfloat16"),
                                  EncodingSpec("topk", topk=0.05), EncodingSpec("ctopk", topk=0.05),
                                  EncodingSpec("ctopk", chunk=64, chunk_k=64, topk_values="int8")], ids=spec_id)
def test_decode_add_uses_bounded_memory(spec):
    n = 8 * CHUNK  # 8 MiB of FP32: a full-size temporary would show as an allocation of n * 4 bytes
    enc = encode(sample((n,), seed=4), spec)
    out = torch.zeros(n)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        decode_add_(out, enc, 0.5)
    biggest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < biggest <= 2 * CHUNK * 8  # one FP32 chunk, and one int64 chunk of top-k positions


# ----------------------------------------------------------------------------- files and malformed parts


@pytest.mark.parametrize("spec", ALL_SPECS, ids=spec_id)
def test_file_round_trip_checks_the_header_first(spec, tmp_path):
    state = {"w": sample((33, 20), seed=1), "b": sample((7,), seed=2), "z": torch.zeros(0),
             "c": sample((3, 4), complex=True)}
    encs = {k: encode(t, spec) for k, t in state.items()}
    tensors = {name: x for k, e in encs.items() for name, x in e.file_tensors(k).items()}
    path = tmp_path / "delta.safetensors"
    save_file(tensors, str(path), metadata=spec.to_metadata())
    with safe_open(str(path), framework="pt") as f:
        read_spec = EncodingSpec.from_metadata(f.metadata())
        found: dict[str, dict] = {}
        for name in f.keys():
            key, part = split_part_name(name)
            sl = f.get_slice(name)
            found.setdefault(key, {})[part] = (sl.get_dtype(), sl.get_shape())  # header only, no data read
        for key, t in state.items():
            check_layout(found[key], t.shape, read_spec, complex=t.is_complex(), key=key)
        for key, t in state.items():
            parts = {p: f.get_tensor(part_name(key, p)) for p in found[key]}
            enc = EncodedTensor.from_parts(parts, t.shape, read_spec, complex=t.is_complex(), key=key)
            assert torch.equal(bits(decode(enc)), bits(decode(encs[key])))


def _malformed(enc: EncodedTensor, part: str, fn) -> dict:
    parts = {p: x.clone() for p, x in enc.parts.items()}
    parts[part] = fn(parts[part])
    return parts


def _set(i, v):
    def fn(x):
        x[i] = v
        return x
    return fn


def _last_on_page_2(enc: EncodedTensor) -> torch.Tensor:
    count = enc.parts["count"].clone()
    count[int((count > 0).nonzero()[-1])] -= 1
    count[2] += 1
    return count


def test_malformed_parts_are_rejected_with_the_key_and_part():
    x = sample((301,), seed=8)
    int8, int4 = EncodingSpec("int8"), EncodingSpec("int4")
    topk = EncodingSpec("topk", topk=0.02, topk_values="int4")
    big = sample((2 * PAGE_SIZE + 7,), seed=9)
    e8, e4, ek = encode(x, int8), encode(x, int4), encode(big, topk)
    cases = [
        (e8, int8, x.shape, {"q": e8.parts["q"]}, "has parts"),
        (e8, int8, x.shape, {**e8.parts, "idx": e8.parts["q"]}, "has parts"),
        (e8, int8, x.shape, {**e8.parts, "q": e8.parts["q"].to(torch.int16)}, "part 'q' is torch.int16"),
        (e8, int8, x.shape, {**e8.parts, "scale": e8.parts["scale"][:-1]}, "part 'scale'"),
        (e8, int8, (300,), e8.parts, "part 'q'"),
        (e8, int8, x.shape, _malformed(e8, "scale", _set(1, float("nan"))), "'scale'"),
        (e8, int8, x.shape, _malformed(e8, "scale", _set(1, -1.0)), "'scale'"),
        (e8, int8, x.shape, _malformed(e8, "scale", _set(1, 3e38)), "decodes to inf"),
        (e8, int8, x.shape, _malformed(e8, "q", _set(5, -128)), "-128"),
        (e4, int4, x.shape, _malformed(e4, "q", _set(5, 0x70)), "nibble 0"),
        (e4, int4, x.shape, _malformed(e4, "q", _set(5, 0x07)), "nibble 0"),
        (e4, int4, x.shape, _malformed(e4, "q", _set(-1, 0x98)), "padding nibble"),
        (ek, topk, big.shape, _malformed(ek, "count", _set(0, -1)), "'count'"),
        (ek, topk, big.shape, _malformed(ek, "count", _set(2, 5)), "'count'"),
        (ek, topk, big.shape, _malformed(ek, "idx", _set(3, ek.parts["idx"][2])), "strictly increasing"),
        (ek, topk, big.shape, {**_malformed(ek, "idx", _set(-1, 1000)), "count": _last_on_page_2(ek)}, "beyond"),
        (ek, topk, big.shape, _malformed(ek, "count", lambda c: torch.tensor([0, int(c.sum()), 0], dtype=torch.int32)),
         "strictly increasing"),
    ]
    for enc, spec, shape, parts, message in cases:
        with pytest.raises(EncodingError, match=message) as info:
            EncodedTensor.from_parts(parts, shape, spec, key="layers.3.w")
        assert str(info.value).startswith("layers.3.w: ")
    for spec in ALL_SPECS:  # a float part with NaN, and a header that names a wrong dtype
        if spec.name in ("float32", "bfloat16", "float16"):
            e = encode(x, spec)
            with pytest.raises(EncodingError, match="NaN or inf"):
                validate_parts(_malformed(e, "q", _set(0, float("nan"))), x.shape, spec)
        want = expected_parts(x.shape, spec)
        with pytest.raises(EncodingError, match="expected"):
            check_layout({p: ("F64", s) for p, (_, s) in want.items()}, x.shape, spec)
    with pytest.raises(ValueError, match="shape"):
        expected_parts((3, -1), int8)
