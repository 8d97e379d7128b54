"""The folder hub (``file://`` / a plain path) and the global-version helpers.

Races use real threads and real processes; crashes are simulated both by raising from
``FileHub.fault`` and by ``kill -9`` of a subprocess at each point of a publication.
Subprocesses import only ``diloco_lightning.hub.local`` (no torch, no lightning).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from diloco_lightning.util import faults  # noqa: E402
from diloco_lightning.wire.delta import model_fingerprint, read_delta, write_delta
from diloco_lightning.util.fileio import sha256_file
from diloco_lightning.hub.versions import GlobalIntegrityError, NothingPublishedError, load_global, load_outer_state, stage_global
from diloco_lightning.hub import (
    DeltaExistsError,
    DeltaRef,
    HubError,
    HubNotFoundError,
    LeaseConflictError,
    PublishConflictError,
    open_hub,
)
from diloco_lightning.hub.local import FileHub
from diloco_lightning.wire.claims import NodeClaim
from diloco_lightning.wire.manifest import GlobalVersion, Lease, ManifestError
from diloco_lightning.wire.names import InvalidNameError
from support.racers import run_racers  # noqa: E402


# ----------------------------------------------------------------------------- helpers


@pytest.fixture
def hub(tmp_path) -> FileHub:
    return FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache")


def _state(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(8, 4, generator=g).to(dtype),
        "b": torch.randn(4, generator=g).to(dtype),
        "s": torch.tensor(float(seed), dtype=dtype),
        "count": torch.tensor(seed),
    }


def _outer(seed: int) -> dict:
    g = torch.Generator().manual_seed(100 + seed)
    return {"t": seed, "lr": 0.7, "betas": [0.9, 0.999], "m": {"w": torch.randn(8, 4, generator=g)}}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same_state(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and _bytes(a[k]) == _bytes(b[k]) for k in a)


def _delta_file(path: Path, node: str, step: int, seed: int, dtype=torch.float32) -> tuple[Path, dict]:
    g = torch.Generator().manual_seed(seed)
    tensors = {"w": torch.randn(8, 4, generator=g).to(dtype), "b": torch.randn(4, generator=g).to(dtype),
               "s": torch.tensor(0.25 * seed, dtype=dtype)}
    write_delta(path, tensors, node_id=node, local_step=step, base_outer_step=0, num_tokens=seed)
    return path, tensors


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too) and its SHA-256."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


_PRELUDE = """
import json, os, sys, time
from diloco_lightning.hub.local import FileHub
from diloco_lightning.hub.base import DeltaExistsError, PublishConflictError
from diloco_lightning.wire.manifest import Manifest
args = json.loads(sys.argv[1])
hub = FileHub(args["root"])
print("READY", flush=True)
deadline = time.monotonic() + 20
while not os.path.exists(args["go"]):
    if time.monotonic() > deadline:
        sys.exit("no go signal")
    time.sleep(0.0005)
"""

_UPLOAD = _PRELUDE + """
try:
    hub.upload_delta(args["src"], args["node"], args["step"])
    result = "WIN"
except DeltaExistsError:
    result = "EXISTS"
assert "torch" not in sys.modules and "lightning" not in sys.modules
print(result, flush=True)
"""

_PUBLISH = _PRELUDE + """
import signal
kill_at = args.get("kill_at")  # the index of the fault point to die at
if kill_at is not None:
    seen = []
    def fault(at):
        seen.append(at)
        if len(seen) - 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    from diloco_lightning.util import faults
    faults.install(hub, fault)
manifest = Manifest.from_json(open(args["manifest"]).read())
try:
    hub.publish(manifest, args["files"], expected_outer_step=args["expected"], delete=args.get("delete", []))
    result = "WIN"
except PublishConflictError as e:
    result = "CONFLICT " + str(e)
