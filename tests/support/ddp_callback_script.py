"""Run by tests/test_callback.py::test_ddp_two_gloo_processes: one DiLoCo worker made of 2 DDP
processes (gloo, CPU). Lightning's DDP launcher re-runs this script for rank 1.

Usage: python ddp_callback_script.py <hub folder> <output folder>
"""

import shutil
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from diloco_lightning import DiLoCo
from diloco_lightning.hub.versions import load_global
from diloco_lightning.hub.local import FileHub
from diloco_lightning.worker import module_state


class RecordingHub(FileHub):
    def __init__(self, root, record, **kw):
        super().__init__(root, **kw)
        self.record = Path(record)
        self.record.mkdir(parents=True, exist_ok=True)

    def upload_delta(self, local_file, node_id, local_step):
        path = super().upload_delta(local_file, node_id, local_step)
        shutil.copyfile(local_file, self.record / f"{node_id}__{local_step:06d}.safetensors")
        return path


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    L.seed_everything(0)
    model = BoringModel()
    cb = DiLoCo(hub=RecordingHub(root, out / "sent"), node_id="w0", inner_steps=4, sync="lockstep", delay=0,
                poll_interval=0.01, wait_timeout=120)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=12, logger=False, enable_checkpointing=False, callbacks=[cb],
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    trainer.fit(model)
    state = {k: v.detach().clone() for k, v in module_state(model).items()}
    torch.save(state, out / f"rank{trainer.global_rank}.pt")
    if trainer.global_rank == 0:
        _, g = load_global(FileHub(root))
        torch.save(g, out / "global.pt")


if __name__ == "__main__":
    main()
