"""Rebasing an async worker onto its own deltas (``WorkerOptions.rebase``).

Why: the version an async worker installs at a boundary was published before the delta it has just
exported reached the master, so it never contains it: without a correction the worker relearns its
own last phase while the master applies it ("stale self"), which costs about as much as the
staleness itself.

The rule: when the worker installs version ``b``, it starts from

    start = version_b - sum_j scale_j * delta_j

over its own deltas ``j`` that ``b`` does not contain. ``b``'s manifest says which: its ledger holds
the highest ``local_step`` of this node's accepted deltas, so every delta with a higher ``local_step``
is not in it (and is kept), every other one is (and is dropped, for good: a later version contains
it too). ``scale_j`` is the factor the master's step multiplies a delta of this node by, as the
manifest publishes it (``master.delta_scales``: ``lr * gate(tau) * w / sum(w)`` for a momentum-free
SGD such as fedavg or staleness_sgd); a master that does not publish it (momentum, Adam, an older
master) gets the fallback ``1 / nodes`` (the nodes of the ledger, this one included): a mean of that
many deltas at lr 1. So the start is what the global will be once the worker's own deltas are in,
everyone else's left as they are. The worker's anchor is that start, so the next delta measures
only the next phase's progress and nothing is counted twice.

Each ``delta_j`` is the phase's FP32 pseudo-gradient (``anchor - local``) on the CPU, before the
wire's encoding (what error feedback sends later is not counted), kept as the phase's anchor and
snapshot (the dicts its delta is computed from, shared with the next phase's anchor when no
install came between) and subtracted one key at a time only when a start needs it. At most
:data:`MAX_PENDING` are kept (the oldest is forgotten first: the start then lacks it, as without
rebase). A delta the
master refuses never moves the ledger, so it is counted until a later delta of this node is
accepted; a worker resumed from a checkpoint starts with none pending (nothing is checkpointed:
:meth:`WorkerOwnDeltas.state_dict` holds the counters only). Lockstep workers and runs with fragments do
not rebase (a lockstep worker installs exact versions; a fragment's delta has its own base).

**Look-ahead** (``WorkerOptions.lookahead``; the eager update of "Eager Updates For Overlapped
Communication and Computation in DiLoCo", arXiv 2502.12996, on an async worker): a delta the version
lacks is rarely the only one in flight. With it, each kept delta stands for one delta of every node
of the ledger (this one included), so its factor is multiplied by ``nodes``:

    start = version_b - nodes * sum_j scale_j * delta_j

(with ``fedavg`` in a round of every node, ``scale_j = 1 / nodes``: the start is the version minus
the worker's whole last pseudo-gradient, where the global lands if the others moved as this worker
did). Nothing is counted twice either way: the anchor is the start, and once ``b``'s successor holds
the round, the real mean replaces the guess (the delta is dropped from the kept ones).

The subtraction itself is :func:`rebase_start`, which the simulator's rebase
(``diloco_lightning/sim/rebase.py: SimOwnDeltas``) uses too: the two differ only in how they learn
which deltas a version lacks and with what scale (here the ledger and the manifest; there the
simulated master's own record), so a simulated start is computed exactly as the product's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diloco_lightning.wire.manifest import Manifest

__all__ = ["MAX_PENDING", "OwnDeltas", "WorkerOwnDeltas", "fallback_scale", "rebase_start"]

log = logging.getLogger(__name__)

#: the most deltas kept (each an FP32 copy of the synced tensors on the CPU; an async worker has 1-2 in flight)
MAX_PENDING = 4


def rebase_start(state: Mapping[str, torch.Tensor],
                 deltas: Sequence[tuple[float, Mapping[str, torch.Tensor]]]) -> Mapping[str, torch.Tensor]:
    """``start = state - sum_j scale_j * delta_j`` over ``deltas`` (``(scale_j, delta_j)`` pairs, every
    ``delta_j`` over the same keys), one key at a time: each key of the start is accumulated in at least
    FP32 on the state's device, the deltas subtracted in their order, and rounded once to the state's
    dtype. ``state`` is never changed: the start is a new dict whose other keys (not in the deltas, such
    as integer buffers) are ``state``'s own tensors; a key the deltas hold and ``state`` lacks is left
    out (the install refuses a version without a synced key, naming it). A delta with scale 0 adds
    nothing and is not read; with none left, the start is ``state`` itself."""
    live = [(scale, delta) for scale, delta in deltas if scale != 0.0]
    if not live:
        return state
    out = dict(state)
    for k in live[0][1]:
        if k not in state:
            continue
        t = state[k]
        acc = t.to(torch.promote_types(t.dtype, torch.float32), copy=True)
        for scale, delta in live:
            acc.sub_(delta[k].to(acc.device, acc.dtype), alpha=scale)
        out[k] = acc.to(t.dtype)
    return out


class _Difference(Mapping[str, torch.Tensor]):
    """``anchor - snapshot``, computed one key at a time when a key is read (a whole delta is never held)."""

    def __init__(self, anchor: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor]) -> None:
        self.anchor, self.snapshot = anchor, snapshot

    def __getitem__(self, k: str) -> torch.Tensor:
        return self.anchor[k] - self.snapshot[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self.anchor)

    def __len__(self) -> int:
        return len(self.anchor)


@dataclass
class _Own:
    local_step: int
    anchor: Mapping[str, torch.Tensor]
    snapshot: Mapping[str, torch.Tensor] | None
    wait: Callable[[], None] | None

    def delta(self) -> Mapping[str, torch.Tensor]:
        return self.anchor if self.snapshot is None else _Difference(self.anchor, self.snapshot)


def fallback_scale(manifest: Manifest, node_id: str) -> float:
    """The scale of a delta of ``node_id`` when ``manifest`` publishes none: ``1 / nodes``, the
    nodes of its ledger with this one (the share of one delta in a mean of every node's at lr 1)."""
    return 1.0 / len(set(manifest.ledger) | {node_id})


class WorkerOwnDeltas:
    """The product's worker's deltas that a version it may install might not contain yet, learnt from
    each version's ledger and scales (module docstring)."""

    def __init__(self, node_id: str, limit: int = MAX_PENDING, *, lookahead: bool = False) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an integer >= 1, got {limit!r}")
        self.node_id, self.limit, self.lookahead = node_id, limit, bool(lookahead)
        self._pending: list[_Own] = []  # oldest first
        self.rebased = 0  # installs that started from a rebased state
        self.forgotten = 0  # deltas dropped by the limit, not by a version

    @property
    def pending(self) -> list[int]:
        """The ``local_step`` of each delta kept, oldest first."""
        return [o.local_step for o in self._pending]

    def sent(self, local_step: int, anchor: Mapping[str, torch.Tensor],
             snapshot: Mapping[str, torch.Tensor] | None = None, wait: Callable[[], None] | None = None) -> None:
        """Keep the delta with ``local_step``: ``anchor - snapshot`` (``name ->`` CPU FP32 tensors,
        never changed in place afterwards, as a :class:`~diloco_lightning.worker.jobs.Part`'s are),
        or ``anchor`` itself without a snapshot. Nothing is computed until a start needs it (the
        training thread pays nothing at a boundary without an install); ``wait``: called first then
        (the snapshot's CUDA copies)."""
        self._pending.append(_Own(local_step, anchor, snapshot, wait))
        while len(self._pending) > self.limit:
            own = self._pending.pop(0)
            self.forgotten += 1
            log.debug("node %s: forgetting its delta %d for rebasing (more than %d kept)", self.node_id,
                      own.local_step, self.limit)

    def scale(self, manifest: Manifest) -> float:
        """The factor ``manifest``'s master applies this node's deltas with (or the fallback); with
        :attr:`lookahead`, times the nodes of its ledger with this one (module docstring)."""
        s = manifest.delta_scale(self.node_id)
        s = fallback_scale(manifest, self.node_id) if s is None else s
        return s * len(set(manifest.ledger) | {self.node_id}) if self.lookahead else s

    def start(self, manifest: Manifest, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The start from version ``manifest.outer_step`` (``state``): ``state`` itself when it contains
        every kept delta (those it contains are dropped), else a copy (each tensor in its own dtype)
        with the others subtracted, each times :meth:`scale`."""
        done = manifest.ledger.get(self.node_id, -1)
        self._pending = [o for o in self._pending if o.local_step > done]
        if not self._pending:
            return state
        scale = self.scale(manifest)
        if scale == 0.0:
            return state
        for o in self._pending:
            if o.wait is not None:
                o.wait()
        out = rebase_start(state, [(scale, o.delta()) for o in self._pending])
        self.rebased += 1
        log.debug("node %s: rebased version %d onto its deltas %s (scale %.4g)", self.node_id, manifest.outer_step,
                  self.pending, scale)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The counters (the deltas are not checkpointed: see the module docstring)."""
        return {"rebased": self.rebased, "forgotten": self.forgotten}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for k in ("rebased", "forgotten"):
            v = state.get(k, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or not math.isfinite(v):
                raise ValueError(f"WorkerOwnDeltas state: {k!r} must be a non-negative integer, got {v!r}")
            setattr(self, k, v)


#: :class:`WorkerOwnDeltas` under its older name, kept importable
OwnDeltas = WorkerOwnDeltas
