"""The tables and the plot of ``benchmarks/sim_stragglers.py`` (``--report``): docs/stragglers_results.md.

For each scenario: every arm at its tuned (family, lr), over its seeds (3 by default); the best synchronous arm (the
lowest mean final loss among the synchronous ones) is the reference; each other arm's paired
differences to it (same seed: same data, initialisation, preemptions and speed draws) at equal
simulated time (the final loss at the budget) and at equal tokens (the loss at the smaller of the
two runs' delivered tokens, interpolated along each run's curve), mean and 95 % t interval
(n - 1 degrees of freedom, n the seeds every compared arm has); the time at which the arm first reaches the reference's final loss
(a fraction of the budget, per seed); the tuning grids (seed 0) with the divergences at every lr.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776}


def loss_at(curve: list[list[float]], x: float) -> float | None:
    """The loss at ``x`` on ``[[x, loss], ...]`` (x non-decreasing), linear between points; None past its end."""
    for (x0, l0), (x1, l1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return l1 if x1 == x0 else l0 + (l1 - l0) * (x - x0) / (x1 - x0)
    return curve[-1][1] if curve and abs(curve[-1][0] - x) < 1e-9 else None


def time_to(curve: list[list[float]], target: float) -> float | None:
    """The first x at which ``[[x, loss], ...]`` reaches ``target`` (linear between points)."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t0 if l0 <= target else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def ci(xs: list[float]) -> tuple[float, float, float] | None:
    """Mean and 95 % t interval of paired differences."""
    if not xs:
        return None
    if not all(math.isfinite(x) for x in xs):  # a diverged run on either side: no interval
        return math.inf if sum(xs) > 0 else -math.inf, math.nan, math.nan
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, math.nan, math.nan
    half = T95.get(len(xs), 2.0) * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - half, m + half


def fmt_ci(c: tuple[float, float, float] | None) -> str:
    if c is None:
        return "-"
    m, lo, hi = c
    if math.isinf(m):
        return "diverged" if m > 0 else "the reference diverged"
    if math.isnan(lo):
        return f"{m:+.3f}"
    mark = "**" if hi < 0 or lo > 0 else ""
    return f"{mark}{m:+.3f} [{lo:+.3f}, {hi:+.3f}]{mark}"


def _final(r: dict) -> float:
    return math.inf if r.get("diverged") or not math.isfinite(r["eval_loss"]) else float(r["eval_loss"])


def cell_runs(study: Any, scenario: str, arm: str) -> tuple[str, float, list[dict]] | None:
    """The arm's tuned (family, lr) and its runs over the seeds (None: not tuned yet)."""
    from sim_stragglers import job

    b = study.best(scenario, arm)
    if b is None:
        return None
    fam, lr = b
    runs = [r for s in study.seeds if (r := study.results(job(scenario, arm, fam, lr, s))) is not None]
    return fam, lr, runs


