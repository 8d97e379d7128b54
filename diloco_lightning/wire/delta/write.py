"""Writing a delta file (``diloco-delta/1``): :func:`write_delta`.

The header, its parser and the errors are in :mod:`diloco_lightning.wire.delta.header`, the
validating reader in :mod:`diloco_lightning.wire.delta.read`; :mod:`diloco_lightning.wire.delta`
exports the public names of the three. A float cast is written in the plain format (no
``encoding`` entry: byte for byte the plain safetensors format); a quantized or top-k
delta stores each key as the parts of ``docs/encoding.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import save_file

from diloco_lightning.encoding import PART_SEP, EncodedTensor, EncodingSpec
from diloco_lightning.util.fileio import atomic_write
from diloco_lightning.wire.delta.header import (
    KNOWN_KEYS,
    COMPLEX_DELTA_DTYPES,
    DELTA_DTYPES,
    MAX_NUM_TOKENS,
    DeltaHeader,
)
from diloco_lightning.wire.names import validate_local_step, validate_node_id
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.wire.statefile import tensors_for_save


# ----------------------------------------------------------------------------- write


def _file_tensors(tensors: Mapping[str, torch.Tensor | EncodedTensor]) -> tuple[dict[str, torch.Tensor], EncodingSpec | None]:
    """The file's tensors, and the quantized encoding they are in (None: the plain format)."""
    out: dict[str, torch.Tensor] = {}
    specs = set()
    plain = []
    for name, t in tensors.items():
        if isinstance(t, EncodedTensor) and t.spec.cast_dtype is not None:  # a cast: the plain format
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
    (:func:`diloco_lightning.encoding.feedback.encode_delta`): a float cast is written in the plain
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
        extra={k: str(v) for k, v in (extra_metadata or {}).items() if k not in KNOWN_KEYS},
        encoding=encoding,
    )
    md = header.to_metadata()
    if signing_key is not None:
        md["signature"] = signing_key.sign(md, out)
    atomic_write(path, lambda tmp: save_file(out, str(tmp), metadata=md))
    return Path(path).stat().st_size
