"""The hub interface: the only channel between workers and the master.

A hub holds (docs/spec.md, "Hub layout")::

    nodes/<node_id>/delta_<local_step>.safetensors   one worker writes it once, never rewritten
    nodes/<node_id>/init.safetensors                 a worker's offered initial weights
    global/manifest.json                             the published version (see diloco_lightning.wire.manifest)
    global/weights_<outer_step>_<token>.safetensors  versioned weights, named by the manifest
    global/outer_state_<outer_step>_<token>.safetensors  the outer optimizer state of that version
    global/lease.json                                which master may publish (holder, epoch, expiry)
    nodes/<node_id>/claim.json                       which worker runs node_id now (diloco_lightning.wire.claims)
    global/latest.safetensors, global/step_count.json   compat="speedtronic" only: Speedtronic's view

Rules every transport keeps:

* Writers never overwrite a delta (``DeltaExistsError``); global files have a unique
  token in their names, so nothing a reader may hold open is ever rewritten. The one
  exception, the *mirrors* (``names.MIRROR_PATHS``: Speedtronic's fixed-name files, written
  only in ``compat="speedtronic"``), are replaced by a rename or a commit, never rewritten in
  place, and always after the manifest that publishes their version.
* ``publish`` is one atomic step guarded by compare-and-swap on the manifest's
  ``outer_step``: of two masters publishing version N+1 over N, exactly one wins and
  the other gets ``PublishConflictError``. A crash at any point leaves the old version
  or the new one visible, never a mix.
* Downloads land in a cache namespaced by hub path, so ``nodes/a/delta_3`` and
  ``nodes/b/delta_3`` can never share a cache file (Speedtronic 2.0.0 averages three
  copies of one file exactly this way).
* Every path from the hub (listing, manifest) is validated by ``diloco_lightning.wire.names``
  before use; a bad node id or a path outside ``nodes/`` / ``global/`` raises
  ``InvalidNameError`` and nothing is written.
"""

from __future__ import annotations

import abc
import hashlib
import inspect
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Mapping, Union

from diloco_lightning.util.errors import DiLoCoError
from diloco_lightning.util.fileio import cache_root, sweep_stale_files, sweep_temporaries
from diloco_lightning.wire.manifest import Lease, Manifest
from diloco_lightning.hub.claims import NodeClaims
from diloco_lightning.wire.claims import NodeClaim
from diloco_lightning.wire.names import (
    GLOBAL_DIR,
    MANIFEST_PATH,
    MIRROR_PATHS,
    NODES_DIR,
    RESERVED_GLOBAL_PATHS,
    DeltaId,
    InvalidNameError,
    validate_global_data_path,
    validate_hub_path,
)

log = logging.getLogger(__name__)


#: what a mirror is made from: a local file, or its bytes
MirrorSource = Union[str, os.PathLike, bytes]


class HubError(DiLoCoError, RuntimeError):
    """A hub operation failed for a reason that retrying will not fix."""


class DeltaExistsError(HubError):
    """A delta with this (node_id, local_step) is already on the hub; deltas are never rewritten."""


class PublishConflictError(HubError):
    """Compare-and-swap lost: the hub's current version is not the one this publication expected."""

    def __init__(self, expected: int | None, found: int | None, detail: str = "") -> None:
        self.expected = expected
        self.found = found
        msg = (
            f"publication refused: expected current outer_step {expected}, hub has {found}"
            f" (another master published first){': ' + detail if detail else ''}"
        )
        super().__init__(msg)


class LeaseConflictError(HubError):
    """Compare-and-swap on the lease lost: someone else changed it first."""


class ClaimConflictError(HubError):
    """Compare-and-swap on a node claim lost: someone else changed ``nodes/<node_id>/claim.json`` first."""


class HubNotFoundError(HubError):
    """The hub (folder or repository) or a file on it does not exist."""


class HubAuthError(HubError):
    """401/403 from a remote hub: missing or insufficient token. Never retried."""


class HubUnavailableError(HubError):
    """A remote hub kept answering 429/5xx or timing out after every retry, or asked for a pause
    longer than a retry may wait. ``retry_after``: the seconds the server asked for (None if it
    did not say); whoever retries later waits at least that long."""

    def __init__(self, msg: str, retry_after: float | None = None) -> None:
        super().__init__(msg)
        self.retry_after = retry_after