assert "torch" not in sys.modules and "lightning" not in sys.modules
print(result, flush=True)
"""


def _publish_v0(hub: FileHub, tmp_path: Path):
    s0 = stage_global(tmp_path / "stage0", 0, _state(0), _outer(0))
    m0 = s0.manifest(ledger={"a": 1})
    hub.publish(m0, s0.files, expected_outer_step=None)
    return s0, m0


# ----------------------------------------------------------------------------- open_hub


def test_open_hub_paths_and_urls(tmp_path, monkeypatch):
    root = tmp_path / "hub dir"
    h1 = open_hub(str(root))
    assert isinstance(h1, FileHub) and h1.root == root and h1.url == root.as_uri()
    assert (root / "nodes").is_dir() and (root / "global").is_dir()
    h2 = open_hub(root.as_uri(), cache_dir=tmp_path / "c")  # file:///.../hub%20dir
    assert h2.root == root and h2.cache_dir == tmp_path / "c"
    assert open_hub(f"file://localhost{root}").root == root
    assert open_hub(root).root == root  # os.PathLike
    assert open_hub(h1) is h1
    monkeypatch.chdir(tmp_path)
    assert open_hub("rel/hub").root == tmp_path / "rel" / "hub"
    assert open_hub(str(root), token=None, endpoint=None).root == root  # unset remote options are fine
    with pytest.raises(HubNotFoundError, match="does not exist"):
        open_hub(str(tmp_path / "absent"), create=False)
    assert not (tmp_path / "absent").exists()


@pytest.mark.parametrize(
    "url,needle",
    [
        ("gs://bucket/x", "unsupported URL scheme"),
        ("http://example.com/hub", "unsupported URL scheme"),
        ("ftp://host/x", "unsupported URL scheme"),
        ("file://otherhost/tmp/hub", "names host"),
        ("file:/tmp/hub", "malformed file URL"),
        ("file:relative", "malformed file URL"),
        ("file:///tmp/hub?x=1", "query"),
        ("", "empty"),
    ],
)
def test_open_hub_rejections(tmp_path, url, needle):
    with pytest.raises(ValueError, match=needle):
        open_hub(url)


def test_open_hub_rejects_remote_options(tmp_path):
    with pytest.raises(ValueError, match="token"):
        open_hub(str(tmp_path / "h"), token="hf_secret")
    with pytest.raises(ValueError, match="already open"):
        open_hub(open_hub(str(tmp_path / "h")), cache_dir=tmp_path)


# ----------------------------------------------------------------------------- deltas


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_upload_list_download_round_trip(hub, tmp_path, dtype):
    made = {}
    for node, step, seed in [("b", 10, 1), ("a", 2, 2), ("a", 1, 3), ("a", 10, 4), ("node.9_x-Y", 0, 5)]:
        src, tensors = _delta_file(tmp_path / f"up_{node}_{step}.safetensors", node, step, seed, dtype)
        assert hub.upload_delta(src, node, step) == f"nodes/{node}/delta_{step}.safetensors"
        made[(node, step)] = (src, tensors)
    refs = hub.list_deltas()
    assert [(r.node_id, r.local_step) for r in refs] == [("a", 1), ("a", 2), ("a", 10), ("b", 10), ("node.9_x-Y", 0)]
    assert all(isinstance(r, DeltaRef) and r.path == f"nodes/{r.node_id}/delta_{r.local_step}.safetensors" for r in refs)
    for r in refs:
        src, tensors = made[r.identity]
        assert r.size == src.stat().st_size
        local = hub.download_delta(r)
        assert local.read_bytes() == src.read_bytes()
        d = read_delta(local, hub_path=r.path)
        assert (d.node_id, d.local_step) == r.identity
        assert all(d.tensors[k].dtype == dtype and _bytes(d.tensors[k]) == _bytes(t) for k, t in tensors.items())
    # the ledger: a node's deltas up to its high-water mark are left out
    assert [r.identity for r in hub.list_deltas(after={"a": 1})] == [("a", 2), ("a", 10), ("b", 10), ("node.9_x-Y", 0)]
    assert [r.identity for r in hub.list_deltas(after={"a": 10, "b": 9, "node.9_x-Y": 0})] == [("b", 10)]
    assert hub.list_deltas(after={"a": 10, "b": 10, "node.9_x-Y": 0}) == []
    assert hub.list_deltas(after={"zzz": 100})[0].identity == ("a", 1)


def test_listing_ignores_junk(hub, tmp_path, caplog):
    src, _ = _delta_file(tmp_path / "d.safetensors", "a", 1, 1)
    hub.upload_delta(src, "a", 1)
    nodes = hub.root / "nodes"
    junk = [
        nodes / ".hidden" / "delta_1.safetensors",
        nodes / "bad name" / "delta_1.safetensors",
        nodes / ("x" * 65) / "delta_1.safetensors",
        nodes / "a" / "delta_01.safetensors",
        nodes / "a" / "delta_-2.safetensors",
        nodes / "a" / "delta_3.safetensors.part",
        nodes / "a" / "notes.txt",
        nodes / "a" / ".delta_5.safetensors.abc.tmp",
        nodes / "stray.safetensors",
        hub.root / "global" / "delta_1.safetensors",
    ]
    for j in junk:
        j.parent.mkdir(parents=True, exist_ok=True)
        j.write_bytes(src.read_bytes())
    (nodes / "a" / "delta_7.safetensors").mkdir()  # a folder named like a delta
    (nodes / "a" / "init.safetensors").write_bytes(b"init")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "delta_9.safetensors").write_bytes(src.read_bytes())
    os.symlink(outside, nodes / "linked")  # a symlinked node folder
    os.symlink(outside / "delta_9.safetensors", nodes / "a" / "delta_9.safetensors")  # a symlinked delta
    with caplog.at_level(logging.WARNING, logger="diloco_lightning.hub.local"):
        for _ in range(3):
            assert [r.identity for r in hub.list_deltas()] == [("a", 1)]
    warned = [r.getMessage() for r in caplog.records]
    assert sum("delta_01" in w for w in warned) == 1  # logged once, not at every listing
    assert any("bad name" in w for w in warned) and any("notes.txt" in w for w in warned)
    assert hub.list_inits() == ["a"]
    with pytest.raises(HubError, match="symbolic link"):
        hub.download("nodes/a/delta_9.safetensors")
    with pytest.raises(HubError, match="symbolic link"):
        hub.download("nodes/linked/delta_9.safetensors")


def test_delta_never_overwritten(hub, tmp_path):
    first, _ = _delta_file(tmp_path / "1.safetensors", "a", 3, 1)
    second, _ = _delta_file(tmp_path / "2.safetensors", "a", 3, 2)
    hub.upload_delta(first, "a", 3)
    with pytest.raises(DeltaExistsError, match="nodes/a/delta_3.safetensors"):
        hub.upload_delta(second, "a", 3)
    assert (hub.root / "nodes/a/delta_3.safetensors").read_bytes() == first.read_bytes()
    assert sorted(os.listdir(hub.root / "nodes" / "a")) == ["delta_3.safetensors"]  # no temp file left


def test_delta_upload_race_threads(hub, tmp_path):
    for round_ in range(10):
        srcs = [_delta_file(tmp_path / f"t{round_}_{i}.safetensors", "a", round_, 10 * round_ + i)[0] for i in range(4)]
        barrier = threading.Barrier(len(srcs))
        results: list = [None] * len(srcs)

        def up(i):
            barrier.wait()
            try:
                hub.upload_delta(srcs[i], "a", round_)
                results[i] = "WIN"
            except DeltaExistsError:
                results[i] = "EXISTS"

        threads = [threading.Thread(target=up, args=(i,)) for i in range(len(srcs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == ["EXISTS"] * (len(srcs) - 1) + ["WIN"]
        winner = srcs[results.index("WIN")]
        assert (hub.root / f"nodes/a/delta_{round_}.safetensors").read_bytes() == winner.read_bytes()
    assert sorted(os.listdir(hub.root / "nodes" / "a")) == sorted(f"delta_{i}.safetensors" for i in range(10))


def test_delta_upload_race_processes(hub, tmp_path):
    for round_ in range(3):
        srcs = [_delta_file(tmp_path / f"p{round_}_{i}.safetensors", "a", round_, 10 * round_ + i)[0] for i in range(2)]
        out = run_racers(_UPLOAD, [dict(root=str(hub.root), src=str(s), node="a", step=round_) for s in srcs],
                          tmp_path / f"go_upload_{round_}")
        assert all(rc == 0 for rc, _ in out), out
        results = [line for _, line in out]
        assert sorted(results) == ["EXISTS", "WIN"], out
        winner = srcs[results.index("WIN")]
        assert (hub.root / f"nodes/a/delta_{round_}.safetensors").read_bytes() == winner.read_bytes()
    assert sorted(os.listdir(hub.root / "nodes" / "a")) == [f"delta_{i}.safetensors" for i in range(3)]


def test_same_step_on_two_nodes(hub, tmp_path):
    a_src, a_t = _delta_file(tmp_path / "a.safetensors", "a", 3, 1)
    b_src, b_t = _delta_file(tmp_path / "b.safetensors", "b", 3, 2)
    hub.upload_delta(a_src, "a", 3)
    hub.upload_delta(b_src, "b", 3)
    paths = {r.node_id: hub.download_delta(r) for r in hub.list_deltas()}
    assert paths["a"] != paths["b"]
    da = read_delta(paths["a"], hub_path="nodes/a/delta_3.safetensors")
    db = read_delta(paths["b"], hub_path="nodes/b/delta_3.safetensors")
    assert _same_state(da.tensors, a_t) and _same_state(db.tensors, b_t)
    assert not _same_state(da.tensors, db.tensors)
    assert (da.header.num_tokens, db.header.num_tokens) == (1, 2)


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("node", ["a/b", "..", ".hidden", "x" * 65, "", "a b", "../../etc", "a\x00"])
def test_bad_node_ids_write_nothing(hub, tmp_path, node):
    src, _ = _delta_file(tmp_path / "d.safetensors", "a", 1, 1)
    before = _snapshot(hub.root)
    with pytest.raises(InvalidNameError, match="node_id"):
        hub.upload_delta(src, node, 1)
    with pytest.raises(InvalidNameError, match="node_id"):
        hub.upload_init(src, node)
    assert _snapshot(hub.root) == before
    assert not (tmp_path / "etc").exists()


def test_bad_steps_and_paths_write_nothing(hub, tmp_path):
    src, _ = _delta_file(tmp_path / "d.safetensors", "a", 1, 1)
    before = _snapshot(hub.root)
    for step in (-1, True, 1.0, "1"):
        with pytest.raises(InvalidNameError, match="local_step"):
            hub.upload_delta(src, "a", step)
    for bad in ("../x", "/etc/passwd", "global/../../x", "nodes/a/../../x", "global/sub/x", "other/file", "global/.lock"):
        with pytest.raises(InvalidNameError):
            hub.download(bad)
        with pytest.raises(InvalidNameError):
            hub.delete([bad])
    for reserved in ("global/manifest.json", "global/lease.json"):
        with pytest.raises(InvalidNameError):
            hub.delete([reserved])
    with pytest.raises(HubNotFoundError, match="nodes/a/delta_5.safetensors"):
        hub.download("nodes/a/delta_5.safetensors")
    assert _snapshot(hub.root) == before


def test_bad_publications_write_nothing(hub, tmp_path):
    s0, m0 = _publish_v0(hub, tmp_path)
    s1 = stage_global(tmp_path / "stage1", 1, _state(1), _outer(1))
    m1 = s1.manifest()
    w_local = s1.files[s1.weights]
    before = _snapshot(hub.root)

    def refused(exc, manifest, files, match=None, **kw):
        with pytest.raises(exc, match=match):
            hub.publish(manifest, files, expected_outer_step=kw.pop("expected", 0), **kw)
        assert _snapshot(hub.root) == before

    for bad_path in ("nodes/a/delta_1.safetensors", "global/sub/x", "../x", "/etc/passwd", "global/../x",
                     "global/manifest.json", "global/lease.json", "global/.lock"):
        refused(InvalidNameError, m1, {**s1.files, bad_path: w_local})
    assert not (tmp_path / "x").exists()
    # a manifest naming a file outside global/ (built in code, never through from_json)
    for field_ in ("weights", "outer_state"):
        for bad_path in ("../x", "/etc/passwd", "nodes/a/delta_1.safetensors", "global/sub/x"):
            bad = s1.manifest()
            setattr(bad, field_, bad_path)
            refused(ManifestError, bad, s1.files, match="global")
    bad = s1.manifest(history=[GlobalVersion(0, "/etc/passwd")])
    refused(ManifestError, bad, s1.files)
    bad = s1.manifest(ledger={"a/b": 3})
    refused(ManifestError, bad, s1.files)
    # a manifest naming a file that is neither uploaded nor on the hub
    refused(HubError, m1, {s1.outer_state: s1.files[s1.outer_state]}, match=s1.weights)
    refused(HubError, s1.manifest(history=[GlobalVersion(0, "global/weights_000000000_00000000.safetensors")]),
            s1.files, match="weights_000000000_00000000")
    # deleting what the new manifest keeps alive, or the manifest itself
    refused(InvalidNameError, s1.manifest(history=[GlobalVersion(0, s0.weights, s0.outer_state)]), s1.files,
            delete=[s0.weights])
    refused(InvalidNameError, m1, s1.files, delete=[s1.weights])
    refused(InvalidNameError, m1, s1.files, delete=["global/manifest.json"])
    refused(InvalidNameError, m1, s1.files, delete=["../x"])
    # a local file that does not exist
    refused(FileNotFoundError, m1, {s1.weights: tmp_path / "missing"}, match="missing")
    # a new version that does not move forward
    refused(ValueError, s0.manifest(), {}, match="must exceed")
    # a global file name that already exists (names must be unique per publication)
    clash = dataclasses.replace(m1, outer_state=None, outer_state_sha256=None)
    refused(HubError, clash, {s1.weights: w_local, s0.weights: w_local}, match="already exists")
    assert hub.read_manifest() == m0
    # and a correct one goes through
    hub.publish(m1, s1.files, expected_outer_step=0, delete=list(s0.files))
    assert hub.read_manifest() == m1
    assert hub.list_global() == sorted(["global/manifest.json", *s1.files])


# ----------------------------------------------------------------------------- publication


def test_publish_and_load_global(hub, tmp_path):
    with pytest.raises(NothingPublishedError, match="nothing published"):
        load_global(hub)
    assert hub.read_manifest() is None
    s0, m0 = _publish_v0(hub, tmp_path)
    assert hub.read_manifest() == m0
    assert json.loads((hub.root / "global/manifest.json").read_text())["outer_step"] == 0
    m, state = load_global(hub)
    assert m == m0 and _same_state(state, _state(0))
    assert m.model_fingerprint == model_fingerprint(_state(0))
    outer = load_outer_state(hub, m)
    assert outer["t"] == 0 and outer["betas"] == [0.9, 0.999] and torch.equal(outer["m"]["w"], _outer(0)["m"]["w"])
    # a bf16 version with history and a ledger
    s1 = stage_global(tmp_path / "stage1", 1, _state(1, torch.bfloat16))
    m1 = s1.manifest(ledger={"a": 3, "b": 0}, history=[GlobalVersion(0, s0.weights, s0.outer_state)])
    hub.publish(m1, s1.files, expected_outer_step=0)
    m, state = load_global(hub)
    assert m == m1 and _same_state(state, _state(1, torch.bfloat16))
    assert load_outer_state(hub, m1) is None
    assert _same_state(load_global(hub, m0)[1], _state(0))  # an older version still kept
    assert hub.list_global() == sorted(["global/manifest.json", *s0.files, *s1.files])
    # every version's weights file matches its sha256
    for man in (m0, m1):
        assert sha256_file(hub.download(man.weights)) == man.weights_sha256


def test_load_global_integrity_errors(hub, tmp_path):
    s0, m0 = _publish_v0(hub, tmp_path)
    weights = hub.root / s0.weights
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # a data byte: still loads, but not what the manifest promised
    os.chmod(weights, 0o644)
    weights.write_bytes(bytes(data))
    with pytest.raises(GlobalIntegrityError, match="SHA-256") as ei:
        load_global(hub)
    assert ei.value.hub_path == s0.weights and s0.weights in str(ei.value) and str(weights) in str(ei.value)
    m, state = load_global(hub, verify=False)
    assert not _same_state(state, _state(0))
    # an outer state file that does not match
    outer = hub.root / s0.outer_state
    outer.write_bytes(outer.read_bytes() + b" ")
    with pytest.raises(GlobalIntegrityError, match="SHA-256") as ei:
        load_outer_state(hub, m0)
    assert s0.outer_state in str(ei.value)
    with pytest.raises(GlobalIntegrityError, match="unreadable"):
        load_outer_state(hub, m0, verify=False)
    # a manifest whose fingerprint does not describe its weights
    s1 = stage_global(tmp_path / "stage1", 1, _state(1))
    hub.publish(s1.manifest(model_fingerprint="0" * 64), s1.files, expected_outer_step=0)
    with pytest.raises(GlobalIntegrityError, match="fingerprint"):
        load_global(hub)
    # a manifest naming a file that was removed behind the hub's back
    s2 = stage_global(tmp_path / "stage2", 2, _state(2))
    m2 = s2.manifest()
    hub.publish(m2, s2.files, expected_outer_step=1)
    (hub.root / s2.weights).unlink()
    with pytest.raises(HubNotFoundError, match=s2.weights):
        load_global(hub, attempts=2)
    with pytest.raises(HubNotFoundError, match=s2.weights):
        load_global(hub, m2)


def test_load_global_follows_a_newer_version_when_files_vanish(hub, tmp_path):
    s0, m0 = _publish_v0(hub, tmp_path)
    s1 = stage_global(tmp_path / "stage1", 1, _state(1))
    real_read = hub.read_manifest
    calls = []

    def read_then_publish():
        m = real_read()
        calls.append(m.outer_step)
        if calls == [0]:  # another master publishes v1 and collects v0 right after we read v0's manifest
            other.publish(s1.manifest(), s1.files, expected_outer_step=0, delete=list(s0.files))
        return m

    other = FileHub(hub.root)
    hub.read_manifest = read_then_publish
    m, state = load_global(hub)
    assert calls == [0, 1] and m.outer_step == 1 and _same_state(state, _state(1))
    with pytest.raises(HubNotFoundError):
        load_global(hub, m0)  # an explicit manifest is never silently replaced


def _cas_check(hub: FileHub, staged: list, results: list, old_files: list[str]) -> int:
    assert results.count("WIN") == 1, results
    assert all(r == "WIN" or r.startswith("CONFLICT") for r in results), results
    win = results.index("WIN")
    m = hub.read_manifest()
    assert m.weights == staged[win].weights and m.ledger == {"winner": win}
    assert sha256_file(hub.download(m.weights)) == m.weights_sha256
    assert _same_state(load_global(hub)[1], _state(1000 + win))
    # the losers' files were removed, the winner's and the older ones kept
    assert hub.list_global() == sorted(["global/manifest.json", *old_files, *staged[win].files])
    return win


def test_publish_cas_race_threads(hub, tmp_path):
    _publish_v0(hub, tmp_path)
    n = 8
    for version in (1, 2, 3):
        old = [p for p in hub.list_global() if p != "global/manifest.json"]
        staged = [stage_global(tmp_path / f"v{version}_{i}", version, _state(1000 + i), _outer(i)) for i in range(n)]
        barrier = threading.Barrier(n)
        results: list = [None] * n

        def publish(i):
            barrier.wait()
            try:
                hub.publish(staged[i].manifest(ledger={"winner": i}), staged[i].files, expected_outer_step=version - 1)
                results[i] = "WIN"
            except PublishConflictError as e:
                assert (e.expected, e.found) == (version - 1, version)
                results[i] = "CONFLICT"

        threads = [threading.Thread(target=publish, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _cas_check(hub, staged, results, old)


def test_publish_cas_race_processes(hub, tmp_path):
    _publish_v0(hub, tmp_path)
    old = [p for p in hub.list_global() if p != "global/manifest.json"]
    n = 4
    staged = [stage_global(tmp_path / f"p{i}", 1, _state(1000 + i), _outer(i)) for i in range(n)]
    args = []
    for i, s in enumerate(staged):
        mpath = tmp_path / f"manifest_{i}.json"
        mpath.write_text(s.manifest(ledger={"winner": i}).to_json())
        args.append(dict(root=str(hub.root), manifest=str(mpath), files={k: str(v) for k, v in s.files.items()}, expected=0))
    out = run_racers(_PUBLISH, args, tmp_path / "go_publish")
    assert all(rc == 0 for rc, _ in out), out
    results = [line for _, line in out]
    assert all("expected current outer_step 0, hub has 1" in r for r in results if r != "WIN"), results
    _cas_check(hub, staged, results, old)


def test_publication_needs_the_expected_version(hub, tmp_path):
    s0 = stage_global(tmp_path / "s0", 0, _state(0))
    s4 = stage_global(tmp_path / "s4", 4, _state(4))
    with pytest.raises(PublishConflictError) as ei:
        hub.publish(s4.manifest(), s4.files, expected_outer_step=3)
    assert (ei.value.expected, ei.value.found) == (3, None)
    assert hub.read_manifest() is None and hub.list_global() == []
    hub.publish(s0.manifest(), s0.files, expected_outer_step=None)
    s0b = stage_global(tmp_path / "s0b", 0, _state(5))
    with pytest.raises(PublishConflictError, match="expected current outer_step None, hub has 0"):
        hub.publish(s0b.manifest(), s0b.files, expected_outer_step=None)
    assert hub.read_manifest().weights == s0.weights


def test_publication_refuses_files_collected_before_the_swap(hub, tmp_path):
    """A concurrent garbage collection removing one of the new files: the swap is refused."""
    s0, m0 = _publish_v0(hub, tmp_path)
    s1 = stage_global(tmp_path / "stage1", 1, _state(1), _outer(1))
    other = FileHub(hub.root)

    def collect(at):
        if at == "files":  # another process collects what it sees as orphans
            other.delete([p for p in other.list_global() if p not in m0.files() and p != "global/manifest.json"])

    faults.install(hub, collect)
    with pytest.raises(HubError, match="vanished"):
        hub.publish(s1.manifest(), s1.files, expected_outer_step=0)
    faults.install(hub, None)
    assert hub.read_manifest() == m0
    assert hub.list_global() == sorted(["global/manifest.json", *s0.files])
    hub.publish(s1.manifest(), s1.files, expected_outer_step=0)
    assert hub.read_manifest().outer_step == 1


# ----------------------------------------------------------------------------- crashes


def _crash_scenario(tmp_path: Path, name: str):
    """A hub at version 0, and version 1 staged to be published while collecting version 0."""
    hub = FileHub(tmp_path / name / "hub")
    s0, m0 = _publish_v0(hub, tmp_path / name)
    s1 = stage_global(tmp_path / name / "stage1", 1, _state(1), _outer(1))
    m1 = s1.manifest(ledger={"a": 3})
    return hub, s0, m0, s1, m1


def _labels(tmp_path: Path) -> list[str]:
    hub, s0, _, s1, m1 = _crash_scenario(tmp_path, "labels")
    seen: list[str] = []
    faults.install(hub, seen.append)
    hub.publish(m1, s1.files, expected_outer_step=0, delete=list(s0.files))
    assert seen == [*(f"file:{p}" for p in s1.files), "files", "locked", "manifest",
                    *(f"delete:{p}" for p in s0.files), "deleted"]
    return seen


def _assert_recovers(root: Path, tmp_path: Path, after_swap: bool, s0, s1) -> None:
    """A fresh hub reads a consistent version, and the next publication goes through (lock free)."""
    fresh = FileHub(root)
    m = fresh.read_manifest()
    assert m.outer_step == (1 if after_swap else 0)
    staged, seed = (s1, 1) if after_swap else (s0, 0)
    assert m.weights == staged.weights
    got_m, state = load_global(fresh)  # sha256 and fingerprint verified
    assert got_m == m and _same_state(state, _state(seed))
    assert load_outer_state(fresh, m)["t"] == seed
    # the lock is free ...
    fd = os.open(root / "global" / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    # ... and a later publication succeeds, collecting the orphans of the crashed one
    orphans = [p for p in fresh.list_global() if p not in m.files() and p != "global/manifest.json"]
    s2 = stage_global(tmp_path / f"stage2_{root.parent.name}", m.outer_step + 1, _state(2))
    done = threading.Event()

    def publish():
        fresh.publish(s2.manifest(), s2.files, expected_outer_step=m.outer_step, delete=[*m.files(), *orphans])
        done.set()

    t = threading.Thread(target=publish, daemon=True)
    t.start()
    t.join(timeout=20)
    assert done.is_set(), "publication blocked: the crashed publication left the hub locked"
    assert fresh.list_global() == sorted(["global/manifest.json", *s2.files])
    assert _same_state(load_global(fresh)[1], _state(2))


class _Crash(Exception):
    pass


def test_crash_at_every_point_raising(tmp_path):
    labels = _labels(tmp_path)
    for i, label in enumerate(labels):
        hub, s0, m0, s1, m1 = _crash_scenario(tmp_path, f"raise{i}")
        seen: list[str] = []

        def fault(at, i=i, seen=seen):
            seen.append(at)
            if len(seen) - 1 == i:
                raise _Crash(at)

        faults.install(hub, fault)
        with pytest.raises(_Crash) as ei:
            hub.publish(m1, s1.files, expected_outer_step=0, delete=list(s0.files))
        assert str(ei.value).split(":")[0] == label.split(":")[0]
        after_swap = i >= labels.index("manifest")
        if not after_swap:  # an interrupted publication cleans up what it uploaded
            assert hub.list_global() == sorted(["global/manifest.json", *s0.files])
        _assert_recovers(hub.root, tmp_path, after_swap, s0, s1)


def test_crash_at_every_point_kill9(tmp_path):
    labels = _labels(tmp_path)
    for i, label in enumerate(labels):
        hub, s0, m0, s1, m1 = _crash_scenario(tmp_path, f"kill{i}")
        mpath = tmp_path / f"kill{i}" / "m1.json"
        mpath.write_text(m1.to_json())
        args = dict(root=str(hub.root), manifest=str(mpath), files={k: str(v) for k, v in s1.files.items()},
                    expected=0, delete=list(s0.files), kill_at=i)
        [(rc, line)] = run_racers(_PUBLISH, [args], tmp_path / f"go_kill{i}")
        assert rc == -signal.SIGKILL, (label, rc, line)
        after_swap = i >= labels.index("manifest")
        _assert_recovers(hub.root, tmp_path, after_swap, s0, s1)


# ----------------------------------------------------------------------------- lease


def test_lease_compare_and_swap(hub):
    assert hub.read_lease() is None
    l1 = Lease("host:1:a", 1, time.time() + 30, time.time())
    hub.write_lease(l1, expected=None)
    assert hub.read_lease() == l1
    l2 = Lease("host:2:b", 2, time.time() + 30, time.time())
    with pytest.raises(LeaseConflictError):
        hub.write_lease(l2, expected=None)
    hub.write_lease(l2, expected=l1)
    with pytest.raises(LeaseConflictError, match="host:2:b"):
        hub.write_lease(Lease("host:1:a", 3, time.time() + 30), expected=l1)  # stale expectation
    assert hub.read_lease() == l2
    with pytest.raises(LeaseConflictError):
        hub.write_lease(None, expected=l1)
    hub.write_lease(None, expected=l2)
    assert hub.read_lease() is None
    assert "global/lease.json" not in hub.list_global()


def test_lease_race_threads(hub):
    n = 8
    barrier = threading.Barrier(n)
    results: list = [None] * n

    def take(i):
        barrier.wait()
        try:
            hub.write_lease(Lease(f"m{i}", 1, time.time() + 30), expected=None)
            results[i] = "WIN"
        except LeaseConflictError:
            results[i] = "LOST"

    threads = [threading.Thread(target=take, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("WIN") == 1
    assert hub.read_lease().holder == f"m{results.index('WIN')}"


def test_one_cache_variable_moves_every_cache(tmp_path, monkeypatch):
    """``$DILOCO_CACHE_DIR`` moves the data cache and the hub downloads; ``$DILOCO_CACHE`` (the older,
    downloads-only name) still wins for the downloads when set."""
    from diloco_lightning.data.cache import default_cache_dir as data_cache
    from diloco_lightning.hub.base import default_cache_dir as hub_cache

    monkeypatch.delenv("DILOCO_CACHE", raising=False)
    monkeypatch.setenv("DILOCO_CACHE_DIR", str(tmp_path / "c"))
    assert data_cache() == tmp_path / "c"
    assert hub_cache("hf://org/run").parent == tmp_path / "c"
    assert hub_cache("hf://org/run") != hub_cache("hf://org/other")
    monkeypatch.setenv("DILOCO_CACHE", str(tmp_path / "old"))
    assert hub_cache("hf://org/run").parent == tmp_path / "old"
    assert data_cache() == tmp_path / "c"
    assert data_cache(tmp_path / "given") == tmp_path / "given"


# ----------------------------------------------------------------------------- symbolic links below the hub folder


def _hub_with_everything(tmp_path: Path) -> tuple[FileHub, Lease, NodeClaim]:
    """A hub with a version, a delta, a lease and a claim of node ``a``."""
    hub = FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache")
    _publish_v0(hub, tmp_path)
    src, _ = _delta_file(tmp_path / "d1.safetensors", "a", 1, 1)
    hub.upload_delta(src, "a", 1)
    lease = Lease("host:1:m", 1, time.time() + 30, time.time())
    hub.write_lease(lease, expected=None)
    now = time.time()
    claim = NodeClaim("a", "host:2:w", 1, now, now, now + 60, {})
    hub.write_claim("a", claim, expected=None)
    return hub, lease, claim


def _link_out(hub: FileHub, tmp_path: Path, which: str) -> tuple[Path, str]:
    """``which`` (``global``, ``nodes`` or the node folder ``nodes/a``) replaced by a symbolic link to a
    copy outside the hub: a link that were followed would find the hub's own (valid) documents."""
    rel = {"global": "global", "nodes": "nodes", "node": "nodes/a"}[which]
    outside = tmp_path / "outside"
    shutil.copytree(hub.root / rel, outside)
    shutil.rmtree(hub.root / rel)
    (hub.root / rel).symlink_to(outside, target_is_directory=True)
    return outside, rel


