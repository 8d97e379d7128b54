"""The node repositories of a run with a repository per node (:mod:`diloco_lightning.hub.hf_nodes`):
their names, this process's handles on them, and their discovery (module docstring of hf_nodes:
one listing of the namespace's matching repositories, a node's tree listed again only when its
head moved, and all of them every ``rescan_interval`` seconds)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterable
from typing import Any

from diloco_lightning.hub.base import Hub, HubNotFoundError
from diloco_lightning.hub.claims import ClaimPoll, NodeClaims
from diloco_lightning.hub.hf import HFHub, check_repo_id
from diloco_lightning.hub.hf_http import EntryMissing
from diloco_lightning.hub.options import parse_node_repo
from diloco_lightning.util.warnonce import WarnOnce
from diloco_lightning.wire.claims import NodeClaim
from diloco_lightning.wire.names import NODE_ID_RE, NODES_DIR, InvalidNameError, validate_node_id

__all__ = ["HFNodeRepos", "NodeRepoClaims"]

Files = list[tuple[str, "int | None", "str | None"]]


class HFNodeRepos:
    """The node repositories of the run whose master repository is ``master``'s, named by the pattern
    ``node_repo``; handles are opened with ``options`` (and ``private`` for a repository a worker
    creates), their crash points reported as ``owner``'s; ``warned``: the owner's bounded warnings."""

    def __init__(self, master: HFHub, node_repo: str, *, private: bool | None, options: dict[str, Any],
                 rescan_interval: float, list_workers: int, owner: Hub, warned: WarnOnce) -> None:
        self.master, self.node_repo, self.owner, self.warned = master, node_repo, owner, warned
        org, name = master.repo_id.split("/")
        self._ns, self._prefix, self._suffix = parse_node_repo(node_repo, org, name)
        self.rescan_interval = float(rescan_interval)
        self.list_workers = int(list_workers)
        self._private = private
        self._options = dict(options)
        self._lock = threading.Lock()
        self._nodes: dict[str, HFHub] = {}
        self._created: set[str] = set()
        self._trees: dict[str, tuple[str | None, Files]] = {}
        self._full_at = -float("inf")

    # ------------------------------------------------------------------ names and handles

    def repo_id(self, node_id: str) -> str:
        """The repository of ``node_id`` (``InvalidNameError`` if the Hub would refuse its name)."""
        node_id = validate_node_id(node_id)
        rid = f"{self._ns}/{self._prefix}{node_id}{self._suffix}"
        try:
            check_repo_id(rid)
        except ValueError as e:
            raise InvalidNameError(
                f"node_id {node_id!r} gives the repository {rid!r} (node_repo {self.node_repo!r}), which the Hub "
                f"refuses: {e}. Use node ids without '--', '..' or a trailing '-' / '.'"
            ) from None
        return rid

    def node_of(self, repo_id: str) -> str | None:
        ns, _, name = repo_id.partition("/")
        if ns != self._ns or not name.startswith(self._prefix) or not name.endswith(self._suffix):
            return None
        node = name[len(self._prefix) : len(name) - len(self._suffix)]
        if not node or NODE_ID_RE.fullmatch(node) is None:
            return None
        try:
            return node if self.repo_id(node) == repo_id else None
        except InvalidNameError:
            return None

    def hub(self, node_id: str, *, write: bool = False) -> HFHub:
        """The handle on ``node_id``'s repository; ``write``: created first (once), as its worker does."""
        rid = self.repo_id(node_id)
        with self._lock:
            hub = self._nodes.get(node_id)
            if hub is None:
                hub = HFHub(rid, create=None, private=self._private, **self._options)
                hub.fault_owner = self.owner
                self._nodes[node_id] = hub
        if write and node_id not in self._created:
            hub.http.call("create the node repository", hub.http.api.create_repo, rid, private=self._private, exist_ok=True)
            with self._lock:
                self._created.add(node_id)
        return hub

    # ------------------------------------------------------------------ discovery

    def scan(self) -> dict[str, str | None]:
        """Node -> head commit (None if the Hub did not say) of every node repository."""
        api = self.master.http.api

        def run() -> list[tuple[str, str | None]]:
            found = api.list_models(author=self._ns, search=self._prefix or self._suffix, expand=["sha"])
            return [(m.id, getattr(m, "sha", None)) for m in found]

        out: dict[str, str | None] = {}
        for rid, sha in self.master.http.call("list the node repositories", run):
            node = self.node_of(str(rid))
            if node is not None:
                out[node] = sha if isinstance(sha, str) else None
        return out

    def tree(self, node_id: str, sha: str | None) -> Files:
        hub = self.hub(node_id)
        try:
            return hub.http.tree(f"{NODES_DIR}/{node_id}", recursive=True, revision=sha)
        except (EntryMissing, HubNotFoundError):  # nothing under nodes/<node>, or the repository went away
            return []

    def files(self) -> dict[str, Files]:
        """Node -> its repository's files, listed again where the head moved (or all, every
        ``rescan_interval``)."""
        heads = self.scan()
        now = time.monotonic()
        full = now - self._full_at >= self.rescan_interval
        with self._lock:
            known = dict(self._trees)
        todo = [n for n, sha in heads.items() if full or sha is None or n not in known or known[n][0] != sha]
        fresh: dict[str, Files] = {}
        if todo:
            workers = min(self.list_workers, len(todo))
            with concurrent.futures.ThreadPoolExecutor(workers, "diloco-hf-list") as pool:
                for node, files in zip(todo, pool.map(lambda n: self.tree(n, heads[n]), todo)):
                    fresh[node] = files
        trees = {n: (heads[n], fresh[n]) if n in fresh else known[n] for n in heads}
        with self._lock:
            self._trees = trees
            if full:
                self._full_at = now
        return {n: files for n, (_, files) in trees.items()}

    def entries(self) -> Iterable[tuple[str, str, int | None, str | None]]:
        """``(node, path, size, blob id)`` of every node repository's own files (another node's are ignored, logged once)."""
        for node, files in sorted(self.files().items()):
            for path, size, blob in files:
                owner = path.split("/")[1] if path.count("/") >= 2 else None
                if owner != node:
                    self.warned.warn(f"{node}:{path}", "ignoring %s in %s: not node %s's file", path,
                                    self.repo_id(node), node)
                    continue
                yield node, path, size, blob


class NodeRepoClaims(NodeClaims):
    """Node claims on the per-node layout: each in its node's repository (written by that node's
    worker, which creates the repository first)."""

    def __init__(self, nodes: HFNodeRepos, warned: WarnOnce) -> None:
        self.nodes = nodes
        self.poll = ClaimPoll(nodes.master.url, warned)

    def read(self, node_id: str) -> NodeClaim | None:
        return self.nodes.hub(node_id, write=True).read_claim(node_id)  # a worker's own node (as for its deltas)

    def write(self, node_id: str, claim: NodeClaim | None, *, expected: NodeClaim | None) -> None:
        self.nodes.hub(node_id, write=True).write_claim(node_id, claim, expected=expected)

    def read_all(self) -> dict[str, NodeClaim]:
        """Every node's claim, from the node repositories the discovery finds (the same listing as the
        deltas': one request per 1000 node repositories, plus a tree listing of each whose head moved),
        a claim read again only when its blob changed. What the master's membership and the workers'
        Dynamic Local Updates read, on this layout as on every other."""
        entries = [(path, size, blob) for _node, path, size, blob in self.nodes.entries()]
        return self.poll.claims(entries, lambda node: self.nodes.hub(node).read_claim(node))
