"""The plugin user's whole journey (issue 41), as the user sees it: the name of the outer step they
chose, a configuration error that ends a command at once, paths that paste back, time-left lines of
this launch, and the printed command that continues a finished sweep job."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diloco_lightning.hub.local import FileHub
from diloco_lightning.master import MasterConfigError, MasterOuterLoop
from diloco_lightning.wire.delta import model_fingerprint, write_delta
from diloco_lightning.wire.statefile import save_weights_file

from support.env import ROOT, repo_env

pytestmark = pytest.mark.usefixtures("one_thread")


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(4, 3), "b": torch.zeros(3)}


def _put(hub: FileHub, tmp: Path, node: str, step: int, base: int, value: float) -> None:
    path = tmp / f"{node}_{step}.safetensors"
    write_delta(path, {k: torch.full_like(v, value) for k, v in _state().items()}, node_id=node, local_step=step,
                base_outer_step=base, model_fingerprint=model_fingerprint(_state()))
    hub.upload_delta(path, node, step)


def _master(hub: FileHub, state_dir: Path, name: str, **options) -> MasterOuterLoop:
    return MasterOuterLoop(hub, _state(), node_state_dir=state_dir, outer_optimizer=name, norm_ratio=None,
                           norm_global_ratio=None, poll_interval=0.02, lease_ttl=30.0, **options)


def _published_hub(tmp_path: Path, name: str, **options) -> Path:
    """A folder hub whose run published outer_step 1 with the outer optimizer ``name``, and the
    initial weights a worker offers."""
    root = tmp_path / "hub"
    hub = FileHub(root)
    save_weights_file(tmp_path / "init.safetensors", _state())
    hub.upload_init(tmp_path / "init.safetensors", "w0")
    m = _master(hub, tmp_path / "made", name, **options)
    _put(hub, tmp_path, "w0", 0, 0, 1.0)
    assert m.sync_once() and m.outer_step == 1
    m.stop()
    return root


def _cmd(tmp_path: Path, *args: str, module: str = "diloco_lightning.app.master", timeout: float = 120):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, env=repo_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------- 1. one name for the outer step


def test_fedavg_is_the_name_diloco_master_shows_and_a_path_with_equals_pastes_back(tmp_path):
    """``diloco-master`` (default ``outer=fedavg``) on a run folder named after its overrides, pasted as
    train.py prints it: its first line names fedavg, with its options; the path is taken as given."""
    hub = tmp_path / "runs" / "recipe=tiny" / "hub"
    hub.mkdir(parents=True)
    proc = _cmd(tmp_path, f"hub.url={hub}", "max_seconds=0.5", "poll_interval=0.1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = proc.stdout.splitlines()[0]
    assert f" on {hub}: optimizer fedavg {{'lr': 1.0, 'momentum': 0.0, 'power': 0.0}}, aggregation round" in first, first
    assert (tmp_path / "runs" / "recipe=tiny" / "hub-master").is_dir()  # its state beside that very folder


def test_help_shows_the_outer_step_by_the_name_chosen(capsys):
    from diloco_lightning.app.cli import run_app

    run_app("diloco-master", "master", lambda cfg: None, argv=["hub.url=/tmp/x/runs/recipe=tiny/hub", "--help"])
    out = capsys.readouterr().out
    assert "outer.name=fedavg " in out and "outer.name=nesterov" not in out
    assert "  hub.url=/tmp/x/runs/recipe=tiny/hub " in out  # the value as given, '=' and all
    assert "with hub.url=/tmp/x/runs/recipe=tiny/hub):" in out  # quoted for Hydra, shown as typed
    run_app("train.py", "train", lambda cfg: None, argv=["outer=fedavg", "hub.url=/tmp/x/runs/recipe=tiny/hub", "--help"])
    out = capsys.readouterr().out
    assert "outer.name=fedavg " in out and "  hub.url=/tmp/x/runs/recipe=tiny/hub " in out


def test_fedavg_is_nesterov_with_its_own_defaults():
    from diloco_lightning.outer import FedAvg, NesterovOuterOptimizer, build_outer_optimizer, same_step

    a, b = _state(), _state()
    fedavg = build_outer_optimizer("fedavg", a)
    nesterov = build_outer_optimizer("nesterov", b, lr=1.0, momentum=0.0)
    assert isinstance(fedavg, FedAvg) and type(nesterov) is NesterovOuterOptimizer
    assert (fedavg.name, fedavg.options, nesterov.name) == ("fedavg", {"lr": 1.0, "momentum": 0.0, "power": 0.0},
                                                             "nesterov")
    assert build_outer_optimizer("nesterov", _state(), lr=0.7).options == {"lr": 0.7, "momentum": 0.9}  # as before
    for delta in ({"w": torch.ones(4, 3), "b": torch.ones(3)}, {"w": torch.full((4, 3), 0.5)}):
        fedavg.step(a, delta)
        nesterov.step(b, delta)
    assert all(torch.equal(a[k], b[k]) for k in a) and torch.equal(a["w"], torch.full((4, 3), -1.5))
    # a stale delta: the default (power 0) is nesterov's step; power 1 gates it by 1 / (1 + tau)
    fedavg.step(a, {"w": torch.ones(4, 3)}, staleness=1)
    nesterov.step(b, {"w": torch.ones(4, 3)}, staleness=1)
    assert torch.equal(a["w"], b["w"]) and torch.equal(a["w"], torch.full((4, 3), -2.5))
    gated = build_outer_optimizer("fedavg", c := _state(), power=1.0)
    gated.step(c, {"w": torch.ones(4, 3)}, staleness=3)
    assert torch.equal(c["w"], _state()["w"] - 0.25) and gated.linear_rate() == 1.0 and gated.gate(1) == 0.5
    with pytest.raises(ValueError, match="power .* needs momentum 0"):
        build_outer_optimizer("fedavg", _state(), momentum=0.9, power=1.0)
    fedavg.load_state_dict(nesterov.state_dict())
    nesterov.load_state_dict(fedavg.state_dict())
    assert same_step("fedavg", "nesterov") and same_step("cgad", "cgad") and not same_step("fedavg", "staleness_sgd")


@pytest.mark.parametrize("before, after", [("nesterov", "fedavg"), ("fedavg", "nesterov")])
def test_a_hub_published_under_one_name_resumes_under_the_other(tmp_path, before, after):
    """A run published as ``nesterov`` (lr 1, momentum 0: what ``outer=fedavg`` was) continues with
    ``outer=fedavg``, from the hub and from the master's own folder, and back."""
    root = _published_hub(tmp_path, before, outer_lr=1.0, outer_momentum=0.0)
    hub = FileHub(root)
    for state_dir in (tmp_path / "fresh", tmp_path / "made"):  # the hub's version; its own saved state
        m = _master(hub, state_dir, after, outer_lr=1.0, outer_momentum=0.0)
        step = hub.read_manifest().outer_step
        _put(hub, tmp_path, "w0", step, step, 1.0)
        assert m.sync_once() and m.outer_step == step + 1
        m.stop()
        assert hub.read_manifest().optimizer["name"] == after
    sd = _master(hub, tmp_path / "again", after, outer_lr=1.0, outer_momentum=0.0)
    sd.sync_once()
    state = sd.state_dict()
    state["outer_optimizer"] = before
    _master(hub, tmp_path / "fourth", after, outer_lr=1.0, outer_momentum=0.0).load_state_dict(state)


