"""The framework-free DiLoCo worker: :class:`DiLoCoWorker` (see ``core.py``)."""

from typing import TYPE_CHECKING

from diloco_lightning.util.lazy import lazy_exports

if TYPE_CHECKING:  # the names, for type checkers; at run time each is imported on first use
    from diloco_lightning.worker.core import BoundaryResult
    from diloco_lightning.worker.core import DiLoCoWorker
    from diloco_lightning.worker.core import InstallResult
    from diloco_lightning.worker.core import UploadReport
    from diloco_lightning.worker.core import WaitTimeoutError
    from diloco_lightning.worker.core import WorkerError
    from diloco_lightning.worker.params import copy_into
    from diloco_lightning.worker.params import module_state
    from diloco_lightning.worker.options import DELTA_DTYPES
    from diloco_lightning.worker.options import SYNC_MODES
    from diloco_lightning.worker.options import WorkerOptions
    from diloco_lightning.worker.options import parse_delta_dtype
    from diloco_lightning.worker.claim import NodeIdTakenError
    from diloco_lightning.worker.sync import WorkerStopped
    from diloco_lightning.worker.sync import resolve_delay

__getattr__, __dir__ = lazy_exports(__name__, {
    'BoundaryResult': 'diloco_lightning.worker.core',
    'DiLoCoWorker': 'diloco_lightning.worker.core',
    'InstallResult': 'diloco_lightning.worker.core',
    'UploadReport': 'diloco_lightning.worker.core',
    'WaitTimeoutError': 'diloco_lightning.worker.core',
    'WorkerError': 'diloco_lightning.worker.core',
    'copy_into': 'diloco_lightning.worker.params',
    'module_state': 'diloco_lightning.worker.params',
    'DELTA_DTYPES': 'diloco_lightning.worker.options',
    'SYNC_MODES': 'diloco_lightning.worker.options',
    'WorkerOptions': 'diloco_lightning.worker.options',
    'parse_delta_dtype': 'diloco_lightning.worker.options',
    'NodeIdTakenError': 'diloco_lightning.worker.claim',
    'WorkerStopped': 'diloco_lightning.worker.sync',
    'resolve_delay': 'diloco_lightning.worker.sync',
})

__all__ = [
    "DiLoCoWorker",
    "WorkerOptions",
    "BoundaryResult",
    "InstallResult",
    "UploadReport",
    "WorkerError",
    "WaitTimeoutError",
    "WorkerStopped",
    "NodeIdTakenError",
    "SYNC_MODES",
    "DELTA_DTYPES",
    "module_state",
    "copy_into",
    "parse_delta_dtype",
    "resolve_delay",
]
