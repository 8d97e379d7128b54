"""What an encoding is to its callers: :class:`Encoding`, its capabilities and its codec.

An encoding is one class in one file (``cast.py``, ``blockwise.py``, ``topk.py``, ``ctopk.py``)
registered under its name (:mod:`diloco_lightning.encoding.registry`). Its callers (the spec, the
codec, the worker's error feedback, the delta file's reader and writer) ask its capabilities, never
its name: whether it is a plain cast (:attr:`Encoding.cast_dtype`), lossless, sparse, whether error
feedback is on by default, whether it adds the residual in its own pass. A class reads and writes
its header entries, lays out its parts, checks an untrusted file's parts and encodes and decodes.

The class attributes and class methods need no torch (a configuration is checked without it); the
codec methods import their kernels on first use.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from diloco_lightning.encoding.limits import CHUNK, DEFAULT_BLOCK_SIZE, DEFAULT_CHUNK_SIZE, LEVELS

if TYPE_CHECKING:
    import torch
    from torch import Tensor

__all__ = ["Encoding", "PartLayout", "SpecFields", "value_chunks"]

#: ``{part: (dtype, shape)}`` of a well-formed encoding (:meth:`Encoding.layout`)
PartLayout = dict[str, tuple["torch.dtype", tuple[int, ...]]]


class SpecFields(Protocol):
    """What an encoding reads of its :class:`~diloco_lightning.encoding.spec.EncodingSpec` (the options)."""

    @property
    def name(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def topk(self) -> float: ...
    @property
    def topk_values(self) -> str: ...
    @property
    def chunk(self) -> int: ...
    @property
    def chunk_k(self) -> int | None: ...


class Encoding:
    """One pseudo-gradient encoding: its capabilities (class attributes), its header entries and
    options (class methods, no torch), its codec (methods of an instance bound to one spec).

    Subclasses set :attr:`name` and implement :meth:`encode`, :meth:`layout`, :meth:`check` and
    :meth:`chunks`; one registration (:func:`~diloco_lightning.encoding.registry.register_encoding`)
    makes the name usable everywhere.
    """

    #: the registry name (``EncodingSpec(name)``, the header's ``encoding`` entry)
    name: ClassVar[str] = ""
    #: a plain cast: the torch dtype name its tensor travels as in the plain delta format (float32,
    #: bfloat16, float16); None: quantized parts in the encoded format (``q``, ``scale``, ...)
    cast_dtype: ClassVar[str | None] = None
    #: every FP32 value is sent exactly (the tensor itself): no residual, error feedback always off
    lossless: ClassVar[bool] = False
    #: error feedback is on by default (``error_feedback=None``): the lossy quantized encodings
    feedback_by_default: ClassVar[bool] = True
    #: only some entries are kept: decoding starts from zeros, ``decode_add_`` leaves the others alone
    sparse: ClassVar[bool] = False
    #: the encoder adds the error-feedback residual chunk by chunk in its one pass (``add=``);
    #: otherwise the residual is added to the whole tensor first (a selection needs all of it)
    adds_in_pass: ClassVar[bool] = False
    #: the accepted ``topk_values`` (how kept values are stored), in the order error messages list them
    value_codes: ClassVar[tuple[str, ...]] = tuple(LEVELS)
    #: the ``topk_values`` a worker gets when it names none (one of :attr:`value_codes`)
    default_values: ClassVar[str] = "int8"

    def __init__(self, spec: SpecFields) -> None:
        self.spec = spec

    # ------------------------------------------------------------------ spec level (no torch)
    @classmethod
    def value_choices(cls) -> tuple[str, ...]:
        """The accepted ``topk_values``, the default first."""
        return (cls.default_values, *(v for v in cls.value_codes if v != cls.default_values))

    @classmethod
    def normalized(cls, spec: SpecFields) -> dict[str, Any]:
        """The spec's fields this encoding fixes (unused ones normalized, so that specs that encode
        alike compare equal)."""
        return {"chunk": DEFAULT_CHUNK_SIZE, "chunk_k": None}

    @classmethod
    def value_encoding(cls, spec: SpecFields) -> str | None:
        """How values are quantized (``int8``/``int4``...), None when they are not (a cast)."""
        return None

    @classmethod
    def header(cls, spec: SpecFields) -> dict[str, str]:
        """The header entries beyond ``encoding`` (strings); only what the encoding uses."""
        return {}

    @classmethod
    def spec_args(cls, md: Mapping[str, str]) -> dict[str, Any]:
        """:class:`~diloco_lightning.encoding.spec.EncodingSpec` keywords (``name`` aside) from an
        untrusted header's entries (``ValueError`` naming a bad one; ``encoding_block_size`` is checked
        already): ``block_size``, ``topk`` and ``topk_values``."""
        topk = md.get("encoding_topk", "0.01")
        try:
            fraction = float(topk) if isinstance(topk, str) and len(topk) <= 32 else math.nan
        except ValueError:
            fraction = math.nan
        if not 0.0 < fraction <= 1.0:  # NaN fails too
            raise ValueError(f"encoding_topk must be a fraction in (0, 1], got {topk!r}")
        return {"block_size": int(md.get("encoding_block_size", str(DEFAULT_BLOCK_SIZE))), "topk": fraction,
                "topk_values": md.get("encoding_topk_values", "int8")}

    # ------------------------------------------------------------------ codec (torch)
    def encode(self, flat: Tensor, real_shape: tuple[int, ...], res: Tensor | None,
               add: Tensor | None) -> dict[str, Tensor]:
        """The parts of the 1-D contiguous tensor ``flat`` (the real values of a tensor of ``real_shape``),
        writing ``flat - decode(parts)`` into ``res`` (FP32, 1-D) when given. ``add`` (only when
        :attr:`adds_in_pass`): ``flat += add`` chunk by chunk in the same pass. ``ValueError`` on
        NaN or inf values."""
        raise NotImplementedError

    def layout(self, real_shape: tuple[int, ...]) -> PartLayout:
        """``{part: (dtype, shape)}`` of a well-formed encoding of a tensor of ``real_shape``."""
        raise NotImplementedError

    def check(self, parts: Mapping[str, Tensor], real_shape: tuple[int, ...]) -> str | None:
        """What is wrong with well-laid-out parts read from a file (None: nothing): every decoded value
        must be finite."""
        raise NotImplementedError

    def chunks(self, parts: Mapping[str, Tensor], numel: int, device: torch.device
               ) -> Iterator[tuple[slice | Tensor, Tensor]]:
        """``(where, values)`` about :data:`CHUNK` values at a time: a slice of the flat tensor (dense)
        or int64 positions, increasing (sparse), and their decoded FP32 values (possibly in a reused
        work buffer)."""
        raise NotImplementedError


def value_chunks(n: int, device: torch.device, fill: Any) -> Iterator[tuple[int, int, Tensor]]:
    """``(start, stop, fill(start, w))`` for values ``0 .. n`` in steps of :data:`CHUNK`, ``w`` the
    FP32 work buffer of ``stop - start`` values (one buffer, reused)."""
    import torch

    w = torch.empty(min(n, CHUNK), dtype=torch.float32, device=device)
    for start in range(0, n, CHUNK):
        stop = min(start + CHUNK, n)
        yield start, stop, fill(start, w[: stop - start])
