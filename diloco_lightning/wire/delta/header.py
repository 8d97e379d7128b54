"""The delta file's format (``diloco-delta/1``): its header, its errors, and what a delta holds.

A delta is a safetensors file holding the pseudo-gradient ``anchor - local`` of one
worker's inner phase, one tensor per floating (or complex) key of the global state,
with a header (safetensors metadata, all strings) that says who made it and from
which global version (``base_outer_step``). See docs/spec.md for the contract.

Every problem a reader finds is a :class:`DeltaFileError` subclass whose ``reason`` is a short
code (``"unreadable"``, ``"format"``, ...); the master logs and counts rejections by that code.
Writing is ``write.py``, reading ``read.py``; the package ``diloco_lightning.wire.delta`` exports the public names of the three.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Union

import torch

from diloco_lightning.encoding import EncodedTensor, EncodingSpec
from diloco_lightning.util.errors import DeltaRejected
from diloco_lightning.wire.names import InvalidNameError, parse_local_step, validate_node_id

FORMAT = "diloco-delta/1"
DELTA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COMPLEX_DELTA_DTYPES = (torch.complex64,)
#: the most tokens one delta may claim (``num_tokens``): 10**15, a thousand times the tokens of
#: today's largest training runs. It keeps ``weighting="tokens"`` far from float overflow.
MAX_NUM_TOKENS = 10**15
#: header budget of a delta: a fixed part plus a generous share per tensor (an honest header
#: holds about 100 bytes per tensor, plus the signature and fingerprint)
HEADER_BYTES_BASE = 64 << 10
HEADER_BYTES_PER_TENSOR = 1 << 10
#: the most tensors one key of the model becomes in a file (top-k: codes, scale, idx, count; ctopk: 3)
MAX_PARTS = 4
#: what an encoding may take beyond FP32 for one key: a 1-value tensor's int8 top-k (1 code byte,
#: a 4-byte scale, a 2-byte position, a 4-byte count) is 11 bytes against 4, its int8 ctopk in
#: chunks of 65536 too (1 code byte, 2 position bytes, 8 scale bytes); a ctopk chunk never takes
#: more than its FP32 values, its tail at most 9 bytes more (docs/encoding.md)
ENCODED_SLACK_PER_KEY = 16
#: the header entries that name a delta's encoding (EncodingSpec.to_metadata)
ENCODING_KEYS = ("encoding", "encoding_block_size", "encoding_topk", "encoding_topk_values", "encoding_chunk",
                 "encoding_chunk_k")

__all__ = [
    "FORMAT", "DELTA_DTYPES", "COMPLEX_DELTA_DTYPES", "MAX_NUM_TOKENS", "HEADER_BYTES_BASE", "HEADER_BYTES_PER_TENSOR",
    "MAX_PARTS", "ENCODED_SLACK_PER_KEY", "ENCODING_KEYS",
    "DeltaFileError", "UnreadableDeltaError", "FormatError", "HeaderError", "NodeIdError", "PathMismatchError",
    "MissingKeyError", "ExtraKeyError", "ShapeMismatchError", "DtypeError", "NonFiniteError", "FingerprintMismatchError",
    "SignatureError", "EncodingFileError", "SizeError",
    "is_synced", "synced_keys", "model_fingerprint", "DeltaHeader", "Delta", "parse_header", "HeaderParser",
]


# ----------------------------------------------------------------------------- errors


class DeltaFileError(DeltaRejected, ValueError):
    """A delta file the reader refuses: a rejection whose ``reason`` is the kind's (a class
    attribute), ``path`` the file."""

    reason = "invalid"

    def __init__(self, path: str | Path, detail: str) -> None:
        self.path = str(path)
        super().__init__(type(self).reason, detail)

    def _message(self) -> str:
        return f"{self.path}: {self.reason}: {self.detail}"


class UnreadableDeltaError(DeltaFileError):
    reason = "unreadable"


class FormatError(DeltaFileError):
    reason = "format"


class HeaderError(DeltaFileError):
    reason = "header"


class NodeIdError(DeltaFileError):
    reason = "node_id"


class PathMismatchError(DeltaFileError):
    reason = "path_mismatch"


class MissingKeyError(DeltaFileError):
    reason = "missing_key"


class ExtraKeyError(DeltaFileError):
    reason = "extra_key"


class ShapeMismatchError(DeltaFileError):
    reason = "shape"


class DtypeError(DeltaFileError):
    reason = "dtype"


class NonFiniteError(DeltaFileError):
    reason = "non_finite"


class FingerprintMismatchError(DeltaFileError):
    reason = "fingerprint"


class SignatureError(DeltaFileError):
    reason = "signature"


class EncodingFileError(DeltaFileError):
    """The header names an encoding that does not exist, or the parts are not a valid encoding
    (missing or extra parts, wrong dtypes or sizes, NaN or huge scales, codes or positions out of
    range); the detail names the key and the part."""

    reason = "encoding"


class SizeError(DeltaFileError):
    """The file (or its header) is larger than a delta of this model can honestly be."""

    reason = "size"


# ----------------------------------------------------------------------------- keys and fingerprint


def is_synced(t: torch.Tensor) -> bool:
    """True for tensors that travel in deltas: floating point or complex (never int/bool buffers)."""
    return t.is_floating_point() or t.is_complex()


def synced_keys(state: Mapping[str, torch.Tensor]) -> list[str]:
    """Sorted floating/complex keys of ``state``."""
    return sorted(k for k, t in state.items() if is_synced(t))


def model_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 hex of ``name|d0,d1,...|dtype`` lines (floating/complex keys, sorted, joined by newlines)."""
    lines = []
    for name in synced_keys(state):
        t = state[name]
        shape = ",".join(str(d) for d in t.shape)
        lines.append(f"{name}|{shape}|{str(t.dtype).removeprefix('torch.')}")
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------- header


