"""When asynchrony wins, measured fairly: asynchronous DiLoCo beside every synchronous baseline, on the simulator.

    python benchmarks/sim_stragglers.py --plan                 # what would run, what is done
    python benchmarks/sim_stragglers.py                        # everything (resumable), then the report
    python benchmarks/sim_stragglers.py --phases tune          # one phase: tune | seeds | sweep
    python benchmarks/sim_stragglers.py --scenarios straggler  # some scenarios only
    python benchmarks/sim_stragglers.py --report               # the tables and the plot from what finished

Every run is ``train.py launch=sim`` composed in this process (the product's own ``run_sim``) and
writes ``<out>/runs/<id>/results.json`` when it ends; a run whose results exist is never run
again, so an interrupted study resumes where it stopped (failures: ``<out>/failures.jsonl``). The
report (``benchmarks/stragglers_report.py``) writes ``docs/stragglers_results.md`` and
``docs/figures/stragglers_scenarios.png``; docs/stragglers.md says what they show.

**Setting.** A small Llama (d_model 64, 2 layers, 4 heads / 2 KV heads, FFN 128, 0.09 M parameters,
UTF-8 bytes, sequences of 32, batch 8, AdamW 4e-3 with 20 warm-up steps and a cosine to 10 %), K =
4 workers, H = 8, 8 evaluations of 8 validation batches per run: sized so the whole study runs in
about an hour and a half on a shared 2-core machine. One unit of simulated time is one inner step of
a speed-1 worker. Every scenario has one **budget of simulated time**, 160 units, that every arm
gets (``sim.max_time``): each worker keeps starting phases while they end in the budget.
``trainer.max_steps`` (also the inner lr schedule's length) is, per arm and seed, the steps its
fastest worker takes in the budget, found by simulating the arm's schedule with no arithmetic first
(:func:`schedule_steps`: the schedule does not depend on the weights), so every arm's inner lr
decays over the budget it has.

**Scenarios** (:data:`SCENARIOS`, run in the order of :data:`MAIN`): ``straggler`` (speeds [1, 1,
1, 1/4]: a lockstep round takes 32 units, so 5 rounds in the budget), ``xdc`` (a cross-datacenter
link: 4 equal workers whose upload of the uncompressed FP32 delta takes rho = 0.5 of a phase's
compute, as a 1.1 B-parameter bf16 delta, 2.2 GB, over 1 Gbit/s takes ~18 s against ~40 s of
compute for H = 100; the download of a version the same), ``preempt`` (4 equal workers, each
preempted at a seeded Poisson rate of 1 per 100 units of up time for an exponential 10 units: ~9 %
of worker time down plus the lost partial phases), ``spread`` ([1, 2/3, 1/2, 1/3]), ``varying`` (4 workers whose speed alternates between 1 and 1/4 in
spells of exponential lengths, means 30 and 10 units, seeded per seed and worker: in expectation
0.8125 a worker, the straggler scenario's total of 3.25, but every worker slows down in turn),
``xdc1`` (the link at rho = 1, tuned on its own), and ``xdc_r<rho>`` (the link at rho 2, 1 and 0:
the sweep, ``sync`` and ``async`` only, with ``xdc``'s tuned lrs). The preemption and speed draws
are the seed's: every arm of a seed sees the same ones (paired).

**Arms** (:data:`ARMS`): synchronous ``sync`` (lockstep, every worker, delay 0), ``sync_drop``
(lockstep without the workers slower than half the fastest), ``sync_q3_drop`` (synchronous rounds
that close with 3 of 4 deltas or at a deadline of twice a fast worker's round; a late delta's phase
is given up: ``sim.barrier``), ``sync_q3_apply`` (the same rounds, a late delta applied in the round
it reaches, with its staleness: ``sim.late=apply``), ``sync_dylu`` (lockstep with Dynamic Local
Updates, token-weighted), ``sync_overlap`` (lockstep with one round of delay: each worker's phase r
starts from version r - 1, so its upload and the next download overlap the next phase), and
asynchronous ``async`` (one outer step per arriving delta) and, on the ``xdc1`` link,
``async_rebase`` (each phase started from the newest version minus the worker's own deltas it does
not hold yet: the product's asynchronous worker, ``diloco.rebase``; ``sim.rebase``); in ``xdc`` also ``*_int4`` (int4 deltas
with error feedback) and ``*_frag4`` (4 fragments, Streaming DiLoCo) on both sides. Also defined,
not run by default: ``async_q3``, ``async_dylu``.

**Outer optimizers, tuned the same way** (:data:`FAMILIES`, :func:`families_of`):
``poly_nesterov`` (momentum 0.9, fed ``g * (1 + tau) ** -0.5``), which at staleness 0 is exactly
DiLoCo's Nesterov, and ``staleness_sgd`` (momentum 0, the delta times ``lr / (1 + tau)``), plain
SGD at staleness 0. The ``straggler``, ``preempt`` and ``xdc`` arms are tuned in both (each arm's best
(family, lr) at seed 0 is its), ``spread``, ``varying``, ``xdc1`` and the arms ``sync_overlap`` and
``sync_q3_apply`` in ``staleness_sgd`` only (every straggler arm's best), the sweep in
``poly_nesterov`` only (``xdc``'s lrs in that family). Each 5-point log lr grid (0.1-1.6 or 0.125-2, factor 2) is extended by one
point (up to four times) on the side where the best lr sits on the edge, so the chosen lr is
interior. Tuning: seed 0, the final eval loss at the budget (equal time). Then seeds 1 and 2 at each
(scenario, arm)'s best. The scenarios with ``tuned_as`` (the sweep) reuse that scenario's tuned
lrs (all three seeds), run after every tuned scenario.

Runs one at a time, one intra-op thread each (run it under ``nice``): see docs/stragglers.md for how
long the whole study took.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# one way to compose a config and run a job with the product's launch=sim code, for every study
from study import _compose, _prepare_data, failed_jobs, final_loss, read_results, run_job  # noqa: E402 - benchmarks/study.py, beside this file

H, K = 8, 4
MODEL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
         "data.tokenizer=byte", "data.max_bytes=2000000", "data.seq_len=32", "data.batch_size=8", "data.val_batches=8",
         "optim.lr=0.004", "optim.warmup_steps=20"]
COMMON = ["recipe=tiny", "launch=sim", f"workers={K}", f"diloco.inner_steps={H}", *MODEL, "launch.eval_points=8",
          "trainer.log_every_n_steps=8", "sim.parallel=1", "sim.stop_above=6.0"]  # ln(257) = 5.55: diverged
SEEDS = (0, 1, 2)  # the default (``--seeds 3``); seed 0 tunes
#: the uncompressed delta of the study's model (FP32), bytes: the link's rho is set against it
DELTA_BYTES = None  # filled by delta_bytes()
RHO_MAIN = 0.5
SWEEP = (2.0, 1.0, 0.0)  # in the order they run

SCENARIOS: dict[str, dict[str, Any]] = {
    "straggler": {"speeds": [1.0, 1.0, 1.0, 0.25], "budget": 160.0},
    "xdc": {"speeds": [1.0] * K, "rho": RHO_MAIN, "budget": 160.0},
    "preempt": {"speeds": [1.0] * K, "preempt": {"rate": 1 / 100, "down": 10.0, "law": "exponential"}, "budget": 160.0},
    "spread": {"speeds": [1.0, 2 / 3, 1 / 2, 1 / 3], "budget": 160.0},
    **{f"xdc_r{rho:g}": {"speeds": [1.0] * K, "rho": rho, "budget": 160.0, "tuned_as": "xdc"} for rho in SWEEP},
    "varying": {"speeds": [1.0] * K, "varying": {"fast": 30.0, "slow": 10.0, "slow_speed": 0.25}, "budget": 160.0},
    "xdc1": {"speeds": [1.0] * K, "rho": 1.0, "budget": 160.0},
}
#: in the order they run (an interrupted study has the whole of each scenario it reached)
MAIN = ("straggler", "xdc", "preempt", "spread", "varying", "xdc1")

SYNC = ["diloco.sync=lockstep", "diloco.delay=0"]
BARRIER = ["diloco.sync=async", "master.aggregation=round", "sim.barrier=true", "sim.quorum=3"]
DYLU = ["diloco.inner_steps=auto", f"diloco.dylu_steps={H}", "master.weighting=tokens"]
INT4 = ["diloco.delta_dtype=int4"]
FRAG4 = ["diloco.fragments=4"]
ARMS: dict[str, dict[str, Any]] = {
    "sync": {"sync": True, "ov": SYNC},
    "sync_drop": {"sync": True, "ov": SYNC, "drop_slow": True},
    "sync_q3_drop": {"sync": True, "ov": [*BARRIER, "sim.late=drop"], "deadline": True},
    "sync_q3_apply": {"sync": True, "ov": [*BARRIER, "sim.late=apply"], "deadline": True},
    "sync_dylu": {"sync": True, "ov": [*SYNC, *DYLU]},
    "sync_overlap": {"sync": True, "ov": ["diloco.sync=lockstep", "diloco.delay=1"]},
    "sync_int4": {"sync": True, "ov": [*SYNC, *INT4]},
    "sync_frag4": {"sync": True, "ov": [*SYNC, *FRAG4]},
    "async": {"sync": False, "ov": ["diloco.sync=async", "master.aggregation=arrival"]},
    "async_rebase": {"sync": False, "ov": ["diloco.sync=async", "master.aggregation=arrival", "sim.rebase=true"]},
    "async_q3": {"sync": False, "ov": ["diloco.sync=async", "master.aggregation=round", "sim.quorum=3"]},
    "async_dylu": {"sync": False, "ov": ["diloco.sync=async", "master.aggregation=arrival", *DYLU]},
    "async_int4": {"sync": False, "ov": ["diloco.sync=async", "master.aggregation=arrival", *INT4]},
    "async_frag4": {"sync": False, "ov": ["diloco.sync=async", "master.aggregation=arrival", *FRAG4]},
}
#: the arms each scenario compares (the others do not apply there: no slow worker to drop, no link to overlap)
SCENARIO_ARMS = {
    "straggler": ["sync", "sync_drop", "sync_q3_drop", "sync_dylu", "sync_overlap", "sync_q3_apply", "async"],
    "spread": ["sync", "sync_drop", "sync_q3_drop", "sync_dylu", "async"],
    "xdc": ["sync", "sync_int4", "sync_frag4", "async", "async_int4", "async_frag4"],
    "preempt": ["sync", "sync_q3_drop", "async"],
    # no worker is slow on average, so "drop the stragglers" keeps every worker (= sync); a quorum with a
    # deadline is the form of dropping that follows the speeds as they change
    "varying": ["sync", "sync_q3_drop", "sync_dylu", "async"],
    "xdc1": ["sync", "sync_overlap", "sync_q3_apply", "async", "async_rebase"],
    **{f"xdc_r{rho:g}": ["sync", "async"] for rho in SWEEP},
}
#: family -> (outer optimizer, its 5-point lr grid), sync and async alike: ``poly_nesterov`` (Nesterov
#: momentum 0.9 fed ``g * (1 + tau) ** -0.5``), which at staleness 0 (every lockstep round, every on-time
#: quorum round) is exactly DiLoCo's Nesterov; ``staleness_sgd`` (momentum 0, the delta times
#: ``lr / (1 + tau)``), which at staleness 0 is plain SGD: the staleness study's pick (docs/study.md).
FAMILIES: dict[str, tuple[str, tuple[float, ...]]] = {
    "nesterov": ("poly_nesterov", (0.1, 0.2, 0.4, 0.8, 1.6)),
    "sgd": ("staleness_sgd", (0.125, 0.25, 0.5, 1.0, 2.0)),
}
#: the families each scenario's arms are tuned in (sync and async alike); absent: ``nesterov`` only.
#: ``straggler``'s and ``preempt``'s original arms are tuned in both; every straggler arm's best was ``staleness_sgd``, so the
#: scenarios and arms tuned since then are tuned in it alone (:data:`SGD_ONLY_ARMS`)
SCENARIO_FAMILIES: dict[str, tuple[str, ...]] = {"straggler": ("nesterov", "sgd"), "preempt": ("nesterov", "sgd"),
                                                 "spread": ("sgd",), "xdc": ("nesterov", "sgd"),
                                                 "varying": ("sgd",), "xdc1": ("sgd",)}
SGD_ONLY_ARMS = ("sync_overlap", "sync_q3_apply", "async_rebase")  # the rebase needs a momentum-free outer step
EXTEND = 4  # grid points added beyond an edge, at most, per side (async wanted 4x below the base grid)


def families_of(scenario: str, arm: str) -> list[str]:
    """The families an arm is tuned in (every arm of a scenario the same ones); its best (family, lr)
    at seed 0 is the arm's."""
    if arm in SGD_ONLY_ARMS:
        return ["sgd"]
    return list(SCENARIO_FAMILIES.get(scenario, ("nesterov",)))