# ----------------------------------------------------------------------------- 2. a configuration error is never retried


def test_diloco_master_on_a_hub_of_another_optimizer_ends_at_once_naming_the_override(tmp_path):
    root = _published_hub(tmp_path, "staleness_sgd", outer_lr=0.5)
    t0 = time.monotonic()
    proc = _cmd(tmp_path, f"hub.url={root}", "poll_interval=0.05", timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and " INFO " not in line]
    assert proc.returncode == 1 and time.monotonic() - t0 < 60, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 2 and "Traceback" not in proc.stderr and "retrying" not in proc.stdout + proc.stderr, proc.stderr
    assert lines[0].startswith("diloco-master: error: the hub's run") and "uses outer optimizer 'staleness_sgd'" in lines[0]
    assert "(outer=staleness_sgd outer.lr=0.5;" in lines[0], lines[0]


def test_the_master_thread_ends_on_a_configuration_error_and_keeps_it(tmp_path):
    root = _published_hub(tmp_path, "staleness_sgd", outer_lr=0.5)
    m = _master(FileHub(root), tmp_path / "other", "cgad", outer_options={"lr": 0.1})
    m.start()
    deadline = time.monotonic() + 20
    while m.error is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert isinstance(m.error, MasterConfigError) and "outer=staleness_sgd" in str(m.error)
    assert not m._thread.is_alive()  # ended, not retrying
    m.stop()


def test_a_whole_run_ends_when_its_master_meets_a_configuration_error(tmp_path):
    """``role=all``: the run's watcher raises the error that ended the master's thread (the command
    reports it in two lines) rather than waiting on workers that no master serves."""
    from types import SimpleNamespace

    from diloco_lightning.app.local import _watch

    error = MasterConfigError("the hub's run uses outer optimizer 'cgad'; ... (outer=cgad)")
    with pytest.raises(MasterConfigError, match="outer=cgad"):
        _watch(tmp_path, [], SimpleNamespace(error=error), None, [], [], time.perf_counter(), timeout=60.0,
               max_steps=8)


