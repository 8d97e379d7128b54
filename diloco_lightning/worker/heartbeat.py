"""A worker's claim on its node id and what its heartbeat says (:class:`Heartbeat`).

The claim itself (taken, renewed, released, left ``finished``) is :class:`~diloco_lightning.worker.claim.ClaimKeeper`'s;
this part of the worker decides *what* goes in it at each boundary: the pacing's speed report
(:mod:`diloco_lightning.worker.pacing`), the phase's mean training loss (the master watches it for
divergence) and the phases replayed after a restart. It also asks the peers' last reports when Dynamic
Local Updates pace by their speed, to decide the next phase's H.
"""

from __future__ import annotations

import dataclasses
import math

from diloco_lightning.hub import Hub
from diloco_lightning.util import timeline
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.worker.claim import ClaimKeeper
from diloco_lightning.worker.pacing import Pacing
from diloco_lightning.worker.waits import Waits

__all__ = ["Heartbeat"]


class Heartbeat:
    """Node ``node_id``'s claim (``claim=False``: none, :attr:`keeper` is None) and its heartbeat's
    reports, paced by ``pacing`` (``ttl``: the claim's life without a heartbeat, None: the hub's default)."""

    def __init__(self, hub: Hub, node_id: str, pacing: Pacing, *, ttl: float | None, signing_key: RunKey | None,
                 claim: bool = True) -> None:
        self.pacing = pacing
        #: the claim's keeper (signed with the run key in a signed run); it reads the peers' reports
        #: when Dynamic Local Updates pace by their speed
        self.keeper = (ClaimKeeper(hub, node_id, ttl=ttl, signing_key=signing_key,
                                   watch_peers=pacing.auto and pacing.dylu_seconds is None) if claim else None)
        if self.keeper is not None:
            self.keeper.set_info(pacing.report().to_info())
        self.train_loss: float | None = None  # the last phase's mean loss, in the heartbeat
        self._reported = False

    def acquire(self, waits: Waits, deadline: float) -> None:
        """Claim the node id (retried on hub errors until ``deadline``), before anything is offered or
        sent: a second live worker with this node_id stops here."""
        keeper = self.keeper
        if keeper is not None and keeper.claim is None and keeper.supported:
            waits.retry("claim the node id", keeper.acquire, deadline)
            timeline.mark("claimed")

    def check(self) -> None:
        """Raise ``NodeIdTakenError`` if another process took this node id over: never send under it."""
        if self.keeper is not None:
            self.keeper.check()

    def note_loss(self, train_loss: float | None) -> None:
        """The phase's mean training loss (a non-finite one is not reported: the heartbeat would drop it)."""
        if train_loss is not None:
            self.train_loss = float(train_loss) if math.isfinite(float(train_loss)) else None

    def end_phase(self, num_tokens: int | None, local_step: int, replayed: int) -> int | None:
        """The phase that just ended (the last at ``local_step``): decide the next one's H (Dynamic
        Local Updates, from the peers' last heartbeats) and report this worker's speed in its own
        heartbeat (at once the first time, so the others learn a newcomer's speed early)."""
        keeper = self.keeper
        peers = keeper.peer_reports() if keeper is not None and keeper.watch_peers else {}
        h = self.pacing.end_phase(num_tokens, [p.step_rate for p in peers.values()])
        if keeper is not None:
            report = dataclasses.replace(self.pacing.report(local_step), train_loss=self.train_loss,
                                         replayed=replayed or None)
            keeper.set_info(report.to_info(), urgent=not self._reported)
            self._reported = True
        return h

    def finish(self, local_step: int | None) -> None:
        """Leave the claim saying this node finished, its last delta at ``local_step`` (``ClaimKeeper.finish``)."""
        if self.keeper is not None:
            self.keeper.finish(local_step)

    def release(self) -> None:
        if self.keeper is not None:
            self.keeper.release()
