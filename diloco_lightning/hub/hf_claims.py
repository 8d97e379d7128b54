"""Node claims on a Hugging Face repository (:class:`~diloco_lightning.hub.hf.HFHub`'s ``claims``):
``nodes/<node_id>/claim.json``, replaced by a commit whose ``parent_commit`` is the head it was read at
(the lease's scheme); listed with one tree listing of ``nodes/`` (:class:`~diloco_lightning.hub.claims.ClaimPoll`)."""

from __future__ import annotations

from diloco_lightning.hub.base import ClaimConflictError
from diloco_lightning.hub.claims import ClaimPoll, NodeClaims
from diloco_lightning.hub.hf_http import HFRequests
from diloco_lightning.util.warnonce import WarnOnce
from diloco_lightning.wire.claims import ClaimError, NodeClaim
from diloco_lightning.wire.names import NODES_DIR, claim_path

__all__ = ["HFClaims"]


class HFClaims(NodeClaims):
    """The claims in the repository ``http`` reaches; ``warned``: the hub's bounded warnings."""

    def __init__(self, http: HFRequests, warned: WarnOnce) -> None:
        self.http, self.warned = http, warned
        self.poll = ClaimPoll(http.url, warned)

    def parse(self, data: bytes | None, node_id: str) -> NodeClaim | None:
        if data is None:
            return None
        try:
            return NodeClaim.from_json(data, node_id=node_id, source=f"{self.http.url}/{claim_path(node_id)}")
        except ClaimError as e:
            self.warned.warn(f"{claim_path(node_id)}:{len(data)}", "ignoring an unreadable claim: %s", e)
            return None

    def read(self, node_id: str) -> NodeClaim | None:
        data, _ = self.http.read_head_file(claim_path(node_id))
        return self.parse(data, node_id)

    def read_all(self) -> dict[str, NodeClaim]:
        return self.poll.claims(self.http.tree(NODES_DIR, recursive=True), self.read)

    def write(self, node_id: str, claim: NodeClaim | None, *, expected: NodeClaim | None) -> None:
        """The scheme of :meth:`~diloco_lightning.hub.hf.HFHub.write_lease` on ``nodes/<node_id>/claim.json`` (one commit per write:
        the keeper renews at most once per half ``ttl``, well inside the Hub's commit rate limits)."""
        self.http.swap(
            claim_path(node_id), None if claim is None else claim.to_json().encode(),
            parse=lambda data: self.parse(data, node_id), target=claim, expected=expected, name="write_claim",
            conflict=lambda found: ClaimConflictError(
                f"claim on {node_id!r} changed on {self.http.url}: expected {expected}, found {found}"),
            message=f"claim {node_id}: " + ("released" if claim is None else f"{claim.holder} epoch {claim.epoch}"),
        )
