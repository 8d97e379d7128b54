"""Where a restarted worker's time to its first training step goes (issue 38, item 1).

Runs the study model (``recipe=tiny``, one worker) as separate processes on a folder hub, as a
restart would be: a master (``train.py role=master``), a first worker life that trains until it
has a checkpoint and a delta on the hub, killed with SIGKILL, then ``--repeats`` restarts of the
worker from a fresh process, each killed at its first training step, with its checkpoint
(``ckpt``) and without it (``fresh``: the checkpoint folder moved aside, the node restarting from
the hub). Each restart writes the start-up timeline of ``diloco_lightning/util/timeline.py``
(``DILOCO_TIMELINE``); the seconds between its marks are printed per phase (median of the repeats),
from the moment the process is spawned to its first training step:

* ``interpreter+cli``: Python's start and the command's imports (Hydra, the app) up to ``run_app``;
* ``config``: composing and checking the configuration; ``node_check``: the hub read for a live claim;
* ``torch+lightning``: importing them (and the callback); ``data``, ``model``, ``trainer``: building;
* ``fit_setup``: Lightning's set-up before training (checkpoint read included: ``checkpoint``);
* ``hub_open``, ``claim``, ``global``: the worker's start (hub, claim, the global downloaded and
  installed or the hub settled after a checkpoint); ``first_step``: the rest up to the first step;
* ``spare_go``: a warm spare (kind ``spare``, ``supervise.spare``): from the go to its configuration
  read; its imports were done before the go, so its ``total`` is the go to the first step;
* ``total``: spawn to the first step (wall); ``cpu_total``: the process's CPU seconds by then (all its
  threads; steadier than wall time on a shared machine).

Then ``python -X importtime`` of the same command with a configuration error
(``diloco.inner_steps=oops``) prints what such an error costs and which packages it imports.

    python benchmarks/restart_time.py                 # 3 restarts of each kind
    python benchmarks/restart_time.py --repeats 5 --keep /tmp/rt    # keep the run folder

Prints figures only; no timing is asserted anywhere. Report ``uptime``'s load with them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "train.py"

#: (phase, from mark, to mark); a missing mark makes the phase absent
PHASES = [
    ("interpreter+cli", "spawn", "cli"),
    ("spare_go", "go", "config"),  # a warm spare: from the go to its configuration read
    ("config", "cli", "config"),
    ("node_check", "config", "node_checked"),
    ("torch+lightning", "node_checked", "imports"),
    ("data", "imports", "data"),
    ("model", "data", "model"),
    ("trainer", "model", "trainer"),
    ("fit_setup", "trainer", "train_start"),
    ("hub_open", "train_start", "hub_open"),
    ("claim", "hub_open", "claimed"),
    ("global", "claimed", "global_installed"),
    ("first_step", "global_installed", "first_step"),
]


def _env(timeline: Path | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("DILOCO_FAULTS", None)
    if timeline is not None:
        env["DILOCO_TIMELINE"] = str(timeline)
    return env


def _marks(path: Path, pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        t, p, name = line.split(maxsplit=2)
        if int(p) == pid:
            out.setdefault(name, float(t))
    return out


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(30)


def _cpu_seconds(pid: int) -> float | None:
    """The CPU seconds (user + system, all threads) process ``pid`` has used (Linux), None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _until_first_step(proc: subprocess.Popen, timeline: Path, deadline: float) -> float | None:
    """Wait for ``proc``'s first training step (or its end); its CPU seconds then."""
    while time.monotonic() < deadline:
        if "first_step" in _marks(timeline, proc.pid) or proc.poll() is not None:
            return _cpu_seconds(proc.pid)
        time.sleep(0.05)
    return None


def _first_marks(proc: subprocess.Popen, timeline: Path, cwd: Path) -> dict[str, float]:
    marks = _marks(timeline, proc.pid)
    if "first_step" not in marks:
        raise RuntimeError(f"the restarted worker reached no training step (see {cwd / 'restart.log'}): {marks}")
    return marks


