"""A worker's state in a checkpoint: its counters, its anchor, and what it had not delivered.

:func:`pack_unsent` / :func:`unpack_unsent` turn the uploader's undelivered :class:`Job` (a
doubtful upload with its step, fresh content) into plain dicts of tensors and back, so a
checkpoint (Lightning's, or any ``torch.save``) carries them; :func:`step_offset_of` reads the
numbering offset, deriving it for checkpoints written before it was recorded.
:func:`pack_residual` / :func:`unpack_residual` carry the error-feedback residual (what the
encoding of the deltas sent so far dropped, owed to the next one: ``encoding/feedback.py``).
:func:`worker_state` / :func:`anchor_state` (and their ``load_`` inverses) are what
``DiLoCoWorker.state_dict`` / ``anchor_state`` return and restore.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from diloco_lightning.worker.params import anchor_copy
from diloco_lightning.worker.sync import WorkerError
from diloco_lightning.worker.uploader import Job, Part

if TYPE_CHECKING:  # the worker calls these; a runtime import would be a cycle
    from diloco_lightning.worker.core import DiLoCoWorker

__all__ = ["STATE_VERSION", "pack_unsent", "unpack_unsent", "pack_residual", "unpack_residual", "step_offset_of",
           "worker_state", "load_worker_state", "anchor_state", "load_anchor_state"]

log = logging.getLogger(__name__)

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
                    synced: Mapping[str, torch.Tensor], *, partial: bool = False) -> dict[str, Any]:
    """Inverse of :func:`pack_residual`: the state :meth:`ErrorFeedback.load_state_dict` takes, after
    checking keys and shapes against the model's synced tensors (with fragments, their pieces;
    ``partial``: some may owe nothing, e.g. a fragment that never sent) (``ValueError`` naming the
    first that does not fit). Checkpoints written before residuals existed have none (zero)."""
    if residual is None:
        return {"residual": None}
    if not isinstance(residual, Mapping):
        raise ValueError(f"expected a mapping of tensors, got {type(residual).__name__}")
    missing = [] if partial else sorted(set(synced).difference(residual))
    extra = sorted(set(residual).difference(synced))
    if missing or extra:
        raise ValueError(f"missing {missing[:5]}, unexpected {extra[:5]}")
    for k, t in residual.items():
        want = synced[k]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(want.shape) or t.is_complex() != want.is_complex():
            raise ValueError(f"{k!r} is {getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}, "
                             f"the model's is {want.dtype} {list(want.shape)}")
    return {"residual": dict(residual)}


def worker_state(w: DiLoCoWorker) -> dict[str, Any]:
    """Worker ``w``'s small counters (no tensors): ``DiLoCoWorker.state_dict``."""
    return {
        "version": STATE_VERSION,
        "node_id": w.node_id,
        "boundaries": w.boundaries,
        "outer_step": w.outer_step,
        "next_local_step": w.boundaries + 1 + w._offset(),
        "step_offset": w._offset(),
        "totals": dict(w.totals),
    }


def load_worker_state(w: DiLoCoWorker, state: Mapping[str, Any]) -> None:
    """Inverse of :func:`worker_state` (before the worker starts); another node's delivery counters are ignored."""
    if w._started:
        raise WorkerError("load_state_dict must be called before the worker starts")
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
        raise ValueError(f"not a DiLoCo worker state (version {STATE_VERSION}): {state!r:.200}")
    same_node = state.get("node_id") == w.node_id
    if not same_node:
        log.warning("node %s: ignoring the delivery counters of node %s's checkpoint", w.node_id, state.get("node_id"))
    w.boundaries = int(state["boundaries"])
    if state.get("outer_step") is not None:
        w.outer_step = int(state["outer_step"])
    if same_node:
        w.step_offset = max(w.step_offset, step_offset_of(state))
        for k, v in (state.get("totals") or {}).items():
            if k in w.totals:  # in place: the worker's outbox counts into the same dict
                w.totals[k] = type(w.totals[k])(v)


