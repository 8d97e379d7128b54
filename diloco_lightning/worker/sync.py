"""Getting global versions to the worker: the async prefetcher, lockstep delays, version lookup.

In ``sync="async"`` the training thread never touches the hub: a :class:`GlobalFetcher` thread
reads the manifest every ``poll_interval`` seconds (and right after each boundary), downloads and
verifies (SHA-256, fingerprint) any version newer than the installed one, and keeps it in memory;
the next boundary installs it with in-place copies.
"""

from __future__ import annotations

import logging
import threading

import torch

from diloco_lightning.util.errors import DiLoCoError
from diloco_lightning.worker.delays import (  # noqa: F401 - re-exported: the old import paths
    DELAY_DISTRIBUTIONS,
    draw_delay,
    node_index_of,
    resolve_delay,
)
from diloco_lightning.hub.versions import (
    GlobalIntegrityError,
    UnauthenticatedVersionError,
    load_global,
    load_weights_at,
    verify_manifest,
)
from diloco_lightning.hub.base import Hub, HubNotFoundError
from diloco_lightning.wire.manifest import Manifest
from diloco_lightning.wire.signing import RunKey

log = logging.getLogger(__name__)

__all__ = ["DELAY_DISTRIBUTIONS", "WorkerError", "WaitTimeoutError", "WorkerStopped", "GlobalFetcher", "draw_delay",
           "resolve_delay", "node_index_of", "load_version"]


class WorkerError(DiLoCoError, RuntimeError):
    """The worker cannot go on (wrong model for this hub, a version it needs is gone, ...)."""


class WaitTimeoutError(WorkerError, TimeoutError):
    """A bounded wait (bootstrap, lockstep) ran past ``wait_timeout``."""


class WorkerStopped(WorkerError):
    """A wait ended because the worker was asked to stop (``DiLoCoWorker.request_stop``: SIGTERM)."""


# ----------------------------------------------------------------------------- versions


def load_version(
    hub: Hub, manifest: Manifest, outer_step: int, *, signing_key: RunKey | None = None
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Exactly version ``outer_step``: the manifest's current one or one of its ``history``,
    each checked against the SHA-256 the manifest gives (and the model fingerprint). With
    ``signing_key`` the manifest must be signed with it; an old version whose digest the
    manifest does not give is then refused (nothing would vouch for it).

    Raises ``WorkerError`` if the version is not on the hub any more (garbage-collected) and
    ``HubNotFoundError`` if it vanished while being read.
    """
    verify_manifest(manifest, signing_key, hub.url)
    if manifest.outer_step == outer_step:
        return load_global(hub, manifest, signing_key=signing_key)
    for v in manifest.history:
        if v.outer_step == outer_step:
            if v.weights_sha256 is None and signing_key is not None:
                raise WorkerError(
                    f"global version {outer_step} on {hub.url} has no SHA-256 in the signed manifest: cannot verify it"
                )
            return manifest, load_weights_at(hub, v.weights, v.weights_sha256, manifest.model_fingerprint)
    kept = sorted([manifest.outer_step] + [v.outer_step for v in manifest.history])
    raise WorkerError(
        f"global version {outer_step} is not on {hub.url} any more (it keeps versions {kept}); "
        f"in lockstep with delay d the master must keep at least d + 2 versions (raise keep_globals)"
    )


class GlobalFetcher:
    """Background prefetch of the newest global version (see the module docstring)."""

    def __init__(
        self, hub: Hub, node_id: str, fingerprint: str, *, poll_interval: float, floor: int,
        signing_key: RunKey | None = None,
    ) -> None:
        self.hub = hub
        self.signing_key = signing_key
        self.node_id = node_id
        self.fingerprint = fingerprint
        self.poll_interval = poll_interval
        self._cond = threading.Condition()
        self._floor = floor
        self._ready: tuple[Manifest, dict[str, torch.Tensor]] | None = None
        self._newest_seen = floor
        self._error: Exception | None = None
        self._bad_versions: set[int] = set()
        self._triggered = False
        self._closed = False
        self._failing = False
        self._thread = threading.Thread(target=self._run, name=f"diloco-fetch-{node_id}", daemon=True)
        self._thread.start()

    @property
    def newest_seen(self) -> int:
        with self._cond:
            return self._newest_seen

    def set_floor(self, outer_step: int) -> None:
        """The installed version: nothing at or below it is fetched (or kept)."""
        with self._cond:
            self._floor = max(self._floor, outer_step)
            if self._ready is not None and self._ready[0].outer_step <= self._floor:
                self._ready = None

    def trigger(self) -> None:
        with self._cond:
            self._triggered = True
            self._cond.notify_all()

    def take(self) -> tuple[Manifest, dict[str, torch.Tensor], int] | None:
        """The prefetched version newer than the floor (and the newest outer_step seen), or None.
        Raises the error that stops this worker (a model mismatch) if there is one."""
        with self._cond:
            if self._error is not None:
                raise self._error
            ready, self._ready = self._ready, None
            if ready is None or ready[0].outer_step <= self._floor:
                return None
            return ready[0], ready[1], max(self._newest_seen, ready[0].outer_step)

    def close(self, timeout: float | None = None) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._triggered and not self._closed:
                    self._cond.wait(self.poll_interval)
                self._triggered = False
                if self._closed:
                    return
            try:
                self._poll()
                self._failing = False
            except UnauthenticatedVersionError as e:  # refused, loudly; nothing of ours changes
                if not self._failing:
                    log.error("node %s: %s; training goes on with the installed version", self.node_id, e)
                self._failing = True
            except Exception as e:  # the hub is down: keep trying, say so once per outage
                if not self._failing:
                    log.warning("node %s: cannot read global versions from %s (%s: %s); training goes on",
                                self.node_id, self.hub.url, type(e).__name__, e)
                self._failing = True

    def _poll(self) -> None:
        m = self.hub.read_manifest()
        if m is None:
            return
        verify_manifest(m, self.signing_key, self.hub.url)  # before anything is believed, even its outer_step
        with self._cond:
            self._newest_seen = max(self._newest_seen, m.outer_step)
            have = max(self._floor, self._ready[0].outer_step if self._ready else -1)
        if m.outer_step <= have or m.outer_step in self._bad_versions:
            return
        if m.model_fingerprint != self.fingerprint:
            with self._cond:
                self._error = WorkerError(
                    f"global version {m.outer_step} on {self.hub.url} has model fingerprint {m.model_fingerprint}, "
                    f"this model has {self.fingerprint}: the hub holds another model (or the same one in another dtype)"
                )
            self._bad_versions.add(m.outer_step)
            return
        try:
            m, state = load_global(self.hub, m, signing_key=self.signing_key)
        except HubNotFoundError:
            return  # collected meanwhile: a newer one is published, the next poll gets it
        except GlobalIntegrityError as e:
            log.warning("node %s: skipping global version %d: %s", self.node_id, m.outer_step, e)
            self._bad_versions.add(m.outer_step)
            return
        with self._cond:
            if m.outer_step > max(self._floor, self._ready[0].outer_step if self._ready else -1):
                self._ready = (m, state)
