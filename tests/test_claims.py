"""Node claims: a worker claims its node id on the hub (nodes/<id>/claim.json, compare-and-swap) with a
heartbeat; a second live claimant refuses to start; a dead one's claim expires. Every transport: the
folder, the Hugging Face Hub (a loopback fake server) and S3 (moto's server on loopback)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from support.hf_server import FakeHubServer

from diloco_lightning.wire.delta import write_delta
from diloco_lightning.hub import ClaimConflictError, open_hub
from diloco_lightning.hub.local import FileHub
from diloco_lightning.master import MasterOuterLoop
from diloco_lightning.wire.claims import MAX_CLAIM_BYTES, ClaimError, NodeClaim
from diloco_lightning.worker import DiLoCoWorker, NodeIdTakenError
from diloco_lightning.worker.claim import ClaimKeeper

REPO = "org/claims"


@pytest.fixture(autouse=True)
def _online(monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False, raising=False)


@pytest.fixture(params=["file", "hf", "s3"])
def hubs(request, tmp_path):
    """A factory of hub handles onto one hub (each handle as another process would open it)."""
    if request.param == "file":
        yield lambda: FileHub(tmp_path / "hub")
        return
    if request.param == "s3":
        import boto3

        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = f"claims-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        n = [0]

        def make_s3():
            n[0] += 1
            return open_hub(f"s3://{bucket}/run", endpoint_url=endpoint, addressing_style="path",
                            cache_dir=tmp_path / f"s{n[0]}", max_retries=2, retry_base_delay=0.001,
                            retry_max_delay=0.01, check_conditional_writes=n[0] == 1)

        yield make_s3
        return
    with FakeHubServer() as server:
        n = [0]

        def make():
            n[0] += 1
            return open_hub(f"hf://{REPO}", endpoint=server.endpoint, token="hf_x", cache_dir=tmp_path / f"c{n[0]}",
                            max_retries=2, retry_base_delay=0.001, retry_max_delay=0.01, commits_per_hour=0)

        yield make


def _claim(node="w0", holder="h:1:a", epoch=1, t=1000.0, ttl=60.0, **info):
    return NodeClaim(node, holder, epoch, t, t, t + ttl, dict(info))


def test_write_claim_is_a_compare_and_swap(hubs):
    a, b = hubs(), hubs()
    assert a.read_claim("w0") is None
    first = _claim(holder="h:1:a")
    a.write_claim("w0", first, expected=None)
    with pytest.raises(ClaimConflictError):
        b.write_claim("w0", _claim(holder="h:2:b"), expected=None)  # lost the race
    assert b.read_claim("w0") == first
    renewed = _claim(holder="h:1:a", t=1030.0, steps_per_second=2.5)  # info travels with the heartbeat
    a.write_claim("w0", renewed, expected=first)
    assert b.read_claim("w0") == renewed and b.read_claim("w0").info == {"steps_per_second": 2.5}
    with pytest.raises(ClaimConflictError):
        b.write_claim("w0", None, expected=first)  # stale view
    a.write_claim("w0", None, expected=renewed)
    assert b.read_claim("w0") is None and b.read_claim("w1") is None


def test_listing_ignores_claims(hubs, tmp_path, caplog):
    hub = hubs()
    hub.write_claim("w0", _claim(), expected=None)
    src = tmp_path / "d.safetensors"
    write_delta(src, {"w": torch.ones(3)}, node_id="w0", local_step=1, base_outer_step=0)
    hub.upload_delta(src, "w0", 1)
    with caplog.at_level(logging.WARNING, logger="diloco_lightning"):
        refs = hub.list_deltas()
    assert [(r.node_id, r.local_step) for r in refs] == [("w0", 1)]
    assert "claim.json" not in caplog.text and "not a delta path" not in caplog.text


def test_claim_documents_are_untrusted():
    good = _claim().to_json()
    assert NodeClaim.from_json(good, node_id="w0") == _claim()
    doc = json.loads(good)
    doc["future_key"] = [1, 2]  # readers ignore what they do not know: the document can grow
    assert NodeClaim.from_json(json.dumps(doc), node_id="w0") == _claim()
    for bad, why in [
        (good.replace('"w0"', '"w1"'), "claims node 'w1'"),
        (good.replace('"epoch": 1', '"epoch": -1'), "epoch"),
        (good.replace('"epoch": 1', '"epoch": true'), "epoch"),
        (good.replace('"expires_at": 1060.0', '"expires_at": "soon"'), "numbers"),
        (good.replace('"info": {}', '"info": []'), "info"),
        ("{" * 10, "nested"),
        ("{" * 5, "JSON"),
        ('{"info": ' * 5000 + "1" + "}" * 5000, "nested more than 8 levels"),  # never a RecursionError
        (" " * (MAX_CLAIM_BYTES + 1), "more than the 65536 such a document may have"),
    ]:
        with pytest.raises(ClaimError, match=why):
            NodeClaim.from_json(bad, node_id="w0")


def test_an_unreadable_claim_counts_as_none(tmp_path):
    hub = FileHub(tmp_path / "hub")
    (tmp_path / "hub" / "nodes" / "w0").mkdir(parents=True)
    (tmp_path / "hub" / "nodes" / "w0" / "claim.json").write_bytes(b"\x00garbage")
    assert hub.read_claim("w0") is None
    keeper = ClaimKeeper(hub, "w0", ttl=60)
    keeper.acquire()  # replaces it
    assert hub.read_claim("w0").holder == keeper.holder
    keeper.release()
    assert not (tmp_path / "hub" / "nodes" / "w0" / "claim.json").exists()


def test_a_second_live_claimant_refuses_and_takes_over_after_release(hubs):
    first = ClaimKeeper(hubs(), "w3", ttl=60)
    first.acquire()
    second = ClaimKeeper(hubs(), "w3", ttl=60)
    with pytest.raises(NodeIdTakenError) as e:
        second.acquire()
    msg = str(e.value)
    assert "node_id 'w3' is already running" in msg and first.holder in msg and "give this worker another node_id" in msg
    first.release()
    second.acquire()
    claim = hubs().read_claim("w3")
    assert claim.holder == second.holder and claim.epoch == 1  # a released claim is gone: a fresh one
    second.release()


def test_a_dead_claim_expires_and_the_heartbeat_keeps_a_live_one(hubs):
    hub = hubs()
    # a claimant that stopped beating: its claim expired a second ago
    hub.write_claim("w0", _claim(holder="elsewhere:99:dead", t=time.time() - 61, ttl=60), expected=None)
    keeper = ClaimKeeper(hubs(), "w0", ttl=1.0)
    keeper.acquire()
    first = hubs().read_claim("w0")
    assert first.holder == keeper.holder and first.epoch == 2
    time.sleep(1.6)  # the heartbeat runs every ttl / 2
    later = hubs().read_claim("w0")
    assert later.renewed_at > first.renewed_at and later.expires_at > time.time()
    with pytest.raises(NodeIdTakenError):
        ClaimKeeper(hubs(), "w0", ttl=1.0).acquire()  # alive: refused even though ttl is short
    keeper.release()


def test_a_killed_process_on_this_host_is_taken_over_at_once(tmp_path):
    """kill -9 leaves a live-looking claim; a restart on the same host sees its pid is gone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    hub = FileHub(tmp_path / "hub")
    hub.write_claim("w0", _claim(holder=f"{socket.gethostname()}:{dead.pid}:x", t=time.time(), ttl=900), expected=None)
    keeper = ClaimKeeper(FileHub(tmp_path / "hub"), "w0")
    keeper.acquire()
    assert hub.read_claim("w0").holder == keeper.holder
    keeper.release()


