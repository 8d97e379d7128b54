"""The tables of the staleness study (``python benchmarks/study.py --report``): study/ -> docs/study_results.md.

Every figure is computed from the runs' ``results.json`` files (``study/runs/<id>/``): final eval
loss (mean ± std over seeds, and each seed's), divergences (final eval loss above chance or not
finite), retained progress ``(U - L_tau) / (U - L_0)`` with ``U`` the unigram loss, single-shot
risk (mean + std), paired differences between methods (same seed: same data, init and delays)
with 95 % confidence intervals (Student's t), and the outer step's size (RMS of the change of the
global weights per outer step, in units of the outer lr, averaged after the warm-up).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any

#: two-sided 95 % Student t quantiles by degrees of freedom
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def _fmt(x: float, d: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else ("inf" if x == math.inf else f"{x:.{d}f}")


def _loss(r: dict | None) -> float:
    if r is None:
        return math.nan
    x = r.get("eval_loss", math.nan)
    return x if isinstance(x, (int, float)) and math.isfinite(x) else math.inf


def _ms(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs or any(math.isinf(x) for x in xs):
        return (math.inf if xs else math.nan), math.nan
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def unigram_loss(study) -> float:
    """Held-out cross-entropy under the training split's byte frequencies (add-one)."""
    import numpy as np

    from study import _compose

    from diloco_lightning.app.build import build_datamodule

    dm = build_datamodule(_compose(study.common + ["run_id=unigram"]))
    dm.prepare_data()
    dm.setup("fit")
    tokens = np.memmap(dm.token_path, dtype=dm._dtype, mode="r")
    split = dm._split
    counts = np.bincount(np.asarray(tokens[:split], dtype=np.int64), minlength=dm.vocab_size) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(tokens[split:], dtype=np.int64)].mean())


class Table:
    def __init__(self, study, lrs: dict[str, dict[str, float]]) -> None:
        self.s, self.lrs = study, lrs
        from study import job

        self.job = job

    def runs(self, method: str, lr: float, setting: str, extra: tuple[str, ...] = ()) -> list[dict | None]:
        return [self.s.results(self.job("", method, lr, setting, seed, extra)) for seed in self.s.seeds]

    def cell(self, runs: list[dict | None]) -> dict[str, Any]:
        losses = [_loss(r) for r in runs]
        done = [x for x in losses if not math.isnan(x)]
        mean, std = _ms(losses)
        div = sum(1 for r in runs if r is not None and (r.get("diverged") or not math.isfinite(r.get("eval_loss", math.nan))))
        return {"losses": losses, "n": len(done), "mean": mean, "std": std, "div": div, "runs": runs}

    @staticmethod
    def text(c: dict[str, Any], with_seeds: bool = True) -> str:
        if c["n"] == 0:
            return "—"
        out = f"{_fmt(c['mean'])} ± {_fmt(c['std'])}"
        if with_seeds:
            out += " (" + ", ".join(_fmt(x, 2) for x in c["losses"] if not math.isnan(x)) + ")"
        if c["div"]:
            out += f" **{c['div']}/{c['n']} div.**"
        return out


def step_size(r: dict | None, after: int) -> float:
    """Mean RMS outer step / lr over the versions published after outer step ``after``."""
    if r is None:
        return math.nan
    xs = [v["update_rms_over_lr"] for v in r["sim"]["versions"] if v["outer_step"] > after and not v.get("null_round")]
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.mean(xs) if xs else math.nan


def paired(a: list[dict | None], b: list[dict | None]) -> tuple[float, float, list[float]]:
    """Mean of a - b over seeds where both finished finite, and the 95 % CI half-width."""
    d = [_loss(x) - _loss(y) for x, y in zip(a, b) if x is not None and y is not None
         and math.isfinite(_loss(x)) and math.isfinite(_loss(y))]
    if not d:
        return math.nan, math.nan, []
    if len(d) == 1:
        return d[0], math.nan, d
    return statistics.mean(d), T95.get(len(d) - 1, 2.0) * statistics.stdev(d) / math.sqrt(len(d)), d


