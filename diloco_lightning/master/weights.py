"""A global state as the master holds it: what it must be (:func:`check_state`), a CPU copy, and how
far a step moved it (:func:`update_distance`, the outer update's L2 norm, in slices: no temporary of a
key's size; on the round's lanes, summed in the order one thread takes them)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from diloco_lightning.wire.delta import is_synced
from diloco_lightning.util.lanes import Lanes

__all__ = ["check_state", "cpu_clone", "owns_its_memory", "update_distance"]


def check_state(state: Any, what: str) -> Mapping[str, torch.Tensor]:
    """``state`` if it is a non-empty ``str -> Tensor`` mapping with a floating tensor and no NaN or
    infinite value, else ``ValueError`` naming the problem (a run started from NaN weights would
    refuse every delta, every round)."""
    if not isinstance(state, Mapping) or not state:
        raise ValueError(f"{what} must be a non-empty mapping of str to Tensor")
    for k, v in state.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise ValueError(f"{what} must map str to Tensor; entry {str(k)[:80]!r} is {type(v).__name__}")
    if not any(is_synced(v) for v in state.values()):
        raise ValueError(f"{what} has no floating point tensor to train")
    for k, v in state.items():
        if not is_synced(v):
            continue
        if v.dtype not in _GLOBAL_DTYPES:
            raise ValueError(f"{what}: {k[:80]!r} is {str(v.dtype).removeprefix('torch.')}; the outer optimizer updates "
                             f"{', '.join(str(d).removeprefix('torch.') for d in _GLOBAL_DTYPES)} weights")
        if v.numel() and not bool(torch.isfinite(v).all()):
            raise ValueError(f"{what}: {k[:80]!r} holds NaN or infinite values")
    return state


#: the floating (and complex) dtypes a global state's synced tensors may have
_GLOBAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64, torch.complex128)


def cpu_clone(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def owns_its_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` is the whole of its storage, contiguous (not a view into a larger buffer)."""
    return (t.is_contiguous() and t.data_ptr() == t.untyped_storage().data_ptr()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


#: elements per slice of :func:`update_distance` (4 MiB of FP32): its temporaries stay that small
_DISTANCE_SLICE = 1 << 20


def update_distance(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor], lanes: Lanes | None = None) -> float:
    """``|new - old|`` over the synced keys (the outer update's L2 norm), a slice of a key at a
    time: ``torch.dist`` of a whole key makes a temporary of its size (71 MB for a 25M model's
    embedding), which was the round's peak memory. With ``lanes``, the slices side by side, their
    squares summed in the same order (the same float)."""
    pairs = [(t, old[k]) for k, t in new.items() if k in old and is_synced(t) and old[k].shape == t.shape]

    def slice_sq(a: torch.Tensor, b: torch.Tensor) -> float:
        real = not a.is_complex()  # FP32 arithmetic for half precision; a complex key keeps its imaginary part
        x, y = (a.float(), b.float()) if real else (a, b)
        return float(torch.dist(x, y)) ** 2

    total = 0.0
    with torch.no_grad():
        spans = None
        if lanes is not None:
            spans = lanes.over_spans(slice_sq, pairs, _DISTANCE_SLICE * 4)  # 4 bytes an FP32 value: the same slices
            if spans is not None and any(a.element_size() != 4 for a, _ in pairs):
                spans = None  # slices are counted in values: only FP32 keys slice the same way in bytes
        if spans is None:
            spans = [[slice_sq(a.reshape(-1)[i:i + _DISTANCE_SLICE], b.reshape(-1)[i:i + _DISTANCE_SLICE])
                      for i in range(0, a.numel(), _DISTANCE_SLICE)] for a, b in pairs]
        for squares in spans:
            for sq in squares:
                total += sq
    return math.sqrt(total)