def test_sigterm_before_the_rounds_start_ends_diloco_master_in_one_line(monkeypatch, capsys):
    """SIGTERM while the command starts (before the rounds install their own handler): one line, 143."""
    import os

    from diloco_lightning.app import master

    def entry(cfg):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the command")

    monkeypatch.setattr(master, "_hydra_entry", entry)
    monkeypatch.setattr(sys, "argv", ["diloco-master", "hub.url=/tmp/nowhere"])
    def unhandled(signum, frame):  # the command left SIGTERM to its default: it would kill the test's process
        raise AssertionError("diloco-master does not handle SIGTERM while it starts")

    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        with pytest.raises(SystemExit) as e:
            master.main()
        assert e.value.code == 143 and signal.getsignal(signal.SIGTERM) is unhandled
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["diloco-master: stopped by SIGTERM"]


# ----------------------------------------------------------------------------- 3. paths with '=' paste back


def test_values_with_a_further_equals_sign_are_quoted_for_hydra():
    from diloco_lightning.app.keys import plain_override, quote_values

    args = ["hub.url=/r/recipe=tiny/hub", "+x=a=b", "run_id=recipe=tiny,seed=1", "seed=1", "-m",
            "y='a=b'", "z=[a,b]", "v=it's=1", "outer=fedavg"]
    assert quote_values(args) == ["hub.url='/r/recipe=tiny/hub'", "+x='a=b'", "run_id='recipe=tiny,seed=1'", "seed=1",
                                  "-m", "y='a=b'", "z=[a,b]", "v=\"it's=1\"", "outer=fedavg"]
    assert [plain_override(a) for a in quote_values(args)] == [*args[:5], "y=a=b", *args[6:]]


def test_train_py_takes_a_hub_path_with_equals_signs(tmp_path):
    from diloco_lightning.app.cli import _compose
    from diloco_lightning.app.keys import quote_values

    cfg = _compose("train", quote_values(["recipe=tiny", "hub.url=/tmp/x/runs/recipe=tiny/hub"]))
    assert cfg.hub.url == "/tmp/x/runs/recipe=tiny/hub"


# ----------------------------------------------------------------------------- 4. this launch's rate


def test_the_time_left_counts_only_this_launchs_steps(tmp_path):
    """A worker resumed at step 160 after an hour's pause: its rate is this launch's, not one that
    counts the pause."""
    from diloco_lightning.app.local import _progress_line

    node = tmp_path / "nodes" / "w0"
    node.mkdir(parents=True)
    t0 = 1_000_000.0
    lines = [{"step": s, "loss": 5.0, "time": t0 + s * 0.5} for s in (1, 80, 160)]  # the first launch: 0.5 s/step
    since = t0 + 160 * 0.5 + 3600.0  # the second launch starts an hour later
    lines += [{"step": s, "loss": 4.0, "time": since + 10.0 + (s - 161) * 0.2} for s in (161, 180, 201)]  # 0.2 s/step
    (node / "progress.jsonl").write_text("".join(json.dumps(d) + "\n" for d in lines))
    line, _ = _progress_line(tmp_path, 1, 320, 30.0, since)
    assert "w0 step 201/320 loss 4.000 (0.2 s/step, ~24 s left)" in line, line
    whole, _ = _progress_line(tmp_path, 1, 320, 30.0)  # without the launch's start: the pause counts
    assert "(18 s/step" in whole, whole


# ----------------------------------------------------------------------------- 5. the printed command continues the job


@pytest.mark.slow  # three train.py processes on the simulator (~15 s)
def test_the_command_printed_for_a_finished_sweep_job_continues_it(tmp_path):
    """Re-running a finished sweep prints, per job, a command that, followed as printed, continues that
    job in its own folder (a sweep's run id keeps trainer.max_steps: without run_id and the sweep's folder
    the command would start another run elsewhere)."""
    small = ["data.max_bytes=200000", "data.seq_len=32", "data.vocab_size=512"]
    sweep = [sys.executable, str(ROOT / "train.py"), "-m", "recipe=tiny", "launch=sim", "seed=0",
             "trainer.max_steps=8", *small]
    env = repo_env(tmp_path)
    for _ in range(2):
        proc = subprocess.run(sweep, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    (job,) = [p.parent for p in (tmp_path / "runs" / "multirun").glob("*/results.json")]
    assert f"run {job.name} is already finished" in proc.stdout
    lines = proc.stdout.splitlines()
    printed = lines[[i for i, line in enumerate(lines) if "raise trainer.max_steps" in line][0] + 1].strip()
    argv = shlex.split(printed)
    assert argv[1] == str(ROOT / "train.py") and "-m" not in argv, printed
    assert "trainer.max_steps=16" in argv and f"run_id={job.name}" in argv and "run_root=runs/multirun" in argv, printed
    again = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["multirun"]  # no new run folder
    assert sorted(p.name for p in (tmp_path / "runs" / "multirun").iterdir() if p.is_dir()) == [job.name]
    results = json.loads((job / "results.json").read_text())
    assert results["max_steps"] == 16 and results["outer"] == "fedavg"
