"""Switching a Speedtronic run to our master (``compat="speedtronic"``, diloco_lightning/master/compat.py).

Speedtronic's real code (PyPI ``speedtronic`` 2.0.0: its ``HubClient``, its worker coordinator,
its master) is the other side, on a folder hub and on the loopback Hub server
(tests/support/speedtronic_side.py says how it reaches a folder). What is checked: its deltas are
applied exactly once, with the numerics of a reference; its ``global_metadata()`` and
``download_global()`` see our versions; a hub its own master served is adopted mid-run (its
weights bit for bit, the documented ledger rule, a fresh optimizer said in the log); a run mixes
its workers and ours; every bad header is a rejection with a reason; kill -9 at each step of
the adoption and of the next round changes nothing of the result.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from support import speedtronic_side as st  # noqa: E402  (skips this module when speedtronic is not installed)

from diloco_lightning.wire.delta import write_delta
from diloco_lightning.hub.hf import HFHub
from diloco_lightning.hub.local import FileHub
from diloco_lightning.master import MasterOuterLoop
from diloco_lightning.wire.names import LATEST_WEIGHTS_PATH, STEP_COUNT_PATH
from diloco_lightning.util.options import OptionError
from diloco_lightning.worker import DiLoCoWorker

TOKEN = "hf_x"
# lr 1, no momentum: a version is the previous one minus the mean of its deltas, exactly (dyadic values)
PLAIN = dict(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0, poll_interval=0.01, lease_ttl=30.0)


class Tiny(torch.nn.Module):
    """A model with a parameter matrix, a bias and an integer buffer (installed, never sent)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("count", torch.tensor(7))
        with torch.no_grad():  # dyadic values: every difference and mean below is exact in FP32
            self.lin.weight.copy_(torch.arange(12, dtype=torch.float32).reshape(3, 4) / 8)
            self.lin.bias.copy_(torch.tensor([0.5, -0.25, 1.0]))


def initial_state() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in Tiny().state_dict().items()}


def train(model: torch.nn.Module, amount: float) -> None:
    """A deterministic stand-in for inner steps: every weight moves by ``amount``."""
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(amount)


class Side:
    """One hub seen from both sides: ``ours()`` opens our transport on it, ``client(cache)``
    Speedtronic's ``HubClient``; ``server`` is the loopback Hub (None for a folder)."""

    def __init__(self, tmp: Path, server=None) -> None:
        self.tmp, self.server, self.n = tmp, server, 0
        self.root = tmp / "hub"
        if server is None:
            self.root.mkdir()
        else:
            server.create_repo(st.REPO)

    def ours(self):
        self.n += 1
        if self.server is None:
            return FileHub(self.root, cache_dir=self.tmp / f"cache{self.n}")
        return HFHub(st.REPO, endpoint=self.server.endpoint, token=TOKEN, cache_dir=self.tmp / f"cache{self.n}",
                     max_retries=2, retry_base_delay=0.01, retry_max_delay=0.05, timeout=10)

    def client(self, cache: Path):
        return st.client(self.root if self.server is None else self.server, cache)


@pytest.fixture(params=["file", "hf"])
def side(request, tmp_path):
    yield Side(tmp_path, request.getfixturevalue("hf_server") if request.param == "hf" else None)


def read_hub_bytes(hub, path: str) -> bytes:
    p = hub.download(path)
    try:
        return Path(p).read_bytes()
    finally:
        hub.release(p)


def assert_speedtronic_view(hub, client, master: MasterOuterLoop, tmp: Path) -> None:
    """What Speedtronic's client sees is our current version: metadata, and weights bit for bit."""
    step, snap = master.snapshot()
    meta = client.global_metadata()
    assert meta.outer_step == step
    man = hub.read_manifest()
    assert man.outer_step == step and meta.model_file == man.weights
    got = load_file(str(client.download_global(tmp / f"dl_{step}.safetensors", meta)))
    assert got.keys() == snap.keys()
    for k in snap:
        assert torch.equal(got[k], snap[k]), k
    # latest.safetensors is the version's weights file, byte for byte; step_count.json as Speedtronic writes it
    assert read_hub_bytes(hub, LATEST_WEIGHTS_PATH) == read_hub_bytes(hub, man.weights)
    doc = json.loads(read_hub_bytes(hub, STEP_COUNT_PATH))
    assert set(doc) == {"outer_step", "updated_at", "model_file", "algorithm", "optimizer"}
    assert doc["outer_step"] == step and doc["model_file"] == man.weights and doc["optimizer"] == "nesterov"