def _restart(cwd: Path, args: list[str], timeline: Path, timeout: float) -> dict[str, float]:
    """One worker process from spawn to its first training step (then SIGKILL): its marks, and its
    CPU seconds then (``cpu``: steadier than wall time on a shared machine)."""
    log = open(cwd / "restart.log", "ab")  # noqa: SIM115 - the child's output, for a failed start
    spawn = time.time()
    proc = subprocess.Popen([sys.executable, str(TRAIN), *args], cwd=cwd, env=_env(timeline), stdout=log, stderr=log)
    try:
        cpu = _until_first_step(proc, timeline, time.monotonic() + timeout)
    finally:
        _kill(proc)
        log.close()
    marks = _first_marks(proc, timeline, cwd)
    marks["spawn"] = spawn
    if cpu is not None:
        marks["cpu"] = cpu
    return marks


def _restart_spare(cwd: Path, config: Path, timeline: Path, timeout: float) -> dict[str, float]:
    """A warm spare's restart (``supervise.spare``, app/supervise.py): the worker process started with
    ``--spare`` ahead of need, its imports done, then told to go; its marks from the go (``spawn`` is
    the go) to its first training step, and the CPU seconds it used after the go."""
    log = open(cwd / "restart.log", "ab")  # noqa: SIM115 - the child's output, for a failed start
    proc = subprocess.Popen([sys.executable, "-m", "diloco_lightning.app.worker", "--config", str(config),
                             "--node-index", "0", "--spare"], cwd=cwd, env=_env(timeline), stdin=subprocess.PIPE,
                            stdout=log, stderr=log)
    cpu = cpu_at_go = go = None
    try:
        deadline = time.monotonic() + timeout
        while "spare_ready" not in _marks(timeline, proc.pid):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the spare did not get ready (see {cwd / 'restart.log'})")
            time.sleep(0.05)
        time.sleep(1.0)  # a spare waits long before it is needed: its process has settled
        cpu_at_go = _cpu_seconds(proc.pid)
        go = time.time()
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        cpu = _until_first_step(proc, timeline, deadline)
    finally:
        _kill(proc)
        log.close()
    marks = _first_marks(proc, timeline, cwd)
    marks["spawn"] = go
    if cpu is not None and cpu_at_go is not None:
        marks["cpu"] = cpu - cpu_at_go
    return marks


def _phases(marks: dict[str, float]) -> dict[str, float]:
    out = {name: marks[b] - marks[a] for name, a, b in PHASES if a in marks and b in marks}
    if "checkpoint_loaded" in marks and "trainer" in marks:
        out["checkpoint"] = marks["checkpoint_loaded"] - marks["trainer"]
    out["total"] = marks["first_step"] - marks["spawn"]
    if "cpu" in marks:
        out["cpu_total"] = marks["cpu"]
    return out


