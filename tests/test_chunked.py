"""The chunked top-k encoding (``ctopk``, diloco_lightning.encoding.chunked) against a plain reference.

The reference below is written from docs/encoding.md ("Chunked top-k") with NumPy float32 scalars
and Python loops, one chunk and one value at a time: offsets, codes, scales and the packed bytes
of both bitstreams must equal it bit for bit. Then: the bitstream packer against a bit-by-bit
reference for every width, the narrowed selection against the whole-row one, error bounds,
ties, zeros, and every malformed part a hostile writer could send. The generic properties
(every shape class, strides, threads and CUDA, residuals, decode_add_, bounded memory, files)
run for ctopk in tests/test_encoding.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diloco_lightning.encoding import (
    EncodedTensor,
    EncodingError,
    EncodingSpec,
    check_layout,
    decode,
    encode,
    encode_with_residual,
    expected_parts,
    validate_parts,
)
from diloco_lightning.encoding.bits import pack_bits, packed_bytes, unpack_bits
from diloco_lightning.encoding.chunked import CHUNK_SIZES, VALUE_BITS, _narrowing, _select, _select_exact, chunk_layout

F32 = np.float32
TINY = 2.0**-100
SPECS = [
    EncodingSpec("ctopk", chunk=16, chunk_k=3, topk_values="int2"),
    EncodingSpec("ctopk", chunk=16, chunk_k=16, topk_values="int8"),
    EncodingSpec("ctopk", chunk=64, chunk_k=5, topk_values="int4"),
    EncodingSpec("ctopk", chunk=64, chunk_k=1, topk_values="sign"),
    EncodingSpec("ctopk", chunk=512, chunk_k=8, topk_values="sign"),
    EncodingSpec("ctopk", chunk=2048, chunk_k=41, topk_values="int2"),  # 11-bit offsets: the bit-by-bit packer
    EncodingSpec("ctopk", chunk=4096, chunk_k=64, topk_values="int2"),  # SparseLoCo's chunk, the narrowed selection
]
SHAPES = [(), (0,), (1,), (3,), (15,), (16,), (17,), (5, 7), (64, 16), (3, 700), (4100,), (2, 4096)]


def spec_id(spec: EncodingSpec) -> str:
    return f"c{spec.chunk}-k{spec.chunk_k}-{spec.topk_values}"


def sample(n: int, seed: int = 0) -> torch.Tensor:
    """Outliers, exact zeros, a zero run, and repeated magnitudes (ties)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(2 * torch.randn(n, generator=gen)) * 1e-3
    x[torch.rand(n, generator=gen) < 0.05] = 0.0
    x[torch.rand(n, generator=gen) < 0.1] = 2e-3 * torch.sign(torch.randn(1, generator=gen))
    x[16:48] = 0.0
    return x


# ----------------------------------------------------------------------------- the reference


def ref_bits(values: list[int], width: int) -> np.ndarray:
    """docs/encoding.md: value i in stream bits i*w .. i*w+w-1, least significant first, bytes low bit first."""
    stream = [(v >> b) & 1 for v in values for b in range(width)]
    stream += [0] * (-len(stream) % 8)
    return np.array([sum(stream[i + j] << j for j in range(8)) for i in range(0, len(stream), 8)], dtype=np.uint8)


def ref_chunk_k(k: int, length: int, chunk: int) -> int:
    return k if length == chunk else max(1, math.ceil(k * length / chunk))


