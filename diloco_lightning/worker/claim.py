"""A worker's claim on its node id (``nodes/<node_id>/claim.json``, :mod:`diloco_lightning.wire.claims`).

:class:`ClaimKeeper` takes the claim when the worker starts, renews its heartbeat from a
light background thread every ``ttl / 2`` seconds (on ``hf://`` each renewal is a commit:
with the default ``ttl`` of 15 minutes that is 8 commits an hour, far inside the Hub's
limit of about 128 per repository), and releases it on a clean close.

A claim held by someone else stops the start with :class:`NodeIdTakenError`, unless it is
dead: expired (no heartbeat for ``ttl`` seconds), or held by a process of this host that
no longer exists (``host:pid`` in the holder; a worker killed with ``kill -9`` and started
again on the same machine does not wait for the expiry). A keeper whose claim was taken
over while it lived (its heartbeat failed for longer than ``ttl``, and another process
claimed the id) marks itself lost; the worker then stops at its next boundary rather than
sending deltas under an id someone else now runs.

Each heartbeat carries what the worker reports about itself (``info``: a
:class:`~diloco_lightning.wire.claims.NodeReport`, set by the worker at each boundary; the first
report is sent at once rather than half a ``ttl`` later, so the others learn a newcomer's speed
early). A keeper that ``watch_peers`` (a worker with Dynamic Local Updates) also reads the
other nodes' claims after each heartbeat (:meth:`ClaimKeeper.peer_reports`), on this light
thread, so the training thread never waits for the hub to learn the peers' speeds.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any, Callable

from diloco_lightning.hub.base import ClaimConflictError, Hub
from diloco_lightning.wire.claims import NodeClaim, NodeReport
from diloco_lightning.util.waiting import format_duration
from diloco_lightning.worker.sync import WorkerError

__all__ = ["ClaimKeeper", "NodeIdTakenError", "default_claim_ttl", "worker_holder"]

log = logging.getLogger(__name__)

FILE_HUB_TTL = 60.0
REMOTE_HUB_TTL = 900.0


class NodeIdTakenError(WorkerError):
    """Another live process runs this node id on the hub (or took it over from this one)."""


def default_claim_ttl(hub: Hub) -> float:
    """60 s on a folder hub (a renewal is a small file write), 15 min elsewhere (a renewal is a commit on
    ``hf://``, a request on ``s3://``)."""
    return FILE_HUB_TTL if str(hub.url).startswith("file:") else REMOTE_HUB_TTL


def worker_holder() -> str:
    """``host:pid:random``: unique per worker process."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _dead_here(holder: str) -> bool:
    """True when ``holder`` names a process of this host that does not exist any more."""
    parts = holder.split(":")
    if len(parts) < 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by someone else
        return False
    return False


class ClaimKeeper:
    """Takes, renews and releases one node's claim (see the module docstring).

    Args:
        hub: the hub.
        node_id: the claimed id.
        ttl: seconds a claim lives after each heartbeat (None: :func:`default_claim_ttl`).
        holder: this process's id in the claim (default :func:`worker_holder`).
        clock: wall clock (expiry times are unix seconds, compared across machines).
        watch_peers: read the other nodes' claims after each heartbeat (:meth:`peer_reports`).
    """

    def __init__(
        self,
        hub: Hub,
        node_id: str,
        *,
        ttl: float | None = None,
        holder: str | None = None,
        clock: Callable[[], float] = time.time,
        watch_peers: bool = False,
    ) -> None:
        self.hub = hub
        self.node_id = node_id
        self.ttl = float(default_claim_ttl(hub) if ttl is None else ttl)
        if not self.ttl > 0:
            raise ValueError(f"claim_ttl must be > 0 seconds, got {ttl!r}")
        self.holder = holder or worker_holder()
        self.clock = clock
        self.supported = True
        self.info: dict[str, Any] = {}
        self._claim: NodeClaim | None = None
        self._lost: str | None = None
        self._stop = threading.Event()
        self._poke = threading.Event()  # a heartbeat now (the first report), or the stop
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.watch_peers = bool(watch_peers)
        self._peers: dict[str, NodeClaim] = {}
        self._peer_problems: set[str] = set()

    @property
    def claim(self) -> NodeClaim | None:
        return self._claim

    def _taken(self, other: NodeClaim, now: float) -> NodeIdTakenError:
        return NodeIdTakenError(
            f"node_id {self.node_id!r} is already running on {self.hub.url}: {other.holder} claimed it and its last "
            f"heartbeat was {format_duration(now - other.renewed_at)} ago (the claim expires in "
            f"{format_duration(other.expires_at - now)}). Two workers with one node_id would be merged into one node: "
            f"give this worker another node_id, or stop the other one."
        )

    def check_free(self) -> None:
        """Raise :class:`NodeIdTakenError` now if another live process holds this node id: a cheap
        read, for a process to call before its slow start-up (data, model) rather than minutes in.
        Nothing is written; :meth:`acquire` still decides."""
        try:
            current = self.hub.read_claim(self.node_id)
        except NotImplementedError:
            return
        now = self.clock()
        if current is not None and current.holder != self.holder and not current.expired(now) \
                and not _dead_here(current.holder):
            raise self._taken(current, now)

    def acquire(self) -> None:
        """Claim the id, then keep the heartbeat going. Raises :class:`NodeIdTakenError`."""
        for _ in range(5):
            now = self.clock()
            try:
                current = self.hub.read_claim(self.node_id)
            except NotImplementedError:
                self.supported = False
                log.warning("node %s: %s cannot hold node claims; a second worker with this node_id would not be "
                            "detected", self.node_id, type(self.hub).__name__)
                return
            if current is not None and current.holder != self.holder:
                if not current.expired(now) and not _dead_here(current.holder):
                    raise self._taken(current, now)
                log.info("node %s: taking over the claim of %s (%s)", self.node_id, current.holder,
                         "expired" if current.expired(now) else "its process is gone")
            epoch = 1 if current is None else current.epoch + (0 if current.holder == self.holder else 1)
            mine = NodeClaim(self.node_id, self.holder, epoch, now, now, now + self.ttl, dict(self.info))
            try:
                self.hub.write_claim(self.node_id, mine, expected=current)
            except ClaimConflictError:
                continue  # someone wrote in between: look again
            self._claim = mine
            self._read_peers()
            self._start_heartbeat()
            log.info("node %s: claimed on %s by %s (heartbeat every %s)", self.node_id, self.hub.url, self.holder,
                     format_duration(self.ttl / 2))
            return
        raise NodeIdTakenError(f"node_id {self.node_id!r}: the claim on {self.hub.url} kept changing; is another "
                               "worker starting with the same node_id?")

    def set_info(self, info: Mapping[str, Any], *, urgent: bool = False) -> None:
        """What the next heartbeat reports about this node (the claim's ``info`` object);
        ``urgent``: send it now rather than at the next regular heartbeat."""
        with self._lock:
            self.info = dict(info)
        if urgent:
            self._poke.set()

    def _read_peers(self) -> None:
        if not self.watch_peers:
            return
        try:
            claims = self.hub.list_claims()
        except NotImplementedError:
            self.watch_peers = False
            return
        except Exception as e:  # noqa: BLE001 - the hub is down: keep the last view
            log.debug("node %s: could not read the other nodes' claims: %s", self.node_id, e)
            return
        claims.pop(self.node_id, None)
        with self._lock:
            self._peers = claims

    def peer_reports(self, now: float | None = None) -> dict[str, NodeReport]:
        """The live peers' heartbeat reports (claims not expired by this machine's clock), each
        value checked (:meth:`NodeReport.from_info`); a value out of bounds is dropped and logged
        once."""
        now = self.clock() if now is None else now
        with self._lock:
            peers = dict(self._peers)
        out: dict[str, NodeReport] = {}
        for node, claim in sorted(peers.items()):
            if claim.expired(now):
                continue
            report, problems = NodeReport.from_info(claim.info)
            for p in problems:
                if f"{node}:{p}" not in self._peer_problems and len(self._peer_problems) < 10_000:
                    self._peer_problems.add(f"{node}:{p}")
                    log.warning("node %s: ignoring what node %s reports in its heartbeat: %s", self.node_id, node, p)
            out[node] = report
        return out

    def renew(self) -> bool:
        """One heartbeat now; False when it failed (a conflict marks the claim lost)."""
        with self._lock:
            mine = self._claim
            if mine is None or self._lost:
                return False
            now = self.clock()
            new = dataclasses.replace(mine, renewed_at=now, expires_at=now + self.ttl, info=dict(self.info))
            try:
                self.hub.write_claim(self.node_id, new, expected=mine)
            except ClaimConflictError:
                other = None
                try:
                    other = self.hub.read_claim(self.node_id)
                except Exception:  # noqa: BLE001 - only for the message
                    pass
                self._lost = (f"node_id {self.node_id!r} was taken over on {self.hub.url} by "
                              f"{other.holder if other else 'another process'} (this worker's heartbeat had stopped)")
                log.error("node %s: %s; stopping", self.node_id, self._lost)
                return False
            except Exception as e:  # noqa: BLE001 - the hub is down: try again sooner
                log.warning("node %s: could not renew the claim on %s (%s: %s)", self.node_id, self.hub.url,
                            type(e).__name__, e)
                return False
            self._claim = new
            return True

    def _start_heartbeat(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"diloco-claim-{self.node_id}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        delay = self.ttl / 2
        while True:
            self._poke.wait(delay)
            self._poke.clear()
            if self._stop.is_set():
                return
            ok = self.renew()
            if self._lost:
                return
            if ok:
                self._read_peers()
            delay = self.ttl / 2 if ok else max(1.0, min(self.ttl / 10, 30.0))

    def check(self) -> None:
        """Raise :class:`NodeIdTakenError` if the claim was taken over while this worker ran."""
        if self._lost:
            raise NodeIdTakenError(self._lost)

    def release(self) -> None:
        """Stop the heartbeat and remove the claim (best effort: an unreachable hub lets it expire)."""
        self._stop.set()
        self._poke.set()
        t, self._thread = self._thread, None
        if t is not None:
            t.join(timeout=10.0)
        with self._lock:
            mine, self._claim = self._claim, None
            if mine is None or self._lost or not self.supported:
                return
            try:
                self.hub.write_claim(self.node_id, None, expected=mine)
            except Exception as e:  # noqa: BLE001
                log.warning("node %s: could not release the claim on %s (%s); it expires in %s", self.node_id,
                            self.hub.url, e, format_duration(mine.expires_at - self.clock()))
