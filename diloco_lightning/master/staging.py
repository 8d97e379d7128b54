"""Staging a version for publication: the weights and optimizer-state files, written and hashed in one pass.

Produces exactly the files of :func:`diloco_lightning.hub.versions.stage_global` (a flat
safetensors weights file with ``outer_step`` in its metadata; a ``diloco-state/1`` state
file for the optimizer), readable by :func:`~diloco_lightning.hub.versions.load_global` and
:func:`~diloco_lightning.hub.versions.load_outer_state`, but faster on the master's hot path:

* the safetensors body is written straight from the tensors' memory, and the SHA-256 the
  manifest needs is computed from the same buffers on a second thread while the file is
  written (``stage_global`` writes, then reads the file back to hash it);
* no fsync: the files are staged under fresh unique names in the master's own folder, the
  hub makes its own durable copy at publication, and the local record that names them is
  only trusted after their SHA-256 is checked again at load (``localstate``); but the disk is
  asked to start writing every 8 MB as it is written (``fileio.start_writeback``), so the fsync
  of a folder hub, which links the staged file, finds it written.

Falls back to ``stage_global``'s writers for a dtype safetensors cannot name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping

import torch

from diloco_lightning.wire.delta import model_fingerprint
from diloco_lightning.util.fileio import sha256_file, start_writeback, write_all
from diloco_lightning.hub.versions import StagedGlobal
from diloco_lightning.wire.names import global_outer_state_path, global_weights_path
from diloco_lightning.wire.statefile import STATE_FORMAT, pack_state_dict, save_state_file, save_weights_file

__all__ = ["stage_version", "write_safetensors_hashed"]

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _name in ("uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = "U" + _name[4:]


def _raw(t: torch.Tensor):
    """The tensor's bytes (little-endian, C order) as a buffer, without a copy when it is CPU-contiguous."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8).numpy()


#: bytes written then hashed at a time (the hash reads them from the cache the write left them in)
_PIECE = 1 << 20
#: bytes written before the disk is asked to start on them (``start_writeback``): the hub's fsync at
#: publication then finds the file on disk instead of writing all of it
_WRITEBACK = 8 << 20


def write_safetensors_hashed(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> str:
    """Write a safetensors file at ``path`` (no fsync) and return its SHA-256 hex digest.

    Raises ``ValueError`` for a dtype safetensors has no name for.
    """
    if sys.byteorder != "little":  # pragma: no cover - safetensors is little-endian
        raise ValueError("write_safetensors_hashed needs a little-endian machine")
    names = sorted(tensors)
    header: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    offset = 0
    for name in names:
        t = tensors[name]
        code = _DTYPES.get(t.dtype)
        if code is None:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors name")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((8 - (8 + len(hjson)) % 8) % 8)
    h = hashlib.sha256()
    prefix = len(hjson).to_bytes(8, "little") + hjson
    h.update(prefix)
    with open(path, "wb", buffering=0) as f:
        fd = f.fileno()
        written = flushed = write_all(fd, prefix)
        for name in names:
            t = tensors[name]
            if t.numel() == 0:
                continue
            buf = memoryview(_raw(t))
            for i in range(0, len(buf), _PIECE):  # each piece hashed right after it is written: still in cache
                piece = buf[i:i + _PIECE]
                written += write_all(fd, piece)
                h.update(piece)
                if written - flushed >= _WRITEBACK:  # the disk writes while the rest is written and hashed
                    start_writeback(fd, flushed, written - flushed)
                    flushed = written
        start_writeback(fd, flushed, written - flushed)
    return h.hexdigest()



def _stage_weights(path: Path, outer_step: int, state: Mapping[str, torch.Tensor]) -> str:
    """Write the weights file at ``path``; its SHA-256."""
    try:
        return write_safetensors_hashed(path, state, {"outer_step": str(outer_step)})
    except ValueError:
        save_weights_file(path, state, metadata={"outer_step": str(outer_step)})
        return sha256_file(path)


def _stage_outer_state(path: Path, outer_step: int, outer_state: Mapping[str, Any]) -> str:
    """Write the optimizer-state file at ``path``; its SHA-256."""
    try:
        tensors, skeleton = pack_state_dict(outer_state)
        md = {"outer_step": str(outer_step), "format": STATE_FORMAT, "state": skeleton}
        return write_safetensors_hashed(path, tensors, md)
    except ValueError:
        save_state_file(path, outer_state, metadata={"outer_step": str(outer_step)})
        return sha256_file(path)


def stage_version(
    workdir: str | os.PathLike,
    outer_step: int,
    state: Mapping[str, torch.Tensor],
    outer_state: Mapping[str, Any] | None,
    *,
    token: str | None = None,
) -> StagedGlobal:
    """Write ``state`` and ``outer_state`` into ``workdir`` under their hub names (fresh token).

    The two files are written and hashed at the same time (the weights on a thread of their own):
    SHA-256 is the publication's largest cost (0.1-0.2 s per 100 MB here) and runs without the
    GIL, so two free cores halve it; each piece is hashed right after it is written, from the
    cache. A failure removes what was written and raises."""
    token = token or secrets.token_hex(8)
    workdir = Path(workdir)
    weights = global_weights_path(outer_step, token)
    local_weights = workdir / Path(weights).name
    outer_path = global_outer_state_path(outer_step, token) if outer_state is not None else None
    local_state = workdir / Path(outer_path).name if outer_path is not None else None
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-stage") as pool:
            job = pool.submit(_stage_weights, local_weights, outer_step, state)
            try:
                state_sha = None
                if local_state is not None and outer_state is not None:
                    state_sha = _stage_outer_state(local_state, outer_step, outer_state)
            finally:
                sha = job.result()  # waited for even when the other failed: nothing is left writing
    except BaseException:
        for f in (local_weights, local_state):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.unlink()
        raise
    staged = StagedGlobal(
        outer_step=outer_step,
        token=token,
        weights=weights,
        weights_sha256=sha,
        model_fingerprint=model_fingerprint(state),
        files={weights: local_weights},
    )
    if outer_path is not None and local_state is not None:
        staged.outer_state = outer_path
        staged.outer_state_sha256 = state_sha
        staged.files[outer_path] = local_state
    return staged
