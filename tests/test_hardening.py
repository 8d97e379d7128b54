"""Hostile input, signed runs and exactly-once under crashes (issue 10), on both transports.

Every test here puts on the hub what any hub writer could put there (a file under another
node's name, a header of any size and text, a forged manifest, a symbolic link, litter of
a killed process) or kills a real process with SIGKILL at a chosen point, and checks what
users rely on: the master keeps running rounds, honest work is applied exactly once, and
nothing a writer without the run key publishes is ever installed or adopted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from speed import default_first
import torch
from safetensors.torch import save_file


from diloco_lightning.util import faults  # noqa: E402
from diloco_lightning.wire.delta import HeaderError, model_fingerprint, write_delta  # noqa: E402
from diloco_lightning.util.fileio import owner_tag  # noqa: E402
from diloco_lightning.hub.versions import UnauthenticatedVersionError, load_global, stage_global  # noqa: E402
from diloco_lightning.hub.local import FileHub  # noqa: E402
from diloco_lightning.wire.manifest import Lease, Manifest  # noqa: E402
from diloco_lightning.master import MasterOuterLoop  # noqa: E402
from diloco_lightning.wire.names import MAX_STEP  # noqa: E402
from diloco_lightning.wire.signing import RunKey  # noqa: E402
from diloco_lightning.worker import DiLoCoWorker  # noqa: E402
from diloco_lightning.worker.sync import WaitTimeoutError  # noqa: E402

from support.hf_server import FakeHubServer  # noqa: E402
from support.spies import count_downloads  # noqa: E402
from support.workers import run_crash_script  # noqa: E402

REPO = "org/hardening"
TOKEN = "hf_hardeningTESTtoken0123456789"
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def s0() -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 3), 2.0), "b": torch.ones(3), "steps": torch.tensor(7)}


FP = model_fingerprint(s0())


def dt(value: float = 0.5) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 3), float(value)), "b": torch.full((3,), float(value))}




class Hubs:
    """Handles on one hub, each with its own cache (separate machines); ``put`` writes a raw file
    as any hub writer could, bypassing every check of the client."""

    def __init__(self, kind: str, tmp: Path, server: FakeHubServer | None = None, s3: str | None = None) -> None:
        self.kind, self.tmp, self.server, self.s3, self.n = kind, tmp, server, s3, 0
        self.root = tmp / "hub"
        if kind == "s3":
            import uuid

            import boto3

            self.client = boto3.client("s3", endpoint_url=s3, region_name="us-east-1")
            self.bucket = f"h-{uuid.uuid4().hex[:16]}"
            self.client.create_bucket(Bucket=self.bucket)

    def open(self):
        self.n += 1
        if self.kind == "file":
            return FileHub(self.root, cache_dir=self.tmp / f"cache{self.n}")
        if self.kind == "s3":
            from diloco_lightning.hub.s3 import S3Hub

            return S3Hub(self.bucket, "run", endpoint_url=self.s3, addressing_style="path", max_retries=2,
                         retry_base_delay=0.01, retry_max_delay=0.05, timeout=10, cache_dir=self.tmp / f"s3cache{self.n}")
        from diloco_lightning.hub.hf import HFHub

        return HFHub(REPO, endpoint=self.server.endpoint, token=TOKEN, cache_dir=self.tmp / f"hfcache{self.n}",
                     max_retries=2, retry_base_delay=0.01, retry_max_delay=0.05, timeout=10, commits_per_hour=0)

    @property
    def url(self) -> str:
        if self.kind == "s3":
            return f"s3://{self.bucket}/run"
        return self.root.as_uri() if self.kind == "file" else f"hf://{REPO}"

    @property
    def options(self) -> dict:
        if self.kind == "file":
            return {}
        if self.kind == "s3":
            return {"endpoint_url": self.s3, "addressing_style": "path", "cache_dir": str(self.tmp / "worker-cache")}
        # no commit budget on the loopback Hub (tests/test_hub_pacing.py tests it): a kill -9 test's worker
        # commits far more often than the real Hub's 128 an hour
        return {"endpoint": self.server.endpoint, "token": TOKEN, "cache_dir": str(self.tmp / "worker-cache"),
                "commits_per_hour": 0}

    def put(self, path: str, data: bytes) -> None:
        if self.kind == "file":
            p = self.root / path
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        elif self.kind == "s3":
            self.client.put_object(Bucket=self.bucket, Key=f"run/{path}", Body=data)
        else:
            self.server.commit_files(REPO, adds={path: data})

    def delete(self, path: str) -> None:
        if self.kind == "file":
            (self.root / path).unlink()
        elif self.kind == "s3":
            self.client.delete_object(Bucket=self.bucket, Key=f"run/{path}")
        else:
            self.server.commit_files(REPO, deletes=[path])


def _hubs(request, tmp_path):
    if request.param == "file":
        yield Hubs("file", tmp_path)
    elif request.param == "s3":
        yield Hubs("s3", tmp_path, s3=request.getfixturevalue("s3_endpoint"))
    else:
        with FakeHubServer() as server:
            yield Hubs("hf", tmp_path, server)


@pytest.fixture(params=["file", "hf", "s3"])
def hubs(request, tmp_path):
    yield from _hubs(request, tmp_path)


@pytest.fixture(params=["file", pytest.param("hf", marks=pytest.mark.slow), pytest.param("s3", marks=pytest.mark.slow)])
def crash_hubs(request, tmp_path):
    """The kill -9 matrix: on S3 (~30 s a case, subprocess workers) it runs with ``-m slow`` (CI's second line)."""
    yield from _hubs(request, tmp_path)


def delta_bytes(tmp: Path, node: str, step: int, base: int = 0, tensors=None, **kw) -> bytes:
    p = tmp / f"mk-{node}-{step}-{time.monotonic_ns()}.safetensors"
    write_delta(p, tensors if tensors is not None else dt(), node_id=node, local_step=step, base_outer_step=base,
                model_fingerprint=FP, **kw)
    return p.read_bytes()


def raw_delta(metadata: dict, tensors=None) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.safetensors"
        save_file(tensors if tensors is not None else dt(), str(p), metadata=metadata)
        return p.read_bytes()


def make_master(hub, tmp: Path, name: str = "m", **kw) -> MasterOuterLoop:
    opts = dict(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0, lease_ttl=30.0, poll_interval=0.02)
    opts.update(kw)
    state = opts.pop("state", s0())
    return MasterOuterLoop(hub, state, node_state_dir=tmp / name, **opts)


# ============================================================================ 1. no header value stops the master


HUGE = "9" * 5000


@pytest.mark.parametrize("field", ["base_outer_step", "local_step", "num_tokens", "text"])
def test_header_values_of_any_size_and_text_are_rejections(hubs, tmp_path, field, caplog):
    hub = hubs.open()
    m = make_master(hub, tmp_path, weighting="tokens")
    assert m.sync_once()
    md = {"format": "diloco-delta/1", "node_id": "x", "local_step": "0", "base_outer_step": "0", "num_tokens": "5"}
    if field == "text":
        md["base_outer_step"] = "zéro " * 100_000  # half a megabyte of text in one value
    else:
        md[field] = HUGE
    hubs.put("nodes/x/delta_0.safetensors", raw_delta(md))
    hubs.put("nodes/good/delta_0.safetensors", delta_bytes(tmp_path, "good", 0, num_tokens=4))
    with caplog.at_level(logging.WARNING):
        assert m.sync_once() is True  # the round goes on: the honest delta is applied
    got = m.last_metrics["rejected_by_reason"]
    assert m.last_metrics["applied"] == ["good/0"]
    assert got in ({"header": 1}, {"path_mismatch": 1}, {"size": 1}), got
    # and again: never a round that raises, never the same file twice
    assert m.sync_once() is False and m.last_metrics["rejected"] == 0
    assert all(len(r.getMessage()) < 2000 for r in caplog.records)  # logs show a bounded excerpt


def test_a_hub_path_with_a_huge_step_is_ignored_not_fatal(hubs, tmp_path):
    hub = hubs.open()
    m = make_master(hub, tmp_path)
    assert m.sync_once()
    digits = HUGE if hubs.kind == "hf" else "9" * 200  # a folder's names stop at 255 bytes
    hubs.put(f"nodes/x/delta_{digits}.safetensors", b"junk")
    hubs.put(f"nodes/x/delta_{MAX_STEP + 1}.safetensors", b"junk")
    hubs.put("nodes/good/delta_0.safetensors", delta_bytes(tmp_path, "good", 0))
    assert m.sync_once() is True and m.last_metrics["applied"] == ["good/0"]
    assert m.sync_once() is False


def test_header_parser_bounds_each_integer():
    from diloco_lightning.wire.delta.header import _parse_header

    base = {"format": "diloco-delta/1", "node_id": "a", "local_step": "1", "base_outer_step": "0"}
    for key, value in (("local_step", str(MAX_STEP + 1)), ("base_outer_step", HUGE), ("num_tokens", str(10**15 + 1)),
                       ("num_tokens", "1" * 400)):
        with pytest.raises(HeaderError) as e:
            _parse_header("f", {**base, key: value})
        assert len(str(e.value)) < 400
    assert _parse_header("f", {**base, "local_step": str(MAX_STEP), "num_tokens": str(10**15)}).num_tokens == 10**15


# ============================================================================ 2. token weighting cannot overflow


def test_token_weights_cannot_overflow_and_stay_exact(hubs, tmp_path):
    hub = hubs.open()
    m = make_master(hub, tmp_path, weighting="tokens", norm_global_ratio=None)
    assert m.sync_once()
    hubs.put("nodes/a/delta_0.safetensors", delta_bytes(tmp_path, "a", 0, tensors=dt(0.25), num_tokens=10**15))
    hubs.put("nodes/b/delta_0.safetensors", delta_bytes(tmp_path, "b", 0, tensors=dt(0.5), num_tokens=3 * 10**14))
    hubs.put("nodes/c/delta_0.safetensors", raw_delta(
        {"format": "diloco-delta/1", "node_id": "c", "local_step": "0", "base_outer_step": "0", "num_tokens": "1" + "0" * 40}))
    assert m.sync_once()
    assert m.last_metrics["rejected_by_reason"] == {"header": 1}  # 10**40 tokens: no worker trains that much
    want = 2.0 - (10**15 * 0.25 + 3 * 10**14 * 0.5) / (13 * 10**14)
    w = m.snapshot()[1]["w"]
    assert torch.isfinite(w).all() and torch.allclose(w, torch.full((4, 3), want), rtol=0, atol=1e-6)


def test_a_non_finite_result_publishes_nothing(hubs, tmp_path, caplog):
    """Each delta is finite and within bounds, but the outer step overflows (a misconfigured lr):
    nothing is published, the error is logged, and the run goes on."""
    hub = hubs.open()
    m = make_master(hub, tmp_path, outer_lr=1e38, norm_global_ratio=None)
    assert m.sync_once()
    for node in ("a", "b"):
        hubs.put(f"nodes/{node}/delta_0.safetensors", delta_bytes(tmp_path, node, 0, tensors=dt(-10.0)))
    with caplog.at_level(logging.ERROR):
        assert m.sync_once() is False
    assert m.last_metrics["rejected_by_reason"] == {"non_finite_update": 2}
    assert any("non-finite" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)
    assert hub.read_manifest().outer_step == 0 and torch.equal(m.snapshot()[1]["w"], s0()["w"])
    assert m.sync_once() is False and m.last_metrics["rejected"] == 0  # refused once, never read again


# ============================================================================ 3. signed publications


def forge_version(hubs: Hubs, tmp: Path, step: int, state, key: RunKey | None = None) -> Manifest:
    """What a hub writer without the run key can do: stage weights and write a matching manifest."""
    staged = stage_global(tmp / f"forge{step}", step, state)
    man = staged.manifest(ledger={}, master={"holder": "mallory"})
    if key is not None:
        man = man.signed(key)
    for hub_path, local in staged.files.items():
        hubs.put(hub_path, Path(local).read_bytes())
    hubs.put("global/manifest.json", man.to_json().encode())
    return man


def test_signed_run_workers_and_masters_refuse_a_forged_version(hubs, tmp_path, caplog):
    key = RunKey("the-run-key")
    hub = hubs.open()
    m = make_master(hub, tmp_path, signing_key=key)
    assert m.sync_once()
    assert hub.read_manifest().signature is not None and hub.read_manifest().verify(key)
    forged_state = {k: (v * 0 + 666 if v.is_floating_point() else v) for k, v in s0().items()}
    forge_version(hubs, tmp_path, 5, forged_state)

    # a worker of the signed run refuses it, naming it, and keeps what it has
    params = {k: v.clone() for k, v in s0().items()}
    with pytest.raises(WaitTimeoutError, match="refusing global version 5.*carries no signature"):
        DiLoCoWorker(hubs.open(), "w0", params, signing_key=key, hub_options=None,
                     poll_interval=0.01, wait_timeout=0.5).start()
    assert torch.equal(params["w"], s0()["w"])
    with pytest.raises(UnauthenticatedVersionError):
        load_global(hubs.open(), signing_key=key)

    # a restarted master neither adopts it nor stops: it republishes its authentic version over it
    m.close()
    m2 = make_master(hubs.open(), tmp_path, name="m", signing_key=key)
    with caplog.at_level(logging.ERROR):
        assert m2.sync_once() is True
    assert any("refusing global version 5" in r.getMessage() for r in caplog.records)
    man = hub.read_manifest()
    assert man.outer_step == 0 and man.verify(key)
    assert torch.equal(load_global(hubs.open(), signing_key=key)[1]["w"], s0()["w"])

    # a forged manifest signed with another key is refused the same way
    forge_version(hubs, tmp_path, 6, forged_state, key=RunKey("not-the-run-key"))
    with pytest.raises(UnauthenticatedVersionError, match="signature does not match"):
        load_global(hubs.open(), signing_key=key)
    assert m2.sync_once() and hub.read_manifest().verify(key)
    # and work goes on
    hubs.put("nodes/a/delta_0.safetensors", delta_bytes(tmp_path, "a", 0, signing_key=key))
    assert m2.sync_once() and m2.outer_step == 1 and hub.read_manifest().verify(key)
    m2.close()


def test_a_malformed_manifest_never_stops_the_master(hubs, tmp_path):
    hub = hubs.open()
    m = make_master(hub, tmp_path)
    assert m.sync_once()
    hubs.put("global/manifest.json", b'{"format": "diloco-manifest/1", "outer_step": ' + HUGE.encode() + b"}")
    assert m.sync_once() is True  # replaced by the master's own version
    assert hub.read_manifest().outer_step == 0


def test_signed_run_ignores_forged_lease_and_forged_init(tmp_path):
    key = RunKey("k")
    hub = FileHub(tmp_path / "hub")
    # a forged lease that would keep every master on standby for a year
    hub.write_lease(Lease("mallory", 99, time.time() + 3.15e7, time.time()), expected=None)
    # a forged offer of initial weights, sorted first
    p = tmp_path / "init.safetensors"
    save_file({"w": torch.full((4, 3), 666.0)}, str(p), metadata={"format": "diloco-init/1"})
    hub.upload_init(p, "aaa")
    m = MasterOuterLoop(hub, None, node_state_dir=tmp_path / "m", signing_key=key, poll_interval=0.02)
    assert m.sync_once() is False  # no signed offer yet: waiting, not adopting the forged one
    params = {"w": torch.nn.Parameter(torch.ones(4, 3))}
    w = DiLoCoWorker(hub, "w1", params, signing_key=key, poll_interval=0.01, wait_timeout=10)
    t = threading.Thread(target=w.start)
    t.start()
    deadline = time.monotonic() + 10
    while m.outer_step == 0 and hub.read_manifest() is None and time.monotonic() < deadline:
        m.sync_once()
        time.sleep(0.01)
    t.join()
    assert m.is_leader and hub.read_lease().holder == m.holder and hub.read_lease().verify(key)
    assert torch.equal(load_global(hub, signing_key=key)[1]["w"], torch.ones(4, 3))  # w1's signed offer
    w.close()
    m.close()


# ============================================================================ 4. rejected files never move the ledger


def test_a_rejected_file_never_hides_the_victims_work(hubs, tmp_path):
    hub = hubs.open()
    counts = count_downloads(hub)
    m = make_master(hub, tmp_path)
    assert m.sync_once()
    hubs.put("nodes/victim/delta_1000000.safetensors", b"garbage, not a safetensors file")
    assert m.sync_once() is False
    assert m.last_metrics["rejected_by_reason"] == {"unreadable": 1}
    assert "victim" not in m.ledger
    for step in (5, 6):
        hubs.put(f"nodes/victim/delta_{step}.safetensors", delta_bytes(tmp_path, "victim", step))
    assert m.sync_once() is True
    assert m.last_metrics["applied"] == ["victim/5", "victim/6"] and m.ledger == {"victim": 6}
    assert counts["nodes/victim/delta_1000000.safetensors"] == 1  # never read twice ...
    assert "nodes/victim/delta_1000000.safetensors" not in [r.path for r in hub.list_deltas()]  # ... and deleted


def test_a_new_file_at_a_refused_path_is_read(hubs, tmp_path):
    hub = hubs.open()
    m = make_master(hub, tmp_path)
    assert m.sync_once()
    hubs.put("nodes/a/delta_3.safetensors", b"garbage")
    assert m.sync_once() is False and m.last_metrics["rejected_by_reason"] == {"unreadable": 1}
    hubs.delete("nodes/a/delta_3.safetensors")
    hubs.put("nodes/a/delta_3.safetensors", delta_bytes(tmp_path, "a", 3))
    assert m.sync_once() is True and m.last_metrics["applied"] == ["a/3"]


# ============================================================================ 5. verify before you load


def test_signed_run_rejects_a_huge_forged_delta_before_reading_it(tmp_path):
    """A file announcing 1 GiB of extra tensor data (sparse on disk) costs the reader nothing."""
    path = tmp_path / "nodes" / "x" / "delta_0.safetensors"
    path.parent.mkdir(parents=True)
    header = {"__metadata__": {"format": "diloco-delta/1", "node_id": "x", "local_step": "0", "base_outer_step": "0",
                               "signature": "0" * 64},
              "b": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
              "w": {"dtype": "F32", "shape": [4, 3], "data_offsets": [12, 60]},
              "zz_extra": {"dtype": "F32", "shape": [1 << 28], "data_offsets": [60, 60 + (1 << 30)]}}
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + 60 + (1 << 30))  # sparse: 1 GiB that takes no disk
    code = f"""
import resource, sys, torch
sys.path.insert(0, {str(ROOT)!r})
from diloco_lightning.wire.delta import read_delta, DeltaFileError
from diloco_lightning.wire.signing import RunKey
ref = {{"w": torch.zeros(4, 3), "b": torch.zeros(3)}}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
reasons = []
for kw in (dict(reference=ref), dict(reference=ref, max_file_bytes=1 << 31)):
    try:
        read_delta({str(path)!r}, signing_key=RunKey("k"), **kw)
    except DeltaFileError as e:
        reasons.append(e.reason)
print(reasons, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reasons, grown_kb = out.stdout.split("]")
    assert reasons.strip("[") == "'size', 'extra_key'"  # refused for its size, or for its names: never read
    assert int(grown_kb) < 50_000  # well under 50 MB, for a 1 GiB file


def test_master_refuses_an_oversized_delta_before_downloading_it(hubs, tmp_path):
    hub = hubs.open()
    m = make_master(hub, tmp_path)
    assert m.sync_once()
    big = {"w": torch.zeros(4, 3), "b": torch.zeros(3), "pad": torch.zeros(2_000_000)}  # 8 MB for a 60-byte model
    hubs.put("nodes/x/delta_0.safetensors", raw_delta(
        {"format": "diloco-delta/1", "node_id": "x", "local_step": "0", "base_outer_step": "0"}, big))
    if hubs.server is not None:
        hubs.server.reset_log()
    assert m.sync_once() is False
    assert m.last_metrics["rejected_by_reason"] == {"size": 1}
    assert m.last_metrics["bytes_downloaded"] == 0
    if hubs.server is not None:  # not one request for the file's content
        assert not [r for r in hubs.server.requests if r.route == "resolve" and r.path.endswith("nodes/x/delta_0.safetensors")]


def test_a_download_stops_at_the_honest_size(tmp_path):
    with FakeHubServer() as server:
        from diloco_lightning.hub.base import HubFileTooLargeError
        from diloco_lightning.hub.hf import HFHub

        hub = HFHub(REPO, endpoint=server.endpoint, token=TOKEN, cache_dir=tmp_path / "c", max_retries=0)
        server.commit_files(REPO, adds={"nodes/x/delta_0.safetensors": b"\0" * 3_000_000})
        with pytest.raises(HubFileTooLargeError, match="more than the 1000"):
            hub.download("nodes/x/delta_0.safetensors", max_bytes=1000)
        assert not (tmp_path / "c" / "nodes/x/delta_0.safetensors").exists()
        assert not list((tmp_path / "c").rglob("*.part"))  # nothing left behind


# ============================================================================ 6. exactly once across a worker's crashes


def _run_worker(cfg: dict, faults: str | None) -> subprocess.CompletedProcess:
    return run_crash_script(cfg, faults, timeout=180)


# the point after the upload (the replay that must not be applied twice) by default; all three in the slow run
@pytest.mark.parametrize("point", default_first(["worker.exported", "worker.uploading", "worker.uploaded"], keep={2}))
def test_worker_progress_is_applied_exactly_once_across_kill_9(crash_hubs, tmp_path, point):
    """kill -9 at the 3rd boundary (of 10): before the delta is sent, while it is sent, and after
    it reached the hub but before the checkpoint that follows. The resumed worker replays from the
    previous checkpoint. No master runs meanwhile, so every delta is still on the hub when the worker
    restarts (a master that already processed one is the other test below); then a master applies
    them all. The global must end at exactly 10 + 20 steps of progress."""
    hub = crash_hubs.open()
    # a short lease: the master is not running while the workers do, so a finished worker's final install
    # (worker/final.py) sees it gone at once instead of waiting out 30 s of lease
    m = MasterOuterLoop(hub, {"p": torch.full((8,), 10.0)}, node_state_dir=tmp_path / "m", outer_optimizer="nesterov", outer_lr=1.0,
                        outer_momentum=0.0, aggregation="arrival", lease_ttl=2)
    assert m.sync_once()  # outer step 0: what the worker installs
    cfg = dict(hub=crash_hubs.url, hub_options=crash_hubs.options, ckpt_dir=str(tmp_path / "ckpt"), max_steps=20, inner_steps=2)
    first = _run_worker(cfg, f"{point}:3")
    assert first.returncode == -9, first.stderr[-3000:]
    second = _run_worker(cfg, None)
    assert second.returncode == 0 and "done 20" in second.stdout, second.stderr[-3000:]
    for _ in range(50):
        m.sync_once(force=True)
        if not hub.list_deltas(after=m.ledger):
            break
    assert m.ledger["w0"] == 10
    assert torch.equal(m.snapshot()[1]["p"], torch.full((8,), 30.0)), m.snapshot()[1]["p"]
    # after the upload: the kill races the checkpoint of boundary 3, which does not wait for the network (it
    # records the delta in flight as a doubt). Written first, the restart finds the doubt on the hub and
    # replays nothing; killed first, the restart replays boundary 3 from boundary 2's checkpoint and drops it
    if point == "worker.uploaded" and "this replay of it is dropped" in second.stderr:
        assert "will not be sent again" in second.stderr
        # the replayed boundary 3 was trained and dropped: reported with its reason, to the master too
        assert m.membership.nodes["w0"].report.replayed == 1
        assert m.last_metrics["replayed"] == {"w0": 1}, m.last_metrics
    elif point == "worker.uploaded":
        assert "will not be sent again" not in second.stderr and not m.membership.nodes["w0"].report.replayed


@pytest.mark.parametrize("resumed", [False, True])
def test_a_restart_during_a_publication_never_reuses_a_processed_step(tmp_path, resumed):
    """The master applies and deletes the node's newest delta after the starting worker read the
    manifest and before it lists the hub: the worker must read the ledger again after listing,
    or it numbers its next delta at or below the ledger and the master drops it unread."""
    root = tmp_path / "hub"
    m = MasterOuterLoop(FileHub(root), s0(), node_state_dir=tmp_path / "m", outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0,
                        norm_global_ratio=None)
    assert m.sync_once()

    def fresh_params():
        return {k: torch.nn.Parameter(v.clone()) if v.is_floating_point() else v.clone() for k, v in s0().items()}

    params = fresh_params()
    w = DiLoCoWorker(FileHub(root), "w0", params, poll_interval=0.01, wait_timeout=10)
    w.start()
    with torch.no_grad():
        params["w"].add_(1.0)
    w.boundary()
    assert w.flush() and m.sync_once() and m.ledger == {"w0": 1}
    counters, anchor = w.state_dict(), w.anchor_state()  # a checkpoint after delta_1 ...
    with torch.no_grad():
        params["w"].add_(1.0)
    w.boundary()
    assert w.flush()  # ... delta_2 delivered, not yet applied: then the process dies
    w.close(flush=False)

    class Interleaved(FileHub):
        def list_deltas(self, after=None):
            if after == {"w0": 1}:
                m.sync_once()  # applies and deletes delta_2 just before this listing
            return super().list_deltas(after)

    w2 = DiLoCoWorker(Interleaved(root), "w0", fresh_params(), poll_interval=0.01, wait_timeout=10)
    if resumed:
        w2.load_state_dict(counters)
        w2.load_anchor_state(anchor)
    w2.start()
    assert m.ledger == {"w0": 2} and w2.next_local_step == 3
    if resumed:
        w2.boundary()  # the replay of boundary 2 since the checkpoint: already applied, not sent again
    else:  # without a checkpoint it resumes at the hub's step: nothing to replay (issue 38)
        assert w2.boundaries == 2 and w2.resumed_boundaries == 2
    with torch.no_grad():
        w2.params["w"].add_(1.0)
    w2.boundary()  # new work
    assert w2.flush()
    w2.close()
    assert m.sync_once() and m.last_metrics["applied"] == ["w0/3"]


# ============================================================================ 7. never delete through a symlink


def test_a_node_folder_swapped_for_a_symlink_never_loses_an_outside_file(tmp_path):
    hub = FileHub(tmp_path / "hub")
    m = make_master(hub, tmp_path, norm_global_ratio=None)
    assert m.sync_once()
    p = tmp_path / "d.safetensors"
    write_delta(p, dt(), node_id="a", local_step=0, base_outer_step=0)
    hub.upload_delta(p, "a", 0)
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "delta_0.safetensors").write_bytes(b"the user's own file")

    def swap(label):  # after reading the delta, before the publication deletes it
        if label == "files":
            node = tmp_path / "hub" / "nodes" / "a"
            shutil.rmtree(node)
            node.symlink_to(outside, target_is_directory=True)

    faults.install(hub, swap)
    assert m.sync_once()
    assert (outside / "delta_0.safetensors").read_bytes() == b"the user's own file"
    # and a worker cannot be made to write through one either
    with pytest.raises(Exception, match="symbolic link"):
        hub.upload_delta(p, "a", 1)
    assert sorted(x.name for x in outside.iterdir()) == ["delta_0.safetensors"]


# ============================================================================ 8. safe defaults


def test_defaults_refuse_an_absurd_first_delta_and_accept_honest_ones(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"emb": torch.randn(512, 64, generator=g) * 0.02, "norm": torch.ones(64)}
    hub = FileHub(tmp_path / "hub")
    m = MasterOuterLoop(hub, state, node_state_dir=tmp_path / "m", outer_optimizer="cgad", outer_lr=0.1)
    assert m.config.norm_global_ratio == 100.0
    assert m.sync_once()
    absurd = {k: torch.full_like(v, 1e19 / (v.numel() ** 0.5) / 2) for k, v in state.items()}
    honest = {k: torch.randn(v.shape, generator=g) * 500 * 1e-3 for k, v in state.items()}  # H*lr = 0.5 per coordinate
    for step, tensors in enumerate((absurd, honest)):
        p = tmp_path / f"d{step}.safetensors"
        write_delta(p, tensors, node_id="a", local_step=step, base_outer_step=0)
        hub.upload_delta(p, "a", step)
    assert m.sync_once()
    assert m.last_metrics["rejected_by_reason"] == {"norm_global": 1} and m.last_metrics["applied"] == ["a/1"]


def test_cli_default_bound_is_on():
    from hydra import compose, initialize_config_dir

    from diloco_lightning.app.config import CONFIG_DIR, register_configs

    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):  # the schema holds the default, as composed
        assert compose("master", overrides=["hub.url=/tmp"]).norm_global_ratio == 100.0
        assert compose("train", overrides=["recipe=tiny"]).master.norm_global_ratio == 100.0


# ============================================================================ 9. no litter


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_kill_9_litter_is_swept_but_live_files_are_kept(tmp_path):
    """A worker killed while it uploads leaves its spool folder and (mid-copy) a hidden temporary
    on the hub; a master killed while it stages leaves temporaries too. The next start sweeps the
    dead ones and keeps a live writer's and a recent foreign one."""
    hub_root = tmp_path / "hub"
    spool = tmp_path / "spool"
    spool.mkdir()
    m = MasterOuterLoop(FileHub(hub_root), None, node_state_dir=tmp_path / "m", poll_interval=0.02)
    m.start()
    try:
        cfg = dict(hub=str(hub_root), ckpt_dir=str(tmp_path / "ckpt"), max_steps=20, inner_steps=2)
        code = (f"import sys, tempfile; tempfile.tempdir = {str(spool)!r}; sys.argv = ['x', {json.dumps(cfg)!r}]; "
                f"sys.path.insert(0, {str(TESTS)!r}); import runpy; runpy.run_path({str(TESTS / 'support' / 'worker_crash_script.py')!r}, run_name='__main__')")
        env = dict(os.environ, PYTHONPATH=str(ROOT), DILOCO_FAULTS="hub.placing:3")  # init, delta_1, then mid-delta_2
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)
        assert r.returncode == -9, r.stderr[-2000:]
    finally:
        m.stop()
    dead_spool = [p for p in spool.iterdir() if p.name.startswith("diloco-w0-")]
    assert dead_spool and any(dead_spool[0].iterdir())  # the killed worker's delta file, left behind
    half_placed = list((hub_root / "nodes" / "w0").glob(".delta_2.safetensors.*.tmp"))
    assert half_placed  # and its half-placed copy on the hub
    # litter of dead processes of this host, a live writer's temporaries, and a foreign host's
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    import socket
    import re as _re

    host = _re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"
    dead = f"dl-{host}-{dead_pid}-"
    litter = [hub_root / "global" / f".weights_000000009_deadbeef.safetensors.{dead}abc.tmp",
              hub_root / "nodes" / "w0" / f".delta_7.safetensors.{dead}xyz.tmp",
              tmp_path / "m" / f".master.json.{dead}q.tmp"]
    live = [hub_root / "global" / f".weights_000000010_cafe1234.safetensors.{owner_tag()}live.tmp"]
    foreign_new = hub_root / "global" / ".weights_000000011_0badf00d.safetensors.dl-otherhost-4242-n.tmp"
    foreign_old = hub_root / "nodes" / "w0" / ".delta_8.safetensors.dl-otherhost-4243-o.tmp"
    for f in litter + live + [foreign_new, foreign_old]:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * 1000)
    os.utime(foreign_old, (time.time() - 7200, time.time() - 7200))
    m2 = MasterOuterLoop(FileHub(hub_root), None, node_state_dir=tmp_path / "m", poll_interval=0.02)
    m2.sync_once()
    assert not any(f.exists() for f in litter + half_placed + [foreign_old])
    assert all(f.exists() for f in live + [foreign_new])
    # the resumed worker sweeps the dead spool folder at start
    cfg_env = dict(os.environ, PYTHONPATH=str(ROOT))

    m2.start()
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=cfg_env)
        assert r.returncode == 0, r.stderr[-2000:]
    finally:
        m2.stop()
    assert not dead_spool[0].exists()
    assert not [p for p in spool.iterdir() if p.name.startswith("diloco-")]  # and its own went with a clean exit


def test_hf_cache_downloads_of_dead_processes_are_swept(tmp_path):
    with FakeHubServer() as server:
        from diloco_lightning.hub.hf import HFHub

        hub = HFHub(REPO, endpoint=server.endpoint, token=TOKEN, cache_dir=tmp_path / "c", max_retries=0)
        dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True).stdout.strip()
        import re as _re
        import socket

        host = _re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"
        dead = tmp_path / "c" / "nodes" / "w0" / f".delta_3.safetensors.dl-{host}-{dead_pid}-x.part"
        mine = tmp_path / "c" / "nodes" / "w0" / f".delta_4.safetensors.{owner_tag()}y.part"
        for f in (dead, mine):
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(b"half a download")
        assert hub.sweep(3600.0) == [str(dead)]
        assert mine.exists() and not dead.exists()
