"""The chunked top-k encoding (``ctopk``): the k largest magnitudes of every chunk, in a few bits each.

SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706) sends, per chunk of ``C`` consecutive values, the
``k`` largest magnitudes of the error-feedback-accumulated pseudo-gradient, quantized to 2 bits.
Every chunk contributes, so a position costs ``log2(C)`` bits (no page counts), and the number of
values per chunk is fixed, so nothing but the codes, the positions and one scale pair per chunk
travels. The byte layout and the rounding rules are in ``docs/encoding.md`` ("Chunked top-k").

Per chunk (the flattened tensor cut into chunks of ``C``; the last one, of ``L < C`` values, keeps
``ceil(k * L / C)``, at least 1):

- **selection**: every magnitude above the k-th largest, then those equal to it by lowest position
  (the same set on every device), stored as offsets in the chunk, increasing, ``log2(C)`` bits each;
- **values**, ``b`` bits each (:data:`VALUE_BITS`): ``b >= 2``: a sign bit and a level ``j`` of
  ``M = 2**(b-1)`` levels between the chunk's smallest and largest kept magnitude, decoded as
  ``lo + j * step`` with ``step = (hi - lo) / (M - 1)``: both ends are levels (to the rounding of
  ``step``), so a chunk's largest value (an outlier) survives and a kept zero decodes to zero. ``b = 1`` (``sign``):
  the sign alone, times the chunk's median kept magnitude (the ``ceil(k/2)``-th largest), which
  never overshoots: ``|x - s * sign(x)|^2`` sums to less than ``|x|^2`` whenever ``s <= 2 mean|x|``.

Only IEEE-exact operations (selection by value, min/max, one division, round half to even, one
multiply and one add): the same bits on CPU and CUDA, as for the other encodings. The kernels work
on :data:`~diloco_lightning.encoding.format.CHUNK` values at a time; decoding yields positions and
values per group of chunks (:func:`decoded_groups`), never a full-size tensor.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

from diloco_lightning.encoding.bits import pack_bits, packed_bytes, unpack_bits
from diloco_lightning.encoding.limits import CHUNK_SIZES, VALUE_BITS

__all__ = ["CHUNK_SIZES", "VALUE_BITS", "ChunkLayout", "chunk_layout", "decoded_groups", "encode_ctopk",
           "validate_ctopk"]



class ChunkLayout:
    """How ``n`` values cut into chunks of ``C`` keeping ``k`` each (the last, shorter chunk fewer).

    ``full`` chunks of ``C`` values, then a ``tail`` of ``n - full * C`` values keeping ``k_tail``;
    ``kept`` values in all; chunk ``c``'s values are ``c * k .. c * k + k - 1`` of the streams.
    """

    __slots__ = ("n", "chunk", "k", "full", "tail", "k_tail", "kept", "chunks", "pos_bits", "value_bits")

    def __init__(self, n: int, chunk: int, k: int, value_bits: int) -> None:
        self.n, self.chunk, self.k, self.value_bits = n, chunk, k, value_bits
        self.full, self.tail = divmod(n, chunk)
        self.k_tail = max(1, -(-k * self.tail // chunk)) if self.tail else 0  # integer ceil, <= tail
        self.kept = self.full * k + self.k_tail
        self.chunks = self.full + (1 if self.tail else 0)
        self.pos_bits = chunk.bit_length() - 1

    @property
    def scales_per_chunk(self) -> int:
        return 1 if self.value_bits == 1 else 2

    def parts(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """``{part: (dtype, shape)}``: ``q`` and ``idx`` uint8 bitstreams, ``scale`` FP32 per chunk."""
        scale_shape = (self.chunks,) if self.value_bits == 1 else (self.chunks, 2)
        return {
            "q": (torch.uint8, (packed_bytes(self.kept, self.value_bits),)),
            "scale": (torch.float32, scale_shape),
            "idx": (torch.uint8, (packed_bytes(self.kept, self.pos_bits),)),
        }


def chunk_layout(n: int, chunk: int, k: int, values: str) -> ChunkLayout:
    return ChunkLayout(n, chunk, k, VALUE_BITS[values])


def _groups(lay: ChunkLayout, chunk_values: int) -> Iterator[tuple[int, int]]:
    """Chunk index ranges ``[c0, c1)`` of about ``chunk_values`` values each (whole chunks)."""
    per = max(1, chunk_values // lay.chunk)
    for c0 in range(0, lay.chunks, per):
        yield c0, min(c0 + per, lay.chunks)


# ----------------------------------------------------------------------------- encode


def _narrowing(length: int, k: int) -> int:
    """Blocks per row for :func:`_select` (0: select on whole rows): ``S > k``, about
    ``sqrt(k * length)`` so that both of its top-ks are alike, a power of two dividing ``length``."""
    blocks = 1 << max(0, ((k * length).bit_length() - 1) // 2)
    while blocks <= k:
        blocks <<= 1
    if blocks >= length or length % blocks or 4 * k * (length // blocks) > 3 * length:  # too little to narrow
        return 0
    return blocks


def _top_unique(keys: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The columns of each row's k largest ``keys`` (int32, in no order), whether that set is unique
    (the (k+1)-th largest is strictly below the k-th: no tie at the boundary), and the k-th largest."""
    mv, mi = torch.topk(keys, k + 1, dim=1, sorted=False)
    low, drop = mv.min(1, keepdim=True)  # the (k+1)-th largest, and where
    # the k others: the last column moved into the dropped one's place (a no-op when it is the dropped one)
    cols = mi.scatter(1, drop, mi[:, k:])[:, :k]
    kth = mv.scatter(1, drop, mv[:, k:])[:, :k].amin(1, keepdim=True)
    return cols, kth > low, kth


