"""Inner steps per second: the simulator (``launch=sim``) against the multi-process run (``launch=local``).

The same recipe (default ``recipe=tiny``: 2 workers, H = 8, 160 steps each), run alternately with
each launcher, ``--repeat`` times, each in a fresh ``train.py`` process (the tokenizer and token
cache built once beforehand, so neither pays for it). Two figures per run:

* end to end: ``workers * max_steps`` over the wall time of the whole ``train.py`` command
  (start-up, data, evaluation and results included): what a user waits for;
* in-run: the same over the run's own ``wall_seconds`` (``results.json``).

    python benchmarks/sim_speed.py                       # tiny recipe, 2 repeats
    python benchmarks/sim_speed.py --repeat 3 -- workers=4 trainer.max_steps=64

Prints one line per run, then the medians and the ratio sim / local. Figures: docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], root: Path, env: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, f"run_root={root}"], cwd=root, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"train.py {' '.join(args)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    run_id = next(a.split("=", 1)[1] for a in args if a.startswith("run_id="))
    return wall, json.loads((root / run_id / "results.json").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("overrides", nargs="*", help="more train.py overrides (after --)")
    a = ap.parse_args(argv)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    common = [f"recipe={a.recipe}", *a.overrides]
    rows: dict[str, list[tuple[float, float]]] = {"local": [], "sim": []}
    with tempfile.TemporaryDirectory(prefix="sim_speed_") as tmp:
        root = Path(tmp)
        env.setdefault("DILOCO_CACHE_DIR", str(root / "cache"))
        print(f"# {' '.join(common)}; load average {os.getloadavg()[0]:.2f}", flush=True)
        _run([*common, "launch=sim", "trainer.max_steps=8", "run_id=warm"], root, env)  # builds the data cache once
        for i in range(a.repeat):
            for launch in ("local", "sim"):
                wall, res = _run([*common, f"launch={launch}", f"run_id={launch}{i}"], root, env)
                steps = res["workers"] * res["max_steps"]
                rows[launch].append((steps / wall, steps / res["wall_seconds"]))
                print(f"{launch:5} run {i}: {steps} inner steps, command {wall:6.1f} s -> {steps / wall:6.1f} steps/s end to end, "
                      f"{steps / res['wall_seconds']:6.1f} steps/s in-run; eval loss {res['eval_loss']:.3f}", flush=True)
    med = {k: (statistics.median(x for x, _ in v), statistics.median(y for _, y in v)) for k, v in rows.items()}
    print(f"# median end to end: local {med['local'][0]:.1f}, sim {med['sim'][0]:.1f} steps/s: "
          f"sim / local = {med['sim'][0] / med['local'][0]:.1f}x")
    print(f"# median in-run:     local {med['local'][1]:.1f}, sim {med['sim'][1]:.1f} steps/s: "
          f"sim / local = {med['sim'][1] / med['local'][1]:.1f}x")
    print(f"# load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
