"""The Hugging Face Hub transport (``hf://org/repo``), through ``huggingface_hub.HfApi``.

One model repository (branch ``revision``, default ``main``) holds the hub layout of
docs/spec.md. Workers commit deltas to it while the master publishes, so the branch head
moves all the time; every write is a ``create_commit`` with ``parent_commit`` as the
compare-and-swap:

* ``upload_delta`` / ``upload_init``: read the head H and check the path is absent at H
  (one ``HEAD .../resolve``, whose answer carries ``X-Repo-Commit`` even on 404), then
  commit the file with ``parent_commit=H``. On 412 (the head moved) check again and
  retry: a delta is never overwritten (``DeltaExistsError``; the same bytes already
  there count as done, which makes a retried upload idempotent).
* ``publish``: read ``global/manifest.json`` and the head H in one ``GET .../resolve``; if
  its ``outer_step`` is not the expected one, ``PublishConflictError`` and no commit.
  Else ONE commit with parent H carries the weights, the optimizer state, the new
  manifest and the deletions (filtered against H by ``paths-info``, so deleting a file
  that is already gone cannot fail the commit). On 412, re-read: if the manifest still
  has the expected ``outer_step`` (only worker commits happened) retry on the new head
  (bounded, jittered); else ``PublishConflictError``. The commit is the single atomic
  point: a crash before it leaves the old version, after it the new one.
  Mirrors (``compat="speedtronic"``: ``global/latest.safetensors``, ``global/step_count.json``)
  are replaced in that same commit.
* ``write_lease``: the same scheme on ``global/lease.json``.
* Listing reads the repo tree of ``nodes/`` (or ``global/``) only; nothing is downloaded.
* ``download`` streams ``GET .../resolve`` into ``cache_dir / hub_path`` (temp file +
  ``os.replace``, length and ETag checked), so two nodes' same-named files never share
  a cache file and two processes sharing the cache never see a partial one. Hub files
  are immutable, so a cached copy is reused; the mutable ones (manifest, lease,
  ``init.safetensors``, the mirrors) are always fetched again. Files named by the last manifest read
  are fetched at the commit that manifest was read at (a later publication deleting
  them cannot pull them away mid-download).

Every commit goes through this repository's commit budget
(:class:`~diloco_lightning.hub.pacing.CommitBudget`, ``commits_per_hour``, default 128: the Hub's
limit for a free account); :meth:`HFHub.commit_wait` tells a writer how long until the next one
fits. The layout with a repository per node (so that each has its own budget) is
:mod:`diloco_lightning.hub.hf_nodes`, built on this class.

Errors, retries (``Retry-After`` included) and the requests themselves: :mod:`diloco_lightning.hub.hf_http`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from diloco_lightning.util import faults
from diloco_lightning.util.warnonce import WarnOnce
from diloco_lightning.hub.hf_claims import HFClaims
from diloco_lightning.hub.base import (
    DeltaExistsError,
    DeltaRef,
    Hub,
    HubError,
    HubFileTooLargeError,
    HubNotFoundError,
    HubUnavailableError,
    LeaseConflictError,
    PublishConflictError,
    Publication,
    default_cache_dir,
)
from diloco_lightning.hub.hf_http import COMMIT_RE, EntryMissing, HFRequests, Precondition
from diloco_lightning.hub.pacing import DEFAULT_COMMITS_PER_HOUR, CommitBudget
from diloco_lightning.hub.pacing import retry_after as _retry_after  # noqa: F401 - importable from here, as before
from diloco_lightning.wire.manifest import Lease, Manifest
from diloco_lightning.wire.names import (
    GLOBAL_DIR,
    LEASE_PATH,
    MANIFEST_PATH,
    MIRROR_PATHS,
    NODES_DIR,
    InvalidNameError,
    delta_path,
    init_path,
    parse_claim_path,
    parse_delta_path,
    parse_init_path,
    validate_global_path,
    validate_hub_path,
    validate_node_id,
)

log = logging.getLogger(__name__)

__all__ = ["HFHub", "HubUnavailableError"]

_REPO_PART_RE = re.compile(r"(?!.*(--|\.\.))[A-Za-z0-9][A-Za-z0-9._-]{0,95}(?<![.-])")


# ----------------------------------------------------------------------------- the hub


def check_repo_id(repo_id: object) -> str:
    """``repo_id`` if it is a Hugging Face repository id (``org/name``), else ``TypeError`` / ``ValueError``."""
    if not isinstance(repo_id, str):
        raise TypeError(f"HFHub: repo id must be a string like 'org/repo', got {repo_id!r}")
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(_REPO_PART_RE.fullmatch(p) for p in parts):
        raise ValueError(
            f"invalid Hugging Face repo id {repo_id!r}: expected 'org/name' (letters, digits, '-', '_', '.';"
            " no '--' or '..'), as in hf://org/name"
        )
    return repo_id


class HFHub(Hub):
    """A hub in a Hugging Face model repository. See the module docstring for the guarantees.

    Options: ``endpoint`` (default ``$HF_ENDPOINT`` or https://huggingface.co), ``token``
    (default: ``huggingface_hub``'s, e.g. ``$HF_TOKEN``), ``cache_dir``, ``revision``
    (a branch, default ``main``; it must exist), ``create`` (create the repository if
    missing, default True), ``private`` (for a created repository), ``max_retries``
    (retries of one HTTP call on 429/5xx/timeouts, default 5), ``retry_base_delay`` /
    ``retry_max_delay`` (seconds; backoff ``min(max, base * 2**n)``, jittered to 50-100 %),
    ``timeout`` (seconds per connect/read/write, default 120), ``max_cas_attempts``
    (rounds of re-read + commit when the head keeps moving, default 20), ``commits_per_hour``
    / ``commit_burst`` (this handle's :class:`~diloco_lightning.hub.pacing.CommitBudget` for
    the repository, default 128 an hour, the Hub's limit for a free account; 0: none; when
    several processes commit to one repository, give each its share).
    ``create=None`` neither creates nor checks the repository at open (no request).
    """

    scheme = "hf"
    url_forms = ("hf://org/repo",)
    rate_limited_writes = True

    #: the classes of ``layout=`` besides ``"shared"`` (this class), by name: ``"per_node"``,
    #: :class:`~diloco_lightning.hub.hf_nodes.HFNodesHub`, is registered with the built-in transports
    layouts: ClassVar[dict[str, Callable[..., Hub]]] = {}

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Hub:
        """``hf://org/repo``: this class's options, and ``layout=`` (``"shared"``, the default, or another
        of :attr:`layouts`, e.g. ``"per_node"``, with ``node_repo=``)."""
        repo_id = url[len("hf://"):].strip("/")
        layout = options.pop("layout", None) or "shared"
        if layout != "shared":
            other = cls.layouts.get(layout)
            if other is None:
                raise ValueError(f"open_hub: layout must be one of {['shared', *cls.layouts]}, got {layout!r}")
            return other(repo_id, **options)
        if options.pop("node_repo", None) is not None:
            raise ValueError("open_hub: node_repo applies to layout='per_node' only")
        return cls(repo_id, **options)

    def __init__(
        self,
        repo_id: str,
        *,
        endpoint: str | None = None,
        token: str | bool | None = None,
        cache_dir: str | os.PathLike | None = None,
        revision: str | None = None,
        create: bool | None = True,
        private: bool | None = None,
        max_retries: int | None = None,
        retry_base_delay: float | None = None,
        retry_max_delay: float | None = None,
        timeout: float | None = 120.0,
        max_cas_attempts: int | None = None,
        commits_per_hour: float | None = DEFAULT_COMMITS_PER_HOUR,
        commit_burst: int | None = None,
    ) -> None:
        from huggingface_hub import constants

        self.repo_id = check_repo_id(repo_id)
        self.revision = revision or "main"
        if not isinstance(self.revision, str) or not self.revision.strip() or self.revision != self.revision.strip():
            raise ValueError(f"HFHub: revision {self.revision!r} must be a branch name")
        self.endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
        if not re.match(r"https?://", self.endpoint):
            raise ValueError(f"HFHub: endpoint {self.endpoint!r} must start with http:// or https://")
        self.url = f"hf://{self.repo_id}"
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(
            f"{self.endpoint}/{self.repo_id}@{self.revision}"
        )
        retries = 5 if max_retries is None else int(max_retries)
        base_delay = 0.5 if retry_base_delay is None else float(retry_base_delay)
        max_delay = 30.0 if retry_max_delay is None else float(retry_max_delay)
        self.max_cas_attempts = 20 if max_cas_attempts is None else int(max_cas_attempts)
        if retries < 0 or base_delay < 0 or max_delay < 0 or self.max_cas_attempts < 1:
            raise ValueError("HFHub: max_retries, retry delays must be >= 0 and max_cas_attempts >= 1")
        self.commit_budget = CommitBudget(commits_per_hour, commit_burst)
        #: the repository's requests: retries, errors, its creation, commits within the budget
        self.http = HFRequests(
            self.repo_id, endpoint=self.endpoint, revision=self.revision, token=token, url=self.url,
            max_retries=retries, retry_base_delay=base_delay, retry_max_delay=max_delay,
            max_cas_attempts=self.max_cas_attempts, timeout=timeout, commit_budget=self.commit_budget,
            create=create, private=private,
        )
        self._pins: dict[str, str] = {}
        self._lock = threading.Lock()
        self._warned = WarnOnce(log)
        self.claims = HFClaims(self.http, self._warned)
        #: the hub whose crash points this one's are (a per-node hub's repositories report as it)
        self.fault_owner: Hub | None = None
        if self.http.opening is not None:
            try:
                self.http.ensure_open()
            except HubUnavailableError as e:
                log.warning("cannot reach %s to %s (%s); done before this process's first write", self.url,
                            self.http.opening, e)

    # ------------------------------------------------------------------ HTTP plumbing

    def _fault(self, label: str) -> None:
        # crash points for tests (diloco_lightning.util.faults), reached by the hub that owns this one if any
        faults.point(label, self.fault_owner or self)

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        self._warned.warn(key, msg, *args)  # bounded: the names are any hub writer's

    # ------------------------------------------------------------------ reads at the head

    # ------------------------------------------------------------------ workers

    def upload_delta(self, local_file: str | os.PathLike, node_id: str, local_step: int, *,
                     delete: Iterable[str] = ()) -> str:
        """See :meth:`Hub.upload_delta`; ``delete``: files removed in the same commit (no extra commit)."""
        hub_path = delta_path(node_id, local_step)
        if not self.http.put_new(local_file, hub_path, "upload delta", delete):
            raise DeltaExistsError(f"{hub_path} already exists on {self.url}; deltas are never rewritten")
        return hub_path

    def upload_init(self, local_file: str | os.PathLike, node_id: str) -> str:
        hub_path = init_path(node_id)
        if not self.http.put_new(local_file, hub_path, "offer initial weights"):
            log.info("%s already offered on %s; keeping the first one", hub_path, self.url)
        return hub_path

    # ------------------------------------------------------------------ listing

    def _node_files(self) -> list[tuple[str, int | None, str | None]]:
        return self.http.tree(NODES_DIR, recursive=True)

    def list_deltas(self, after: Mapping[str, int] | None = None) -> list[DeltaRef]:
        after = after or {}
        out: list[DeltaRef] = []
        for path, size, blob in self._node_files():
            ident = parse_delta_path(path)
            if ident is None:
                if parse_init_path(path) is None and parse_claim_path(path) is None:
                    self._warn_once(path, "ignoring %s on %s: not a delta path", path, self.url)
                continue
            if ident.local_step <= after.get(ident.node_id, -1):
                continue
            out.append(DeltaRef(ident.node_id, ident.local_step, path, size, blob))
        out.sort()
        return out

    def list_node_deltas(self, node_id: str, after: int = -1) -> list[DeltaRef]:
        """One node's deltas: a listing of ``nodes/<node_id>/`` only."""
        folder = f"{NODES_DIR}/{validate_node_id(node_id)}"
        out = [DeltaRef(i.node_id, i.local_step, p, size, blob) for p, size, blob in self.http.tree(folder, recursive=True)
               if (i := parse_delta_path(p)) is not None and i.node_id == node_id and i.local_step > after]
        return sorted(out)

    def list_inits(self) -> list[str]:
        return sorted({n for n in (parse_init_path(p) for p, _, _ in self._node_files()) if n is not None})

    def list_global(self) -> list[str]:
        out = []
        for path, _, _ in self.http.tree(GLOBAL_DIR, recursive=False):
            try:
                out.append(validate_global_path(path))
            except InvalidNameError:
                continue
        return sorted(out)

    # ------------------------------------------------------------------ reading

    def download(self, hub_path: str, *, max_bytes: int | None = None) -> Path:
        hub_path = validate_hub_path(hub_path)
        dest = self.cache_dir / hub_path
        mutable = hub_path in (MANIFEST_PATH, LEASE_PATH) or hub_path in MIRROR_PATHS or parse_init_path(hub_path) is not None
        if not mutable and dest.is_file():
            if max_bytes is not None and dest.stat().st_size > max_bytes:
                raise HubFileTooLargeError(f"{hub_path} on {self.url} is more than the {max_bytes} bytes allowed")
            return dest  # hub files are immutable and cached copies are complete (atomic rename)
        with self._lock:
            pinned = self._pins.get(hub_path)
        for revision in ([pinned] if pinned else []) + [self.revision]:
            try:
                self.http.call(f"download {hub_path}", self.http.stream_to, hub_path, revision, dest, max_bytes)
                return dest
            except EntryMissing:
                continue
        raise HubNotFoundError(f"{hub_path} not found on {self.url}")

    def read_manifest_bytes(self) -> bytes | None:
        data, _ = self.http.read_head_file(MANIFEST_PATH)
        return data

    def read_manifest(self) -> Manifest | None:
        data, commit = self.http.read_head_file(MANIFEST_PATH)
        if data is None:
            return None
        manifest = Manifest.from_json(data, source=f"{self.url}/{MANIFEST_PATH}@{commit[:12]}")
        with self._lock:
            self._pins = {p: commit for p in manifest.files()}
        return manifest

    # ------------------------------------------------------------------ publishing

    def _publish(self, pub: Publication) -> None:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        self.http.ensure_open()
        manifest, files, mirrors = pub.manifest, pub.files, pub.mirrors
        expected_outer_step, expected_digest = pub.expected_outer_step, pub.expected_digest
        delete = sorted(set(pub.delete))
        text = manifest.to_json()
        named = manifest.files()
        data = text.encode()
        big = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(src)) for p, src in sorted(files.items())]
        need = [p for p in named if p not in files]
        message = f"publish outer_step {manifest.outer_step}"
        for attempt in range(self.max_cas_attempts):
            current_bytes, head = self.http.read_head_file(MANIFEST_PATH)
            if current_bytes is not None and current_bytes == data:
                log.info("%s: outer_step %d is already on %s (an earlier attempt landed)", message, manifest.outer_step, self.url)
                self._set_pins(named, head)
                return
            if expected_digest is not None:
                digest = None if current_bytes is None else hashlib.sha256(current_bytes).hexdigest()
                if digest != expected_digest:
                    raise PublishConflictError(expected_outer_step, None, "the manifest being replaced changed")
            else:
                current = None if current_bytes is None else Manifest.from_json(current_bytes, source=f"{self.url}/{MANIFEST_PATH}")
                found = None if current is None else current.outer_step
                if found != expected_outer_step:
                    raise PublishConflictError(expected_outer_step, found)
            present = self.http.paths_present([*need, *delete, *files], head)
            missing = [p for p in need if p not in present]
            if missing:
                raise HubError(f"manifest names {missing} but they are neither uploaded now nor on {self.url}")
            taken = sorted(p for p in files if p in present)
            if taken:
                raise HubError(f"{taken} already exist on {self.url}; global file names must be unique")
            ops: list[CommitOperationAdd | CommitOperationDelete] = [
                *big, CommitOperationAdd(path_in_repo=MANIFEST_PATH, path_or_fileobj=data)]
            # the mirrors ride in the same commit: the new manifest and Speedtronic's view appear together
            ops += [CommitOperationAdd(path_in_repo=p, path_or_fileobj=src if isinstance(src, bytes) else str(src))
                    for p, src in mirrors.items()]
            ops += [CommitOperationDelete(path_in_repo=p) for p in delete if p in present]
            # upload everything that must be uploaded first (LFS/Xet content on the real Hub); the commit
            # below is then the single atomic step
            self.http.call("upload publication files", self.http.api.preupload_lfs_files, self.repo_id,
                       additions=[op for op in ops if isinstance(op, CommitOperationAdd)], revision=self.revision,
                       free_memory=False)
            self._fault("files")
            self._fault("locked")
            try:
                commit = self.http.commit(ops, head, message)
            except Precondition:
                log.info("%s: the head of %s moved (worker commits?); re-reading the manifest", message, self.url)
                self.http.cas_pause(attempt)
                continue
            self._set_pins(named, commit)
            self._fault("committed")
            self._fault("manifest")
            self._fault("deleted")
            return
        raise HubError(f"{message}: gave up after {self.max_cas_attempts} attempts; the head of {self.url} kept moving")

    def _set_pins(self, paths: Iterable[str], commit: str | None) -> None:
        if commit and COMMIT_RE.fullmatch(commit):
            with self._lock:
                self._pins = {p: commit for p in paths}

    def delete(self, paths: Iterable[str]) -> None:
        from huggingface_hub import CommitOperationDelete

        paths = sorted({validate_hub_path(p) for p in paths})
        for p in paths:
            if p in (MANIFEST_PATH, LEASE_PATH):
                raise InvalidNameError(f"refusing to delete {p!r}")
        self.http.ensure_open()
        if not paths:
            return
        for attempt in range(self.max_cas_attempts):
            head = self.http.head_commit()
            present = self.http.paths_present(paths, head)
            if not present:
                return
            try:
                self.http.commit([CommitOperationDelete(path_in_repo=p) for p in sorted(present)], head, f"delete {len(present)} file(s)")
                return
            except Precondition:
                self.http.cas_pause(attempt)
        raise HubError(f"delete: gave up after {self.max_cas_attempts} attempts; the head of {self.url} kept moving")

    # ------------------------------------------------------------------ lease

    def _parse_lease(self, data: bytes | None) -> Lease | None:
        return None if data is None else Lease.from_hub_bytes(data, source=f"{self.url}/{LEASE_PATH}")

    def read_lease(self) -> Lease | None:
        data, _ = self.http.read_head_file(LEASE_PATH)
        return self._parse_lease(data)

    def write_lease(self, lease: Lease | None, *, expected: Lease | None) -> None:
        self.http.swap(
            LEASE_PATH, None if lease is None else lease.to_json().encode(), parse=self._parse_lease, target=lease,
            expected=expected, name="write_lease",
            conflict=lambda found: LeaseConflictError(f"lease changed on {self.url}: expected {expected}, found {found}"),
            message="lease" if lease is None else f"lease: {lease.holder} epoch {lease.epoch}",
        )

    def commit_wait(self, node_id: str | None = None) -> float:
        """Seconds until this repository's commit budget allows the next commit (every write here is one)."""
        return self.commit_budget.wait()

    def __repr__(self) -> str:
        return f"HFHub({self.url!r}, endpoint={self.endpoint!r}, revision={self.revision!r})"