@pytest.mark.parametrize("which", ["global", "nodes", "node"])
def test_no_write_ever_goes_through_a_symbolic_link_below_the_hub(tmp_path, which, caplog):
    """A master publication, a lease write, a claim write and a delta upload write nothing outside the hub
    when ``global/``, ``nodes/`` or ``nodes/a/`` is a link to a folder outside: each writes inside the hub
    when its folder is not the link, else fails with a ``HubError`` naming the link. Before, each wrote
    through the link (the manifest, the lease, the claim, ``.lock`` / ``.claim.lock``, the delta)."""
    hub, lease, claim = _hub_with_everything(tmp_path)
    outside, rel = _link_out(hub, tmp_path, which)
    before = _snapshot(outside)
    in_global = which == "global"

    def attempt(write, through_link: bool) -> None:
        if through_link:
            with pytest.raises(HubError, match=f"{rel} on .* is a symbolic link"):
                write()
        else:
            write()

    s1 = stage_global(tmp_path / "stage1", 1, _state(1))
    m1 = s1.manifest(ledger={"a": 1})
    attempt(lambda: hub.publish(m1, s1.files, expected_outer_step=0), in_global)
    attempt(lambda: hub.write_lease(Lease("host:1:m", 2, time.time() + 30, time.time()), expected=lease), in_global)
    now = time.time()
    attempt(lambda: hub.write_claim("a", NodeClaim("a", "host:2:w", 1, now, now + 1, now + 61, {}), expected=claim),
            not in_global)
    attempt(lambda: hub.write_claim("b", NodeClaim("b", "host:3:w", 1, now, now, now + 60, {}), expected=None),
            which == "nodes")
    src, _ = _delta_file(tmp_path / "d2.safetensors", "a", 2, 2)
    attempt(lambda: hub.upload_delta(src, "a", 2), not in_global)
    attempt(lambda: hub.upload_delta(src, "b", 2), which == "nodes")
    hub.sweep(0.0)
    assert _snapshot(outside) == before  # nothing written, renamed, created or removed outside


