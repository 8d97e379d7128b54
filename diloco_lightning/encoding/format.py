"""What an encoded pseudo-gradient is: the spec, its parts' layout, the checks of an untrusted file.

Encodings, chosen per run by name (:class:`EncodingSpec`), one class each
(:mod:`diloco_lightning.encoding.registry`, which lays out and checks their parts):

- ``float32`` / ``bfloat16`` / ``float16``: a plain cast (round to nearest even);
- ``int8``: blocks of ``block_size`` consecutive values (row-major order) share one FP32 scale
  ``s = absmax / 127``; each value is stored as ``round_half_even(x / s)`` in ``[-127, 127]``;
- ``int4``: the same with ``s = absmax / 7`` and codes in ``[-7, 7]``, two codes per byte;
- ``topk``: the ``k = topk_count(n, topk)`` largest magnitudes of each tensor, their values encoded
  as int8 or int4 (blocks of consecutive kept values), their positions as 16-bit offsets within
  pages of 65536 entries plus one count per page (2 bytes per kept value instead of 4 or 8);
- ``ctopk`` (chunked top-k, SparseLoCo's): the ``chunk_k`` largest magnitudes of every chunk of
  ``chunk`` values, their offsets in ``log2(chunk)`` bits, their values in 8, 4, 2 or 1 bits
  (``topk_values``: ``int8``, ``int4``, ``int2``, ``sign``) with one scale pair per chunk
  (:mod:`diloco_lightning.encoding.chunked`).

An :class:`EncodedTensor` holds named parts (``q`` codes, ``scale``, ``idx``, ``count``) stored in
a safetensors file as ``<key>`` (``q``) and ``<key>::<part>`` (the others). The layout, byte for
byte, and the rounding rules are in ``docs/encoding.md``. A reader checks an untrusted file's
dtypes and shapes against :func:`expected_parts` before it reads any data (:func:`check_layout`),
then the values with :func:`validate_parts` (finite scales, codes in range, indices increasing).

The encoder and decoder are in :mod:`diloco_lightning.encoding`, which re-exports these names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diloco_lightning.encoding.base import PartLayout
from diloco_lightning.encoding.kernels import codes_layout, topk_count, topk_positions  # noqa: F401 - re-exported
from diloco_lightning.encoding.limits import PART_SEP, EncodingError
from diloco_lightning.encoding.limits import __all__ as _LIMITS
from diloco_lightning.encoding.registry import encoding_for
from diloco_lightning.encoding.spec import EncodingSpec
from diloco_lightning.util.lazy import lazy_exports

#: the limits' old import path (``format.CHUNK``): they live in :mod:`diloco_lightning.encoding.limits`
__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(_LIMITS, "diloco_lightning.encoding.limits"))

__all__ = [  # and, by their old path, the limits (``__getattr__``)
    "CAST_DTYPES", "EncodedTensor", "EncodingError", "EncodingSpec", "PartLayout", "check_layout", "codes_layout", "expected_parts",
    "part_name", "real_view_shape", "split_part_name", "topk_count", "topk_positions", "validate_parts",
]

CAST_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- layout


def part_name(key: str, part: str) -> str:
    """The safetensors name of one part of ``key``'s encoding (``q`` is stored as ``key`` itself)."""
    return key if part == "q" else f"{key}{PART_SEP}{part}"


def split_part_name(name: str) -> tuple[str, str]:
    """Inverse of :func:`part_name`: ``"w::scale"`` -> ``("w", "scale")``, ``"w"`` -> ``("w", "q")``."""
    key, sep, part = name.rpartition(PART_SEP)
    return (key, part) if sep else (name, "q")


def real_view_shape(shape: Sequence[int], complex: bool) -> tuple[int, ...]:
    if isinstance(shape, (str, bytes)) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"shape must be a sequence of non-negative ints, got {shape!r}")
    return (*shape, 2) if complex else tuple(shape)


