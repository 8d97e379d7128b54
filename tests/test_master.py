"""MasterOuterLoop with real files: on a folder hub and on the loopback Hugging Face server.

Exactness checks use the outer step of docs/spec.md: with Nesterov ``lr=1, momentum=0`` a round
subtracts the (weighted) mean of its deltas, and in arrival mode every delta is subtracted
once, so integer-valued deltas give bit-exact expectations. Crash (kill -9) tests are in
tests/test_master_crash.py.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file


from diloco_lightning.util import faults  # noqa: E402
from diloco_lightning.wire.delta import model_fingerprint, write_delta  # noqa: E402
from diloco_lightning.hub.versions import load_global, load_outer_state  # noqa: E402
from diloco_lightning.hub.base import DeltaRef  # noqa: E402
from diloco_lightning.hub import open_hub  # noqa: E402
from diloco_lightning.hub.local import FileHub  # noqa: E402
from diloco_lightning.wire.manifest import Lease  # noqa: E402
from diloco_lightning.master import REASONS, MasterConfigError, MasterOuterLoop  # noqa: E402
from diloco_lightning.master.staging import write_safetensors_hashed  # noqa: E402
from diloco_lightning.util.fileio import sha256_file  # noqa: E402
from diloco_lightning.wire.signing import RunKey  # noqa: E402
from diloco_lightning.wire.statefile import load_state_file, load_weights_file, save_state_file, save_weights_file  # noqa: E402

from support.hf_server import FakeHubServer  # noqa: E402
from support.spies import count_downloads  # noqa: E402

REPO = "org/master-run"
TOKEN = "hf_masterTESTtoken0123456789"


def s0() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(4, 3), "b": torch.zeros(3), "steps": torch.tensor(7)}


FP = model_fingerprint(s0())


def dt(value: float = 1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 3), float(value)), "b": torch.full((3,), float(value))}




class Hubs:
    """Handles on one hub: each master or worker opens its own (own cache), like separate machines."""

    def __init__(self, kind: str, tmp: Path, server: FakeHubServer | None = None, s3: tuple[str, str] | None = None) -> None:
        self.kind, self.tmp, self.server, self.s3 = kind, tmp, server, s3
        self.n = 0

    def open(self):
        self.n += 1
        if self.kind == "file":
            return FileHub(self.tmp / "hub", cache_dir=self.tmp / f"cache{self.n}")
        if self.kind == "s3":  # through the proxy, which makes racing conditional writes atomic as on S3
            endpoint, bucket = self.s3
            return open_hub(f"s3://{bucket}/run", endpoint_url=endpoint, addressing_style="path",
                            cache_dir=self.tmp / f"s3cache{self.n}", max_retries=2, retry_base_delay=0.01,
                            retry_max_delay=0.05, check_conditional_writes=self.n == 1)
        from diloco_lightning.hub.hf import HFHub

        return HFHub(
            REPO, endpoint=self.server.endpoint, token=TOKEN, cache_dir=self.tmp / f"hfcache{self.n}",
            max_retries=2, retry_base_delay=0.01, retry_max_delay=0.05, timeout=10, commits_per_hour=0,
        )


@pytest.fixture(params=["file", "hf"])
def hubs(request, tmp_path):
    if request.param == "file":
        yield Hubs("file", tmp_path)
    else:
        with FakeHubServer() as server:
            yield Hubs("hf", tmp_path, server)


@pytest.fixture(params=["file", "hf", pytest.param("s3", marks=pytest.mark.slow)])
def all_hubs(request, tmp_path):
    """Every transport: the folder, the loopback Hub, S3 (moto behind the proxy; 10-15 s a test, so slow:
    the S3 transport's own compare-and-swap races run by default in tests/test_hub_s3.py)."""
    if request.param == "s3":
        yield Hubs("s3", tmp_path, s3=(request.getfixturevalue("s3_proxy").endpoint, request.getfixturevalue("s3_bucket")))
    elif request.param == "hf":
        with FakeHubServer() as server:
            yield Hubs("hf", tmp_path, server)
    else:
        yield Hubs("file", tmp_path)


@pytest.fixture
def fhubs(tmp_path):
    return Hubs("file", tmp_path)


class Workers:
    """Writes deltas onto a hub as workers would."""

    def __init__(self, hub, tmp: Path) -> None:
        self.hub = hub
        self.dir = tmp / "worker_files"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.k = 0

    def _tmp(self) -> Path:
        self.k += 1
        return self.dir / f"f{self.k}.safetensors"

    def put(self, node: str, step: int, base: int = 0, tensors=None, value: float = 1.0, fp: str | None = FP, **kw) -> str:
        p = self._tmp()
        write_delta(p, tensors if tensors is not None else dt(value), node_id=node, local_step=step,
                    base_outer_step=base, model_fingerprint=fp, **kw)
        return self.hub.upload_delta(p, node, step)

    def put_raw(self, node: str, step: int, tensors: dict, metadata: dict | None) -> str:
        p = self._tmp()
        save_file(tensors, str(p), metadata=metadata)
        return self.hub.upload_delta(p, node, step)

    def put_bytes(self, node: str, step: int, data: bytes) -> str:
        p = self._tmp()
        p.write_bytes(data)
        return self.hub.upload_delta(p, node, step)


def make_master(hub, tmp: Path, name: str = "m", state=s0, **kw) -> MasterOuterLoop:
    # the library's default until the scaling study (fedavg now), named: these tests' hubs say nesterov
    opts = dict(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0, lease_ttl=30.0, norm_ratio=None, norm_global_ratio=None, poll_interval=0.02)
    opts.update(kw)
    st = state() if callable(state) else state
    return MasterOuterLoop(hub, st, node_state_dir=tmp / name, **opts)


def drain(master: MasterOuterLoop, n: int = 20) -> None:
    for _ in range(n):
        master.sync_once(force=True)
        if not master.hub.list_deltas(after=master.ledger):
            return


# ============================================================================ basics


def test_round_applies_weighted_mean_publishes_and_cleans_up(hubs, tmp_path):
    hub = hubs.open()
    w = Workers(hubs.open(), tmp_path)
    m = make_master(hub, tmp_path, keep_globals=1)
    assert m.sync_once() is True  # publishes outer step 0
    assert m.outer_step == 0 and hub.read_manifest().outer_step == 0
    w.put("a", 0, value=1)
    w.put("b", 0, value=3)
    assert m.sync_once() is True
    step, snap = m.snapshot()
    assert step == 1
    assert torch.equal(snap["w"], torch.full((4, 3), -2.0)) and torch.equal(snap["b"], torch.full((3,), -2.0))
    assert int(snap["steps"]) == 7  # integer buffers never move
    man = hub.read_manifest()
    assert man.outer_step == 1 and man.ledger == {"a": 0, "b": 0}
    assert [v.outer_step for v in man.history] == [0]
    assert man.optimizer["name"] == "nesterov" and man.master["holder"] == m.holder
    assert hub.list_deltas() == []  # processed deltas are deleted with the publication
    _, state = load_global(hubs.open(), man)
    assert torch.equal(state["w"], snap["w"])
    assert load_outer_state(hubs.open(), man)["optimizer"] is not None
    metrics = m.last_metrics
    assert metrics["accepted"] == 2 and metrics["staleness_histogram"] == {"0": 2}
    assert sorted(metrics["applied"]) == ["a/0", "b/0"] and metrics["published"] == 1
    assert m.sync_once() is False and m.outer_step == 1  # nothing new: nothing published
    for i in range(3):
        w.put("a", i + 1, base=m.outer_step, value=1)
        assert m.sync_once()
    man = hub.read_manifest()
    assert [v.outer_step for v in man.history] == [3]  # keep_globals=1
    assert sorted(p for p in hub.list_global() if "weights_" in p) == sorted([man.weights, man.history[0].weights])
    assert sum("outer_state_" in p for p in hub.list_global()) == 1
    assert "nodes/a/delta_3.safetensors" in m.processed_filenames
    assert "nodes/a/delta_4.safetensors" not in m.processed_filenames


def test_token_weighting(fhubs, tmp_path):
    hub = fhubs.open()
    w = Workers(hub, tmp_path)
    m = make_master(hub, tmp_path, weighting="tokens")
    m.sync_once()
    w.put("a", 0, value=1, num_tokens=1)
    w.put("b", 0, value=4, num_tokens=3)
    w.put("c", 0, value=100)  # no num_tokens: rejected
    assert m.sync_once()
    assert torch.equal(m.snapshot()[1]["w"], torch.full((4, 3), -3.25))  # (1*1 + 3*4) / 4
    assert m.last_metrics["rejected_by_reason"] == {"num_tokens": 1}
    # a rejection never moves the ledger; the refused file goes with the publication
    assert hub.read_manifest().ledger == {"a": 0, "b": 0}
    assert [r.path for r in hub.list_deltas()] == []


def test_staleness_gates_and_weights_cgad(fhubs, tmp_path):
    """g = sum(w_i * gate(tau_i) * delta_i) / sum(w_i), then one CGAD step with gated=True."""
    from diloco_lightning.outer import build_outer_optimizer

    hub = fhubs.open()
    w = Workers(hub, tmp_path)
    opts = dict(lr=0.1, alpha=0.2, tau_cut=32)
    m = make_master(hub, tmp_path, outer_optimizer="cgad", outer_options=opts)
    m.sync_once()
    w.put("a", 0, value=1)
    assert m.sync_once()  # outer step 1
    w.put("a", 1, base=1, value=1)
    w.put("b", 0, base=0, value=2)  # staleness 1
    assert m.sync_once()
    ref_state = s0()
    ref = build_outer_optimizer("cgad", ref_state, **opts)
    ref.step(ref_state, dt(1), staleness=0, gated=True)
    gate1 = ref.gate(1)
    g = {k: (1.0 * v + gate1 * 2 * torch.ones_like(v)) / 2 for k, v in dt(1).items()}
    ref.step(ref_state, g, staleness=0, gated=True)
    snap = m.snapshot()[1]
    assert torch.allclose(snap["w"], ref_state["w"], rtol=1e-6, atol=1e-7)
    assert m.last_metrics["staleness_histogram"] == {"0": 1, "1": 1}


@pytest.mark.parametrize("publish", ["pass", "each"])
def test_arrival_mode_one_step_per_delta_in_order(hubs, tmp_path, publish):
    hub = hubs.open()
    w = Workers(hubs.open(), tmp_path)
    m = make_master(hub, tmp_path, aggregation="arrival", arrival_publish=publish)
    m.sync_once()
    w.put("b", 0, base=0, value=1)
    w.put("b", 1, base=0, value=2)
    w.put("a", 0, base=0, value=4)
    assert m.sync_once()
    assert m.outer_step == 3
    assert torch.equal(m.snapshot()[1]["w"], torch.full((4, 3), -7.0))
    # oldest anchor first, ties by node, one node's deltas in upload order; staleness grows per step
    assert m.last_metrics["applied"] == ["a/0", "b/0", "b/1"]
    assert m.last_metrics["staleness_histogram"] == {"0": 1, "1": 1, "2": 1}
    manifest = hub.read_manifest()
    assert manifest.ledger == {"a": 0, "b": 1} and manifest.outer_step == 3
    # "pass": the three outer steps are published as one version (1 and 2 never exist); "each": one per delta
    assert m.last_metrics["published"] == (1 if publish == "pass" else 3)
    assert [v.outer_step for v in manifest.history] == ([0] if publish == "pass" else [2, 1, 0])
    assert hub.list_deltas() == []  # every applied delta deleted by the publication that carried it


def _flat(sd, prefix=""):
    """A state dict's leaves as comparable lists (tensors as their values)."""
    if isinstance(sd, dict):
        return {k: v for key, val in sd.items() for k, v in _flat(val, f"{prefix}{key}/").items()}
    if isinstance(sd, (list, tuple)):
        return {k: v for i, val in enumerate(sd) for k, v in _flat(val, f"{prefix}{i}/").items()}
    return {prefix: sd.flatten().tolist() if isinstance(sd, torch.Tensor) else sd}


def test_a_pass_of_several_deltas_gets_the_staleness_and_steps_of_a_publication_each(fhubs, tmp_path):
    """A master behind its arrivals applies the deltas one pass finds as consecutive optimizer and outer
    steps, each delta's staleness counted at its own application: CGAD's gates and Adam moments are
    bit for bit those of the master that publishes every delta, with one publication instead of four;
    the next pass counts from the published version (outer step 4)."""
    opts = dict(lr=0.1, alpha=0.2, tau_cut=32)
    masters, workers = {}, {}
    for publish in ("pass", "each"):
        d = tmp_path / publish
        hub = FileHub(d / "hub", cache_dir=d / "cache")
        masters[publish] = make_master(hub, d, outer_optimizer="cgad", outer_options=opts, aggregation="arrival",
                                       arrival_publish=publish)
        masters[publish].sync_once()
        workers[publish] = Workers(FileHub(d / "hub", cache_dir=d / "wcache"), d)
    for publish, w in workers.items():
        w.put("a", 0, base=0, value=1)
        w.put("b", 0, base=0, value=2)
        w.put("c", 0, base=0, value=-1)
        w.put("a", 1, base=0, value=3)
    for m in masters.values():
        assert m.sync_once() and m.outer_step == 4
        assert m.last_metrics["staleness_histogram"] == {"0": 1, "1": 1, "2": 1, "3": 1}
    assert masters["pass"].last_metrics["published"] == 1 and masters["each"].last_metrics["published"] == 4
    for k, v in masters["each"].snapshot()[1].items():
        assert torch.equal(masters["pass"].snapshot()[1][k], v), k
    assert _flat(masters["pass"].run.opt.state_dict()) == _flat(masters["each"].run.opt.state_dict())
    w = workers["pass"]
    w.put("b", 1, base=4, value=1)  # from the version the pass published
    w.put("c", 1, base=0, value=0.5)  # the older anchor: applied first, at outer step 4 (staleness 4)
    assert masters["pass"].sync_once() and masters["pass"].outer_step == 6
    assert masters["pass"].last_metrics["applied"] == ["c/1", "b/1"]
    assert masters["pass"].last_metrics["staleness_histogram"] == {"4": 1, "1": 1}  # b/1 applied at outer step 5
    assert masters["pass"].hub.read_manifest().ledger == {"a": 1, "b": 1, "c": 1}


def test_pa_cgad_round_mode_gates_on_round_max_staleness(fhubs, tmp_path):
    hub = fhubs.open()
    w = Workers(hub, tmp_path)
    m = make_master(hub, tmp_path, outer_optimizer="pa_cgad", outer_options=dict(lr=0.1))
    m.sync_once()
    w.put("a", 0, value=1)
    assert m.sync_once()
    w.put("a", 1, base=1, value=1)
    w.put("b", 0, base=0, value=3)
    assert m.sync_once()
    assert m.outer_step == 2 and m.last_metrics["staleness_histogram"] == {"0": 1, "1": 1}


# ============================================================================ validation


def _signed_key():
    return RunKey(b"run-secret")


CASES = {
    # reason: (master kwargs, setup rounds with a good delta first, writer of the bad delta)
    "unreadable": ({}, 0, lambda w: w.put_bytes("x", 0, b"not a safetensors file at all")),
    "format": ({}, 0, lambda w: w.put_raw("x", 0, dt(), {"format": "speedtronic", "node_id": "x"})),
    "header": ({}, 0, lambda w: w.put_raw("x", 0, dt(), {"format": "diloco-delta/1", "node_id": "x", "local_step": "0"})),
    "node_id": ({}, 0, lambda w: w.put_raw(
        "x", 0, dt(), {"format": "diloco-delta/1", "node_id": ".bad", "local_step": "0", "base_outer_step": "0"})),
    "path_mismatch": ({}, 0, lambda w: w.put_raw(
        "x", 0, dt(), {"format": "diloco-delta/1", "node_id": "y", "local_step": "0", "base_outer_step": "0"})),
    "missing_key": ({}, 0, lambda w: w.put("x", 0, tensors={"w": torch.ones(4, 3)}, fp=None)),
    "extra_key": ({}, 0, lambda w: w.put("x", 0, tensors={**dt(), "zz": torch.ones(2)}, fp=None)),
    "shape": ({}, 0, lambda w: w.put("x", 0, tensors={"w": torch.ones(3, 4), "b": torch.ones(3)}, fp=None)),
    "dtype": ({}, 0, lambda w: w.put_raw(
        "x", 0, {"w": torch.ones(4, 3, dtype=torch.int32), "b": torch.ones(3)},
        {"format": "diloco-delta/1", "node_id": "x", "local_step": "0", "base_outer_step": "0"})),
    "non_finite": ({}, 0, lambda w: w.put("x", 0, tensors={"w": torch.full((4, 3), float("nan")), "b": torch.ones(3)})),
    "fingerprint": ({}, 0, lambda w: w.put("x", 0, fp="0" * 64)),
    "signature": ({"signing_key": _signed_key()}, 0, lambda w: w.put("x", 0, signing_key=RunKey(b"wrong key"))),
    "negative_staleness": ({}, 0, lambda w: w.put("x", 0, base=5)),
    "max_staleness": ({"max_staleness": 0}, 1, lambda w: w.put("x", 0, base=0)),
    "too_stale": ({"outer_optimizer": "cgad", "outer_options": {"lr": 0.1, "tau_cut": 1}}, 1, lambda w: w.put("x", 0, base=0)),
    "num_tokens": ({"weighting": "tokens"}, 0, lambda w: w.put("x", 0)),
    "norm": ({"max_delta_norm": 5.0}, 0, lambda w: w.put("x", 0, value=10.0)),
    "norm_relative": ({"norm_ratio": 3.0, "norm_min_history": 2}, 2, lambda w: w.put("x", 0, value=20.0)),
}


@pytest.mark.parametrize("reason", sorted(CASES))
def test_each_rejection_reason(hubs, tmp_path, reason, caplog):
    kw, setup, bad = CASES[reason]
    hub = hubs.open()
    counts = count_downloads(hub)
    w = Workers(hubs.open(), tmp_path)
    key = kw.get("signing_key")
    good = dict(signing_key=key, num_tokens=1)
    m = make_master(hub, tmp_path, **kw)
    m.sync_once()
    for i in range(setup):
        w.put("good", i, base=m.outer_step, value=1, **good)
        assert m.sync_once()
    before = m.snapshot()
    bad(w)
    with caplog.at_level(logging.WARNING, logger="diloco_lightning.master.loop"):
        assert m.sync_once() is False  # only a rejected delta: nothing published
    assert m.last_metrics["rejected_by_reason"] == {reason: 1}
    assert any(reason in r.getMessage() and "nodes/x/delta_0" in r.getMessage() for r in caplog.records)
    after = m.snapshot()
    assert after[0] == before[0] and all(torch.equal(after[1][k], before[1][k]) for k in before[1])
    assert m.sync_once() is False and m.last_metrics["rejected"] == 0  # never retried
    w.put("good", setup, base=m.outer_step, value=1, **good)
    assert m.sync_once()
    assert "x" not in hub.read_manifest().ledger  # a rejected delta never moves the ledger ...
    assert "nodes/x/delta_0.safetensors" not in [r.path for r in hub.list_deltas()]  # ... it is deleted
    assert counts.get("nodes/x/delta_0.safetensors", 0) == 1
    assert reason in REASONS


def test_replay_is_rejected_without_download(fhubs, tmp_path):
    hub = fhubs.open()
    counts = count_downloads(hub)
    w = Workers(hub, tmp_path)
    m = make_master(hub, tmp_path)
    m.sync_once()
    w.put("a", 0)
    assert m.sync_once()
    orig = hub.list_deltas
    hub.list_deltas = lambda after=None: sorted(orig(after) + [DeltaRef("a", 0, "nodes/a/delta_0.safetensors", 100)])
    assert m.sync_once() is False
    assert m.last_metrics["rejected_by_reason"] == {"replay": 1}
    assert counts == {"nodes/a/delta_0.safetensors": 1}


def test_download_failures_block_the_node_then_reject(fhubs, tmp_path):
    hub = fhubs.open()
    w = Workers(hub, tmp_path)
    m = make_master(hub, tmp_path, max_download_attempts=2)
    m.sync_once()
    orig = hub.download

    def flaky(path, **kw):
        if path == "nodes/a/delta_0.safetensors":
            raise OSError("connection reset")
        return orig(path, **kw)

    hub.download = flaky
    w.put("a", 0, value=1)
    w.put("a", 1, value=1)  # must wait behind a/0: the ledger is a high-water mark
    w.put("b", 0, value=2)
    assert m.sync_once()
    assert m.last_metrics["applied"] == ["b/0"] and m.ledger == {"b": 0}
    assert m.sync_once()  # second failure: a/0 rejected, a/1 applied
    assert m.last_metrics["rejected_by_reason"] == {"download": 1} and m.last_metrics["applied"] == ["a/1"]
    assert m.ledger == {"a": 1, "b": 0}


def test_auth_error_aborts_the_round(fhubs, tmp_path):
    from diloco_lightning.hub.base import HubAuthError

    hub = fhubs.open()
    w = Workers(hub, tmp_path)
    m = make_master(hub, tmp_path)
    m.sync_once()
    w.put("a", 0)

    def denied(path, **kw):
        raise HubAuthError("401")

    orig, hub.download = hub.download, denied
    with pytest.raises(HubAuthError):
        m.sync_once()
    hub.download = orig
    assert m.sync_once() and m.ledger == {"a": 0}


# ============================================================================ downloads, memory, locking


def test_no_redownload_across_rounds_and_restart(hubs, tmp_path):
    hub = hubs.open()
    counts = count_downloads(hub)
    w = Workers(hubs.open(), tmp_path)
    m = make_master(hub, tmp_path)
    m.sync_once()
    for node in "abcd":
        w.put(node, 0)
    assert m.sync_once()
    w.put("a", 1, base=1)
    w.put("b", 1, base=1)
    assert m.sync_once()
    assert m.sync_once() is False
    deltas = {p: n for p, n in counts.items() if p.startswith("nodes/")}
    assert len(deltas) == 6 and set(deltas.values()) == {1}
    # a restarted master resumes from its local state and downloads nothing already processed
    m.stop()
    m2 = make_master(hubs.open(), tmp_path)
    counts2 = count_downloads(m2.hub)
    w.put("c", 1, base=2)
    assert m2.sync_once()
    assert {p for p in counts2 if p.startswith("nodes/")} == {"nodes/c/delta_1.safetensors"}
    assert m2.outer_step == 3


def test_downloads_are_parallel_and_bounded(fhubs, tmp_path):
    hub = fhubs.open()
    w = Workers(hub, tmp_path)
    m = make_master(hub, tmp_path, download_workers=3, prefetch=4)
    m.sync_once()
    for i in range(12):
        w.put(f"n{i:02d}", 0)
    active, peak, lock = [0], [0], threading.Lock()
    orig = hub.download

    def slow(path, **kw):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.02)
        try:
            return orig(path, **kw)
        finally:
            with lock:
                active[0] -= 1

    hub.download = slow
    assert m.sync_once()
    assert m.last_metrics["accepted"] == 12
    assert 2 <= peak[0] <= 3


