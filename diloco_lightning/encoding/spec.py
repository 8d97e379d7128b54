"""What a run's encoding *is*, without torch: :class:`EncodingSpec` (checked options, header entries),
asking its encoding's class (:mod:`diloco_lightning.encoding.registry`); the limits
(:mod:`diloco_lightning.encoding.limits`) are re-exported. ``encoding/format.py`` re-exports every name
(the old import paths keep working); a configuration is checked with this module alone, so a
configuration error is reported without importing torch (``benchmarks/restart_time.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from diloco_lightning.encoding.limits import BLOCK_SIZES, CHUNK_SIZES, DEFAULT_BLOCK_SIZE, DEFAULT_CHUNK_SIZE, small_decimal
from diloco_lightning.encoding.limits import __all__ as _LIMITS
from diloco_lightning.encoding.registry import ENCODING_CLASSES, Encoding, encoding_class
from diloco_lightning.util.lazy import lazy_exports

#: the limits' old import path (``spec.CHUNK``): they live in :mod:`diloco_lightning.encoding.limits`
__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(_LIMITS, "diloco_lightning.encoding.limits"))

__all__ = ["EncodingSpec"]  # and, by their old path, the limits (``__getattr__``)

# ----------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class EncodingSpec:
    """How a run encodes its pseudo-gradients.

    Args:
        name: a registered encoding (:func:`~diloco_lightning.encoding.registry.encoding_names`; the
            built-in ones are :data:`ENCODINGS`).
        block_size: values per scale for int8/int4 (and top-k values); a power of two, 16 to 4096.
        topk: for ``topk``, the fraction of each tensor's entries kept, in ``(0, 1]``; for
            ``ctopk``, the fraction of each chunk's (``chunk_k = round(topk * chunk)``, at least 1,
            unless ``chunk_k`` is given; ``topk`` then becomes ``chunk_k / chunk``).
        topk_values: how the kept values are stored: ``topk``: ``int8`` (default: the indices
            dominate the size, so 8-bit values cost only ~20 % more than 4-bit) or ``int4``;
            ``ctopk``: ``int8``, ``int4``, ``int2`` (SparseLoCo's 2 bits) or ``sign`` (1 bit).
        chunk: for ``ctopk``, values per chunk; a power of two, 16 to 65536 (positions of
            ``log2(chunk)`` bits).
        chunk_k: for ``ctopk``, values kept per chunk, 1 to ``chunk`` (None: from ``topk``).
    """

    name: str = "float32"
    block_size: int = DEFAULT_BLOCK_SIZE
    topk: float = 0.01
    topk_values: str = "int8"
    chunk: int = DEFAULT_CHUNK_SIZE
    chunk_k: int | None = None

    def __post_init__(self) -> None:
        kind = _encoding_class(self.name)  # ValueError listing the registered names
        if type(self.block_size) is not int or self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be a power of two from 16 to 4096, got {self.block_size!r}")
        if isinstance(self.topk, bool) or not isinstance(self.topk, (int, float)) or not 0.0 < self.topk <= 1.0:
            raise ValueError(f"topk must be a fraction in (0, 1], got {self.topk!r}")
        values = kind.value_codes
        if self.topk_values not in values:
            raise ValueError(f"topk_values must be one of {list(values)} for {self.name}, got {self.topk_values!r}")
        if type(self.chunk) is not int or self.chunk not in CHUNK_SIZES:
            raise ValueError(f"chunk must be a power of two from 16 to 65536, got {self.chunk!r}")
        if self.chunk_k is not None and (type(self.chunk_k) is not int or not 1 <= self.chunk_k <= self.chunk):
            raise ValueError(f"chunk_k must be an integer from 1 to chunk ({self.chunk}), got {self.chunk_k!r}")
        object.__setattr__(self, "topk", float(self.topk))
        for field, value in kind.normalized(self).items():  # e.g. ctopk's chunk_k and topk; unused fields reset
            object.__setattr__(self, field, value)

    @property
    def value_encoding(self) -> str | None:
        """How values are quantized: ``int8``/``int4`` (top-k and ctopk: their ``topk_values``),
        None for the casts."""
        return _encoding_class(self.name).value_encoding(self)

    @property
    def cast_dtype(self) -> str | None:
        """The torch dtype name a plain cast travels as (the plain delta format); None for an encoding
        whose parts travel in the encoded format."""
        return _encoding_class(self.name).cast_dtype

    @property
    def lossless(self) -> bool:
        """Every FP32 value is sent exactly (float32): no residual, ever."""
        return _encoding_class(self.name).lossless

    @property
    def feedback_by_default(self) -> bool:
        """Error feedback is on unless told otherwise (the lossy quantized encodings)."""
        return _encoding_class(self.name).feedback_by_default

    def to_metadata(self) -> dict[str, str]:
        """The spec as safetensors header entries (strings); only what the encoding uses."""
        return {"encoding": self.name, **_encoding_class(self.name).header(self)}

    @classmethod
    def from_metadata(cls, md: Mapping[str, str]) -> EncodingSpec:
        """Parse :meth:`to_metadata`'s entries from an untrusted header (no ``encoding``: float32)."""
        name = md.get("encoding", "float32")
        block = md.get("encoding_block_size", str(DEFAULT_BLOCK_SIZE))
        if not small_decimal(block):
            raise ValueError(f"encoding_block_size must be a power of two from 16 to 4096, got {block!r}")
        kind = _encoding_class(name, known=False)
        return cls(name=name, **kind.spec_args(md))


def _encoding_class(name: str, *, known: bool = True) -> type[Encoding]:
    """The class registered as ``name`` (``ValueError`` listing the names); ``known=False``: the base
    class for a name not registered (whose spec then fails its own check)."""
    if known:
        return encoding_class(name)
    return ENCODING_CLASSES.get(name, Encoding) if isinstance(name, str) else Encoding
