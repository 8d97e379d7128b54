"""Waiting is never silent and never deaf: a line at growing intervals (what, on which hub, for how
long), and SIGTERM stops a plugin worker and a master cleanly (real subprocesses, real signals)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from diloco_lightning import DiLoCo
from diloco_lightning.hub.local import FileHub
from diloco_lightning.master import MasterOuterLoop
from diloco_lightning.util.waiting import Patience, format_duration

ROOT = Path(__file__).resolve().parents[1]


def test_patience_speaks_at_growing_intervals():
    now = [0.0]
    lines: list[str] = []
    p = Patience("global version 3", "file:///hub", say=lines.append, first=10, cap=600, limit=1200, clock=lambda: now[0])
    spoke_at = []
    for t in range(0, 3000):
        now[0] = float(t)
        if p.tick("; the hub has 2"):
            spoke_at.append(t)
    assert spoke_at == [10, 20, 40, 80, 160, 320, 640, 1240, 1840, 2440]  # doubling, then every 10 minutes
    assert lines[0] == ("still waiting for global version 3 on file:///hub: 10 s so far; the hub has 2 "
                        "(gives up after 20 min)")
    assert format_duration(3725) == "1 h 02 min" and format_duration(125) == "2 min 05 s"


def _popen(args: list[str], cwd: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read_until(proc: subprocess.Popen, needle: str, timeout: float = 120) -> str:
    out = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out.append(line)
        if needle in line:
            return "".join(out)
    raise AssertionError(f"{needle!r} never came:\n{''.join(out)[-3000:]}")


ACCELERATE_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from accelerate import Accelerator
    from diloco_lightning.adapters.accelerate import DiLoCo

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    with DiLoCo(accelerator, model, hub=sys.argv[1], node_id="w0", inner_steps=4, poll_interval=0.1) as diloco:
        for _ in range(40):
            optimizer.step()
            diloco.step()
    print("loop returned")
""")

PLUGIN_SCRIPT = textwrap.dedent("""
    import sys
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel
    from diloco_lightning import DiLoCo

    trainer = L.Trainer(max_steps=40, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[DiLoCo(hub=sys.argv[1], node_id="w0", inner_steps=4, poll_interval=0.1)])
    trainer.fit(BoringModel())
    print("fit returned")
""")


@pytest.mark.parametrize("script", ["lightning", "accelerate"])
def test_a_plugin_worker_without_a_master_says_so_and_stops_on_sigterm(tmp_path, script):
    """The reported bug: a worker with no master waited 20 minutes silently and ignored SIGTERM. Now it
    says at once what it waits for and where (no logging configured by the script), and SIGTERM ends it
    in seconds with status 143, its initial weights offered and its node claim released."""
    hub = tmp_path / "hub"
    hub.mkdir()
    path = tmp_path / "worker.py"
    path.write_text(PLUGIN_SCRIPT if script == "lightning" else ACCELERATE_SCRIPT)
    proc = _popen([sys.executable, str(path), str(hub)], tmp_path)
    try:
        out = _read_until(proc, "waiting for a master to publish outer step 0")
        assert f"on file://{hub}" in out and "offered nodes/w0/init.safetensors" in out
        assert (hub / "nodes" / "w0" / "claim.json").is_file()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        stopped_in = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, rest[-3000:]
    assert stopped_in < 30, stopped_in
    assert "stopped while waiting for a master to publish outer step 0" in rest and "exiting with status 143" in rest
    assert "returned" not in rest and "Traceback" not in rest, rest[-3000:]
    assert (hub / "nodes" / "w0" / "init.safetensors").is_file()
    assert not (hub / "nodes" / "w0" / "claim.json").exists()


def test_a_master_on_an_empty_hub_says_so_and_stops_on_sigterm(tmp_path):
    hub = tmp_path / "hub"
    hub.mkdir()
    proc = _popen([sys.executable, "-m", "diloco_lightning.app.master", f"hub.url={hub}", "poll_interval=0.1",
                   "lease_ttl=30"], tmp_path)
    try:
        out = _read_until(proc, "[master] waiting for a worker's initial weights")
        assert f"on {hub}" in out.splitlines()[-1] and f"local state in {tmp_path / 'hub-master'}" in out
        assert FileHub(hub).read_lease() is not None
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, rest[-3000:]
    assert "[master] stopped at outer_step 0" in rest and "Traceback" not in rest
    assert FileHub(hub).read_lease() is None  # released: another master can take over at once


def test_the_plugin_shows_syncs_in_the_progress_bar_and_a_line_per_sync(tmp_path, caplog):
    root = tmp_path / "hub"
    FileHub(root)
    master = MasterOuterLoop(FileHub(root), None, node_state_dir=tmp_path / "m", poll_interval=0.02, norm_ratio=None)
    master.start()
    try:
        cbs = {}
        for verbose in (True, False):
            caplog.clear()
            cb = DiLoCo(hub=str(root), node_id=f"v{int(verbose)}", inner_steps=4, poll_interval=0.02, wait_timeout=30,
                        verbose=verbose, sync="lockstep")
            trainer = L.Trainer(max_steps=12, accelerator="cpu", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                                callbacks=[cb])
            with caplog.at_level(logging.INFO, logger="diloco_lightning"):
                trainer.fit(BoringModel())
            cbs[verbose] = (trainer.progress_bar_metrics, [r.getMessage() for r in caplog.records
                                                           if r.getMessage().startswith("DiLoCo ")])
    finally:
        master.stop()
    bar, lines = cbs[True]
    assert {"outer_step", "stale", "sent_MB"} <= set(bar), bar  # short: a progress bar cuts its line
    assert bar["outer_step"] >= 1 and bar["sent_MB"] > 0
    assert len(lines) == 3, lines  # one per sync (steps 4, 8, 12)
    assert lines[0].startswith("DiLoCo v1 | step 4 | sync 1 | outer_step ") and "sent " in lines[0] and " in all)" in lines[0]
    bar, lines = cbs[False]
    assert "outer_step" in bar and lines == []  # quiet, the progress bar still has the numbers
