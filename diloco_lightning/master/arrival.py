"""Arrival mode's pass when the master is behind: several deltas, one publication.

A master that keeps up finds one delta per pass and publishes it as its own version. One that
publishes slower than deltas arrive (a publication on S3 costs about ten requests) finds several;
publishing each of them on its own would keep its rate at one delta per publication while the
backlog, and with it every delta's staleness, grows. :func:`apply_pass` (``arrival_publish="pass"``,
the default) applies them exactly as one publication each would, and publishes once:

* every delta is its own optimizer step, in :func:`~diloco_lightning.master.aggregation.arrival_order`,
  and its own outer step: delta ``i`` of the pass (0-based, counting the deltas applied) is applied
  at outer step ``s + i`` (``s``: the version before the pass), so its staleness is
  ``s + i - base_outer_step``, the tau it would have had with a publication each;
* the pass publishes ONE version, ``s + n`` (``n`` deltas applied), whose ledger holds all of them,
  and deletes them: the published outer steps skip ``s + 1 .. s + n - 1``, which no worker can have
  installed. Workers install the newest version, so they cope; a lockstep worker installs a given
  version and its run is given ``arrival_publish="each"`` (``app/build.py``);
* a delta gated to zero is refused as too stale and takes no step; a step that makes the state
  non-finite refuses its delta and publishes nothing (the pass's other deltas are read again next pass);
* the norm bounds a delta is checked against are those of the version before the pass (a
  publication each would have widened them by each earlier delta of the pass).

A run with fragments publishes each delta (a fragment's step count, which its next delta's
staleness is measured by, is the published manifest's).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from diloco_lightning.encoding.feedback import decode_delta
from diloco_lightning.hub.base import DeltaRef
from diloco_lightning.master.aggregation import arrival_step, merge_marks
from diloco_lightning.master.config import MasterConfig
from diloco_lightning.master.intake import Intake
from diloco_lightning.master.membership import Membership
from diloco_lightning.master.metrics import RoundMetrics
from diloco_lightning.master.runstate import RunState
from diloco_lightning.master.validation import Accepted, DeltaRejected
from diloco_lightning.util import faults
from diloco_lightning.wire.delta import Delta

__all__ = ["PassHost", "apply_pass"]

log = logging.getLogger(__name__)


class PassHost(Protocol):
    """What a pass uses of the master's round procedures (:class:`~diloco_lightning.master.rounds.Rounds`,
    which imports this module, is the implementation): the master's parts, the check of one delta at
    an outer step, and the steps every application shares (the spare buffer, the finite check that
    refuses, the roll-back and the publication)."""

    config: MasterConfig
    run: RunState
    intake: Intake
    membership: Membership
    owner: Any  # receives the crash points (util/faults.py)

    def check(self, ref: DeltaRef, path: Path, outer_step: int) -> tuple[Delta, Accepted]: ...

    def take_buffer(self) -> tuple[dict[str, torch.Tensor], Any]: ...

    def roll_back(self, buf: dict[str, torch.Tensor], backup: Any) -> None: ...

    def finite_or_refuse(self, buf: dict[str, torch.Tensor], backup: Any, accepted: list[Accepted],
                         m: RoundMetrics) -> tuple[float, int] | None: ...

    def publish_stepped(self, buf: dict[str, torch.Tensor], backup: Any, new_step: int, new_ledger: dict[str, int],
                        processed: list[str], norms: list[float], m: RoundMetrics, accepted: list[Accepted],
                        updated: list[str] | None = None, *, norm: tuple[float, int],
                        applied_at: list[int] | None = None, scales: Mapping[str, float] | None = None) -> bool: ...


def apply_pass(rounds: PassHost, order: list[tuple[DeltaRef, Path]], blocked: set[str], m: RoundMetrics) -> bool:
    """Apply the deltas of ``order`` (those of nodes in ``blocked`` skipped) as consecutive optimizer
    and outer steps and publish one version (the module docstring); returns whether it published.
    ``rounds``: the master's round procedures (:class:`PassHost`)."""
    run, intake = rounds.run, rounds.intake
    name = rounds.config.outer_optimizer
    start = run.outer_step
    buf: Any = None
    backup: Any = None
    done: list[tuple[Accepted, DeltaRef, Path]] = []
    norm: tuple[float, int] | None = None
    try:
        for ref, path in order:
            if ref.node_id in blocked:
                continue
            at = start + len(done)  # this delta's outer step at application
            try:
                delta, acc = rounds.check(ref, path, at)
            except DeltaRejected as e:
                intake.refuse(ref, e.reason, e.detail, m)
                continue
            # an encoded delta is decoded (FP32) for its own outer step: one delta at a time
            tensors = delta.tensors if delta.encoded is None else decode_delta(delta.encoded)
            del delta
            if buf is None:
                buf, backup = rounds.take_buffer()
            applied = arrival_step(run.opt, name, run.opt_state(buf), tensors, acc.staleness, acc.fragment)
            del tensors
            if applied is False:  # fully gated: nothing changed
                intake.refuse(ref, "too_stale", "the optimizer gated the whole step to 0", m)
                continue
            norm = rounds.finite_or_refuse(buf, backup, [acc], m)
            if norm is None:  # refused; the buffer is given back and nothing is published
                return False
            faults.point("stepped", rounds.owner)
            done.append((acc, ref, path))
    except BaseException:
        if buf is not None:
            rounds.roll_back(buf, backup)
        raise
    if not done or norm is None:
        if buf is not None:
            run.give_back(buf)
        return False
    accepted = [a for a, _, _ in done]
    if len(done) > 1:
        log.info("applying %d deltas (one optimizer step each, outer steps %d-%d) and publishing version %d: "
                 "they arrived faster than a publication each allows", len(done), start + 1, start + len(done),
                 start + len(done))
    new_ledger = merge_marks(run.ledger, *({r.node_id: r.local_step} for _, r, _ in done))
    processed = intake.pending + [r.path for _, r, _ in done]
    rate = run.opt.linear_rate()  # each delta its own step: its factor is rate * gate(tau), a node's last one kept
    scales = None if rate is None else {a.ref.node_id: rate * run.opt.gate(a.staleness) for a in accepted}
    ok = rounds.publish_stepped(buf, backup, start + len(done), new_ledger, processed, [a.norm for a in accepted], m,
                                accepted, [], norm=norm, applied_at=[start + i for i in range(len(done))],
                                scales=scales)
    if ok:
        for acc, ref, path in done:
            rounds.membership.heard(ref.node_id)
            m.apply(acc.ident, acc.staleness)
            intake.release(path)
    return bool(ok)
