"""One master at a time: a lease on the hub, taken and renewed with the hub's compare-and-swap.

``global/lease.json`` holds ``(holder, epoch, expires_at)``. A master publishes only while it
holds a live lease; every round checks it, and renews it (a write, which on the Hugging Face
Hub is a commit) once less than half of ``ttl`` is left, as does every publication; a second master started on the same hub finds
a live lease held by someone else and stands by, polling, until the lease expires (its
holder died or hung) or is released (a clean ``stop()``), then takes it over with
``epoch + 1`` and continues from the newest published version, optimizer state included. A
standby with ``warm_standby`` (the default) loads each version as it is published while it waits
(``Adoption.follow``), so its takeover round starts at once, with nothing to load: the run goes
without a master for at most one ``ttl`` plus a poll after its holder dies
(``benchmarks/handover.py`` measures it).

The lease is a liveness device, not the safety one: publication itself compares-and-swaps
on the manifest's ``outer_step``, so even a master that kept working after losing its lease
(a long pause, a clock jump) can never overwrite a version or apply a delta twice: its
publication is refused and it re-reads the hub. Expiry times are wall-clock seconds, so
masters on different machines need roughly synchronised clocks (NTP); an error of a few
seconds only shortens or lengthens a takeover.

Any hub writer can write ``global/lease.json``, so a lease file is never trusted to stop a
master: a malformed one counts as expired, and in a signed run so does one without the run
key's signature (a writer without the key cannot hold the lease, only lose a race for it).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Callable

from diloco_lightning.hub.base import Hub, LeaseConflictError
from diloco_lightning.util.errors import DiLoCoError
from diloco_lightning.wire.manifest import Lease
from diloco_lightning.wire.signing import RunKey

__all__ = ["StandbyError", "LeaseKeeper", "default_holder"]

log = logging.getLogger(__name__)


class StandbyError(DiLoCoError, RuntimeError):
    """This master is on standby (another holds the lease): it has no version of its own to give."""


def default_holder() -> str:
    """``host:pid:random``: unique per master process."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class LeaseKeeper:
    """Takes, renews and releases this master's lease on ``hub``.

    Args:
        hub: the hub.
        holder: this master's id (see :func:`default_holder`).
        ttl: seconds a lease stays valid after each renewal.
        clock: wall clock (tests).
        signing_key: the run key of a signed run: leases are signed, and one not signed with it is void.
    """

    def __init__(
        self, hub: Hub, holder: str, ttl: float, *, clock: Callable[[], float] = time.time, signing_key: RunKey | None = None
    ) -> None:
        if not ttl > 0:
            raise ValueError(f"lease_ttl must be > 0, got {ttl!r}")
        self.signing_key = signing_key
        self.hub = hub
        self.holder = holder
        self.ttl = float(ttl)
        self.clock = clock
        self._mine: Lease | None = None
        #: the lease seen at the last :meth:`acquire` that someone else holds (for logs/metrics)
        self.other: Lease | None = None
        #: set when the last :meth:`acquire` took the lease over from another holder (or a fresh hub)
        self.took_over = False

    @property
    def epoch(self) -> int | None:
        return None if self._mine is None else self._mine.epoch

    @property
    def held(self) -> bool:
        """Whether this master held a live lease at its last renewal (no hub read)."""
        return self._mine is not None and not self._mine.expired(self.clock())

    def acquire(self, *, min_epoch: int | Callable[[], int] = 0) -> bool:
        """Renew our lease, or take a free or expired one; False if someone else holds a live one.

        ``min_epoch`` (or a callable giving it, called only when a new lease is taken): a new
        epoch is above it (the epoch in the published manifest), so epochs keep growing even
        if the lease file was removed by a clean stop.
        """
        self.took_over = False
        current = self.hub.read_lease()
        now = self.clock()
        void = current is not None and (
            current.unreadable is not None or (self.signing_key is not None and not current.verify(self.signing_key))
        )
        if void and current is not None and current.unreadable is None:
            log.warning("the lease on %s (holder %r) is not signed with the run key; ignoring it", self.hub.url,
                        current.holder)
        ours = (
            not void and current is not None and current.holder == self.holder
            and (self._mine is None or current.epoch == self._mine.epoch)
        )
        if ours:
            assert current is not None
            if self._mine is not None and current.expires_at - now > self.ttl / 2:
                self._mine = current  # ours and fresh: no write (on the HF Hub each write is a commit)
                self.other = None
                return True
            new = Lease(self.holder, current.epoch, now + self.ttl, now)
        elif void or current is None or current.expired(now):
            # a free, expired or void lease (void: malformed, or unsigned in a signed run) is taken over
            floor = min_epoch() if callable(min_epoch) else min_epoch
            epoch = max(current.epoch if current is not None and not void else 0, int(floor)) + 1
            new = Lease(self.holder, epoch, now + self.ttl, now)
        else:
            if self._mine is not None:
                log.warning(
                    "lost the master lease on %s to %s (epoch %d); standing by", self.hub.url, current.holder, current.epoch
                )
            self._mine = None
            self.other = current
            return False
        if self.signing_key is not None:
            new = new.signed(self.signing_key)
        try:
            self.hub.write_lease(new, expected=current)
        except LeaseConflictError:
            log.info("another master changed the lease on %s first; standing by", self.hub.url)
            self._mine = None
            self.other = None
            return False
        if self._mine is None or self._mine.epoch != new.epoch:
            self.took_over = True
            log.info(
                "master %s holds the lease on %s (epoch %d%s)",
                self.holder,
                self.hub.url,
                new.epoch,
                f", taken over from {current.holder}" if current is not None and current.holder != self.holder else "",
            )
        self._mine = new
        self.other = None
        return True

    def ensure_fresh(self) -> bool:
        """Renew before a publication when less than half the ttl is left; False if the lease is lost."""
        if self._mine is not None and self._mine.expires_at - self.clock() > self.ttl / 2:
            return True
        epoch = self.epoch
        return self.acquire() and self.epoch == epoch

    def release(self) -> None:
        """Give the lease up (a clean stop), so a standby master can take over at once."""
        mine, self._mine = self._mine, None
        if mine is None:
            return
        try:
            current = self.hub.read_lease()
            if current is not None and current.holder == self.holder and current.epoch == mine.epoch:
                self.hub.write_lease(None, expected=current)
                log.info("released the master lease on %s (epoch %d)", self.hub.url, mine.epoch)
        except Exception as e:  # noqa: BLE001 - best effort: the lease expires anyway
            log.warning("could not release the master lease on %s: %s", self.hub.url, e)
