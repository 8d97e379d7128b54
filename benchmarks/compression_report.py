"""The tables and the loss-vs-bytes figure of ``benchmarks/compression_study.py --report``.

From each run's ``results.json``: bytes per delta (the encoded parts, as the simulator counts them;
a delta file adds ~100 bytes of header per key), the final eval loss of the global model, and its
eval curve. For every row and setting, against ``float32`` of the same seed (same data, same
initial weights): the paired difference of the final loss **at equal rounds**, and **at equal
bytes**: float32's loss when it had sent as many bytes as the row sent in the whole run (its eval
curve interpolated linearly in outer steps). Means with 95 % t intervals over the seeds.
The goals of issue 28: >= 50x fewer bytes at <= +0.02 nats, >= 100x at <= +0.05, an interval
whose upper end is within the bound ("excludes worse").
"""

from __future__ import annotations

import json
import math
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
GOALS = ((50.0, 0.02), (100.0, 0.05))


def _ci(xs: list[float]) -> tuple[float, float, float]:
    """(mean, low, high) of a 95 % t interval; (mean, nan, nan) for one value."""
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return math.nan, math.nan, math.nan
    m = statistics.mean(xs)
    if len(xs) < 2:
        return m, math.nan, math.nan
    h = T95.get(len(xs) - 1, 2.0) * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - h, m + h


def _f(x: float, d: int = 3, sign: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:+.{d}f}" if sign else f"{x:.{d}f}"


def _interval(m: float, lo: float, hi: float) -> str:
    if math.isnan(lo):
        return f"{_f(m, 3, True)} (1 seed)"
    return f"{_f(m, 3, True)} [{_f(lo, 3, True)}, {_f(hi, 3, True)}]"


def bytes_per_step(r: dict) -> float:
    return r["bytes_sent"] / max(1, r["outer_steps"])


def loss_at_step(r: dict, step: float) -> float:
    """The eval curve of ``r`` at outer step ``step`` (linear between its points; its last past the end)."""
    curve = sorted((s, x) for s, x in r["eval_curve"])
    if step <= curve[0][0]:
        return curve[0][1]
    for (s0, x0), (s1, x1) in zip(curve, curve[1:]):
        if s0 <= step <= s1:
            return x0 + (x1 - x0) * (step - s0) / (s1 - s0) if s1 > s0 else x1
    return curve[-1][1]


REFERENCES = ("float32", "float32-plain")  # uncompressed, with Nesterov momentum / SparseLoCo's plain step


def reference_row(study, setting: str) -> str:
    """The uncompressed row every other is compared with: of ``REFERENCES`` run, the one whose tuned
    lr gave the lower seed-0 loss (the best a user would pick without compression)."""
    scored = []
    for row in REFERENCES:
        lr = study.best_lr(row, setting) if row in study.rows_of[setting] else None
        if lr is not None:
            scored.append((study.loss(study.job(row, setting, lr, study.seeds[0])), row))
    return min(scored)[1] if scored else "float32"