def _import_profile(cwd: Path, args: list[str]) -> tuple[float, dict[str, float]]:
    """A configuration error's wall seconds, and the seconds its top-level imports took (by package)."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-X", "importtime", str(TRAIN), *args], cwd=cwd, env=_env(None),
                          capture_output=True, text=True, timeout=300)
    wall = time.time() - t0
    by_root: dict[str, float] = {}
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cumulative, name = line.split("|")
        if name.startswith("  ") or not cumulative.strip().isdigit():
            continue  # only the imports the program itself asked for (depth 0)
        root = name.strip().split(".")[0]
        by_root[root] = by_root.get(root, 0.0) + int(cumulative) / 1e6
    return wall, by_root


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--repeats", type=int, default=3, help="restarts of each kind (default 3)")
    ap.add_argument("--kinds", default="ckpt,fresh,spare",
                    help="ckpt (a new process resumed from its checkpoint), fresh (without it), spare (a warm spare "
                         "told to go, supervise.spare: timed from the go; with its checkpoint)")
    ap.add_argument("--recipe", default="tiny", help="the recipe every process runs (default tiny, the study model)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a start may take before it counts as failed")
    ap.add_argument("--keep", default=None, help="run in this folder and keep it (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    ap.add_argument("overrides", nargs="*", help="more train.py overrides for every process (e.g. diloco=async)")
    args = ap.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    cwd = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="restart-time-"))
    cwd.mkdir(parents=True, exist_ok=True)
    common = [f"recipe={args.recipe}", "workers=1", "run_id=restart_time", "trainer.max_steps=100000", *args.overrides]
    # the restarts run their worker in the command's process (no supervisor: one process, timed from its spawn)
    worker = [*common, "role=worker", "node_index=0", "supervise.restarts=0"]
    run = cwd / "runs" / "restart_time"
    ckpt = run / "nodes" / "w0" / "checkpoints"
    timeline = cwd / "timeline.txt"
    master = subprocess.Popen([sys.executable, str(TRAIN), *common, "role=master"], cwd=cwd, env=_env(None),
                              stdout=open(cwd / "master.log", "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
    results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    try:
        deadline = time.monotonic() + args.timeout
        while not (run / "hub" / "global").is_dir():  # the master creates the hub
            if master.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the master did not create the hub (see {cwd / 'master.log'})")
            time.sleep(0.2)
        # the first life: until it has a checkpoint and its first delta applied, then kill -9
        # (supervised, so the worker's resolved configuration is on disk for a spare; killed as a group)
        first = subprocess.Popen([sys.executable, str(TRAIN), *common, "role=worker", "node_index=0", "supervise.spare=false"],
                                 cwd=cwd, env=_env(None), start_new_session=True,
                                 stdout=open(cwd / "first.log", "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
        deadline = time.monotonic() + args.timeout
        manifest = run / "hub" / "global" / "manifest.json"
        while time.monotonic() < deadline:
            applied = json.loads(manifest.read_text()).get("ledger", {}) if manifest.is_file() else {}
            if (ckpt / "last.ckpt").is_file() and applied.get("w0", -1) >= 1:
                break
            if first.poll() is not None:
                raise RuntimeError(f"the first worker life ended (see {cwd / 'first.log'})")
            time.sleep(0.2)
        else:
            raise RuntimeError(f"no checkpoint and applied delta within {args.timeout:g} s (see {cwd})")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
        config = run / "nodes" / "w0" / "worker-config.yaml"
        for i in range(args.repeats):
            for kind in kinds:
                aside = ckpt.with_name("checkpoints.aside")
                if kind == "fresh":
                    shutil.move(str(ckpt), str(aside))
                try:
                    marks = (_restart_spare(cwd, config, timeline, args.timeout) if kind == "spare" else
                             _restart(cwd, worker, timeline, args.timeout))
                finally:
                    if kind == "fresh":
                        shutil.rmtree(ckpt, ignore_errors=True)
                        shutil.move(str(aside), str(ckpt))
                results[kind].append(_phases(marks))
                print(f"restart {i + 1} ({kind}): {results[kind][-1]['total']:.2f} s to the first step", flush=True)
    finally:
        master.send_signal(signal.SIGTERM)
        try:
            master.wait(30)
        except subprocess.TimeoutExpired:
            _kill(master)
    wall, imports = _import_profile(cwd, [*common, "diloco.inner_steps=oops"])
    load = os.getloadavg()
    names = [name for name, _, _ in PHASES] + ["checkpoint", "total", "cpu_total"]
    print(f"\nrestart to first training step, recipe={args.recipe}, median of {args.repeats} (seconds; load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs)")
    print(f"{'phase':<18}" + "".join(f"{k:>10}" for k in kinds))
    medians: dict[str, dict[str, float]] = {k: {} for k in kinds}
    for name in names:
        row = []
        for k in kinds:
            vals = [r[name] for r in results[k] if name in r]
            if vals:
                medians[k][name] = statistics.median(vals)
            row.append(f"{medians[k][name]:>10.2f}" if vals else f"{'-':>10}")
        print(f"{name:<18}" + "".join(row))
    print(f"\na configuration error (diloco.inner_steps=oops): {wall:.2f} s wall; top-level imports "
          "(python -X importtime, cumulative s):")
    for root, s in sorted(imports.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  {root:<24}{s:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": medians, "runs": results, "config_error_s": wall,
                                               "config_error_imports": imports, "load": load}, indent=2))
    if not args.keep:
        shutil.rmtree(cwd, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
