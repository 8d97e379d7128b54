"""Litter and growth after kills and outages, on every transport.

* the sweep (a master's at start and with garbage collection, a worker's of its download cache at
  start) covers every kind of temporary file the product writes: a folder hub's half-placed files,
  a download's ``.part`` / ``.tmp`` in a cache, S3's conditional-write probe object and the
  incomplete multipart upload a probe killed midway leaves;
* a worker's download cache keeps no version it has installed (one model-sized file per version,
  834-925 files per worker after 15 minutes before);
* a worker or a master started while the store is unreachable waits and says so, instead of exiting.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from diloco_lightning.master import MasterOuterLoop
from diloco_lightning.util.fileio import owner_tag
from diloco_lightning.worker import DiLoCoWorker

ROOT = Path(__file__).resolve().parents[1]


def _dead_tag() -> str:
    """The owner tag of a process of this host that no longer exists."""
    pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                         text=True).stdout.strip()
    return owner_tag().replace(f"-{os.getpid()}-", f"-{pid}-")


def test_a_probe_killed_midway_leaves_nothing_after_the_next_sweep(tmp_path, s3_endpoint):
    """A master killed during the conditional-write probe at hub open left 2 ``global/.probe-*`` objects
    and 2 incomplete multipart uploads of them on S3, which nothing removed."""
    import uuid

    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    bucket = f"p-{uuid.uuid4().hex[:16]}"
    client.create_bucket(Bucket=bucket)
    code = ("from diloco_lightning.hub.s3 import S3Hub; "
            f"S3Hub({bucket!r}, 'run', endpoint_url={s3_endpoint!r}, addressing_style='path')")
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(ROOT), DILOCO_FAULTS="s3.probing"))
        assert r.returncode == -9, r.stderr[-2000:]
    objects = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents") or []]
    uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads") or []
    assert len([k for k in objects if "/.probe-dl-" in k]) == 2 and len(uploads) == 2  # the litter
    # a live probe of this process and a foreign one, recent: kept
    live = f"run/global/.probe-{owner_tag()}live"
    foreign = "run/global/.probe-dl-otherhost-4242-x"
    for k in (live, foreign):
        client.put_object(Bucket=bucket, Key=k, Body=b"1")
    from diloco_lightning.hub.s3 import S3Hub

    hub = S3Hub(bucket, "run", endpoint_url=s3_endpoint, addressing_style="path", cache_dir=tmp_path / "c")
    removed = hub.sweep(3600.0)
    assert len(removed) == 4, removed
    objects = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents") or [])
    assert objects == sorted([live, foreign])
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
    # an incomplete upload of a delta (a worker killed mid-upload) goes once initiated more than the sweep
    # age ago (moto dates every upload 2010-11-10: here it is old at once)
    client.create_multipart_upload(Bucket=bucket, Key="run/nodes/w0/delta_3.safetensors")
    assert hub.sweep(3600.0) == ["nodes/w0/delta_3.safetensors (incomplete upload)"]
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")


def test_every_kind_of_temporary_is_swept_on_every_transport(transport, tmp_path):
    """What a killed process of this host leaves (owner-tagged temporaries) goes at the next sweep: a
    master's sweeps the hub and its cache, a worker's start its own download cache."""
    dead = _dead_tag()
    m_hub = transport.open("m")
    w_hub = transport.open("w0")
    litter = [m_hub.cache_dir / "nodes" / "w0" / f".delta_3.safetensors.{dead}x.part",
              m_hub.cache_dir / "global" / f".weights_000000001_ab.safetensors.{dead}y.tmp",
              w_hub.cache_dir / "global" / f".weights_000000002_cd.safetensors.{dead}z.part",
              w_hub.cache_dir / "global" / f".manifest.json.{dead}q.tmp"]
    if transport.kind == "file":
        litter += [transport.root / "nodes" / "w0" / f".delta_7.safetensors.{dead}a.tmp",
                   transport.root / "global" / f".weights_000000009_ef.safetensors.{dead}b.tmp"]
    old_copy = w_hub.cache_dir / "global" / "weights_000000001_ab.safetensors"  # a complete copy never released
    for f in [*litter, old_copy]:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * 100)
    os.utime(old_copy, (time.time() - 7200, time.time() - 7200))
    live = w_hub.cache_dir / "global" / f".weights_000000003_ff.safetensors.{owner_tag()}live.part"
    live.write_bytes(b"mine")
    m = MasterOuterLoop(m_hub, {"w": torch.zeros(4)}, node_state_dir=tmp_path / "m", poll_interval=0.01)
    assert m.sync_once()  # sweeps at start
    w = DiLoCoWorker(w_hub, "w0", {"w": torch.nn.Parameter(torch.zeros(4))}, poll_interval=0.01, wait_timeout=20)
    w.start()  # sweeps its cache at start
    left = [str(f) for f in [*litter, old_copy] if f.exists()]
    assert not left, left
    assert live.exists()  # a live writer's own temporary is never touched
    w.close()
    m.close()


def test_the_masters_state_in_the_cache_survives_its_sweeps(transport, tmp_path):
    """diloco-master keeps its local state in ``<cache>/master`` on a remote hub. The cache sweep removed
    that folder while it was still empty (and would remove its files after an hour unchanged), so the
    first publication failed on every round: a worker waited for version 0 forever."""
    hub = transport.open("m")
    state_dir = Path(hub.cache_dir) / "master"
    old = state_dir / "weights_000000000_0123456789abcdef.safetensors"  # unchanged for two hours
    old.parent.mkdir(parents=True, exist_ok=True)
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert hub.sweep_cache(3600.0) == [] and old.exists()
    old.unlink()
    m = MasterOuterLoop(hub, {"w": torch.zeros(4)}, node_state_dir=state_dir, poll_interval=0.01, gc_every=1)
    assert m.sync_once() and m.outer_step == 0  # the sweep at start left the empty folder in place
    assert sorted(p.name.split("_")[0] for p in state_dir.glob("*.safetensors")) == ["outer", "weights"]
    m.close()


def test_a_workers_cache_keeps_no_version_it_installed(transport, tmp_path):
    m = MasterOuterLoop(transport.open("m"), {"w": torch.zeros(64)}, node_state_dir=tmp_path / "m", poll_interval=0.01,
                        outer_lr=1.0, outer_momentum=0.0, aggregation="arrival", norm_global_ratio=None)
    assert m.sync_once()
    params = {"w": torch.nn.Parameter(torch.zeros(64))}
    w = DiLoCoWorker(transport.open("w0"), "w0", params, poll_interval=0.01, wait_timeout=20)
    w.start()
    for _ in range(6):
        with torch.no_grad():
            params["w"].add_(1.0)
        w.boundary()
        assert w.flush()
        assert m.sync_once()
        deadline = time.monotonic() + 10
        while w._fetcher.newest_seen < m.outer_step and time.monotonic() < deadline:
            time.sleep(0.02)
    assert m.outer_step == 6 and w.totals["installs_total"] >= 2
    cached = [p for p in Path(w.hub.cache_dir).rglob("*") if p.is_file()]
    assert len(cached) <= 1, cached  # at most a download in flight, never a version per install
    w.close()
    m.close()


@pytest.mark.parametrize("who", ["worker", "master"])
def test_a_process_started_while_the_store_is_down_waits_and_says_so(transport, tmp_path, who, caplog):
    """A worker or master started while S3 was unreachable exited at once (16 crashes in the outage run:
    the store probe at hub open raised before any wait applied). It now waits, saying so."""
    if transport.kind == "file":
        pytest.skip("a folder hub has no outage at open")
    m = MasterOuterLoop(transport.open("m0"), {"w": torch.zeros(4)}, node_state_dir=tmp_path / "m0", poll_interval=0.01,
                        lease=False)
    assert m.sync_once()  # a run exists
    transport.down()
    threading.Timer(2.0, transport.up).start()
    with caplog.at_level(logging.WARNING):
        hub = transport.open(who)  # no exception: the probe (s3) or the repository check (hf) waits for a write
        if who == "worker":
            w = DiLoCoWorker(hub, "w0", {"w": torch.nn.Parameter(torch.zeros(4))}, poll_interval=0.05, wait_timeout=60)
            w.start()  # retries until the store is back
            assert w.outer_step == 0
            w.close()
        else:
            m2 = MasterOuterLoop(hub, None, node_state_dir=tmp_path / "m2", poll_interval=0.05, lease=False)
            from diloco_lightning.master.serve import serve

            stop = threading.Event()
            t = threading.Thread(target=serve, kwargs=dict(master=m2, stop=stop), daemon=True)
            t.start()
            deadline = time.monotonic() + 60
            while not m2.has_state and time.monotonic() < deadline:
                time.sleep(0.05)
            stop.set()
            t.join(30)
            assert m2.has_state and m2.outer_step == 0
            m2.close()
    said = " ".join(r.getMessage() for r in caplog.records)
    assert ("retrying" in said or "round failed" in said) and ("unreachable" in said or "failed after" in said), said
    m.close()



# ============================================================================ the sweep stays inside the hub

class _SwapAfterListing:
    """``os.scandir`` that, the first time a listing shows ``name``, swaps that folder for a symbolic link
    to ``target`` right after the listing: a writer racing the master's sweep."""

    def __init__(self, folder: Path, name: str, target: Path) -> None:
        self.folder, self.name, self.target, self.done = folder, name, target, False
        self.real = os.scandir

    def __call__(self, path=None):
        it = self.real(path) if path is not None else self.real()
        with it:
            entries = list(it)
        if not self.done and any(e.name == self.name for e in entries):
            self.done = True
            victim = self.folder / self.name
            for f in victim.iterdir():
                f.unlink()
            victim.rmdir()
            victim.symlink_to(self.target, target_is_directory=True)
        return _Listing(entries)


