"""The plugin as a user adds it to their own module: what it refuses, what it says, what it
defaults to. Real Trainers, real hubs (a folder, the loopback fake Hugging Face Hub)."""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from diloco_lightning import DiLoCo
from diloco_lightning.hub import HubNotFoundError

FAST = dict(poll_interval=0.01, wait_timeout=60.0)


def _trainer(callback, steps: int = 4, **kw) -> L.Trainer:
    return L.Trainer(max_steps=steps, callbacks=[callback], accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, **kw)


# ----------------------------------------------------------------------------- no silent creation


def test_callback_refuses_a_hub_folder_that_does_not_exist_at_once(tmp_path):
    typo = tmp_path / "shraed" / "run"
    cb = DiLoCo(hub=str(typo), node_id="w0", inner_steps=2, **FAST)
    t0 = time.monotonic()
    with pytest.raises(HubNotFoundError) as e:
        _trainer(cb).fit(BoringModel())
    assert time.monotonic() - t0 < 20
    assert "does not exist" in str(e.value) and "create=True" in str(e.value)
    assert not typo.exists() and not (tmp_path / "shraed").exists()


def test_callback_creates_the_hub_only_when_asked(tmp_path):
    hub = tmp_path / "new-hub"
    cb = DiLoCo(hub=str(hub), node_id="w0", inner_steps=2, create=True, wait_timeout=0.5, poll_interval=0.01)
    with pytest.raises(Exception, match="outer step 0"):  # no master: it waits (0.5 s here) for one
        _trainer(cb).fit(BoringModel())
    assert (hub / "nodes" / "w0" / "init.safetensors").is_file()


def test_hub_options_create_is_the_same_switch(tmp_path):
    cb = DiLoCo(hub=f"file://{tmp_path}/x", node_id="w0", inner_steps=2, hub_options={"create": False}, create=True,
                **FAST)
    with pytest.raises(HubNotFoundError):
        _trainer(cb).fit(BoringModel())


def test_callback_refuses_a_missing_hf_repository(tmp_path, hf_server):
    cb = DiLoCo(hub="hf://org/misspelt", node_id="w0", inner_steps=2, **FAST,
                hub_options={"endpoint": hf_server.endpoint, "cache_dir": str(tmp_path)})
    with pytest.raises(HubNotFoundError, match="create=True"):
        _trainer(cb).fit(BoringModel())


def test_accelerate_adapter_refuses_a_missing_hub(tmp_path):
    from accelerate import Accelerator

    from diloco_lightning.adapters.accelerate import DiLoCo as AccelerateDiLoCo

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 2))
    diloco = AccelerateDiLoCo(accelerator, model, hub=str(tmp_path / "nope"), node_id="w0", inner_steps=2, **FAST)
    with pytest.raises(HubNotFoundError, match="check the spelling, or pass create=True"):
        diloco.start()
    assert not (tmp_path / "nope").exists()


# ----------------------------------------------------------------------------- what it says


def test_sync_lines_never_say_sent_0_B(tmp_path, caplog):
    """Async: the first sync's delta is still uploading when its line is printed; the line says so
    instead of "sent 0 B"; the progress bar's names are short enough not to be cut."""
    import logging

    from diloco_lightning.hub.local import FileHub
    from diloco_lightning.master import MasterOuterLoop

    root = tmp_path / "hub"
    FileHub(root)
    master = MasterOuterLoop(FileHub(root), None, node_state_dir=tmp_path / "m", poll_interval=0.02)
    master.start()
    try:
        cb = DiLoCo(hub=str(root), node_id="w0", inner_steps=2, **FAST)
        trainer = _trainer(cb, steps=8)
        with caplog.at_level(logging.INFO, logger="diloco_lightning"):
            trainer.fit(BoringModel())
    finally:
        master.stop()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DiLoCo w0 | step")]
    assert len(lines) == 4, lines
    assert not any("sent 0 B" in line for line in lines), lines
    assert any("uploading" in line or "sent " in line for line in lines[:1]), lines
    assert all(len(k) <= 10 for k in trainer.progress_bar_metrics if k in ("outer_step", "stale", "sent_MB"))
    assert {"outer_step", "stale", "sent_MB"} <= set(trainer.progress_bar_metrics)


