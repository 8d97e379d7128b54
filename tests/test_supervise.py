"""Supervised workers (``supervise.*``, issue 38 item 2): ``train.py`` restarts a worker process that
crashed (here: a real ``kill -9``), from its checkpoint, with back-off, one line per restart, and the
run finishes with its results; a worker that ended with a user error is never restarted."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco_lightning.app.supervise import EXIT_CONFIG, EXIT_HUB_AWAY, EXIT_USER, Restarts, SuperviseOptions
from diloco_lightning.util.options import OptionError

from support.env import repo_env

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["data.max_bytes=300000", "data.seq_len=32", "data.vocab_size=512", "launch.eval_points=0"]


def test_the_restart_policy_backs_off_is_bounded_and_never_retries_a_user_error():
    p = Restarts(SuperviseOptions(restarts=3, backoff=1.0, max_backoff=3.0, reset_after=600.0), "worker w1")
    assert p.decide(EXIT_CONFIG) is None and p.decide(EXIT_USER) is None and p.decide(0) is None
    assert [p.decide(-9), p.decide(1), p.decide(EXIT_HUB_AWAY)] == [1.0, 2.0, 3.0]
    assert p.decide(-9) is None and "supervise.restarts=3" in p.spent(-9)
    assert "was killed by SIGKILL" in p.line(-9, 1.0) and "restart 3 of 3" in p.line(-9, 1.0)
    q = Restarts(SuperviseOptions(restarts=1, backoff=0.5, max_backoff=1.0, reset_after=0.0), "worker w0")
    assert q.decide(-9) == 0.5 and q.decide(-9) == 0.5  # ran reset_after (0 s) since its start: counted afresh
    assert Restarts(SuperviseOptions(restarts=0), "w").decide(-9) is None
    with pytest.raises(OptionError, match="max_backoff"):
        SuperviseOptions(backoff=5.0, max_backoff=1.0).validate()


def test_supervise_keys_leave_the_run_id_alone():
    """``supervise.*`` says how a run is kept alive, not what it trains: the same command with another value
    resumes the same run folder."""
    from diloco_lightning.app.config import run_id_from_overrides

    assert run_id_from_overrides(["recipe=tiny", "supervise.restarts=0"]) == run_id_from_overrides(["recipe=tiny"])


def test_a_bad_supervise_value_is_one_line_naming_the_key(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "recipe=tiny", "supervise.restarts=-1",
                           f"run_root={tmp_path / 'runs'}"], cwd=tmp_path, env=repo_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("train.py: error: supervise.restarts"), lines


def _timeline_pids(path: Path, name: str) -> list[int]:
    text = path.read_text() if path.exists() else ""
    return [int(line.split()[1]) for line in text.splitlines() if line.split()[2] == name]


@pytest.mark.slow  # a whole run's processes, and a restart
@pytest.mark.parametrize("spare", ["cold", "warm"])
def test_a_worker_killed_with_sigkill_is_restarted_and_the_run_finishes(tmp_path, spare):
    """role=all: worker w1 killed with SIGKILL is restarted and the run ends with every step applied;
    ``warm``: its warm spare (``supervise.spare_after=0``) is the restarted worker."""
    import psutil

    from diloco_lightning.util.timeline import ENV

    timeline = tmp_path / "timeline.txt"
    cmd = [sys.executable, str(ROOT / "train.py"), "recipe=tiny", "trainer.max_steps=64", *SMALL,
           "supervise.backoff=0.5", f"run_root={tmp_path / 'runs'}",
           *(["supervise.spare=false"] if spare == "cold" else ["supervise.spare_after=0"])]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**repo_env(tmp_path), ENV: str(timeline)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            out.append(line)
            if not line or line.startswith("[master] outer_step 1 "):
                break
        children = psutil.Process(proc.pid).children()
        (victim,) = [p for p in children if p.cmdline()[-2:] == ["--node-index", "1"]]
        spares = [p for p in children if p.cmdline()[-3:] == ["--node-index", "1", "--spare"]]
        assert len(spares) == (1 if spare == "warm" else 0), [p.cmdline() for p in children]
        while spare == "warm" and spares[0].pid not in _timeline_pids(timeline, "spare_ready") and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        victim.kill()
        rest, err = proc.communicate(timeout=400)
        out.append(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout = "".join(out)
    assert proc.returncode == 0, (stdout[-3000:], err[-3000:])
    restarts = [line for line in stdout.splitlines() if line.startswith("[supervise]")]
    assert len(restarts) == 1 and restarts[0].startswith("[supervise] worker w1 was killed by SIGKILL"), restarts
    assert "restarting it in 0.5 s from its checkpoint (restart 1 of 3" in restarts[0]
    run = next((tmp_path / "runs").iterdir())
    results = json.loads((run / "results.json").read_text())
    assert results["outer_steps"] == 64 // 8 and results["deltas_rejected"] == 0
    assert {s["node_id"]: s["steps"] for s in results["workers_summary"]} == {"w0": 64, "w1": 64}
    log = (run / "nodes" / "w1" / "worker.log").read_text()
    assert restarts[0] in log
    if spare == "warm":
        assert _timeline_pids(timeline, "go") == [spares[0].pid]  # the spare became w1
    time.sleep(0.5)
    assert not [p for p in psutil.process_iter(["cmdline"]) if "--spare" in (p.info["cmdline"] or [])
                and str(tmp_path) in " ".join(p.info["cmdline"] or [])]  # no spare left behind


@pytest.mark.slow  # a command and its worker process
def test_a_supervised_worker_with_a_user_error_is_not_restarted(tmp_path):
    """``train.py role=worker`` runs its worker as a child it supervises; a hub whose run holds another model
    is the user's to fix (a mismatch no restart changes): the worker's one line, no restart, status 1."""
    import torch

    from diloco_lightning.hub.local import FileHub
    from diloco_lightning.master import MasterOuterLoop

    other = MasterOuterLoop(FileHub(tmp_path / "hub"), {"w": torch.zeros(2)}, node_state_dir=tmp_path / "m", lease=False)
    assert other.sync_once()
    cmd = [sys.executable, str(ROOT / "train.py"), "recipe=tiny", "role=worker", f"hub.url={tmp_path / 'hub'}", *SMALL,
           f"run_root={tmp_path / 'runs'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=repo_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("worker w0: error: the global on ") and "the hub holds another model" in last, last
    assert "[supervise]" not in proc.stderr + proc.stdout and "Traceback" not in proc.stderr
    assert proc.stderr.count("worker w0: error:") == 1


@pytest.mark.slow  # a master, a worker command and its worker process, and a restart
@pytest.mark.parametrize("spare", ["cold", "warm"])
def test_a_supervised_role_worker_survives_a_kill9_of_its_worker_process(tmp_path, spare):
    """``train.py role=worker`` against a ``diloco-master``: its worker process is killed with SIGKILL after
    its first checkpoint; the command restarts it, and it trains to ``trainer.max_steps``, every phase
    applied by the master. ``cold``: a fresh process (``supervise.spare=false``); ``warm``: the warm spare,
    started at once (``supervise.spare_after=0``), is the restarted worker (its imports done before the
    kill: the timeline's ``go`` is its), and no spare outlives the command."""
    import psutil

    from diloco_lightning.util.timeline import ENV

    hub = tmp_path / "hub"
    env = repo_env(tmp_path)
    timeline = tmp_path / "timeline.txt"
    env[ENV] = str(timeline)
    master = subprocess.Popen([sys.executable, "-m", "diloco_lightning.app.master", f"hub.url={hub}", "hub.create=true",
                               "min_deltas=1", "until_finished=true", "expected_nodes=1", "poll_interval=0.2",
                               f"node_state_dir={tmp_path / 'master'}"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cmd = [sys.executable, str(ROOT / "train.py"), "recipe=tiny", "role=worker", "workers=1", f"hub.url={hub}",
           "hub.create=true", "trainer.max_steps=32", *SMALL, "supervise.backoff=0.2", "run_id=x", f"run_root={tmp_path / 'runs'}",
           *(["supervise.spare=false"] if spare == "cold" else ["supervise.spare_after=0"])]
    worker = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    spares: list = []
    try:
        ckpt = tmp_path / "runs" / "x" / "nodes" / "w0" / "checkpoints" / "last.ckpt"
        deadline = time.monotonic() + 300

        def marks(name: str) -> list[int]:
            text = timeline.read_text() if timeline.exists() else ""
            return [int(line.split()[1]) for line in text.splitlines() if line.split()[2] == name]

        while (not ckpt.exists() or (spare == "warm" and not marks("spare_ready"))) and time.monotonic() < deadline \
                and worker.poll() is None:
            time.sleep(0.1)
        assert worker.poll() is None, worker.communicate()[0][-4000:]
        children = psutil.Process(worker.pid).children()
        (child,) = [c for c in children if "--spare" not in c.cmdline()]
        spares = [c for c in children if "--spare" in c.cmdline()]
        assert child.cmdline()[-2:] == ["--node-index", "0"]
        assert len(spares) == (1 if spare == "warm" else 0), [c.cmdline() for c in children]
        child.kill()
        out, _ = worker.communicate(timeout=400)
        assert worker.returncode == 0, out[-4000:]
        master_out, _ = master.communicate(timeout=120)
    finally:
        for p in (worker, master):
            if p.poll() is None:
                p.kill()
    restarts = [line for line in out.splitlines() if line.startswith("[supervise]")]
    assert len(restarts) == 1 and restarts[0].startswith("[supervise] worker w0 was killed by SIGKILL"), restarts
    summary = json.loads((tmp_path / "runs" / "x" / "nodes" / "w0" / "summary.json").read_text())
    assert summary["steps"] == 32 and summary["launch"]["from_step"] >= 8  # resumed from its checkpoint
    if spare == "warm":
        assert marks("go") == [spares[0].pid]  # the spare became the worker: no second start-up paid
        assert spares[0].pid in marks("first_step")
    time.sleep(0.5)
    assert not [p for p in psutil.process_iter(["cmdline"]) if "--spare" in (p.info["cmdline"] or [])
                and str(tmp_path) in " ".join(p.info["cmdline"] or [])]  # no spare left behind
    from diloco_lightning.hub.local import FileHub

    manifest = FileHub(hub, cache_dir=tmp_path / "c").read_manifest()
    assert manifest.ledger == {"w0": 4}, manifest.ledger  # the 4th phase of 32 / 8 is the last applied
    rounds = [json.loads(line) for line in (tmp_path / "master" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["accepted"] for r in rounds) == 4 and sum(r["rejected"] for r in rounds) == 0  # each phase once
    assert master.returncode == 0, master_out[-3000:]


@pytest.mark.slow  # an S3 server, a master, a worker command, its worker process and its restarts
def test_a_supervised_worker_outlives_a_hub_outage_at_its_start(tmp_path, s3_endpoint, s3_bucket, s3_proxy):
    """The store is unreachable when ``train.py role=worker`` starts (an outage: the proxy cuts every
    connection): the worker process gives up on the hub (status 75) and is restarted with back-off until
    the store is back; then it trains to the end, every phase applied by the master."""
    url = f"s3://{s3_bucket}/run"
    hub_args = [f"hub.url={url}", f"hub.endpoint_url={s3_proxy.endpoint}", "hub.addressing_style=path"]
    env = repo_env(tmp_path)
    s3_proxy.down = True
    cmd = [sys.executable, str(ROOT / "train.py"), "recipe=tiny", "role=worker", "workers=1", "hub=s3", *hub_args,
           "trainer.max_steps=16", *SMALL, "supervise.backoff=0.2", "supervise.max_backoff=1", "supervise.restarts=20",
           "run_id=x", f"run_root={tmp_path / 'runs'}"]
    worker = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    master = None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = worker.stdout.readline()
            lines.append(line)
            if not line or line.startswith("[supervise] worker w0 exited with status 75"):
                break
        assert lines and lines[-1].startswith("[supervise] worker w0 exited with status 75"), "".join(lines)[-4000:]
        s3_proxy.down = False
        master = subprocess.Popen([sys.executable, "-m", "diloco_lightning.app.master", *hub_args, "min_deltas=1",
                                   "until_finished=true", "expected_nodes=1", "poll_interval=0.2",
                                   f"node_state_dir={tmp_path / 'master'}", f"hub.cache_dir={tmp_path / 'mc'}"],
                                  cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = worker.communicate(timeout=400)
        lines.append(out)
        assert worker.returncode == 0, "".join(lines)[-4000:]
        master_out, _ = master.communicate(timeout=120)
        assert master.returncode == 0, master_out[-3000:]
    finally:
        s3_proxy.down = False
        for p in (worker, master):
            if p is not None and p.poll() is None:
                p.kill()
    rounds = [json.loads(line) for line in (tmp_path / "master" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["accepted"] for r in rounds) == 2 and sum(r["rejected"] for r in rounds) == 0
