"""What a worker has done so far, in one object the phases (start, install, boundary, checkpoint)
are handed: where its anchor stands, how its deltas are numbered, and its running totals.

* ``boundaries``: inner phases ended; ``outer_step``: the version the anchor is based on (the
  newest a fragment was installed from, with fragments); ``anchor``: the FP32 copy the next
  pseudo-gradient is taken against (per piece, with fragments); ``frags``: each fragment's base.
* Numbering (``worker/core.py``, "Nothing is sent twice"): ``local_step = boundary + step_offset``;
  ``delivered_until``: the highest ``local_step`` the hub had of this node at a resume (boundaries
  replayed up to it are not sent again); ``restored``: the anchor came from this node's checkpoint;
  ``resumed``: the boundaries a start without a checkpoint skipped to the hub's step.
  Once the uploader runs it owns the offset (it may move it past deltas found on the hub), and
  :meth:`offset` asks it.
* ``newest_seen``: the newest version seen on the hub (staleness of an install is measured to it);
  ``totals``: the counters a run reports (uploads, bytes, waits ...), kept across a resume.

:meth:`state_dict` / :meth:`load_state_dict` are the worker's small counters in a checkpoint
(``DiLoCoWorker.state_dict``); the anchor travels in ``anchor_state`` (``worker/checkpoint.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from diloco_lightning.worker.fragstate import FragmentBook

__all__ = ["STATE_VERSION", "Progress", "step_offset_of"]

log = logging.getLogger(__name__)

#: the version of :meth:`Progress.state_dict` (and of the checkpoint's anchor state)
STATE_VERSION = 1


def new_totals() -> dict[str, Any]:
    return {
        "deltas_uploaded_total": 0,
        "bytes_uploaded_total": 0,
        "phases_delivered_total": 0,
        "upload_failures_total": 0,
        "uploads_paced_total": 0,  # boundaries whose delta was held back for the hub's commit budget
        "installs_total": 0,
        "wait_seconds_total": 0.0,
        "boundaries_total": 0,
        "phases_replayed_total": 0,  # boundaries trained again after a restart and not sent: the hub had them
        "boundary_seconds_total": 0.0,  # training-thread time spent in boundary() (waits included)
    }


def step_offset_of(state: Mapping[str, Any]) -> int:
    """The checkpoint's ``step_offset`` (derived for checkpoints written before it was recorded)."""
    if state.get("step_offset") is not None:
        return int(state["step_offset"])
    return max(0, int(state.get("next_local_step", 1)) - int(state.get("boundaries", 0)) - 1)


class Progress:
    """One worker's progress (see the module docstring)."""

    def __init__(self, node_id: str, frags: FragmentBook) -> None:
        self.node_id = node_id
        self.frags = frags
        self.boundaries = 0
        self.outer_step: int | None = None
        self.anchor: dict[str, torch.Tensor] | None = None
        self.step_offset = 0
        self.delivered_until = -1
        self.restored = False
        #: boundaries a restart without a checkpoint skipped to resume at the hub's step (``worker/startup.py``)
        self.resumed = 0
        self.newest_seen = -1
        #: in place only: the outbox counts into the same dict
        self.totals: dict[str, Any] = new_totals()
        self._offset_owner: Callable[[], int] | None = None

    def hand_offset_to(self, owner: Callable[[], int]) -> None:
        """From now on the offset is ``owner()``'s (the uploader's, once started)."""
        self._offset_owner = owner

    def take_offset_back(self) -> None:
        """The offset's owner stops (the uploader closes): keep its last value."""
        if self._offset_owner is not None:
            self.step_offset = self._offset_owner()
            self._offset_owner = None

    def offset(self) -> int:
        return self._offset_owner() if self._offset_owner is not None else self.step_offset

    def next_local_step(self) -> int:
        """The ``local_step`` of the next delta (replayed boundaries the hub has send nothing)."""
        return max(self.boundaries + 1 + self.offset(), self.delivered_until + 1)

    def delivered(self, boundary: int) -> bool:
        """Whether boundary ``boundary``'s delta reached the hub before a restart."""
        return boundary + self.offset() <= self.delivered_until

    def saw(self, *versions: int | None) -> None:
        """Versions seen on the hub: ``newest_seen`` is the newest of them all."""
        self.newest_seen = max([self.newest_seen, *(v for v in versions if v is not None)])

    def installed(self, outer_step: int, newest: int | None = None, *, exact: bool = False) -> int | None:
        """A version was installed (its ``outer_step``; ``newest``: the newest seen meanwhile): the
        anchor's base is it (``exact``: a whole version), or with fragments the newest a fragment was
        installed from. Returns the base before."""
        previous = self.outer_step
        self.outer_step = outer_step if exact or previous is None else max(previous, outer_step)
        self.saw(outer_step, newest)
        self.totals["installs_total"] += 1
        return previous

    def counters(self) -> dict[str, Any]:
        """The numbering every checkpoint part carries."""
        return {
            "version": STATE_VERSION,
            "node_id": self.node_id,
            "outer_step": self.outer_step,
            "boundaries": self.boundaries,
            "next_local_step": self.boundaries + 1 + self.offset(),
            "step_offset": self.offset(),
        }

    def state_dict(self) -> dict[str, Any]:
        """The small counters (no tensors)."""
        return {**self.counters(), "totals": dict(self.totals)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict`; another node's delivery counters are ignored."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a DiLoCo worker state (version {STATE_VERSION}): {state!r:.200}")
        same_node = state.get("node_id") == self.node_id
        if not same_node:
            log.warning("node %s: ignoring the delivery counters of node %s's checkpoint", self.node_id,
                        state.get("node_id"))
        self.boundaries = int(state["boundaries"])
        if state.get("outer_step") is not None:
            self.outer_step = int(state["outer_step"])
        if same_node:
            self.step_offset = max(self.step_offset, step_offset_of(state))
            for k, v in (state.get("totals") or {}).items():
                if k in self.totals:
                    self.totals[k] = type(self.totals[k])(v)
