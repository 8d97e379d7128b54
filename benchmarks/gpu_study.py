"""The outer state's precision at 25 M parameters on one GPU (``benchmarks/gpu_study.sh``): the
paper's 7B mechanism, as the CPU study's precision block (docs/study.md) tests it, at a larger scale.

Adam-Decay and CGAD with the naive outer state (m and v as the buffers the gated delta enters) in
bf16 and in 8-bit blockwise, beta2 = 0.999, under a heavy-tailed delay law past tau_cut (P(tau > 32)
= 10 %, drawn per delta), one delta per outer step, 1008 outer steps, 5 seeds: 20 runs of the
simulator (``launch=sim``), seed by seed (so a run cut short leaves every configuration with the
same seeds), each writing ``<outdir>/runs/<id>/results.json`` when it ends; ``<outdir>/summary.md``
(the CPU study's precision table: final losses, v at the quantisation floor and stuck, loss
spikes against stale arrivals) is rewritten after every run. Runs already done are skipped (an
interrupted study resumes), and no run starts after ``--minutes`` (default 7.5).

    bash benchmarks/gpu_study.sh /path/to/outdir          # the 25 M version (CUDA, bf16 autocast)
    bash benchmarks/gpu_study.sh --cpu /path/to/outdir    # the same plan, reduced to seconds, on the CPU

The 25 M model is the ``llama25m`` geometry (d_model 320, 6 layers, 5 heads, SwiGLU 864, vocabulary
50,304, tied embeddings: 23.5 M parameters) reading UTF-8 bytes of the Python standard library (no
tokenizer to train), sequences of 256, batch 16 per worker, 4 workers, H = 2, 504 inner AdamW steps
each, ``trainer.precision=bf16-mixed``; the global model is evaluated every 8 outer steps. Not run
here: no GPU was lent to this work, so its time is an estimate (about 20 s a run on an H200).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = ("adam_decay", "cgad")
STATES = ("naive-bf16", "naive-int8")
BETA2 = 0.999
SEEDS = (0, 1, 2, 3, 4)
LR = 0.002

GPU = ["recipe=tiny", "launch=sim", "model=llama25m", "data.tokenizer=byte", "data.max_bytes=8000000", "data.seq_len=256",
       "data.batch_size=16", "data.val_batches=4", "workers=4", "diloco.inner_steps=2", "trainer.max_steps=504",
       "trainer.accelerator=gpu", "trainer.precision=bf16-mixed", "optim.lr=0.002", "optim.warmup_steps=40",
       "launch.eval_points=126", "trainer.log_every_n_steps=8"]
#: the same plan on the CPU, reduced to seconds per run (what the test runs)
CPU = ["recipe=tiny", "launch=sim", "data.tokenizer=byte", "data.max_bytes=200000", "data.seq_len=32", "data.batch_size=4",
       "data.val_batches=2", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1",
       "model.ffn_hidden=64", "workers=2", "diloco.inner_steps=2", "trainer.max_steps=24", "optim.lr=0.004",
       "launch.eval_points=12"]


def jobs(cpu: bool) -> list[dict]:
    from study import job, lr_of

    seeds = SEEDS[:1] if cpu else SEEDS
    k = 0
    assert lr_of("adam", k) == LR
    out = []
    for seed in seeds:
        for m in METHODS:
            for st in STATES:
                extra = (f"outer.options.betas=[0.9,{BETA2}]",
                         "outer.options.state_layout=naive", f"outer.state_dtype={st.split('-')[1]}")
                j = job("heavy", m, k, seed, extra, block="gpu")
                j.update(id="gpu-" + j["id"], state=st, beta2=BETA2)
                out.append(j)
    return out


def summary(outdir: Path, js: list[dict]) -> str:
    from study_report import precision_pairs, precision_rows

    groups: dict[tuple, list[dict]] = {}
    for j in js:
        try:
            r = json.loads((outdir / "runs" / j["id"] / "results.json").read_text())
        except (OSError, ValueError):
            continue
        groups.setdefault((j["method"], j["state"], j["beta2"]), []).append(r)
    return "\n".join(precision_rows(groups) + ["", *precision_pairs(groups)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--cpu", action="store_true", help="the reduced CPU version (a smoke test of the script)")
    ap.add_argument("--minutes", type=float, default=7.5, help="start no run after this many minutes")
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
        if time.time() - t0 > a.minutes * 60:
            print(f"[{time.time() - t0:6.0f}s] --minutes={a.minutes:g} reached: {len(js) - i} runs not started", flush=True)
            break
        rec = run_job((j, common, str(outdir)))
        with open(outdir / "log.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        state = f"FAILED: {rec['error'][:300]}" if rec.get("error") else \
            f"eval {rec['eval_loss']:.3f}{' DIVERGED' if rec['diverged'] else ''} ({rec['wall']:.0f} s)"
        print(f"[{time.time() - t0:6.0f}s] {i + 1}/{len(js)} {j['method']} {j['state']} seed={j['seed']}: {state}",
              flush=True)
        (outdir / "summary.md").write_text(summary(outdir, js))
    (outdir / "summary.md").write_text(summary(outdir, js))
    print(f"done in {(time.time() - t0) / 60:.1f} min: {outdir / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
