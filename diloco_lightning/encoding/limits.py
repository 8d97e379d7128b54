"""The encodings' limits, without torch: sizes, code books, the parts' naming, :class:`EncodingError`.

The bottom of the package: every encoding's class (``base.py`` and its subclasses), the kernels
and :class:`~diloco_lightning.encoding.spec.EncodingSpec` read them; ``spec.py`` and ``format.py``
re-export them (the old import paths keep working).
"""

from __future__ import annotations

from diloco_lightning.util.errors import DiLoCoError

__all__ = [
    "BLOCK_SIZES", "CHUNK", "CHUNK_SIZES", "DEFAULT_BLOCK_SIZE", "DEFAULT_CHUNK_SIZE", "ENCODINGS", "LEVELS",
    "PAGE_SIZE", "PART_SEP", "TINY", "VALUE_BITS", "EncodingError", "small_decimal",
]

#: value codes of the chunked top-k -> bits per value
VALUE_BITS = {"int8": 8, "int4": 4, "int2": 2, "sign": 1}
#: allowed chunk sizes: powers of two, 16 to 65536 (positions of 4 to 16 bits)
CHUNK_SIZES = tuple(2**i for i in range(4, 17))
#: the built-in encodings (:mod:`diloco_lightning.encoding.registry` holds them, and any registered later)
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


def small_decimal(text: object) -> bool:
    """A header's number: ASCII digits only, at most 5 of them (every size it may name is below 10**5)."""
    return isinstance(text, str) and text.isascii() and text.isdigit() and len(text) <= 5
