"""A whole DiLoCo run on your own module, on one machine: a master, two workers, an export.

    python docs/examples/char_gpt_journey.py --out journey          # about 255k parameters, 512 steps per worker

What it does, in order (docs/plugin.md, "A whole run on your own module"):

1. starts the master:  python -m diloco_lightning.app.master hub.url=journey/hub hub.create=true until_finished=true
   (``diloco-master`` is the same command); it creates the hub folder and ends by itself once every worker it
   knows has finished and its last delta is applied;
2. starts two workers: this script with ``--worker --node w0`` and ``--worker --node w1``: each one runs
   ``trainer.fit`` on the character-level GPT below with ``DiLoCo(hub=..., node_id=..., inner_steps=...)``
   and every other default, then saves its module's weights (after ``fit``: the global version that
   holds its last delta, which the callback installs) to ``journey/workers/<node>.safetensors``;
3. waits for the three processes to end by themselves;
4. exports the global model:  python -m diloco_lightning.app.export hub.url=journey/hub out=journey/final_model
   (``diloco-export``), and loads ``journey/final_model/model.safetensors`` into a fresh module with
   ``load_state_dict``;
5. prints the held-out loss of the exported model and of each worker's module, and whether each worker's
   module is bit for bit the exported model.

The module is plain torch inside this file (nothing of the project's own models); the data is the
bytes of the Python standard library's sources (a byte is a token: vocabulary 256), 5 % held out.
Nothing is downloaded. Every process's output is in ``journey/logs/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset

VOCAB = 256  # bytes


# ----------------------------------------------------------------------------- the module (yours)


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharGPT(L.LightningModule):
    """A small character-level GPT: byte embeddings, learned positions, pre-norm blocks, a tied head."""

    def __init__(self, d_model: int = 96, layers: int = 2, heads: int = 4, seq: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.ln(h) @ self.tok.weight.T  # logits

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


# ----------------------------------------------------------------------------- the data (yours)


def byte_splits(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard library's sources as bytes: 95 % to train on, the last 5 % held out."""
    from diloco_lightning.data.corpus import iter_texts, stdlib_corpus

    data = "".join(iter_texts(stdlib_corpus(max_bytes))).encode("utf-8", "replace")[:max_bytes]
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    cut = int(len(t) * 0.95)
    return t[:cut], t[cut:]


class Windows(Dataset):
    """Non-overlapping windows of ``seq + 1`` bytes: ``(inputs, targets)``."""

    def __init__(self, tokens: torch.Tensor, seq: int) -> None:
        self.tokens, self.seq = tokens, seq

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq

    def __getitem__(self, i: int):
        w = self.tokens[i * self.seq: i * self.seq + self.seq + 1]
        return w[:-1], w[1:]


@torch.no_grad()
def held_out_loss(model: CharGPT, held_out: torch.Tensor, seq: int, windows: int = 64) -> float:
    """Mean cross-entropy (nats per byte) over the first ``windows`` held-out windows."""
    model.eval()
    data = Windows(held_out, seq)
    xs, ys = zip(*(data[i] for i in range(min(windows, len(data)))))
    return float(model.loss((torch.stack(xs), torch.stack(ys))))


def build(args) -> CharGPT:
    return CharGPT(d_model=args.d_model, layers=args.layers, seq=args.seq)


# ----------------------------------------------------------------------------- one worker


def worker(args) -> None:
    from diloco_lightning import DiLoCo

    out = Path(args.out)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.workers))
    L.seed_everything(0)  # the same seed on every node: DiLoCo reseeds each one from its node_id
    model = build(args)
    train, _ = byte_splits(args.max_bytes)
    loader = DataLoader(Windows(train, args.seq), batch_size=args.batch_size, shuffle=True, drop_last=True)
    options = {} if args.poll_interval is None else {"poll_interval": args.poll_interval}

    # Start fit once every worker is up. The master's until_finished ends the run when every worker it
    # KNOWS (by its claim on the hub, made at the start of fit) has finished: a worker that starts
    # after the others are done would train alone, its deltas applied by no master. Your launcher (SLURM, ...)
    # starts them together; here one file per worker says "ready".
    ready = out / "ready"
    ready.mkdir(parents=True, exist_ok=True)
    (ready / args.node).touch()
    deadline = time.monotonic() + 300
    while len(list(ready.iterdir())) < args.workers and time.monotonic() < deadline:
        time.sleep(0.05)

    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[DiLoCo(hub=str(out / "hub"), node_id=args.node, inner_steps=args.inner_steps,
                                          **options)])
    trainer.fit(model, loader)
    # after fit the module holds the run's global weights (the version with this node's last delta)
    (out / "workers").mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "workers" / f"{args.node}.safetensors"))
    print(f"{args.node}: fit done, weights saved to {out / 'workers' / (args.node + '.safetensors')}", flush=True)


# ----------------------------------------------------------------------------- the whole journey


def run(cmd: list[str], log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT)


def last_lines(path: Path, n: int) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-n:]


