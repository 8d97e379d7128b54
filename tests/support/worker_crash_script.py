"""A Lightning worker whose progress is countable, for kill -9 tests (tests/test_hardening.py).
Not a test module (no ``test_`` prefix).

    python tests/support/worker_crash_script.py '<json config>'

The model is one parameter vector ``p`` (initialised to 10) trained with SGD(lr=1) on
``loss = -p.sum()``: every optimizer step adds exactly 1 to each element, so the work a
worker has done is a whole number of steps, and a master applying every delta exactly once
(arrival mode, Nesterov lr=1, momentum 0) ends at ``10 + max_steps``, bit for bit. A
checkpoint (``last.ckpt``) is saved at every boundary; the run resumes from it when it exists.
Kill points come from ``DILOCO_FAULTS`` (``diloco_lightning.util.faults``).

Config: ``hub`` (a URL), ``hub_options``, ``ckpt_dir``, ``max_steps``, ``inner_steps``,
``signing_key`` (optional); for the elasticity tests (tests/test_elastic.py) also ``node_id``
(default w0), ``throttle`` (seconds slept per step) and ``claim_ttl``; for the fragment tests
(tests/test_fragments.py) ``fragments`` (then the model has a second vector ``q``, the same rule); for
benchmarks/chaos.py ``step_log`` (a file each executed step appends ``<monotonic time> <global step>`` to);
``refuse_uploads_from`` (a folder hub's path as ``hub``): uploads of this node's deltas at that step and
above fail, as in an outage that lasts past the end of training.
Prints ``started <outer_step> step <global step>`` once the worker has installed its starting version (a
restart without a checkpoint resumes past the phases the hub has), and ``done <steps>`` at the end.
``sync`` / ``delay``: the sync mode (default async). ``--spare`` after the config: a warm spare, which
waits for a line ``go`` on its standard input once its imports are done (end of input: it leaves).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from diloco_lightning import DiLoCo  # noqa: E402


class Counter(L.LightningModule):
    def __init__(self, two: bool = False) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.full((8,), 10.0))
        self.q = torch.nn.Parameter(torch.full((8,), 10.0)) if two else None

    def training_step(self, batch, batch_idx):
        return -self.p.sum() - (self.q.sum() if self.q is not None else 0.0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def train_dataloader(self):
        return DataLoader(torch.zeros(10_000, 1), batch_size=1)


def main() -> None:
    if "--spare" in sys.argv[2:]:  # a warm spare (benchmarks/chaos.py --spare): imports done, wait for the go
        if sys.stdin.buffer.readline() != b"go\n":
            return
    cfg = json.loads(sys.argv[1])
    ckpt_dir = Path(cfg["ckpt_dir"])
    hub = cfg["hub"]
    if cfg.get("refuse_uploads_from") is not None:  # a folder hub that refuses this node's deltas from a step on
        from diloco_lightning.hub.local import FileHub

        class Refusing(FileHub):
            def upload_delta(self, local, node_id, local_step):
                if local_step >= cfg["refuse_uploads_from"]:
                    raise ConnectionRefusedError(f"refusing delta_{local_step} (the test's outage)")
                return super().upload_delta(local, node_id, local_step)

        hub = Refusing(cfg["hub"].removeprefix("file://"))
    diloco = DiLoCo(
        hub=hub, node_id=cfg.get("node_id", "w0"), inner_steps=cfg["inner_steps"],
        hub_options=cfg.get("hub_options") or None, signing_key=cfg.get("signing_key"), poll_interval=0.02,
        wait_timeout=60.0, token_counter=False, throttle=cfg.get("throttle", 0.0), claim_ttl=cfg.get("claim_ttl"),
        fragments=cfg.get("fragments"), **cfg.get("encoding", {}),
        **({"sync": cfg["sync"], "delay": cfg.get("delay", 0)} if cfg.get("sync") else {}),
    )

    class Started(L.Callback):
        def on_train_start(self, trainer, pl_module):
            print(f"started {diloco.worker.outer_step} step {trainer.global_step}", flush=True)
    class StepLog(L.Callback):
        def __init__(self, path: str) -> None:
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 - one line per step, flushed

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.file.write(f"{time.monotonic():.4f} {trainer.global_step}\n")
    logs = [StepLog(cfg["step_log"])] if cfg.get("step_log") else []
    every = cfg.get("ckpt_every", cfg["inner_steps"])
    saves = [ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0, every_n_train_steps=every)] if every else []
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=cfg["max_steps"], logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[diloco, Started(), *saves, *logs],
        enable_checkpointing=bool(every),
    )
    last = ckpt_dir / "last.ckpt"
    trainer.fit(Counter(two=cfg.get("fragments") is not None), ckpt_path=str(last) if last.is_file() else None)
    print(f"done {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
