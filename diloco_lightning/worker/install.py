"""Installing a global version into a worker's model: a whole version, an exact one, or one fragment of one.

:meth:`Installer.install_state` copies a whole global state into the params (in place: optimizer
and DDP references stay valid) and moves the anchor onto it. :meth:`Installer.install_exact` loads
version ``target`` from the hub first (lockstep, and a fresh start), re-reading the manifest when the
version was collected while being read; :meth:`Installer.install_fragment` installs one fragment of a
version (Streaming DiLoCo: the fragment's anchor moves, the others stay). :func:`check_fingerprint`
refuses a global of another model or split in other fragments. What an install changes is the
worker's :class:`~diloco_lightning.worker.progress.Progress` (anchor, base, versions seen) and the
model's tensors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import torch

from diloco_lightning.hub import Hub, HubNotFoundError
from diloco_lightning.wire.manifest import Manifest
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.worker.params import LocalModel, copy_into
from diloco_lightning.worker.progress import Progress
from diloco_lightning.worker.results import InstallResult
from diloco_lightning.worker.sync import WorkerError, load_version
from diloco_lightning.worker.waits import Waits

__all__ = ["check_fingerprint", "Installer"]

log = logging.getLogger(__name__)


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


class Installer:
    """How one worker installs versions (see the module docstring).

    Args:
        hub, model, progress: the worker's hub, model and progress.
        signing_key: a signed run's key (a version not signed with it is never installed).
        waits: the worker's waits (a manifest re-read is retried on hub errors).
        read_manifest: reads the hub's manifest, refusing an unauthenticated one.
        on_whole_install: called with the outer step of each whole version installed (the async
            prefetcher's floor).
    """

    def __init__(self, hub: Hub, model: LocalModel, progress: Progress, *, signing_key: RunKey | None, waits: Waits,
                 read_manifest: Callable[[], Manifest | None],
                 on_whole_install: Callable[[int], None] = lambda outer_step: None) -> None:
        self.hub, self.model, self.progress = hub, model, progress
        self.signing_key = signing_key
        self.waits = waits
        self.read_manifest = read_manifest
        self.on_whole_install = on_whole_install

    def check_global(self, manifest: Manifest) -> None:
        """:func:`check_fingerprint` of ``manifest`` against this worker's model and fragments."""
        check_fingerprint(manifest, self.model.fingerprint, self.progress.frags.digests(), self.hub.url)

    def install_state(self, outer_step: int, state: Mapping[str, torch.Tensor], *, newest: int | None = None,
                      fragment_steps: Mapping[str, int] | None = None) -> InstallResult:
        """Copy a whole global state into the params in place; the anchor becomes its FP32 copy.
        ``fragment_steps``: with fragments, each fragment's outer step count at that version."""
        t0 = time.perf_counter()
        model, progress = self.model, self.progress
        progress.frags.rebase_all(outer_step, fragment_steps, self.hub.url)
        try:
            kept = copy_into(model.params, {k: v for k, v in state.items() if k in model.params},
                             what=f"global version {outer_step}", required=model.synced)
        except ValueError as e:
            raise WorkerError(str(e)) from None
        for k in kept:
            log.warning("node %s: global version %d has no %r (an integer buffer); keeping the local one",
                        progress.node_id, outer_step, k)
        progress.anchor = progress.frags.anchor_of(state, model.synced, model.pin)
        previous = progress.installed(outer_step, newest, exact=True)
        self.on_whole_install(outer_step)
        return InstallResult(outer_step, progress.newest_seen - outer_step, previous, time.perf_counter() - t0)

    def install_exact(self, target: int, manifest: Manifest, deadline: float,
                      fragment: str | None = None) -> InstallResult:
        """Install version ``target`` (``manifest`` is current and at least ``target``); only
        ``fragment``'s keys when given."""
        while True:
            try:
                m, state = load_version(self.hub, manifest, target, signing_key=self.signing_key)
                if fragment is not None:
                    return self.install_fragment(fragment, target, manifest, state, newest=manifest.outer_step)
                return self.install_state(target, state, newest=manifest.outer_step,
                                          fragment_steps=manifest.fragment_steps_at(target) if self.model.plan else None)
            except HubNotFoundError:  # collected while being read: re-read the manifest
                if time.monotonic() >= deadline:
                    raise
                current = self.waits.retry("read the manifest", self.read_manifest, deadline)
                # the hub had a version a moment ago (``manifest``): a hub never goes back to no manifest
                assert current is not None, f"the manifest of {self.hub.url} disappeared"
                manifest = current

    def install_fragment(self, fragment: str, outer_step: int, manifest: Manifest,
                         state: Mapping[str, torch.Tensor], *, newest: int | None = None) -> InstallResult:
        """Copy fragment ``fragment``'s keys of version ``outer_step`` (and the integer buffers) into
        the params; that fragment's anchor becomes their FP32 copy, its base that version."""
        t0 = time.perf_counter()
        model, progress = self.model, self.progress
        frags = progress.frags
        self.check_global(manifest)
        step = frags.step_of(manifest, outer_step, fragment, self.hub.url)
        keys = frags.keys(fragment)  # piece names: whole keys, or row ranges of a split key
        synced = set(model.synced)
        what = f"global version {outer_step}"
        assert model.plan is not None  # a fragment name exists only when there is a plan
        for k in model.plan.base_keys(fragment):  # the whole tensor of a split key is checked, not only its rows
            if k not in state:
                raise WorkerError(f"{what} lacks key(s) {[k]} of this model")
            if tuple(state[k].shape) != tuple(model.params[k].shape):
                raise WorkerError(f"{what}: key {k!r} has shape {list(state[k].shape)}, the model's is "
                                  f"{list(model.params[k].shape)}")
        targets = frags.units(model.synced_state(), model.synced, fragment)
        targets.update({k: v for k, v in model.params.items() if k not in synced})
        sub = frags.units(state, model.synced, fragment)
        sub.update({k: v for k, v in state.items() if k in model.params and k not in synced})
        try:
            copy_into(targets, sub, what=what, required=list(keys))
        except ValueError as e:
            raise WorkerError(str(e)) from None
        progress.anchor = {**(progress.anchor or {}), **frags.anchor_of(state, model.synced, model.pin, fragment)}
        frags.base[fragment] = (outer_step, step)
        previous = progress.installed(outer_step, newest)
        return InstallResult(outer_step, progress.newest_seen - outer_step, previous, time.perf_counter() - t0)
