"""The master's local state in ``node_state_dir``: a copy of the version it last published or adopted.

Layout::

    <node_state_dir>/master.json                                   the commit record (metadata_path)
    <node_state_dir>/weights_<outer_step>_<token>.safetensors      the weights (state_path)
    <node_state_dir>/outer_state_<outer_step>_<token>.safetensors  optimizer state + master state

The two data files are the very files that were published (same names as on the hub, same
SHA-256), written before the publication; ``master.json`` is replaced atomically after it
and is the commit point: it names the files and carries the published manifest, ledger
included. A crash at any point leaves either the previous record (whose files are still
there: old files are removed only after the new record is in place) or the new one.
Because the record is written *after* the remote publication, the hub is never older than
the local state, and on restart the master adopts whichever is newer (the hub on ties).
No pickle: the files are safetensors with a JSON header (``diloco_lightning.wire.statefile``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from diloco_lightning.util.fileio import atomic_write_json
from diloco_lightning.wire.manifest import Manifest, ManifestError

__all__ = ["LOCAL_FORMAT", "METADATA_NAME", "LocalRecord", "save_record", "load_record", "cleanup"]

log = logging.getLogger(__name__)

LOCAL_FORMAT = "diloco-master-local/1"
METADATA_NAME = "master.json"
_DATA_RE = re.compile(r"(weights|outer_state)_[0-9]{9}_[0-9a-f]{8,32}\.safetensors")


@dataclass
class LocalRecord:
    hub_url: str
    manifest: Manifest
    weights_file: Path
    outer_state_file: Path | None
    saved_at: float = 0.0

    @property
    def outer_step(self) -> int:
        return self.manifest.outer_step


def save_record(
    directory: Path, hub_url: str, manifest: Manifest, weights_file: Path, outer_state_file: Path | None
) -> LocalRecord:
    """Write ``master.json`` atomically (naming files already in ``directory``), then drop older files."""
    for f in (weights_file, outer_state_file):
        if f is not None and Path(f).parent.resolve() != directory.resolve():
            raise ValueError(f"local state file {f} is not in {directory}")
    rec = LocalRecord(hub_url, manifest, Path(weights_file), Path(outer_state_file) if outer_state_file else None, time.time())
    atomic_write_json(
        directory / METADATA_NAME,
        {
            "format": LOCAL_FORMAT,
            "hub_url": hub_url,
            "outer_step": manifest.outer_step,
            "weights_file": rec.weights_file.name,
            "outer_state_file": rec.outer_state_file.name if rec.outer_state_file else None,
            "manifest": json.loads(manifest.to_json()),
            "saved_at": rec.saved_at,
        },
    )
    cleanup(directory, keep={rec.weights_file.name} | ({rec.outer_state_file.name} if rec.outer_state_file else set()))
    return rec


def load_record(directory: Path) -> LocalRecord | None:
    """The committed local record, or None (none, unreadable, or its files are gone)."""
    path = directory / METADATA_NAME
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable local master state %s: %s", path, e)
        return None
    try:
        if not isinstance(doc, dict) or doc.get("format") != LOCAL_FORMAT:
            raise ValueError(f"format is {doc.get('format') if isinstance(doc, dict) else None!r}")
        manifest = Manifest.from_json(json.dumps(doc["manifest"]), source=str(path))
        names = [doc["weights_file"], doc.get("outer_state_file")]
        for n in names:
            if n is not None and (not isinstance(n, str) or _DATA_RE.fullmatch(n) is None):
                raise ValueError(f"bad file name {n!r}")
        weights = directory / names[0]
        outer = directory / names[1] if names[1] else None
        for f in (weights, outer):
            if f is not None and not f.is_file():
                raise ValueError(f"{f.name} is missing")
        return LocalRecord(str(doc["hub_url"]), manifest, weights, outer, float(doc.get("saved_at", 0.0)))
    except (KeyError, TypeError, ValueError, ManifestError) as e:
        log.warning("ignoring local master state %s: %s", path, e)
        return None


def cleanup(directory: Path, keep: set[str]) -> None:
    """Remove data files (and leftover temporaries of ours) not named in ``keep``."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return
    for e in entries:
        name = e.name
        ours = _DATA_RE.fullmatch(name) is not None or (
            name.startswith(".") and name.endswith(".tmp") and _DATA_RE.match(name[1:]) is not None
        )
        if ours and name not in keep:
            try:
                os.unlink(e.path)
            except FileNotFoundError:
                pass
            except OSError as err:
                log.warning("could not remove old local state file %s: %s", e.path, err)