# ----------------------------------------------------------------------------- the plan


def scenario_overrides(name: str, seed: int, drop_slow: bool = False) -> tuple[list[str], list[float]]:
    """``(sim overrides, speeds)`` of a scenario for ``seed`` (``drop_slow``: without the workers
    slower than half the fastest)."""
    sc = SCENARIOS[name]
    speeds = list(sc["speeds"])
    keep = [k for k, v in enumerate(speeds) if not drop_slow or v >= 0.5 * max(speeds)]
    speeds = [speeds[k] for k in keep]
    ov = [f"workers={len(keep)}", "sim.speeds=[" + ",".join(f"{v:.6g}" for v in speeds) + "]",
          f"sim.max_time={sc['budget']:g}"]
    if sc.get("rho"):
        bandwidth = delta_bytes() / (sc["rho"] * H)
        ov.append(f"sim.bandwidth={bandwidth:.6g}")
    if "preempt" in sc:
        law = {**sc["preempt"], "seed": seed}
        ov.append("sim.preempt={" + ",".join(f"{k}:{v}" for k, v in law.items()) + "}")
    if "varying" in sc:
        traces = [varying_trace(seed, k, sc["budget"], **sc["varying"]) for k in keep]
        ov.append("sim.traces=" + json.dumps(traces).replace(" ", ""))
    return ov, speeds


