"""What asynchrony buys with slow workers, under one budget of simulated time (issue 16's evidence, ``launch=sim``).

Four workers on the in-process simulator with per-worker speeds (``sim.speeds``: inner steps per
unit of simulated time), every run of a profile under the SAME budget of simulated time
(``sim.max_time``): the time synchronous DiLoCo needs for ``--rounds`` rounds (each round waits
for the slowest worker: ``H / min(speeds)``). Every worker keeps starting phases while they end
within the budget, so in the asynchronous runs the fast workers train ~3x the steps of the
synchronous run's. Configs:

* ``sync``: synchronous DiLoCo: ``diloco.sync=lockstep`` (delay 0), Nesterov (DiLoCo's outer
  optimizer); every round waits for the slowest worker.
* ``sync_cgad``: the same with CGAD (a control: the outer optimizer, not the waiting).
* ``async_nesterov``: ``diloco.sync=async``, one outer step per arriving delta
  (``master.aggregation=arrival``), Nesterov: nobody waits, stale deltas are not gated.
* ``async_cgad``: the same with CGAD (the staleness gate).
* ``async_cgad_dylu``: plus Dynamic Local Updates (``diloco.inner_steps=auto``, ``dylu_steps=H``):
  the slow workers take fewer inner steps per phase (arrival mode: each delta is its own outer step).
* ``async_cgad_q3``: CGAD in rounds of any 3 deltas (``aggregation=round``, ``sim.quorum=3``: the
  real master's quorum of 3 of 4 live workers), a fixed H.
* ``async_cgad_q3_dylu``: the same with DyLU and ``master.weighting=tokens`` (each delta weighted
  by its tokens in the round's mean).

Model (``--model study``, the default): ``benchmarks/study.py``'s (a Llama of d_model 96, 3
layers, UTF-8 bytes, sequences of 64, batch 8, AdamW lr 4e-3), ~4x cheaper per step than
``recipe=tiny``'s. ``trainer.max_steps`` (also the inner lr schedule's length) is, per config,
the steps its fastest worker can take in the budget (sync: ``rounds * H``; async: ``max_time *
max(speeds)``), as a user sizes a run.

Reported per profile (mean ± std over seeds): the final eval loss at the budget (equal time);
the simulated time each run first reaches the same seed's synchronous run's final loss
(interpolated between the evenly spaced evaluations) as a ratio of the budget; the eval loss at
the synchronous run's total tokens (the tokens of the deltas delivered to the master, interpolated
between evaluations); and, for each asynchronous config, the paired difference to ``sync`` per
seed with a 95 % t interval (n = number of seeds).

Phases: ``grid`` (every config at its default outer lr, every profile and seed), ``tune`` (seed 0,
the first profile: 3 outer lrs per config, the same budget for every method: Nesterov 0.1 / 0.3 /
0.7, CGAD 0.001 / 0.003 / 0.01), ``tuned`` (the other seeds of the first profile at each config's
tuned lr, the lowest final loss of ``tune``).

    python benchmarks/sim_stragglers.py                         # grid: 36 runs, 47 min on 2 cores at load 6-8
    python benchmarks/sim_stragglers.py --phases grid tune tuned --plot docs/figures/stragglers_sim_time.png
    python benchmarks/sim_stragglers.py --report                # the tables again from the finished runs

Runs go to ``bench_sim_stragglers/<profile>-<config>[-lr<lr>]-s<seed>/results.json`` (a finished
run is not run again); the tables are printed and written to ``bench_sim_stragglers/summary.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H = 8

PROFILES = {
    "one_4x_straggler": [1.0, 1.0, 1.0, 0.25],
    "spread": [1.0, 2 / 3, 1 / 2, 1 / 3],
}
CONFIGS = {
    "sync": ["diloco.sync=lockstep", "diloco.delay=0", "outer=nesterov"],
    "sync_cgad": ["diloco.sync=lockstep", "diloco.delay=0", "outer=cgad"],
    "async_nesterov": ["diloco.sync=async", "master.aggregation=arrival", "outer=nesterov"],
    "async_cgad": ["diloco.sync=async", "master.aggregation=arrival", "outer=cgad"],
    "async_cgad_dylu": ["diloco.sync=async", "master.aggregation=arrival", "outer=cgad", "diloco.inner_steps=auto",
                        f"diloco.dylu_steps={H}"],
    "async_cgad_q3": ["diloco.sync=async", "master.aggregation=round", "sim.quorum=3", "outer=cgad"],
    "async_cgad_q3_dylu": ["diloco.sync=async", "master.aggregation=round", "sim.quorum=3", "outer=cgad",
                           "diloco.inner_steps=auto", f"diloco.dylu_steps={H}", "master.weighting=tokens"],
}
LR_GRID = {"nesterov": (0.1, 0.3, 0.7), "cgad": (0.001, 0.003, 0.01)}
DEFAULT_LR = {"nesterov": 0.7, "cgad": 0.003}
MODELS = {
    "study": ["model.d_model=96", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=256",
              "data.tokenizer=byte", "data.max_bytes=2000000", "data.seq_len=64", "data.batch_size=8",
              "data.val_batches=24", "optim.lr=0.004", "optim.warmup_steps=20"],
    "tiny": [],
}
T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776}  # two-sided 95 % t quantiles by n (df = n - 1)


def outer_of(config: str) -> str:
    return "nesterov" if "nesterov" in config or config == "sync" else "cgad"


def budget(profile: str, rounds: int) -> float:
    """The synchronous run's simulated time: ``rounds`` rounds, each waiting for the slowest worker."""
    return rounds * (H / min(PROFILES[profile]))


