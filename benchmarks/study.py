"""The staleness study (docs/study.md) on the simulator: every run is ``train.py launch=sim`` composed in-process.

    python benchmarks/study.py                 # every table of docs/study_results.md into study_small/ (resumable)
    python benchmarks/study.py --jobs 2        # two runs at a time (one core each)
    python benchmarks/study.py --plan          # every run planned so far as a train.py command line, done or not
    python benchmarks/study.py --report        # study_small/ -> docs/study_results.md, no runs
    python benchmarks/study.py --large         # the same plan at the setting below (3-10 min a run here) in study/
    python benchmarks/study.py --quick         # a few-minute smoke version into study_quick/
    python benchmarks/study.py --full          # every method at every setting (about twice the runs)
    python benchmarks/study.py --only arr8     # the cells of one setting (pilots); --methods sgd,cgad likewise
    python benchmarks/study.py --verify 4      # 4 done runs again, compared bit for bit, and the study's run time

The reduced setting the tables were made with (:data:`SMALL`, the default; ``--small`` says it
explicitly) is a Llama of d_model 64, 2 layers (0.1 M parameters), H = 4, 96 inner steps per worker,
the rest as below. ``--large``: a Llama of d_model 96, 3 layers (4 heads, 2 KV heads, SwiGLU 256, tied embeddings:
0.33 M parameters) on UTF-8 bytes (vocabulary 257) of the first 2 MB of the Python standard library's
sources, sequences of 64, batch 8, 4 workers, H = 8, 200 inner AdamW steps each (lr 4e-3, 20 warm-up
steps, cosine to 10 %): 100 deltas, so 100 outer steps when every delta is its own outer step
(``master.aggregation=arrival``) and 25 rounds of 4 in round mode.

The plan, in phases (each waits for the one before, since it reads its results):

1. ``tune``: every method of every cell (:data:`PLAN`: setting x method), seed 0, on a log grid of
   outer lrs (factor 2, on the method family's lattice ``BASE * 2**k``), 5 points around the method's
   prior, extended one point at a time until the best lr is interior;
2. ``seeds``: the best lr of each cell with seeds 1 and 2;
3. ``transfer``: "tuned at tau = 0, run at tau": each cell's method at the lr its family's synchronous
   cell chose (3 seeds where a user decides: async, arr8, heavy; seed 0 elsewhere);
4. ``close``: seeds 3 and 4 for the pairs whose difference is within 2 standard errors (each
   setting's best against every method within reach, CGAD against Adam-Decay), and at 8 arrivals and 2
   rounds (:data:`GOAL_SETTINGS`) for the best and the baseline ``sgd`` whatever their difference;
5. ``precision``: the long heavy-tailed runs of the outer state's precision (:data:`LONG`).

A run whose ``results.json`` exists is never run again (an interrupted study resumes); failures go
to ``study/failures.jsonl`` (``--retry-failed``). Runs whose global model goes above chance at an
evaluation stop there (``sim.stop_above``): they are counted as diverged.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tuning import bracket  # noqa: E402 - benchmarks/tuning.py, beside this file

WORKERS = 4
CHANCE = math.log(257)
MODEL = ["model.d_model=96", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=256"]
COMMON = [
    "recipe=tiny", "launch=sim", f"workers={WORKERS}", "diloco.inner_steps=8", "trainer.max_steps=200",
    "data.tokenizer=byte", "data.max_bytes=2000000", "data.seq_len=64", "data.batch_size=8", "data.val_batches=24",
    "optim.lr=0.004", "optim.warmup_steps=20", "launch.eval_points=4", "trainer.log_every_n_steps=8", *MODEL,
    "sim.parallel=1",  # --jobs runs at a time, one core each (the results do not depend on it)
    f"sim.stop_above={CHANCE:.4f}",
]
#: P(tau > 32) = 10 %: the discretised Lomax law, shape 1, scale 3.67 (median 3), capped at 128, drawn per delta
HEAVY = ["diloco.delay={distribution:pareto,shape:1.0,scale:3.67,max:128}", "sim.delay_per=delta"]
SETTINGS: dict[str, list[str]] = {
    "sync": ["master.aggregation=round", "diloco.delay=0"],  # synchronous DiLoCo: the fair reference
    "async": ["master.aggregation=arrival", "diloco.sync=async", "diloco.delay=0"],  # 4 equal workers: tau = 3
    "arr4": ["master.aggregation=arrival", "diloco.delay=4"],
    "arr6": ["master.aggregation=arrival", "diloco.delay=6"],  # the rebase's control (MISSING_SETTINGS)
    "arr8": ["master.aggregation=arrival", "diloco.delay=8"],
    "arr16": ["master.aggregation=arrival", "diloco.delay=16"],
    "heavy": ["master.aggregation=arrival", *HEAVY],
    "rnd2": ["master.aggregation=round", "diloco.delay=2"],  # 2 rounds of 4: about 8 arrivals
    "rnd4": ["master.aggregation=round", "diloco.delay=4"],  # what recipes named tau4 run (their tau counts rounds)
}
#: which lr a method's "tuned at tau = 0" takes: its family's synchronous cell
FAMILY_SYNC = {"sgd0": "sgd", "sgd0.5": "sgd_m0.5", "sgd0.9": "sgd_m0.9", "adam": "adam"}
#: the lattice of each family's lrs: BASE * 2**k
BASE = {"sgd0": 1.0, "sgd0.5": 0.5, "sgd0.9": 0.1, "adam": 0.002}


@dataclass(frozen=True)
class Method:
    outer: str
    options: dict[str, Any]
    family: str
    k0: int = 0  # the prior: the centre of the first grid is BASE[family] * 2**k0
    note: str = ""
    extra: tuple[str, ...] = ()  # more overrides this method always takes


METHODS: dict[str, Method] = {
    "sgd": Method("staleness_sgd", {"momentum": 0.0}, "sgd0", 0, "staleness-scaled SGD, lr / (1 + tau), no momentum"),
    "sgd_p0": Method("staleness_sgd", {"momentum": 0.0, "power": 0.0}, "sgd0", -3, "plain SGD, a constant lr (no gate)"),
    "sgd_p2": Method("staleness_sgd", {"momentum": 0.0, "power": 2.0}, "sgd0", 2, "staleness-scaled SGD, lr / (1 + tau)^2"),
    "sgd_rb": Method("staleness_sgd", {"momentum": 0.0}, "sgd0", 0,
                     "staleness-scaled SGD, each worker rebased onto its own deltas (sim.rebase)", ("sim.rebase=true",)),
    "sgd_rb_la": Method("staleness_sgd", {"momentum": 0.0}, "sgd0", 0,
                        "the rebase with the look-ahead start: each own delta in flight stands for one of every "
                        "worker's (diloco.lookahead)", ("sim.rebase=true", "diloco.lookahead=true")),
    "sgd_rb_tr": Method("staleness_sgd", {"momentum": 0.0}, "sgd0", 0,
                        "the rebase with the master's trend look-ahead: the others' deltas a base lacks predicted by "
                        "the master's mean movement per delta over its last 8 versions (sim.lookahead_trend)",
                        ("sim.rebase=true", "sim.lookahead_trend=8")),
    "sgd_rb_tr32": Method("staleness_sgd", {"momentum": 0.0}, "sgd0", 0,
                          "sgd_rb_tr over the master's last 32 versions", ("sim.rebase=true", "sim.lookahead_trend=32")),
    "sgd_m0.5": Method("staleness_sgd", {"momentum": 0.5}, "sgd0.5", 0, "the same, Nesterov momentum 0.5"),
    "sgd_m0.5_da": Method("staleness_sgd", {"momentum": 0.5}, "sgd0.5", 0,
                          "momentum 0.5 with DANA's look-ahead: each phase starts where the momentum will carry the "
                          "global before its delta lands (sim.lookahead_momentum)", ("sim.lookahead_momentum=true",)),
    "sgd_m0.9_da": Method("staleness_sgd", {"momentum": 0.9}, "sgd0.9", 0,
                          "momentum 0.9 with DANA's look-ahead (sim.lookahead_momentum)", ("sim.lookahead_momentum=true",)),
    "sgd_mneg": Method("staleness_sgd", {"momentum": -0.5}, "sgd0", 0, "the same, momentum -0.5 (asynchrony begets momentum)"),
    "sgd_m0.9": Method("staleness_sgd", {"momentum": 0.9}, "sgd0.9", 0, "the same, Nesterov momentum 0.9"),
    "nesterov": Method("nesterov", {"momentum": 0.9}, "sgd0.9", -2, "DiLoCo's outer step (no gate)"),
    "poly": Method("poly_nesterov", {"momentum": 0.9}, "sgd0.9", -1, "Poly: Nesterov fed g (1 + tau)^-1/2"),
    "dn": Method("delayed_nesterov", {"momentum": 0.9, "buffer_size": WORKERS}, "sgd0.9", 1,
                 "delayed Nesterov, buffer = workers"),
    "gap": Method("gap_aware", {"momentum": 0.0, "history": 0}, "sgd0", -1, "gap-aware SGD, running estimate"),
    "gap_h": Method("gap_aware", {"momentum": 0.0, "history": 16}, "sgd0", -1, "gap-aware SGD, exact (16 versions)"),
    "dc": Method("dc_asgd", {"momentum": 0.0, "history": 16, "lam": 1.0}, "sgd0", -1, "DC-ASGD, exact, lambda 1"),
    "adam": Method("adam", {}, "adam", 0, "plain Adam (no gate): the control"),
    "adam_decay": Method("adam_decay", {}, "adam", 0, "Adam-Decay, gate exp(-0.2 tau)"),
    "cgad": Method("cgad", {"state_layout": "naive"}, "adam", -1, "CGAD (the paper's, unchanged; m and v as FP32 buffers)"),
}
#: the cells (setting -> methods): the synchronous reference, then the audit's baseline (sgd), the
#: master-side corrections (gap, dc), CGAD and DiLoCo's Nesterov (the old default) at each delay, the
#: worker-side rebase (sgd_rb: sim.rebase; not at async, where it changes nothing with instant
#: transfers), Nesterov momentum 0.5 under the gate (sgd_m0.5) up to 8 arrivals, and at 8 arrivals two cheap
#: variants of the baseline (power 2, momentum -0.5). At
#: a fixed delay a constant gate is a constant lr factor after the first tau arrivals, so nesterov is
#: sgd_m0.9 there up to that warm-up, and adam_decay is cgad.
PLAN: dict[str, list[str]] = {
    "sync": ["sgd", "sgd_m0.9", "sgd_m0.5"],  # sgd_m0.9 at tau = 0 is DiLoCo's Nesterov step exactly
    "async": ["sgd", "gap", "dc", "cgad", "nesterov", "sgd_m0.5"],
    "arr4": ["sgd", "gap", "cgad", "nesterov", "sgd_rb", "sgd_rb_la", "sgd_m0.5"],
    "arr8": ["sgd", "gap", "dc", "cgad", "nesterov", "sgd_rb", "sgd_rb_la", "sgd_rb_tr", "sgd_rb_tr32", "sgd_m0.5_da",
             "sgd_m0.9_da", "sgd_p2", "sgd_mneg", "sgd_m0.5"],
    "arr16": ["sgd", "gap", "cgad", "nesterov", "sgd_rb", "sgd_rb_la"],
    "heavy": ["sgd", "sgd_rb"],
    "arr6": ["sgd"],  # 6 deltas missing from a base, as at 8 arrivals after the rebase (MISSING_SETTINGS)
    "rnd2": ["sgd", "sgd_rb", "sgd_rb_la"],  # 2 rounds of 4 (the unit the recipes' tau counts): about 8 arrivals
}
#: --full: the rest of the grid (momentum for the SGD family, the other Adam and Nesterov variants,
#: the heavy tail, round-mode delays)
FULL_EXTRA: dict[str, list[str]] = {
    "sync": ["adam"],
    "async": ["sgd_m0.9", "poly", "dn", "adam", "adam_decay", "gap_h"],
    "arr4": ["sgd_m0.9", "dc", "dn", "adam"],
    "arr8": ["sgd_p0", "sgd_m0.9", "gap_h", "dn", "adam"],
    "arr16": ["sgd_m0.5", "sgd_m0.9", "dc", "dn", "adam"],
    "heavy": ["sgd_m0.9", "gap", "nesterov", "poly", "dn", "adam", "adam_decay", "cgad"],
    "rnd2": ["sgd_m0.9", "gap", "adam", "cgad"],
    "rnd4": ["sgd", "sgd_rb", "gap", "adam", "cgad"],
}
SEEDS = (0, 1, 2)
CLOSE_SEEDS = (3, 4)
#: the issue's goal (R at 8 arrivals) and its round-mode counterpart (2 rounds, the unit the recipes'
#: tau counts): their best cell and the baseline (sgd) get seeds 3 and 4 even when they are not within
#: 2 standard errors, for the goal's R and paired CI
GOAL_SETTINGS = ("arr8", "rnd2")
#: the rebase's control: at 8 arrivals a rebased phase still lacks the other workers' 6 deltas; plain
#: sgd at 6 arrivals lacks 6 deltas too (own and others'). Seeds 3 and 4 for it, so that it pairs
#: with arr8's sgd_rb over five seeds: if the two match, what the rebase leaves is just the count of
#: deltas missing, whoever made them
MISSING_SETTINGS = ("arr6",)
TRANSFER_SEEDS = {"async": SEEDS, "arr8": SEEDS, "heavy": SEEDS}  # elsewhere seed 0 only
POINTS, MAX_EXTEND = 5, 4
#: the precision runs (issue 24, section 4): heavy-tailed delays past tau_cut, 1000+ outer steps
LONG = {
    "common": ["diloco.inner_steps=2", "trainer.max_steps=504", "model.d_model=64", "model.n_layers=2",
               "model.ffn_hidden=172", "data.val_batches=4", "launch.eval_points=252", "optim.warmup_steps=40"],
    "methods": ("adam_decay", "cgad"),
    "states": ("naive-bf16", "naive-int8", "fp32"),  # naive FP32 is scaled FP32 up to rounding (a unit test)
    "beta2": (0.999, 0.95),  # 0.999 first: there v decays slowly enough to reach a low-precision floor
    "lr": 0.002,
    "seeds": SEEDS,
}

QUICK = {"common_extra": ["trainer.max_steps=32", "model.d_model=32", "model.n_layers=1", "model.ffn_hidden=64",
                          "data.val_batches=2", "data.max_bytes=300000"],
         "plan": {"sync": ["sgd"], "arr8": ["sgd", "cgad"]}, "points": 3, "seeds": (0, 1)}


#: the reduced setting the study ran on this shared 2-core machine (the default; --large for the other): 0.1 M parameters, H = 4,
#: 96 inner steps per worker (96 deltas: 96 outer steps in arrival mode, 24 rounds of 4 in round mode);
#: under a minute a run here, against 3-10 min for --large
SMALL = {"common_extra": ["trainer.max_steps=96", "diloco.inner_steps=4", "model.d_model=64", "model.n_layers=2",
                          "model.ffn_hidden=172", "data.val_batches=8", "optim.warmup_steps=10",
                          "launch.eval_points=2"]}


def lr_of(method: str, k: int) -> float:
    m = METHODS[method]
    return float(f"{BASE[m.family] * 2.0 ** k:.4g}")


def job(setting: str, method: str, k: int, seed: int, extra: tuple[str, ...] = (), block: str = "") -> dict[str, Any]:
    """One run: ``method`` at lattice point ``k`` in ``setting`` with ``seed`` (``extra``: more overrides)."""
    m, lr = METHODS[method], lr_of(method, k)
    ov = [f"outer={m.outer}", f"outer.lr={lr}", f"seed={seed}", *SETTINGS[setting]]
    ov += [f"outer.options.{key}={value}" for key, value in sorted(m.options.items())] + list(m.extra) + list(extra)
    ident = hashlib.sha256(json.dumps(ov).encode()).hexdigest()[:10]
    return {"id": f"{setting}-{method}-lr{lr:g}-s{seed}-{ident}", "setting": setting, "method": method, "k": k,
            "lr": lr, "seed": seed, "block": block, "overrides": ov}


def read_results(root: Path, j: dict) -> dict | None:
    """The ``results.json`` of job ``j`` under ``root`` (None: not run, or unreadable)."""
    try:
        return json.loads((root / "runs" / j["id"] / "results.json").read_text())
    except (OSError, ValueError):
        return None


def final_loss(r: dict | None) -> float:
    """Final eval loss; inf when the run diverged (above chance, not finite, stopped early); nan if not run."""
    if r is None:
        return math.nan
    return math.inf if r.get("diverged") or not math.isfinite(r["eval_loss"]) else float(r["eval_loss"])


def failed_jobs(root: Path, *, retry: bool) -> set[str]:
    """The ids of the jobs ``root/failures.jsonl`` records as failed (none when they are to be ``retry``-ed)."""
    p = root / "failures.jsonl"
    if not p.is_file() or retry:
        return set()
    return {json.loads(x)["id"] for x in p.read_text().splitlines() if x.strip()}


@dataclass
class Cell:
    setting: str
    method: str
    ks: list[int] = field(default_factory=list)


class Study:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        large = bool(getattr(args, "large", False)) and not args.quick
        q = QUICK if args.quick else {} if large else SMALL
        default = "study_quick" if args.quick else "study" if large else "study_small"
        self.root = Path(args.root or (ROOT / default)).resolve()
        plan = q.get("plan", PLAN)
        if args.full and not args.quick:
            plan = {s: list(PLAN.get(s, [])) + FULL_EXTRA.get(s, []) for s in SETTINGS}
        if args.only:
            plan = {s: v for s, v in plan.items() if s in args.only.split(",")}
        if args.methods:
            plan = {s: [m for m in v if m in args.methods.split(",")] for s, v in plan.items()}
        self.plan = {s: list(v) for s, v in plan.items() if v}
        self.points = q.get("points", POINTS)
        self.seeds = q.get("seeds", SEEDS)
        extra = q.get("common_extra", [])
        keys = {e.split("=")[0] for e in extra}
        self.common = [c for c in COMMON if c.split("=")[0] not in keys] + list(extra)

    # ------------------------------------------------------------------ bookkeeping
    def results(self, j: dict) -> dict | None:
        return read_results(self.root, j)

    def loss(self, j: dict) -> float:
        return final_loss(self.results(j))

    def failed(self) -> set[str]:
        return failed_jobs(self.root, retry=self.args.retry_failed)

    # ------------------------------------------------------------------ tuning
    def grid(self, setting: str, method: str) -> list[int]:
        """The lattice points of a cell's tuning so far: the first grid, then one more point past an
        edge that won, until the best is interior (at most MAX_EXTEND more). Stops at a point not yet run."""
        k0, half = METHODS[method].k0, self.points // 2
        return bracket(range(k0 - half, k0 + half + 1), lambda k: self.loss(job(setting, method, k, 0)),
                       lambda k: k - 1, lambda k: k + 1, MAX_EXTEND)[0]

    def best_k(self, setting: str, method: str) -> int | None:
        """The tuned lattice point (seed 0; ties to the smaller lr), None while the tuning is not done."""
        ks = self.grid(setting, method)
        losses = [self.loss(job(setting, method, k, 0)) for k in ks]
        if any(math.isnan(x) for x in losses):
            return None
        return min(zip(losses, ks))[1]

    def cells(self) -> list[tuple[str, str]]:
        return [(s, m) for s, ms in self.plan.items() for m in ms]

    def tuning_jobs(self) -> list[dict]:
        return [job(s, m, k, 0, block="tune") for s, m in self.cells() for k in self.grid(s, m)]

    # ------------------------------------------------------------------ the other phases
    def seed_jobs(self) -> list[dict]:
        out = []
        for s, m in self.cells():
            k = self.best_k(s, m)
            if k is not None:
                out += [job(s, m, k, seed, block="seeds") for seed in self.seeds[1:]]
        return out

    def sync_k(self, method: str) -> int | None:
        """The lattice point the method's family chose synchronously (None: not tuned yet)."""
        ref = FAMILY_SYNC[METHODS[method].family]
        if "sync" not in self.plan or ref not in self.plan["sync"]:
            return None
        return self.best_k("sync", ref)

    def transfer_jobs(self) -> list[dict]:
        out = []
        for s, m in self.cells():
            k = self.sync_k(m)
            if s != "sync" and k is not None:
                reduced = self.args.quick or self.args.small
                seeds = self.seeds[:1] if reduced else TRANSFER_SEEDS.get(s, self.seeds[:1])
                out += [job(s, m, k, seed, block="transfer") for seed in seeds]
        return out

    def tuned_losses(self, s: str, m: str, seeds=None) -> list[float]:
        k = self.best_k(s, m)
        return [] if k is None else [self.loss(job(s, m, k, seed)) for seed in (seeds or self.seeds)]

    def close_jobs(self) -> list[dict]:
        """Seeds 3 and 4 for pairs within 2 standard errors of each other (paired by seed)."""
        if self.args.quick:
            return []
        out = []
        for s, methods in self.plan.items():
            means = {}
            for m in methods:
                xs = self.tuned_losses(s, m, SEEDS)
                if xs and all(math.isfinite(x) for x in xs):
                    means[m] = statistics.mean(xs)
            if len(means) < 2:
                continue
            best = min(means, key=means.get)  # type: ignore[arg-type]
            pairs = [(best, m) for m in means if m != best]
            if "cgad" in means and "adam_decay" in means:
                pairs.append(("cgad", "adam_decay"))
            for a, b in pairs:
                d = [x - y for x, y in zip(self.tuned_losses(s, a, SEEDS), self.tuned_losses(s, b, SEEDS))]
                se = statistics.stdev(d) / math.sqrt(len(d))
                goal = s in GOAL_SETTINGS and b == "sgd"
                if abs(statistics.mean(d)) < 2 * se or goal:
                    for m in (a, b):
                        k = self.best_k(s, m)
                        out += [job(s, m, k, seed, block="close") for seed in CLOSE_SEEDS]  # type: ignore[arg-type]
        for s in MISSING_SETTINGS:
            for m in self.plan.get(s, []):
                k = self.best_k(s, m)
                if k is not None:
                    out += [job(s, m, k, seed, block="close") for seed in CLOSE_SEEDS]
        if out and any(s in self.plan for s in GOAL_SETTINGS) and "sync" in self.plan:
            # the synchronous reference's seeds 3 and 4 too, so that R is per seed over all five
            refs = {m: self.tuned_losses("sync", m, SEEDS) for m in self.plan["sync"]}
            refs = {m: statistics.mean(x) for m, x in refs.items() if x and all(math.isfinite(v) for v in x)}
            if refs:
                ref = min(refs, key=refs.get)  # type: ignore[arg-type]
                out += [job("sync", ref, self.best_k("sync", ref), seed, block="close")  # type: ignore[arg-type]
                        for seed in CLOSE_SEEDS]
        return out

    def long_jobs(self) -> list[dict]:
        """The precision runs: Adam-Decay and CGAD with each outer-state layout and beta2, heavy tail."""
        asked = bool(self.args.only) and "long" in self.args.only.split(",")
        if self.args.quick or (self.args.only and not asked) or (self.args.methods and not asked):
            return []
        out = []
        for b2 in LONG["beta2"]:  # pairs first: each (beta2, state) row is both methods, all seeds
            for st in LONG["states"]:
                for m in LONG["methods"]:
                    extra = [*LONG["common"], f"outer.options.betas=[0.9,{b2}]"]
                    if st.startswith("naive"):
                        extra.append("outer.options.state_layout=naive")
                    if st.endswith("bf16"):
                        extra.append("outer.state_dtype=bf16")
                    if st.endswith("int8"):
                        extra.append("outer.state_dtype=int8")
                    k = round(math.log2(LONG["lr"] / BASE["adam"]))
                    for seed in LONG["seeds"]:
                        j = job("heavy", m, k, seed, tuple(extra), block="long")
                        j.update(id="long-" + j["id"], state=st, beta2=b2)
                        out.append(j)
        return out

    def all_jobs(self) -> list[dict]:
        jobs = self.tuning_jobs() + self.seed_jobs() + self.transfer_jobs() + self.close_jobs() + self.long_jobs()
        seen, out = set(), []
        for j in jobs:
            if j["id"] not in seen:
                seen.add(j["id"])
                out.append(j)
        return out

    # ------------------------------------------------------------------ running
    def run_batch(self, jobs: list[dict], phase: str) -> int:
        failed = self.failed()
        todo = [j for j in jobs if self.results(j) is None and j["id"] not in failed]
        if todo:
            print(f"== {phase}: {len(todo)} runs to make ({len(jobs) - len(todo)} done or failed)", flush=True)
        specs = [(j, self.common, str(self.root)) for j in todo]
        if self.args.jobs <= 1 or len(specs) <= 1:
            for spec in specs:
                self._report_one(run_job(spec))
        else:
            import multiprocessing as mp

            with mp.get_context("spawn").Pool(self.args.jobs, initializer=_child_init) as pool:
                for rec in pool.imap_unordered(run_job, specs):
                    self._report_one(rec)
        return len(todo)

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

    def verify(self, n: int) -> int:
        """Run ``n`` done runs again (a seeded draw, one method each first) in a scratch folder with this checkout's code and
        compare what the tables read, bit for bit; and say how long the stored runs took."""
        import random
        import tempfile

        done = sorted((j for j in self.all_jobs() if self.results(j) is not None), key=lambda j: j["id"])
        walls = [float(self.results(j).get("wall_seconds", 0.0)) for j in done]  # type: ignore[union-attr]
        print(f"{len(done)} runs done; their run time: {sum(walls) / 60:.0f} min on one core "
              f"(median {statistics.median(walls) if walls else 0:.0f} s a run)")
        keys = ("eval_loss", "final_train_loss", "eval_curve", "train_curve", "diverged")
        bad = 0
        with tempfile.TemporaryDirectory(prefix="study-verify-") as tmp:
            rng, by_method = random.Random(0), {}
            for j in done:
                by_method.setdefault(j["method"] + (" long" if j["block"] == "long" else ""), []).append(j)
            # one run of each method first (every outer step, the rebase, the precision block), then any
            picks = [rng.choice(js) for _, js in sorted(by_method.items())]
            picks = (rng.sample(picks, n) if n < len(picks) else
                     picks + rng.sample([j for j in done if j not in picks], min(n - len(picks), len(done) - len(picks))))
            for j in picks:
                stored = self.results(j) or {}
                saved = json.loads((self.root / "runs" / j["id"] / "job.json").read_text())
                if saved["overrides"] != j["overrides"]:
                    print(f"   {j['id']}: was run with other overrides than this plan's")
                    bad += 1
                    continue
                rec = run_job((j, saved.get("common", self.common), tmp))  # the common part it was run with
                new = json.loads((Path(tmp) / "runs" / j["id"] / "results.json").read_text()) if not rec.get("error") else {}
                same = [k for k in keys if stored.get(k) == new.get(k)]
                ok = len(same) == len(keys)
                bad += not ok
                print(f"   {j['id']}: eval {stored.get('eval_loss')!r} -> {new.get('eval_loss')!r} "
                      f"({'identical' if ok else 'DIFFERENT: ' + ', '.join(k for k in keys if k not in same)}; "
                      f"{rec['wall']:.0f} s)", flush=True)
        return 1 if bad else 0

    def run(self) -> int:
        t0 = time.time()
        self.root.mkdir(parents=True, exist_ok=True)
        _prepare_data(self.common)
        with open(self.root / "driver_log.jsonl", "a") as f:
            f.write(json.dumps({"event": "start", "time": t0, "argv": sys.argv[1:]}) + "\n")
        for phase, make in (("tune", self.tuning_jobs), ("seeds", self.seed_jobs), ("transfer", self.transfer_jobs),
                            ("close", self.close_jobs), ("precision", self.long_jobs)):
            while self.run_batch(make(), phase):  # tuning grows its grids from what it ran
                pass
        wall = time.time() - t0
        with open(self.root / "driver_log.jsonl", "a") as f:
            f.write(json.dumps({"event": "end", "time": time.time(), "wall": wall}) + "\n")
        print(f"study session: {wall / 60:.1f} min", flush=True)
        return self.report()

    def plan_text(self) -> int:
        jobs = self.all_jobs()
        done = 0
        for j in jobs:
            ok = self.results(j) is not None
            done += ok
            print(f"{'done' if ok else '    '} {j['block']:9} python train.py "
                  f"{' '.join(self.common + j['overrides'])} run_id={j['id']}")
        print(f"{len(jobs)} runs planned so far ({done} done); later phases are planned from the earlier ones' results")
        return 0

    def report(self) -> int:
        from study_report import write_report  # benchmarks/study_report.py

        out = Path(self.args.out) if self.args.out else (self.root / "results.md" if self.args.quick or self.args.only
                                                         or self.args.methods else ROOT / "docs" / "study_results.md")
        write_report(self, out)
        print(f"wrote {out}")
        return 0