def anchor_state(w: DiLoCoWorker, timeout: float | None = None) -> dict[str, Any]:
    """Worker ``w``'s anchor (CPU FP32) and whatever is not yet on the hub: ``DiLoCoWorker.anchor_state``."""
    if w._anchor is None:
        raise WorkerError("the worker has no anchor yet (call start() first)")
    outbox = w._outbox
    if w._started:
        busy = not outbox.uploader.wait_idle(w.wait_timeout if timeout is None else timeout)
        outbox.collect()
        if busy:
            log.warning("node %s: an upload is still running at checkpoint time; if this process dies now, "
                        "the phases it carries are not in the checkpoint", w.node_id)
    if w._pin:
        torch.cuda.synchronize()
    unsent = pack_unsent(outbox.jobs.get(None))
    feedback = w._uploader.feedback_state() if w._uploader is not None else w._feedback.state_dict()
    extra: dict[str, Any] = w._frags.state()  # per fragment: its anchor's base
    if w.plan is not None:  # and its undelivered work
        extra["unsent_fragments"] = [pack_unsent(j) for n, j in sorted((k, j) for k, j in outbox.jobs.items()
                                                                      if k is not None)]
    return {
        **extra,
        "version": STATE_VERSION,
        "node_id": w.node_id,
        "outer_step": w.outer_step,
        "boundaries": w.boundaries,
        "next_local_step": w.boundaries + 1 + w._offset(),
        "step_offset": w._offset(),
        "anchor": dict(w._anchor),
        "unsent": unsent,
        "residual": pack_residual(feedback),
    }


def load_anchor_state(w: DiLoCoWorker, state: Mapping[str, Any]) -> None:
    """Inverse of :func:`anchor_state` (before the worker starts): ``DiLoCoWorker.load_anchor_state``."""
    if w._started:
        raise WorkerError("load_anchor_state must be called before the worker starts")
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION or "anchor" not in state:
        raise ValueError("not a DiLoCo anchor state")
    anchor = state["anchor"]
    # the anchor's entries: the synced keys, or with fragments their pieces (a split key's row ranges)
    units = w._frags.units({k: w.params[k].detach() for k in w.synced}, w.synced)
    w._frags.load(state.get("fragment_bases"))
    missing = [k for k in units if k not in anchor]
    extra = [k for k in anchor if k not in units]
    if missing or extra:
        split = w.plan is not None and (w.plan.split or any(k not in w.params for k in anchor))
        raise WorkerError(
            f"the checkpoint's DiLoCo anchor does not fit this model: missing {missing[:5]}, unexpected {extra[:5]}"
            + ("; it was written with the model's tensors split into fragments otherwise: resume with the same "
               "fragments" if split else "")
        )
    for k, t in units.items():
        if tuple(anchor[k].shape) != tuple(t.shape):
            raise WorkerError(
                f"the checkpoint's DiLoCo anchor has shape {list(anchor[k].shape)} for {k!r}, "
                f"the model has {list(t.shape)}"
            )
    rows = w.plan.rows if w.plan is not None else {}
    w._anchor = {k: anchor_copy(anchor[k], w._pin, own=k in rows) for k in units}
    w.outer_step = int(state["outer_step"])
    w.boundaries = int(state.get("boundaries", w.boundaries))
    if state.get("node_id") != w.node_id:
        log.warning("node %s: restoring the anchor of node %s's checkpoint (its undelivered deltas stay with it)",
                    w.node_id, state.get("node_id"))
        return
    w._restored = True
    try:  # keyed as the deltas are: by piece with fragments, each owed to its own fragment's next delta
        w._feedback.load_state_dict(unpack_residual(state.get("residual"), units, partial=w.plan is not None))
    except ValueError as e:
        raise WorkerError(f"the checkpoint's DiLoCo error-feedback residual does not fit this model: {e}") from None
    w.step_offset = step_offset_of(state)
    w._outbox.hold(unpack_unsent(state.get("unsent"), boundaries=w.boundaries, step_offset=w.step_offset))
    for packed in state.get("unsent_fragments") or []:
        w._outbox.hold(unpack_unsent(packed, boundaries=w.boundaries, step_offset=w.step_offset))