# ----------------------------------------------------------------------------- a mixed run


def test_speedtronic_and_our_workers_in_one_run(side, tmp_path):
    """Speedtronic's worker coordinator and our DiLoCoWorker train against one compat master: each
    delta is applied exactly once, the versions are exact, and Speedtronic's worker installs them."""
    open_ours, open_client = side.ours, side.client
    hub = open_ours()
    master = MasterOuterLoop(hub, initial_state(), node_state_dir=tmp_path / "m", compat="speedtronic", **PLAIN)
    assert master.sync_once()  # outer_step 0, with Speedtronic's view of it
    client = open_client(tmp_path / "stc")
    assert_speedtronic_view(hub, client, master, tmp_path)

    model = Tiny()
    sw = st.worker(client, "st-node", model, tmp_path / "stw", inner_steps=2)
    assert sw.last_global_step == 0
    params = {k: v.detach().clone() for k, v in initial_state().items()}
    ours = DiLoCoWorker(open_ours(), "our-node", params, poll_interval=0.01, wait_timeout=10)
    ours.start()

    v0 = initial_state()
    # round 1: Speedtronic's worker moves by 0.25 (its delta: +0.25 everywhere), ours by 0.5
    train(model, 0.25)
    sw.after_optimizer_step(model, 1)
    assert sw.after_optimizer_step(model, 2)  # a boundary: the delta went up (synchronously)
    with torch.no_grad():
        for k in ("lin.weight", "lin.bias"):
            params[k].sub_(0.5)
    ours.boundary()
    assert ours.flush()
    assert master.sync_once()
    assert master.outer_step == 1
    assert master.ledger == {"st-node": 2, "our-node": 1}
    step, snap = master.snapshot()
    for k in ("lin.weight", "lin.bias"):
        assert torch.equal(snap[k], v0[k] - 0.375), k  # minus the mean of 0.25 and 0.5
    assert torch.equal(snap["count"], v0["count"])
    assert_speedtronic_view(hub, client, master, tmp_path)
    assert not master.sync_once()  # nothing new: nothing applied twice, no version published
    assert master.last_metrics["accepted"] == 0

    # Speedtronic's worker installs version 1 at its next step; its next delta has base 1
    sw.after_optimizer_step(model, 3)
    assert sw.last_global_step == 1
    for k in ("lin.weight", "lin.bias"):
        assert torch.equal(model.state_dict()[k], snap[k])
    train(model, 0.125)
    sw.after_optimizer_step(model, 4)
    assert master.sync_once()
    assert master.ledger == {"st-node": 4, "our-node": 1}
    _, snap2 = master.snapshot()
    for k in ("lin.weight", "lin.bias"):
        assert torch.equal(snap2[k], snap[k] - 0.125), k
    assert_speedtronic_view(hub, client, master, tmp_path)
    # the processed deltas are gone from the hub (Speedtronic never deleted any)
    assert [r.path for r in hub.list_deltas()] == []
    if side.server is not None:  # on hf://, each version and Speedtronic's view of it are one commit
        for c in side.server.commits(st.REPO):
            if "global/manifest.json" in c.added:
                assert {LATEST_WEIGHTS_PATH, STEP_COUNT_PATH} <= set(c.added), c.summary
    ours.close()
    sw.stop()
    master.close()


# ----------------------------------------------------------------------------- adoption