def test_snapshot_answers_while_a_download_stalls(fhubs, tmp_path):
    hub = fhubs.open()
    w = Workers(hub, tmp_path)
    m = make_master(hub, tmp_path)
    m.sync_once()
    w.put("a", 0)
    gate, entered = threading.Event(), threading.Event()
    orig = hub.download

    def stalled(path, **kw):
        entered.set()
        gate.wait(10)
        return orig(path, **kw)

    hub.download = stalled
    t = threading.Thread(target=m.sync_once)
    t.start()
    try:
        assert entered.wait(5)
        t0 = time.monotonic()
        step, state = m.snapshot()
        assert time.monotonic() - t0 < 0.5
        assert step == 0 and torch.equal(state["w"], torch.zeros(4, 3))
        assert m.outer_step == 0 and m.ledger == {}
    finally:
        gate.set()
        t.join(10)
    assert m.outer_step == 1


def test_streaming_holds_one_delta_at_a_time(fhubs, tmp_path, monkeypatch):
    """The round reads deltas one by one and folds them into one FP32 sum."""
    import diloco_lightning.master.validation as loop  # where the master reads deltas

    hub = fhubs.open()
    w = Workers(hub, tmp_path)
    m = make_master(hub, tmp_path)
    m.sync_once()
    for i in range(6):
        w.put(f"n{i}", 0, value=i)
    live, peak = [0], [0]
    orig = loop.read_delta

    class Tracked(dict):
        def __del__(self):
            live[0] -= 1

    def tracking(*a, **k):
        d = orig(*a, **k)
        d.tensors = Tracked(d.tensors)
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        return d

    monkeypatch.setattr(loop, "read_delta", tracking)
    assert m.sync_once()
    assert peak[0] == 1
    assert torch.equal(m.snapshot()[1]["w"], torch.full((4, 3), -2.5))


