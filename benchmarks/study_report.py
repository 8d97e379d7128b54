"""The tables of the staleness study (``python benchmarks/study.py --report``): study/ -> docs/study_results.md.

Every figure is computed from the runs' ``results.json`` files. Final held-out loss ``L`` (a run
whose global model went above chance, or not finite, is diverged: ``inf``); retained progress
``R = (U - L) / (U - L_sync)`` with ``U`` the unigram loss and ``L_sync`` the fair synchronous
reference (the best tuned synchronous cell), computed per seed (same seed: same initialisation and
data order) and averaged; 95 % confidence intervals from Student's t over seeds (paired
differences: the per-seed differences). The precision block reads each version's record: the
fraction of Adam's ``v`` at the quantisation floor and stuck, the staleness of the delta it applied,
and the eval loss at every version (loss spikes against stale arrivals).
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
#: the audit's baseline every method is paired against: staleness-scaled SGD, lr / (1 + tau), no momentum
BASELINE = "sgd"
ASYNC = ("async", "arr4", "arr6", "arr8", "arr16", "heavy", "rnd2")
LABEL = {"sync": "synchronous (round, tau 0)", "async": "natural async (4 equal workers, tau 3)",
         "arr4": "tau = 4 arrivals", "arr6": "tau = 6 arrivals", "arr8": "tau = 8 arrivals", "arr16": "tau = 16 arrivals",
         "heavy": "heavy tail (P(tau > 32) = 10 %)", "rnd2": "tau = 2 rounds (~8 arrivals)"}


def fmt(x: float | None, d: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return "div." if x == math.inf else f"{x:.{d}f}"


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and 95 % half-width (nan with one value; inf mean if any is inf)."""
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    if any(math.isinf(x) for x in xs):
        return math.inf, math.nan
    m = statistics.mean(xs)
    if len(xs) < 2:
        return m, math.nan
    return m, T95.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


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


