"""Published global versions: staging the files of a new version, and loading one back.

The master stages a version with :func:`stage_global` (the weights and the outer
optimizer state, written atomically under fresh unique names, with their SHA-256 and the
model fingerprint), builds its :class:`~diloco_lightning.wire.manifest.Manifest` and hands both
to ``Hub.publish``. Workers and a restarting master read it back with
:func:`load_global` / :func:`load_outer_state`, which follow only the paths the manifest
names (already checked to lie directly under ``global/``) and, by default, verify each
file's SHA-256 against the manifest before loading it; a mismatch raises
:class:`GlobalIntegrityError` naming the file.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from diloco_lightning.util.errors import DiLoCoError
from diloco_lightning.wire.delta import model_fingerprint
from diloco_lightning.util.fileio import sha256_file
from diloco_lightning.hub.base import Hub, HubError, HubNotFoundError
from diloco_lightning.wire.manifest import Manifest
from diloco_lightning.wire.names import global_outer_state_path, global_weights_path
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.wire.statefile import (
    DigestMismatchError,
    StateFileError,
    load_state_file,
    load_weights_file,
    save_state_file,
    save_weights_file,
)

log = logging.getLogger(__name__)

__all__ = [
    "GlobalIntegrityError",
    "UnauthenticatedVersionError",
    "NothingPublishedError",
    "verify_manifest",
    "read_verified_manifest",
    "load_weights_at",
    "StagedGlobal",
    "stage_global",
    "load_global",
    "load_outer_state",
    "export_global",
    "EXPORT_WEIGHTS",
    "EXPORT_INFO",
]

#: what :func:`export_global` writes in its folder: the weights, and what they are
EXPORT_WEIGHTS, EXPORT_INFO = "model.safetensors", "diloco_global.json"


class GlobalIntegrityError(HubError):
    """A published global file that is not what the manifest promises (SHA-256, fingerprint,
    unreadable). ``hub_path`` names it on the hub, ``local_path`` where it was read."""

    def __init__(self, hub_path: str, local_path: str | os.PathLike, detail: str) -> None:
        self.hub_path = hub_path
        self.local_path = str(local_path)
        self.detail = detail
        super().__init__(f"{hub_path} (read from {self.local_path}): {detail}")


class NothingPublishedError(HubNotFoundError):
    """The hub has no manifest yet: no global version was ever published."""


class UnauthenticatedVersionError(HubError):
    """In a signed run, a published manifest without the run key's valid signature."""

    def __init__(self, hub_url: str, manifest: Manifest, detail: str) -> None:
        self.outer_step = manifest.outer_step
        super().__init__(
            f"refusing global version {manifest.outer_step} on {hub_url}: {detail} (the run is signed: only a master "
            "holding the run key can publish; someone else wrote global/manifest.json)"
        )


def verify_manifest(manifest: Manifest, signing_key: RunKey | None, hub_url: str) -> Manifest:
    """``manifest`` if the run is unsigned or it carries the run key's signature, else raise
    :class:`UnauthenticatedVersionError` naming it."""
    if signing_key is None:
        return manifest
    if manifest.signature is None:
        raise UnauthenticatedVersionError(hub_url, manifest, "it carries no signature")
    if not manifest.verify(signing_key):
        raise UnauthenticatedVersionError(hub_url, manifest, "its signature does not match the run key")
    return manifest


def read_verified_manifest(hub: Hub, signing_key: RunKey | None) -> Manifest | None:
    """``hub.read_manifest()`` checked with :func:`verify_manifest` (None: nothing published)."""
    m = hub.read_manifest()
    return None if m is None else verify_manifest(m, signing_key, hub.url)


