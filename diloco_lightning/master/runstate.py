"""The master's run state: the global state it works on, its optimizer, and which published
version that is.

One object owns it all (:class:`RunState`) and changes it in one place (:meth:`RunState.set`),
under a lock that only ever covers in-memory work, so ``snapshot()`` never waits for the
network. A version comes in three ways: installed from a state given in code (or a worker's
``init.safetensors``), resumed from the master's own folder (``node_state_dir``,
:mod:`~diloco_lightning.master.localstate`), or adopted from the hub. Adoption reads the local
copy when it is that version (checked by SHA-256), else the hub (manifest signature in a signed
run, SHA-256, fingerprint), then keeps a local copy so a restart needs no download.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from diloco_lightning.util.fileio import copy_checked
from diloco_lightning.util.lanes import Lanes
from diloco_lightning.wire.delta import is_synced, model_fingerprint
from diloco_lightning.wire.fragments import (
    FragmentError,
    FragmentPlan,
    build_plan,
    fragment_count,
    split_optimizer_state,
    stepped_state,
)
from diloco_lightning.hub.versions import load_global, load_outer_state
from diloco_lightning.hub.base import Hub
from diloco_lightning.wire.manifest import Manifest, ManifestError, parse_fragments
from diloco_lightning.master import localstate
from diloco_lightning.master.weights import check_state, cpu_clone  # noqa: F401 - also their old home
from diloco_lightning.master.config import MasterConfig, MasterConfigError, with_run_fragments
from diloco_lightning.wire.names import init_path
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.wire.statefile import StateFileError, load_state_file, load_weights_file
from diloco_lightning.wire.layout import LayoutError, read_layout

__all__ = ["RunState", "check_state", "STATE_DICT_FORMAT"]

log = logging.getLogger(__name__)

STATE_DICT_FORMAT = "diloco-master/1"


class RunState:
    """See the module docstring. Attributes are read freely between rounds; they change only
    through :meth:`set` (and :meth:`committed`), under :attr:`lock`."""

    def __init__(self, config: MasterConfig, hub: Hub, node_state_dir: Path, signing_key: RunKey | None) -> None:
        self.config = config
        self.hub = hub
        self.node_state_dir = node_state_dir
        self.signing_key = signing_key
        self.opt_options = config.optimizer_options()
        self.lock = threading.Lock()
        #: nodes whose offered initial weights were refused (an offer is never replaced: read once)
        self._refused_inits: set[str] = set()
        self.state: dict[str, torch.Tensor] | None = None
        self.opt: Any = None
        self.fingerprint: str | None = None
        #: the fingerprint of a state given in code: the hub's or local versions must match it
        self.user_fingerprint: str | None = None
        self.outer_step = 0
        self.ledger: dict[str, int] = {}
        self.manifest: Manifest | None = None  # the published version our state equals
        self.hub_manifest: Manifest | None = None  # the hub's current version as last seen
        self.record: localstate.LocalRecord | None = None  # our local copy of the newest version
        #: the optimizer state file of the version we hold (a rollback reloads it)
        self.committed_outer_file: Path | None = None
        self._spare: dict[str, torch.Tensor] | None = None
        self._recycled: dict[str, torch.Tensor] | None = None
        #: the fragments of the model (``config.fragments``; None: no fragments), and per fragment
        #: ``(outer steps that updated it, the version that last did)``, as the manifest records them
        self.plan: FragmentPlan | None = None
        self.fragment_steps: dict[str, tuple[int, int]] = {}

    # ------------------------------------------------------------------ the one place state changes

    def plan_for(self, state: Mapping[str, torch.Tensor]) -> FragmentPlan | None:
        """The fragments of ``config.fragments`` for the model ``state`` (MasterConfigError if they do not fit)."""
        try:
            return build_plan(self.config.fragments, state)
        except FragmentError as e:
            raise MasterConfigError(f"fragments: {e}") from None

    def build_optimizer(self, state: Mapping[str, torch.Tensor]):
        from diloco_lightning.outer import build_outer_optimizer

        plan = self.plan_for(state)
        options = with_run_fragments(self.config.outer_optimizer, self.opt_options, plan)
        return build_outer_optimizer(self.config.outer_optimizer, self.opt_state(state, plan), **options)

    def opt_state(self, state: Mapping[str, torch.Tensor], plan: FragmentPlan | None = None) -> dict[str, torch.Tensor]:
        """What the outer optimizer steps on (:func:`~diloco_lightning.wire.fragments.stepped_state`)."""
        return stepped_state(plan if plan is not None else self.plan, state)

    def _load_optimizer(self, opt: Any, saved: Mapping[str, Any], state: Mapping[str, torch.Tensor], hm: Manifest) -> None:
        """Load version ``hm``'s optimizer state into ``opt``. A version without fragments, continued
        by a master whose fragments split tensors by rows (spec: "a master with fragments may adopt
        a version without them"), has its buffers named by whole key: they are cut into the pieces."""
        plan = self.plan_for(state)
        if plan is None or not plan.split or hm.fragments:
            opt.load_state_dict(saved)
            return
        try:
            opt.load_state_dict(split_optimizer_state(plan, saved))
        except ValueError as e:
            raise MasterConfigError(
                f"outer_step {hm.outer_step} on {self.hub.url} has no fragments and its optimizer state cannot be "
                f"split by rows for fragments={plan.count} ({e}); continue it without fragments"
            ) from None

    def check_split(self, state: Mapping[str, torch.Tensor], hm: Manifest) -> None:
        """Refuse (MasterConfigError, one line) a version whose fragments are split otherwise than
        this master's, before its optimizer state (named by piece) is read."""
        self._fragment_steps(self.plan_for(state), hm.outer_step, hm)

    def _fragment_steps(self, plan: FragmentPlan | None, outer_step: int, manifest: Manifest | None) -> dict[str, tuple[int, int]]:
        """Per fragment (outer steps, last updated at) of ``manifest``; a version without fragment
        entries (a run started without fragments) starts them at (0, its outer_step)."""
        if plan is None:
            return {}
        if manifest is None or not manifest.fragments:
            return {n: (0, outer_step) for n in plan.names}
        ours = [plan.digest(n) for n in plan.names]
        theirs = [f["keys_sha256"] for f in manifest.fragments]
        if ours != theirs:
            raise MasterConfigError(
                f"the run on {self.hub.url} (outer_step {manifest.outer_step}) splits the model into {len(theirs)} "
                f"fragments{' another way' if len(ours) == len(theirs) else ''}; this master into {len(ours)} "
                f"(fragments option): give the run's fragments"
            )
        return {f["name"]: (f["outer_step"], f["updated_at"]) for f in manifest.fragments}

    def fragment_doc(self, new_step: int, updated: Any = ()) -> list[dict[str, Any]] | None:
        """The manifest's ``fragments`` for version ``new_step``, the fragments ``updated`` by it counted."""
        if self.plan is None:
            return None
        out = []
        for n in self.plan.names:
            steps, at = self.fragment_steps.get(n, (0, 0))
            if n in updated:
                steps, at = steps + 1, new_step
            out.append({"name": n, "keys_sha256": self.plan.digest(n), "outer_step": steps, "updated_at": at})
        return out

    def set(self, state: dict[str, torch.Tensor], opt: Any, *, fingerprint: str, outer_step: int,
            ledger: Mapping[str, int], manifest: Manifest | None) -> None:
        plan = self.plan_for(state)
        steps = self._fragment_steps(plan, outer_step, manifest)
        with self.lock:
            self.plan, self.fragment_steps = plan, steps
            self.state, self._spare, self.opt = state, None, opt
            self.fingerprint = fingerprint
            self.outer_step = outer_step
            self.ledger = dict(ledger)
            self.manifest = manifest

    def install(self, state: dict[str, torch.Tensor], *, outer_step: int) -> None:
        """A fresh state (given in code, or a worker's offer): a fresh optimizer, an empty ledger."""
        self.set(state, self.build_optimizer(state), fingerprint=model_fingerprint(state), outer_step=outer_step,
                 ledger={}, manifest=None)
        self.committed_outer_file = None

    def committed(self, buf: dict[str, torch.Tensor], outer_step: int, ledger: Mapping[str, int], manifest: Manifest,
                  record: localstate.LocalRecord) -> None:
        """A publication of ``buf`` as ``outer_step`` succeeded (hub and local copy): swap it in."""
        self.record = record
        self.committed_outer_file = record.outer_state_file
        self.hub_manifest = manifest
        steps = self._fragment_steps(self.plan, outer_step, manifest)
        with self.lock:
            self.fragment_steps = steps
            if buf is not self.state:
                # the old state's memory becomes the next round's FP32 sum (take_sum_storage), not a
                # second state buffer: a round peaks at state + optimizer buffers + sum + one delta
                self.state, self._spare, self._recycled = buf, None, self.state
            self.outer_step = outer_step
            self.ledger = dict(ledger)
            self.manifest = manifest

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        with self.lock:
            if self.state is None:
                raise RuntimeError(
                    "the master has no global state yet (no initial state was given, and no round has adopted the "
                    "hub's published version or a worker's init.safetensors); call sync_once() first"
                )
            return self.outer_step, {k: v.clone() for k, v in self.state.items()}

    # ------------------------------------------------------------------ the working buffer

    def spare_buffer(self, storage: Mapping[str, torch.Tensor] | None = None, lanes: Lanes | None = None) -> dict[str, torch.Tensor]:
        """A second state buffer holding a copy of the current state (allocated once, reused): a
        round steps on it and swaps it in after publishing, so readers never wait. ``storage``:
        tensors of some keys' shapes and dtypes to use when there is no spare (the round's read
        buffer, memory already in place). ``lanes``: the copy in spans on the round's threads."""
        assert self.state is not None
        spare = self._spare
        if spare is None or spare.keys() != self.state.keys() or any(
            spare[k].shape != v.shape or spare[k].dtype != v.dtype for k, v in self.state.items()
        ):
            have = storage or {}
            spare = {k: have[k] if k in have and have[k].shape == v.shape and have[k].dtype == v.dtype
                     else torch.empty_like(v) for k, v in self.state.items()}
        pairs = [(spare[k], v) for k, v in self.state.items()]
        if lanes is None or lanes.over_spans(lambda a, b: a.copy_(b), pairs) is None:  # side by side, else whole
            for a, b in pairs:
                a.copy_(b)
        self._spare = None
        return spare

    def take_sum_storage(self) -> dict[str, torch.Tensor] | None:
        """The previous state's tensors, to hold the next round's FP32 sum (None unless every
        floating key of it is FP32 / complex64 of the current shapes): memory reused, not faulted
        in afresh each round."""
        old, self._recycled = self._recycled, None
        if old is None or self.state is None:
            return None
        out = {}
        for k, v in self.state.items():
            if not is_synced(v):
                continue
            t = old.get(k)
            want = torch.complex64 if v.is_complex() else torch.float32
            if t is None or t.dtype != want or t.shape != v.shape or not t.is_contiguous():
                return None
            out[k] = t
        return out

    def give_back(self, buf: dict[str, torch.Tensor]) -> None:
        """A working buffer that was not published (kept for the next round)."""
        if buf is not self.state:
            self._spare = buf

    def restore_optimizer(self, backup: dict[str, Any] | None) -> bool:
        """Undo an optimizer step that was not published. False when that failed (the caller then
        re-reads the hub's version)."""
        try:
            if backup is not None:
                self.opt.load_state_dict(backup)
            elif self.committed_outer_file is not None:
                payload, _ = load_state_file(self.committed_outer_file)
                self.opt.load_state_dict(payload.get("optimizer") or {})
            else:
                assert self.state is not None
                self.opt = self.build_optimizer(self.state)
            return True
        except Exception as e:  # noqa: BLE001
            log.error("could not restore the optimizer state (%s); re-reading the hub's version", e)
            self.manifest = None  # forces an adoption at the next round
            return False

    # ------------------------------------------------------------------ versions from the hub or our folder

    def check_published(self, hm: Manifest, where: str) -> None:
        """Refuse a version of another optimizer or (when a state was given) another model."""
        from diloco_lightning.outer import same_step

        name = (hm.optimizer or {}).get("name")
        if name is not None and not same_step(name, self.config.outer_optimizer):
            lr = ((hm.optimizer or {}).get("options") or {}).get("lr")
            fix = f"outer={name}" + (f" outer.lr={lr:g}" if isinstance(lr, (int, float)) and not isinstance(lr, bool) else "")
            raise MasterConfigError(
                f"{where} uses outer optimizer {name!r} (outer_step {hm.outer_step}); "
                f"this master is configured for {self.config.outer_optimizer!r}: give it the run's ({fix}; "
                f"in Python, MasterOuterLoop(outer_optimizer={name!r}))"
            )
        ours, theirs = fragment_count(self.config.fragments), len(hm.fragments or []) or 1
        if theirs > 1 and ours != theirs:
            raise MasterConfigError(
                f"{where} syncs {theirs} fragments (outer_step {hm.outer_step}); this master is configured for "
                f"{'none' if ours == 1 else ours}: give it the run's fragments (fragments={theirs})"
            )
        if self.user_fingerprint is not None and hm.model_fingerprint != self.user_fingerprint:
            raise MasterConfigError(
                f"{where} holds another model (fingerprint {hm.model_fingerprint[:12]}...) than the state this master "
                f"was given (fingerprint {self.user_fingerprint[:12]}...)"
            )

    def adopt(self, hm: Manifest) -> dict[str, Any]:
        """Make the hub's version ``hm`` ours (weights, optimizer state, ledger); returns the
        version's master payload (``{"norms": [...]}``) for the validator."""
        self.check_published(hm, f"the hub's run ({self.hub.url})")
        opts = (hm.optimizer or {}).get("options") or {}
        if opts and opts != dict(self.opt.options if self.opt is not None else self.opt_options):
            log.info("the hub's run used optimizer options %s; continuing with %s", opts, self.opt_options)
        state, outer, src_w, src_o = self._load_version(hm)
        self.check_split(state, hm)
        opt = self.build_optimizer(state)
        if outer is not None:
            self._load_optimizer(opt, outer.get("optimizer") or {}, state, hm)
        elif hm.outer_step > 0:
            log.warning("outer_step %d on %s has no optimizer state; starting the optimizer afresh", hm.outer_step, self.hub.url)
        self.set(state, opt, fingerprint=hm.model_fingerprint, outer_step=hm.outer_step, ledger=hm.ledger, manifest=hm)
        self.hub_manifest = hm
        log.info("adopted outer_step %d from %s (%d node(s) in the ledger)", hm.outer_step, self.hub.url, len(hm.ledger))
        self._persist_adopted(hm, src_w, src_o)
        return dict((outer or {}).get("master") or {})

    def _load_version(self, hm: Manifest, *, local_only: bool = False):
        """(state, outer payload, weights file, outer-state file) of ``hm``: our local copy if it is
        that version (digests checked on the files read), else the hub."""
        rec = self.record
        if rec is not None and rec.manifest.weights == hm.weights and rec.manifest.outer_state == hm.outer_state:
            try:
                state, _ = load_weights_file(rec.weights_file, hm.weights_sha256)
                outer = None
                if rec.outer_state_file is not None:
                    outer = load_state_file(rec.outer_state_file, hm.outer_state_sha256)[0]
                if model_fingerprint(state) == hm.model_fingerprint:
                    return state, outer, None, None
            except (OSError, StateFileError) as e:
                log.warning("local copy of outer_step %d unusable (%s)", hm.outer_step, e)
        if local_only:
            raise ValueError(f"the local copy of outer_step {hm.outer_step} does not match its record")
        # the downloads are kept until they are copied into the local state (_persist_adopted releases them)
        _, state = load_global(self.hub, hm, signing_key=self.signing_key, keep_file=True)
        outer = load_outer_state(self.hub, hm, signing_key=self.signing_key, keep_file=True)
        src_w = self.hub.download(hm.weights)
        src_o = self.hub.download(hm.outer_state) if hm.outer_state else None
        return state, outer, src_w, src_o

    def _persist_adopted(self, hm: Manifest, src_w: Path | None, src_o: Path | None) -> None:
        if src_w is None:  # loaded from the local record itself
            self.committed_outer_file = self.record.outer_state_file if self.record else None
            return
        self.committed_outer_file = None
        try:
            # the copies are the bytes the manifest promises (a file swapped on the hub since it was
            # loaded is not copied; a held download is read as it was checked: util/heldfile.py)
            dst_w = self.node_state_dir / Path(hm.weights).name
            copy_checked(src_w, dst_w, hm.weights_sha256)
            dst_o = None
            if src_o is not None and hm.outer_state:
                dst_o = self.node_state_dir / Path(hm.outer_state).name
                copy_checked(src_o, dst_o, hm.outer_state_sha256)
            self.record = localstate.save_record(self.node_state_dir, self.hub.url, hm, dst_w, dst_o)
            self.committed_outer_file = dst_o
        except OSError as e:
            log.warning("could not save the adopted version locally in %s: %s", self.node_state_dir, e)
        for p in (src_w, src_o):
            if p is not None:
                self.hub.release(p)

    def load_local(self) -> dict[str, Any] | None:
        """Resume from ``node_state_dir`` if it holds a version of this hub (verified by SHA-256);
        returns that version's master payload, or None when nothing was resumed."""
        rec = localstate.load_record(self.node_state_dir)
        if rec is None:
            localstate.cleanup(self.node_state_dir, keep=set())
            return None
        if rec.hub_url != self.hub.url:
            log.warning("ignoring the local state in %s: it belongs to hub %s, not %s", self.node_state_dir, rec.hub_url,
                        self.hub.url)
            return None
        hm = rec.manifest
        self.check_published(hm, f"the local state in {self.node_state_dir}")
        if self.state is not None and rec.outer_step < self.outer_step:
            return None
        self.record = rec
        localstate.cleanup(
            self.node_state_dir, keep={rec.weights_file.name} | ({rec.outer_state_file.name} if rec.outer_state_file else set())
        )
        try:
            state, outer, _, _ = self._load_version(hm, local_only=True)
        except (OSError, StateFileError, ValueError) as e:
            self.record = None
            log.warning("ignoring the local state in %s: %s", self.node_state_dir, e)
            return None
        self.check_split(state, hm)
        opt = self.build_optimizer(state)
        if outer is not None:
            self._load_optimizer(opt, outer.get("optimizer") or {}, state, hm)
        self.set(state, opt, fingerprint=hm.model_fingerprint, outer_step=hm.outer_step, ledger=hm.ledger, manifest=hm)
        self.committed_outer_file = rec.outer_state_file
        log.info("resumed outer_step %d from %s", hm.outer_step, self.node_state_dir)
        return dict((outer or {}).get("master") or {})

    def bootstrap_from_init(self) -> bool:
        """Adopt the first worker's offered ``init.safetensors`` (sorted by node id) as outer step
        0; in a signed run only a signed offer. False while there is none."""
        for node in self.hub.list_inits():
            if node in self._refused_inits:  # an offer is never replaced (first writer wins): judged once
                continue
            path = self.hub.download(init_path(node))
            try:
                if self.signing_key is not None:
                    layout = read_layout(path)
                    if not self.signing_key.verify_file(layout.metadata.get("signature"), path, layout):
                        raise ValueError("it is not signed with the run key")
                state, _ = load_weights_file(path)
                state = dict(check_state(state, f"nodes/{node}/init.safetensors"))
            except (ValueError, OSError, LayoutError, StateFileError) as e:
                log.error("ignoring nodes/%s/init.safetensors on %s: %s; waiting for another worker's offer", node,
                          self.hub.url, e)
                if len(self._refused_inits) < 100_000:
                    self._refused_inits.add(node)
                continue
            finally:
                self.hub.release(path)
            self.install(state, outer_step=0)
            log.info("bootstrapped the global state from nodes/%s/init.safetensors (%d tensors)", node, len(state))
            return True
        return False

    # ------------------------------------------------------------------ state_dict

    def state_dict(self, extra: Mapping[str, Any]) -> dict[str, Any]:
        with self.lock:
            if self.state is None:
                raise RuntimeError("the master has no global state yet; call sync_once() first")
            return {
                "format": STATE_DICT_FORMAT,
                "outer_step": self.outer_step,
                "global": {k: v.clone() for k, v in self.state.items()},
                "optimizer": self.opt.state_dict(),
                "outer_optimizer": self.config.outer_optimizer,
                "outer_options": dict(self.opt.options),
                "ledger": dict(self.ledger),
                "history": [asdict(v) for v in (self.manifest.history if self.manifest else [])],
                # per fragment: its outer step count and the version that last updated it (the staleness
                # and age a_f of its next deltas), as the manifest records them; None without fragments
                "fragments": self.fragment_doc(self.outer_step),
                **extra,
            }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        if not isinstance(sd, Mapping) or sd.get("format") != STATE_DICT_FORMAT:
            raise ValueError(f"state_dict must be a {STATE_DICT_FORMAT!r} mapping from MasterOuterLoop.state_dict()")
        from diloco_lightning.outer import same_step

        name = sd.get("outer_optimizer")
        if not same_step(name, self.config.outer_optimizer):
            raise ValueError(f"state_dict is for outer optimizer {name!r}, this master runs {self.config.outer_optimizer!r}")
        step = sd.get("outer_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"state_dict['outer_step'] must be a non-negative integer, got {step!r}")
        ledger = sd.get("ledger") or {}
        if not isinstance(ledger, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in ledger.items()
        ):
            raise ValueError("state_dict['ledger'] must map node ids to integers")
        state = cpu_clone(check_state(sd.get("global"), "state_dict['global']"))
        steps = self._state_dict_fragments(sd.get("fragments"), self.plan_for(state), step)
        opt = self.build_optimizer(state)
        try:
            opt.load_state_dict(sd.get("optimizer") or {})
        except ValueError as e:
            plan = self.plan_for(state)
            if plan is None or not plan.split:
                raise
            # its buffers are named by piece (key[start:stop]) when a tensor is split: another split names others
            raise ValueError(f"{e}; the state_dict's optimizer state may be of a run whose fragments split the model "
                             f"otherwise: resume with the same fragments") from None
        self.set(state, opt, fingerprint=model_fingerprint(state), outer_step=step, ledger=ledger, manifest=None)
        if steps is not None:
            with self.lock:
                self.fragment_steps = steps
        self.committed_outer_file = None

    @staticmethod
    def _state_dict_fragments(raw: Any, plan: FragmentPlan | None, outer_step: int) -> dict[str, tuple[int, int]] | None:
        """The per-fragment counters of a ``state_dict`` (None: it has none, e.g. one written before
        they were kept, and the counters restart from ``outer_step`` as after a fresh install)."""
        if raw is None:
            return None
        try:
            doc = parse_fragments(raw, outer_step, "state_dict['fragments']")
        except ManifestError as e:
            raise ValueError(str(e)) from None
        theirs = [f["keys_sha256"] for f in doc or []]
        if plan is None or theirs != [plan.digest(n) for n in plan.names]:
            raise ValueError(f"state_dict['fragments'] is of a run with {len(theirs)} fragments and this master has "
                             f"{'none' if plan is None else plan.count}, which split the model otherwise: "
                             f"resume with the same fragments")
        return {f["name"]: (f["outer_step"], f["updated_at"]) for f in doc or []}
