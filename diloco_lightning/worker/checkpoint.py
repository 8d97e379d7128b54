"""A worker's state in a checkpoint: its counters, its anchor, and what it had not delivered.

:func:`pack_unsent` / :func:`unpack_unsent` turn the uploader's undelivered :class:`Job` (a
doubtful upload with its step, fresh content) into plain dicts of tensors and back, so a
checkpoint (Lightning's, or any ``torch.save``) carries them; :func:`step_offset_of` reads the
numbering offset, deriving it for checkpoints written before it was recorded.
:func:`pack_residual` / :func:`unpack_residual` carry the error-feedback residual (what the
encoding of the deltas sent so far dropped, owed to the next one: ``compression.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from diloco_lightning.worker.uploader import Job, Part

__all__ = ["STATE_VERSION", "pack_unsent", "unpack_unsent", "pack_residual", "unpack_residual", "step_offset_of"]

STATE_VERSION = 1


def _pack(part: Part, **extra: Any) -> dict[str, Any]:
    out = {**extra, "base_outer_step": part.base_outer_step, "num_tokens": part.num_tokens, "phases": part.phases,
           "boundary": part.boundary, "tensors": part.materialize()}
    if part.fragment is not None:
        out.update(fragment=part.fragment, base_fragment_step=part.base_fragment_step)
    return out


def _frag(d: Mapping[str, Any]) -> dict[str, Any]:
    if d.get("fragment") is None:
        return {}
    return {"fragment": str(d["fragment"]), "base_fragment_step": int(d["base_fragment_step"])}


def pack_unsent(job: Job | None) -> dict[str, Any] | None:
    """The undelivered work of a worker, as plain dicts (tensors materialized: the checkpoint owns them)."""
    if job is None or job.empty:
        return None
    out: dict[str, Any] = {}
    if job.fresh is not None:
        out["fresh"] = _pack(job.fresh)
    if job.doubt is not None:
        step, part = job.doubt
        out["doubt"] = _pack(part, local_step=step)
    return out


def unpack_unsent(unsent: Mapping[str, Any] | None, *, boundaries: int, step_offset: int) -> Job | None:
    """Inverse of :func:`pack_unsent` (``boundaries`` / ``step_offset``: the checkpoint's, for parts
    written before their boundary was recorded)."""
    if not unsent:
        return None
    job = Job()
    if unsent.get("fresh"):
        f = unsent["fresh"]
        job.fresh = Part(int(f["base_outer_step"]), f["num_tokens"], int(f["phases"]),
                         residual={k: v.float() if not v.is_complex() else v for k, v in f["tensors"].items()},
                         boundary=int(f.get("boundary", boundaries)), **_frag(f))
    if unsent.get("doubt"):
        d = unsent["doubt"]
        step = int(d["local_step"])
        job.doubt = (step, Part(int(d["base_outer_step"]), d["num_tokens"], int(d["phases"]),
                                residual=dict(d["tensors"]), boundary=int(d.get("boundary", step - step_offset)),
                                **_frag(d)))
    return job


def step_offset_of(state: Mapping[str, Any]) -> int:
    """The checkpoint's ``step_offset`` (derived for checkpoints written before it was recorded)."""
    if state.get("step_offset") is not None:
        return int(state["step_offset"])
    return max(0, int(state.get("next_local_step", 1)) - int(state.get("boundaries", 0)) - 1)


def pack_residual(feedback_state: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
    """The error-feedback residual of :meth:`ErrorFeedback.state_dict` for a checkpoint (None: zero)."""
    residual = feedback_state.get("residual")
    return None if residual is None else dict(residual)


def unpack_residual(residual: Mapping[str, torch.Tensor] | None,
                    synced: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Inverse of :func:`pack_residual`: the state :meth:`ErrorFeedback.load_state_dict` takes, after
    checking keys and shapes against the model's synced tensors (``ValueError`` naming the first
    that does not fit). Checkpoints written before residuals existed have none (zero)."""
    if residual is None:
        return {"residual": None}
    if not isinstance(residual, Mapping):
        raise ValueError(f"expected a mapping of tensors, got {type(residual).__name__}")
    missing = sorted(set(synced).difference(residual))
    extra = sorted(set(residual).difference(synced))
    if missing or extra:
        raise ValueError(f"missing {missing[:5]}, unexpected {extra[:5]}")
    for k, t in residual.items():
        want = synced[k]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(want.shape) or t.is_complex() != want.is_complex():
            raise ValueError(f"{k!r} is {getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}, "
                             f"the model's is {want.dtype} {list(want.shape)}")
    return {"residual": dict(residual)}