def test_a_lost_claim_stops_the_worker(tmp_path):
    """Another process took the id over (this one's heartbeat had stopped for longer than its ttl, so
    its claim had expired): the next renewal notices, and the worker refuses to send under an id
    someone else runs. (A live claim overwritten is claimed back: tests/test_hostile_files.py.)"""
    hub = FileHub(tmp_path / "hub")
    now = [time.time()]
    keeper = ClaimKeeper(hub, "w0", ttl=60, clock=lambda: now[0])
    keeper.acquire()
    mine = hub.read_claim("w0")
    now[0] += 61  # the heartbeat failed for 61 s (an outage): the claim expired
    hub.write_claim("w0", _claim(holder="other:1:x", t=now[0]), expected=mine)
    assert keeper.renew() is False
    with pytest.raises(NodeIdTakenError, match="taken over .* by other:1:x"):
        keeper.check()
    keeper.release()
    assert hub.read_claim("w0").holder == "other:1:x"  # never removes someone else's claim


def test_two_workers_with_one_node_id_are_never_merged(tmp_path):
    """The reported bug: two workers started with node_id w0 were merged by the master. Now the second
    refuses to start, with a clear error, and the first keeps working."""
    root = tmp_path / "hub"
    params = {"w": torch.zeros(4)}
    master = MasterOuterLoop(FileHub(root), {"w": torch.zeros(4)}, node_state_dir=tmp_path / "m", poll_interval=0.01)
    master.sync_once()  # outer step 0
    a = DiLoCoWorker(FileHub(root), "w0", params, poll_interval=0.01, wait_timeout=10)
    a.start()
    b = DiLoCoWorker(FileHub(root), "w0", {"w": torch.zeros(4)}, poll_interval=0.01, wait_timeout=10)
    with pytest.raises(NodeIdTakenError, match="node_id 'w0' is already running"):
        b.start()
    b.close()
    assert FileHub(root).read_claim("w0").holder == a.heartbeat.keeper.holder  # b did not disturb a's claim
    params["w"] += 1.0
    a.boundary()
    assert a.flush(timeout=10)
    a.close()
    assert FileHub(root).read_claim("w0") is None  # released on a clean close
    c = DiLoCoWorker(FileHub(root), "w0", {"w": torch.zeros(4)}, poll_interval=0.01, wait_timeout=10)
    c.start()  # the id is free again
    c.close()


