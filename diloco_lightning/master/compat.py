"""``compat="speedtronic"``: a master that speaks Speedtronic 2.0's hub layout beside its own.

Speedtronic (PyPI ``speedtronic`` 2.0.0, ``speedtronic.distributed``) runs DiLoCo through a
Hugging Face repository. What its code reads and writes (from its installed source:
``distributed/hub.py``, ``outer.py``, ``diloco.py``, ``tensors.py``):

* a worker uploads ``nodes/<node_id>/delta_<local_step>.safetensors`` (``HubClient.upload_delta``):
  ``float32(baseline) - float32(current)`` of every floating (and complex) key of its model's
  ``state_dict()``, header ``node_id``, ``local_step`` (its trainer step), ``base_outer_step``
  (the ``outer_step`` of the last global version it installed, ``-1`` before the first), and
  ``algorithm: dumb_diloco`` when its coordinator wrote it. No ``format`` key: this is what our
  master refused as ``format``;
* a worker reads ``global/step_count.json`` (``{"outer_step", "updated_at", "model_file", ...}``:
  ``HubClient.global_metadata``), installs a version only when its ``outer_step`` is above the
  one it has, and downloads the file ``model_file`` names (``download_global``);
* its master writes ``global/latest.safetensors`` (the full ``state_dict``, written by
  ``safetensors.save_file``, no metadata), *then* ``global/step_count.json`` naming it
  (``HubClient.publish_global``: "weights must exist before the metadata that advertises them"),
  as two separate uploads, and keeps the set of deltas it processed, and its momentum, in its
  own local folder only (``outer_state.pt``, a pickle). It never deletes a delta.

What this mode adds to the master (its core only delegates here):

* **Intake** (:meth:`SpeedtronicCompat.parse_header`): a delta whose header has no ``format`` is
  read as Speedtronic's and passes every check our own deltas pass (path identity, names,
  shapes, finite values, the norm bounds, staleness), plus: exactly the keys ``node_id``,
  ``local_step``, ``base_outer_step`` and optionally ``algorithm`` (which must then be
  ``dumb_diloco``); FP32 tensors only (Speedtronic never writes another dtype); a
  ``base_outer_step`` of ``-1`` (a worker that never installed a version) is refused as
  ``header``. Any other key or value, of any size, is a ``header`` rejection with a reason.
  Our own deltas (``format: diloco-delta/1``) are read as always: a run may mix both kinds of
  workers. Exactly-once is the ledger's, as for ours: a Speedtronic worker's ``local_step`` is
  its trainer step, increasing per node.
* **Publication** (:meth:`SpeedtronicCompat.mirrors`): with each version, the *mirrors*
  ``global/latest.safetensors`` (byte for byte our weights file of the version: a hard link on
  a folder, the same content, so no second upload, on the Hub, a copy on the store on S3) and
  ``global/step_count.json`` (``outer_step``, ``updated_at``, ``model_file``, ``algorithm``,
  ``optimizer``), in that order, after the manifest (``Hub.publish``'s ``mirrors``): renamed
  into place under the publication lock on a folder, in the same commit on ``hf://``, right
  after the manifest's conditional PUT on ``s3://``. ``model_file`` names our *versioned* weights
  file (``global/weights_<step>_<token>.safetensors``), which is never rewritten: a Speedtronic
  worker that reads ``step_count.json`` and then downloads ``model_file`` always gets the
  version it read, whatever is published between the two reads (with ``model_file`` naming
  ``latest.safetensors``, as Speedtronic's master writes it, the pair can mix versions).
  ``latest.safetensors`` is kept for anything that reads that fixed name.
* **Adoption** (:meth:`SpeedtronicCompat.adopt`): on a hub with no manifest of ours but a
  ``global/step_count.json``, the master takes the version it names as outer step N: its
  weights (the file ``model_file`` names, only a file directly under ``global/``; checked: a
  safetensors file, finite, and the model of the state this master was given, if any), with a
  fresh optimizer state (Speedtronic's momentum is in its master's local pickle, which is never
  loaded). It then publishes N as its own (manifest, ledger, mirrors) and owns the run: its
  lease keeps other masters of ours on standby. Speedtronic's own master does not know our
  lease: stop it before starting ours.

The adoption rule (which deltas Speedtronic already applied). Its processed set is local to
its master, so the hub does not say. But its master lists every delta at every poll and
publishes a new version after every poll that found one. So a delta whose
``base_outer_step >= N`` was made from the last version Speedtronic published and cannot have
been applied (a round applying it would have published N+1): it is applied by us. A delta
made from an older version (``base_outer_step < N``) was almost surely applied by one of
Speedtronic's rounds; the exception is one that arrived after Speedtronic's last poll (at most
the upload in flight of each worker when Speedtronic's master stopped), which the hub cannot
tell apart: it is counted as processed, never applied a second time (a lost inner phase costs
less than one applied twice; one staler than ``max_staleness`` or gated to zero would be
refused anyway). Per node, the ledger starts at the highest ``local_step`` of a *valid* delta
with ``base_outer_step < N`` (found by reading from the node's newest delta down, usually one
or two; a file that is not a valid delta of this model moves no ledger, as in every round), so a
node's later deltas, and all of a node that has only new ones, are applied. An adopted
``outer_step`` must leave room to run (at most ``names.MAX_ADOPTED_STEP``), else the version is
refused with that reason. The mirror this package's own master writes (``algorithm:
diloco_lightning``) is never adopted as Speedtronic's by a master with a state of its own: a
deleted manifest makes it publish its own version again, optimizer state and ledger included.
Deltas at or below the ledger are deleted with the adoption's publication (Speedtronic never
deleted any).

Limits. A signed run cannot use this mode (Speedtronic deltas and versions carry no
signature), nor ``weighting="tokens"`` (its deltas carry no token count); both are refused
when the master is built. A Speedtronic worker restarted without its checkpoint numbers its
deltas from its trainer step again: those at or below its node's ledger are refused as
``replay`` (Speedtronic's master keyed on ``(node, local_step, base_outer_step)`` and would
have taken them): give it a new ``node_id``. Speedtronic's master must be stopped before ours
starts (it neither reads our lease nor our manifest: both would publish). Complex parameters
cannot travel from a Speedtronic worker (it casts them to FP32, dropping the imaginary part;
refused as ``dtype``).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from diloco_lightning.wire.delta import (
    DeltaFileError,
    DeltaHeader,
    HeaderError,
    NodeIdError,
    max_header_bytes,
    model_fingerprint,
    parse_header as parse_own_header,
    read_delta,
    read_delta_header,
)
from diloco_lightning.hub.base import Hub, HubError, HubFileTooLargeError, HubNotFoundError
from diloco_lightning.wire.manifest import Manifest
from diloco_lightning.master.config import MasterConfigError
from diloco_lightning.master.weights import check_state
from diloco_lightning.wire.names import (
    LATEST_WEIGHTS_PATH,
    MAX_ADOPTED_STEP,
    MAX_STEP,
    STEP_COUNT_PATH,
    InvalidNameError,
    parse_local_step,
    validate_global_data_path,
    validate_node_id,
)
from diloco_lightning.util.jsondoc import load_json
from diloco_lightning.util.options import OptionError
from diloco_lightning.wire.statefile import StateFileError, load_weights_file
from diloco_lightning.wire.layout import LayoutError

if TYPE_CHECKING:  # pragma: no cover
    from diloco_lightning.master.runstate import RunState
    from diloco_lightning.master.validation import DeltaValidator

__all__ = [
    "SPEEDTRONIC",
    "SpeedtronicAdoptionError",
    "SpeedtronicCompat",
    "SpeedtronicVersion",
    "make_compat",
    "parse_speedtronic_header",
    "parse_step_count",
    "step_count_document",
]

log = logging.getLogger(__name__)

SPEEDTRONIC = "speedtronic"
#: the ``algorithm`` a Speedtronic 2.0 coordinator writes in its deltas' headers
SPEEDTRONIC_ALGORITHM = "dumb_diloco"
_HEADER_KEYS = ("node_id", "local_step", "base_outer_step")
_OPTIONAL_KEYS = ("algorithm",)
#: a ``step_count.json`` larger than this is not Speedtronic's (it writes about 200 bytes)
STEP_COUNT_MAX_BYTES = 64 << 10
_SHOWN = 40


def _show(text: str) -> str:
    """An untrusted header value, as much as a message needs of it."""
    return repr(text) if len(text) <= _SHOWN else f"{text[:20]!r}...({len(text)} characters)"


class SpeedtronicAdoptionError(HubError):
    """The hub holds a Speedtronic version this master cannot take (the message says why and what
    to do); the master publishes nothing over it and tries again next round."""


# ----------------------------------------------------------------------------- deltas


def parse_speedtronic_header(path: str | Path, md: Mapping[str, str] | None) -> DeltaHeader:
    """The header of a Speedtronic 2.0 delta, checked (see the module docstring); raises a
    :class:`~diloco_lightning.wire.delta.DeltaFileError` (``header``, ``node_id``) with a reason."""
    md = dict(md or {})
    for k in _HEADER_KEYS:
        if k not in md:
            raise HeaderError(path, f"header has no {k!r} (a Speedtronic delta has {list(_HEADER_KEYS)})")
    extra = sorted(set(md) - set(_HEADER_KEYS) - set(_OPTIONAL_KEYS))
    if extra:
        shown = [_show(k) for k in extra[:5]]
        raise HeaderError(
            path, f"unexpected header key(s) {', '.join(shown)}{' ...' if len(extra) > 5 else ''} for a Speedtronic delta "
            f"(it has {list(_HEADER_KEYS + _OPTIONAL_KEYS)}; a delta of ours has 'format')"
        )
    algorithm = md.get("algorithm")
    if algorithm is not None and algorithm != SPEEDTRONIC_ALGORITHM:
        raise HeaderError(path, f"header 'algorithm' is {_show(algorithm)}; a Speedtronic delta says {SPEEDTRONIC_ALGORITHM!r}")
    try:
        node_id = validate_node_id(md["node_id"])
    except InvalidNameError:
        raise NodeIdError(path, f"header 'node_id' {_show(md['node_id'])} is not a valid node id") from None
    try:
        local_step = parse_local_step(md["local_step"])
    except InvalidNameError as e:
        raise HeaderError(path, f"header 'local_step': {e}") from None
    if md["base_outer_step"] == "-1":
        raise HeaderError(
            path, "header 'base_outer_step' is -1: the Speedtronic worker had installed no global version "
            "(it could not read global/step_count.json when it started)"
        )
    try:
        base = parse_local_step(md["base_outer_step"])
    except InvalidNameError as e:
        raise HeaderError(path, f"header 'base_outer_step': {e}") from None
    extra_md = {"algorithm": algorithm} if algorithm is not None else {}
    return DeltaHeader(node_id, local_step, base, extra=extra_md, dtypes=(torch.float32,))


def parse_header(path: str | Path, md: Mapping[str, str] | None) -> DeltaHeader:
    """Ours when the header says ``format``, else Speedtronic's (both checked)."""
    if md and "format" in md:
        return parse_own_header(path, md)
    return parse_speedtronic_header(path, md)