def expected_parts(shape: Sequence[int], spec: EncodingSpec, *, complex: bool = False) -> PartLayout:
    """``{part: (dtype, shape)}`` of a well-formed encoding of a tensor of ``shape``.

    ``n`` is the number of real values (twice the elements of a complex tensor), ``B`` the block
    size: casts ``{"q": (dtype, shape)}`` (``shape + (2,)`` when complex); int8 ``q`` int8 ``(n,)``
    and ``scale`` float32 ``(ceil(n/B),)``; int4 ``q`` uint8 ``(ceil(n/2),)`` and ``scale``; topk
    with ``k = topk_count(n, topk)``: ``q`` and ``scale`` for k values, ``idx`` int16 ``(k,)`` and
    ``count`` int32 ``(ceil(n/65536),)``; ctopk: ``q`` and ``idx`` uint8 bitstreams and ``scale``
    float32 ``(chunks, 2)`` (``(chunks,)`` for ``sign``), see :class:`~diloco_lightning.encoding.
    chunked.ChunkLayout`.
    """
    return encoding_for(spec).layout(real_view_shape(shape, complex))


_ST_CODES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I8": torch.int8,
             "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32}


def check_layout(found: Mapping[str, tuple[torch.dtype | str, Sequence[int]]], shape: Sequence[int],
                 spec: EncodingSpec, *, complex: bool = False, key: str = "tensor") -> None:
    """Check the parts' names, dtypes and shapes (e.g. from a safetensors header) before reading data.

    ``found`` maps part names (``q``, ``scale``, ...) to ``(dtype, shape)``; a dtype may be a torch
    dtype or a safetensors code (``"I8"``). Raises :class:`EncodingError` naming key and part.
    """
    want = expected_parts(shape, spec, complex=complex)
    if set(found) != set(want):
        raise EncodingError(key, f"{spec.name} encoding has parts {sorted(want)}, got {sorted(found)}")
    for part, (dtype, shp) in found.items():
        dtype = _ST_CODES.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if dtype != want[part][0] or tuple(shp) != want[part][1]:
            wdtype, wshape = want[part]
            raise EncodingError(key, f"part {part!r} is {dtype} {list(shp)}, expected {wdtype} {list(wshape)}")


def validate_parts(parts: Mapping[str, Tensor], shape: Sequence[int], spec: EncodingSpec, *,
                   complex: bool = False, key: str = "tensor") -> None:
    """Check that ``parts`` decode to finite values of a tensor of ``shape``; EncodingError otherwise.

    Layout (:func:`check_layout`), then values: cast values finite; scales finite, >= 0 and small
    enough that every decoded value is finite; int8 codes not -128, int4 nibbles not 0 and the
    padding nibble 8; top-k counts >= 0 summing to k, positions strictly increasing and < n;
    ctopk: :func:`~diloco_lightning.encoding.chunked.validate_ctopk`.
    """
    check_layout({p: (t.dtype, t.shape) for p, t in parts.items()}, shape, spec, complex=complex, key=key)
    problem = encoding_for(spec).check(parts, real_view_shape(shape, complex))
    if problem is not None:
        raise EncodingError(key, problem)


# ----------------------------------------------------------------------------- encoded tensor


@dataclass
class EncodedTensor:
    """One tensor's encoding: its parts, and what decoding needs (shape, dtype class, spec)."""

    spec: EncodingSpec
    shape: tuple[int, ...]
    complex: bool
    parts: dict[str, Tensor]

    @property
    def numel(self) -> int:
        """Real values encoded (twice the elements of a complex tensor)."""
        return math.prod(self.shape) * (2 if self.complex else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def file_tensors(self, key: str) -> dict[str, Tensor]:
        """The parts under their safetensors names (:func:`part_name`)."""
        return {part_name(key, p): t for p, t in self.parts.items()}

    @classmethod
    def from_parts(cls, parts: Mapping[str, Tensor], shape: Sequence[int], spec: EncodingSpec, *,
                   complex: bool = False, key: str = "tensor", validate: bool = True) -> EncodedTensor:
        """Wrap parts read from a file; validated (:func:`validate_parts`) unless told otherwise."""
        if validate:
            validate_parts(parts, shape, spec, complex=complex, key=key)
        return cls(spec, tuple(shape), complex, dict(parts))
