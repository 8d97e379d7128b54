"""Turn the staleness study's outputs into ``docs/results.md`` and ``docs/figures/*.png``.

    python benchmarks/staleness_study.py          # runs the study into study/
    python benchmarks/make_results.py             # study/ -> docs/results.md, docs/figures/
    python benchmarks/make_results.py --study study_quick --out /tmp/quick_docs

Reads every ``results.json`` under ``<study>/multirun/`` (one per ``train.py`` job),
``<study>/tuning.json`` (the lr each method kept) and ``<study>/driver_log.jsonl`` (how long
the study took). Runs of the tuning phase with a learning rate that was not kept appear only
in the tuning table. A job that failed (``<study>/failures.jsonl``) counts as diverged with an
infinite loss.

Statistics per (precision, regime, tau, method) over seeds: final eval loss of the global model
mean ± std (population std, as ``diloco_lightning.summarize``), the "single-shot risk"
mean + std (the CGAD paper's figure of merit: what one run is likely to land at), the number
of diverged runs (eval loss non-finite or above chance, ln |V|), and the change of the mean
from the same method's tau = 0 mean. Diverged runs keep their (huge) loss in the mean, as
the paper reports Nesterov's 319 at tau = 16: a method cannot look good by dropping failures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METHOD_ORDER = ("nesterov", "poly_nesterov", "delayed_nesterov", "adam_decay", "cgad")
COLORS = {"nesterov": "tab:red", "poly_nesterov": "tab:orange", "delayed_nesterov": "tab:brown",
          "adam_decay": "tab:blue", "cgad": "tab:green"}
REGIME_STYLE = {("fixed", "fp32"): "-", ("heterogeneous", "fp32"): "--", ("fixed", "bf16"): ":"}


def _prec(r: dict) -> str:
    return "bf16" if str(r.get("precision", "")).startswith("bf16") else "fp32"


def load(study: Path) -> tuple[list[dict], dict, list[dict]]:
    runs = []
    for p in sorted(study.glob("multirun/*/results.json")):
        r = json.loads(p.read_text())
        r["_dir"] = p.parent.name
        runs.append(r)
    tuning = json.loads((study / "tuning.json").read_text()) if (study / "tuning.json").is_file() else {}
    failures = []
    if (study / "failures.jsonl").is_file():
        failures = [json.loads(l) for l in (study / "failures.jsonl").read_text().splitlines() if l.strip()]
    return runs, tuning, failures


def _failure_run(f: dict) -> dict:
    """A failed job as a diverged run with an infinite loss (its overrides give the group)."""
    ov = dict(o.split("=", 1) for o in f["overrides"])
    delay = ov.get("diloco.delay", "0")
    hetero = delay.startswith("[")
    tau = str(max(int(x) for x in delay.strip("[]").split(","))) if hetero else delay
    return {"outer": ov.get("outer"), "outer_lr": float(ov.get("outer.lr", "nan")), "tau": tau,
            "regime": "heterogeneous" if hetero else "fixed", "seed": int(ov.get("seed", 0)),
            "precision": "bf16-true/adamw8bit" if "trainer.precision" in ov else "32-true/adamw",
            "eval_loss": math.inf, "diverged": True, "failed": True, "train_curve": [], "chance_loss": math.nan}


def stats(rs: list[dict]) -> dict:
    rs = sorted(rs, key=lambda r: r.get("seed", 0))
    losses = [r["eval_loss"] if r.get("eval_loss") is not None and math.isfinite(r["eval_loss"]) else math.inf for r in rs]
    finite = all(math.isfinite(x) for x in losses)
    mean = statistics.fmean(losses) if finite else math.inf
    std = statistics.pstdev(losses) if finite and len(losses) > 1 else (0.0 if finite else math.inf)
    trains = [r["final_train_loss"] for r in rs if math.isfinite(r.get("final_train_loss", math.inf))]
    return {
        "n": len(rs), "mean": mean, "std": std, "risk": mean + std, "diverged": sum(bool(r.get("diverged")) for r in rs),
        "failed": sum(bool(r.get("failed")) for r in rs), "losses": losses,
        "train": statistics.fmean(trains) if trains else math.nan,
        "accepted": sum(int(r.get("deltas_accepted", 0)) for r in rs),
        "rejected": sum(int(r.get("deltas_rejected", 0)) for r in rs),
        "wall": statistics.fmean([r["wall_seconds"] for r in rs if "wall_seconds" in r] or [math.nan]),
        "delays": rs[0].get("delays"),
    }


def f3(x: float) -> str:
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, float) and math.isnan(x):
        return "n/a"
    return f"{x:.3f}" if abs(x) < 1000 else f"{x:.3g}"


def unigram_loss(cfg: dict) -> float | None:
    """Cross-entropy of the held-out tokens under the training split's unigram frequencies (add-one)."""
    try:
        import numpy as np

        from diloco_lightning.data import TextDataModule

        dm = TextDataModule(seq_len=cfg["seq_len"], batch_size=cfg["batch_size"], val_fraction=cfg["val_fraction"],
                            tokenizer="bpe", vocab_size=cfg["vocab_size"], max_bytes=cfg["max_bytes"])
        dm.prepare_data()
        dm.setup("fit")
        tokens = np.memmap(dm.token_path, dtype=dm._dtype, mode="r")
        split = dm._split
        counts = np.bincount(np.asarray(tokens[:split], dtype=np.int64), minlength=dm.vocab_size) + 1.0
        logp = np.log(counts / counts.sum())
        val = np.asarray(tokens[split:], dtype=np.int64)
        return float(-logp[val].mean())
    except Exception as e:  # noqa: BLE001 - a reference figure, not essential
        print(f"(no unigram reference: {type(e).__name__}: {e})", file=sys.stderr)
        return None


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return f"{os.cpu_count()} CPU cores ({cpu}), {platform.system()} {platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}"


