"""A folder hub's download is the file its checks were made on (issue 42, item 2).

``FileHub.download`` returns hub files in place. Its checks (a regular file, within its size
bound, no symbolic link on the way) were once made on the path, and every reader opened the path
again: a hub writer who renamed another file over it, or put a link (to a file outside the hub, to
a FIFO) or a linked folder in its place between the two, had the reader read something that was
never checked. The path returned now holds the checked file open (``util/heldfile.py``) and every
reader (``open_regular``: deltas, weights and state files, signatures, digests) reads that one.
Each test swaps the file for real, on disk, between the download and the read.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from diloco_lightning.hub.local import FileHub
from diloco_lightning.util.fileio import open_regular, sha256_file
from diloco_lightning.util.heldfile import held_fd
from diloco_lightning.wire.delta import read_delta, read_delta_header, write_delta
from diloco_lightning.wire.statefile import load_weights_file, save_weights_file

PATH = "nodes/w00/delta_0.safetensors"


def _state() -> dict[str, torch.Tensor]:
    return {"a": torch.zeros(4, 3), "b": torch.zeros(5)}


def _delta(dest: Path, value: float, node: str = "w00") -> bytes:
    dest.parent.mkdir(parents=True, exist_ok=True)
    write_delta(dest, {k: torch.full_like(v, value) for k, v in _state().items()}, node_id=node, local_step=0,
                base_outer_step=0)
    return dest.read_bytes()


@pytest.fixture
def hub(tmp_path) -> FileHub:
    return FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache")


def _swap_rename(hub: FileHub, tmp_path: Path) -> None:
    """Another valid delta renamed over the path (what any writer of the folder can do)."""
    other = hub.root / "nodes" / "w00" / ".other.tmp"
    _delta(other, 9.0)
    os.replace(other, hub.root / PATH)


def _swap_symlink(hub: FileHub, tmp_path: Path) -> None:
    """A symbolic link to a file outside the hub in its place."""
    outside = tmp_path / "outside" / "delta_0.safetensors"
    _delta(outside, 9.0)
    (hub.root / PATH).unlink()
    os.symlink(outside, hub.root / PATH)


def _swap_fifo(hub: FileHub, tmp_path: Path) -> None:
    """A FIFO in its place (an open by path would block for ever)."""
    (hub.root / PATH).unlink()
    os.mkfifo(hub.root / PATH)


def _swap_folder(hub: FileHub, tmp_path: Path) -> None:
    """The node's folder moved away and a link to a folder outside the hub put in its place."""
    outside = tmp_path / "elsewhere"
    _delta(outside / "delta_0.safetensors", 9.0)
    os.rename(hub.root / "nodes" / "w00", hub.root / "nodes" / ".w00.old")
    os.symlink(outside, hub.root / "nodes" / "w00")


SWAPS = {"rename": _swap_rename, "symlink": _swap_symlink, "fifo": _swap_fifo, "folder": _swap_folder}


@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_a_delta_swapped_after_its_download_is_read_as_checked(hub, tmp_path, swap):
    honest = _delta(hub.root / PATH, 1.0)
    local = hub.download(PATH, max_bytes=len(honest))
    SWAPS[swap](hub, tmp_path)
    assert read_delta_header(local).node_id == "w00"
    d = read_delta(local, reference=_state(), hub_path=PATH)
    assert all(bool((t == 1.0).all()) for t in d.tensors.values())  # the checked file's values, not 9.0
    assert sha256_file(local) == hashlib.sha256(honest).hexdigest()
    with open_regular(local) as a, open_regular(local) as b:  # each reader its own offset
        assert a.read(8) == b.read(8) == honest[:8]
    hub.release(local)
    assert held_fd(local) is None
    with pytest.raises(OSError):  # released: never reopened by its path
        open_regular(local)


def test_a_weights_file_swapped_between_its_digest_check_and_its_load_is_the_checked_one(hub, tmp_path):
    w = hub.root / "global" / "weights_000000001_00.safetensors"
    w.parent.mkdir(parents=True, exist_ok=True)
    save_weights_file(w, {"a": torch.ones(3)})
    digest = hashlib.sha256(w.read_bytes()).hexdigest()
    local = hub.download("global/weights_000000001_00.safetensors")
    forged = tmp_path / "forged.safetensors"
    save_weights_file(forged, {"a": torch.full((3,), 7.0)})
    os.replace(forged, w)
    state, _ = load_weights_file(local, digest)  # the digest and the tensors: the file downloaded
    assert torch.equal(state["a"], torch.ones(3))


def test_a_plain_path_is_read_as_before(tmp_path):
    p = tmp_path / "d" / "delta_0.safetensors"
    _delta(p, 2.0)
    assert held_fd(p) is None
    with open_regular(p) as f:
        assert f.read(8) == p.read_bytes()[:8]


def test_the_checks_are_made_on_the_open_file(hub, tmp_path):
    honest = _delta(hub.root / PATH, 1.0)
    from diloco_lightning.hub.base import HubError, HubFileTooLargeError

    with pytest.raises(HubFileTooLargeError):
        hub.download(PATH, max_bytes=len(honest) - 1)
    _swap_fifo(hub, tmp_path)
    with pytest.raises(HubError, match="not a regular file"):
        hub.download(PATH)
    (hub.root / PATH).unlink()
    os.symlink(tmp_path / "nowhere", hub.root / PATH)
    with pytest.raises(HubError, match="symbolic link"):
        hub.download(PATH)


def test_an_adopted_copy_is_the_promised_bytes_whatever_was_swapped_in(hub, tmp_path):
    """What a master copies into its own state folder when it adopts a version (runstate.py,
    ``fileio.copy_checked``): the held file, checked against the manifest's digest on the way."""
    from diloco_lightning.util.fileio import copy_checked

    honest = _delta(hub.root / PATH, 1.0)
    local = hub.download(PATH)
    _swap_rename(hub, tmp_path)
    dest = tmp_path / "state" / "copy.safetensors"
    dest.parent.mkdir()
    copy_checked(local, dest, hashlib.sha256(honest).hexdigest())
    assert dest.read_bytes() == honest
    forged = (hub.root / PATH).read_bytes()
    with pytest.raises(OSError, match="SHA-256"):  # bytes other than the promised ones are never kept
        copy_checked(hub.root / PATH, tmp_path / "state" / "other.safetensors", hashlib.sha256(honest).hexdigest())
    assert forged != honest and not (tmp_path / "state" / "other.safetensors").exists()