def varying_trace(seed: int, k: int, budget: float, *, fast: float, slow: float, slow_speed: float) -> list[list[float]]:
    """Worker ``k``'s speed over time: fast (1) and slow (``slow_speed``) spells of exponential
    lengths (means ``fast`` and ``slow``), from ``random.Random("<seed>:varying:<k>")``."""
    rng = random.Random(f"{seed}:varying:{k}")
    t, points, is_fast = 0.0, [], rng.random() < fast / (fast + slow)
    while t < budget:
        points.append([round(t, 3), 1.0 if is_fast else slow_speed])
        t += rng.expovariate(1.0 / (fast if is_fast else slow))
        is_fast = not is_fast
    return points


def varying_compute(seed: int, name: str = "varying") -> float:
    """The total speed of a ``varying`` scenario's workers over its budget for ``seed`` (the work done
    per unit of time by all of them; 3.25 in expectation, the straggler scenario's)."""
    sc = SCENARIOS[name]
    total = 0.0
    for k in range(len(sc["speeds"])):
        trace = varying_trace(seed, k, sc["budget"], **sc["varying"])
        for i, (t, v) in enumerate(trace):
            end = trace[i + 1][0] if i + 1 < len(trace) else sc["budget"]
            total += v * (end - t)
    return total / sc["budget"]


