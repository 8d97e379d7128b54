"""Which nodes are live: the master's view of the workers' claims and heartbeats.

Every worker claims its node id on the hub and renews the claim (its heartbeat) every half
``claim_ttl`` (:mod:`diloco_lightning.worker.claim`); each heartbeat carries what the worker
reports about itself (:class:`~diloco_lightning.wire.claims.NodeReport`). :class:`Membership`
reads the claims (``Hub.list_claims``) and keeps, per node, when it last heard from it **on the
master's own clock**: a heartbeat counts when the master sees the claim change (new
``renewed_at``, holder or epoch), and an accepted delta counts too (:meth:`Membership.heard`).
The workers' clocks are used once only, bounded: a claim seen for the first time is taken to
be ``min(now - renewed_at, 2 * timeout)`` old, so a master that starts late does not count the
claim of a long-dead worker as live.

**Live**: heard from within the node's timeout. The timeout is ``node_timeout`` when set, else
the claim's own ``ttl`` (``expires_at - renewed_at`` as the worker wrote it) bounded by the
master's own ``max_timeout`` (by default the transport's claim ttl: 60 s on a folder hub, 900 s
on ``hf://`` and ``s3://``, that is two missed heartbeats), and at least 1 s. A claim can make
its node's timeout shorter, never longer than the master's configuration allows: a forged claim
with a ttl of a day cannot keep a round waiting for a day (the deadline's cap, ``max_wait=auto``,
is the longest live timeout). A released claim (a worker that stopped cleanly) leaves at once, and so does a finished one (the claim a
worker leaves when its training ended says ``finished``: :meth:`~diloco_lightning.worker.claim.ClaimKeeper.finish`). A
node that left is simply no longer counted in the quorum: its late deltas are still read,
checked and gated by their staleness like any other, and it rejoins with its next heartbeat.
A new node joins with its first claim; it starts from the newest global version (the worker
installs it at start), so nothing has to be done for it here.

**Reads**: the claims are read at most every ``refresh`` seconds: a quarter of the shortest
timeout, at least the poll interval, at most a minute (one listing, plus one read per claim
that changed on remote hubs); and at once when a delta arrives from a node the membership
does not know (a newcomer counts from its first delta at the latest). A transport without
claims gives an empty membership (a fraction quorum is then 1).

The values a heartbeat reports are untrusted: each is checked against a bound and dropped
(logged once per node and problem) if out of bounds or of the wrong type. In a signed run a
claim that is not signed with the run key is ignored (logged once per node), like a malformed
one; an unreadable claim never hides the others (the hub leaves it out with a reason). The number of live
nodes is bounded by the hub's listing; a writer who can forge claims can make the quorum wait
for nodes that do not exist, up to the deadline (``max_wait``) or their timeout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from diloco_lightning.wire.claims import NodeClaim, NodeReport, default_claim_ttl
from diloco_lightning.util.waiting import format_duration
from diloco_lightning.util.warnonce import WarnOnce

__all__ = ["Membership", "NodeState", "claim_ttl", "MIN_TIMEOUT", "MAX_TIMEOUT", "MAX_REFRESH"]

log = logging.getLogger(__name__)

#: bounds of a node's timeout taken from its claim (a claim may say anything)
MIN_TIMEOUT, MAX_TIMEOUT = 1.0, 86400.0
#: the longest pause between two reads of the claims
MAX_REFRESH = 60.0
#: a node not heard from for this many timeouts is forgotten (its claim was left behind by a kill)
FORGET_AFTER = 10.0


def claim_ttl(claim: NodeClaim) -> float:
    """The ttl the worker gave its claim (``expires_at - renewed_at``), bounded to [1 s, 1 day]."""
    return min(MAX_TIMEOUT, max(MIN_TIMEOUT, claim.expires_at - claim.renewed_at))


@dataclass
class NodeState:
    """What the master knows of one node."""

    node_id: str
    holder: str | None = None
    epoch: int | None = None
    renewed_at: float | None = None  #: the worker's own clock, as written (compared for change only)
    ttl: float = MAX_TIMEOUT
    last_heard: float = 0.0  #: the master's clock: the last heartbeat or delta seen
    report: NodeReport = NodeReport()
    claimed: bool = False  #: it holds a claim on the hub now
    live: bool = False
    finished: bool = False  #: its claim says its training ended (``NodeReport.finished``)
    finished_step: int | None = None  #: then: the ``local_step`` of its last delta (None: it sent none)


class Membership:
    """The live nodes (see the module docstring).

    Args:
        hub: the hub (``list_claims``); None for a membership fed by hand (tests, the simulator).
        node_timeout: seconds without a heartbeat or delta before a node is not live (None: each
            claim's ttl, at most ``max_timeout``).
        max_timeout: the longest timeout a claim's ttl may give (None: the transport's default claim
            ttl, ``wire.claims.default_claim_ttl``; a day without a hub).
        signing_key: the run key (a signed run): claims not signed with it are ignored.
        poll_interval: the master's poll interval (the shortest pause between two reads).
        clock: the master's clock (monotonic seconds).
        wall: the wall clock (unix seconds; only to age a claim seen for the first time).
    """

    def __init__(
        self,
        hub: Any = None,
        *,
        node_timeout: float | None = None,
        poll_interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        max_timeout: float | None = None,
        signing_key: Any = None,
    ) -> None:
        self.hub = hub
        self.node_timeout = node_timeout
        if max_timeout is None:
            max_timeout = default_claim_ttl(hub) if hub is not None else MAX_TIMEOUT
        self.max_timeout = min(MAX_TIMEOUT, max(MIN_TIMEOUT, float(max_timeout)))
        self.signing_key = signing_key
        self.poll_interval = float(poll_interval)
        self.clock = clock
        self.wall = wall
        self.nodes: dict[str, NodeState] = {}
        self.supported = hub is not None
        self._read_at: float | None = None
        self._warned = WarnOnce(log)  # bounded: node ids and problems are any hub writer's

    # ------------------------------------------------------------------ reading the hub

    def timeout(self, node: NodeState) -> float:
        return float(self.node_timeout) if self.node_timeout is not None else min(node.ttl, self.max_timeout)

    def refresh_interval(self) -> float:
        timeouts = [self.timeout(n) for n in self.nodes.values() if n.claimed]
        quarter = min(timeouts) / 4 if timeouts else 5.0
        return min(MAX_REFRESH, max(self.poll_interval, quarter))

    def refresh(self, *, force: bool = False) -> bool:
        """Read the claims if due (or ``force``); True when they were read. Errors of the hub are
        logged and leave the last view in place (the round goes on)."""
        if not self.supported:
            return False
        now = self.clock()
        if not force and self._read_at is not None and now - self._read_at < self.refresh_interval():
            return False
        self._read_at = now
        try:
            claims = self.hub.list_claims()
        except NotImplementedError:
            self.supported = False
            log.warning("%s holds no node claims: the master cannot tell which workers are live, and a fraction "
                        "min_deltas counts as 1", type(self.hub).__name__)
            return False
        except Exception as e:  # noqa: BLE001 - the hub is down: keep the last view
            log.warning("could not read the node claims on %s (%s: %s); keeping the last view", getattr(self.hub, "url", "?"),
                        type(e).__name__, e)
            return False
        if self.signing_key is not None:
            claims = self._authentic(claims)
        self.observe(claims, now)
        return True

    def _authentic(self, claims: Mapping[str, NodeClaim]) -> dict[str, NodeClaim]:
        """The claims signed with the run key; the others are ignored, logged once per node."""
        out = {}
        for node_id, claim in claims.items():
            if claim.verify(self.signing_key):
                out[node_id] = claim
            else:
                self._warned.warn(f"{node_id}:unsigned", "ignoring the claim of node %s (%s): it is not signed with "
                                  "the run key", node_id, claim.holder[:80])
        return out

    def observe(self, claims: Mapping[str, NodeClaim], now: float | None = None) -> None:
        """Take in the claims on the hub (all of them: a node absent here released its claim)."""
        now = self.clock() if now is None else now
        for node_id, claim in claims.items():
            st = self.nodes.get(node_id)
            if st is None:
                st = self.nodes[node_id] = NodeState(node_id)
                st.ttl = claim_ttl(claim)
                # the one use of the worker's clock: how old the heartbeat was at first sight, bounded
                age = min(max(0.0, self.wall() - claim.renewed_at), 2 * self.timeout(st))
                st.last_heard = now - age
            elif (claim.holder, claim.epoch, claim.renewed_at) != (st.holder, st.epoch, st.renewed_at):
                st.last_heard = max(st.last_heard, now)
            report, problems = NodeReport.from_info(claim.info)
            finished = bool(report.finished)
            if finished and not st.finished:
                log.info("node %s finished (its last delta: local_step %s)", node_id, report.local_step)
            # a finished node left the quorum as a released claim does (its claim stays as the record)
            st.holder, st.epoch, st.renewed_at, st.claimed = claim.holder, claim.epoch, claim.renewed_at, not finished
            st.finished, st.finished_step = finished, report.local_step if finished else None
            st.live = st.live and not finished
            st.ttl = claim_ttl(claim)
            if (report.replayed or 0) > (st.report.replayed or 0):
                log.warning("node %s: %d inner phase(s) it trained again after a restart from an older checkpoint "
                            "were dropped, not sent (the hub already had them: replays of delivered work)", node_id,
                            report.replayed)
            st.report = report
            for p in problems:
                self._warned.warn(f"{node_id}:{p.split('=')[0]}", "node %s: ignoring part of its heartbeat: %s", node_id, p)
        for node_id, st in self.nodes.items():
            if node_id not in claims and st.claimed:
                st.claimed = False
                if st.live:
                    log.info("node %s left the quorum: its claim was released", node_id)
                    st.live = False
        self._update(now)

    # ------------------------------------------------------------------ evidence of life

    def heard(self, node_id: str, now: float | None = None) -> bool:
        """A delta of ``node_id`` was accepted now. False when the node is unknown (the caller
        may :meth:`refresh` with ``force``: a newcomer's claim is on the hub by now)."""
        now = self.clock() if now is None else now
        st = self.nodes.get(node_id)
        if st is None:
            return False
        st.last_heard = max(st.last_heard, now)
        if st.claimed and not st.live:
            self._update(now)
        return True

    def _update(self, now: float) -> None:
        for node_id in list(self.nodes):
            st = self.nodes[node_id]
            silent = now - st.last_heard
            live = st.claimed and silent <= self.timeout(st)
            if live and not st.live:
                log.info("node %s joined the quorum (%s, epoch %s)", node_id, st.holder, st.epoch)
            elif st.live and not live:
                log.info("node %s left the quorum: nothing heard for %s (timeout %s); its late deltas are still "
                         "judged by their staleness", node_id, format_duration(silent), format_duration(self.timeout(st)))
            st.live = live
            if not st.claimed and silent > FORGET_AFTER * self.timeout(st):
                del self.nodes[node_id]

    # ------------------------------------------------------------------ the view

    def live(self, now: float | None = None) -> list[str]:
        """The live nodes, sorted (evaluated at ``now``)."""
        self._update(self.clock() if now is None else now)
        return sorted(n for n, st in self.nodes.items() if st.live)

    def knows(self, node_id: str) -> bool:
        return node_id in self.nodes

    def reports(self) -> dict[str, NodeReport]:
        """The live nodes' last heartbeat reports."""
        return {n: st.report for n, st in sorted(self.nodes.items()) if st.live}

    def cap(self) -> float:
        """The longest wait worth having for a live node: the longest timeout among them (after it,
        a silent node is dropped and the quorum shrinks anyway)."""
        timeouts = [self.timeout(st) for st in self.nodes.values() if st.live]
        if timeouts:
            return max(timeouts)
        return float(self.node_timeout) if self.node_timeout is not None else MAX_REFRESH

    def state_dict(self) -> dict[str, Any]:
        """For reports (not needed to resume: one read of the claims rebuilds it)."""
        return {n: {"live": st.live, "holder": st.holder, "epoch": st.epoch, **st.report.to_info()}
                for n, st in sorted(self.nodes.items())}