def test_adopt_a_run_speedtronic_served(side, tmp_path, caplog):
    """Speedtronic's own master serves the hub for two rounds; then ours takes it over: it adopts
    outer_step 2 (weights bit for bit, fresh optimizer said in the log), applies the delta made from
    version 2 exactly once, counts the one made from version 1 as processed (the rule), and
    Speedtronic's worker goes on installing our versions."""
    open_ours, open_client = side.ours, side.client
    client = open_client(tmp_path / "stc")
    theirs = st.speedtronic_master(client, initial_state(), tmp_path / "their_master")
    a_model, b_model = Tiny(), Tiny()
    a = st.worker(client, "a", a_model, tmp_path / "wa")
    b = st.worker(open_client(tmp_path / "stc_b"), "b", b_model, tmp_path / "wb")
    assert a.last_global_step == 0 and b.last_global_step == 0
    for step, amount in ((2, 0.25), (4, 0.5)):  # two of Speedtronic's rounds, one delta of a each
        train(a_model, amount)
        assert a.after_optimizer_step(a_model, step)
        assert theirs.sync_once() == step // 2
        a.after_optimizer_step(a_model, step + 1)  # installs it
    assert a.last_global_step == 2
    # in flight when Speedtronic's master stops: a's delta from version 2, b's from version 0
    train(a_model, 0.125)
    assert a.after_optimizer_step(a_model, 6)
    train(b_model, 1.0)
    assert b.after_optimizer_step(b_model, 2)
    _, their_v2 = theirs.snapshot()
    theirs.stop()

    hub = open_ours()
    with caplog.at_level(logging.INFO, logger="diloco_lightning.master.compat"):
        master = MasterOuterLoop(hub, initial_state(), node_state_dir=tmp_path / "m", compat="speedtronic", **PLAIN)
        assert master.sync_once()
    assert "adopted Speedtronic's outer_step 2" in caplog.text and "fresh state" in caplog.text
    assert master.last_metrics["adopted"] == 2
    # a's delta from version 2 is applied; b's from version 0 counts as processed by Speedtronic
    assert master.outer_step == 3
    assert master.ledger == {"a": 6, "b": 2}
    _, snap = master.snapshot()
    for k in their_v2:
        want = their_v2[k] - 0.125 if k != "count" else their_v2[k]
        assert torch.equal(snap[k], want), k
    assert master.hub.read_lease().holder == master.holder  # ours owns the run now
    assert [r.path for r in hub.list_deltas()] == []  # Speedtronic's backlog collected
    assert_speedtronic_view(hub, client, master, tmp_path)
    a.after_optimizer_step(a_model, 7)
    b.after_optimizer_step(b_model, 3)
    assert a.last_global_step == 3 and b.last_global_step == 3
    assert not master.sync_once()  # exactly once
    # a restarted master (same folder) resumes ours, never adopts Speedtronic's again
    master.close()
    again = MasterOuterLoop(open_ours(), initial_state(), node_state_dir=tmp_path / "m", compat="speedtronic", **PLAIN)
    assert not again.sync_once()
    assert again.outer_step == 3 and again.ledger == {"a": 6, "b": 2}
    again.close()
    a.stop()
    b.stop()


# ----------------------------------------------------------------------------- what a bad delta gets