class HubFileTooLargeError(HubError):
    """A download was stopped: the file is larger than the reader allows (``max_bytes``)."""


@dataclass(frozen=True, order=True)
class DeltaRef:
    """A delta seen in a listing (nothing downloaded). Sorted by node, local step, path.

    ``size`` is the file size the hub reports (None if unknown); ``version`` an opaque token
    that changes when a file is replaced at the same path (inode and mtime on a folder, the
    blob id on the Hugging Face Hub), so a reader can remember a file it refused without
    also refusing a different file put at that path later.
    """

    node_id: str
    local_step: int
    path: str
    size: int | None = None
    version: str | None = None

    @property
    def identity(self) -> DeltaId:
        return DeltaId(self.node_id, self.local_step)


def default_cache_dir(url: str) -> Path:
    """One folder per hub URL under ``$DILOCO_CACHE`` (the older, downloads-only name) or
    :func:`~diloco_lightning.util.fileio.cache_root` (``$DILOCO_CACHE_DIR``, ``~/.cache/diloco_lightning``)."""
    root = Path(os.environ["DILOCO_CACHE"]).expanduser() if os.environ.get("DILOCO_CACHE") else cache_root()
    return root / hashlib.sha256(url.encode()).hexdigest()[:16]


def check_publication(
    manifest: Manifest,
    files: Mapping[str, str | os.PathLike],
    *,
    expected_outer_step: int | None,
    delete: Iterable[str] = (),
    source: str = "hub",
    expected_digest: str | None = None,
) -> tuple[dict[str, str | os.PathLike], list[str]]:
    """The transport-independent checks of ``Hub.publish``, done before anything is written.

    Raises ``ManifestError`` (a manifest naming a path outside ``global/``, a bad ledger
    node id ...), ``ValueError`` (the new ``outer_step`` does not exceed
    ``expected_outer_step``), ``InvalidNameError`` (an uploaded file outside ``global/``
    or named like the manifest/lease; a deletion outside ``nodes/``/``global/``, of the
    manifest or lease, or of a file the new manifest names or this publication uploads)
    and ``FileNotFoundError`` (a local file that does not exist). Returns ``files`` as a
    dict and ``delete`` as a validated list. Whether the manifest's files exist on the hub
    is left to the transport.
    """
    manifest.validate(source=f"manifest of outer_step {manifest.outer_step} for {source}")
    if expected_digest is None and expected_outer_step is not None and manifest.outer_step <= expected_outer_step:
        raise ValueError(
            f"publish: the new manifest's outer_step {manifest.outer_step} must exceed the expected "
            f"current one {expected_outer_step}"
        )
    files = dict(files)
    for hub_path, src in files.items():
        validate_global_data_path(hub_path)
        if not os.path.isfile(src):
            raise FileNotFoundError(f"publish: local file {os.fspath(src)!r} for {hub_path} does not exist")
    delete = [validate_hub_path(p) for p in delete]
    live = set(manifest.files())
    for p in delete:
        if p in RESERVED_GLOBAL_PATHS:
            raise InvalidNameError(f"refusing to delete {p!r}")
        if p in live or p in files:
            raise InvalidNameError(f"refusing to delete {p!r}: the new manifest names it or this publication uploads it")
    return files, delete


def check_mirrors(
    mirrors: Mapping[str, MirrorSource] | None, files: Iterable[str] = (), delete: Iterable[str] = ()
) -> dict[str, MirrorSource]:
    """The checks of ``Hub.publish``'s ``mirrors``, before anything is written: each is one of
    ``names.MIRROR_PATHS`` and its local file exists; no mirror path is among the publication's
    unique-name ``files`` or its deletions (``InvalidNameError``, ``FileNotFoundError``).
    Returns the mirrors as a dict, in their order."""
    out = dict(mirrors or {})
    for hub_path, src in out.items():
        if hub_path not in MIRROR_PATHS:
            raise InvalidNameError(f"refusing mirror {hub_path!r}: mirrors are {sorted(MIRROR_PATHS)}")
        if not isinstance(src, bytes) and not os.path.isfile(src):
            raise FileNotFoundError(f"publish: local file {os.fspath(src)!r} for {hub_path} does not exist")
    for p in [*files, *delete]:
        if p in MIRROR_PATHS:
            raise InvalidNameError(f"refusing {p!r} as a file or a deletion of a publication: it is a mirror")
    return out


