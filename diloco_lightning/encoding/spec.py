"""What a run's encoding *is*, without torch: the encodings' names and limits and
:class:`EncodingSpec` (checked options, header entries). ``encoding/format.py`` re-exports every name
(the old import paths keep working); a configuration is checked with this module alone, so a
configuration error is reported without importing torch (``benchmarks/restart_time.py``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from diloco_lightning.util.errors import DiLoCoError

__all__ = [
    "BLOCK_SIZES", "CHUNK", "CHUNK_SIZES", "DEFAULT_BLOCK_SIZE", "DEFAULT_CHUNK_SIZE", "ENCODINGS", "LEVELS",
    "PAGE_SIZE", "PART_SEP", "TINY", "VALUE_BITS", "EncodingError", "EncodingSpec",
]

#: value codes of the chunked top-k -> bits per value
VALUE_BITS = {"int8": 8, "int4": 4, "int2": 2, "sign": 1}
#: allowed chunk sizes: powers of two, 16 to 65536 (positions of 4 to 16 bits)
CHUNK_SIZES = tuple(2**i for i in range(4, 17))
ENCODINGS = ("float32", "bfloat16", "float16", "int8", "int4", "topk", "ctopk")
LEVELS = {"int8": 127, "int4": 7}  # symmetric: absmax maps to +-LEVELS, so -128 / -8 are never used
#: 128 values per FP32 scale: int8 costs (1 + 4/128) / 4 = 0.258x FP32, int4 (0.5 + 4/128) / 4 = 0.133x.
#: Smaller blocks track outliers better but the scales start to weigh (64: int4 0.141x).
DEFAULT_BLOCK_SIZE = 128
#: Allowed block sizes: powers of two, so blocks tile every chunk and pair up for int4 packing.
BLOCK_SIZES = tuple(2**i for i in range(4, 13))
#: The chunked top-k's default chunk: SparseLoCo's (64 x 64 tiles there; here 4096 consecutive values).
DEFAULT_CHUNK_SIZE = 4096
#: Top-k positions are stored as 16-bit offsets within pages of this many entries.
PAGE_SIZE = 1 << 16
#: File names of the parts: ``<key>`` for ``q``, ``<key>::<part>`` for the others.
PART_SEP = "::"
#: A block whose absmax is below this is stored as zeros (scale 0): every non-zero scale is then a
#: normal float, so a device that flushes subnormals to zero cannot change a code or a value.
TINY = 2.0**-100
#: Values per chunk (1 MiB of FP32, half a core's L2): work buffers stay in cache, and decode_add_
#: never allocates more than this. A multiple of every block size.
CHUNK = 1 << 18


class EncodingError(DiLoCoError, ValueError):
    """Encoded parts that do not form a valid encoding; the message names the key and the part."""

    def __init__(self, key: str, detail: str) -> None:
        self.key, self.detail = key, detail
        super().__init__(f"{key}: {detail}")


# ----------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class EncodingSpec:
    """How a run encodes its pseudo-gradients.

    Args:
        name: one of :data:`ENCODINGS`.
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
        if self.name not in ENCODINGS:
            raise ValueError(f"name must be one of {list(ENCODINGS)}, got {self.name!r}")
        if type(self.block_size) is not int or self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be a power of two from 16 to 4096, got {self.block_size!r}")
        if isinstance(self.topk, bool) or not isinstance(self.topk, (int, float)) or not 0.0 < self.topk <= 1.0:
            raise ValueError(f"topk must be a fraction in (0, 1], got {self.topk!r}")
        values = VALUE_BITS if self.name == "ctopk" else LEVELS
        if self.topk_values not in values:
            raise ValueError(f"topk_values must be one of {list(values)} for {self.name}, got {self.topk_values!r}")
        if type(self.chunk) is not int or self.chunk not in CHUNK_SIZES:
            raise ValueError(f"chunk must be a power of two from 16 to 65536, got {self.chunk!r}")
        if self.chunk_k is not None and (type(self.chunk_k) is not int or not 1 <= self.chunk_k <= self.chunk):
            raise ValueError(f"chunk_k must be an integer from 1 to chunk ({self.chunk}), got {self.chunk_k!r}")
        object.__setattr__(self, "topk", float(self.topk))
        if self.name == "ctopk":  # the header carries chunk and chunk_k; topk is their ratio
            k = self.chunk_k if self.chunk_k is not None else min(self.chunk, max(1, round(self.topk * self.chunk)))
            object.__setattr__(self, "chunk_k", k)
            object.__setattr__(self, "topk", k / self.chunk)
            object.__setattr__(self, "block_size", DEFAULT_BLOCK_SIZE)  # one scale pair per chunk instead
        else:  # unused: normalized, so that specs that encode alike compare equal
            object.__setattr__(self, "chunk", DEFAULT_CHUNK_SIZE)
            object.__setattr__(self, "chunk_k", None)

    @property
    def value_encoding(self) -> str | None:
        """How values are quantized: ``int8``/``int4`` (top-k and ctopk: their ``topk_values``),
        None for the casts."""
        if self.name in ("topk", "ctopk"):
            return self.topk_values
        return self.name if self.name in LEVELS else None

    def to_metadata(self) -> dict[str, str]:
        """The spec as safetensors header entries (strings); only what the encoding uses."""
        md = {"encoding": self.name}
        if self.name in ("int8", "int4", "topk"):
            md["encoding_block_size"] = str(self.block_size)
        if self.name == "topk":
            md["encoding_topk"] = repr(self.topk)  # shortest repr: float() reads back the same double
            md["encoding_topk_values"] = self.topk_values
        if self.name == "ctopk":
            md.update(encoding_chunk=str(self.chunk), encoding_chunk_k=str(self.chunk_k),
                      encoding_topk_values=self.topk_values)
        return md

    @classmethod
    def from_metadata(cls, md: Mapping[str, str]) -> EncodingSpec:
        """Parse :meth:`to_metadata`'s entries from an untrusted header (no ``encoding``: float32)."""
        name = md.get("encoding", "float32")
        block = md.get("encoding_block_size", str(DEFAULT_BLOCK_SIZE))
        if not _small_decimal(block):
            raise ValueError(f"encoding_block_size must be a power of two from 16 to 4096, got {block!r}")
        if name == "ctopk":
            chunk, k = md.get("encoding_chunk"), md.get("encoding_chunk_k")
            if chunk is None or not _small_decimal(chunk):
                raise ValueError(f"encoding_chunk must be a power of two from 16 to 65536, got {chunk!r}")
            if k is None or not _small_decimal(k):
                raise ValueError(f"encoding_chunk_k must be an integer from 1 to encoding_chunk, got {k!r}")
            return cls(name=name, chunk=int(chunk), chunk_k=int(k), topk_values=md.get("encoding_topk_values", ""))
        topk = md.get("encoding_topk", "0.01")
        try:
            fraction = float(topk) if isinstance(topk, str) and len(topk) <= 32 else math.nan
        except ValueError:
            fraction = math.nan
        if not 0.0 < fraction <= 1.0:  # NaN fails too
            raise ValueError(f"encoding_topk must be a fraction in (0, 1], got {topk!r}")
        return cls(name=name, block_size=int(block), topk=fraction, topk_values=md.get("encoding_topk_values", "int8"))


def _small_decimal(text: object) -> bool:
    """A header's number: ASCII digits only, at most 5 of them (every size it may name is below 10**5)."""
    return isinstance(text, str) and text.isascii() and text.isdigit() and len(text) <= 5