#: the sign bit of an FP32 value's int32 pattern cleared: the pattern of its magnitude
_MAGNITUDE = 0x7FFFFFFF
#: the int32 pattern of +inf: a magnitude's pattern at or above it is an infinity or a NaN
_INF_BITS = 0x7F800000


def _select(x: Tensor, k: int, work: Tensor | None = None) -> Tensor:
    """Rows of FP32 values ``x`` -> the offsets of each row's k largest magnitudes, increasing: every
    magnitude above the k-th largest, then those equal to it by lowest offset.

    Cut each row into ``S > k`` blocks of ``w = length / S`` consecutive entries. If the k-th
    largest block maximum is strictly above the (k+1)-th, every entry outside the k blocks with
    the largest maxima is at most its block's maximum, so it has k entries (those maxima) strictly
    above it: the row's top k lie in those k blocks. If, among their ``k * w`` entries (in any
    order), the k-th largest is again strictly above the (k+1)-th, those k are the row's top k
    whatever the tie rule. A row where either test fails (a tie) is selected whole by
    :func:`_select_exact`. About 4x less work than a top-k of whole rows at 1-3 % density.

    Magnitudes are compared as int32 bit patterns, the sign bit cleared (non-negative floats order
    like their patterns, NaN above inf, and -0.0 is 0), which ``torch.topk`` ranks about 1.6x faster
    than floats; the patterns are written once into ``work`` (int32, at least ``x.numel()``
    entries; None: a new buffer), so the blocks are gathered as whole rows of ``w`` entries.
    Raises ``ValueError`` on a NaN or an infinity (it shows in the block maxima).
    """
    rows, length = x.shape
    blocks = _narrowing(length, k)
    if not blocks:
        a = x.abs()
        if not bool(torch.isfinite(a.amax())):
            raise ValueError("cannot encode a tensor with NaN or inf values")
        return _select_exact(a, k)
    width = length // blocks
    if work is None:
        work = torch.empty(x.numel(), dtype=torch.int32, device=x.device)
    keys = torch.bitwise_and(x.view(torch.int32), _MAGNITUDE, out=work[: x.numel()].view(rows, length))
    bmax = keys.view(rows, blocks, width).amax(2)
    if int(bmax.max()) >= _INF_BITS:
        raise ValueError("cannot encode a tensor with NaN or inf values")
    mi, ok, _ = _top_unique(bmax, k)
    first = torch.arange(0, rows * blocks, blocks, device=x.device).unsqueeze(1)  # row r's block 0
    sub = keys.view(rows * blocks, width).index_select(0, mi.add(first).view(-1)).view(rows, k * width)
    cols, ok2, _ = _top_unique(sub, k)
    idx = mi.gather(1, cols.div(width, rounding_mode="floor")).mul_(width).add_(cols.remainder(width))
    bad = (~(ok & ok2).squeeze(1)).nonzero().squeeze(1)
    if bad.numel():
        idx[bad] = _select_exact(x[bad].abs(), k)
    return idx.sort(dim=1).values