# ----------------------------------------------------------------------------- the master's advice


def test_master_warns_when_two_nodes_send_identical_deltas(tmp_path, caplog):
    """Two nodes trained on the same batches from the same weights (seed_per_node=False and no
    shard): their deltas are identical, and the master says so in one line naming the fix."""
    import logging
    import threading

    from diloco_lightning.hub.local import FileHub
    from diloco_lightning.master import MasterOuterLoop
    from diloco_lightning.worker import DiLoCoWorker

    root = tmp_path / "hub"
    FileHub(root)
    master = MasterOuterLoop(FileHub(root), None, node_state_dir=tmp_path / "m", poll_interval=0.02, min_deltas=2)
    master.start()
    torch.manual_seed(0)
    init = {"w": torch.randn(8, 4), "b": torch.zeros(4)}
    models = [{k: v.clone() for k, v in init.items()} for _ in range(2)]
    workers = [DiLoCoWorker(str(root), f"w{i}", models[i], sync="lockstep", **FAST) for i in range(2)]
    try:
        with caplog.at_level(logging.WARNING, logger="diloco_lightning.master.health"):
            threads = [threading.Thread(target=w.start) for w in workers]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for r in range(2):
                for m in models:  # the same "training step" on both
                    m["w"].add_(0.01 * (r + 1))
                threads = [threading.Thread(target=w.boundary) for w in workers]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            for w in workers:
                w.close()
            master.stop(drain=True)
    finally:
        master.stop()
    lines = [r.getMessage() for r in caplog.records if "identical deltas" in r.getMessage()]
    assert len(lines) == 1, lines  # said once for the pair
    assert "w0" in lines[0] and "w1" in lines[0] and "seed_per_node" in lines[0]


def test_divergence_is_said_once_naming_the_knobs(caplog):
    import logging

    from diloco_lightning.master.health import RunHealth

    healthy = RunHealth(lr=0.7, min_deltas=1)
    with caplog.at_level(logging.WARNING, logger="diloco_lightning.master.health"):
        for step in range(1, 40):  # updates shrink as the run converges, the state's norm grows slowly
            assert not healthy.note_version(step, 1.0 / step, 10.0 + 0.1 * step)
        assert not caplog.records
        sick = RunHealth(lr=0.7, min_deltas=1)
        said = [sick.note_version(step, 0.1 * 1.5 ** max(0, step - 10), 10.0 * 1.2 ** max(0, step - 10))
                for step in range(1, 30)]
    assert sum(said) == 1 or (sum(said) == 2 and said.index(True) < 20), said
    text = caplog.records[0].getMessage()
    assert "diverging" in text and "outer.lr (now 0.7, e.g. outer.lr=0.175)" in text and "min_deltas (now 1)" in text
    assert sick.diverging


# ----------------------------------------------------------------------------- a module we never saw


@pytest.mark.slow  # importing transformers alone takes ~10 s
def test_a_tiny_hf_gpt2_trains_through_the_plugin(tmp_path):
    """A random-init GPT-2 from ``transformers`` (built from a config, never downloaded) in a plain
    LightningModule: its deltas reach the master, the global weights come back, the loss falls.
    ``benchmarks/foreign_modules.py`` measures the quality against one worker alone."""
    transformers = pytest.importorskip("transformers")

    from diloco_lightning.hub.local import FileHub
    from diloco_lightning.master import MasterOuterLoop

    class GPT2(L.LightningModule):
        def __init__(self):
            super().__init__()
            cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                          bos_token_id=0, eos_token_id=0)
            self.model = transformers.GPT2LMHeadModel(cfg)
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            loss = self.model(input_ids=ids, labels=ids).loss
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    torch.manual_seed(0)
    ids = (torch.arange(16).repeat(64, 1) + torch.randint(0, 4, (64, 1))) % 64  # learnable sequences
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=8, shuffle=True)
    root = tmp_path / "hub"
    FileHub(root)
    master = MasterOuterLoop(FileHub(root), None, node_state_dir=tmp_path / "m", poll_interval=0.02)
    master.start()
    try:
        module = GPT2()
        cb = DiLoCo(hub=str(root), node_id="w0", inner_steps=4, **FAST)
        _trainer(cb, steps=24).fit(module, train_dataloaders=loader)
        master.stop(drain=True)
    finally:
        master.stop()
    assert cb.metrics["deltas_uploaded_total"] >= 5 and master.outer_step >= 5
    assert sum(module.losses[-4:]) / 4 < sum(module.losses[:4]) / 4 - 0.3, module.losses


