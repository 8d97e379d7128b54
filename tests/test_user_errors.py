"""User errors that ended in tracebacks or false results: each now ends in one or two lines naming the
fix, or is refused where it is given; and every JSON file the product writes is valid JSON.

The command-line cases run ``diloco-master`` / ``train.py`` as real subprocesses (as a user types them);
the library cases call what a user's code calls.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from diloco_lightning.hub.local import FileHub
from diloco_lightning.master import MasterOuterLoop
from diloco_lightning.master.config import MasterConfig
from diloco_lightning.master.lease import StandbyError
from diloco_lightning.master.metrics import MetricsSink, RoundMetrics
from diloco_lightning.master.serve import serve
from diloco_lightning.util.jsondoc import dumps_json
from diloco_lightning.util.options import OptionError

ROOT = Path(__file__).resolve().parents[1]


def _master(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), DILOCO_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "diloco_lightning.app.master", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _two_lines(proc: subprocess.CompletedProcess, key: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr[-3000:])
    assert 1 <= len(lines) <= 2 and lines[0].startswith(f"diloco-master: error: {key}"), lines
    return lines[0]


@pytest.mark.parametrize("args, key, says", [
    (["outer=cgad", "outer.options.tau_cut=-1"], "outer.options", "tau_cut must be"),  # 63 lines of traceback before
    (["outer=cgad", "outer.options.betas=[2,0.9]"], "outer.options", "betas[0] must be"),
    (["init={tmp}/weights.bin"], "init", "is not a model's initial weights"),  # 46 lines before
    (["max_seconds=-1"], "max_seconds", "must be > 0"),
    (["max_rounds=-1"], "max_rounds", "must be >= 0"),
])
def test_diloco_master_user_errors_end_in_two_lines(tmp_path, args, key, says):
    (tmp_path / "weights.bin").write_bytes(b"not safetensors")
    hub = tmp_path / "hub"
    hub.mkdir()
    line = _two_lines(_master(tmp_path, f"hub.url={hub}", *[a.format(tmp=tmp_path) for a in args]), key)
    assert says in line, line


def test_bad_outer_options_are_refused_when_the_master_is_built():
    with pytest.raises(OptionError, match="outer_options: tau_cut must be"):
        MasterConfig(outer_optimizer="cgad", outer_lr=0.1, outer_options={"tau_cut": -1}).validate()


def test_a_master_refuses_non_finite_initial_weights_once_and_waits_for_a_good_offer(tmp_path, caplog):
    """Without ``init=``, a master whose first worker offered bad weights failed every round for ever."""
    hub = FileHub(tmp_path / "hub")
    for node, w in (("a-bad", torch.tensor([math.nan, 1.0])), ("b-f8", torch.ones(2).to(torch.float8_e4m3fn))):
        save_file({"w": w}, str(tmp_path / f"{node}.st"), metadata={"format": "diloco-init/1"})
        hub.upload_init(tmp_path / f"{node}.st", node)
    m = MasterOuterLoop(hub, None, node_state_dir=tmp_path / "m", poll_interval=0.01)
    for _ in range(3):
        assert m.sync_once() is False  # no exception, no version: waiting
    refused = [r.getMessage() for r in caplog.records if "ignoring nodes/" in r.getMessage()]
    assert len(refused) == 2 and "NaN" in refused[0] and "float8" in refused[1], refused  # once each
    save_file({"w": torch.ones(2)}, str(tmp_path / "c.st"), metadata={"format": "diloco-init/1"})
    hub.upload_init(tmp_path / "c.st", "c-good")
    assert m.sync_once() and torch.equal(m.snapshot()[1]["w"], torch.ones(2))
    with pytest.raises(ValueError, match="NaN or infinite"):
        MasterOuterLoop(hub, {"w": torch.tensor([math.inf])}, node_state_dir=tmp_path / "m2")
    m.close()


def test_a_run_shorter_than_one_phase_is_refused(hydra_configs):
    """``launch=sim`` with ``trainer.max_steps`` below ``inner_steps`` exited 0, printed DIVERGED and wrote
    a bare NaN into results.json; every launch refuses it now, naming the keys."""
    from hydra import compose, initialize_config_dir

    from diloco_lightning.app.config import ConfigError, validate

    with initialize_config_dir(str(hydra_configs), version_base=None):
        for extra in (["launch=sim"], []):
            cfg = compose("train", overrides=["recipe=tiny", "trainer.max_steps=3", "diloco.inner_steps=8", *extra])
            with pytest.raises(ConfigError, match=r"trainer.max_steps: is 3, fewer than the 8 inner steps"):
                validate(cfg)
        cfg = compose("train", overrides=["recipe=tiny", "trainer.max_steps=8", "diloco.inner_steps=8"])
        validate(cfg)


def test_every_json_file_the_product_writes_is_json(tmp_path):
    assert json.loads(dumps_json({"eval_loss": math.nan, "curve": [[1, math.inf], (2, -math.inf)], "ok": 1.5})) == {
        "eval_loss": None, "curve": [[1, None], [2, None]], "ok": 1.5}
    sink = MetricsSink(tmp_path / "metrics.jsonl", lambda d: None)
    m = RoundMetrics(aggregation="round", optimizer="cgad", holder="h")
    m.round_seconds = math.nan  # a NaN metric used to make the whole line vanish (allow_nan=False raised)
    sink.emit(m)
    line = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(line) == 1 and json.loads(line[0])["round_seconds"] is None


def test_serve_refuses_negative_limits():
    with pytest.raises(ValueError, match="max_seconds must be"):
        serve(None, max_seconds=-1)
    with pytest.raises(ValueError, match="max_rounds must be"):
        serve(None, max_rounds=-1)


def test_a_standby_master_says_it_is_standby_and_who_holds_the_lease(tmp_path):
    """A standby master answered ``snapshot()`` with "nothing published on the hub", which was false. (A
    cold one: a warm standby, the default, holds the published version and gives it, below.)"""
    root = tmp_path / "hub"
    a = MasterOuterLoop(FileHub(root), {"w": torch.zeros(2)}, node_state_dir=tmp_path / "a", poll_interval=0.01,
                        lease_ttl=60, holder="host:1:a")
    assert a.sync_once()
    warm = MasterOuterLoop(FileHub(root), None, node_state_dir=tmp_path / "w", poll_interval=0.01, lease_ttl=60)
    warm.sync_once()
    assert not warm.is_leader and warm.snapshot()[0] == 0 and torch.equal(warm.snapshot()[1]["w"], torch.zeros(2))
    warm.close()
    b = MasterOuterLoop(FileHub(root), None, node_state_dir=tmp_path / "b", poll_interval=0.01, lease_ttl=60,
                        warm_standby=False)
    b.sync_once()
    assert not b.is_leader
    with pytest.raises(StandbyError, match=r"standby: host:1:a holds the master lease .* \(epoch 1"):
        b.snapshot()
    a.stop()  # releases the lease: b takes over and has a version
    b.sync_once()
    assert b.is_leader and b.snapshot()[0] == 0
    a.close()
    b.close()
