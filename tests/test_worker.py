"""The framework-free worker (``diloco_lightning.worker``) against a real folder hub.

Versions are published by hand here (``stage_global`` + ``hub.publish``), so every test
controls exactly what the worker sees; the end-to-end tests with the real master are in
``tests/test_callback.py`` and ``tests/test_accelerate.py``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from diloco_lightning.wire.delta import model_fingerprint, read_delta
from diloco_lightning.hub.versions import stage_global
from diloco_lightning.hub.local import FileHub
from diloco_lightning.wire.manifest import GlobalVersion, Manifest
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.wire.statefile import load_weights_file
from diloco_lightning.worker import (
    DiLoCoWorker,
    WaitTimeoutError,
    WorkerError,
    module_state,
    resolve_delay,
)
from diloco_lightning.worker.uploader import Job, Part, merge_parts

from support.workers import run_two_workers

FAST = dict(poll_interval=0.01, wait_timeout=10.0)


def make_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.nn.Parameter(torch.randn(4, 3, generator=g)),
        "layer.bias": torch.nn.Parameter(torch.randn(3, generator=g)),
        "norm.running_mean": torch.randn(3, generator=g),
        "norm.num_batches_tracked": torch.tensor(5, dtype=torch.long),
    }


def snapshot(params):
    return {k: v.detach().clone() for k, v in params.items()}


class Publisher:
    """Publishes global versions on a hub like a master would (history kept: ``keep`` versions)."""

    def __init__(self, hub: FileHub, workdir: Path, keep: int = 100, key: RunKey | None = None) -> None:
        self.hub, self.workdir, self.keep, self.key = hub, workdir, keep, key
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.current: Manifest | None = None

    def publish(self, state, ledger=None) -> Manifest:
        step = 0 if self.current is None else self.current.outer_step + 1
        staged = stage_global(self.workdir, step, state)
        history = []
        if self.current is not None:
            history = [GlobalVersion(self.current.outer_step, self.current.weights, None, self.current.weights_sha256)]
            history = (history + list(self.current.history))[: self.keep - 1]
        m = staged.manifest(ledger=dict(ledger or (self.current.ledger if self.current else {})), history=history)
        if self.key is not None:
            m = m.signed(self.key)
        self.hub.publish(m, staged.files, expected_outer_step=None if self.current is None else self.current.outer_step)
        self.current = m
        return m


def deltas(hub: FileHub, node: str = "w0"):
    return [read_delta(hub.download(r.path)) for r in hub.list_deltas() if r.node_id == node]


@pytest.fixture()
def hub(tmp_path):
    return FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache")


@pytest.fixture()
def pub(hub, tmp_path):
    return Publisher(hub, tmp_path / "pub")


def test_bootstrap_offers_init_and_installs_outer_step_0(hub, pub):
    params = make_params(1)
    init = snapshot(params)
    w = DiLoCoWorker(hub, "w0", params, **FAST)
    published = {}

    def master():  # adopt the offered weights as version 0, as a master without a model does
        while not hub.list_inits():
            time.sleep(0.01)
        state, md = load_weights_file(hub.download("nodes/w0/init.safetensors"))
        assert md["model_fingerprint"] == model_fingerprint(init)
        state = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}  # recognisable
        published["state"] = state
        pub.publish(state)

    t = threading.Thread(target=master)
    t.start()
    installed = w.start()
    t.join()
    assert installed.outer_step == 0 and w.outer_step == 0
    for k, v in published["state"].items():
        assert torch.equal(params[k], v)
    w.close()


def test_delta_content_header_and_anchor_moves(hub, pub):
    params = make_params()
    v0 = snapshot(params)
    key = RunKey("secret")
    pub.key = key  # a signed run: the master signs what it publishes
    pub.publish(v0)
    with DiLoCoWorker(hub, "w0", params, signing_key=key, **FAST) as w:
        ptr = params["layer.weight"].data_ptr()
        with torch.no_grad():
            params["layer.weight"].add_(0.5)
            params["norm.running_mean"].sub_(0.25)
            params["norm.num_batches_tracked"].add_(3)
        r1 = w.boundary(num_tokens=100)
        assert r1.boundary == 1 and r1.base_outer_step == 0 and r1.installed is None
        after1 = snapshot(params)
        with torch.no_grad():
            params["layer.bias"].add_(1.0)
        w.boundary(num_tokens=50)
        assert w.flush()
    assert params["layer.weight"].data_ptr() == ptr
    d1, d2 = deltas(hub)
    assert d1.header.local_step < d2.header.local_step
    assert d1.header.base_outer_step == 0 and d1.header.num_tokens == 100
    assert d1.header.model_fingerprint == model_fingerprint(params)
    assert set(d1.tensors) == {"layer.weight", "layer.bias", "norm.running_mean"}  # no integer buffer
    for k in d1.tensors:
        assert torch.equal(d1.tensors[k], v0[k] - after1[k])
    # the anchor moved to the local weights: the second delta covers only the second phase
    assert torch.allclose(d2.tensors["layer.bias"], torch.full((3,), -1.0))
    assert torch.equal(d2.tensors["layer.weight"], torch.zeros(4, 3))
    # signed: the master's reader accepts it with the key and refuses it without the right one
    read_delta(hub.download(hub.list_deltas()[0].path), signing_key=key, reference=v0)
    with pytest.raises(Exception, match="signature"):
        read_delta(hub.download(hub.list_deltas()[0].path), signing_key=RunKey("other"))


def test_async_install_in_place_and_bf16_deltas(hub, pub):
    params = make_params()
    pub.publish(snapshot(params))
    # rebase off: the version itself is installed (tests/test_rebase.py has the rebased start)
    w = DiLoCoWorker(hub, "w0", params, delta_dtype="bfloat16", rebase=False, **FAST)
    w.start()
    opt = torch.optim.SGD([params["layer.weight"], params["layer.bias"]], lr=0.1)
    new = {k: (v + 2 if v.is_floating_point() else v + 10) for k, v in snapshot(params).items()}
    pub.publish(new)
    deadline = time.monotonic() + 10
    installed = None
    while installed is None and time.monotonic() < deadline:  # the prefetcher picks it up in the background
        with torch.no_grad():
            params["layer.weight"].add_(0.01)
        installed = w.boundary().installed
        time.sleep(0.02)
    assert installed is not None and installed.outer_step == 1 and installed.staleness == 0
    assert opt.param_groups[0]["params"][0] is params["layer.weight"]
    for k in new:
        assert torch.equal(params[k], new[k])  # integer buffers installed too
    assert w.flush()  # the deltas of the phases before the install are out
    with torch.no_grad():
        params["layer.weight"].sub_(0.5)
    w.boundary()
    assert w.flush()
    last = deltas(hub)[-1]
    assert last.header.base_outer_step == 1
    assert last.tensors["layer.weight"].dtype == torch.bfloat16
    assert torch.allclose(last.tensors["layer.weight"].float(), torch.full((4, 3), 0.5), atol=1e-2)
    w.close()


class FlakyHub(FileHub):
    """A folder hub whose uploads (and listings) fail while ``down`` is set, or block on ``gate``."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.down = False
        self.list_down = False
        self.gate: threading.Event | None = None
        self.calls = 0

    def upload_delta(self, local_file, node_id, local_step):
        self.calls += 1
        if self.gate is not None:
            self.gate.wait(10)
        if self.down:
            raise ConnectionError("hub unreachable (injected)")
        return super().upload_delta(local_file, node_id, local_step)

    def list_deltas(self, after=None):
        if self.list_down:
            raise ConnectionError("hub unreachable (injected)")
        return super().list_deltas(after)