def write_report(study, out: Path) -> None:
    lrs = json.loads((study.root / "tuning.json").read_text()) if (study.root / "tuning.json").is_file() else study.tuned()
    if lrs is None:
        raise SystemExit("tuning is not done yet: nothing to report")
    T = Table(study, lrs)
    tau = study.target
    U = unigram_loss(study)
    chance = math.log(257)
    lr0, lrt, lrr = lrs["arr0"], lrs[f"arr{tau}"], lrs["rnd0"]
    M = list(study.methods)
    L: list[str] = []
    w = L.append

    # ---------------------------------------------------------------- header
    log = [json.loads(x) for x in (study.root / "driver_log.jsonl").read_text().splitlines() if x.strip()]
    runs = [x for x in log if "id" in x and not x.get("error")]
    fails = [x for x in log if x.get("error")]
    # the driver's sessions (an interrupted study resumes in a new one): each from its start to its last run's end
    sessions: list[tuple[float, float, int]] = []
    for x in log:
        if x.get("event") == "start":
            sessions.append((x["time"], x["time"], 0))
        elif "id" in x and sessions:
            start, end, n = sessions[-1]
            sessions[-1] = (start, max(end, x["time"] + x["wall"]), n + (0 if x.get("error") else 1))
    sessions = [x for x in sessions if x[2]]
    span = sum(end - start for start, end, _ in sessions) / 60
    per = ", ".join(f"{(end - start) / 60:.0f} min for {n} runs" for start, end, n in sessions)
    w("# Staleness study: results\n")
    w("Generated by `python benchmarks/study.py --report` from `study/runs/*/results.json` (the runs of "
      "`python benchmarks/study.py`). What it means: [study.md](study.md).\n")
    w(f"* Machine: {os.cpu_count()} CPU cores, {platform.system()} {platform.machine()}, Python {platform.python_version()}; "
      f"shared with other jobs. {len(runs)} runs finished ({len(fails)} failed attempts); "
      f"wall clock, summed over the driver's {len(sessions)} sessions: **{span:.0f} min** ({per}; "
      f"sum of run times {sum(x['wall'] for x in runs) / 60:.0f} min, runs 2 at a time).")
    w("* Setting: " + " ".join(c for c in study.common if not c.startswith("launch.")) + "; lockstep (imposed delays).")
    w(f"* Reference losses (held-out bytes): chance ln 257 = {chance:.3f}; **unigram U = {U:.3f}**. Diverged: final eval "
      "loss above chance or not finite.")
    w("* Retained progress R = (U - L_tau) / (U - L_0), L_0 the same method's mean at tau = 0 (same lr rule); "
      "1 = no loss from staleness, 0 = no better than unigram, below 0 = worse than unigram; — where a seed "
      "diverged. Single-shot risk = mean + std.\n")

    # ---------------------------------------------------------------- tuning
    w("## Tuning (seed 0, the same 3 outer lrs per method)\n")
    w("| method | arrival, tau = 0 | arrival, tau = %d | round, tau = 0 |" % tau)
    w("|---|---|---|---|")
    for m in M:
        cols = []
        for setting, grid, chosen in (("arr0", study.lr_grid, lr0), (f"arr{tau}", study.lr_grid, lrt),
                                      ("rnd0", study.round_lr_grid, lrr)):
            if m not in grid:
                cols.append("—")
                continue
            parts = []
            for lr in grid[m]:
                x = _loss(study.results(T.job("", m, lr, setting, study.seeds[0])))
                parts.append(("**" if lr == chosen.get(m) else "") + f"{lr:g}: {_fmt(x)}" + ("**" if lr == chosen.get(m) else ""))
            cols.append(", ".join(parts))
        w(f"| {m} | " + " | ".join(cols) + " |")
    w("\nBold: the lr kept (lowest final eval loss). \"Tuned at tau = 0\" is what a user does; \"tuned for the staleness\" "
      f"uses the tau = {tau} column.\n")

    # ---------------------------------------------------------------- main fixed table
    w("## Fixed delay in arrivals (one outer step per delta), lr tuned at tau = 0\n")
    w("Final eval loss, mean ± std (per seed), divergences; R: retained progress; risk: mean + std; "
      "step: mean outer step RMS / lr after the warm-up.\n")
    w("| method | lr | tau = 0 | tau = 4 | tau = %d | R(4) | R(%d) | risk(%d) | step(0) | step(4) | step(%d) |" % (tau, tau, tau, tau))
    w("|---|---|---|---|---|---|---|---|---|---|---|")
    base: dict[str, float] = {}
    for m in M:
        cells = {x: T.cell(T.runs(m, lr0[m], f"arr{x}")) for x in (0, 4, tau)}
        L0 = cells[0]["mean"]
        base[m] = L0

        def R(c, L0=L0):
            if c["div"]:  # a mean over diverged runs is no measure of retained progress
                return math.nan
            return (U - c["mean"]) / (U - L0) if c["n"] and math.isfinite(c["mean"]) and math.isfinite(L0) else math.nan

        steps = [statistics.mean([s for s in (step_size(r, x) for r in cells[x]["runs"]) if not math.isnan(s)] or [math.nan])
                 for x in (0, 4, tau)]
        c16 = cells[tau]
        w(f"| {m} | {lr0[m]:g} | {T.text(cells[0])} | {T.text(cells[4])} | {T.text(cells[tau])} | {_fmt(R(cells[4]), 2)} | "
          f"{_fmt(R(c16), 2)} | {_fmt(c16['mean'] + c16['std'] if c16['n'] else math.nan)} | "
          + " | ".join(_fmt(s, 2) for s in steps) + " |")

    # ---------------------------------------------------------------- the step size through the run
    w(f"\n## The outer step's size through the run (tau = {tau}, lr tuned at tau = 0)\n")
    w("RMS change of the global weights per outer step in units of the outer lr, mean over the seeds and over blocks "
      "of outer steps (per-step values: `sim.versions[].update_rms_over_lr` in each results.json). An Adam-type step "
      "is about 1 lr when its gate is constant; below 1, the gate (through v, which remembers the larger early gated "
      "values) acts as a learning-rate decay.\n")
    total = max((len(r["sim"]["versions"]) for m in M for r in T.runs(m, lr0[m], f"arr{tau}") if r), default=0)
    edges = list(range(0, total, max(1, total // 5))) + [total]
    w("| method | " + " | ".join(f"steps {a + 1}-{b}" for a, b in zip(edges, edges[1:])) + " |")
    w("|---|" + "---|" * (len(edges) - 1))
    for m in M:
        rs = [r for r in T.runs(m, lr0[m], f"arr{tau}") if r]
        cols = []
        for a, b in zip(edges, edges[1:]):
            xs = [v["update_rms_over_lr"] for r in rs for v in r["sim"]["versions"]
                  if a < v["outer_step"] <= b and v.get("update_rms_over_lr") is not None
                  and math.isfinite(v["update_rms_over_lr"])]
            cols.append(_fmt(statistics.mean(xs), 2) if xs else "—")
        w(f"| {m} | " + " | ".join(cols) + " |")

    # ---------------------------------------------------------------- tuned for staleness
    w(f"\n## tau = {tau}: tuned at tau = 0 vs tuned for the staleness\n")
    w("| method | lr (tau = 0) | eval loss | lr (tau = %d) | eval loss | R (tuned for tau) |" % tau)
    w("|---|---|---|---|---|---|")
    for m in M:
        a, b = T.cell(T.runs(m, lr0[m], f"arr{tau}")), T.cell(T.runs(m, lrt[m], f"arr{tau}"))
        r = (U - b["mean"]) / (U - base[m]) if b["n"] and math.isfinite(b["mean"]) and math.isfinite(base[m]) else math.nan
        w(f"| {m} | {lr0[m]:g} | {T.text(a)} | {lrt[m]:g} | {T.text(b)} | {_fmt(r, 2)} |")

    # ---------------------------------------------------------------- hetero, heavy
    w("\n## Heterogeneous delays and a heavy-tailed law (arrivals, lr tuned at tau = 0)\n")
    w("Heterogeneous: the 4 workers at delays [0, 4, 8, 16]. Heavy tail: every delta draws its delay from a "
      "discretised Lomax law (shape 1.5, scale 4; median 2, mean ~7.5, P(tau >= 32) = 3.7 %, capped at 128): "
      "past CGAD's tau_cut = 32, CGAD refuses the delta (`too_stale`).\n")
    w("| method | heterogeneous | R | heavy tail | R | refused (heavy, all seeds) | step (heavy) |")
    w("|---|---|---|---|---|---|---|")
    for m in M:
        h, hv = T.cell(T.runs(m, lr0[m], "het")), T.cell(T.runs(m, lr0[m], "heavy"))

        def R(c, L0=base[m]):
            if c["div"]:  # a mean over diverged runs is no measure of retained progress
                return math.nan
            return (U - c["mean"]) / (U - L0) if c["n"] and math.isfinite(c["mean"]) and math.isfinite(L0) else math.nan

        refused = sum(int(r.get("deltas_rejected", 0)) for r in hv["runs"] if r)
        st = [s for s in (step_size(r, 16) for r in hv["runs"]) if not math.isnan(s)]
        w(f"| {m} | {T.text(h) if h['n'] else '—'} | {_fmt(R(h), 2)} | {T.text(hv)} | {_fmt(R(hv), 2)} | {refused} | "
          f"{_fmt(statistics.mean(st) if st else math.nan, 2)} |")

    # ---------------------------------------------------------------- natural asynchrony
    w("\n## Natural asynchrony (sanity anchor): 4 equal workers, `diloco.sync=async`, seed 0, lr tuned at tau = 0\n")
    w("No imposed delay: the simulated clock makes the staleness (3 arrivals after the first round, as 4 equal "
      "asynchronous workers do). Compare with the imposed tau = 4 column above.\n")
    w("| method | async (seed 0) | staleness histogram | imposed tau = 4 (seed 0) |")
    w("|---|---|---|---|")
    for m in M:
        r = study.results(T.job("", m, lr0[m], "async", study.seeds[0]))
        if r is None:
            continue
        r4 = study.results(T.job("", m, lr0[m], "arr4", study.seeds[0]))
        w(f"| {m} | {_fmt(_loss(r))}{' **div.**' if r.get('diverged') else ''} | "
          f"{r['sim']['staleness_histogram']} | {_fmt(_loss(r4))} |")

    # ---------------------------------------------------------------- round mode
    w("\n## Round mode (one outer step per round of 4 deltas), fixed delay in rounds, lr tuned at tau = 0 in round mode\n")
    w("| method | lr | tau = 0 | tau = 4 rounds | R(4) | step(0) | step(4) |")
    w("|---|---|---|---|---|---|---|")
    for m in study.round_methods:
        a, b = T.cell(T.runs(m, lrr[m], "rnd0")), T.cell(T.runs(m, lrr[m], "rnd4"))
        r = (U - b["mean"]) / (U - a["mean"]) if a["n"] and b["n"] and math.isfinite(a["mean"]) and math.isfinite(b["mean"]) else math.nan
        s0 = [s for s in (step_size(x, 0) for x in a["runs"]) if not math.isnan(s)]
        s4 = [s for s in (step_size(x, 4) for x in b["runs"]) if not math.isnan(s)]
        w(f"| {m} | {lrr[m]:g} | {T.text(a)} | {T.text(b)} | {_fmt(r, 2)} | {_fmt(statistics.mean(s0) if s0 else math.nan, 2)} | "
          f"{_fmt(statistics.mean(s4) if s4 else math.nan, 2)} |")

    # ---------------------------------------------------------------- paired differences
    w("\n## Paired differences (same seeds: same data, initialisation and delays)\n")
    w("Final eval loss of the first method minus the second's; negative = the first is better. 95 % CI: Student's t over "
      "the seeds where both runs finished finite.\n")
    w("| setting | CGAD - Adam-Decay | per seed | CGAD - Adam | per seed |")
    w("|---|---|---|---|---|")
    settings = [("arrivals, tau = 4", "arr4", (), lr0), (f"arrivals, tau = {tau}", f"arr{tau}", (), lr0),
                (f"arrivals, tau = {tau}, tuned for it", f"arr{tau}", (), lrt), ("heterogeneous", "het", (), lr0),
                ("heavy tail", "heavy", (), lr0), ("round, tau = 4", "rnd4", (), None),
                (f"arrivals, tau = {tau}, bf16 outer state", f"arr{tau}", ("outer.state_dtype=bfloat16",), lr0),
                ("heavy tail, bf16 outer state", "heavy", ("outer.state_dtype=bfloat16",), lr0),
                (f"arrivals, tau = {tau}, bf16 weights + 8-bit AdamW", f"arr{tau}", tuple(_bf16w()), lr0)]
    for name, setting, extra, lrmap in settings:
        def runs(m, lrmap=lrmap, setting=setting, extra=extra):
            if lrmap is None:
                return T.runs(m, lrr[m], setting, extra) if m in lrr else [None] * len(study.seeds)
            return T.runs(m, lrmap[m], setting, extra) if m in lrmap else [None] * len(study.seeds)

        cg = runs("cgad")
        cols = []
        for other in ("adam_decay", "adam"):
            mean, ci, d = paired(cg, runs(other)) if other in M else (math.nan, math.nan, [])
            cols += [f"{_fmt(mean)} ± {_fmt(ci)}" if d else "—", ", ".join(_fmt(x) for x in d) or "—"]
        w(f"| {name} | " + " | ".join(cols) + " |")

    # ---------------------------------------------------------------- bf16 outer state
    w("\n## bf16 outer state (buffers m, v in bf16), lr tuned at tau = 0\n")
    w("`outer.state_dtype=bfloat16`, rounded to nearest even; SR: stochastic rounding. Difference: bf16 minus FP32, paired "
      "by seed, 95 % CI.\n")
    w("| setting | method | FP32 | bf16 | bf16 - FP32 | bf16 SR | SR - FP32 |")
    w("|---|---|---|---|---|---|---|")
    for name, setting in ((f"tau = {tau}", f"arr{tau}"), ("heavy tail", "heavy")):
        for m in ("cgad", "adam_decay", "adam"):
            if m not in M:
                continue
            f32 = T.runs(m, lr0[m], setting)
            b16 = T.runs(m, lr0[m], setting, ("outer.state_dtype=bfloat16",))
            sr = T.runs(m, lr0[m], setting, ("outer.state_dtype=bfloat16", "outer.stochastic_rounding=true"))
            d1, c1, _ = paired(b16, f32)
            d2, c2, n2 = paired(sr, f32)
            w(f"| {name} | {m} | {T.text(T.cell(f32), False)} | {T.text(T.cell(b16), False)} | {_fmt(d1)} ± {_fmt(c1)} | "
              f"{T.text(T.cell(sr), False) if any(sr) else '—'} | {(_fmt(d2) + ' ± ' + _fmt(c2)) if n2 else '—'} |")

    # ---------------------------------------------------------------- bf16 weights
    w("\n## bf16 weights + 8-bit AdamW inner (bitsandbytes on CPU), lr tuned at tau = 0 (FP32)\n")
    w("`trainer.precision=bf16-true optim=adamw8bit` (same inner lr and warm-up as FP32; tensors under 4096 values keep "
      "32-bit Adam state, bitsandbytes' default). The global state is bf16 too (the workers' dtype).\n")
    w("| method | tau = 0 | tau = %d | R(%d) | std FP32 (tau = %d) | std bf16 (tau = %d) |" % (tau, tau, tau, tau))
    w("|---|---|---|---|---|---|")
    for m in ("nesterov", "adam_decay", "cgad"):
        if m not in M:
            continue
        a = T.cell(T.runs(m, lr0[m], "arr0", tuple(_bf16w())))
        b = T.cell(T.runs(m, lr0[m], f"arr{tau}", tuple(_bf16w())))
        f = T.cell(T.runs(m, lr0[m], f"arr{tau}"))
        L0 = a["mean"] if a["n"] else T.cell(T.runs("cgad", lr0["cgad"], "arr0", tuple(_bf16w())))["mean"]
        r = (U - b["mean"]) / (U - L0) if b["n"] and math.isfinite(b["mean"]) and math.isfinite(L0) else math.nan
        w(f"| {m} | {T.text(a) if a['n'] else '(= cgad at tau = 0)'} | {T.text(b)} | {_fmt(r, 2)} | {_fmt(f['std'])} | "
          f"{_fmt(b['std'])} |")
    out.write_text("\n".join(L) + "\n")


def _bf16w() -> list[str]:
    from study import BF16_WEIGHTS

    return list(BF16_WEIGHTS)
