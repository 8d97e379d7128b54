"""The DiLoCo master: ``MasterOuterLoop`` (library) and ``diloco-master`` (CLI, :mod:`.cli`).

See :mod:`diloco_lightning.master.loop` for what the master guarantees, and
:mod:`diloco_lightning.master.validation` for the rejection reasons.
"""

from diloco_lightning.master.loop import MasterConfig, MasterConfigError, MasterOuterLoop, ProcessedDeltas
from diloco_lightning.master.metrics import RoundMetrics, format_progress
from diloco_lightning.master.validation import REASONS

__all__ = [
    "MasterOuterLoop",
    "MasterConfig",
    "MasterConfigError",
    "ProcessedDeltas",
    "RoundMetrics",
    "format_progress",
    "REASONS",
]
