"""The staleness study (issue 7): outer optimizers under controlled staleness, with the real product.

Every run is ``python train.py -m ...`` (Hydra multirun: a master thread, K worker processes,
a folder hub, results.json per job), so what is measured is exactly what a user runs.

    python benchmarks/staleness_study.py              # the full study into study/ (~80-100 min on 2 cores)
    python benchmarks/staleness_study.py --budget     # what is planned, done, failed, and the time spent
    python benchmarks/staleness_study.py --quick      # a 3-minute smoke version into study_quick/
    python benchmarks/staleness_study.py --dry-run    # print the train.py commands, run nothing
    python benchmarks/make_results.py                 # study/ -> docs/results.md + docs/figures/*.png

Phases, in order (each is skipped where its results.json files already exist, so an
interrupted study resumes where it stopped; a failed job is recorded in
``study/failures.jsonl`` and not retried unless ``--retry-failed``):

1. ``tuning``: each outer optimizer at tau = 0 (fixed regime, FP32, seed 0) with 3 outer
   learning rates (an equal budget per method); where the best of the 3 is at an edge of
   the grid, one more lr ~3x beyond that edge (the same rule for every method); the lr
   with the lowest final eval loss is kept (``study/tuning.json``).
2. ``fixed``: FP32, every worker at the same delay tau in {0, 4, 8, 16}, 3 seeds, the
   tuned lr. (tau = 0, seed 0 is the tuning run itself: same overrides, same folder.)
3. ``hetero``: FP32, heterogeneous delays: worker i of 4 at ``[0, tau/4, tau/2, tau][i]``
   for tau in {4, 8, 16}, 3 seeds.
4. ``bf16``: bf16 weights (``trainer.precision=bf16-true``) with bitsandbytes 8-bit AdamW
   as the inner optimizer (same inner lr/warmup as FP32), fixed tau in {0, 8}, 3 seeds,
   the FP32-tuned lr, for ``--bf16-methods`` (default: nesterov, cgad, adam_decay, the
   methods the paper's bf16 claim is about).

Setting (every run): the ``tiny`` recipe's Llama narrowed to d_model 64 (4 layers, 4 heads,
2 KV heads, FFN 172, tied embeddings; 0.25 M parameters with a 1024-token BPE), the Python
standard library's sources (first 2 MB), sequences of 64 tokens, batch 8 per worker, 4
workers, H = 8 inner AdamW steps (lr 3e-3, 20 warmup steps, cosine to 10 %), 256 inner
steps per worker = 32 outer rounds, ``sync=lockstep`` (every delta arrives with
staleness exactly its worker's delay, after the first tau rounds), master quorum = all
workers. See docs/study.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

METHODS = ("nesterov", "cgad", "adam_decay", "delayed_nesterov", "poly_nesterov")
# An equal tuning budget: 3 outer lrs per method, spread ~3x around each family's documented default.
LR_GRID = {
    "nesterov": (0.3, 0.7, 1.0),
    "poly_nesterov": (0.3, 0.7, 1.0),
    "delayed_nesterov": (0.3, 0.7, 1.0),
    "cgad": (0.01, 0.03, 0.1),
    "adam_decay": (0.01, 0.03, 0.1),
}
TAUS = (0, 4, 8, 16)
HETERO_TAUS = (4, 8, 16)
BF16_TAUS = (0, 8)
BF16_METHODS = ("nesterov", "cgad", "adam_decay")
SEEDS = (0, 1, 2)
EDGE_FACTOR = 3.0

# What every run shares (Hydra overrides of train.py).
COMMON = [
    "recipe=tiny",
    "workers=4",
    "diloco.inner_steps=8",
    "trainer.max_steps=256",
    "model.d_model=64",
    "model.ffn_hidden=172",
    "data.max_bytes=2000000",
    "data.seq_len=64",
    "data.vocab_size=1024",
    "data.batch_size=8",
    "trainer.log_every_n_steps=8",
    # a run whose deltas the master keeps rejecting (non-finite) stalls the lockstep: fail fast instead
    "diloco.wait_timeout=120",
    "launch.timeout=1200",
]
BF16 = ["trainer.precision=bf16-true", "optim=adamw8bit", "optim.lr=0.003", "optim.warmup_steps=20"]

QUICK = {
    "methods": ("nesterov", "cgad"), "lr_grid": {"nesterov": (0.3, 0.7), "cgad": (0.01, 0.03)}, "taus": (0, 4),
    "hetero_taus": (4,), "bf16_taus": (0,), "bf16_methods": ("nesterov", "cgad"), "seeds": (0,),
    "common_extra": ["trainer.max_steps=32", "workers=2"],
}


def hetero_delays(tau: int, workers: int = 4) -> list[int]:
    """Worker i's delay: evenly from 0 to tau (4 workers: [0, tau/4, tau/2, tau])."""
    if workers == 4:
        return [0, tau // 4, tau // 2, tau]
    return [round(tau * i / max(1, workers - 1)) for i in range(workers)] if workers > 1 else [tau]


class Study:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        q = QUICK if args.quick else {}
        self.root = Path(args.root or (ROOT / ("study_quick" if args.quick else "study"))).resolve()
        self.methods = tuple(args.methods.split(",")) if args.methods else q.get("methods", METHODS)
        self.lr_grid = q.get("lr_grid", LR_GRID)
        self.taus = q.get("taus", TAUS)
        self.hetero_taus = q.get("hetero_taus", HETERO_TAUS)
        self.bf16_taus = q.get("bf16_taus", BF16_TAUS)
        bm = args.bf16_methods or ",".join(q.get("bf16_methods", BF16_METHODS))
        self.bf16_methods = tuple(m for m in (METHODS if bm == "all" else bm.split(",")) if m in self.methods)
        self.seeds = tuple(int(s) for s in args.seeds.split(",")) if args.seeds else q.get("seeds", SEEDS)
        self.common = list(COMMON)
        extra = q.get("common_extra", [])
        keys = {e.split("=")[0] for e in extra}
        self.common = [c for c in self.common if c.split("=")[0] not in keys] + extra
        self.workers = int(next(c for c in self.common if c.startswith("workers=")).split("=")[1])
        self.log_path = self.root / "driver_log.jsonl"
        self.fail_path = self.root / "failures.jsonl"

    # ------------------------------------------------------------------ bookkeeping

    def _done(self) -> dict[frozenset, Path]:
        """Override sets (minus run_root) of every job with a results.json."""
        out = {}
        for res in self.root.glob("multirun/*/results.json"):
            ov = res.parent / "hydra" / "overrides.yaml"
            if ov.is_file():
                out[self._key(_read_overrides(ov))] = res
        return out

    def _failed(self) -> set[frozenset]:
        if not self.fail_path.is_file() or self.args.retry_failed:
            return set()
        return {self._key(json.loads(l)["overrides"]) for l in self.fail_path.read_text().splitlines() if l.strip()}

    @staticmethod
    def _key(overrides) -> frozenset:
        """Overrides as a set of (key, parsed value) (so "[0, 2]" == "[0,2]"), run_root left out."""
        import yaml

        out = set()
        for o in overrides:
            k, _, v = str(o).partition("=")
            if k.lstrip("+~") == "run_root":
                continue
            try:
                parsed = yaml.safe_load(v)
                if isinstance(parsed, str):
                    try:
                        parsed = float(parsed)  # "3e-3" (a string to YAML 1.1) == 0.003, as Hydra writes it
                    except ValueError:
                        pass
                v = json.dumps(parsed, sort_keys=True)
            except yaml.YAMLError:
                pass
            out.add((k, v))
        return frozenset(out)

    def _log(self, **rec) -> None:
        if self.args.dry_run:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as f:
            f.write(json.dumps({"time": time.time(), **rec}) + "\n")

    # ------------------------------------------------------------------ jobs

    def job(self, method: str, lr: float, delay, seed: int, bf16: bool = False) -> list[str]:
        d = f"[{','.join(str(x) for x in delay)}]" if isinstance(delay, list) else str(delay)
        return self.common + [f"outer={method}", f"outer.lr={lr}", f"diloco.delay={d}"] + (BF16 if bf16 else []) + [f"seed={seed}"]

    def tuning_jobs(self, extended: bool = True) -> list[list[str]]:
        grids = self.extended_grid() if extended else self.lr_grid
        return [self.job(m, lr, 0, self.seeds[0]) for m in self.methods for lr in grids[m]]

    def _tuning_loss(self, done: dict, m: str, lr: float) -> float | None:
        p = done.get(self._key(self.job(m, lr, 0, self.seeds[0])))
        if p is None:
            return None
        r = json.loads(p.read_text())
        return r["eval_loss"] if not r.get("diverged") else float("inf")

    def extended_grid(self) -> dict[str, tuple[float, ...]]:
        """The same rule for every method: when the best of its 3 lrs is at an edge of its grid, one more lr
        ~3x beyond that edge (once), so each kept lr is bracketed or at least one step past the edge."""
        done = self._done()
        out = {}
        for m in self.methods:
            grid = tuple(self.lr_grid[m])
            losses = [self._tuning_loss(done, m, lr) for lr in grid]
            if any(x is None for x in losses):
                out[m] = grid
                continue
            best = grid[min(range(len(grid)), key=lambda i: (losses[i], grid[i]))]
            if best == min(grid):
                grid = (float(f"{min(grid) / EDGE_FACTOR:.1g}"),) + grid
            elif best == max(grid):
                grid = grid + (float(f"{max(grid) * EDGE_FACTOR:.1g}"),)
            out[m] = grid
        return out

    def best_lr(self) -> dict[str, float] | None:
        done = self._done()
        best = {}
        table = {}
        grids = self.extended_grid()
        for m in self.methods:
            scores = []
            for lr in grids[m]:
                p = done.get(self._key(self.job(m, lr, 0, self.seeds[0])))
                if p is None:
                    continue
                r = json.loads(p.read_text())
                loss = r["eval_loss"] if not r.get("diverged") else float("inf")
                scores.append((loss, lr))
            table[m] = {str(lr): s for s, lr in sorted(scores, key=lambda x: x[1])}
            if scores:
                best[m] = min(scores)[1]  # lowest loss; ties go to the smaller lr
        if set(best) != set(self.methods):
            return None
        (self.root / "tuning.json").write_text(json.dumps({"chosen_lr": best, "eval_loss": table,
                                                           "lr_grid": {m: list(self.lr_grid[m]) for m in self.methods},
                                                           "tried": {m: list(grids[m]) for m in self.methods}}, indent=2))
        return best

    def grid_jobs(self, best: dict[str, float]) -> dict[str, list[list[str]]]:
        fixed = [self.job(m, best[m], t, s) for m in self.methods for t in self.taus for s in self.seeds]
        hetero = [self.job(m, best[m], hetero_delays(t, self.workers), s) for m in self.methods for t in self.hetero_taus
                  for s in self.seeds]
        bf16 = [self.job(m, best[m], t, s, bf16=True) for m in self.bf16_methods for t in self.bf16_taus for s in self.seeds]
        return {"fixed": fixed, "hetero": hetero, "bf16": bf16}

    # ------------------------------------------------------------------ running

    def run_jobs(self, phase: str, jobs: list[list[str]]) -> None:
        """Run the pending jobs, grouped into multiruns that differ only in the seed (or the tuning lr)."""
        done, failed = self._done(), self._failed()
        pending = [j for j in jobs if self._key(j) not in done and self._key(j) not in failed]
        # group: same overrides except the last varying one (seed) -> one `train.py -m ... seed=0,1,2`
        groups: dict[tuple, list[list[str]]] = {}
        for j in pending:
            groups.setdefault(tuple(j[:-1]), []).append(j)
        print(f"== phase {phase}: {len(jobs)} jobs, {len(jobs) - len(pending)} done/failed, {len(pending)} to run "
              f"in {len(groups)} multirun(s)", flush=True)
        for head, js in groups.items():
            seeds = ",".join(j[-1].split("=", 1)[1] for j in js)
            cmd = [sys.executable, str(ROOT / "train.py"), "-m", *head, f"seed={seeds}", f"run_root={self.root}"]
            print("$ python train.py " + " ".join(_quote(c) for c in cmd[2:]), flush=True)
            if self.args.dry_run:
                continue
            t0 = time.time()
            log_file = self.root / "logs" / f"{phase}-{len(list((self.root / 'logs').glob('*.log'))) if (self.root / 'logs').is_dir() else 0:04d}.log"
            log_file.parent.mkdir(parents=True, exist_ok=True)
            with open(log_file, "w") as fh:
                proc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, check=False)
            wall = time.time() - t0
            now_done = self._done()
            ok = [j for j in js if self._key(j) in now_done]
            bad = [j for j in js if self._key(j) not in now_done]
            for j in bad:
                tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-15:])
                with open(self.fail_path, "a") as f:
                    f.write(json.dumps({"phase": phase, "overrides": j, "rc": proc.returncode, "log": str(log_file),
                                        "tail": tail}) + "\n")
            self._log(phase=phase, jobs=len(js), ok=len(ok), failed=len(bad), wall=wall, rc=proc.returncode,
                      cmd=cmd[2:], log=str(log_file))
            summary = []
            for j in ok:
                r = json.loads(now_done[self._key(j)].read_text())
                summary.append(f"seed {r['seed']}: eval {r['eval_loss']:.3f}{' DIVERGED' if r['diverged'] else ''}")
            print(f"   {wall:.0f}s, {len(ok)} ok, {len(bad)} failed | " + " | ".join(summary), flush=True)
            if not self.args.keep_hubs:
                for j in ok:
                    d = now_done[self._key(j)].parent
                    shutil.rmtree(d / "hub", ignore_errors=True)
                    for ck in d.glob("nodes/*/checkpoints"):
                        shutil.rmtree(ck, ignore_errors=True)

    def run(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        self._log(event="start", argv=sys.argv[1:])
        phases = self.args.phases.split(",")
        if "tuning" in phases:
            self.run_jobs("tuning", self.tuning_jobs(extended=False))
            self.run_jobs("tuning", self.tuning_jobs())  # one lr past the edge where the best was at an edge
        best = self.best_lr()
        if best is None:
            if self.args.dry_run:
                best = {m: self.lr_grid[m][1] for m in self.methods}
                print(f"(dry run: tuning not done, showing the grid with the middle lr {best})")
            else:
                print("tuning incomplete: cannot run the grid (see failures.jsonl)", file=sys.stderr)
                return 1
        else:
            print(f"tuned outer lr (tau=0, seed {self.seeds[0]}): {best}", flush=True)
        grid = self.grid_jobs(best)
        for phase in ("fixed", "hetero", "bf16"):
            if phase in phases:
                self.run_jobs(phase, grid[phase])
        self._log(event="end", wall=time.time() - t0)
        print(f"study session took {(time.time() - t0) / 60:.1f} min; totals: python {Path(__file__).name} --budget"
              f"{' --quick' if self.args.quick else ''}", flush=True)
        return 0

    def budget(self) -> int:
        done, failed = self._done(), self._failed()
        best = self.best_lr() or {m: self.lr_grid[m][1] for m in self.methods}
        phases = {"tuning": self.tuning_jobs(), **self.grid_jobs(best)}
        seen: set = set()
        total_wall = 0.0
        print(f"study root: {self.root}")
        print(f"{'phase':8} {'planned':>7} {'done':>5} {'failed':>6} {'todo':>5} {'run-min':>8}")
        for name, jobs in phases.items():
            keys = [self._key(j) for j in jobs if self._key(j) not in seen]
            seen.update(keys)
            nd = [k for k in keys if k in done]
            nf = [k for k in keys if k in failed and k not in done]
            wall = sum(json.loads(done[k].read_text()).get("wall_seconds", 0.0) for k in nd)
            total_wall += wall
            print(f"{name:8} {len(keys):7d} {len(nd):5d} {len(nf):6d} {len(keys) - len(nd) - len(nf):5d} {wall / 60:8.1f}")
        n_done = sum(1 for k in seen if k in done)
        n_todo = sum(1 for k in seen if k not in done and k not in failed)
        # driver wall clock: from the multirun calls (includes each train.py's start-up and teardown)
        calls = [json.loads(l) for l in self.log_path.read_text().splitlines()] if self.log_path.is_file() else []
        call_wall = sum(c.get("wall", 0.0) for c in calls if "phase" in c)
        per_job = call_wall / max(1, sum(c.get("jobs", 0) for c in calls if "phase" in c))
        print(f"jobs: {len(seen)} planned, {n_done} done; in-run wall {total_wall / 60:.1f} min, "
              f"driver wall (train.py calls incl. start-up) {call_wall / 60:.1f} min, {per_job:.0f} s/job; "
              f"estimated remaining {n_todo * per_job / 60:.1f} min")
        runs = [c for c in calls if "phase" in c]
        if runs:
            first = min(c["time"] - c["wall"] for c in runs)
            last = max(c["time"] for c in runs)
            print(f"first train.py call started {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(first))} UTC, the last ended "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(last))} UTC: span {(last - first) / 60:.1f} min")
        print("tuned lr:", best)
        return 0