def scenario_table(study: Any, scenario: str) -> tuple[list[str], dict[str, Any]]:
    """Markdown lines of one scenario's table, and its summary (best sync, best async, their differences)."""
    from sim_stragglers import ARMS, SCENARIO_ARMS, SCENARIOS

    cells = {}
    for arm in SCENARIO_ARMS[scenario]:
        c = cell_runs(study, scenario, arm)
        if c is not None and c[2]:
            cells[arm] = c
    if not cells:
        return [], {}

    def mean_loss(arm: str) -> float:
        xs = [_final(r) for r in cells[arm][2]]
        return statistics.fmean(xs) if xs else math.inf

    n_seeds = max(len(c[2]) for c in cells.values())
    complete = {a: c for a, c in cells.items() if len(c[2]) == n_seeds}
    syncs = [a for a in complete if ARMS[a]["sync"]]
    asyncs = [a for a in complete if not ARMS[a]["sync"]]
    ref = min(syncs, key=mean_loss) if syncs else None
    best_async = min(asyncs, key=mean_loss) if asyncs else None
    budget = SCENARIOS[scenario]["budget"]
    by_seed = {r["seed"]: r for r in cells[ref][2]} if ref else {}
    lines = [f"| arm | outer, lr | final loss (equal time) | reaches {ref or 'best sync'}'s final loss at (x budget, per seed) "
             f"| tokens x {ref or 'ref'} | vs {ref}: equal time | vs {ref}: equal tokens |", "|---|---|---|---|---|---|---|"]
    summary: dict[str, Any] = {"scenario": scenario, "best_sync": ref, "best_async": best_async, "seeds": n_seeds}
    for arm, (fam, lr, runs) in cells.items():
        losses = [_final(r) for r in runs]
        finite = [x for x in losses if math.isfinite(x)]
        loss_txt = (f"{statistics.fmean(finite):.3f} ± {statistics.stdev(finite):.3f}" if len(finite) > 1
                    else (f"{finite[0]:.3f}" if finite else "diverged"))
        if len(finite) < len(losses):
            loss_txt += f" ({len(losses) - len(finite)} diverged)"
        reach, tok_x, d_time, d_tok = [], [], [], []
        for r in runs:
            s = by_seed.get(r["seed"])
            if s is None:
                continue
            t = time_to(r["sim"]["eval_curve_time"], _final(s))
            reach.append("-" if t is None else f"{t / budget:.2f}")
            ta, ts = r["sim"]["eval_curve_tokens"], s["sim"]["eval_curve_tokens"]
            tok_x.append(ta[-1][0] / max(1, ts[-1][0]))
            d_time.append(_final(r) - _final(s))
            x = min(ta[-1][0], ts[-1][0])
            la, ls = loss_at(ta, x), loss_at(ts, x)
            if la is not None and ls is not None:
                d_tok.append(la - ls)
        name = f"**{arm}**" if arm in (ref, best_async) else arm
        same = arm == ref
        lines.append(f"| {name} | {fam} {lr:g} | {loss_txt} | {' '.join(reach)} | "
                     f"{statistics.fmean(tok_x) if tok_x else math.nan:.2f} | {'(reference)' if same else fmt_ci(ci(d_time))} | "
                     f"{'' if same else fmt_ci(ci(d_tok))} |")
        if arm == best_async:
            summary.update(async_time=ci(d_time), async_tokens=ci(d_tok), async_reach=reach,
                           sync_loss=mean_loss(ref) if ref else None, async_loss=mean_loss(arm))
    return lines, summary


def grid_lines(study: Any, scenario: str) -> list[str]:
    from sim_stragglers import SCENARIO_ARMS, SEEDS, families_of, job

    out = ["| arm | family | lr: final loss at seed 0 (chosen in bold; x: diverged) |", "|---|---|---|"]
    for arm in SCENARIO_ARMS[scenario]:
        for fam in families_of(scenario, arm):
            lrs, _ = study.grid(scenario, arm, fam)
            scores = [(lr, study.loss(job(scenario, arm, fam, lr, SEEDS[0]))) for lr in lrs]
            if all(math.isnan(x) for _, x in scores):
                continue
            finite = [(x, lr) for lr, x in scores if math.isfinite(x)]
            best = min(finite)[1] if finite else None
            cells = []
            for lr, x in scores:
                txt = "…" if math.isnan(x) else ("x" if math.isinf(x) else f"{x:.3f}")
                cells.append(f"**{lr:g}: {txt}**" if lr == best else f"{lr:g}: {txt}")
            out.append(f"| {arm} | {fam} | {', '.join(cells)} |")
    return out


