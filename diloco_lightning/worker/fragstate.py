"""A worker's per-fragment bookkeeping (Streaming DiLoCo: Douillard et al. 2025, section 2.2).

With fragments (``diloco_lightning/wire/fragments.py``) the boundary r sends only fragment
``plan.fragment_at(r)``'s pseudo-gradient and installs only that fragment of a newer global
version. :class:`FragmentBook` keeps, per fragment, the base of its anchor (``base_outer_step``
and the fragment's own outer step count: the master gates a fragment delta on the latter), the
tokens trained on since its last delta, and the newest prefetched version whose fragments are
installed one by one (each at its turn). Without fragments (``plan`` None) it holds nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from diloco_lightning.wire.fragments import FragmentPlan
from diloco_lightning.wire.manifest import Manifest
from diloco_lightning.worker.params import anchor_copy
from diloco_lightning.worker.sync import WorkerError

__all__ = ["FragmentBook"]


class FragmentBook:
    """Per fragment: the anchor's base, the tokens since the last delta, the newest prefetched version."""

    def __init__(self, plan: FragmentPlan | None) -> None:
        self.plan = plan
        #: per fragment: (base_outer_step, the fragment's outer step count) of its anchor
        self.base: dict[str, tuple[int, int]] = {}
        #: per fragment: tokens trained on since its last delta
        self._tokens: dict[str, int | None] = {n: 0 for n in (plan.names if plan else ())}
        #: the newest prefetched version, whose fragments are installed one by one
        self._latest: tuple[Manifest, dict[str, torch.Tensor]] | None = None
        #: the fragments that did not have their turn at the kept version yet
        self._pending: set[str] = set()

    def keys(self, fragment: str) -> tuple[str, ...]:
        """The fragment's piece names (whole keys, or row ranges ``key[start:stop]``: fragments.py)."""
        assert self.plan is not None  # a fragment name exists only when there is a plan
        return self.plan.keys[fragment]

    def units(self, state: Mapping[str, torch.Tensor], synced: Sequence[str],
              fragment: str | None = None) -> dict[str, torch.Tensor]:
        """``state``'s tensors as the anchor holds them, by name: every key of ``synced`` without
        fragments; with fragments every piece (only ``fragment``'s when given), a row piece as a
        view of its rows."""
        if self.plan is None:
            return {k: state[k] for k in synced}
        if fragment is not None:
            return self.plan.substate(fragment, state)
        return self.plan.pieces({k: state[k] for k in synced})

    def anchor_of(self, state: Mapping[str, torch.Tensor], synced: Sequence[str], pin: bool,
                  fragment: str | None = None) -> dict[str, torch.Tensor]:
        """:meth:`units` of ``state`` as anchor tensors (CPU FP32; a row piece in memory of its own)."""
        rows = self.plan.rows if self.plan is not None else {}
        return {u: anchor_copy(t, pin, own=u in rows) for u, t in self.units(state, synced, fragment).items()}

    def digests(self) -> list[str] | None:
        """The fragments' key digests (what the manifest's ``fragments`` must list), None without fragments."""
        return [self.plan.digest(n) for n in self.plan.names] if self.plan is not None else None

    def tokens(self, fragment: str | None, num_tokens: int | None) -> int | None:
        """The tokens a fragment's delta covers: those since that fragment's last delta."""
        if fragment is None:
            return num_tokens
        for name, n in self._tokens.items():
            self._tokens[name] = None if n is None or num_tokens is None else n + num_tokens
        tokens, self._tokens[fragment] = self._tokens[fragment], 0
        return tokens

    def rebase_all(self, outer_step: int, fragment_steps: Mapping[str, int] | None, url: str) -> None:
        """A whole version is installed: every fragment's anchor has that base."""
        if self.plan is None:
            return
        if fragment_steps is None or set(fragment_steps) != set(self.plan.names):
            raise WorkerError(f"global version {outer_step} on {url} does not say its fragments' outer steps")
        self.base = {n: (outer_step, int(fragment_steps[n])) for n in self.plan.names}

    def step_of(self, manifest: Manifest, outer_step: int, fragment: str, url: str) -> int:
        """``fragment``'s outer step count at version ``outer_step`` (as ``manifest`` records it)."""
        steps = manifest.fragment_steps_at(outer_step)
        if steps is None or fragment not in steps:
            raise WorkerError(f"global version {outer_step} on {url} does not say its fragments' outer steps")
        return int(steps[fragment])

    def updated(self, fragment: str, steps: Mapping[str, int] | None) -> bool:
        """Whether a version whose fragments' outer step counts are ``steps`` updated ``fragment``
        since this worker's anchor of it (only then is the fragment installed from it; the simulator
        asks the same)."""
        return steps is not None and fragment in steps and steps[fragment] > self.base[fragment][1]

    def keep(self, manifest: Manifest, state: Mapping[str, torch.Tensor]) -> None:
        """A newer prefetched version: its fragments are installed one by one (:meth:`take`)."""
        self._latest = (manifest, dict(state))
        self._pending = set(self.plan.names) if self.plan is not None else set()

    def take(self, fragment: str, synced: list[str]) -> tuple[Manifest, dict[str, torch.Tensor]] | None:
        """The kept version, when it updated ``fragment`` since this worker's anchor of it (the
        caller installs that fragment from it). The fragment's tensors are dropped from the kept
        version either way (they are of no more use), so it is freed once every fragment had its
        turn (``synced``: every key a kept version may still hold)."""
        if self._latest is None:
            return None
        m, state = self._latest
        assert self.plan is not None  # a fragment name exists only when there is a plan
        keys = self.plan.base_keys(fragment)
        due = self.updated(fragment, m.fragment_steps_at(m.outer_step)) and all(k in state for k in keys)
        # the caller installs before the keys are dropped: hand it the fragment's tensors
        picked = (m, dict(state)) if due else None
        self._pending.discard(fragment)
        # a key split by rows is dropped once every fragment holding rows of it had its turn
        needed = {k for n in self._pending for k in self.plan.base_keys(n)}
        for k in keys:
            if k not in needed:
                state.pop(k, None)
        if not any(k in state for k in synced):
            self._latest = None
        return picked

    def state(self) -> dict[str, Any]:
        """The checkpoint's per-fragment part (empty without fragments)."""
        if self.plan is None:
            return {}
        return {"fragment_bases": {n: list(b) for n, b in self.base.items()}}

    def load(self, bases: Mapping[str, Any] | None) -> None:
        """Restore :meth:`state`'s bases (``state["fragment_bases"]``), refusing a checkpoint written
        with other fragments."""
        if (self.plan is None) != (bases is None) or (
            self.plan is not None and bases is not None and set(bases) != set(self.plan.names)
        ):
            raise WorkerError(
                f"the checkpoint's DiLoCo state was written with {'no' if bases is None else len(bases)} fragments, "
                f"this worker has {'none' if self.plan is None else self.plan.count}: resume with the same fragments"
            )
        if bases is not None:
            self.base = {str(n): (int(b[0]), int(b[1])) for n, b in bases.items()}