# ============================================================================ quorum, thread, stop


def test_quorum_min_deltas_and_max_wait(fhubs, tmp_path):
    hub = fhubs.open()
    counts = count_downloads(hub)
    w = Workers(hub, tmp_path)
    m = make_master(hub, tmp_path, min_deltas=3, max_wait=0.3)
    m.sync_once()
    w.put("a", 0, value=1)
    assert m.sync_once() is False and m.last_metrics["waiting"]
    w.put("b", 0, value=2)
    assert m.sync_once() is False
    w.put("c", 0, value=6)
    assert m.sync_once() is True
    assert torch.equal(m.snapshot()[1]["w"], torch.full((4, 3), -3.0))
    assert all(n == 1 for p, n in counts.items() if p.startswith("nodes/"))  # pending deltas not re-read
    w.put("a", 1, base=1, value=1)
    assert m.sync_once() is False
    time.sleep(0.35)
    assert m.sync_once() is True  # max_wait after the first pending delta
    assert m.outer_step == 2


def test_background_thread_and_stop_drain(fhubs, tmp_path):
    hub = fhubs.open()
    w = Workers(fhubs.open(), tmp_path)
    seen: list[tuple[int, float]] = []
    m = make_master(hub, tmp_path, min_deltas=2, poll_interval=0.02)
    m.on_global_update = lambda state: seen.append((m.outer_step, float(state["w"][0, 0])))
    m.start()
    m.start()  # idempotent: one thread
    try:
        w.put("a", 0, value=1)
        w.put("b", 0, value=3)
        deadline = time.monotonic() + 10
        while m.outer_step < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert m.outer_step == 1
        w.put("a", 1, base=1, value=4)  # below the quorum: only the drain applies it
        time.sleep(0.1)
        assert m.outer_step == 1
    finally:
        m.stop(drain=True)
    assert m._thread is None
    assert not any(t.name.startswith("diloco-master-") and t.is_alive() for t in threading.enumerate())
    assert m.outer_step == 2 and float(m.snapshot()[1]["w"][0, 0]) == -6.0
    assert seen == [(0, 0.0), (1, -2.0), (2, -6.0)]  # after each publication, outer step 0 included
    assert hub.read_lease() is None  # released: a standby may take over at once


