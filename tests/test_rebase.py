"""An async worker rebasing onto its own deltas (``WorkerOptions.rebase``, ``worker/rebase.py``):
the start after an install is ``version_b - sum_j scale_j * delta_j`` over its deltas ``b`` lacks,
with the scale the manifest publishes (``master.delta_scales``), which a master with a
momentum-free SGD writes and every reader checks."""

from __future__ import annotations

import json
import time

import pytest
import torch

from diloco_lightning.hub.local import FileHub
from diloco_lightning.hub.versions import stage_global
from diloco_lightning.master.aggregation import delta_scales
from diloco_lightning.outer import build_outer_optimizer
from diloco_lightning.wire.delta import read_delta
from diloco_lightning.wire.manifest import Manifest, ManifestError
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.worker import DiLoCoWorker
from diloco_lightning.worker.rebase import WorkerOwnDeltas, fallback_scale

from support.workers import run_two_workers

FAST = dict(poll_interval=0.01, wait_timeout=10.0)
SHA = "0" * 64


def manifest(ledger: dict[str, int], scales: dict[str, float] | None = None, step: int = 3) -> Manifest:
    master: dict = {"holder": "test"}
    if scales is not None:
        master["delta_scales"] = scales
    return Manifest(step, f"global/weights_{step:09d}_x.safetensors", SHA, SHA, ledger=ledger, master=master).validate()


def test_the_start_subtracts_the_deltas_the_version_lacks_times_the_published_scale():
    own = WorkerOwnDeltas("w0")
    own.sent(3, {"a": torch.full((2,), 4.0), "b": torch.full((1,), 8.0)})  # applied by the version: dropped
    own.sent(4, {"a": torch.full((2,), 2.0), "b": torch.full((1,), -1.0)})  # not applied yet: subtracted
    state = {"a": torch.ones(2), "b": torch.ones(1, dtype=torch.bfloat16), "n": torch.tensor(7)}
    start = own.start(manifest({"w0": 3, "w1": 9}, {"w0": 0.25, "w1": 0.5}), state)
    assert own.pending == [4]
    assert torch.equal(start["a"], torch.full((2,), 0.5))  # 1 - 0.25 * 2
    assert start["b"].dtype == torch.bfloat16 and torch.equal(start["b"], torch.full((1,), 1.25, dtype=torch.bfloat16))
    assert start["n"] is state["n"] and torch.equal(state["a"], torch.ones(2))  # the version itself is not touched
    # a later version containing delta 4 needs no correction: the state itself
    later = {"a": torch.zeros(2), "b": torch.zeros(1, dtype=torch.bfloat16)}
    assert own.start(manifest({"w0": 4}, {"w0": 0.25}), later) is later and own.pending == []
    assert own.state_dict() == {"rebased": 1, "forgotten": 0}


def test_without_a_published_scale_the_fallback_is_one_over_the_nodes():
    own = WorkerOwnDeltas("w0")
    own.sent(1, {"a": torch.full((1,), 3.0)})
    m = manifest({"w1": 5, "w2": 2})  # an older master: no delta_scales; w0 not in the ledger yet
    assert m.delta_scale("w0") is None and fallback_scale(m, "w0") == pytest.approx(1 / 3)
    start = own.start(m, {"a": torch.zeros(1)})
    assert torch.allclose(start["a"], torch.full((1,), -1.0))


def test_with_lookahead_each_delta_in_flight_stands_for_one_of_every_nodes():
    """``lookahead``: the published scale times the ledger's nodes (this one included): with fedavg's
    1/3 in a round of three nodes the start is the version minus the whole own delta."""
    own = WorkerOwnDeltas("w0", lookahead=True)
    own.sent(4, {"a": torch.full((2,), 3.0)})
    start = own.start(manifest({"w0": 3, "w1": 9, "w2": 1}, {"w0": 1 / 3, "w1": 1 / 3, "w2": 1 / 3}),
                      {"a": torch.ones(2)})
    assert torch.allclose(start["a"], torch.full((2,), -2.0), atol=0, rtol=1e-6)  # 1 - 3 * (1/3) * 3
    # a node not in the ledger yet counts itself: two nodes, scale 0.25 -> factor 0.5
    own = WorkerOwnDeltas("w0", lookahead=True)
    own.sent(1, {"a": torch.full((1,), 4.0)})
    assert torch.equal(own.start(manifest({"w1": 2}, {"w0": 0.25}), {"a": torch.zeros(1)})["a"], torch.full((1,), -2.0))
    # without a published scale: 1/nodes times nodes, the whole delta
    own = WorkerOwnDeltas("w0", lookahead=True)
    own.sent(1, {"a": torch.full((1,), 3.0)})
    assert torch.equal(own.start(manifest({"w1": 5, "w2": 2}), {"a": torch.zeros(1)})["a"], torch.full((1,), -3.0))


