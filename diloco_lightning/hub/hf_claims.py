"""Node claims on a Hugging Face repository (:class:`~diloco_lightning.hub.hf.HFHub`'s ``claims``):
``nodes/<node_id>/claim.json``, replaced by a commit whose ``parent_commit`` is the head it was read at
(the lease's scheme); listed with one tree listing of ``nodes/`` (:class:`~diloco_lightning.hub.claims.ClaimPoll`)."""

from __future__ import annotations

from diloco_lightning.hub.base import ClaimConflictError, HubError
from diloco_lightning.hub.claims import ClaimPoll, NodeClaims
from diloco_lightning.hub.hf_http import HFRequests, Precondition
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
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        path = claim_path(node_id)
        self.http.ensure_open()
        for attempt in range(self.http.max_cas_attempts):
            data, head = self.http.read_head_file(path)
            current = self.parse(data, node_id)
            if current == claim and (claim is not None or data is None):
                return  # already in place (an earlier attempt of ours landed)
            if current != expected:
                raise ClaimConflictError(f"claim on {node_id!r} changed on {self.http.url}: expected {expected}, found {current}")
            if claim is None:
                ops: list[CommitOperationAdd | CommitOperationDelete] = [CommitOperationDelete(path_in_repo=path)]
            else:
                ops = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=claim.to_json().encode())]
            try:
                self.http.commit(ops, head, f"claim {node_id}: " + ("released" if claim is None else f"{claim.holder} epoch {claim.epoch}"))
                return
            except Precondition:
                self.http.cas_pause(attempt)
        raise HubError(f"write_claim: gave up after {self.http.max_cas_attempts} attempts; the head of {self.http.url} kept moving")