def test_background_loop_logs_and_retries(fhubs, tmp_path, caplog):
    hub = fhubs.open()
    w = Workers(hub, tmp_path)
    m = make_master(hub, tmp_path, poll_interval=0.01, retry_max_delay=0.05)
    m.sync_once()
    w.put("a", 0)
    fails = [2]

    def fault(label):
        if label == "files" and fails[0] > 0:
            fails[0] -= 1
            raise OSError("disk full")

    faults.install(hub, fault)
    with caplog.at_level(logging.ERROR, logger="diloco_lightning.master"):
        m.start()
        deadline = time.monotonic() + 10
        while m.outer_step < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        m.stop()
    assert m.outer_step == 1 and fails[0] == 0
    assert sum("master round failed" in r.getMessage() for r in caplog.records) == 2


# ============================================================================ crash safety in-process


def _momentum_master(hub, tmp, name, **kw):
    return make_master(hub, tmp, name, outer_lr=0.7, outer_momentum=0.9, **kw)


def _rand(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def _reference(tmp: Path, batches: list[list[tuple[str, int, int]]], **kw) -> dict[str, torch.Tensor]:
    """An uninterrupted master over the same deltas (one batch per round)."""
    hub = FileHub(tmp / "ref_hub", cache_dir=tmp / "ref_cache")
    w = Workers(hub, tmp / "ref")
    m = _momentum_master(hub, tmp / "ref", "m", **kw)
    m.sync_once()
    for batch in batches:
        for node, step, seed in batch:
            w.put(node, step, base=m.outer_step, tensors=_rand(seed))
        m.sync_once()
    return m.snapshot()[1]


@pytest.mark.parametrize("point", ["files", "locked", "manifest", "deleted", "stepped", "published", "saved"])
def test_failure_rolls_back_then_applies_exactly_once(fhubs, tmp_path, point):
    """A failure anywhere in a round leaves memory as before it; the next round (which
    adopts the hub's version if the publication went through) applies every delta once,
    bit-exact with an uninterrupted run, momentum included."""
    batches = [[("a", 0, 1), ("b", 0, 2)], [("a", 1, 3)], [("b", 1, 4), ("c", 0, 5)]]
    ref = _reference(tmp_path, batches)
    hub = fhubs.open()
    w = Workers(hub, tmp_path)
    m = _momentum_master(hub, tmp_path, "m")
    m.sync_once()
    armed = [False]

    def fault(label):
        if armed[0] and label == point:
            armed[0] = False
            raise OSError(f"injected failure at {point}")

    faults.install(hub, fault)

    faults.install(m, fault)
    for i, batch in enumerate(batches):
        for node, step, seed in batch:
            w.put(node, step, base=m.outer_step, tensors=_rand(seed))
        if i == 1:
            before = m.snapshot()
            ledger = m.ledger
            armed[0] = True
            with pytest.raises(OSError, match="injected"):
                m.sync_once()
            after = m.snapshot()
            assert after[0] == before[0] and torch.equal(after[1]["w"], before[1]["w"]) and m.ledger == ledger
        m.sync_once()
    assert m.outer_step == 3
    snap = m.snapshot()[1]
    assert all(torch.equal(snap[k], ref[k]) for k in ref), point


def test_local_state_saved_after_publication_and_reconciled(fhubs, tmp_path):
    hub = fhubs.open()
    w = Workers(hub, tmp_path)
    m = make_master(hub, tmp_path)
    m.sync_once()
    w.put("a", 0, value=2)
    assert m.sync_once()
    assert m.metadata_path.is_file() and m.state_path.is_file() and m.outer_state_path.is_file()
    rec = json.loads(m.metadata_path.read_text())
    assert rec["outer_step"] == 1 and rec["manifest"]["ledger"] == {"a": 0}
    assert sha256_file(m.state_path) == hub.read_manifest().weights_sha256
    assert sorted(p.name for p in m.node_state_dir.iterdir()) == sorted(
        ["master.json", m.state_path.name, m.outer_state_path.name])
    # the hub moves on without this master's local state (e.g. killed before its local save)
    faults.install(m, lambda label: (_ for _ in ()).throw(OSError("killed")) if label == "published" else None)
    w.put("a", 1, base=1, value=1)
    with pytest.raises(OSError):
        m.sync_once()
    assert json.loads(m.metadata_path.read_text())["outer_step"] == 1 and hub.read_manifest().outer_step == 2
    m.stop()
    m2 = make_master(fhubs.open(), tmp_path)  # same node_state_dir
    assert m2.outer_step == 1  # local state loaded at construction
    assert m2.sync_once() is False and m2.outer_step == 2  # the hub is newer: adopted, nothing re-applied
    assert m2.last_metrics["adopted"] == 2 and torch.equal(m2.snapshot()[1]["w"], torch.full((4, 3), -3.0))
    assert json.loads(m2.metadata_path.read_text())["outer_step"] == 2


def test_state_dict_roundtrip_and_no_pickle(fhubs, tmp_path):
    hub = fhubs.open()
    w = Workers(hub, tmp_path)
    m = _momentum_master(hub, tmp_path, "m", norm_ratio=5.0)
    m.sync_once()
    w.put("a", 0, tensors=_rand(1))
    m.sync_once()
    sd = m.state_dict()
    save_state_file(tmp_path / "sd.safetensors", sd)  # tensors + JSON: no pickle needed
    sd2, _ = load_state_file(tmp_path / "sd.safetensors")
    m2 = _momentum_master(FileHub(tmp_path / "other_hub"), tmp_path, "m2", norm_ratio=5.0)
    m2.load_state_dict(sd2)
    assert m2.outer_step == 1 and m2.ledger == {"a": 0}
    assert all(torch.equal(m2.snapshot()[1][k], m.snapshot()[1][k]) for k in sd["global"])
    assert m2.state_dict()["norms"] == sd["norms"]
    with pytest.raises(ValueError, match="outer optimizer"):
        make_master(hub, tmp_path, "m3", outer_optimizer="cgad").load_state_dict(sd)
    for f in list(m.node_state_dir.iterdir()) + [Path(hub.root) / p for p in hub.list_global()]:
        assert f.read_bytes()[:2] != b"\x80\x04"  # no pickle anywhere


# ============================================================================ one master at a time


def test_second_master_stands_by_then_takes_over_bit_exact(all_hubs, tmp_path):
    hubs = all_hubs
    batches = [[("a", 0, 1), ("b", 0, 2)], [("a", 1, 3)], [("b", 1, 4), ("c", 0, 5)], [("a", 2, 6)]]
    ref = _reference(tmp_path, batches)
    w = Workers(hubs.open(), tmp_path)
    # long enough that a lease cannot lapse between a master's rounds, nor m2's before m1's last check
    # (on a loaded machine an S3 round takes seconds)
    ttl = 1.5 if hubs.kind == "file" else 8.0
    m1 = _momentum_master(hubs.open(), tmp_path, "m1", lease_ttl=ttl, holder="one")
    m2 = _momentum_master(hubs.open(), tmp_path, "m2", lease_ttl=ttl, holder="two")
    assert m1.sync_once()
    for i, batch in enumerate(batches):
        for node, step, seed in batch:
            w.put(node, step, base=hubs.open().read_manifest().outer_step, tensors=_rand(seed))
        if i < 2:
            assert m1.sync_once()
            assert m2.sync_once() is False and m2.last_metrics["standby"]
            assert m2.last_metrics["warm"] == m1.outer_step  # a warm standby: m1's version loaded (warm_standby)
        else:
            if i == 2:  # m1 dies without releasing its lease; m2 takes over once it expires
                time.sleep(ttl + 0.1)
            assert m2.sync_once()
            if i == 2:  # ... with nothing to load
                assert m2.last_metrics["took_over"] == 2 and m2.last_metrics["adopted"] is None
    assert m2.outer_step == 4
    lease = hubs.open().read_lease()
    assert lease.holder == "two" and lease.epoch == 2
    assert hubs.open().read_manifest().master == {"holder": "two", "epoch": 2}
    snap = m2.snapshot()[1]
    assert all(torch.equal(snap[k], ref[k]) for k in ref)  # continued from the published optimizer state
    assert m1.sync_once() is False and m1.last_metrics["standby"]  # the old master stands by now


def test_publication_cas_between_masters_without_lease(fhubs, tmp_path):
    hub1, hub2 = fhubs.open(), fhubs.open()
    w = Workers(fhubs.open(), tmp_path)
    m1 = make_master(hub1, tmp_path, "m1", lease=False, aggregation="arrival")
    m2 = make_master(hub2, tmp_path, "m2", lease=False, aggregation="arrival")
    m1.sync_once()
    w.put("a", 0, value=1)
    assert m2.sync_once()  # adopts 0, applies a/0 -> 1
    w.put("b", 0, value=2)

    def race(label):  # m2 publishes b/0 while m1 is between its step and its publication
        if label == "stepped":
            faults.install(m1, None)
            assert m2.sync_once()

    faults.install(m1, race)
    assert m1.sync_once() is False  # its publication over version 1 is refused
    assert m1.last_metrics["conflict"] and m1.outer_step == 1
    drain(m1)
    assert m1.outer_step == 2 and torch.equal(m1.snapshot()[1]["w"], torch.full((4, 3), -3.0))


def test_two_masters_racing_apply_every_delta_once(all_hubs, tmp_path):
    hubs = all_hubs
    w = Workers(hubs.open(), tmp_path)
    masters = [
        make_master(hubs.open(), tmp_path, f"m{i}", aggregation="arrival", holder=f"m{i}",
                    lease_ttl=0.15 if hubs.kind == "file" else 1.0)
        for i in range(2)
    ]
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(m):
        while not stop.is_set():
            try:
                m.sync_once()
            except Exception as e:  # noqa: BLE001 - a round may fail when the other master deletes what it read
                errors.append(e)
            time.sleep(0.01)

    threads = [threading.Thread(target=run, args=(m,)) for m in masters]
    for t in threads:
        t.start()
    total = 0.0
    n_nodes, n_steps = 4, 5 if hubs.kind == "file" else 3
    try:
        for step in range(n_steps):
            for node in range(n_nodes):
                v = float(1 + node + 10 * step)
                total += v
                man = hubs.open().read_manifest()
                w.put(f"n{node}", step, base=man.outer_step if man else 0, value=v)
            time.sleep(0.05)
            if step == n_steps // 2:  # one master dies: the other takes over when its lease expires
                victim = masters[0] if masters[0].is_leader else masters[1]
                victim_thread = threads[masters.index(victim)]
                stop.set()
                for t in threads:
                    t.join()
                stop.clear()
                threads = [threading.Thread(target=run, args=(m,)) for m in masters if m is not victim]
                for t in threads:
                    t.start()
                assert not victim_thread.is_alive()
        survivor = [m for m in masters if m is not victim][0]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            man = hubs.open().read_manifest()
            if man.ledger == {f"n{i}": n_steps - 1 for i in range(n_nodes)}:
                break
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join()
    man = hubs.open().read_manifest()
    assert man.ledger == {f"n{i}": n_steps - 1 for i in range(n_nodes)}
    assert man.outer_step == n_nodes * n_steps
    _, state = load_global(hubs.open(), man)
    assert torch.equal(state["w"], torch.full((4, 3), -total)), errors
    survivor.sync_once()
    assert torch.equal(survivor.snapshot()[1]["w"], state["w"])


def test_32_workers_10_rounds_concurrent_writers_nothing_lost(fhubs, tmp_path):
    _many_workers(fhubs, tmp_path, 32, 10)


def _many_workers(fhubs, tmp_path, n_workers: int, n_rounds: int) -> None:
    """Workers upload concurrently (threads, each its own hub handle) while the master runs rounds."""
    applied: list[str] = []
    m = make_master(fhubs.open(), tmp_path, poll_interval=0.01, logger=lambda d: applied.extend(d["applied"]))
    m.sync_once()
    m.start()

    def worker(i: int) -> None:
        hub = fhubs.open()
        wk = Workers(hub, tmp_path / f"w{i}")
        for r in range(n_rounds):
            man = hub.read_manifest()
            wk.put(f"w{i:02d}", r, base=man.outer_step, value=1.0)
            time.sleep(0.001 * (i % 5))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.monotonic() + 60
    want = {f"w{i:02d}": n_rounds - 1 for i in range(n_workers)}
    while m.ledger != want and time.monotonic() < deadline:
        time.sleep(0.05)
    m.stop(drain=True)
    assert m.ledger == want
    assert sorted(applied) == sorted(f"w{i:02d}/{r}" for i in range(n_workers) for r in range(n_rounds))
    assert len(set(applied)) == len(applied)  # each exactly once
    # every round subtracts the mean of ones: the state moved by exactly one per version
    step, snap = m.snapshot()
    assert torch.equal(snap["w"], torch.full((4, 3), -float(step)))
    assert fhubs.open().list_deltas() == []


# ============================================================================ bootstrap, config, metrics


def test_bootstrap_from_first_workers_init(hubs, tmp_path):
    hub = hubs.open()
    m = MasterOuterLoop(hub, None, node_state_dir=tmp_path / "m", outer_lr=1.0, outer_momentum=0.0, lease_ttl=30, norm_global_ratio=None)
    with pytest.raises(RuntimeError, match="no global state"):
        m.snapshot()
    assert m.sync_once() is False  # nothing to start from yet
    init = {"w": torch.full((4, 3), 5.0), "b": torch.ones(3), "steps": torch.tensor(7)}
    other = {"w": torch.full((4, 3), 9.0), "b": torch.ones(3), "steps": torch.tensor(7)}
    save_weights_file(tmp_path / "i1.safetensors", init)
    save_weights_file(tmp_path / "i2.safetensors", other)
    wh = hubs.open()
    wh.upload_init(tmp_path / "i2.safetensors", "zz-node")
    wh.upload_init(tmp_path / "i1.safetensors", "aa-node")
    assert m.sync_once() is True
    man = hub.read_manifest()
    assert man.outer_step == 0 and man.model_fingerprint == model_fingerprint(init)
    assert torch.equal(m.snapshot()[1]["w"], init["w"])
    Workers(wh, tmp_path).put("aa-node", 0, value=1, fp=model_fingerprint(init))
    assert m.sync_once() and torch.equal(m.snapshot()[1]["w"], torch.full((4, 3), 4.0))


def test_master_given_another_model_refuses_the_hub(fhubs, tmp_path):
    hub = fhubs.open()
    m1 = make_master(hub, tmp_path, "m1")
    m1.sync_once()
    m1.stop()
    other = lambda: {"w": torch.zeros(2, 2)}  # noqa: E731
    m2 = make_master(fhubs.open(), tmp_path, "m2", state=other)
    with pytest.raises(MasterConfigError, match="model"):
        m2.sync_once()
    m2.stop()
    m3 = make_master(fhubs.open(), tmp_path, "m3", outer_optimizer="cgad", outer_options={"lr": 0.1})
    with pytest.raises(MasterConfigError, match="nesterov"):
        m3.sync_once()


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(aggregation="sum"), "aggregation"),
        (dict(weighting="bytes"), "weighting"),
        (dict(min_deltas=0), "min_deltas"),
        (dict(poll_interval=0), "poll_interval"),
        (dict(max_staleness=-1), "max_staleness"),
        (dict(keep_globals=-1), "keep_globals"),
        (dict(download_workers=0), "download_workers"),
        (dict(norm_ratio=0.5), "norm_ratio"),
        (dict(max_wait=-1.0), "max_wait"),
        (dict(outer_lr=0), "outer_lr"),
        (dict(lease_ttl=0), "lease_ttl"),
    ],
)
def test_bad_arguments_name_themselves(fhubs, tmp_path, kw, name):
    with pytest.raises(ValueError, match=name):
        make_master(fhubs.open(), tmp_path, **kw)