@dataclass(frozen=True)
class DeltaHeader:
    """The parsed header of a delta file."""

    node_id: str
    local_step: int
    base_outer_step: int
    num_tokens: int | None = None
    model_fingerprint: str | None = None
    signature: str | None = None
    extra: dict[str, str] = field(default_factory=dict)
    #: the tensor dtypes this header's format allows for real keys (None: float32, bfloat16, float16)
    dtypes: tuple[torch.dtype, ...] | None = None
    #: the encoding the file's tensors are stored in; None: the plain format (float casts)
    encoding: EncodingSpec | None = None

    def to_metadata(self) -> dict[str, str]:
        md = dict(self.extra)
        if self.encoding is not None:
            md.update(self.encoding.to_metadata())
        md.update(
            format=FORMAT,
            node_id=self.node_id,
            local_step=str(self.local_step),
            base_outer_step=str(self.base_outer_step),
        )
        if self.num_tokens is not None:
            md["num_tokens"] = str(self.num_tokens)
        if self.model_fingerprint is not None:
            md["model_fingerprint"] = self.model_fingerprint
        if self.signature is not None:
            md["signature"] = self.signature
        return md


@dataclass
class Delta:
    """A validated delta: its header, its tensors (CPU), the file it came from.

    ``tensors`` are the file's tensors by name: for the plain format one per key, the
    pseudo-gradient itself; for an encoded delta the parts (``<key>``, ``<key>::scale`` ...), and
    ``encoded`` maps each key to its :class:`~diloco_lightning.encoding.EncodedTensor` (the same
    memory). :meth:`by_key` gives whichever of the two a consumer sums.
    """

    header: DeltaHeader
    tensors: dict[str, torch.Tensor]
    path: str
    nbytes: int = 0
    encoded: dict[str, EncodedTensor] | None = None
    #: the sum of the squares of the plain tensors' values, when the reader summed them as it read
    #: them (a reused buffer: ``read_delta(arena=)``), else None; NaN/inf propagate
    sumsq: float | None = None

    def by_key(self) -> dict[str, torch.Tensor | EncodedTensor]:
        """Per key of the global state: the plain tensor, or its encoding (``decode_add_`` it)."""
        return dict(self.encoded) if self.encoded is not None else dict(self.tensors)

    @property
    def encoding(self) -> EncodingSpec | None:
        return self.header.encoding

    @property
    def node_id(self) -> str:
        return self.header.node_id

    @property
    def local_step(self) -> int:
        return self.header.local_step

    @property
    def base_outer_step(self) -> int:
        return self.header.base_outer_step


