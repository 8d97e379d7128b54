"""State files: a full global state, or a nested ``state_dict()``, as one safetensors file.

No pickle anywhere (Speedtronic loads its state with ``torch.load(weights_only=False)``):
tensors go into the safetensors body, everything else (ints, floats, strings, lists,
nested dicts) into a JSON document in the header, where each tensor is replaced by
``{"__tensor__": "<flat name>"}``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file

from diloco_lightning.util.errors import DiLoCoError
from diloco_lightning.util.fileio import atomic_write, open_regular
from diloco_lightning.util.jsondoc import MAX_INT_DIGITS, load_json
from diloco_lightning.wire.layout import LayoutError, read_layout, read_tensor

STATE_FORMAT = "diloco-state/1"
_TENSOR = "__tensor__"
_FLOAT = "__float__"
_DICT = "__dict__"


class StateFileError(DiLoCoError, ValueError):
    """A state file that cannot be read or is not what its caller expects."""

    def __init__(self, path: str | Path, detail: str) -> None:
        self.path = str(path)
        self.detail = detail
        super().__init__(f"{self.path}: {detail}")


class DigestMismatchError(StateFileError):
    """The file's SHA-256 is not the one its caller was promised (a manifest's)."""


def read_tensors(path: str | Path, expect_sha256: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors (memory the caller owns) and the metadata of a safetensors file.

    With ``expect_sha256`` the file's SHA-256 is checked first, on the same open file the
    tensors are then read from: the bytes checked are the bytes loaded, even if the path is
    replaced meanwhile (``DigestMismatchError``). Malformed files raise ``StateFileError``;
    a missing one ``FileNotFoundError``.
    """
    with open_regular(path) as f:  # a held hub file: the one checked, whatever its path names now
        if expect_sha256 is not None:
            h = hashlib.sha256()
            while chunk := f.read(8 << 20):
                h.update(chunk)
            if not hmac.compare_digest(h.hexdigest(), str(expect_sha256)):
                raise DigestMismatchError(path, f"SHA-256 is {h.hexdigest()}, expected {expect_sha256}")
        try:
            layout = read_layout(f)
            tensors = {name: read_tensor(f, info) for name, info in layout.tensors.items()}
        except LayoutError as e:
            raise StateFileError(path, f"unreadable ({e})") from None
    return tensors, dict(layout.metadata)


def tensors_for_save(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors that ``safetensors.torch.save_file`` accepts.

    safetensors refuses tensors that share memory (tied weights such as an embedding
    and an output head, or one tensor stored under two names); those are cloned.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[str, int]] = set()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(t).__name__}, expected a tensor")
        t = t.detach().cpu().contiguous()
        if t.numel():
            key = (t.device.type, t.untyped_storage().data_ptr())
            if key in seen:
                t = t.clone()
            else:
                seen.add(key)
        out[name] = t
    return out


def _is_marker(obj: dict) -> bool:
    return len(obj) == 1 and next(iter(obj)) in (_TENSOR, _FLOAT, _DICT)