def test_a_refused_delta_counts_until_a_later_one_of_the_node_is_accepted_and_the_keep_is_bounded():
    own = WorkerOwnDeltas("w0", limit=2)
    own.sent(5, {"a": torch.ones(1)})  # refused by the master: the ledger never reaches 5 through it
    own.sent(6, {"a": torch.ones(1)})
    own.start(manifest({"w0": 4}, {"w0": 1.0}), {"a": torch.zeros(1)})
    assert own.pending == [5, 6]
    assert own.start(manifest({"w0": 6}, {"w0": 1.0}), {"a": torch.zeros(1)})["a"].item() == 0.0  # 6 accepted: both gone
    assert own.pending == []
    for s in (7, 8, 9):
        own.sent(s, {"a": torch.ones(1)})
    assert own.pending == [8, 9] and own.forgotten == 1
    with pytest.raises(ValueError, match="limit"):
        WorkerOwnDeltas("w0", limit=0)


@pytest.mark.parametrize("bad, words", [
    ("x", "must be an object"),
    ({"w0": -0.5}, "from 0 to 100"),
    ({"w0": 1e9}, "from 0 to 100"),
    ({"w0": True}, "from 0 to 100"),
    ({"w0": "0.5"}, "from 0 to 100"),
    ({"../w0": 0.5}, "delta_scales"),
])
def test_a_malformed_delta_scales_entry_is_refused_with_a_reason(bad, words):
    doc = json.loads(manifest({"w0": 1}).to_json())
    doc["master"]["delta_scales"] = bad
    with pytest.raises(ManifestError, match=words):
        Manifest.from_json(json.dumps(doc))


def test_non_finite_scales_are_refused_and_a_signed_manifest_keeps_them_verifiable():
    doc = json.loads(manifest({"w0": 1}).to_json())
    text = json.dumps(doc).replace('"holder": "test"', '"holder": "test", "delta_scales": {"w0": NaN}')
    with pytest.raises(ManifestError):
        Manifest.from_json(text)
    key = RunKey("secret")
    signed = manifest({"w0": 1}, {"w0": 0.5}).signed(key)
    back = Manifest.from_json(signed.to_json())
    assert back.verify(key) and back.delta_scale("w0") == 0.5
    # a reader that knows nothing of the entry: it rides inside ``master``, kept as it was signed
    doc = json.loads(signed.to_json())
    assert key.verify_document("manifest", doc)


def test_the_scales_a_master_publishes():
    state = {"a": torch.zeros(2)}
    assert build_outer_optimizer("nesterov", state, lr=1.0, momentum=0.0).linear_rate() == 1.0
    assert build_outer_optimizer("nesterov", state, lr=0.7, momentum=0.9).linear_rate() is None
    assert build_outer_optimizer("cgad", state, lr=0.003).linear_rate() is None
    sgd = build_outer_optimizer("staleness_sgd", state, lr=0.5, momentum=0.0)
    assert sgd.linear_rate() == 0.5 and sgd.gate(1) == pytest.approx(0.5)
    assert delta_scales(1.0, [("w0", 1.0, 1.0), ("w1", 3.0, 0.5)]) == {"w0": 0.25, "w1": 0.375}
    assert delta_scales(None, [("w0", 1.0, 1.0)]) is None
    # the published factor is what the step multiplies a delta by: state -= scale * delta
    opt = build_outer_optimizer("nesterov", {"a": torch.zeros(2)}, lr=0.8, momentum=0.0)
    s = {"a": torch.zeros(2)}
    opt.step(s, {"a": torch.full((2,), 2.0)}, staleness=0)
    assert torch.allclose(s["a"], torch.full((2,), -0.8 * 2.0))