class LandsThenFails(FlakyHub):
    """Its first upload lands, then reports a failure (a commit that timed out), and listings fail
    from then on: the worker cannot tell that the delta is on the hub."""

    def upload_delta(self, local_file, node_id, local_step):
        path = FileHub.upload_delta(self, local_file, node_id, local_step)
        if self.calls == 0:
            self.calls += 1
            self.list_down = True
            raise TimeoutError("commit timed out (injected, but it landed)")
        return path


def _train_phase(params, amount):
    with torch.no_grad():
        params["layer.weight"].add_(amount)
        params["layer.bias"].sub_(amount)


def test_failed_uploads_merge_into_the_next_delta(tmp_path):
    hub = FlakyHub(tmp_path / "hub")
    Publisher(hub, tmp_path / "pub").publish(snapshot(params := make_params()))
    v0 = snapshot(params)
    w = DiLoCoWorker(hub, "w0", params, **FAST)
    w.start()
    hub.down = True
    hub.list_down = True  # cannot even tell whether it landed: kept as a doubt
    for i in range(3):
        _train_phase(params, 0.125)
        w.boundary(num_tokens=10)
        w._uploader.wait_idle(5)
    assert w.totals["upload_failures_total"] >= 2
    hub.down = hub.list_down = False
    assert not deltas(hub)
    _train_phase(params, 0.125)
    w.boundary(num_tokens=10)
    assert w.flush()
    got = deltas(hub)
    assert len(got) == 1  # everything merged into one cumulative delta
    d = got[0]
    assert d.header.base_outer_step == 0 and d.header.num_tokens == 40 and d.header.extra["phases"] == "4"
    assert torch.allclose(d.tensors["layer.weight"], v0["layer.weight"] - params["layer.weight"])
    assert torch.allclose(d.tensors["layer.bias"], torch.full((3,), 0.5))
    assert w.totals["phases_delivered_total"] == 4
    w.close()


