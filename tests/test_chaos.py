"""The chaos benchmark's short run (benchmarks/chaos.py): a real master and two real Lightning workers
under a seeded monkey that kill -9s one of them every 10-20 s for two minutes (a worker once it has trained
5 s, so that its kills land in training rather than in Lightning's start-up) and restarts it (on S3 also
with 2 % of the store's requests failed and outages); nothing may be lost or applied twice.
About four minutes a run on a loaded 2-core machine (start-ups are slow): CI's slow run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "file": [],
    "s3": ["--fault-rate", "0.02", "--outage-every", "30", "--outage-seconds", "8"],
}


@pytest.mark.slow
@pytest.mark.parametrize("transport", list(CASES))
def test_a_short_chaos_run_loses_nothing_and_duplicates_nothing(tmp_path, transport):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--transport", transport, "--workers", "2",
           "--seconds", "120", "--steps", "240", "--inner-steps", "4", "--throttle", "0.2", "--kill-every", "10,20",
           "--settle", "5", "--seed", "1", "--drain-timeout", "300", "--out", str(out), *CASES[transport]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.exists(), proc.stderr[-3000:]
    res = json.loads(out.read_text())[-1]
    assert not res.get("timed_out"), res
    assert sum(res["kills"].values()) >= 3, res  # the monkey did kill
    assert res["lost"] == 0 and res["duplicated"] == 0 and res["all_elements_equal"], res
    assert res["applied_steps"] == 2 * 240 and sorted(res["ledger"]) == ["w0", "w1"], res
    # the timeline: every life of every process, each worker life's steps in order, the losses accounted for
    lives = [r for r in res["timeline"] if r["who"] != "master"]
    assert len(lives) == sum(n for who, n in res["lives"].items() if who != "master"), res["timeline"]
    assert sum(r.get("steps", 0) for r in lives) == res["executed_steps"], res["timeline"]
    assert all(r["start"] <= r.get("first", r["end"]) <= r.get("last", r["end"]) <= r["end"] for r in lives), lives
    assert set(res["losses_s"]) == {"startup", "stalls", "replays", "tail"}, res["losses_s"]
    print(proc.stdout.strip())  # the run's figures (pytest -s shows them)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
