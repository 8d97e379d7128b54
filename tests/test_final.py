"""The plugin user's whole journey (issue 41): the global model in the module after ``fit``, the
local one kept when the master is gone, a master that ends with its run, ``diloco-export``, and
workers that start before the hub exists."""

from __future__ import annotations

import json
import logging
import shlex
import threading
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel
from safetensors.torch import load_file

from diloco_lightning import DiLoCo
from diloco_lightning.adapters.shared import open_worker_hub
from diloco_lightning.app.export import main as export_main
from diloco_lightning.hub import HubNotFoundError
from diloco_lightning.hub.local import FileHub
from diloco_lightning.hub.versions import load_global
from diloco_lightning.master import MasterOuterLoop
from diloco_lightning.worker import module_state

FAST = dict(poll_interval=0.01, wait_timeout=30.0)


def trainer(max_steps: int, callbacks) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                     num_sanity_val_steps=0, callbacks=list(callbacks))


def master(root: Path, workdir: Path, **kw) -> MasterOuterLoop:
    opts = dict(poll_interval=0.02, keep_globals=8, norm_ratio=None)
    opts.update(kw)
    return MasterOuterLoop(FileHub(root), None, node_state_dir=workdir, **opts)


def weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module_state(module).items()}


def test_fit_ends_with_the_hubs_newest_global_and_the_master_ends_with_its_run(tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "hub"
    root.mkdir()
    m = master(root, tmp_path / "master", until_finished=True)
    m.start()
    L.seed_everything(0)
    model = BoringModel()
    cb = DiLoCo(hub=str(root), node_id="w0", inner_steps=4, **FAST)
    try:
        with caplog.at_level(logging.INFO, logger="diloco_lightning"):
            trainer(12, [cb]).fit(model)
            deadline = time.monotonic() + 20
            while m._thread is not None and m._thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not m._thread.is_alive()  # until_finished: the master's loop ended on its own
    finally:
        m.stop()
    manifest, state = load_global(FileHub(root))
    assert manifest.ledger["w0"] == 3  # three boundaries, the last delta applied
    local = weights(model)
    assert local.keys() == state.keys()
    for k in state:
        assert torch.equal(local[k], state[k]), k  # bit for bit: the module holds the hub's newest global
    assert m.run_over() == {"w0": 3}
    text = caplog.text
    assert "every worker finished and its last delta is applied: w0 (last delta 3)" in text
    assert f"diloco-export hub.url={FileHub(root).url} out=./final_model" in text
    claim = json.loads((root / "nodes" / "w0" / "claim.json").read_text())
    assert claim["info"]["finished"] is True and claim["info"]["local_step"] == 3

    # the one-command export, followed exactly as the master printed it (from the user's folder): a plain
    # safetensors file the user's module loads, bit for bit the global
    printed = next(line[line.index("diloco-export "):].strip() for line in text.splitlines() if "diloco-export hub.url=" in line)
    export_main(shlex.split(printed)[1:])
    out = tmp_path / "final_model"
    exported = load_file(str(out / "model.safetensors"))
    fresh = BoringModel()
    fresh.load_state_dict(exported)
    for k, v in weights(fresh).items():
        assert torch.equal(v, state[k]), k
    info = json.loads((out / "diloco_global.json").read_text())
    assert info["outer_step"] == manifest.outer_step and info["model_fingerprint"] == manifest.model_fingerprint


class StopMasterFirst(Callback):
    """At the end of fit, before DiLoCo's hook: stop the master (no final round) and note the local weights."""

    def __init__(self, m: MasterOuterLoop) -> None:
        self.m, self.local = m, None

    def on_train_end(self, trainer, pl_module):
        self.m.stop()
        self.local = weights(pl_module)


def test_a_master_gone_at_the_end_keeps_the_local_weights(tmp_path, caplog):
    root = tmp_path / "hub"
    root.mkdir()
    m = master(root, tmp_path / "master", min_deltas=2)  # one worker never makes the quorum: only version 0
    m.start()
    L.seed_everything(0)
    model = BoringModel()
    stopper = StopMasterFirst(m)
    cb = DiLoCo(hub=str(root), node_id="w0", inner_steps=4, **FAST)
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="diloco_lightning"):
        trainer(8, [stopper, cb]).fit(model)
    assert time.monotonic() - t0 < 20  # the gone master is noticed, not waited for (wait_timeout 30 s)
    assert stopper.local is not None
    for k, v in weights(model).items():
        assert torch.equal(v, stopper.local[k]), k
    assert "the master of" in caplog.text and "is gone (no live lease)" in caplog.text
    assert "keeping the local weights" in caplog.text
    manifest, state = load_global(FileHub(root))
    assert manifest.outer_step == 0 and not torch.equal(state["layer.weight"], stopper.local["layer.weight"])


def test_a_worker_waits_for_a_hub_the_master_creates_later(tmp_path, caplog):
    root = tmp_path / "later"
    with pytest.raises(HubNotFoundError, match="pass create=True"):
        open_worker_hub(str(root), None, False)  # without wait_for_hub: refused at once, naming the fix
    with pytest.raises(HubNotFoundError, match="no master created it within wait_timeout=0.2 s"):
        open_worker_hub(str(root), None, False, wait=0.2, poll_interval=0.05)
    timer = threading.Timer(0.3, lambda: root.mkdir())
    timer.start()
    with caplog.at_level(logging.INFO, logger="diloco_lightning"):
        hub = open_worker_hub(str(root), None, False, wait=10.0, poll_interval=0.05)
    timer.join()
    assert hub.local_root == root.resolve() or str(root) in hub.url
    lines = [r.message for r in caplog.records if "waiting up to" in r.message]
    assert len(lines) == 1 and "wait_for_hub=True" in lines[0]
    cb = DiLoCo(hub=str(tmp_path / "x"), node_id="w0", inner_steps=4, wait_for_hub=True)
    assert cb.options.wait_for_hub is True and cb.options.final_install is True
    with pytest.raises(ValueError, match="wait_for_hub"):
        DiLoCo(hub=str(tmp_path / "x"), node_id="w0", inner_steps=4, wait_for_hub="yes")


def test_diloco_export_errors_are_one_line(tmp_path, capsys):
    root = tmp_path / "hub"
    root.mkdir()
    with pytest.raises(SystemExit) as e:
        export_main([f"hub.url={root}", f"out={tmp_path / 'o'}"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "nothing published" in err and "diloco-master" in err
    with pytest.raises(SystemExit):
        export_main([f"hub.url={tmp_path / 'missing'}"])
    assert "hub.url" in capsys.readouterr().err

