"""Training throughput with and without the DiLoCo callback (worker overhead).

Trains the same small causal transformer with an unmodified Lightning ``Trainer``, once
without the callback and once with ``DiLoCo(sync="async")`` at each ``inner_steps`` (H) on a
folder hub, and prints steps/s and the slowdown. A real master (``MasterOuterLoop``) runs on
the hub (``--master process``, the default: a separate process, as it would be on another
machine; ``thread``: a thread of the training process; ``none``: only outer step 0 is
published, so no install ever happens),
so the measured worker cost includes exports, background uploads, prefetching and installs.

Runs are interleaved (baseline, H=8, H=50, baseline, ...) and the median of ``--repeats`` is
reported, so background load on the machine affects every variant alike. Throughput is timed
from the end of a warm-up (``--warmup`` steps) to the last step, on the training thread,
*including* the time boundaries take there (the timer runs after the callback). The CPU
time of the training process (all its threads: the uploader's and prefetcher's work included,
not the master's when it runs in its own process) is reported per step too: on a machine
shared with other jobs it is a steadier measure of the worker's cost than wall time.

    python benchmarks/worker_overhead.py                  # H = 8 and 50, 200 steps, 3 repeats
    python benchmarks/worker_overhead.py --steps 800 --h 8 50 200 --master process
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Tokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i]}


def build_module(args):
    import lightning as L

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(args.vocab, args.d_model)
            layer = nn.TransformerEncoderLayer(
                args.d_model, nhead=4, dim_feedforward=4 * args.d_model, dropout=0.0, batch_first=True, norm_first=True
            )
            self.enc = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(args.d_model)
            self.head = nn.Linear(args.d_model, args.vocab, bias=False)
            self.head.weight = self.emb.weight

        def training_step(self, batch, batch_idx):
            ids = batch["input_ids"]
            x, y = ids[:, :-1], ids[:, 1:]
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            h = self.norm(self.enc(self.emb(x), mask=mask, is_causal=True))
            return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self):
            return DataLoader(Tokens(args.batch * 64, args.seq, args.vocab), batch_size=args.batch, shuffle=True)

    return LM()


def _master_process(root: str, workdir: str, ready, stop) -> None:
    from diloco_lightning.master import MasterOuterLoop

    torch.set_num_threads(1)
    m = MasterOuterLoop(root, None, node_state_dir=workdir, poll_interval=0.2)
    m.start()
    ready.set()
    stop.wait()
    m.stop()


def run_once(args, h: int | None, workdir: Path) -> dict:
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from diloco_lightning import DiLoCo

    class Timer(Callback):
        def __init__(self):
            self.start = self.end = None
            self.n = 0

        @staticmethod
        def now():
            return time.perf_counter(), time.process_time(), time.thread_time()

        def on_train_batch_end(self, trainer, *a):
            if trainer.global_step == args.warmup:
                self.start = self.now()
            elif trainer.global_step > args.warmup:
                self.end = self.now()
                self.n = trainer.global_step - args.warmup

    L.seed_everything(0, verbose=False)
    module = build_module(args)
    nparams = sum(p.numel() for p in module.parameters())
    timer = Timer()
    callbacks = [timer]
    master = stop = proc = None
    cb = None
    if h is not None:
        root = workdir / f"hub_h{h}_{time.monotonic_ns()}"
        cb = DiLoCo(hub=str(root), node_id="w0", inner_steps=h, poll_interval=args.poll_interval)
        callbacks = [cb, timer]
        if args.master == "thread":
            from diloco_lightning.hub.local import FileHub
            from diloco_lightning.master import MasterOuterLoop

            master = MasterOuterLoop(FileHub(root), module_state_for(module), node_state_dir=root.with_suffix(".m"),
                                     poll_interval=0.2)
            master.start()
        elif args.master == "process":
            ctx = mp.get_context("spawn")
            stop, ready = ctx.Event(), ctx.Event()
            proc = ctx.Process(target=_master_process, args=(str(root), str(root.with_suffix(".m")), ready, stop),
                               daemon=True)
            proc.start()
            deadline = time.monotonic() + 180
            while not ready.wait(0.5):
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"the master process did not start (exit code {proc.exitcode})")
        else:  # publish outer step 0 by hand: the worker exports and uploads but never installs
            from diloco_lightning.hub.versions import stage_global
            from diloco_lightning.hub.local import FileHub

            hub = FileHub(root)
            staged = stage_global(root.with_suffix(".m"), 0, module_state_for(module))
            hub.publish(staged.manifest(), staged.files, expected_outer_step=None)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    trainer.fit(module)
    if master is not None:
        master.stop()
    if proc is not None:
        stop.set()
        proc.join(30)
    wall, proc_cpu, thread_cpu = (b - a for a, b in zip(timer.start, timer.end))
    out = {
        "h": h,
        "steps_per_s": timer.n / wall,
        "thread_ms": 1000 * thread_cpu / timer.n,  # the training thread's CPU (boundaries included)
        "bg_ms": 1000 * (proc_cpu - thread_cpu) / timer.n,  # every other thread: uploader, prefetcher, ...
        "params": nparams,
    }
    if cb is not None:
        out.update(
            installs=int(cb.metrics.get("installs_total", 0)),
            deltas=int(cb.metrics.get("deltas_uploaded_total", 0)),
            mb=cb.metrics.get("bytes_uploaded_total", 0) / 1e6,
            # training-thread time inside boundaries (export, hand-over, install), per boundary
            boundary_ms=1000 * cb.metrics.get("boundary_seconds_total", 0.0) / max(1, cb.metrics.get("boundaries_total", 0)),
        )
        out["boundary_share"] = out["boundary_ms"] / h / (1000 / out["steps_per_s"])
    return out


def module_state_for(module):
    from diloco_lightning.worker import module_state

    return {k: v.detach().clone() for k, v in module_state(module).items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--h", type=int, nargs="+", default=[8, 50], help="inner_steps values (default 8 50)")
    ap.add_argument("--steps", type=int, default=300, help="timed optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--master", choices=["process", "thread", "none"], default="process")
    ap.add_argument("--poll-interval", type=float, default=1.0)
    ap.add_argument("--d-model", type=int, default=192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    variants: list[int | None] = [None] + list(args.h)
    results: dict[int | None, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as tmp:
        for rep in range(args.repeats):
            for v in variants:
                r = run_once(args, v, Path(tmp))
                results[v].append(r)
                print(f"  repeat {rep + 1}/{args.repeats}  {'baseline' if v is None else f'H={v}':>9}: "
                      f"{r['steps_per_s']:.3f} steps/s, training thread {r['thread_ms']:.1f} CPU ms/step, "
                      f"other threads {r['bg_ms']:.1f}", file=sys.stderr, flush=True)
    med = lambda v, key: statistics.median(r[key] for r in results[v])
    best = lambda v: max(r["steps_per_s"] for r in results[v])
    params = results[None][0]["params"]
    print(f"model: {params / 1e6:.2f}M parameters (transformer d={args.d_model}, {args.layers} layers, seq {args.seq}, "
          f"batch {args.batch}); torch threads {torch.get_num_threads()}; master: {args.master}; "
          f"{args.steps} timed steps; {args.repeats} interleaved runs per variant")
    print(f"{'variant':>10} {'steps/s':>8} {'slowdown':>9} {'best':>8} {'slowdown':>9} {'train-thread':>13} "
          f"{'extra':>7} {'other':>7} {'boundary':>9} {'share':>6} {'deltas':>7} {'installs':>9} {'MB sent':>8}")
    print(f"{'':>10} {'median':>8} {'':>9} {'steps/s':>8} {'(best)':>9} {'CPU ms/step':>13} {'':>7} "
          f"{'CPU ms':>7} {'ms':>9}")
    def pct(x: float) -> str:
        return f"{100 * x:+.2f}%"

    for v in variants:
        rs = results[v]
        name = "baseline" if v is None else f"H={v}"
        sps, top, cpu = med(v, "steps_per_s"), best(v), med(v, "thread_ms")
        slow = "" if v is None else pct(1 - sps / med(None, "steps_per_s"))
        slow_best = "" if v is None else pct(1 - top / best(None))
        extra = "" if v is None else pct(cpu / med(None, "thread_ms") - 1)
        row = f"{name:>10} {sps:>8.3f} {slow:>9} {top:>8.3f} {slow_best:>9} {cpu:>13.1f} {extra:>7} {med(v, 'bg_ms'):>7.1f}"
        if v is not None:
            row += (f" {med(v, 'boundary_ms'):>9.1f} {pct(med(v, 'boundary_share')):>6} {rs[-1]['deltas']:>7}"
                    f" {rs[-1]['installs']:>9} {rs[-1]['mb']:>8.1f}")
        print(row)
    print("slowdown: 1 - steps/s with the callback / without (median, and best run against best run); "
          "train-thread CPU: the training thread's CPU time per step (exports and installs included), "
          "extra: against the baseline; other: CPU of the process's other threads per step (uploads, prefetch); "
          "boundary: training-thread time per boundary (export, hand-over, install), share: that time over the "
          "H steps' time")

if __name__ == "__main__":
    main()
