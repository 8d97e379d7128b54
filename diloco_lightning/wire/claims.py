"""A node's claim on its id: ``nodes/<node_id>/claim.json``.

Two workers started with the same ``node_id`` would write into one ledger entry and the
master would merge them into one node. So a worker claims its id on the hub when it
starts (compare-and-swap: ``Hub.write_claim``), renews the claim's heartbeat while it
lives, and releases it on a clean close; a second live claimant refuses to start, and a
dead one's claim expires ``ttl`` seconds after its last heartbeat
(:class:`diloco_lightning.worker.claim.ClaimKeeper`).

```json
{
  "format": "diloco-claim/1",
  "node_id": "w3",
  "holder": "host:pid:random",
  "epoch": 2,
  "claimed_at": 1764430000.0,
  "renewed_at": 1764430450.0,
  "expires_at": 1764431350.0,
  "info": {},
  "signature": "<hex HMAC-SHA256, signed runs only>"
}
```

``epoch`` grows at each takeover. ``info`` is what a live node reports about itself with
each heartbeat (:class:`NodeReport`: its step rate, tokens per second, last local step and
inner steps H, read by the master's membership and by the workers' Dynamic Local Updates);
readers ignore keys they do not know, so the document can grow without a new format.
A claim file is untrusted input like every hub byte: at most :data:`MAX_CLAIM_BYTES`,
strict types, and its ``node_id`` must be the path's; every value of ``info`` is checked
against a bound (:meth:`NodeReport.from_info`) and a value out of bounds is dropped, never
used. In a signed run the worker signs its claim with the run key (``diloco-doc-sig/1``, kind
``claim``: :mod:`diloco_lightning.wire.signing`) and every reader ignores a claim that is not
signed with it, as a malformed one.

What a claim says about time is bounded by the reader, never believed as written
(:meth:`NodeClaim.dead_reason`): a claim lives at most :data:`MAX_CLAIM_TTL` after its
``renewed_at``, and one renewed more than :data:`MAX_CLOCK_SKEW` in the reader's future is not a
heartbeat, so no expiry (``1e300``) can block a node id for ever. The master's own bounds (how
long a silent node stays in the quorum, the longest wait of a round) come from its configuration
(``master/membership.py``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from diloco_lightning.util.errors import DiLoCoError
from diloco_lightning.util.jsondoc import load_json
from diloco_lightning.wire.names import InvalidNameError, validate_node_id

__all__ = ["NodeClaim", "NodeReport", "ClaimError", "CLAIM_FORMAT", "MAX_CLAIM_BYTES", "REPORT_BOUNDS",
           "MAX_CLAIM_TTL", "MAX_CLOCK_SKEW", "FILE_HUB_TTL", "REMOTE_HUB_TTL", "default_claim_ttl"]

CLAIM_FORMAT = "diloco-claim/1"
MAX_CLAIM_BYTES = 64 * 1024
#: the longest a claim lives after its last heartbeat, whatever its ``expires_at`` says
MAX_CLAIM_TTL = 86400.0
#: a heartbeat dated further than this in the reader's future is not one (clocks of one run agree within it)
MAX_CLOCK_SKEW = 600.0
#: a claim's ttl by default: 60 s on a folder hub (a renewal is a small file write), 15 min elsewhere
#: (a renewal is a commit on ``hf://``, a request on ``s3://``)
FILE_HUB_TTL = 60.0
REMOTE_HUB_TTL = 900.0


def default_claim_ttl(hub: Any) -> float:
    """The default claim ttl on ``hub`` (a Hub or a URL): :data:`FILE_HUB_TTL` on a folder hub,
    :data:`REMOTE_HUB_TTL` elsewhere. Also the master's default bound on how long a silent node
    stays live."""
    url = str(getattr(hub, "url", hub))
    return FILE_HUB_TTL if url.startswith("file:") else REMOTE_HUB_TTL


#: what a heartbeat may report, and the largest value believed: an inner step faster than a
#: microsecond, 10**13 tokens a second (a million times a large GPU), a local step of more than
#: 18 digits (the delta header's own bound), an H above 10**9 or a training loss above 10**6 is
#: not a measurement but a bug or a lie, and is dropped
REPORT_BOUNDS: dict[str, tuple[type, float]] = {
    "step_rate": (float, 1e6),
    "tokens_per_second": (float, 1e13),
    "local_step": (int, 10**18 - 1),
    "inner_steps": (int, 10**9),
    "train_loss": (float, 1e6),
    "replayed": (int, 10**9),
}


class ClaimError(DiLoCoError, ValueError):
    """A claim document that is malformed, too large, or for another node."""


@dataclass(frozen=True)
class NodeClaim:
    """``holder`` owns ``node_id`` until ``expires_at`` (unix seconds) unless it renews."""

    node_id: str
    holder: str
    epoch: int
    claimed_at: float
    renewed_at: float
    expires_at: float
    info: dict[str, Any] = field(default_factory=dict)
    #: the run key's signature over every other entry (signed runs only)
    signature: str | None = None

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at

    def dead_reason(self, now: float | None = None) -> str | None:
        """Why this claim no longer holds its id at ``now`` (None: it is live): expired, silent for
        longer than :data:`MAX_CLAIM_TTL`, or renewed further than :data:`MAX_CLOCK_SKEW` in the
        future. The bounds are the reader's: an expiry of ``1e300`` blocks an id for a day at most."""
        now = time.time() if now is None else now
        if now >= self.expires_at:
            return "expired"
        if self.renewed_at > now + MAX_CLOCK_SKEW:
            return f"its heartbeat is dated {self.renewed_at - now:.3g} s in the future"
        if now >= self.renewed_at + MAX_CLAIM_TTL:
            return f"no heartbeat for more than {MAX_CLAIM_TTL:g} s (whatever its expiry says)"
        return None

    def to_doc(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["format"] = CLAIM_FORMAT
        if doc["signature"] is None:
            del doc["signature"]
        return doc

    def signed(self, key: Any) -> "NodeClaim":
        """A copy carrying the run key's (a :class:`~diloco_lightning.wire.signing.RunKey`) signature."""
        unsigned = replace(self, signature=None)
        return replace(unsigned, signature=key.sign_document("claim", unsigned.to_doc()))

    def verify(self, key: Any) -> bool:
        """Whether the signature is the run key's over this claim."""
        return key.verify_document("claim", self.to_doc())

    def to_json(self) -> str:
        doc = self.to_doc()
        try:
            text = json.dumps(doc, sort_keys=True, allow_nan=False) + "\n"
        except (TypeError, ValueError) as e:
            raise ClaimError(f"claim of {self.node_id!r} is not JSON-serialisable: {e}") from None
        if len(text.encode()) > MAX_CLAIM_BYTES:
            raise ClaimError(f"claim of {self.node_id!r} exceeds {MAX_CLAIM_BYTES} bytes")
        return text

    @classmethod
    def from_json(cls, data: str | bytes, *, node_id: str, source: str = "claim") -> "NodeClaim":
        """Parse and check a claim read from ``nodes/<node_id>/claim.json``."""
        try:
            doc = load_json(data, max_bytes=MAX_CLAIM_BYTES, max_depth=8, what=source)
        except ValueError as e:
            raise ClaimError(str(e)) from None
        if not isinstance(doc, dict) or doc.get("format") != CLAIM_FORMAT:
            raise ClaimError(f"{source}: not a {CLAIM_FORMAT} document")
        try:
            validate_node_id(doc.get("node_id"))
        except InvalidNameError as e:
            raise ClaimError(f"{source}: {e}") from None
        if doc["node_id"] != node_id:
            raise ClaimError(f"{source}: claims node {doc['node_id']!r}, but it is {node_id!r}'s file")
        holder = doc.get("holder")
        if not isinstance(holder, str) or not 0 < len(holder) <= 256:
            raise ClaimError(f"{source}: 'holder' must be a string of 1 to 256 characters")
        epoch = doc.get("epoch")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ClaimError(f"{source}: 'epoch' must be a non-negative integer, got {epoch!r}")
        times = [doc.get(k) for k in ("claimed_at", "renewed_at", "expires_at")]
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in times):
            raise ClaimError(f"{source}: 'claimed_at', 'renewed_at', 'expires_at' must be numbers")
        info = doc.get("info", {})
        if not isinstance(info, dict):
            raise ClaimError(f"{source}: 'info' must be an object")
        signature = doc.get("signature")
        if signature is not None and not isinstance(signature, str):
            raise ClaimError(f"{source}: 'signature' must be a string")
        claimed, renewed, expires = (float(t) for t in times)  # type: ignore[arg-type]  # checked finite numbers above
        return cls(doc["node_id"], holder, epoch, claimed, renewed, expires, info, signature)