def delta_bytes() -> int:
    """Bytes of the study model's FP32 delta (every parameter, 4 bytes)."""
    global DELTA_BYTES
    if DELTA_BYTES is None:
        from diloco_lightning.models.llama import LlamaConfig

        dims = {o.split("=")[0][len("model."):]: int(o.split("=")[1]) for o in MODEL if o.startswith("model.")}
        DELTA_BYTES = 4 * LlamaConfig(vocab_size=257, **dims).parameter_count()
    return DELTA_BYTES


def run_id(scenario: str, arm: str, family: str, lr: float, seed: int) -> str:
    return f"{scenario}-{arm}-{family}-lr{lr:g}-s{seed}"


def job(scenario: str, arm: str, family: str, lr: float, seed: int) -> dict[str, Any]:
    spec = ARMS[arm]
    sim_ov, speeds = scenario_overrides(scenario, seed, drop_slow=spec.get("drop_slow", False))
    ov = [*sim_ov, *spec["ov"], f"outer={FAMILIES[family][0]}", f"outer.lr={lr}", f"seed={seed}"]
    if spec.get("deadline"):
        sc = SCENARIOS[scenario]
        comm = 2 * sc.get("rho", 0.0) * H
        ov.append(f"sim.deadline={2 * (H / max(speeds) + comm):g}")
    return {"id": run_id(scenario, arm, family, lr, seed), "scenario": scenario, "arm": arm, "family": family,
            "lr": lr, "seed": seed, "overrides": ov}


