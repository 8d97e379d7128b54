"""The global manifest (``global/manifest.json``) and the master lease (``global/lease.json``).

The manifest is the single source of truth for what the master has published:

```json
{
  "format": "diloco-manifest/1",
  "outer_step": 12,
  "weights": "global/weights_000000012_1a2b3c4d.safetensors",
  "weights_sha256": "<hex>",
  "model_fingerprint": "<hex>",
  "outer_state": "global/outer_state_000000012_1a2b3c4d.safetensors",
  "outer_state_sha256": "<hex>",
  "optimizer": {"name": "cgad", "options": {"lr": 0.7, "alpha": 0.2, "tau_cut": 32}},
  "ledger": {"worker-0": 37, "worker-1": 35},
  "history": [{"outer_step": 11, "weights": "...", "outer_state": "...",
               "weights_sha256": "<hex or null>", "outer_state_sha256": "<hex or null>"}],
  "master": {"holder": "host:pid:uuid", "epoch": 3, "delta_scales": {"worker-0": 0.5, "worker-1": 0.5}},
  "published_at": 1764430000.0,
  "fragments": [{"name": "0", "keys_sha256": "<hex>", "outer_step": 6, "updated_at": 11}, ...],
  "signature": "<hex HMAC-SHA256, signed runs only>"
}
```

In a signed run the master signs the manifest (``diloco_lightning.wire.signing``, scheme
``diloco-doc-sig/1``): the signature covers every entry, and through the SHA-256 digests
the weights and optimizer state of the current and every kept older version. Readers
holding the run key refuse an unsigned or badly signed manifest (:meth:`Manifest.verify`).

``ledger`` is the per-node high-water mark of *accepted* deltas: every delta
``nodes/<n>/delta_<s>`` with ``s <= ledger[n]`` is done with and never read again. Only a
delta that passed every check (its signature too, in a signed run) moves it, so a file
any hub writer drops under another node's name can never hide that node's work.
``history`` lists the older versions still kept on the hub (``keep_globals``).
``master.delta_scales`` (optional; a master whose outer step is a fixed multiple of each delta, a
momentum-free SGD such as fedavg or staleness_sgd, writes it): per node, the factor its last applied
delta entered the global with (``state -= scale * delta``: ``lr * gate(tau) * w / sum(w)`` for a round
of weighted deltas). An async worker that rebases onto its own deltas (``WorkerOptions.rebase``)
reads it; it sits inside ``master`` so that a reader that does not know it keeps it as it was signed.
Each value is checked: a finite number from 0 to :data:`MAX_DELTA_SCALE`.
``fragments`` (only in a run with fragments, :mod:`diloco_lightning.wire.fragments`): per fragment,
the digest of its key names, how many outer steps updated it, and the version that last did.
Every path a manifest names is checked to be a file directly under ``global/`` (and
not ``global/manifest.json`` or ``global/lease.json``): nothing read from the hub is
followed blindly. Both documents are parsed with bounds on size and depth
(:func:`~diloco_lightning.util.jsondoc.load_json`): a malformed one, of any size or nesting, is a
``ManifestError``, never another exception. ``Manifest.from_json`` is the only way a manifest is read, and
``Manifest.validate()`` applies the same checks to one built in code before it is
published.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from diloco_lightning.util.errors import DiLoCoError
from diloco_lightning.util.jsondoc import load_json
from diloco_lightning.wire.names import MAX_STEP, InvalidNameError, validate_global_data_path, validate_node_id

if TYPE_CHECKING:  # pragma: no cover
    from diloco_lightning.wire.signing import RunKey

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "diloco-manifest/1"
LEASE_FORMAT = "diloco-lease/1"
#: the largest manifest read (a ledger of 100,000 nodes is ~3 MB) and lease (~300 bytes)
MAX_MANIFEST_BYTES = 16 << 20
MAX_LEASE_BYTES = 64 << 10
#: the largest ``master.delta_scales`` value accepted (lr * gate * share: an outer lr above it is not a DiLoCo run)
MAX_DELTA_SCALE = 100.0


class ManifestError(DiLoCoError, ValueError):
    """A manifest or lease document that is malformed or names a forbidden path."""


def _int(doc: dict, key: str, where: str) -> int:
    v = doc.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_STEP:
        shown = repr(v) if not isinstance(v, (int, str)) or len(str(v)) <= 40 else f"{str(v)[:20]}... ({len(str(v))} characters)"
        raise ManifestError(f"{where}: {key!r} must be an integer from 0 to {MAX_STEP}, got {shown}")
    return v


def _sha(doc: dict, key: str, where: str) -> str:
    v = doc.get(key)
    if not isinstance(v, str) or len(v) != 64 or any(c not in "0123456789abcdef" for c in v):
        raise ManifestError(f"{where}: {key!r} must be a SHA-256 hex digest, got {v!r}")
    return v


def _gpath(doc: dict, key: str, where: str) -> str:
    try:
        return validate_global_data_path(doc.get(key))
    except InvalidNameError as e:
        raise ManifestError(f"{where}: {key!r}: {e}") from None


def _sha_or_none(doc: dict, key: str, where: str) -> str | None:
    return None if doc.get(key) is None else _sha(doc, key, where)


def _gpath_or_none(doc: dict, key: str, where: str) -> str | None:
    return None if doc.get(key) is None else _gpath(doc, key, where)


def _steps_or_none(doc: dict, key: str, where: str) -> list[int] | None:
    raw = doc.get(key)
    if raw is None:
        return None
    if not isinstance(raw, list) or not 2 <= len(raw) <= 4096:
        raise ManifestError(f"{where}: {key!r} must be a list of 2 to 4096 integers")
    return [_int({"n": v}, "n", f"{where}: {key}") for v in raw]


def _fragments(doc: dict, source: str) -> list[dict[str, Any]] | None:
    raw = doc.get("fragments")
    if raw is None:
        return None
    if not isinstance(raw, list) or not 2 <= len(raw) <= 4096:
        raise ManifestError(f"{source}: 'fragments' must be a list of 2 to 4096 objects")
    out: list[dict[str, Any]] = []
    ahead: list[int] = []  # per fragment: the higher of its outer_step and updated_at (ints, checked by _int)
    for i, f in enumerate(raw):
        where = f"{source}: fragments[{i}]"
        if not isinstance(f, dict) or f.get("name") != str(i):
            raise ManifestError(f"{where} must be an object named {str(i)!r}")
        step, updated = _int(f, "outer_step", where), _int(f, "updated_at", where)
        out.append({"name": str(i), "keys_sha256": _sha(f, "keys_sha256", where),
                    "outer_step": step, "updated_at": updated})
        ahead.append(max(step, updated))
    outer = doc.get("outer_step")
    for f, high in zip(out, ahead):
        if isinstance(outer, int) and high > outer:
            raise ManifestError(f"{source}: fragment {f['name']} is ahead of outer_step {outer}")
    return out


def _delta_scales(master: dict, source: str) -> None:
    """Check ``master.delta_scales`` (module docstring) in place: an object of node id -> a finite
    number in ``[0, MAX_DELTA_SCALE]``; absent is fine."""
    raw = master.get("delta_scales")
    if raw is None:
        return
    where = f"{source}: master.delta_scales"
    if not isinstance(raw, dict):
        raise ManifestError(f"{where} must be an object of node id -> number")
    for node, v in raw.items():
        try:
            validate_node_id(node)
        except InvalidNameError as e:
            raise ManifestError(f"{where}: {e}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0.0 <= v <= MAX_DELTA_SCALE:
            raise ManifestError(f"{where}: {node!r} must be a finite number from 0 to {MAX_DELTA_SCALE:g}, got {v!r}")


def parse_fragments(raw: Any, outer_step: int, source: str) -> list[dict[str, Any]] | None:
    """A ``fragments`` list as a manifest holds it (per fragment: name, keys_sha256, outer_step,
    updated_at), checked as a manifest's is, for a version at ``outer_step``; :class:`ManifestError`
    otherwise. A master's ``state_dict`` carries the same list."""
    return _fragments({"fragments": raw, "outer_step": outer_step}, source)


