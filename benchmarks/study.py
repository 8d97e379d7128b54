"""The staleness study (issue 13), on the simulator: every run is ``train.py launch=sim`` composed in-process.

    python benchmarks/study.py                 # the whole study into study/ (resumable), then the tables
    python benchmarks/study.py --jobs 2        # two runs at a time (one per core)
    python benchmarks/study.py --plan          # what would run (and what is done), nothing else
    python benchmarks/study.py --report        # study/ -> docs/study_results.md (tables), no runs
    python benchmarks/study.py --quick         # a 3-minute smoke version into study_quick/ (tables: study_quick/results.md)

Each run is a Hydra composition of ``configs/train.yaml`` with the overrides printed by ``--plan``,
run by the product's own ``launch=sim`` code (:func:`diloco_lightning.app.sim.run_sim`), which
writes ``study/runs/<id>/results.json`` when the run ends; a run whose ``results.json`` exists is
never run again, so an interrupted study resumes where it stopped (failures go to
``study/failures.jsonl``). ``--jobs N`` runs N runs at a time in N long-lived processes.

Setting (every run; docs/study.md says why): a Llama of d_model 96, 3 layers (4 heads, 2 KV
heads, SwiGLU 256, tied embeddings; 0.36 M parameters) on UTF-8 bytes (vocabulary 257) of the
first 2 MB of the Python standard library's sources, sequences of 64, batch 8; 4 workers, H = 8,
200 inner AdamW steps each (lr 4e-3, 20 warm-up steps, cosine to 10 %): 100 deltas, so 100 outer
steps in arrival mode (one per delta, the paper's asynchronous setting) and 25 rounds in round
mode. Staleness is imposed (``diloco.sync=lockstep``).

Phases: ``tuning`` (every method, 3 outer lrs, seed 0, at tau = 0 and at tau = 16 in arrivals;
round mode at tau = 0), then ``grid``: fixed tau in {0, 4, 16} arrivals (3 seeds, the lr tuned
at tau = 0 "as a user would", and at tau = 16 the lr tuned there), heterogeneous delays
[0, 4, 8, 16], a heavy-tailed law past tau_cut (Lomax: shape 1.5, scale 4, capped at 128, drawn
per delta), round mode at tau in {0, 4} rounds, bf16 outer state (to nearest at tau = 16 and in the
heavy tail, stochastic in the heavy tail), bf16 weights + 8-bit AdamW inner at tau = 16 (3 seeds)
and 0 (1 seed).

Runs 2 at a time (``--jobs 2``), one thread each: 157 runs, about an hour on 2 cores (71 min from a fresh clone on a loaded machine).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHODS = ("nesterov", "poly_nesterov", "delayed_nesterov", "adam", "adam_decay", "cgad")
NESTEROV_FAMILY = ("nesterov", "poly_nesterov", "delayed_nesterov")
#: the same budget for every method: 3 outer lrs ~3x apart around the family's working range
LR_GRID = {m: (0.1, 0.3, 0.7) if m in NESTEROV_FAMILY else (0.001, 0.003, 0.01) for m in METHODS}
ROUND_METHODS = ("nesterov", "adam", "cgad")
ROUND_LR_GRID = {"nesterov": (0.3, 0.7, 1.0), "adam": (0.001, 0.003, 0.01), "cgad": (0.001, 0.003, 0.01)}
TARGET_TAU = 16
SEEDS = (0, 1, 2)
WORKERS = 4

MODEL = ["model.d_model=96", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=256"]
COMMON = [
    "recipe=tiny", "launch=sim", f"workers={WORKERS}", "diloco.inner_steps=8", "trainer.max_steps=200",
    "data.tokenizer=byte", "data.max_bytes=2000000", "data.seq_len=64", "data.batch_size=8", "data.val_batches=24",
    "optim.lr=0.004", "optim.warmup_steps=20", "launch.eval_points=4", "trainer.log_every_n_steps=8", *MODEL,
    "sim.parallel=1",  # the study runs --jobs runs at a time, one core each (the results do not depend on it)
]
HEAVY = ["diloco.delay={distribution:pareto,shape:1.5,scale:4,max:128}", "sim.delay_per=delta"]
HETERO = "[0,4,8,16]"
BF16_WEIGHTS = ["trainer.precision=bf16-true", "optim=adamw8bit", "optim.lr=0.004", "optim.warmup_steps=20"]

QUICK = {"methods": ("nesterov", "cgad"), "lr_grid": {"nesterov": (0.3,), "cgad": (0.003,)}, "round_methods": ("cgad",),
         "round_lr_grid": {"cgad": (0.003,)}, "seeds": (0,), "target_tau": 4,
         "common_extra": ["trainer.max_steps=32", "model.d_model=32", "model.n_layers=1", "model.ffn_hidden=64",
                          "data.val_batches=2", "data.max_bytes=300000"]}


# ----------------------------------------------------------------------------- jobs


#: at tau = 0 every gate is 1: Poly is Nesterov, CGAD and Adam-Decay are Adam (the same code path, bit for
#: bit), so those runs are made once, as the method they equal
SAME_AT_TAU0 = {"poly_nesterov": "nesterov", "cgad": "adam", "adam_decay": "adam"}


def job(block: str, method: str, lr: float, setting: str, seed: int, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One run: ``setting`` is ``arr<tau>``, ``rnd<tau>``, ``het`` or ``heavy``; ``extra`` adds overrides."""
    runs_as = SAME_AT_TAU0.get(method, method) if setting in ("arr0", "rnd0") else method
    ov = [f"outer={runs_as}", f"outer.lr={lr}", f"seed={seed}"]
    if runs_as == "delayed_nesterov":
        ov.append(f"outer.options.buffer_size={WORKERS}")  # Liu et al.: the buffer is the number of workers
    if setting.startswith("arr"):
        ov += ["master.aggregation=arrival", f"diloco.delay={int(setting[3:])}"]
    elif setting.startswith("rnd"):
        ov += ["master.aggregation=round", f"diloco.delay={int(setting[3:])}"]
    elif setting == "het":
        ov += ["master.aggregation=arrival", f"diloco.delay={HETERO}"]
    elif setting == "heavy":
        ov += ["master.aggregation=arrival", *HEAVY]
    elif setting == "async":  # no imposed delay: 4 equal workers on the simulated clock (staleness 3 arrivals)
        ov += ["master.aggregation=arrival", "diloco.sync=async", "diloco.delay=0"]
    else:
        raise ValueError(setting)
    ov += list(extra)
    variant = "fp32"
    if "outer.state_dtype=bfloat16" in extra:
        variant = "outer-bf16-sr" if "outer.stochastic_rounding=true" in extra else "outer-bf16"
    if "optim=adamw8bit" in extra:
        variant = "bf16+8bit"
    ident = hashlib.sha256(json.dumps(sorted(ov)).encode()).hexdigest()[:12]
    return {"id": f"{runs_as}-{setting}-{variant}-lr{lr:g}-s{seed}-{ident}", "block": block, "method": method,
            "runs_as": runs_as, "lr": lr, "setting": setting, "seed": seed, "variant": variant, "overrides": ov}


