"""Before each round, the master's state is brought in line with the hub: what it adopts, what it
publishes over, and what it never trusts.

:meth:`Adoption.reconcile` reads the hub's manifest (checked: well-formed, and signed with the run
key in a signed run) and decides:

* **nothing published**: a hub that Speedtronic's master served is adopted (``compat``), else the
  master bootstraps from a worker's ``init.safetensors`` (or waits for one), then publishes its
  version as is (outer step 0, or a restart on a wiped hub);
* **the hub is at least as new** (or the master has no state yet): adopt it: weights, optimizer
  state, ledger and the validator's norm window, forgetting the round in progress;
* **the master is newer** (its local state survived a hub that went back): keep it, and the next
  publication goes over the hub's;
* **malformed, unauthenticated, or at an outer step that leaves no room to run**: never adopted;
  the master's last authentic version is published over it by compare-and-swap on its exact bytes (:meth:`replace_forged`).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable

from diloco_lightning.hub.base import Hub, PublishConflictError
from diloco_lightning.hub.versions import UnauthenticatedVersionError, verify_manifest
from diloco_lightning.master.intake import Intake
from diloco_lightning.master.metrics import RoundMetrics
from diloco_lightning.master.publication import LeaseLost, Publisher
from diloco_lightning.master.runstate import RunState
from diloco_lightning.master.validation import DeltaValidator
from diloco_lightning.wire.manifest import GlobalVersion, ManifestError
from diloco_lightning.wire.names import MANIFEST_PATH, MAX_ADOPTED_STEP, MAX_STEP
from diloco_lightning.wire.signing import RunKey

__all__ = ["Adoption"]

log = logging.getLogger(__name__)


class Adoption:
    """The master's side of the hub's manifest (see the module docstring).

    Args:
        hub, run, intake, validator, publisher: the master's parts.
        signing_key: the run key (a manifest not signed with it is never adopted).
        compat: the compatibility mode (``master/compat.py``), or None.
        discard: forgets what was processed but not published (``Rounds.discard``).
        on_published: called after each publication of this module's.
    """

    def __init__(self, hub: Hub, run: RunState, intake: Intake, validator: DeltaValidator, publisher: Publisher, *,
                 signing_key: RunKey | None, compat: Any, discard: Callable[[], None],
                 on_published: Callable[[], None]) -> None:
        self.hub, self.run, self.intake, self.validator, self.publisher = hub, run, intake, validator, publisher
        self.signing_key = signing_key
        self.compat = compat
        self.discard = discard
        self.on_published = on_published
        self._waiting_logged = False

    def reconcile(self, m: RoundMetrics) -> bool:
        """Bring the in-memory state in line with the hub. False when there is nothing to work on yet."""
        run = self.run
        try:
            hm = self.hub.read_manifest()
            if hm is not None:
                verify_manifest(hm, self.signing_key, self.hub.url)
        except ManifestError as e:
            return self.replace_forged(f"{self.hub.url}/{MANIFEST_PATH} is not a valid manifest ({e})", m)
        except UnauthenticatedVersionError as e:
            return self.replace_forged(str(e), m)
        if hm is not None and hm.outer_step > MAX_ADOPTED_STEP:  # no publication could ever follow it
            return self.replace_forged(
                f"{self.hub.url}/{MANIFEST_PATH} says outer_step {hm.outer_step}, which leaves no room to run (the "
                f"largest is {MAX_STEP}); it is not a version of this run", m)
        if hm is None:
            run.hub_manifest = None
            if self.compat is not None and self.compat.adopt(run, self.validator):  # a hub Speedtronic's master served
                self.discard()
                self.validator.load_state_dict(None)
                self.publisher.collect_soon()
                m.adopted = run.outer_step
            elif run.state is None and not self._bootstrap():
                return False
            # Nothing on the hub: publish our current version (outer step 0, or a restart on a wiped hub).
            if self.republish(m, history=[]):
                m.published += 1
            return run.hub_manifest is not None
        if run.state is not None and run.manifest is not None and hm.outer_step == run.outer_step and hm.weights == run.manifest.weights:
            run.hub_manifest = hm
            return True
        if run.state is None or hm.outer_step >= run.outer_step:
            self.discard()
            payload = run.adopt(hm)
            self.validator.load_state_dict(payload)
            self.publisher.collect_soon()
            m.adopted = hm.outer_step
            return True
        if run.hub_manifest is None or run.hub_manifest.weights != hm.weights:
            log.warning("the local state (outer_step %d) is newer than the hub's (%d); publishing over it",
                        run.outer_step, hm.outer_step)
        run.hub_manifest = hm
        return True

    def follow(self) -> int | None:
        """A standby's round (``warm_standby``): load the hub's newest version when it is newer than the
        one held (weights, optimizer state, ledger, norm window), so that the round which takes the lease
        over finds its state current (:meth:`reconcile` then adopts nothing). Read-only: a standby never
        publishes, and a manifest it cannot trust or read now is left to the lease holder (or to the
        takeover's :meth:`reconcile`). Returns the outer step held (None: none yet). A version of
        another optimizer or model is a :class:`~diloco_lightning.master.config.MasterConfigError`, raised
        at once rather than at takeover."""
        from diloco_lightning.master.config import MasterConfigError

        run = self.run
        try:
            hm = self.hub.read_manifest()
            if hm is None or hm.outer_step > MAX_ADOPTED_STEP:
                return run.outer_step if run.state is not None else None
            verify_manifest(hm, self.signing_key, self.hub.url)
            current = (run.state is not None and run.manifest is not None and hm.outer_step == run.outer_step
                       and hm.weights == run.manifest.weights)
            if not current and (run.state is None or hm.outer_step >= run.outer_step):
                self.discard()
                payload = run.adopt(hm)
                self.validator.load_state_dict(payload)
                self.publisher.collect_soon()
                log.info("standby: holding outer_step %d warm (weights, optimizer state, ledger of %d node(s))",
                         hm.outer_step, len(hm.ledger))
            else:
                run.hub_manifest = hm
        except MasterConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a version collected mid-read, an outage: the next poll tries again
            log.debug("standby: could not load the hub's newest version (%s: %s); trying at the next poll",
                      type(e).__name__, e)
        return run.outer_step if run.state is not None else None

    def _bootstrap(self) -> bool:
        if self.run.bootstrap_from_init():
            return True
        if not self._waiting_logged:
            log.info("nothing published on %s and no worker's init.safetensors yet; waiting", self.hub.url)
            self._waiting_logged = True
        return False

    def replace_forged(self, reason: str, m: RoundMetrics) -> bool:
        """The hub's manifest is not one a master of this run published (malformed, or not signed
        with the run key): never adopt it; publish our last authentic version over it, by
        compare-and-swap on its exact bytes. False when there is nothing of ours to publish."""
        run = self.run
        if run.state is None:
            log.error("%s; this master has no version of its own to restore, waiting", reason)
            return False
        log.error("%s; publishing this master's outer_step %d over it", reason, run.outer_step)
        raw = self.hub.read_manifest_bytes()
        run.hub_manifest = None
        published = self.republish(
            m, history=list(run.manifest.history) if run.manifest is not None else [],
            expected_digest=None if raw is None else hashlib.sha256(raw).hexdigest(),
        )
        if published:
            m.published += 1
        return published

    def republish(self, m: RoundMetrics, history: list[GlobalVersion], expected_digest: str | None = None) -> bool:
        """Publish the current state as is (outer step 0, a hub wiped or forged): no step taken."""
        run = self.run
        assert run.state is not None
        try:
            manifest, record = self.publisher.publish(
                run, run.state, run.outer_step, run.ledger, self.intake.pending, self.validator.state_dict(),
                history=history, expected_digest=expected_digest,
            )
        except PublishConflictError as e:
            log.info("%s; reading the hub's version", e)
            m.conflict = True
            return False
        except LeaseLost:
            m.standby = True
            return False
        run.committed(run.state, run.outer_step, run.ledger, manifest, record)
        self.intake.published(run.ledger)
        self.on_published()
        return True
