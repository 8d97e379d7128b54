"""The master: applies workers' deltas with a staleness-aware outer optimizer and publishes versions.

:class:`MasterOuterLoop` keeps the API and behaviour of Speedtronic's DumbDiLoCo master
(``speedtronic.distributed.outer.MasterOuterLoop``) and fixes what its documentation admits:

* **No re-download.** The published manifest carries a per-node high-water mark (the
  *ledger*); listing asks the hub only for deltas above it, so a processed delta is never
  downloaded again. New ones are downloaded by a bounded thread pool, a few ahead of the
  consumer, into the hub's per-path cache.
* **Streaming aggregation.** Deltas are read one at a time (memory-mapped when the file is this
  process's own download, read into owned memory when another writer can change it: a folder
  hub's file, truncated under a map, would kill the master with SIGBUS), checked, and
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
  ``aggregation="round"`` (docs/spec.md, "Master round") the accepted deltas of a round give
  ``g = sum(w_i * gate(tau_i) * delta_i) / sum(w_i)`` (``w_i`` 1, or ``num_tokens`` with
  ``weighting="tokens"``), then one step with ``gated=True``. In ``aggregation="arrival"``
  every accepted delta is its own outer step and its own published version, with its own
  staleness, in a deterministic order (see :func:`~diloco_lightning.master.aggregation.arrival_order`).
  ``pa_cgad`` in round mode: each delta is gated on ``max(tau_i, age_f)`` (its fragment's age)
  before the mean, as the paper defines it, and the step gates nothing again
  (``PACGAD.step_pregated``); deltas whose gate is 0 are rejected as ``too_stale``. Only a
  PA-CGAD given fragments of its own in ``outer_options``, in a run without ``fragments``, keeps
  the older rule (average ungated, gate each fragment on ``max(tau_max, age_f)``). With
  ``fragments`` (Streaming DiLoCo, :mod:`diloco_lightning.wire.fragments`) each fragment's deltas
  make their own mean with their fragment's staleness (``master/rounds.py``).
* **Quorum.** ``min_deltas`` accepted deltas before a round is applied, or a fraction of the
  live nodes (``min_deltas=0.75``; :mod:`diloco_lightning.master.membership` follows the
  workers' claims and heartbeats), or ``max_wait`` seconds after the first one arrived (fixed,
  or ``"auto"``: from the recent arrival offsets, :mod:`diloco_lightning.master.quorum`); the
  pending sum is kept across polls.
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
* **Coming from Speedtronic** (``compat="speedtronic"``, :mod:`diloco_lightning.master.compat`):
  Speedtronic's deltas are taken too, each version is also written where Speedtronic's
  workers read it, and a hub that Speedtronic's master served is adopted mid-run.

References: DiLoCo (Douillard et al. 2023, arXiv 2311.08105); CGAD (Shah & Sun 2026, arXiv
2605.09126); asynchronous Local-SGD / Delayed Nesterov (Liu et al. 2024, arXiv 2401.09135).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Container, Mapping
from pathlib import Path
from typing import Any

import torch

from diloco_lightning.hub import open_hub
from diloco_lightning.hub.base import Hub
from diloco_lightning.master import localstate
from diloco_lightning.master.adoption import Adoption
from diloco_lightning.master.health import RunHealth
from diloco_lightning.master.compat import make_compat
from diloco_lightning.master.config import AGGREGATIONS, WEIGHTINGS, MasterConfig, MasterConfigError
from diloco_lightning.master.intake import Intake
from diloco_lightning.master.lease import LeaseKeeper, StandbyError, default_holder
from diloco_lightning.master.membership import Membership
from diloco_lightning.master.metrics import MetricsSink, RoundMetrics
from diloco_lightning.master.publication import Publisher
from diloco_lightning.master.rounds import Rounds
from diloco_lightning.master.runstate import RunState
from diloco_lightning.master.weights import check_state, cpu_clone
from diloco_lightning.master.validation import DeltaValidator
from diloco_lightning.util.errors import ConfigError
from diloco_lightning.wire.names import parse_delta_path
from diloco_lightning.wire.signing import RunKey, load_run_key

__all__ = ["MasterOuterLoop", "MasterConfig", "MasterConfigError", "ProcessedDeltas", "AGGREGATIONS", "WEIGHTINGS"]

log = logging.getLogger(__name__)


class ProcessedDeltas(Container):
    """``path in master.processed_filenames``: whether a delta is done with (at or below the ledger).

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
            ``max(3 * poll_interval, 30)`` seconds, 900 on a hub whose writes are rate-limited
            commits; ``holder`` default ``host:pid:random``).
        signing_key: the run key (signed runs); default from ``DILOCO_RUN_KEY`` /
            ``DILOCO_RUN_KEY_FILE``, none meaning an unsigned run.
        metrics_path: a JSONL file receiving one line per eventful round.
        gc_every: every this many publications (and the first after a start or an adoption)
            also sweep orphans of interrupted publications and processed deltas left behind.
        retry_max_delay: the longest pause of the background thread after failed rounds.
        sweep_age: temporary files of writers on other hosts (or of unknown owner) older than
            this many seconds are removed by the litter sweep (same-host ones as soon as their
            process is gone).
        compat: ``"speedtronic"`` to also speak Speedtronic 2.0's hub layout: take its workers'
            deltas, write ``global/latest.safetensors`` and ``global/step_count.json`` with each
            version, adopt a run its master served (:mod:`diloco_lightning.master.compat`).
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
        on_global_update: Callable[[dict[str, torch.Tensor]], Any] | None = None,
        logger: logging.Logger | Callable[[dict], Any] | None = None,
        holder: str | None = None,
        signing_key: RunKey | bytes | str | None = None,
        metrics_path: str | os.PathLike | None = None,
        config: MasterConfig | None = None,
        **options: Any,
    ) -> None:
        if "outer_options" in options and options["outer_options"] is None:
            del options["outer_options"]
        unknown = sorted(set(options) - set(MasterConfig.names()))
        if unknown:
            raise TypeError(f"MasterOuterLoop got unknown option(s) {unknown}; valid: {MasterConfig.names()}")
        if config is not None and options:
            raise TypeError("MasterOuterLoop: give either config= or option keywords, not both")
        self.config = (config or MasterConfig(**options)).validate()
        self.config.outer_options = dict(self.config.outer_options)
        if self.config.torch_threads is not None:
            torch.set_num_threads(self.config.torch_threads)
        if on_global_update is not None and not callable(on_global_update):
            raise ValueError(f"on_global_update must be callable or None, got {on_global_update!r}")
        if node_state_dir is None:
            raise ValueError("node_state_dir is required: a folder for the master's local state")
        self.hub: Hub = hub if isinstance(hub, Hub) else open_hub(hub)
        self.node_state_dir = Path(node_state_dir)
        self.node_state_dir.mkdir(parents=True, exist_ok=True)
        self.on_global_update = on_global_update
        self.holder = holder or default_holder()
        key = load_run_key(signing_key)
        self._key = key
        #: the compatibility mode (None, or master.compat.SpeedtronicCompat): what it changes is there
        self.compat = make_compat(self.config.compat, self.hub, key)
        self._sink = MetricsSink(metrics_path, logger)
        self._lease = (
            LeaseKeeper(self.hub, self.holder, self.config.effective_lease_ttl(self.hub.rate_limited_writes),
                        signing_key=key) if self.config.lease else None
        )
        # the parts (each owns its state; see docs/design.md for the map)
        self.run = RunState(self.config, self.hub, self.node_state_dir, key)
        self.intake = Intake(self.hub, self.config)
        self.validator = DeltaValidator(self.config, key, self.hub.private_downloads,
                                        header_parser=self.compat.parse_header if self.compat is not None else None)
        self.publisher = Publisher(self.hub, self.config, self.node_state_dir, key, self.holder, self._lease, owner=self,
                                   compat=self.compat)
        self.membership = Membership(self.hub, node_timeout=self.config.node_timeout, poll_interval=self.config.poll_interval,
                                     signing_key=key)
        #: identical deltas from two nodes, a diverging run: one line each, naming the knob
        self.health = RunHealth(lr=self.config.optimizer_options().get("lr"), min_deltas=self.config.min_deltas,
                                optimizer=self.config.outer_optimizer)
        self.rounds = Rounds(self.config, self.hub, self.run, self.intake, self.validator, self.publisher,
                             self.membership, on_published=self._notify, health=self.health, owner=self)
        self.adoption = Adoption(self.hub, self.run, self.intake, self.validator, self.publisher, signing_key=key,
                                 compat=self.compat, discard=self.rounds.discard, on_published=self._notify)

        self._round_lock = threading.RLock()  # one round at a time
        self._thread_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop_event = threading.Event()
        #: the configuration error that ended the background thread (:meth:`start`), None while none did
        self.error: ConfigError | None = None
        self._last_metrics: RoundMetrics | None = None
        #: ``until_finished``: the run is not over before this many workers were seen (a run of known size)
        self.expected_nodes = self.config.expected_nodes or 1
        self._claims_read_at: float | None = None

        if state is not None:
            self.run.install(cpu_clone(check_state(state, "state")), outer_step=0)
            self.run.user_fingerprint = self.run.fingerprint
        payload = self.run.load_local()
        if payload is not None:
            self.validator.load_state_dict(payload)

    # ================================================================== public API

    @property
    def outer_step(self) -> int:
        with self.run.lock:
            return self.run.outer_step

    @property
    def ledger(self) -> dict[str, int]:
        """The committed per-node high-water marks (what the last published manifest carries)."""
        with self.run.lock:
            return dict(self.run.ledger)

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
        rec = self.run.record
        return rec.weights_file if rec is not None else None

    @property
    def outer_state_path(self) -> Path | None:
        """The local copy of the current optimizer state (None before the first save)."""
        rec = self.run.record
        return rec.outer_state_file if rec is not None else None

    @property
    def has_state(self) -> bool:
        """Whether the master holds a global state yet (given, adopted from the hub, or bootstrapped
        from a worker's ``init.safetensors``)."""
        return self.run.state is not None

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
        return self.run.opt

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """``(outer_step, cloned full state)`` of the last published version.

        Never waits for network I/O: rounds compute on a second buffer and only swap it in
        under the lock. A warm standby (``warm_standby``, the default) gives the newest published
        version it has loaded. A standby master that never held a version (a cold one, or before
        its first poll) raises :class:`~diloco_lightning.master.lease.StandbyError` saying so and who holds the lease.
        """
        other = self._lease.other if self._lease is not None else None
        if self.run.state is None and other is not None:
            raise StandbyError(
                f"this master is on standby: {other.holder} holds the master lease on {self.hub.url} (epoch "
                f"{other.epoch}, for {max(0.0, other.expires_at - time.time()):.0f} s more unless renewed); it has no "
                "version of its own until it takes over. The published version: "
                "diloco_lightning.hub.versions.load_global(hub)"
            )
        return self.run.snapshot()

    def run_over(self) -> dict[str, int | None] | None:
        """``{node: its last local_step}`` once every worker this master knows has finished and its last
        delta is applied (or refused); None while the run goes on (:mod:`diloco_lightning.master.finish`).
        Reads the workers' claims when due; call it between rounds (``until_finished`` does)."""
        from diloco_lightning.master.finish import run_over

        with self._round_lock:
            # a finished claim is news the quorum's refresh pace (a quarter of a claim's ttl) would hear late:
            # read the claims every second on a folder hub, every 10 s on a remote one (one listing)
            now = time.monotonic()
            every = max(self.config.poll_interval, 1.0 if self.hub.local_root is not None else 10.0)
            force = self._claims_read_at is None or now - self._claims_read_at >= every
            if self.membership.refresh(force=force):
                self._claims_read_at = now
            return run_over(self.membership, self.ledger, self.intake.refused_step, self.expected_nodes)

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
                m.outer_step = self.run.outer_step
                m.epoch = self._lease.epoch if self._lease is not None else None
                self._last_metrics = m
                if m.eventful or (m.waiting and m.downloads > 0):
                    self._sink.emit(m)
            return m.published > 0

    def start(self) -> None:
        """Run rounds every ``poll_interval`` seconds in one daemon thread (errors are logged and retried;
        a configuration error, which no retry fixes, ends the thread and is kept in :attr:`error`)."""
        with self._thread_lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self.error = None
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
            except ConfigError as e:  # a run this master does not match: one line, no traceback
                log.error("the final round of stop(drain=True) failed: %s", e)
            except Exception:  # noqa: BLE001
                log.exception("the final round of stop(drain=True) failed")
        if self._lease is not None:
            with self._round_lock:
                self._lease.release()

    def close(self) -> None:
        """``stop()``, then close the hub (and end the round's lanes)."""
        self.stop()
        self.hub.close()
        if self.validator.arena.lanes is not None:
            self.validator.arena.lanes.close()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: global state, optimizer state, ledger, history, norm window.

        Tensors are clones; the rest is JSON-able, so ``statefile.save_state_file`` can store it.
        Waits for a round in progress (the optimizer's buffers change during a step).
        """
        with self._round_lock:
            return self.run.state_dict(self.validator.state_dict())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace the master's state by one from :meth:`state_dict`.

        The next round still reconciles with the hub: a hub version at least as new wins.
        """
        with self._round_lock:
            self.run.load_state_dict(state_dict)
            self.rounds.discard()
            self.validator.load_state_dict(state_dict)

    # ================================================================== background thread

    def _run(self) -> None:
        from diloco_lightning.master.serve import serve

        try:
            serve(self, stop=self._stop_event)  # the one serve loop (errors reported, retried with backoff)
        except ConfigError as e:  # never retried: the thread ends, and the run watching it reads error
            self.error = e
            log.error("the master stopped: %s", e)

    # ================================================================== one round

    def _sync(self, m: RoundMetrics, force: bool) -> None:
        if not self.publisher.swept:
            self.publisher.sweep()
        if self._lease is not None:
            if not self._lease.acquire(min_epoch=self._published_epoch):
                m.standby = True
                self.rounds.discard()
                if self.config.warm_standby:
                    m.warm = self.adoption.follow()
                return
            if self._lease.took_over:
                m.took_over = self._lease.epoch
        if not self.adoption.reconcile(m):
            return
        if self.config.aggregation == "round":
            self.rounds.round(m, force)
        else:
            self.rounds.arrival(m, force)

    def _published_epoch(self) -> int:
        """The lease epoch in the hub's manifest (a new lease's epoch is above it)."""
        try:
            hm = self.hub.read_manifest()
        except Exception:  # noqa: BLE001 - the lease CAS is what matters; the epoch is for the record
            hm = self.run.hub_manifest
        epoch = (hm.master or {}).get("epoch", 0) if hm is not None else 0
        return epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0 else 0

    def _notify(self) -> None:
        cb = self.on_global_update
        if cb is None:
            return
        try:
            _, state = self.snapshot()
            cb(state)
        except Exception:  # noqa: BLE001
            log.exception("on_global_update failed")