def journey(args) -> int:
    out = Path(args.out).resolve()
    hub, logs = out / "hub", out / "logs"
    if hub.exists():
        sys.exit(f"{hub} exists (a previous run): choose another --out")
    poll = [] if args.poll_interval is None else [f"poll_interval={args.poll_interval}"]

    # 1. the master: creates the hub, ends by itself once every worker finished and its last delta is applied
    master_cmd = [sys.executable, "-m", "diloco_lightning.app.master", f"hub.url={hub}", "hub.create=true",
                  "until_finished=true", *poll]
    print("$", " ".join(["python", *master_cmd[1:]]), f"> {logs / 'master.log'}", flush=True)
    master = run(master_cmd, logs / "master.log")
    deadline = time.monotonic() + 120
    while not hub.is_dir() and master.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the workers need the hub: the master creates it (or pass DiLoCo(..., wait_for_hub=True))
    if not hub.is_dir():
        sys.exit(f"the master did not create {hub}; see {logs / 'master.log'}")

    # 2. the workers: this script with --worker --node w<i>
    passed = [f"--steps={args.steps}", f"--inner-steps={args.inner_steps}", f"--d-model={args.d_model}",
              f"--layers={args.layers}", f"--seq={args.seq}", f"--batch-size={args.batch_size}",
              f"--max-bytes={args.max_bytes}", f"--workers={args.workers}", f"--out={out}"]
    if args.poll_interval is not None:
        passed.append(f"--poll-interval={args.poll_interval}")
    workers = {}
    for i in range(args.workers):
        node = f"w{i}"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", f"--node={node}", *passed]
        print("$", " ".join(["python", *cmd[1:]]), f"> {logs / (node + '.log')}", flush=True)
        workers[node] = run(cmd, logs / f"{node}.log")

    # 3. everything ends by itself: the workers when fit returns, the master when the run is over
    failed = False
    for node, p in workers.items():
        code = p.wait()
        print(f"{node}: exited with status {code}", flush=True)
        failed |= code != 0
    try:
        code = master.wait(timeout=args.master_wait)
        print(f"master: exited by itself with status {code}; its last lines:", flush=True)
    except subprocess.TimeoutExpired:
        master.terminate()
        code = master.wait()
        print(f"master: still running {args.master_wait:g} s after the workers; stopped it (status {code})", flush=True)
        failed = True
    for line in last_lines(logs / "master.log", 6):
        if line.startswith("[master]"):  # where the final model is, and the export command
            print("   ", line, flush=True)
    if failed:
        print(f"something failed: see {logs}", flush=True)
        return 1

    # 4. the export, and the global model in a fresh module of yours
    final = out / "final_model"
    export_cmd = [sys.executable, "-m", "diloco_lightning.app.export", f"hub.url={hub}", f"out={final}"]
    print("$", " ".join(["python", *export_cmd[1:]]), flush=True)
    subprocess.run(export_cmd, check=True)
    exported = load_file(str(final / "model.safetensors"))
    model = build(args)
    model.load_state_dict(exported)

    # 5. what it learnt
    _, held_out = byte_splits(args.max_bytes)
    print(f"held-out loss of the exported global model: {held_out_loss(model, held_out, args.seq):.4f} nats/byte "
          f"(chance: ln 256 = {math.log(VOCAB):.4f})", flush=True)
    step = json.loads((final / "diloco_global.json").read_text())["outer_step"]
    for node in workers:
        state = load_file(str(out / "workers" / f"{node}.safetensors"))
        mine = build(args)
        mine.load_state_dict(state)
        print(f"{node}'s module after fit: held-out loss {held_out_loss(mine, held_out, args.seq):.4f}, "
              f"bit for bit {which_version(state, exported, step, hub)}", flush=True)
    return 0


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def which_version(state: dict[str, torch.Tensor], exported: dict[str, torch.Tensor], step: int, hub: Path) -> str:
    """Which global version a worker's module holds after fit. The callback installs the newest version
    that holds the worker's last delta: the exported (final) one, unless the other worker's last delta
    came in a later round; the folder hub keeps the last few versions as global/weights_<step>_*.safetensors."""
    if same(state, exported):
        return f"the exported global model (version {step})"
    for path in sorted(hub.glob("global/weights_*.safetensors"), reverse=True):
        if same(state, load_file(str(path))):
            return (f"global version {int(path.name.split('_')[1])}, the newest with its last delta when it "
                    f"finished (the other worker's last delta came later)")
    return "no global version (the local weights: its log says why)"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="journey", help="the run's folder: hub/, logs/, workers/, final_model/")
    p.add_argument("--steps", type=int, default=512, help="optimizer steps per worker (a multiple of --inner-steps)")
    p.add_argument("--inner-steps", type=int, default=64, help="H: optimizer steps between two syncs")
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="bytes of the standard library's sources read")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--poll-interval", type=float, default=None,
                   help="seconds between the hub reads of the master and the workers (default: the library's, 1 s)")
    p.add_argument("--master-wait", type=float, default=120.0, help="seconds the master may outlive the workers")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--node", default="w0", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
    else:
        sys.exit(journey(args))


if __name__ == "__main__":
    main()
