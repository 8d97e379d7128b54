"""Streaming DiLoCo fragments on the simulator: final eval loss for F in {1, 2, 4} x {cgad, pa_cgad}.

Issue 15's quality evidence. Every run is ``python train.py launch=sim`` (the in-process
simulator: deterministic, the product's worker schedule and master; ``docs/simulator.md``) on the
study's model (``benchmarks/study.py``: a Llama of d_model 96, 3 layers, tied embeddings, 0.36 M
parameters, on UTF-8 bytes, sequences of 64, batch 8; 4 workers, H = 8, 200 inner AdamW steps
each), lockstep in rounds (one outer step per round of 4 deltas, the outer lr 0.003 the study
tuned for CGAD in round mode). With ``F`` fragments a worker reaches a boundary every H / F = 8 / F
steps and each round updates one fragment (3 blocks: fragment ``i mod F`` for block ``i``;
embeddings and the final norm placed where the fewest values are).

Two latencies, the same in inner steps for every F:

* ``L = 0``: no delay (per-fragment staleness tau = 0);
* ``L = H``: each worker installs the fragment of the version one H-phase (8 inner steps) old:
  ``diloco.delay = F`` rounds (a round is H / F steps), so every fragment delta is applied with
  tau = 1 of its fragment's outer steps for every F. CGAD is stable there (gate 0.82; the study
  finds it far from stable at 4 rounds). PA-CGAD gates on ``max(tau, a_f)``: at lockstep a
  fragment is ``a_f = F - 1`` outer steps old when its deltas arrive (the other fragments were
  updated in between), so F = 4 is gated on 3 (0.54) even at L = 0.

At F = 1, PA-CGAD has one fragment whose age is 0 at every round: it is CGAD exactly, so the F = 1
rows run once (as cgad) and stand for both.

    python benchmarks/fragment_quality.py                        # the grid, seeds 0 1 2
    python benchmarks/fragment_quality.py --table-only           # print what --out holds
    python benchmarks/fragment_quality.py --seeds 0 --max-steps 32   # a smoke run

Runs already in ``--out`` (default ``runs/perf/fragment_quality.json``) are not run again, so an
interrupted study resumes. Target (issue 15): F = 4 within 0.05 nats of F = 1 at L = 0
(Streaming DiLoCo, Douillard et al. 2025, arXiv 2501.18512, reports parity).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trainrun import train_results

ROOT = Path(__file__).resolve().parents[1]

H = 8
MODEL = ["model.d_model=96", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=256"]
COMMON = [
    "recipe=tiny", "launch=sim", "workers=4", f"diloco.inner_steps={H}", "diloco.sync=lockstep",
    "master.aggregation=round", "data.tokenizer=byte", "data.max_bytes=2000000", "data.seq_len=64",
    "data.batch_size=8", "data.val_batches=24", "optim.lr=0.004", "optim.warmup_steps=20", "launch.eval_points=4",
    "trainer.log_every_n_steps=8", "outer.lr=0.003", *MODEL,
]
FRAGMENTS = (1, 2, 4)
OUTERS = ("cgad", "pa_cgad")
LATENCIES = (0, H)
#: t quantile, 97.5 %, by degrees of freedom (a 95 % CI over n seeds uses n - 1)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}


def runs_as(outer: str, fragments: int) -> str:
    """PA-CGAD with one fragment is CGAD (its only fragment's age is 0 at every lockstep round)."""
    return "cgad" if fragments == 1 else outer


def key(outer: str, fragments: int, latency: int, seed: int, steps: int) -> str:
    return f"{runs_as(outer, fragments)}|F={fragments}|L={latency}|seed={seed}|steps={steps}"


def run_one(outer: str, fragments: int, latency: int, seed: int, steps: int, threads: int) -> dict:
    delay = latency * fragments // H  # rounds of H / F steps
    with tempfile.TemporaryDirectory(prefix="fragq-") as tmp:
        overrides = [*COMMON, f"outer={runs_as(outer, fragments)}", f"diloco.fragments={fragments}",
                     f"diloco.delay={delay}", f"seed={seed}", f"trainer.max_steps={steps}",
                     f"sim.parallel={threads}", f"run_root={tmp}", "run_id=r"]
        t0 = time.perf_counter()
        res = train_results(overrides, tmp)
        return {"outer": runs_as(outer, fragments), "fragments": fragments, "latency": latency, "delay": delay,
                "seed": seed, "steps": steps, "eval_loss": res["eval_loss"], "final_train_loss": res["final_train_loss"],
                "outer_steps": res["outer_steps"], "rejected": res["deltas_rejected"], "diverged": res["diverged"],
                "staleness": res["sim"]["staleness_histogram"], "wall": time.perf_counter() - t0,
                "command": "python train.py " + " ".join(o for o in overrides if not o.startswith("run_root"))}


def _ci(diffs: list[float]) -> str:
    if len(diffs) < 2:
        return f"{diffs[0]:+.3f}" if diffs else "—"
    m, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = T975.get(len(diffs) - 1, 1.96) * sd / math.sqrt(len(diffs))
    return f"{m:+.3f} [{m - half:+.3f}, {m + half:+.3f}]"


def table(runs: list[dict], seeds: list[int], steps: int) -> str:
    by = {(r["outer"], r["fragments"], r["latency"], r["seed"]): r["eval_loss"] for r in runs if r["steps"] == steps}

    def losses(outer: str, f: int, lat: int) -> dict[int, float]:
        o = runs_as(outer, f)
        return {s: by[(o, f, lat, s)] for s in seeds if (o, f, lat, s) in by}

    out = ["| latency | F | outer | eval loss, mean ± std | per seed |", "|---|---|---|---|---|"]
    for lat in LATENCIES:
        for f in FRAGMENTS:
            for outer in (OUTERS if f > 1 else ("cgad",)):
                got = losses(outer, f, lat)
                if not got:
                    continue
                v = list(got.values())
                sd = statistics.stdev(v) if len(v) > 1 else 0.0
                name = outer if f > 1 else "cgad = pa_cgad"
                out.append(f"| {lat} | {f} | {name} | {statistics.fmean(v):.3f} ± {sd:.3f} | "
                           f"{', '.join(f'{x:.3f}' for x in v)} |")
    out += ["", "Paired differences (same seeds: same data, initialisation); mean [95 % CI, t with n - 1 dof]; "
            "negative = the first is better.", "", "| latency | difference | cgad | pa_cgad |", "|---|---|---|---|"]
    for lat in LATENCIES:
        for f in (4, 2):
            cells = []
            for outer in OUTERS:
                a, b = losses(outer, f, lat), losses("cgad", 1, lat)
                cells.append(_ci([a[s] - b[s] for s in seeds if s in a and s in b]))
            out.append(f"| {lat} | F={f} − F=1 | {cells[0]} | {cells[1]} |")
    out += ["", "| latency | F | pa_cgad − cgad |", "|---|---|---|"]
    for lat in LATENCIES:
        for f in (2, 4):
            a, b = losses("pa_cgad", f, lat), losses("cgad", f, lat)
            out.append(f"| {lat} | {f} | {_ci([a[s] - b[s] for s in seeds if s in a and s in b])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--max-steps", type=int, default=200, help="inner steps per worker (the study's 200)")
    ap.add_argument("--threads", type=int, default=1, help="sim.parallel: workers computed side by side")
    ap.add_argument("--out", default=str(ROOT / "runs" / "perf" / "fragment_quality.json"))
    ap.add_argument("--table-only", action="store_true", help="print the table of what --out holds")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.is_file() else {"runs": []}
    done = {key(r["outer"], r["fragments"], r["latency"], r["seed"], r["steps"]) for r in data["runs"]}
    if not args.table_only:
        out.parent.mkdir(parents=True, exist_ok=True)
        for seed in seeds:  # seeds outermost: a partial study is still paired
            for lat in LATENCIES:
                for f in FRAGMENTS:
                    for outer in OUTERS:
                        k = key(outer, f, lat, seed, args.max_steps)
                        if k in done:
                            continue
                        load = os.getloadavg()[0]
                        r = run_one(outer, f, lat, seed, args.max_steps, args.threads)
                        r["load_before"] = load
                        data["runs"].append(r)
                        done.add(k)
                        data["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
                        out.write_text(json.dumps(data, indent=1))
                        print(f"{r['outer']:<8} F={f} L={lat} seed {seed}: eval loss {r['eval_loss']:.4f} "
                              f"staleness {r['staleness']} ({r['wall']:.0f} s, load {load:.1f})", flush=True)
    print(table(data["runs"], seeds, args.max_steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