def test_unknown_optimizer_and_options(fhubs, tmp_path):
    with pytest.raises(ValueError, match="unknown outer optimizer"):
        make_master(fhubs.open(), tmp_path, outer_optimizer="sgd")
    with pytest.raises(ValueError, match="bogus"):
        make_master(fhubs.open(), tmp_path, outer_options={"bogus": 1})


def test_metrics_jsonl_and_loggers(fhubs, tmp_path, caplog):
    hub = fhubs.open()
    w = Workers(hub, tmp_path)
    path = tmp_path / "metrics.jsonl"
    got: list[dict] = []
    m = make_master(hub, tmp_path, metrics_path=path, logger=got.append, max_delta_norm=100.0)
    m.sync_once()
    w.put("a", 0, value=1)
    w.put("b", 0, value=1000)
    assert m.sync_once()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    last = lines[-1]
    assert last == got[-1]
    for key in ("outer_step", "accepted", "rejected_by_reason", "staleness_histogram", "round_seconds", "bytes_downloaded"):
        assert key in last
    assert last["outer_step"] == 1 and last["accepted"] == 1 and last["rejected_by_reason"] == {"norm": 1}
    assert last["bytes_downloaded"] > 0
    lg = logging.getLogger("test.master.progress")
    m2 = make_master(hub, tmp_path, "m2", logger=lg)
    w.put("a", 1, base=1)
    with caplog.at_level(logging.INFO, logger="test.master.progress"):
        m.stop()  # release the lease for m2
        assert m2.sync_once()
    assert any(r.name == "test.master.progress" and "outer_step 2" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="logger"):
        make_master(hub, tmp_path, "m3", logger=42)


