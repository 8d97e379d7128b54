"""Reading an untrusted safetensors file's layout before touching its data.

A safetensors file is ``u64 little-endian header length N`` + ``N bytes of JSON`` + the data.
The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [start, end]}``
(offsets relative to the data area) and may carry ``"__metadata__"`` (string -> string).

Every byte of a delta comes from a hub writer we do not trust, so before a single tensor
byte is read (or mapped) :func:`read_layout` checks, in bounded memory and time:

* the header length against ``max_header_bytes`` (a file announcing a 5 GB header is
  refused after reading 8 bytes);
* the JSON is an object of well-formed entries: names are strings, dtypes known codes,
  shapes short lists of small non-negative integers, offsets integers;
* the offsets tile the data area exactly (sorted, contiguous, no gap, no overlap), each
  tensor's byte count is ``numel * itemsize``, and the file size is exactly
  ``8 + N + data length`` (no trailing bytes, no truncation).

A caller then compares names, shapes and dtypes with what it expects (still without
reading data), verifies a signature by streaming the tensor bytes in fixed-size chunks
(:func:`iter_tensor_bytes`), and only then loads tensors from a file that passed.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator

from diloco_lightning.util.errors import DiLoCoError
from diloco_lightning.util.fileio import open_regular
from diloco_lightning.util.jsondoc import load_json

__all__ = [
    "DTYPE_SIZES",
    "TORCH_DTYPE_NAMES",
    "LayoutError",
    "OversizeError",
    "TensorInfo",
    "Layout",
    "positional_reader",
    "read_span",
    "read_layout",
    "iter_tensor_bytes",
    "read_tensor",
    "map_tensors",
    "torch_dtype",
    "MAX_RANK",
    "MAX_DIM",
]

#: byte size of each safetensors dtype code
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
    "BOOL": 1, "C64": 8, "C128": 16,
}
#: the dtype name torch prints (without ``torch.``) for each code: the names signatures use
TORCH_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64",
    "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool", "C64": "complex64", "C128": "complex128",
}
#: a tensor of more dimensions, or a dimension larger than this, is not a model tensor
MAX_RANK = 16
MAX_DIM = 1 << 48
_READ_CHUNK = 1 << 20


class LayoutError(DiLoCoError, ValueError):
    """The file is not a well-formed safetensors file."""


class OversizeError(LayoutError):
    """The file, or its header, is larger than the caller allows."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors code, e.g. "F32"
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    end: int  # absolute file offset one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Layout:
    """What :func:`read_layout` found: metadata, tensors (by name) and sizes."""

    metadata: dict[str, str]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    header_bytes: int = 0
    file_size: int = 0


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_layout(
    source: str | os.PathLike | BinaryIO, *, max_header_bytes: int = 100 << 20, max_file_bytes: int | None = None
) -> Layout:
    """Parse and check the layout of a safetensors file (a path, or a file opened in binary mode,
    read from its start); see the module docstring.

    Raises ``OSError`` when the file cannot be opened or read (the caller decides whether
    that is the file's fault) and :class:`LayoutError` for anything malformed, including a
    file larger than ``max_file_bytes`` or a header larger than ``max_header_bytes``.
    """
    if isinstance(source, (str, os.PathLike)):
        with open_regular(source) as opened:  # a FIFO or a device: refused at once (OSError)
            return read_layout(opened, max_header_bytes=max_header_bytes, max_file_bytes=max_file_bytes)
    f = source
    f.seek(0)
    size = os.fstat(f.fileno()).st_size
    if max_file_bytes is not None and size > max_file_bytes:
        raise OversizeError(f"file is {size} bytes, more than the {max_file_bytes} a file of this model can honestly have")
    raw = f.read(8)
    if len(raw) < 8:
        raise LayoutError(f"file is {size} bytes: too short for a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if 8 + n > size:
        raise LayoutError(f"header announces {n} bytes but the file has only {size - 8} after the length")
    if n > max_header_bytes:
        raise OversizeError(f"header announces {n} bytes, more than the {max_header_bytes} allowed")
    text = f.read(n)
    if len(text) != n:
        raise LayoutError("file shrank while its header was read")
    try:
        doc = load_json(text, max_bytes=n, max_depth=8, what="header")
    except ValueError as e:
        raise LayoutError(str(e)) from None
    if not isinstance(doc, dict):
        raise LayoutError(f"header is a JSON {type(doc).__name__}, expected an object")
    md = doc.pop("__metadata__", None)
    if md is None:
        md = {}
    if not isinstance(md, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in md.items()):
        raise LayoutError("header '__metadata__' must map strings to strings")
    data_start = 8 + n
    entries: list[tuple[int, int, str, str, tuple[int, ...]]] = []
    for name, entry in doc.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise LayoutError(f"tensor entry {name[:80]!r} must have exactly dtype, shape and data_offsets")
        dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise LayoutError(f"tensor {name[:80]!r} has unknown dtype {str(dtype)[:20]!r}")
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_int(d) and 0 <= d <= MAX_DIM for d in shape):
            raise LayoutError(f"tensor {name[:80]!r} has a malformed shape")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_int(o) and o >= 0 for o in offs) or offs[0] > offs[1]:
            raise LayoutError(f"tensor {name[:80]!r} has malformed data_offsets")
        if math.prod(shape) * DTYPE_SIZES[dtype] != offs[1] - offs[0]:
            raise LayoutError(f"tensor {name[:80]!r}: {offs[1] - offs[0]} bytes for shape {shape} of {dtype}")
        entries.append((offs[0], offs[1], name, dtype, tuple(shape)))
    # the tensors must tile the data area exactly, in offset order
    entries.sort()
    pos = 0
    for start, end, name, _, _ in entries:
        if start != pos:
            raise LayoutError(f"tensor {name[:80]!r} starts at {start}, expected {pos} (gap or overlap)")
        pos = end
    if data_start + pos != size:
        raise LayoutError(f"file is {size} bytes; its header describes {data_start + pos}")
    layout = Layout(metadata=md, header_bytes=n, file_size=size)
    for start, end, name, dtype, shape in entries:
        layout.tensors[name] = TensorInfo(name, dtype, shape, data_start + start, data_start + end)
    return layout


