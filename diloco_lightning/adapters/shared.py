"""What the Lightning callback and the Accelerate adapter both do around a :class:`DiLoCoWorker`:
check their common arguments (the worker's options are one :class:`WorkerOptions`), start the
worker the same way (:class:`WorkerStart`), run it on rank 0 only (its result or error reaching
every rank), broadcast installed weights from rank 0, and sum the token count over the ranks."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from diloco_lightning.util import timeline
from diloco_lightning.hub.base import Hub
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.wire.names import InvalidNameError, validate_node_id
from diloco_lightning.worker.options import WorkerOptions, parse_delta_dtype
from diloco_lightning.worker.core import DiLoCoWorker
from diloco_lightning.worker.pacing import Pacing
from diloco_lightning.worker.results import InstallResult

log = logging.getLogger(__name__)

__all__ = [
    "SIGTERM_EXIT",
    "SigtermWatch",
    "broadcast_params",
    "WorkerStart",
    "check_connection",
    "check_worker_args",
    "adapter_options",
    "open_worker_hub",
    "PhaseLoss",
    "ensure_console_logging",
    "format_bytes",
    "sent_text",
    "node_seed",
    "seed_this_node",
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


class PhaseLoss:
    """The mean training loss of an inner phase: each step's loss added detached (no device sync),
    averaged once at the boundary (the heartbeat reports it; the master watches it for divergence)."""

    def __init__(self) -> None:
        self._sum: float | torch.Tensor = 0.0
        self._n = 0

    def add(self, loss: Any) -> None:
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._sum = loss.detach().float() + self._sum
            self._n += 1
        elif isinstance(loss, (int, float)) and not isinstance(loss, bool):
            self._sum, self._n = self._sum + float(loss), self._n + 1

    def take(self) -> float | None:
        """The mean since the last call (None: no loss seen), and start again."""
        total, n = self._sum, self._n
        self._sum, self._n = 0.0, 0
        return float(total) / n if n else None


def node_seed(base: int, node_id: str) -> int:
    """The seed of node ``node_id`` in a process seeded with ``base``: ``(base * 1000003 +
    crc32(node_id)) mod 2**32``. Two nodes of one script (one ``seed_everything``) get different
    seeds, so their shuffled data, dropout and augmentations differ; the same node gets the same
    seed again on every launch."""
    return (int(base) * 1_000_003 + zlib.crc32(node_id.encode())) % 2**32


def seed_this_node(node_id: str) -> int:
    """Reseed ``torch`` (every device), ``random`` and ``numpy`` with :func:`node_seed` of this process's
    torch seed; returns the seed. Called before the data is iterated and after the model is built, so
    the initial weights (replaced by the run's global weights anyway) stay the script's."""
    import random

    seed = node_seed(torch.initial_seed(), node_id)
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        pass
    return seed


def sent_text(sent: float | None, total: float, pending: int) -> str:
    """The sync line's upload part: what reached the hub since the last line (``sent``: None when no
    upload finished), all sent so far, and an upload still going on in the background (the first
    async sync's delta is on its way, not "0 B")."""
    if sent:
        text = f"sent {format_bytes(sent)} ({format_bytes(total)} in all)"
    elif total:
        text = f"{format_bytes(total)} sent in all"
    else:
        text = "nothing sent yet"
    return text + (f", {pending} delta(s) uploading" if pending else "")


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


def check_connection(hub: Any, hub_options: Any, signing_key: Any) -> None:
    """Refuse a ``hub`` that is not a URL, a path or a :class:`Hub`, ``hub_options`` that are not a
    mapping (or given with an open hub), and a ``signing_key`` of the wrong kind or empty."""
    if not isinstance(hub, (str, os.PathLike, Hub)) or (isinstance(hub, str) and not hub):
        raise ValueError(f"DiLoCo: hub must be a URL, a path or a Hub, got {hub!r}")
    if hub_options is not None and not isinstance(hub_options, Mapping):
        raise ValueError(f"DiLoCo: hub_options must be a mapping or None, got {type(hub_options).__name__}")
    if isinstance(hub, Hub) and hub_options:
        raise ValueError("DiLoCo: hub_options cannot be given with an already open Hub")
    if signing_key is not None and not isinstance(signing_key, (RunKey, str, bytes)):
        raise ValueError(f"DiLoCo: signing_key must be a RunKey, text, bytes or None, got {type(signing_key).__name__}")
    if isinstance(signing_key, (str, bytes)) and not signing_key:
        raise ValueError("DiLoCo: signing_key is empty")


def open_worker_hub(hub: Any, hub_options: dict[str, Any] | None, create: bool, *, wait: float | None = None,
                    poll_interval: float = 1.0, stop: Callable[[], bool] = lambda: False) -> Hub:
    """The hub an adapter's worker uses: ``hub`` itself when it is an open :class:`Hub`, else
    ``open_hub(hub, create=create, **hub_options)`` (``hub_options["create"]`` wins when given; an
    S3 bucket is never created). A hub that does not exist is refused with the same rule and words
    as ``diloco-master``: it is an error unless ``create=True``, so a misspelt hub is never created
    and then waited on. ``wait`` (``wait_for_hub=True``: the options' ``wait_timeout``): a hub that
    does not exist yet is looked for again every ``poll_interval`` seconds for that long (one line
    says so), so a worker may start before the master creates it; ``stop()`` ends the wait (SIGTERM)."""
    from diloco_lightning.hub import HubNotFoundError, open_hub, transport_for

    if isinstance(hub, Hub):
        return hub
    opts = dict(hub_options or {})
    url = os.fspath(hub)
    creatable = transport_for(url).creatable
    if creatable:
        opts.setdefault("create", bool(create))
    deadline = None if wait is None else time.monotonic() + float(wait)
    said = False
    while True:
        try:
            return open_hub(url, **opts)
        except HubNotFoundError as e:
            if deadline is None or time.monotonic() >= deadline or stop():
                error = e
                break
            if not said:
                log.info("DiLoCo: %s; waiting up to %.0f s for the master to create it (wait_for_hub=True)", e,
                         deadline - time.monotonic())
                said = True
            time.sleep(min(float(poll_interval), max(0.0, deadline - time.monotonic())))
    if deadline is not None:
        raise HubNotFoundError(f"DiLoCo: {error}, and no master created it within wait_timeout={wait:g} s; start "
                               "diloco-master with hub.create=true, or check the spelling") from None
    if not creatable:  # the transport's message says what to do (an S3 bucket is never created)
        raise HubNotFoundError(f"DiLoCo: {error}") from None
    raise HubNotFoundError(f"DiLoCo: {error}; check the spelling, or pass create=True to create it") from None


def adapter_options(inner_steps: int | str | None, options: WorkerOptions | None,
                    values: Mapping[str, Any]) -> WorkerOptions:
    """An adapter's :class:`WorkerOptions`: ``options`` whole, or the option keywords ``values`` with
    ``inner_steps`` (the adapters' third positional argument, required unless ``options`` is given)."""
    given = dict(values) if inner_steps is None else {"inner_steps": inner_steps, **values}
    return WorkerOptions.given(options, given, who="DiLoCo", required=("inner_steps",))


def check_worker_args(node_id: Any, node_index: int | None,
                      options: WorkerOptions) -> tuple[str, int, WorkerOptions, Pacing]:
    """Check an adapter's ``node_id`` and its :class:`~diloco_lightning.worker.options.WorkerOptions`;
    return ``(node_id, resolved delay, the options (a copy, ``delta_dtype`` as the encoding's name),
    this worker's Pacing)``. Errors are ``ValueError("DiLoCo: ...")``."""
    try:
        checked_id = validate_node_id(node_id)
    except InvalidNameError as e:
        raise ValueError(f"DiLoCo: node_id: {e}") from None
    try:
        options.validate(checked_id, node_index)
        opts = dataclasses.replace(options, delta_dtype=parse_delta_dtype(options.delta_dtype))
        return checked_id, opts.resolved_delay(checked_id, node_index), opts, opts.pacing(checked_id, node_index)
    except ValueError as e:
        raise ValueError(f"DiLoCo: {e}") from None


class WorkerStart:
    """How both adapters make and start their worker (on rank 0): their common arguments checked
    (:func:`check_connection`, ``create``, :func:`check_worker_args`: :attr:`node_id`, :attr:`delay`,
    :attr:`options`, :attr:`pacing`), then at :meth:`start` the :class:`DiLoCoWorker` made (kept in
    :attr:`worker` before it starts, so SIGTERM can stop its waits: :meth:`request_stop`), a
    checkpoint's counters and anchor restored, and the worker started."""

    def __init__(self, hub: Any, node_id: Any, options: WorkerOptions, *, node_index: int | None,
                 hub_options: Mapping[str, Any] | None, signing_key: RunKey | str | bytes | None,
                 create: bool = False) -> None:
        check_connection(hub, hub_options, signing_key)
        if not isinstance(create, bool):
            raise ValueError(f"DiLoCo: create must be True or False, got {create!r}")
        self.node_id, self.delay, self.options, self.pacing = check_worker_args(node_id, node_index, options)
        self.hub = hub
        self.node_index = node_index
        self.hub_options = dict(hub_options or {})
        self.create = create  # a hub that does not exist is an error unless asked (open_worker_hub)
        self.signing_key = signing_key
        self.worker: DiLoCoWorker | None = None

    def request_stop(self) -> None:
        """SIGTERM: end every wait of the worker (the one starting, too: a wait for the master at start)."""
        if self.worker is not None:
            self.worker.request_stop()

    def start(self, params: dict[str, torch.Tensor], *, stop: bool, counters: Mapping[str, Any] | None,
              anchor: Mapping[str, Any] | None, stopped: Callable[[], bool] | None = None) -> InstallResult | None:
        """A new worker on ``params`` (``stop``: SIGTERM came already; ``stopped()``: it came since, which
        ends a wait for the hub), resumed from ``counters`` (``state_dict``) and ``anchor``
        (``anchor_state``) when given; what its start installed."""
        opts = self.options
        hub = open_worker_hub(self.hub, self.hub_options, self.create, poll_interval=opts.poll_interval,
                              wait=opts.wait_timeout if opts.wait_for_hub else None, stop=stopped or (lambda: stop))
        timeline.mark("hub_open")
        self.worker = DiLoCoWorker(
            hub, self.node_id, params, self.options,
            node_index=self.node_index, signing_key=self.signing_key, pacing=self.pacing,
        )
        if stop:
            self.worker.request_stop()
        if counters is not None:
            self.worker.load_state_dict(counters)
        if anchor is not None:
            self.worker.load_anchor_state(anchor)
        return self.worker.start()


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
