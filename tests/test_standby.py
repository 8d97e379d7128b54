"""A warm standby master (``warm_standby``, issue 38 item 3): while another master holds the lease it keeps
the newest published version loaded (weights, optimizer state, ledger); when the holder dies it takes
the lease within one lease period (plus a poll) and its first round publishes without loading anything,
continuing the ledger exactly (bit-exact against an uninterrupted master: no delta lost or applied twice,
the momentum carried over)."""

from __future__ import annotations

import time

import pytest
import torch

from diloco_lightning.hub.local import FileHub
from diloco_lightning.master import MasterOuterLoop

from support.handover import NESTEROV, _put, deltas_of, handover, reference_state, took_over_line
from support.master_crash_script import initial_state

pytestmark = pytest.mark.usefixtures("one_thread")


def _standby_pair(tmp_path, **options):
    hub = FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache_a")
    a = MasterOuterLoop(hub, initial_state(0), node_state_dir=tmp_path / "a", holder="A", lease_ttl=0.5,
                        poll_interval=0.02, **NESTEROV)
    b = MasterOuterLoop(FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache_b"), None, node_state_dir=tmp_path / "b",
                        holder="B", lease_ttl=0.5, poll_interval=0.02, **NESTEROV, **options)
    return hub, a, b


def test_a_standby_follows_the_published_versions_and_takes_over_warm(tmp_path):
    hub, a, b = _standby_pair(tmp_path)
    deltas = deltas_of(3, 2)
    a.sync_once()
    for i, (node, step) in enumerate(deltas[:3]):
        _put(hub, tmp_path / "w", i, node, step)
        a.sync_once()
        b.sync_once()
        m = b.last_metrics
        assert m["standby"] and m["warm"] == i + 1 and m["published"] == 0
        assert b.outer_step == a.outer_step and b.ledger == a.ledger
    # the optimizer state is loaded too: B's momentum is A's
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa if isinstance(sa[k], torch.Tensor))
    # A dies without releasing its lease: B takes over once it expires, adopting nothing
    for i, (node, step) in enumerate(deltas[3:], start=3):
        _put(hub, tmp_path / "w", i, node, step)
    deadline = time.monotonic() + 5
    while not b.sync_once() and time.monotonic() < deadline:
        time.sleep(0.02)
    m = b.last_metrics
    assert m["took_over"] == 2 and m["adopted"] is None and m["published"] >= 1
    while b.sync_once():
        pass
    ref_step, ref = reference_state(tmp_path, deltas)
    step, state = b.snapshot()
    assert step == ref_step == len(deltas)
    assert b.ledger == {"a": 1, "b": 1, "c": 0}
    for k, v in ref.items():
        assert torch.equal(state[k], v), k


def test_a_cold_standby_loads_the_version_at_takeover(tmp_path):
    hub, a, b = _standby_pair(tmp_path, warm_standby=False)
    a.sync_once()
    _put(hub, tmp_path / "w", 0, "a", 0)
    a.sync_once()
    b.sync_once()
    assert b.last_metrics["standby"] and b.last_metrics["warm"] is None and not b.has_state
    _put(hub, tmp_path / "w", 1, "b", 0)
    deadline = time.monotonic() + 5
    while not b.sync_once() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert b.last_metrics["adopted"] == 1 and b.outer_step == 2


@pytest.mark.slow
def test_kill9_of_the_lease_holder_hands_over_within_one_lease_period(tmp_path):
    """Two ``diloco-master`` processes; the holder is killed with SIGKILL as a delta arrives: the standby
    publishes it within ``lease_ttl + poll_interval`` (plus a second for a loaded machine), its state
    warm, and the run ends bit-exact with an uninterrupted master's."""
    h = handover(tmp_path / "run", lease_ttl=2.0, poll_interval=0.1, before=3, after=2)
    assert h.seconds <= h.lease_ttl + h.poll_interval + 1.0, h.seconds
    line = took_over_line(h.standby_log)
    assert line is not None and "state held warm" in line, h.standby_log[-3000:]
    assert h.holder == "B" and h.outer_step == len(h.deltas) == 5
    assert h.ledger == {"a": 1, "b": 1, "c": 0}
    _, ref = reference_state(tmp_path / "ref", h.deltas)
    for k, v in ref.items():
        assert torch.equal(h.state[k], v), k
