"""The delta file (``diloco-delta/1``): writing, and a reader that validates everything.

A delta is a safetensors file holding the pseudo-gradient ``anchor - local`` of one
worker's inner phase, one tensor per floating (or complex) key of the global state,
with a header (safetensors metadata, all strings) that says who made it and from
which global version (``base_outer_step``). See SPEC.md for the contract.

:func:`read_delta` reports each problem as a :class:`DeltaFileError` subclass whose
``reason`` is a short code (``"unreadable"``, ``"format"``, ...); the master logs and
counts rejections by that code.

Encoded deltas (issue 14): a header entry ``encoding`` (``int8``, ``int4``, ``topk``, with
``encoding_block_size`` and, for top-k, ``encoding_topk`` / ``encoding_topk_values``) says that
each key is stored as the parts of ``docs/encoding.md`` (``<key>`` the codes, ``<key>::scale``
...). The float casts are the plain format and carry no ``encoding`` entry, so their files are
byte for byte what they were before encodings existed. The reader checks every part's dtype and
shape against the model's shapes from the header alone (the file is then exactly the honest size
of that encoding), then the values (finite scales, codes in range, top-k positions), and refuses
a malformed encoding with the reason ``encoding``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Union

import torch
from safetensors.torch import save_file

from diloco_lightning.encoding import (
    PART_SEP,
    EncodedTensor,
    EncodingError,
    EncodingSpec,
    check_layout,
    part_name,
    split_part_name,
)
from diloco_lightning.fileio import atomic_write
from diloco_lightning.names import (
    InvalidNameError,
    parse_delta_path,
    parse_local_step,
    validate_local_step,
    validate_node_id,
)
from diloco_lightning.signing import RunKey
from diloco_lightning.statefile import tensors_for_save
from diloco_lightning.stheader import LayoutError, OversizeError, map_tensors, read_layout, read_tensor

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
#: the most tensors one key of the model becomes in a file (top-k: codes, scale, idx, count)
MAX_PARTS = 4
#: what an encoding may take beyond FP32 for one key: a 1-value tensor's int8 top-k (1 code byte,
#: a 4-byte scale, a 2-byte position, a 4-byte count) is 11 bytes against 4 (docs/encoding.md)
ENCODED_SLACK_PER_KEY = 16
#: the header entries that name a delta's encoding (EncodingSpec.to_metadata)
ENCODING_KEYS = ("encoding", "encoding_block_size", "encoding_topk", "encoding_topk_values")

__all__ = [
    "FORMAT",
    "Delta",
    "DeltaHeader",
    "DeltaFileError",
    "UnreadableDeltaError",
    "FormatError",
    "HeaderError",
    "NodeIdError",
    "PathMismatchError",
    "MissingKeyError",
    "ExtraKeyError",
    "ShapeMismatchError",
    "DtypeError",
    "NonFiniteError",
    "FingerprintMismatchError",
    "SignatureError",
    "SizeError",
    "EncodingFileError",
    "MAX_NUM_TOKENS",
    "max_header_bytes",
    "max_delta_bytes",
    "is_synced",
    "synced_keys",
    "model_fingerprint",
    "write_delta",
    "read_delta",
    "read_delta_header",
    "parse_header",
    "HeaderParser",
]


# ----------------------------------------------------------------------------- errors


class DeltaFileError(ValueError):
    """A delta file the reader refuses. ``reason`` is a stable short code, ``path`` the file."""

    reason = "invalid"

    def __init__(self, path: str | Path, detail: str) -> None:
        self.path = str(path)
        self.detail = detail
        super().__init__(f"{self.path}: {self.reason}: {detail}")


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


_KNOWN_KEYS = {"format", "node_id", "local_step", "base_outer_step", "num_tokens", "model_fingerprint", "signature",
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
    extra = {k: v for k, v in md.items() if k not in _KNOWN_KEYS}
    encoding = _parse_encoding(path, md)
    return DeltaHeader(node_id, local_step, base, num_tokens, fp, md.get("signature") or None, extra, encoding=encoding)


#: ``(path, header metadata) -> DeltaHeader``, raising a :class:`DeltaFileError`: how a reader
#: parses a header (default :func:`parse_header`; a master in a compatibility mode passes its own)
HeaderParser = Callable[[Union[str, Path], Optional[Mapping[str, str]]], DeltaHeader]

#: the header of a ``diloco-delta/1`` file (SPEC.md), checked
parse_header: HeaderParser = _parse_header


# ----------------------------------------------------------------------------- write


def _file_tensors(tensors: Mapping[str, torch.Tensor | EncodedTensor]) -> tuple[dict[str, torch.Tensor], EncodingSpec | None]:
    """The file's tensors, and the quantized encoding they are in (None: the plain format)."""
    out: dict[str, torch.Tensor] = {}
    specs = set()
    plain = []
    for name, t in tensors.items():
        if isinstance(t, EncodedTensor) and t.spec.value_encoding is None:  # a cast: the plain format
            q = t.parts["q"]
            if t.complex and q.dtype != torch.float32:
                raise ValueError(f"delta tensor {name!r} is complex: it travels as complex64, not {t.spec.name}")
            t = torch.view_as_complex(q) if t.complex else q
        if isinstance(t, EncodedTensor):
            if PART_SEP in name:
                raise ValueError(f"key {name!r} contains {PART_SEP!r}: it cannot be told apart from an encoded part")
            specs.add(t.spec)
            for fname, part in t.file_tensors(name).items():
                if part.device.type != "cpu":
                    raise ValueError(f"delta tensor {fname!r} is on {part.device}; move it to the CPU first")
                out[fname] = part
            continue
        if not isinstance(t, torch.Tensor) or t.dtype not in DELTA_DTYPES + COMPLEX_DELTA_DTYPES:
            raise ValueError(f"delta tensor {name!r} has dtype {getattr(t, 'dtype', type(t).__name__)}; expected "
                             "float32, bfloat16 or float16 (or an EncodedTensor)")
        if t.device.type != "cpu":
            raise ValueError(f"delta tensor {name!r} is on {t.device}; move it to the CPU first")
        plain.append(name)
        out[name] = t
    if len(specs) > 1 or (specs and plain):
        raise ValueError("a delta is in one encoding: every key encoded with the same EncodingSpec, or none")
    return out, next(iter(specs), None)


