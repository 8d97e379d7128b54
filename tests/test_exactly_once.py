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
  deltas reached the hub but before its first checkpoint starts again from step 0: it is
  restarting, not starting fresh, and must not send the replayed phases again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diloco_lightning.master import MasterOuterLoop
from diloco_lightning.worker import DiLoCoWorker

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
H = 4


def counter_master(hub, tmp: Path, **kw) -> MasterOuterLoop:
    opts = dict(outer_lr=1.0, outer_momentum=0.0, aggregation="arrival", lease_ttl=30.0, poll_interval=0.02,
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


def test_a_doubt_applied_during_an_outage_is_never_sent_again(transport, tmp_path):
    """The 48-of-40 double application: delta_1 lands, its answer is lost, the store goes down (the
    uploader's retries and its "did it land?" listing fail: a doubt); back up, the master applies and
    deletes delta_1 before the worker asks again; the worker must find it in the ledger."""
    m = counter_master(transport.open("m"), tmp_path)
    assert m.sync_once()
    params = {"p": torch.nn.Parameter(torch.full((8,), 10.0))}
    w = DiLoCoWorker(transport.open("w"), "w0", params, poll_interval=0.01, wait_timeout=30, claim=False)
    w.start()
    phase(params)
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
    m = counter_master(transport.open("m"), tmp_path)
    assert m.sync_once()
    params = {"p": torch.nn.Parameter(torch.full((8,), 10.0))}
    w = DiLoCoWorker(transport.open("w"), "w0", params, poll_interval=0.01, wait_timeout=30, claim=False)
    w.start()
    phase(params)
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


def _run_worker(cfg: dict, faults: str | None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("DILOCO_FAULTS", None)
    if faults:
        env["DILOCO_FAULTS"] = faults
    return subprocess.run([sys.executable, str(TESTS / "support" / "worker_crash_script.py"), json.dumps(cfg)],
                          capture_output=True, text=True, timeout=timeout, env=env)


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
    checkpoint (none at all, or one every 8 boundaries); its next life starts from step 0 with the same
    node id. A master applies everything meanwhile. Exactly the run's 40 inner steps must be applied:
    the replayed phases up to the hub's delta_3 are not sent again (48, 56 or 64 of 40 before).
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
    finally:
        m.stop()
    drain(m, hub)
    assert applied(m) == 10 * H, f"{applied(m)} of {10 * H} inner steps applied"
    assert m.ledger["w0"] == 10
