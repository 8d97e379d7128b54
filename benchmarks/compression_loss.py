"""Final eval loss of each pseudo-gradient encoding, with and without error feedback, against float32.

Real runs (issue 14's loss evidence until the in-process simulator exists): ``python train.py
recipe=tiny`` (2 workers, H = 8, lockstep, CGAD, 160 inner steps per worker, folder hub) with
``diloco.delta_dtype`` and ``diloco.error_feedback`` set per row, for each seed and staleness
``diloco.delay`` (tau). Each run's ``results.json`` gives the final eval loss of the global model;
the table reports per row and tau the mean and spread over seeds and the mean difference to
float32 of the same seeds (paired: the seed fixes the data order and the initial weights).

    python benchmarks/compression_loss.py                          # every row, seeds 0 1 2, tau 0
    python benchmarks/compression_loss.py --taus 0,4 --seeds 0,1,2
    python benchmarks/compression_loss.py --rows float32,int8,int4 --seeds 0 --max-steps 32   # a smoke run

Runs already in ``--out`` (a JSON file, default ``runs/perf/compression_loss.json``) are not run
again, so an interrupted study resumes; ``benchmarks/run_all.py`` reads that file for the loss
column of ``docs/performance.md``'s compression table. Targets (issue 14): int8 within the seed
noise of float32; int4 with error feedback within 0.02 nats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trainrun import train_results

ROOT = Path(__file__).resolve().parents[1]

#: row name -> train.py overrides
ROWS = {
    "float32": ["diloco.delta_dtype=float32"],
    "bfloat16": ["diloco.delta_dtype=bfloat16"],
    "int8+ef": ["diloco.delta_dtype=int8", "diloco.error_feedback=true"],
    "int8": ["diloco.delta_dtype=int8", "diloco.error_feedback=false"],
    "int4+ef": ["diloco.delta_dtype=int4", "diloco.error_feedback=true"],
    "int4": ["diloco.delta_dtype=int4", "diloco.error_feedback=false"],
    "topk1%+int4+ef": ["diloco.delta_dtype=topk", "diloco.topk=0.01", "diloco.topk_values=int4",
                       "diloco.error_feedback=true"],
    "topk1%+int4": ["diloco.delta_dtype=topk", "diloco.topk=0.01", "diloco.topk_values=int4",
                    "diloco.error_feedback=false"],
}


def run_key(row: str, seed: int, tau: int, steps: int, launch: str = "local") -> str:
    return f"{row}|seed={seed}|tau={tau}|steps={steps}" + ("" if launch == "local" else f"|launch={launch}")


def run_one(row: str, seed: int, tau: int, steps: int, threads: int, launch: str = "local") -> dict:
    with tempfile.TemporaryDirectory(prefix="comploss-") as tmp:
        overrides = ["recipe=tiny", *ROWS[row], f"seed={seed}", f"diloco.delay={tau}", f"trainer.max_steps={steps}",
                     f"run_root={tmp}", "run_id=r"] + ([f"launch={launch}"] if launch != "local" else [])
        if threads:
            overrides.append(f"trainer.num_threads={threads}")
        t0 = time.perf_counter()
        res = train_results(overrides, tmp)
        deltas = sum(s["deltas_sent"] for s in res["workers_summary"])
        return {"row": row, "seed": seed, "tau": tau, "steps": steps, "launch": launch, "eval_loss": res["eval_loss"],
                "final_train_loss": res["final_train_loss"], "bytes_per_delta": res["bytes_sent"] / max(1, deltas),
                "outer_steps": res["outer_steps"], "rejected": res["deltas_rejected"], "diverged": res["diverged"],
                "wall": time.perf_counter() - t0,
                "command": "python train.py " + " ".join(o for o in overrides if not o.startswith("run_root"))}


def table(runs: list[dict], rows: list[str], taus: list[int], seeds: list[int], steps: int, launch: str = "local") -> str:
    by = {(r["row"], r["seed"], r["tau"]): r for r in runs if r["steps"] == steps and r.get("launch", "local") == launch}
    out = [f"{'encoding':<16} {'tau':>3} {'seeds':>5} {'eval loss':>10} {'spread':>8} {'vs float32':>11} "
           f"{'(per seed)':<28} {'bytes/delta':>12}"]
    for tau in taus:
        base = {s: by[("float32", s, tau)]["eval_loss"] for s in seeds if ("float32", s, tau) in by}
        for row in rows:
            got = [by[(row, s, tau)] for s in seeds if (row, s, tau) in by]
            if not got:
                continue
            losses = [g["eval_loss"] for g in got]
            mean = statistics.fmean(losses)
            spread = (max(losses) - min(losses)) if len(losses) > 1 else 0.0
            diffs = [g["eval_loss"] - base[g["seed"]] for g in got if g["seed"] in base]
            vs = f"{statistics.fmean(diffs):+.4f}" if diffs and row != "float32" else "-"
            per = " ".join(f"{d:+.3f}" for d in diffs) if row != "float32" else ""
            b = statistics.fmean(g["bytes_per_delta"] for g in got)
            out.append(f"{row:<16} {tau:>3} {len(got):>5} {mean:>10.4f} {spread:>8.4f} {vs:>11} {per:<28} {b:>12,.0f}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}".replace("%", "%%"))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--taus", default="0", help="lockstep staleness values (diloco.delay)")
    ap.add_argument("--max-steps", type=int, default=160, help="inner steps per worker (the recipe's 160)")
    ap.add_argument("--threads", type=int, default=0, help="trainer.num_threads per worker (0: the recipe's)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "perf" / "compression_loss.json"))
    ap.add_argument("--launch", default="local", choices=["local", "sim"],
                    help="local: real processes and a folder hub; sim: the in-process simulator (launch=sim, the same "
                         "encodings and error feedback, deterministic, faster)")
    ap.add_argument("--table-only", action="store_true", help="print the table of what --out holds")
    args = ap.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        ap.error(f"unknown row(s) {unknown}; choose from {list(ROWS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    taus = [int(t) for t in args.taus.split(",")]
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    done = {run_key(r["row"], r["seed"], r["tau"], r["steps"], r.get("launch", "local")) for r in data["runs"]}
    if not args.table_only:
        out.parent.mkdir(parents=True, exist_ok=True)
        for tau in taus:
            for seed in seeds:  # seeds outermost within a tau: a partial study is still paired
                for row in rows:
                    if run_key(row, seed, tau, args.max_steps, args.launch) in done:
                        continue
                    load = os.getloadavg()[0]
                    r = run_one(row, seed, tau, args.max_steps, args.threads, args.launch)
                    r["load_before"] = load
                    data["runs"].append(r)
                    data["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
                    out.write_text(json.dumps(data, indent=1))
                    print(f"{row:<16} seed {seed} tau {tau}: eval loss {r['eval_loss']:.4f} "
                          f"({r['wall']:.0f} s, load {load:.1f})", flush=True)
    print(table(data["runs"], rows, taus, seeds, args.max_steps, args.launch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
