"""The delta file (``diloco-delta/1``): one worker's pseudo-gradient ``anchor - local`` and its header.

``header`` (the format: constants, :class:`DeltaHeader`, :class:`Delta`, the errors, the header
parser, the model fingerprint) -> ``read`` (:func:`read_delta`: validates everything before a
tensor byte is read) and ``write`` (:func:`write_delta`). See ``docs/spec.md`` for the contract.
"""

from diloco_lightning.wire.delta.header import (
    Delta,
    DeltaFileError,
    DeltaHeader,
    DtypeError,
    EncodingFileError,
    ExtraKeyError,
    FORMAT,
    FingerprintMismatchError,
    FormatError,
    HeaderError,
    HeaderParser,
    MAX_NUM_TOKENS,
    MissingKeyError,
    NodeIdError,
    NonFiniteError,
    PathMismatchError,
    ShapeMismatchError,
    SignatureError,
    SizeError,
    UnreadableDeltaError,
    is_synced,
    model_fingerprint,
    parse_header,
    synced_keys,
)
from diloco_lightning.wire.delta.read import (
    max_delta_bytes,
    max_header_bytes,
    read_delta,
    read_delta_header,
)
from diloco_lightning.wire.delta.write import write_delta

__all__ = [
    "Delta",
    "DeltaFileError",
    "DeltaHeader",
    "DtypeError",
    "EncodingFileError",
    "ExtraKeyError",
    "FORMAT",
    "FingerprintMismatchError",
    "FormatError",
    "HeaderError",
    "HeaderParser",
    "MAX_NUM_TOKENS",
    "MissingKeyError",
    "NodeIdError",
    "NonFiniteError",
    "PathMismatchError",
    "ShapeMismatchError",
    "SignatureError",
    "SizeError",
    "UnreadableDeltaError",
    "is_synced",
    "model_fingerprint",
    "parse_header",
    "synced_keys",
    "max_delta_bytes",
    "max_header_bytes",
    "read_delta",
    "read_delta_header",
    "write_delta",
]