class Study:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.root = Path(args.out).resolve()
        default = [*MAIN, *(s for s in SCENARIOS if s not in MAIN)]
        self.scenarios = [s for s in (args.scenarios or default) if s in SCENARIOS]
        #: the seeds every tuned cell runs (``--seeds N``: 0 .. N-1); the report pairs what exists of them
        self.seeds = tuple(range(getattr(args, "seeds", len(SEEDS))))
        self._steps: dict[str, int] = {}
        p = self.root / "steps.json"
        if p.is_file():
            self._steps = json.loads(p.read_text())

    def results(self, j: dict) -> dict | None:
        return read_results(self.root, j)

    def loss(self, j: dict) -> float:
        return final_loss(self.results(j))

    def failed(self) -> set[str]:
        return failed_jobs(self.root, retry=self.args.retry_failed)

    # ------------------------------------------------------------------ tuning: a grid per (scenario, arm, family)

    def grid(self, scenario: str, arm: str, family: str) -> tuple[list[float], bool]:
        """The lrs run or to run for this cell, and whether the grid is settled (the best lr interior,
        or the extension limit reached)."""
        lrs = list(FAMILIES[family][1])
        for _ in range(2 * EXTEND + 1):
            scores = [self.loss(job(scenario, arm, family, lr, SEEDS[0])) for lr in lrs]
            if any(math.isnan(x) for x in scores):
                return lrs, False
            best = min(range(len(lrs)), key=lambda i: (scores[i], lrs[i]))
            grown = len(lrs) - len(FAMILIES[family][1])
            if best == 0 and grown < 2 * EXTEND and lrs[0] / FAMILIES[family][1][0] > 0.5 ** EXTEND * 1.001:
                lrs.insert(0, lrs[0] / 2)
            elif best == len(lrs) - 1 and grown < 2 * EXTEND and lrs[-1] / FAMILIES[family][1][-1] < 2 ** EXTEND / 1.001:
                lrs.append(lrs[-1] * 2)
            else:
                return lrs, True
        return lrs, True

    def tuning_jobs(self) -> tuple[list[dict], bool]:
        """The tuning runs still to do (seed 0), and whether every cell's grid is settled."""
        todo, settled = [], True
        for sc in self.scenarios:
            if "tuned_as" in SCENARIOS[sc]:
                continue
            for arm in SCENARIO_ARMS[sc]:
                if self.args.arms and arm not in self.args.arms:
                    continue
                for fam in families_of(sc, arm):
                    lrs, ok = self.grid(sc, arm, fam)
                    settled &= ok
                    todo += [job(sc, arm, fam, lr, SEEDS[0]) for lr in lrs]
        return todo, settled

    def best(self, scenario: str, arm: str) -> tuple[str, float] | None:
        """The (family, lr) with the lowest final loss at seed 0 (None: tuning not finished); a scenario
        tuned as another takes the other's best lr in each of its own families (the sweep runs in
        ``nesterov`` only, as ``xdc`` was tuned)."""
        source = SCENARIOS[scenario].get("tuned_as", scenario)
        out = []
        for fam in families_of(scenario, arm):
            lrs, ok = self.grid(source, arm, fam)
            if not ok:
                return None
            out += [(self.loss(job(source, arm, fam, lr, SEEDS[0])), fam, lr) for lr in lrs]
        loss, fam, lr = min(out, key=lambda x: (x[0], x[1], x[2]))
        return fam, lr

    def seed_jobs(self, sweep: bool) -> list[dict]:
        """Seeds 1 .. N-1 of every arm at its tuned (family, lr) (the sweep: every seed at ``xdc``'s);
        in each scenario the best synchronous and the best asynchronous arm (seed 0) first."""
        out = []
        for sc in self.scenarios:
            if ("tuned_as" in SCENARIOS[sc]) != sweep:
                continue
            cells = [(arm, b) for arm in SCENARIO_ARMS[sc] if (not self.args.arms or arm in self.args.arms)
                     and (b := self.best(sc, arm)) is not None]
            source = SCENARIOS[sc].get("tuned_as", sc)

            def seed0(cell: tuple[str, tuple[str, float]], source: str = source) -> float:
                return self.loss(job(source, cell[0], cell[1][0], cell[1][1], SEEDS[0]))

            first = [min((c for c in cells if ARMS[c[0]]["sync"] == side), key=seed0, default=None)
                     for side in (True, False)]
            ordered = [c for c in first if c is not None] + [c for c in cells if c not in first]
            for arm, (fam, lr) in ordered:
                out += [job(sc, arm, fam, lr, s) for s in self.seeds if sweep or s != SEEDS[0]]
        return out

    # ------------------------------------------------------------------ running

    def steps_for(self, j: dict) -> int:
        """``trainer.max_steps`` of a run: the steps its fastest worker takes in the budget (cached)."""
        ov = [o for o in j["overrides"] if not o.startswith(("outer=", "outer.lr="))]
        key = json.dumps(ov)
        if key not in self._steps:
            self._steps[key] = schedule_steps(COMMON + ov + ["outer=staleness_sgd"])
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / "steps.json").write_text(json.dumps(self._steps, indent=0))
        return self._steps[key]

    def run_all(self, jobs: list[dict], phase: str) -> None:
        failed = self.failed()
        todo = [j for j in jobs if self.results(j) is None and j["id"] not in failed]
        print(f"== {phase}: {len(jobs)} runs, {len(jobs) - len(todo)} done or failed, {len(todo)} to run", flush=True)
        for j in todo:
            j = {**j, "overrides": j["overrides"] + [f"trainer.max_steps={self.steps_for(j)}"]}
            rec = run_job((j, COMMON, str(self.root)))
            with open(self.root / "log.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            if "error" in rec:
                with open(self.root / "failures.jsonl", "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(f"  FAILED {j['id']}: {rec['error'].splitlines()[0]}", flush=True)
            else:
                print(f"  {j['id']}: eval loss {rec['eval_loss']:.3f}{' (diverged)' if rec['diverged'] else ''} "
                      f"in {rec['wall']:.0f} s", flush=True)

    def run(self) -> int:
        """Scenario by scenario: its tuning (grids grow until every best lr is interior), then its seeds;
        the sweep (which reuses ``xdc``'s tuning) last."""
        self.root.mkdir(parents=True, exist_ok=True)
        _prepare_data(COMMON)
        phases = self.args.phases
        everything = self.scenarios
        for sc in [s for s in everything if "tuned_as" not in SCENARIOS[s]]:
            self.scenarios = [sc]
            while "tune" in phases:
                todo, _ = self.tuning_jobs()
                if not [j for j in todo if self.results(j) is None and j["id"] not in self.failed()]:
                    break
                self.run_all(todo, f"tune {sc}")
            if "seeds" in phases:
                self.run_all(self.seed_jobs(sweep=False), f"seeds {sc}")
        self.scenarios = everything
        if "sweep" in phases:
            self.run_all(self.seed_jobs(sweep=True), "sweep")
        return self.report()

    def plan(self) -> int:
        todo, settled = self.tuning_jobs()
        seeds, sweep = self.seed_jobs(False), self.seed_jobs(True)
        for name, jobs in (("tune", todo), ("seeds", seeds), ("sweep", sweep)):
            done = sum(self.results(j) is not None for j in jobs)
            print(f"{name}: {len(jobs)} runs known so far, {done} done")
        print("tuning settled" if settled else "tuning not settled: grids may still grow, seeds and sweep follow it")
        return 0

    def report(self) -> int:
        from stragglers_report import write_report

        write_report(self, Path(self.args.doc), Path(self.args.plot))
        print(f"wrote {self.args.doc} and {self.args.plot}")
        return 0


# ----------------------------------------------------------------------------- the schedule alone, and one run


def schedule_steps(overrides: list[str]) -> int:
    """The inner steps the fastest worker of this configuration takes in its budget, from simulating
    its schedule with workers that compute nothing (the schedule depends on speeds, traces, links,
    preemptions and DyLU, never on the weights): the model's parameter shapes, zero deltas, no norm
    checks, and an outer optimizer that refuses nothing (``staleness_sgd``: a refused delta would
    publish no version and so change when versions are downloaded; CGAD refuses past tau_cut = 32,
    which no arm here reaches)."""
    import itertools

    import torch

    from diloco_lightning.app.build import build_module, nominal_inner_steps
    from diloco_lightning.app.config import master_config, sim_options
    from diloco_lightning.app.sim import _delay_option, _fragments, dylu_option
    from diloco_lightning.sim import InnerLoop, SimMaster, SimWorker, Simulator
    from diloco_lightning.worker.options import resolve_encoding
    from diloco_lightning.worker.params import module_state

    cfg = _compose(overrides + ["trainer.max_steps=1000000", "run_id=schedule"])
    opts = sim_options(cfg)
    module = build_module(cfg, 257)
    shapes = {k: v.detach() for k, v in module_state(module).items()}
    tokens = int(cfg.data.batch_size) * int(cfg.data.seq_len)
    workers = []
    for i in range(int(cfg.workers)):
        dummy = torch.nn.Parameter(torch.zeros(()))
        inner = InnerLoop(lambda _b, d=dummy: d * 0.0, torch.optim.SGD([dummy], lr=0.0), itertools.repeat(None),
                          count_tokens=lambda _b: tokens)
        params = {k: torch.zeros_like(v) for k, v in shapes.items()}
        workers.append(SimWorker(i, params, inner, inner_steps=nominal_inner_steps(cfg), max_steps=None,
                                 speed=opts.speed(i), fragments=_fragments(cfg)))
    config = master_config(cfg.master, cfg.outer, min_deltas=cfg.workers if cfg.diloco.sync == "lockstep" else 1,
                           fragments=cfg.diloco.get("fragments"))
    config.norm_ratio = config.norm_global_ratio = config.max_delta_norm = None
    encoding, feedback = resolve_encoding(cfg.diloco.delta_dtype, cfg.diloco.topk, cfg.diloco.topk_values,
                                          cfg.diloco.error_feedback)
    opts.batched = False
    sim = Simulator(workers, SimMaster(shapes, config), sync=cfg.diloco.sync, delay=_delay_option(cfg), options=opts,
                    delta_dtype=encoding, error_feedback=feedback, seed=int(cfg.seed), dylu=dylu_option(cfg))
    sim.run()
    return max(w.steps for w in sim.workers)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=None)
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=None)
    ap.add_argument("--phases", nargs="+", default=["tune", "seeds", "sweep"], choices=["tune", "seeds", "sweep"])
    ap.add_argument("--out", default=str(ROOT / "bench_stragglers"))
    ap.add_argument("--plan", action="store_true", help="print what would run and what is done")
    ap.add_argument("--report", action="store_true", help="run nothing: write the report from what finished")
    ap.add_argument("--retry-failed", action="store_true")
    ap.add_argument("--seeds", type=int, default=len(SEEDS),
                    help="seeds per tuned cell, 0 .. N-1 (seed 0 tunes); more than 3 tightens the paired intervals")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "stragglers_results.md"))
    ap.add_argument("--plot", default=str(ROOT / "docs" / "figures" / "stragglers_scenarios.png"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    study = Study(args)
    if args.plan:
        return study.plan()
    if args.report:
        return study.report()
    return study.run()


if __name__ == "__main__":
    sys.exit(main())