def test_every_bad_speedtronic_delta_is_a_rejection_with_a_reason(tmp_path, caplog):
    """Deltas written by Speedtronic's own HubClient with hostile headers and tensors: each one is
    refused with its reason (no value of any size shown whole), none moves the ledger, and the good
    delta of the same round is applied."""
    root = tmp_path / "hub"
    hub = FileHub(root, cache_dir=tmp_path / "c")
    master = MasterOuterLoop(hub, initial_state(), node_state_dir=tmp_path / "m", compat="speedtronic", **PLAIN)
    master.sync_once()
    client = st.client(root, tmp_path / "stc")
    good = {"lin.weight": torch.full((3, 4), 0.25), "lin.bias": torch.full((3,), 0.25)}
    big = "9" * 5000
    cases = {  # node -> (tensors, base_outer_step, extra header, expected reason)
        "algo": (good, 0, {"algorithm": "x" * 5000}, "header"),
        "bloat": (good, 0, {"algorithm": "x" * 100_000}, "size"),  # larger than any delta of this model: never read
        "extra": (good, 0, {"evil": "1"}, "header"),
        "never": (good, -1, {}, "header"),
        "hugebase": (good, 0, {"base_outer_step": big}, "header"),
        "hugestep": (good, 0, {"local_step": big}, "header"),
        "steps": (good, 0, {"local_step": "3"}, "path_mismatch"),
        "who": (good, 0, {"node_id": "someone-else"}, "path_mismatch"),
        "badid": (good, 0, {"node_id": "../../etc"}, "node_id"),
        "ahead": (good, 5, {}, "negative_staleness"),
        "bf16": ({k: v.to(torch.bfloat16) for k, v in good.items()}, 0, {}, "dtype"),
        "missing": ({"lin.weight": good["lin.weight"]}, 0, {}, "missing_key"),
        "more": (dict(good, intruder=torch.zeros(2)), 0, {}, "extra_key"),
        "shape": (dict(good, **{"lin.bias": torch.zeros(4)}), 0, {}, "shape"),
        "nan": (dict(good, **{"lin.bias": torch.tensor([0.0, float("nan"), 0.0])}), 0, {}, "non_finite"),
        "huge": ({k: v * 1e6 for k, v in good.items()}, 0, {}, "norm_global"),
        "fine": (good, 0, {"algorithm": "dumb_diloco"}, None),
    }
    for node, (tensors, base, extra, _) in cases.items():
        client.upload_delta(tensors, node_id=node, local_step=5, base_outer_step=base, metadata=extra)
    # a file that only looks like a delta, and one of ours with a hostile format
    (root / "nodes" / "junk").mkdir()
    (root / "nodes" / "junk" / "delta_5.safetensors").write_bytes(b"\xff" * 64)
    ours = tmp_path / "ours.safetensors"
    save_file(good, str(ours), metadata={"format": "f" * 10_000, "node_id": "fmt", "local_step": "5", "base_outer_step": "0"})
    hub.upload_delta(ours, "fmt", 5)
    with caplog.at_level(logging.WARNING, logger="diloco_lightning.master"):
        assert master.sync_once()
    want = {}
    for *_, reason in cases.values():
        if reason is not None:
            want[reason] = want.get(reason, 0) + 1
    want["unreadable"] = 1
    want["format"] = 1
    assert master.last_metrics["rejected_by_reason"] == want
    assert master.ledger == {"fine": 5}
    _, snap = master.snapshot()
    assert torch.equal(snap["lin.weight"], initial_state()["lin.weight"] - 0.25)
    assert max(len(r.getMessage()) for r in caplog.records) < 1500  # no 100 kB header value in a log line
    assert "is -1: the Speedtronic worker had installed no global version" in caplog.text
    assert "'algorithm' is 'xxxxxxxxxxxxxxxxxxxx'...(5000 characters)" in caplog.text
    assert not master.sync_once()  # refused files are never read twice, and were deleted with the publication
    assert [r.path for r in hub.list_deltas()] == []
    master.close()


def test_without_compat_a_speedtronic_delta_is_refused_with_a_hint(tmp_path, caplog):
    root = tmp_path / "hub"
    master = MasterOuterLoop(FileHub(root, cache_dir=tmp_path / "c"), initial_state(), node_state_dir=tmp_path / "m", **PLAIN)
    master.sync_once()
    st.client(root, tmp_path / "stc").upload_delta(
        {"lin.weight": torch.zeros(3, 4), "lin.bias": torch.zeros(3)}, node_id="a", local_step=2, base_outer_step=0)
    with caplog.at_level(logging.WARNING, logger="diloco_lightning.master"):
        master.sync_once()
    assert master.last_metrics["rejected_by_reason"] == {"format": 1}
    assert "a master started with compat=speedtronic takes them" in caplog.text
    assert not (root / STEP_COUNT_PATH).exists() and not (root / LATEST_WEIGHTS_PATH).exists()
    master.close()


