"""The plain casts ``float32``, ``bfloat16``, ``float16``: each value rounded to the dtype (nearest even).

One part, ``q``, of the dtype and the tensor's real shape; it travels in the plain delta format
(``wire/delta/write.py``), byte for byte the files without an encoding. ``float32`` is lossless: the
worker sends its tensor itself and keeps no residual.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, ClassVar

from diloco_lightning.encoding.base import Encoding, PartLayout, value_chunks
from diloco_lightning.encoding.limits import CHUNK

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = ["BFloat16", "Cast", "Float16", "Float32"]


class Cast(Encoding):
    """A plain cast to :attr:`cast_dtype` (a subclass per dtype)."""

    feedback_by_default = False  # ~0.2 % error per value: not worth an FP32 residual by default
    adds_in_pass = True

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.cast_dtype or "")

    def encode(self, flat: Tensor, real_shape: tuple[int, ...], res: Tensor | None,
               add: Tensor | None) -> dict[str, Tensor]:
        import torch

        q = torch.empty(real_shape, dtype=self.dtype, device=flat.device)  # a copy even for float32: the caller may reuse its tensor
        # each chunk's largest and smallest value: NaN propagates through amax/amin and an infinity
        # (or a value beyond the dtype's range, cast to one) is one of them; 5-10x cheaper than isfinite().all()
        ends = torch.zeros((-(-flat.numel() // CHUNK), 2), dtype=q.dtype, device=flat.device)
        for i, start in enumerate(range(0, flat.numel(), CHUNK)):  # in cache: cast, check, residual
            part = slice(start, start + CHUNK)
            if add is not None:
                flat[part].add_(add[part])
            xc = flat[part].to(torch.float32)  # float64 is rounded to FP32 first, as everywhere
            qc = q.view(-1)[part].copy_(xc)
            torch.amax(qc, dim=0, out=ends[i, 0])
            torch.amin(qc, dim=0, out=ends[i, 1])
            if res is not None:
                torch.sub(xc, qc, out=res[part])  # a 16-bit float widens to FP32 exactly
        if not bool(torch.isfinite(ends).all()):
            raise ValueError("cannot encode a tensor with NaN or inf values (or beyond the dtype's range)")
        return {"q": q}

    def layout(self, real_shape: tuple[int, ...]) -> PartLayout:
        return {"q": (self.dtype, real_shape)}

    def check(self, parts: Mapping[str, Tensor], real_shape: tuple[int, ...]) -> str | None:
        import torch

        return None if bool(torch.isfinite(parts["q"]).all()) else "values contain NaN or inf"

    def chunks(self, parts: Mapping[str, Tensor], numel: int, device: torch.device
               ) -> Iterator[tuple[slice | Tensor, Tensor]]:
        q = parts["q"].reshape(-1)
        for start, stop, vals in value_chunks(numel, device, lambda s, w: w.copy_(q[s : s + w.numel()])):
            yield slice(start, stop), vals


class Float32(Cast):
    name = "float32"
    cast_dtype: ClassVar[str | None] = "float32"
    lossless = True


class BFloat16(Cast):
    name = "bfloat16"
    cast_dtype: ClassVar[str | None] = "bfloat16"


class Float16(Cast):
    name = "float16"
    cast_dtype: ClassVar[str | None] = "float16"
