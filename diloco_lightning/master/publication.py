"""Publishing a version: stage, compare-and-swap on the hub, record locally; garbage collection
and the litter sweep that go with it.

A publication (:meth:`Publisher.publish`):

1. stages the weights and the optimizer state under fresh unique names in the master's
   folder (:func:`~diloco_lightning.master.staging.stage_version`: one pass writes and hashes);
2. builds the manifest: digests, fingerprint, ledger, the kept older versions with their
   digests, the optimizer, the master and its lease epoch, signed in a signed run;
3. publishes it in one atomic step guarded by compare-and-swap (``Hub.publish``), with the
   deletions it carries: the deltas it processed or refused, the previous optimizer state,
   versions beyond ``keep_globals`` and, every ``gc_every`` publications, everything older
   left behind by crashes;
4. records it locally (:mod:`~diloco_lightning.master.localstate`), which is what lets a
   restarted master adopt the newer of its own copy and the hub's: every accepted delta is
   applied exactly once whatever is killed when.

A failure at any step leaves the previous version in place and raises; the staged files are
removed. The round that asked for the publication rolls its in-memory work back.
"""

from __future__ import annotations

import contextlib
import math
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from diloco_lightning.util.errors import DiLoCoError
from diloco_lightning.util import faults
from diloco_lightning.util.fileio import sweep_temporaries
from diloco_lightning.hub.base import Hub
from diloco_lightning.wire.manifest import MAX_DELTA_SCALE, GlobalVersion, Manifest
from diloco_lightning.master import localstate
from diloco_lightning.master.config import MasterConfig
from diloco_lightning.master.lease import LeaseKeeper
from diloco_lightning.master.runstate import RunState
from diloco_lightning.master.staging import stage_version
from diloco_lightning.wire.signing import RunKey

__all__ = ["LeaseLost", "Publisher", "global_file_step"]

log = logging.getLogger(__name__)


class LeaseLost(DiLoCoError):
    """This master no longer holds the lease: it must not publish."""


def global_file_step(path: str) -> int | None:
    """The outer step in ``global/weights_<step>_<token>.safetensors`` / ``outer_state_...``, else None."""
    name = path.rsplit("/", 1)[-1]
    for prefix in ("weights_", "outer_state_"):
        if name.startswith(prefix) and name.endswith(".safetensors"):
            parts = name[len(prefix) : -len(".safetensors")].split("_")
            if len(parts) == 2 and parts[0].isdigit():
                return int(parts[0])
    return None