def test_a_speedtronic_hub_that_cannot_be_adopted_is_never_published_over(tmp_path):
    """A malformed step_count.json, weights of another model or with a NaN: the master says why
    and publishes nothing (a Speedtronic worker would otherwise be left on its old version)."""
    root = tmp_path / "hub"
    hub = FileHub(root, cache_dir=tmp_path / "c")
    client = st.client(root, tmp_path / "stc")
    from diloco_lightning.master.compat import SpeedtronicAdoptionError
    from diloco_lightning.master.config import MasterConfigError

    def master():  # no lease: each attempt is a fresh master, none of them closed
        return MasterOuterLoop(hub, initial_state(), node_state_dir=tmp_path / "m", compat="speedtronic", **dict(PLAIN, lease=False))

    for text in ('{"outer_step": -3}', '{"outer_step": "7"}', "[1]", '{"outer_step": 1, "model_file": "../../etc/passwd"}',
                 '{"outer_step": 1, "model_file": "global/step_count.json"}', '{"outer_step": ' + "9" * 30 + "}"):
        (root / STEP_COUNT_PATH).write_text(text)
        with pytest.raises(SpeedtronicAdoptionError, match="step_count.json"):
            master().sync_once()
    (root / STEP_COUNT_PATH).write_bytes(b" " * 100_000)
    with pytest.raises(SpeedtronicAdoptionError, match="more than"):
        master().sync_once()
    other = {"w": torch.zeros(5)}
    client.publish_global(other, outer_step=4)
    with pytest.raises(MasterConfigError, match="another model"):
        master().sync_once()
    bad = initial_state()
    bad["lin.bias"][1] = float("inf")
    client.publish_global(bad, outer_step=4)
    with pytest.raises(SpeedtronicAdoptionError, match="NaN or inf"):
        master().sync_once()
    assert hub.read_manifest() is None
    # repaired: adopted
    client.publish_global(initial_state(), outer_step=4)
    m = master()
    assert m.sync_once() and m.outer_step == 4 and hub.read_manifest().outer_step == 4
    m.close()


# ----------------------------------------------------------------------------- options and the command


def test_compat_options(tmp_path, monkeypatch):
    hub = FileHub(tmp_path / "hub", cache_dir=tmp_path / "c")
    with pytest.raises(OptionError, match="compat must be null or one of"):
        MasterOuterLoop(hub, initial_state(), node_state_dir=tmp_path / "m", compat="speedtronix")
    with pytest.raises(OptionError, match="weighting='equal'"):
        MasterOuterLoop(hub, initial_state(), node_state_dir=tmp_path / "m", compat="speedtronic", weighting="tokens")
    monkeypatch.setenv("DILOCO_RUN_KEY", "a-run-key-of-some-length")
    with pytest.raises(OptionError, match="signed run"):
        MasterOuterLoop(hub, initial_state(), node_state_dir=tmp_path / "m", compat="speedtronic")


