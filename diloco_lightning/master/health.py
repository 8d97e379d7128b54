"""What the master can tell a user about their run that no single delta shows: two nodes sending
the same delta (they train on the same data), and a run that is diverging. Each is said in one
log line naming the knob to turn, once (a diverging run is said again only if it gets worse).

* **Identical deltas.** Two nodes whose deltas from one base version have the same L2 norm, to
  the last bit, trained on the same batches from the same weights: the run is one worker's
  training counted twice. The norm is computed by validation anyway; equal norms of honest
  deltas of different data do not happen in floating point.
* **Divergence**, from the workers' training losses (each heartbeat carries its last phase's
  mean, :class:`~diloco_lightning.wire.claims.NodeReport`): the median over the nodes rose more
  than ``LOSS_RISE`` nats (or half its best, whichever is more) above its best, in two readings
  in a row (one, when it rose three times that). A model-free master knows nothing of the
  loss but what the workers report.
* **Divergence**, from the global model the master publishes: the norm of its update
  (``|theta_new - theta_old|``) grew ``GROWTH`` times above the smallest of the last ``WINDOW``
  versions while the state's own norm grew too, for ``PATIENCE`` versions in a row. A healthy
  run's updates shrink or hold as it converges; an outer step that overshoots (too large an lr,
  momentum fed stale deltas, a quorum of one) makes them grow geometrically, and the state
  with them. The line names ``outer.lr`` and the quorum (``min_deltas``).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Hashable, Iterable

__all__ = ["RunHealth", "GROWTH", "WINDOW", "PATIENCE", "LOSS_RISE"]

log = logging.getLogger(__name__)

#: update norm over the smallest of the recent window that counts as growing
GROWTH = 4.0
#: versions the smallest update is taken over
WINDOW = 8
#: versions in a row the update (and the state) must grow before the line is said
PATIENCE = 3
#: nats the workers' median training loss may rise above its best before the run counts as diverging
LOSS_RISE = 1.0


class RunHealth:
    """Watches published versions and accepted deltas (see the module docstring).

    Args:
        lr: the outer learning rate (named in the advice).
        min_deltas: the quorum (named in the advice).
        optimizer: the outer optimizer's name.
    """

    def __init__(self, lr: float | None = None, min_deltas: object = None, optimizer: str = "") -> None:
        self.lr, self.min_deltas, self.optimizer = lr, min_deltas, optimizer
        self._updates: deque[float] = deque(maxlen=WINDOW)
        self._state_norm: float | None = None
        self._streak = 0
        self._warned_at: float | None = None  # the growth ratio last warned about
        self._seen: dict[tuple[Hashable, str], str] = {}  # (base, norm bits) -> node; base: any hashable
        self._twins: set[frozenset[str]] = set()
        self.diverging = False
        self._heard: tuple = ()
        self._best_loss: tuple[float, int] | None = None  # (median, outer step)
        self._loss_streak = 0
        self._loss_warned: float | None = None

    # ------------------------------------------------------------------ identical deltas

    def note_deltas(self, deltas: Iterable[tuple[str, Hashable, float]]) -> list[tuple[str, str]]:
        """``(node_id, base, norm)`` of accepted deltas (``base``: the outer step they start from, with
        the fragment when there are fragments); returns the new pairs of nodes
        found sending identical ones (each pair is warned about once)."""
        found = []
        for node, base, norm in deltas:
            if not math.isfinite(norm) or norm == 0.0:
                continue
            key = (base, float(norm).hex())
            other = self._seen.setdefault(key, node)
            pair = frozenset((node, other))
            if other != node and pair not in self._twins:
                self._twins.add(pair)
                found.append((other, node))
                log.warning(
                    "nodes %s and %s sent identical deltas (from outer step %s, norm %.6g): they train on the same "
                    "data from the same weights, so the run counts one worker twice. Give each node its own data: "
                    "the callback's seed_per_node=True (its default) reseeds each node from its node_id; a "
                    "sampler or a data shard per node does it for data that is not shuffled", other, node, _step(base), norm)
        if len(self._seen) > 4096:  # only recent deltas matter
            self._seen = dict(list(self._seen.items())[-1024:])
        return found

    # ------------------------------------------------------------------ divergence

    def note_version(self, outer_step: int, update_norm: float, state_norm: float) -> bool:
        """A published version: the norm of its update and of the new state. True when this
        version made the master say that the run diverges."""
        previous_state, self._state_norm = self._state_norm, state_norm
        floor = min(self._updates) if self._updates else None
        self._updates.append(update_norm)
        if not (math.isfinite(update_norm) and math.isfinite(state_norm)):
            return False
        growing = (floor is not None and floor > 0 and update_norm > GROWTH * floor
                   and previous_state is not None and state_norm > previous_state)
        self._streak = self._streak + 1 if growing else 0
        if self._streak < PATIENCE or floor is None:
            return False
        ratio = update_norm / floor
        if self._warned_at is not None and ratio < 4 * self._warned_at:
            return False  # said already; said again only if it gets much worse
        self._warned_at = ratio
        self.diverging = True
        log.warning("the run looks like it is diverging: the outer update at outer step %d is %.3g, %.0fx the smallest "
                    "of the last %d (%.3g), and the global weights' norm keeps growing (%.4g). %s", outer_step,
                    update_norm, ratio, WINDOW, floor, state_norm, self.advice())
        return True

    def note_losses(self, outer_step: int, losses: dict[str, float]) -> bool:
        """The nodes' last reported training losses at ``outer_step``. True when this reading made
        the master say that the run diverges."""
        heard = tuple(sorted(losses.items()))
        vals = sorted(v for v in losses.values() if math.isfinite(v))
        if not vals or heard == self._heard:
            return False  # nothing new was heard
        self._heard = heard
        median = vals[len(vals) // 2]
        if self._best_loss is None or median < self._best_loss[0]:
            self._best_loss, self._loss_streak = (median, outer_step), 0
            return False
        best, at = self._best_loss
        rise = max(LOSS_RISE, 0.5 * best)
        self._loss_streak = self._loss_streak + 1 if median > best + rise else 0
        if not (self._loss_streak >= 2 or median > best + 3 * rise):
            return False
        if self._loss_warned is not None and median < 2 * self._loss_warned:
            return False
        self._loss_warned, self.diverging = median, True
        log.warning("the run looks like it is diverging: the workers' training loss is %.4g at outer step %d (the median "
                    "of %d node(s)), up from %.4g at outer step %d. %s", median, outer_step, len(vals), best, at,
                    self.advice())
        return True

    def advice(self) -> str:
        """The knobs, with their values now."""
        lr = f"outer.lr (now {self.lr:g}, e.g. outer.lr={self.lr / 4:g})" if self.lr else "outer.lr"
        quorum = f"min_deltas (now {self.min_deltas})" if self.min_deltas is not None else "min_deltas"
        return (f"Lower {lr}, or apply more deltas per round: raise {quorum} (min_deltas=1.0 waits for every live "
                "worker), master.min_deltas in train.py; an outer optimizer with momentum amplifies stale deltas "
                "(outer.options.momentum=0 removes it; outer=fedavg, diloco-master's default, is their plain average)")


def _step(base: Hashable) -> object:
    """The outer step of a base key ``(outer_step, fragment)`` or ``outer_step``."""
    return base[0] if isinstance(base, tuple) and base else base
