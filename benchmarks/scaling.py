"""Scaling evidence: do K workers give a better model than one worker, near data-parallel? (docs/scaling.md)

    python benchmarks/scaling.py                     # the reduced setting at K = 1, 2, 4, 8 into scaling_reduced/ (resumable)
    python benchmarks/scaling.py --jobs 2            # two runs at a time (one core each; results do not depend on it)
    python benchmarks/scaling.py --setting main      # H = 16, 50 outer steps, 1.1 M parameters (hours a grid on 2 cores)
    python benchmarks/scaling.py --k 4 --arms one,dp,sgd   # a slice
    python benchmarks/scaling.py --curves h          # G against H at K = 4 (h, steps, size: the curves)
    python benchmarks/scaling.py --plan              # every run as a train.py command line, done or not
    python benchmarks/scaling.py --report            # the tables -> docs/scaling_results.md (--out FILE)

Every run is ``train.py launch=sim`` composed in-process (the product's model, data, inner AdamW,
schedule, outer optimizers and master), scored on the same held-out windows (``data.val_windows``:
the first 256 windows of the held-out split, whatever the batch size). The arms, for each K:

* ``one``: one worker alone, batch B, the same steps (``workers=1 outer=fedavg``: plain training);
  its inner lr tuned on a bracketing grid; ``one_tokens``: the same worker run K times longer
  (equal tokens, its schedule stretched), at the tuned lr;
* ``dp``: data-parallel's equivalent, one worker with a K x B batch and the same steps (same tokens as
  K workers), inner lr on a bracketing grid at each K;
* ``sgd``: synchronous DiLoCo (round mode, tau 0), outer SGD without momentum (``fedavg`` at lr 1),
  outer lr on a bracketing grid at each K; ``nesterov``: the same with Nesterov momentum 0.9
  (DiLoCo's; its lr bracketed) and ``nesterov_m`` with momentum 0.6;
* ``async``: K equal asynchronous workers (``diloco.sync=async``, every delta its own outer step),
  the product's async worker (rebase on), outer lr bracketed;
* ``async_round``: K equal asynchronous workers and a master whose round takes every live worker's
  delta (what the plugin's ``DiLoCo(...)`` workers and ``diloco-master`` do by default), outer SGD;
* ``default``: the shipped defaults, nothing overridden but K (what a user gets).

``G = (L_one - L) / (L_one - L_dp)`` per seed (same seed: same initialisation and data order), then
its mean and 95 % t interval: 1 is data-parallel's gain over one worker, 0 none. Tuning: seed 0
decides on a factor-2 log grid extended past a winning edge until the best is interior
(``benchmarks/tuning.py``), then the other seeds at the tuned point.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from study import _child_init, _prepare_data, final_loss, read_results, run_job  # noqa: E402 - benchmarks/study.py, beside this file
from study_report import T95, fmt, mean_ci  # noqa: E402
from tuning import bracket  # noqa: E402

CHANCE = math.log(257)
#: the settings: the model, the data, H, the run length, and what each one's K, H, steps and size axes are
SETTINGS: dict[str, dict[str, Any]] = {
    # the staleness study's reduced setting run 4x longer (96 outer steps at H = 4): 0.1 M parameters
    "reduced": {"overrides": ["model.d_model=64", "model.n_layers=2", "model.ffn_hidden=172", "model.n_heads=4",
                              "model.n_kv_heads=2", "data.seq_len=64", "data.batch_size=8", "diloco.inner_steps=4",
                              "trainer.max_steps=384", "optim.warmup_steps=10", "data.max_bytes=4000000"],
                "batch": 8, "steps": 384, "h": 4, "size": "64x2", "ks": [1, 2, 4, 8],
                "curves": {"h": [1, 4, 16], "steps": [96, 384, 768], "size": ["64x2", "96x3"]}},
    # the "question is real" setting, as large as the 2-core machine allows: 1.1 M parameters,
    # H = 16 for 50 outer steps (800 inner steps), warmup 50 + cosine, no window seen twice
    "main": {"overrides": ["model.d_model=128", "model.n_layers=6", "model.ffn_hidden=344", "model.n_heads=4",
                           "model.n_kv_heads=2", "data.seq_len=128", "data.batch_size=8", "diloco.inner_steps=16",
                           "trainer.max_steps=800", "optim.warmup_steps=50", "data.max_bytes=12000000"],
             "batch": 8, "steps": 800, "h": 16, "size": "128x6", "ks": [1, 2, 4, 8],
             "curves": {"h": [16, 64], "steps": [400, 800], "size": ["96x3", "128x6"]}},
    "quick": {"overrides": ["model.d_model=32", "model.n_layers=1", "model.ffn_hidden=64", "model.n_heads=2",
                            "model.n_kv_heads=1", "data.seq_len=32", "data.batch_size=4", "diloco.inner_steps=2",
                            "trainer.max_steps=16", "optim.warmup_steps=2", "data.max_bytes=300000", "data.val_windows=16"],
              "batch": 4, "steps": 16, "h": 2, "size": "32x1", "ks": [1, 2],
              "curves": {"h": [1, 2], "steps": [8, 16], "size": ["32x1"]}},
}
COMMON = ["recipe=tiny", "launch=sim", "data.tokenizer=byte", "optim.lr=0.004", "trainer.log_every_n_steps=8",
          "data.val_windows=256", "launch.eval_points=4", "sim.parallel=1", f"sim.stop_above={CHANCE:.4f}"]
SYNC = ["master.aggregation=round", "diloco=lockstep", "diloco.delay=0"]


@dataclass(frozen=True)
class Arm:
    """One arm: its overrides at K (``{k}``, ``{kb}``: K and K x B), the tuned key and its lattice
    ``base * 2**i`` (``i0`` the prior's centre), and whether it runs at K = 1."""

    overrides: tuple[str, ...]
    key: str | None
    base: float
    i0: int = 0
    at_one: bool = False
    note: str = ""
    #: the arms whose losses are this arm's own L_one and L_dp (an inner optimizer other than AdamW is
    #: measured against one worker and data-parallel with that optimizer too), beside the AdamW ones
    refs: tuple[str, str] | None = None


ARMS: dict[str, Arm] = {
    "one": Arm(("workers=1", "outer=fedavg"), "optim.lr", 0.004, 0, True, "one worker alone, batch B"),
    "dp": Arm(("workers=1", "outer=fedavg", "data.batch_size={kb}"), "optim.lr", 0.004, 1, False,
              "data-parallel equivalent: one worker, batch K x B"),
    "sgd": Arm(("workers={k}", "outer=fedavg", *SYNC), "outer.lr", 1.0, 0, False, "synchronous DiLoCo, outer SGD"),
    "nesterov": Arm(("workers={k}", "outer=nesterov", "outer.options.momentum=0.9", *SYNC), "outer.lr", 0.7, -1, False,
                    "synchronous DiLoCo, outer Nesterov 0.9"),
    "nesterov_m": Arm(("workers={k}", "outer=nesterov", "outer.options.momentum=0.6", *SYNC), "outer.lr", 0.7, 0, False,
                      "synchronous DiLoCo, outer Nesterov 0.6"),
    # DiLoCo's Nesterov 0.9 at the H curve's far point (outer momentum tuned per H, as the scaling-law paper does;
    # ``sgd`` at H = 16 is the curve's run)
    "nesterov_h16": Arm(("workers={k}", "outer=nesterov", "outer.options.momentum=0.9", *SYNC, "diloco.inner_steps=16"),
                        "outer.lr", 0.7, -2, False, "synchronous DiLoCo at H = 16, outer Nesterov 0.9"),
    "async": Arm(("workers={k}", "diloco=async", "master.aggregation=arrival"), "outer.lr", 0.5, 0, False,
                 "asynchronous DiLoCo, K equal workers (the product's async worker, the default outer step)"),
    "async_round": Arm(("workers={k}", "diloco=async", "master.aggregation=round", "outer=fedavg"), "outer.lr", 1.0, 0,
                       False, "asynchronous workers, the master's round of every live worker's delta (a plugin user's "
                       "DiLoCo(...) workers and diloco-master's min_deltas=1.0), outer SGD"),
    "default": Arm(("workers={k}",), None, 1.0, 0, False, "the shipped defaults (nothing overridden but K)"),
    # the look-ahead start (diloco.lookahead: each own delta in flight stands for one of every node's)
    "async_la": Arm(("workers={k}", "diloco=async", "master.aggregation=arrival", "diloco.lookahead=true"), "outer.lr",
                    0.5, 0, False, "asynchronous DiLoCo as `async`, the look-ahead start on"),
    "async_round_la": Arm(("workers={k}", "diloco=async", "master.aggregation=round", "outer=fedavg",
                           "diloco.lookahead=true"), "outer.lr", 1.0, 0, False,
                          "asynchronous workers as `async_round`, the look-ahead start on"),
    # a plugin user's run as shipped: DiLoCo(...) async workers, diloco-master's round of every live worker's delta
    # at fedavg's lr 1 (nothing tuned; the plain mean, power 0), the look-ahead start off and on
    "plugin_mean": Arm(("workers={k}", "diloco=async", "master.aggregation=round", "outer=fedavg",
                        "outer.options.power=0.0", "diloco.lookahead=false"), None, 1.0, 0, False,
                       "the plugin's async workers and diloco-master as shipped (fedavg: the plain mean)"),
    "plugin_mean_la": Arm(("workers={k}", "diloco=async", "master.aggregation=round", "outer=fedavg",
                           "outer.options.power=0.0", "diloco.lookahead=true"), None, 1.0, 0, False,
                          "as `plugin_mean`, the look-ahead start on"),
    # the staleness gate: staleness_sgd lr 1, momentum 0, power 1 (fedavg with outer.options.power=1: the same step)
    "plugin_gate": Arm(("workers={k}", "diloco=async", "master.aggregation=round", "outer=staleness_sgd",
                        "outer.lr=1.0", "outer.options.momentum=0.0", "diloco.lookahead=false"), None, 1.0, 0, False,
                       "the plugin's async workers, diloco-master with staleness_sgd lr 1, look-ahead off"),
    "plugin_gate_la": Arm(("workers={k}", "diloco=async", "master.aggregation=round", "outer=staleness_sgd",
                           "outer.lr=1.0", "outer.options.momentum=0.0", "diloco.lookahead=true"), None, 1.0, 0, False,
                          "the plugin's async workers, diloco-master with staleness_sgd lr 1, look-ahead on"),
    # levers (the issue's item 4), each against ``sgd``: the workers' inner lr at outer lr 1; the inner state
    # cleared at every install instead of kept
    "sgd_inner": Arm(("workers={k}", "outer=fedavg", *SYNC), "optim.lr", 0.004, 0, False,
                     "synchronous DiLoCo, outer SGD lr 1, the workers' inner lr tuned"),
    "sgd_reset": Arm(("workers={k}", "outer=fedavg", "diloco.reset_inner_optimizer=true", *SYNC), "outer.lr", 1.0, 0,
                     False, "synchronous DiLoCo, outer SGD, the inner AdamW state cleared at every install"),
    # levers tried on the K = 4 reduced setting (docs/scaling.md, "Levers tried"), each against ``sgd``
    "sgd_syncstate": Arm(("workers={k}", "outer=fedavg", "sim.sync_inner_state=true", *SYNC), "outer.lr", 1.0, 0,
                         False, "synchronous DiLoCo, outer SGD, the workers' inner AdamW moments averaged at every sync "
                         "(simulator only: the product would send them)"),
    # the Muon arms' grids are centred on their K = 4 optimum (found from 0.004 upwards; Muon wants 4-16x AdamW's lr)
    "sgd_muon": Arm(("workers={k}", "outer=fedavg", "optim.name=muon", *SYNC), "optim.lr", 0.004, 4, False,
                    "synchronous DiLoCo, outer SGD lr 1, Muon inner optimizer (MuLoCo), its inner lr tuned",
                    refs=("one_muon", "dp_muon")),
    "sgd_muon_sync": Arm(("workers={k}", "outer=fedavg", "optim.name=muon", "sim.sync_inner_state=true", *SYNC),
                         "optim.lr", 0.004, 2, False, "sgd_muon with the inner state (AdamW's moments, Muon's momentum) "
                         "averaged at every sync (simulator only)", refs=("one_muon", "dp_muon")),
    "sgd_muon_h16": Arm(("workers={k}", "outer=fedavg", "optim.name=muon", *SYNC, "diloco.inner_steps=16"), "optim.lr",
                        0.004, 4, False, "sgd_muon at H = 16 (the H curve's far point; one and dp do not depend on H)",
                        refs=("one_muon", "dp_muon")),
    "one_muon": Arm(("workers=1", "outer=fedavg", "optim.name=muon"), "optim.lr", 0.004, 2, False,
                    "one worker alone with the Muon inner optimizer (Muon's own L_one), inner lr tuned"),
    "dp_muon": Arm(("workers=1", "outer=fedavg", "optim.name=muon", "data.batch_size={kb}"), "optim.lr", 0.004, 3,
                   False, "data-parallel equivalent with the Muon inner optimizer (Muon's own L_dp), inner lr tuned"),
    # a synchronous warm-up: each worker's first 8 inner steps (about the lr warm-up's 10) synced every step, then
    # phases of H (sim.sync_warmup; W = 4 and 16 were tried at seed 0: docs/scaling.md). The master's relative norm
    # filter is off: the one-step deltas of the lr warm-up are far smaller than the first phase's (``sgd`` rejects
    # nothing with it on)
    "sgd_warmup": Arm(("workers={k}", "outer=fedavg", "master.norm_ratio=null", "sim.sync_warmup=8", *SYNC), None,
                      1.0, 0, False, "synchronous DiLoCo, outer SGD lr 1, the first 8 inner steps synced every step"),
    # imposed staleness (the staleness study's arr8 / arr16 cells on this setting, issue 36): arrival mode, each
    # delta applied 8 (16) arrivals after its base, staleness-scaled SGD (lr / (1 + tau)), lr tuned; with the
    # worker-side rebase onto its own deltas, and with the look-ahead start on top
    "arr8": Arm(("workers={k}", "master.aggregation=arrival", "diloco=lockstep", "diloco.delay=8",
                 "outer=staleness_sgd", "outer.options.momentum=0.0"), "outer.lr", 0.5, 1, False,
                "8 arrivals of staleness imposed, staleness-scaled SGD"),
    "arr8_rb": Arm(("workers={k}", "master.aggregation=arrival", "diloco=lockstep", "diloco.delay=8",
                    "outer=staleness_sgd", "outer.options.momentum=0.0", "sim.rebase=true"), "outer.lr", 0.5, 1, False,
                   "arr8, each worker rebased onto its own deltas (sim.rebase)"),
    "arr8_la": Arm(("workers={k}", "master.aggregation=arrival", "diloco=lockstep", "diloco.delay=8",
                    "outer=staleness_sgd", "outer.options.momentum=0.0", "sim.rebase=true", "diloco.lookahead=true"),
                   "outer.lr", 0.5, 1, False, "arr8_rb with the look-ahead start (diloco.lookahead)"),
    "arr16_la": Arm(("workers={k}", "master.aggregation=arrival", "diloco=lockstep", "diloco.delay=16",
                     "outer=staleness_sgd", "outer.options.momentum=0.0", "sim.rebase=true", "diloco.lookahead=true"),
                    "outer.lr", 0.5, 1, False, "16 arrivals imposed, the rebase and the look-ahead start"),
    # the outer lr and the inner lr together: the inner lr tuned at outer SGD lr 2 and 0.5 (sgd_inner: at 1)
    "sgd_o2_inner": Arm(("workers={k}", "outer=fedavg", "outer.lr=2.0", *SYNC), "optim.lr", 0.004, -1, False,
                        "synchronous DiLoCo, outer SGD lr 2, the workers' inner lr tuned"),
    "sgd_o05_inner": Arm(("workers={k}", "outer=fedavg", "outer.lr=0.5", *SYNC), "optim.lr", 0.004, 1, False,
                         "synchronous DiLoCo, outer SGD lr 0.5, the workers' inner lr tuned"),
}
#: the imposed-staleness arms, whose R (the staleness study's measure) the report gives beside G
STALE_ARMS = ("arr8", "arr8_rb", "arr8_la", "arr16_la")
#: the arms of the curves (one worker and data-parallel first: G's ends)
CURVE_ARMS = ("one", "dp", "sgd")
MAX_EXTEND = 4
POINTS = 3  # the first grid: the prior's centre and one point either side


def value(arm: str, i: int) -> float:
    return float(f"{ARMS[arm].base * 2.0 ** i:.4g}")


class Scaling:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.setting = SETTINGS[args.setting]
        self.root = Path(args.root or ROOT / f"scaling_{args.setting}").resolve()
        self.common = COMMON + self.setting["overrides"]
        self.seeds = list(range(args.seeds))
        self.ks = [int(k) for k in args.k.split(",")] if args.k else self.setting["ks"]
        self.arms = args.arms.split(",") if args.arms else list(ARMS)
        for a in self.arms:
            if a not in ARMS and a != "one_tokens":
                raise SystemExit(f"--arms: unknown arm {a!r}; valid: {', '.join([*ARMS, 'one_tokens'])}")

    # ------------------------------------------------------------------ runs
    def job(self, arm: str, k: int, i: int | None, seed: int, extra: tuple[str, ...] = ()) -> dict[str, Any]:
        a = ARMS[arm]
        ov = [o.format(k=k, kb=k * self.setting["batch"]) for o in a.overrides]
        if a.key is not None and i is not None:
            ov.append(f"{a.key}={value(arm, i)}")
        ov += [*extra, f"seed={seed}"]
        ident = hashlib.sha256(json.dumps(self.common + ov).encode()).hexdigest()[:10]
        lr = f"-{value(arm, i):g}" if a.key is not None and i is not None else ""
        return {"id": f"{arm}-k{k}{lr}-s{seed}-{ident}", "arm": arm, "k": k, "i": i, "seed": seed, "overrides": ov}

    def results(self, j: dict) -> dict | None:
        return read_results(self.root, j)

    def loss(self, j: dict) -> float:
        return final_loss(self.results(j))

    def k_of(self, arm: str, k: int) -> int:
        """The K an arm's run stands for: ``one`` is the same run at every K."""
        return 1 if arm == "one" else k

    def grid(self, arm: str, k: int, extra: tuple[str, ...] = ()) -> list[int]:
        a = ARMS[arm]
        if a.key is None:
            return [0]
        k = self.k_of(arm, k)
        return bracket(range(a.i0 - POINTS // 2, a.i0 + POINTS // 2 + 1), lambda i: self.loss(self.job(arm, k, i, 0, extra)),
                       lambda i: i - 1, lambda i: i + 1, MAX_EXTEND)[0]

    def best(self, arm: str, k: int, extra: tuple[str, ...] = ()) -> int | None:
        """The tuned lattice point (seed 0; ties to the smaller value), None while the tuning is not done."""
        if ARMS[arm].key is None:
            return None
        ks = self.grid(arm, k, extra)
        k = self.k_of(arm, k)
        losses = [self.loss(self.job(arm, k, i, 0, extra)) for i in ks]
        if any(math.isnan(x) for x in losses):
            return None
        return min(zip(losses, ks))[1]

    def cells(self) -> list[tuple[str, int]]:
        out = []
        for k in self.ks:
            for arm in self.arms:
                if arm == "one_tokens" or (k == 1 and not ARMS[arm].at_one) or (arm == "one" and k != self.ks[0]):
                    continue
                out.append((arm, k))
        if "one" in self.arms and ("one", self.ks[0]) not in out:
            out.insert(0, ("one", self.ks[0]))
        return out

    def tuning_jobs(self) -> list[dict]:
        return [self.job(arm, self.k_of(arm, k), i, 0) for arm, k in self.cells() for i in self.grid(arm, k)]

    def seed_jobs(self) -> list[dict]:
        out = []
        for arm, k in self.cells():
            if ARMS[arm].key is not None and self.best(arm, k) is None:
                continue
            out += [self.job(arm, self.k_of(arm, k), self.best(arm, k), s) for s in self.seeds]
        if "one_tokens" in self.arms or not self.args.arms:
            i = self.best("one", 1)
            if i is not None:
                for k in self.ks:
                    if k > 1:
                        out += [self.tokens_job(k, i, s) for s in self.seeds]
        return out

    def tokens_job(self, k: int, i: int, seed: int) -> dict[str, Any]:
        """One worker alone at equal tokens: K x the steps, its warmup and cosine over the longer run."""
        j = self.job("one", 1, i, seed, (f"trainer.max_steps={k * self.setting['steps']}",))
        return {**j, "id": j["id"].replace("one-k1", f"one_tokens-k{k}"), "arm": "one_tokens", "k": k}

    def curve_extra_of(self, arm: str, axis: str, point: Any) -> tuple[str, ...]:
        """The overrides of ``arm`` at a curve's point: one worker alone and data-parallel take no H
        (a single worker's run is the same at every H), so on the H curve they are the main grid's runs."""
        return () if axis == "h" and arm in ("one", "dp") else self.curve_extra(axis, point)

    def curve_jobs(self, axis: str) -> list[dict]:
        """G against ``axis`` at K = 4 (h: H; steps: the run length; size: d_model x layers): one, dp and
        the best synchronous arm (sgd), each tuned at each point, 3 seeds."""
        out: list[dict] = []
        for point in self.setting["curves"][axis]:
            for arm in CURVE_ARMS:
                extra = self.curve_extra_of(arm, axis, point)
                k = 1 if arm == "one" else 4
                out += [self.job(arm, k, i, 0, extra) for i in self.grid(arm, k, extra)]
                i = self.best(arm, k, extra)
                if i is not None:
                    out += [self.job(arm, k, i, s, extra) for s in self.seeds]
        return out

    def curve_extra(self, axis: str, point: Any) -> tuple[str, ...]:
        """The overrides of a curve's point; none at the setting's own value (the main grid's runs)."""
        own = {"h": self.setting["h"], "steps": self.setting["steps"], "size": self.setting.get("size")}[axis]
        if str(point) == str(own):
            return ()
        if axis == "h":
            return (f"diloco.inner_steps={point}",)
        if axis == "steps":
            return (f"trainer.max_steps={point}", f"optim.warmup_steps={max(2, int(point) // 40)}")
        d, n = (int(x) for x in str(point).split("x"))
        return (f"model.d_model={d}", f"model.n_layers={n}", f"model.ffn_hidden={int(d * 8 / 3 + 63) // 64 * 64}")

    def all_jobs(self) -> list[dict]:
        jobs = self.tuning_jobs() + self.seed_jobs()
        for axis in self.args.curves.split(",") if self.args.curves else []:
            jobs += self.curve_jobs(axis)
        seen: dict[str, dict] = {}
        for j in jobs:
            seen.setdefault(j["id"], j)
        return list(seen.values())

    def run_batch(self, jobs: list[dict], phase: str) -> int:
        todo = [j for j in jobs if self.results(j) is None]
        if todo:
            print(f"== {phase}: {len(todo)} runs to make ({len(jobs) - len(todo)} done)", flush=True)
        specs = [(j, self.common, str(self.root)) for j in todo]
        if self.args.jobs <= 1 or len(specs) <= 1:
            recs = map(run_job, specs)
            self._log(recs)
        else:
            import multiprocessing as mp

            with mp.get_context("spawn").Pool(self.args.jobs, initializer=_child_init) as pool:
                self._log(pool.imap_unordered(run_job, specs))
        return len(todo)

    def _log(self, recs) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "log.jsonl", "a") as f:
            for rec in recs:
                f.write(json.dumps(rec) + "\n")
                f.flush()
                err = rec.get("error")
                print(f"  {rec['id']}: " + (f"FAILED {err.splitlines()[0]}" if err else
                                             f"{fmt(rec['eval_loss'])} in {rec['wall']:.0f} s"), flush=True)

    def run(self) -> int:
        _prepare_data(self.common)
        curves = [(f"curve {axis}", lambda axis=axis: self.curve_jobs(axis))
                  for axis in (self.args.curves.split(",") if self.args.curves else [])]
        while True:  # tuning grids extend from their own results: run until nothing is left
            made = self.run_batch(self.tuning_jobs(), "tune") + self.run_batch(self.seed_jobs(), "seeds")
            for name, fn in curves:
                made += self.run_batch(fn(), name)
            if made == 0:
                return 0

    # ------------------------------------------------------------------ report
    def losses(self, arm: str, k: int, extra: tuple[str, ...] = ()) -> dict[int, float]:
        if arm == "one_tokens":
            i = self.best("one", 1)
            out = {} if i is None else {s: self.loss(self.tokens_job(k, i, s)) for s in self.seeds}
            return {s: x for s, x in out.items() if not math.isnan(x)}
        i = self.best(arm, k, extra)
        if ARMS[arm].key is not None and i is None:
            return {}
        k = self.k_of(arm, k)
        out = {s: self.loss(self.job(arm, k, i, s, extra)) for s in self.seeds}
        return {s: x for s, x in out.items() if not math.isnan(x)}

    def divergences(self, arm: str, k: int) -> str:
        """Runs above chance or not finite, over every point its grid ran (seed 0) and its seeds."""
        k = self.k_of(arm, k)
        jobs = [self.job(arm, k, i, 0) for i in self.grid(arm, k)] if ARMS[arm].key else []
        jobs += [self.job(arm, k, self.best(arm, k), s) for s in self.seeds if ARMS[arm].key is None or self.best(arm, k) is not None]
        done = {j["id"]: self.loss(j) for j in jobs}
        done = {i: x for i, x in done.items() if not math.isnan(x)}
        return f"{sum(math.isinf(x) for x in done.values())}/{len(done)}"


def gain(one: dict[int, float], dp: dict[int, float], m: dict[int, float]) -> tuple[float, float, int]:
    """G = (L_one - L) / (L_one - L_dp) per seed; its mean, 95 % half-width and the seeds."""
    m = {s: x for s, x in m.items() if not math.isnan(x)}
    gs = [(one[s] - m[s]) / (one[s] - dp[s]) for s in m if s in one and s in dp and one[s] != dp[s]]
    gs = [g if math.isfinite(g) else -math.inf for g in gs]
    if any(math.isinf(g) for g in gs):
        return -math.inf, math.nan, len(gs)
    mean, half = mean_ci(gs)
    return mean, half, len(gs)


def paired(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, int]:
    d = [a[s] - b[s] for s in a if s in b and math.isfinite(a[s]) and math.isfinite(b[s])]
    m, h = mean_ci(d)
    return m, h, len(d)


def ci(m: float, h: float, d: int = 2) -> str:
    if math.isinf(m):
        return "div."
    return f"{m:.{d}f}" + ("" if math.isnan(h) else f" [{m - h:.{d}f}, {m + h:.{d}f}]")


def report(sc: Scaling) -> str:
    made = " ".join(f"--{k} {v}" for k, v in (("setting", sc.args.setting), ("k", sc.args.k), ("arms", sc.args.arms),
                                                 ("curves", sc.args.curves),
                                                 ("seeds", sc.args.seeds if sc.args.seeds != 3 else None)) if v)
    if sc.args.out and sc.args.out != "-":
        made += f" --out {sc.args.out}"
    lines = [f"# Scaling results: setting `{sc.args.setting}` (generated by `python benchmarks/scaling.py {made} --report`)", "",
             f"Every run: `python train.py {' '.join(sc.common)} <the arm's overrides>` (`--plan` prints each). "
             f"Seeds {sc.seeds}; 95 % t intervals over seeds (t = {T95.get(len(sc.seeds) - 1, 1.96)}); "
             "G = (L_one - L) / (L_one - L_dp) per seed.", ""]
    one = sc.losses("one", 1)
    for k in [k for k in sc.ks if k > 1]:
        dp = sc.losses("dp", k)
        sgd = sc.losses("sgd", k)
        lines += [f"## K = {k}", "", "| arm | tuned | final held-out loss, mean [95 % CI] | G [95 % CI] (seeds) | "
                  "minus dp, paired [95 % CI] | minus sgd, paired [95 % CI] | diverged |", "|---|---|---|---|---|---|---|"]
        for arm in ["one", "one_tokens", *[a for a in ARMS if a != "one"]]:
            if arm != "one_tokens" and arm not in sc.arms:
                continue
            ls = sc.losses(arm, k)
            if not ls:
                continue
            m, h = mean_ci(list(ls.values()))
            g = gain(one, dp, ls)
            d = paired(ls, dp)
            a = ARMS.get(arm)
            i = sc.best(arm, k) if a is not None else sc.best("one", 1)
            key = (a or ARMS["one"]).key or ""
            label = f"{key.split('.')[0]} lr" if key.endswith(".lr") else key
            tuned = "—" if a is not None and a.key is None else f"{label} {value(arm if a else 'one', i):g}"
            div = sc.divergences(arm, k) if a is not None else "—"
            e = paired(ls, sgd)
            lines.append(f"| {arm} | {tuned} | {ci(m, h, 3)} | {ci(g[0], g[1])} ({g[2]}) | {ci(d[0], d[1], 3)} ({d[2]}) | "
                         f"{ci(e[0], e[1], 3)} ({e[2]}) | {div} |")
        lines.append("")
        own = [a for a in sc.arms if a in ARMS and ARMS[a].refs is not None and ARMS[a].refs[0] in sc.arms
               and ARMS[a].refs[1] in sc.arms]
        own = [a for a in own if sc.losses(a, k) and sc.losses(ARMS[a].refs[0], k) and sc.losses(ARMS[a].refs[1], k)]  # type: ignore[index]
        if own:
            lines += [f"G against the arm's own references (K = {k}): one worker alone and data-parallel with the "
                      "same inner optimizer, each with its inner lr tuned", "",
                      f"| arm | references | L_one | L_dp | G [95 % CI] (seeds) | minus its own one, paired [95 % CI] | "
                      f"minus {own[0]}, paired [95 % CI] |", "|---|---|---|---|---|---|---|"]
            first = sc.losses(own[0], k)
            for arm in own:
                r1, r2 = ARMS[arm].refs  # type: ignore[misc]
                o, d, ls = sc.losses(r1, k), sc.losses(r2, k), sc.losses(arm, k)
                if not (o and d and ls):
                    continue
                g, e, f = gain(o, d, ls), paired(ls, o), paired(ls, first)
                lines.append(f"| {arm} | {r1}, {r2} | {fmt(mean_ci(list(o.values()))[0])} | "
                             f"{fmt(mean_ci(list(d.values()))[0])} | {ci(g[0], g[1])} ({g[2]}) | {ci(e[0], e[1], 3)} ({e[2]}) | "
                             f"{ci(f[0], f[1], 3)} ({f[2]}) |")
            lines.append("")
    stale = [a for a in sc.arms if a in STALE_ARMS]
    if stale and "one" in sc.arms and "dp" in sc.arms and "sgd" in sc.arms:
        from study_report import unigram_loss  # benchmarks/study_report.py

        u = unigram_loss(sc)
        lines += [f"## Imposed staleness: R and G side by side (K = {sc.ks[-1]})", "",
                  f"R = (U - L) / (U - L_sgd) per seed (the staleness study's retained progress, against synchronous "
                  f"`sgd` here), U = {u:.3f} the unigram loss of this setting's data; G as above.", "",
                  "| arm | tuned | loss | R [95 % CI] (seeds) | G [95 % CI] | minus sgd, paired [95 % CI] |",
                  "|---|---|---|---|---|---|"]
        k = sc.ks[-1]
        dp, sgd = sc.losses("dp", k), sc.losses("sgd", k)
        for arm in stale:
            ls = sc.losses(arm, k)
            if not ls:
                continue
            rs = [(u - ls[s_]) / (u - sgd[s_]) for s_ in ls if s_ in sgd]
            r, g, e = mean_ci(rs), gain(one, dp, ls), paired(ls, sgd)
            i = sc.best(arm, k)
            lines.append(f"| {arm} | outer lr {value(arm, i):g} | {fmt(mean_ci(list(ls.values()))[0])} | "
                         f"{ci(r[0], r[1])} ({len(rs)}) | {ci(g[0], g[1])} | {ci(e[0], e[1], 3)} ({e[2]}) |")
        lines.append("")
    for axis in sc.args.curves.split(",") if sc.args.curves else []:
        lines += [f"## G against {axis} (K = 4)", "", f"| {axis} | L_one | L_dp | "
                  + " | ".join(f"{a}: G [95 % CI] (tuned lr)" for a in CURVE_ARMS[2:]) + " |",
                  "|---|---|---|" + "---|" * len(CURVE_ARMS[2:])]
        for point in sc.setting["curves"][axis]:
            o, dp = (sc.losses(a, k, sc.curve_extra_of(a, axis, point)) for a, k in (("one", 1), ("dp", 4)))
            row = [str(point), fmt(mean_ci(list(o.values()))[0]), fmt(mean_ci(list(dp.values()))[0])]
            for arm in CURVE_ARMS[2:]:
                extra = sc.curve_extra_of(arm, axis, point)
                g = gain(o, dp, sc.losses(arm, 4, extra))
                i = sc.best(arm, 4, extra)
                row.append(f"{ci(g[0], g[1])} (lr {value(arm, i):g})" if i is not None else "—")
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="reduced")
    ap.add_argument("--k", help="the Ks, comma-separated (default: the setting's)")
    ap.add_argument("--arms", help=f"the arms, comma-separated (default: all: {', '.join([*ARMS, 'one_tokens'])})")
    ap.add_argument("--curves", default="", help="the curves to run or report at K = 4: h, steps, size (comma-separated)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--root", help="the runs' folder (default scaling_<setting>/)")
    ap.add_argument("--plan", action="store_true", help="print every run planned so far, done or not")
    ap.add_argument("--report", action="store_true", help="write the tables (no runs)")
    ap.add_argument("--out", help="the report's file (default docs/scaling_results.md, or "
                    "docs/scaling_results_<setting>.md for another setting; '-' prints it)")
    args = ap.parse_args(argv)
    sc = Scaling(args)
    if args.plan:
        for j in sc.all_jobs():
            done = "done" if sc.results(j) is not None else "todo"
            print(f"{done:5} python train.py {' '.join(sc.common + j['overrides'])} run_id={j['id']}")
        return 0
    if args.report:
        text = report(sc)
        if args.out == "-":
            print(text)
        else:
            name = "scaling_results.md" if args.setting == "reduced" else f"scaling_results_{args.setting}.md"
            out = Path(args.out or ROOT / "docs" / name)
            out.write_text(text)
            print(f"wrote {out}")
        return 0
    return sc.run()


if __name__ == "__main__":
    sys.exit(main())