class Report:
    def __init__(self, study) -> None:
        import study as S  # benchmarks/study.py

        self.s, self.S = study, S
        self.U = unigram_loss(study)
        self.seeds_all = tuple(S.SEEDS) + tuple(S.CLOSE_SEEDS) if not study.args.quick else tuple(study.seeds)

    # ------------------------------------------------------------------ data
    def losses(self, setting: str, method: str, k: int | None) -> dict[int, float]:
        if k is None:
            return {}
        out = {}
        for seed in self.seeds_all:
            x = self.s.loss(self.S.job(setting, method, k, seed))
            if not math.isnan(x):
                out[seed] = x
        return out

    def reference(self) -> tuple[str | None, dict[int, float]]:
        """The fair synchronous reference: the sync cell with the lowest mean over its seeds."""
        best, best_mean, best_losses = None, math.inf, {}
        for m in self.s.plan.get("sync", []):
            ls = self.losses("sync", m, self.s.best_k("sync", m))
            if len(ls) >= 1 and all(math.isfinite(x) for x in ls.values()) and statistics.mean(ls.values()) < best_mean:
                best, best_mean, best_losses = m, statistics.mean(ls.values()), ls
        return best, best_losses

    def retained(self, ls: dict[int, float], ref: dict[int, float]) -> tuple[float, float]:
        rs = [(self.U - x) / (self.U - ref[s]) if math.isfinite(x) else -math.inf for s, x in ls.items() if s in ref]
        if any(math.isinf(r) for r in rs):
            return -math.inf, math.nan
        return mean_ci(rs)

    def paired(self, a: dict[int, float], b: dict[int, float]) -> tuple[float, float, int]:
        d = [a[s] - b[s] for s in a if s in b and math.isfinite(a[s]) and math.isfinite(b[s])]
        m, h = mean_ci(d)
        return m, h, len(d)

    # ------------------------------------------------------------------ tables
    def tuned_table(self, ref: dict[int, float]) -> tuple[list[str], dict[str, list[tuple]]]:
        lines = ["| setting | method | tuned lr | eval loss, mean ± 95 % CI (seeds) | R [95 % CI] | diverged at this lr |",
                 "|---|---|---|---|---|---|"]
        ranking: dict[str, list[tuple]] = {}
        for setting, methods in self.s.plan.items():
            rows = []
            for m in methods:
                k = self.s.best_k(setting, m)
                ls = self.losses(setting, m, k)
                if not ls:
                    continue
                mean, h = mean_ci(list(ls.values()))
                r, rh = self.retained(ls, ref)
                div = sum(1 for x in ls.values() if math.isinf(x))
                rows.append((mean, m, k, ls, h, r, rh, div))
            rows.sort(key=lambda t: (t[0], t[1]))
            ranking[setting] = rows
            for mean, m, k, ls, h, r, rh, div in rows:
                seeds = ", ".join(fmt(ls[s], 3) for s in sorted(ls))
                lines.append(f"| {LABEL.get(setting, setting)} | {m} | {self.S.lr_of(m, k):g} | {fmt(mean)} ± {fmt(h)} "
                             f"({seeds}) | {fmt(r, 2)} [{fmt(r - rh if math.isfinite(rh) else math.nan, 2)}, "
                             f"{fmt(r + rh if math.isfinite(rh) else math.nan, 2)}] | {div}/{len(ls)} |")
        return lines, ranking

    def pick_table(self, ranking: dict[str, list[tuple]], ref: dict[int, float]) -> list[str]:
        lines = ["| staleness | pick | its lr | R [95 % CI] | next best | next − pick, paired [95 % CI] (n) |",
                 "|---|---|---|---|---|---|"]
        for setting in ASYNC:
            rows = [t for t in ranking.get(setting, []) if math.isfinite(t[0])]
            if not rows:
                continue
            best, nxt = rows[0], rows[1] if len(rows) > 1 else None
            diff = self.paired(nxt[3], best[3]) if nxt else (math.nan, math.nan, 0)
            lines.append(f"| {LABEL[setting]} | **{best[1]}** | {self.S.lr_of(best[1], best[2]):g} | {fmt(best[5], 2)} "
                         f"[{fmt(best[5] - best[6], 2)}, {fmt(best[5] + best[6], 2)}] | {nxt[1] if nxt else '—'} | "
                         f"{fmt(diff[0])} [{fmt(diff[0] - diff[1])}, {fmt(diff[0] + diff[1])}] ({diff[2]}) |")
        return lines

    def grid_table(self) -> list[str]:
        lines = ["| setting | method | lr: final eval loss, seed 0 (**best**; div. = diverged) | best interior? |",
                 "|---|---|---|---|"]
        for setting, m in self.s.cells():
            ks = self.s.grid(setting, m)
            best = self.s.best_k(setting, m)
            cells = []
            for k in ks:
                x = self.s.loss(self.S.job(setting, m, k, 0))
                text = f"{self.S.lr_of(m, k):g}: {fmt(x)}"
                cells.append(f"**{text}**" if k == best else text)
            interior = "—" if best is None else ("yes" if ks[0] < best < ks[-1] else "**edge**")
            lines.append(f"| {setting} | {m} | {', '.join(cells)} | {interior} |")
        return lines

    def divergence_table(self) -> list[str]:
        """Every run of a cell (all phases) counted per lr: diverged / runs."""
        lines = ["| setting | method | diverged / runs at each lr (every seed run there) |", "|---|---|---|"]
        for setting, m in self.s.cells():
            parts = []
            for k in sorted(set(self.s.grid(setting, m)) | {x for x in (self.s.sync_k(m),) if x is not None}):
                ls = self.losses(setting, m, k)
                if ls:
                    parts.append(f"{self.S.lr_of(m, k):g}: {sum(math.isinf(x) for x in ls.values())}/{len(ls)}")
            lines.append(f"| {setting} | {m} | {', '.join(parts)} |")
        return lines

    def transfer_table(self, ref: dict[int, float]) -> list[str]:
        lines = ["| setting | method | lr tuned synchronously | its loss (seeds) | R | lr tuned here | its R | "
                 "synchronous − here, paired [95 % CI] |", "|---|---|---|---|---|---|---|---|"]
        for setting, m in self.s.cells():
            if setting == "sync":
                continue
            k0, kt = self.s.sync_k(m), self.s.best_k(setting, m)
            a, b = self.losses(setting, m, k0), self.losses(setting, m, kt)
            if not a or not b:
                continue
            ra, rb = self.retained(a, ref)[0], self.retained(b, ref)[0]
            d = self.paired(a, b)
            lines.append(f"| {setting} | {m} | {self.S.lr_of(m, k0):g} | {', '.join(fmt(a[s]) for s in sorted(a))} | "
                         f"{fmt(ra, 2)} | {self.S.lr_of(m, kt):g} | {fmt(rb, 2)} | "
                         f"{fmt(d[0])} [{fmt(d[0] - d[1])}, {fmt(d[0] + d[1])}] |")
        return lines

    def paired_table(self, ranking: dict[str, list[tuple]]) -> list[str]:
        lines = ["| setting | method − best (paired by seed) | mean | 95 % CI | seeds |", "|---|---|---|---|---|"]
        for setting, rows in ranking.items():
            fin = [t for t in rows if math.isfinite(t[0])]
            if len(fin) < 2:
                continue
            best = fin[0]
            for t in rows[1:]:
                m, h, n = self.paired(t[3], best[3])
                lines.append(f"| {setting} | {t[1]} − {best[1]} | {fmt(m)} | [{fmt(m - h)}, {fmt(m + h)}] | {n} |")
            by = {t[1]: t for t in rows}
            base = by.get(BASELINE)
            if base is not None and math.isfinite(base[0]) and best[1] != BASELINE:
                for t in rows:
                    if t[1] not in (BASELINE, best[1]):
                        m, h, n = self.paired(t[3], base[3])
                        lines.append(f"| {setting} | {t[1]} − {BASELINE} (the baseline) | {fmt(m)} | "
                                     f"[{fmt(m - h)}, {fmt(m + h)}] | {n} |")
            if "cgad" in by and "adam_decay" in by:
                m, h, n = self.paired(by["cgad"][3], by["adam_decay"][3])
                lines.append(f"| {setting} | cgad − adam_decay | {fmt(m)} | [{fmt(m - h)}, {fmt(m + h)}] | {n} |")
        return lines

    def missing_table(self, ref: dict[int, float]) -> list[str]:
        """The rebase's control: at 8 arrivals a rebased phase lacks 6 deltas (the other workers'),
        as a plain phase at 6 arrivals does (its own and others'). Paired by seed."""
        pairs = [(s, m) for s in self.S.MISSING_SETTINGS for m in self.s.plan.get(s, [])]
        if not pairs or "arr8" not in self.s.plan or "sgd_rb" not in self.s.plan["arr8"]:
            return ["(not run)"]
        rb = self.losses("arr8", "sgd_rb", self.s.best_k("arr8", "sgd_rb"))
        lines = ["| cell | deltas a base lacks | R [95 % CI] | minus arr8 sgd_rb, paired [95 % CI] (seeds) |",
                 "|---|---|---|---|"]
        rows = [("arr8", "sgd_rb", "6 (the other workers')", rb),
                ("arr8", "sgd", "8 (2 own, 6 others')", self.losses("arr8", "sgd", self.s.best_k("arr8", "sgd")))]
        rows += [(s, m, f"{s[3:]} (own and others')", self.losses(s, m, self.s.best_k(s, m))) for s, m in pairs]
        for s, m, what, ls in rows:
            if not ls:
                continue
            r, rh = self.retained(ls, ref)
            d, dh, n = self.paired(ls, rb)
            diff = "(reference)" if (s, m) == ("arr8", "sgd_rb") else f"{fmt(d)} [{fmt(d - dh)}, {fmt(d + dh)}] ({n})"
            lines.append(f"| {s} {m} | {what} | {fmt(r, 2)} [{fmt(r - rh, 2)}, {fmt(r + rh, 2)}] | {diff} |")
        return lines

    def precision_table(self) -> list[str]:
        groups: dict[tuple, list[dict]] = {}
        if not self.s.long_jobs():
            return ["Its runs have a setting of their own: `python benchmarks/study.py --only long`, then "
                    "`--only long --report --out docs/study_precision.md` ([study_precision.md](study_precision.md))."]
        for j in self.s.long_jobs():
            r = self.s.results(j)
            if r is not None:
                groups.setdefault((j["method"], j["state"], j["beta2"]), []).append(r)
        return precision_rows(groups)