@dataclass(frozen=True)
class GlobalVersion:
    """An older published version still kept on the hub."""

    outer_step: int
    weights: str
    outer_state: str | None = None
    #: optional digests (a master that records them lets readers verify old versions too)
    weights_sha256: str | None = None
    outer_state_sha256: str | None = None
    #: runs with fragments: each fragment's outer step count at this version (absent otherwise)
    fragment_steps: list[int] | None = None


@dataclass
class Manifest:
    """One published global version. See the module docstring for the JSON form."""

    outer_step: int
    weights: str
    weights_sha256: str
    model_fingerprint: str
    ledger: dict[str, int] = field(default_factory=dict)
    outer_state: str | None = None
    outer_state_sha256: str | None = None
    optimizer: dict[str, Any] = field(default_factory=dict)
    history: list[GlobalVersion] = field(default_factory=list)
    master: dict[str, Any] = field(default_factory=dict)
    published_at: float = 0.0
    signature: str | None = None
    #: per fragment (runs with ``fragments``; absent otherwise): ``{"name", "keys_sha256",
    #: "outer_step" (the outer steps that updated it), "updated_at" (the version that last did)}``
    fragments: list[dict[str, Any]] | None = None

    def files(self) -> list[str]:
        """Every hub path this manifest keeps alive (current and history)."""
        out = [self.weights] + ([self.outer_state] if self.outer_state else [])
        for v in self.history:
            out.append(v.weights)
            if v.outer_state:
                out.append(v.outer_state)
        return out

    def to_doc(self) -> dict[str, Any]:
        """The JSON document (the ``signature`` entry only when there is one)."""
        doc = asdict(self)
        doc["format"] = MANIFEST_FORMAT
        if doc["signature"] is None:
            del doc["signature"]
        if doc["fragments"] is None:  # a run without fragments: no fragments entry (the unfragmented manifest)
            del doc["fragments"]
        for h in doc["history"]:
            if h.get("fragment_steps") is None:
                h.pop("fragment_steps", None)
        return doc

    def fragment_steps_at(self, outer_step: int) -> dict[str, int] | None:
        """Each fragment's outer step count at version ``outer_step`` (this one or a kept older one);
        None when the manifest does not say (no fragments, or an older version it has no count of)."""
        if outer_step == self.outer_step:
            return None if self.fragments is None else {f["name"]: f["outer_step"] for f in self.fragments}
        for v in self.history:
            if v.outer_step == outer_step and v.fragment_steps is not None:
                return {str(i): n for i, n in enumerate(v.fragment_steps)}
        return None

    def fragment(self, name: str) -> dict[str, Any] | None:
        """The entry of fragment ``name`` (None: no such fragment, or a run without fragments)."""
        for f in self.fragments or []:
            if f["name"] == name:
                return f
        return None

    def delta_scale(self, node_id: str) -> float | None:
        """The factor node ``node_id``'s last applied delta entered the global with
        (``master.delta_scales``, checked when parsed), None when the master does not say."""
        v = (self.master.get("delta_scales") or {}).get(node_id)
        return None if v is None else float(v)

    def signed(self, key: "RunKey") -> "Manifest":
        """A copy carrying the run key's signature over every other entry."""
        unsigned = replace(self, signature=None)
        return replace(unsigned, signature=key.sign_document("manifest", unsigned.to_doc()))

    def verify(self, key: "RunKey") -> bool:
        """Whether the signature is the run key's over this manifest."""
        return key.verify_document("manifest", self.to_doc())

    def to_json(self) -> str:
        doc = self.to_doc()
        try:
            return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n"
        except (TypeError, ValueError) as e:
            raise ManifestError(f"manifest of outer_step {self.outer_step!r} is not JSON-serialisable: {e}") from None

    def validate(self, source: str = "manifest") -> "Manifest":
        """Raise ``ManifestError`` unless this manifest passes the checks of :meth:`from_json`
        (paths under ``global/``, hex digests, valid ledger ...); returns ``self``."""
        Manifest.from_json(self.to_json(), source=source)
        return self

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "manifest") -> "Manifest":
        try:
            doc = load_json(text, max_bytes=MAX_MANIFEST_BYTES, what=source)
        except ValueError as e:
            raise ManifestError(str(e)) from None
        if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ManifestError(f"{source}: format is {got!r}, expected {MANIFEST_FORMAT!r}")
        ledger_doc = doc.get("ledger") or {}
        if not isinstance(ledger_doc, dict):
            raise ManifestError(f"{source}: 'ledger' must be an object")
        ledger = {}
        for node in ledger_doc:
            try:
                validate_node_id(node)
            except InvalidNameError as e:
                raise ManifestError(f"{source}: ledger: {e}") from None
            ledger[node] = _int(ledger_doc, node, f"{source}: ledger")
        history = []
        for i, h in enumerate(doc.get("history") or []):
            if not isinstance(h, dict):
                raise ManifestError(f"{source}: history[{i}] must be an object")
            where = f"{source}: history[{i}]"
            if h.get("outer_state") is None and h.get("outer_state_sha256") is not None:
                raise ManifestError(f"{where}: 'outer_state_sha256' given without 'outer_state'")
            history.append(
                GlobalVersion(
                    _int(h, "outer_step", where),
                    _gpath(h, "weights", where),
                    _gpath_or_none(h, "outer_state", where),
                    _sha_or_none(h, "weights_sha256", where),
                    _sha_or_none(h, "outer_state_sha256", where),
                    _steps_or_none(h, "fragment_steps", where),
                )
            )
        optimizer = doc.get("optimizer") or {}
        master = doc.get("master") or {}
        if not isinstance(optimizer, dict) or not isinstance(master, dict):
            raise ManifestError(f"{source}: 'optimizer' and 'master' must be objects")
        _delta_scales(master, source)
        published_at = doc.get("published_at", 0.0)
        if not isinstance(published_at, (int, float)) or not math.isfinite(published_at):
            raise ManifestError(f"{source}: 'published_at' must be a number")
        fp = _sha(doc, "model_fingerprint", source)
        if doc.get("outer_state") is None and doc.get("outer_state_sha256") is not None:
            raise ManifestError(f"{source}: 'outer_state_sha256' given without 'outer_state'")
        signature = doc.get("signature")
        if signature is not None and not isinstance(signature, str):
            raise ManifestError(f"{source}: 'signature' must be a string")
        fragments = _fragments(doc, source)
        return cls(
            fragments=fragments,
            outer_step=_int(doc, "outer_step", source),
            weights=_gpath(doc, "weights", source),
            weights_sha256=_sha(doc, "weights_sha256", source),
            model_fingerprint=fp,
            ledger=ledger,
            outer_state=_gpath_or_none(doc, "outer_state", source),
            outer_state_sha256=_sha_or_none(doc, "outer_state_sha256", source),
            optimizer=optimizer,
            history=history,
            master=master,
            published_at=float(published_at),
            signature=signature,
        )


