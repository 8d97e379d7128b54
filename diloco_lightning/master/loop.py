"""The master: applies workers' deltas with a staleness-aware outer optimizer and publishes versions.

:class:`MasterOuterLoop` keeps the API and behaviour of Speedtronic's DumbDiLoCo master
(``speedtronic.distributed.outer.MasterOuterLoop``) and fixes what its documentation admits:

* **No re-download.** The published manifest carries a per-node high-water mark (the
  *ledger*); listing asks the hub only for deltas above it, so a processed delta is never
  downloaded again. New ones are downloaded by a bounded thread pool, a few ahead of the
  consumer, into the hub's per-path cache.
* **Streaming aggregation.** Deltas are read one at a time (memory-mapped), checked, and
  folded into a single FP32 sum, so a round holds the global state, a working copy of it,
  the optimizer state, the sum and one delta, whatever the number of deltas.
* **Lock scope.** ``snapshot()`` takes a lock that only ever covers in-memory work (a
  clone, a reference swap); the round computes on a second buffer and swaps it in after
  publishing, so a snapshot never waits for the network.
* **Validation** (:mod:`diloco_lightning.master.validation`): everything the delta reader
  checks (a file larger than a delta of this model can be is refused before it is
  downloaded; names, shapes, dtypes and sizes are checked from the header before any
  tensor byte is read; signatures are verified as the bytes are read), staleness
  (negative, above ``max_staleness``, gated to 0), replay, absolute, global-relative and
  median-relative norm bounds, fingerprint and signature. A rejected delta is logged with
  its reason, counted, remembered (never read again) and deleted with the next
  publication; it never moves the ledger, which only accepted deltas advance. No content
  of any delta can make a round fail: a round raises only for the hub or the master itself.
* **Nothing non-finite is published.** Weights (``weighting="tokens"``) are scaled by a
  power of two so the FP32 sum never grows beyond its deltas, and the aggregate and the
  new state are checked before publication: a non-finite result publishes nothing, is
  logged as an error and refuses the round's deltas.
* **Signed runs** (a run key): the master signs every manifest it publishes (and its lease),
  and neither adopts a version nor an offered ``init.safetensors`` that is not signed with
  the key. A manifest on the hub that is malformed or not authentic is replaced by the
  last authentic version (compare-and-swap on its bytes) instead of stopping the master.
* **No litter.** At start and with garbage collection, the master sweeps the temporary
  files that dead writers left on the hub, in its cache and in its state folder.
* **Staleness-aware.** Any optimizer of :mod:`diloco_lightning.outer` by name. In
  ``aggregation="round"`` (SPEC.md, "Master round") the accepted deltas of a round give
  ``g = sum(w_i * gate(tau_i) * delta_i) / sum(w_i)`` (``w_i`` 1, or ``num_tokens`` with
  ``weighting="tokens"``), then one step with ``gated=True``. In ``aggregation="arrival"``
  every accepted delta is its own outer step and its own published version, with its own
  staleness, in a deterministic order (see :meth:`MasterOuterLoop._arrival_order`).
  ``pa_cgad`` in round mode: the deltas are averaged *ungated* (``w_i`` weights only) and
  the optimizer gates each fragment itself on ``max(tau_max, age_f)``, ``tau_max`` being the
  largest staleness among the round's accepted deltas (a conservative choice: a fragment
  is never gated more leniently than its stalest contribution). Deltas whose own gate is 0
  are still rejected as ``too_stale`` before they enter the mean.
* **Quorum.** ``min_deltas`` accepted deltas before a round is applied (or ``max_wait``
  seconds after the first one arrived); the pending sum is kept across polls.
* **Crash safety.** Each publication carries the ledger and the optimizer state; the local
  state (:mod:`diloco_lightning.master.localstate`) is written after the remote
  publication, and a (re)starting master adopts whichever of local and hub is newer (the
  hub on ties). A kill -9 anywhere applies every accepted delta exactly once.
* **One master at a time** (:mod:`diloco_lightning.master.lease`) and publication by
  compare-and-swap on the previous version.
* **Bounded growth.** Each publication deletes the deltas it processed, the previous
  optimizer state, global versions beyond ``keep_globals``, and (periodically) orphans and
  stragglers left by crashes.
* **Bootstrap without model code.** With no global version on the hub and no initial
  state, the master adopts the first worker's ``nodes/<node>/init.safetensors`` (sorted by
  node id) as outer step 0 and publishes it.

References: DiLoCo (Douillard et al. 2023, arXiv 2311.08105); CGAD (Shah & Sun 2026, arXiv
2605.09126); asynchronous Local-SGD / Delayed Nesterov (Liu et al. 2024, arXiv 2401.09135).
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import math
import os
import random
import shutil
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Container
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from diloco_lightning.deltafile import (
    DeltaFileError,
    is_synced,
    max_delta_bytes,
    max_header_bytes,
    model_fingerprint,
    read_delta,
    read_delta_header,
    synced_keys,
)
from diloco_lightning.fileio import sha256_file, sweep_temporaries
from diloco_lightning.globals import UnauthenticatedVersionError, load_global, load_outer_state, verify_manifest
from diloco_lightning.hub import open_hub
from diloco_lightning.hub.base import (
    DeltaRef,
    Hub,
    HubAuthError,
    HubFileTooLargeError,
    HubNotFoundError,
    PublishConflictError,
)
from diloco_lightning.manifest import GlobalVersion, Manifest, ManifestError
from diloco_lightning.master import localstate
from diloco_lightning.master.lease import LeaseKeeper, default_holder
from diloco_lightning.master.metrics import MetricsSink, RoundMetrics
from diloco_lightning.master.staging import stage_version
from diloco_lightning.master.validation import (
    DeltaRejected,
    NormGuard,
    check_staleness,
    delta_norm,
    max_abs,
    state_norm,
)
from diloco_lightning.names import MANIFEST_PATH, init_path, parse_delta_path
from diloco_lightning.signing import RunKey, load_run_key
from diloco_lightning.statefile import StateFileError, load_state_file, load_weights_file
from diloco_lightning.stheader import LayoutError, read_layout

__all__ = ["MasterOuterLoop", "MasterConfig", "MasterConfigError", "ProcessedDeltas"]

log = logging.getLogger(__name__)

AGGREGATIONS = ("round", "arrival")
WEIGHTINGS = ("equal", "tokens")
_MOMENTUM_OPTIMIZERS = ("nesterov", "poly_nesterov", "delayed_nesterov")
_STATE_DICT_FORMAT = "diloco-master/1"
#: refused files remembered (path, version token), so they are never read twice; bounded
_REFUSED_MEMORY = 100_000


class MasterConfigError(ValueError):
    """The hub's published run does not match this master's configuration (optimizer, model)."""


class _LeaseLost(Exception):
    pass


# ----------------------------------------------------------------------------- config


@dataclass
class MasterConfig:
    """Everything that shapes the master's behaviour (constructor keywords of :class:`MasterOuterLoop`)."""

    outer_optimizer: str = "nesterov"
    outer_options: dict[str, Any] = field(default_factory=dict)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    aggregation: str = "round"
    weighting: str = "equal"
    poll_interval: float = 60.0
    min_deltas: int = 1
    max_wait: float | None = None
    max_staleness: int | None = None
    max_delta_norm: float | None = None
    norm_global_ratio: float | None = 100.0
    norm_ratio: float | None = 10.0
    norm_window: int = 32
    norm_min_history: int = 4
    download_workers: int = 4
    prefetch: int = 4
    max_download_attempts: int = 3
    arrival_batch: int = 64
    keep_globals: int = 4
    lease: bool = True
    lease_ttl: float | None = None
    gc_every: int = 16
    retry_max_delay: float = 300.0
    torch_threads: int | None = None
    sweep_age: float = 3600.0

    def validate(self) -> "MasterConfig":
        def bad(name: str, want: str) -> None:
            raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")

        def num(name: str, *, low: float, strict: bool = False, optional: bool = False, integer: bool = False) -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            ok = (
                not isinstance(v, bool)
                and isinstance(v, (int, float))
                and (not integer or isinstance(v, int))
                and math.isfinite(v)
                and (v > low if strict else v >= low)
            )
            if not ok:
                bad(name, f"{'an integer' if integer else 'a number'} {'>' if strict else '>='} {low}" + (" or None" if optional else ""))

        if not isinstance(self.outer_optimizer, str) or not self.outer_optimizer:
            bad("outer_optimizer", "an optimizer name")
        if not isinstance(self.outer_options, Mapping):
            bad("outer_options", "a mapping of option names to values")
        if self.aggregation not in AGGREGATIONS:
            bad("aggregation", f"one of {list(AGGREGATIONS)}")
        if self.weighting not in WEIGHTINGS:
            bad("weighting", f"one of {list(WEIGHTINGS)}")
        num("outer_lr", low=0.0, strict=True)
        num("outer_momentum", low=0.0)
        num("poll_interval", low=0.0, strict=True)
        num("min_deltas", low=1, integer=True)
        num("max_wait", low=0.0, optional=True)
        num("max_staleness", low=0, integer=True, optional=True)
        num("max_delta_norm", low=0.0, strict=True, optional=True)
        num("norm_global_ratio", low=0.0, strict=True, optional=True)
        num("norm_ratio", low=1.0, strict=True, optional=True)
        num("norm_window", low=1, integer=True)
        num("norm_min_history", low=1, integer=True)
        num("download_workers", low=1, integer=True)
        num("prefetch", low=1, integer=True)
        num("max_download_attempts", low=1, integer=True)
        num("arrival_batch", low=1, integer=True)
        num("keep_globals", low=0, integer=True)
        num("lease_ttl", low=0.0, strict=True, optional=True)
        num("gc_every", low=1, integer=True)
        num("retry_max_delay", low=0.0, strict=True)
        num("torch_threads", low=1, integer=True, optional=True)
        num("sweep_age", low=0.0, strict=True)
        return self

    def optimizer_options(self) -> dict[str, Any]:
        """``outer_lr`` (and ``outer_momentum`` for the Nesterov family), overridden by ``outer_options``."""
        opts: dict[str, Any] = {"lr": self.outer_lr}
        if self.outer_optimizer in _MOMENTUM_OPTIMIZERS:
            opts["momentum"] = self.outer_momentum
        opts.update(dict(self.outer_options))
        return opts

    def effective_lease_ttl(self) -> float:
        return self.lease_ttl if self.lease_ttl is not None else max(3.0 * self.poll_interval, 30.0)