class Study:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        q = QUICK if args.quick else {}
        self.root = Path(args.root or (ROOT / ("study_quick" if args.quick else "study"))).resolve()
        self.methods = q.get("methods", METHODS)
        self.lr_grid = q.get("lr_grid", LR_GRID)
        self.round_methods = q.get("round_methods", ROUND_METHODS)
        self.round_lr_grid = q.get("round_lr_grid", ROUND_LR_GRID)
        self.seeds = q.get("seeds", SEEDS)
        self.target = q.get("target_tau", TARGET_TAU)
        extra = q.get("common_extra", [])
        keys = {e.split("=")[0] for e in extra}
        self.common = [c for c in COMMON if c.split("=")[0] not in keys] + list(extra)

    # ------------------------------------------------------------------ bookkeeping

    def results(self, j: dict) -> dict | None:
        p = self.root / "runs" / j["id"] / "results.json"
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            return None

    def failed(self) -> set[str]:
        p = self.root / "failures.jsonl"
        if not p.is_file() or self.args.retry_failed:
            return set()
        return {json.loads(x)["id"] for x in p.read_text().splitlines() if x.strip()}

    def loss(self, j: dict) -> float:
        r = self.results(j)
        if r is None:
            return math.nan
        return math.inf if r.get("diverged") or not math.isfinite(r["eval_loss"]) else r["eval_loss"]

    # ------------------------------------------------------------------ the plan

    def tuning_jobs(self) -> list[dict]:
        s0 = self.seeds[0]
        out = [job("tune0", m, lr, "arr0", s0) for m in self.methods for lr in self.lr_grid[m]
               if SAME_AT_TAU0.get(m, m) == m or SAME_AT_TAU0[m] not in self.methods]
        out += [job(f"tune{self.target}", m, lr, f"arr{self.target}", s0) for m in self.methods for lr in self.lr_grid[m]]
        out += [job("tuneR", m, lr, "rnd0", s0) for m in self.round_methods for lr in self.round_lr_grid[m]
                if SAME_AT_TAU0.get(m, m) == m or SAME_AT_TAU0[m] not in self.round_methods]
        return out

    def best(self, setting: str, methods, grid) -> dict[str, float] | None:
        s0 = self.seeds[0]
        out = {}
        for m in methods:
            scores = [(self.loss(job("", m, lr, setting, s0)), lr) for lr in grid[m]]
            if any(math.isnan(x) for x, _ in scores):
                return None
            out[m] = min(scores)[1]  # lowest loss; ties to the smaller lr
        return out

    def tuned(self) -> dict[str, dict[str, float]] | None:
        lr0 = self.best("arr0", self.methods, self.lr_grid)
        lrt = self.best(f"arr{self.target}", self.methods, self.lr_grid)
        lrr = self.best("rnd0", self.round_methods, self.round_lr_grid)
        if lr0 is None or lrt is None or lrr is None:
            return None
        return {"arr0": lr0, f"arr{self.target}": lrt, "rnd0": lrr}

    def grid_jobs(self, t: dict[str, dict[str, float]]) -> list[dict]:
        lr0, lrt, lrr = t["arr0"], t[f"arr{self.target}"], t["rnd0"]
        tau, S, M = self.target, self.seeds, self.methods
        adamish = [m for m in ("cgad", "adam_decay", "adam") if m in M]
        jobs = [job("fixed", m, lr0[m], f"arr{x}", s) for x in (0, 4, tau) for m in M for s in S]
        jobs += [job("heavy", m, lr0[m], "heavy", s) for m in M for s in S]
        jobs += [job("stale-tuned", m, lrt[m], f"arr{tau}", s) for m in M for s in S]
        jobs += [job("het", m, lr0[m], "het", s) for m in M if m in ("nesterov", "adam", "adam_decay", "cgad") for s in S]
        jobs += [job("round", m, lrr[m], f"rnd{x}", s) for x in (0, 4) for m in self.round_methods for s in S]
        o16 = ("outer.state_dtype=bfloat16",)
        sr = ("outer.state_dtype=bfloat16", "outer.stochastic_rounding=true")
        jobs += [job("outer-bf16", m, lr0[m], "heavy", s, o16) for m in adamish for s in S]
        jobs += [job("outer-bf16", m, lr0[m], f"arr{tau}", s, o16) for m in adamish for s in S]
        jobs += [job("outer-bf16", m, lr0[m], "heavy", s, sr) for m in adamish if m != "adam" for s in S]
        w16 = tuple(BF16_WEIGHTS)
        jobs += [job("bf16-weights", m, lr0[m], f"arr{tau}", s, w16) for m in ("nesterov", "adam_decay", "cgad") if m in M
                 for s in S]
        jobs += [job("bf16-weights", m, lr0[m], "arr0", S[0], w16) for m in ("nesterov", "cgad") if m in M]
        # a sanity anchor for the imposed delays: the staleness 4 equal asynchronous workers make themselves
        jobs += [job("async", m, lr0[m], "async", S[0]) for m in ("nesterov", "adam", "adam_decay", "cgad") if m in M]
        seen, out = set(), []
        for j in jobs:  # a run shared by two blocks (e.g. tau = 0 seed 0 is a tuning run) runs once
            if j["id"] not in seen:
                seen.add(j["id"])
                out.append(j)
        return out

    # ------------------------------------------------------------------ running

    def run_all(self, jobs: list[dict], phase: str) -> None:
        failed = self.failed()
        todo = [j for j in jobs if self.results(j) is None and j["id"] not in failed]
        print(f"== {phase}: {len(jobs)} runs, {len(jobs) - len(todo)} done or failed, {len(todo)} to run", flush=True)
        if not todo:
            return
        specs = [(j, self.common, str(self.root)) for j in todo]
        if self.args.jobs <= 1:
            for spec in specs:
                self._report_one(run_job(spec))
            return
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(self.args.jobs, initializer=_child_init) as pool:
            for rec in pool.imap_unordered(run_job, specs):
                self._report_one(rec)

    def _report_one(self, rec: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "driver_log.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        if rec.get("error"):
            with open(self.root / "failures.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(f"   FAILED {rec['id']}: {rec['error'][-300:]}", flush=True)
        else:
            print(f"   {rec['id']}: eval {rec['eval_loss']:.3f}{' DIVERGED' if rec['diverged'] else ''} "
                  f"({rec['wall']:.0f} s)", flush=True)

    def run(self) -> int:
        t0 = time.time()
        self.root.mkdir(parents=True, exist_ok=True)
        _prepare_data(self.common)
        with open(self.root / "driver_log.jsonl", "a") as f:
            f.write(json.dumps({"event": "start", "time": t0, "argv": sys.argv[1:]}) + "\n")
        self.run_all(self.tuning_jobs(), "tuning")
        t = self.tuned()
        if t is None:
            print("tuning incomplete (see failures.jsonl): cannot plan the grid", file=sys.stderr)
            return 1
        (self.root / "tuning.json").write_text(json.dumps(t, indent=2))
        print(f"tuned outer lrs: {json.dumps(t)}", flush=True)
        self.run_all(self.grid_jobs(t), "grid")
        wall = time.time() - t0
        with open(self.root / "driver_log.jsonl", "a") as f:
            f.write(json.dumps({"event": "end", "time": time.time(), "wall": wall}) + "\n")
        print(f"study session: {wall / 60:.1f} min", flush=True)
        return self.report()

    def plan(self) -> int:
        t = self.tuned()
        jobs = self.tuning_jobs() + (self.grid_jobs(t) if t else [])
        done = sum(self.results(j) is not None for j in jobs)
        for j in jobs:
            mark = "done" if self.results(j) is not None else "    "
            print(f"{mark} {j['block']:12} python train.py {' '.join(self.common + j['overrides'])} run_id={j['id']}")
        print(f"{len(jobs)} runs planned{'' if t else ' (tuning first; the grid is planned once it is done)'}, {done} done")
        return 0

    def report(self) -> int:
        from study_report import write_report  # benchmarks/study_report.py

        out = Path(self.args.out) if self.args.out else (self.root / "results.md" if self.args.quick
                                                         else ROOT / "docs" / "study_results.md")
        write_report(self, out)
        print(f"wrote {out}")
        return 0


# ----------------------------------------------------------------------------- a run, in a pool process or here


def _child_init() -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)  # one run per core: two runs with two intra-op threads each would fight over 2 cores
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # a CPU 4-bit kernel it does not need


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from diloco_lightning.app.config import CONFIG_DIR, register_configs, validate

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="train", overrides=overrides)
    return validate(cfg)