def run_id(profile: str, config: str, seed: int, lr: float | None) -> str:
    return f"{profile}-{config}{'' if lr is None else f'-lr{lr:g}'}-s{seed}"


def overrides(profile: str, config: str, seed: int, lr: float | None, args) -> list[str]:
    speeds = ",".join(f"{s:.6g}" for s in PROFILES[profile])
    t = budget(profile, args.rounds)
    steps = args.rounds * H if config.startswith("sync") else math.ceil(t * max(PROFILES[profile]))
    return ["recipe=tiny", "launch=sim", "workers=4", f"diloco.inner_steps={H}", f"sim.speeds=[{speeds}]",
            *CONFIGS[config], *MODELS[args.model], *([f"outer.lr={lr}"] if lr is not None else []), f"seed={seed}",
            f"trainer.max_steps={steps}", f"sim.max_time={t:g}", f"launch.eval_points={args.eval_points}",
            f"run_root={args.out}", f"run_id={run_id(profile, config, seed, lr)}"]


def time_to(curve: list[list[float]], target: float) -> float | None:
    """The first x at which the curve ``[[x, loss], ...]`` reaches ``target`` (linear between points)."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            if l0 <= target:
                return t0
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def loss_at(curve: list[list[float]], x: float) -> float | None:
    """The loss at ``x`` on the curve ``[[x, loss], ...]``, linear between points (None past its end)."""
    for (x0, l0), (x1, l1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return l0 if x1 == x0 else l0 + (l1 - l0) * (x - x0) / (x1 - x0)
    return None


def run(ov: list[str], path: Path) -> bool:
    if path.is_file():
        return True
    print("$ python train.py " + " ".join(o for o in ov if not o.startswith("run_root")), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "train.py", *ov], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-1500:] + proc.stderr[-1500:], file=sys.stderr, flush=True)
        return False
    print(f"  {proc.stdout.strip().splitlines()[-1].split(' | /')[0][:200]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return True


def load(args, profile: str, config: str, seed: int, lr: float | None) -> dict | None:
    path = Path(args.out) / run_id(profile, config, seed, lr) / "results.json"
    return json.loads(path.read_text()) if path.is_file() else None


def tuned_lrs(args, configs: list[str]) -> dict[str, float]:
    """Each config's outer lr with the lowest final loss at seed 0 on the first profile (ties: the default)."""
    profile, out = args.profiles[0], {}
    for config in configs:
        scores = []
        for lr in LR_GRID[outer_of(config)]:
            r = load(args, profile, config, 0, None if lr == DEFAULT_LR[outer_of(config)] else lr)
            if r is not None and math.isfinite(r["eval_loss"]):
                scores.append((r["eval_loss"], lr))
        if scores:
            out[config] = min(scores)[1]
    return out


