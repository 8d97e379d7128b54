"""The buffers of an outer optimizer: one per buffer family per floating key, in their precision.

:class:`BufferStore` owns them: CPU FP32 tensors (complex64 for a complex family of a complex key)
or, with :meth:`BufferStore.set_precision`, bf16 or 8-bit blockwise codes (with their FP32 block
maxima, :mod:`~diloco_lightning.outer.blockwise`) for the real keys; the keys' shapes; the rounding
mode and its step count. An :class:`~diloco_lightning.outer.base.OuterOptimizer` holds one and its
:class:`~diloco_lightning.outer.work.WorkArea` reads and writes through it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from diloco_lightning.outer.blockwise import blocks, dequantize_, quantize_
from diloco_lightning.outer.precision import math_dtype

__all__ = ["BufferStore", "is_trainable", "real_view"]


def is_trainable(tensor: Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def real_view(tensor: Tensor) -> Tensor:
    """``tensor`` itself, or ``torch.view_as_real(tensor)`` for a complex tensor."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


class BufferStore:
    """The buffers of one optimizer, by family and key (see the module docstring).

    Args:
        families: buffer family -> whether it is complex for a complex key (else always real).
        nonnegative: families whose values are never negative (8-bit: the unsigned code book).
        label: whose buffers they are, for messages (the optimizer's name).
    """

    def __init__(self, families: Mapping[str, bool], nonnegative: frozenset[str] = frozenset(),
                 label: str = "outer optimizer") -> None:
        self.families: dict[str, bool] = dict(families)
        self.nonnegative = nonnegative
        self.label = label
        #: key -> (shape, is_complex), in registration order
        self.specs: dict[str, tuple[tuple[int, ...], bool]] = {}
        self.buffers: dict[str, dict[str, Tensor]] = {family: {} for family in self.families}
        #: 8-bit blockwise buffers: family -> key -> FP32 block maxima
        self.absmax: dict[str, dict[str, Tensor]] = {family: {} for family in self.families}
        self.state_dtype: torch.dtype = torch.float32  # of the buffers of real keys
        self.stochastic = False
        self.rounding_step = 0  # steps taken with stochastic rounding (seeds the rounding; in state_dict)
        self._views: dict[str, dict[str, Tensor]] = {}

    def signed(self, family: str) -> bool:
        return family not in self.nonnegative

    def register(self, key: str, tensor: Tensor) -> None:
        """Note ``key``'s shape and create its buffers (zeros)."""
        self.specs[key] = (tuple(tensor.shape), tensor.is_complex())
        for family in self.families:
            self.buffer(family, key)

    def buffer(self, family: str, key: str) -> Tensor:
        """The ``family`` buffer of ``key`` (created as zeros on first use)."""
        buffers = self.buffers[family]
        buf = buffers.get(key)
        if buf is None:
            buf = buffers[key] = torch.zeros(self.specs[key][0], dtype=self.dtype_of(family, key))
            if buf.dtype == torch.uint8:  # all-zero maxima: every code stands for 0
                self.absmax[family][key] = torch.zeros(blocks(buf.numel()))
        return buf

    def views(self, key: str) -> dict[str, Tensor]:
        """``{family: real view of key's buffer}``, cached (the buffers are updated in place)."""
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = {family: real_view(self.buffer(family, key)) for family in self.families}
        return views

    def values(self, family: str, key: str) -> Tensor:
        """The values of a buffer in its math dtype (8-bit codes decoded)."""
        buf = self.buffer(family, key)
        if buf.dtype != torch.uint8:
            return buf.clone()
        return dequantize_(torch.empty(buf.shape), buf, self.absmax[family][key], self.signed(family))

    def store(self, family: str, key: str, values: Tensor | tuple[Tensor, Tensor]) -> None:
        """Keep ``values`` as ``family``'s buffer of ``key`` in its dtype (8-bit: as codes and maxima;
        ``values`` may be 8-bit ``(codes, maxima)`` already, kept as they are: decoding and coding
        again is not exact)."""
        want = self.dtype_of(family, key)
        self.absmax[family].pop(key, None)
        if isinstance(values, tuple):
            if want == torch.uint8:
                self.buffers[family][key], self.absmax[family][key] = values
                return
            values = dequantize_(torch.empty(values[0].shape), *values, self.signed(family))
        if want != torch.uint8:
            self.buffers[family][key] = values.to(want)
            return
        codes, amax = torch.empty(values.shape, dtype=torch.uint8), torch.empty(blocks(values.numel()))
        quantize_(codes, amax, values.float(), self.signed(family))
        self.buffers[family][key], self.absmax[family][key] = codes, amax

    def dtype_of(self, family: str, key: str) -> torch.dtype:
        """What ``family``'s buffer of ``key`` is stored in: complex64 for a complex buffer, FP32 for the
        real buffers of a complex key, else the state dtype (FP32, bf16 or uint8 codes)."""
        if self.specs[key][1]:
            return math_dtype(self.families[family])
        return self.state_dtype

    def set_precision(self, dtype: torch.dtype, stochastic: bool) -> None:
        """Keep the buffers of real keys in ``dtype`` (existing ones converted now, to nearest)."""
        values = {(f, k): self.values(f, k) for f, per_key in self.buffers.items() for k in per_key}
        self.state_dtype, self.stochastic = dtype, stochastic
        for (family, key), value in values.items():
            self.store(family, key, value)
        self._views = {}

    def replace(self, buffers: dict[str, dict[str, Any]]) -> None:
        """Keep ``buffers`` (values as :meth:`parse` gives them), each in its buffer dtype."""
        self.buffers = {family: {} for family in self.families}
        self.absmax = {family: {} for family in self.families}
        for family, per_key in buffers.items():
            for key, values in per_key.items():
                self.store(family, key, values)
        self._views = {}

    def state_dict(self, copy: bool = True) -> dict[str, Tensor]:
        """The buffers as ``state_dict`` entries: ``"<family>/<key>"`` (and an 8-bit buffer's maxima
        under ``"<family>.absmax/<key>"``), cloned unless ``copy=False``. The rounding step is the
        optimizer's entry (``rounding_step``)."""
        out: dict[str, Tensor] = {}
        for family, buffers in self.buffers.items():
            for key, buf in buffers.items():
                out[f"{family}/{key}"] = buf.clone() if copy else buf
                if buf.dtype == torch.uint8:
                    amax = self.absmax[family][key]
                    out[f"{family}.absmax/{key}"] = amax.clone() if copy else amax
        return out

    def load_state_dict(self, tensors: Mapping[str, Tensor]) -> None:
        """Replace the buffers by :meth:`state_dict`'s entries (checked first: :meth:`parse`); absent
        ones restart from zero."""
        self.replace(self.parse(tensors))

    def parse(self, tensors: Mapping[str, Tensor]) -> dict[str, dict[str, Any]]:
        """Checked buffer values of ``state_dict`` tensors (8-bit ones as ``(codes, maxima)``), zeros
        where absent; ``ValueError`` naming an entry that is not a buffer. Changes nothing."""
        label = self.label
        buffers: dict[str, dict[str, Any]] = {family: {} for family in self.families}
        maxima = {name: t for name, t in tensors.items() if name.partition("/")[0].endswith(".absmax")}
        for name, tensor in tensors.items():
            if name.partition("/")[0].endswith(".absmax"):
                continue
            family, sep, key = name.partition("/")
            if tensor.dtype == torch.uint8 and sep and family in self.families:
                amax = maxima.pop(f"{family}.absmax/{key}", None)
                if amax is None or amax.dtype != torch.float32 or amax.numel() != blocks(tensor.numel()):
                    raise ValueError(f"state_dict entry {name!r} holds 8-bit codes without their {family}.absmax/{key} "
                                     f"({blocks(tensor.numel())} FP32 block maxima)")
                spec = self.specs.get(key)
                if spec is None or spec[1] or tuple(tensor.shape) != spec[0]:
                    raise ValueError(f"state_dict entry {name!r}: 8-bit codes of shape {tuple(tensor.shape)} do not "
                                     f"match a real key of the global state")
                buffers[family][key] = (tensor.detach().to("cpu", copy=True), amax.detach().to("cpu", copy=True))
                continue
            if not sep or family not in self.families:
                raise ValueError(
                    f"unexpected tensor {name!r} in {label} state_dict "
                    f"(expected '<buffer>/<key>' with buffer in {sorted(self.families)})"
                )
            buffers[family][key] = self._checked(name, key, tensor, self.families[family])
        # Keys with no saved buffer restart from zero.
        for family, per_key in buffers.items():
            for key, (shape, _) in self.specs.items():
                if key not in per_key:
                    per_key[key] = torch.zeros(shape, dtype=math_dtype(self.specs[key][1] and self.families[family]))
        if maxima:
            raise ValueError(f"unexpected tensor(s) {sorted(maxima)} in {label} state_dict (block maxima without codes)")
        return buffers

    def _checked(self, name: str, key: str, tensor: Tensor, follows_complex: bool) -> Tensor:
        spec = self.specs.get(key)
        if spec is None:
            raise ValueError(f"state_dict entry {name!r}: {key!r} is not a floating key of the global state")
        shape, is_complex = spec
        if tuple(tensor.shape) != shape:
            raise ValueError(f"state_dict entry {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        want_complex = is_complex and follows_complex
        if not is_trainable(tensor) or (tensor.is_complex() and not want_complex):
            raise ValueError(f"state_dict entry {name!r} has dtype {tensor.dtype}")
        # kept in the math dtype here; replace() stores it in the buffer dtype (FP32 -> bf16 to nearest)
        return tensor.detach().to(device="cpu", dtype=math_dtype(want_complex), copy=True)
