"""Blockwise absmax ``int8`` and ``int4``: blocks of ``block_size`` values share one FP32 scale.

``int8``: ``s = absmax / 127``, each value stored as ``round_half_even(x / s)`` in ``[-127, 127]``;
``int4``: ``s = absmax / 7``, codes in ``[-7, 7]``, two per byte (``docs/encoding.md``). Parts: ``q``
(the codes) and ``scale``. The kernels are in :mod:`diloco_lightning.encoding.kernels`;
:func:`codes_problem` checks a file's codes and scales (``topk`` stores its values the same way).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from diloco_lightning.encoding.base import Encoding, PartLayout, SpecFields, value_chunks
from diloco_lightning.encoding.limits import LEVELS

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = ["Blockwise", "Int4", "Int8", "codes_problem"]


class Blockwise(Encoding):
    """Blockwise absmax codes of ``name``'s width (a subclass per width)."""

    adds_in_pass = True

    @classmethod
    def value_encoding(cls, spec: SpecFields) -> str | None:
        return cls.name

    @classmethod
    def header(cls, spec: SpecFields) -> dict[str, str]:
        return {"encoding_block_size": str(spec.block_size)}

    def encode(self, flat: Tensor, real_shape: tuple[int, ...], res: Tensor | None,
               add: Tensor | None) -> dict[str, Tensor]:
        from diloco_lightning.encoding.kernels import quantize

        q, scale = quantize(flat, self.name, self.spec.block_size, res, add)
        return {"q": q, "scale": scale}

    def layout(self, real_shape: tuple[int, ...]) -> PartLayout:
        import torch

        from diloco_lightning.encoding.kernels import codes_layout

        n = math.prod(real_shape)
        return {"q": codes_layout(n, self.name), "scale": (torch.float32, (-(-n // self.spec.block_size),))}

    def check(self, parts: Mapping[str, Tensor], real_shape: tuple[int, ...]) -> str | None:
        return codes_problem(parts, self.name, math.prod(real_shape))

    def chunks(self, parts: Mapping[str, Tensor], numel: int, device: torch.device
               ) -> Iterator[tuple[slice | Tensor, Tensor]]:
        from diloco_lightning.encoding.kernels import dequantize

        q, scale, block = parts["q"].reshape(-1), parts["scale"], self.spec.block_size
        for start, stop, vals in value_chunks(numel, device, lambda s, w: dequantize(q, scale, self.name, block, s, w)):
            yield slice(start, stop), vals


class Int8(Blockwise):
    name = "int8"


class Int4(Blockwise):
    name = "int4"


def codes_problem(parts: Mapping[str, Tensor], values: str, count: int) -> str | None:
    """What is wrong with blockwise codes ``q`` and ``scale`` of ``count`` values in ``values``
    (``int8``/``int4``) (None: nothing): scales finite, >= 0 and small enough that every decoded
    value is finite; int8 codes not -128, int4 nibbles not 0 and an odd count's padding nibble 8."""
    import torch

    levels = LEVELS[values]
    scale, q = parts["scale"], parts["q"]
    # fl(levels * s) is the largest decoded magnitude of the block: it must be finite
    if not bool((scale >= 0).all()) or not bool(torch.isfinite(scale * levels).all()):
        return "part 'scale' has a negative, NaN or too large (decodes to inf) value"
    # reductions, not comparisons: no temporary of the codes' size (a master checks every delta)
    if values == "int8":
        if q.numel() and int(q.amin()) == -128:
            return "part 'q' has code -128 (codes are -127..127)"
    elif q.numel():
        if int(q.amin()) < 16 or int((q & 15).amin()) == 0:  # high nibble 0 <=> byte < 16
            return "part 'q' has nibble 0 (int4 codes are stored as 1..15)"
        if count % 2 and int(q[-1]) >> 4 != 8:
            return "part 'q' has a padding nibble other than 8 (code 0)"
    return None
