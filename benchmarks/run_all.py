"""Run every benchmark and write ``docs/performance.md`` (figures, the command behind each, the machine).

    python benchmarks/run_all.py                     # everything (~15 min on 2 cores), then docs/performance.md
    python benchmarks/run_all.py --only bytes,e2e    # re-run some sections; the others come from the cache
    python benchmarks/run_all.py --quick             # shortened settings (a smoke test of this script)
    python benchmarks/run_all.py --doc-only          # rewrite docs/performance.md from the cache only

Sections (each one's raw output is cached in ``runs/perf/<section>.json``, so ``--only`` regenerates
the document with fresh figures for those sections and cached ones for the rest):

* ``outer_step``: ``benchmarks/outer_step.py``: one outer step over a 25M-parameter state, each
  outer optimizer against torch's fused Adam / SGD-Nesterov.
* ``master_round``: ``benchmarks/master_round.py``: master round time and peak RSS for N = 1..32
  deltas of a 25M-parameter FP32 model; a least-squares line through the round time (time is
  linear in N) and the spread of the peaks (memory is flat in N), plus a PNG.
* ``worker_overhead``: ``benchmarks/worker_overhead.py``: training throughput with and without the
  DiLoCo callback.
* ``bytes``: bytes one worker sends per round, per encoding (``diloco.delta_dtype``): measured end
  to end with ``train.py recipe=tiny`` (float32, bfloat16, int8, int4, top-k 1 % with int4 values:
  ``bytes_sent`` / deltas) and by writing one delta file of the 25M-parameter geometry as a worker
  does (``compression.encode_delta`` + ``deltafile.write_delta``) per encoding; relative to FP32.
* ``compression``: ``benchmarks/compression.py`` (file bytes, encode / decode GB/s, error of each
  encoding on real pseudo-gradients of the tiny and 25M models) and ``benchmarks/master_round.py
  --n 8 --encodings float32,int8,int4,topk+int4`` (a master round over 8 deltas of each encoding,
  side by side), plus the loss column from ``runs/perf/compression_loss.json`` when
  ``benchmarks/compression_loss.py`` has produced it (else marked pending).
* ``hub_scale``: ``benchmarks/hub_scale.py``: the real master against 64 and 256 simulated workers
  on the folder, the loopback Hugging Face Hub (one repository, and one per node) and a loopback
  S3 server: deltas applied per second, requests per round, listing cost, ledger check.
* ``e2e``: end-to-end tokens per second of ``python train.py recipe=tiny`` with 1, 2 and 4 workers
  (``tokens / wall``, the wall clock including process start-up and the final evaluation; and the
  training-only rate, tokens over the slowest worker's ``Trainer.fit`` time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SECTIONS = ("outer_step", "master_round", "worker_overhead", "bytes", "compression", "e2e", "hub_scale")
#: each section's heading in docs/performance.md: a section with no cached figures keeps its text
#: from the current document (so ``--only`` on a fresh clone does not drop the others)
HEADINGS = {
    "bytes": "## Bytes sent per worker per round",
    "compression": "## Compression",
    "master_round": "## Master round",
    "outer_step": "## Outer step",
    "worker_overhead": "## Worker overhead",
    "e2e": "## End to end",
    "hub_scale": "## Hub scale",
}
#: train.py overrides of each encoding in the ``bytes`` section
BYTES_ENCODINGS = {
    "float32": ["diloco.delta_dtype=float32"],
    "bfloat16": ["diloco.delta_dtype=bfloat16"],
    "int8": ["diloco.delta_dtype=int8"],
    "int4": ["diloco.delta_dtype=int4"],
    "topk1%+int4": ["diloco.delta_dtype=topk", "diloco.topk=0.01", "diloco.topk_values=int4"],
}
BYTES_TARGETS = {"int8": 0.27, "int4": 0.14, "topk1%+int4": 0.03}


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = int(next(l for l in Path("/proc/meminfo").read_text().splitlines() if l.startswith("MemTotal")).split()[1]) / 2**20
    except (OSError, StopIteration):
        mem = math.nan
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} CPU cores ({cpu}), {mem:.0f} GiB RAM, {gpu}, {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def sh(cmd: list[str], timeout: float = 1800, env: dict | None = None) -> dict:
    """Run a command from the repository root; its output, wall time and the load around it."""
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {"command": " ".join(_display(c) for c in cmd), "stdout": proc.stdout, "stderr": proc.stderr, "wall": wall,
            "load_before": load0, "load_after": os.getloadavg()[0], "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _display(c: str) -> str:
    c = c.replace(sys.executable, "python").replace(str(ROOT) + "/", "")
    return f"'{c}'" if any(ch in c for ch in " []{}") else c


# ----------------------------------------------------------------------------- sections


def run_outer_step(args) -> dict:
    cmd = [sys.executable, "benchmarks/outer_step.py", "--sizes", "25M", "--repeats", "5" if args.quick else "11",
           "--staleness", "4"]
    return sh(cmd)


def run_master_round(args) -> dict:
    ns = ["1", "2", "4", "8"] if args.quick else ["1", "2", "4", "8", "16", "32"]
    cmd = [sys.executable, "benchmarks/master_round.py", "--n", *ns, "--repeat", "1" if args.quick else "3"]
    r = sh(cmd)
    rows = []
    for line in r["stdout"].splitlines():
        m = re.match(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s+(\d+)", line)
        if m:
            rows.append({"n": int(m[1]), "best": float(m[2]), "median": float(m[3]), "peak": float(m[4]), "before": float(m[5])})
    r["rows"] = rows
    return r


def run_worker_overhead(args) -> dict:
    cmd = [sys.executable, "benchmarks/worker_overhead.py"]
    if args.quick:
        cmd += ["--steps", "60", "--repeats", "1", "--h", "8"]
    return sh(cmd)


def run_hub_scale(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="perf-hub-scale-") as tmp:
        out = Path(tmp) / "hub_scale.json"
        cmd = [sys.executable, "benchmarks/hub_scale.py", "--json", str(out)]
        if args.quick:
            cmd += ["--workers", "16", "--rounds", "2", "--period", "1"]
        r = sh(cmd, timeout=3600)
        r.update(json.loads(out.read_text()))
    return r


def _shapes_25m() -> dict[str, tuple[int, ...]]:
    d, layers, ffn, vocab = 320, 6, 864, 50304
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            s[p + f"self_attn.{n}.weight"] = (d, d)
        s[p + "mlp.gate_proj.weight"] = (ffn, d)
        s[p + "mlp.up_proj.weight"] = (ffn, d)
        s[p + "mlp.down_proj.weight"] = (d, ffn)
        s[p + "input_layernorm.weight"] = (d,)
        s[p + "post_attention_layernorm.weight"] = (d,)
    s["model.norm.weight"] = (d,)
    return s


def run_bytes_files() -> list[dict]:
    import torch

    from diloco_lightning.encoding.feedback import encode_delta
    from diloco_lightning.wire.delta import model_fingerprint, write_delta
    from diloco_lightning.encoding import EncodingSpec

    shapes = _shapes_25m()
    state = {k: torch.zeros(v) for k, v in shapes.items()}
    fp = model_fingerprint(state)
    numel = sum(t.numel() for t in state.values())
    specs = {"float32": EncodingSpec("float32"), "bfloat16": EncodingSpec("bfloat16"), "float16": EncodingSpec("float16"),
             "int8": EncodingSpec("int8"), "int4": EncodingSpec("int4"),
             "topk1%+int8": EncodingSpec("topk", topk=0.01, topk_values="int8"),
             "topk1%+int4": EncodingSpec("topk", topk=0.01, topk_values="int4"),
             "ctopk1%+int2": EncodingSpec("ctopk", topk=0.01, topk_values="int2"),
             "ctopk1.6%+int2": EncodingSpec("ctopk", chunk_k=64, topk_values="int2"),
             "ctopk3%+int2": EncodingSpec("ctopk", topk=0.03, topk_values="int2")}
    rows = []
    g = torch.Generator().manual_seed(0)
    delta = {k: torch.randn(v, generator=g).mul_(1e-3) for k, v in shapes.items()}
    with tempfile.TemporaryDirectory(prefix="perf-delta-") as tmp:
        for name, spec in specs.items():
            sent, _ = encode_delta(delta, spec, error_feedback=False)
            p = Path(tmp) / f"delta_{name}.safetensors"
            write_delta(p, sent, node_id="w0", local_step=1, base_outer_step=0, num_tokens=4096, model_fingerprint=fp)
            rows.append({"dtype": name, "bytes": p.stat().st_size, "params": numel})
    return rows


def run_compression(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="perf-compression-") as tmp:
        raw = Path(tmp) / "compression.json"
        cmd = [sys.executable, "benchmarks/compression.py", "--repeats", "3" if args.quick else "7", "--json", str(raw)]
        if args.quick:
            cmd += ["--models", "tiny"]
        r = sh(cmd)
        r["command"] = r["command"].replace(f" --json {raw}", "")
        r["figures"] = json.loads(raw.read_text())
    cmd = [sys.executable, "benchmarks/master_round.py", "--n", "8", "--repeat", "2" if args.quick else "5",
           "--encodings", "float32,int8,int4,topk+int4,ctopk+int2"]
    m = sh(cmd)
    r["master_round"] = {k: m[k] for k in ("command", "stdout", "wall", "load_before", "load_after", "when")}
    return r


def run_e2e(args) -> dict:
    out = []
    with tempfile.TemporaryDirectory(prefix="perf-e2e-") as tmp:
        for k in (1, 2, 4):
            cmd = [sys.executable, "train.py", "recipe=tiny", f"workers={k}", f"run_root={tmp}", f"run_id=tiny_w{k}"]
            if args.quick:
                cmd.append("trainer.max_steps=32")
            r = sh(cmd)
            res = json.loads((Path(tmp) / f"tiny_w{k}" / "results.json").read_text())
            fit = max(s["wall_seconds"] for s in res["workers_summary"])
            out.append({"workers": k, "command": r["command"].replace(f" run_root={tmp}", ""), "tokens": res["tokens"], "wall": res["wall_seconds"],
                        "tokens_per_second": res["tokens_per_second"], "fit_seconds": fit,
                        "train_tokens_per_second": res["tokens"] / fit, "eval_loss": res["eval_loss"],
                        "outer_steps": res["outer_steps"], "load_before": r["load_before"], "load_after": r["load_after"],
                        "when": r["when"]})
    return {"runs": out}


# ----------------------------------------------------------------------------- document


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    icpt = my - slope * mx
    ss_res = sum((y - (icpt + slope * x)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return slope, icpt, 1 - ss_res / ss_tot if ss_tot else 1.0


def plot_master(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["n"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.plot(ns, [r["best"] for r in rows], "o-", label="best")
    a.plot(ns, [r["median"] for r in rows], "s--", label="median", alpha=0.7)
    s, i, r2 = fit_line(ns, [r["best"] for r in rows])
    a.plot(ns, [i + s * n for n in ns], ":", color="gray", label=f"fit {i:.2f} + {s * 1e3:.0f} ms x N (R² {r2:.3f})")
    a.set_xlabel("deltas in the round (N)")
    a.set_ylabel("round time (s)")
    a.legend(fontsize=7)
    a.grid(alpha=0.3)
    b.plot(ns, [r["peak"] for r in rows], "o-", color="tab:red", label="peak RSS during the round")
    b.plot(ns, [r["before"] for r in rows], "s--", color="gray", label="RSS before the round")
    b.set_ylim(0, max(r["peak"] for r in rows) * 1.25)
    b.set_xlabel("deltas in the round (N)")
    b.set_ylabel("MB")
    b.legend(fontsize=7)
    b.grid(alpha=0.3)
    fig.suptitle("master round, 25.2M-parameter FP32 deltas, Nesterov, folder hub", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


LOSS_ROWS = {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8+ef", "int4": "int4+ef",
             "topk1%+int4": "topk1%+int4+ef"}


def _loss_launch(loss: dict | None) -> str:
    """The simulator's runs when there are any (deterministic: differences are the encodings'), else real ones."""
    return "sim" if loss and any(r.get("launch") == "sim" for r in loss["runs"]) else "local"


def _loss_cells(loss: dict | None, row: str, tau: int = 0) -> tuple[str, str]:
    """(mean eval loss ± spread over seeds, mean paired difference to float32) or pending."""
    if not loss:
        return "pending", "pending"
    launch = _loss_launch(loss)
    mine = [r for r in loss["runs"] if r.get("launch", "local") == launch and r["tau"] == tau and r["steps"] == 160]
    runs = [r for r in mine if r["row"] == row]
    base = {r["seed"]: r["eval_loss"] for r in mine if r["row"] == "float32"}
    if not runs:
        return "pending", "pending"
    vals = [r["eval_loss"] for r in runs]
    mean = sum(vals) / len(vals)
    spread = max(vals) - min(vals)
    diffs = [r["eval_loss"] - base[r["seed"]] for r in runs if r["seed"] in base]
    d = "-" if row == "float32" or not diffs else f"{sum(diffs) / len(diffs):+.3f}"
    return f"{mean:.3f} (range {spread:.3f}, {len(vals)} seeds)", d


def write_compression(w, d: dict, loss: dict | None) -> None:
    w("## Compression: bytes, speed and loss of each pseudo-gradient encoding")
    w("")
    w("`diloco.delta_dtype` picks the encoding (docs/encoding.md; error feedback on by default for int8, int4, "
      "top-k and the chunked top-k `ctopk`). Bytes: the delta file a worker writes, header included (the `bytes` section measures the same end to "
      "end). Speeds on the 25M model's real pseudo-gradient (10 AdamW steps on Zipf tokens), GB/s of FP32 input on "
      "one core (one torch thread, timed by the thread's CPU time): "
      "*worker* = `ErrorFeedback.encode(in_place=True)`, the uploader's whole step (residual added, encoded, new "
      "residual kept); *master* = `decode_add_` into the round's FP32 sum. Loss: final eval loss of `train.py "
      "recipe=tiny` (2 workers, H = 8, lockstep, tau = 0, CGAD, 160 steps; on the simulator, `launch=sim`, when its "
      "runs exist: the same encodings and error feedback, deterministic, so a difference is the encoding's, not the "
      "machine's), mean over seeds, and the mean paired difference to float32 (same seeds), from "
      "`python benchmarks/compression_loss.py [--launch sim]`.")
    w("")
    rows = {(r["model"], r["encoding"]): r for r in d["figures"]["rows"]}
    w("| encoding | tiny file bytes | vs FP32 | 25M file bytes | vs FP32 | worker GB/s | master GB/s | rel. error | "
      "eval loss | vs float32 |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    for enc in ("float32", "bfloat16", "float16", "int8", "int4", "topk1%+int8", "topk1%+int4", "ctopk1%+int2",
                "ctopk1.6%+int2", "ctopk2%+int2", "ctopk3%+int2", "ctopk1.6%+sign", "ctopk1.6%+int8"):
        t, b = rows.get(("tiny", enc)), rows.get(("llama25m", enc))
        if t is None and b is None:
            continue
        lrow = LOSS_ROWS.get(enc)
        lc = _loss_cells(loss, lrow) if lrow else ("not run", "not run")
        cells = [enc]
        for r in (t, b):
            cells += ["-", "-"] if r is None else [f"{r['bytes']:,}", f"{r['ratio']:.4f}x"]
        r = b or t
        cells += [f"{r['worker_gbs']:.2f}", f"{r['decode_add_gbs']:.2f}", f"{r['rel_err']:.2e}", *lc]
        w("| " + " | ".join(cells) + " |")
    w("")
    if loss:
        w("Loss per encoding, with and without error feedback (`ef`) (the raw tables, "
          f"`python benchmarks/compression_loss.py --table-only`; runs of {loss.get('when', '?')}):")
        w("")
        import importlib.util

        spec = importlib.util.spec_from_file_location("compression_loss", ROOT / "benchmarks" / "compression_loss.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
        for launch in ("sim", "local"):
            runs = [r for r in loss["runs"] if r.get("launch", "local") == launch]
            if not runs:
                continue
            seeds = sorted({r["seed"] for r in runs})
            taus = sorted({r["tau"] for r in runs})
            w(f"`--launch {launch}` ({'the simulator' if launch == 'sim' else 'real processes and a folder hub'}):")
            w("")
            w(_block(mod.table(runs, list(mod.ROWS), taus, seeds, 160, launch)))
            w("")
    else:
        w("The loss column is **pending**: run `python benchmarks/compression_loss.py` (24 runs of `train.py "
          "recipe=tiny`, about 30 min on 2 cores), then `python benchmarks/run_all.py --doc-only`.")
        w("")
    w(f"Command: `{d['command']}` ({d['when']}, load average {d['load_before']:.2f} before, {d['load_after']:.2f} after; "
      "a shared machine: speeds vary by 2-5x between runs). Raw output:")
    w("")
    w(_block(d["stdout"]))
    w("")
    m = d["master_round"]
    w(f"A master round over 8 deltas of 25.2M parameters per encoding (each encoding's files from the same "
      f"pseudo-gradients; folder hub; best of the repeats): `{m['command']}` ({m['when']}, load average "
      f"{m['load_before']:.2f} before, {m['load_after']:.2f} after):")
    w("")
    w(_block(m["stdout"]))
    w("")


def _old_sections(path: Path) -> dict[str, str]:
    """The current document's text of each section (by HEADINGS), to keep what has no cached figures."""
    if not path.is_file():
        return {}
    text = path.read_text()
    parts = re.split(r"(?m)^(?=## )", text)
    out = {}
    for name, head in HEADINGS.items():
        for part in parts:
            if part.startswith(head):
                out[name] = part.rstrip("\n")
    return out