class Publisher:
    """See the module docstring. ``owner`` receives the crash points (``staged``, ``published``,
    ``saved``) of :mod:`diloco_lightning.util.faults`."""

    def __init__(
        self,
        hub: Hub,
        config: MasterConfig,
        node_state_dir: Path,
        signing_key: RunKey | None,
        holder: str,
        lease: LeaseKeeper | None,
        owner: Any = None,
        compat: Any = None,
    ) -> None:
        self.hub = hub
        self.config = config
        self.node_state_dir = node_state_dir
        self.signing_key = signing_key
        self.holder = holder
        self.lease = lease
        self.owner = owner
        #: a compatibility mode (master/compat.py) whose mirrors ride with each publication
        self.compat = compat
        self.gc_countdown = 0  # 0: the next publication collects garbage too
        self.swept = False

    def collect_soon(self) -> None:
        """The next publication collects garbage (after a start or an adoption)."""
        self.gc_countdown = 0

    def publish(
        self,
        run: RunState,
        buf: dict[str, torch.Tensor],
        new_step: int,
        ledger: Mapping[str, int],
        processed: list[str],
        master_payload: Mapping[str, Any],
        *,
        history: list[GlobalVersion] | None = None,
        expected_digest: str | None = None,
        updated_fragments: Any = (),
        delta_scales: Mapping[str, float] | None = None,
    ) -> tuple[Manifest, localstate.LocalRecord]:
        """Publish ``buf`` (with the optimizer's current state) as ``new_step``; see the module
        docstring. Nothing changes in ``run``: the caller swaps the version in. ``delta_scales``:
        the factor each node's delta of this step got, merged into the previous manifest's
        ``master.delta_scales`` (nodes of the ledger only); None: the entry is left out."""
        if self.lease is not None and not self.lease.ensure_fresh():
            raise LeaseLost()
        # the live buffers, not copies: they are written out before the optimizer steps again
        payload = {"optimizer": run.opt.state_dict(copy=False), "master": dict(master_payload)}
        staged = stage_version(self.node_state_dir, new_step, buf, payload)
        del payload
        faults.point("staged", self.owner)
        local_files = list(staged.files.values())
        try:
            prev = run.hub_manifest
            if history is None:
                history = []
                if prev is not None:  # with its digest: a reader (and a signature) can vouch for an old version
                    steps = [f["outer_step"] for f in prev.fragments] if prev.fragments else None
                    history = [GlobalVersion(prev.outer_step, prev.weights, None, prev.weights_sha256,
                                               fragment_steps=steps)] + list(prev.history)
                history = history[: self.config.keep_globals]
            epoch = self.lease.epoch if self.lease is not None else None
            master: dict[str, Any] = {"holder": self.holder, "epoch": epoch} if epoch is not None else {"holder": self.holder}
            if delta_scales is not None:
                known = dict((prev.master.get("delta_scales") or {}) if prev is not None else {})
                known.update({n: v for n, v in delta_scales.items() if math.isfinite(v) and 0.0 <= v <= MAX_DELTA_SCALE})
                master["delta_scales"] = {n: known[n] for n in sorted(known) if n in ledger}
            manifest = staged.manifest(
                ledger=dict(ledger),
                optimizer={"name": run.opt.name, "options": dict(run.opt.options)},
                history=history,
                master=master,
                published_at=time.time(),
                fragments=run.fragment_doc(new_step, updated_fragments),
            )
            if self.signing_key is not None:
                manifest = manifest.signed(self.signing_key)
            delete = self._deletions(manifest, prev, processed, ledger)
            extra: dict[str, Any] = {}
            if self.compat is not None:  # e.g. Speedtronic's latest.safetensors + step_count.json, after the manifest
                extra["mirrors"] = self.compat.mirrors(manifest, staged.files[staged.weights])
            self.hub.publish(
                manifest,
                staged.files,
                expected_outer_step=prev.outer_step if prev is not None else None,
                delete=delete,
                expected_digest=expected_digest,
                **extra,
            )
        except BaseException:
            _remove(local_files)
            raise
        self.gc_countdown = (self.gc_countdown - 1) if self.gc_countdown > 0 else self.config.gc_every - 1
        run.hub_manifest = manifest
        faults.point("published", self.owner)
        try:
            record = localstate.save_record(
                self.node_state_dir, self.hub.url, manifest, staged.files[staged.weights],
                staged.files.get(staged.outer_state) if staged.outer_state else None,
            )
        except BaseException as e:
            log.error(
                "outer_step %d is published but could not be saved in %s (%s); rolling back in memory, "
                "the next round adopts it from the hub", new_step, self.node_state_dir, e,
            )
            _remove(local_files)
            raise
        faults.point("saved", self.owner)
        return manifest, record

    def _deletions(self, manifest: Manifest, prev: Manifest | None, processed: list[str],
                   ledger: Mapping[str, int]) -> list[str]:
        keep = set(manifest.files())
        dels = set(processed)
        if prev is not None:
            dels.update(p for p in prev.files() if p not in keep)
        if self.gc_countdown <= 0:
            self.swept = False  # the next round sweeps temporary files too
            try:
                for p in self.hub.list_global():
                    step = global_file_step(p)
                    if step is not None and step <= manifest.outer_step and p not in keep:
                        dels.add(p)
                for ref in self.hub.list_deltas():
                    if ref.local_step <= ledger.get(ref.node_id, -1):
                        dels.add(ref.path)
            except Exception as e:  # noqa: BLE001 - garbage collection is best effort
                log.warning("could not list %s for garbage collection: %s", self.hub.url, e)
        return sorted(dels - keep)

    def sweep(self) -> None:
        """Remove what dead writers left: temporary files on the hub, in its cache, in our folder."""
        self.swept = True
        age = self.config.sweep_age
        try:
            removed = self.hub.sweep(age) + sweep_temporaries(self.node_state_dir, age)
        except Exception as e:  # noqa: BLE001 - sweeping is housekeeping, never a reason to fail a round
            log.warning("could not sweep temporary files of %s: %s", self.hub.url, e)
            return
        if removed:
            log.info("swept %d temporary file(s) left by interrupted writers (%s%s)", len(removed),
                     ", ".join(removed[:3]), " ..." if len(removed) > 3 else "")


def _remove(files: list[Path]) -> None:
    for f in files:
        with contextlib.suppress(Exception):
            f.unlink()