def write_report(study: Any, doc: Path, plot: Path) -> None:
    from sim_stragglers import MAIN, SCENARIOS, SWEEP, varying_compute

    parts = ["# Stragglers, links, preemptions: the tables (generated)", "",
             "Written by `python benchmarks/sim_stragglers.py --report` from the runs in "
             f"`{study.root.name}/`; what they show: [stragglers.md](stragglers.md). Bold differences: the 95 % interval "
             "excludes 0 (negative: the arm is better than the reference).", ""]
    summaries = []
    for sc in MAIN:
        lines, summary = scenario_table(study, sc)
        if not lines:
            continue
        summaries.append(summary)
        parts += [f"## {sc}: {describe(sc)}", "", *lines, ""]
        if "varying" in SCENARIOS[sc]:
            parts += ["Total speed of the 4 workers over the budget, per seed (the straggler scenario's: 3.25): "
                      + ", ".join(f"seed {s} {varying_compute(s, sc):.2f}" for s in study.seeds) + ".", ""]
        parts += ["Tuning (seed 0):", "", *grid_lines(study, sc), ""]
    sweep = []
    for rho in sorted({*SWEEP, SCENARIOS["xdc"]["rho"]}):
        sc = "xdc" if rho == SCENARIOS["xdc"]["rho"] else f"xdc_r{rho:g}"
        if sc != "xdc" and rho not in SWEEP:
            continue
        lines, summary = scenario_table(study, sc)
        if lines:
            sweep.append((rho, summary))
            parts += [f"## {sc}: communication / compute = {rho:g} (lrs tuned at {SCENARIOS['xdc']['rho']:g})", "",
                      *lines, ""]
    head = ["## Headline: the best asynchronous arm against the best synchronous one", "",
            "| scenario | best sync | its loss | best async | its loss | async - sync, equal time | async - sync, equal tokens "
            "| async reaches sync's loss at (x budget) |", "|---|---|---|---|---|---|---|---|"]
    for s in summaries + [x for _, x in sweep if x.get("scenario") != "xdc"]:
        if not s.get("best_sync") or not s.get("best_async"):
            continue
        head.append(f"| {s['scenario']} | {s['best_sync']} | {s.get('sync_loss', math.nan):.3f} | {s['best_async']} | "
                    f"{s.get('async_loss', math.nan):.3f} | {fmt_ci(s.get('async_time'))} | {fmt_ci(s.get('async_tokens'))} | "
                    f"{' '.join(s.get('async_reach', []))} |")
    head += ["", "Against plain lockstep on every worker (`sync`): the `async` arm's paired difference at equal time.", "",
             "| scenario | async - sync, equal time |", "|---|---|"]
    for sc in [*MAIN, *(f"xdc_r{rho:g}" for rho in sorted(SWEEP))]:
        a, s = cell_runs(study, sc, "async"), cell_runs(study, sc, "sync")
        if a and s:
            by_seed = {r["seed"]: r for r in s[2]}
            d = [_final(r) - _final(by_seed[r["seed"]]) for r in a[2] if r["seed"] in by_seed]
            head.append(f"| {sc} | {fmt_ci(ci(d))} |")
    parts[4:4] = head + [""]  # after the title and the paragraph under it
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(parts) + "\n")
    draw(study, plot)


def describe(sc: str) -> str:
    from sim_stragglers import SCENARIOS

    s = SCENARIOS[sc]
    bits = [f"speeds {[round(v, 3) for v in s['speeds']]}", f"budget {s['budget']:g}"]
    if s.get("rho"):
        bits.append(f"upload of the FP32 delta = {s['rho']:g} x a phase")
    if "preempt" in s:
        bits.append(f"preemptions {s['preempt']}")
    if "varying" in s:
        bits.append(f"speeds switching 1 <-> {s['varying']['slow_speed']} (mean spells {s['varying']['fast']:g} / "
                    f"{s['varying']['slow']:g})")
    return ", ".join(bits)


def draw(study: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sim_stragglers import ARMS, MAIN, SCENARIO_ARMS

    panels = [sc for sc in [*MAIN, "xdc_r2"] if any(cell_runs(study, sc, a) for a in SCENARIO_ARMS[sc])]
    if not panels:
        return
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 4.3 * rows), squeeze=False)
    for ax, sc in zip(axes.flat, panels):
        _, summary = scenario_table(study, sc)
        lows = []
        for arm in SCENARIO_ARMS[sc]:
            c = cell_runs(study, sc, arm)
            if not c or not c[2]:
                continue
            curves = [r["sim"]["eval_curve_time"] for r in c[2]]
            n = min(len(x) for x in curves)
            t = [curves[0][i][0] for i in range(n)]
            y = [statistics.fmean(x[i][1] for x in curves) for i in range(n)]
            star = arm in (summary.get("best_sync"), summary.get("best_async"))
            ax.plot(t, y, label=f"{arm} ({c[0]} {c[1]:g})", linestyle="--" if ARMS[arm]["sync"] else "-",
                    linewidth=2.2 if star else 0.9, alpha=1.0 if star else 0.6)
            lows.append(min(y))
        ax.set_title(f"{sc}: {describe(sc)}", fontsize=8)
        ax.set_xlabel("simulated time (inner steps of a speed-1 worker)")
        ax.set_ylabel(f"eval loss, mean of {summary.get('seeds', 0)} seeds")
        if lows:
            ax.set_ylim(min(lows) - 0.05, min(lows) + 1.2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("loss against simulated time: synchronous arms dashed, asynchronous solid; thick: the best of each")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
