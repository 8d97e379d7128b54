"""Pseudo-gradient encodings: what a delta's tensors are on the wire (``docs/encoding.md``).

``bits`` (fixed-width codes in a bitstream) -> ``chunked`` (the chunked top-k, SparseLoCo's) ->
``format`` (the spec, the parts' layout, the checks of an untrusted file) -> ``kernels`` (blockwise
int8/int4 codes, the top-k selection) -> ``codec`` (encode, decode, decode into a sum) ->
``feedback`` (what a worker sends: the encoding with error feedback). Depends on torch only.
"""

from diloco_lightning.encoding.codec import decode, decode_add_, encode, encode_with_residual, sum_of_squares
from diloco_lightning.encoding.format import (
    BLOCK_SIZES,
    CHUNK,
    CHUNK_SIZES,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CHUNK_SIZE,
    ENCODINGS,
    LEVELS,
    PAGE_SIZE,
    PART_SEP,
    VALUE_BITS,
    EncodedTensor,
    EncodingError,
    EncodingSpec,
    check_layout,
    expected_parts,
    part_name,
    split_part_name,
    topk_count,
    validate_parts,
)

__all__ = [
    "BLOCK_SIZES", "CHUNK", "CHUNK_SIZES", "DEFAULT_BLOCK_SIZE", "DEFAULT_CHUNK_SIZE", "ENCODINGS", "LEVELS",
    "PAGE_SIZE", "PART_SEP", "VALUE_BITS", "EncodedTensor",
    "EncodingError", "EncodingSpec", "check_layout", "decode", "decode_add_", "encode", "encode_with_residual",
    "expected_parts", "part_name", "split_part_name", "sum_of_squares", "topk_count", "validate_parts",
]
