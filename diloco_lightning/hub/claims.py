"""Node claims on a hub (``nodes/<node_id>/claim.json``: which worker runs a node id now).

:class:`NodeClaims` is the part of a transport that holds them (``Hub.claims``: the hub's
``read_claim``, ``write_claim`` and ``list_claims`` ask it). :class:`ClaimPoll` is how a remote
transport lists every claim at the cost of one listing: it remembers, per node, the version token of the claim file it read last and what
it held: a poll reads again only the claims whose token changed, so it costs one listing plus one
read per heartbeat that changed.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable

from diloco_lightning.util.warnonce import WarnOnce
from diloco_lightning.wire.claims import MAX_CLAIM_BYTES, NodeClaim
from diloco_lightning.wire.names import parse_claim_path

__all__ = ["ClaimPoll", "NodeClaims"]


class NodeClaims(abc.ABC):
    """A transport's node claims (see :meth:`~diloco_lightning.hub.base.Hub.read_claim` and its siblings,
    which check their arguments and ask this part)."""

    @abc.abstractmethod
    def read(self, node_id: str) -> NodeClaim | None:
        """The claim on ``node_id`` (None: none, or unreadable, with a warning)."""

    @abc.abstractmethod
    def write(self, node_id: str, claim: NodeClaim | None, *, expected: NodeClaim | None) -> None:
        """Replace the claim on ``node_id`` by ``claim`` (None: remove it) iff the current one equals ``expected``;
        else ``ClaimConflictError``. ``claim`` is ``node_id``'s (checked by the hub)."""

    @abc.abstractmethod
    def read_all(self) -> dict[str, NodeClaim]:
        """Every readable claim on the hub, by node id."""


class ClaimPoll:
    """The claims of one hub, read from listings (module docstring). ``url``: the hub's, for the
    warnings; ``warned``: its bounded warnings (a name on the hub is any writer's)."""

    def __init__(self, url: str, warned: WarnOnce) -> None:
        self.url = url
        self.warned = warned
        self.versions: dict[str, tuple[str, NodeClaim | None]] = {}

    def claims(
        self, entries: Iterable[tuple[str, int | None, str | None]], read: Callable[[str], NodeClaim | None]
    ) -> dict[str, NodeClaim]:
        """Every readable claim, by node id: ``entries`` are ``(path, size, version token)`` of the files
        under ``nodes/`` (one listing); ``read(node_id)`` reads one claim (None: unreadable or none)."""
        cache = self.versions
        out: dict[str, NodeClaim] = {}
        seen: set[str] = set()
        for path, size, version in entries:
            node = parse_claim_path(path)
            if node is None or size == 0:  # not a claim, or a released one (an empty object on s3://)
                continue
            seen.add(node)
            if size is not None and size > MAX_CLAIM_BYTES:  # never read: what read_claim would refuse anyway
                self.warned.warn(f"{path}:{version}", "ignoring the claim %s on %s: %d bytes, more than the %d a "
                                 "claim may have", path, self.url, size, MAX_CLAIM_BYTES)
                continue
            hit = cache.get(node)
            if version is not None and hit is not None and hit[0] == version:
                claim = hit[1]
            else:
                claim = read(node)
                if version is not None:
                    cache[node] = (version, claim)
            if claim is not None:
                out[node] = claim
        for node in [n for n in cache if n not in seen]:
            cache.pop(node, None)
        return out