def test_upload_in_flight_makes_the_next_delta_cumulative(tmp_path):
    hub = FlakyHub(tmp_path / "hub")
    Publisher(hub, tmp_path / "pub").publish(snapshot(params := make_params()))
    w = DiLoCoWorker(hub, "w0", params, **FAST)
    w.start()
    hub.gate = threading.Event()  # the first upload hangs
    _train_phase(params, 1.0)
    t0 = time.perf_counter()
    w.boundary()
    _train_phase(params, 2.0)
    w.boundary()  # upload 1 still running: phase 2 waits, merged with phase 3
    _train_phase(params, 4.0)
    w.boundary()
    assert time.perf_counter() - t0 < 2.0  # never blocked on I/O
    assert w.pending_phases == 3  # one in flight, two held and merged
    hub.gate.set()
    assert w.flush()
    got = deltas(hub)
    assert [d.header.extra["phases"] for d in got] == ["1", "2"]
    assert torch.allclose(got[0].tensors["layer.bias"], torch.full((3,), 1.0))
    assert torch.allclose(got[1].tensors["layer.bias"], torch.full((3,), 6.0))
    w.close()


def test_ambiguous_failure_that_landed_is_not_sent_twice(tmp_path):
    hub = LandsThenFails(tmp_path / "hub")
    Publisher(hub, tmp_path / "pub").publish(snapshot(params := make_params()))
    w = DiLoCoWorker(hub, "w0", params, **FAST)
    w.start()
    _train_phase(params, 1.0)
    w.boundary()
    w._uploader.wait_idle(5)
    hub.list_down = False
    _train_phase(params, 2.0)
    w.boundary()
    assert w.flush()
    got = deltas(hub)
    assert [torch.allclose(d.tensors["layer.bias"], torch.full((3,), v)) for d, v in zip(got, (1.0, 2.0))] == [True, True]
    assert len(got) == 2 and w.totals["phases_delivered_total"] == 2
    w.close()


def test_a_node_the_hub_knows_restarts_without_sending_what_the_hub_has(hub, pub):
    """Without a checkpoint, a node with history on the hub (its ledger entry, or its deltas) is
    restarting: it resumes at the hub's step (its boundary count is the hub's, so the adapter moves its
    trainer on), nothing is sent again, and every boundary it trains from there is sent (issue 38)."""
    params = make_params()
    pub.publish(snapshot(params), ledger={"w0": 7})
    with DiLoCoWorker(hub, "w0", params, **FAST) as w:
        assert w.next_local_step == 8 and w.progress.delivered_until == 7  # after the ledger
        assert w.boundaries == 7 and w.resumed_boundaries == 7
        _train_phase(params, 1.0)
        w.boundary()  # new work on the installed global: sent
        assert w.flush()
    assert [r.local_step for r in hub.list_deltas()] == [8]
    with DiLoCoWorker(hub, "w0", params, **FAST) as w:  # again, after its delta_8 reached the hub
        assert w.next_local_step == 9 and w.progress.delivered_until == 8


def test_lockstep_installs_exactly_r_minus_delay_from_history(hub, pub):
    params = make_params()
    states = [snapshot(params)]
    pub.publish(states[0])
    for i in range(1, 4):
        states.append({k: v + i if v.is_floating_point() else v for k, v in states[0].items()})
        pub.publish(states[i])
    w = DiLoCoWorker(hub, "w0", params, sync="lockstep", delay=2, **FAST)
    assert w.start().outer_step == 0
    seen = []
    for r in range(1, 7):
        if r == 6:
            threading.Timer(0.2, lambda: pub.publish(states[0])).start()  # version 4 arrives later
        res = w.boundary()
        seen.append(res.installed.outer_step)
        assert res.base_outer_step == max(0, r - 3)
    assert seen == [0, 0, 1, 2, 3, 4]
    assert torch.equal(params["layer.weight"], states[0]["layer.weight"])
    assert res.wait_seconds > 0.1
    # delta r is held until version r-1 exists (one delta per worker per master round)
    assert not w._uploader.wait_idle(0.3)
    assert [d.header.base_outer_step for d in deltas(hub)] == [0, 0, 0, 1, 2]
    assert w.pending_phases == 1
    w.close(flush=False)