def summarize(study) -> dict[str, dict[str, dict[str, Any]]]:
    """setting -> row -> {lr, edge, bytes, ratio, losses, equal_rounds, equal_bytes, ...}."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for s in study.settings:
        out[s] = {}
        ref = reference_row(study, s)
        base_lr = study.best_lr(ref, s)
        base = {seed: study.results(study.job(ref, s, base_lr, seed)) for seed in study.seeds} if base_lr else {}
        for row in study.rows_of[s]:
            lr = study.best_lr(row, s)
            if lr is None:
                continue
            runs = {seed: study.results(study.job(row, s, lr, seed)) for seed in study.seeds}
            runs = {k: v for k, v in runs.items() if v is not None}
            if not runs:
                continue
            losses = [study.loss(study.job(row, s, lr, seed)) for seed in runs]
            per_delta = statistics.mean(r["bytes_sent"] / max(1, r["deltas_accepted"] + r["deltas_rejected"])
                                        for r in runs.values())
            eq_rounds, eq_bytes, seeds = [], [], []
            for seed, r in runs.items():
                b = base.get(seed)
                if b is None:
                    continue
                seeds.append(seed)
                eq_rounds.append(study.loss(study.job(row, s, lr, seed)) - study.loss(study.job(ref, s, base_lr, seed)))
                eq_bytes.append(study.loss(study.job(row, s, lr, seed)) - loss_at_step(b, r["bytes_sent"] / bytes_per_step(b)))
            fp32_bytes = statistics.mean(r["bytes_sent"] for r in base.values() if r) if base else math.nan
            total = statistics.mean(r["bytes_sent"] for r in runs.values())
            grid = study.grid(row, s)[0] if row not in study.lr_from else [lr]
            out[s][row] = {
                "lr": lr, "edge": lr in (grid[0], grid[-1]) and len(grid) > 1, "bytes_per_delta": per_delta,
                "lr_from": study.lr_from.get(row), "reference": ref,
                "ratio": fp32_bytes / total if total else math.nan, "losses": losses, "seeds": seeds,
                "loss": _ci(losses), "equal_rounds": _ci(eq_rounds), "equal_bytes": _ci(eq_bytes),
                "diffs": eq_rounds, "outer_steps": statistics.mean(r["outer_steps"] for r in runs.values()),
                "diverged": sum(1 for x in losses if math.isinf(x)),
                "lr_grid": {g: study.loss(study.job(row, s, g, study.seeds[0])) for g in grid},
                "curve": {seed: [(st * bytes_per_step(r), x) for st, x in r["eval_curve"]] for seed, r in runs.items()},
            }
    return out


SETTING_TITLES = {"r0": "round mode, staleness 0 (100 rounds of 4 deltas)",
                  "a4": "arrival mode, every delta 4 arrivals stale (400 outer steps)",
                  "f4": "round mode, 4 fragments (400 rounds, one fragment each)"}


def tables(summary: dict, titles: dict[str, str] | None = None) -> str:
    lines = []
    for s, rows in summary.items():
        ref = next(iter(rows.values()))["reference"] if rows else "float32"
        lines += [f"### {s}: {(titles or {}).get(s) or SETTING_TITLES.get(s, s)}", "",
                  f"Reference: `{ref}` (of the uncompressed rows, the one with the lower tuned seed-0 loss).", "",
                  "| encoding | bytes / delta | fewer bytes than float32 | outer lr (grid) | final eval loss | "
                  f"vs {ref}, equal rounds | vs {ref}, equal bytes | per seed (equal rounds) |",
                  "|---|---|---|---|---|---|---|---|"]
        for row, v in rows.items():
            m, lo, hi = v["loss"]
            grid = ", ".join(f"{g:g}: {_f(x)}" for g, x in v["lr_grid"].items())
            lr = (f"{v['lr']:g} ({v['lr_from']}'s, not tuned)" if v["lr_from"]
                  else f"{v['lr']:g}{' (edge)' if v['edge'] else ''} ({grid})")
            loss = f"{_f(m)} ± {_f((hi - lo) / 2) if not math.isnan(lo) else '—'}"
            is_ref = row == v["reference"]
            same = "— (the reference)" if is_ref else _interval(*v["equal_rounds"])
            eqb = "—" if is_ref else _interval(*v["equal_bytes"])
            per = "" if is_ref else ", ".join(_f(d, 3, True) for d in v["diffs"])
            lines.append(f"| {row} | {v['bytes_per_delta']:,.0f} | {v['ratio']:.1f}x | {lr} | {loss} | {same} | {eqb} | {per} |")
        lines.append("")
    return "\n".join(lines)


def goals(summary: dict) -> str:
    """Which rows meet the issue's goals, setting by setting."""
    lines = ["| setting | goal | rows that meet it (fewer bytes, upper end of the paired interval) | closest miss |",
             "|---|---|---|---|"]
    for s, rows in summary.items():
        for factor, bound in GOALS:
            met, miss = [], []
            for row, v in rows.items():
                if row in REFERENCES or not v["ratio"] >= factor:
                    continue
                m, lo, hi = v["equal_rounds"]
                (met if not math.isnan(hi) and hi <= bound else miss).append((hi if not math.isnan(hi) else m, row, v["ratio"]))
            fmt = lambda xs: ", ".join(f"{r} ({x:.0f}x, {_f(h, 3, True)})" for h, r, x in sorted(xs)) or "none"  # noqa: E731
            lines.append(f"| {s} | >= {factor:g}x at <= +{bound} | {fmt(met)} | {fmt(sorted(miss)[:1])} |")
    return "\n".join(lines)


def plot(summary: dict, path: Path, titles: dict[str, str] | None = None) -> None:
    """Final eval loss against bytes sent per worker and round, log scale, one panel per setting;
    float32's whole curve (loss against its cumulative bytes) as the reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4.5), squeeze=False)
    for ax, (s, rows) in zip(axes[0], summary.items()):
        for i, (row, v) in enumerate(rows.items()):
            if row == v["reference"]:
                for seed, pts in v["curve"].items():
                    xs, ys = zip(*[(b, x) for b, x in pts if b > 0])
                    ax.plot(xs, ys, color="black", lw=0.8, alpha=0.6, label="float32 (its curve)" if seed == 0 else None)
            total = statistics.mean(pts[-1][0] for pts in v["curve"].values())
            m, lo, hi = v["loss"]
            ax.errorbar([total], [m], yerr=[[m - lo], [hi - m]] if not math.isnan(lo) else None, fmt="os^Dv"[i % 5], ms=4,
                        label=row, capsize=2, color=plt.get_cmap("tab20")(i % 20))  # 14 rows: 20 colours, 5 markers
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent (all workers, whole run)")
        ax.set_ylabel("final eval loss")
        ax.set_title((titles or {}).get(s) or SETTING_TITLES.get(s, s), fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def write_report(study, out: Path) -> None:
    summary = summarize(study)
    (study.root / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    # in the folder's figures/ when it has one (docs/), else beside the report; named after the report
    figure = (out.parent / "figures" if (out.parent / "figures").is_dir() else out.parent) / f"{out.stem}.png"
    titles = getattr(study, "titles", {})
    plot(summary, figure, titles)
    command = shlex.join(["python", "benchmarks/compression_study.py", *sys.argv[1:]])  # the report's own
    text = [f"# Compression study: loss against bytes ({study.root.name})", "",
            f"Written by `{command}` from the runs in `{study.root.name}/` (each run's command: `--plan`); "
            f"figure: `{figure.relative_to(out.parent)}`.", "", f"![loss against bytes]({figure.relative_to(out.parent)})", "",
            tables(summary, titles), "## Goals", "", goals(summary), ""]
    out.write_text("\n".join(text))