@dataclass
class StagedGlobal:
    """The local files of a version about to be published, and what its manifest must say."""

    outer_step: int
    token: str
    weights: str
    weights_sha256: str
    model_fingerprint: str
    outer_state: str | None = None
    outer_state_sha256: str | None = None
    #: ``hub path -> local file``, as ``Hub.publish(files=...)`` takes it
    files: dict[str, Path] = field(default_factory=dict)

    def manifest(self, **fields: Any) -> Manifest:
        """A manifest naming these files; ``fields`` sets the rest (``ledger``, ``history`` ...)."""
        kw: dict[str, Any] = dict(
            outer_step=self.outer_step,
            weights=self.weights,
            weights_sha256=self.weights_sha256,
            model_fingerprint=self.model_fingerprint,
            outer_state=self.outer_state,
            outer_state_sha256=self.outer_state_sha256,
        )
        kw.update(fields)
        return Manifest(**kw)


def stage_global(
    workdir: str | os.PathLike,
    outer_step: int,
    state: Mapping[str, torch.Tensor],
    outer_state: Mapping[str, Any] | None = None,
    *,
    token: str | None = None,
) -> StagedGlobal:
    """Write ``state`` (and the outer optimizer's ``state_dict()``) into ``workdir`` under the
    names they will have on the hub, with a fresh token unless one is given."""
    token = token or secrets.token_hex(8)
    workdir = Path(workdir)
    weights = global_weights_path(outer_step, token)
    local_weights = workdir / Path(weights).name
    save_weights_file(local_weights, state, metadata={"outer_step": str(outer_step)})
    staged = StagedGlobal(
        outer_step=outer_step,
        token=token,
        weights=weights,
        weights_sha256=sha256_file(local_weights),
        model_fingerprint=model_fingerprint(state),
        files={weights: local_weights},
    )
    if outer_state is not None:
        staged.outer_state = global_outer_state_path(outer_step, token)
        local_state = workdir / Path(staged.outer_state).name
        save_state_file(local_state, outer_state, metadata={"outer_step": str(outer_step)})
        staged.outer_state_sha256 = sha256_file(local_state)
        staged.files[staged.outer_state] = local_state
    return staged


class _Vanished(DiLoCoError):
    """A file the manifest named disappeared while it was read (garbage-collected)."""

    def __init__(self, error: HubNotFoundError) -> None:
        super().__init__(str(error))
        self.error = error


def _load_verified(hub: Hub, hub_path: str, sha256: str | None, verify: bool, reader, keep: bool = False):
    """Download ``hub_path`` and read it with ``reader(local, expect_sha256)`` (one open file:
    the digest checked is that of the bytes loaded). The downloaded copy is released once read
    (:meth:`Hub.release`: a remote hub's cache keeps no version it has loaded) unless ``keep``."""
    try:
        local = hub.download(hub_path)
    except HubNotFoundError as e:
        raise _Vanished(e) from None
    try:
        out = reader(local, sha256 if verify else None), local
        if not keep:
            hub.release(local)
        return out
    except FileNotFoundError:
        raise _Vanished(HubNotFoundError(f"{hub_path} vanished from {hub.url} while it was read")) from None
    except DigestMismatchError as e:
        raise GlobalIntegrityError(hub_path, local, f"{e.detail}, as the manifest promises") from None
    except StateFileError as e:
        if not local.exists():
            raise _Vanished(HubNotFoundError(f"{hub_path} vanished from {hub.url} while it was read")) from None
        raise GlobalIntegrityError(hub_path, local, str(e)) from None


def load_weights_at(
    hub: Hub, hub_path: str, sha256: str | None, fingerprint: str | None, *, verify: bool = True
) -> dict[str, torch.Tensor]:
    """The weights file ``hub_path``, checked against ``sha256`` and the model ``fingerprint``
    (each when given and ``verify``). Raises ``HubNotFoundError`` if it is gone."""
    try:
        (state, _), local = _load_verified(hub, hub_path, sha256, verify, load_weights_file)
    except _Vanished as v:
        raise v.error from None
    if verify and fingerprint is not None:
        fp = model_fingerprint(state)
        if fp != fingerprint:
            raise GlobalIntegrityError(hub_path, local, f"model fingerprint is {fp}, the manifest says {fingerprint}")
    return state


