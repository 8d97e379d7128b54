"""The plugin on modules it was never written for: does DiLoCo's global model end at least as
good as one worker alone with the same steps per worker?

Two foreign LightningModules, as a user has them:

* ``demo``: Lightning's own demo ``Transformer`` (``lightning.pytorch.demos``; its
  ``LightningTransformer`` with its own SGD lr 0.1), on byte tokens (vocabulary 256);
* ``gpt2``: a tiny random-init GPT-2 from ``transformers`` (built from a ``GPT2Config`` here,
  never downloaded; AdamW lr 1e-3), on the same bytes.

Data: the Python standard library's own sources as bytes (nothing downloaded), 5 % held out.
Each run: ``single`` (one plain Trainer, ``--steps`` steps) or a DiLoCo configuration: a real
``diloco-master`` process on a folder hub and 2 worker processes, each a plain Trainer with the
``DiLoCo`` callback (``sync=async``, H = ``--inner-steps``) running the same script and the same
``seed_everything`` (what a user does), ``--steps`` steps each. The score is the held-out loss
of the final model (the single worker's, or the master's last global), on the same batches. The
comparison is at equal steps per worker: the two DiLoCo workers together see twice the tokens of
the single worker. Two more references, each one plain Trainer: ``single_tokens`` (one worker,
twice the steps: equal tokens) and ``dp`` (one worker, twice the batch, the same steps: what
data-parallel training on the two machines would give, at the module's own lr). The report gives
each DiLoCo configuration's share of data-parallel's gain over one worker,
``G = (L_single - L) / (L_single - L_dp)`` per seed.

    python benchmarks/foreign_modules.py                          # every model, config, seed 0,1,2
    python benchmarks/foreign_modules.py --models gpt2 --configs single,default --seeds 0
    python benchmarks/foreign_modules.py --report                 # the table from the saved results

Results are appended, one run at a time, to ``runs/perf/foreign_modules.json`` (resumable: a
run already there is skipped). Configurations (``--configs``): see :data:`CONFIGS`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "perf" / "foreign_modules.json"
SEQ = 64
BATCH = 16

#: name -> (diloco-master overrides, callback keywords); "single" is one worker without DiLoCo
CONFIGS: dict[str, tuple[list[str], dict]] = {
    # what the README and DiLoCo's paper suggest, with both nodes on identical batches (the script's seed)
    "cgad_0.003_q1_sameseed": (["outer=cgad", "outer.lr=0.003", "min_deltas=1"], {"seed_per_node": False}),
    "nesterov_0.7_q1_sameseed": (["outer=nesterov", "outer.lr=0.7", "min_deltas=1"], {"seed_per_node": False}),
    "nesterov_0.7_q2_sameseed": (["outer=nesterov", "outer.lr=0.7", "min_deltas=2"], {"seed_per_node": False}),
    # the same with each node on its own data (the callback's default)
    "cgad_0.003_q1": (["outer=cgad", "outer.lr=0.003", "min_deltas=1"], {}),
    "nesterov_0.7_q1": (["outer=nesterov", "outer.lr=0.7", "min_deltas=1"], {}),
    "nesterov_0.7_q2": (["outer=nesterov", "outer.lr=0.7", "min_deltas=2"], {"rebase": False}),
    # the same rebasing with the fallback scale (a master with momentum publishes no delta_scales)
    "rebase_nesterov_0.7_q2": (["outer=nesterov", "outer.lr=0.7", "min_deltas=2"], {"rebase": True}),
    # outer SGD without momentum (FedAvg at lr 1): the audit's robust baseline
    "sgd_1.0_q1": (["outer=nesterov", "outer.lr=1.0", "outer.options.momentum=0.0", "min_deltas=1"], {}),
    "sgd_1.0_q2": (["outer=nesterov", "outer.lr=1.0", "outer.options.momentum=0.0", "min_deltas=2"],
                   {"rebase": False}),
    # the same async workers rebasing onto their own deltas (worker/rebase.py)
    "rebase_sgd_1.0_q2": (["outer=nesterov", "outer.lr=1.0", "outer.options.momentum=0.0", "min_deltas=2"],
                          {"rebase": True}),
    # outer lr above 1 with the whole quorum: the mean of K deltas is shorter than one worker's move
    "sgd_1.5_q2": (["outer=nesterov", "outer.lr=1.5", "outer.options.momentum=0.0", "min_deltas=2"], {}),
    "sgd_2.0_q2": (["outer=nesterov", "outer.lr=2.0", "outer.options.momentum=0.0", "min_deltas=2"], {}),
    "sgd_0.7_q2": (["outer=nesterov", "outer.lr=0.7", "outer.options.momentum=0.0", "min_deltas=2"], {}),
    # synchronous DiLoCo: each worker installs version r at boundary r (waits for it): no staleness
    "lockstep_sgd_1.0_q2": (["outer=nesterov", "outer.lr=1.0", "outer.options.momentum=0.0", "min_deltas=2"],
                            {"sync": "lockstep"}),
    # lr 1/K: a quorum of one applies each of the K workers' deltas whole, so lr 1 moves K times as far
    "sgd_0.5_q1": (["outer=nesterov", "outer.lr=0.5", "outer.options.momentum=0.0", "min_deltas=1"], {}),
    # the staleness study's pick for quorum 1 (docs/study.md): each delta its own outer step, lr 0.5 / (1 + tau)
    "staleness_sgd_0.5_arrival": (["outer=staleness_sgd", "outer.lr=0.5", "outer.options.momentum=0.0",
                                   "aggregation=arrival", "min_deltas=1"], {}),
    # diloco-master with no outer options at all: whatever its defaults are
    "default": ([], {}),
    # fedavg with its staleness gate (a delta tau versions old counted 1 / (1 + tau)), the look-ahead start off and on
    "fedavg_gate": (["outer.options.power=1.0"], {}),
    "fedavg_gate_la": (["outer.options.power=1.0"], {"lookahead": True}),
    # the defaults with the look-ahead start (the plain mean: the simulator's plugin_mean_la gained 0.135 nats)
    "default_la": ([], {"lookahead": True}),
}


# ----------------------------------------------------------------------------- data and modules


def byte_tokens(max_bytes: int = 2_000_000):
    import torch

    from diloco_lightning.data.corpus import iter_texts, stdlib_corpus

    data = "".join(iter_texts(stdlib_corpus(max_bytes))).encode("utf-8", "replace")[:max_bytes]
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(t) * 0.95)
    return t[:cut], t[cut:]


class Windows:
    """Non-overlapping windows of ``SEQ + 1`` tokens: ``(inputs, targets)``."""

    def __init__(self, tokens) -> None:
        self.tokens, self.n = tokens, (len(tokens) - 1) // SEQ

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        w = self.tokens[i * SEQ: i * SEQ + SEQ + 1]
        return w[:-1], w[1:]


def build_module(name: str):
    import lightning as L
    import torch

    if name == "demo":
        from lightning.pytorch.demos import LightningTransformer

        class Demo(LightningTransformer):  # the user's module, with the user's data (no download)
            def prepare_data(self) -> None:
                pass

        return Demo(vocab_size=256)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        class GPT2(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=96, n_layer=2,
                                                        n_head=4, bos_token_id=0, eos_token_id=0))

            def forward(self, inputs, target):
                logits = self.model(input_ids=inputs).logits
                return torch.nn.functional.log_softmax(logits, -1).reshape(-1, logits.shape[-1])

            def training_step(self, batch, batch_idx):
                inputs, target = batch
                return torch.nn.functional.nll_loss(self(inputs, target), target.reshape(-1))

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters(), lr=1e-3)

        return GPT2()
    raise SystemExit(f"unknown model {name!r}: demo or gpt2")


def held_out_loss(module, held) -> float:
    import torch

    module.eval()
    data = Windows(held)
    losses = []
    with torch.no_grad():
        for i in range(0, min(len(data), 20 * BATCH), BATCH):
            xs, ys = zip(*(data[j] for j in range(i, min(i + BATCH, len(data)))))
            x, y = torch.stack(xs), torch.stack(ys)
            losses.append(float(torch.nn.functional.nll_loss(module(x, y), y.reshape(-1))))
    return sum(losses) / len(losses)


#: the plain-Trainer references: name -> (steps factor, batch factor) against ``single``
SINGLES = {"single": (1, 1), "single_tokens": (2, 1), "dp": (1, 2)}


def train(model: str, seed: int, steps: int, callbacks: list, batch: int = BATCH) -> object:
    import lightning as L
    import torch

    L.seed_everything(seed, verbose=False)
    module = build_module(model)
    train_tokens, _ = byte_tokens()
    loader = torch.utils.data.DataLoader(Windows(train_tokens), batch_size=batch, shuffle=True)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, train_dataloaders=loader)
    return module


# ----------------------------------------------------------------------------- one process of a run


def run_single(args) -> None:
    module = train(args.model, args.seed, args.steps, [], batch=args.batch)
    Path(args.out).write_text(json.dumps({"eval_loss": held_out_loss(module, byte_tokens()[1])}))


def run_worker(args) -> None:
    from diloco_lightning import DiLoCo

    cb = DiLoCo(hub=args.hub, node_id=args.node, inner_steps=args.inner_steps, poll_interval=0.1, wait_timeout=600,
                **json.loads(args.callback))
    train(args.model, args.seed, args.steps, [cb])


def evaluate_hub(model: str, hub_dir: str) -> tuple[int, float]:
    from diloco_lightning.hub import open_hub
    from diloco_lightning.hub.versions import load_global
    from diloco_lightning.worker.params import copy_into, module_state

    manifest, state = load_global(open_hub(hub_dir, create=False))
    module = build_module(model)
    copy_into(module_state(module), state, what="the global state")
    return manifest.outer_step, held_out_loss(module, byte_tokens()[1])


# ----------------------------------------------------------------------------- the driver


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               OMP_NUM_THREADS="1")
    return env


def one_run(model: str, config: str, seed: int, steps: int, h: int) -> dict:
    t0 = time.perf_counter()
    me = [sys.executable, str(Path(__file__).resolve())]
    with tempfile.TemporaryDirectory(prefix="foreign-") as tmp:
        if config in SINGLES:
            out = Path(tmp) / "single.json"
            more_steps, more_batch = SINGLES[config]
            subprocess.run(me + ["single", "--model", model, "--seed", str(seed), "--steps", str(steps * more_steps),
                                 "--batch", str(BATCH * more_batch), "--out", str(out)],
                           check=True, env=_env(), capture_output=True)
            rec = json.loads(out.read_text())
        else:
            overrides, callback = CONFIGS[config]
            hub = Path(tmp) / "hub"
            master = subprocess.Popen([sys.executable, "-m", "diloco_lightning.app.master", f"hub.url={hub}",
                                       "hub.create=true", "poll_interval=0.1", *overrides], env=_env(),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            time.sleep(3.0)  # the hub folder exists before the workers open it (create=False)
            workers = [subprocess.Popen(me + ["worker", "--model", model, "--seed", str(seed), "--steps", str(steps),
                                              "--hub", str(hub), "--node", f"w{i}", "--inner-steps", str(h),
                                              "--callback", json.dumps(callback)],
                                        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                       for i in range(2)]
            logs = [w.communicate()[0] for w in workers]
            master.send_signal(signal.SIGINT)  # a last round for what is pending, then it stops
            master_log = master.communicate(timeout=120)[0]
            if any(w.returncode for w in workers):
                raise RuntimeError(f"{model} {config} seed {seed}: a worker failed:\n" + "\n".join(x[-3000:] for x in logs))
            outer_step, loss = evaluate_hub(model, str(hub))
            rec = {"eval_loss": loss, "outer_steps": outer_step,
                   "diverging_said": "diverging" in master_log, "identical_said": "identical deltas" in master_log}
    rec.update(model=model, config=config, seed=seed, steps=steps, inner_steps=h, seconds=time.perf_counter() - t0)
    return rec


def load(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def report(rows: list[dict]) -> str:
    """Mean held-out loss per (model, config) and its paired difference to ``single`` (same seeds)."""
    import statistics

    out = ["| model | steps | config | seeds | eval loss (mean ± std) | minus single, paired (mean [95 % CI]) | "
           "G: share of dp's gain (mean [95 % CI]) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    by: dict[tuple, dict[int, float]] = {}
    for r in rows:
        by.setdefault((r["model"], r["steps"], r["config"]), {})[r["seed"]] = r["eval_loss"]
    t975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57}
    for (model, steps, config), losses in sorted(by.items()):
        vals = list(losses.values())
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        base = by.get((model, steps, "single"), {})
        diffs = [losses[s] - base[s] for s in losses if s in base and math.isfinite(losses[s])]
        if config != "single" and diffs:
            m = statistics.mean(diffs)
            if len(diffs) > 1:
                half = t975.get(len(diffs) - 1, 2.0) * statistics.stdev(diffs) / math.sqrt(len(diffs))
                diff = f"{m:+.3f} [{m - half:+.3f}, {m + half:+.3f}]"
            else:
                diff = f"{m:+.3f} (one seed: no interval)"
        else:
            diff = ""
        dp = by.get((model, steps, "dp"), {})
        gs = [(base[s] - losses[s]) / (base[s] - dp[s]) for s in losses
              if s in base and s in dp and base[s] != dp[s] and math.isfinite(losses[s])]
        g = ""
        if config not in ("single", "dp") and gs:
            gm = statistics.mean(gs)
            gh = t975.get(len(gs) - 1, 2.0) * statistics.stdev(gs) / math.sqrt(len(gs)) if len(gs) > 1 else math.nan
            g = f"{gm:.2f}" + (f" [{gm - gh:.2f}, {gm + gh:.2f}]" if math.isfinite(gh) else "")
        out.append(f"| {model} | {steps} | {config} | {len(vals)} | {statistics.mean(vals):.3f} ± {sd:.3f} | {diff} | {g} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    for name in ("single", "worker"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--steps", type=int, default=200)
        p.add_argument("--out")
        p.add_argument("--hub")
        p.add_argument("--node")
        p.add_argument("--inner-steps", type=int, default=10)
        p.add_argument("--batch", type=int, default=BATCH)
        p.add_argument("--callback", default="{}")
    ap.add_argument("--models", default="demo,gpt2")
    ap.add_argument("--configs", default=",".join([*SINGLES, *CONFIGS]))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--inner-steps", type=int, default=10)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--report", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "single":
        run_single(args)
        return 0
    if args.cmd == "worker":
        run_worker(args)
        return 0
    out = Path(args.out)
    rows = load(out)
    if not args.report:
        out.parent.mkdir(parents=True, exist_ok=True)
        done = {(r["model"], r["config"], r["seed"], r["steps"], r["inner_steps"]) for r in rows}
        for seed in [int(s) for s in args.seeds.split(",")]:
            for model in args.models.split(","):
                for config in args.configs.split(","):
                    if (model, config, seed, args.steps, args.inner_steps) in done:
                        continue
                    rec = one_run(model, config, seed, args.steps, args.inner_steps)
                    rows.append(rec)
                    out.write_text(json.dumps(rows, indent=1))
                    print(f"{model:5} {config:26} seed {seed}: eval loss {rec['eval_loss']:.3f} "
                          f"({rec['seconds']:.0f} s)", flush=True)
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
