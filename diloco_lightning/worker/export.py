"""A boundary's export: the local weights snapshotted (CPU FP32) and the anchor moved onto them.

:func:`export_part` is step 1 and 2 of a boundary (``worker/core.py``'s module docstring): it copies
the weights the delta covers (every synced key, or with Streaming DiLoCo fragments one fragment's
pieces) into a :class:`~diloco_lightning.worker.jobs.Part` beside the anchor they are measured from,
and moves the anchor on, so the next delta covers only the next inner phase. The uploader computes,
encodes and sends ``anchor - snapshot`` in the background.
"""

from __future__ import annotations

from diloco_lightning.worker.jobs import Part
from diloco_lightning.worker.params import LocalModel, snapshot
from diloco_lightning.worker.progress import Progress

__all__ = ["export_part"]


def export_part(model: LocalModel, progress: Progress, num_tokens: int | None, fragment: str | None = None) -> Part:
    """Snapshot ``model``'s weights (CPU FP32) and move ``progress``'s anchor onto them
    (``fragment``'s only); the part to deliver, numbered as the boundary after ``progress.boundaries``."""
    frags = progress.frags
    keys = model.synced if fragment is None else frags.keys(fragment)
    # a fragment's pieces: whole tensors or views of their rows (detached: no autograd view)
    source = model.params if fragment is None else frags.units(model.synced_state(), model.synced, fragment)
    snap, event = snapshot(source, keys, model.pin)
    if fragment is not None:
        base, fbase = frags.base[fragment]
        anchor = progress.anchor or {}
        part = Part(base, num_tokens, 1, anchor={k: anchor[k] for k in keys}, snapshot=snap, event=event,
                    boundary=progress.boundaries + 1, fragment=fragment, base_fragment_step=fbase)
        progress.anchor = {**anchor, **snap}  # a new dict: the part's own anchor dict is never touched
        return part
    # every boundary comes after start(), which installed or restored a version
    assert progress.outer_step is not None
    part = Part(progress.outer_step, num_tokens, 1, anchor=progress.anchor, snapshot=snap, event=event,
                boundary=progress.boundaries + 1)
    progress.anchor = snap
    return part