def _params():
    return {"layer.weight": torch.nn.Parameter(torch.zeros(4, 3)), "layer.bias": torch.nn.Parameter(torch.zeros(3)),
            "norm.running_mean": torch.zeros(3), "norm.num_batches_tracked": torch.tensor(5)}


def _publish(hub, tmp_path, step, state, ledger, scales, prev=None):
    staged = stage_global(tmp_path / "pub", step, state)
    m = staged.manifest(ledger=ledger, master={"holder": "test", "delta_scales": scales})
    hub.publish(m, staged.files, expected_outer_step=prev)
    return m


def _started(tmp_path, rebase: bool, lookahead: bool = False):
    """A folder hub holding version 0 (the params' values) and a worker started on it:
    ``(hub, params, version 0, worker)``."""
    hub = FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache")
    params = _params()
    v0 = {k: v.detach().clone() for k, v in params.items()}
    _publish(hub, tmp_path, 0, v0, {}, {})
    w = DiLoCoWorker(hub, "w0", params, rebase=rebase, lookahead=lookahead, **FAST)
    w.start()
    return hub, params, v0, w


def _install_next(w):
    """Boundaries (no progress between them: zero deltas) until ``w`` installs a newer version, which is returned."""
    deadline = time.monotonic() + 10
    installed = None
    while installed is None and time.monotonic() < deadline:
        installed = w.boundary().installed
        time.sleep(0.02)
    return installed


def test_an_async_worker_installs_the_version_minus_its_pending_deltas_and_anchors_there(tmp_path):
    hub, params, v0, w = _started(tmp_path, rebase=True)
    with torch.no_grad():
        params["layer.weight"].add_(0.5)  # phase 1: delta -0.5 on the weight
    w.boundary()
    with torch.no_grad():
        params["layer.bias"].add_(1.0)  # phase 2: delta -1 on the bias
    w.boundary()
    assert w.flush()
    steps = sorted(r.local_step for r in hub.list_deltas())
    v1 = {k: (v + 3 if v.is_floating_point() else v) for k, v in v0.items()}
    _publish(hub, tmp_path, 1, v1, {"w0": steps[0]}, {"w0": 0.25}, prev=0)  # contains phase 1 only
    installed = _install_next(w)
    assert installed is not None and installed.outer_step == 1
    assert torch.equal(params["layer.weight"], torch.full((4, 3), 3.0))  # phase 1 is in version 1
    assert torch.equal(params["layer.bias"], torch.full((3,), 3.25))  # 3 - 0.25 * (-1)
    assert torch.equal(params["norm.running_mean"], torch.full((3,), 3.0))
    assert torch.equal(w.anchor["layer.bias"], torch.full((3,), 3.25))  # the anchor is the start
    w.boundary()  # nothing trained since the install: the next delta is zero (nothing counted twice)
    assert w.flush()
    last = max(hub.list_deltas(), key=lambda r: r.local_step)
    assert all(torch.count_nonzero(t) == 0 for t in read_delta(hub.download(last.path)).tensors.values())
    w.close()


def test_a_lookahead_worker_installs_the_version_minus_its_delta_times_the_nodes(tmp_path):
    """The product's async worker with ``lookahead=True``: version 1 lacks its phase (-1 on the bias),
    published with scale 0.25 for w0 and a ledger of w0 and w1: the start is 3 - 2 * 0.25 * (-1)."""
    hub, params, v0, w = _started(tmp_path, rebase=True, lookahead=True)
    with torch.no_grad():
        params["layer.bias"].add_(1.0)
    w.boundary()
    assert w.flush()
    _publish(hub, tmp_path, 1, {k: v + 3 if v.is_floating_point() else v for k, v in v0.items()}, {"w1": 4},
             {"w0": 0.25, "w1": 0.25}, prev=0)
    assert _install_next(w) is not None
    assert torch.equal(params["layer.bias"], torch.full((3,), 3.5))
    assert torch.equal(params["layer.weight"], torch.full((4, 3), 3.0))  # nothing trained there
    assert torch.equal(w.anchor["layer.bias"], torch.full((3,), 3.5))
    w.close()


