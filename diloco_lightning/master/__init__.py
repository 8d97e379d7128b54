"""The DiLoCo master: ``MasterOuterLoop`` (library) and ``diloco-master`` (CLI, :mod:`.cli`).

See :mod:`diloco_lightning.master.loop` for what the master guarantees, and
:mod:`diloco_lightning.master.validation` for the rejection reasons.
"""

from typing import TYPE_CHECKING

from diloco_lightning.util.lazy import lazy_exports

if TYPE_CHECKING:  # the names, for type checkers; at run time each is imported on first use
    from diloco_lightning.master.loop import MasterConfig
    from diloco_lightning.master.loop import MasterConfigError
    from diloco_lightning.master.loop import MasterOuterLoop
    from diloco_lightning.master.loop import ProcessedDeltas
    from diloco_lightning.master.metrics import RoundMetrics
    from diloco_lightning.master.metrics import format_progress
    from diloco_lightning.master.validation import REASONS

__getattr__, __dir__ = lazy_exports(__name__, {
    'MasterConfig': 'diloco_lightning.master.loop',
    'MasterConfigError': 'diloco_lightning.master.loop',
    'MasterOuterLoop': 'diloco_lightning.master.loop',
    'ProcessedDeltas': 'diloco_lightning.master.loop',
    'RoundMetrics': 'diloco_lightning.master.metrics',
    'format_progress': 'diloco_lightning.master.metrics',
    'REASONS': 'diloco_lightning.master.validation',
})

__all__ = [
    "MasterOuterLoop",
    "MasterConfig",
    "MasterConfigError",
    "ProcessedDeltas",
    "RoundMetrics",
    "format_progress",
    "REASONS",
]
