"""Inner steps per second: the simulator (``launch=sim``) against the multi-process run (``launch=local``).

The same recipe (default ``recipe=tiny``: 2 workers, H = 8, 160 steps each; ``--model study``: the
staleness study's model and data, 4 workers, 200 steps each), run alternately with each launcher,
``--repeat`` times, each in a fresh ``train.py`` process (the tokenizer and token cache built once
beforehand, so neither pays for it). The simulator runs twice: unbatched (``sim``:
``sim.batched=false``, the workers' phases on threads, the default on a CPU) and batched
(``sim-batched``: ``sim.batched=true``, the default on a GPU). Two figures per run:

* end to end: ``workers * max_steps`` over the wall time of the whole ``train.py`` command
  (start-up, data, evaluation and results included): what a user waits for;
* in-run: the same over the run's own ``wall_seconds`` (``results.json``);
* per CPU second: the same over the CPU time (user + system) of the whole ``train.py`` process
  tree: what the cores buy, whatever else runs on them. Each launcher keeps both cores of an idle
  2-core machine busy, so there the wall-clock ratio tends to this one; on a shared machine the
  wall clock measures the load as much as the launcher (the multi-process run's most).

    python benchmarks/sim_speed.py                       # tiny recipe, 2 repeats
    python benchmarks/sim_speed.py --repeat 3 -- workers=4 trainer.max_steps=64

Prints one line per run, then the medians and the ratio sim / local. Figures: docs/simulator.md.

``--ceiling`` adds a third figure, the most any in-process launcher could reach here: the bare
inner step (the product's model, batches, AdamW, clipping and schedule, built by the same
functions as ``launch=sim``: forward, backward, clip, step, nothing else) of ``min(workers,
cores)`` workers side by side on threads, one intra-op thread each, as the simulator runs them.
Its ratio to the multi-process run bounds the simulator's speed-up on this machine.

    python benchmarks/sim_speed.py --repeat 2 --ceiling
    python benchmarks/sim_speed.py --model study --repeat 3 --ceiling
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: ``--model study``: the staleness study's setting (benchmarks/study.py), 4 workers, 200 inner steps each
STUDY = ["workers=4", "data.tokenizer=byte", "data.max_bytes=2000000", "data.seq_len=64", "data.batch_size=8",
         "model.d_model=96", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=256",
         "optim.lr=0.004", "optim.warmup_steps=20", "trainer.max_steps=200"]
LAUNCHES = {"local": ["launch=local"], "sim": ["launch=sim", "sim.batched=false"], "sim-batched": ["launch=sim", "sim.batched=true"]}


def _run(args: list[str], root: Path, env: dict) -> tuple[float, dict]:
    t0, c0 = time.perf_counter(), _children_cpu()
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, f"run_root={root}"], cwd=root, env=env,
                          capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    if proc.returncode:
        raise SystemExit(f"train.py {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    run_id = next(a.split("=", 1)[1] for a in args if a.startswith("run_id="))
    return wall, cpu, json.loads((root / run_id / "results.json").read_text())


def _children_cpu() -> float:
    """CPU seconds (user + system) of every finished child process tree (train.py waits for the
    multi-process run's master and workers, so theirs are in it)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _ceiling(overrides: list[str], root: Path, steps: int = 24) -> tuple[float, float]:
    """Inner steps per second of bare inner loops, ``min(workers, cores)`` on threads (see the
    docstring), and per CPU second of this process."""
    import threading

    import torch
    from hydra import compose, initialize_config_dir

    from diloco_lightning.app.config import CONFIG_DIR, register_configs, validate
    from diloco_lightning.app.sim import build_worker

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = validate(compose(config_name="train", overrides=[*overrides, f"run_root={root}", "run_id=ceiling"]))
    torch.set_num_threads(1)
    n = max(1, min(int(cfg.workers), os.cpu_count() or 1))
    workers = [build_worker(cfg, i, torch.device("cpu")) for i in range(n)]
    for w in workers:  # warm-up: first-call allocations and the data loader's start
        for _ in range(2):
            w.inner.step()
    barrier = threading.Barrier(n + 1)

    def loop(w) -> None:
        barrier.wait()
        for _ in range(steps):
            w.inner.step()

    threads = [threading.Thread(target=loop, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    barrier.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.join()
    return n * steps / (time.perf_counter() - t0), n * steps / (time.process_time() - c0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--model", choices=("recipe", "study"), default="recipe",
                    help="study: the staleness study's model and data (4 workers, 200 steps)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ceiling", action="store_true", help="also time the bare inner loops (the in-process bound)")
    ap.add_argument("overrides", nargs="*", help="more train.py overrides (after --)")
    a = ap.parse_args(argv)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    common = [f"recipe={a.recipe}", *(STUDY if a.model == "study" else []), *a.overrides]
    rows: dict[str, list[tuple[float, float, float]]] = {k: [] for k in LAUNCHES}
    bare: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="sim_speed_") as tmp:
        root = Path(tmp)
        env.setdefault("DILOCO_CACHE_DIR", str(root / "cache"))
        print(f"# {' '.join(common)}; load average {os.getloadavg()[0]:.2f}", flush=True)
        _run([*common, "launch=sim", "trainer.max_steps=8", "run_id=warm"], root, env)  # builds the data cache once
        for i in range(a.repeat):
            for launch, extra in LAUNCHES.items():
                wall, cpu, res = _run([*common, *extra, f"run_id={launch}{i}"], root, env)
                steps = res["workers"] * res["max_steps"]
                rows[launch].append((steps / wall, steps / res["wall_seconds"], steps / cpu))
                print(f"{launch:8} run {i}: {steps} inner steps, command {wall:6.1f} s -> {steps / wall:6.1f} steps/s end to end, "
                      f"{steps / res['wall_seconds']:6.1f} steps/s in-run, {steps / cpu:6.2f} per CPU second end to end; "
                      f"eval loss {res['eval_loss']:.3f}; load {os.getloadavg()[0]:.1f}", flush=True)
            if a.ceiling:
                bare.append(_ceiling(common, root))
                print(f"bare  run {i}: {bare[-1][0]:6.1f} steps/s, {bare[-1][1]:6.2f} per CPU second (inner steps only, "
                      "no launcher)", flush=True)
    med = {k: tuple(statistics.median(r[i] for r in v) for i in range(3)) for k, v in rows.items()}
    # per CPU second: what the machine's cores buy, whatever else runs on them. Each launcher keeps
    # both cores of an idle 2-core machine busy (the multi-process run with its processes, the
    # simulator with min(workers, cores) threads), so there the wall-clock ratio tends to this one;
    # on a loaded machine the wall clock measures the load as much as the launcher
    for i, what in ((0, "end to end"), (1, "in-run"), (2, "per CPU second, end to end")):
        print(f"# median {what:10}: local {med['local'][i]:.1f}, sim {med['sim'][i]:.1f}, sim-batched "
              f"{med['sim-batched'][i]:.1f} steps/s: sim / local = {med['sim'][i] / med['local'][i]:.1f}x, "
              f"sim-batched / local = {med['sim-batched'][i] / med['local'][i]:.1f}x, "
              f"sim-batched / sim = {med['sim-batched'][i] / med['sim'][i]:.2f}x")
    if bare:
        b, bc = statistics.median(x for x, _ in bare), statistics.median(y for _, y in bare)
        print(f"# median bare inner loops: {b:.1f} steps/s: bare / local (in-run) = {b / med['local'][1]:.1f}x, "
              f"sim / bare = {med['sim'][1] / b:.2f}; per CPU second {bc:.2f}: bare / local = {bc / med['local'][2]:.1f}x, "
              f"sim-batched / bare = {med['sim-batched'][2] / bc:.2f}")
    print(f"# load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
