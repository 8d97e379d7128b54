"""The key staleness comparisons at 25 M parameters on one GPU (``benchmarks/gpu_study.sh``).

One delta per outer step (``master.aggregation=arrival``), fixed delay tau in {0, 4, 16} arrivals,
outer optimizers {nesterov, adam, adam_decay, cgad}, 2 seeds: 24 runs of the simulator
(``launch=sim``), one after the other in this process, each writing ``<outdir>/runs/<id>/results.json``
when it ends; ``<outdir>/summary.md`` is rewritten after every run. Runs already done are skipped
(an interrupted study resumes).

    bash benchmarks/gpu_study.sh /path/to/outdir          # the 25 M version (CUDA, bf16 autocast)
    bash benchmarks/gpu_study.sh --cpu /path/to/outdir    # the same grid, reduced, on the CPU (a smoke test)

The 25 M model is the ``llama25m`` geometry (d_model 320, 6 layers, 5 heads, SwiGLU 864, vocabulary
50,304, tied embeddings: 23.5 M parameters) reading UTF-8 bytes of the Python standard library (no
tokenizer to train: the rows past 257 are never a target), sequences of 256, batch 16 per worker,
4 workers, H = 8, 200 inner AdamW steps each (100 deltas), ``trainer.precision=bf16-mixed``. The
outer lrs are the CPU study's tuned values at tau = 0 (docs/study.md), not tuned again here.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = ("nesterov", "adam", "adam_decay", "cgad")
TAUS = (0, 4, 16)
SEEDS = (0, 1)
#: outer lrs: the CPU study's choice at tau = 0 (docs/study.md, "Tuning")
LRS = {"nesterov": 0.1, "adam": 0.003, "adam_decay": 0.003, "cgad": 0.003}

GPU = ["recipe=tiny", "launch=sim", "model=llama25m", "data.tokenizer=byte", "data.max_bytes=8000000", "data.seq_len=256",
       "data.batch_size=16", "data.val_batches=16", "workers=4", "diloco.inner_steps=8", "trainer.max_steps=200",
       "trainer.accelerator=gpu", "trainer.precision=bf16-mixed", "optim.lr=0.002", "optim.warmup_steps=20",
       "launch.eval_points=2", "trainer.log_every_n_steps=8", "master.aggregation=arrival"]
#: the same grid on the CPU, reduced to seconds per run (what the test runs)
CPU = ["recipe=tiny", "launch=sim", "data.tokenizer=byte", "data.max_bytes=200000", "data.seq_len=32", "data.batch_size=4",
       "data.val_batches=2", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
       "model.ffn_hidden=64", "workers=2", "diloco.inner_steps=4", "trainer.max_steps=8", "optim.lr=0.004",
       "launch.eval_points=1", "master.aggregation=arrival"]


def jobs(cpu: bool) -> list[dict]:
    from study import job

    taus, seeds = ((0, 4), (0,)) if cpu else (TAUS, SEEDS)
    out = []
    for tau in taus:
        for m in METHODS:
            for s in seeds:
                j = job("gpu", m, LRS[m], f"arr{tau}", s)
                j["id"] = j["id"].replace("-fp32-", "-")
                out.append(j)
    return out


def summary(outdir: Path, js: list[dict]) -> str:
    """The results so far as a markdown table (one row per tau and method)."""
    rows = ["| tau | method | lr | eval loss per seed | mean | diverged | s/run |", "|---|---|---|---|---|---|---|"]
    for tau in sorted({int(j["setting"][3:]) for j in js}):
        for m in METHODS:
            res = []
            for j in js:
                if j["setting"] == f"arr{tau}" and j["method"] == m:
                    try:
                        res.append(json.loads((outdir / "runs" / j["id"] / "results.json").read_text()))
                    except (OSError, ValueError):
                        pass
            if not res:
                rows.append(f"| {tau} | {m} | {LRS[m]:g} | — | — | — | — |")
                continue
            losses = [r["eval_loss"] for r in res]
            fin = [x for x in losses if math.isfinite(x)]
            mean = f"{statistics.mean(fin):.3f}" if fin else "—"
            rows.append(f"| {tau} | {m} | {LRS[m]:g} | {', '.join(f'{x:.3f}' for x in losses)} | {mean} | "
                        f"{sum(bool(r['diverged']) for r in res)}/{len(res)} | "
                        f"{statistics.mean(r['wall_seconds'] for r in res):.0f} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--cpu", action="store_true", help="the reduced CPU version (a smoke test of the script)")
    a = ap.parse_args(argv)
    from study import _prepare_data, run_job

    outdir = Path(a.outdir).resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    common = CPU if a.cpu else GPU
    if not a.cpu:
        import torch

        if not torch.cuda.is_available():
            print("gpu_study: torch sees no CUDA device; use --cpu for the reduced CPU version", file=sys.stderr)
            return 2
    js = jobs(a.cpu)
    t0 = time.time()
    _prepare_data(common)
    for i, j in enumerate(js):
        if (outdir / "runs" / j["id"] / "results.json").is_file():
            continue
        rec = run_job((j, common, str(outdir)))
        with open(outdir / "log.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        if rec.get("error"):
            state = f"FAILED: {rec['error'][:300]}"
        else:
            state = f"eval {rec['eval_loss']:.3f}{' DIVERGED' if rec['diverged'] else ''}"
        print(f"[{time.time() - t0:6.0f}s] {i + 1}/{len(js)} {j['method']} tau={j['setting'][3:]} seed={j['seed']}: {state}",
              flush=True)
        (outdir / "summary.md").write_text(summary(outdir, js))
    (outdir / "summary.md").write_text(summary(outdir, js))
    print(f"done in {(time.time() - t0) / 60:.1f} min: {outdir / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
