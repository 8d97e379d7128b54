"""The Hugging Face Hub with a repository per node (``hf://org/run`` with ``layout="per_node"``).

The Hub limits how often one repository may be committed to (128 commits an hour on a free
account). With one repository per run every worker upload, claim renewal and master
publication shares that budget; here each node has its own:

* the **master's repository** ``org/run`` holds ``global/``: the manifest, the weights, the
  optimizer state, the lease. Only the master writes to it (workers only read it);
* each **node's repository** is named by the pattern ``node_repo`` (default
  ``{repo}-{node}``: ``org/run-w3`` for node ``w3``; ``{org}`` and ``{repo}`` are the master
  repository's parts, and a pattern with a ``/`` names another namespace). Inside it the paths
  are the usual ``nodes/<node>/delta_<step>.safetensors``, ``nodes/<node>/init.safetensors``,
  ``nodes/<node>/claim.json``. Only that node's worker writes to it, and creates it on its
  first write (``create_repo``, once).

**Discovery.** The master finds the node repositories by listing the namespace's models whose
name matches the pattern (one paginated ``GET /api/models?author=<ns>&search=<prefix>&expand=sha``
per listing, 1000 repositories a page), with each repository's head commit. A node's tree
(``nodes/<node>/`` at that commit) is listed again only when its head moved, plus once every
``rescan_interval`` seconds for all of them; so a round costs one request per changed node
repository plus one per 1000 node repositories. Nothing is registered anywhere: a worker
joins by writing to its repository, and a repository whose name matches but whose files are
not that node's (``nodes/<other>/...``) contributes nothing (logged once). Pick run names
that are not prefixes of each other's (``run`` and ``run-old``), or a pattern with a suffix.

**What each rule of ``diloco_lightning.hub.base`` becomes.** Deltas are committed to the
node's repository exactly as on a single repository (never overwritten, a retried upload is
idempotent); publication, the lease and everything under ``global/`` are the single-repository
transport's own (:class:`~diloco_lightning.hub.hf.HFHub` on the master's repository: one commit
with ``parent_commit``, crash points included). Validation, sizes from the listing, signing
and exactly-once are unchanged (they live above the transport).

**Garbage collection without commits.** The master cannot delete in the node repositories
without spending their budgets (and write access to them). So each worker removes its own
processed deltas: every delta upload also deletes, in the same commit, this node's deltas at
or below the ledger of the newest manifest this handle read (verified with the run key from
``DILOCO_RUN_KEY`` / ``DILOCO_RUN_KEY_FILE`` in a signed run: a forged ledger deletes
nothing). A node repository thus holds about one processed delta at a time; the last one of a
finished worker stays (delete the node repositories with the run). The master's own
publication deletions (``global/``) ride in its commit as before; its deletions under
``nodes/`` are left to the workers.

**Membership** (:meth:`HFNodesHub.list_claims`, through
:class:`~diloco_lightning.hub.hf_node_repos.NodeRepoClaims`): a node's claim (``nodes/<node>/claim.json``, its
heartbeat) is in the node's repository, found by the same discovery and tree listings as its
deltas, so the master's live nodes, a fractional quorum, the adaptive deadline and the workers'
Dynamic Local Updates work on this layout as on one repository.

**Commit budgets** (:class:`~diloco_lightning.hub.pacing.CommitBudget`): one per repository
this handle writes to, ``commits_per_hour`` each (default 128): a worker's uploads and claim
renewals share its repository's, the master's publications and lease renewals the master
repository's.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from diloco_lightning.hub.base import (
    DeltaRef,
    Hub,
    HubNotFoundError,
    Publication,
)
from diloco_lightning.hub.hf import HFHub
from diloco_lightning.hub.hf_node_repos import HFNodeRepos, NodeRepoClaims
from diloco_lightning.wire.manifest import Lease, Manifest
from diloco_lightning.wire.names import (
    GLOBAL_DIR,
    NODES_DIR,
    delta_path,
    parse_claim_path,
    parse_delta_path,
    parse_init_path,
    validate_hub_path,
)
from diloco_lightning.hub.options import DEFAULT_NODE_REPO, LAYOUTS, parse_node_repo
from diloco_lightning.util.warnonce import WarnOnce

log = logging.getLogger(__name__)

__all__ = ["HFNodesHub", "DEFAULT_NODE_REPO", "LAYOUTS", "parse_node_repo"]


class HFNodesHub(Hub):
    """A run on the Hugging Face Hub with a repository per node; see the module docstring.

    Options: ``node_repo`` (the pattern), ``rescan_interval`` (seconds between full listings of
    every node repository, default 300), ``list_workers`` (node repositories listed at once,
    default 16), and every :class:`~diloco_lightning.hub.hf.HFHub` option (``create`` and
    ``private`` apply to the master's repository; a node's repository is created by its worker,
    with ``private``).
    """

    rate_limited_writes = True

    def __init__(
        self,
        repo_id: str,
        *,
        node_repo: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        create: bool | None = True,
        private: bool | None = None,
        revision: str | None = None,
        rescan_interval: float = 300.0,
        list_workers: int = 16,
        **options: Any,
    ) -> None:
        if revision not in (None, "main"):
            raise ValueError(f"layout='per_node' uses each repository's main branch; revision={revision!r} is not supported")
        if not rescan_interval > 0 or int(list_workers) < 1:
            raise ValueError("rescan_interval must be > 0 seconds and list_workers >= 1")
        self.master = HFHub(repo_id, cache_dir=cache_dir, create=create, private=private, **options)
        self.master.fault_owner = self
        self.url = self.master.url
        self.repo_id = self.master.repo_id
        self.cache_dir = self.master.cache_dir  # hub paths never collide across the run's repositories
        self.node_repo = node_repo or DEFAULT_NODE_REPO
        self._lock = threading.Lock()
        self._warned = WarnOnce(log)
        #: the node repositories: names, handles, discovery
        self.nodes = HFNodeRepos(self.master, self.node_repo, private=private,
                                 options=dict(options, endpoint=self.master.endpoint, cache_dir=self.cache_dir),
                                 rescan_interval=rescan_interval, list_workers=list_workers, owner=self,
                                 warned=self._warned)
        self._own: dict[str, set[int]] = {}  # this handle's node(s): steps known to be in the node's repository
        self._ledger: dict[str, int] = {}
        from diloco_lightning.wire.signing import load_run_key  # torch: when a per-node hub is opened only

        self._key = load_run_key()
        self.claims = NodeRepoClaims(self.nodes, self._warned)

    # ------------------------------------------------------------------ node repositories

    def node_repo_id(self, node_id: str) -> str:
        """The repository of ``node_id`` (``InvalidNameError`` if the Hub would refuse its name)."""
        return self.nodes.repo_id(node_id)

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        self._warned.warn(key, msg, *args)  # bounded: the names are any hub writer's

    # ------------------------------------------------------------------ workers

    def _processed(self, node_id: str, hub: HFHub) -> list[str]:
        """This node's deltas at or below the ledger last read, to delete with its next upload."""
        with self._lock:
            own = self._own.get(node_id)
        if own is None:  # the first upload of this handle: what earlier runs of the node left
            own = {r.local_step for r in hub.list_node_deltas(node_id)}
            with self._lock:
                self._own[node_id] = own
        floor = self._ledger.get(node_id, -1)
        return [delta_path(node_id, s) for s in sorted(own) if s <= floor]

    def upload_delta(self, local_file: str | os.PathLike, node_id: str, local_step: int) -> str:
        hub = self.nodes.hub(node_id, write=True)
        stale = self._processed(node_id, hub)
        path = hub.upload_delta(local_file, node_id, local_step, delete=stale)
        with self._lock:
            own = self._own.setdefault(node_id, set())
            own.difference_update(parse_delta_path(p).local_step for p in stale)  # type: ignore[union-attr]
            own.add(local_step)
        return path

    def upload_init(self, local_file: str | os.PathLike, node_id: str) -> str:
        return self.nodes.hub(node_id, write=True).upload_init(local_file, node_id)

    def list_node_deltas(self, node_id: str, after: int = -1) -> list[DeltaRef]:
        # a worker asks about its own node: its repository is created first (a missing private
        # repository may answer 401 rather than 404)
        return self.nodes.hub(node_id, write=True).list_node_deltas(node_id, after)

    def commit_wait(self, node_id: str | None = None) -> float:
        if node_id is None:
            return self.master.commit_wait()
        return self.nodes.hub(node_id).commit_wait()

    # ------------------------------------------------------------------ listing (the master)

    def list_deltas(self, after: Mapping[str, int] | None = None) -> list[DeltaRef]:
        after = after or {}
        out: list[DeltaRef] = []
        for node, path, size, blob in self.nodes.entries():
            ident = parse_delta_path(path)
            if ident is None:
                if parse_init_path(path) is None and parse_claim_path(path) is None:
                    self._warn_once(path, "ignoring %s in %s: not a delta path", path, self.node_repo_id(node))
                continue
            if ident.local_step > after.get(node, -1):
                out.append(DeltaRef(node, ident.local_step, path, size, blob))
        out.sort()
        return out

    def list_inits(self) -> list[str]:
        return sorted({node for node, path, _, _ in self.nodes.entries() if parse_init_path(path) == node})

    def list_global(self) -> list[str]:
        return self.master.list_global()

    # ------------------------------------------------------------------ reading

    def download(self, hub_path: str, *, max_bytes: int | None = None) -> Path:
        hub_path = validate_hub_path(hub_path)
        if hub_path.startswith(NODES_DIR + "/"):
            return self.nodes.hub(hub_path.split("/")[1]).download(hub_path, max_bytes=max_bytes)
        return self.master.download(hub_path, max_bytes=max_bytes)

    def read_manifest_bytes(self) -> bytes | None:
        return self.master.read_manifest_bytes()

    def read_manifest(self) -> Manifest | None:
        manifest = self.master.read_manifest()
        if manifest is not None:
            self._note_ledger(manifest)
        return manifest

    def _note_ledger(self, manifest: Manifest) -> None:
        """The ledger a worker's next upload cleans up to, from a manifest it may trust (signed
        with the run key in a signed run)."""
        if self._key is not None and not manifest.verify(self._key):
            return
        with self._lock:
            self._ledger = dict(manifest.ledger)

    # ------------------------------------------------------------------ publishing (the master's repository)

    def _publish(self, pub: Publication) -> None:
        # nodes/ files live in the workers' repositories: each worker deletes its processed deltas
        # with its next upload (module docstring); global/ ones ride in the publication's commit
        self.master.publish(pub.manifest, pub.files, expected_outer_step=pub.expected_outer_step,
                            delete=[p for p in pub.delete if p.startswith(GLOBAL_DIR + "/")],
                            expected_digest=pub.expected_digest, mirrors=pub.mirrors)

    def delete(self, paths: Iterable[str]) -> None:
        paths = sorted({validate_hub_path(p) for p in paths})
        by_node: dict[str, list[str]] = {}
        for p in paths:
            if p.startswith(NODES_DIR + "/"):
                by_node.setdefault(p.split("/")[1], []).append(p)
        self.master.delete([p for p in paths if not p.startswith(NODES_DIR + "/")])
        for node, node_paths in by_node.items():
            try:
                self.nodes.hub(node).delete(node_paths)
            except HubNotFoundError:
                continue

    def read_lease(self) -> Lease | None:
        return self.master.read_lease()

    def write_lease(self, lease: Lease | None, *, expected: Lease | None) -> None:
        self.master.write_lease(lease, expected=expected)

    def __repr__(self) -> str:
        return f"HFNodesHub({self.url!r}, node_repo={self.node_repo!r}, endpoint={self.master.endpoint!r})"
