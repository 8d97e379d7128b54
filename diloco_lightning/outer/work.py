"""The FP32 work area of the outer optimizers: validated items, cache-sized chunks, scratch memory.

A step's math runs on :class:`Work` units: contiguous CPU FP32 (complex64) views of one state
tensor (or a chunk of it), its delta and its buffers. A tensor that is already CPU FP32
contiguous is used in place; any other is converted, in chunks of :data:`CHUNK_BYTES`, into a
scratch area of :data:`TEMP_BUDGET_BYTES` kept between steps, and written back afterwards (see
:mod:`diloco_lightning.outer.base` for the contract). :class:`WorkArea` does this; an
:class:`~diloco_lightning.outer.base.OuterOptimizer` holds one over its
:class:`~diloco_lightning.outer.buffers.BufferStore`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from diloco_lightning.outer.blockwise import BLOCK, blocks, dequantize_, quantize_
from diloco_lightning.outer.buffers import BufferStore, real_view
from diloco_lightning.outer.precision import math_dtype, stochastic_round_

__all__ = ["CHUNK_BYTES", "TEMP_BUDGET_BYTES", "Back", "Item", "Work", "WorkArea", "real_view"]

#: Size of the reusable FP32 scratch area for delta conversions and copies of non-FP32 state.
TEMP_BUDGET_BYTES = 16 * 1024 * 1024
#: Converted tensors are processed in chunks of this many FP32 bytes (about a core's share of cache).
CHUNK_BYTES = 4 * 1024 * 1024
assert (CHUNK_BYTES // 4) % BLOCK == 0  # a chunk of an 8-bit blockwise buffer starts on a block


@dataclass(frozen=True)
class Item:
    """One validated (state tensor, delta tensor) pair that a step will update."""

    key: str
    param: Tensor
    delta: Tensor


class Back(NamedTuple):
    """A low-precision buffer (slice) and its FP32 copy in a :class:`Work`'s ``bufs``."""

    stored: Tensor  # the bf16 values or uint8 codes
    math_copy: Tensor  # FP32, what the math updated
    label: str  # seeds stochastic rounding
    family: str
    absmax: Tensor | None  # 8-bit blockwise: the slice of the block maxima (None for bf16)


@dataclass(slots=True)
class Work:
    """One unit of math: flat FP32 views of (a chunk of) one state tensor, its delta and buffers.

    ``p`` and ``g`` are contiguous 1-D CPU FP32 tensors (``view_as_real`` of complex64 ones, so
    ``(n, 2)``, for a complex key); ``p`` aliases the state tensor itself when that is already CPU
    FP32 contiguous. ``bufs`` maps each buffer family to the matching slice (real view for complex).
    """

    key: str
    p: Tensor
    g: Tensor
    bufs: dict[str, Tensor]
    is_complex: bool
    target: Tensor  # the state tensor (or its flat slice) that p stands for
    p_math: Tensor  # p before view_as_real, shaped like target
    writeback: str | None  # None (p is the state tensor), "copy" or "add"
    #: low-precision buffers: what their FP32 copies in ``bufs`` are stored back into after the math
    buffer_back: list[Back] = field(default_factory=list)
    #: where ``p`` starts in the key's flattened tensor (elements; 0 for a whole tensor)
    start: int = 0

    def write_back(self) -> None:
        if self.writeback == "copy":
            self.target.copy_(self.p_math)
        elif self.writeback == "add":
            self.target.add_(self.p_math.to(self.target.device))


_ALIGN = 16  # scratch offsets in FP32 elements (64 bytes)


def _usable(tensor: Tensor, dtype: torch.dtype) -> bool:
    return tensor.dtype == dtype and tensor.device.type == "cpu" and tensor.is_contiguous()


class _Unit(NamedTuple):
    """Elements ``[start, stop)`` of one item (the whole tensor, in its shape, when ``whole``)."""

    item: Item
    start: int
    stop: int
    whole: bool
    is_complex: bool
    delta_ok: bool  # the delta is already CPU FP32 (complex64) contiguous
    param_ok: bool  # the state tensor is already CPU FP32 (complex64) contiguous
    floats: int  # FP32 elements of one converted copy
    need: int  # FP32 scratch elements (aligned) this unit takes


