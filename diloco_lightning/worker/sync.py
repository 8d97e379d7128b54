"""Getting global versions to the worker: the async prefetcher, lockstep delays, version lookup.

In ``sync="async"`` the training thread never touches the hub: a :class:`GlobalFetcher` thread
reads the manifest every ``poll_interval`` seconds (and right after each boundary), downloads and
verifies (SHA-256, fingerprint) any version newer than the installed one, and keeps it in memory;
the next boundary installs it with in-place copies.
"""

from __future__ import annotations

import logging
import math
import random
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from diloco_lightning.util.errors import DiLoCoError
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


# ----------------------------------------------------------------------------- delays


def node_index_of(node_id: str, node_index: int | None) -> int:
    """``node_index`` if given, else the number that ends ``node_id`` (``"w3"`` -> 3)."""
    if node_index is not None:
        if isinstance(node_index, bool) or not isinstance(node_index, int) or node_index < 0:
            raise ValueError(f"node_index must be a non-negative integer, got {node_index!r}")
        return node_index
    m = re.search(r"(\d+)$", node_id)
    if m is None:
        raise ValueError(
            f"delay is a per-node list or a distribution, so each worker needs its index: pass node_index= "
            f"(node_id {node_id!r} does not end with a number to take it from)"
        )
    return int(m.group(1))


def _nonneg_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


#: the laws a delay may be drawn from (:func:`draw_delay`)
DELAY_DISTRIBUTIONS = ("uniform", "choice", "geometric", "pareto")


def resolve_delay(delay: Any, node_id: str, node_index: int | None = None) -> int:
    """This worker's lockstep delay (tau) from the ``delay`` option.

    * an int >= 0: the same for every worker;
    * a list of ints: ``delay[index % len(delay)]`` (per-node delays);
    * a mapping, a seeded distribution drawn once per worker (``random.Random(f"{seed}:{index}")``,
      the draw ``train.py`` makes for each worker) by :func:`draw_delay`, e.g.
      ``{"distribution": "uniform", "low": 0, "high": 8, "seed": 0}`` (inclusive bounds; the
      default distribution when ``high`` is given) or
      ``{"distribution": "choice", "values": [0, 4, 8], "weights": [2, 1, 1], "seed": 0}``.

    ``index`` is ``node_index`` or the number ending ``node_id``.
    """
    if isinstance(delay, bool):
        raise ValueError(f"delay must be an int, a list of ints or a distribution mapping, got {delay!r}")
    if isinstance(delay, int):
        return _nonneg_int(delay, "delay")
    if isinstance(delay, Sequence) and not isinstance(delay, (str, bytes)):
        values = [_nonneg_int(d, f"delay[{i}]") for i, d in enumerate(delay)]
        if not values:
            raise ValueError("delay: an empty list gives no delay to any worker")
        return values[node_index_of(node_id, node_index) % len(values)]
    if isinstance(delay, Mapping):
        index = node_index_of(node_id, node_index)
        return draw_delay(delay, random.Random(f"{delay.get('seed', 0)}:{index}"))
    raise ValueError(f"delay must be an int, a list of ints or a distribution mapping, got {delay!r}")


def draw_delay(spec: Mapping[str, Any], rng: random.Random) -> int:
    """One draw of a delay from the law ``spec`` names (``seed`` is ignored here: ``rng`` is seeded).

    * ``uniform``: ``low`` (default 0) to ``high``, inclusive, equally likely;
    * ``choice``: one of ``values`` (with ``weights``, default equal);
    * ``geometric``: ``P(tau = k) = p (1 - p)^k`` for k >= 0, given by ``mean`` (``p = 1 / (mean + 1)``);
    * ``pareto``: a heavy tail, the discretised Lomax law ``tau = floor(scale * (U^(-1/shape) - 1))``,
      ``P(tau >= x) ~ (1 + x / scale)^-shape`` (``shape`` default 1.5, ``scale`` default 4: median 2,
      mean 8, 3.7 % of the draws at 32 or more);

    ``geometric`` and ``pareto`` take an optional ``max`` (draws above it are set to it). Raises
    ``ValueError`` naming the key on a bad spec.
    """
    spec = dict(spec)
    spec.pop("seed", None)
    dist = spec.pop("distribution", "uniform" if "high" in spec else None)
    if dist == "uniform":
        low = _nonneg_int(spec.pop("low", 0), "delay['low']")
        if "high" not in spec:
            raise ValueError("delay: a uniform distribution needs 'high'")
        high = _nonneg_int(spec.pop("high"), "delay['high']")
        if high < low:
            raise ValueError(f"delay: 'high' ({high}) is below 'low' ({low})")
        out = rng.randint(low, high)
    elif dist == "choice":
        values = spec.pop("values", None)
        if not isinstance(values, Sequence) or not values:
            raise ValueError("delay: a choice distribution needs a non-empty 'values' list")
        values = [_nonneg_int(v, "delay['values'][...]") for v in values]
        weights = spec.pop("weights", None)
        if weights is not None and (len(weights) != len(values) or any(float(w) < 0 for w in weights)):
            raise ValueError("delay: 'weights' must be as long as 'values' and non-negative")
        out = rng.choices(values, weights=weights)[0]
    elif dist in ("geometric", "pareto"):
        cap = spec.pop("max", None)
        if cap is not None:
            cap = _nonneg_int(cap, "delay['max']")
        if dist == "geometric":
            mean = _positive_real(spec.pop("mean", None), "delay['mean']")
            u = 1.0 - rng.random()  # (0, 1]
            out = int(math.floor(math.log(u) / math.log(mean / (mean + 1.0))))
        else:
            shape = _positive_real(spec.pop("shape", 1.5), "delay['shape']")
            scale = _positive_real(spec.pop("scale", 4.0), "delay['scale']")
            u = 1.0 - rng.random()
            out = int(min(math.floor(scale * (u ** (-1.0 / shape) - 1.0)), 2**62))
        if cap is not None:
            out = min(out, cap)
    else:
        raise ValueError(f"delay: unknown distribution {dist!r} (expected one of {', '.join(DELAY_DISTRIBUTIONS)})")
    if spec:
        raise ValueError(f"delay: unknown key(s) {sorted(spec)} in the distribution spec")
    return out


def _positive_real(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive number, got {value!r}")
    return float(value)


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
