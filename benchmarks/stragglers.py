"""What asynchrony buys with a straggler: a real multi-process run (issue 16), synchronous vs asynchronous.

Four workers, one of them ``--slow`` times slower (``diloco.throttle``: every worker sleeps
``--throttle`` seconds per inner step, the straggler ``slow x`` that, so the step time is the
sleep and the comparison does not depend on how busy the machine's cores are). Each run trains
for the same wall time (``trainer.max_time``), with the real product (``python train.py``: a master
thread, four worker processes, a folder hub), and reports the tokens per second of the whole run
and the final eval loss of the global model:

* ``sync``: synchronous DiLoCo: ``sync=lockstep`` (delay 0), the master's quorum every live worker
  (``master.min_deltas=1.0``): everyone waits for the straggler at every round.
* ``async``: ``sync=async``, quorum 3 of 4 live workers (``min_deltas=0.75``) with the adaptive
  deadline (``max_wait=auto``): nobody waits; the straggler's deltas arrive late and are gated by
  their staleness (CGAD).
* ``async_dylu``: the same plus Dynamic Local Updates (``inner_steps=auto``, the fastest worker's H
  is ``--h``) and ``weighting=tokens``: the straggler does fewer inner steps per delta, so its
  deltas arrive with the others' and weigh what they hold.
* ``sync_nesterov``, ``async_nesterov``, ``async_dylu_nesterov`` (``--configs ...``): the same three
  with DiLoCo's Nesterov outer step (``outer=nesterov``) instead of CGAD.

The default three use the same outer optimizer (the ``tiny`` recipe's CGAD), and every run the same learning-rate
schedule (``trainer.max_steps`` far beyond what ``max_time`` allows, so the cosine decay is flat).

    python benchmarks/stragglers.py                       # 3 runs x (--seconds + ~25 s start-up), ~5 min on 2 cores
    python benchmarks/stragglers.py --seconds 30 --dry-run  # print the train.py commands only
    python benchmarks/stragglers.py --report              # the table again from the finished runs

Runs go to ``bench_stragglers/<config>-s<seed>/`` (each with its ``results.json`` and the master's
``metrics.jsonl``); a finished run is not run again. The table is printed and written to
``bench_stragglers/summary.json``.
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

#: a small model on a small vocabulary (0.25 M parameters), so that four workers fit two cores
COMMON = [
    "recipe=tiny",
    "workers=4",
    "model.d_model=64",
    "model.ffn_hidden=172",
    "data.max_bytes=2000000",
    "data.seq_len=64",
    "data.vocab_size=1024",
    "data.batch_size=8",
    "trainer.max_steps=100000",  # max_time ends every run: a flat cosine schedule, the same for all
    "trainer.num_threads=1",
    "trainer.log_every_n_steps=8",
    "launch.eval_points=0",
    "diloco.claim_ttl=10",  # heartbeats every 5 s: the master and DyLU see the workers' speeds quickly
    "diloco.wait_timeout=300",
]

SYNC = ["diloco.sync=lockstep", "diloco.delay=0", "master.min_deltas=1.0"]
ASYNC = ["diloco.sync=async", "master.min_deltas=0.75", "master.max_wait=auto"]
DYLU = ["diloco.inner_steps=auto", "master.weighting=tokens"]
CONFIGS: dict[str, list[str]] = {
    "sync": SYNC,
    "async": ASYNC,
    "async_dylu": ASYNC + DYLU,
    # DiLoCo's own outer optimizer (Nesterov, lr 0.7, momentum 0.9), for the same comparison
    "sync_nesterov": SYNC + ["outer=nesterov"],
    "async_nesterov": ASYNC + ["outer=nesterov"],
    "async_dylu_nesterov": ASYNC + DYLU + ["outer=nesterov"],
}
DEFAULT_CONFIGS = ("sync", "async", "async_dylu")


def overrides(config: str, args: argparse.Namespace, seed: int) -> list[str]:
    t = args.throttle
    throttle = "[" + ",".join(f"{x:g}" for x in (t, t, t, t * args.slow)) + "]"
    return [*COMMON, *CONFIGS[config], f"diloco.inner_steps={args.h}" if "dylu" not in config else "",
            f"diloco.dylu_steps={args.h}", f"diloco.throttle={throttle}", f"trainer.max_time={args.seconds:g}",
            f"outer.lr={args.outer_lr:g}" if args.outer_lr is not None else "",
            f"seed={seed}", f"run_root={args.out}", f"run_id={config}-s{seed}"]


def run(config: str, args: argparse.Namespace, seed: int) -> Path:
    rdir = Path(args.out) / f"{config}-s{seed}"
    cmd = [sys.executable, str(ROOT / "train.py"), *[o for o in overrides(config, args, seed) if o]]
    print("$ python train.py " + " ".join(cmd[2:]), flush=True)
    if args.dry_run or args.report or (rdir / "results.json").is_file():
        return rdir
    rdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(rdir.parent / f"{rdir.name}.log", "w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, check=False)
    print(f"  exit {proc.returncode} after {time.time() - t0:.0f} s (log: {rdir.parent / (rdir.name + '.log')})", flush=True)
    return rdir


def summarize(rdir: Path) -> dict | None:
    try:
        res = json.loads((rdir / "results.json").read_text())
    except (OSError, ValueError):
        return None
    workers = res["workers_summary"]
    train_wall = max(w["wall_seconds"] for w in workers)  # the training window (fit() of the longest worker)
    rounds = []
    metrics = rdir / "master" / "metrics.jsonl"
    if metrics.is_file():
        rounds = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    hist: dict[int, int] = {}
    applied: dict[str, int] = {}
    for r in rounds:
        for k, v in (r.get("staleness_histogram") or {}).items():
            hist[int(k)] = hist.get(int(k), 0) + v
        for a in r.get("applied") or []:
            node = a.split("/")[0]
            applied[node] = applied.get(node, 0) + 1
    n = sum(hist.values())
    return {
        "run": rdir.name,
        "eval_loss": res["eval_loss"],
        "final_train_loss": res["final_train_loss"],
        "outer_steps": res["outer_steps"],
        "tokens": res["tokens"],
        "wall_seconds": res["wall_seconds"],
        "train_seconds": train_wall,
        "tokens_per_second": res["tokens"] / train_wall if train_wall > 0 else math.nan,
        "tokens_per_second_incl_startup": res["tokens_per_second"],
        "steps": {w["node_id"]: w["steps"] for w in workers},
        "deltas_applied": applied,
        "mean_staleness": sum(k * v for k, v in hist.items()) / n if n else math.nan,
        "staleness_histogram": dict(sorted(hist.items())),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="training wall time of every run (trainer.max_time)")
    ap.add_argument("--throttle", type=float, default=0.1, help="seconds slept per inner step by a normal worker")
    ap.add_argument("--slow", type=float, default=4.0, help="how many times slower the straggler is")
    ap.add_argument("--h", type=int, default=8, help="inner steps H (DyLU: the fastest worker's)")
    ap.add_argument("--outer-lr", type=float, default=None, help="outer.lr of every run (default: the outer group's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--out", default=str(ROOT / "bench_stragglers"))
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--report", action="store_true", help="only print the table of finished runs")
    args = ap.parse_args()
    rows = []
    for seed in args.seeds:
        for config in args.configs:
            rdir = run(config, args, seed)
            s = None if args.dry_run else summarize(rdir)
            if s is not None:
                rows.append({"config": config, "seed": seed, **s})
    if not rows:
        return 0
    base = {(r["seed"], "nesterov" in r["config"]): r for r in rows if r["config"].startswith("sync")}
    print(f"\n4 workers, throttle {args.throttle:g} s/step, one {args.slow:g}x slower; {args.seconds:g} s of training "
          f"per run; H={args.h}\n")
    print(f"{'config':<20} {'seed':>4} {'tokens/s':>9} {'x sync':>7} {'tokens':>8} {'outer':>6} {'staleness':>9} "
          f"{'eval loss':>9} {'train loss':>10}  straggler deltas / steps")
    for r in rows:
        b = base.get((r["seed"], "nesterov" in r["config"]))
        ratio = r["tokens_per_second"] / b["tokens_per_second"] if b else math.nan
        slow = r["deltas_applied"].get("w3", 0)
        print(f"{r['config']:<20} {r['seed']:>4} {r['tokens_per_second']:>9.0f} {ratio:>7.2f} {r['tokens']:>8} "
              f"{r['outer_steps']:>6} {r['mean_staleness']:>9.2f} {r['eval_loss']:>9.3f} {r['final_train_loss']:>10.3f}"
              f"  {slow} / {r['steps'].get('w3')}")
    if len(args.seeds) > 1:
        for config in args.configs:
            xs = [r["eval_loss"] for r in rows if r["config"] == config]
            if len(xs) > 1:
                print(f"{config}: eval loss {statistics.mean(xs):.3f} +- {statistics.stdev(xs):.3f} over {len(xs)} seeds")
    out = Path(args.out) / "summary.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"\n{out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
