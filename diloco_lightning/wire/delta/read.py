"""Reading a delta file (``diloco-delta/1``): a reader that validates everything.

:func:`read_delta` checks the file's layout, its header, its names, shapes and dtypes before a
tensor byte is read, then reads the tensors from the one open file (authenticated in a signed
run), and reports each problem as a :class:`~diloco_lightning.wire.delta.header.DeltaFileError`
subclass (``wire/delta/header.py``).

Encoded deltas (issue 14): a header entry ``encoding`` (``int8``, ``int4``, ``topk``, with
``encoding_block_size`` and, for top-k, ``encoding_topk`` / ``encoding_topk_values``) says that
each key is stored as the parts of ``docs/encoding.md`` (``<key>`` the codes, ``<key>::scale``
...). The float casts are the plain format and carry no ``encoding`` entry, so their files are
byte for byte the plain safetensors format (any reader of it reads them). The reader checks every part's dtype and
shape against the model's shapes from the header alone (the file is then exactly the honest size
of that encoding), then the values (finite scales, codes in range, top-k positions), and refuses
a malformed encoding with the reason ``encoding`` (:func:`_read_encoded`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from diloco_lightning.wire.delta.header import (
    COMPLEX_DELTA_DTYPES,
    DELTA_DTYPES,
    ENCODED_SLACK_PER_KEY,
    HEADER_BYTES_BASE,
    HEADER_BYTES_PER_TENSOR,
    MAX_PARTS,
    Delta,
    DeltaHeader,
    DtypeError,
    EncodingFileError,
    ExtraKeyError,
    FingerprintMismatchError,
    HeaderParser,
    MissingKeyError,
    NonFiniteError,
    PathMismatchError,
    ShapeMismatchError,
    SignatureError,
    SizeError,
    UnreadableDeltaError,
    parse_header,
    synced_keys,
)
from diloco_lightning.encoding import EncodedTensor, EncodingError, check_layout, part_name, split_part_name
from diloco_lightning.util.fileio import open_regular
from diloco_lightning.wire.names import parse_delta_path
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.wire.arena import ReadArena
from diloco_lightning.wire.layout import (
    DTYPE_SIZES, LayoutError, OversizeError, map_tensors, read_layout, read_span, read_tensor,
)

__all__ = ["max_header_bytes", "max_delta_bytes", "read_delta", "read_delta_header"]

_ST_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "C64": torch.complex64,
}


_ST_CODE_OF = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}  # a cast's dtype -> its code


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
    return (header_parser or parse_header)(path, _layout(path, path, max_header=max_header, max_file=None).metadata)


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
    arena: ReadArena | None = None,
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
    cache): only for a file no other process can write (a remote hub's download in this process's
    cache): a mapped file truncated by its writer kills the reader with SIGBUS, and one rewritten
    in place changes what was checked.

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
            ``signature`` (``SignatureError``); see :mod:`diloco_lightning.wire.signing`.
        check_finite: reject NaN/inf values (``NonFiniteError``).
        clone: kept for compatibility (see ``copy``).
        max_file_bytes: refuse larger files (default: :func:`max_delta_bytes` of ``reference``).
        copy: read the tensors into owned memory (True) or map the file (False: never for a file
            another process can write; see above).
        header_parser: parses and checks the header (default :func:`parse_header`); the dtypes
            its :class:`DeltaHeader` allows (``dtypes``) replace float32/bfloat16/float16.
        arena: with ``copy``, read the tensors into this reused buffer (owned memory, no page
            faults after the first read): the returned tensors are then views of it, valid
            until the next read into the same arena (the master's round, which folds each delta
            into its sum before it reads the next).
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
        # one open file for the checks and the read: what is checked is what is read; a FIFO or a device
        # (a link to /dev/zero) is refused at once, never waited on nor read without end
        f = open_regular(path)  # a held hub file (the folder hub's download): the inode that was checked
    except OSError as e:
        raise UnreadableDeltaError(path, f"cannot open ({type(e).__name__}: {e.strerror or e})") from None
    with f:
        return _read_open_delta(f, path, path_str, want, reference, max_header, max_file_bytes, hub_path,
                                expected_fingerprint, signing_key, check_finite, copy, header_parser or parse_header,
                                arena if copy else None)


def _read_open_delta(f, path, path_str, want, reference, max_header, max_file_bytes, hub_path,
                     expected_fingerprint, signing_key, check_finite, copy, header_parser, arena=None) -> Delta:
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
    if spec is not None and spec.cast_dtype is None:
        return _read_encoded(f, path, path_str, layout, header, spec, want, reference, signing_key, expected_fingerprint,
                             copy, arena)
    if want is not None:
        _check_keys(path, names, want)
    cast = None if spec is None else _ST_CODE_OF[spec.cast_dtype]  # a header naming a cast fixes the dtype
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
    tensors, nbytes, sumsq = _read_tensors(f, path, layout, names, raw_md, signing_key, copy, arena)
    _check_fingerprint(path, header, expected_fingerprint)
    if check_finite:
        for name in names:
            if not bool(torch.isfinite(tensors[name]).all()):
                raise NonFiniteError(path, f"key {name!r} contains NaN or inf")
    return Delta(header=header, tensors=tensors, path=path_str, nbytes=nbytes, sumsq=sumsq)


def _arena_slots(layout, names, arena: ReadArena | None) -> dict[str, torch.Tensor]:
    """Where each tensor of ``names`` lands in ``arena``: at its offset in the file's data area (the
    layout checked that the tensors tile it, so the arena holds exactly the data, at most the file's
    bounded size). A tensor whose offset is not a multiple of its item size (no honest writer's) or
    that is empty gets no slot: it is read into a fresh tensor."""
    infos = [layout.tensors[n] for n in names]
    if arena is None or not infos:
        return {}
    by_key = arena.slots({i.name: i.nbytes for i in infos})  # the adopted per-key tensors, if they fit
    if by_key is not None:
        return {n: s for n, s in by_key.items() if s.numel() and s.numel() % DTYPE_SIZES[layout.tensors[n].dtype] == 0}
    base = min(i.start for i in infos)
    data = arena.take(max(i.start + i.nbytes for i in infos) - base)
    return {i.name: data[i.start - base:i.start - base + i.nbytes] for i in infos
            if i.nbytes and (i.start - base) % DTYPE_SIZES[i.dtype] == 0}


def _chunk_norm(info):
    """The norm of one run of values as :func:`_read_summing` takes it (half precision in FP32,
    as ``validation.delta_norm`` does)."""
    acc = torch.float32 if info.dtype in ("BF16", "F16") else None
    return lambda values: float(torch.linalg.vector_norm(values, dtype=acc))


def _read_summing(f, info, slot: torch.Tensor) -> tuple[torch.Tensor, float]:
    """:func:`read_tensor` into ``slot``, and the sum of the squares of its values, each chunk's
    taken right after it is read (in cache: the norm costs no second pass over memory)."""
    norm = _chunk_norm(info)
    total = [0.0]

    def add(values: torch.Tensor) -> None:
        part = norm(values)
        total[0] += part * part

    t = read_tensor(f, info, slot, on_values=add)
    return t, total[0]


#: bytes of one tensor a lane reads at a time (a multiple of the read chunk: the same runs of values
#: are normed, so the sum of squares is the bits of one thread's)
_SPAN = 8 << 20


def _read_spans(f, path, layout, names, slots, lanes) -> list[tuple[torch.Tensor, float | None]]:
    """Every tensor of ``names`` (each with a slot, or empty) read into its slot in spans of
    :data:`_SPAN` bytes on ``lanes``, each span's runs of values normed as read; per tensor, its
    view and the sum of the squares of its values, folded in the order one thread takes them."""
    spans = [(n, lo, min(lo + _SPAN, layout.tensors[n].nbytes))
             for n in names for lo in range(0, layout.tensors[n].nbytes, _SPAN)]

    def read_piece(span: tuple[str, int, int]) -> list[float]:
        name, lo, hi = span
        info = layout.tensors[name]
        norm, parts = _chunk_norm(info), []
        flat = slots[name].view(_ST_DTYPES[info.dtype])
        try:
            read_span(f, info, flat, lo, hi, on_values=lambda v: parts.append(norm(v)))
        except (OSError, LayoutError) as e:
            raise UnreadableDeltaError(path, f"cannot read tensor {name[:80]!r} ({type(e).__name__}: {e})") from None
        return parts

    done = iter(lanes.run(read_piece, spans, [hi - lo for _, lo, hi in spans]))
    out: list[tuple[torch.Tensor, float | None]] = []
    for name in names:
        info = layout.tensors[name]
        if not info.nbytes:
            out.append((torch.empty(info.shape, dtype=_ST_DTYPES[info.dtype]), None))
            continue
        total = 0.0
        for _ in range(0, info.nbytes, _SPAN):
            for part in next(done):
                total += part * part
        out.append((slots[name].view(_ST_DTYPES[info.dtype]).reshape(info.shape), total))
    return out


def _read_tensors(f, path, layout, names, raw_md, signing_key, copy,
                  arena: ReadArena | None = None) -> tuple[dict[str, torch.Tensor], int, float | None]:
    """Every tensor of the checked ``layout``, from the one open file ``f``, the signature (a
    signed run) verified over exactly the bytes read; with ``arena`` (and ``copy``), into its
    reused buffer, the sum of the squares of the values taken as they are read (else None)."""
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
    slots = _arena_slots(layout, names, arena) if mapped is None else {}

    def read_one(name: str) -> tuple[torch.Tensor, float | None]:
        info = layout.tensors[name]
        try:
            slot = slots.get(name)
            if slot is not None and info.dtype in _ST_DTYPES:
                return _read_summing(f, info, slot)
            return (read_tensor(f, info, slot) if mapped is None else mapped[name]), None
        except (OSError, LayoutError) as e:
            raise UnreadableDeltaError(path, f"cannot read tensor {name[:80]!r} ({type(e).__name__}: {e})") from None

    lanes = arena.lanes if arena is not None and slots and mac is None else None
    if lanes is not None and all(layout.tensors[n].dtype in _ST_DTYPES and (n in slots or not layout.tensors[n].nbytes)
                                 for n in names):
        read = _read_spans(f, path, layout, names, slots, lanes)  # side by side, folded in order
    else:  # one at a time: a signed delta's MAC takes each tensor as it is read
        read = []
        for name in names:
            read.append(read_one(name))
            if mac is not None:
                signing_key.add_tensor(mac, name, read[-1][0])
    sumsq: float | None = 0.0 if slots else None
    for name, (t, sq) in zip(names, read):
        if sq is not None:
            sumsq = None if sumsq is None else sumsq + sq
        else:
            sumsq = None if layout.tensors[name].nbytes else sumsq  # an empty tensor adds nothing
        nbytes += layout.tensors[name].nbytes
        tensors[name] = t
    if mac is not None and not signing_key.finish_verify(mac, raw_md["signature"]):
        raise SignatureError(path, "signature does not match (wrong run key, or the file was altered)")
    return tensors, nbytes, sumsq


def _check_keys(path, present, want) -> None:
    """The delta holds exactly the keys ``want``: MissingKeyError or ExtraKeyError (names cut short:
    they are a hub writer's text) otherwise."""
    missing = sorted(set(want).difference(present))
    if missing:
        raise MissingKeyError(path, f"missing key(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    extra = sorted(set(present).difference(want))
    if extra:
        shown = [n[:80] for n in extra[:5]]
        raise ExtraKeyError(path, f"unexpected key(s) {shown}{' ...' if len(extra) > 5 else ''}")


def _check_fingerprint(path, header: DeltaHeader, expected: str | None) -> None:
    if expected is not None and header.model_fingerprint is not None and header.model_fingerprint != expected:
        raise FingerprintMismatchError(
            path, f"model_fingerprint {header.model_fingerprint[:12]}... != global {expected[:12]}..."
        )


def _read_encoded(f, path, path_str, layout, header, spec, want, reference, signing_key, expected_fingerprint,
                  copy, arena: ReadArena | None = None) -> Delta:
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
    _check_keys(path, parts, want)
    for key in want:
        found = {p: (layout.tensors[n].dtype, layout.tensors[n].shape) for p, n in parts[key].items()}
        try:
            check_layout(found, reference[key].shape, spec, complex=reference[key].is_complex(), key=key[:80])
        except EncodingError as e:
            raise EncodingFileError(path, str(e)[:400]) from None
    tensors, nbytes, _ = _read_tensors(f, path, layout, sorted(layout.tensors), layout.metadata, signing_key, copy, arena)
    _check_fingerprint(path, header, expected_fingerprint)
    encoded: dict[str, EncodedTensor] = {}
    for key in want:
        try:
            encoded[key] = EncodedTensor.from_parts({p: tensors[n] for p, n in parts[key].items()}, reference[key].shape,
                                                    spec, complex=reference[key].is_complex(), key=key[:80])
        except EncodingError as e:
            raise EncodingFileError(path, str(e)[:400]) from None
    return Delta(header=header, tensors=tensors, path=path_str, nbytes=nbytes, encoded=encoded)