def load_global(
    hub: Hub,
    manifest: Manifest | None = None,
    *,
    verify: bool = True,
    attempts: int = 3,
    signing_key: RunKey | None = None,
    keep_file: bool = False,
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """The manifest and the global weights it names (CPU tensors that own their memory).

    Without ``manifest`` the hub's current one is read, and if its weights are
    garbage-collected while being read (a newer version was published meanwhile) the
    manifest is read again, up to ``attempts`` times. With ``verify`` the file's SHA-256
    and the state's fingerprint must equal the manifest's (``GlobalIntegrityError``).
    With ``signing_key`` the manifest must carry its signature (``UnauthenticatedVersionError``).
    Raises ``NothingPublishedError`` when nothing was ever published and
    ``HubNotFoundError`` when a given manifest's weights are gone. The downloaded file is released
    once loaded (the tensors own their memory) unless ``keep_file``.
    """
    follow = manifest is None
    for attempt in range(1, max(1, attempts) + 1):
        if follow:
            manifest = hub.read_manifest()
            if manifest is None:
                raise NothingPublishedError(f"nothing published on {hub.url} yet (no global/manifest.json)")
        assert manifest is not None
        verify_manifest(manifest, signing_key, hub.url)
        try:
            (state, _), local = _load_verified(hub, manifest.weights, manifest.weights_sha256, verify, load_weights_file,
                                               keep_file)
        except _Vanished as v:
            if not follow or attempt >= attempts:
                raise v.error from None
            log.info("%s; re-reading the manifest (attempt %d of %d)", v.error, attempt + 1, attempts)
            continue
        if verify:
            fp = model_fingerprint(state)
            if fp != manifest.model_fingerprint:
                raise GlobalIntegrityError(
                    manifest.weights, local, f"model fingerprint is {fp}, the manifest says {manifest.model_fingerprint}"
                )
        return manifest, state
    raise AssertionError("unreachable")  # pragma: no cover


def load_outer_state(hub: Hub, manifest: Manifest, *, verify: bool = True, signing_key: RunKey | None = None,
                     keep_file: bool = False) -> Any | None:
    """The outer optimizer's state dict published with ``manifest``, or None if it names none.

    With ``verify`` (and a ``outer_state_sha256`` in the manifest) the file's SHA-256 must match;
    with ``signing_key`` the manifest must be signed with it.
    """
    verify_manifest(manifest, signing_key, hub.url)
    if manifest.outer_state is None:
        return None
    try:
        (state, _), _local = _load_verified(hub, manifest.outer_state, manifest.outer_state_sha256, verify, load_state_file,
                                            keep_file)
    except _Vanished as v:
        raise v.error from None
    return state


def export_global(hub: Hub, out_dir: str | os.PathLike, *, signing_key: RunKey | None = None,
                  manifest: Manifest | None = None) -> Path:
    """Write the hub's newest global version (or ``manifest``'s) to ``out_dir`` as a plain model:
    ``model.safetensors`` (the global state, loadable with ``safetensors.torch.load_file`` and
    ``module.load_state_dict``; its metadata holds ``outer_step`` and ``model_fingerprint``) and
    ``diloco_global.json`` (``outer_step``, ``model_fingerprint``, the file's ``sha256``, the hub and
    the version's path on it). The version is read as every install reads it (:func:`load_global`:
    the manifest's SHA-256 and fingerprint checked; in a signed run its signature too), and each file
    is written atomically. Returns the path of ``model.safetensors``. ``diloco-export`` is its command."""
    from diloco_lightning.util.fileio import atomic_write_json

    m, state = load_global(hub, manifest, signing_key=signing_key)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"outer_step": str(m.outer_step), "model_fingerprint": m.model_fingerprint}
    weights = out / EXPORT_WEIGHTS
    save_weights_file(weights, state, metadata=meta)
    atomic_write_json(out / EXPORT_INFO, {
        "format": "diloco-export/1",
        "outer_step": m.outer_step,
        "model_fingerprint": m.model_fingerprint,
        "sha256": sha256_file(weights),
        "hub": hub.url,
        "source": m.weights,
        "signed": m.signature is not None,
    })
    log.info("exported global version %d of %s to %s", m.outer_step, hub.url, weights)
    return weights