def write_delta(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor | EncodedTensor],
    *,
    node_id: str,
    local_step: int,
    base_outer_step: int,
    num_tokens: int | None = None,
    model_fingerprint: str | None = None,
    signing_key: RunKey | None = None,
    extra_metadata: Mapping[str, str] | None = None,
) -> int:
    """Write a delta file atomically; returns its size in bytes.

    ``tensors`` are CPU tensors of dtype float32, bfloat16 or float16 (complex64 for complex
    parameters), or :class:`~diloco_lightning.encoding.EncodedTensor` of one encoding
    (:func:`diloco_lightning.compression.encode_delta`): a float cast is written in the plain
    format, int8/int4/top-k as their parts with the encoding in the header. The file is written to
    a temporary name beside ``path``, fsynced and renamed, so readers never see a partial file.
    """
    validate_node_id(node_id)
    validate_local_step(local_step)
    validate_local_step(base_outer_step)
    if num_tokens is not None:
        validate_local_step(num_tokens)
        if num_tokens > MAX_NUM_TOKENS:
            raise ValueError(f"num_tokens {num_tokens} is above the bound {MAX_NUM_TOKENS}")
    out, encoding = _file_tensors(tensors)
    out = tensors_for_save(out)
    header = DeltaHeader(
        node_id=node_id,
        local_step=local_step,
        base_outer_step=base_outer_step,
        num_tokens=num_tokens,
        model_fingerprint=model_fingerprint,
        extra={k: str(v) for k, v in (extra_metadata or {}).items() if k not in _KNOWN_KEYS},
        encoding=encoding,
    )
    md = header.to_metadata()
    if signing_key is not None:
        md["signature"] = signing_key.sign(md, out)
    atomic_write(path, lambda tmp: save_file(out, str(tmp), metadata=md))
    return Path(path).stat().st_size


# ----------------------------------------------------------------------------- read


_ST_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "C64": torch.complex64,
}


_ST_CODE_OF = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


_ST_NAMES = {"F64": "float64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C128": "complex128"}


def _stored_dtype(code: str) -> str:
    """A readable dtype name for a safetensors dtype code (``"I64"`` -> ``"int64"`` ...)."""
    if code in _ST_DTYPES:
        return str(_ST_DTYPES[code]).removeprefix("torch.")
    if code in _ST_NAMES:
        return _ST_NAMES[code]
    if code[:1] in ("I", "U") and code[1:].isdigit():
        return f"{'int' if code[0] == 'I' else 'uint'}{code[1:]}"
    return code