# ----------------------------------------------------------------------------- LightningCLI


def test_the_lightning_cli_yaml_example_runs(tmp_path):
    """``docs/examples/lightning_cli.yaml`` as the docs say to use it: ``class_path`` / ``init_args``
    for the callback, the node's id and the hub given on the command line."""
    pytest.importorskip("jsonargparse")
    from pathlib import Path

    from lightning.pytorch.cli import LightningCLI

    from diloco_lightning.hub.local import FileHub
    from diloco_lightning.master import MasterOuterLoop

    example = Path(__file__).resolve().parents[1] / "docs" / "examples" / "lightning_cli.yaml"
    root = tmp_path / "hub"
    FileHub(root)
    master = MasterOuterLoop(FileHub(root), None, node_state_dir=tmp_path / "m", poll_interval=0.02)
    master.start()
    try:
        cli = LightningCLI(args=["fit", "--config", str(example), f"--trainer.callbacks.hub={root}",
                                 "--trainer.callbacks.node_id=w1", "--trainer.callbacks.inner_steps=2",
                                 "--trainer.callbacks.poll_interval=0.02", "--trainer.max_steps=6",
                                 "--trainer.accelerator=cpu", "--trainer.logger=false",
                                 "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
                                 f"--trainer.default_root_dir={tmp_path}"],
                           save_config_kwargs={"overwrite": True})
        master.stop(drain=True)
    finally:
        master.stop()
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, DiLoCo)]
    assert cb.node_id == "w1" and cb.options.inner_steps == 2
    # async: a delta may merge into the next, and a round may take two of the node's deltas at once
    assert cb.metrics["deltas_uploaded_total"] >= 2 and master.outer_step >= 1
    assert (root / "nodes" / "w1").is_dir() and FileHub(root).list_deltas() == []  # the drain applied every one


def test_workers_losses_reach_the_heartbeat_and_a_rise_is_said(tmp_path, caplog):
    import logging

    from diloco_lightning.master.health import RunHealth
    from diloco_lightning.wire.claims import NodeReport

    # the heartbeat's report carries the phase's mean loss, checked on the reading side
    assert NodeReport.from_info({"train_loss": 2.5})[0].train_loss == 2.5
    assert NodeReport.from_info({"train_loss": float("nan")})[0].train_loss is None
    assert NodeReport.from_info({"train_loss": 1e300})[1]  # out of bounds: a problem, dropped
    health = RunHealth(lr=0.7, min_deltas=1)
    with caplog.at_level(logging.WARNING, logger="diloco_lightning.master.health"):
        for step, (a, b) in enumerate([(5.5, 5.4), (4.0, 4.2), (3.1, 3.3), (3.0, 3.2), (3.2, 3.1), (2.9, 3.0)]):
            assert not health.note_losses(step, {"w0": a, "w1": b})  # noisy but falling: nothing said
        assert not health.note_losses(6, {"w0": 4.5, "w1": 4.6})  # one high reading: not yet
        assert health.note_losses(7, {"w0": 6.0, "w1": 7.0})
        assert not health.note_losses(8, {"w0": 6.5, "w1": 7.2})  # said once
    (line,) = [r.getMessage() for r in caplog.records]
    assert "workers' training loss is 7 at outer step 7" in line and "up from 3 at outer step 5" in line
    assert "outer.lr (now 0.7" in line
