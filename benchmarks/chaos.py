"""Chaos: a real master and N real Lightning workers, a seeded monkey that kill -9s them, and an oracle.

    python benchmarks/chaos.py                                   # folder hub, 3 workers, 2 minutes of kills
    python benchmarks/chaos.py --transport s3 --fault-rate 0.02 --outage-every 40 --outage-seconds 15
    python benchmarks/chaos.py --transport hf --outage-every 40  # the loopback Hub, with outages
    python benchmarks/chaos.py --seconds 900 --kill-every 10,30  # the 15-minute run

The workers are ``tests/support/worker_crash_script.py``: a Lightning Trainer whose model is the counter
(every inner step adds exactly 1 to each element of ``p``, initialised to 10), checkpointing at every
boundary and resuming from ``last.ckpt``; the master (this script with ``--role master``) applies every
delta with outer SGD lr 1 in arrival mode, so the global ``p`` is ``10 + the inner steps applied``, bit
for bit. Every worker has ``--steps`` inner steps to do. While the monkey runs (``--seconds``), every
``--kill-every`` seconds (drawn uniformly in the range, seeded) it SIGKILLs a random live process (the
master or a worker; with ``--settle``, one that has served or trained that long, the kill waiting for one)
and restarts it ``--restart-delay`` seconds later with the same node id, state
folder and checkpoints. On S3 (moto behind ``tests/support/s3_proxy.py``) ``--fault-rate`` of the
requests fail (503, a stall, a dropped connection, a write whose answer is lost); on S3 and HF
``--outage-every`` makes the store unreachable for ``--outage-seconds`` (drawn up to that), every
``--outage-every`` seconds on average. After the monkey stops, every process runs to the end and the
oracle reads the hub:

* **lost** / **duplicated**: inner steps of the workers' final trajectories that the global misses /
  holds more than once (expected ``workers x steps``; both 0 is exactly-once);
* **step goodput**: inner steps applied / inner steps executed (every life's steps, replays after a
  kill included: a worker resumes from its last checkpoint);
* **time goodput**: the applied steps at the median step time / the workers' process seconds (every
  life, from spawn to exit or kill: start-up, waits and replays are the loss; with ``--spare``, a life
  woken from a warm spare counts from its go: the spare waited idle, its imports done, as the
  product's ``supervise.spare`` does);
* kills by kind, kills during an outage, and where the worker kills landed (the inner step within its
  phase: 0 is just after a boundary);
* ``timeline``: every life of every process (``--timeline`` prints it), and ``losses_s``: where the
  workers' process seconds that did not train went (start-up, stalls on the hub, replays, tails).

Results go to ``runs/perf/chaos.json`` (one entry per run). Exit status 1 when anything was lost or
duplicated.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from diloco_lightning.app.supervise import Spare  # noqa: E402

WORKER = ROOT / "tests" / "support" / "worker_crash_script.py"
START = 10.0  # the counter's initial value


# ----------------------------------------------------------------------------- the master (a process)


def master_main(cfg: dict[str, Any]) -> None:
    """``--role master``: serve arrival rounds on the hub until killed (or ``stop_file`` appears)."""
    import logging

    import torch

    from diloco_lightning.hub import open_hub
    from diloco_lightning.master import MasterOuterLoop

    logging.basicConfig(level=logging.WARNING, format="master %(levelname)s %(name)s: %(message)s")
    hub = open_hub(cfg["hub"], cache_dir=cfg["cache"], **cfg["options"])
    m = MasterOuterLoop(hub, {"p": torch.full((8,), START)}, node_state_dir=cfg["state_dir"], holder="chaos-master",
                        aggregation="arrival", outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0,
                        lease_ttl=5.0, poll_interval=0.05, norm_global_ratio=None, norm_ratio=None, torch_threads=1)
    print("master up", flush=True)
    stop = Path(cfg["stop_file"])
    while not stop.exists():
        try:
            m.sync_once()
        except Exception as e:  # noqa: BLE001 - the store is failing on purpose: retry as diloco-master does
            print(f"master: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            time.sleep(0.5)
        time.sleep(0.05)
    m.close()


# ----------------------------------------------------------------------------- the stores and the processes


class Store:
    """The hub of ``kind`` (the loopback servers run in this process) and its outage switch."""

    def __init__(self, kind: str, tmp: Path, fault_rate: float, seed: int) -> None:
        from master_throughput import Stores

        self.kind, self.tmp = kind, tmp
        self.stores = Stores(tmp)
        self.stores.start([kind])
        self.url, self.options = self.stores.hub_spec(kind, "chaos")
        if kind == "file":
            self.options = {}
        if kind == "s3":
            self.options.update(max_retries=3, retry_base_delay=0.05, retry_max_delay=1.0)
            if fault_rate > 0:
                self.stores.proxy.random_faults(fault_rate, seed=seed, stall=2.0)
        if kind == "hf":
            self.options.update(max_retries=3, retry_base_delay=0.05, retry_max_delay=1.0, timeout=10)

    @property
    def can_fail(self) -> bool:
        return self.kind in ("s3", "hf")

    def set_down(self, down: bool) -> None:
        server = self.stores.proxy if self.kind == "s3" else self.stores.hf
        server.down = down

    def stop(self) -> None:
        self.stores.stop()


class Proc:
    """One role (the master or a worker) and its lives."""

    def __init__(self, name: str, argv_for_life, env: dict[str, str], logs: Path, spare: bool = False) -> None:
        self.name, self.argv_for_life, self.env, self.logs = name, argv_for_life, env, logs
        self.lives: list[dict[str, Any]] = []
        self.popen: subprocess.Popen | None = None
        self.done = False
        #: the next life started ahead of need (the product's ``supervise.spare``, app/supervise.py: Spare): its
        #: imports done, waiting for a go; its life is counted from the go. One per life: a spare that died is not
        #: started again before the next life
        self.with_spare = spare
        self.spare: Spare | None = None

    def prepare_spare(self) -> None:
        if self.with_spare and not self.done and self.spare is None:
            n = len(self.lives)  # the life it will be
            with open(self.logs / f"{self.name}.{n}.log", "w") as out:  # the child writes it
                self.spare = Spare(self.argv_for_life(n), stdout=out, stderr=subprocess.STDOUT, env=self.env)
                self.spare.prepare()

    def start(self) -> None:
        n = len(self.lives)
        spare, self.spare = self.spare, None
        woken = spare.take() if spare is not None else None
        if woken is not None:
            self.popen = woken
            self.lives.append({"start": time.monotonic(), "end": None, "how": None, "spare": True})
            return
        out = open(self.logs / f"{self.name}.{n}.log", "w")  # noqa: SIM115 - the child writes it
        self.popen = subprocess.Popen(self.argv_for_life(n), stdout=out, stderr=subprocess.STDOUT, env=self.env)
        out.close()
        self.lives.append({"start": time.monotonic(), "end": None, "how": None})

    def close_spare(self) -> None:
        spare, self.spare = self.spare, None
        if spare is not None:
            spare.close()

    def poll(self) -> int | None:
        if self.popen is None:
            return None
        rc = self.popen.poll()
        if rc is not None:
            self._ended("exit" if rc == 0 else f"rc {rc}")
        return rc

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        if self.alive():
            assert self.popen is not None
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait()
            self._ended("killed")

    def _ended(self, how: str) -> None:
        life = self.lives[-1]
        if life["end"] is None:
            life["end"], life["how"] = time.monotonic(), how
        self.popen = None

    def seconds(self) -> float:
        now = time.monotonic()
        return sum((life["end"] or now) - life["start"] for life in self.lives)


def _steps(path: Path) -> list[tuple[float, int]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            out.append((float(parts[0]), int(parts[1])))
    return out


def _trained_for(p: Proc, is_master: bool, logs: Path, now: float) -> float:
    """Seconds the current life of ``p`` has run (the master) or trained (a worker: since its first step,
    -1 before it; CLOCK_MONOTONIC is one clock for every process of the machine)."""
    if is_master:
        return now - p.lives[-1]["start"]
    steps = _steps(logs / f"{p.name}.{len(p.lives) - 1}.steps")
    return now - steps[0][0] if steps else -1.0


def _timeline(master: Proc, workers: list[Proc], lives: dict[tuple[str, int], list[tuple[float, int]]], t0: float,
              step_s: float) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Every life (seconds from the monkey's start) and where the workers' process seconds went
    (``lives``: each worker life's step log, by name and life).

    A worker life is ``start`` (its spawn, or its go when woken from a warm spare), ``first`` (its first
    inner step), ``last`` (its last), ``end`` (exit or kill, ``how``). Its seconds split into: start-up
    (``start`` to ``first``, and the first step's own time), training at the median step time, stalls (steps
    slower than that: boundaries that waited on the hub), replays (steps a life executed again after a kill:
    its first step is below the previous life's last + 1) and the tail (``last`` to ``end``: a killed life's
    unfinished step, or an exiting one's final flush). The losses over the workers' process seconds are 1 -
    time goodput, up to the applied steps that no life counted twice."""
    rows: list[dict[str, Any]] = []
    losses = {"startup": 0.0, "stalls": 0.0, "replays": 0.0, "tail": 0.0}
    for p in [master, *workers]:
        done = 0  # the highest global step a previous life of this worker executed
        for n, life in enumerate(p.lives):
            end = life["end"] if life["end"] is not None else time.monotonic()
            row: dict[str, Any] = {"who": p.name, "life": n, "start": round(life["start"] - t0, 2),
                                   "end": round(end - t0, 2), "how": life["how"] or "running",
                                   "spare": bool(life.get("spare"))}
            if p is not master:
                steps = lives[(p.name, n)]
                if steps:
                    first, last = steps[0], steps[-1]
                    replayed = sum(1 for _, g in steps if g <= done)
                    stall = sum(max(0.0, b[0] - a[0] - step_s) for a, b in zip(steps, steps[1:]))
                    row.update(first=round(first[0] - t0, 2), last=round(last[0] - t0, 2), steps=len(steps),
                               from_step=first[1], to_step=last[1], replayed=replayed,
                               startup_s=round(first[0] - life["start"], 2), stall_s=round(stall, 2),
                               tail_s=round(end - last[0], 2))
                    losses["startup"] += first[0] - life["start"]
                    losses["stalls"] += stall
                    losses["replays"] += replayed * step_s
                    losses["tail"] += end - last[0]
                    done = max(done, last[1])
                else:
                    row.update(steps=0, startup_s=round(end - life["start"], 2))
                    losses["startup"] += end - life["start"]
            rows.append(row)
    rows.sort(key=lambda r: r["start"])
    return rows, {k: round(v, 1) for k, v in losses.items()}