def _select_exact(a: Tensor, k: int) -> Tensor:
    """Rows of magnitudes ``a`` -> offsets of the kept entries, increasing (the rule of :func:`_select`)."""
    length = a.shape[1]
    kk = min(k + 1, length)
    keys = a.view(torch.int32)
    v, i = torch.topk(keys, kk, dim=1)  # one more than kept: a tie across the boundary shows
    idx = i[:, :k]
    if kk > k:
        tied = (v[:, k] == v[:, k - 1]).nonzero().squeeze(1)
        if tied.numel():
            sub = keys[tied]
            t = v[tied, k - 1 : k]
            gt, eq = sub > t, sub == t
            need = k - gt.sum(1, keepdim=True)
            keep = gt | (eq & (eq.cumsum(1) <= need))
            idx[tied] = keep.nonzero()[:, 1].view(-1, k)  # row-major: each row's offsets increasing
    return idx.sort(dim=1).values


def _quantize(xs: Tensor, bits: int, tiny: float) -> tuple[Tensor, Tensor, Tensor]:
    """Codes (int64), scales and decoded values of the kept values ``xs`` (rows). See the module
    docstring."""
    mags = xs.abs()
    neg = xs < 0  # -0.0 is not negative: it decodes to +0.0 or +lo
    if bits == 1:
        s = mags.kthvalue(mags.shape[1] - (mags.shape[1] - 1) // 2, dim=1).values  # the ceil(k/2)-th largest
        s.masked_fill_(s < tiny, 0.0)
        sb = s.unsqueeze(1).expand_as(xs)
        return neg.to(torch.int64), s, torch.where(neg, -sb, sb)
    levels = 1 << (bits - 1)
    lo, hi = mags.amin(1), mags.amax(1)
    lo.masked_fill_(lo < tiny, 0.0)  # every non-zero scale is a normal float (as the block scales)
    # a tensor divisor: CUDA divides by a Python number as a * (1/b), one bit off sometimes
    step = torch.div(hi - lo, torch.full_like(lo, float(levels - 1)))
    step.masked_fill_(step < tiny, 0.0)
    lo1, step1 = lo.unsqueeze(1), step.unsqueeze(1)
    # |x| - lo over step, rounded half to even; a chunk whose step is 0 has every level 0
    j = mags.sub_(lo1).div_(step.masked_fill(step == 0, 1.0).unsqueeze(1)).round_()
    j.clamp_(0, levels - 1).mul_(step1 != 0)
    mag = j.mul(step1).add_(lo1)
    codes = j.to(torch.int64).add_(neg.to(torch.int64), alpha=levels)  # the sign is the top bit
    return codes, torch.stack([lo, step], 1), torch.where(neg, mag.neg(), mag)


#: values per work group of the encoder: 16 MiB of FP32. Larger than a core's L2 on purpose: at
#: 1-3 % density most of a group's steps work on a few hundred thousand entries, whose fixed cost
#: per call (tens of microseconds each) a larger group amortizes; measured fastest of 1, 4 and 16
#: MiB on the 25M delta (docs/performance.md)
GROUP_VALUES = 1 << 22


def encode_ctopk(flat: Tensor, chunk: int, k: int, values: str, res: Tensor | None, *, tiny: float) -> dict[str, Tensor]:
    """Encode a 1-D tensor (any float dtype); the residual ``x - decode`` into ``res`` (which may be
    ``flat`` itself)."""
    lay = chunk_layout(flat.numel(), chunk, k, values)
    dev = flat.device
    codes = torch.empty(lay.kept, dtype=torch.uint8, device=dev)
    offsets = torch.empty(lay.kept, dtype=torch.int32, device=dev)
    scale = torch.empty(lay.parts()["scale"][1], dtype=torch.float32, device=dev)
    per = max(1, GROUP_VALUES // chunk)
    xbuf = None if flat.dtype == torch.float32 else torch.empty(min(lay.n, per * chunk), dtype=torch.float32, device=dev)
    work = torch.empty(min(lay.n, per * chunk), dtype=torch.int32, device=dev)  # the selection's magnitude patterns
    groups = [(c0, min(c0 + per, lay.full), k, chunk) for c0 in range(0, lay.full, per)]
    if lay.tail:
        groups.append((lay.full, lay.full + 1, lay.k_tail, lay.tail))
    for r0, r1, kc, width in groups:
        lo, hi = r0 * chunk, r0 * chunk + (r1 - r0) * width
        x = flat[lo:hi] if xbuf is None else xbuf[: hi - lo].copy_(flat[lo:hi])
        xr = x.view(r1 - r0, width)
        idx = _select(xr, kc, work)
        xs = xr.gather(1, idx)
        c, sc, dec = _quantize(xs, lay.value_bits, tiny)
        i0 = r0 * k
        codes[i0 : i0 + idx.numel()] = c.view(-1)
        offsets[i0 : i0 + idx.numel()] = idx.view(-1)
        scale[r0:r1] = sc
        if res is not None:  # xs was gathered above: res may be flat itself
            rr = res[lo:hi]
            if rr.data_ptr() != xr.data_ptr():
                rr.copy_(x)
            rr.view(r1 - r0, width).scatter_(1, idx, xs.sub_(dec))
    return {"q": pack_bits(codes, lay.value_bits), "scale": scale, "idx": pack_bits(offsets, lay.pos_bits)}


# ----------------------------------------------------------------------------- decode


def decoded_groups(parts: Mapping[str, Tensor], lay: ChunkLayout, kept_values: int) -> Iterator[tuple[Tensor, Tensor]]:
    """``(positions int64, values FP32)`` of the kept entries, about ``kept_values`` of them (whole
    chunks) at a time, positions increasing."""
    q, scale, idx = parts["q"], parts["scale"], parts["idx"]
    bits, k = lay.value_bits, lay.k
    per = max(1, kept_values // k)
    for c0 in range(0, lay.chunks, per):
        c1 = min(c0 + per, lay.chunks)
        # the full chunks as rows of k (a chunk's scales broadcast along its row), then the tail's
        for r0, r1, kc in ((c0, min(c1, lay.full), k), (lay.full, c1, lay.k_tail)):
            if r1 <= r0:
                continue
            i0 = r0 * k
            rows = r1 - r0
            pos = unpack_bits(idx, lay.pos_bits, i0, rows * kc).view(rows, kc)
            pos.add_(torch.arange(r0 * lay.chunk, r1 * lay.chunk, lay.chunk, device=idx.device).unsqueeze(1))
            code = unpack_bits(q, bits, i0, rows * kc).view(rows, kc)
            if bits == 1:
                neg = code.bool()
                mag = scale[r0:r1].unsqueeze(1).expand(rows, kc)
            else:
                neg = code >= (1 << (bits - 1))  # the sign is the top bit
                j = (code & ((1 << (bits - 1)) - 1)).to(torch.float32)
                s = scale[r0:r1]
                mag = j.mul_(s[:, 1:2]).add_(s[:, 0:1])
            yield pos.view(-1), torch.where(neg, mag.neg(), mag).view(-1)


# ----------------------------------------------------------------------------- checks


def _padding_zero(stream: Tensor, count: int, width: int) -> bool:
    used = count * width % 8
    return not used or stream.numel() == 0 or int(stream[-1]) >> used == 0


def validate_ctopk(parts: Mapping[str, Tensor], lay: ChunkLayout, chunk_values: int) -> str | None:
    """What is wrong with well-laid-out parts (None: nothing): scales finite, >= 0 and decoding to
    finite values; offsets strictly increasing in each chunk and inside the last, shorter one;
    the streams' padding bits 0."""
    scale = parts["scale"]
    if scale.numel():
        if lay.value_bits == 1:
            bad = not bool((scale >= 0).all()) or not bool(torch.isfinite(scale).all())
        else:
            lo, step = scale[:, 0], scale[:, 1]
            top = step * float((1 << (lay.value_bits - 1)) - 1) + lo
            bad = not bool((scale >= 0).all()) or not bool(torch.isfinite(top).all())
        if bad:
            return "part 'scale' has a negative, NaN or too large (decodes to inf) value"
    if not _padding_zero(parts["q"], lay.kept, lay.value_bits):
        return "part 'q' has non-zero padding bits"
    if not _padding_zero(parts["idx"], lay.kept, lay.pos_bits):
        return "part 'idx' has non-zero padding bits"
    k = lay.k
    for c0, c1 in _groups(lay, chunk_values):
        full = max(0, min(c1, lay.full) - c0)
        if full:
            off = unpack_bits(parts["idx"], lay.pos_bits, c0 * k, full * k).view(full, k)
            if k > 1 and not bool((off[:, 1:] > off[:, :-1]).all()):
                return "part 'idx' offsets are not strictly increasing within a chunk"
        if c1 > lay.full and lay.tail:  # offsets of a full chunk are < C by their width; the tail's need a check
            off = unpack_bits(parts["idx"], lay.pos_bits, lay.full * k, lay.k_tail)
            if (off.numel() > 1 and not bool((off[1:] > off[:-1]).all())) or int(off.max()) >= lay.tail:
                return f"part 'idx' offsets of the last chunk must increase and stay below its {lay.tail} values"
    return None
