"""Summarise a sweep: ``python -m diloco_lightning.summarize runs/multirun [--out DIR]``.

Reads every ``results.json`` below the folder (one per run, written by ``train.py``),
groups runs by (outer optimizer, tau, regime) and prints a Markdown table of the final
eval loss (mean ± std over seeds), the *single-shot risk*, the divergence count, and
writes ``summary.md``, ``summary.csv`` and one loss-curve PNG per tau (``loss_tau<k>.png``,
needs matplotlib): the global model's eval loss against the outer step, the mean over
seeds with a ± std band, on a linear axis.

The single-shot risk is ``mean + std`` of the final eval loss over seeds: what one run,
launched once, may reasonably end at (the CGAD paper, Shah & Sun 2026, reports it because a
large run is launched once). A method that diverges in any seed has an infinite mean.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Iterable

log = logging.getLogger(__name__)

COLUMNS = ("outer", "tau", "regime", "precision", "runs", "eval_loss_mean", "eval_loss_std", "single_shot_risk",
           "final_train_loss_mean", "diverged", "deltas_accepted", "deltas_rejected", "wall_seconds_mean")


def load_results(root: str | Path) -> list[dict]:
    """Every ``results.json`` under ``root``, sorted by path."""
    out = []
    for p in sorted(Path(root).rglob("results.json")):
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            log.warning("skipping %s: %s", p, e)
            continue
        doc["_path"] = str(p)
        out.append(doc)
    return out


def _finite(xs: Iterable[float | None]) -> list[float]:
    return [x for x in xs if x is not None and math.isfinite(x)]


def group_key(r: dict) -> tuple:
    return (r.get("outer", "?"), str(r.get("tau", "?")), r.get("regime", "fixed"), r.get("precision", "?"))


def summarize(results: list[dict]) -> list[dict]:
    """One row per (outer, tau, regime, precision), sorted."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in results:
        groups[group_key(r)].append(r)

    def sort_key(k):
        outer, tau, regime, prec = k
        return (outer, regime, prec, int(tau) if tau.isdigit() else 10**9, tau)

    rows = []
    for key in sorted(groups, key=sort_key):
        rs = groups[key]
        # A diverged run has no meaningful loss: it counts in `diverged`, and its loss is reported as inf
        # in the mean (so a method that diverges cannot look good by dropping its failures).
        evals: list[float] = [
            float(x) if (x is not None and math.isfinite(x) and not r.get("diverged")) else math.inf
            for x, r in ((r.get("eval_loss"), r) for r in rs)
        ]
        finite = _finite(evals)
        mean = statistics.fmean(evals) if evals and len(finite) == len(evals) else math.inf
        if len(evals) > 1 and len(finite) == len(evals):
            std = statistics.pstdev(evals)
        else:
            std = 0.0 if len(evals) == 1 and finite else math.inf
        trains = _finite(r.get("final_train_loss") for r in rs)
        rows.append(
            dict(
                outer=key[0], tau=key[1], regime=key[2], precision=key[3], runs=len(rs),
                eval_loss_mean=mean, eval_loss_std=std, single_shot_risk=mean + std,
                final_train_loss_mean=statistics.fmean(trains) if trains else math.nan,
                diverged=sum(bool(r.get("diverged")) for r in rs),
                deltas_accepted=sum(int(r.get("deltas_accepted", 0)) for r in rs),
                deltas_rejected=sum(int(r.get("deltas_rejected", 0)) for r in rs),
                wall_seconds_mean=statistics.fmean(_finite(r.get("wall_seconds") for r in rs) or [math.nan]),
            )
        )
    return rows


SINGLE_SHOT_NOTE = (
    "single-shot risk = mean + std of the final eval loss over seeds: what one run, launched once, may end at "
    "(lower is better; inf when a seed diverged)."
)


def _fmt(x, digits: int = 4) -> str:
    if isinstance(x, float):
        return "inf" if math.isinf(x) else ("nan" if math.isnan(x) else f"{x:.{digits}f}")
    return str(x)


