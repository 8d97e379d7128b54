"""``ctopk``, the chunked top-k (SparseLoCo's): the ``chunk_k`` largest magnitudes of every ``chunk`` values.

Offsets in ``log2(chunk)`` bits, values in 8, 4, 2 or 1 bits (``topk_values``: ``int8``, ``int4``,
``int2``, ``sign``) with one scale pair per chunk; the kernels and the layout are in
:mod:`diloco_lightning.encoding.chunked`. The header carries ``chunk`` and ``chunk_k``; ``topk`` is
their ratio.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from diloco_lightning.encoding.base import Encoding, PartLayout, SpecFields
from diloco_lightning.encoding.limits import CHUNK, DEFAULT_BLOCK_SIZE, TINY, VALUE_BITS, small_decimal

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from diloco_lightning.encoding.chunked import ChunkLayout
__all__ = ["ChunkedTopK"]


class ChunkedTopK(Encoding):
    name = "ctopk"
    sparse = True
    value_codes = tuple(VALUE_BITS)
    default_values = "int2"  # SparseLoCo's

    @classmethod
    def normalized(cls, spec: SpecFields) -> dict[str, Any]:
        k = spec.chunk_k if spec.chunk_k is not None else min(spec.chunk, max(1, round(spec.topk * spec.chunk)))
        # one scale pair per chunk instead of blocks
        return {"chunk_k": k, "topk": k / spec.chunk, "block_size": DEFAULT_BLOCK_SIZE}

    @classmethod
    def value_encoding(cls, spec: SpecFields) -> str | None:
        return spec.topk_values

    @classmethod
    def header(cls, spec: SpecFields) -> dict[str, str]:
        return {"encoding_chunk": str(spec.chunk), "encoding_chunk_k": str(spec.chunk_k),
                "encoding_topk_values": spec.topk_values}

    @classmethod
    def spec_args(cls, md: Mapping[str, str]) -> dict[str, Any]:
        chunk, k = md.get("encoding_chunk"), md.get("encoding_chunk_k")
        if chunk is None or not small_decimal(chunk):
            raise ValueError(f"encoding_chunk must be a power of two from 16 to 65536, got {chunk!r}")
        if k is None or not small_decimal(k):
            raise ValueError(f"encoding_chunk_k must be an integer from 1 to encoding_chunk, got {k!r}")
        return {"chunk": int(chunk), "chunk_k": int(k), "topk_values": md.get("encoding_topk_values", "")}

    def _layout(self, n: int) -> ChunkLayout:
        from diloco_lightning.encoding.chunked import chunk_layout

        assert self.spec.chunk_k is not None  # set by EncodingSpec for ctopk
        return chunk_layout(n, self.spec.chunk, self.spec.chunk_k, self.spec.topk_values)

    def encode(self, flat: Tensor, real_shape: tuple[int, ...], res: Tensor | None,
               add: Tensor | None) -> dict[str, Tensor]:
        from diloco_lightning.encoding.chunked import encode_ctopk

        assert self.spec.chunk_k is not None  # set by EncodingSpec for ctopk
        return encode_ctopk(flat, self.spec.chunk, self.spec.chunk_k, self.spec.topk_values, res, tiny=TINY)

    def layout(self, real_shape: tuple[int, ...]) -> PartLayout:
        import math

        return self._layout(math.prod(real_shape)).parts()

    def check(self, parts: Mapping[str, Tensor], real_shape: tuple[int, ...]) -> str | None:
        import math

        from diloco_lightning.encoding.chunked import validate_ctopk

        return validate_ctopk(parts, self._layout(math.prod(real_shape)), CHUNK)

    def chunks(self, parts: Mapping[str, Tensor], numel: int, device: torch.device
               ) -> Iterator[tuple[slice | Tensor, Tensor]]:
        from diloco_lightning.encoding.chunked import decoded_groups

        yield from decoded_groups(parts, self._layout(numel), CHUNK)
