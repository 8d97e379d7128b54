"""Loss against bytes of every pseudo-gradient encoding, on the simulator, tuned alike, paired by seed.

    python benchmarks/compression_study.py --small --jobs 2     # the study of docs/study_compression.md
    python benchmarks/compression_study.py --long --jobs 2      # its 100-round horizon (the same file)
    python benchmarks/compression_study.py --small --plan       # what would run, what is done; runs nothing
    python benchmarks/compression_study.py --small --report     # the runs -> results.md; runs nothing
    python benchmarks/compression_study.py --quick              # a smoke version into compression_study_quick/
    python benchmarks/compression_study.py                      # the full design (4 workers, d_model 96: days here)

Every run is ``train.py launch=sim`` composed in-process (benchmarks/study.py's ``run_job``) on UTF-8
bytes of the standard library's sources (sequences of 64, batch 8, inner AdamW lr 4e-3, cosine to 10 %),
lockstep. The full design: the study's model (Llama d_model 96, 3 layers, 0.36 M parameters), 4 workers,
H = 8, 800 inner steps. ``--small`` (what a shared 2-core machine affords; :data:`SMALL`): the
staleness study's small model (d_model 64, 2 layers, 0.1 M parameters), 2 workers, 400 inner steps
(50 rounds); ``--long``: the same at 800 (100 rounds), fewer rows (:data:`LONG`). Settings:

* ``r0``: round mode, staleness 0 (the synchronous reference);
* ``a4``: arrival mode, every delta 4 arrivals stale (``diloco.delay=4``): one outer step per delta;
* ``f4``: round mode, ``diloco.fragments=4`` (a boundary every 2 steps, one fragment each): rounds
  each carrying a quarter of the model.

Rows (:data:`ROWS`): the casts, ``int8``, ``int4`` (error feedback on), today's ``topk`` (1 %, int8
values), and the chunked top-k ``ctopk`` at 1, 2 and 3 % of every chunk of 4096 with 2-bit values:
without error feedback, with it (``+ef``: beta 1), with SparseLoCo's decayed error feedback (``+ef.95``,
``+ef.8``); ``-plain`` rows take SparseLoCo's plain outer step (Nesterov with momentum 0, the buffer
playing the momentum), ``-ssgd`` ones the product's default (``staleness_sgd``: lr / (1 + tau)), the
others Nesterov 0.9. Every tuned row is tuned the same way: a grid of outer learning rates on seed 0,
extended past an edge that wins until the best is interior (``benchmarks/tuning.py``), then the other
seeds at the best; a row in ``--lr-from`` runs at another row's tuned lr (flagged "not tuned"). Each
run's eval curve gives the loss at equal rounds and, with its exact bytes per delta, at equal bytes.

Runs are ``<root>/runs/<id>/results.json``; one that exists is never run again, so an interrupted
study resumes. ``--jobs 2`` runs two at a time (one core each).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from study import COMMON, _prepare_data, final_loss, read_results, run_job  # noqa: E402 - benchmarks/study.py, beside this file
from tuning import bracket  # noqa: E402

MAX_EXTEND = 3  # at most 3 points past the first grid's edges (8x beyond)

NESTEROV = ["outer=nesterov", "outer.options.momentum=0.9"]
PLAIN = ["outer=nesterov", "outer.options.momentum=0.0"]  # SparseLoCo's outer step: theta -= lr * mean
#: row -> (train.py overrides, the outer lr grid)
ROWS: dict[str, tuple[list[str], tuple[float, ...]]] = {
    "float32": (["diloco.delta_dtype=float32", *NESTEROV], (0.3, 0.7, 1.0)),
    "float32-plain": (["diloco.delta_dtype=float32", *PLAIN], (2.0, 4.0, 8.0)),  # SparseLoCo's outer step, no compression
    "bf16": (["diloco.delta_dtype=bfloat16", *NESTEROV], (0.3, 0.7, 1.0)),
    "int8": (["diloco.delta_dtype=int8", *NESTEROV], (0.3, 0.7, 1.0)),
    "int8-plain": (["diloco.delta_dtype=int8", *PLAIN], (0.5, 1.0, 2.0)),
    "int4": (["diloco.delta_dtype=int4", *NESTEROV], (0.3, 0.7, 1.0)),
    "int4-plain": (["diloco.delta_dtype=int4", *PLAIN], (0.5, 1.0, 2.0)),
    "topk1%": (["diloco.delta_dtype=topk", "diloco.topk=0.01", "diloco.topk_values=int8", *NESTEROV], (0.3, 0.7, 1.0)),
}
for _pct in (1, 2, 3):
    _ct = ["diloco.delta_dtype=ctopk", f"diloco.topk={_pct / 100}", "diloco.topk_values=int2", "diloco.topk_chunk=4096"]
    ROWS[f"ctopk{_pct}%"] = ([*_ct, "diloco.error_feedback=false", *NESTEROV], (0.3, 0.7, 1.0))
    ROWS[f"ctopk{_pct}%+ef"] = ([*_ct, *NESTEROV], (0.3, 0.7, 1.0))
    ROWS[f"ctopk{_pct}%+ef.95"] = ([*_ct, "diloco.error_feedback_decay=0.95", *PLAIN], (2.0, 4.0, 8.0))
    ROWS[f"ctopk{_pct}%+ef.8"] = ([*_ct, "diloco.error_feedback_decay=0.8", *PLAIN], (2.0, 4.0, 8.0))  # a shorter memory
    # SparseLoCo's step with plain error feedback (beta 1), and with none: which of the two changes matters
    ROWS[f"ctopk{_pct}%+ef1-plain"] = ([*_ct, *PLAIN], (2.0, 4.0, 8.0))
    ROWS[f"ctopk{_pct}%-plain"] = ([*_ct, "diloco.error_feedback=false", *PLAIN], (2.0, 4.0, 8.0))
# the product's default outer step (staleness_sgd: lr / (1 + tau), momentum 0): at tau = 0 the plain step itself
SSGD = ["outer=staleness_sgd", "outer.options.momentum=0.0", "outer.options.power=1.0"]
ROWS["ctopk2%+ef.95-ssgd"] = ([o for o in ROWS["ctopk2%+ef.95"][0] if o not in PLAIN] + SSGD, (1.0, 2.0, 4.0))
ROWS["bf16-plain"] = (["diloco.delta_dtype=bfloat16", *PLAIN], (0.5, 1.0, 2.0))

SETTINGS = {
    "r0": ["master.aggregation=round", "diloco.delay=0"],
    "a4": ["master.aggregation=arrival", "diloco.delay=4"],
    "f4": ["master.aggregation=round", "diloco.delay=0", "diloco.fragments=4"],
}
STEPS = 800  # inner steps per worker: 100 rounds of H = 8
SEEDS = (0, 1, 2)
QUICK = {"steps": 64, "extra": ["model.d_model=32", "model.n_layers=1", "model.ffn_hidden=64", "data.val_batches=2",
                                "data.max_bytes=300000"], "rows": ("float32", "ctopk2%+ef", "ctopk2%+ef.95"),
         "seeds": (0,), "settings": ("r0",)}
#: what a shared 2-core machine affords (``--small``, about 75 min at two runs at a time): the staleness
#: study's small model (d_model 64, 2 layers, SwiGLU 172), 2 workers, 50 rounds of H = 8; the rows of
#: each setting below, in this order (a partial study has whole rows); rows in ``lr_from`` run at another
#: row's tuned lr (3 seeds, "not tuned" in the tables); ``seeds_of``: rows with more seeds than 3
_PLAINS = ["int8-plain=float32-plain", "int4-plain=float32-plain", "bf16-plain=float32-plain",
           "ctopk2%-plain=ctopk2%+ef.95", "ctopk2%+ef1-plain=ctopk2%+ef.95", "ctopk1%+ef.95=ctopk2%+ef.95",
           "ctopk3%+ef.95=ctopk2%+ef.95", "ctopk2%=ctopk2%+ef", "topk1%=ctopk2%+ef"]
SMALL = {"steps": 400, "extra": ["workers=2", "model.d_model=64", "model.n_layers=2", "model.ffn_hidden=172",
                                 "data.val_batches=8", "optim.warmup_steps=10"],
         "eval_points": 25, "settings": ("r0", "a4", "f4"),
         "rows": {"r0": ("float32", "ctopk2%+ef.95", "float32-plain", "ctopk2%+ef", "topk1%", "int8-plain", "ctopk2%",
                         "int4-plain", "bf16-plain", "ctopk2%-plain", "ctopk2%+ef1-plain", "ctopk1%+ef.95",
                         "ctopk3%+ef.95", "ctopk2%+ef.8", "ctopk2%+ef.95-ssgd"),
                  "a4": ("float32-plain", "ctopk2%+ef.95", "float32", "int8-plain", "int4-plain", "ctopk2%-plain",
                         "ctopk2%+ef.8", "ctopk2%+ef.95-ssgd"),
                  "f4": ("float32-plain", "ctopk2%+ef.95", "float32", "int8-plain", "int4-plain", "ctopk2%-plain",
                         "ctopk2%+ef.95-ssgd", "ctopk2%+ef.8")},
         "lr_from": ",".join(_PLAINS), "seeds_of": {"r0": {"float32-plain": 5, "ctopk2%+ef.95": 5}},
         "grids": {"nesterov": (0.0625, 0.125, 0.25, 0.5), "plain": (1.0, 2.0, 4.0, 8.0),
                   "float32-plain": (0.25, 0.5, 1.0, 2.0, 4.0, 8.0), "ctopk2%+ef": (0.0625, 0.125, 0.25, 0.5, 1.0),
                   # one delta per outer step at staleness 4: the r0 grids' best diverged in a pilot
                   "plain@a4": (0.03125, 0.0625, 0.125, 0.25), "nesterov@a4": (0.0078125, 0.015625, 0.03125, 0.0625),
                   "ssgd": (1.0, 2.0, 4.0), "ssgd@a4": (0.5, 1.0, 2.0)},
         "titles": {"r0": "round mode, staleness 0 ({rounds} rounds of 2 deltas; d_model 64, 2 layers)",
                    "a4": "arrival mode, every delta 4 arrivals stale ({arrivals} outer steps of one delta; d_model 64)",
                    "f4": "round mode, 4 fragments ({fragment_rounds} rounds of one fragment from each worker; d_model 64)"}}
#: ``--long``: the same at 100 rounds of H = 8 (800 inner steps), the
#: reference and SparseLoCo's recipe (first grids around their 50-round best), in compression_study_long/
LONG = {**SMALL, "steps": 800,
        "rows": {"r0": ("float32-plain", "ctopk2%+ef.95", "ctopk1%+ef.95", "int4-plain", "ctopk2%+ef.8"),
                 "f4": ("float32-plain", "ctopk2%+ef.95", "ctopk2%+ef.8"),
                 "a4": ("float32-plain", "ctopk2%+ef.95", "ctopk2%+ef.8")},
        "lr_from": "ctopk1%+ef.95=ctopk2%+ef.95,int4-plain=float32-plain",
        "grids": {**SMALL["grids"], "float32-plain": (0.25, 0.5, 1.0), "ctopk2%+ef.95": (1.0, 2.0, 4.0),
                  "ctopk2%+ef.8": (1.0, 2.0, 4.0), "ctopk2%+ef.8@a4": (0.25, 0.5, 1.0)}}


def job(row: str, setting: str, lr: float, seed: int, eval_points: int = 50) -> dict[str, Any]:
    overrides = [*ROWS[row][0], *SETTINGS[setting], f"outer.lr={lr}", f"seed={seed}"]
    if row.startswith("float32"):  # its early curve is the reference at equal bytes: evaluate it more often
        overrides.append(f"launch.eval_points={2 * eval_points}")
    ident = f"{setting}-{row.replace('%', 'pct').replace('+', '_')}-lr{lr:g}-s{seed}"
    return {"id": ident, "block": setting, "row": row, "setting": setting, "lr": lr, "seed": seed,
            "overrides": overrides}


class CompressionStudy:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        q: dict[str, Any] = QUICK if args.quick else LONG if args.long else SMALL if args.small else {}
        default = ("compression_study_quick" if args.quick else "compression_study_long" if args.long
                   else "compression_study_small" if args.small else "compression_study")
        self.root = Path(args.root or (ROOT / default)).resolve()
        self.eval_points = int(q.get("eval_points", 50))
        self.grids: dict[str, tuple[float, ...]] = dict(q.get("grids", {}))
        for item in (args.grid or "").split(","):  # --grid row=0.25/0.5/1: a first grid for the row
            if item:
                row, _, lrs = item.partition("=")
                self.grids[row] = tuple(float(x) for x in lrs.split("/"))
        steps = args.steps or q.get("steps", STEPS)
        counts = {"rounds": steps // 8, "arrivals": 2 * steps // 8, "fragment_rounds": steps // 2}  # H = 8, 2 workers
        self.titles: dict[str, str] = {k: v.format(**counts) for k, v in q.get("titles", {}).items()}
        self.settings = [s for s in (args.settings.split(",") if args.settings else q.get("settings", SETTINGS)) if s]
        rows = q.get("rows", list(ROWS))  # a profile's rows: one list, or one per setting
        #: setting -> its rows (``--rows``: the same in every setting)
        self.rows_of = {s: [r for r in (args.rows.split(",") if args.rows else rows.get(s, ()) if isinstance(rows, dict)
                                        else rows) if r] for s in self.settings}
        self.rows = list(dict.fromkeys(r for s in self.settings for r in self.rows_of[s]))  # all, in order
        n = args.seeds or len(q.get("seeds", SEEDS))
        #: (setting, row) -> its number of seeds: ``--seeds``, else the profile's ``seeds_of``, else 3
        self.n_seeds = {(s, r): args.seeds or q.get("seeds_of", {}).get(s, {}).get(r, n)
                        for s in self.settings for r in self.rows_of[s]}
        self.seeds = tuple(range(max(self.n_seeds.values(), default=n)))
        #: rows run at another row's tuned lr instead of their own grid (``--lr-from row=other,...``)
        self.lr_from = dict(x.split("=", 1) for x in (args.lr_from or q.get("lr_from", "")).split(",") if x)
        extra = [f"trainer.max_steps={steps}", f"launch.eval_points={self.eval_points}", *q.get("extra", [])]
        keys = {e.split("=")[0] for e in extra}
        self.common = [c for c in COMMON if c.split("=")[0] not in keys] + extra
        unknown = ([r for r in self.rows if r not in ROWS] + [s for s in self.settings if s not in SETTINGS]
                   + [r for kv in self.lr_from.items() for r in kv if r not in ROWS]
                   + [r for r in (x.partition("=")[0].partition("@")[0] for x in (args.grid or "").split(",") if x)
                      if r not in ROWS])
        if unknown:
            raise SystemExit(f"unknown rows or settings {unknown}; rows: {list(ROWS)}, settings: {list(SETTINGS)}")

    # ------------------------------------------------------------------ bookkeeping

    def job(self, row: str, setting: str, lr: float, seed: int) -> dict[str, Any]:
        return job(row, setting, lr, seed, self.eval_points)

    def grid(self, row: str, setting: str) -> tuple[list[float], bool]:
        """The row's outer lr grid at ``setting`` so far, and whether it is settled: the profile's grid
        (``row@setting``, ``kind@setting``, ``row``, ``kind``, in that order; ``kind`` is the outer step,
        ``plain``, ``ssgd`` or ``nesterov``) or the row's own, then halved or doubled past an edge that won
        (``benchmarks/tuning.py``)."""
        over = ROWS[row][0]
        kind = ("ssgd" if "outer=staleness_sgd" in over else "plain" if "outer.options.momentum=0.0" in over
                else "nesterov")
        base = next((self.grids[k] for k in (f"{row}@{setting}", f"{kind}@{setting}", row, kind) if k in self.grids),
                    ROWS[row][1])
        return bracket(base, lambda lr: self.loss(self.job(row, setting, lr, self.seeds[0])),
                       lambda lr: lr / 2, lambda lr: lr * 2, MAX_EXTEND)

    def results(self, j: dict) -> dict | None:
        return read_results(self.root, j)

    def loss(self, j: dict) -> float:
        return final_loss(self.results(j))

    def best_lr(self, row: str, setting: str) -> float | None:
        """The grid's best outer lr on seed 0 (ties to the smaller); for a row run ``--lr-from`` another
        (not tuned: the tables say so), that row's."""
        if row in self.lr_from:
            return self.best_lr(self.lr_from[row], setting)
        lrs, settled = self.grid(row, setting)
        if not settled:
            return None
        return min((self.loss(self.job(row, setting, lr, self.seeds[0])), lr) for lr in lrs)[1]

    def tuning_jobs(self, rows: list[str] | None = None) -> list[dict]:
        return [self.job(r, s, lr, self.seeds[0]) for s in self.settings for r in self.rows_of[s]
                if (rows is None or r in rows) and r not in self.lr_from for lr in self.grid(r, s)[0]]

    def seed_jobs(self, rows: list[str] | None = None) -> list[dict]:
        """The seeds of each row at its tuned lr (all of them for a row run at another's lr)."""
        out = []
        for s in self.settings:
            for r in self.rows_of[s]:
                lr = self.best_lr(r, s) if rows is None or r in rows else None
                if lr is not None:
                    seeds = range(0 if r in self.lr_from else 1, self.n_seeds[(s, r)])
                    out += [self.job(r, s, lr, seed) for seed in seeds]
        return out

    # ------------------------------------------------------------------ running

    def run_all(self, jobs: list[dict], phase: str) -> None:
        todo = [j for j in jobs if self.results(j) is None]
        print(f"== {phase}: {len(jobs)} runs, {len(jobs) - len(todo)} done, {len(todo)} to run", flush=True)
        specs = [(j, self.common, str(self.root)) for j in todo]
        if self.args.jobs <= 1:
            for spec in specs:
                self._report_one(run_job(spec))
            return
        import multiprocessing as mp

        from study import _child_init

        with mp.get_context("spawn").Pool(self.args.jobs, initializer=_child_init) as pool:
            for rec in pool.imap_unordered(run_job, specs):
                self._report_one(rec)

    def _report_one(self, rec: dict) -> None:
        with open(self.root / "driver_log.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        if rec.get("error"):
            print(f"   FAILED {rec['id']}: {rec['error'][-400:]}", flush=True)
        else:
            print(f"   {rec['id']}: eval {rec['eval_loss']:.4f}{' DIVERGED' if rec['diverged'] else ''} "
                  f"({rec['wall']:.0f} s)", flush=True)

    def run(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        import torch

        torch.set_num_threads(1)
        _prepare_data(self.common)
        t0 = time.time()
        for s in self.settings:  # setting by setting, row by row: a partial study has whole rows
            for r in self.rows_of[s]:
                tried: set[str] = set()
                while True:  # a grid grows past a winning edge: run until every point of it is done
                    todo = [j for j in self.tuning_jobs([r]) if j["setting"] == s and self.results(j) is None]
                    if not todo or {j["id"] for j in todo} <= tried:  # done, or only runs that failed are left
                        break
                    tried |= {j["id"] for j in todo}
                    self.run_all(todo, f"tuning {s} {r}")
                self.run_all([j for j in self.seed_jobs([r]) if j["setting"] == s], f"seeds {s} {r}")
        print(f"study session: {(time.time() - t0) / 60:.1f} min", flush=True)
        return self.report()

    def plan(self) -> int:
        jobs = self.tuning_jobs() + self.seed_jobs()
        for j in jobs:
            mark = "done" if self.results(j) is not None else "    "
            print(f"{mark} python train.py {' '.join(self.common + j['overrides'])} run_id={j['id']}")
        done = sum(self.results(j) is not None for j in jobs)
        print(f"{len(jobs)} runs planned (the other seeds of a row once its tuning is done), {done} done")
        return 0

    def report(self) -> int:
        from compression_report import write_report  # benchmarks/compression_report.py

        out = Path(self.args.out) if self.args.out else self.root / "results.md"
        write_report(self, out)
        print(f"wrote {out}")
        return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time, each in its own process (default 1)")
    ap.add_argument("--rows", help=f"comma-separated subset of {','.join(ROWS)}".replace("%", "%%"))
    ap.add_argument("--settings", help=f"comma-separated subset of {','.join(SETTINGS)}")
    ap.add_argument("--lr-from", help="row=other,...: run row at other's tuned outer lr, untuned (its 3 seeds only)")
    ap.add_argument("--grid", help="row=lr/lr/lr,... (row@setting=...: in one setting): the first outer-lr grid of "
                    "these rows (extended past a winning edge)")
    ap.add_argument("--steps", type=int, help="inner steps per worker (default: the profile's; H = 8: 8 per round); "
                    "give another --root, run ids do not name it")
    ap.add_argument("--seeds", type=int, help="seeds per row (default 3: 0, 1, 2); the tuning runs on seed 0")
    ap.add_argument("--quick", action="store_true", help="a smoke version (3 rows, 64 steps, 1 seed)")
    ap.add_argument("--small", action="store_true",
                    help="what a shared 2-core machine affords (SMALL: 2 workers, 50 rounds, r0 a4 f4) in compression_study_small/")
    ap.add_argument("--long", action="store_true",
                    help="--small at 100 rounds (800 inner steps), the reference and SparseLoCo's recipe, in compression_study_long/")
    ap.add_argument("--plan", action="store_true", help="list the runs (done or not); run nothing")
    ap.add_argument("--report", action="store_true", help="write the tables from what is done; run nothing")
    ap.add_argument("--root", help="study folder (default compression_study/)")
    ap.add_argument("--out", help="report file (default <root>/results.md)")
    args = ap.parse_args(argv)
    study = CompressionStudy(args)
    if args.plan:
        return study.plan()
    if args.report:
        return study.report()
    return study.run()


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t interval (n - 1 degrees of freedom; nan for n < 2)."""
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return math.nan, math.nan
    if len(xs) < 2:
        return xs[0], math.nan
    t = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}.get(len(xs) - 1, 2.0)
    return statistics.mean(xs), t * statistics.stdev(xs) / math.sqrt(len(xs))


if __name__ == "__main__":
    sys.exit(main())