def _block(text: str) -> str:
    return "```\n" + text.strip("\n") + "\n```"


def write_doc(data: dict, out: Path, mach: str) -> None:
    old = _old_sections(out)
    L: list[str] = []
    w = L.append
    w("# Performance")
    w("")
    w("Generated by `python benchmarks/run_all.py` (every figure below names the command that produced it; "
      "the raw outputs are quoted). The staleness study is in [study.md](study.md) and [study_results.md](study_results.md).")
    w("")
    w(f"Machine (all sections): {mach}. A shared machine: other jobs ran at times, so each section gives the "
      "load average (1 min) before and after it; where a benchmark reports best and median, the best is the cost "
      "and the median shows the noise.")
    w("")

    if "bytes" not in data and "bytes" in old:
        w(old["bytes"])
        w("")
    if "bytes" in data:
        d = data["bytes"]
        w("## Bytes sent per worker per round, by encoding")
        w("")
        w("One worker sends one delta file per round (H inner steps). End to end (`train.py recipe=tiny`, 2 workers, "
          "H = 8; the tiny model with its 4096-token BPE), `bytes_sent / deltas` from `results.json` (the delta files' "
          "sizes, headers included; error feedback at its default, on for int8, int4 and top-k):")
        w("")
        w("| encoding | bytes per worker per round | vs FP32 | target | command |")
        w("|---|---|---|---|---|")
        base = next((r["per_delta"] for r in d["e2e"] if r["dtype"] == "float32"), None)
        for r in d["e2e"]:
            rel = "1 (reference)" if r["dtype"] == "float32" else f"{r['per_delta'] / base:.4f}x ({base / r['per_delta']:.1f}x smaller)"
            t = BYTES_TARGETS.get(r["dtype"])
            verdict = "" if t is None else f"<= {t}x: {'met' if r['per_delta'] / base <= t else 'MISSED'}"
            w(f"| {r['dtype']} | {r['per_delta']:,.0f} | {rel} | {verdict} | `{r['command']}` |")
        w("")
        w("The 25M-parameter geometry (d_model 320, 6 layers, FFN 864, vocabulary 50,304, tied embeddings), one delta "
          "file written as a worker writes it (`compression.encode_delta` + `deltafile.write_delta`: safetensors, 8-byte "
          "length, JSON header with the delta metadata and the encoding, the encoded parts):")
        w("")
        w("| encoding | parameters | file bytes | bytes / parameter | vs FP32 | target |")
        w("|---|---|---|---|---|---|")
        fbase = next(r["bytes"] for r in d["files"] if r["dtype"] == "float32")
        for r in d["files"]:
            rel = "1 (reference)" if r["dtype"] == "float32" else f"{r['bytes'] / fbase:.4f}x ({fbase / r['bytes']:.1f}x smaller)"
            t = BYTES_TARGETS.get(r["dtype"])
            verdict = "" if t is None else f"<= {t}x: {'met' if r['bytes'] / fbase <= t else 'MISSED'}"
            w(f"| {r['dtype']} | {r['params']:,} | {r['bytes']:,} | {r['bytes'] / r['params']:.4f} | {rel} | {verdict} |")
        w("")
        w(f"Command: `python benchmarks/run_all.py --only bytes` ({d.get('when', '?')}). Per round the whole run sends "
          "workers x this figure. The layout of each encoding is in docs/spec.md (\"Encoded deltas\") and "
          "docs/encoding.md.")
        w("")

    if "compression" in data:
        write_compression(w, data["compression"], data.get("compression_loss"))
    elif "compression" in old:
        w(old["compression"])
        w("")

    if "master_round" not in data and "master_round" in old:
        w(old["master_round"])
        w("")
    if "master_round" in data:
        d = data["master_round"]
        rows = d["rows"]
        w("## Master round: time and peak memory against the number of deltas")
        w("")
        w(f"Command: `{d['command']}` ({d['when']}, {d['wall']:.0f} s; load average {d['load_before']:.2f} before, "
          f"{d['load_after']:.2f} after).")
        w("")
        if rows:
            ns = [r["n"] for r in rows]
            s, i, r2 = fit_line(ns, [r["best"] for r in rows])
            peaks = [r["peak"] for r in rows]
            w("| N deltas | best s | median s | s per delta (best / N) | peak RSS MB | RSS before MB |")
            w("|---|---|---|---|---|---|")
            for r in rows:
                w(f"| {r['n']} | {r['best']:.3f} | {r['median']:.3f} | {r['best'] / r['n']:.3f} | {r['peak']:.0f} | {r['before']:.0f} |")
            w("")
            w(f"Time is linear in N: least squares through the best times gives {i:.3f} s + {s * 1e3:.1f} ms x N "
              f"(R² = {r2:.3f}): a fixed cost (outer step, publication, SHA-256, local save) plus one read-and-accumulate "
              f"per delta. Memory is flat in N: the peak RSS spans {min(peaks):.0f}–{max(peaks):.0f} MB "
              f"({max(peaks) - min(peaks):.0f} MB spread from 1 to {max(ns)} deltas), because deltas are streamed into "
              "one accumulator rather than held together.")
            w("")
            w("![master round](figures/master_round.png)")
            w("")
        w("Raw output:")
        w("")
        w(_block(d["stdout"]))
        w("")

    for name in ("outer_step", "worker_overhead", "e2e"):
        if name not in data and name in old:
            w(old[name])
            w("")
    if "outer_step" in data:
        d = data["outer_step"]
        w("## Outer step")
        w("")
        w(f"Command: `{d['command']}` ({d['when']}, load average {d['load_before']:.2f} before, {d['load_after']:.2f} after).")
        w("")
        w(_block(d["stdout"]))
        w("")

    if "worker_overhead" in data:
        d = data["worker_overhead"]
        w("## Worker overhead (the DiLoCo callback in a training loop)")
        w("")
        w(f"Command: `{d['command']}` ({d['when']}, {d['wall']:.0f} s; load average {d['load_before']:.2f} before, "
          f"{d['load_after']:.2f} after).")
        w("")
        w(_block(d["stdout"]))
        w("")

    if "e2e" in data:
        d = data["e2e"]
        w("## End to end: `recipe=tiny` tokens per second with 1, 2 and 4 workers")
        w("")
        w("`python train.py recipe=tiny workers=K` (master thread + K worker processes, folder hub, 160 inner steps of "
          "batch 8 x 128 tokens per worker, H = 8, lockstep, CGAD; each worker gets max(1, cores / K) torch threads). "
          "*tokens/s (wall)*: all workers' training tokens over the whole run's wall clock, as `results.json` reports it "
          "(process start-up, data preparation, bootstrap and the final evaluation included); *training tokens/s*: over "
          "the slowest worker's `Trainer.fit` time.")
        w("")
        w("| workers | tokens | wall s | tokens/s (wall) | fit s (slowest worker) | training tokens/s | outer steps | eval loss | load before / after | command |")
        w("|---|---|---|---|---|---|---|---|---|---|")
        for r in d["runs"]:
            w(f"| {r['workers']} | {r['tokens']:,} | {r['wall']:.1f} | {r['tokens_per_second']:,.0f} | {r['fit_seconds']:.1f} | "
              f"{r['train_tokens_per_second']:,.0f} | {r['outer_steps']} | {r['eval_loss']:.3f} | "
              f"{r['load_before']:.2f} / {r['load_after']:.2f} | `{r['command']}` |")
        w("")
        by = {r["workers"]: r for r in d["runs"]}
        if all(k in by for k in (1, 2, 4)):
            g12 = by[2]["tokens_per_second"] / by[1]["tokens_per_second"] - 1
            g24 = by[4]["tokens_per_second"] / by[2]["tokens_per_second"] - 1
            w(f"From 1 to 2 workers the wall-clock rate changes by {g12:+.0%} (two single-threaded processes use the 2 "
              f"cores better than one process with 2 threads); from 2 to 4 by {g24:+.0%}: with more workers than cores "
              "they share the same cores, so more workers bring more tokens per round, not more tokens per second. "
              "DiLoCo's gain is across machines, which one machine cannot show.")
        w("")
    if "hub_scale" in data:
        from hub_scale import render_markdown

        d = data["hub_scale"]
        w(render_markdown(d["results"], d["command"], d["when"], tuple(d["load"])))
    elif "hub_scale" in old:
        w(old["hub_scale"])
    out.write_text("\n".join(L))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(SECTIONS)} (others from the cache)")
    ap.add_argument("--quick", action="store_true", help="shortened settings (smoke test)")
    ap.add_argument("--doc-only", action="store_true", help="run nothing: rewrite the document from the cache")
    ap.add_argument("--cache", default=str(ROOT / "runs" / "perf"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "performance.md"))
    args = ap.parse_args(argv)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    todo = [] if args.doc_only else (args.only.split(",") if args.only else list(SECTIONS))
    data = {}
    for name in SECTIONS:
        p = cache / f"{name}.json"
        if name in todo:
            print(f"== {name} ...", flush=True)
            t0 = time.perf_counter()
            if name == "bytes":
                d = run_bytes_files_and_e2e(args)
            else:
                d = globals()[f"run_{name}"](args)
            print(f"   {time.perf_counter() - t0:.0f} s", flush=True)
            p.write_text(json.dumps(d, indent=1))
        if p.is_file():
            data[name] = json.loads(p.read_text())
    loss = cache / "compression_loss.json"  # benchmarks/compression_loss.py's runs (the loss column)
    if loss.is_file():
        data["compression_loss"] = json.loads(loss.read_text())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if "master_round" in data and data["master_round"].get("rows"):
        (out.parent / "figures").mkdir(exist_ok=True)
        plot_master(data["master_round"]["rows"], out.parent / "figures" / "master_round.png")
    write_doc(data, out, machine())
    print(f"wrote {out}")
    return 0


