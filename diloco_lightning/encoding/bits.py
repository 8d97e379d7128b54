"""Fixed-width unsigned codes in a little-endian bitstream: how the chunked top-k stores positions and values.

Value ``i`` of width ``w`` occupies stream bits ``i*w .. i*w + w - 1``, its least significant bit
first; stream bit ``t`` is bit ``t mod 8`` of byte ``t // 8``. The last byte's unused high bits
are 0. So with ``w = 2`` byte ``b`` holds values ``4b .. 4b + 3`` in bits 0-1, 2-3, 4-5, 6-7, and
with ``w = 12`` bytes ``3b .. 3b + 2`` hold values ``2b`` (all of byte 3b, the low 4 bits of byte
3b + 1) and ``2b + 1`` (the high 4 bits of byte 3b + 1, all of byte 3b + 2).

Packing works on groups of ``g = 8 / gcd(w, 8)`` values, the fewest whose bits fill whole bytes:
each group is one int64 word when ``g * w <= 64`` (every width used here but the odd ones from 9
to 15), else each value is expanded to its bits. Both give the same stream
(``tests/test_encoding.py`` checks them against each other and against a bit-by-bit reference).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["SLICE", "packed_bytes", "pack_bits", "unpack_bits", "group_size"]


def packed_bytes(count: int, width: int) -> int:
    """Bytes of ``count`` values of ``width`` bits: ``ceil(count * width / 8)``."""
    return (count * width + 7) // 8


def group_size(width: int) -> int:
    """Values per whole-byte group: ``8 / gcd(width, 8)``; a group starts at a byte boundary."""
    return 8 // math.gcd(width, 8)


def _word_fits(width: int) -> bool:
    return group_size(width) * width <= 64


#: values packed at a time (a multiple of every group size): the int64 work buffers stay small
SLICE = 1 << 16


def pack_bits(values: Tensor, width: int) -> Tensor:
    """Pack ``values`` (integers in ``[0, 2**width)``, any integer dtype, 1-D) into a uint8 stream."""
    if not 1 <= width <= 16:
        raise ValueError(f"width must be 1 to 16 bits, got {width}")
    m = values.numel()
    if width == 8:
        return values.to(torch.uint8)
    out = torch.empty(packed_bytes(m, width), dtype=torch.uint8, device=values.device)
    for i in range(0, m, SLICE):  # a slice starts on a byte: SLICE * width is a multiple of 8
        part = _pack(values[i : i + SLICE], width)
        b0 = i * width // 8
        out[b0 : b0 + part.numel()] = part
    return out


def _pack(values: Tensor, width: int) -> Tensor:
    m = values.numel()
    out_len = packed_bytes(m, width)
    g = group_size(width)
    pad = -m % g
    v = values.to(torch.int64)
    if pad:
        v = torch.cat([v, v.new_zeros(pad)])
    if _word_fits(width):
        groups = v.view(-1, g)
        word = groups[:, 0].clone()
        for i in range(1, g):
            word |= groups[:, i] << (width * i)
        nb = g * width // 8
        out = torch.empty((groups.shape[0], nb), dtype=torch.uint8, device=values.device)
        for j in range(nb):
            out[:, j] = (word >> (8 * j)) & 0xFF
        return out.view(-1)[:out_len]
    shifts = torch.arange(width, device=values.device, dtype=torch.int64)
    bits = ((v.unsqueeze(1) >> shifts) & 1).to(torch.uint8).view(-1, 8)
    out = bits[:, 0].clone()
    for j in range(1, 8):
        out |= bits[:, j] << j
    return out[:out_len]


def unpack_bits(stream: Tensor, width: int, start: int, count: int) -> Tensor:
    """Values ``start .. start + count`` (int64) of a stream written by :func:`pack_bits`.

    Reads only the bytes that hold them; ``stream`` must have at least ``packed_bytes(start +
    count, width)`` bytes (the caller checked the stream's size against the header).
    """
    if count <= 0:
        return torch.zeros(0, dtype=torch.int64, device=stream.device)
    if width == 8:
        return stream[start : start + count].to(torch.int64)
    g = group_size(width)
    first = start - start % g  # a group starts on a byte
    stop = start + count
    last = stop + (-stop % g)
    b0, b1 = first * width // 8, min(stream.numel(), last * width // 8)
    raw = stream[b0:b1].to(torch.int64)
    nb = g * width // 8
    if raw.numel() % nb:  # the stream's last group is cut short at its last byte
        raw = torch.cat([raw, raw.new_zeros(nb - raw.numel() % nb)])
    mask = (1 << width) - 1
    if _word_fits(width):
        groups = raw.view(-1, nb)
        word = groups[:, 0].clone()
        for j in range(1, nb):
            word |= groups[:, j] << (8 * j)
        out = torch.empty((groups.shape[0], g), dtype=torch.int64, device=stream.device)
        for i in range(g):
            out[:, i] = (word >> (width * i)) & mask
        vals = out.view(-1)
    else:
        shifts = torch.arange(8, device=stream.device, dtype=torch.int64)
        bits = ((raw.unsqueeze(1) >> shifts) & 1).view(-1, width)
        weights = torch.ones(width, dtype=torch.int64, device=stream.device) << torch.arange(width, device=stream.device)
        vals = (bits * weights).sum(1)
    return vals[start - first : start - first + count]