def test_diloco_master_compat_speedtronic_adopts_from_the_command_line(tmp_path):
    """``diloco-master compat=speedtronic`` (real Hydra composition, a subprocess, no model code) on
    a hub Speedtronic's master served: it adopts, applies the new delta, and says so."""
    root = tmp_path / "hub"
    client = st.client(root, tmp_path / "stc")
    theirs = st.speedtronic_master(client, initial_state(), tmp_path / "their")
    client.upload_delta({"lin.weight": torch.full((3, 4), 0.5), "lin.bias": torch.full((3,), 0.5)}, node_id="a",
                        local_step=2, base_outer_step=0, metadata={"algorithm": "dumb_diloco"})
    assert theirs.sync_once() == 1
    client.upload_delta({"lin.weight": torch.full((3, 4), 0.25), "lin.bias": torch.full((3,), 0.25)}, node_id="a",
                        local_step=4, base_outer_step=1, metadata={"algorithm": "dumb_diloco"})
    _, v1 = theirs.snapshot()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), DILOCO_CACHE=str(tmp_path / "hc"))
    proc = subprocess.run(
        [sys.executable, "-m", "diloco_lightning.app.master", f"hub.url={root}", "compat=speedtronic", "outer=nesterov",
         "outer.lr=1.0", "outer.options.momentum=0.0", "max_rounds=1", "poll_interval=0.05", f"node_state_dir={tmp_path / 'ms'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "adopted Speedtronic's outer_step 1" in proc.stderr, proc.stderr[-3000:]
    meta = client.global_metadata()
    assert meta.outer_step == 2
    got = load_file(str(client.download_global(tmp_path / "g.safetensors", meta)))
    assert torch.equal(got["lin.weight"], v1["lin.weight"] - 0.25) and torch.equal(got["count"], v1["count"])


def test_mirrors_on_s3(tmp_path, s3_endpoint):
    """s3://: Speedtronic's view is written after the manifest's conditional PUT (its client does not
    speak S3; the files are what a client reading them would need)."""
    import boto3

    from diloco_lightning.hub import open_hub

    bucket = f"compat-{os.getpid()}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    hub = open_hub(f"s3://{bucket}/run", endpoint_url=s3_endpoint, addressing_style="path", cache_dir=tmp_path / "c",
                   max_retries=2, retry_base_delay=0.001, retry_max_delay=0.01)
    master = MasterOuterLoop(hub, initial_state(), node_state_dir=tmp_path / "m", compat="speedtronic", **PLAIN)
    master.sync_once()
    p = tmp_path / "d.safetensors"
    write_delta(p, {"lin.weight": torch.full((3, 4), 0.5), "lin.bias": torch.full((3,), 0.5)}, node_id="n", local_step=1,
                base_outer_step=0)
    hub.upload_delta(p, "n", 1)
    assert master.sync_once()
    man = hub.read_manifest()
    assert read_hub_bytes(hub, LATEST_WEIGHTS_PATH) == read_hub_bytes(hub, man.weights)
    doc = json.loads(read_hub_bytes(hub, STEP_COUNT_PATH))
    assert doc["outer_step"] == 1 and doc["model_file"] == man.weights
    master.close()


# ----------------------------------------------------------------------------- kill -9


SCRIPT = Path(__file__).parent / "support" / "master_crash_script.py"
CRASH_MASTER = dict(outer_lr=0.7, outer_momentum=0.9, lease_ttl=0.5, norm_ratio=4.0, poll_interval=0.02, compat="speedtronic")


def _crash_state() -> dict[str, torch.Tensor]:
    from support.master_crash_script import initial_state as crash_initial_state

    return crash_initial_state(0)


def _fp32_delta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + seed)
    return {k: torch.randn(v.shape, generator=g) * 0.01 for k, v in _crash_state().items() if v.is_floating_point()}


def _speedtronic_served(where, tmp: Path) -> None:
    """Speedtronic's master serves two rounds; then deltas of a, b (from version 2) and c (one from
    version 1: counted as processed; one from version 2: new) wait on the hub."""
    client = st.client(where, tmp / "stc")
    theirs = st.speedtronic_master(client, _crash_state(), tmp / "their")
    up = [0]

    def upload(node, step, base):
        up[0] += 1
        client.upload_delta(_fp32_delta(up[0]), node_id=node, local_step=step, base_outer_step=base,
                            metadata={"algorithm": "dumb_diloco"})

    upload("a", 10, 0)
    upload("b", 10, 0)
    assert theirs.sync_once() == 1
    upload("a", 20, 1)
    assert theirs.sync_once() == 2
    upload("a", 30, 2)
    upload("b", 20, 2)
    upload("c", 5, 1)
    upload("c", 6, 2)


