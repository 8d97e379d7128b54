"""The kernels of the quantized encodings: blockwise int8/int4 codes and the top-k selection.

Every kernel uses only IEEE-exact element-wise ops (division, multiplication, round half to even),
max/min reductions (exact whatever their order) and, for top-k, a selection rule that does not
depend on how the device sorts: the same tensor gives the same bits on CPU and CUDA, contiguous
or not. They work in chunks of :data:`~diloco_lightning.encoding.format.CHUNK` values, so their
work buffers stay in cache. What they write is laid out in :mod:`diloco_lightning.encoding.format`
(``docs/encoding.md``); :mod:`diloco_lightning.encoding` calls them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from diloco_lightning.encoding.base import SpecFields
from diloco_lightning.encoding.limits import CHUNK, LEVELS, PAGE_SIZE, TINY

__all__ = ["codes_layout", "dequantize", "encode_topk", "quantize", "topk_count", "topk_positions"]


# ----------------------------------------------------------------------------- layout


def codes_layout(n: int, bits_name: str) -> tuple[torch.dtype, tuple[int]]:
    return (torch.int8, (n,)) if bits_name == "int8" else (torch.uint8, ((n + 1) // 2,))


def topk_count(numel: int, fraction: float) -> int:
    """Entries kept by top-k: ``round(fraction * numel)`` (IEEE double, ties to even), 1 to numel."""
    return 0 if numel == 0 else min(numel, max(1, round(fraction * numel)))


def topk_positions(idx: Tensor, ends: Tensor, j0: int, j1: int) -> Tensor:
    """Absolute positions of kept values j0..j1: page (from the counts' running sum) * 65536 + offset."""
    page = torch.searchsorted(ends, torch.arange(j0, j1, device=idx.device), right=True)
    return page.mul_(PAGE_SIZE).add_(idx[j0:j1].to(torch.int64) & 0xFFFF)  # int16 bits read as unsigned


# ----------------------------------------------------------------------------- quantization


def quantize(flat: Tensor, name: str, block: int, res: Tensor | None,
             add: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Blockwise absmax codes and scales of a 1-D tensor (any float dtype); residual into ``res``.

    Works in chunks of CHUNK values so that the FP32 work buffer stays in cache: per chunk one
    max/min pass, one division, one rounding, one store of the codes (and for the residual one
    multiply and one subtraction). The last block of the tensor may be shorter than ``block``.
    ``add`` (FP32 ``flat`` only): ``flat += add`` first, chunk by chunk in the same pass (the
    worker's error-feedback residual, which ``res`` may then overwrite: each chunk is read first).
    """
    n, levels, dev = flat.numel(), LEVELS[name], flat.device
    scale = torch.empty(-(-n // block), dtype=torch.float32, device=dev)
    dtype, shape = codes_layout(n, name)
    codes = torch.empty(shape, dtype=dtype, device=dev)
    work = torch.empty(min(n, CHUNK), dtype=torch.float32, device=dev)
    xbuf = None if flat.dtype == torch.float32 else torch.empty_like(work)
    pack = torch.empty(min(n, CHUNK) // 2 + 1, dtype=torch.float32, device=dev) if name == "int4" else None
    # int4's bytes are exact integers 0..255: FP32 -> int16 -> uint8 is 3x faster on CPU than one
    # FP32 -> uint8 conversion (not vectorized; FP32 -> int8 is), with the same bits
    narrow = torch.empty(min(n, CHUNK) // 2 + 1, dtype=torch.int16, device=dev) if name == "int4" else None
    # a tensor divisor, never a Python number: CUDA divides by a scalar as a * (1/b), which can
    # differ from a / b in the last bit
    divisor = torch.full((min(n, CHUNK) // block + 1,), float(levels), device=dev)
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        if add is not None:
            flat[start:stop].add_(add[start:stop])
        x = flat[start:stop] if xbuf is None else xbuf[: stop - start].copy_(flat[start:stop])
        full = (stop - start) // block * block  # only the tensor's last chunk can end in a short block
        for lo, hi in ((0, full), (full, stop - start)):
            if hi == lo:
                continue
            width = block if hi - lo >= block else hi - lo
            xb, w = x[lo:hi].view(-1, width), work[lo:hi].view(-1, width)
            b0 = (start + lo) // block
            s = scale[b0 : b0 + xb.shape[0]]
            amax = torch.maximum(xb.amax(1), xb.amin(1).neg_())  # two plain reductions beat abs().amax()
            torch.div(amax, divisor[: amax.numel()], out=s)
            tiny = amax < TINY  # NaN is not < TINY: it stays in the scale and is caught below
            s.masked_fill_(tiny, 0.0)
            # |x / s| <= amax / fl(amax / levels) = levels * (1 + 2^-23): rounds to <= levels, no clamp
            torch.div(xb, s.masked_fill(tiny, 1.0).unsqueeze(1), out=w).round_()  # round half to even
            seg = w.view(-1)
            if name == "int8":
                codes[start + lo : start + hi].copy_(seg)
            else:  # byte = (c0 + 8) | (c1 + 8) << 4, computed exactly in FP32 then stored as uint8
                if seg.numel() % 2:  # odd tail of the tensor: pad with code 0
                    seg = torch.cat([seg, seg.new_zeros(1)])
                pairs = seg.view(-1, 2)
                assert pack is not None and narrow is not None  # allocated for int4
                p = torch.add(pairs[:, 0], pairs[:, 1], alpha=16, out=pack[: pairs.shape[0]]).add_(136)
                c0 = (start + lo) // 2
                codes[c0 : c0 + p.numel()].copy_(narrow[: p.numel()].copy_(p))
            if res is not None:  # x - fl(q * s): exactly what decode gives back
                torch.sub(xb, w.mul_(s.unsqueeze(1)), out=res[start + lo : start + hi].view(-1, width))
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("cannot encode a tensor with NaN or inf values")
    return codes, scale


def dequantize(codes: Tensor, scale: Tensor, name: str, block: int, start: int, w: Tensor) -> Tensor:
    """Decode values ``start .. start + len(w)`` into ``w`` (FP32, 1-D); ``start`` is a multiple of CHUNK."""
    m = w.numel()
    if name == "int8":
        w.copy_(codes[start : start + m])
    else:  # low nibble first: value 2i in bits 0-3 of byte i, value 2i+1 in bits 4-7
        pb = codes[start // 2 : start // 2 + (m + 1) // 2]
        even = m - m % 2
        wp = w[:even].view(-1, 2)
        wp[:, 0].copy_(pb[: even // 2] & 15)
        wp[:, 1].copy_(pb[: even // 2] >> 4)
        if m % 2:
            w[even:].copy_(pb[-1:] & 15)
        w.sub_(8)
    full = m // block * block
    s = scale[start // block : -(-(start + m) // block)]
    w[:full].view(-1, block).mul_(s[: full // block].unsqueeze(1))
    if full < m:
        w[full:].mul_(s[-1])
    return w


# ----------------------------------------------------------------------------- top-k


def _radix_bin(hist: Tensor, k: int) -> tuple[int, int, int]:
    """The bin of a histogram (ints in [0, bins)) that holds the k-th largest, the rank within it, its size."""
    from_top = hist.flip(0).cumsum(0)  # entries in the j+1 highest bins
    j = int(torch.searchsorted(from_top, k))
    below = int(from_top[j - 1]) if j else 0
    return hist.numel() - 1 - j, k - below, int(from_top[j]) - below


class _Magnitudes:
    """``|x|`` of a 1-D tensor as int32 keys (non-negative floats order like their bit patterns),
    CHUNK values at a time in reused buffers: every pass of :func:`encode_topk` stays in cache and
    allocates nothing of the tensor's size."""

    def __init__(self, flat: Tensor) -> None:
        self.flat, self.n = flat, flat.numel()
        m = min(self.n, CHUNK)
        self.abs = torch.empty(m, dtype=torch.float32, device=flat.device)
        self.work = torch.empty(m, dtype=torch.int32, device=flat.device)
        self.x = None if flat.dtype == torch.float32 else torch.empty(m, dtype=torch.float32, device=flat.device)

    def __iter__(self):
        for start in range(0, self.n, CHUNK):
            stop = min(start + CHUNK, self.n)
            x = self.flat[start:stop] if self.x is None else self.x[: stop - start].copy_(self.flat[start:stop])
            yield start, torch.abs(x, out=self.abs[: stop - start]).view(torch.int32), self.work[: stop - start]


#: one run of SAMPLE_RUN consecutive magnitudes in SAMPLE_STRIDE runs is read to guess top-k's
#: threshold (:func:`_kth_from_sample`): whole runs, since a strided read touches every cache line
SAMPLE_STRIDE, SAMPLE_RUN = 32, 1024


def _kth_from_sample(mags: _Magnitudes, k: int) -> tuple[int, Tensor] | None:
    """The k-th largest magnitude (its int32 key) and the positions whose key is at least it
    (increasing, int64), in one pass over the tensor; None when the guess below fails (the caller
    then takes the exact two-level radix select, :func:`_kth_largest`).

    Guess a threshold ``T``: a rank in a sample (one run of :data:`SAMPLE_RUN` entries in
    :data:`SAMPLE_STRIDE`) a few standard deviations beyond ``k / SAMPLE_STRIDE``, so that about
    ``k`` and a few percent of the entries are at least ``T``. Then one pass collects every entry
    whose key is at least ``T``. If there are at least ``k`` of them, the k-th largest of the whole
    tensor is at least ``T`` (k entries are), so every entry at or above it was collected, and the
    k-th largest of the collected keys is the answer, exactly, whatever the sample was. Fewer than
    ``k`` (an unlucky or structured sample), or more than ``2k + CHUNK`` (bounded memory: magnitudes
    alike), and the guess is abandoned. A NaN or an infinity anywhere is refused by the pass, or by
    the radix select when the guess was abandoned first.
    """
    runs = mags.n // SAMPLE_RUN
    sample = mags.flat[: runs * SAMPLE_RUN].view(runs, SAMPLE_RUN)[::SAMPLE_STRIDE].reshape(-1)
    want = k // SAMPLE_STRIDE
    want += 4 * int(want**0.5) + 16  # 4 standard deviations of a sampled rank, and a floor
    if want >= sample.numel() // 2:  # a dense top-k: the radix select is as cheap
        return None
    skeys = sample.to(torch.float32).abs().view(torch.int32)
    t = int(torch.kthvalue(skeys, skeys.numel() - want + 1).values)  # the want-th largest of the sample
    cap = 2 * k + CHUNK
    found: list[tuple[Tensor, Tensor]] = []
    total = 0
    for start, keys, _ in mags:
        if not bool(torch.isfinite(keys.view(torch.float32).amax())):  # amax propagates NaN
            raise ValueError("cannot encode a tensor with NaN or inf values")
        pos = torch.nonzero(keys >= t).squeeze(1)
        total += pos.numel()
        if total > cap:
            return None
        found.append((pos + start, keys[pos]))
    if total < k:
        return None
    pos, keys = torch.cat([p for p, _ in found]), torch.cat([q for _, q in found])
    v = int(torch.kthvalue(keys, total - k + 1).values)  # the k-th largest of the collected, exact on integers
    return v, pos[keys >= v]


def _kth_largest(mags: _Magnitudes, k: int) -> tuple[int, Tensor | None]:
    """The k-th largest magnitude (its int32 key) by a two-level radix select, no sort at all: a
    histogram of the high 16 bits finds the bin holding it, one of the low 16 bits of that bin's
    entries the value itself. The result is a value, the same on every device. Also the positions
    whose key is at least the bin's lowest (increasing, int64) when that bin is small (then the
    caller needs no third pass), else None."""
    hist = torch.zeros(1 << 15, dtype=torch.int64, device=mags.flat.device)
    for _, keys, work in mags:
        if not bool(torch.isfinite(keys.view(torch.float32).amax())):  # amax propagates NaN
            raise ValueError("cannot encode a tensor with NaN or inf values")
        hist += torch.bincount(torch.bitwise_right_shift(keys, 16, out=work), minlength=1 << 15)
    b, rank, size = _radix_bin(hist, k)
    if size * 8 >= mags.n:  # a big bin (magnitudes alike): count its low bits, gather nothing
        low = torch.zeros(1 << 16, dtype=torch.int64, device=hist.device)
        for _, keys, work in mags:
            low += torch.bincount(keys[torch.bitwise_right_shift(keys, 16, out=work) == b] & 0xFFFF, minlength=1 << 16)
        return (b << 16) | _radix_bin(low, rank)[0], None
    found = []  # the candidates: the bin and every one above it (about k + size of them), in position order
    for start, keys, _ in mags:
        pos = torch.nonzero(keys >= b << 16).squeeze(1)
        found.append((pos.add_(start), keys[pos - start]))
    pos, keys = torch.cat([p for p, _ in found]), torch.cat([q for _, q in found])
    inbin = keys[(keys >> 16) == b] & 0xFFFF
    v = (b << 16) | _radix_bin(torch.bincount(inbin, minlength=1 << 16), rank)[0]
    return v, pos[keys >= v]


def encode_topk(flat: Tensor, spec: SpecFields, res: Tensor | None) -> dict[str, Tensor]:
    """Keep the k largest magnitudes: all above the k-th largest, then ties to it by lowest position.

    The threshold (a value) and both masks are the same on every device, unlike the order in which
    ``torch.topk`` returns tied entries. Usually one pass over the tensor, CHUNK values at a time
    (:class:`_Magnitudes`), collecting the entries above a threshold guessed from a sample
    (:func:`_kth_from_sample`); when the guess fails, two or three: a histogram, the threshold
    (collecting the candidates when they are few), the selection (:func:`_kth_largest`).
    """
    n, k, dev = flat.numel(), topk_count(flat.numel(), spec.topk), flat.device
    mags = _Magnitudes(flat)
    if k == 0:
        idx = torch.zeros(0, dtype=torch.int64, device=dev)
    else:
        guess = _kth_from_sample(mags, k)
        v, found = guess if guess is not None else _kth_largest(mags, k)
        # a big threshold bin: the positions at or above the threshold, one more pass
        idx = found if found is not None else torch.cat(
            [torch.nonzero(keys >= v).squeeze(1).add_(start) for start, keys, _ in mags])
        extra = idx.numel() - k  # increasing positions; more than k only on ties with v
        if extra:  # drop the ties at the highest positions
            tied = flat[idx].to(torch.float32).abs().view(torch.int32) == v
            keep = torch.ones_like(idx, dtype=torch.bool)
            keep[tied.nonzero().squeeze(1)[-extra:]] = False
            idx = idx[keep]
    x = flat if flat.dtype == torch.float32 else None
    vals = flat[idx].to(torch.float32)
    res_vals = None if res is None else torch.empty_like(vals)
    q, scale = quantize(vals, spec.topk_values, spec.block_size, res_vals)
    pages = -(-n // PAGE_SIZE)
    bounds = torch.arange(1, pages + 1, device=dev, dtype=torch.int64) * PAGE_SIZE
    ends = torch.searchsorted(idx, bounds)  # kept positions below each page's end
    count = torch.diff(ends, prepend=ends.new_zeros(1)).to(torch.int32)
    low = (idx & 0xFFFF).to(torch.int32)
    low = torch.where(low >= 1 << 15, low - (1 << 16), low).to(torch.int16)  # same 16 bits, as int16
    if res is not None:  # vals were gathered above: res may be the input tensor itself
        assert res_vals is not None  # set whenever res is
        if x is None or res.data_ptr() != x.data_ptr():
            res.copy_(flat)  # a 16-bit input widens exactly
        res[idx] = res_vals
    return {"q": q, "scale": scale, "idx": low, "count": count}
