"""Exactly-once through outages and restarts, on every transport (file, hf, hf per node, s3).

The progress of a worker is countable here: its model is one vector ``p`` and every inner step
adds exactly 1 to each element (the counter model of ``tests/support/worker_crash_script.py``), and the
master applies deltas one by one with outer SGD lr 1, momentum 0 (arrival mode), so the global
``p`` is ``10 +`` the number of inner steps applied, bit for bit: a phase applied twice or lost
shows at once.

* A *doubt*: a delta lands but its answer is lost and the store goes down before the worker can
  ask whether it landed; the master then applies it and deletes it (every publication deletes
  what it processed). When the store is back the listing no longer shows the delta: only the
  manifest's ledger says it was applied. A worker that believed the listing merged it into its
  next delta: applied twice.
* A *restart without a checkpoint*: a worker killed (``kill -9``, a real process) after its first
  deltas reached the hub but before its first checkpoint starts again: it is restarting, not
  starting fresh. It resumes at the hub's step (the trainer moves on past the phases the hub has),
  so it trains nothing twice and every phase it trains is sent; also while the master is in the
  middle of publishing one of its earlier deltas (issue 38: the restart race).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from diloco_lightning.master import MasterOuterLoop
from diloco_lightning.util import faults
from diloco_lightning.worker import DiLoCoWorker
from support.workers import run_crash_script

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
H = 4


def counter_master(hub, tmp: Path, **kw) -> MasterOuterLoop:
    opts = dict(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0, aggregation="arrival", lease_ttl=30.0, poll_interval=0.02,
                norm_global_ratio=None)
    opts.update(kw)
    return MasterOuterLoop(hub, {"p": torch.full((8,), 10.0)}, node_state_dir=tmp / "master", **opts)


def phase(params: dict[str, torch.Tensor], steps: int = H) -> None:
    """``steps`` inner steps of the counter model: each adds 1 to every element."""
    with torch.no_grad():
        params["p"].add_(float(steps))


def drain(m: MasterOuterLoop, hub, rounds: int = 50) -> None:
    for _ in range(rounds):
        m.sync_once(force=True)
        if not hub.list_deltas(after=m.ledger):
            return


def applied(m: MasterOuterLoop) -> float:
    """The inner steps the master applied (the counter model: ``p - 10``)."""
    p = m.snapshot()[1]["p"]
    assert torch.all(p == p[0]), p
    return float(p[0]) - 10.0


# ============================================================================ 1. a doubt resolved by the ledger


def _after_one_phase(transport, tmp_path):
    """A counter master with version 0 published, and worker ``w0`` started with one phase trained."""
    m = counter_master(transport.open("m"), tmp_path)
    assert m.sync_once()
    params = {"p": torch.nn.Parameter(torch.full((8,), 10.0))}
    w = DiLoCoWorker(transport.open("w"), "w0", params, poll_interval=0.01, wait_timeout=30, claim=False)
    w.start()
    phase(params)
    return m, params, w


def test_a_doubt_applied_during_an_outage_is_never_sent_again(transport, tmp_path):
    """The 48-of-40 double application: delta_1 lands, its answer is lost, the store goes down (the
    uploader's retries and its "did it land?" listing fail: a doubt); back up, the master applies and
    deletes delta_1 before the worker asks again; the worker must find it in the ledger."""
    m, params, w = _after_one_phase(transport, tmp_path)
    transport.lose_next_delta_answer()
    w.boundary()
    assert w._uploader.wait_idle(30)
    assert transport.is_down
    assert transport.exists("nodes/w0/delta_1.safetensors")  # it landed
    transport.up()
    assert m.sync_once() and m.ledger == {"w0": 1}  # applied, and deleted with the publication
    # (per node, the worker deletes its processed deltas itself, with its next upload: the listing still shows it)
    assert transport.exists("nodes/w0/delta_1.safetensors") == (transport.kind == "hf_nodes")
    phase(params)
    w.boundary()  # the doubt is resolved first: in the ledger, so it is not merged into delta_2
    assert w.flush()
    w.close()
    drain(m, m.hub)
    assert applied(m) == 2 * H, f"{applied(m)} of {2 * H} inner steps applied"
    assert w.totals["phases_delivered_total"] == 2


def test_a_definite_failure_is_still_merged_into_the_next_delta(transport, tmp_path):
    """The other side of the rule: a delta that did not land (not listed, not in the ledger) is merged."""
    m, params, w = _after_one_phase(transport, tmp_path)
    transport.down()
    w.boundary()
    assert w._uploader.wait_idle(30)
    transport.up()
    assert not transport.exists("nodes/w0/delta_1.safetensors")
    phase(params)
    w.boundary()
    assert w.flush()
    w.close()
    drain(m, m.hub)
    assert applied(m) == 2 * H


# ============================================================================ 2. a restart without a checkpoint


def _run_worker(cfg: dict, faults: str | None) -> subprocess.CompletedProcess:
    return run_crash_script(cfg, faults, timeout=240)


SLOW = pytest.mark.slow


@pytest.fixture(params=["file", pytest.param("hf", marks=SLOW), pytest.param("hf_nodes", marks=SLOW),
                        pytest.param("s3", marks=SLOW)])
def crash_transport(request, tmp_path):
    """The kill -9 matrix: two Lightning subprocesses per case, so only the folder hub runs by default."""
    from conftest import _transport

    t = _transport(request, tmp_path, request.param)
    yield t
    t.up()


@pytest.mark.parametrize("checkpoints", ["none", pytest.param("every_8H", marks=SLOW)])
def test_a_worker_killed_before_its_first_checkpoint_restarts_without_replaying(crash_transport, tmp_path, checkpoints):
    """A real Lightning worker is killed (SIGKILL) right after its 3rd delta reached the hub, before any
    checkpoint (none at all, or one every 8 boundaries); its next life, with the same node id, resumes
    at the hub's step (step 3H: it does not train the delivered phases again). A master applies
    everything meanwhile. Exactly the run's 40 inner steps must be applied (48, 56 or 64 of 40 before
    the restart read the hub).
    Two subprocess lives of a Lightning worker each: the folder case without checkpoints runs by
    default, the others with ``-m slow``."""
    transport = crash_transport
    hub = transport.open("m")
    m = counter_master(hub, tmp_path)
    assert m.sync_once()
    m.start()
    try:
        cfg = dict(hub=transport.url, hub_options=transport.options("worker"), ckpt_dir=str(tmp_path / "ckpt"),
                   max_steps=10 * H, inner_steps=H, ckpt_every=0 if checkpoints == "none" else 8 * H)
        first = _run_worker(cfg, "worker.uploaded:3")
        assert first.returncode == -9, first.stderr[-3000:]
        assert not list((tmp_path / "ckpt").glob("*.ckpt"))  # died before any checkpoint
        second = _run_worker(cfg, None)
        assert second.returncode == 0 and f"done {10 * H}" in second.stdout, second.stderr[-3000:]
        assert "restarting without a checkpoint" in second.stderr
        resumed = re.search(r"resumes at boundary (\d+)", second.stderr)  # the hub's step (uploads may merge phases)
        assert resumed and f"step {int(resumed.group(1)) * H}" in second.stdout, second.stdout  # the trainer moved on
    finally:
        m.stop()
    drain(m, hub)
    assert applied(m) == 10 * H, f"{applied(m)} of {10 * H} inner steps applied"
    assert m.ledger["w0"] == 10


# ============================================================================ 3. the restart race (issue 38)


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["async", "lockstep"])
def test_a_restart_while_the_master_publishes_an_earlier_delta_loses_no_phase(crash_transport, tmp_path, sync):
    """Issue 38, item 5, tried as an outside check would: a 5-phase run; the worker (a real Lightning
    process) is killed (SIGKILL) right after its delta_3 reached the hub, while the master is in the
    middle of publishing an earlier delta of it (async: delta_2, its files written and the manifest not
    yet swapped; lockstep, where delta_3 waits for version 2: delta_3 itself), and restarted without a
    checkpoint while that publication is still held. It must resume at local_step 4 (the trainer at step
    3H: nothing trained twice), and every phase it trains must be applied: 5 of 5, the executed steps of
    both lives equal to the applied ones (before the fix the second life trained 5 phases and sent 2:
    3 phases of work dropped, as an outside check counts them, or lost for a loop that does not replay)."""
    transport = crash_transport
    hub = transport.open("m")
    m = counter_master(hub, tmp_path)
    assert m.sync_once()
    held, release = threading.Event(), threading.Event()
    publishing = 1 if sync == "async" else 2  # the master's ledger when the held publication starts

    def hook(label: str) -> None:
        if label == "files" and m.run.ledger.get("w0") == publishing and not held.is_set():
            held.set()
            release.wait(120)

    faults.install(hub, hook)
    m.start()
    steps = tmp_path / "steps.log"
    cfg = dict(hub=transport.url, hub_options=transport.options("worker"), ckpt_dir=str(tmp_path / "ckpt"),
               max_steps=5 * H, inner_steps=H, ckpt_every=0, sync=sync, step_log=str(steps),
               throttle=0.05)  # slow steps: one delta per phase (an async upload still in flight merges phases)
    try:
        first = _run_worker(cfg, "worker.uploaded:3")
        assert first.returncode == -9, first.stderr[-3000:]
        assert held.wait(30), "the master never reached the publication to hold"
        assert hub.read_manifest().ledger == {"w0": publishing}  # still publishing: the restart reads the hub now
        env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_DISABLE_TELEMETRY="1")
        env.pop("DILOCO_FAULTS", None)
        second = subprocess.Popen([sys.executable, str(TESTS / "support" / "worker_crash_script.py"), json.dumps(cfg)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        err: list[str] = []

        def read_err() -> None:
            for line in second.stderr:
                err.append(line)
                if "restarting without a checkpoint" in line:
                    release.set()  # the restart has read the hub during the publication: let it finish

        reader = threading.Thread(target=read_err, daemon=True)
        reader.start()
        out = second.stdout.read()
        second.wait(240)
        reader.join(10)
        release.set()
        stderr = "".join(err)
        assert second.returncode == 0 and f"done {5 * H}" in out, stderr[-3000:]
        assert "resumes at boundary 3 (next delta delta_4)" in stderr, stderr[-3000:]
        assert f"step {3 * H}" in out, out  # the trainer resumed at the hub's step
    finally:
        release.set()
        m.stop()
        faults.install(hub, None)
    drain(m, hub)
    assert applied(m) == 5 * H, f"{applied(m) / H:g} of 5 phases applied"
    assert m.ledger["w0"] == 5
    # every step of both lives (the first may die before logging its last one): none trained twice
    executed = [int(line.split()[1]) for line in steps.read_text().splitlines()]
    assert len(executed) == len(set(executed)) and set(range(3 * H + 1, 5 * H + 1)) <= set(executed), executed


def test_a_loop_that_does_not_replay_loses_nothing_after_a_restart(tmp_path):
    """The other face of the race: a worker restarted without a checkpoint whose loop goes on from
    where the hub's work ends (an Accelerate loop, a DiLoCoWorker caller) instead of replaying from step
    0. Each boundary it reaches is new work on the installed global and must be sent: before the fix
    its first 3 were taken for replays and dropped (3 of 5 phases applied, restarting at local_step 3)."""
    from diloco_lightning.hub.local import FileHub

    root = tmp_path / "hub"
    m = counter_master(FileHub(root, create=True), tmp_path)
    assert m.sync_once()
    params = {"p": torch.nn.Parameter(torch.full((8,), 10.0))}
    w = DiLoCoWorker(FileHub(root), "w0", params, poll_interval=0.01, wait_timeout=30, claim=False)
    w.start()
    for _ in range(3):
        phase(params)
        w.boundary()
    assert w.flush()
    w.close(flush=False)  # the process dies: no checkpoint
    assert m.sync_once(force=True) and m.ledger == {"w0": 3}
    params = {"p": torch.nn.Parameter(torch.full((8,), 10.0))}
    w2 = DiLoCoWorker(FileHub(root), "w0", params, poll_interval=0.01, wait_timeout=30, claim=False)
    w2.start()
    assert w2.next_local_step == 4 and w2.resumed_boundaries == 3 and w2.boundaries == 3
    assert params["p"][0].item() == 10.0 + 3 * H  # the global holds the delivered phases
    for _ in range(2):
        phase(params)
        w2.boundary()
    assert w2.flush()
    w2.close()
    drain(m, m.hub)
    assert applied(m) == 5 * H, f"{applied(m) / H:g} of 5 phases applied"
    assert m.ledger == {"w0": 5}


# ============================================================================ 4. a checkpoint while a delta uploads


def _gated_hub(root: Path, *, create: bool = False):
    """A folder hub whose delta uploads wait for ``gate`` (``lose``: the upload then fails without landing;
    ``ended`` is set when an attempt is over)."""
    from diloco_lightning.hub.local import FileHub

    class Gated(FileHub):
        def __init__(self) -> None:
            super().__init__(root, create=create)
            self.gate, self.entered, self.ended = threading.Event(), threading.Event(), threading.Event()
            self.lose = False

        def upload_delta(self, local, node_id, local_step):
            self.entered.set()
            try:
                assert self.gate.wait(30)
                if self.lose:
                    raise ConnectionError("the connection dropped")
                return super().upload_delta(local, node_id, local_step)
            finally:
                self.ended.set()

    return Gated()


def _checkpoint_mid_upload(tmp_path: Path, root: Path, params: dict[str, torch.Tensor], *, lands: bool, **kw):
    """Worker w0 trains a phase (its delta_1 held at the gate), checkpoints with the upload in flight,
    then the upload lands or fails and the process dies before it sends anything else."""
    hub = _gated_hub(root)
    w = DiLoCoWorker(hub, "w0", params, poll_interval=0.01, wait_timeout=30, claim=False, **kw)
    w.start()
    phase(params)
    w.boundary()
    assert hub.entered.wait(10)
    counters, anchor = w.state_dict(), w.anchor_state()
    assert not hub.gate.is_set()  # the checkpoint did not wait for the network
    local = {k: v.detach().clone() for k, v in params.items()}
    hub.lose = not lands
    hub.gate.set()
    assert hub.ended.wait(10)
    w.close(flush=False)  # the process dies: nothing is sent after the attempt
    return counters, anchor, local


def _resume_and_train_a_phase(root: Path, counters, anchor, weights: torch.Tensor) -> None:
    """A new life of w0 restored from the checkpoint (``counters``, ``anchor``, the model's ``weights``)
    trains one more phase and delivers everything."""
    from diloco_lightning.hub.local import FileHub

    params = {"p": torch.nn.Parameter(weights.clone())}
    w = DiLoCoWorker(FileHub(root), "w0", params, poll_interval=0.01, wait_timeout=30, claim=False)
    w.load_state_dict(counters)
    w.load_anchor_state(anchor)
    w.start()
    phase(params)
    w.boundary()
    assert w.flush()
    w.close()


@pytest.mark.parametrize("lands,applied_first", [(True, False), (True, True), (False, False)],
                         ids=["landed", "landed-applied-deleted", "lost"])
def test_a_checkpoint_taken_while_a_delta_uploads_does_not_wait_and_loses_nothing(tmp_path, lands, applied_first):
    """The checkpoint records the delta in flight as a doubt at its step instead of waiting for it: a
    worker restarted from it asks the hub and sends it again only if it never landed (also when the master
    applied and deleted it meanwhile: the ledger says so). Every phase is applied once."""
    from diloco_lightning.hub.local import FileHub

    root = tmp_path / "hub"
    m = counter_master(FileHub(root, create=True), tmp_path)
    assert m.sync_once()
    params = {"p": torch.nn.Parameter(torch.full((8,), 10.0))}
    counters, anchor, local = _checkpoint_mid_upload(tmp_path, root, params, lands=lands)
    assert anchor["unsent"]["doubt"]["local_step"] == 1 and "fresh" not in anchor["unsent"]
    assert torch.equal(anchor["unsent"]["doubt"]["tensors"]["p"], torch.full((8,), -4.0))
    assert sorted(p.name for p in (root / "nodes" / "w0").glob("delta_*")) == (["delta_1.safetensors"] if lands else [])
    if applied_first:
        drain(m, FileHub(root))
        assert m.ledger == {"w0": 1} and not list((root / "nodes" / "w0").glob("delta_*"))
    _resume_and_train_a_phase(root, counters, anchor, local["p"])
    drain(m, FileHub(root))
    assert m.ledger == {"w0": 2} and applied(m) == 2 * H


def test_a_checkpoints_doubt_keeps_the_error_feedback_exact(tmp_path):
    """With int8 and error feedback: after a restart from a checkpoint taken mid-upload, the next delta is
    bit for bit the one a worker that never stopped sends (the landed doubt's residual is owed again)."""
    from diloco_lightning.encoding.feedback import decode_delta
    from diloco_lightning.hub.local import FileHub
    from diloco_lightning.wire.delta import read_delta

    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(64, generator=g) * 1e-2 for _ in range(2)]

    out = {}
    for name, crash in (("ref", False), ("crash", True)):
        root = tmp_path / name
        hub = FileHub(root, create=True)
        m = MasterOuterLoop(hub, {"p": torch.zeros(64)}, node_state_dir=tmp_path / f"{name}-m", outer_lr=1.0,
                            outer_optimizer="nesterov", outer_momentum=0.0, aggregation="arrival", norm_global_ratio=None)
        assert m.sync_once()  # version 0 (nothing applied after it: the deltas stay on the hub to be read)
        params = {"p": torch.nn.Parameter(torch.zeros(64))}
        if crash:
            hub2 = _gated_hub(root)
            w = DiLoCoWorker(hub2, "w0", params, poll_interval=0.01, wait_timeout=30, claim=False, delta_dtype="int8")
            w.start()
            with torch.no_grad():
                params["p"].add_(steps[0])
            w.boundary()
            assert hub2.entered.wait(10)
            counters, anchor = w.state_dict(), w.anchor_state()
            assert not hub2.gate.is_set() and anchor["unsent"]["doubt"]["local_step"] == 1
            assert anchor["residual"] is None  # the residual travels in the doubt
            hub2.gate.set()
            assert hub2.ended.wait(10)
            w.close(flush=False)
            params = {"p": torch.nn.Parameter(params["p"].detach().clone())}
            w = DiLoCoWorker(FileHub(root), "w0", params, poll_interval=0.01, wait_timeout=30, claim=False,
                             delta_dtype="int8")
            w.load_state_dict(counters)
            w.load_anchor_state(anchor)
            w.start()
        else:
            w = DiLoCoWorker(hub, "w0", params, poll_interval=0.01, wait_timeout=30, claim=False, delta_dtype="int8")
            w.start()
            with torch.no_grad():
                params["p"].add_(steps[0])
            w.boundary()
            assert w.flush()
        with torch.no_grad():
            params["p"].add_(steps[1])
        w.boundary()
        assert w.flush()
        w.close()
        out[name] = decode_delta(read_delta(root / "nodes" / "w0" / "delta_2.safetensors",
                                           reference={"p": torch.zeros(64)}).encoded)["p"]
    assert torch.equal(out["ref"], out["crash"])


@pytest.mark.parametrize("second_sent", [True, False], ids=["next-delta-sent", "died-in-the-outage"])
def test_a_checkpoint_taken_while_a_doubt_is_settled_keeps_the_doubt_and_the_new_phase(tmp_path, second_sent):
    """delta_1 lands but its answer is lost and the hub goes down: it is a doubt. At the next boundary the
    uploader asks the hub about it (the question hangs) while the checkpoint is taken: the checkpoint keeps
    the doubt and the new phase, without waiting. Restarted from it, the worker sends neither again if the hub
    has them, and every phase is applied once."""
    from diloco_lightning.hub.local import FileHub

    class Flaky(FileHub):
        def __init__(self) -> None:
            super().__init__(root)
            self.down, self.asking, self.answer = False, threading.Event(), threading.Event()

        def upload_delta(self, local, node_id, local_step):
            if self.down:
                raise ConnectionError("the hub is down")
            out = super().upload_delta(local, node_id, local_step)
            if local_step == 1:  # it landed; the answer is lost and the hub goes down
                self.down = True
                raise ConnectionError("the connection dropped")
            return out

        def list_node_deltas(self, node_id, after=-1):
            if self.down:
                self.asking.set()
                assert self.answer.wait(30)
                if self.down:
                    raise ConnectionError("the hub is down")
            return super().list_node_deltas(node_id, after)

        def read_manifest(self):
            if self.down:
                raise ConnectionError("the hub is down")
            return super().read_manifest()

    root = tmp_path / "hub"
    m = counter_master(FileHub(root, create=True), tmp_path)
    assert m.sync_once()
    params = {"p": torch.nn.Parameter(torch.full((8,), 10.0))}
    hub = Flaky()
    w = DiLoCoWorker(hub, "w0", params, poll_interval=0.01, wait_timeout=30, claim=False)
    w.start()
    phase(params)
    w.boundary()
    assert hub.asking.wait(10)  # delta_1 landed, its answer lost: the uploader asks whether it landed
    hub.answer.set()            # the hub cannot say: a doubt comes back
    for _ in range(500):
        if w.totals["upload_failures_total"]:
            break
        threading.Event().wait(0.01)
    hub.answer.clear()
    hub.asking.clear()
    phase(params)
    w.boundary()                # the doubt and boundary 2's phase go out together: the question hangs
    assert hub.asking.wait(10)
    counters, anchor = w.state_dict(), w.anchor_state()
    assert not hub.answer.is_set()  # it did not wait for the hub
    unsent = anchor["unsent"]
    assert unsent["doubt"]["local_step"] == 1 and torch.equal(unsent["doubt"]["tensors"]["p"], torch.full((8,), -4.0))
    assert unsent["fresh"]["phases"] == 1 and torch.equal(unsent["fresh"]["tensors"]["p"], torch.full((8,), -4.0))
    local = params["p"].detach().clone()
    if second_sent:
        hub.down = False  # back: the doubt is on the hub, boundary 2's phase goes out as delta_2
    hub.answer.set()
    if second_sent:
        assert w.flush(timeout=10)
    w.close(flush=False)  # the process dies
    assert sorted(p.name for p in (root / "nodes" / "w0").glob("delta_*")) == (
        ["delta_1.safetensors", "delta_2.safetensors"] if second_sent else ["delta_1.safetensors"])
    _resume_and_train_a_phase(root, counters, anchor, local)
    drain(m, FileHub(root))
    assert m.ledger == {"w0": 3} and applied(m) == 3 * H


# ============================================================================ 5. killed after its last checkpoint


def test_a_worker_killed_in_its_final_flush_delivers_its_last_phases_when_restarted(tmp_path):
    """The hub refuses the last two deltas (an outage past the end of training), so the last checkpoint
    (at max_steps) holds them undelivered; the process is kill -9ed as its final flush starts. Restarted
    from that checkpoint, Lightning has nothing left to train and skips the training hooks: the callback
    still delivers what the checkpoint held (``on_fit_end``) and installs the global. Every phase once."""
    from diloco_lightning.hub.local import FileHub

    root = tmp_path / "hub"
    m = counter_master(FileHub(root, create=True), tmp_path, lease_ttl=2)
    assert m.sync_once()
    cfg = dict(hub=str(root), ckpt_dir=str(tmp_path / "ckpt"), max_steps=8, inner_steps=2)
    first = run_crash_script({**cfg, "refuse_uploads_from": 3}, "worker.finishing", timeout=180)
    assert first.returncode == -9, first.stderr[-3000:]
    assert sorted(p.name for p in (root / "nodes" / "w0").glob("delta_*")) == ["delta_1.safetensors",
                                                                               "delta_2.safetensors"]
    drain(m, FileHub(root))
    assert m.ledger == {"w0": 2} and applied(m) == 4
    second = run_crash_script(cfg, None, timeout=180)
    assert second.returncode == 0 and "done 8" in second.stdout, second.stderr[-3000:]
    assert "started" not in second.stdout  # nothing was trained: the training hooks did not run
    drain(m, FileHub(root))
    assert m.ledger["w0"] >= 3 and applied(m) == 8, (m.ledger, second.stderr[-3000:])
