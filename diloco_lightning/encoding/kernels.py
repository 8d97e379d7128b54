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

from diloco_lightning.encoding.format import CHUNK, LEVELS, PAGE_SIZE, TINY, EncodingSpec, codes_layout, topk_count

__all__ = ["dequantize", "encode_topk", "quantize"]


# ----------------------------------------------------------------------------- quantization


def quantize(flat: Tensor, name: str, block: int, res: Tensor | None) -> tuple[Tensor, Tensor]:
    """Blockwise absmax codes and scales of a 1-D tensor (any float dtype); residual into ``res``.

    Works in chunks of CHUNK values so that the FP32 work buffer stays in cache: per chunk one
    max/min pass, one division, one rounding, one store of the codes (and for the residual one
    multiply and one subtraction). The last block of the tensor may be shorter than ``block``.
    """
    n, levels, dev = flat.numel(), LEVELS[name], flat.device
    scale = torch.empty(-(-n // block), dtype=torch.float32, device=dev)
    dtype, shape = codes_layout(n, name)
    codes = torch.empty(shape, dtype=dtype, device=dev)
    work = torch.empty(min(n, CHUNK), dtype=torch.float32, device=dev)
    xbuf = None if flat.dtype == torch.float32 else torch.empty_like(work)
    pack = torch.empty(min(n, CHUNK) // 2 + 1, dtype=torch.float32, device=dev) if name == "int4" else None
    # a tensor divisor, never a Python number: CUDA divides by a scalar as a * (1/b), which can
    # differ from a / b in the last bit
    divisor = torch.full((min(n, CHUNK) // block + 1,), float(levels), device=dev)
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
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
                assert pack is not None  # allocated for int4
                p = torch.add(pairs[:, 0], pairs[:, 1], alpha=16, out=pack[: pairs.shape[0]]).add_(136)
                c0 = (start + lo) // 2
                codes[c0 : c0 + p.numel()].copy_(p)
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


def _kth_largest(a: Tensor, k: int) -> Tensor:
    """The k-th largest of finite ``a >= 0`` by a two-level radix select: no sort at all.

    Non-negative floats order like their bit patterns. A histogram of the high 16 bits finds the
    bin holding the k-th largest, a histogram of the low 16 bits of that bin's entries finds the
    value itself: two counting passes, 2-5x faster than ``kthvalue`` on CPU, also when all
    magnitudes are alike (an Adam update). The result is a value, the same on every device.
    """
    bits = a.view(torch.int32)
    hi = bits >> 16
    b, k, size = _radix_bin(hi, 1 << 15, k)
    if size * 8 < bits.numel():  # a small bin: gather its entries
        lo, k, _ = _radix_bin(bits[hi == b] & 0xFFFF, 1 << 16, k)
    else:  # a big one: count the other bins' entries in an extra bin below all (no gather)
        lo, k, _ = _radix_bin(torch.where(hi == b, (bits & 0xFFFF) + 1, 0), (1 << 16) + 1, k)
        lo -= 1
    return torch.tensor([(b << 16) | lo], dtype=torch.int32, device=a.device).view(torch.float32)[0]


def _radix_bin(keys: Tensor, bins: int, k: int) -> tuple[int, int, int]:
    """The bin holding the k-th largest of ``keys`` (ints in [0, bins)), the rank within it, its size."""
    from_top = torch.bincount(keys, minlength=bins).flip(0).cumsum(0)  # entries in the j+1 highest bins
    j = int(torch.searchsorted(from_top, k))
    below = int(from_top[j - 1]) if j else 0
    return bins - 1 - j, k - below, int(from_top[j]) - below


def encode_topk(flat: Tensor, spec: EncodingSpec, res: Tensor | None) -> dict[str, Tensor]:
    """Keep the k largest magnitudes: all above the k-th largest, then ties to it by lowest position.

    The threshold (a value) and both masks are the same on every device, unlike the order in which
    ``torch.topk`` returns tied entries.
    """
    x = flat.to(torch.float32)
    n, k, dev = x.numel(), topk_count(flat.numel(), spec.topk), x.device
    a = x.abs()
    if n and not bool(torch.isfinite(a.amax())):
        raise ValueError("cannot encode a tensor with NaN or inf values")
    if k == 0:
        idx = torch.zeros(0, dtype=torch.int64, device=dev)
    else:
        v = _kth_largest(a, k)
        idx = (a >= v).nonzero().squeeze(1)  # increasing positions; more than k only on ties with v
        extra = idx.numel() - k
        if extra:  # drop the ties at the highest positions
            keep = torch.ones_like(idx, dtype=torch.bool)
            keep[(a[idx] == v).nonzero().squeeze(1)[-extra:]] = False
            idx = idx[keep]
    del a
    vals = x[idx]
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
        res.copy_(x)[idx] = res_vals
    return {"q": q, "scale": scale, "idx": low, "count": count}