def max_header_bytes(num_tensors: int) -> int:
    """The largest header an honest delta of a model of ``num_tensors`` synced tensors may have
    (each key may be stored as up to :data:`MAX_PARTS` tensors, 1 KiB of header each)."""
    return HEADER_BYTES_BASE + HEADER_BYTES_PER_TENSOR * MAX_PARTS * max(0, num_tensors)


def max_delta_bytes(reference: Mapping[str, torch.Tensor]) -> int:
    """The largest file an honest delta of ``reference`` can be: every synced key in FP32
    (complex64 for complex keys), the widest dtype a delta may use, plus what an encoding may
    add for a tiny tensor (:data:`ENCODED_SLACK_PER_KEY`), plus the header budget. A listing
    that reports more is refused before anything is downloaded."""
    keys = synced_keys(reference)
    data = sum(reference[k].numel() * (8 if reference[k].is_complex() else 4) + ENCODED_SLACK_PER_KEY for k in keys)
    return 8 + max_header_bytes(len(keys)) + data


def _layout(source, path: str | Path, *, max_header: int, max_file: int | None):
    try:
        return read_layout(source, max_header_bytes=max_header, max_file_bytes=max_file)
    except OversizeError as e:
        raise SizeError(path, str(e)) from None
    except LayoutError as e:
        raise UnreadableDeltaError(path, f"not a safetensors file: {e}") from None
    except OSError as e:
        raise UnreadableDeltaError(path, f"cannot open ({type(e).__name__}: {e.strerror or e})") from None


def read_delta_header(path: str | Path, *, max_header: int = 100 << 20, header_parser: HeaderParser | None = None) -> DeltaHeader:
    """Parse and check the header only (no tensor byte is read; the file's layout is checked)."""
    return (header_parser or _parse_header)(path, _layout(path, path, max_header=max_header, max_file=None).metadata)


def read_delta(
    path: str | Path,
    *,
    reference: Mapping[str, torch.Tensor] | None = None,
    hub_path: str | None = None,
    expected_fingerprint: str | None = None,
    signing_key: RunKey | None = None,
    check_finite: bool = True,
    clone: bool = True,
    max_file_bytes: int | None = None,
    copy: bool = True,
    header_parser: HeaderParser | None = None,
) -> Delta:
    """Read and validate a delta file, checking everything it can before reading tensor data.

    Checks, in this order (the first failing one is raised):

    1. the file's layout (``UnreadableDeltaError``: missing, truncated, garbage, offsets that
       do not tile the data; ``SizeError``: a file above ``max_file_bytes`` (default, with a
       ``reference``: :func:`max_delta_bytes`) or a header above the honest budget);
    2. the header (``FormatError``, ``HeaderError``, ``NodeIdError``);
    3. header ``node_id``/``local_step`` against the hub path (``PathMismatchError``);
    4. the tensor names against ``reference`` (``MissingKeyError``, ``ExtraKeyError``), then per
       tensor shape (``ShapeMismatchError``) and dtype (``DtypeError``): all from the header,
       so a file holding anything but what a delta of this model holds is refused unread;
    5. in a signed run, the signature (``SignatureError``: missing, malformed, wrong key,
       altered file), computed over the bytes as they are read: the tensors are returned
       only if it matches, and the file is read exactly once;
    6. the fingerprint (``FingerprintMismatchError``);
    7. NaN/inf (``NonFiniteError``) when ``check_finite``.

    Tensors come from the one open file whose layout was checked. With ``copy`` (the default)
    they are read into memory the process owns: a reader's memory is at most the honest size of
    a delta, and a file rewritten or truncated meanwhile cannot change what was checked (nor
    crash the reader). ``copy=False`` maps the file instead (no copy, the speed of the page
    cache): right for a file no one else can write (a remote hub's download in this process's
    cache) or whose bytes need no authentication.

    Args:
        path: the local file.
        reference: the global state; when given, the delta must carry exactly its
            floating/complex keys, with the same shapes, real keys as float32/bfloat16/
            float16 and complex keys as complex64.
        hub_path: the file's hub path (``nodes/<node>/delta_<step>.safetensors``);
            header ``node_id`` / ``local_step`` must match it (``PathMismatchError``).
            Defaults to ``path`` itself when ``path`` ends like a hub path.
        expected_fingerprint: when given and the header carries ``model_fingerprint``,
            they must be equal (``FingerprintMismatchError``).
        signing_key: when given (a signed run), the header must carry a valid
            ``signature`` (``SignatureError``); see :mod:`diloco_lightning.signing`.
        check_finite: reject NaN/inf values (``NonFiniteError``).
        clone: kept for compatibility (see ``copy``).
        max_file_bytes: refuse larger files (default: :func:`max_delta_bytes` of ``reference``).
        copy: read the tensors into owned memory (True) or map the file (False); see above.
        header_parser: parses and checks the header (default :func:`parse_header`); the dtypes
            its :class:`DeltaHeader` allows (``dtypes``) replace float32/bfloat16/float16.
    """
    del clone
    path_str = str(path)
    if reference is not None:
        want = synced_keys(reference)
        max_header = max_header_bytes(len(want))
        if max_file_bytes is None:
            max_file_bytes = max_delta_bytes(reference)
    else:
        want = None
        max_header = 100 << 20
    try:
        f = open(path_str, "rb")  # one open file for the checks and the read: what is checked is what is read
    except OSError as e:
        raise UnreadableDeltaError(path, f"cannot open ({type(e).__name__}: {e.strerror or e})") from None
    with f:
        return _read_open_delta(f, path, path_str, want, reference, max_header, max_file_bytes, hub_path,
                                expected_fingerprint, signing_key, check_finite, copy, header_parser or _parse_header)