def _finish(master: MasterOuterLoop, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:  # a killed master's lease expires after lease_ttl
        master.sync_once(force=True)
        if master.is_leader and master.outer_step >= 3 and not master.hub.list_deltas(after=master.ledger):
            return
        time.sleep(0.05)
    raise AssertionError("the master did not finish")


_CRASH_REF: dict[str, tuple] = {}


def _crash_reference(tmp_factory) -> tuple:
    if "ref" not in _CRASH_REF:
        tmp = tmp_factory.mktemp("compat_ref")
        _speedtronic_served(tmp / "hub", tmp)
        m = MasterOuterLoop(FileHub(tmp / "hub", cache_dir=tmp / "c"), _crash_state(), node_state_dir=tmp / "m", **CRASH_MASTER)
        _finish(m)
        _CRASH_REF["ref"] = (*m.snapshot(), m.ledger)
        m.close()
    return _CRASH_REF["ref"]


def _kill_and_restart(tmp: Path, side: Side, spec: dict, crash: str, occurrence: int, ref: tuple) -> None:
    _speedtronic_served(side.root if side.server is None else side.server, tmp)
    env = dict(os.environ)
    cfg = {"hub": spec, "state_dir": str(tmp / "m"), "seed": 0, "crash": crash, "occurrence": occurrence,
           "master": CRASH_MASTER}
    proc = subprocess.run([sys.executable, str(SCRIPT), json.dumps(cfg)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == -signal.SIGKILL, (crash, proc.returncode, proc.stdout, proc.stderr[-3000:])
    m = MasterOuterLoop(side.ours(), _crash_state(), node_state_dir=tmp / "m", **CRASH_MASTER)
    _finish(m)
    step, snap = m.snapshot()
    assert step == ref[0] == 3 and m.ledger == ref[2] == {"a": 30, "b": 20, "c": 6}, (crash, step, m.ledger)
    for k, v in ref[1].items():
        assert torch.equal(snap[k], v), (crash, k)
    hub = m.hub
    man = hub.read_manifest()
    doc = json.loads(read_hub_bytes(hub, STEP_COUNT_PATH))
    assert doc["outer_step"] == 3 and doc["model_file"] == man.weights
    assert read_hub_bytes(hub, LATEST_WEIGHTS_PATH) == read_hub_bytes(hub, man.weights)
    m.close()


FOLDER_POINTS = [
    ("files", 1, False),  # the adoption's publication: staged, nothing swapped
    ("manifest", 1, False),  # our manifest of the adopted version is in place, Speedtronic's view still theirs
    ("mirror:global/latest.safetensors", 1, True),  # latest replaced, step_count.json not yet
    ("published", 1, True),  # adopted and published, the local copy not saved
    ("downloaded", 1, True),  # the first round's deltas read, nothing applied
    ("mirror:global/step_count.json", 2, False),  # the round's version and its view published, nothing deleted
    ("saved", 2, True),
]


@pytest.mark.parametrize("crash, occurrence", [pytest.param(c, o, marks=pytest.mark.slow) if slow else (c, o)
                                               for c, o, slow in FOLDER_POINTS], ids=[f"{c}#{o}" for c, o, _ in FOLDER_POINTS])
def test_kill9_during_adoption_and_after_on_a_folder(tmp_path, tmp_path_factory, crash, occurrence):
    """kill -9 at each step of the adoption and of the round after it: a restarted master ends with
    the uninterrupted master's state, bit for bit, and Speedtronic's view of it."""
    ref = _crash_reference(tmp_path_factory)
    side = Side(tmp_path)
    spec = {"kind": "file", "path": str(side.root), "cache_dir": str(tmp_path / "script_cache")}
    _kill_and_restart(tmp_path, side, spec, crash, occurrence, ref)


@pytest.mark.parametrize("crash, occurrence", [("committed", 1), pytest.param("files", 2, marks=pytest.mark.slow)])
def test_kill9_during_adoption_on_the_hugging_face_hub(tmp_path, tmp_path_factory, hf_server, crash, occurrence):
    ref = _crash_reference(tmp_path_factory)
    side = Side(tmp_path, hf_server)
    spec = {"kind": "hf", "endpoint": hf_server.endpoint, "repo": st.REPO, "token": TOKEN,
            "cache_dir": str(tmp_path / "script_cache")}
    _kill_and_restart(tmp_path, side, spec, crash, occurrence, ref)
