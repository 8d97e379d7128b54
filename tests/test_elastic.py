"""Elastic membership with real processes: a worker killed with ``kill -9`` mid-run, another
started later, one stopped cleanly (SIGTERM), on the folder hub, the loopback Hugging Face Hub
and S3 (moto on loopback). The master's quorum is every live node (``min_deltas=1.0``) with the
adaptive deadline: the run goes on, the quorum follows the live workers, and every delivered step
is applied exactly once.

The workers are ``tests/support/worker_crash_script.py``: a Lightning ``Trainer`` whose one parameter
vector grows by exactly 1 per optimizer step, so with ``arrival`` aggregation and an outer
SGD of lr 1 the global ends at ``10 + H * sum(ledger)``, bit for bit, whatever the staleness:
a delta applied twice or lost (below the ledger) would show.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from diloco_lightning.hub import open_hub
from diloco_lightning.hub.local import FileHub
from diloco_lightning.master import MasterOuterLoop

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
H = 4
REPO = "org/elastic"
TOKEN = "hf_elasticTESTtoken0123456789"


class Run:
    """One hub (folder, loopback HF or S3), its URL and the options a worker process opens it with."""

    def __init__(self, kind: str, tmp: Path, request) -> None:
        self.kind, self.tmp = kind, tmp
        if kind == "file":
            self.url, self.options = (tmp / "hub").as_uri(), {}
            self.open = lambda: FileHub(tmp / "hub")
        elif kind == "hf":
            server = request.getfixturevalue("hf_server")
            self.url = f"hf://{REPO}"
            # no commit budget on the loopback Hub: heartbeats every second and one publication per delta
            # are far beyond the real Hub's 128 commits an hour (tests/test_hub_pacing.py tests the budget)
            self.options = {"endpoint": server.endpoint, "token": TOKEN, "cache_dir": str(tmp / "wcache"), "create": True,
                            "commits_per_hour": 0}
            self.open = lambda: open_hub(self.url, endpoint=server.endpoint, token=TOKEN, cache_dir=tmp / "mcache",
                                         create=True, commits_per_hour=0)
        else:
            import boto3

            endpoint = request.getfixturevalue("s3_endpoint")
            bucket = f"elastic-{uuid.uuid4().hex[:12]}"
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
            self.url = f"s3://{bucket}/run"
            self.options = {"endpoint_url": endpoint, "addressing_style": "path", "cache_dir": str(tmp / "wcache")}
            self.open = lambda: open_hub(self.url, endpoint_url=endpoint, addressing_style="path", cache_dir=tmp / "mcache")

    def worker(self, node: str, max_steps: int) -> subprocess.Popen:
        cfg = dict(hub=self.url, hub_options=self.options, ckpt_dir=str(self.tmp / f"ckpt-{node}"), max_steps=max_steps,
                   inner_steps=H, node_id=node, throttle=0.05, claim_ttl=2.0)
        env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_DISABLE_TELEMETRY="1")
        env.pop("DILOCO_FAULTS", None)
        out = open(self.tmp / f"{node}.out", "w")  # files, not pipes: a chatty worker never blocks on a full pipe
        err = open(self.tmp / f"{node}.err", "w")
        with out, err:
            return subprocess.Popen([sys.executable, str(TESTS / "support" / "worker_crash_script.py"), json.dumps(cfg)],
                                    stdout=out, stderr=err, text=True, env=env)

    def log(self, node: str, stream: str = "err") -> str:
        return (self.tmp / f"{node}.{stream}").read_text(errors="replace")


def _until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _elastic_run(run: Run, tmp_path: Path) -> None:
    rounds: list[dict] = []
    master = MasterOuterLoop(
        run.open(), {"p": torch.full((8,), 10.0)}, node_state_dir=tmp_path / "master", outer_lr=1.0, outer_momentum=0.0,
        aggregation="arrival", min_deltas=1.0, max_wait="auto", poll_interval=0.05, lease_ttl=30, logger=rounds.append,
    )
    master.sync_once()  # outer step 0
    master.start()
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["w0"] = run.worker("w0", 100_000)  # runs until stopped (SIGTERM)
        procs["w1"] = run.worker("w1", 100_000)  # killed with kill -9
        _until(lambda: any(r.get("live_nodes") == 2 and r.get("quorum") == 2 for r in rounds)
               and master.ledger.get("w1", 0) >= 2, 120, "w0 and w1 both live, w1 with 2 deltas applied")
        procs["w1"].send_signal(signal.SIGKILL)
        assert procs["w1"].wait(30) == -9
        killed_at = len(rounds)
        # w1's claim stays on the hub, its heartbeat stopped: it leaves the quorum after its ttl (2 s)
        # and w0 goes on alone with a quorum of 1 (its deltas meanwhile waited, or went by the deadline)
        _until(lambda: any(r.get("live_nodes") == 1 and r.get("quorum") == 1 for r in rounds[killed_at:]), 180,
               "the quorum to drop to w0 alone")  # generous: a round on S3 takes seconds, more on a loaded machine
        joined_at = master.outer_step
        procs["w2"] = run.worker("w2", 100_000)  # a new node joins the running run; stopped with SIGTERM
        # a round logs after its publication moved the ledger, and a round on S3 takes seconds: wait for the
        # round itself, with w2 live beside w0 (w2 runs until stopped, so the check does not race its end)
        _until(lambda: any(r.get("live_nodes") == 2 and r.get("quorum") == 2
                           and sum(a.startswith("w2/") for a in r.get("applied", [])) >= 1 for r in rounds[killed_at:])
               and master.ledger.get("w2", 0) >= 2, 180, "the quorum to grow back to w0 and w2, with w2's deltas applied")
        for node in ("w2", "w0"):  # clean stops: each uploads what is pending and releases its claim
            procs[node].send_signal(signal.SIGTERM)
            assert procs[node].wait(60) == 143, run.log(node)[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        master.stop()
    started = [int(line.split()[1]) for line in run.log("w2", "out").splitlines() if line.startswith("started ")]
    assert started and started[0] >= joined_at  # the newcomer started from the newest global, not version 0
    hub = run.open()
    for _ in range(100):  # whatever is still on the hub (w1's last deltas, w0's final flush)
        master.sync_once(force=True)
        if not hub.list_deltas(after=master.ledger):
            break
    ledger = master.ledger
    assert ledger["w2"] >= 2 and ledger["w1"] >= 2 and ledger["w0"] >= 2
    applied = [a for r in rounds for a in r.get("applied", [])]
    assert len(applied) == len(set(applied)), "a delta was applied twice"
    # exactly once: every step any worker delivered, and nothing else, is in the global
    expected = 10.0 + H * sum(ledger.values())
    assert torch.equal(master.snapshot()[1]["p"], torch.full((8,), expected)), (master.snapshot()[1]["p"], ledger)
    assert hub.list_deltas() == []  # nothing left behind
    master.close()


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_kill_join_and_leave_on_a_folder_hub(tmp_path):
    _elastic_run(Run("file", tmp_path, None), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hf", "s3"])
def test_kill_join_and_leave_on_remote_hubs(tmp_path, request, kind):
    _elastic_run(Run(kind, tmp_path, request), tmp_path)