def pack_state_dict(sd: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """Split a nested state dict into flat CPU tensors and a JSON skeleton.

    Supported leaves: tensors, None, bools, ints (of at most ``MAX_INT_DIGITS`` digits: what every reader
    of JSON here takes), floats (inf/nan included), strings;
    containers: mappings with string keys, lists and tuples (read back as lists).
    """
    tensors: dict[str, torch.Tensor] = {}

    def enc(obj: Any, prefix: str) -> Any:
        if isinstance(obj, torch.Tensor):
            name = prefix or "_"
            if name in tensors:
                raise ValueError(f"two tensors of the state dict flatten to the same name {name!r}")
            tensors[name] = obj
            return {_TENSOR: name}
        if isinstance(obj, Mapping):
            out = {}
            for k, v in obj.items():
                if not isinstance(k, str):
                    raise TypeError(f"state dict keys must be strings, got {k!r} at {prefix!r}")
                out[k] = enc(v, f"{prefix}/{k}" if prefix else k)
            # a user dict that looks like one of our markers is wrapped, so it reads back as itself
            return {_DICT: out} if _is_marker(out) else out
        if isinstance(obj, (list, tuple)):
            return [enc(v, f"{prefix}/{i}") for i, v in enumerate(obj)]
        if isinstance(obj, float) and not math.isfinite(obj):
            return {_FLOAT: repr(obj)}
        if isinstance(obj, int) and not isinstance(obj, bool) and abs(obj) >= 10**MAX_INT_DIGITS:
            raise ValueError(f"cannot store an integer of more than {MAX_INT_DIGITS} digits at {prefix!r} in a state "
                             "file (its reader refuses it)")
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise TypeError(f"cannot store {type(obj).__name__} at {prefix!r} in a state file")

    skeleton = enc(sd, "")
    return tensors_for_save(tensors), json.dumps(skeleton, sort_keys=True, separators=(",", ":"), allow_nan=False)


def unpack_state_dict(tensors: Mapping[str, torch.Tensor], skeleton: str) -> Any:
    """Inverse of :func:`pack_state_dict`. Raises ``KeyError``/``ValueError`` on a corrupt skeleton."""

    def dec(obj: Any) -> Any:
        if isinstance(obj, dict):
            if len(obj) == 1 and _TENSOR in obj:
                name = obj[_TENSOR]
                if not isinstance(name, str) or name not in tensors:
                    raise KeyError(f"skeleton names tensor {name!r}, which the file does not hold")
                return tensors[name]
            if len(obj) == 1 and _FLOAT in obj:
                if obj[_FLOAT] not in ("inf", "-inf", "nan"):
                    raise ValueError(f"bad non-finite float {obj[_FLOAT]!r}")
                return float(obj[_FLOAT])
            if len(obj) == 1 and _DICT in obj:
                inner = obj[_DICT]
                if not isinstance(inner, dict):
                    raise ValueError(f"{_DICT} must hold an object")
                return {k: dec(v) for k, v in inner.items()}
            return {k: dec(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [dec(v) for v in obj]
        return obj

    return dec(load_json(skeleton, max_bytes=len(skeleton), max_depth=64, what="state skeleton"))


def save_state_file(path: str | Path, sd: Mapping[str, Any], metadata: Mapping[str, str] | None = None) -> int:
    """Write a nested state dict atomically; returns the file size."""
    tensors, skeleton = pack_state_dict(sd)
    md = {str(k): str(v) for k, v in (metadata or {}).items()}
    md.update(format=STATE_FORMAT, state=skeleton)
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=md))
    return Path(path).stat().st_size


def load_state_file(path: str | Path, expect_sha256: str | None = None) -> tuple[Any, dict[str, str]]:
    """Read a state file written by :func:`save_state_file` (see :func:`read_tensors`)."""
    try:
        tensors, md = read_tensors(path, expect_sha256)
    except StateFileError:
        raise
    except OSError as e:
        raise StateFileError(path, f"unreadable ({type(e).__name__}: {e})") from None
    if md.get("format") != STATE_FORMAT or "state" not in md:
        raise StateFileError(path, f"not a {STATE_FORMAT} file (format={md.get('format')!r})")
    skeleton = md.pop("state")
    try:
        return unpack_state_dict(tensors, skeleton), md
    except (KeyError, ValueError, TypeError, RecursionError) as e:
        raise StateFileError(path, f"corrupt state skeleton ({type(e).__name__}: {e})") from None


def save_weights_file(path: str | Path, state: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> int:
    """Write a flat ``name -> tensor`` state (global weights) atomically; returns the file size."""
    tensors = tensors_for_save(state)
    md = {str(k): str(v) for k, v in (metadata or {}).items()}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=md))
    return Path(path).stat().st_size


def load_weights_file(path: str | Path, expect_sha256: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a flat weights file (see :func:`read_tensors`)."""
    try:
        return read_tensors(path, expect_sha256)
    except StateFileError as e:
        if type(e) is StateFileError:
            raise StateFileError(path, f"unreadable weights file ({e.detail})") from None
        raise
    except OSError as e:
        raise StateFileError(path, f"unreadable weights file ({type(e).__name__}: {e})") from None
