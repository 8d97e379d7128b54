"""The two commands as a user meets them: real subprocesses of ``train.py`` and ``diloco-master``.

A user error ends in one or two lines on stderr and a non-zero status (the traceback with ``-v``
or ``HYDRA_FULL_ERROR=1``); both commands share one schema and one validation; ``--help`` lists
the command's own groups and a line per key; ``docs/configuration.md`` is the schema's.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from diloco_lightning.app.cli import configuration_markdown, short_message
from diloco_lightning.app.config import (
    CONFIG_DIR,
    ConfigError,
    MasterCommandConf,
    TrainConf,
    describe,
    register_configs,
    validate,
    validate_master_command,
)
from speed import default_first
from support.env import repo_env

ROOT = Path(__file__).resolve().parents[1]
register_configs()


def _without_waits(err: str) -> list[str]:
    """The console's lines less what a wait says while it lasts (the whole run's master waits for the
    workers its process is starting, and says so: at once, and again when it lasts)."""
    return [line for line in err.splitlines() if line.strip() and not line.startswith(("[master] waiting", "[master] still waiting"))]


def _train(tmp_path: Path, *args: str, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args, f"run_root={tmp_path / 'runs'}"],
                          cwd=tmp_path, env=repo_env(tmp_path, **env), capture_output=True, text=True, timeout=timeout)


def _master(tmp_path: Path, *args: str, timeout: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco_lightning.app.master", *args],
                          cwd=tmp_path, env=repo_env(tmp_path, **env), capture_output=True, text=True, timeout=timeout)


def _short(proc: subprocess.CompletedProcess, prog: str, status: int) -> list[str]:
    """Assert the command failed with one or two lines on stderr and no traceback; return the lines."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == status, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert 1 <= len(lines) <= 2 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines
    return lines


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "args, key",
    default_first([
        (["diloco.inner_steps=0"], "diloco.inner_steps"),
        (["unknown_key=1"], "unknown_key"),
        (["diloco.inner_steps=eight"], "diloco.inner_steps"),
        (["recipe=nope"], "recipe/nope"),
        (["outer.lr=-1"], "outer.lr"),
        (["hub.url=/no/such/folder/hub"], "hub.url"),
        (["hub=hf"], "hub.url"),  # hub=hf without its URL: never a silent fallback to a folder hub
    ], keep=2),
)
def test_train_config_errors_end_in_two_lines_naming_the_key(tmp_path, args, key):
    lines = _short(_train(tmp_path, *args), "train.py", 2)
    assert key in lines[0]
    assert "-v" in lines[1] and "HYDRA_FULL_ERROR=1" in lines[1]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("results.json"))


def test_a_missing_hub_folder_is_an_error_unless_asked_to_create_it(tmp_path):
    lines = _short(_train(tmp_path, "hub.url=" + str(tmp_path / "hubb")), "train.py", 2)
    assert "hub.create=true" in lines[0] and not (tmp_path / "hubb").exists()
    lines = _short(_master(tmp_path, f"hub.url={tmp_path / 'hubb'}"), "diloco-master", 2)
    assert lines[0].startswith("diloco-master: error: hub.url:") and "hub.create=true" in lines[0]
    assert not (tmp_path / "hubb").exists()  # a misspelt hub is never created silently
    ok = _master(tmp_path, f"hub.url={tmp_path / 'hubb'}", "hub.create=true", "max_seconds=0.5", "poll_interval=0.1")
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "hubb" / "nodes").is_dir() and (tmp_path / "hubb-master").is_dir()
    assert f"local state in {tmp_path / 'hubb-master'}" in ok.stdout  # beside the run, and said at start


