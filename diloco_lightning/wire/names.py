"""Names on the hub: node ids, delta paths, and the allow-list of hub paths.

Every path that comes from the hub (a listing, a manifest) goes through these
functions before it is used, so a hostile or corrupt hub cannot make a reader
touch anything outside ``nodes/`` and ``global/`` (Speedtronic follows any
``model_file`` it is given).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from diloco_lightning.util.errors import DiLoCoError

NODE_ID_RE = re.compile(r"(?!\.)[A-Za-z0-9._-]{1,64}")
#: Steps (``local_step``, ``outer_step``, ``base_outer_step``) are below 10**18: at most 18
#: decimal digits. A longer number from a hub (a path, a header) is malformed, never parsed:
#: Python refuses to convert strings of over 4300 digits, and no run takes 10**18 steps.
MAX_STEP = 10**18 - 1
#: the highest counter a master adopts from a hub: one above it leaves fewer than 10**9 steps to run
#: before MAX_STEP (a real run is nowhere near; a forged one is refused with a reason, not adopted and
#: then failing every round)
MAX_ADOPTED_STEP = MAX_STEP - 10**9
_STEP = r"0|[1-9][0-9]{0,17}"
_LOCAL_STEP_RE = re.compile(_STEP)
_DELTA_PATH_RE = re.compile(rf"nodes/((?!\.)[A-Za-z0-9._-]{{1,64}})/delta_({_STEP})\.safetensors")
_INIT_PATH_RE = re.compile(r"nodes/((?!\.)[A-Za-z0-9._-]{1,64})/init\.safetensors")
_CLAIM_PATH_RE = re.compile(r"nodes/((?!\.)[A-Za-z0-9._-]{1,64})/claim\.json")
# Files the master writes: versioned weights / optimizer state, the manifest, the lease.
_GLOBAL_NAME_RE = re.compile(r"global/[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")

NODES_DIR = "nodes"
CLAIM_NAME = "claim.json"  # nodes/<node_id>/claim.json: the node's claim on its id (diloco_lightning.wire.claims)
GLOBAL_DIR = "global"
MANIFEST_PATH = "global/manifest.json"
LEASE_PATH = "global/lease.json"
#: Speedtronic's fixed-name view of the current version: its workers read these two files. A
#: master in ``compat="speedtronic"`` replaces them with each publication (``Hub.publish``'s
#: ``mirrors``), after the manifest; see diloco_lightning.master.compat.
LATEST_WEIGHTS_PATH = "global/latest.safetensors"
STEP_COUNT_PATH = "global/step_count.json"
#: the only global files a publication replaces in place (every other global file has a unique name)
MIRROR_PATHS = frozenset({LATEST_WEIGHTS_PATH, STEP_COUNT_PATH})


class InvalidNameError(DiLoCoError, ValueError):
    """A node id, local step or hub path outside what docs/spec.md allows."""


class DeltaId(NamedTuple):
    """The identity of a delta: one per (node, local_step), never rewritten."""

    node_id: str
    local_step: int


def validate_node_id(node_id: object) -> str:
    """Return ``node_id`` if it is 1-64 chars of ``[A-Za-z0-9._-]`` not starting with a dot."""
    if not isinstance(node_id, str) or NODE_ID_RE.fullmatch(node_id) is None:
        raise InvalidNameError(
            f"invalid node_id {node_id!r}: expected 1 to 64 characters of [A-Za-z0-9._-], not starting with '.'"
        )
    return node_id


def validate_local_step(local_step: object) -> int:
    """Return ``local_step`` as an int if it is an integer in ``[0, MAX_STEP]`` (bools refused)."""
    if isinstance(local_step, bool) or not isinstance(local_step, int) or not 0 <= local_step <= MAX_STEP:
        raise InvalidNameError(f"invalid local_step {local_step!r}: expected an integer from 0 to {MAX_STEP}")
    return local_step


def parse_local_step(text: str) -> int:
    """Parse a header/path step: at most 18 decimal digits, no sign, no leading zeros."""
    if not isinstance(text, str) or _LOCAL_STEP_RE.fullmatch(text) is None:
        shown = text if not isinstance(text, str) or len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"
        raise InvalidNameError(f"invalid step {shown!r}: expected a decimal integer from 0 to {MAX_STEP}")
    return int(text)


def delta_path(node_id: str, local_step: int) -> str:
    """``nodes/<node_id>/delta_<local_step>.safetensors`` after validating both parts."""
    return f"{NODES_DIR}/{validate_node_id(node_id)}/delta_{validate_local_step(local_step)}.safetensors"


def init_path(node_id: str) -> str:
    """``nodes/<node_id>/init.safetensors``: a worker's offered initial weights."""
    return f"{NODES_DIR}/{validate_node_id(node_id)}/init.safetensors"