# ----------------------------------------------------------------------------- a run, in a pool process or here
def _child_init() -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)  # one run per core
    logging.basicConfig(level=logging.WARNING)


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
    rec: dict[str, Any] = {"id": j["id"], "block": j.get("block", ""), "time": time.time()}
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
    ap.add_argument("--quick", action="store_true", help="a smoke version (2 cells, 32 steps) in study_quick/")
    ap.add_argument("--small", action="store_true", help="the reduced setting (SMALL, docs/study.md's tables; the default)")
    ap.add_argument("--large", action="store_true", help="the 0.33 M-parameter setting (3-10 min a run here) in study/")
    ap.add_argument("--full", action="store_true", help="the whole grid (every method at every setting; ~2x the runs)")
    ap.add_argument("--plan", action="store_true", help="list the runs planned so far (done or not); run nothing")
    ap.add_argument("--report", action="store_true", help="write the tables from what is done; run nothing")
    ap.add_argument("--only", help="comma-separated settings to run (and 'long' for the precision runs)")
    ap.add_argument("--methods", help="comma-separated methods to run")
    ap.add_argument("--root", help="study folder (default study_small/; study/ with --large, study_quick/ with --quick)")
    ap.add_argument("--out", help="report file (default docs/study_results.md)")
    ap.add_argument("--retry-failed", action="store_true")
    ap.add_argument("--verify", type=int, metavar="N", help="run N done runs again and compare them bit for bit; run nothing else")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    study = Study(args)
    if args.plan:
        return study.plan_text()
    if args.report:
        return study.report()
    if args.verify is not None:  # --verify 0 only prints the run time; it must never start the study
        return study.verify(args.verify)
    return study.run()


if __name__ == "__main__":
    sys.exit(main())
