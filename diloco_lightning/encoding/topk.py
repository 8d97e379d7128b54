"""``topk``: the ``k = topk_count(n, topk)`` largest magnitudes of each tensor.

Their values are blockwise int8 or int4 codes (``topk_values``, blocks of consecutive kept values),
their positions 16-bit offsets within pages of 65536 entries (``idx``) plus one count per page
(``count``): 2 bytes per kept value instead of 4 or 8. The selection is
:func:`~diloco_lightning.encoding.kernels.encode_topk` (``docs/encoding.md``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from diloco_lightning.encoding.base import Encoding, PartLayout, SpecFields, value_chunks
from diloco_lightning.encoding.blockwise import codes_problem
from diloco_lightning.encoding.limits import CHUNK, PAGE_SIZE

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = ["TopK"]


class TopK(Encoding):
    name = "topk"
    sparse = True

    @classmethod
    def value_encoding(cls, spec: SpecFields) -> str | None:
        return spec.topk_values

    @classmethod
    def header(cls, spec: SpecFields) -> dict[str, str]:
        return {"encoding_block_size": str(spec.block_size),
                "encoding_topk": repr(spec.topk),  # shortest repr: float() reads back the same double
                "encoding_topk_values": spec.topk_values}

    def encode(self, flat: Tensor, real_shape: tuple[int, ...], res: Tensor | None,
               add: Tensor | None) -> dict[str, Tensor]:
        from diloco_lightning.encoding.kernels import encode_topk

        return encode_topk(flat, self.spec, res)

    def layout(self, real_shape: tuple[int, ...]) -> PartLayout:
        import torch

        from diloco_lightning.encoding.kernels import codes_layout, topk_count

        n = math.prod(real_shape)
        k = topk_count(n, self.spec.topk)
        return {
            "q": codes_layout(k, self.spec.topk_values),
            "scale": (torch.float32, (-(-k // self.spec.block_size),)),
            "idx": (torch.int16, (k,)),
            "count": (torch.int32, (-(-n // PAGE_SIZE),)),
        }

    def check(self, parts: Mapping[str, Tensor], real_shape: tuple[int, ...]) -> str | None:
        import torch

        from diloco_lightning.encoding.kernels import topk_positions

        idx = parts["idx"]
        problem = codes_problem(parts, self.spec.topk_values, idx.numel())
        if problem is not None:
            return problem
        count = parts["count"]
        n = math.prod(real_shape)
        if bool((count < 0).any()) or int(count.sum(dtype=torch.int64)) != idx.numel():
            return f"part 'count' must be >= 0 and sum to {idx.numel()}"
        ends = count.to(torch.int64).cumsum(0)
        last = -1
        for j in range(0, idx.numel(), CHUNK):
            pos = topk_positions(idx, ends, j, min(j + CHUNK, idx.numel()))
            if int(pos[0]) <= last or (pos.numel() > 1 and not bool((pos[1:] > pos[:-1]).all())):
                return "part 'idx' positions are not strictly increasing"
            last = int(pos[-1])
        if last >= n:
            return f"part 'idx' has position {last} beyond the tensor's {n} values"
        return None

    def chunks(self, parts: Mapping[str, Tensor], numel: int, device: torch.device
               ) -> Iterator[tuple[slice | Tensor, Tensor]]:
        import torch

        from diloco_lightning.encoding.kernels import topk_positions
        from diloco_lightning.encoding.kernels import dequantize

        idx, values, block = parts["idx"], self.spec.topk_values, self.spec.block_size
        q, scale = parts["q"].reshape(-1), parts["scale"]
        ends = parts["count"].to(torch.int64).cumsum(0)
        for start, stop, vals in value_chunks(idx.numel(), device, lambda s, w: dequantize(q, scale, values, block, s, w)):
            yield topk_positions(idx, ends, start, stop), vals