def test_with_rebase_off_the_version_itself_is_installed(tmp_path):
    hub, params, v0, w = _started(tmp_path, rebase=False)
    with torch.no_grad():
        params["layer.bias"].add_(1.0)
    w.boundary()
    assert w.flush()
    _publish(hub, tmp_path, 1, {k: v + 3 if v.is_floating_point() else v for k, v in v0.items()}, {}, {"w0": 0.25},
             prev=0)
    assert _install_next(w) is not None
    assert torch.equal(params["layer.bias"], torch.full((3,), 3.0))
    w.close()


def test_two_rebasing_async_workers_with_the_real_master(tmp_path):
    """A momentum-free master (fedavg: lr 1, momentum 0, every worker per round) publishes each
    node's scale, 1/n for a round of n deltas; both rebasing workers use it and the run ends finite and in step."""
    from diloco_lightning.master import MasterOuterLoop

    root = tmp_path / "hub"
    init = {k: v.detach().clone() for k, v in _params().items()}
    master = MasterOuterLoop(FileHub(root), init, node_state_dir=tmp_path / "master", poll_interval=0.02,
                             min_deltas=2, outer_lr=1.0, outer_momentum=0.0, norm_ratio=None)
    master.start()
    workers = run_two_workers(master, root, init, outer_steps=4, pause=0.05, rebase=True)
    m = FileHub(root).read_manifest()
    assert m is not None and m.outer_step >= 4
    scales = m.master["delta_scales"]  # lr 1 / the round's deltas (2, or more when one node sent two)
    assert set(scales) == {"w0", "w1"} and all(round(1 / v) >= 2 and 1 / v == pytest.approx(round(1 / v)) for v in scales.values())
    assert sum(w._mode.own.rebased for w in workers.values()) >= 1  # at least one install was rebased


def test_rebase_is_an_option_checked_like_the_others(tmp_path):
    from diloco_lightning.util.options import OptionError
    from diloco_lightning.worker.options import WorkerOptions

    with pytest.raises(OptionError, match="rebase"):
        WorkerOptions(rebase="yes").validate()
    with pytest.raises(OptionError, match="lookahead"):
        WorkerOptions(lookahead=1).validate()
    assert WorkerOptions(rebase=True, sync="lockstep").validate().rebase  # accepted; a lockstep worker never rebases


@pytest.mark.parametrize("aggregation, publish", [("round", "each"), ("arrival", "each"), ("arrival", "pass")])
def test_the_master_publishes_each_nodes_scale_in_every_aggregation(tmp_path, aggregation, publish):
    """Round: ``lr * w_i / sum(w)``; arrival (a publication each, or one per pass): ``lr * gate(tau)``.
    A master with momentum publishes none."""
    from diloco_lightning.master import MasterOuterLoop
    from diloco_lightning.wire.delta import model_fingerprint, write_delta

    state = {"w": torch.zeros(2), "n": torch.tensor(1)}
    hub = FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache")
    master = MasterOuterLoop(hub, state, node_state_dir=tmp_path / "m", outer_optimizer="staleness_sgd",
                             outer_lr=0.5, outer_momentum=0.0, aggregation=aggregation, arrival_publish=publish,
                             min_deltas=2, norm_ratio=None, norm_global_ratio=None, poll_interval=0.02)
    assert master.sync_once()  # version 0
    for i, node in enumerate(("w0", "w1")):
        p = tmp_path / f"d{i}.safetensors"
        write_delta(p, {"w": torch.ones(2)}, node_id=node, local_step=1, base_outer_step=0,
                    model_fingerprint=model_fingerprint(state))
        hub.upload_delta(p, node, 1)
    master.sync_once(force=True)
    while master.sync_once(force=True):
        pass
    scales = hub.read_manifest().master["delta_scales"]
    gate = master.optimizer.gate
    if aggregation == "round":
        assert scales == {"w0": 0.25, "w1": 0.25}  # one step of the mean: 0.5 * gate(0) * 1/2
    else:  # one step each, in arrival order: the second one is a version staler
        assert sorted(scales.values()) == sorted([0.5 * gate(0), 0.5 * gate(1)])
    momentum = MasterOuterLoop(FileHub(tmp_path / "hub2"), state, node_state_dir=tmp_path / "m2", outer_lr=0.7,
                               outer_momentum=0.9, norm_ratio=None, poll_interval=0.02)
    assert momentum.sync_once() and "delta_scales" not in FileHub(tmp_path / "hub2").read_manifest().master