def claim_path(node_id: str) -> str:
    """``nodes/<node_id>/claim.json``: who runs ``node_id`` now (not a delta; listings skip it)."""
    return f"{NODES_DIR}/{validate_node_id(node_id)}/{CLAIM_NAME}"


def parse_claim_path(path: str) -> str | None:
    """The node_id of a claim path, or None if ``path`` is not one."""
    m = _CLAIM_PATH_RE.fullmatch(path) if isinstance(path, str) else None
    return None if m is None else m.group(1)


def parse_delta_path(path: str) -> DeltaId | None:
    """The (node_id, local_step) of a delta path, or None if ``path`` is not one."""
    m = _DELTA_PATH_RE.fullmatch(path)
    if m is None:
        return None
    return DeltaId(m.group(1), int(m.group(2)))


def parse_init_path(path: str) -> str | None:
    """The node_id of an init path, or None if ``path`` is not one."""
    m = _INIT_PATH_RE.fullmatch(path)
    return None if m is None else m.group(1)


def validate_global_path(path: object) -> str:
    """Return ``path`` if it names a file directly under ``global/`` (no ``..``, no sub-folders)."""
    if not isinstance(path, str) or _GLOBAL_NAME_RE.fullmatch(path) is None or ".." in path:
        raise InvalidNameError(f"refusing hub path {path!r}: only files directly under 'global/' may be named here")
    return path


RESERVED_GLOBAL_PATHS = frozenset({MANIFEST_PATH, LEASE_PATH})


def validate_global_data_path(path: object) -> str:
    """Return ``path`` if it may name a published data file (weights, optimizer state): a file
    directly under ``global/`` that is not the manifest or the lease."""
    path = validate_global_path(path)
    if path in RESERVED_GLOBAL_PATHS:
        raise InvalidNameError(f"refusing hub path {path!r}: reserved for the hub itself, not a data file")
    return path


def validate_hub_path(path: object) -> str:
    """Return ``path`` if it is a delta, an init file, or a file under ``global/``; else raise."""
    if isinstance(path, str) and (parse_delta_path(path) or parse_init_path(path)):
        return path
    try:
        return validate_global_path(path)
    except InvalidNameError:
        raise InvalidNameError(
            f"refusing hub path {path!r}: only nodes/<node_id>/delta_<step>.safetensors, "
            "nodes/<node_id>/init.safetensors and global/<file> exist on a hub"
        ) from None


def _token_ok(token: str) -> str:
    if not isinstance(token, str) or re.fullmatch(r"[0-9a-f]{8,32}", token) is None:
        raise InvalidNameError(f"invalid publication token {token!r}: expected 8-32 lowercase hex digits")
    return token


def global_weights_path(outer_step: int, token: str) -> str:
    """The weights file of ``outer_step``; ``token`` is unique per publication attempt, so two
    masters racing for the same version never write the same file (zero-padded: listings sort)."""
    return f"{GLOBAL_DIR}/weights_{validate_local_step(outer_step):09d}_{_token_ok(token)}.safetensors"


def global_outer_state_path(outer_step: int, token: str) -> str:
    """The outer optimizer state published with ``outer_step`` (see :func:`global_weights_path`)."""
    return f"{GLOBAL_DIR}/outer_state_{validate_local_step(outer_step):09d}_{_token_ok(token)}.safetensors"