def study_time(study: Path) -> tuple[float, float, int, str]:
    """(minutes in train.py calls, span in minutes first-to-last record, jobs, first date)."""
    p = study / "driver_log.jsonl"
    if not p.is_file():
        return math.nan, math.nan, 0, "?"
    recs = [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
    calls = [r for r in recs if "phase" in r]
    wall = sum(r["wall"] for r in calls)
    # span: from the first call's start to the last call's end
    starts = [r["time"] - r["wall"] for r in calls] or [recs[0]["time"]]
    ends = [r["time"] for r in calls] or [recs[-1]["time"]]
    first = time.strftime("%Y-%m-%d %H:%M", time.gmtime(min(starts)))
    return wall / 60, (max(ends) - min(starts)) / 60, sum(r["jobs"] for r in calls), first


# ----------------------------------------------------------------------------- plots


def plot_curves(groups: dict, taus: list[str], chance: float, out: Path, uni: float | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for tau in taus:
        fig, ax = plt.subplots(figsize=(10, 4.6))
        top = chance + 0.6
        lows = []
        for (prec, regime, t, outer), rs in sorted(groups.items(), key=lambda kv: (METHOD_ORDER.index(kv[0][3]) if kv[0][3] in METHOD_ORDER else 99, kv[0])):
            if t != tau:
                continue
            curves = [r["train_curve"] for r in rs if r.get("train_curve")]
            if not curves:
                continue
            steps = sorted({int(s) for c in curves for s, _ in c})
            mean = []
            for s in steps:
                vals = [v for c in curves for st, v in c if int(st) == s]
                vals = [v if math.isfinite(v) else 1e9 for v in vals]
                mean.append(statistics.fmean(vals) if vals else math.nan)
            lows.append(min(mean))
            st = stats(rs)
            label = f"{outer} ({regime[:6]}, {prec}) eval {f3(st['mean'])}"
            if st["diverged"]:
                label += f", {st['diverged']}/{st['n']} diverged"
            ax.plot(steps, [min(m, top + 5) for m in mean], REGIME_STYLE.get((regime, prec), "-"),
                    color=COLORS.get(outer, None), label=label, lw=1.4)
        ax.axhline(chance, color="gray", lw=0.8, ls="-.")
        ax.text(0.01, chance + 0.03, f"chance ln|V| = {chance:.2f}", fontsize=7, color="gray",
                transform=ax.get_yaxis_transform())
        if uni:
            ax.axhline(uni, color="gray", lw=0.8, ls=":")
            ax.text(0.01, uni + 0.03, f"unigram {uni:.2f}", fontsize=7, color="gray", transform=ax.get_yaxis_transform())
        ax.set_ylim(min(lows + [chance]) - 0.15, top)
        ax.set_xlabel("inner step (per worker); H = 8, one outer round every 8 steps")
        ax.set_ylabel("train loss (mean over workers and seeds)")
        ax.set_title(f"tau = {tau}: solid = fixed delay, dashed = heterogeneous (0..tau), dotted = bf16 + 8-bit AdamW", fontsize=8.5)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1)
        fig.tight_layout()
        p = out / f"loss_tau{tau}.png"
        fig.savefig(p, dpi=90)
        plt.close(fig)
        paths.append(p)
    return paths


def plot_eval_vs_tau(groups: dict, chance: float, out: Path, uni: float | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("fp32", "fixed"), ("fp32", "heterogeneous"), ("bf16", "fixed")]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4.0), sharey=True)
    for ax, (prec, regime) in zip(axes, panels):
        for outer in METHOD_ORDER:
            pts = sorted((int(t), stats(rs)) for (p, rg, t, o), rs in groups.items() if p == prec and rg == regime and o == outer)
            if regime == "heterogeneous":  # tau = 0 is the same run in both regimes
                pts = sorted(pts + [(0, stats(rs)) for (p, rg, t, o), rs in groups.items()
                                    if p == prec and rg == "fixed" and o == outer and t == "0"])
            if not pts:
                continue
            cap = chance + 0.5
            xs = [t for t, _ in pts]
            ys = [min(s["mean"], cap) for _, s in pts]
            # no error bar where the mean is off the plot (a diverged group: its std is in the table)
            es = [s["std"] if math.isfinite(s["std"]) and s["mean"] < cap else 0 for _, s in pts]
            jitter = {"nesterov": -0.3, "poly_nesterov": -0.15, "delayed_nesterov": 0.0, "adam_decay": 0.15, "cgad": 0.3}
            xj = [x + jitter.get(outer, 0) for x in xs]
            ax.errorbar(xj, ys, yerr=es, marker="o", ms=4, capsize=3, color=COLORS[outer], label=outer, lw=1.2)
            for (t, s), x, y in zip(pts, xj, ys):
                if s["mean"] >= cap:
                    ax.plot([x], [y], marker="^", ms=8, color=COLORS[outer])
                if s["diverged"]:
                    ax.annotate(f"{s['diverged']}/{s['n']}", (x, y), fontsize=6.5, color=COLORS[outer],
                                xytext=(-4, 6 + 7 * list(jitter).index(outer) if outer in jitter else 6),
                                textcoords="offset points")
        ax.axhline(chance, color="gray", lw=0.8, ls="-.")
        if uni:
            ax.axhline(uni, color="gray", lw=0.8, ls=":")
        ax.set_ylim(5.0, chance + 1.3)
        ax.set_title(f"{prec}, {regime} delays", fontsize=9)
        ax.set_xlabel("tau (max delay)")
        ax.set_xticks([0, 4, 8, 16])
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("final eval loss, mean ± std over seeds")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.text(0.5, 0.005, "triangles: mean off the scale (chance + 0.5 or more; see the table), with the number of diverged "
             "seeds; dash-dot: chance ln|V|; dotted: unigram model", ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    p = out / "eval_vs_tau.png"
    fig.savefig(p, dpi=90)
    plt.close(fig)
    return p


# ----------------------------------------------------------------------------- document


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", default=str(ROOT / "study"))
    ap.add_argument("--out", default=str(ROOT / "docs"), help="results.md goes here, PNGs in <out>/figures")
    args = ap.parse_args(argv)
    study, out = Path(args.study), Path(args.out)
    runs, tuning, failures = load(study)
    if not runs:
        print(f"no results under {study}/multirun", file=sys.stderr)
        return 1
    chosen = tuning.get("chosen_lr", {})
    cfg0 = json.loads(json.dumps(_config_of(study, runs[0])))
    chance = runs[0]["chance_loss"]

    # the study's runs: the kept lr of each method (the others are tuning-only)
    main_runs = [r for r in runs if chosen.get(r["outer"]) is None or math.isclose(r["outer_lr"], chosen[r["outer"]])]
    have = {(r["outer"], r["outer_lr"], str(r["tau"]), r["regime"], r["seed"], _prec(r)) for r in runs}
    def _fkey(x: dict) -> tuple:
        return (x["outer"], x["outer_lr"], x["tau"], x["regime"], x["seed"], _prec(x))

    failures = [f for f in failures if _fkey(_failure_run(f)) not in have]
    main_runs += [_failure_run(f) for f in failures if f.get("phase") != "tuning"]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in main_runs:
        groups[(_prec(r), r["regime"], str(r["tau"]), r["outer"])].append(r)

    figdir = out / "figures"
    figdir.mkdir(parents=True, exist_ok=True)
    taus = sorted({k[2] for k in groups}, key=int)
    uni = unigram_loss(cfg0["data"])
    pngs = plot_curves(groups, taus, chance, figdir, uni)
    overview = plot_eval_vs_tau(groups, chance, figdir, uni)
    run_min, span_min, _jobs, first = study_time(study)

    L: list[str] = []
    w = L.append
    w("# Staleness study: results")
    w("")
    w("Generated by `python benchmarks/make_results.py` from the outputs of `python benchmarks/staleness_study.py`")
    w(f"(folder `{study.name}/`, {len(runs)} runs with results{f', {len(failures)} failed' if failures else ''}). "
      "How to run it, and what it means: [study.md](study.md).")
    w("")
    w(f"* Machine: {machine()}; the study ran {first} UTC, {span_min:.0f} min wall clock from its first to its last run "
      f"({len(runs)} jobs, one at a time; {run_min:.0f} min inside the `train.py` calls the driver logged), on a machine "
      "shared with other jobs.")
    m, d, o = cfg0["model"], cfg0["data"], cfg0["optim"]
    w(f"* Model: Llama, d_model {m['d_model']}, {m['n_layers']} layers, {m['n_heads']} heads ({m['n_kv_heads']} KV), "
      f"FFN {m['ffn_hidden']}, tied embeddings, vocabulary {d['vocab_size']} (byte-level BPE trained on the corpus): "
      f"{_count_params(cfg0):,} parameters.")
    w(f"* Data: the Python standard library's sources (first {d['max_bytes'] / 1e6:.0f} MB), sequences of {d['seq_len']} tokens, "
      f"batch {d['batch_size']} per worker; held-out split {d['val_fraction']:.0%}, eval = {d['val_batches']} batches of the "
      "final global model.")
    dl = cfg0["diloco"]
    w(f"* DiLoCo: {cfg0['workers']} workers, H = {dl['inner_steps']}, {cfg0['trainer']['max_steps']} inner steps per worker = "
      f"{cfg0['trainer']['max_steps'] // dl['inner_steps']} outer rounds, `sync=lockstep` (at its r-th boundary a worker "
      "installs exactly global version r - delay, so after the first tau rounds every delta is applied with staleness "
      "exactly its worker's delay), master quorum = all workers, equal weights, deltas in FP32.")
    w(f"* Inner optimizer: AdamW lr {o['lr']}, betas {list(o['betas'])}, weight decay {o['weight_decay']}, "
      f"{o['warmup_steps']} warmup steps, cosine to {o['min_lr_ratio']:.0%}, gradient clipping 1.0. "
      "bf16 rows: `trainer.precision=bf16-true` (bf16 weights, bf16 global state on the master) and bitsandbytes "
      "`AdamW8bit` with the same lr/warmup (tensors under 4096 elements keep 32-bit state, bitsandbytes' default).")
    hetero = sorted({(r["tau"], tuple(r["delays"])) for r in main_runs if r["regime"] == "heterogeneous" and r.get("delays")},
                    key=lambda x: int(x[0]))
    w("* Regimes: *fixed*: every worker at delay tau. *heterogeneous*: worker delays "
      + ", ".join(f"{list(dd)} (tau = {t})" for t, dd in hetero) + ".")
    w(f"* Reference losses: chance ln |V| = {chance:.3f}; a unigram model (token frequencies of the training split) "
      f"scores {f3(uni) if uni else 'n/a'} on the held-out split.")
    w("* Diverged: final eval loss non-finite or above chance. Failed jobs count as diverged with an infinite loss.")
    w("")

    # ---- hyperparameters + tuning
    w("## Outer optimizers and their tuning")
    w("")
    w("Each method got the same budget: 3 outer learning rates at tau = 0 (fixed regime, FP32, seed 0), spread ~3x "
      "around the family's documented default; where the best of the 3 was at an edge of the grid, the same rule gave "
      "every such method one more lr ~3x beyond that edge (marked *). The lr with the lowest final eval loss was kept "
      "for every other run (FP32 and bf16). Other options are the repository's defaults (`configs/outer/*.yaml`).")
    w("")
    w("| method | options | lr grid: eval loss at tau = 0 | kept lr |")
    w("|---|---|---|---|")
    for meth in METHOD_ORDER:
        if meth not in chosen:
            continue
        opts = _outer_options(meth)
        grid = tuning.get("eval_loss", {}).get(meth, {})
        base = {float(x) for x in tuning.get("lr_grid", {}).get(meth, [])}
        cells = ", ".join(f"{lr}{'' if not base or float(lr) in base else '*'}: {f3(v)}" for lr, v in grid.items())
        w(f"| {meth} | {opts} | {cells} | **{chosen[meth]}** |")
    w("")
    # identical algorithms at tau = 0: a measure of how chaotic training is (the noise floor of any comparison)
    pairs = []
    tun = {(r["outer"], r["outer_lr"]): r for r in runs
           if str(r["tau"]) == "0" and r["regime"] == "fixed" and _prec(r) == "fp32" and r["seed"] == min(x["seed"] for x in runs)}
    for a, b in (("nesterov", "poly_nesterov"), ("cgad", "adam_decay")):
        for (o, lr), ra in sorted(tun.items()):
            rb = tun.get((b, lr))
            if o == a and rb is not None:
                first = next((int(s1) for (s1, v1), (_, v2) in zip(ra["train_curve"], rb["train_curve"]) if v1 != v2), None)
                pairs.append((a, b, lr, ra["eval_loss"], rb["eval_loss"], first))
    if pairs:
        w("**Noise floor.** At tau = 0 two pairs of methods are the same algorithm (Poly's factor (1 + 0)^-0.5 = 1; "
          "CGAD's and Adam-Decay's gates are both 1), implemented by different code paths whose float rounding differs. "
          "Same seed, same data, same lr: the workers' train losses agree to ~1e-7 until the first outer step that "
          "differs, then the runs drift apart (training is chaotic). Their final eval losses:")
        w("")
        w("| pair | lr | eval loss | eval loss | difference | train curves first differ at step |")
        w("|---|---|---|---|---|---|")
        for a, b, lr, la, lb, first in pairs:
            w(f"| {a} / {b} | {lr} | {f3(la)} | {f3(lb)} | {abs(la - lb):.3f} | {first if first is not None else 'never'} |")
        w("")
        w("So a difference between two methods smaller than these (and than the seed-to-seed std below) is not evidence.")
        w("")
    w("Gates at the delays used (`diloco_lightning.outer`): CGAD `0.5 (1 + cos(pi tau / 32)) exp(-0.2 tau)`: "
      + ", ".join(f"tau {t} → {_cgad(t):.3g}" for t in (0, 1, 2, 4, 8, 16))
      + "; Adam-Decay `exp(-0.2 tau)`: " + ", ".join(f"{t} → {math.exp(-0.2 * t):.3g}" for t in (4, 8, 16))
      + "; Poly `(1 + tau)^-0.5`: " + ", ".join(f"{t} → {(1 + t) ** -0.5:.3g}" for t in (4, 8, 16))
      + ". Nesterov and Delayed Nesterov ignore staleness. No delay here reaches CGAD's cut (tau_cut = 32), so CGAD and "
        "Adam-Decay differ only by the cosine factor (0.85 at tau 8, 0.5 at tau 16).")
    w("")

    # ---- compact pivots
    for prec, regime, title in (("fp32", "fixed", "FP32, fixed delay (every worker at tau)"),
                                ("fp32", "heterogeneous", "FP32, heterogeneous delays (workers spread over 0..tau)"),
                                ("bf16", "fixed", "bf16 weights + 8-bit AdamW, fixed delay")):
        ts = sorted({k[2] for k in groups if k[0] == prec and k[1] == regime}, key=int)
        if not ts:
            continue
        w(f"## {title}: final eval loss, mean ± std over seeds")
        w("")
        if regime == "heterogeneous":
            w("(tau = 0 is the fixed-regime run: with a maximum delay of 0 the regimes coincide.)")
            w("")
        w("| method | " + " | ".join(f"tau = {t}" for t in ts) + " |")
        w("|---|" + "---|" * len(ts))
        for meth in METHOD_ORDER:
            cells = []
            for t in ts:
                rs = groups.get((prec, regime, t, meth))
                if not rs:
                    cells.append("—")
                    continue
                s = stats(rs)
                c = f"{f3(s['mean'])} ± {f3(s['std'])}"
                if s["diverged"]:
                    c += f" ({s['diverged']}/{s['n']} div.)"
                cells.append(c)
            if any(c != "—" for c in cells):
                w(f"| {meth} | " + " | ".join(cells) + " |")
        w("")

    # ---- the full table
    w("## Full table")
    w("")
    w("Δ tau0: the mean minus the same method's mean at tau = 0 (same precision). Single-shot risk = mean + std. "
      "Accepted/rejected: deltas over all seeds (a delta whose gate is 0 counts as rejected).")
    w("")
    w("| precision | regime | tau | delays | method | lr | runs | eval loss mean ± std | single-shot risk | Δ tau0 | diverged | final train loss | accepted / rejected | wall s/run | chance |")
    w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(groups, key=lambda k: (k[0] != "fp32", k[1] != "fixed", int(k[2]), METHOD_ORDER.index(k[3]) if k[3] in METHOD_ORDER else 99)):
        prec, regime, t, meth = key
        s = stats(groups[key])
        base = groups.get((prec, "fixed", "0", meth))
        delta = s["mean"] - stats(base)["mean"] if base else math.nan
        dtxt = "inf" if math.isinf(delta) else ("n/a" if math.isnan(delta) else f"{delta:+.3f}")
        w(f"| {prec} | {regime} | {t} | {s['delays']} | {meth} | {chosen.get(meth, groups[key][0]['outer_lr'])} | {s['n']} | "
          f"{f3(s['mean'])} ± {f3(s['std'])} | {f3(s['risk'])} | {dtxt} | {s['diverged']} | {f3(s['train'])} | "
          f"{s['accepted']} / {s['rejected']} | {s['wall']:.0f} | {chance:.3f} |")
    w("")
    w("Per-seed final eval losses (seeds 0, 1, 2): " + "; ".join(
        f"{k[3]} {k[0]} {k[1][:6]} tau {k[2]}: " + ", ".join(f3(x) for x in stats(v)["losses"])
        for k, v in sorted(groups.items(), key=lambda kv: (kv[0][0] != "fp32", kv[0][1] != "fixed", int(kv[0][2]),
                                                            METHOD_ORDER.index(kv[0][3]) if kv[0][3] in METHOD_ORDER else 99))) + ".")
    w("")
    if failures:
        w("## Failed jobs")
        w("")
        for f in failures:
            w(f"* phase {f['phase']}: `{' '.join(x for x in f['overrides'] if x.split('=')[0] in ('outer', 'outer.lr', 'diloco.delay', 'seed', 'trainer.precision'))}` "
              f"(exit {f['rc']}; log `{Path(f['log']).relative_to(study.parent) if Path(f['log']).is_absolute() else f['log']}`)")
        w("")

    # ---- figures
    w("## Figures")
    w("")
    w(f"![final eval loss vs tau](figures/{overview.name})")
    w("")
    w(f"Train loss (mean over the {cfg0['workers']} workers' local models, then over seeds) against the inner step, one plot per tau; "
      "curves above the plot's top are cut (a diverged run). Methods: red Nesterov, orange Poly, brown Delayed Nesterov, "
      "blue Adam-Decay, green CGAD.")
    w("")
    for p in pngs:
        w(f"![train loss, {p.stem}](figures/{p.name})")
        w("")
    (out / "results.md").write_text("\n".join(L))
    print(f"wrote {out / 'results.md'} and {len(pngs) + 1} PNGs in {figdir} "
          f"({', '.join(f'{p.name} {p.stat().st_size // 1024} KB' for p in pngs + [overview])})")
    return 0


def _cgad(t: int, alpha: float = 0.2, cut: int = 32) -> float:
    return 0.5 * (1 + math.cos(math.pi * t / cut)) * math.exp(-alpha * t) if 0 <= t <= cut else 0.0


def _outer_options(name: str) -> str:
    import yaml

    p = ROOT / "configs" / "outer" / f"{name}.yaml"
    try:
        d = yaml.safe_load(p.read_text())
        return ", ".join(f"{k} {v}" for k, v in (d.get("options") or {}).items()) or "—"
    except OSError:
        return "?"


def _config_of(study: Path, r: dict) -> dict:
    import yaml

    return yaml.safe_load((study / "multirun" / r["_dir"] / "config.yaml").read_text())


def _count_params(cfg: dict) -> int:
    m, v = cfg["model"], cfg["data"]["vocab_size"]
    d, ffn, L = m["d_model"], m["ffn_hidden"], m["n_layers"]
    hd = d // m["n_heads"]
    attn = d * d * 2 + 2 * d * hd * m["n_kv_heads"]
    per = attn + 3 * d * ffn + 2 * d
    return (m.get("vocab_size") or v) * d * (1 if m["tie_embeddings"] else 2) + L * per + d


if __name__ == "__main__":
    sys.exit(main())