def row_stats(rows: list[dict], key: str) -> tuple[float, float]:
    xs = [x[key] for x in rows if x[key] is not None]
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def paired(rows: list[dict], ref: dict[int, dict], key: str) -> str:
    diffs = [x[key] - ref[x["seed"]][key] for x in rows if x["seed"] in ref and x[key] is not None
             and ref[x["seed"]][key] is not None]
    if len(diffs) < 2:
        return "" if not diffs else f"{diffs[0]:+.3f}"
    m, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = T95.get(len(diffs), 2.0) * sd / math.sqrt(len(diffs))
    return f"{m:+.3f} [{m - half:+.3f}, {m + half:+.3f}]"


def table(args, profile: str, configs: list[str], seeds: list[int], lrs: dict[str, float | None], title: str) -> list:
    """Print one profile's table; returns its rows."""
    t_budget = budget(profile, args.rounds)
    print(f"\n{title}: speeds {[round(s, 3) for s in PROFILES[profile]]} ({profile}); budget {t_budget:g} units of "
          f"simulated time ({args.rounds} synchronous rounds of H={H}); seeds {seeds}")
    print(f"{'config':<20} {'outer lr':>8} {'final loss (time)':>18} {'reach sync':>11} {'x budget':>9} "
          f"{'loss @ sync tokens':>19} {'tokens x sync':>13} | paired vs sync: final loss, loss @ sync tokens (95% CI)")
    ref: dict[int, dict] = {}
    out = []
    for config in configs:
        lr = lrs.get(config)
        rows = []
        for seed in seeds:
            r = load(args, profile, config, seed, lr if lr != DEFAULT_LR[outer_of(config)] else None)
            s = load(args, profile, "sync", seed, lrs.get("sync") if lrs.get("sync") != DEFAULT_LR["nesterov"] else None)
            if r is None or s is None:
                continue
            sync_tokens = s["sim"]["eval_curve_tokens"][-1][0]
            tokens = r["sim"]["eval_curve_tokens"]
            reach = time_to(r["sim"]["eval_curve_time"], s["eval_loss"])
            rows.append({"seed": seed, "loss": r["eval_loss"], "reach": reach,
                         "x_reach": None if reach is None else reach / t_budget,
                         "loss_tok": loss_at(tokens, sync_tokens), "x_tokens": tokens[-1][0] / sync_tokens,
                         "outer_steps": r["outer_steps"], "phase_steps": [sorted(set(p)) for p in r["sim"]["phase_steps"]]})
        if not rows:
            continue
        if config == "sync":
            ref = {x["seed"]: x for x in rows}
        (lm, ls), (rm, _), (xm, _), (tm, ts), (km, _) = (row_stats(rows, k) for k in
                                                          ("loss", "reach", "x_reach", "loss_tok", "x_tokens"))
        reached = sum(x["reach"] is not None for x in rows)
        used_lr = lr if lr is not None else DEFAULT_LR[outer_of(config)]
        print(f"{config:<20} {used_lr:>8g} {lm:>10.3f} ± {ls:<5.3f} {rm:>11.0f} {xm:>9.2f} {tm:>11.3f} ± {ts:<5.3f} "
              f"{km:>13.2f} | " + (f"{paired(rows, ref, 'loss')}, {paired(rows, ref, 'loss_tok')}" if config != "sync" else "")
              + "  per seed: " + " ".join(f"{x['loss']:.3f}" for x in rows)
              + " | x budget per seed: " + " ".join("-" if x["x_reach"] is None else f"{x['x_reach']:.2f}" for x in rows)
              + (f"  (reached sync's final loss in {reached}/{len(rows)})" if reached < len(rows) else ""))
        out.append({"profile": profile, "config": config, "outer_lr": used_lr, "budget": t_budget, "runs": rows})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=20, help="synchronous rounds the budget allows (20 x H=8: 160 steps)")
    ap.add_argument("--model", default="study", choices=list(MODELS), help="study: benchmarks/study.py's; tiny: recipe=tiny's")
    ap.add_argument("--eval-points", type=int, default=24, help="evaluations, evenly over the budget")
    ap.add_argument("--phases", nargs="+", default=["grid"], choices=["grid", "tune", "tuned"])
    ap.add_argument("--out", default=str(ROOT / "bench_sim_stragglers"))
    ap.add_argument("--report", action="store_true", help="run nothing: print the tables of the finished runs")
    ap.add_argument("--plot", default=None, help="write a PNG of eval loss against simulated time (seed 0) here")
    args = ap.parse_args(argv)
    out = Path(args.out)
    started = time.perf_counter()
    if not args.report:
        if "grid" in args.phases:
            for profile in args.profiles:
                for seed in args.seeds:
                    for config in args.configs:
                        run(overrides(profile, config, seed, None, args), out / run_id(profile, config, seed, None) / "results.json")
        if "tune" in args.phases:
            for config in args.configs:
                for lr in LR_GRID[outer_of(config)]:
                    if lr != DEFAULT_LR[outer_of(config)]:
                        p = args.profiles[0]
                        run(overrides(p, config, 0, lr, args), out / run_id(p, config, 0, lr) / "results.json")
        if "tuned" in args.phases:
            for config, lr in tuned_lrs(args, args.configs).items():
                if lr != DEFAULT_LR[outer_of(config)]:
                    p = args.profiles[0]
                    for seed in args.seeds[1:]:
                        run(overrides(p, config, seed, lr, args), out / run_id(p, config, seed, lr) / "results.json")
        print(f"runs took {time.perf_counter() - started:.0f} s", flush=True)
    summary = []
    for profile in args.profiles:
        summary += table(args, profile, args.configs, args.seeds, {}, "default outer lrs (Nesterov 0.7, CGAD 0.003)")
    tuned = tuned_lrs(args, args.configs)
    if any(load(args, args.profiles[0], c, 0, lr) is not None for c in args.configs for lr in LR_GRID[outer_of(c)]
           if lr != DEFAULT_LR[outer_of(c)]):  # the tuning ran
        print(f"\ntuned outer lrs (seed 0, {args.profiles[0]}, grid {LR_GRID}): {tuned}")
        summary += table(args, args.profiles[0], args.configs, args.seeds, dict(tuned), "tuned outer lrs")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"tuned_lrs": tuned, "tables": summary}, indent=1))
    if args.plot:
        plot(args, Path(args.plot))
    return 0


def plot(args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = min(args.seeds)
    fig, axes = plt.subplots(1, len(args.profiles), figsize=(5.8 * len(args.profiles), 4.2), squeeze=False)
    for ax, profile in zip(axes[0], args.profiles):
        for config in args.configs:
            r = load(args, profile, config, seed, None)
            if r is None:
                continue
            t, loss = zip(*r["sim"]["eval_curve_time"])
            ax.plot(t, loss, marker=".", label=config, linestyle="--" if config.startswith("sync") else "-")
        s = load(args, profile, "sync", seed, None)
        if s is not None:
            ax.axhline(s["eval_loss"], color="gray", linewidth=0.8)
        ax.set_title(f"speeds {[round(v, 2) for v in PROFILES[profile]]}, seed {seed}, default outer lrs")
        ax.set_xlabel("simulated time (inner steps of a speed-1 worker)")
        ax.set_ylabel("eval loss of the global model")
        lows = [r["eval_loss"] for c in args.configs if (r := load(args, profile, c, seed, None)) is not None]
        if lows:
            ax.set_ylim(min(lows) - 0.1, min(lows) + 2.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