# ----------------------------------------------------------------------------- step_count.json


#: the ``algorithm`` of the ``step_count.json`` this package's master writes (its own mirror)
OWN_ALGORITHM = "diloco_lightning"


@dataclass(frozen=True)
class SpeedtronicVersion:
    """What ``global/step_count.json`` says: the version and the file holding its weights;
    ``ours``: it is the mirror a master of this package wrote (``algorithm: diloco_lightning``)."""

    outer_step: int
    model_file: str
    updated_at: str = ""
    ours: bool = False


def parse_step_count(data: bytes, source: str) -> SpeedtronicVersion:
    """Parse and check a ``step_count.json`` (``SpeedtronicAdoptionError`` naming the problem)."""

    def bad(detail: str) -> SpeedtronicAdoptionError:
        return SpeedtronicAdoptionError(
            f"{source} is not a Speedtronic step_count.json this master can adopt: {detail}. Fix or remove it, or start "
            "the master on another hub"
        )

    try:
        doc = load_json(data, max_bytes=STEP_COUNT_MAX_BYTES, max_depth=8, what="the document")
    except ValueError as e:
        raise bad(str(e).removeprefix("the document: ")) from None
    if not isinstance(doc, dict):
        raise bad(f"a JSON {type(doc).__name__}, expected an object")
    step = doc.get("outer_step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        shown = _show(json.dumps(step)[:200]) if not isinstance(step, int) or isinstance(step, bool) else f"{step:.3g}"
        raise bad(f"'outer_step' is {shown}, expected an integer from 0 to {MAX_STEP}")
    if step > MAX_ADOPTED_STEP:
        raise bad(f"'outer_step' is {step}, which leaves fewer than {MAX_STEP - MAX_ADOPTED_STEP} versions to run before "
                  f"the largest one ({MAX_STEP}); no run gets there")
    model_file = doc.get("model_file", LATEST_WEIGHTS_PATH)
    if not isinstance(model_file, str):
        raise bad("'model_file' is not a string")
    try:
        validate_global_data_path(model_file)
    except InvalidNameError:
        raise bad(f"'model_file' {_show(model_file)} is not a file directly under global/") from None
    if model_file == STEP_COUNT_PATH:
        raise bad("'model_file' names step_count.json itself")
    updated = doc.get("updated_at")
    updated_at = updated[:64] if isinstance(updated, str) else ""
    return SpeedtronicVersion(step, model_file, updated_at, ours=doc.get("algorithm") == OWN_ALGORITHM)


def step_count_document(manifest: Manifest) -> bytes:
    """``global/step_count.json`` for the version ``manifest`` publishes, as Speedtronic writes
    it (``json.dumps(..., indent=2, sort_keys=True)``), naming the version's own weights file."""
    published = manifest.published_at
    ok = isinstance(published, (int, float)) and math.isfinite(published) and published > 0
    when = datetime.fromtimestamp(published, timezone.utc) if ok else datetime.now(timezone.utc)
    doc = {
        "outer_step": manifest.outer_step,
        "updated_at": when.isoformat(),
        "model_file": manifest.weights,
        "algorithm": OWN_ALGORITHM,
        "optimizer": str((manifest.optimizer or {}).get("name", "")),
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")


# ----------------------------------------------------------------------------- the mode


class SpeedtronicCompat:
    """``compat="speedtronic"`` for one master and its hub (see the module docstring)."""

    name = SPEEDTRONIC

    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    # the three places the master delegates to

    @staticmethod
    def parse_header(path: str | Path, md: Mapping[str, str] | None) -> DeltaHeader:
        return parse_header(path, md)

    def mirrors(self, manifest: Manifest, weights_file: str | Path) -> dict[str, str | Path | bytes]:
        """What a publication of ``manifest`` writes for Speedtronic's workers, in order: the
        weights (the staged file of the version), then the metadata that advertises them."""
        return {LATEST_WEIGHTS_PATH: weights_file, STEP_COUNT_PATH: step_count_document(manifest)}

    def read_version(self) -> SpeedtronicVersion | None:
        """The version ``global/step_count.json`` names, or None if the hub has none."""
        try:
            path = self.hub.download(STEP_COUNT_PATH, max_bytes=STEP_COUNT_MAX_BYTES)
        except HubNotFoundError:
            return None
        except HubFileTooLargeError as e:
            raise SpeedtronicAdoptionError(f"{self.hub.url}/{STEP_COUNT_PATH} is not Speedtronic's: {e}") from None
        try:
            data = Path(path).read_bytes()[: STEP_COUNT_MAX_BYTES + 1]
        finally:
            self.hub.release(path)
        return parse_step_count(data, f"{self.hub.url}/{STEP_COUNT_PATH}")

    def adopt(self, run: "RunState", validator: "DeltaValidator") -> bool:
        """Take the Speedtronic version on a hub without a manifest of ours (module docstring).
        False when there is none (or this master's own state is newer); raises
        :class:`SpeedtronicAdoptionError` when there is one it cannot take, ``MasterConfigError``
        when it is another model than the state this master was given."""
        version = self.read_version()
        if version is None:
            return False
        if run.state is not None and run.record is not None and (version.ours or run.outer_step >= version.outer_step):
            # our own mirror (the manifest that went with it is gone), or a version no newer than ours: never
            # adopted as Speedtronic's, which would reset the optimizer and rebuild the ledger from headers
            log.warning(
                "%s/%s says outer_step %d (%s); this master has its own outer_step %d (from %s): publishing ours",
                self.hub.url, STEP_COUNT_PATH, version.outer_step,
                "this package's own mirror, its manifest is gone" if version.ours else "not newer than this master's",
                run.outer_step, run.node_state_dir,
            )
            return False
        if version.ours:
            log.warning("%s/%s is the mirror of a master of this package whose manifest is gone, and this master has no "
                        "state of its own: adopting it as a Speedtronic version (fresh optimizer; deltas made from older "
                        "versions count as processed)", self.hub.url, STEP_COUNT_PATH)
        state = self._load_weights(run, version)
        fingerprint = model_fingerprint(state)
        ledger, new, old = self._ledger(version.outer_step, state, fingerprint, validator)
        run.set(state, run.build_optimizer(state), fingerprint=fingerprint, outer_step=version.outer_step, ledger=ledger,
                manifest=None)
        run.committed_outer_file = None
        run.hub_manifest = None
        log.info(
            "adopted Speedtronic's outer_step %d from %s (%s, updated_at %s; %d tensors). The outer optimizer %s starts "
            "with a fresh state: Speedtronic keeps its momentum in its master's local outer_state.pt (a pickle this master "
            "never loads). Deltas on the hub: %d new (made from version %d or later: to apply), %d counted as processed by "
            "Speedtronic's master (made from older versions); ledger of %d node(s): %s",
            version.outer_step, self.hub.url, version.model_file, version.updated_at or "?", len(state),
            run.config.outer_optimizer, new, version.outer_step, old, len(ledger), _short_ledger(ledger),
        )
        return True

    # helpers

    def _load_weights(self, run: "RunState", version: SpeedtronicVersion) -> dict[str, torch.Tensor]:
        where = f"{self.hub.url}/{version.model_file} (named by {STEP_COUNT_PATH}, outer_step {version.outer_step})"
        max_bytes = None
        if run.state is not None:  # the honest size of a full state of this model, generously (8 bytes per value)
            max_bytes = 8 + max_header_bytes(len(run.state)) + sum(8 * t.numel() for t in run.state.values())
        try:
            path = self.hub.download(version.model_file, max_bytes=max_bytes)
        except HubNotFoundError:
            raise SpeedtronicAdoptionError(f"{where} does not exist; waiting for Speedtronic's weights") from None
        except HubFileTooLargeError as e:
            raise SpeedtronicAdoptionError(f"cannot adopt {where}: {e}") from None
        try:
            state, _ = load_weights_file(path)
            state = dict(check_state(state, where))
        except (StateFileError, LayoutError, OSError, ValueError) as e:
            raise SpeedtronicAdoptionError(f"cannot adopt {where}: {e}") from None
        finally:
            self.hub.release(path)
        for k in sorted(state):
            t = state[k]
            if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
                raise SpeedtronicAdoptionError(f"cannot adopt {where}: key {k!r} holds NaN or inf")
        if run.user_fingerprint is not None and model_fingerprint(state) != run.user_fingerprint:
            given = {k: (tuple(v.shape), str(v.dtype)) for k, v in (run.state or {}).items() if v.is_floating_point() or v.is_complex()}
            found = {k: (tuple(v.shape), str(v.dtype)) for k, v in state.items() if v.is_floating_point() or v.is_complex()}
            diff = sorted(set(given.items()) ^ set(found.items()))[:3]
            raise MasterConfigError(
                f"{where} holds another model than the state this master was given (first differences: {diff}); start "
                "the master with that model's state, or without one"
            )
        return state

    def _ledger(self, outer_step: int, state: Mapping[str, torch.Tensor], fingerprint: str,
                validator: "DeltaValidator") -> tuple[dict[str, int], int, int]:
        """``(ledger, new, processed)``: per node, the highest ``local_step`` of a *valid* delta made from
        a version before ``outer_step`` (module docstring), read from the newest delta down. Only a delta
        that passes the reader's every check (layout, header, its path, this model's keys, shapes and
        dtypes, finite values) moves a ledger, as in every round: a garbage file named as a node's
        ``delta_<10**17>`` cannot hide that node's later work."""
        max_bytes, max_header = validator.size_limits(state, fingerprint)
        by_node: dict[str, list[Any]] = {}
        for ref in self.hub.list_deltas():
            by_node.setdefault(ref.node_id, []).append(ref)
        ledger: dict[str, int] = {}
        new = old = 0
        for node in sorted(by_node):
            refs = sorted(by_node[node], key=lambda r: r.local_step, reverse=True)
            for i, ref in enumerate(refs):
                base, path = self._base_of(ref, max_bytes, max_header, state, fingerprint, validator)
                if base is not None and base < outer_step:
                    if path is not None:
                        self.hub.release(path)
                    ledger[node] = ref.local_step
                    old += len(refs) - i
                    break
                if base is None:
                    if path is not None:
                        self.hub.release(path)  # judged like any other delta when its turn comes
                else:
                    new += 1  # kept: the round reads it next (a remote hub's cached copy is reused)
        return ledger, new, old

    def _base_of(self, ref: Any, max_bytes: int, max_header: int, state: Mapping[str, torch.Tensor], fingerprint: str,
                 validator: "DeltaValidator") -> tuple[int | None, Path | None]:
        """``(base_outer_step, local copy)`` of a delta, the step None when it is not a valid delta of
        this model (unreadable, malformed, naming another delta than its path, other keys or shapes,
        non-finite values: it is judged like any other when its turn comes, and moves no ledger)."""
        try:
            path = self.hub.download(ref.path, max_bytes=max_bytes)
        except HubError as e:
            log.info("adoption: %s not read (%s)", ref.path, e)
            return None, None
        try:
            header = read_delta_header(path, max_header=max_header, header_parser=parse_header)
            if header.node_id != ref.node_id or header.local_step != ref.local_step:
                return None, path
            read_delta(path, reference=state, hub_path=ref.path, expected_fingerprint=fingerprint,
                       max_file_bytes=max_bytes, header_parser=parse_header, copy=not validator.private_downloads)
        except DeltaFileError as e:
            log.info("adoption: %s is not a valid delta (%s); it moves no ledger", ref.path, e)
            return None, path
        return header.base_outer_step, path


def _short_ledger(ledger: Mapping[str, int], n: int = 8) -> str:
    items = [f"{k}<={v}" for k, v in sorted(ledger.items())]
    return ", ".join(items[:n]) + (f" ... ({len(items)} in all)" if len(items) > n else "") if items else "empty"


def make_compat(mode: str | None, hub: Hub, signing_key: Any) -> SpeedtronicCompat | None:
    """The compatibility mode ``mode`` (``MasterConfig.compat``) for a master on ``hub``, or None."""
    if mode is None:
        return None
    if mode != SPEEDTRONIC:
        raise OptionError("compat", f"must be null or {SPEEDTRONIC!r}, got {mode!r}")
    if signing_key is not None:
        raise OptionError(
            "compat",
            "cannot be used in a signed run: Speedtronic's deltas and versions carry no signature. Unset DILOCO_RUN_KEY / "
            "DILOCO_RUN_KEY_FILE for this run, or drop compat=speedtronic",
        )
    return SpeedtronicCompat(hub)
