"""What the Lightning callback and the Accelerate adapter both do around a :class:`DiLoCoWorker`:
check their common arguments, run the worker on rank 0 only (its result or error reaching every
rank), broadcast installed weights from rank 0, and sum the token count over the ranks."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch

from diloco_lightning.hub.base import Hub
from diloco_lightning.wire.names import InvalidNameError, validate_node_id
from diloco_lightning.worker.options import WorkerOptions, parse_delta_dtype
from diloco_lightning.worker.pacing import Pacing

__all__ = [
    "SIGTERM_EXIT",
    "SigtermWatch",
    "broadcast_params",
    "check_hub_arg",
    "check_worker_args",
    "ensure_console_logging",
    "format_bytes",
    "run_on_rank0",
    "sum_tokens_over_ranks",
]

#: exit status of a worker stopped by SIGTERM before its work was done (128 + SIGTERM, as a shell reports it)
SIGTERM_EXIT = 128 + int(signal.SIGTERM)
#: seconds a worker stopped by SIGTERM spends uploading what is pending (schedulers wait ~30 s before SIGKILL)
SIGTERM_FLUSH_SECONDS = 20.0


def format_bytes(n: float) -> str:
    """``5.2 kB``, ``12.4 MB``, ``1.3 GB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale * 0.95:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def ensure_console_logging() -> None:
    """Make the library's INFO lines (waits, syncs) visible in a script that configured no logging,
    as Lightning does for its own messages: a stderr handler on the ``diloco_lightning`` logger when
    neither it nor the root logger has one."""
    lib = logging.getLogger("diloco_lightning")
    if lib.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    lib.addHandler(handler)
    if lib.level == logging.NOTSET or lib.level > logging.INFO:
        lib.setLevel(logging.INFO)


class SigtermWatch:
    """While installed (main thread only), SIGTERM first calls ``on_sigterm()`` (the adapter asks its
    worker to stop waiting), then the handler that was there before (Lightning's sets
    ``trainer.received_sigterm``; the default one is not called: the adapter ends the process itself,
    after uploading what is pending). :meth:`uninstall` puts the previous handler back."""

    def __init__(self, on_sigterm: Callable[[], None]) -> None:
        self.on_sigterm = on_sigterm
        self.received = False
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True
        self.on_sigterm()
        if callable(self._previous):
            self._previous(signum, frame)

    def uninstall(self) -> None:
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        self._installed = False


def check_hub_arg(hub: Any) -> None:
    """Refuse a ``hub`` that is not a URL, a path or a :class:`Hub`."""
    if not isinstance(hub, (str, os.PathLike, Hub)) or (isinstance(hub, str) and not hub):
        raise ValueError(f"DiLoCo: hub must be a URL, a path or a Hub, got {hub!r}")


def check_worker_args(
    node_id: Any, inner_steps: Any, sync: Any, delay: Any, node_index: int | None, delta_dtype: Any,
    topk: Any = 0.01, topk_values: Any = None, error_feedback: Any = None, **pacing: Any,
) -> tuple[str, int, WorkerOptions, Pacing]:
    """Check an adapter's ``node_id`` and its :class:`~diloco_lightning.worker.options.WorkerOptions`
    (``inner_steps``, ``sync``, ``delay``, ``delta_dtype``, ``topk``, ``topk_values``,
    ``error_feedback`` and the other :class:`WorkerOptions` given as keywords: ``dylu_steps``,
    ``dylu_min_steps``, ``dylu_seconds``, ``throttle``, ``fragments``, ``topk_chunk``,
    ``error_feedback_decay``); return ``(node_id, resolved delay, the options, this worker's Pacing)`` with
    ``delta_dtype`` as the encoding's name. Errors are ``ValueError("DiLoCo: ...")``."""
    try:
        checked_id = validate_node_id(node_id)
    except InvalidNameError as e:
        raise ValueError(f"DiLoCo: node_id: {e}") from None
    opts = WorkerOptions(inner_steps=inner_steps, sync=sync, delay=delay, delta_dtype=delta_dtype, topk=topk,
                         topk_values=topk_values, error_feedback=error_feedback, **pacing)
    try:
        opts.validate(checked_id, node_index)
        opts.delta_dtype = parse_delta_dtype(delta_dtype)
        return checked_id, opts.resolved_delay(checked_id, node_index), opts, opts.pacing(checked_id, node_index)
    except ValueError as e:
        raise ValueError(f"DiLoCo: {e}") from None


def run_on_rank0(
    fn: Callable[[], Any], *, is_main: bool, world_size: int, broadcast: Callable[[Any], Any], where: str
) -> Any:
    """Run ``fn`` on rank 0 (``is_main``); every rank gets its (picklable) result or raises its
    error. ``broadcast(obj)`` returns rank 0's ``obj`` on every rank (called when ``world_size > 1``);
    ``where`` names rank 0 in the error the other ranks raise."""
    result: Any = None
    error: BaseException | None = None
    if is_main:
        try:
            result = ("ok", fn())
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the other ranks hear of it
            error = e
            result = ("error", f"{type(e).__name__}: {e}")
    if world_size > 1:
        result = broadcast(result)
    if result[0] == "error":
        if error is not None:
            raise error
        raise RuntimeError(f"DiLoCo worker on {where} failed: {result[1]}")
    return result[1]


def broadcast_params(params: dict[str, torch.Tensor]) -> None:
    """Copy rank 0's tensors into every rank's (``torch.distributed`` must be initialised)."""
    import torch.distributed as dist

    with torch.no_grad():
        for t in params.values():
            dist.broadcast(t.data, src=0)


def sum_tokens_over_ranks(
    tokens: int | torch.Tensor | None, device: Any, reduce_sum: Callable[[torch.Tensor], torch.Tensor]
) -> int | None:
    """The ranks' token counts summed with ``reduce_sum`` (a sum all-reduce); None when any rank's
    count is unknown (None)."""
    known = tokens is not None
    t = torch.tensor([0.0 if tokens is None else float(tokens), 0.0 if known else 1.0], device=device, dtype=torch.float64)
    t = reduce_sum(t)
    return None if float(t[1]) > 0 else int(round(float(t[0])))