@dataclass(frozen=True)
class NodeReport:
    """What a worker says about itself in its heartbeat (the claim's ``info``).

    ``step_rate``: inner optimizer steps per second of compute (waits for the master and the
    boundaries themselves left out); ``tokens_per_second``: tokens trained on per second of
    compute; ``local_step``: its last delta's ``local_step``; ``inner_steps``: the H it uses now;
    ``train_loss``: the mean training loss of its last inner phase (the master watches it for
    divergence, :mod:`diloco_lightning.master.health`); ``finished``: true in the claim a worker
    leaves when its training ended (its last delta's ``local_step`` beside it); ``replayed``: inner
    phases it trained and did not send because the hub already had them (after a restart from a
    checkpoint older than its last delta: replays of delivered work, dropped so that nothing is applied
    twice; the master reports them per node). Any may be None (not measured yet).
    Untrusted on the reading side: see :meth:`from_info`.
    """

    step_rate: float | None = None
    tokens_per_second: float | None = None
    local_step: int | None = None
    inner_steps: int | None = None
    train_loss: float | None = None
    #: the worker ended its training and every delta it exported is on the hub (its last one is
    #: ``local_step``): written once, in the claim it leaves behind (``ClaimKeeper.finish``)
    finished: bool | None = None
    replayed: int | None = None

    def to_info(self) -> dict[str, Any]:
        """The heartbeat's ``info`` object (keys of None values left out)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_info(cls, info: Any) -> tuple["NodeReport", list[str]]:
        """``(report, problems)`` from a claim's ``info``: each known key must be a finite number of
        its kind (an integer for ``local_step`` and ``inner_steps``, ``inner_steps`` at least 1),
        not negative and at most its :data:`REPORT_BOUNDS` bound; a value that is not is left out
        of the report (None) and named in ``problems``. Unknown keys are ignored."""
        if not isinstance(info, Mapping):
            return cls(), [f"info is a {type(info).__name__}, not an object"]
        values: dict[str, Any] = {}
        problems: list[str] = []
        for key, (kind, bound) in REPORT_BOUNDS.items():
            v = info.get(key)
            if v is None:
                continue
            low = 1 if key == "inner_steps" else 0
            ok = (
                not isinstance(v, bool)
                and (isinstance(v, int) if kind is int else isinstance(v, (int, float)))
                and math.isfinite(v)
                and low <= v <= bound
            )
            if ok:
                values[key] = kind(v)
            else:
                problems.append(f"{key}={str(v)[:40]!r} is not {'an integer' if kind is int else 'a number'} "
                                f"in [{low}, {bound:g}]")
        v = info.get("finished")
        if isinstance(v, bool):
            values["finished"] = v
        elif v is not None:
            problems.append(f"finished={str(v)[:40]!r} is not true or false")
        return cls(**values), problems