def test_orphans_and_stragglers_are_collected(fhubs, tmp_path):
    hub = fhubs.open()
    w = Workers(hub, tmp_path)
    m = make_master(hub, tmp_path, gc_every=1)
    m.sync_once()
    orphan = Path(hub.root) / "global" / "weights_000000000_deadbeefdeadbeef.safetensors"
    orphan.write_bytes(b"x")
    w.put("a", 0)
    w.put("b", 0)
    straggler = Path(hub.root) / "nodes/a/delta_0.safetensors"
    m.sync_once()
    assert not orphan.exists() and not straggler.exists()
    # a straggler left by a crash between the manifest swap and the deletions
    w.put("a", 1, base=1)
    faults.install(hub, lambda label: (_ for _ in ()).throw(OSError("crash")) if label == "manifest" else None)
    with pytest.raises(OSError):
        m.sync_once()
    faults.install(hub, None)
    assert (Path(hub.root) / "nodes/a/delta_1.safetensors").exists() and hub.read_manifest().ledger["a"] == 1
    w.put("b", 1, base=2)
    assert m.sync_once()
    assert hub.list_deltas() == []


def test_staged_files_read_back_with_the_foundation_readers(tmp_path):
    state = {"a": torch.randn(5, 3), "h": torch.randn(4).to(torch.bfloat16), "i": torch.arange(6).reshape(2, 3),
             "z": torch.zeros(0), "s": torch.tensor(1.5), "c": torch.randn(2, dtype=torch.complex64), "t": torch.ones(2, dtype=torch.bool)}
    sha = write_safetensors_hashed(tmp_path / "x.safetensors", state, {"outer_step": "3"})
    assert sha == sha256_file(tmp_path / "x.safetensors")
    back, md = load_weights_file(tmp_path / "x.safetensors")
    assert md == {"outer_step": "3"}
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_lease_is_renewed_and_epoch_grows(fhubs, tmp_path):
    hub = fhubs.open()
    m = make_master(hub, tmp_path, lease_ttl=10.0, holder="h1")
    now = [time.time()]
    m._lease.clock = lambda: now[0]
    m.sync_once()
    l1 = hub.read_lease()
    now[0] += 4.0
    m.sync_once()
    assert hub.read_lease() == l1  # fresh: not rewritten (on the HF Hub a write is a commit)
    now[0] += 2.0  # less than half the ttl left: renewed
    m.sync_once()
    l2 = hub.read_lease()
    assert l1.holder == l2.holder == "h1" and l2.expires_at > l1.expires_at and l2.epoch == l1.epoch == 1
    m.stop()
    assert hub.read_lease() is None
    m2 = make_master(fhubs.open(), tmp_path, "m2", lease_ttl=10.0, holder="h2")
    m2.sync_once()
    assert hub.read_lease().epoch == 2  # above the published epoch, though the lease file was gone
    hub.write_lease(Lease("intruder", 9, time.time() + 100), expected=hub.read_lease())
    assert m2.sync_once() is False and m2.last_metrics["standby"]


