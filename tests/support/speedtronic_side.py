"""Speedtronic's side of the compatibility tests (tests/test_speedtronic.py): its real
``HubClient``, worker coordinator and master (PyPI ``speedtronic`` 2.0.0), on a folder or on the
loopback Hub server. Not a test module (no ``test_`` prefix).

Speedtronic only speaks the Hugging Face API: ``HubClient(repo_id, api=...)`` calls
``list_repo_files``, ``upload_file`` and ``hf_hub_download`` (``create_repo`` for its master) on
the object it is given. On the loopback server that object is a real ``HfApi``. For a folder hub
it is :class:`FolderHfApi`, those calls on a folder: an upload replaces the file atomically
(temporary file + rename, as a Hub commit replaces it), a download copies it. This is the
transport Speedtronic lacks, not a stand-in for a part of ours.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

speedtronic = pytest.importorskip(
    "speedtronic.distributed", reason="speedtronic is not installed (pip install speedtronic==2.0.0; CI installs it)"
)

from speedtronic.config import DistributedConfig  # noqa: E402
from speedtronic.distributed import DumbDiLoCoCoordinator, HubClient  # noqa: E402
from speedtronic.distributed.outer import MasterOuterLoop as SpeedtronicMaster  # noqa: E402

REPO = "org/run"

__all__ = ["REPO", "FolderHfApi", "client", "worker", "speedtronic_master", "SpeedtronicMaster", "HubClient"]


class FolderHfApi:
    """The part of ``huggingface_hub.HfApi`` that Speedtronic's ``HubClient`` calls, on a folder."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def create_repo(self, repo_id, repo_type="model", private=True, exist_ok=True):
        self.root.mkdir(parents=True, exist_ok=True)

    def list_repo_files(self, repo_id, repo_type="model"):
        out = []
        for dirpath, _, names in os.walk(self.root):
            for n in names:
                if not n.startswith("."):
                    out.append(str((Path(dirpath) / n).relative_to(self.root)))
        return sorted(out)

    def upload_file(self, path_or_fileobj, path_in_repo, repo_id, repo_type="model"):
        dest = self.root / path_in_repo
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
        os.close(fd)
        shutil.copyfile(path_or_fileobj, tmp)
        os.replace(tmp, dest)

    def hf_hub_download(self, repo_id, filename, local_dir, repo_type="model", token=None):
        src = self.root / filename
        if not src.is_file():
            raise FileNotFoundError(f"{filename} not found in {self.root}")
        dest = Path(local_dir) / filename
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        return str(dest)


def client(where, cache_dir: str | os.PathLike) -> HubClient:
    """Speedtronic's ``HubClient`` on a folder (a path) or on the loopback server (a FakeHubServer),
    retrying fast and never sleeping (its retries sleep 1, 2, 4 ... seconds otherwise)."""
    if isinstance(where, (str, os.PathLike)):
        api = FolderHfApi(where)
    else:
        from huggingface_hub import HfApi

        api = HfApi(endpoint=where.endpoint, token="hf_x")
    return HubClient(REPO, token="hf_x", cache_dir=cache_dir, api=api, retry_attempts=2, retry_initial=0.01,
                     retry_max=0.01, sleeper=lambda s: None)


def worker(hub: HubClient, node_id: str, model: torch.nn.Module, state_dir, inner_steps: int = 2) -> DumbDiLoCoCoordinator:
    """Speedtronic's worker coordinator (role worker), synchronous uploads and polls (deterministic),
    polling for a new global at every step."""
    cfg = DistributedConfig(enabled=True, role="worker", node_id=node_id, repo_id=REPO, inner_steps=inner_steps,
                            poll_interval=1e-6, async_delta_upload=False, async_global_poll=False)
    coord = DumbDiLoCoCoordinator(cfg, model, hub=hub, state_dir=state_dir)
    coord.start()
    return coord


def speedtronic_master(hub: HubClient, state: dict[str, torch.Tensor], state_dir, **options) -> SpeedtronicMaster:
    """Speedtronic's master as its coordinator starts it on a fresh hub: its outer loop, and the
    bootstrap publication of outer step 0 (``DumbDiLoCoCoordinator._start_master``). Rounds are
    run by calling ``sync_once()``."""
    master = SpeedtronicMaster(hub, state, node_state_dir=state_dir, **options)
    hub.publish_global(master.global_state, outer_step=0, work_dir=Path(state_dir) / "outgoing",
                       metadata_extra={"algorithm": "dumb_diloco", "bootstrap": "true"})
    return master