def _read_open_delta(f, path, path_str, want, reference, max_header, max_file_bytes, hub_path,
                     expected_fingerprint, signing_key, check_finite, copy, header_parser) -> Delta:
    layout = _layout(f, path, max_header=max_header, max_file=max_file_bytes)
    raw_md = layout.metadata
    header = header_parser(path, raw_md)
    real_dtypes = header.dtypes or DELTA_DTYPES
    ident = None
    if hub_path is not None:
        ident = parse_delta_path(hub_path)
        if ident is None:
            raise PathMismatchError(path, f"hub path {hub_path!r} is not nodes/<node_id>/delta_<step>.safetensors")
    else:
        parts = Path(path_str).parts
        if len(parts) >= 3:
            ident = parse_delta_path("/".join(parts[-3:]))
    if ident is not None:
        if header.node_id != ident.node_id:
            raise PathMismatchError(path, f"header node_id {header.node_id!r} != path node_id {ident.node_id!r}")
        if header.local_step != ident.local_step:
            raise PathMismatchError(path, f"header local_step {header.local_step} != path local_step {ident.local_step}")

    names = sorted(layout.tensors)
    spec = header.encoding
    if spec is not None and spec.value_encoding is not None:
        return _read_encoded(f, path, path_str, layout, header, spec, want, reference, signing_key, expected_fingerprint,
                             copy)
    if want is not None:
        missing = sorted(set(want).difference(names))
        if missing:
            raise MissingKeyError(path, f"missing key(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        extra = sorted(set(names).difference(want))
        if extra:
            shown = [n[:80] for n in extra[:5]]
            raise ExtraKeyError(path, f"unexpected key(s) {shown}{' ...' if len(extra) > 5 else ''}")
    cast = None if spec is None else _ST_CODE_OF[spec.name]  # a header naming a cast fixes the dtype
    for name in names:
        info = layout.tensors[name]
        if reference is not None and tuple(reference[name].shape) != info.shape:
            raise ShapeMismatchError(
                path, f"key {name!r} has shape {list(info.shape)}, global state has {list(reference[name].shape)}"
            )
        if reference is None:
            allowed = real_dtypes + COMPLEX_DELTA_DTYPES
        else:
            allowed = COMPLEX_DELTA_DTYPES if reference[name].is_complex() else real_dtypes
        if cast is not None and info.dtype not in (cast, "C64"):
            raise DtypeError(path, f"key {name[:80]!r} has dtype {_stored_dtype(info.dtype)}; the header says "
                                   f"encoding {spec.name}")  # type: ignore[union-attr]
        if _ST_DTYPES.get(info.dtype) not in allowed:
            raise DtypeError(
                path,
                f"key {name[:80]!r} has dtype {_stored_dtype(info.dtype)}, "
                f"expected one of {[str(d).removeprefix('torch.') for d in allowed]}",
            )
    tensors, nbytes = _read_tensors(f, path, layout, names, raw_md, signing_key, copy)
    _check_fingerprint(path, header, expected_fingerprint)
    if check_finite:
        for name in names:
            if not bool(torch.isfinite(tensors[name]).all()):
                raise NonFiniteError(path, f"key {name!r} contains NaN or inf")
    return Delta(header=header, tensors=tensors, path=path_str, nbytes=nbytes)


def _read_tensors(f, path, layout, names, raw_md, signing_key, copy) -> tuple[dict[str, torch.Tensor], int]:
    """Every tensor of the checked ``layout``, from the one open file ``f``, the signature (a
    signed run) verified over exactly the bytes read."""
    mac = None
    if signing_key is not None:
        # authenticity next: an unsigned file is rejected as such before a tensor byte is read
        if "signature" not in raw_md:
            raise SignatureError(path, "the run is signed but this delta carries no signature")
        mac = signing_key.start_message(raw_md)
    tensors: dict[str, torch.Tensor] = {}
    nbytes = 0
    try:
        mapped = None if copy else map_tensors(f, layout)
    except (OSError, ValueError) as e:
        raise UnreadableDeltaError(path, f"cannot map the file ({type(e).__name__}: {e})") from None
    for name in names:
        info = layout.tensors[name]
        try:
            t = read_tensor(f, info) if mapped is None else mapped[name]
        except (OSError, LayoutError) as e:
            raise UnreadableDeltaError(path, f"cannot read tensor {name[:80]!r} ({type(e).__name__}: {e})") from None
        if mac is not None:
            signing_key.add_tensor(mac, name, t)
        nbytes += info.nbytes
        tensors[name] = t
    if mac is not None and not signing_key.finish_verify(mac, raw_md["signature"]):
        raise SignatureError(path, "signature does not match (wrong run key, or the file was altered)")
    return tensors, nbytes


def _check_fingerprint(path, header: DeltaHeader, expected: str | None) -> None:
    if expected is not None and header.model_fingerprint is not None and header.model_fingerprint != expected:
        raise FingerprintMismatchError(
            path, f"model_fingerprint {header.model_fingerprint[:12]}... != global {expected[:12]}..."
        )


def _read_encoded(f, path, path_str, layout, header, spec, want, reference, signing_key, expected_fingerprint,
                  copy) -> Delta:
    """An encoded delta: every key's parts checked against the model's shapes from the header (so
    the file is exactly the honest size of this encoding) before any data is read, then read and
    authenticated like a plain delta, then each key's parts validated (``EncodingFileError``)."""
    if reference is None:
        raise EncodingFileError(path, f"an {spec.name}-encoded delta is read against the model's shapes (reference=)")
    parts: dict[str, dict[str, str]] = {}  # key -> part -> file name
    for name in layout.tensors:
        key, part = split_part_name(name)
        if part_name(key, part) != name:  # "w::q": the codes are stored as "w" itself
            raise EncodingFileError(path, f"tensor {name[:80]!r} is not a part name (codes are stored as the key)")
        parts.setdefault(key, {})[part] = name
    missing = sorted(set(want).difference(parts))
    if missing:
        raise MissingKeyError(path, f"missing key(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    extra = sorted(set(parts).difference(want))
    if extra:
        shown = [n[:80] for n in extra[:5]]
        raise ExtraKeyError(path, f"unexpected key(s) {shown}{' ...' if len(extra) > 5 else ''}")
    for key in want:
        found = {p: (layout.tensors[n].dtype, layout.tensors[n].shape) for p, n in parts[key].items()}
        try:
            check_layout(found, reference[key].shape, spec, complex=reference[key].is_complex(), key=key[:80])
        except EncodingError as e:
            raise EncodingFileError(path, str(e)[:400]) from None
    tensors, nbytes = _read_tensors(f, path, layout, sorted(layout.tensors), layout.metadata, signing_key, copy)
    _check_fingerprint(path, header, expected_fingerprint)
    encoded: dict[str, EncodedTensor] = {}
    for key in want:
        try:
            encoded[key] = EncodedTensor.from_parts({p: tensors[n] for p, n in parts[key].items()}, reference[key].shape,
                                                    spec, complex=reference[key].is_complex(), key=key[:80])
        except EncodingError as e:
            raise EncodingFileError(path, str(e)[:400]) from None
    return Delta(header=header, tensors=tensors, path=path_str, nbytes=nbytes, encoded=encoded)
