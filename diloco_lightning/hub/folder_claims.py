"""Node claims in a folder hub (:class:`~diloco_lightning.hub.local.FileHub`'s ``claims``):
``nodes/<node_id>/claim.json``, read and replaced through the folder's descriptors (never through a
symbolic link), compare-and-swap under a lock file of the node's folder."""

from __future__ import annotations

from collections.abc import Callable

from diloco_lightning.hub.base import ClaimConflictError
from diloco_lightning.hub.claims import NodeClaims
from diloco_lightning.hub.folder import HubFolder
from diloco_lightning.util.fileio import RefusedFile
from diloco_lightning.util.warnonce import WarnOnce
from diloco_lightning.wire.claims import MAX_CLAIM_BYTES, ClaimError, NodeClaim
from diloco_lightning.wire.names import NODES_DIR, claim_path

__all__ = ["FolderClaims"]

_CLAIM_LOCK = ".claim.lock"


class FolderClaims(NodeClaims):
    """The claims in ``folder``; ``node_ids()``: the valid node folders (the hub's listing);
    ``warned``: the hub's bounded warnings (a claim's content is any writer's)."""

    def __init__(self, folder: HubFolder, warned: WarnOnce, node_ids: Callable[[], list[str]]) -> None:
        self.folder, self.warned, self.node_ids = folder, warned, node_ids

    def read(self, node_id: str) -> NodeClaim | None:
        path = claim_path(node_id)
        data = self.folder.read_document(path, MAX_CLAIM_BYTES, name=path)
        if data is None:
            return None
        if isinstance(data, RefusedFile):  # a link, a FIFO, a device, a file over its size: no claim
            self.warned.warn(f"{path}:{bytes(data)!r}", "ignoring the claim %s on %s: %s", path, self.folder.url, data.reason)
            return None
        try:
            return NodeClaim.from_json(data, node_id=node_id, source=f"{self.folder.url}/{path}")
        except ClaimError as e:
            self.warned.warn(f"{path}:{len(data)}", "ignoring an unreadable claim: %s", e)
            return None

    def read_all(self) -> dict[str, NodeClaim]:
        out: dict[str, NodeClaim] = {}
        for node in self.node_ids():
            claim = self.read(node)  # a folder that became a link meanwhile: no claim
            if claim is not None:
                out[node] = claim
        return out

    def write(self, node_id: str, claim: NodeClaim | None, *, expected: NodeClaim | None) -> None:
        path = claim_path(node_id)  # validates node_id
        text = None if claim is None else claim.to_json().encode()
        # the lock, the read and the write each go through folder descriptors: never through a link
        with self.folder.locked([NODES_DIR, node_id], _CLAIM_LOCK):
            current = self.read(node_id)
            if current != expected:
                raise ClaimConflictError(f"claim on {node_id!r} changed on {self.folder.url}: expected {expected}, found {current}")
            if text is None:
                self.folder.unlink(path)
            else:
                self.folder.replace_bytes(path, text)
