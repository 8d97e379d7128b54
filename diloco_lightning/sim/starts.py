"""What a simulated worker's phase starts from: a version of the master's, and what comes with it.

:class:`PhaseStarts` gives a phase from version ``base`` its starting state (that version, or with
``sim.rebase`` / ``diloco.rebase`` that version minus the worker's own deltas it does not contain
yet: :mod:`~diloco_lightning.sim.rebase`; with ``sim.lookahead_trend`` moved by the master's
prediction of the others' deltas it lacks: :mod:`~diloco_lightning.sim.trend`) and its arguments: whether the worker's inner optimizer
is reset (``diloco.reset_inner_optimizer``), with fragments the version's number and fragment
counts; with ``sim.sync_inner_state`` the first phase of a round averages the workers' inner
optimizer states.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from diloco_lightning.sim.inner import average_optimizer_states

if TYPE_CHECKING:
    from diloco_lightning.sim.inner import SimWorker
    from diloco_lightning.sim.master import SimMaster
    from diloco_lightning.sim.rebase import SimOwnDeltas

__all__ = ["PhaseStarts"]


class PhaseStarts:
    """See the module docstring; ``exact``: a fragment due is installed whatever its counts say
    (lockstep installs exactly its target version, async only what updated the fragment)."""

    def __init__(self, workers: Sequence[SimWorker], master: SimMaster, *, rebase: SimOwnDeltas | None,
                 reset_inner_optimizer: bool, sync_inner_state: bool, exact: bool) -> None:
        self.workers = workers
        self.master = master
        self.rebase = rebase
        self.reset_inner_optimizer = reset_inner_optimizer
        self.sync_inner_state = sync_inner_state
        self.exact = exact
        self._phase_base: dict[int, int] = {}  # each worker's last phase's version (reset_inner_optimizer)
        #: sim.sync_inner_state: the last version whose phases began from the workers' averaged inner state
        self._synced_base: int | None = None

    def state(self, k: int, base: int) -> Mapping[str, Tensor]:
        """What worker ``k``'s phase from version ``base`` starts from: that version, or with
        ``sim.rebase`` that version minus the worker's own deltas it does not contain yet."""
        state: Mapping[str, Tensor] = self.master.versions[base]
        if self.rebase is not None:
            state = self.rebase.start(k, base, state, min(self.master.versions))
        trend = self.master.trend
        if trend is not None:  # sim.lookahead_trend: the others' deltas it lacks, predicted (sim/trend.py)
            state = trend.start(base, state, self.rebase.missing(k, base) if self.rebase is not None else 0)
        return state

    def args(self, k: int, base: int) -> dict[str, Any]:
        """What worker ``k``'s phase starting from version ``base`` is given besides that version,
        with fragments: its number, its fragments' outer step counts, and ``exact``."""
        args: dict[str, Any] = {}
        if self.sync_inner_state and base > 0 and self._synced_base != base:
            # a synchronous round: every worker's last phase is computed (the version holds all their
            # deltas) and none has begun the next one yet; the first of them to begin averages all
            average_optimizer_states([w.inner.optimizer for w in self.workers])
            self._synced_base = base
        if self.reset_inner_optimizer:  # the product clears the inner state after each install of a new version
            args["reset"] = self._phase_base.get(k) != base
            self._phase_base[k] = base
        if self.workers[k].plan is None:
            return args
        return {**args, "version": base, "steps": self.master.version_steps.get(base), "exact": self.exact}

    def state_dict(self) -> dict[str, Any]:
        return {"phase_base": dict(self._phase_base), "synced_base": self._synced_base}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self._phase_base = {int(k): int(v) for k, v in sd["phase_base"].items()}
        self._synced_base = None if sd["synced_base"] is None else int(sd["synced_base"])
