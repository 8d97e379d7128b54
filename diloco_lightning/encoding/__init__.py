"""Pseudo-gradient encodings: what a delta's tensors are on the wire (``docs/encoding.md``).

``bits`` (fixed-width codes in a bitstream) -> ``chunked`` (the chunked top-k, SparseLoCo's) ->
``format`` (the spec, the parts' layout, the checks of an untrusted file) -> ``kernels`` (blockwise
int8/int4 codes, the top-k selection) -> ``codec`` (encode, decode, decode into a sum) ->
``feedback`` (what a worker sends: the encoding with error feedback); ``spec`` (the encodings' names,
limits and :class:`EncodingSpec`) needs no torch. Each encoding is one class in one file (``cast``,
``blockwise``, ``topk``, ``ctopk``; :class:`Encoding` in ``base``) registered by name in ``registry``
(:func:`register_encoding`): callers ask its capabilities, never its name. Depends on torch only.
"""

from typing import TYPE_CHECKING

from diloco_lightning.util.lazy import lazy_exports

if TYPE_CHECKING:  # the names, for type checkers; at run time each is imported on first use
    from diloco_lightning.encoding.limits import BLOCK_SIZES
    from diloco_lightning.encoding.limits import CHUNK
    from diloco_lightning.encoding.limits import CHUNK_SIZES
    from diloco_lightning.encoding.limits import DEFAULT_BLOCK_SIZE
    from diloco_lightning.encoding.limits import DEFAULT_CHUNK_SIZE
    from diloco_lightning.encoding.limits import ENCODINGS
    from diloco_lightning.encoding.limits import LEVELS
    from diloco_lightning.encoding.limits import PAGE_SIZE
    from diloco_lightning.encoding.limits import PART_SEP
    from diloco_lightning.encoding.limits import VALUE_BITS
    from diloco_lightning.encoding.limits import EncodingError
    from diloco_lightning.encoding.spec import EncodingSpec
    from diloco_lightning.encoding.codec import decode
    from diloco_lightning.encoding.codec import decode_add_
    from diloco_lightning.encoding.codec import encode
    from diloco_lightning.encoding.codec import encode_with_residual
    from diloco_lightning.encoding.codec import sum_of_squares
    from diloco_lightning.encoding.format import EncodedTensor
    from diloco_lightning.encoding.format import check_layout
    from diloco_lightning.encoding.format import expected_parts
    from diloco_lightning.encoding.format import part_name
    from diloco_lightning.encoding.format import split_part_name
    from diloco_lightning.encoding.format import topk_count
    from diloco_lightning.encoding.format import validate_parts
    from diloco_lightning.encoding.registry import Encoding
    from diloco_lightning.encoding.registry import encoding_class
    from diloco_lightning.encoding.registry import encoding_for
    from diloco_lightning.encoding.registry import encoding_names
    from diloco_lightning.encoding.registry import register_encoding
    from diloco_lightning.encoding.registry import unregister_encoding

#: each name imported on first use: the spec's without torch (``spec.py``), the others with it
__getattr__, __dir__ = lazy_exports(__name__, {
    'BLOCK_SIZES': 'diloco_lightning.encoding.limits',
    'CHUNK': 'diloco_lightning.encoding.limits',
    'CHUNK_SIZES': 'diloco_lightning.encoding.limits',
    'DEFAULT_BLOCK_SIZE': 'diloco_lightning.encoding.limits',
    'DEFAULT_CHUNK_SIZE': 'diloco_lightning.encoding.limits',
    'ENCODINGS': 'diloco_lightning.encoding.limits',
    'LEVELS': 'diloco_lightning.encoding.limits',
    'PAGE_SIZE': 'diloco_lightning.encoding.limits',
    'PART_SEP': 'diloco_lightning.encoding.limits',
    'VALUE_BITS': 'diloco_lightning.encoding.limits',
    'EncodingError': 'diloco_lightning.encoding.limits',
    'EncodingSpec': 'diloco_lightning.encoding.spec',
    'decode': 'diloco_lightning.encoding.codec',
    'decode_add_': 'diloco_lightning.encoding.codec',
    'encode': 'diloco_lightning.encoding.codec',
    'encode_with_residual': 'diloco_lightning.encoding.codec',
    'sum_of_squares': 'diloco_lightning.encoding.codec',
    'EncodedTensor': 'diloco_lightning.encoding.format',
    'check_layout': 'diloco_lightning.encoding.format',
    'expected_parts': 'diloco_lightning.encoding.format',
    'part_name': 'diloco_lightning.encoding.format',
    'split_part_name': 'diloco_lightning.encoding.format',
    'topk_count': 'diloco_lightning.encoding.format',
    'validate_parts': 'diloco_lightning.encoding.format',
    'Encoding': 'diloco_lightning.encoding.registry',
    'encoding_class': 'diloco_lightning.encoding.registry',
    'encoding_for': 'diloco_lightning.encoding.registry',
    'encoding_names': 'diloco_lightning.encoding.registry',
    'register_encoding': 'diloco_lightning.encoding.registry',
    'unregister_encoding': 'diloco_lightning.encoding.registry',
})

__all__ = [
    "BLOCK_SIZES", "CHUNK", "CHUNK_SIZES", "DEFAULT_BLOCK_SIZE", "DEFAULT_CHUNK_SIZE", "ENCODINGS", "LEVELS",
    "PAGE_SIZE", "PART_SEP", "VALUE_BITS", "EncodedTensor", "Encoding",
    "EncodingError", "EncodingSpec", "check_layout", "decode", "decode_add_", "encode", "encoding_class",
    "encode_with_residual", "encoding_for", "encoding_names", "expected_parts", "part_name", "register_encoding",
    "split_part_name", "sum_of_squares", "topk_count", "unregister_encoding", "validate_parts",
]