@pytest.mark.parametrize("which", ["global", "nodes", "node"])
def test_no_read_or_listing_ever_goes_through_a_symbolic_link_below_the_hub(tmp_path, which, caplog):
    """The manifest, the lease and the claims read through a linked folder are refused like an unreadable
    file (a malformed manifest, an expired lease, no claim, each with a warning naming the link), and a
    listing skips the link with a warning: never the outside copy. Before, each returned the outside file."""
    hub, lease, claim = _hub_with_everything(tmp_path)
    outside, rel = _link_out(hub, tmp_path, which)
    with caplog.at_level(logging.WARNING):
        if which == "global":
            with pytest.raises(ManifestError, match="reached through global, a symbolic link"):
                hub.read_manifest()
            assert hub.read_lease() != lease and hub.read_lease().holder == ""  # expired stand-in
            assert hub.list_global() == []
            with pytest.raises(HubError, match="symbolic link"):
                hub.download("global/manifest.json")
            assert hub.list_claims() == {"a": claim}  # the rest of the hub is read as usual
        else:
            assert hub.read_manifest() is not None and hub.read_lease() == lease
            assert hub.list_deltas() == [] and hub.list_inits() == []
            assert hub.read_claim("a") is None and hub.list_claims() == {}
            with pytest.raises(HubError, match="symbolic link"):
                hub.download("nodes/a/delta_1.safetensors")
    assert any(rel in r.getMessage() and "symbolic link" in r.getMessage() for r in caplog.records), caplog.text
    assert (outside / ("manifest.json" if which == "global" else "a/delta_1.safetensors" if which == "nodes"
                       else "delta_1.safetensors")).is_file()  # the outside copy was there to be found