def spikes(curve: list[list[float]], taus: dict[int, int], stale: int = 16) -> tuple[int, int]:
    """Loss spikes of an eval curve (``[[outer_step, loss], ...]``): a point more than max(0.05,
    3 x 1.4826 MAD) above the median of the 8 before it; and how many of them came within 2
    versions of a delta staler than ``stale`` (``taus``: outer step -> the staleness it applied)."""
    count = aligned = 0
    for i in range(8, len(curve)):
        window = sorted(x for _, x in curve[i - 8:i])
        med = (window[3] + window[4]) / 2
        mad = statistics.median(abs(x - med) for x in window)
        if curve[i][1] - med > max(0.05, 3 * 1.4826 * mad):
            count += 1
            step = int(curve[i][0])
            aligned += any(taus.get(step - d, 0) > stale for d in range(3))
    return count, aligned


def chance_aligned(p: float, window: int = 3) -> float:
    """The chance that a point falls within ``window - 1`` versions after a stale delta when each
    version applies one with probability ``p``, independently: what :func:`spikes`' alignment
    would count for spikes that have nothing to do with staleness."""
    return 1.0 - (1.0 - p) ** window


def precision_rows(groups: dict[tuple, list[dict]]) -> list[str]:
    """The precision block: per (method, outer state, beta2), the runs' final losses, the fraction of
    v at the quantisation floor and stuck (over every version), and loss spikes against stale arrivals."""
    if not groups:
        return ["(not run)"]
    lines = ["| method | outer state | beta2 | final eval loss (seeds) | diverged | v at the floor: mean, max | "
             "v stuck: mean | spikes | of them within 2 versions of a delta with tau > 16 (expected by chance) | "
             "versions with tau > 16 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (m, st, b2), rs in sorted(groups.items()):
        losses = [math.inf if x.get("diverged") else x["eval_loss"] for x in rs]
        floor, stuck, n_spikes, n_aligned, stale, versions = [], [], 0, 0, 0, 0
        for r in rs:
            vs = r["sim"]["versions"]
            for v in vs:
                o = (v.get("outer_state") or {}).get("exp_avg_sq")
                if o:
                    floor.append(o["floor"])
                    stuck.append(o["stuck"])
            taus = {int(v["outer_step"]): max((int(t) for t in (v.get("staleness_histogram") or {})), default=0)
                    for v in vs}
            c, a = spikes(r["eval_curve"], taus)
            n_spikes, n_aligned = n_spikes + c, n_aligned + a
            stale += sum(1 for t in taus.values() if t > 16)
            versions += len(taus)
        lines.append(f"| {m} | {st} | {b2} | {', '.join(fmt(x) for x in losses)} | "
                     f"{sum(math.isinf(x) for x in losses)}/{len(losses)} | "
                     f"{fmt(statistics.mean(floor), 4) if floor else '—'}, {fmt(max(floor), 4) if floor else '—'} | "
                     f"{fmt(statistics.mean(stuck), 4) if stuck else '—'} | {n_spikes} | {n_aligned} "
                     f"({fmt(n_spikes * chance_aligned(stale / max(versions, 1)), 1)}) | "
                     f"{fmt(stale / max(versions, 1), 3)} |")
    return lines


def write_precision_report(study, out: Path) -> None:
    """``--only long --report``: the precision block alone (its runs have their own setting, LONG)."""
    rep = Report(study)
    n_runs = sum(1 for j in study.long_jobs() if study.results(j) is not None)
    common = " ".join(study.common + list(rep.S.LONG["common"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join([
        "# Staleness study: the outer state's precision under a heavy tail",
        "",
        f"Generated by `python benchmarks/study.py --only long --report` from the runs' `results.json` files "
        f"({n_runs} runs; {platform.machine()}, {os.cpu_count()} CPUs). What they mean: [study.md](study.md), "
        "\"The paper's low-precision mechanism\".",
        "",
        f"Every run: `python train.py {common} <the row's overrides>` (`--only long --plan` prints each one). "
        f"Unigram loss U = {rep.U:.3f}; chance = ln 257 = {math.log(257):.3f}.",
        "",
        *rep.precision_table(),
        "",
    ]))


def write_report(study, out: Path) -> None:
    if not study.plan and study.long_jobs():
        return write_precision_report(study, out)
    rep = Report(study)
    ref_method, ref = rep.reference()
    tuned, ranking = rep.tuned_table(ref)
    mean, h = mean_ci(list(ref.values()))
    flags = " --quick" if study.args.quick else " --large" if getattr(study.args, "large", False) else ""
    n_runs = len(list((study.root / "runs").glob("*/results.json"))) if (study.root / "runs").is_dir() else 0
    text = [
        "# Staleness study: the tables",
        "",
        f"Generated by `python benchmarks/study.py{flags} --report` from the runs' `results.json` files "
        f"({n_runs} runs; {platform.machine()}, {os.cpu_count()} CPUs). What they mean and what they do not show: "
        "[study.md](study.md).",
        "",
        f"Every run: `python train.py {' '.join(study.common)} <the cell's overrides>` (`--plan` prints each one).",
        "",
        f"Unigram loss U = {rep.U:.3f}; chance = ln 257 = {math.log(257):.3f}. **Fair synchronous reference**: "
        f"{ref_method} in round mode, tuned, L_sync = {fmt(mean)} ± {fmt(h)} (95 % CI, seeds "
        f"{', '.join(str(s) for s in sorted(ref))}). R = (U - L) / (U - L_sync), per seed, then averaged.",
        "",
        "## What to pick at which staleness",
        "",
        *rep.pick_table(ranking, ref),
        "",
        "## Every cell at its tuned lr",
        "",
        *tuned,
        "",
        "## The tuning grids (seed 0)",
        "",
        *rep.grid_table(),
        "",
        "## Tuned at tau = 0 (synchronously), run at tau",
        "",
        *rep.transfer_table(ref),
        "",
        "## Paired differences against each setting's best (and against the baseline, sgd)",
        "",
        *rep.paired_table(ranking),
        "",
        "## What the rebase leaves: the count of deltas a base lacks",
        "",
        *rep.missing_table(ref),
        "",
        "## Divergences at every lr",
        "",
        *rep.divergence_table(),
        "",
        "## The outer state's precision under a heavy tail (1000+ outer steps)",
        "",
        *rep.precision_table(),
        "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(text))
    (study.root / "summary.json").write_text(json.dumps(
        {s: [{"method": t[1], "lr": study_lr(rep, t), "losses": t[3], "R": t[5], "R_ci": t[6]} for t in rows]
         for s, rows in ranking.items()}, indent=2, default=str))


def study_lr(rep: Report, row: tuple[Any, ...]) -> float:
    return rep.S.lr_of(row[1], row[2])
