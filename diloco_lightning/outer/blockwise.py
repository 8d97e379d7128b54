"""8-bit blockwise buffers (``state_dtype="int8"``), as bitsandbytes keeps 8-bit optimizer states.

Dettmers et al. 2022 ("8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861): a buffer
is cut into blocks of :data:`BLOCK` consecutive values; each block stores its absolute maximum in
FP32 and each value as the uint8 index of the nearest entry of a fixed 256-entry code book applied
to ``value / absmax``. The code book is the *dynamic* map (Dettmers 2015, arXiv 1511.04561):
exponents 10^-6 ... 10^0, each with a linear fraction, so small values keep a relative precision
down to about 1e-7 of their block's maximum; below half the smallest code they are stored as 0
(:func:`floor_fraction` counts them). Signed values (Adam's ``m``) use the signed map; values that
are never negative (Adam's ``v``) the unsigned one, which spends the sign bit on precision.

The map is built here (:func:`dynamic_map`, the construction of bitsandbytes'
``create_dynamic_map``, which a test compares), and rounding is to the nearest code
(bitsandbytes' kernels search the book approximately and take a neighbouring code for about 1 %
of values).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["BLOCK", "blocks", "dequantize_", "dynamic_map", "floor_fraction", "quantize_"]

#: values per block (bitsandbytes' 8-bit optimizers use 256)
BLOCK = 256


@functools.lru_cache(maxsize=2)
def dynamic_map(signed: bool) -> Tensor:
    """The 256 sorted values of the dynamic 8-bit code book in [-1, 1] (``signed``) or [0, 1].

    For each exponent ``e`` of 10^-6 ... 10^0 (7 in all) the midpoints of a linear split of
    [0.1, 1] into ``2**(i + 1)`` (signed) or ``2**(i + 2)`` (unsigned) parts, times ``10**e``, then 0
    and 1; the unused entries are 0.
    """
    max_exponent_bits, non_sign_bits = 7, 7
    data: list[float] = []
    for i in range(max_exponent_bits):
        items = 2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        bounds = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = ((bounds[:-1] + bounds[1:]) / 2.0) * 10 ** (-(max_exponent_bits - 1) + i)
        data += means.tolist()
        if signed:
            data += (-means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


@functools.lru_cache(maxsize=2)
def _midpoints(signed: bool) -> tuple[Tensor, Tensor]:
    """The distinct code values and the midpoints between neighbours (for nearest-code search),
    and for each distinct value its code index."""
    book = dynamic_map(signed)
    values: list[float] = []
    first: list[int] = []
    for idx, v in enumerate(book.tolist()):
        if not values or v != values[-1]:
            values.append(v)
            first.append(idx)
    vals = torch.tensor(values, dtype=torch.float32)
    return (vals[:-1] + vals[1:]) / 2.0, torch.tensor(first, dtype=torch.uint8)


def blocks(numel: int) -> int:
    """Blocks of a buffer of ``numel`` values."""
    return -(-numel // BLOCK)


def quantize_(codes: Tensor, absmax: Tensor, values: Tensor, signed: bool) -> None:
    """Store the FP32 ``values`` (flat, a whole number of blocks but the last) into ``codes`` (uint8,
    same length) and ``absmax`` (FP32, one per block), in place."""
    n = values.numel()
    nb = blocks(n)
    flat = values.reshape(-1)
    pad = nb * BLOCK - n
    padded = torch.nn.functional.pad(flat, (0, pad)) if pad else flat
    grid = padded.view(nb, BLOCK)
    amax = grid.abs().amax(dim=1)
    absmax.copy_(amax)
    scale = torch.where(amax > 0, amax, torch.ones_like(amax)).unsqueeze(1)
    normed = (grid / scale).reshape(-1)[:n]
    mids, index = _midpoints(signed)
    codes.copy_(index[torch.bucketize(normed, mids)].view_as(codes))


def dequantize_(out: Tensor, codes: Tensor, absmax: Tensor, signed: bool) -> Tensor:
    """``out`` (FP32, flat, as many values as ``codes``) = the values ``codes`` and ``absmax`` stand for."""
    n = codes.numel()
    book = dynamic_map(signed)
    vals = book[codes.reshape(-1).long()]
    nb = blocks(n)
    pad = nb * BLOCK - n
    if pad:
        vals = torch.nn.functional.pad(vals, (0, pad))
    out.reshape(-1).copy_((vals.view(nb, BLOCK) * absmax.unsqueeze(1)).reshape(-1)[:n])
    return out


def floor_fraction(codes: Tensor, absmax: Tensor, values: Tensor, signed: bool) -> float:
    """The fraction of ``values`` that are not zero but are stored as 0 (below half the smallest code
    of their block: the quantisation floor)."""
    zero = int(_midpoints(signed)[1][torch.bucketize(torch.zeros(1), _midpoints(signed)[0])].item())
    if values.numel() == 0:
        return 0.0
    return float(((codes.reshape(-1) == zero) & (values.reshape(-1) != 0)).float().mean())