def run_bytes_files_and_e2e(args) -> dict:
    d = run_bytes_e2e(args)
    d["files"] = run_bytes_files()
    return d


def run_bytes_e2e(args) -> dict:
    out: dict = {"e2e": [], "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    steps = 16 if args.quick else 32
    with tempfile.TemporaryDirectory(prefix="perf-bytes-") as tmp:
        for dt, overrides in BYTES_ENCODINGS.items():
            cmd = [sys.executable, "train.py", "recipe=tiny", *overrides, f"trainer.max_steps={steps}",
                   f"run_root={tmp}", f"run_id=bytes_{dt.replace('%', '').replace('+', '_')}"]
            r = sh(cmd)
            res = json.loads((Path(tmp) / f"bytes_{dt.replace('%', '').replace('+', '_')}" / "results.json").read_text())
            deltas = sum(s["deltas_sent"] for s in res["workers_summary"])
            cmd_txt = r["command"].replace(f"run_root={tmp} ", "").replace(f" run_root={tmp}", "")
            out["e2e"].append({"dtype": dt, "command": cmd_txt, "bytes_sent": res["bytes_sent"], "deltas": deltas,
                               "per_delta": res["bytes_sent"] / max(1, deltas), "workers": res["workers"],
                               "rounds": res["outer_steps"], "eval_loss": res["eval_loss"],
                               "rejected": res["deltas_rejected"]})
    return out


if __name__ == "__main__":
    sys.exit(main())
