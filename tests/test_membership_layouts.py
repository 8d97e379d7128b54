"""Membership, a fractional quorum, the adaptive deadline and Dynamic Local Updates on every layout.

The rules themselves are tested exactly in ``tests/test_membership.py`` (on a folder hub); here the
same master and workers run on each transport (``tests/support/transports.py``: the folder, one Hugging Face
repository, a repository per node, S3), because each finds the claims its own way. On the per-node
layout the master once saw no claims at all: ``min_deltas=1.0`` became 1 (a round of 1 of 3
deltas) and DyLU lost its peers' speeds.
"""

from __future__ import annotations

import time

import torch

from diloco_lightning.master import MasterOuterLoop
from diloco_lightning.wire.claims import default_claim_ttl
from diloco_lightning.worker import DiLoCoWorker
from diloco_lightning.worker.pacing import Pacing


def _worker(transport, node: str, **kw) -> tuple[DiLoCoWorker, dict]:
    params = {"w": torch.nn.Parameter(torch.zeros(4))}
    w = DiLoCoWorker(transport.open(node), node, params, poll_interval=0.01, wait_timeout=30, claim_ttl=120, **kw)
    w.start()
    return w, params


def _deliver(w: DiLoCoWorker, params: dict) -> None:
    with torch.no_grad():
        params["w"].add_(1.0)
    w.boundary()
    assert w.flush(timeout=30)


def test_fractional_quorum_deadline_and_dylu_follow_the_claims(transport, tmp_path):
    hub = transport.open("m")
    m = MasterOuterLoop(hub, {"w": torch.zeros(4)}, node_state_dir=tmp_path / "m", poll_interval=0.01, min_deltas=1.0,
                        max_wait="auto", outer_lr=1.0, outer_momentum=0.0, norm_ratio=None, lease_ttl=30)
    assert m.sync_once()
    fast = Pacing("auto", dylu_steps=16)
    a, pa = _worker(transport, "a", pacing=fast)
    b, pb = _worker(transport, "b")
    c, pc = _worker(transport, "c")
    for w, rate in ((b, 8.0), (c, 4.0)):  # what their heartbeats report
        w.heartbeat.keeper.set_info({"step_rate": rate, "inner_steps": 16})
        assert w.heartbeat.keeper.renew()

    # DyLU: a reads its peers' speeds from their claims, on this layout
    a.heartbeat.keeper._read_peers()
    reports = a.heartbeat.keeper.peer_reports()
    assert {n: r.step_rate for n, r in reports.items()} == {"b": 8.0, "c": 4.0}

    # membership and the fractional quorum: 3 live nodes, a round waits for all 3
    _deliver(a, pa)
    _deliver(b, pb)
    m.membership.refresh(force=True)
    m.sync_once()
    got = m.last_metrics
    assert got["waiting"] and (got["live_nodes"], got["quorum"]) == (3, 3) and m.outer_step == 0
    # the adaptive deadline: no offsets known yet, so the cap: the claims' ttl (120 s), at most the master's
    # own bound on this transport (60 s on a folder hub, 900 s elsewhere)
    assert got["deadline"] == min(120.0, default_claim_ttl(hub))
    _deliver(c, pc)
    assert m.sync_once() and m.outer_step == 1
    assert sorted(m.last_metrics["applied"]) == ["a/1", "b/1", "c/1"]

    # a node that ends cleanly leaves at once: the quorum follows
    c.close()
    m.membership._read_at = None
    _deliver(a, pa)
    _deliver(b, pb)
    deadline = time.monotonic() + 10
    while m.outer_step < 2 and time.monotonic() < deadline:
        m.membership._read_at = None
        m.sync_once()
    assert m.outer_step == 2 and m.last_metrics["quorum"] == 2
    for w in (a, b):
        w.close()
    m.close()