def ref_encode(x: list[np.float32], spec: EncodingSpec) -> dict[str, np.ndarray]:
    chunk, k, bits = spec.chunk, spec.chunk_k, VALUE_BITS[spec.topk_values]
    levels = 1 << (bits - 1)
    codes, offsets, scales = [], [], []
    for c0 in range(0, len(x), chunk):
        seg = x[c0 : c0 + chunk]
        kc = ref_chunk_k(k, len(seg), chunk)
        keep = sorted(sorted(range(len(seg)), key=lambda i: (-abs(seg[i]), i))[:kc])  # ties: lowest offset
        mags = sorted((F32(abs(seg[i])) for i in keep), reverse=True)
        offsets += keep
        if bits == 1:
            s = mags[(kc - 1) // 2]
            s = F32(0.0) if s < TINY else s
            scales.append(s)
            codes += [1 if seg[i] < 0 else 0 for i in keep]
            continue
        lo, hi = mags[-1], mags[0]
        lo = F32(0.0) if lo < TINY else lo
        step = F32(F32(hi - lo) / F32(levels - 1))
        step = F32(0.0) if step < TINY else step
        scales.append([lo, step])
        for i in keep:
            j = 0 if step == 0 else min(levels - 1, max(0, int(np.rint(F32(F32(abs(seg[i]) - lo) / step)))))
            codes.append(j + (levels if seg[i] < 0 else 0))
    pos_bits = chunk.bit_length() - 1
    return {"q": ref_bits(codes, bits), "scale": np.array(scales, dtype=np.float32).reshape(-1, *([2] if bits > 1 else [])),
            "idx": ref_bits(offsets, pos_bits)}


def ref_decode(parts: dict[str, np.ndarray], spec: EncodingSpec, n: int) -> np.ndarray:
    chunk, k, bits = spec.chunk, spec.chunk_k, VALUE_BITS[spec.topk_values]
    pos_bits = chunk.bit_length() - 1
    stream = lambda b, w, i: sum(((int(b[(i * w + t) // 8]) >> ((i * w + t) % 8)) & 1) << t for t in range(w))  # noqa: E731
    out = np.zeros(n, dtype=np.float32)
    i = 0
    for c, c0 in enumerate(range(0, n, chunk)):
        for _ in range(ref_chunk_k(k, min(chunk, n - c0), chunk)):
            off, code = stream(parts["idx"], pos_bits, i), stream(parts["q"], bits, i)
            if bits == 1:
                v = parts["scale"][c] * (-1 if code else 1)
            else:
                lo, step = parts["scale"][c]
                mag = F32(F32(F32(code & ((1 << (bits - 1)) - 1)) * step) + lo)
                v = -mag if code >> (bits - 1) else mag
            out[c0 + off] = v
            i += 1
    return out


# ----------------------------------------------------------------------------- spec


@pytest.mark.parametrize(("kwargs", "argument"), [
    ({"chunk": 100}, "chunk"), ({"chunk": 8}, "chunk"), ({"chunk": 1 << 17}, "chunk"), ({"chunk": 4096.0}, "chunk"),
    ({"chunk_k": 0}, "chunk_k"), ({"chunk": 64, "chunk_k": 65}, "chunk_k"), ({"chunk_k": True}, "chunk_k"),
    ({"topk_values": "fp4"}, "topk_values"), ({"topk_values": "int3"}, "topk_values"), ({"topk": 0.0}, "topk"),
])
def test_spec_rejects_bad_arguments(kwargs, argument):
    with pytest.raises(ValueError, match=f"^{argument} must"):
        EncodingSpec("ctopk", **kwargs)


def test_spec_k_from_the_fraction_and_the_header_round_trip():
    spec = EncodingSpec("ctopk", topk=0.01, topk_values="int2")
    assert (spec.chunk, spec.chunk_k, spec.topk) == (4096, 41, 41 / 4096)  # round(40.96)
    assert EncodingSpec("ctopk", topk=1e-9).chunk_k == 1 and EncodingSpec("ctopk", topk=1.0, chunk=16).chunk_k == 16
    assert EncodingSpec("ctopk", chunk_k=64, topk=0.5).topk == 64 / 4096  # chunk_k wins: the header carries it
    assert EncodingSpec("ctopk", block_size=64) == EncodingSpec("ctopk")  # no blocks: one scale pair per chunk
    assert EncodingSpec("int8", chunk=64, chunk_k=3) == EncodingSpec("int8")  # unused fields normalized
    with pytest.raises(ValueError, match="topk_values"):
        EncodingSpec("topk", topk_values="int2")  # the paged top-k keeps its int8 / int4 codes
    md = spec.to_metadata()
    assert md == {"encoding": "ctopk", "encoding_chunk": "4096", "encoding_chunk_k": "41", "encoding_topk_values": "int2"}
    assert EncodingSpec.from_metadata(md) == spec
    bad = [
        ({**md, "encoding_chunk": "4095"}, "chunk must"),
        ({**md, "encoding_chunk": "1" * 400}, "encoding_chunk"),
        ({**md, "encoding_chunk": "-4096"}, "encoding_chunk"),
        ({**md, "encoding_chunk": "４０９６"}, "encoding_chunk"),  # non-ASCII digits
        ({k: v for k, v in md.items() if k != "encoding_chunk"}, "encoding_chunk"),
        ({**md, "encoding_chunk_k": "0"}, "chunk_k must"),
        ({**md, "encoding_chunk_k": "4097"}, "chunk_k must"),
        ({**md, "encoding_chunk_k": "1e3"}, "encoding_chunk_k"),
        ({k: v for k, v in md.items() if k != "encoding_chunk_k"}, "encoding_chunk_k"),
        ({**md, "encoding_topk_values": "int16"}, "topk_values"),
        ({k: v for k, v in md.items() if k != "encoding_topk_values"}, "topk_values"),
    ]
    for header, message in bad:
        with pytest.raises(ValueError, match=message):
            EncodingSpec.from_metadata(header)


def test_layout_is_positions_in_log2_chunk_bits_and_a_scale_pair_per_chunk():
    spec = EncodingSpec("ctopk", chunk=4096, chunk_k=64, topk_values="int2")
    n = 3 * 4096 + 100  # 3 full chunks, and a tail of 100 keeping ceil(64 * 100 / 4096) = 2
    parts = expected_parts((n,), spec)
    kept = 3 * 64 + 2
    assert parts == {"q": (torch.uint8, (packed_bytes(kept, 2),)), "scale": (torch.float32, (4, 2)),
                     "idx": (torch.uint8, (packed_bytes(kept, 12),))}
    assert packed_bytes(kept, 12) == math.ceil(kept * 12 / 8) and packed_bytes(kept, 2) == math.ceil(kept / 4)
    sign = expected_parts((n,), EncodingSpec("ctopk", chunk=4096, chunk_k=64, topk_values="sign"))
    assert sign["scale"] == (torch.float32, (4,)) and sign["q"] == (torch.uint8, (packed_bytes(kept, 1),))
    assert expected_parts((0,), spec) == {"q": (torch.uint8, (0,)), "scale": (torch.float32, (0, 2)),
                                          "idx": (torch.uint8, (0,))}
    # 1.56 % of the values at 12 + 2 bits and 8 bytes per chunk: 0.0071x of FP32 (141x smaller)
    lay = chunk_layout(1 << 24, 4096, 64, "int2")
    assert lay.kept == (1 << 24) // 64
    assert abs(sum(math.prod(s) * (4 if d == torch.float32 else 1) for d, s in lay.parts().values())
               / (4 << 24) - (64 * 14 / 8 + 8) / (4 * 4096)) < 1e-9


# ----------------------------------------------------------------------------- bit-exact against the reference


@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(spec, shape):
    n = math.prod(shape)
    t = sample(n, seed=n).view(shape)
    enc = encode(t, spec)
    ref = ref_encode([F32(v) for v in t.reshape(-1).tolist()], spec)
    assert enc.parts.keys() == ref.keys()
    for p, want in ref.items():
        assert np.array_equal(enc.parts[p].numpy().view(np.uint8), want.view(np.uint8)), p  # bytes: -0.0 != 0.0
    assert np.array_equal(decode(enc).reshape(-1).numpy(), ref_decode(ref, spec, n))


@pytest.mark.parametrize("width", range(1, 17))
def test_bitstream_packing_matches_the_bit_by_bit_reference(width):
    gen = torch.Generator().manual_seed(width)
    for count in (0, 1, 7, 8, 9, 23, 64, 1001):
        values = torch.randint(0, 1 << width, (count,), generator=gen)
        packed = pack_bits(values, width)
        assert packed.dtype == torch.uint8 and packed.numel() == packed_bytes(count, width)
        assert np.array_equal(packed.numpy(), ref_bits(values.tolist(), width))
        for start, size in ((0, count), (count // 3, count // 2), (max(0, count - 5), min(5, count))):
            assert torch.equal(unpack_bits(packed, width, start, size), values[start : start + size])


def test_narrowed_selection_equals_the_whole_row_one():
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        chunk, k = (256, 1024, 4096)[trial % 3], (1, 5, 41, 64, 123)[trial % 5]
        x = torch.randn(40, chunk, generator=gen)
        if trial % 4 == 0:
            x = (x * 4).round()  # many ties, also across block boundaries
        if trial % 7 == 0:
            x[:5] = 0.0  # all-zero rows
        if trial % 5 == 1:
            x[5:9] = 1e-3 * torch.sign(x[5:9])  # Adam-like: every magnitude alike
        assert torch.equal(_select(x, k), _select_exact(x.abs(), k)), (chunk, k)


def _hard_rows(rows: int, chunk: int, seed: int) -> torch.Tensor:
    """Rows that stress the narrowed selection: ties (also across blocks), -0.0 beside +0.0, all-zero
    and all-(-0.0) rows, rows of one magnitude, one outlier per row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, chunk, generator=gen)
    x[0::5] = (x[0::5] * 3).round()  # few distinct magnitudes: ties everywhere
    x[1::5] = -0.0
    x[1::5, ::3] = 0.0  # -0.0 and +0.0 mixed (both magnitude 0)
    x[2::5] = 1e-3 * torch.sign(x[2::5])  # Adam-like: every magnitude alike
    x[3::5, chunk // 2] = 1e30  # one outlier
    x[4::5] = torch.where(torch.rand(x[4::5].shape, generator=gen) < 0.5, -0.0, x[4::5])
    x[-2], x[-1] = 0.0, -0.0  # an all-zero row and an all-(-0.0) row
    return x


@pytest.mark.parametrize("chunk", CHUNK_SIZES)
def test_selection_is_exact_for_every_chunk_size(chunk):
    rows = max(5, (1 << 15) // chunk)
    x = _hard_rows(rows, chunk, seed=chunk)
    ks = sorted({1, 2, max(1, chunk // 64), max(1, round(chunk * 0.03)), chunk // 4, chunk - 1, chunk})
    assert any(_narrowing(chunk, k) for k in ks)  # the narrowed path runs (the whole-row one for the largest k)
    for k in ks:
        got = _select(x, k)
        assert got.dtype == torch.int64 and got.shape == (rows, k)
        assert torch.equal(got, _select_exact(x.abs(), k)), (chunk, k)
        work = torch.full((x.numel() + 7,), -1, dtype=torch.int32)  # a kept buffer, larger than needed
        assert torch.equal(_select(x, k, work), got)


@pytest.mark.parametrize("chunk", [16, 4096, 65536])
def test_selection_refuses_nan_and_inf_anywhere(chunk):
    k = max(1, chunk // 64)
    for bad in (float("nan"), float("inf"), -float("inf"), -float("nan")):
        for where in ((0, 0), (2, chunk - 1), (1, chunk // 2 + 1)):
            x = _hard_rows(3, chunk, seed=1)
            x[where] = bad
            with pytest.raises(ValueError, match="NaN or inf"):
                _select(x, k)
    spec = EncodingSpec("ctopk", chunk=chunk, chunk_k=k, topk_values="int2")
    t = torch.randn(3 * chunk + 5)
    t[-1] = float("nan")  # in the last, shorter chunk
    with pytest.raises(ValueError, match="NaN or inf"):
        encode(t, spec)


@pytest.mark.parametrize(("chunk", "k", "values"), [(65536, 1000, "int4"), (16384, 256, "sign"), (8192, 131, "int8"),
                                                     (32768, 512, "int2")])
def test_large_chunks_match_the_reference(chunk, k, values):
    spec = EncodingSpec("ctopk", chunk=chunk, chunk_k=k, topk_values=values)
    n = 2 * chunk + 777  # two full chunks and a tail
    t = sample(n, seed=chunk)
    t[chunk : chunk + 50] = -0.0
    t[chunk + 100 : chunk + 100 + 3 * k] = 2e-3  # a tie across the boundary of the kept set
    enc = encode(t, spec)
    ref = ref_encode([F32(v) for v in t.tolist()], spec)
    for p, want in ref.items():
        assert np.array_equal(enc.parts[p].numpy().view(np.uint8), want.view(np.uint8)), p
    _, res = encode_with_residual(t, spec)
    assert torch.equal(res, t - decode(enc))


def test_selection_keeps_ties_by_lowest_offset_and_every_chunk_contributes():
    spec = EncodingSpec("ctopk", chunk=16, chunk_k=2, topk_values="int8")
    x = torch.zeros(48)
    x[3], x[5], x[9] = 2.0, -2.0, 2.0  # chunk 0: a three-way tie for 2 places
    x[20] = 1e-3  # chunk 1: one tiny value, the rest zeros (kept by lowest offset)
    x[40:] = -5.0  # chunk 2: all equal from offset 8
    enc = encode(x, spec)
    offsets = unpack_bits(enc.parts["idx"], 4, 0, 6).tolist()
    assert offsets == [3, 5, 0, 4, 8, 9]
    dec = decode(enc)
    assert dec[3] == 2.0 and dec[5] == -2.0 and dec[9] == 0.0 and dec[20] == F32(1e-3) and dec[16] == 0.0
    assert dec[40] == -5.0 and dec[41] == -5.0 and dec[42] == 0.0


# ----------------------------------------------------------------------------- values and error bounds


@pytest.mark.parametrize("values", ["int8", "int4", "int2"])
def test_levels_reproduce_both_ends_and_bound_the_error(values):
    bits = VALUE_BITS[values]
    spec = EncodingSpec("ctopk", chunk=256, chunk_k=32, topk_values=values)
    x = sample(256 * 40, seed=3)
    enc = encode(x, spec)
    dec, lo_step = decode(enc), enc.parts["scale"]
    for c in range(40):
        seg, out = x[c * 256 : (c + 1) * 256], dec[c * 256 : (c + 1) * 256]
        sent = out != 0
        if not sent.any():
            continue
        lo, step = lo_step[c].tolist()
        err = (seg[sent] - out[sent]).abs()
        assert (err <= step / 2 * (1 + 1e-5) + 1e-12).all()  # half a level, up to the roundings
        # both ends are levels: the smallest and the largest kept magnitude come back (to an ulp)
        top = seg.abs().max()
        assert abs(out.abs().max() - top) <= top * 2**-22
        assert abs(out.abs()[sent].min() - max(lo, float(seg.abs()[sent].min()))) <= top * 2**-22
        assert torch.equal(torch.sign(out[sent]), torch.sign(seg[sent]))
        assert step * ((1 << (bits - 1)) - 1) + lo <= top * (1 + 2**-22)


def test_sign_values_are_the_median_kept_magnitude_and_never_overshoot():
    spec = EncodingSpec("ctopk", chunk=64, chunk_k=8, topk_values="sign")
    x = sample(64 * 50, seed=5)
    enc, res = encode_with_residual(x, spec)
    dec = decode(enc)
    for c in range(50):
        seg = x[c * 64 : (c + 1) * 64]
        mags = seg.abs().sort(descending=True).values[:8]
        s = float(enc.parts["scale"][c])
        assert s == (float(mags[3]) if float(mags[3]) >= TINY else 0.0)  # the ceil(8/2) = 4th largest
        kept = (dec[c * 64 : (c + 1) * 64] != 0).sum()
        assert kept <= 8
    # the residual's energy never exceeds the input's (a contraction: error feedback stays bounded)
    assert res.square().sum() <= x.square().sum()


def test_zero_tiny_and_equal_chunks_decode_without_nan():
    spec = EncodingSpec("ctopk", chunk=16, chunk_k=4, topk_values="int2")
    x = torch.zeros(64)
    x[16:32] = 1e-35  # below 2^-100: stored as zeros
    x[32:48] = 0.25  # every kept magnitude equal: step 0, level 0, exact
    x[48] = -3.0  # one value and zeros: lo 0, the zeros stay 0
    enc, res = encode_with_residual(x, spec)
    dec = decode(enc)
    assert torch.isfinite(enc.parts["scale"]).all() and torch.isfinite(dec).all()
    assert dec[:32].abs().max() == 0 and dec[32:36].tolist() == [0.25] * 4 and dec[48] == -3.0
    assert dec[49:].abs().max() == 0 and torch.equal(res, x - dec)
    assert enc.parts["scale"][0].tolist() == [0.0, 0.0] and enc.parts["scale"][2].tolist() == [0.25, 0.0]


def test_error_feedback_delivers_the_dropped_values_over_rounds():
    spec = EncodingSpec("ctopk", chunk=256, chunk_k=4, topk_values="int2")  # 1.6 %
    gen = torch.Generator().manual_seed(2)
    target = torch.randn(256 * 8, generator=gen) * 1e-2
    residual, sent = torch.zeros_like(target), torch.zeros_like(target, dtype=torch.float64)
    peak = 0.0
    for _ in range(600):  # the same delta every round
        enc, residual = encode_with_residual(target + residual, spec)
        sent += decode(enc).double()
        peak = max(peak, residual.abs().max().item())
    # what was sent plus what is owed is everything (to FP32 rounding) ...
    torch.testing.assert_close(sent + residual.double(), 600 * target.double(), atol=1e-4, rtol=0)
    # ... and what is owed stays bounded (each entry goes out about every chunk / k rounds), so the
    # mean sent per round converges to the delta
    assert peak < 2 * (256 / 4) * target.abs().max().item()
    assert (sent / 600 - target.double()).abs().max() < peak / 600 + 1e-7


# ----------------------------------------------------------------------------- hostile parts


def _with(parts: dict, part: str, fn) -> dict:
    out = {p: x.clone() for p, x in parts.items()}
    out[part] = fn(out[part])
    return out


def _set(i, v):
    def fn(x):
        x[i] = v
        return x
    return fn


def _offsets(parts: dict, spec: EncodingSpec, kept: int, fn) -> dict:
    """Parts whose idx stream is re-packed after ``fn`` changed the offsets."""
    width = spec.chunk.bit_length() - 1
    off = unpack_bits(parts["idx"], width, 0, kept)
    return {**parts, "idx": pack_bits(fn(off.clone()), width)}


def test_malformed_parts_are_rejected_with_the_key_and_part():
    spec = EncodingSpec("ctopk", chunk=64, chunk_k=5, topk_values="int2")
    sign = EncodingSpec("ctopk", chunk=64, chunk_k=5, topk_values="sign")
    n = 64 * 3 + 10  # a tail of 10 keeping 1
    x = sample(n, seed=4)
    e, es = encode(x, spec), encode(x, sign)
    kept = 3 * 5 + 1
    swap = lambda o: o[[1, 0, *range(2, o.numel())]]  # noqa: E731
    cases = [
        (e, spec, (n,), {"q": e.parts["q"], "scale": e.parts["scale"]}, "has parts"),
        (e, spec, (n,), {**e.parts, "count": e.parts["q"]}, "has parts"),
        (e, spec, (n,), {**e.parts, "idx": e.parts["idx"].to(torch.int16)}, "part 'idx' is torch.int16"),
        (e, spec, (n,), {**e.parts, "q": e.parts["q"][:-1]}, "part 'q'"),
        (e, spec, (n,), {**e.parts, "scale": e.parts["scale"][:, 0].contiguous()}, "part 'scale'"),
        (e, spec, (n + 64,), e.parts, "part"),
        (e, spec, (n,), _with(e.parts, "scale", _set((1, 0), float("nan"))), "'scale'"),
        (e, spec, (n,), _with(e.parts, "scale", _set((1, 1), -1e-3)), "'scale'"),
        (e, spec, (n,), _with(e.parts, "scale", _set(1, 3e38)), "decodes to inf"),  # lo + step overflows
        (e, spec, (n,), _with(e.parts, "scale", _set((1, 0), float("inf"))), "'scale'"),
        (es, sign, (n,), _with(es.parts, "scale", _set(2, -1.0)), "'scale'"),
        (es, sign, (n,), _with(es.parts, "scale", _set(2, float("nan"))), "'scale'"),
        (e, spec, (n,), _offsets(e.parts, spec, kept, swap), "strictly increasing"),
        (e, spec, (n,), _offsets(e.parts, spec, kept, lambda o: _set(6, int(o[5]))(o)), "strictly increasing"),  # a duplicate
        (e, spec, (n,), _offsets(e.parts, spec, kept, _set(kept - 1, 10)), "last chunk"),  # beyond the 10-value tail
    ]
    for _enc, s, shape, parts, message in cases:
        with pytest.raises(EncodingError, match=message) as info:
            EncodedTensor.from_parts(parts, shape, s, key="layers.3.w")
        assert str(info.value).startswith("layers.3.w: ")
    # padding bits: 17 kept values of 2 bits leave 6 bits of the last q byte, 17 of 6 bits 2 of idx's
    odd = EncodingSpec("ctopk", chunk=64, chunk_k=17, topk_values="int2")
    eo = encode(sample(64, seed=1), odd)
    for part in ("q", "idx"):
        bad = _with(eo.parts, part, lambda t: t.index_fill_(0, torch.tensor([t.numel() - 1]), int(t[-1]) | 0x80))
        with pytest.raises(EncodingError, match=f"part '{part}' has non-zero padding"):
            EncodedTensor.from_parts(bad, (64,), odd, key="w")
    want = expected_parts((n,), spec)
    with pytest.raises(EncodingError, match="expected"):
        check_layout({p: ("I16", s) for p, (_, s) in want.items()}, (n,), spec)
    validate_parts(e.parts, (n,), spec)  # the honest parts pass