class _Listing:
    """What ``os.scandir`` returns (an iterator and a context manager), over a listing made already."""

    def __init__(self, entries: list) -> None:
        self.it = iter(entries)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.it)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def close(self) -> None:
        pass


def _old_litter(folder: Path, tag: str) -> list[Path]:
    """Temporaries of another host's writer, two hours old: what a sweep removes."""
    folder.mkdir(parents=True, exist_ok=True)
    made = [folder / f".delta_7.safetensors.dl-otherhost-4242-{tag}.tmp",
            folder / f".weights_000000003_ab.safetensors.{tag}.part"]
    for f in made:
        f.write_bytes(b"x")
        os.utime(f, (time.time() - 7200, time.time() - 7200))
    return made


@pytest.mark.parametrize("level", ["global", "nodes", "node"])
def test_the_sweep_never_follows_a_symbolic_link_out_of_the_hub(tmp_path, level, monkeypatch, caplog):
    """With ``global/``, ``nodes/`` or a node folder (swapped after the listing) a symbolic link to a folder
    outside the hub, the master's sweep removed the old ``.tmp`` / ``.part`` files there (3 of 3). They stay;
    the hub's own litter is still swept, and the link is named in a warning."""
    from diloco_lightning.hub.local import FileHub

    hub = FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache")
    outside = tmp_path / "outside"
    theirs = _old_litter(outside, "out") + _old_litter(outside / "w1", "outnode")
    ours: list[Path] = []
    if level == "global":
        (tmp_path / "hub" / "global").rmdir()
        (tmp_path / "hub" / "global").symlink_to(outside, target_is_directory=True)
        ours = _old_litter(tmp_path / "hub" / "nodes" / "w0", "ours")
    elif level == "nodes":
        (tmp_path / "hub" / "nodes").rmdir()
        (tmp_path / "hub" / "nodes").symlink_to(outside, target_is_directory=True)
        ours = _old_litter(tmp_path / "hub" / "global", "ours")
    else:
        ours = _old_litter(tmp_path / "hub" / "global", "ours") + _old_litter(tmp_path / "hub" / "nodes" / "w0", "ours")
        (tmp_path / "hub" / "nodes" / "evil").mkdir()
        monkeypatch.setattr(os, "scandir", _SwapAfterListing(tmp_path / "hub" / "nodes", "evil", outside))
    with caplog.at_level(logging.WARNING):
        removed = hub.sweep(3600.0)
    monkeypatch.undo()
    assert [str(f) for f in theirs if not f.exists()] == []
    assert [str(f) for f in ours if f.exists()] == [] and len(removed) == len(ours), removed
    linked = {"global": "global", "nodes": "nodes", "node": "nodes/evil"}[level]
    assert any(linked in r.getMessage() and "symbolic link" in r.getMessage() for r in caplog.records), caplog.text