KNOWN_KEYS = {"format", "node_id", "local_step", "base_outer_step", "num_tokens", "model_fingerprint", "signature",
               *ENCODING_KEYS}


def _parse_encoding(path: str | Path, md: Mapping[str, str]) -> EncodingSpec | None:
    """The header's encoding: None for the plain format (no ``encoding`` entry), a cast's spec
    when it names one (the plain format, its dtype then fixed), else the quantized spec."""
    if not any(k in md for k in ENCODING_KEYS):
        return None
    if "encoding" not in md:
        raise EncodingFileError(path, f"header has {[k for k in ENCODING_KEYS if k in md]} but no 'encoding'")
    try:
        spec = EncodingSpec.from_metadata(md)
    except ValueError as e:
        raise EncodingFileError(path, f"header 'encoding': {str(e)[:200]}") from None
    return spec


def _parse_header(path: str | Path, md: Mapping[str, str] | None) -> DeltaHeader:
    if not md or md.get("format") != FORMAT:
        got = None if not md else md.get("format")
        hint = ""
        if got is None and md and "base_outer_step" in md:
            hint = " (a Speedtronic delta? a master started with compat=speedtronic takes them)"
        shown = got if got is None or len(got) <= 40 else f"{got[:20]}...({len(got)} characters)"
        raise FormatError(path, f"header 'format' is {shown!r}, expected {FORMAT!r}{hint}")
    for k in ("node_id", "local_step", "base_outer_step"):
        if k not in md:
            raise HeaderError(path, f"header has no {k!r}")
    try:
        node_id = validate_node_id(md["node_id"])
    except InvalidNameError as e:
        raise NodeIdError(path, str(e)) from None
    try:
        local_step = parse_local_step(md["local_step"])
    except InvalidNameError as e:
        raise HeaderError(path, f"header 'local_step': {e}") from None
    try:
        base = parse_local_step(md["base_outer_step"])
    except InvalidNameError as e:
        raise HeaderError(path, f"header 'base_outer_step': {e}") from None
    num_tokens = None
    if md.get("num_tokens") not in (None, ""):
        try:
            num_tokens = parse_local_step(md["num_tokens"])
        except InvalidNameError as e:
            raise HeaderError(path, f"header 'num_tokens': {e}") from None
        if num_tokens > MAX_NUM_TOKENS:
            raise HeaderError(path, f"header 'num_tokens' is {num_tokens}, above the bound {MAX_NUM_TOKENS} (10**15)")
    fp = md.get("model_fingerprint") or None
    if fp is not None and (len(fp) != 64 or any(c not in "0123456789abcdef" for c in fp)):
        raise HeaderError(path, f"header 'model_fingerprint' is not a SHA-256 hex digest: {fp!r}")
    extra = {k: v for k, v in md.items() if k not in KNOWN_KEYS}
    encoding = _parse_encoding(path, md)
    return DeltaHeader(node_id, local_step, base, num_tokens, fp, md.get("signature") or None, extra, encoding=encoding)


#: ``(path, header metadata) -> DeltaHeader``, raising a :class:`DeltaFileError`: how a reader
#: parses a header (default :func:`parse_header`; a master in a compatibility mode passes its own)
HeaderParser = Callable[[Union[str, Path], Optional[Mapping[str, str]]], DeltaHeader]

#: the header of a ``diloco-delta/1`` file (docs/spec.md), checked
parse_header: HeaderParser = _parse_header
