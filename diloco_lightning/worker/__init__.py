"""The framework-free DiLoCo worker: :class:`DiLoCoWorker` (see ``core.py``)."""

from diloco_lightning.worker.core import (
    BoundaryResult,
    DiLoCoWorker,
    InstallResult,
    UploadReport,
    WaitTimeoutError,
    WorkerError,
)
from diloco_lightning.worker.params import copy_into, module_state
from diloco_lightning.worker.options import DELTA_DTYPES, SYNC_MODES, WorkerOptions, parse_delta_dtype
from diloco_lightning.worker.claim import NodeIdTakenError
from diloco_lightning.worker.sync import WorkerStopped, resolve_delay

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