def torch_dtype(code: str):
    """The torch dtype of a safetensors dtype code (None if this torch has none)."""
    import torch

    name = TORCH_DTYPE_NAMES.get(code)
    return getattr(torch, name, None) if name else None


def read_tensor(f: BinaryIO, info: TensorInfo, out=None, on_values=None):
    """One tensor's bytes read from the open file into a fresh CPU tensor that owns its memory,
    or into ``out`` (a 1-D ``uint8`` tensor of exactly ``info.nbytes`` bytes, aligned for the
    dtype: a slice of a reused buffer, :class:`~diloco_lightning.wire.arena.ReadArena`), the
    tensor then being a view of it. ``on_values``: called with each run of values (a 1-D view)
    right after it is read, :data:`_READ_CHUNK` bytes at a time (while they are in cache).

    No memory map: a file truncated or rewritten under the reader can only make this read
    short (``LayoutError``), never crash the process with SIGBUS; and reading from the one
    open file keeps what was checked (a digest, a signature) and what is loaded the same bytes.
    """
    import torch

    dtype = torch_dtype(info.dtype)
    if dtype is None:
        raise LayoutError(f"tensor {info.name[:80]!r}: dtype {info.dtype} is not supported by this torch")
    if out is None:
        t = torch.empty(info.shape, dtype=dtype)
    else:
        if out.dtype != torch.uint8 or out.numel() != info.nbytes:
            raise ValueError(f"out must be {info.nbytes} uint8 bytes, got {out.numel()} {out.dtype}")
        t = out.view(dtype).reshape(info.shape)
    if info.nbytes:
        read_span(f, info, t.reshape(-1), 0, info.nbytes, on_values)
    return t


def read_span(f: BinaryIO, info: TensorInfo, flat, lo: int, hi: int, on_values=None) -> None:
    """Bytes ``[lo, hi)`` of the tensor ``info`` from the open file into the same bytes of ``flat``
    (the tensor's values, 1-D, contiguous); ``lo`` a multiple of :data:`_READ_CHUNK` (so the runs of
    values given to ``on_values`` are those of a whole read, :func:`read_tensor`). Several threads
    may each read a span of one file at once (``os.preadv``: no shared position)."""
    import torch

    buf = memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # ndarray is a buffer
    step = hi - lo if on_values is None else _READ_CHUNK
    size = DTYPE_SIZES[info.dtype]
    read_at = positional_reader(f)
    got, done = lo, lo // size
    while got < hi:
        n = read_at(buf[got:min(hi, got + step)], info.start + got)
        if not n:
            raise LayoutError(f"file ended inside tensor {info.name[:80]!r} (changed while it was read?)")
        got += n
        if on_values is not None and got // size > done:
            on_values(flat[done:got // size])
            done = got // size


def positional_reader(f: BinaryIO):
    """``read_at(buffer, offset) -> bytes read``: ``os.preadv`` on the file's descriptor (no shared
    position: several threads may read one open file at once, :class:`~diloco_lightning.util.lanes.Lanes`),
    or a seek then ``readinto`` for a file object without one."""
    try:
        fd = f.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        fd = None
    if fd is not None and hasattr(os, "preadv"):
        return lambda buf, offset: os.preadv(fd, [buf], offset)

    def read_at(buf, offset: int) -> int:
        f.seek(offset)
        return f.readinto(buf) or 0  # type: ignore[attr-defined]  # a binary file

    return read_at


def map_tensors(f: BinaryIO, layout: Layout) -> dict:
    """Every tensor of ``layout`` as a view into one private, copy-on-write memory map of the
    open file ``f`` (the inode whose layout was checked, whatever happens to the path): no copy,
    pages read as they are used. Unlike :func:`read_tensor`, a file rewritten in place or
    truncated by another process while the views live shows through (or, truncated, faults):
    use it only for files no one else writes, or whose bytes need no authentication."""
    import torch

    if layout.file_size == 0:
        return {}
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if len(mm) != layout.file_size:
        mm.close()
        raise LayoutError("the file changed size since its layout was read")
    out = {}
    for name, info in layout.tensors.items():
        dtype = torch_dtype(info.dtype)
        if dtype is None:
            raise LayoutError(f"tensor {name[:80]!r}: dtype {info.dtype} is not supported by this torch")
        if info.numel == 0:
            out[name] = torch.empty(info.shape, dtype=dtype)
        else:
            out[name] = torch.frombuffer(mm, dtype=dtype, count=info.numel, offset=info.start).reshape(info.shape)
    return out


def iter_tensor_bytes(f: BinaryIO, info: TensorInfo, chunk: int = _READ_CHUNK) -> Iterator[bytes]:
    """The raw bytes of one tensor, ``chunk`` bytes at a time (bounded memory)."""
    f.seek(info.start)
    left = info.nbytes
    while left > 0:
        b = f.read(min(chunk, left))
        if not b:
            raise LayoutError(f"file ended inside tensor {info.name[:80]!r}")
        left -= len(b)
        yield b
