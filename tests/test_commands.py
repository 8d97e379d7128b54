"""What the two commands accept and leave behind: unknown keys (``+`` included) refused with the
closest known key, ``diloco-master`` taking ``train.py``'s ``master.*`` names, a refused command
leaving no run folder, and what the whole-run job prints on its console. Real subprocesses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from diloco_lightning.app.config import MasterCommandConf, TrainConf
from diloco_lightning.app.keys import check_override_keys, known_keys, master_aliases
from speed import default_first
from support.env import repo_env

ROOT = Path(__file__).resolve().parents[1]
TRAIN_GROUPS = ("recipe", "model", "data", "optim", "diloco", "outer", "hub", "trainer", "launch")


def _run(tmp_path: Path, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *cmd], cwd=tmp_path, env=repo_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout)


def _error(proc: subprocess.CompletedProcess, prog: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-1500:], proc.stderr[-1500:])
    assert 1 <= len(lines) <= 2 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines
    return lines[0]


# ----------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("arg, closest", [
    ("outer.lrr=0.1", "outer.lr"),
    ("+outer.lrr=0.1", "outer.lr"),          # Hydra's own hint: followed, it ran and dropped the key
    ("++outer.lrr=0.1", "outer.lr"),
    ("trainer.max_step=3", "trainer.max_steps"),
    ("+diloco.inner_step=4", "diloco.inner_steps"),
    ("outerr=cgad", "outer"),
    ("+seeed=1", "seed"),
])
def test_unknown_keys_are_refused_with_the_closest_match(arg, closest):
    with pytest.raises(ValueError, match=f"unknown key; did you mean {closest}\\?"):
        check_override_keys([arg], TrainConf, TRAIN_GROUPS)


def test_known_keys_free_form_fields_and_hydra_pass():
    check_override_keys(["recipe=tiny", "outer=nesterov", "outer.lr=0.1", "+outer.options.momentum=0.5",
                         "diloco.delay.high=8", "launch.submitit.partition=debug", "hydra/launcher=basic",
                         "hydra.verbose=true", "-m", "--cfg", "job", "seed=0,1,2", "~trainer.max_time"],
                        TrainConf, TRAIN_GROUPS)
    keys, free = known_keys(TrainConf)
    assert {"outer.lr", "master.poll_interval", "diloco.inner_steps", "trainer.max_steps"} <= keys
    assert {"outer.options", "launch.submitit", "diloco.delay"} <= free


def test_train_py_refuses_a_plus_key_before_anything_runs(tmp_path):
    proc = _run(tmp_path, str(ROOT / "train.py"), "+outer.lrr=0.1", f"run_root={tmp_path / 'runs'}")
    line = _error(proc, "train.py")
    assert "outer.lrr: unknown key; did you mean outer.lr?" in line
    assert not (tmp_path / "runs").exists()


def test_master_accepts_train_py_key_names(tmp_path):
    assert master_aliases(["master.poll_interval=1", "+master.keep_globals=3", "hub.url=x", "master.nope=1"],
                          {"poll_interval", "keep_globals"}) == ["poll_interval=1", "+keep_globals=3", "hub.url=x",
                                                                 "master.nope=1"]
    check_override_keys(["poll_interval=1", "hub.url=/x", "outer=nesterov", "outer.lr=0.7"], MasterCommandConf, ("outer",))
    # the README's form runs: a master on a fresh folder hub for 1 s, polling every 0.2 s
    proc = _run(tmp_path, "-m", "diloco_lightning.app.master", f"hub.url={tmp_path / 'hub'}", "hub.create=true",
                "master.poll_interval=0.2", "max_seconds=1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[master] stopped at outer_step 0" in proc.stdout + proc.stderr


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_master_says_which_name_to_use(tmp_path):
    proc = _run(tmp_path, "-m", "diloco_lightning.app.master", f"hub.url={tmp_path}", "master.pol_interval=1")
    line = _error(proc, "diloco-master")
    assert "master.pol_interval: unknown key" in line and "at the top level" in line and "poll_interval" in line


# ----------------------------------------------------------------------------- nothing left behind


@pytest.mark.parametrize("args", default_first([["outer.lr=-1"], ["recipe=llama7b_tau8"]]))
def test_a_refused_command_leaves_no_run_folder(tmp_path, args):
    """A value refused by validation, a recipe refused by the resource check: no run folder (Hydra
    had made one with its own files before the job ran)."""
    proc = _run(tmp_path, str(ROOT / "train.py"), *args, f"run_root={tmp_path / 'runs'}")
    assert proc.returncode in (1, 2), proc.stderr[-2000:]
    assert not (tmp_path / "runs").exists(), sorted(str(p) for p in (tmp_path / "runs").rglob("*"))


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_a_refused_command_keeps_an_existing_run(tmp_path):
    run = tmp_path / "runs" / "outer.lr=-1"
    (run / "nodes").mkdir(parents=True)
    proc = _run(tmp_path, str(ROOT / "train.py"), "outer.lr=-1", f"run_root={tmp_path / 'runs'}")
    assert proc.returncode == 2
    assert (run / "nodes").is_dir()


def test_a_second_worker_with_a_running_node_id_is_refused_at_once(tmp_path):
    """role=worker with a node id another live process holds: refused in one or two lines, before the
    data (the tokenizer) or the model is built, and leaving no run folder."""
    from diloco_lightning.hub import open_hub
    from diloco_lightning.worker.claim import ClaimKeeper

    hub = open_hub(str(tmp_path / "hub"))
    keeper = ClaimKeeper(hub, "w0")
    keeper.acquire()
    try:
        proc = _run(tmp_path, str(ROOT / "train.py"), "recipe=tiny", "role=worker", "node_index=0",
                    f"hub.url={tmp_path / 'hub'}", "run_id=x", f"run_root={tmp_path / 'runs'}", timeout=600)
    finally:
        keeper.release()
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and 1 <= len(lines) <= 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "node_id 'w0' is already running" in lines[0] and "give this worker another node_id" in lines[0]
    assert not (tmp_path / "cache").exists()  # no tokenizer was trained
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_a_refused_master_never_removes_its_working_folder(tmp_path):
    """diloco-master's output dir is the working folder: a refusal there removes nothing, even
    when the folder is empty."""
    cwd = tmp_path / "empty"
    cwd.mkdir()
    proc = subprocess.run([sys.executable, "-m", "diloco_lightning.app.master", f"hub.url={cwd / 'hubb'}"], cwd=cwd,
                          env=repo_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and cwd.is_dir()