# ============================================================================ CLI


def _cli_hub(tmp_path: Path, n: int = 2) -> Path:
    hub = FileHub(tmp_path / "hub")
    save_weights_file(tmp_path / "init.safetensors", s0())
    hub.upload_init(tmp_path / "init.safetensors", "w0")
    w = Workers(hub, tmp_path)
    for i in range(n):
        w.put(f"w{i}", 0, value=2 * i + 1)
    return tmp_path / "hub"


def test_cli_runs_rounds_prints_progress_and_writes_metrics(tmp_path, capsys, hydra_configs):
    from hydra import compose, initialize_config_dir

    from diloco_lightning.app.master import CONFIG_DIR, run

    hub_dir = _cli_hub(tmp_path)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="master", overrides=[
            f"hub.url={hub_dir}", "outer=nesterov", "outer.lr=1.0", "outer.options.momentum=0.0", "max_rounds=1",
            "poll_interval=0.02", f"node_state_dir={tmp_path / 'st'}", "max_delta_norm=1000", "norm_global_ratio=null",
            "torch_threads=null",  # leave this test process's torch threads alone
        ])
    assert run(cfg) == 0
    out = capsys.readouterr().out
    assert "[master] outer_step 1 | accepted 2 | rejected 0 | staleness [0:2]" in out
    lines = [json.loads(x) for x in (tmp_path / "st" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["outer_step"] == 1 and lines[-1]["applied"] == ["w0/0", "w1/0"]
    man = FileHub(hub_dir).read_manifest()
    assert man.outer_step == 1 and man.optimizer == {"name": "nesterov", "options": {"lr": 1.0, "momentum": 0.0}}
    _, state = load_global(FileHub(hub_dir), man)
    assert torch.equal(state["w"], torch.full((4, 3), -2.0))
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="master", overrides=[f"hub.url={hub_dir}", "outer=cgad", "outer.name=nesterov", "max_rounds=0"])
    from diloco_lightning.app.config import outer_options

    assert outer_options(cfg.outer) == {"lr": float(cfg.outer.lr)}  # cgad's options dropped for another optimizer


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_cli_subprocess_drains_on_sigterm(tmp_path):
    import signal
    import subprocess
    import sys

    hub_dir = _cli_hub(tmp_path, n=2)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco_lightning.app.master", f"hub.url={hub_dir}", "outer=adam", "outer.lr=0.1",
         "min_deltas=5", "poll_interval=0.05", f"node_state_dir={tmp_path / 'st'}", "lease_ttl=5", "norm_global_ratio=null"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        deadline = time.monotonic() + 60
        hub = FileHub(hub_dir)
        while time.monotonic() < deadline and not (hub.read_manifest() and (tmp_path / "st" / "metrics.jsonl").exists()
                                                    and "waiting" in (tmp_path / "st" / "metrics.jsonl").read_text()):
            time.sleep(0.05)
        assert hub.read_manifest().outer_step == 0  # below the quorum: waiting
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err  # stopped, not finished: a scheduler must not read it as done
    assert "final round" in out and "[master] outer_step 1 | accepted 2" in out, out
    assert hub.read_manifest().outer_step == 1 and hub.read_lease() is None


def test_arrival_order_keeps_each_nodes_upload_order_and_cap_is_fair():
    from diloco_lightning.master.aggregation import arrival_order, cap_round_robin

    def ref(node, step):
        return DeltaRef(node, step, f"nodes/{node}/delta_{step}.safetensors", 1)

    items = [(ref("a", 0), None, 2), (ref("a", 1), None, 1), (ref("b", 0), None, 0), (ref("c", 0), None, 1)]
    order = [(r.node_id, r.local_step) for r, _, _ in arrival_order(items)]
    # oldest anchor first, but a/1 never overtakes a/0 (the ledger is a per-node high-water mark)
    assert order == [("b", 0), ("c", 0), ("a", 0), ("a", 1)]
    refs = [ref("a", i) for i in range(10)] + [ref("b", 0), ref("c", 0), ref("c", 1)]
    capped = cap_round_robin(refs, 5)
    assert [(r.node_id, r.local_step) for r in capped] == [("a", 0), ("a", 1), ("b", 0), ("c", 0), ("c", 1)]
