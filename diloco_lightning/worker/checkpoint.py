"""A worker's state in a checkpoint: its counters, its anchor, and what it had not delivered.

:func:`pack_unsent` / :func:`unpack_unsent` turn the uploader's undelivered :class:`Job` (a
doubtful upload with its step, fresh content) into plain dicts of tensors and back, so a
checkpoint (Lightning's, or any ``torch.save``) carries them; :func:`step_offset_of` reads the
numbering offset (``worker/progress.py``), deriving it for checkpoints written before it was recorded.
:func:`pack_residual` / :func:`unpack_residual` carry the error-feedback residual (what the
encoding of the deltas sent so far dropped, owed to the next one: ``encoding/feedback.py``).
:func:`anchor_state` / :func:`load_anchor_state` are what ``DiLoCoWorker.anchor_state`` returns and
restores (its counters are :class:`~diloco_lightning.worker.progress.Progress`'s ``state_dict``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from diloco_lightning.encoding.feedback import ErrorFeedback
from diloco_lightning.worker.outbox import Outbox
from diloco_lightning.worker.params import LocalModel, anchor_copy
from diloco_lightning.worker.progress import STATE_VERSION, Progress, step_offset_of
from diloco_lightning.worker.sync import WorkerError
from diloco_lightning.worker.jobs import Job, Part, merge_jobs

__all__ = ["STATE_VERSION", "pack_unsent", "unpack_unsent", "pack_residual", "unpack_residual", "step_offset_of",
           "settle_uploads", "anchor_state", "load_anchor_state"]

log = logging.getLogger(__name__)


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


def pack_residual(feedback_state: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
    """The error-feedback residual of :meth:`ErrorFeedback.state_dict` for a checkpoint (None: zero)."""
    residual = feedback_state.get("residual")
    return None if residual is None else dict(residual)


def unpack_residual(residual: Mapping[str, torch.Tensor] | None,
                    synced: Mapping[str, torch.Tensor], *, partial: bool = False) -> dict[str, Any]:
    """Inverse of :func:`pack_residual`: the state :meth:`ErrorFeedback.load_state_dict` takes, after
    checking keys and shapes against the model's synced tensors (with fragments, their pieces;
    ``partial``: some may owe nothing, e.g. a fragment that never sent) (``ValueError`` naming the
    first that does not fit). A checkpoint without a residual owes nothing (zero)."""
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


def settle_uploads(outbox: Outbox, timeout: float, node_id: str) -> tuple[Job | None, dict[str, Any]]:
    """Before a checkpoint: what the uploader has not delivered, and its error-feedback state.

    An upload in flight is not waited for: it is recorded as a doubtful delta (``Uploader.snapshot``),
    which a worker restarted from the checkpoint settles by asking the hub whether it landed, so a
    checkpoint never stalls training on the network. Where that cannot be told (lockstep's queue, a
    fragment's delta, a doubt being settled) it waits up to ``timeout`` for the upload, as before."""
    outbox.collect()
    view = outbox.uploader.snapshot()
    held = outbox.jobs.get(None)
    if view is not None and not (view[0] is not None and held is not None and held.doubt is not None):
        outbox.collect()  # a job that ended just before the snapshot: its report (nothing ends after it)
        return view
    busy = not outbox.uploader.wait_idle(timeout)
    outbox.collect()
    if busy:
        log.warning("node %s: an upload is still running at checkpoint time; if this process dies now, "
                    "the phases it carries are not in the checkpoint", node_id)
    return None, outbox.uploader.feedback_state()


def anchor_state(progress: Progress, model: LocalModel, outbox: Outbox, feedback: Mapping[str, Any],
                 in_flight: Job | None = None) -> dict[str, Any]:
    """The anchor (CPU FP32) and whatever is not yet on the hub (held in ``outbox``, and ``in_flight``:
    the doubtful upload of :func:`settle_uploads`), with the error-feedback residual of ``feedback``
    (``ErrorFeedback.state_dict``): ``DiLoCoWorker.anchor_state``."""
    assert progress.anchor is not None  # the worker refuses before
    if model.pin:
        torch.cuda.synchronize()
    extra: dict[str, Any] = progress.frags.state()  # per fragment: its anchor's base
    if model.plan is not None:  # and its undelivered work
        extra["unsent_fragments"] = [pack_unsent(j) for n, j in sorted((k, j) for k, j in outbox.jobs.items()
                                                                      if k is not None)]
    return {
        **extra,
        **progress.counters(),
        "anchor": dict(progress.anchor),
        "unsent": pack_unsent(merge_jobs(in_flight, outbox.jobs.get(None))),
        "residual": pack_residual(feedback),
    }


def load_anchor_state(progress: Progress, model: LocalModel, outbox: Outbox, feedback: ErrorFeedback,
                      state: Mapping[str, Any]) -> None:
    """Inverse of :func:`anchor_state` (before the worker starts): ``DiLoCoWorker.load_anchor_state``."""
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION or "anchor" not in state:
        raise ValueError("not a DiLoCo anchor state")
    anchor = state["anchor"]
    frags, plan = progress.frags, model.plan
    # the anchor's entries: the synced keys, or with fragments their pieces (a split key's row ranges)
    units = frags.units(model.synced_state(), model.synced)
    frags.load(state.get("fragment_bases"))
    missing = [k for k in units if k not in anchor]
    extra = [k for k in anchor if k not in units]
    if missing or extra:
        split = plan is not None and (plan.split or any(k not in model.params for k in anchor))
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
    rows = plan.rows if plan is not None else {}
    progress.anchor = {k: anchor_copy(anchor[k], model.pin, own=k in rows) for k in units}
    progress.outer_step = int(state["outer_step"])
    progress.boundaries = int(state.get("boundaries", progress.boundaries))
    node_id = progress.node_id
    if state.get("node_id") != node_id:
        log.warning("node %s: restoring the anchor of node %s's checkpoint (its undelivered deltas stay with it)",
                    node_id, state.get("node_id"))
        return
    progress.restored = True
    try:  # keyed as the deltas are: by piece with fragments, each owed to its own fragment's next delta
        feedback.load_state_dict(unpack_residual(state.get("residual"), units, partial=plan is not None))
    except ValueError as e:
        raise WorkerError(f"the checkpoint's DiLoCo error-feedback residual does not fit this model: {e}") from None
    progress.step_offset = step_offset_of(state)
    outbox.hold(unpack_unsent(state.get("unsent"), boundaries=progress.boundaries, step_offset=progress.step_offset))
    for packed in state.get("unsent_fragments") or []:
        outbox.hold(unpack_unsent(packed, boundaries=progress.boundaries, step_offset=progress.step_offset))