def test_the_publication_lock_is_never_a_link_nor_a_fifo(tmp_path):
    """``global/.lock`` made a link to a path outside the hub: the lock is refused with a ``HubError`` naming
    it (before, it was created outside the hub). Made a FIFO: refused at once, never waited on (a thread with
    a timeout, so that a regression fails rather than hangs); the same for a node's ``.claim.lock``."""
    hub = FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache")
    target = tmp_path / "outside" / "made-by-the-lock"
    target.parent.mkdir()
    (hub.root / "global" / ".lock").symlink_to(target)
    lease = Lease("host:1:m", 1, time.time() + 30, time.time())
    with pytest.raises(HubError, match=r"global/\.lock on .*: it is a symbolic link"):
        hub.write_lease(lease, expected=None)
    assert not target.exists() and list(target.parent.iterdir()) == []

    (hub.root / "global" / ".lock").unlink()
    os.mkfifo(hub.root / "global" / ".lock")
    (hub.root / "nodes" / "a").mkdir()
    os.mkfifo(hub.root / "nodes" / "a" / ".claim.lock")
    now = time.time()
    for write, where in ((lambda: hub.write_lease(lease, expected=None), r"global/\.lock"),
                         (lambda: hub.write_claim("a", NodeClaim("a", "h:2:w", 1, now, now, now + 60, {}), expected=None),
                          r"nodes/a/\.claim\.lock")):
        box: list = []

        def run() -> None:
            try:
                write()
                box.append(None)
            except BaseException as e:  # noqa: BLE001 - handed to the test thread
                box.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(5)
        assert not t.is_alive(), f"stalled on the FIFO {where}"
        assert isinstance(box[0], HubError), box
        assert re.search(f"{where} on .*: it is a FIFO, not a regular file", str(box[0])), box[0]
    assert sorted(os.listdir(hub.root / "global")) == [".lock"] and hub.read_lease() is None