@pytest.mark.parametrize(
    "args, key",
    default_first([
        (["outer.lr=-1"], "outer.lr"),
        (["outer.name=sgd"], "outer.name"),
        (["norm_ratio=0.5"], "norm_ratio"),
        (["min_deltas=0"], "min_deltas"),
        ([], "hub.url"),
        (["hub.url=ftp://host/x"], "hub.url"),
        (["hub.url=/tmp", "hub.revision=dev"], "hub.revision"),
        (["init=/no/such/weights.safetensors"], "init"),
        (["hub.url=/proc/no/such/hub", "hub.create=true"], "hub.url"),  # cannot be created: no traceback
    ], keep=2),
)
def test_master_checks_what_train_checks(tmp_path, args, key):
    hub = tmp_path / "hub"
    hub.mkdir()
    args = args if any(a.startswith("hub.url=") for a in args) or key == "hub.url" else [f"hub.url={hub}", *args]
    lines = _short(_master(tmp_path, *args), "diloco-master", 2)
    assert lines[0].startswith(f"diloco-master: error: {key}"), lines


_WITHOUT_TORCH = """
import sys
sys.argv = [sys.argv[0], *sys.argv[1:]]
from diloco_lightning.app import master
from diloco_lightning.app.cli import train_main
try:
    master.main() if sys.argv.pop(1) == "master" else train_main()
except SystemExit as e:
    print("status", e.code)
print("torch imported", "torch" in sys.modules)
"""


@pytest.mark.parametrize("command, args, key", [
    ("train", ["trainer.precision=99"], "trainer.precision"),
    ("train", ["data.seq_len=0"], "data.seq_len"),
    ("train", ["master.quorum=-1"], "master.quorum"),
    ("train", ["supervise.restarts=-1"], "supervise.restarts"),
    ("train", ["launch=sim", "sim.quorum=-3"], "sim.quorum"),
    ("master", ["max_rounds=-1"], "max_rounds"),
    ("train", ["outer.lr=-1"], "outer.lr"),  # the outer optimizer's other options need it built on a probe (torch)
    ("master", ["outer.lr=0"], "outer.lr"),
])
def test_a_bad_value_is_refused_before_torch_is_imported(tmp_path, command, args, key):
    """Start-up: every check but the outer optimizer's (which builds one on a probe) runs before
    anything imports torch, so a bad value is refused in well under a second."""
    hub = tmp_path / "hub"
    hub.mkdir()
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, command, *args, f"hub.url={hub}",
                           *([f"run_root={tmp_path / 'runs'}"] if command == "train" else [])],
                          cwd=tmp_path, env=repo_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert "status 2" in proc.stdout and key in proc.stderr, (proc.stdout, proc.stderr[-2000:])
    assert "torch imported False" in proc.stdout, proc.stdout


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_verbose_and_hydra_full_error_show_the_traceback(tmp_path):
    for proc in (_train(tmp_path, "diloco.inner_steps=0", "-v"), _train(tmp_path, "diloco.inner_steps=0", HYDRA_FULL_ERROR="1")):
        assert proc.returncode != 0
        assert "Traceback" in proc.stderr and "ConfigError: diloco.inner_steps: must be an integer >= 1 or 'auto', got 0" in proc.stderr


