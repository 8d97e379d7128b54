"""A Lightning worker restarted without a checkpoint moves its trainer on (issue 38).

The hub already holds the phases the node's earlier life delivered (``DiLoCoWorker.resumed_boundaries``):
:func:`skip_ahead` advances the trainer's step by those phases, so it trains only what the run still
lacks (``max_steps`` counts the whole run, as after a checkpoint) instead of training phases again whose
work is already in the global version it installed. Step-wise LR schedulers are stepped on as many
times. The data loader starts over (no checkpoint holds its position).
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning.pytorch import LightningModule, Trainer

from diloco_lightning.worker.pacing import Pacing

__all__ = ["skip_ahead"]


def skip_ahead(trainer: Trainer, pl_module: LightningModule, pacing: Pacing, boundaries: int) -> int:
    """Move ``trainer`` on to the step after ``boundaries`` phases of ``pacing``'s H (with Dynamic
    Local Updates the phases' lengths are not known: each counts as the nominal H; with fragments a
    phase is ``H / fragments`` steps); the steps skipped (0: the trainer is there already)."""
    h = pacing.fixed if pacing.fixed is not None else pacing.inner_steps
    if not h:
        return 0
    skip = boundaries * max(1, h // pacing.fragments) - trainer.global_step
    if skip <= 0:
        return 0
    loop = trainer.fit_loop.epoch_loop
    if pl_module.automatic_optimization:
        total = loop.automatic_optimization.optim_progress.optimizer.step.total
    else:
        total = loop.manual_optimization.optim_step_progress.total
    total.ready += skip
    total.completed += skip
    _count_stepped_batches(loop, skip)
    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": on purpose here
        warnings.simplefilter("ignore")
        for config in trainer.lr_scheduler_configs:
            if config.interval == "step" and not config.reduce_on_plateau:  # a plateau's step needs a metric
                for _ in range(skip // max(1, int(config.frequency or 1))):
                    config.scheduler.step()  # type: ignore[call-arg]
    return skip


def _count_stepped_batches(epoch_loop: Any, skip: int) -> None:
    """Lightning's private count of batches that stepped (``_TrainingEpochLoop._batches_that_stepped``,
    what its loggers use as their step and a checkpoint saves) moved on by ``skip``: Lightning offers no
    public way to advance it, and left behind the logged steps would restart at 0 after a skip. The one
    place this package reaches into Lightning's privates."""
    epoch_loop._batches_that_stepped += skip