# ----------------------------------------------------------------------------- helpers


class ProcessedDeltas(Container):
    """``path in master.processed_filenames``: whether a delta was processed (applied or rejected).

    Speedtronic keeps a set of file names that grows forever; here membership is answered
    from the per-node ledger (``local_step <= ledger[node]``), which is what is published.
    """

    def __init__(self, ledger: Mapping[str, int]) -> None:
        self.ledger = dict(ledger)

    def __contains__(self, item: object) -> bool:
        if not isinstance(item, str):
            return False
        ident = parse_delta_path(item)
        return ident is not None and ident.local_step <= self.ledger.get(ident.node_id, -1)

    def __repr__(self) -> str:
        return f"ProcessedDeltas(ledger={self.ledger!r})"


@dataclass
class _Accepted:
    ref: DeltaRef
    staleness: int
    gate: float
    weight: float
    norm: float

    @property
    def ident(self) -> str:
        return f"{self.ref.node_id}/{self.ref.local_step}"


@dataclass
class _OpenRound:
    """A round being gathered (kept across polls while waiting for the quorum)."""

    outer_step: int
    sum: dict[str, torch.Tensor] | None = None
    #: weights are summed (and the sum accumulated) in units of ``scale``, the smallest power of
    #: two at or above the largest weight so far: every coefficient is at most 1, so the FP32 sum
    #: is bounded by its deltas whatever ``num_tokens`` claims, and powers of two keep it exact
    scale: float = 1.0
    total_weight: float = 0.0
    accepted: list[_Accepted] = field(default_factory=list)
    marks: dict[str, int] = field(default_factory=dict)
    first_at: float | None = None