def test_lockstep_errors_clearly(hub, tmp_path):
    pub = Publisher(hub, tmp_path / "pub", keep=2)
    params = make_params()
    pub.publish(snapshot(params))
    w = DiLoCoWorker(hub, "w0", params, sync="lockstep", delay=0, poll_interval=0.01, wait_timeout=0.3)
    w.start()
    with pytest.raises(WaitTimeoutError, match="global version 1"):
        w.boundary()
    w.close(flush=False)
    for _ in range(4):
        pub.publish(snapshot(params))
    w = DiLoCoWorker(hub, "w1", params, sync="lockstep", delay=0, **FAST)
    with pytest.raises(WorkerError, match="not on .* any more.*keep_globals"):
        w.start()


def test_fingerprint_mismatch_is_refused(hub, pub):
    pub.publish(make_params())
    params = make_params()
    params["layer.weight"] = torch.nn.Parameter(torch.zeros(5, 3))
    with pytest.raises(WorkerError, match="fingerprint"):
        DiLoCoWorker(hub, "w0", params, **FAST).start()


def test_anchor_state_round_trip_and_undelivered_delta(tmp_path):
    hub = FlakyHub(tmp_path / "hub")
    Publisher(hub, tmp_path / "pub").publish(snapshot(params := make_params()))
    v0 = snapshot(params)
    w = DiLoCoWorker(hub, "w0", params, **FAST)
    w.start()
    hub.down = True
    _train_phase(params, 1.0)
    w.boundary(num_tokens=3)
    _train_phase(params, 1.0)  # half of a phase, then a checkpoint
    sd, anchor = w.state_dict(), w.anchor_state()
    ckpt = snapshot(params)
    w.close(flush=False)

    params2 = {k: torch.nn.Parameter(v.clone()) if v.is_floating_point() else v.clone() for k, v in ckpt.items()}
    w2 = DiLoCoWorker(hub, "w0", params2, **FAST)
    w2.load_state_dict(sd)
    w2.load_anchor_state(anchor)
    hub.down = False
    assert w2.start() is None  # resumed: no install
    assert torch.equal(params2["layer.weight"], ckpt["layer.weight"])
    assert w2.boundaries == 1
    _train_phase(params2, 1.0)
    w2.boundary(num_tokens=4)
    assert w2.flush()
    got = deltas(hub)  # the undelivered phase goes out at start, then the interrupted phase
    assert [d.header.num_tokens for d in got] == [3, 4]
    # delta_1's attempt did not land (the hub says so once it is back): it goes out under its boundary's step
    assert [d.header.local_step for d in got] == [1, 2]
    total = got[0].tensors["layer.bias"] + got[1].tensors["layer.bias"]
    assert torch.allclose(total, v0["layer.bias"] - params2["layer.bias"])
    assert torch.allclose(got[1].tensors["layer.bias"], torch.full((3,), 2.0))  # anchor restored
    w2.close()



def test_resume_after_the_lost_run_delivered_drops_the_checkpoints_undelivered_delta(tmp_path):
    """A checkpoint taken while a delta was undelivered; the run went on, delivered it (merged into a
    later delta that the master processed and deleted) and died. The resumed worker must not send it again."""
    hub = FlakyHub(tmp_path / "hub")
    pub = Publisher(hub, tmp_path / "pub")
    params = make_params()
    pub.publish(snapshot(params))
    w = DiLoCoWorker(hub, "w0", params, **FAST)
    w.start()
    hub.down = True
    _train_phase(params, 1.0)
    w.boundary()
    anchor = w.anchor_state()
    assert anchor["unsent"] is not None and anchor["next_local_step"] == 2
    hub.down = False
    _train_phase(params, 1.0)
    w.boundary()
    assert w.flush()  # the lost run delivered it as delta_2 ...
    w.close()
    for ref in hub.list_deltas():  # ... which the master processed and deleted
        hub.delete([ref.path])
    pub.publish(snapshot(params), ledger={"w0": 2})
    w2 = DiLoCoWorker(hub, "w0", make_params(), **FAST)
    w2.load_anchor_state(anchor)
    w2.start()
    assert w2.pending_phases == 0 and w2.next_local_step == 3
    w2.close()