def markdown_table(rows: list[dict]) -> str:
    head = ("| outer | tau | regime | precision | runs | eval loss (mean ± std) | single-shot risk | final train loss "
            "| diverged | accepted | rejected | wall s |")
    sep = "|" + "---|" * 12
    lines = [head, sep]
    for r in rows:
        lines.append(
            f"| {r['outer']} | {r['tau']} | {r['regime']} | {r['precision']} | {r['runs']} | "
            f"{_fmt(r['eval_loss_mean'])} ± {_fmt(r['eval_loss_std'])} | {_fmt(r['single_shot_risk'])} | "
            f"{_fmt(r['final_train_loss_mean'])} | {r['diverged']} | {r['deltas_accepted']} | {r['deltas_rejected']} | "
            f"{_fmt(r['wall_seconds_mean'], 0)} |"
        )
    return "\n".join(lines) + "\n\n" + SINGLE_SHOT_NOTE + "\n"


def _curve_of(r: dict) -> tuple[list, str]:
    """A run's eval-loss curve ``[[outer_step, loss], ...]`` (older results: the train-loss curve)."""
    if r.get("eval_curve"):
        return r["eval_curve"], "eval"
    return r.get("train_curve") or [], "train"


def _series(results: list[dict]) -> tuple[dict[str, dict[tuple, list[list]]], dict[str, set[str]]]:
    """Curves grouped by tau, then by (outer, regime, precision); and which kind of curve each tau has."""
    by_tau: dict[str, dict[tuple, list[list]]] = defaultdict(lambda: defaultdict(list))
    kinds: dict[str, set[str]] = defaultdict(set)
    for r in results:
        curve, kind = _curve_of(r)
        if curve:
            tau = str(r.get("tau", "?"))
            by_tau[tau][(r.get("outer", "?"), r.get("regime", "fixed"), r.get("precision", "?"))].append(curve)
            kinds[tau].add(kind)
    return by_tau, kinds


def loss_figure(tau: str, series: dict[tuple, list[list]], kinds: set[str]):
    """The figure of one tau: per (outer, regime, precision), the mean curve over seeds with a ± std band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (outer, regime, prec), curves in sorted(series.items()):
        steps = sorted({int(s) for c in curves for s, _ in c})
        mean, std = [], []
        for s in steps:
            vals = _finite(v for c in curves for st, v in c if int(st) == s)
            mean.append(statistics.fmean(vals) if vals else math.nan)
            std.append(statistics.pstdev(vals) if len(vals) > 1 else 0.0)
        line = ax.plot(steps, mean, marker="o", markersize=3, label=f"{outer} ({regime}, {prec}, n={len(curves)})")[0]
        ax.fill_between(steps, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                        color=line.get_color(), alpha=0.2, linewidth=0)
    eval_only = kinds == {"eval"}
    ax.set_xlabel("outer step" if eval_only else "outer step (eval) / inner step (train)")
    ax.set_ylabel("eval loss of the global model" if eval_only else "loss")
    ax.set_title(f"tau = {tau}: mean ± std over seeds")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_curves(results: list[dict], out_dir: Path) -> list[Path]:
    """One PNG per tau (:func:`loss_figure`): the global model's eval loss against the outer step,
    mean over seeds with a ± std band, linear axis. Needs matplotlib."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no loss-curve plots (pip install matplotlib)")
        return []
    by_tau, kinds = _series(results)
    paths = []
    for tau, series in sorted(by_tau.items()):
        fig = loss_figure(tau, series, kinds[tau])
        p = out_dir / f"loss_tau{tau}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", help="a folder holding results.json files (e.g. runs/multirun)")
    ap.add_argument("--out", help="where to write summary.md/csv and PNGs (default: sweep_dir)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = load_results(args.sweep_dir)
    if not results:
        print(f"no results.json under {args.sweep_dir}", file=sys.stderr)
        return 1
    out = Path(args.out or args.sweep_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(results)
    table = markdown_table(rows)
    (out / "summary.md").write_text(table)
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    pngs = plot_curves(results, out)
    print(table)
    print(f"{len(results)} runs; wrote {out / 'summary.md'}, {out / 'summary.csv'}" + "".join(f", {p}" for p in pngs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