def _read_overrides(path: Path) -> list[str]:
    import yaml

    return [str(x) for x in (yaml.safe_load(path.read_text()) or [])]


def _quote(s: str) -> str:
    return f"'{s}'" if any(c in s for c in "[]{} ,") and not s.startswith("seed=") else s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="a smoke version (2 methods, 32 steps, 2 workers) in study_quick/")
    ap.add_argument("--budget", action="store_true", help="report planned/done/failed jobs and time spent; run nothing")
    ap.add_argument("--dry-run", action="store_true", help="print the train.py commands only")
    ap.add_argument("--root", help="study folder (default study/, or study_quick/ with --quick)")
    ap.add_argument("--phases", default="tuning,fixed,hetero,bf16", help="comma-separated subset, in this order")
    ap.add_argument("--methods", help=f"comma-separated subset of {','.join(METHODS)}")
    ap.add_argument("--bf16-methods", help="comma-separated, or 'all' (default nesterov,cgad,adam_decay)")
    ap.add_argument("--seeds", help="comma-separated (default 0,1,2)")
    ap.add_argument("--retry-failed", action="store_true")
    ap.add_argument("--keep-hubs", action="store_true", help="keep each run's hub/ and checkpoints (default: deleted once results.json exists)")
    args = ap.parse_args(argv)
    study = Study(args)
    return study.budget() if args.budget else study.run()


if __name__ == "__main__":
    sys.exit(main())
