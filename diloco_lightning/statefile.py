"""State files: a full global state, or a nested ``state_dict()``, as one safetensors file.

No pickle anywhere (Speedtronic loads its state with ``torch.load(weights_only=False)``):
tensors go into the safetensors body, everything else (ints, floats, strings, lists,
nested dicts) into a JSON document in the header, where each tensor is replaced by
``{"__tensor__": "<flat name>"}``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from diloco_lightning.fileio import atomic_write

STATE_FORMAT = "diloco-state/1"
_TENSOR = "__tensor__"
_FLOAT = "__float__"


class StateFileError(ValueError):
    """A state file that cannot be read or is not what its caller expects."""

    def __init__(self, path: str | Path, detail: str) -> None:
        self.path = str(path)
        super().__init__(f"{self.path}: {detail}")


def pack_state_dict(sd: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """Split a nested state dict into flat CPU tensors and a JSON skeleton."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(obj: Any, prefix: str) -> Any:
        if isinstance(obj, torch.Tensor):
            name = prefix or "_"
            assert name not in tensors, name
            tensors[name] = obj.detach().cpu().contiguous()
            return {_TENSOR: name}
        if isinstance(obj, Mapping):
            out = {}
            for k, v in obj.items():
                if not isinstance(k, str):
                    raise TypeError(f"state dict keys must be strings, got {k!r} at {prefix!r}")
                out[k] = enc(v, f"{prefix}/{k}" if prefix else k)
            return out
        if isinstance(obj, (list, tuple)):
            return [enc(v, f"{prefix}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, float) and not math.isfinite(obj):
            return {_FLOAT: repr(obj)}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise TypeError(f"cannot store {type(obj).__name__} at {prefix!r} in a state file")

    skeleton = enc(sd, "")
    return tensors, json.dumps(skeleton, sort_keys=True, separators=(",", ":"))


def unpack_state_dict(tensors: Mapping[str, torch.Tensor], skeleton: str) -> Any:
    def dec(obj: Any) -> Any:
        if isinstance(obj, dict):
            if set(obj) == {_TENSOR}:
                return tensors[obj[_TENSOR]]
            if set(obj) == {_FLOAT}:
                return float(obj[_FLOAT])
            return {k: dec(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [dec(v) for v in obj]
        return obj

    return dec(json.loads(skeleton))


def save_state_file(path: str | Path, sd: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> int:
    """Write a nested state dict atomically; returns the file size."""
    tensors, skeleton = pack_state_dict(sd)
    md = {str(k): str(v) for k, v in (metadata or {}).items()}
    md.update(format=STATE_FORMAT, state=skeleton)
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=md))
    return Path(path).stat().st_size


def load_state_file(path: str | Path) -> tuple[Any, dict[str, str]]:
    """Read a state file written by :func:`save_state_file`; tensors are cloned out of the mapping."""
    try:
        with safe_open(str(path), framework="pt") as f:
            md = dict(f.metadata() or {})
            if md.get("format") != STATE_FORMAT or "state" not in md:
                raise StateFileError(path, f"not a {STATE_FORMAT} file (format={md.get('format')!r})")
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    except StateFileError:
        raise
    except Exception as e:
        raise StateFileError(path, f"unreadable ({type(e).__name__}: {e})") from None
    skeleton = md.pop("state")
    try:
        return unpack_state_dict(tensors, skeleton), md
    except (KeyError, ValueError) as e:
        raise StateFileError(path, f"corrupt state skeleton ({e})") from None


def save_weights_file(path: str | Path, state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> int:
    """Write a flat ``name -> tensor`` state (global weights) atomically; returns the file size."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    md = {str(k): str(v) for k, v in (metadata or {}).items()}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=md))
    return Path(path).stat().st_size


def load_weights_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a flat weights file; tensors are cloned (they outlive the file)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            md = dict(f.metadata() or {})
            return {k: f.get_tensor(k).clone() for k in f.keys()}, md
    except Exception as e:
        raise StateFileError(path, f"unreadable weights file ({type(e).__name__}: {e})") from None
