"""What asynchrony buys with slow workers, in simulated wall time (issue 16's evidence, on ``launch=sim``).

Four workers of ``recipe=tiny`` on the in-process simulator, with per-worker speeds
(``sim.speeds``: inner steps per unit of simulated time, relative), for each speed profile and seed:

* ``sync``: synchronous DiLoCo: ``diloco.sync=lockstep`` (delay 0), Nesterov (DiLoCo's outer
  optimizer); every round waits for the slowest worker.
* ``sync_cgad``: the same synchronous run with CGAD (a control: the outer optimizer, not the waiting).
* ``async_nesterov``: ``diloco.sync=async``, one outer step per arriving delta
  (``master.aggregation=arrival``), Nesterov: nobody waits, stale deltas are not gated.
* ``async_cgad``: the same with CGAD (the staleness gate).
* ``async_cgad_q3``: asynchronous CGAD with rounds of 3 deltas (``master.aggregation=round``,
  ``sim.quorum=3``: whichever 3 arrive first; the master of ``benchmarks/stragglers.py`` uses a
  quorum of 3 of 4 live workers), so that each outer step averages deltas as DiLoCo's does.

Every run trains each worker for the same number of inner steps (``trainer.max_steps``), so the
totals of tokens are equal; the fast workers of an asynchronous run finish early. Reported per
profile (mean over seeds, and each seed): the simulated time the run took, the final eval loss
(equal tokens), the simulated time at which the run first reached the synchronous run's final
loss (same seed; interpolated between evaluations), its ratio to the synchronous run's time, and
the eval loss at the time the synchronous run needed for a quarter / half of its rounds.

Dynamic Local Updates are not simulated (``launch=sim`` refuses ``inner_steps=auto``): the real
multi-process comparison with DyLU is ``benchmarks/stragglers.py``.

    python benchmarks/sim_stragglers.py                     # 2 profiles x 3 configs x 3 seeds, ~25 min on 2 cores
    python benchmarks/sim_stragglers.py --seeds 0 --configs sync async_cgad
    python benchmarks/sim_stragglers.py --report            # the table again from the finished runs

Runs go to ``bench_sim_stragglers/<profile>-<config>-s<seed>/results.json`` (a finished run is not
run again); the table is printed and written to ``bench_sim_stragglers/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROFILES = {
    "one_4x_straggler": [1.0, 1.0, 1.0, 0.25],
    "spread": [1.0, 2 / 3, 1 / 2, 1 / 3],
}
CONFIGS = {
    "sync": ["diloco.sync=lockstep", "diloco.delay=0", "outer=nesterov"],
    "sync_cgad": ["diloco.sync=lockstep", "diloco.delay=0", "outer=cgad"],
    "async_nesterov": ["diloco.sync=async", "master.aggregation=arrival", "outer=nesterov"],
    "async_cgad": ["diloco.sync=async", "master.aggregation=arrival", "outer=cgad"],
    "async_cgad_q3": ["diloco.sync=async", "master.aggregation=round", "sim.quorum=3", "outer=cgad"],
}


def overrides(profile: str, config: str, seed: int, steps: int, out: Path) -> list[str]:
    speeds = ",".join(f"{s:.6g}" for s in PROFILES[profile])
    return ["recipe=tiny", "launch=sim", "workers=4", f"sim.speeds=[{speeds}]", *CONFIGS[config], f"seed={seed}",
            f"trainer.max_steps={steps}", "launch.eval_points=24", f"run_root={out}", f"run_id={profile}-{config}-s{seed}"]


def time_to(curve: list[list[float]], target: float) -> float | None:
    """The first simulated time the eval curve reaches ``target`` (linear between evaluations)."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            if l0 <= target:
                return t0
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def loss_at(curve: list[list[float]], t: float) -> float:
    """The eval loss of the newest version at simulated time ``t`` (a step function)."""
    best = curve[0][1]
    for ti, li in curve:
        if ti <= t:
            best = li
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=160, help="inner steps per worker (the tiny recipe's 160)")
    ap.add_argument("--out", default=str(ROOT / "bench_sim_stragglers"))
    ap.add_argument("--report", action="store_true", help="run nothing: print the table of the finished runs")
    ap.add_argument("--plot", default=None, help="write a PNG of eval loss against simulated time (seed 0) here")
    args = ap.parse_args(argv)
    out = Path(args.out)
    results: dict[tuple[str, str, int], dict] = {}
    for profile in args.profiles:
        for seed in args.seeds:
            for config in args.configs:
                ov = overrides(profile, config, seed, args.steps, out)
                path = out / f"{profile}-{config}-s{seed}" / "results.json"
                if not path.is_file() and not args.report:
                    print("$ python train.py " + " ".join(o for o in ov if not o.startswith("run_root")), flush=True)
                    proc = subprocess.run([sys.executable, "train.py", *ov], cwd=ROOT, capture_output=True, text=True)
                    if proc.returncode != 0:
                        print(proc.stdout[-1500:] + proc.stderr[-1500:], file=sys.stderr)
                        continue
                if path.is_file():
                    results[(profile, config, seed)] = json.loads(path.read_text())
    summary = []
    for profile in args.profiles:
        print(f"\nspeeds {PROFILES[profile]} ({profile}); 4 workers x {args.steps} inner steps each, recipe=tiny, launch=sim")
        print(f"{'config':<16} {'seeds':>5} {'sim time':>9} {'x sync':>7} {'final loss':>11} {'reach sync':>11} "
              f"{'x sync':>7} {'loss @ sync/4':>14} {'loss @ sync/2':>14}  per seed: final loss")
        for config in args.configs:
            rows = []
            for seed in args.seeds:
                r, s = results.get((profile, config, seed)), results.get((profile, "sync", seed))
                if r is None or s is None:
                    continue
                curve, sync_curve = r["sim"]["eval_curve_time"], s["sim"]["eval_curve_time"]
                t_sync = s["sim"]["sim_time"]
                reach = time_to(curve, s["eval_loss"])
                rows.append({"seed": seed, "time": r["sim"]["sim_time"], "x_time": r["sim"]["sim_time"] / t_sync,
                             "loss": r["eval_loss"], "reach": reach, "x_reach": None if reach is None else reach / t_sync,
                             "q": loss_at(curve, t_sync / 4), "h": loss_at(curve, t_sync / 2),
                             "sync_q": loss_at(sync_curve, t_sync / 4), "diverged": r["diverged"]})
            if not rows:
                continue
            m = lambda k, rows=rows: statistics.fmean(x[k] for x in rows if x[k] is not None) if any(x[k] is not None for x in rows) else float("nan")  # noqa: E731
            sd = statistics.stdev([x["loss"] for x in rows]) if len(rows) > 1 else 0.0
            reached = sum(x["reach"] is not None for x in rows)
            print(f"{config:<16} {len(rows):>5} {m('time'):>9.0f} {m('x_time'):>7.2f} {m('loss'):>6.3f}±{sd:<4.2f} "
                  f"{m('reach'):>11.0f} {m('x_reach'):>7.2f} {m('q'):>14.3f} {m('h'):>14.3f}  "
                  + " ".join(f"{x['loss']:.3f}" for x in rows)
                  + (f"  (reached sync's loss in {reached}/{len(rows)})" if reached < len(rows) else ""))
            summary.append({"profile": profile, "config": config, "runs": rows})
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot(results, args.profiles, args.configs, min(args.seeds), Path(args.plot))
    return 0


def plot(results: dict, profiles: list[str], configs: list[str], seed: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(profiles), figsize=(5.5 * len(profiles), 4), squeeze=False)
    for ax, profile in zip(axes[0], profiles):
        for config in configs:
            r = results.get((profile, config, seed))
            if r is None:
                continue
            t, loss = zip(*r["sim"]["eval_curve_time"])
            ax.plot(t, loss, marker=".", label=config)
        ax.set_title(f"speeds {[round(s, 2) for s in PROFILES[profile]]}, seed {seed}")
        ax.set_xlabel("simulated wall time (inner steps of a speed-1 worker)")
        ax.set_ylabel("eval loss of the global model")
        ax.set_ylim(top=min(9.0, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