def _prepare_data(common: list[str]) -> None:
    from diloco_lightning.app.build import build_datamodule

    build_datamodule(_compose(common + ["run_id=prepare"])).prepare_data()


def run_job(spec: tuple[dict, list[str], str]) -> dict[str, Any]:
    """Run one job with the product's launch=sim code; its stdout goes to ``<run>/sim.log``."""
    j, common, root = spec
    from diloco_lightning.app.sim import run_sim

    rdir = Path(root) / "runs" / j["id"]
    rdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"id": j["id"], "block": j["block"], "time": time.time()}
    try:
        cfg = _compose(common + j["overrides"] + [f"run_id={j['id']}", f"run_root={Path(root) / 'runs'}"])
        (rdir / "job.json").write_text(json.dumps({**j, "common": common}, indent=2))
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            res = run_sim(cfg)
        (rdir / "sim.log").write_text(buf.getvalue())
        rec.update(eval_loss=res["eval_loss"], diverged=res["diverged"], wall=time.perf_counter() - t0,
                   inner_steps_per_second=res["sim"]["inner_steps_per_second"])
    except Exception as e:  # noqa: BLE001 - recorded, the study goes on
        import traceback

        rec.update(error=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}", wall=time.perf_counter() - t0)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time, each in its own process (default 1)")
    ap.add_argument("--quick", action="store_true", help="a smoke version (2 methods, 32 steps, 1 seed) in study_quick/")
    ap.add_argument("--plan", action="store_true", help="list the runs (done or not); run nothing")
    ap.add_argument("--report", action="store_true", help="write the tables from what is done; run nothing")
    ap.add_argument("--root", help="study folder (default study/, or study_quick/ with --quick)")
    ap.add_argument("--out", help="report file (default docs/study_results.md)")
    ap.add_argument("--retry-failed", action="store_true")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    study = Study(args)
    if args.plan:
        return study.plan()
    if args.report:
        return study.report()
    return study.run()


def _mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


if __name__ == "__main__":
    sys.exit(main())