def own_options(cls: Callable[..., Any], what: str, url: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``options`` that ``cls``'s constructor takes (its keyword-only parameters). One it does not take
    is a ``ValueError`` naming ``what`` (``"the S3 hub"``) and ``url``, unless it is None (an option meant
    for another transport and left unset: one configuration serves every transport)."""
    params = inspect.signature(cls).parameters.values()
    takes = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    unknown = sorted(k for k, v in options.items() if k not in takes and v is not None)
    if unknown:
        raise ValueError(f"open_hub: option(s) {unknown} do not apply to {what} {url!r} (it takes {sorted(takes)})")
    return {k: v for k, v in options.items() if k in takes}


@dataclass(frozen=True)
class Publication:
    """One publication, checked (:func:`check_publication`, :func:`check_mirrors`): what
    :meth:`Hub.publish` hands its transport's ``_publish``. ``files``: hub path -> local file;
    ``delete``: validated hub paths; ``mirrors``: mirror path -> local file or bytes, in order."""

    manifest: Manifest
    files: dict[str, str | os.PathLike]
    delete: list[str]
    mirrors: dict[str, MirrorSource]
    expected_outer_step: int | None
    expected_digest: str | None


class Hub(abc.ABC):
    """A transport. Thread-safe: the worker's uploader thread and the master's download pool share one.

    A transport class declares its ``scheme`` and ``url_forms``, its capabilities (``creatable``,
    ``rate_limited_writes``, ``private_downloads``) and :meth:`from_url`, and is registered once
    (:mod:`diloco_lightning.hub.transports`)."""

    #: the URL scheme this transport serves (its registry key; ``"file"`` also serves a plain path)
    scheme: ClassVar[str] = ""
    #: how its URLs are written, for the error that lists every transport's (``"hf://org/repo"``)
    url_forms: ClassVar[tuple[str, ...]] = ()
    #: whether ``create=True`` creates a hub that does not exist (a folder, a repository; never an
    #: S3 bucket): a caller that cannot create one asks the hub's transport, not its scheme
    creatable: ClassVar[bool] = True

    #: canonical URL (``file:///abs/path`` or ``hf://org/repo``)
    url: str
    #: local folder for downloads; files inside are named by their hub path
    cache_dir: Path
    #: the folder of a hub that is a local folder (None for remote transports)
    local_root: Path | None = None
    #: whether every write is a commit the transport rate-limits (the Hugging Face Hub): periodic
    #: writes (the master's lease, a worker's claim) then default to long intervals
    rate_limited_writes: bool = False
    #: whether what :meth:`download` returns is this process's own copy (a remote hub's cache),
    #: which no other writer can change while it is read; the folder hub returns files in place
    private_downloads: bool = True
    #: the part holding this transport's node claims (:class:`~diloco_lightning.hub.claims.NodeClaims`;
    #: None: it holds none)
    claims: "NodeClaims | None" = None

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "Hub":
        """The hub at ``url`` (of this transport's scheme) opened with ``options``: what
        :func:`~diloco_lightning.hub.open_hub` calls. Raises ``ValueError`` on a malformed URL or an
        option this transport does not take (one given as None is ignored: one configuration serves
        every transport)."""
        raise NotImplementedError(f"{cls.__name__} cannot be opened from a URL")

    # ------------------------------------------------------------------ workers

    @abc.abstractmethod
    def upload_delta(self, local_file: str | os.PathLike, node_id: str, local_step: int) -> str:
        """Put a delta file on the hub as ``nodes/<node_id>/delta_<local_step>.safetensors``.

        Returns the hub path. Raises ``DeltaExistsError`` if that path exists (never overwritten).
        """

    @abc.abstractmethod
    def upload_init(self, local_file: str | os.PathLike, node_id: str) -> str:
        """Offer a worker's initial weights as ``nodes/<node_id>/init.safetensors`` (first writer wins)."""

    # ------------------------------------------------------------------ master

    @abc.abstractmethod
    def list_deltas(self, after: Mapping[str, int] | None = None) -> list[DeltaRef]:
        """Deltas on the hub, sorted by (node_id, local_step, path), without downloading them.

        ``after`` is a ledger: a delta of node n with ``local_step <= after[n]`` is left out.
        Files under ``nodes/`` that are not valid delta paths are ignored (and logged once).
        """

    def list_node_deltas(self, node_id: str, after: int = -1) -> list[DeltaRef]:
        """``node_id``'s deltas with ``local_step > after``, sorted (what a worker asks about itself);
        a transport may list that node's files only."""
        return [r for r in self.list_deltas(after={node_id: after}) if r.node_id == node_id]

    @abc.abstractmethod
    def list_inits(self) -> list[str]:
        """Node ids that offered ``init.safetensors``, sorted."""

    @abc.abstractmethod
    def list_global(self) -> list[str]:
        """Every hub path under ``global/`` (for garbage collection of orphans)."""

    @abc.abstractmethod
    def download(self, hub_path: str, *, max_bytes: int | None = None) -> Path:
        """A local path holding the file ``hub_path`` (validated first).

        Remote transports download into ``cache_dir / hub_path`` (atomically, reusing
        a complete cached copy: every hub file is immutable). The folder transport may
        return the file in place. Raises ``HubNotFoundError`` if it does not exist, and
        ``HubFileTooLargeError`` (before or while transferring it, never after a full
        transfer) if it is larger than ``max_bytes``.
        """

    @abc.abstractmethod
    def read_manifest_bytes(self) -> bytes | None:
        """The current ``global/manifest.json`` as stored (None if there is none), unparsed. A file
        over the largest manifest may be read only in part (up to one byte past it), or not at all on
        S3 (a stand-in naming its size and version): enough to refuse it, and to replace it by
        compare-and-swap on the digest of what was read."""

    def read_manifest(self) -> Manifest | None:
        """The current manifest, or None if nothing was ever published. Raises ``ManifestError``
        if the file is not a valid manifest."""
        data = self.read_manifest_bytes()
        if data is None:
            return None
        return Manifest.from_json(data, source=f"{self.url}/{MANIFEST_PATH}")

    def publish(
        self,
        manifest: Manifest,
        files: Mapping[str, str | os.PathLike],
        *,
        expected_outer_step: int | None,
        delete: Iterable[str] = (),
        expected_digest: str | None = None,
        mirrors: Mapping[str, MirrorSource] | None = None,
    ) -> None:
        """Publish ``manifest`` and upload ``files`` (``hub path -> local file``, all under
        ``global/``) as one atomic step, if and only if the hub's current manifest has
        ``outer_step == expected_outer_step`` (None: no manifest yet). Otherwise raise
        ``PublishConflictError`` and publish nothing.

        With ``expected_digest`` the condition is instead that the current manifest file's
        bytes have that SHA-256 (whatever they hold): how a master replaces a manifest that
        is malformed or, in a signed run, not authentic.

        ``delete`` (hub paths) are removed in the same publication where the transport
        can (Hugging Face: the same commit), else right after the manifest swap.

        ``mirrors`` (``hub path -> local file or bytes``, paths of ``names.MIRROR_PATHS``)
        replace those fixed-name files in the same publication, *after* the manifest and in
        the given order: in the same commit on the Hugging Face Hub; on a folder, renamed into
        place under the publication lock right after the manifest; on S3, written right after
        the manifest's conditional PUT. A mirror that fails after the manifest is in place is
        logged, not raised (the version is published; the next publication writes the mirrors
        again).

        ``manifest.outer_step`` must exceed ``expected_outer_step``. Every check of
        :func:`check_publication` runs first: a refused publication writes nothing.
        """
        files, dels = check_publication(
            manifest, files, expected_outer_step=expected_outer_step, delete=delete, source=self.url,
            expected_digest=expected_digest,
        )
        self._publish(Publication(manifest, files, dels, check_mirrors(mirrors, files, dels), expected_outer_step,
                                  expected_digest))

    @abc.abstractmethod
    def _publish(self, pub: Publication) -> None:
        """:meth:`publish` of this transport, given the publication its checks passed."""

    @abc.abstractmethod
    def delete(self, paths: Iterable[str]) -> None:
        """Remove hub files (garbage collection outside a publication). Missing files are ignored."""

    @abc.abstractmethod
    def read_lease(self) -> Lease | None:
        """The current master lease, or None."""

    @abc.abstractmethod
    def write_lease(self, lease: Lease | None, *, expected: Lease | None) -> None:
        """Replace the lease by ``lease`` (None: remove it) iff the current one equals ``expected``;
        else raise ``LeaseConflictError``."""

    # ------------------------------------------------------------------ node claims (optional: a transport
    # without them still works; the worker then cannot detect a duplicate node_id)

    def read_claim(self, node_id: str) -> "NodeClaim | None":
        """The current claim on ``node_id`` (``nodes/<node_id>/claim.json``), or None. An unreadable
        claim (malformed, too large, another node's) counts as none, with a warning."""
        if self.claims is None:
            raise NotImplementedError(f"{type(self).__name__} does not hold node claims")
        return self.claims.read(node_id)

    def write_claim(self, node_id: str, claim: "NodeClaim | None", *, expected: "NodeClaim | None") -> None:
        """Replace the claim on ``node_id`` by ``claim`` (None: remove it) iff the current one equals
        ``expected`` (None: there is none, or it is unreadable); else raise ``ClaimConflictError``."""
        if self.claims is None:
            raise NotImplementedError(f"{type(self).__name__} does not hold node claims")
        if claim is not None and claim.node_id != node_id:
            raise ValueError(f"write_claim: a claim for {claim.node_id!r} written as {node_id!r}'s")
        self.claims.write(node_id, claim, expected=expected)

    def list_claims(self) -> dict[str, "NodeClaim"]:
        """Every readable claim on the hub, by node id (who runs which node, and each heartbeat's
        ``info``): what the master's membership and the workers' Dynamic Local Updates read. An
        unreadable claim (malformed, too large, another node's) is left out, with a warning."""
        if self.claims is None:
            raise NotImplementedError(f"{type(self).__name__} does not hold node claims")
        return self.claims.read_all()

    # ------------------------------------------------------------------ common

    def commit_wait(self, node_id: str | None = None) -> float:
        """Seconds to wait before the next write for ``node_id`` (None: the master's publication)
        stays within the transport's write rate limit; 0 means now. A writer that can wait (a
        worker with a delta to send, a master with a round to publish) holds its work back and
        merges it with what comes next instead of meeting the limit. Transports without a
        limit: always 0."""
        return 0.0

    def download_delta(self, ref: DeltaRef) -> Path:
        return self.download(ref.path)

    def release(self, local_path: str | os.PathLike) -> None:
        """A copy :meth:`download` returned is no longer needed: remote transports remove it from
        their cache (the folder hub returns files in place and keeps them)."""
        try:
            p = Path(local_path).resolve()
            if p.is_relative_to(Path(self.cache_dir).resolve()):
                p.unlink(missing_ok=True)
        except OSError:
            pass

    def sweep_cache(self, max_age: float) -> list[str]:
        """This handle's download cache: temporaries of interrupted downloads whose owner process is
        gone (or older than ``max_age`` seconds), and complete copies unchanged for ``max_age`` (every
        download is released once read, so what stays was left by a killed process). What a worker
        runs at start: its cache keeps what it needs and no more. Returns what was removed.

        Only the folders a download lands in (``nodes/`` and ``global/``: every hub path is under one)
        are swept: the cache folder also holds what is not a download, such as the master's local
        state (``diloco-master``'s default ``<cache>/master``), which must survive its own sweep."""
        removed: list[str] = []
        for sub in (NODES_DIR, GLOBAL_DIR):
            folder = Path(self.cache_dir) / sub
            if folder.is_dir():
                removed += sweep_temporaries(folder, max_age, recursive=True) + sweep_stale_files(folder, max_age)
        return removed

    def sweep(self, max_age: float) -> list[str]:
        """Remove what dead writers left behind (temporary files of interrupted uploads and
        downloads, here and in the cache: :meth:`sweep_cache`): files whose owner process is known to
        be dead, or older than ``max_age`` seconds; never a live writer's file. What the master runs
        at start and with garbage collection. Returns what was removed (for the log)."""
        return self.sweep_cache(max_age)

    def close(self) -> None:  # noqa: B027 - optional: most transports hold nothing to release
        """Release resources (HTTP sessions, thread pools)."""

    def __enter__(self) -> "Hub":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