def test_hub_errors_at_the_command_line_are_short(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    lines = _short(_master(tmp_path, f"hub.url={tmp_path / 'file'}"), "diloco-master", 2)
    assert "hub.url" in lines[0]
    lines = _short(_master(tmp_path, "hub.url=hf://not a repo"), "diloco-master", 2)
    assert "hub.url" in lines[0] and "org/name" in lines[0]


def test_one_schema_one_validation():
    """The master's keys are the training run's master/hub/outer sections, checked by the same code."""
    train_keys = {k for k, _, _ in describe(TrainConf)}
    master_keys = {k for k, _, _ in describe(MasterCommandConf)}
    for key in master_keys & {k.removeprefix("master.") for k in train_keys if k.startswith("master.")}:
        assert f"master.{key}" in train_keys
    assert {k for k in master_keys if k.startswith(("hub.", "outer."))} == {k for k in train_keys if k.startswith(("hub.", "outer."))}
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        t = compose("train", overrides=["recipe=tiny", "master.norm_ratio=0.5"])
        m = compose("master", overrides=["hub.url=/tmp", "norm_ratio=0.5"])
    with pytest.raises(ConfigError) as a:
        validate(t)
    with pytest.raises(ConfigError) as b:
        validate_master_command(m)
    assert a.value.key == "master.norm_ratio" and b.value.key == "norm_ratio"
    assert str(a.value).split(": ", 1)[1] == str(b.value).split(": ", 1)[1]  # the same check said the same thing


def test_short_message_folds_hydra_errors_into_one_line():
    from hydra.errors import MissingConfigException

    e = MissingConfigException("In 'train': Could not find 'recipe/x'\n\nAvailable options in 'recipe':\n\ta\n\tb\n"
                               "Config search path:\n\tprovider=hydra, path=pkg://hydra.conf", missing_cfg_file="recipe/x")
    assert short_message(e) == "In 'train': Could not find 'recipe/x'. Available options in 'recipe': a, b"


# ----------------------------------------------------------------------------- help and docs


def _help_keys(text: str) -> set[str]:
    return {line.split("=", 1)[0].strip() for line in text.splitlines() if line.startswith("  ") and "=" in line.split()[0]}


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_master_help_lists_its_own_groups_and_a_line_per_key(tmp_path):
    proc = _master(tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    groups = [line.split(":")[0].strip() for line in out.split("Groups (GROUP=OPTION):")[1].split("Keys")[0].splitlines()
              if line.startswith("  ") and not line.startswith("      ")]
    assert groups == ["outer"]
    assert _help_keys(out) == {k for k, _, _ in describe(MasterCommandConf)}
    assert "outer.lr=1.0" in out and "min_deltas=1.0" in out  # configs/master.yaml: outer=fedavg, every live node
    assert "outer.lr=0.7" in _master(tmp_path, "--help", "outer=nesterov").stdout


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_train_help_lists_every_group_and_key(tmp_path):
    proc = _train(tmp_path, "--help")
    assert proc.returncode == 0, proc.stderr
    assert _help_keys(proc.stdout) == {k for k, _, _ in describe(TrainConf)}
    for group in ["recipe", *sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir())]:  # every group folder
        assert f"\n  {group}: " in proc.stdout, group
    assert "model.d_model=320" in _train(tmp_path, "--help", "recipe=llama25m_tau8").stdout


def test_every_key_has_help_and_the_configuration_doc_is_current():
    for schema in (TrainConf, MasterCommandConf):
        missing = [k for k, _, h in describe(schema) if not h]
        assert not missing, f"keys without help: {missing}"
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == configuration_markdown(), "docs/configuration.md is stale: python -m diloco_lightning.app.cli --write-docs"
    for schema in (TrainConf, MasterCommandConf):
        for f in dataclasses.fields(schema):
            assert f"`{f.name}" in doc or f"`{f.name}." in doc


# ----------------------------------------------------------------------------- signals


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_stop_train_py_workers_and_master_cleanly(tmp_path, sig):
    """SIGTERM to `python train.py` (what timeout, SLURM and Kubernetes send), or Ctrl-C (SIGINT to the
    whole process group): the workers stop (on SIGTERM each uploads what is pending and exits 143),
    the master stops, and the run ends with status 128 + signal and one line saying what happened
    and how to resume (no results.json: the run is not done)."""
    cmd = [sys.executable, str(ROOT / "train.py"), "recipe=tiny", "trainer.max_steps=800", "data.max_bytes=300000",
           "data.seq_len=32", "data.vocab_size=512", "launch.eval_points=0", f"run_root={tmp_path / 'runs'}"]
    # SIGINT at its default, as in a terminal: a shell without job control starts background commands with
    # SIGINT ignored, and a process that inherits that never sees Ctrl-C (Python then installs no handler)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=repo_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        out = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            out.append(line)
            if line.startswith("[master] outer_step 2 "):
                break
        assert any(line.startswith("[master] outer_step 2 ") for line in out), "".join(out)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches the whole foreground process group
        else:
            proc.send_signal(sig)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])
    lines = _without_waits(err)
    name = signal.Signals(sig).name
    assert len(lines) == 1 and lines[0].startswith(f"train.py: interrupted by {name}"), err
    assert "stopped the master at outer_step" in lines[0] and "The same command resumes the run" in lines[0]
    run = tmp_path / "runs" / next(p.name for p in (tmp_path / "runs").iterdir())
    assert not (run / "results.json").exists()
    if sig == signal.SIGTERM:
        for w in ("w0", "w1"):
            log = (run / "nodes" / w / "worker.log").read_text()
            assert "SIGTERM at step" in log and "exiting with status 143" in log, log[-2000:]
        assert not list((run / "hub" / "nodes").glob("*/claim.json"))  # claims released on the way out


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_a_killed_worker_is_named_with_how_it_ended(tmp_path):
    """The reported `worker w6 failed (-9)` with an empty worker.log: now the line names the worker, says it
    was killed by SIGKILL (what the out-of-memory killer sends), that the others were stopped, and shows the
    end of its log. (Unsupervised: ``supervise.restarts=0``; a supervised run restarts it, tests/test_supervise.py.)"""
    import psutil

    cmd = [sys.executable, str(ROOT / "train.py"), "recipe=tiny", "trainer.max_steps=800", "data.max_bytes=300000",
           "data.seq_len=32", "data.vocab_size=512", "launch.eval_points=0", "supervise.restarts=0",
           f"run_root={tmp_path / 'runs'}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=repo_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line or line.startswith("[master] outer_step 1 "):
                break
        (victim,) = [p for p in psutil.Process(proc.pid).children() if p.cmdline()[-2:] == ["--node-index", "1"]]
        victim.kill()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    first = _without_waits(err)[0]
    assert first.startswith("train.py: error: worker w1 was killed by SIGKILL (the kernel's out-of-memory killer"), first
    assert "the other workers were stopped" in first and "Last lines of" in first and "worker.log" in first
    assert "Traceback (most recent call last)" not in err.split("Last lines of", 1)[0]


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_diloco_master_serves_an_s3_run(tmp_path, s3_endpoint, s3_bucket, s3_proxy):
    """`diloco-master hub.url=s3://bucket/run hub.endpoint_url=...` serves a run: it adopts a worker's initial
    weights, applies its deltas and exits after max_rounds. hub.endpoint is the older name of hub.endpoint_url;
    a bucket is never created; a store that ignores conditional writes is refused in one line."""
    import boto3
    import torch

    from diloco_lightning.hub import open_hub
    from diloco_lightning.worker import DiLoCoWorker
    from support.s3_proxy import S3Proxy

    url = f"s3://{s3_bucket}/run"
    cmd = [sys.executable, "-m", "diloco_lightning.app.master", f"hub.url={url}", f"hub.endpoint_url={s3_endpoint}",
           "max_rounds=2", "poll_interval=0.1", f"hub.cache_dir={tmp_path / 'c'}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=repo_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        hub = open_hub(url, endpoint_url=s3_endpoint, cache_dir=tmp_path / "w", check_conditional_writes=False)
        params = {"w": torch.nn.Parameter(torch.zeros(4, 3))}
        with DiLoCoWorker(hub, "w0", params, poll_interval=0.05, wait_timeout=60.0) as w:
            w.start()  # offers its initial weights; waits for the master to publish them as version 0
            for k in (1, 2):
                with torch.no_grad():
                    params["w"].add_(1.0)
                w.boundary()
                assert w.flush()
                deadline = time.monotonic() + 30
                while hub.read_manifest().outer_step < k and time.monotonic() < deadline:
                    time.sleep(0.05)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert f"on {url}" in out and f"local state in {tmp_path / 'c' / 'master'}" in out
    assert "[master] outer_step 2 | accepted 1" in out, out[-2000:]
    manifest = hub.read_manifest()
    assert manifest.outer_step == 2 and manifest.ledger == {"w0": 2} and hub.list_deltas() == []

    lines = _short(_master(tmp_path, "hub.url=s3://no-such-bucket-here/run", f"hub.endpoint={s3_endpoint}"), "diloco-master", 2)
    assert lines[0].startswith("diloco-master: error: hub.url:") and "does not exist (create it first" in lines[0]
    names = [b["Name"] for b in boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").list_buckets()["Buckets"]]
    assert "no-such-bucket-here" not in names
    with S3Proxy(s3_endpoint, strip_conditionals=True) as ignoring:
        lines = _short(_master(tmp_path, f"hub.url={url}", f"hub.endpoint_url={ignoring.endpoint}"), "diloco-master", 1)
    assert "does not honour conditional writes" in lines[0] and "If-None-Match" in lines[0]
