"""Node claims on S3 (:class:`~diloco_lightning.hub.s3.S3Hub`'s ``claims``): ``nodes/<node_id>/claim.json``,
replaced by a conditional PUT on the ETag read (``If-Match``, or ``If-None-Match: *`` when there is none);
a released claim is an empty object, as a removed lease. Listed with one listing of ``nodes/``
(:class:`~diloco_lightning.hub.claims.ClaimPoll`)."""

from __future__ import annotations

from collections.abc import Callable

from diloco_lightning.hub.base import ClaimConflictError
from diloco_lightning.hub.claims import ClaimPoll, NodeClaims
from diloco_lightning.hub.s3_store import S3Store, TooLarge
from diloco_lightning.util.warnonce import WarnOnce
from diloco_lightning.wire.claims import ClaimError, NodeClaim
from diloco_lightning.wire.names import NODES_DIR, claim_path

__all__ = ["S3Claims"]


class S3Claims(NodeClaims):
    """The claims under ``store``; ``before_write()`` runs before any write (the hub's conditional-write
    probe); ``warned``: the hub's bounded warnings (a claim's content is any writer's)."""

    def __init__(self, store: S3Store, warned: WarnOnce, before_write: Callable[[], None]) -> None:
        self.store, self.warned, self.before_write = store, warned, before_write
        self.poll = ClaimPoll(store.url, warned)

    def parse(self, data: bytes | None, node_id: str) -> NodeClaim | None:
        if not data:
            return None  # absent, or released (an empty object, as the lease)
        if isinstance(data, TooLarge):
            self.warned.warn(f"{claim_path(node_id)}:{bytes(data)!r}", "ignoring an unreadable claim: %s", data.reason)
            return None
        try:
            return NodeClaim.from_json(data, node_id=node_id, source=f"{self.store.url}/{claim_path(node_id)}")
        except ClaimError as e:
            self.warned.warn(f"{claim_path(node_id)}:{len(data)}", "ignoring an unreadable claim: %s", e)
            return None

    def read(self, node_id: str) -> NodeClaim | None:
        data, _ = self.store.read_small(claim_path(node_id))
        return self.parse(data, node_id)

    def read_all(self) -> dict[str, NodeClaim]:
        return self.poll.claims(self.store.list(NODES_DIR, recursive=True), self.read)

    def write(self, node_id: str, claim: NodeClaim | None, *, expected: NodeClaim | None) -> None:
        self.before_write()
        self.store.swap(
            claim_path(node_id), b"" if claim is None else claim.to_json().encode(),
            parse=lambda data: self.parse(data, node_id), target=claim, expected=expected,
            conflict=lambda found: ClaimConflictError(
                f"claim on {node_id!r} changed on {self.store.url}: expected {expected}, found {found}"),
        )
