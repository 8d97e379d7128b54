"""Installing a global version into a worker's model: an exact version, or one fragment of one.

``DiLoCoWorker.install_state`` copies a whole global state into the params (in place:
optimizer and DDP references stay valid) and moves the anchor onto it. :func:`install_exact`
loads version ``target`` from the hub first (lockstep, and a fresh start), re-reading the
manifest when the version was collected while being read; :func:`install_fragment` installs
one fragment of a version (Streaming DiLoCo: the fragment's anchor moves, the others stay).
:func:`check_fingerprint` refuses a global of another model or split in other fragments.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from diloco_lightning.hub import HubNotFoundError
from diloco_lightning.wire.manifest import Manifest
from diloco_lightning.worker.params import copy_into
from diloco_lightning.worker.results import InstallResult
from diloco_lightning.worker.sync import WorkerError, load_version

if TYPE_CHECKING:  # the worker calls these; a runtime import would be a cycle
    from diloco_lightning.worker.core import DiLoCoWorker

__all__ = ["check_fingerprint", "check_global", "install_exact", "install_fragment"]


def check_fingerprint(manifest: Manifest, fingerprint: str, digests: list[str] | None, url: str) -> None:
    """Refuse a global of another model (``fingerprint``) or split in other fragments (``digests``:
    this worker's fragment key digests, None without fragments)."""
    if manifest.model_fingerprint != fingerprint:
        raise WorkerError(
            f"the global on {url} (outer_step {manifest.outer_step}) has model fingerprint "
            f"{manifest.model_fingerprint}, this model has {fingerprint}: the hub holds another model "
            f"(different parameter names, shapes or dtypes)"
        )
    theirs = [f["keys_sha256"] for f in manifest.fragments] if manifest.fragments else None
    if theirs != digests:
        def say(x: list[str] | None) -> str:
            return "no fragments" if x is None else f"{len(x)} fragments"
        raise WorkerError(
            f"the run on {url} syncs {say(theirs)}, this worker {say(digests)}"
            f"{' split another way' if theirs and digests and len(theirs) == len(digests) else ''}: "
            f"give the worker the master's fragments option (diloco.fragments)"
        )


def check_global(w: DiLoCoWorker, manifest: Manifest) -> None:
    """:func:`check_fingerprint` of ``manifest`` against worker ``w``'s model and fragments."""
    check_fingerprint(manifest, w.fingerprint, w._frags.digests(), w.hub.url)


def install_exact(w: DiLoCoWorker, target: int, manifest: Manifest, deadline: float,
                  fragment: str | None = None) -> InstallResult:
    """Install version ``target`` into worker ``w`` (``manifest`` is current and at least
    ``target``); only ``fragment``'s keys when given."""
    while True:
        try:
            m, state = load_version(w.hub, manifest, target, signing_key=w.signing_key)
            if fragment is not None:
                return install_fragment(w, fragment, target, manifest, state, newest=manifest.outer_step)
            return w.install_state(target, state, newest=manifest.outer_step,
                                   fragment_steps=manifest.fragment_steps_at(target) if w.plan else None)
        except HubNotFoundError:  # collected while being read: re-read the manifest
            if time.monotonic() >= deadline:
                raise
            current = w._waits.retry("read the manifest", w._read_manifest, deadline)
            # the hub had a version a moment ago (``manifest``): a hub never goes back to no manifest
            assert current is not None, f"the manifest of {w.hub.url} disappeared"
            manifest = current


def install_fragment(w: DiLoCoWorker, fragment: str, outer_step: int, manifest: Manifest,
                     state: Mapping[str, torch.Tensor], *, newest: int | None = None) -> InstallResult:
    """Copy fragment ``fragment``'s keys of version ``outer_step`` (and the integer buffers) into
    worker ``w``'s params; that fragment's anchor becomes their FP32 copy, its base that version."""
    t0 = time.perf_counter()
    check_global(w, manifest)
    step = w._frags.step_of(manifest, outer_step, fragment, w.hub.url)
    keys = w._frags.keys(fragment)  # piece names: whole keys, or row ranges of a split key
    synced = set(w.synced)
    what = f"global version {outer_step}"
    assert w.plan is not None  # a fragment name exists only when there is a plan
    for k in w.plan.base_keys(fragment):  # the whole tensor of a split key is checked, not only its rows
        if k not in state:
            raise WorkerError(f"{what} lacks key(s) {[k]} of this model")
        if tuple(state[k].shape) != tuple(w.params[k].shape):
            raise WorkerError(f"{what}: key {k!r} has shape {list(state[k].shape)}, the model's is "
                              f"{list(w.params[k].shape)}")
    targets = w._frags.units({k: w.params[k].detach() for k in w.synced}, w.synced, fragment)
    targets.update({k: v for k, v in w.params.items() if k not in synced})
    sub = w._frags.units(state, w.synced, fragment)
    sub.update({k: v for k, v in state.items() if k in w.params and k not in synced})
    try:
        copy_into(targets, sub, what=what, required=list(keys))
    except ValueError as e:
        raise WorkerError(str(e)) from None
    w._anchor = {**(w._anchor or {}), **w._frags.anchor_of(state, w.synced, w._pin, fragment)}
    w._frags.base[fragment] = (outer_step, step)
    previous = w.outer_step
    w.outer_step = outer_step if previous is None else max(previous, outer_step)
    w._newest_seen = max(w._newest_seen, outer_step, -1 if newest is None else newest)
    w.totals["installs_total"] += 1
    return InstallResult(outer_step, w._newest_seen - outer_step, previous, time.perf_counter() - t0)