def _merge_marks(*marks: Mapping[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in marks:
        for node, step in m.items():
            if step > out.get(node, -1):
                out[node] = step
    return out


def _cpu_clone(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def _build_optimizer(name: str, state: Mapping[str, torch.Tensor], options: Mapping[str, Any]):
    from diloco_lightning.outer import build_outer_optimizer

    return build_outer_optimizer(name, state, **dict(options))


# ----------------------------------------------------------------------------- the master


class MasterOuterLoop:
    """The DiLoCo master (see the module docstring for what it guarantees).

    Args:
        hub: a :class:`~diloco_lightning.hub.base.Hub` or a URL for :func:`~diloco_lightning.hub.open_hub`.
        state: the initial global state (cloned to CPU), or None to adopt the hub's newest
            version, or else the first worker's ``init.safetensors``.
        node_state_dir: a folder of its own for the local state (``metadata_path``,
            ``state_path``, ``outer_state_path``).
        outer_lr, outer_momentum: Speedtronic's Nesterov lr (0.7) and momentum (0.9); ``outer_lr``
            is the ``lr`` of every optimizer and ``outer_momentum`` the momentum of the
            Nesterov family, unless ``outer_options`` sets them.
        poll_interval: seconds between rounds of the background thread.
        on_global_update: called with a cloned state after each publication (the new version is
            ``master.outer_step``); an exception from it is logged, never raised.
        logger: a :class:`logging.Logger` (gets a progress line per round at INFO) or a callable
            receiving each round's metrics dict (:class:`~diloco_lightning.master.metrics.RoundMetrics`).
        outer_optimizer, outer_options: the outer optimizer by name
            (:func:`diloco_lightning.outer.build_outer_optimizer`) and its options.
        aggregation: ``"round"`` (one step per round over all accepted deltas) or ``"arrival"``
            (one step and one version per accepted delta).
        weighting: ``"equal"`` or ``"tokens"`` (weights are the headers' ``num_tokens``).
        min_deltas, max_wait: quorum: apply a round once ``min_deltas`` deltas were accepted, or
            ``max_wait`` seconds after the first one (None: wait for the quorum).
        max_staleness: reject deltas staler than this (None: only the optimizer's gate decides).
        max_delta_norm, norm_global_ratio, norm_ratio, norm_window, norm_min_history: norm bounds
            (:class:`~diloco_lightning.master.validation.NormGuard`; None disables one).
            ``norm_global_ratio`` (default 100) bounds every delta, from the first one, by
            ``100 x max(||global||, 0.01 sqrt(n))``; see :mod:`~diloco_lightning.master.validation`.
        download_workers, prefetch: parallel downloads, and how many deltas may be fetched ahead.
        max_download_attempts: a delta failing to download this many times is rejected.
        arrival_batch: at most this many deltas handled per ``sync_once`` in arrival mode.
        keep_globals: older versions kept on the hub besides the current one.
        lease, lease_ttl, holder: one master at a time (``lease_ttl`` default:
            ``max(3 * poll_interval, 30)`` seconds; ``holder`` default ``host:pid:random``).
        signing_key: the run key (signed runs); default from ``DILOCO_RUN_KEY`` /
            ``DILOCO_RUN_KEY_FILE``, none meaning an unsigned run.
        metrics_path: a JSONL file receiving one line per eventful round.
        gc_every: every this many publications (and the first after a start or an adoption)
            also sweep orphans of interrupted publications and processed deltas left behind.
        retry_max_delay: the longest pause of the background thread after failed rounds.
        sweep_age: temporary files of writers on other hosts (or of unknown owner) older than
            this many seconds are removed by the litter sweep (same-host ones as soon as their
            process is gone).
        torch_threads: if set, ``torch.set_num_threads(torch_threads)`` (process-wide). The round
            is memory-bound; on a machine whose cores are shared, multi-threaded ops stall on
            OpenMP barriers (measured: 5x slower rounds at 2 threads on 2 busy cores), so a
            dedicated master process does best with 1. None leaves torch's setting alone.
    """

    def __init__(
        self,
        hub: Hub | str | os.PathLike,
        state: Mapping[str, torch.Tensor] | None = None,
        *,
        node_state_dir: str | os.PathLike,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        poll_interval: float = 60.0,
        on_global_update: Callable[[dict[str, torch.Tensor]], Any] | None = None,
        logger: logging.Logger | Callable[[dict], Any] | None = None,
        outer_optimizer: str = "nesterov",
        outer_options: Mapping[str, Any] | None = None,
        aggregation: str = "round",
        weighting: str = "equal",
        min_deltas: int = 1,
        max_wait: float | None = None,
        max_staleness: int | None = None,
        max_delta_norm: float | None = None,
        norm_global_ratio: float | None = 100.0,
        norm_ratio: float | None = 10.0,
        norm_window: int = 32,
        norm_min_history: int = 4,
        download_workers: int = 4,
        prefetch: int = 4,
        max_download_attempts: int = 3,
        arrival_batch: int = 64,
        keep_globals: int = 4,
        lease: bool = True,
        lease_ttl: float | None = None,
        holder: str | None = None,
        signing_key: RunKey | bytes | str | None = None,
        metrics_path: str | os.PathLike | None = None,
        gc_every: int = 16,
        retry_max_delay: float = 300.0,
        torch_threads: int | None = None,
        sweep_age: float = 3600.0,
    ) -> None:
        self.config = MasterConfig(
            outer_optimizer=outer_optimizer,
            outer_options=dict(outer_options or {}),
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            aggregation=aggregation,
            weighting=weighting,
            poll_interval=poll_interval,
            min_deltas=min_deltas,
            max_wait=max_wait,
            max_staleness=max_staleness,
            max_delta_norm=max_delta_norm,
            norm_global_ratio=norm_global_ratio,
            norm_ratio=norm_ratio,
            norm_window=norm_window,
            norm_min_history=norm_min_history,
            download_workers=download_workers,
            prefetch=prefetch,
            max_download_attempts=max_download_attempts,
            arrival_batch=arrival_batch,
            keep_globals=keep_globals,
            lease=lease,
            lease_ttl=lease_ttl,
            gc_every=gc_every,
            retry_max_delay=retry_max_delay,
            torch_threads=torch_threads,
            sweep_age=sweep_age,
        ).validate()
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        if on_global_update is not None and not callable(on_global_update):
            raise ValueError(f"on_global_update must be callable or None, got {on_global_update!r}")
        if node_state_dir is None:
            raise ValueError("node_state_dir is required: a folder for the master's local state")
        self.hub: Hub = hub if isinstance(hub, Hub) else open_hub(hub)
        self.node_state_dir = Path(node_state_dir)
        self.node_state_dir.mkdir(parents=True, exist_ok=True)
        self.on_global_update = on_global_update
        self._sink = MetricsSink(metrics_path, logger)
        self._key = load_run_key(signing_key)
        self.holder = holder or default_holder()
        self._lease = (
            LeaseKeeper(self.hub, self.holder, self.config.effective_lease_ttl(), signing_key=self._key)
            if self.config.lease
            else None
        )
        self._opt_options = self.config.optimizer_options()
        #: test hook: called with a label at each step of a round ("listed", "downloaded",
        #: "stepped", "staged", "published", "saved", "swapped"); raising or killing the
        #: process there simulates a crash at that point.
        self.fault: Callable[[str], None] | None = None

        self._lock = threading.Lock()  # in-memory state only; never held across I/O
        self._round_lock = threading.RLock()  # one round at a time
        self._thread_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()

        self._state: dict[str, torch.Tensor] | None = None
        self._spare: dict[str, torch.Tensor] | None = None
        self._opt = None
        self._fingerprint: str | None = None
        self._user_fingerprint: str | None = None
        self._outer_step = 0
        self._ledger: dict[str, int] = {}
        self._manifest: Manifest | None = None  # the published version our state equals
        self._hub_manifest: Manifest | None = None  # the hub's current version as last seen
        self._record: localstate.LocalRecord | None = None
        self._committed_outer_file: Path | None = None
        self._norms = NormGuard(max_delta_norm, norm_ratio, norm_window, norm_min_history, norm_global_ratio)
        self._norms_at: tuple[int, str | None] | None = None  # (outer_step, weights) the global bound is for
        self._open: _OpenRound | None = None
        self._pending_paths: list[str] = []  # refused since the last publication: deleted by the next one
        self._refused: OrderedDict[tuple[str, str | None], None] = OrderedDict()
        self._download_failures: dict[tuple[str, int], int] = {}
        self._replays_seen: OrderedDict[str, None] = OrderedDict()
        self._limits: tuple[str, int, int] | None = None  # (fingerprint, max file bytes, max header bytes)
        self._swept = False
        self._arrival_wait_since: float | None = None
        self._gc_countdown = 0
        self._last_metrics: RoundMetrics | None = None
        self._waiting_logged = False

        if state is not None:
            self._install(_cpu_clone(self._check_state(state, "state")), outer_step=0)
            self._user_fingerprint = self._fingerprint
        self._load_local()

    # ================================================================== public API

    @property
    def outer_step(self) -> int:
        with self._lock:
            return self._outer_step

    @property
    def ledger(self) -> dict[str, int]:
        """The committed per-node high-water marks (what the last published manifest carries)."""
        with self._lock:
            return dict(self._ledger)

    @property
    def processed_filenames(self) -> ProcessedDeltas:
        """``"nodes/<n>/delta_<s>.safetensors" in master.processed_filenames`` (see :class:`ProcessedDeltas`)."""
        return ProcessedDeltas(self.ledger)

    @property
    def metadata_path(self) -> Path:
        """The local commit record (``master.json``)."""
        return self.node_state_dir / localstate.METADATA_NAME

    @property
    def state_path(self) -> Path | None:
        """The local copy of the current global weights (a versioned name; None before the first save)."""
        rec = self._record
        return rec.weights_file if rec is not None else None

    @property
    def outer_state_path(self) -> Path | None:
        """The local copy of the current optimizer state (None before the first save)."""
        rec = self._record
        return rec.outer_state_file if rec is not None else None

    @property
    def is_leader(self) -> bool:
        """Whether this master held the lease at its last round (always True without a lease)."""
        return self._lease is None or self._lease.held

    @property
    def last_metrics(self) -> dict[str, Any] | None:
        m = self._last_metrics
        return None if m is None else m.to_dict()

    @property
    def optimizer(self):
        """The outer optimizer (mutated by rounds: read it only between them)."""
        return self._opt

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """``(outer_step, cloned full state)`` of the last published version.

        Never waits for network I/O: rounds compute on a second buffer and only swap it in
        under the lock.
        """
        with self._lock:
            if self._state is None:
                raise RuntimeError(
                    "the master has no global state yet (no initial state given, nothing published on the hub, "
                    "no worker's init.safetensors adopted); call sync_once() first"
                )
            return self._outer_step, {k: v.clone() for k, v in self._state.items()}

    def sync_once(self, *, force: bool = False) -> bool:
        """One round: reconcile with the hub, fetch and check new deltas, apply, publish.

        ``force`` applies the pending deltas even below the quorum (``min_deltas``).
        Returns True if at least one new version was published.
        """
        with self._round_lock:
            m = RoundMetrics(aggregation=self.config.aggregation, optimizer=self.config.outer_optimizer, holder=self.holder)
            t0 = time.perf_counter()
            try:
                self._sync(m, force)
            finally:
                m.round_seconds = time.perf_counter() - t0
                m.outer_step = self._outer_step
                m.epoch = self._lease.epoch if self._lease is not None else None
                self._last_metrics = m
                if m.eventful or (m.waiting and m.downloads > 0):
                    self._sink.emit(m)
            return m.published > 0

    def start(self) -> None:
        """Run rounds every ``poll_interval`` seconds in one daemon thread (errors are logged and retried)."""
        with self._thread_lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop_event = threading.Event()
            self._thread = threading.Thread(target=self._run, name=f"diloco-master-{self.holder}", daemon=True)
            self._thread.start()

    def stop(self, drain: bool = False, timeout: float | None = None) -> None:
        """Stop the background thread and return once it has ended (a round in progress finishes).

        ``drain=True`` then runs a final round that applies whatever is pending, quorum or not.
        The lease is released, so a standby master can take over at once.
        """
        with self._thread_lock:
            self._stop_event.set()
            t = self._thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                log.warning("the master thread did not end within %.1fs", timeout)
                return
        with self._thread_lock:
            self._thread = None
        if drain:
            try:
                self.sync_once(force=True)
            except Exception:  # noqa: BLE001
                log.exception("the final round of stop(drain=True) failed")
        if self._lease is not None:
            with self._round_lock:
                self._lease.release()

    def close(self) -> None:
        """``stop()``, then close the hub."""
        self.stop()
        self.hub.close()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: global state, optimizer state, ledger, history, norm window.

        Tensors are clones; the rest is JSON-able, so ``statefile.save_state_file`` can store it.
        Waits for a round in progress (the optimizer's buffers change during a step).
        """
        with self._round_lock:
            if self._state is None:
                raise RuntimeError("the master has no global state yet; call sync_once() first")
            with self._lock:
                return {
                    "format": _STATE_DICT_FORMAT,
                    "outer_step": self._outer_step,
                    "global": {k: v.clone() for k, v in self._state.items()},
                    "optimizer": self._opt.state_dict(),
                    "outer_optimizer": self.config.outer_optimizer,
                    "outer_options": dict(self._opt.options),
                    "ledger": dict(self._ledger),
                    "history": [asdict(v) for v in (self._manifest.history if self._manifest else [])],
                    "norms": self._norms.norms,
                }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace the master's state by one from :meth:`state_dict`.

        The next round still reconciles with the hub: a hub version at least as new wins.
        """
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != _STATE_DICT_FORMAT:
            raise ValueError(f"state_dict must be a {_STATE_DICT_FORMAT!r} mapping from MasterOuterLoop.state_dict()")
        name = state_dict.get("outer_optimizer")
        if name != self.config.outer_optimizer:
            raise ValueError(
                f"state_dict is for outer optimizer {name!r}, this master runs {self.config.outer_optimizer!r}"
            )
        step = state_dict.get("outer_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"state_dict['outer_step'] must be a non-negative integer, got {step!r}")
        ledger = state_dict.get("ledger") or {}
        if not isinstance(ledger, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in ledger.items()
        ):
            raise ValueError("state_dict['ledger'] must map node ids to integers")
        state = _cpu_clone(self._check_state(state_dict.get("global"), "state_dict['global']"))
        opt = _build_optimizer(self.config.outer_optimizer, state, self._opt_options)
        opt.load_state_dict(state_dict.get("optimizer") or {})
        with self._round_lock:
            self._discard()
            with self._lock:
                self._state, self._spare, self._opt = state, None, opt
                self._fingerprint = model_fingerprint(state)
                self._outer_step = step
                self._ledger = dict(ledger)
                self._manifest = None
            self._norms.load(state_dict.get("norms") or [])
            self._committed_outer_file = None

    # ================================================================== background thread

    def _run(self) -> None:
        failures = 0
        stop = self._stop_event
        while not stop.is_set():
            try:
                self.sync_once()
                failures = 0
                delay = self.config.poll_interval
            except Exception:  # noqa: BLE001 - logged and retried, with backoff and jitter
                failures += 1
                base = min(self.config.poll_interval * 2 ** min(failures - 1, 16), max(self.config.retry_max_delay, self.config.poll_interval))
                delay = base * random.uniform(0.5, 1.0)
                log.exception("master round failed (%d in a row); retrying in %.1fs", failures, delay)
            stop.wait(delay)

    # ================================================================== one round

    def _sync(self, m: RoundMetrics, force: bool) -> None:
        if not self._swept:
            self._sweep()
        if self._lease is not None:
            if not self._lease.acquire(min_epoch=self._published_epoch):
                m.standby = True
                self._discard()
                return
        if not self._reconcile(m):
            return
        if self.config.aggregation == "round":
            self._round(m, force)
        else:
            self._arrival(m, force)

    def _published_epoch(self) -> int:
        """The lease epoch in the hub's manifest (a new lease's epoch is above it)."""
        try:
            hm = self.hub.read_manifest()
        except Exception:  # noqa: BLE001 - the lease CAS is what matters; the epoch is for the record
            hm = self._hub_manifest
        epoch = (hm.master or {}).get("epoch", 0) if hm is not None else 0
        return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0 else 0

    def _fault(self, label: str) -> None:
        if self.fault is not None:
            self.fault(label)

    def _sweep(self) -> None:
        """Remove what dead writers left: temporary files on the hub, in its cache, in our state folder."""
        self._swept = True
        age = self.config.sweep_age
        try:
            removed = self.hub.sweep(age) + sweep_temporaries(self.node_state_dir, age)
        except Exception as e:  # noqa: BLE001 - sweeping is housekeeping, never a reason to fail a round
            log.warning("could not sweep temporary files of %s: %s", self.hub.url, e)
            return
        if removed:
            log.info("swept %d temporary file(s) left by interrupted writers (%s%s)", len(removed),
                     ", ".join(removed[:3]), " ..." if len(removed) > 3 else "")

    # ------------------------------------------------------------------ reconcile / adopt

    def _reconcile(self, m: RoundMetrics) -> bool:
        """Bring the in-memory state in line with the hub. False when there is nothing to work on yet."""
        try:
            hm = self.hub.read_manifest()
            if hm is not None:
                verify_manifest(hm, self._key, self.hub.url)
        except ManifestError as e:
            return self._replace_forged(f"{self.hub.url}/{MANIFEST_PATH} is not a valid manifest ({e})", m)
        except UnauthenticatedVersionError as e:
            return self._replace_forged(str(e), m)
        if hm is None:
            self._hub_manifest = None
            if self._state is None and not self._bootstrap_from_init():
                return False
            # Nothing on the hub: publish our current version (outer step 0, or a restart on a wiped hub).
            if self._publish_current(m):
                m.published += 1
            return self._hub_manifest is not None
        if self._state is not None and self._manifest is not None and hm.outer_step == self._outer_step and hm.weights == self._manifest.weights:
            self._hub_manifest = hm
            return True
        if self._state is None or hm.outer_step >= self._outer_step:
            self._adopt(hm, m)
            return True
        if self._hub_manifest is None or self._hub_manifest.weights != hm.weights:
            log.warning(
                "the local state (outer_step %d) is newer than the hub's (%d); publishing over it",
                self._outer_step, hm.outer_step,
            )
        self._hub_manifest = hm
        return True

    def _replace_forged(self, reason: str, m: RoundMetrics) -> bool:
        """The hub's manifest is not one a master of this run published (malformed, or not signed
        with the run key): never adopt it; publish our last authentic version over it, by
        compare-and-swap on its exact bytes. False when there is nothing of ours to publish."""
        if self._state is None:
            log.error("%s; this master has no version of its own to restore, waiting", reason)
            return False
        log.error("%s; publishing this master's outer_step %d over it", reason, self._outer_step)
        raw = self.hub.read_manifest_bytes()
        digest = None if raw is None else hashlib.sha256(raw).hexdigest()
        self._hub_manifest = None
        try:
            self._publish(self._outer_step, self._state, dict(self._ledger), [], [], m,
                          history=list(self._manifest.history) if self._manifest is not None else [],
                          expected_digest=digest)
        except PublishConflictError as e:
            log.info("%s; reading the hub again", e)
            m.conflict = True
            return False
        except _LeaseLost:
            m.standby = True
            return False
        m.published += 1
        self._notify()
        return True

    def _adopt(self, hm: Manifest, m: RoundMetrics | None) -> None:
        """Make the hub's version ``hm`` ours: weights, optimizer state, ledger, history, norm window."""
        name = (hm.optimizer or {}).get("name")
        if name is not None and name != self.config.outer_optimizer:
            raise MasterConfigError(
                f"the hub's run uses outer optimizer {name!r} (published outer_step {hm.outer_step}); "
                f"this master is configured for {self.config.outer_optimizer!r}"
            )
        if self._user_fingerprint is not None and hm.model_fingerprint != self._user_fingerprint:
            raise MasterConfigError(
                f"the hub's global model (fingerprint {hm.model_fingerprint[:12]}...) is not the model this master "
                f"was given (fingerprint {self._user_fingerprint[:12]}...)"
            )
        opts = (hm.optimizer or {}).get("options") or {}
        if opts and opts != dict(self._opt.options if self._opt is not None else self._opt_options):
            log.info("the hub's run used optimizer options %s; continuing with %s", opts, self._opt_options)
        state, outer, src_w, src_o = self._load_version(hm)
        opt = _build_optimizer(self.config.outer_optimizer, state, self._opt_options)
        norms: list[float] = []
        if outer is not None:
            opt.load_state_dict(outer.get("optimizer") or {})
            norms = list(((outer.get("master") or {}).get("norms")) or [])
        elif hm.outer_step > 0:
            log.warning("outer_step %d on %s has no optimizer state; starting the optimizer afresh", hm.outer_step, self.hub.url)
        self._discard()
        with self._lock:
            self._state, self._spare, self._opt = state, None, opt
            self._fingerprint = hm.model_fingerprint
            self._outer_step = hm.outer_step
            self._ledger = dict(hm.ledger)
            self._manifest = hm
            self._hub_manifest = hm
        self._norms.load(norms)
        self._gc_countdown = 0
        if m is not None:
            m.adopted = hm.outer_step
        log.info("adopted outer_step %d from %s (%d node(s) in the ledger)", hm.outer_step, self.hub.url, len(hm.ledger))
        self._persist_adopted(hm, src_w, src_o)

    def _load_version(self, hm: Manifest, *, local_only: bool = False):
        """(state, outer payload, weights file, outer-state file) of ``hm``: local copy if it is that version, else the hub."""
        rec = self._record
        if rec is not None and rec.manifest.weights == hm.weights and rec.manifest.outer_state == hm.outer_state:
            try:
                if sha256_file(rec.weights_file) == hm.weights_sha256 and (
                    rec.outer_state_file is None or hm.outer_state_sha256 is None
                    or sha256_file(rec.outer_state_file) == hm.outer_state_sha256
                ):
                    state, _ = load_weights_file(rec.weights_file)
                    outer = load_state_file(rec.outer_state_file)[0] if rec.outer_state_file is not None else None
                    if model_fingerprint(state) == hm.model_fingerprint:
                        return state, outer, None, None
            except (OSError, StateFileError) as e:
                log.warning("local copy of outer_step %d unusable (%s)", hm.outer_step, e)
        if local_only:
            raise ValueError(f"the local copy of outer_step {hm.outer_step} does not match its record")
        _, state = load_global(self.hub, hm, signing_key=self._key)
        outer = load_outer_state(self.hub, hm, signing_key=self._key)
        src_w = self.hub.download(hm.weights)
        src_o = self.hub.download(hm.outer_state) if hm.outer_state else None
        return state, outer, src_w, src_o

    def _persist_adopted(self, hm: Manifest, src_w: Path | None, src_o: Path | None) -> None:
        if src_w is None:  # loaded from the local record itself
            self._committed_outer_file = self._record.outer_state_file if self._record else None
            return
        self._committed_outer_file = None
        try:
            dst_w = self.node_state_dir / Path(hm.weights).name
            shutil.copyfile(src_w, dst_w)
            dst_o = None
            if src_o is not None and hm.outer_state:
                dst_o = self.node_state_dir / Path(hm.outer_state).name
                shutil.copyfile(src_o, dst_o)
            self._record = localstate.save_record(self.node_state_dir, self.hub.url, hm, dst_w, dst_o)
            self._committed_outer_file = dst_o
        except OSError as e:
            log.warning("could not save the adopted version locally in %s: %s", self.node_state_dir, e)
        for p in (src_w, src_o):
            self._drop_cached(p)

    def _bootstrap_from_init(self) -> bool:
        inits = self.hub.list_inits()
        if not inits:
            if not self._waiting_logged:
                log.info("nothing published on %s and no worker's init.safetensors yet; waiting", self.hub.url)
                self._waiting_logged = True
            return False
        for node in inits:
            path = self.hub.download(init_path(node))
            try:
                if self._key is not None:
                    layout = read_layout(path)
                    if not self._key.verify_file(layout.metadata.get("signature"), path, layout):
                        raise ValueError("it is not signed with the run key")
                state, _ = load_weights_file(path)
                state = self._check_state(state, f"nodes/{node}/init.safetensors")
            except (ValueError, OSError, LayoutError, StateFileError) as e:
                log.error("ignoring nodes/%s/init.safetensors on %s: %s", node, self.hub.url, e)
                continue
            finally:
                self._drop_cached(path)
            self._install(state, outer_step=0)
            log.info("bootstrapped the global state from nodes/%s/init.safetensors (%d tensors)", node, len(state))
            return True
        return False

    def _publish_current(self, m: RoundMetrics) -> bool:
        """Publish the current state as is (the hub has no version): outer step 0, or a re-publication."""
        try:
            self._publish(self._outer_step, self._state, dict(self._ledger), [], [], m, history=[])
        except PublishConflictError as e:
            log.info("%s; reading the hub's version", e)
            m.conflict = True
            return False
        except _LeaseLost:
            m.standby = True
            return False
        self._notify()
        return True

    # ------------------------------------------------------------------ listing and fetching

    def _effective_marks(self) -> dict[str, int]:
        return _merge_marks(self._ledger, self._open.marks if self._open else {})

    def _size_limits(self) -> tuple[int, int]:
        """(max file bytes, max header bytes) of an honest delta of the current model."""
        if self._limits is None or self._limits[0] != self._fingerprint:
            n = len(synced_keys(self._state))
            self._limits = (self._fingerprint, max_delta_bytes(self._state), max_header_bytes(n))
        return self._limits[1], self._limits[2]

    def _list_new(self, m: RoundMetrics) -> list[DeltaRef]:
        marks = self._effective_marks()
        refs = self.hub.list_deltas(after=marks)
        m.listed = len(refs)
        max_bytes, _ = self._size_limits()
        out: list[DeltaRef] = []
        seen: set[tuple[str, int]] = set()
        for ref in refs:
            if (ref.path, ref.version) in self._refused:
                continue  # refused before: never read twice (a new file at that path has a new version)
            if ref.size is not None and ref.size > max_bytes:
                self._reject(ref, "size", f"{ref.size} bytes listed; a delta of this model is at most {max_bytes}", m)
                continue
            key = (ref.node_id, ref.local_step)
            if ref.local_step <= marks.get(ref.node_id, -1) or key in seen:
                # a hub that lists what it was told to leave out, or lists a delta twice: never re-download
                if ref.path not in self._replays_seen:
                    self._replays_seen[ref.path] = None
                    while len(self._replays_seen) > 10000:
                        self._replays_seen.popitem(last=False)
                    log.warning("rejecting %s: replay of an already processed delta", ref.path)
                    m.reject("replay")
                continue
            seen.add(key)
            out.append(ref)
        out.sort()
        return out

    def _fetch(
        self, refs: list[DeltaRef], blocked: set[str], m: RoundMetrics
    ) -> Iterator[tuple[DeltaRef, Path | None, BaseException | None]]:
        """Yield ``(ref, local path, error)`` in order; downloads run ``prefetch`` ahead on a bounded pool."""
        if not refs:
            return
        it = iter(refs)
        window: deque = deque()
        max_bytes, _ = self._size_limits()
        ex = ThreadPoolExecutor(max_workers=self.config.download_workers, thread_name_prefix="diloco-master-dl")

        def submit() -> None:
            for ref in it:
                if ref.node_id in blocked:
                    continue
                window.append((ref, ex.submit(self.hub.download, ref.path, max_bytes=max_bytes)))
                return

        try:
            for _ in range(self.config.prefetch):
                submit()
            while window:
                ref, fut = window.popleft()
                submit()
                try:
                    path = fut.result()
                except BaseException as e:  # noqa: BLE001 - classified by the caller
                    yield ref, None, e
                    continue
                m.downloads += 1
                try:
                    m.bytes_downloaded += ref.size if ref.size is not None else os.path.getsize(path)
                except OSError:
                    pass
                yield ref, path, None
        finally:
            for _, fut in window:
                fut.cancel()
            ex.shutdown(wait=True, cancel_futures=True)

    def _downloaded(self, refs: list[DeltaRef], blocked: set[str], m: RoundMetrics) -> Iterator[tuple[DeltaRef, Path]]:
        """``_fetch`` with each failed download classified (``_download_error``) and the deltas of a
        node blocked meanwhile dropped: ``(ref, local path)`` of the deltas to process, in order."""
        for ref, path, err in self._fetch(refs, blocked, m):
            if err is not None:
                self._download_error(ref, err, blocked, m)
                continue
            if ref.node_id in blocked:
                self._drop_cached(path)
                continue
            yield ref, path

    def _download_error(self, ref: DeltaRef, err: BaseException, blocked: set[str], m: RoundMetrics) -> None:
        """Classify a failed download: auth errors abort the round; others block the node, then reject."""
        if isinstance(err, HubAuthError):
            raise err
        if isinstance(err, HubFileTooLargeError):
            self._reject(ref, "size", str(err), m)
            return
        if isinstance(err, HubNotFoundError):
            blocked.add(ref.node_id)  # later deltas of this node wait: the ledger is a high-water mark
            log.info("%s vanished before it was downloaded (processed elsewhere?): %s", ref.path, err)
            return
        key = (ref.node_id, ref.local_step)
        n = self._download_failures.get(key, 0) + 1
        self._download_failures[key] = n
        if n >= self.config.max_download_attempts:
            del self._download_failures[key]
            self._reject(ref, "download", f"{n} failed attempts, last: {err}", m)
        else:
            blocked.add(ref.node_id)
            log.warning("download of %s failed (attempt %d of %d): %s", ref.path, n, self.config.max_download_attempts, err)

    def _drop_cached(self, path: Path | None) -> None:
        """Remove a downloaded copy from the hub's cache (never a file of a folder hub itself)."""
        if path is None:
            return
        try:
            p = Path(path).resolve()
            root = getattr(self.hub, "root", None)
            if root is not None and p.is_relative_to(Path(root).resolve()):
                return
            if p.is_relative_to(Path(self.hub.cache_dir).resolve()):
                p.unlink(missing_ok=True)
        except OSError:
            pass

    # ------------------------------------------------------------------ checks

    def _reject(self, ref: DeltaRef, reason: str, detail: str, m: RoundMetrics) -> None:
        """Refuse a delta: logged, counted, remembered (never read again), deleted with the next
        publication. It does not move the ledger: only accepted deltas do, so a file anyone put
        under a node's name cannot hide that node's later work."""
        log.warning("rejecting %s: %s: %s", ref.path, reason, detail)
        m.reject(reason)
        self._refused[(ref.path, ref.version)] = None
        while len(self._refused) > _REFUSED_MEMORY:
            self._refused.popitem(last=False)
        self._pending_paths.append(ref.path)

    def _check_safely(self, ref: DeltaRef, path: Path, outer_step: int):
        """:meth:`_check`, with any error from the file's content turned into a rejection:
        ``(Delta, _Accepted)``, or raises ``DeltaRejected``."""
        try:
            return self._check(ref, path, outer_step)
        except (DeltaRejected, DeltaFileError):
            raise
        except Exception as e:  # noqa: BLE001 - a last line of defence: one delta never fails a round
            log.exception("unexpected error while checking %s", ref.path)
            raise DeltaRejected("invalid", f"{type(e).__name__}: {str(e)[:300]}") from None

    def _global_bound_for(self, outer_step: int) -> None:
        """Point the global-relative norm bound at the current state (computed once per version)."""
        key = (outer_step, self._manifest.weights if self._manifest is not None else None)
        if self._norms_at != key:
            self._norms.set_global(*state_norm(self._state))
            self._norms_at = key

    def _check(self, ref: DeltaRef, path: Path, outer_step: int):
        """Validate one downloaded delta against the state at ``outer_step``; ``(Delta, _Accepted)`` or raise."""
        max_bytes, max_header = self._size_limits()
        header = read_delta_header(path, max_header=max_header)
        if header.node_id != ref.node_id or header.local_step != ref.local_step:
            raise DeltaRejected(
                "path_mismatch",
                f"header says {header.node_id}/{header.local_step}, the hub path {ref.node_id}/{ref.local_step}",
            )
        tau = outer_step - header.base_outer_step
        gate = float(self._opt.gate(tau)) if tau >= 0 else 0.0
        check_staleness(tau, max_staleness=self.config.max_staleness, gate=gate)
        weight = 1.0
        if self.config.weighting == "tokens":
            if not header.num_tokens:
                raise DeltaRejected("num_tokens", "weighting='tokens' needs a positive num_tokens in the header")
            weight = float(header.num_tokens)
        delta = read_delta(
            path,
            reference=self._state,
            hub_path=ref.path,
            expected_fingerprint=self._fingerprint,
            signing_key=self._key,
            check_finite=False,  # the norm below is NaN/inf exactly when a value is
            max_file_bytes=max_bytes,
        )
        norm = delta_norm(delta.tensors)
        self._global_bound_for(outer_step)
        self._norms.check(norm, delta.tensors)
        return delta, _Accepted(ref, tau, gate, weight, norm)

    # ------------------------------------------------------------------ round mode

    def _round(self, m: RoundMetrics, force: bool) -> None:
        if self._open is None or self._open.outer_step != self._outer_step:
            self._open = _OpenRound(self._outer_step)
        rnd = self._open
        refs = self._list_new(m)
        self._fault("listed")
        blocked: set[str] = set()
        pa = self.config.outer_optimizer == "pa_cgad"
        for ref, path in self._downloaded(refs, blocked, m):
            try:
                try:
                    delta, acc = self._check_safely(ref, path, rnd.outer_step)
                except (DeltaRejected, DeltaFileError) as e:
                    self._reject(ref, e.reason, getattr(e, "detail", str(e)), m)
                    continue
                try:
                    self._rescale(rnd, acc.weight)
                    w = acc.weight / rnd.scale
                    self._accumulate(rnd, delta.tensors, w if pa else w * acc.gate)
                except BaseException:
                    self._open = None  # a partial sum is worthless: the round starts over
                    raise
                del delta
                rnd.total_weight += w
                rnd.accepted.append(acc)
                rnd.marks[ref.node_id] = max(ref.local_step, rnd.marks.get(ref.node_id, -1))
                if rnd.first_at is None:
                    rnd.first_at = time.monotonic()
            finally:
                self._drop_cached(path)
        self._fault("downloaded")
        m.pending = len(rnd.accepted)
        if not rnd.accepted:
            return
        waited = time.monotonic() - (rnd.first_at or time.monotonic())
        quorum = len(rnd.accepted) >= self.config.min_deltas
        timed_out = self.config.max_wait is not None and waited >= self.config.max_wait
        if not (force or quorum or timed_out):
            m.waiting = True
            log.debug("waiting for the quorum: %d of %d deltas", len(rnd.accepted), self.config.min_deltas)
            return
        self._commit_round(rnd, m, pa)

    @staticmethod
    def _rescale(rnd: _OpenRound, weight: float) -> None:
        """Raise the round's unit to the power of two at or above ``weight`` (exact rescaling)."""
        if weight <= rnd.scale:
            return
        scale = 2.0 ** math.ceil(math.log2(weight))
        if rnd.sum is not None:
            for t in rnd.sum.values():
                t.mul_(rnd.scale / scale)
        rnd.total_weight *= rnd.scale / scale
        rnd.scale = scale

    def _accumulate(self, rnd: _OpenRound, tensors: Mapping[str, torch.Tensor], coef: float) -> None:
        """``sum += coef * delta`` in FP32 (complex64), into one buffer per round (freed after the step)."""
        first = rnd.sum is None
        if first:
            rnd.sum = {
                k: torch.empty(v.shape, dtype=torch.complex64 if v.is_complex() else torch.float32)
                for k, v in self._state.items()
                if is_synced(v)
            }
        for k, d in tensors.items():
            s = rnd.sum[k]
            if first:
                s.copy_(d)
                if coef != 1.0:
                    s.mul_(coef)
            else:
                s.add_(d, alpha=coef)

    def _refuse_round(self, accepted: list[_Accepted], detail: str, m: RoundMetrics) -> None:
        log.error("refusing the %d delta(s) of this round (%s): %s; nothing is published",
                  len(accepted), ", ".join(a.ident for a in accepted[:8]), detail)
        for a in accepted:
            self._reject(a.ref, "non_finite_update", detail, m)

    def _commit_round(self, rnd: _OpenRound, m: RoundMetrics, pa: bool) -> None:
        if rnd.total_weight != 1.0:
            for t in rnd.sum.values():
                t.div_(rnd.total_weight)
        bad = next((k for k, t in rnd.sum.items() if not math.isfinite(max_abs(t))), None)
        if bad is not None:
            self._open = None
            self._refuse_round(list(rnd.accepted), f"the aggregate of key {bad!r} is not finite", m)
            return
        tau_max = max(a.staleness for a in rnd.accepted)
        # the only reference to the sum is popped by the step, so it is freed before the
        # optimizer state is copied for publication (the round's peak stays one buffer lower)
        box = [rnd.sum]
        rnd.sum = None
        if pa:
            step = lambda buf: self._opt.step(buf, box.pop(), staleness=tau_max)  # noqa: E731 - gated per fragment
        else:
            step = lambda buf: self._opt.step(buf, box.pop(), staleness=0, gated=True)  # noqa: E731
        new_ledger = _merge_marks(self._ledger, rnd.marks)
        processed = self._pending_paths + [a.ref.path for a in rnd.accepted]
        accepted = list(rnd.accepted)
        self._open = None
        ok = self._apply_and_publish(step, new_ledger, processed, [a.norm for a in accepted], m, accepted)
        if ok:
            for a in accepted:
                m.apply(a.ident, a.staleness)

    # ------------------------------------------------------------------ arrival mode

    def _arrival(self, m: RoundMetrics, force: bool) -> None:
        refs = self._list_new(m)
        self._fault("listed")
        if not refs:
            self._arrival_wait_since = None
            return
        if not force and len(refs) < self.config.min_deltas:
            now = time.monotonic()
            if self._arrival_wait_since is None:
                self._arrival_wait_since = now
            if self.config.max_wait is None or now - self._arrival_wait_since < self.config.max_wait:
                m.waiting, m.pending = True, len(refs)
                return
        self._arrival_wait_since = None
        refs = self._cap(refs, self.config.arrival_batch)
        blocked: set[str] = set()
        fetched: list[tuple[DeltaRef, Path, int]] = []
        try:
            for ref, path in self._downloaded(refs, blocked, m):
                try:
                    base = read_delta_header(path, max_header=self._size_limits()[1]).base_outer_step
                except DeltaFileError:
                    base = -1  # rejected when its turn comes, with the reader's reason
                fetched.append((ref, path, base))
            self._fault("downloaded")
            for ref, path, _ in self._arrival_order(fetched):
                if ref.node_id in blocked:
                    continue
                try:
                    delta, acc = self._check_safely(ref, path, self._outer_step)
                except (DeltaRejected, DeltaFileError) as e:
                    self._reject(ref, e.reason, getattr(e, "detail", str(e)), m)
                    continue
                tensors = delta.tensors
                del delta
                new_ledger = _merge_marks(self._ledger, {ref.node_id: ref.local_step})
                processed = self._pending_paths + [ref.path]
                step = lambda buf, t=tensors, tau=acc.staleness: self._opt.step(buf, t, staleness=tau)  # noqa: E731
                ok = self._apply_and_publish(step, new_ledger, processed, [acc.norm], m, [acc])
                del tensors, step
                if not ok:
                    break
                m.apply(acc.ident, acc.staleness)
                self._drop_cached(path)
        finally:
            for _, path, _ in fetched:
                self._drop_cached(path)

    @staticmethod
    def _cap(refs: list[DeltaRef], cap: int) -> list[DeltaRef]:
        """At most ``cap`` refs, taken round-robin over nodes (each node's lowest steps first)."""
        if len(refs) <= cap:
            return refs
        by_node: dict[str, deque] = {}
        for r in refs:
            by_node.setdefault(r.node_id, deque()).append(r)
        out: list[DeltaRef] = []
        while len(out) < cap:
            for node in sorted(by_node):
                q = by_node[node]
                if q and len(out) < cap:
                    out.append(q.popleft())
        return sorted(out)

    @staticmethod
    def _arrival_order(items: list[tuple[DeltaRef, Path, int]]) -> list[tuple[DeltaRef, Path, int]]:
        """The order of arrival mode: oldest anchor first (``base_outer_step``, then node id), never
        reordering one node's deltas (each node's are taken in ``local_step`` order, as uploaded).
        A deterministic stand-in for upload order, which no hub reports reliably."""
        by_node: dict[str, deque] = {}
        for it in sorted(items, key=lambda x: x[0]):
            by_node.setdefault(it[0].node_id, deque()).append(it)
        heap = [(q[0][2], node) for node, q in by_node.items()]
        heapq.heapify(heap)
        out = []
        while heap:
            _, node = heapq.heappop(heap)
            q = by_node[node]
            out.append(q.popleft())
            if q:
                heapq.heappush(heap, (q[0][2], node))
        return out

    # ------------------------------------------------------------------ apply + publish

    def _spare_buffer(self) -> dict[str, torch.Tensor]:
        """A second state buffer holding a copy of the current state (allocated once, reused)."""
        spare = self._spare
        if spare is None or spare.keys() != self._state.keys() or any(
            spare[k].shape != v.shape or spare[k].dtype != v.dtype for k, v in self._state.items()
        ):
            spare = {k: torch.empty_like(v) for k, v in self._state.items()}
        for k, v in self._state.items():
            spare[k].copy_(v)
        self._spare = None
        return spare

    def _restore_optimizer(self, backup: dict[str, Any] | None) -> None:
        try:
            if backup is not None:
                self._opt.load_state_dict(backup)
            elif self._committed_outer_file is not None:
                payload, _ = load_state_file(self._committed_outer_file)
                self._opt.load_state_dict(payload.get("optimizer") or {})
            else:
                self._opt = _build_optimizer(self.config.outer_optimizer, self._state, self._opt_options)
        except Exception as e:  # noqa: BLE001
            log.error("could not restore the optimizer state (%s); re-reading the hub's version", e)
            self._manifest = None  # forces an adoption at the next round

    def _roll_back(self, buf: dict[str, torch.Tensor], backup: dict[str, Any] | None) -> None:
        """Undo a failed ``_apply_and_publish``: ``buf`` is the spare again, the optimizer state
        is restored and what was processed but not published is forgotten."""
        self._spare = buf
        self._restore_optimizer(backup)
        self._discard()

    def _apply_and_publish(
        self,
        step: Callable[[dict[str, torch.Tensor]], bool],
        new_ledger: dict[str, int],
        processed: list[str],
        norms: list[float],
        m: RoundMetrics,
        accepted: list[_Accepted],
    ) -> bool:
        """One outer step on a copy of the state, then publication; rollback of everything on failure."""
        new_step = self._outer_step + 1
        buf = self._spare_buffer()
        backup = None if self._committed_outer_file is not None else self._opt.state_dict()
        try:
            applied = step(buf)
            if applied is False:  # fully gated (e.g. PA-CGAD fragments all too old): nothing changed
                self._spare = buf
                for a in accepted:
                    self._reject(a.ref, "too_stale", "the optimizer gated the whole step to 0", m)
                return False
            bad = next((k for k, t in buf.items() if is_synced(t) and not math.isfinite(max_abs(t))), None)
            if bad is not None:
                self._spare = buf
                self._restore_optimizer(backup)
                self._refuse_round(accepted, f"the outer step made key {bad!r} of the state non-finite", m)
                return False
            self._fault("stepped")
            self._publish(new_step, buf, new_ledger, processed, norms, m)
        except PublishConflictError as e:
            log.warning("%s; discarding this round and re-reading the hub", e)
            m.conflict = True
            self._roll_back(buf, backup)
            return False
        except _LeaseLost:
            m.standby = True
            self._roll_back(buf, backup)
            return False
        except BaseException:
            self._roll_back(buf, backup)
            raise
        m.published += 1
        self._notify()
        return True

    def _publish(
        self,
        new_step: int,
        buf: dict[str, torch.Tensor],
        new_ledger: dict[str, int],
        processed: list[str],
        norms: list[float],
        m: RoundMetrics,
        history: list[GlobalVersion] | None = None,
        expected_digest: str | None = None,
    ) -> Manifest:
        """Stage, publish (CAS), save locally, swap in memory. Raises on failure with nothing changed in memory."""
        if self._lease is not None and not self._lease.ensure_fresh():
            raise _LeaseLost()
        new_norms = (self._norms.norms + [float(n) for n in norms if math.isfinite(n)])[-self.config.norm_window :]
        payload = {
            "optimizer": self._opt.state_dict(),
            "master": {"norms": new_norms, "aggregation": self.config.aggregation, "weighting": self.config.weighting},
        }
        staged = stage_version(self.node_state_dir, new_step, buf, payload)
        del payload
        self._fault("staged")
        local_files = list(staged.files.values())
        try:
            prev = self._hub_manifest
            if history is None:
                history = []
                if prev is not None:  # with its digest: a reader (and a signature) can vouch for an old version
                    history = [GlobalVersion(prev.outer_step, prev.weights, None, prev.weights_sha256)] + list(prev.history)
                history = history[: self.config.keep_globals]
            epoch = self._lease.epoch if self._lease is not None else None
            manifest = staged.manifest(
                ledger=dict(new_ledger),
                optimizer={"name": self._opt.name, "options": dict(self._opt.options)},
                history=history,
                master={"holder": self.holder, "epoch": epoch} if epoch is not None else {"holder": self.holder},
                published_at=time.time(),
            )
            if self._key is not None:
                manifest = manifest.signed(self._key)
            delete = self._deletions(manifest, processed, new_ledger)
            self.hub.publish(
                manifest,
                staged.files,
                expected_outer_step=prev.outer_step if prev is not None else None,
                delete=delete,
                expected_digest=expected_digest,
            )
        except BaseException:
            for f in local_files:
                with _suppress():
                    f.unlink()
            raise
        self._gc_countdown = (self._gc_countdown - 1) if self._gc_countdown > 0 else self.config.gc_every - 1
        self._hub_manifest = manifest
        self._fault("published")
        try:
            rec = localstate.save_record(
                self.node_state_dir, self.hub.url, manifest, staged.files[staged.weights],
                staged.files.get(staged.outer_state) if staged.outer_state else None,
            )
        except BaseException as e:
            log.error(
                "outer_step %d is published but could not be saved in %s (%s); rolling back in memory, "
                "the next round adopts it from the hub", new_step, self.node_state_dir, e,
            )
            for f in local_files:
                with _suppress():
                    f.unlink()
            raise
        self._record = rec  # the local copy of the hub's newest version (an adoption may reuse it)
        self._fault("saved")
        self._committed_outer_file = rec.outer_state_file
        with self._lock:
            if buf is not self._state:
                self._state, self._spare = buf, self._state
            self._outer_step = new_step
            self._ledger = dict(new_ledger)
            self._manifest = manifest
        self._norms.load(new_norms)
        self._pending_paths = []
        for node, step in new_ledger.items():
            for key in [k for k in self._download_failures if k[0] == node and k[1] <= step]:
                del self._download_failures[key]
        self._fault("swapped")
        return manifest

    def _deletions(self, manifest: Manifest, processed: list[str], ledger: Mapping[str, int]) -> list[str]:
        keep = set(manifest.files())
        dels = set(processed)
        prev = self._hub_manifest
        if prev is not None:
            dels.update(p for p in prev.files() if p not in keep)
        if self._gc_countdown <= 0:
            self._swept = False  # the next round sweeps temporary files too
            try:
                for p in self.hub.list_global():
                    step = _global_file_step(p)
                    if step is not None and step <= manifest.outer_step and p not in keep:
                        dels.add(p)
                for ref in self.hub.list_deltas():
                    if ref.local_step <= ledger.get(ref.node_id, -1):
                        dels.add(ref.path)
            except Exception as e:  # noqa: BLE001 - garbage collection is best effort
                log.warning("could not list %s for garbage collection: %s", self.hub.url, e)
        return sorted(dels - keep)

    def _notify(self) -> None:
        cb = self.on_global_update
        if cb is None:
            return
        try:
            _, state = self.snapshot()
            cb(state)
        except Exception:  # noqa: BLE001
            log.exception("on_global_update failed")

    # ------------------------------------------------------------------ state bookkeeping

    def _discard(self) -> None:
        """Forget everything processed but not published (it will be processed again)."""
        self._open = None
        self._pending_paths = []
        self._arrival_wait_since = None

    @staticmethod
    def _check_state(state: Any, what: str) -> Mapping[str, torch.Tensor]:
        if not isinstance(state, Mapping) or not state:
            raise ValueError(f"{what} must be a non-empty mapping of str to Tensor")
        for k, v in state.items():
            if not isinstance(k, str) or not isinstance(v, torch.Tensor):
                raise ValueError(f"{what} must map str to Tensor; entry {k!r} is {type(v).__name__}")
        if not any(is_synced(v) for v in state.values()):
            raise ValueError(f"{what} has no floating point tensor to train")
        return state

    def _install(self, state: dict[str, torch.Tensor], *, outer_step: int) -> None:
        opt = _build_optimizer(self.config.outer_optimizer, state, self._opt_options)
        with self._lock:
            self._state, self._spare, self._opt = state, None, opt
            self._fingerprint = model_fingerprint(state)
            self._outer_step = outer_step
            self._ledger = {}
            self._manifest = None
        self._committed_outer_file = None

    def _load_local(self) -> None:
        """Resume from ``node_state_dir`` if it holds a version of this hub (verified by SHA-256)."""
        rec = localstate.load_record(self.node_state_dir)
        if rec is None:
            localstate.cleanup(self.node_state_dir, keep=set())
            return
        if rec.hub_url != self.hub.url:
            log.warning("ignoring the local state in %s: it belongs to hub %s, not %s", self.node_state_dir, rec.hub_url, self.hub.url)
            return
        hm = rec.manifest
        if (hm.optimizer or {}).get("name") not in (None, self.config.outer_optimizer):
            raise MasterConfigError(
                f"the local state in {self.node_state_dir} is for outer optimizer {hm.optimizer.get('name')!r}; "
                f"this master is configured for {self.config.outer_optimizer!r}"
            )
        if self._state is not None and rec.outer_step < self._outer_step:
            return
        self._record = rec
        localstate.cleanup(
            self.node_state_dir, keep={rec.weights_file.name} | ({rec.outer_state_file.name} if rec.outer_state_file else set())
        )
        try:
            self._adopt_local(rec)
        except (OSError, StateFileError, ValueError) as e:
            self._record = None
            log.warning("ignoring the local state in %s: %s", self.node_state_dir, e)

    def _adopt_local(self, rec: localstate.LocalRecord) -> None:
        hm = rec.manifest
        if self._user_fingerprint is not None and hm.model_fingerprint != self._user_fingerprint:
            raise MasterConfigError(
                f"the local state in {self.node_state_dir} is of another model than the state this master was given"
            )
        state, outer, _, _ = self._load_version(hm, local_only=True)
        opt = _build_optimizer(self.config.outer_optimizer, state, self._opt_options)
        norms = []
        if outer is not None:
            opt.load_state_dict(outer.get("optimizer") or {})
            norms = list(((outer.get("master") or {}).get("norms")) or [])
        with self._lock:
            self._state, self._spare, self._opt = state, None, opt
            self._fingerprint = hm.model_fingerprint
            self._outer_step = hm.outer_step
            self._ledger = dict(hm.ledger)
            self._manifest = hm
        self._norms.load(norms)
        self._committed_outer_file = rec.outer_state_file
        log.info("resumed outer_step %d from %s", hm.outer_step, self.node_state_dir)


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], Exception)


def _global_file_step(path: str) -> int | None:
    """The outer step in ``global/weights_<step>_<token>.safetensors`` / ``outer_state_...``, else None."""
    name = path.rsplit("/", 1)[-1]
    for prefix in ("weights_", "outer_state_"):
        if name.startswith(prefix) and name.endswith(".safetensors"):
            parts = name[len(prefix) : -len(".safetensors")].split("_")
            if len(parts) == 2 and parts[0].isdigit():
                return int(parts[0])
    return None