@dataclass(frozen=True)
class Lease:
    """Who may publish: ``holder`` until ``expires_at`` (unix seconds). ``epoch`` grows at each takeover.

    ``unreadable`` is set (to the SHA-256 of the bytes) on the stand-in :meth:`from_hub_bytes`
    returns for a lease file that is not a lease: expired, so a master takes it over by
    compare-and-swap instead of being stopped by it. ``signature``: signed runs.
    """

    holder: str
    epoch: int
    expires_at: float
    renewed_at: float = 0.0
    signature: str | None = None
    unreadable: str | None = None

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at

    def to_doc(self) -> dict[str, Any]:
        if self.unreadable is not None:
            raise ManifestError("an unreadable lease cannot be written")
        doc = asdict(self)
        del doc["unreadable"]
        doc["format"] = LEASE_FORMAT
        if doc["signature"] is None:
            del doc["signature"]
        return doc

    def to_json(self) -> str:
        return json.dumps(self.to_doc(), sort_keys=True) + "\n"

    def signed(self, key: "RunKey") -> "Lease":
        unsigned = replace(self, signature=None)
        return replace(unsigned, signature=key.sign_document("lease", unsigned.to_doc()))

    def verify(self, key: "RunKey") -> bool:
        return self.unreadable is None and key.verify_document("lease", self.to_doc())

    @classmethod
    def from_hub_bytes(cls, data: bytes, source: str = "lease") -> "Lease":
        """:meth:`from_json` for bytes read from a hub: a malformed file (anyone may write one)
        becomes an expired stand-in naming its digest, never an error that stops a master."""
        try:
            return cls.from_json(data, source)
        except ManifestError as e:
            return cls.unreadable_stand_in(data, source, str(e))

    @classmethod
    def unreadable_stand_in(cls, data: bytes, source: str, reason: str) -> "Lease":
        """The expired stand-in for the lease file ``data`` (what a transport read of it: a file over
        its size may be read only in part, or not at all), with a warning naming it and ``reason``."""
        log.warning("%s is not a valid lease (%s); treating it as expired", source, reason)
        return cls("", 0, 0.0, unreadable=hashlib.sha256(data).hexdigest())

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "lease") -> "Lease":
        try:
            doc = load_json(text, max_bytes=MAX_LEASE_BYTES, what=source)
        except ValueError as e:
            raise ManifestError(str(e)) from None
        if not isinstance(doc, dict) or doc.get("format") != LEASE_FORMAT:
            raise ManifestError(f"{source}: not a {LEASE_FORMAT} document")
        holder = doc.get("holder")
        if not isinstance(holder, str) or not holder:
            raise ManifestError(f"{source}: 'holder' must be a non-empty string")
        exp, ren = doc.get("expires_at"), doc.get("renewed_at", 0.0)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in (exp, ren)):
            raise ManifestError(f"{source}: 'expires_at'/'renewed_at' must be numbers")
        signature = doc.get("signature")
        if signature is not None and not isinstance(signature, str):
            raise ManifestError(f"{source}: 'signature' must be a string")
        return cls(holder, _int(doc, "epoch", source), float(exp), float(ren), signature)  # type: ignore[arg-type]