def test_resolve_delay_forms():
    assert resolve_delay(3, "w0") == 3
    assert resolve_delay([0, 2, 4], "w1") == 2
    assert resolve_delay([0, 2, 4], "x", node_index=5) == 4
    draws = [resolve_delay({"distribution": "uniform", "low": 0, "high": 8, "seed": 1}, f"w{i}") for i in range(20)]
    assert draws == [resolve_delay({"low": 0, "high": 8, "seed": 1}, f"w{i}") for i in range(20)]
    assert len(set(draws)) > 2 and all(0 <= d <= 8 for d in draws)
    assert resolve_delay({"distribution": "choice", "values": [5], "seed": 0}, "w0") == 5
    for bad, msg in ((-1, "delay"), (True, "delay"), ([1, -2], r"delay\[1\]"), ({"distribution": "x"}, "unknown distribution")):
        with pytest.raises(ValueError, match=msg):
            resolve_delay(bad, "w0")
    with pytest.raises(ValueError, match="node_index"):
        resolve_delay([1, 2], "master")


def test_constructor_validation(hub):
    params = make_params()
    for kwargs, msg in (
        (dict(sync="sometimes"), "sync"),
        (dict(delta_dtype="int2"), "delta_dtype"),
        (dict(delta_dtype="topk", topk=-0.5), "topk"),
        (dict(topk_values="float8"), "topk_values"),
        (dict(error_feedback="on"), "error_feedback"),
        (dict(wait_timeout=0), "wait_timeout"),
        (dict(poll_interval=-1), "poll_interval"),
    ):
        with pytest.raises(ValueError, match=msg):
            DiLoCoWorker(hub, "w0", params, **kwargs)
    with pytest.raises(ValueError, match="node_id"):
        DiLoCoWorker(hub, "../evil", params)


def test_module_state_dedups_tied_weights():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight
            self.bn = torch.nn.BatchNorm1d(3)
            self.register_buffer("cache", torch.zeros(2), persistent=False)

    keys = set(module_state(Tied()))
    assert keys == {"emb.weight", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}


def test_merge_parts_telescopes_and_materializes():
    a = {"x": torch.tensor([1.0])}
    s1 = {"x": torch.tensor([0.5])}
    s2 = {"x": torch.tensor([0.0])}
    p = merge_parts(Part(3, 1, 1, anchor=a, snapshot=s1), Part(4, 2, 1, anchor=s1, snapshot=s2))
    assert p.anchor is a and p.snapshot is s2 and p.residual is None and p.base_outer_step == 3 and p.num_tokens == 3
    g = {"x": torch.tensor([5.0])}  # an install in between: no telescoping
    q = merge_parts(p, Part(5, None, 1, anchor=g, snapshot=s1))
    assert torch.equal(q.materialize()["x"], torch.tensor([1.0 + 4.5])) and q.num_tokens is None and q.phases == 3
    assert Job(fresh=q).phases == 3


def test_two_workers_lockstep_heterogeneous_delays_with_the_real_master(tmp_path):
    """Workers w0 (delay 1) and w1 (delay 3), a master with a quorum of both: every applied delta
    has staleness exactly its worker's delay (after the warm-up from version 0), one per worker per round."""
    from diloco_lightning.master import MasterOuterLoop

    root = tmp_path / "hub"
    init = make_params(0)
    rounds: list[dict] = []
    master = MasterOuterLoop(FileHub(root), init, node_state_dir=tmp_path / "master", poll_interval=0.02,
                             min_deltas=2, keep_globals=8, norm_ratio=None, logger=rounds.append)
    master.start()
    run_two_workers(master, root, init, outer_steps=8, sync="lockstep", delay=[1, 3])
    assert master.outer_step == 8
    applied = [(r["outer_step"], sorted(r["applied"]), r["staleness_histogram"]) for r in rounds if r.get("applied")]
    assert [a[1] for a in applied] == [[f"w0/{k}", f"w1/{k}"] for k in range(1, 9)]  # one delta per worker per round
    for k, (_, _, hist) in enumerate(applied, start=1):
        want = {}
        for d in (1, 3):
            s = str(min(k - 1, d))
            want[s] = want.get(s, 0) + 1
        assert hist == want, (k, hist)