def _print_timeline(res: dict[str, Any]) -> None:
    print(f"{'who':>7} {'life':>4} {'start':>8} {'first':>8} {'last':>8} {'end':>8}  {'how':<8} {'spare':<5} "
          f"{'steps':>6} {'from':>6} {'replay':>6} {'startup':>7} {'stall':>6} {'tail':>6}")
    for r in res.get("timeline", []):
        print(f"{r['who']:>7} {r['life']:>4} {r['start']:>8} {r.get('first', ''):>8} {r.get('last', ''):>8} "
              f"{r['end']:>8}  {r['how']:<8} {str(r['spare']):<5} {r.get('steps', ''):>6} {r.get('from_step', ''):>6} "
              f"{r.get('replayed', ''):>6} {r.get('startup_s', ''):>7} {r.get('stall_s', ''):>6} {r.get('tail_s', ''):>6}")
    ws = res.get("worker_seconds") or 0
    if ws:
        print("losses (s, share of the workers' process seconds): " + ", ".join(
            f"{k} {v:g} ({v / ws:.3f})" for k, v in res.get("losses_s", {}).items()))


# ----------------------------------------------------------------------------- one run


def run(args) -> dict[str, Any]:
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
    store = Store(args.transport, tmp, args.fault_rate, args.seed)
    logs = tmp / "logs"
    logs.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1")
    env.pop("DILOCO_FAULTS", None)
    stop_file = tmp / "stop"
    mcfg = {"hub": store.url, "options": store.options, "cache": str(tmp / "master-cache"),
            "state_dir": str(tmp / "master"), "stop_file": str(stop_file)}
    master = Proc("master", lambda n: [sys.executable, str(Path(__file__).resolve()), "--role", "master", json.dumps(mcfg)],
                  env, logs)
    workers = []
    for i in range(args.workers):
        def argv(n: int, i: int = i) -> list[str]:
            cfg = {"hub": store.url, "hub_options": store.options or None, "node_id": f"w{i}",
                   "ckpt_dir": str(tmp / f"ckpt{i}"), "max_steps": args.steps, "inner_steps": args.inner_steps,
                   "throttle": args.throttle, "step_log": str(logs / f"w{i}.{n}.steps")}
            return [sys.executable, str(WORKER), json.dumps(cfg)]
        workers.append(Proc(f"w{i}", argv, env, logs, spare=args.spare))
    procs = [master, *workers]
    kills: dict[str, int] = {"master": 0, "worker": 0}
    landed: dict[str, int] = {}
    outage_kills, outages, outage_s = 0, 0, 0.0
    down_until: float | None = None
    lo, hi = (float(x) for x in args.kill_every.split(","))
    restart_at: dict[str, float] = {}
    result: dict[str, Any] = {"transport": args.transport, "workers": args.workers, "steps": args.steps,
                              "inner_steps": args.inner_steps, "seconds": args.seconds, "kill_every": args.kill_every,
                              "fault_rate": args.fault_rate, "outage_every": args.outage_every, "seed": args.seed,
                              "spare": args.spare}
    try:
        master.start()
        for w in workers:
            w.start()
        t0 = time.monotonic()
        next_kill = t0 + rng.uniform(lo, hi)
        next_outage = t0 + rng.expovariate(1 / args.outage_every) if args.outage_every and store.can_fail else None
        deadline = t0 + args.seconds + args.drain_timeout
        while True:
            now = time.monotonic()
            chaos = now - t0 < args.seconds
            for p in procs:
                rc = p.poll()
                if p is not master and rc == 0:
                    p.done = True
                elif rc is not None and rc != 0:  # it failed by itself (e.g. a wait timed out): restart it
                    restart_at.setdefault(p.name, now + args.restart_delay)
            for p in procs:
                if p.name in restart_at and now >= restart_at[p.name] and not p.alive() and not p.done:
                    del restart_at[p.name]
                    p.start()
                if p.alive() and p.with_spare and now - p.lives[-1]["start"] >= args.spare_after:
                    p.prepare_spare()
                elif p.done:
                    p.close_spare()
            if down_until is not None and now >= down_until:
                store.set_down(False)
                down_until = None
            if chaos and next_outage is not None and now >= next_outage and down_until is None:
                length = rng.uniform(args.outage_seconds / 3, args.outage_seconds)
                store.set_down(True)
                outages, outage_s = outages + 1, outage_s + length
                down_until = now + length
                next_outage = now + length + rng.expovariate(1 / args.outage_every)
            if chaos and now >= next_kill:
                live = [p for p in procs if p.alive() and _trained_for(p, p is master, logs, now) >= args.settle]
                if live:
                    victim = rng.choice(live)
                    kind = "master" if victim is master else "worker"
                    if kind == "worker":
                        steps = _steps(logs / f"{victim.name}.{len(victim.lives) - 1}.steps")
                        where = f"step {steps[-1][1] % args.inner_steps} of a phase" if steps else "before its first step"
                        landed[where] = landed.get(where, 0) + 1
                    victim.kill()
                    kills[kind] += 1
                    outage_kills += down_until is not None
                    restart_at[victim.name] = now + args.restart_delay
                    next_kill = now + rng.uniform(lo, hi)
                else:  # no life old enough yet: the kill waits for one
                    next_kill = now + 0.5
            if not chaos and down_until is None and all(w.done for w in workers):
                break
            if now >= deadline:
                result["timed_out"] = True
                break
            time.sleep(0.1)
        if down_until is not None:
            store.set_down(False)
        # the master applies what is left; then the oracle reads the hub
        if not master.alive():
            master.start()
        from diloco_lightning.hub import open_hub
        from diloco_lightning.hub.versions import load_global

        hub = open_hub(store.url, cache_dir=str(tmp / "oracle-cache"), **store.options)
        final = args.steps // args.inner_steps
        t_drain = time.monotonic() + 120
        manifest = None
        while time.monotonic() < t_drain:
            try:
                manifest = hub.read_manifest()
            except Exception:  # noqa: BLE001 - the store may still fail at random
                manifest = None
            if manifest is not None and all(manifest.ledger.get(w.name, -1) >= final for w in workers):
                break
            time.sleep(0.5)
        stop_file.touch()
        for _ in range(3):
            try:
                manifest, state = load_global(hub, hub.read_manifest())
                break
            except Exception:  # noqa: BLE001
                time.sleep(1)
        else:
            raise RuntimeError("the oracle could not read the global version")
        p = state["p"]
        applied = float(p[0]) - START
        expected = float(args.workers * args.steps)
        lives = {(w.name, n): _steps(logs / f"{w.name}.{n}.steps") for w in workers for n in range(len(w.lives))}
        executed = sum(len(steps) for steps in lives.values())
        intervals = [b[0] - a[0] for steps in lives.values() for a, b in zip(steps, steps[1:]) if b[1] == a[1] + 1]
        step_s = statistics.median(intervals) if intervals else float("nan")
        worker_s = sum(w.seconds() for w in workers)
        timeline, losses = _timeline(master, workers, lives, t0, step_s)
        result.update({
            "all_elements_equal": bool((p == p[0]).all()), "expected_steps": expected, "applied_steps": applied,
            "lost": max(0.0, expected - applied), "duplicated": max(0.0, applied - expected),
            "executed_steps": executed, "step_goodput": round(applied / executed, 4) if executed else None,
            "median_step_s": round(step_s, 4), "worker_seconds": round(worker_s, 1),
            "time_goodput": round(applied * step_s / worker_s, 4) if worker_s else None,
            "kills": kills, "kills_during_outage": outage_kills, "worker_kills_landed": landed,
            "outages": outages, "outage_seconds": round(outage_s, 1),
            "lives": {p.name: len(p.lives) for p in procs},
            "failed_lives": {p.name: [life["how"] for life in p.lives if life["how"] not in (None, "exit", "killed")]
                             for p in procs},
            "ledger": manifest.ledger, "outer_step": manifest.outer_step,
            "losses_s": losses, "timeline": timeline,
            "wall_s": round(time.monotonic() - t0, 1),
        })
    finally:
        stop_file.touch()
        for p in procs:
            if p.alive() and p is master:
                try:
                    assert p.popen is not None
                    p.popen.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
            p.kill()
            p.close_spare()
        store.stop()
        if args.keep:
            result["folder"] = str(tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="run", choices=["run", "master"])
    ap.add_argument("config", nargs="?", help=argparse.SUPPRESS)
    ap.add_argument("--transport", default="file", choices=["file", "s3", "hf"])
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=120.0, help="how long the monkey kills (and the store fails)")
    ap.add_argument("--steps", type=int, default=400, help="inner steps each worker does in all")
    ap.add_argument("--inner-steps", type=int, default=4, help="H, the inner steps of a phase")
    ap.add_argument("--throttle", type=float, default=0.2, help="seconds each inner step sleeps (a step's compute)")
    ap.add_argument("--kill-every", default="10,30", help="seconds between kills: a uniform draw in lo,hi")
    ap.add_argument("--restart-delay", type=float, default=1.0)
    ap.add_argument("--spare", action="store_true",
                    help="restart workers by waking a warm spare (started --spare-after seconds into each life, "
                         "its imports done; the product's supervise.spare): a life counts from its go")
    ap.add_argument("--spare-after", type=float, default=5.0)
    ap.add_argument("--settle", type=float, default=0.0,
                    help="a life is killed only once it has served (the master) or trained (a worker: since its first "
                    "step) this many seconds (0: any life, start-ups included; a Lightning worker's start-up takes "
                    "20 s and more on a loaded 2-core machine, so short intervals kill mostly start-ups)")
    ap.add_argument("--fault-rate", type=float, default=0.0, help="s3: share of requests failed at random")
    ap.add_argument("--outage-every", type=float, default=0.0, help="s3, hf: mean seconds between outages (0: none)")
    ap.add_argument("--outage-seconds", type=float, default=15.0, help="the longest outage (drawn in [1/3, 1] of it)")
    ap.add_argument("--drain-timeout", type=float, default=600.0, help="seconds after the kills for the run to end")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeline", action="store_true", help="print every life (start-up, stalls, replays, tail)")
    ap.add_argument("--keep", action="store_true", help="keep the run's folder (logs, hub)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "perf" / "chaos.json"))
    args = ap.parse_args(argv)
    if args.role == "master":
        master_main(json.loads(args.config))
        return 0
    res = run(args)
    if args.timeline:
        _print_timeline(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out.read_text()) if out.exists() else []
    results.append(res)
    out.write_text(json.dumps(results, indent=2))
    print(f"{res['transport']}: {res['workers']} workers x {res['steps']} steps, kills {res['kills']} "
          f"({res['kills_during_outage']} during {res['outages']} outages), lost {res['lost']:g}, duplicated "
          f"{res['duplicated']:g}, step goodput {res['step_goodput']}, time goodput {res['time_goodput']}, "
          f"worker kills landed {res['worker_kills_landed']}, wall {res['wall_s']} s", flush=True)
    return 0 if res["lost"] == 0 and res["duplicated"] == 0 and res.get("all_elements_equal") else 1


if __name__ == "__main__":
    raise SystemExit(main())
