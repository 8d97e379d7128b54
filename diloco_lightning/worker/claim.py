"""A worker's claim on its node id (``nodes/<node_id>/claim.json``, :mod:`diloco_lightning.wire.claims`).

:class:`ClaimKeeper` takes the claim when the worker starts, renews its heartbeat from a
light background thread every ``ttl / 2`` seconds (on ``hf://`` each renewal is a commit:
with the default ``ttl`` of 15 minutes that is 8 commits an hour, far inside the Hub's
limit of about 128 per repository), and releases it on a clean close.

A claim held by someone else stops the start with :class:`NodeIdTakenError`, unless it is
dead: expired (no heartbeat for ``ttl`` seconds; whatever its expiry says, at most a day after
its last heartbeat: ``NodeClaim.dead_reason``), held by a process of this host that no longer
exists (``host:pid`` in the holder; a worker killed with ``kill -9`` and started again on the
same machine does not wait for the expiry), or, in a signed run, not signed with the run key
(anyone can write a file; only a worker of the run can sign a claim). The keeper signs its own
claims in a signed run.

A heartbeat whose compare-and-swap fails looks at what is there now:

* nothing, an unreadable file, one not signed with the run key, or a claim of its own holder:
  the claim vanished or someone else wrote garbage over it; the keeper claims the id again
  (a file deleted or overwritten by any hub writer does not stop a worker);
* another holder's claim, and this keeper's own had expired (its heartbeat failed for longer
  than ``ttl``: a hub outage): the id was taken over as the rules allow; the keeper marks itself
  lost and the worker stops at its next boundary rather than sending deltas under an id someone
  else now runs;
* another holder's claim while this keeper's was live: no worker of the run does that (a
  live claim is never taken over); the keeper claims the id again, with a warning, at most
  :data:`MAX_RECLAIMS` times within ``ttl``, then stops (two processes that keep taking one id
  from each other are a duplicate node id, whichever is right).

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
from diloco_lightning.wire.claims import FILE_HUB_TTL, REMOTE_HUB_TTL, NodeClaim, NodeReport, default_claim_ttl
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.util.waiting import format_duration
from diloco_lightning.util.warnonce import WarnOnce
from diloco_lightning.worker.sync import WorkerError

__all__ = ["ClaimKeeper", "NodeIdTakenError", "default_claim_ttl", "worker_holder", "FILE_HUB_TTL", "REMOTE_HUB_TTL",
           "MAX_RECLAIMS"]

log = logging.getLogger(__name__)

#: how many times within one ``ttl`` a keeper claims its id back from another holder before it stops
MAX_RECLAIMS = 3


class NodeIdTakenError(WorkerError):
    """Another live process runs this node id on the hub (or took it over from this one)."""


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
        signing_key: the run key (a signed run): claims are signed with it, and one that is not is
            no claim.
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
        signing_key: RunKey | None = None,
    ) -> None:
        self.hub = hub
        self.node_id = node_id
        self.ttl = float(default_claim_ttl(hub) if ttl is None else ttl)
        if not self.ttl > 0:
            raise ValueError(f"claim_ttl must be > 0 seconds, got {ttl!r}")
        self.holder = holder or worker_holder()
        self.clock = clock
        self.signing_key = signing_key
        self._reclaims: list[float] = []  # when this keeper took its id back from another holder
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
        self._peer_problems = WarnOnce(log)  # bounded: the peers' names and reports are any hub writer's

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

    def _sign(self, claim: NodeClaim) -> NodeClaim:
        return claim.signed(self.signing_key) if self.signing_key is not None else claim

    def _authentic(self, claim: NodeClaim) -> bool:
        return self.signing_key is None or claim.verify(self.signing_key)

    def _dead(self, other: NodeClaim, now: float) -> str | None:
        """Why another holder's claim ``other`` does not hold the id at ``now`` (None: it does)."""
        if not self._authentic(other):
            return "it is not signed with the run key"
        return other.dead_reason(now) or ("its process is gone" if _dead_here(other.holder) else None)

    def check_free(self) -> None:
        """Raise :class:`NodeIdTakenError` now if another live process holds this node id: a cheap
        read, for a process to call before its slow start-up (data, model) rather than minutes in.
        Nothing is written; :meth:`acquire` still decides."""
        try:
            current = self.hub.read_claim(self.node_id)
        except NotImplementedError:
            return
        now = self.clock()
        if current is not None and current.holder != self.holder and self._dead(current, now) is None:
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
                why = self._dead(current, now)
                if why is None:
                    raise self._taken(current, now)
                log.info("node %s: taking over the claim of %s (%s)", self.node_id, current.holder[:80], why)
            epoch = 1 if current is None else min(current.epoch, 10**15) + (0 if current.holder == self.holder else 1)
            mine = self._sign(NodeClaim(self.node_id, self.holder, epoch, now, now, now + self.ttl, dict(self.info)))
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
            if claim.dead_reason(now) is not None or not self._authentic(claim):
                continue
            report, problems = NodeReport.from_info(claim.info)
            for p in problems:
                self._peer_problems.warn(f"{node}:{p}", "node %s: ignoring what node %s reports in its heartbeat: %s",
                                         self.node_id, node, p)
            out[node] = report
        return out

    def renew(self) -> bool:
        """One heartbeat now; False when it failed (a takeover marks the claim lost; see the module
        docstring for a claim that vanished or was overwritten)."""
        with self._lock:
            mine = self._claim
            if mine is None or self._lost:
                return False
            now = self.clock()
            new = self._sign(dataclasses.replace(mine, renewed_at=now, expires_at=now + self.ttl, info=dict(self.info),
                                                 signature=None))
            try:
                self.hub.write_claim(self.node_id, new, expected=mine)
            except ClaimConflictError:
                return self._conflict(mine, now)
            except Exception as e:  # noqa: BLE001 - the hub is down: try again sooner
                log.warning("node %s: could not renew the claim on %s (%s: %s)", self.node_id, self.hub.url,
                            type(e).__name__, e)
                return False
            self._claim = new
            return True

    def _conflict(self, mine: NodeClaim, now: float) -> bool:
        """The heartbeat's compare-and-swap failed: claim the id again, or mark it lost (module docstring)."""
        try:
            other = self.hub.read_claim(self.node_id)
        except Exception as e:  # noqa: BLE001 - cannot tell what is there: the next heartbeat looks again
            log.warning("node %s: the claim on %s changed and cannot be read (%s: %s)", self.node_id, self.hub.url,
                        type(e).__name__, e)
            return False
        if other is not None and other.holder != self.holder and self._authentic(other):
            if now - mine.renewed_at >= self.ttl:  # ours had expired: taken over as the rules allow
                self._lost = (f"node_id {self.node_id!r} was taken over on {self.hub.url} by {other.holder[:80]} "
                              f"(this worker's heartbeat had stopped for {format_duration(now - mine.renewed_at)})")
                log.error("node %s: %s; stopping", self.node_id, self._lost)
                return False
            self._reclaims = [t for t in self._reclaims if now - t < self.ttl] + [now]
            if len(self._reclaims) > MAX_RECLAIMS:
                self._lost = (f"node_id {self.node_id!r} on {self.hub.url} keeps being claimed by {other.holder[:80]} "
                              f"while this worker's claim is live: two processes run with this node_id")
                log.error("node %s: %s; stopping", self.node_id, self._lost)
                return False
            log.warning("node %s: its live claim on %s was overwritten by %s (no worker of this run takes a live "
                        "claim); claiming it back", self.node_id, self.hub.url, other.holder[:80])
        else:
            log.warning("node %s: its claim on %s %s; claiming it again", self.node_id, self.hub.url,
                        "vanished" if other is None else "was replaced by an unauthenticated or older file")
        epoch = max(mine.epoch, min(other.epoch, 10**15) if other is not None else 0)
        again = self._sign(dataclasses.replace(mine, epoch=epoch, renewed_at=now, expires_at=now + self.ttl,
                                               info=dict(self.info), signature=None))
        try:
            self.hub.write_claim(self.node_id, again, expected=other)
        except Exception as e:  # noqa: BLE001 - a conflict again, or the hub is down: the next heartbeat retries
            log.warning("node %s: could not claim its id again on %s (%s: %s)", self.node_id, self.hub.url,
                        type(e).__name__, e)
            return False
        self._claim = again
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

    def finish(self, local_step: int | None) -> bool:
        """The worker's training ended and every delta it exported is on the hub (its last:
        ``local_step``, None when it sent none): stop the heartbeat and leave a claim that says so
        (``info.finished``) and is already expired, so the master's ``until_finished`` counts this
        node as done and a later worker may take the id at once. True when it was written (else the
        claim is released as usual by :meth:`release`)."""
        self._stop_heartbeat()
        with self._lock:
            mine = self._claim
            if mine is None or self._lost or not self.supported:
                return False
            info = {k: v for k, v in self.info.items() if k != "local_step"}
            info["finished"] = True
            if local_step is not None:
                info["local_step"] = int(local_step)
            now = self.clock()
            done = self._sign(dataclasses.replace(mine, renewed_at=now, expires_at=now, info=info, signature=None))
            try:
                self.hub.write_claim(self.node_id, done, expected=mine)
            except Exception as e:  # noqa: BLE001 - best effort: release() removes the claim instead
                log.warning("node %s: could not mark its claim on %s finished (%s: %s)", self.node_id, self.hub.url,
                            type(e).__name__, e)
                return False
            self._claim = None
            return True

    def _stop_heartbeat(self) -> None:
        """Stop the heartbeat thread (it renews nothing after this returns, or within 10 s)."""
        self._stop.set()
        self._poke.set()
        t, self._thread = self._thread, None
        if t is not None:
            t.join(timeout=10.0)

    def release(self) -> None:
        """Stop the heartbeat and remove the claim (best effort: an unreachable hub lets it expire)."""
        self._stop_heartbeat()
        with self._lock:
            mine, self._claim = self._claim, None
            if mine is None or self._lost or not self.supported:
                return
            try:
                self.hub.write_claim(self.node_id, None, expected=mine)
            except Exception as e:  # noqa: BLE001
                log.warning("node %s: could not release the claim on %s (%s); it expires in %s", self.node_id,
                            self.hub.url, e, format_duration(mine.expires_at - self.clock()))