def _units(item: Item, chunk_floats: int, buffer_conversions: int = 0) -> list[_Unit]:
    """Split an item that needs conversions into cache-sized chunks (when both sides are contiguous).
    ``buffer_conversions``: the item's buffers kept in a low precision (each takes an FP32 copy)."""
    param, delta = item.param, item.delta
    is_complex = param.is_complex()
    dtype = math_dtype(is_complex)
    delta_ok, param_ok = _usable(delta, dtype), _usable(param, dtype)
    conversions = (not delta_ok) + (not param_ok) + buffer_conversions
    n = param.numel()
    width = 2 if is_complex else 1
    chunk = max(1, chunk_floats // width)
    if conversions == 0 or n <= chunk or not (param.is_contiguous() and delta.is_contiguous()):
        bounds = [(0, n)]
    else:
        bounds = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
    units = []
    for start, stop in bounds:
        floats = (stop - start) * width
        need = -(-floats // _ALIGN) * _ALIGN * conversions
        units.append(_Unit(item, start, stop, len(bounds) == 1, is_complex, delta_ok, param_ok, floats, need))
    return units


class WorkArea:
    """The FP32 work area of one outer optimizer: runs a step's math on :class:`Work` batches over the
    buffers of a :class:`~diloco_lightning.outer.buffers.BufferStore` (the optimizer's), in a scratch
    area of its own kept between steps.

    Attributes:
        track_precision: measure what the buffers' precision does at each step (:attr:`precision_stats`);
            off by default (it costs passes).
        precision_stats: per low-precision buffer family, for the last step: ``floor`` (the fraction of
            values stored as 0 although not 0) and ``stuck`` (stored unchanged although the step changed
            them: rounded away).
    """

    def __init__(self, store: BufferStore) -> None:
        self.store = store
        self.track_precision = False
        self.precision_stats: dict[str, dict[str, float]] = {}
        self._scratch: Tensor | None = None

    def run(self, items: list[Item], fn: Callable[[list[Work]], None]) -> None:
        """Call ``fn`` on batches of :class:`Work` (flat FP32 views of the items), then write back.

        Every item's key must have its buffers (:meth:`BufferStore.register`). Conversions (a delta that is not CPU
        FP32, a state tensor that is not CPU FP32 contiguous) go to a scratch area of
        :data:`TEMP_BUDGET_BYTES` kept between steps (fresh allocations of that size would
        page-fault on every step), in chunks of :data:`CHUNK_BYTES` so that a converted chunk is
        still in cache when the kernel reads it; a batch closes when the scratch area is full.
        ``fn`` must treat each :class:`Work` on its own (chunks of one key may land in different
        batches): per-key scalars are to be read before and written after :meth:`_run`.
        """
        store = self.store
        low = 0 if store.state_dtype == torch.float32 else len(store.families)
        counts: dict[str, list[int]] = {}
        units = [u for item in items
                 for u in _units(item, CHUNK_BYTES // 4, 0 if item.param.is_complex() else low)]
        needs = [u.need for u in units]
        if any(needs):
            size = max(TEMP_BUDGET_BYTES // 4, *needs)
            if self._scratch is None or self._scratch.numel() < size:
                self._scratch = None  # free the old area first
                self._scratch = torch.empty(size, dtype=torch.float32)
        scratch = self._scratch
        offset = 0

        def take(unit: _Unit) -> Tensor:
            nonlocal offset
            n = unit.floats
            assert scratch is not None and offset + n <= scratch.numel()
            flat = scratch[offset : offset + n]
            offset += -(-n // _ALIGN) * _ALIGN
            return flat.view(torch.complex64) if unit.item.param.is_complex() else flat

        batch: list[Work] = []
        for unit, need in zip(units, needs):
            if scratch is not None and offset + need > scratch.numel():
                self._flush(batch, fn, counts)
                batch, offset = [], 0
            batch.append(self._make_work(unit, take))
        if batch:
            self._flush(batch, fn, counts)
        if self.track_precision:
            self.precision_stats = {f: {"floor": c[0] / max(c[2], 1), "stuck": c[1] / max(c[2], 1)}
                                    for f, c in counts.items()}

    def _flush(self, batch: list[Work], fn: Callable[[list[Work]], None], counts: dict[str, list[int]]) -> None:
        fn(batch)
        for work in batch:
            work.write_back()
            for back in work.buffer_back:
                if self.store.stochastic:
                    seed = zlib.crc32(f"{self.store.rounding_step}:{back.label}".encode())
                    stochastic_round_(back.math_copy, torch.Generator().manual_seed(seed))
                if self.track_precision:
                    self._count_precision(back, counts.setdefault(back.family, [0, 0, 0]))
                if back.absmax is None:
                    back.stored.copy_(back.math_copy)  # to nearest even (exact after a stochastic rounding)
                else:
                    quantize_(back.stored, back.absmax, back.math_copy, self.store.signed(back.family))

    def _count_precision(self, back: Back, count: list[int]) -> None:
        """Add to ``count`` ([floor, stuck, values]) what storing ``back`` will do (before it is stored)."""
        new, old = back.math_copy, back.stored
        if back.absmax is None:
            rounded = new.to(old.dtype)
            old_values = old.float()
        else:
            signed = self.store.signed(back.family)
            codes, amax = torch.empty_like(old), torch.empty_like(back.absmax)
            quantize_(codes, amax, new, signed)
            old_values = dequantize_(torch.empty(old.shape), old, back.absmax, signed)
            rounded = dequantize_(torch.empty(old.shape), codes, amax, signed)
        rounded_f, changed = rounded.float(), new != old_values
        count[0] += int(((rounded_f == 0) & (new != 0)).sum())
        count[1] += int(((rounded_f == old_values) & changed).sum())
        count[2] += new.numel()

    def _make_work(self, unit: _Unit, take: Callable[[_Unit], Tensor]) -> Work:
        item = unit.item
        param, delta = item.param, item.delta.detach()
        whole, start, stop = unit.whole, unit.start, unit.stop
        if unit.delta_ok:
            g = delta if whole else delta.view(-1)[start:stop]
        else:
            g = take(unit)
            if whole:
                g = g.view(param.shape)
                g.copy_(delta)
            else:
                g.copy_(delta.view(-1)[start:stop])
        mode: str | None
        if unit.param_ok:
            p, target, mode = (param if whole else param.view(-1)[start:stop]), param, None
        else:
            target = param if whole else param.view(-1)[start:stop]
            p = take(unit).view(target.shape)
            if param.dtype in (torch.float64, torch.complex128):
                # Keep the state's precision: compute the FP32 update on zeros, add it in float64.
                p.zero_()
                mode = "add"
            else:
                p.copy_(target)
                mode = "copy"
        p_math = p
        back: list[Back] = []
        store = self.store
        if unit.is_complex or store.state_dtype == torch.float32:
            if whole:
                bufs = store.views(item.key)
            else:
                bufs = {family: real_view(store.buffer(family, item.key).view(-1)[start:stop]) for family in store.families}
        else:  # low-precision buffers: an FP32 copy of each, stored back in _flush
            bufs = {}
            for family in store.families:
                buf = store.buffer(family, item.key)
                stored = buf if whole else buf.view(-1)[start:stop]
                math_copy = take(unit).view(stored.shape)
                absmax = None
                if buf.dtype == torch.uint8:  # 8-bit blockwise: chunks start on a block (CHUNK_BYTES // 4 % BLOCK == 0)
                    absmax = store.absmax[family][item.key][start // BLOCK: blocks(stop)]
                    dequantize_(math_copy, stored, absmax, store.signed(family))
                else:
                    math_copy.copy_(stored)
                bufs[family] = math_copy
                back.append(Back(stored, math_copy, f"{family}/{item.key}/{start}", family, absmax))
        if unit.is_complex:
            p, g = torch.view_as_real(p), torch.view_as_real(g)
        return Work(item.key, p, g, bufs, unit.is_complex, target, p_math, mode, back, 0 if whole else start)