def test_list_claims_reads_every_claim_and_only_the_ones_that_changed(hubs, tmp_path):
    """The master's membership and DyLU workers list every claim each poll; on remote hubs a claim whose
    version token did not change is not downloaded again, and a released or unreadable one is left out."""
    a, b = hubs(), hubs()
    assert b.list_claims() == {}
    c0, c1 = _claim("w0", steps_per_second=1.0), _claim("w1", holder="h:2:b")
    a.write_claim("w0", c0, expected=None)
    a.write_claim("w1", c1, expected=None)
    reads: list[str] = []
    original = b.claims.read  # the transport's claims part: what list_claims reads each claim with
    b.claims.read = lambda node: (reads.append(node), original(node))[1]
    assert b.list_claims() == {"w0": c0, "w1": c1}
    first = sorted(reads)
    reads.clear()
    assert b.list_claims() == {"w0": c0, "w1": c1}
    renewed = _claim("w0", t=1030.0, step_rate=2.0)
    a.write_claim("w0", renewed, expected=c0)
    assert b.list_claims() == {"w0": renewed, "w1": c1}
    if not isinstance(b, FileHub):  # a remote hub: one listing, and only the changed claim read again
        assert first == ["w0", "w1"] and reads == ["w0"]
    a.write_claim("w1", None, expected=c1)
    assert b.list_claims() == {"w0": renewed}
    if isinstance(b, FileHub):  # an unreadable claim is left out, with a warning (the others still listed)
        (tmp_path / "hub" / "nodes" / "w2").mkdir()
        (tmp_path / "hub" / "nodes" / "w2" / "claim.json").write_bytes(b"{garbage")
        assert b.list_claims() == {"w0": renewed}
