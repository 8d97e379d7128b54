"""A worker's options: one definition (:class:`WorkerOptions`), one validation.

The Lightning callback, the Accelerate adapter and :class:`~diloco_lightning.worker.DiLoCoWorker`
take them as keywords; ``train.py`` composes the same fields into its ``diloco`` section
(``diloco_lightning.app.config``) with the help text written here. The lists of choices
(:data:`SYNC_MODES`, :data:`DELTA_DTYPES`) live here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from diloco_lightning.options import OptionError, check_choice, check_number, option

__all__ = ["SYNC_MODES", "DELTA_DTYPES", "WorkerOptions", "parse_delta_dtype"]

#: ``async``: install the newest global at each boundary, never wait; ``lockstep``: install exactly
#: version ``r - delay`` at boundary r (controlled staleness, for experiments)
SYNC_MODES = ("async", "lockstep")
#: the names a pseudo-gradient's wire format may be given (aliases included) and their dtypes
DELTA_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_delta_dtype(value: Any, argname: str = "delta_dtype") -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` (or the torch dtype) -> torch dtype."""
    if isinstance(value, torch.dtype) and value in DELTA_DTYPES.values():
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in DELTA_DTYPES:
        return DELTA_DTYPES[value.lower().removeprefix("torch.")]
    raise OptionError(argname, f"must be one of 'float32', 'bfloat16', 'float16', got {value!r}")


@dataclass
class WorkerOptions:
    """What shapes a worker (keywords of ``DiLoCo``, the Accelerate adapter and ``DiLoCoWorker``)."""

    inner_steps: int = option(500, "H: inner optimizer steps between two deltas")
    sync: str = option("async", "async (install the newest global, never wait) | lockstep (install exactly version r - delay)")
    delay: Any = option(
        0, "lockstep staleness tau: an int, a per-worker list, or {distribution: uniform|choice|geometric|pareto, ...[, seed]}"
    )
    delta_dtype: str = option("float32", "pseudo-gradient dtype on the wire: float32 | bfloat16 | float16")
    reset_inner_optimizer: bool = option(False, "clear the inner optimizer state after each install")
    wait_timeout: float = option(1200.0, "seconds a worker waits for the master (bootstrap, lockstep) before giving up")
    poll_interval: float = option(1.0, "seconds between a worker's reads of the hub while waiting")
    claim_ttl: float | None = option(
        None, "seconds a worker's claim on its node id lives without a heartbeat (null: 60 on a folder, 900 on hf:// and s3://)"
    )

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def validate(self, node_id: str = "w0", node_index: int | None = None) -> "WorkerOptions":
        """Raise :class:`~diloco_lightning.options.OptionError` naming the first option out of
        range (``delay`` is checked by resolving it for ``node_id`` / ``node_index``)."""
        from diloco_lightning.worker.sync import resolve_delay

        check_number(self, "inner_steps", low=1, integer=True)
        check_choice(self, "sync", SYNC_MODES)
        if isinstance(self.delta_dtype, torch.dtype):
            parse_delta_dtype(self.delta_dtype)
        else:
            check_choice(self, "delta_dtype", tuple(DELTA_DTYPES))
        if not isinstance(self.reset_inner_optimizer, bool):
            raise OptionError("reset_inner_optimizer", f"must be True or False, got {self.reset_inner_optimizer!r}")
        check_number(self, "wait_timeout", low=0.0, strict=True)
        check_number(self, "poll_interval", low=0.0, strict=True)
        check_number(self, "claim_ttl", low=0.0, strict=True, optional=True)
        try:
            resolve_delay(self.delay, node_id, node_index if node_index is not None else (0 if _no_index(node_id) else None))
        except ValueError as e:  # "delay must be ...", "delay[1] must be ...", "delay: unknown ..."
            msg = str(e)
            head, _, rest = msg.partition(" ")
            name = head.rstrip(":") if head.startswith("delay") else "delay"
            raise OptionError(name, rest if head.startswith("delay") else msg, msg) from None
        return self

    def resolved_delay(self, node_id: str, node_index: int | None = None) -> int:
        from diloco_lightning.worker.sync import resolve_delay

        return resolve_delay(self.delay, node_id, node_index)

    @property
    def dtype(self) -> torch.dtype:
        return parse_delta_dtype(self.delta_dtype)


def _no_index(node_id: str) -> bool:
    return not node_id[-1:].isdigit()
