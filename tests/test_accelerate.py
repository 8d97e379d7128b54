"""``diloco_lightning.adapters.accelerate.DiLoCo`` in a plain Accelerate loop, against the real master."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from diloco_lightning.adapters.accelerate import DiLoCo  # noqa: E402
from diloco_lightning.wire.delta import read_delta  # noqa: E402
from diloco_lightning.hub.local import FileHub  # noqa: E402
from diloco_lightning.master import MasterOuterLoop  # noqa: E402

FAST = dict(poll_interval=0.01, wait_timeout=60.0)


class RecordingHub(FileHub):
    """Keeps a copy of each uploaded delta (the master deletes the ones it processed)."""

    def __init__(self, root, record, **kw):
        super().__init__(root, **kw)
        self.record = Path(record)
        self.record.mkdir(parents=True, exist_ok=True)

    def upload_delta(self, local_file, node_id, local_step):
        path = super().upload_delta(local_file, node_id, local_step)
        shutil.copyfile(local_file, self.record / f"{node_id}__{local_step:06d}.safetensors")
        return path

    def sent(self):
        return [read_delta(p) for p in sorted(self.record.glob("*.safetensors"))]


@contextlib.contextmanager
def running_master(root: Path, workdir: Path, **kw):
    master = MasterOuterLoop(FileHub(root), None, node_state_dir=workdir, poll_interval=0.02, norm_ratio=None, **kw)
    master.start()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def setup(accumulation: int = 1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model, opt, loader = acc.prepare(model, opt, DataLoader(data, batch_size=4))
    return acc, model, opt, loader


def train(acc, model, opt, loader, micro_batches: int, diloco=None, skip: int = 0, on_step=None):
    """``micro_batches`` batches (cycling the loader), the first ``skip`` of them already done."""
    batches = [b for _ in range(4) for b in loader]
    for i in range(skip, micro_batches):
        x, y = batches[i]
        with acc.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            if diloco is not None:
                diloco.step(num_tokens=x.shape[0])
        if on_step is not None:
            on_step(i + 1)


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_accelerate_loop_lockstep_equals_plain_training(tmp_path):
    acc, model, opt, loader = setup()
    train(acc, model, opt, loader, 12)
    plain = weights(model)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    root = tmp_path / "hub"
    hub = RecordingHub(root, tmp_path / "sent")
    acc, model, opt, loader = setup()
    logged = []
    with running_master(root, tmp_path / "master", outer_lr=1.0, outer_momentum=0.0):
        with DiLoCo(acc, model, hub, "w0", inner_steps=4, sync="lockstep", log_fn=logged.append, **FAST) as diloco:
            train(acc, model, opt, loader, 12, diloco)
        assert FileHub(root).read_manifest().outer_step == 3
    sent = hub.sent()
    assert [(d.header.local_step, d.header.base_outer_step, d.header.num_tokens) for d in sent] == [
        (1, 0, 16), (2, 1, 16), (3, 2, 16)
    ]
    assert set(sent[0].tensors) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert [m["diloco/installed_outer_step"] for m in logged] == [1.0, 2.0, 3.0]
    now = weights(model)
    for k in plain:
        assert torch.allclose(plain[k], now[k], rtol=1e-5, atol=1e-6), k


def test_accelerate_accumulation_and_checkpoint_resume(tmp_path):
    """accumulation 2, H=3; a run saved at optimizer step 7 (mid-phase), killed at 8 and resumed
    with accelerator.load_state sends the same deltas as a straight run."""

    def run(name: str, kill: int | None):
        root = tmp_path / name / "hub"
        hub = RecordingHub(root, tmp_path / name / "sent")
        ckpt = tmp_path / name / "ckpt"
        with running_master(root, tmp_path / name / "master"):
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            acc, model, opt, loader = setup(accumulation=2)
            with DiLoCo(acc, model, hub, "w0", inner_steps=3, sync="lockstep", **FAST) as diloco:

                def save(i):
                    if i == 14:  # 7 optimizer steps
                        acc.save_state(str(ckpt))

                train(acc, model, opt, loader, 24 if kill is None else 2 * kill, diloco, on_step=save)
            if kill is not None:  # a new process
                AcceleratorState._reset_state(True)
                GradientState._reset_state()
                acc, model, opt, loader = setup(accumulation=2)
                diloco = DiLoCo(acc, model, hub, "w0", inner_steps=3, sync="lockstep", **FAST)
                acc.load_state(str(ckpt))
                assert diloco.num_steps == 7
                with diloco:
                    train(acc, model, opt, loader, 24, diloco, skip=14)
        return hub.sent(), weights(model)

    straight, w1 = run("straight", None)
    resumed, w2 = run("resumed", kill=8)
    assert len(straight) == len(resumed) == 4  # 12 optimizer steps / H=3, accumulation does not count
    for a, b in zip(straight, resumed):
        assert (a.header.local_step, a.header.base_outer_step) == (b.header.local_step, b.header.base_outer_step)
        for k in a.tensors:
            assert torch.allclose(a.tensors[k], b.tensors[k], rtol=1e-6, atol=1e-7), (a.header.local_step, k)
    for k in w1:
        assert torch.allclose(w1[k], w2[k], rtol=1e-6, atol=1e-7), k


def test_accelerate_disabled_and_validation(tmp_path):
    acc, model, opt, loader = setup()
    d = DiLoCo(acc, model, tmp_path / "hub", "w0", inner_steps=2, enabled=False)
    with d:
        assert d.step() is None and d.worker is None
    for kwargs, name in (
        (dict(inner_steps=0), "inner_steps"),
        (dict(node_id=".x"), "node_id"),
        (dict(sync="maybe"), "sync"),
        (dict(reset_inner_optimizer=True), "optimizer"),
        (dict(delta_dtype="int2"), "delta_dtype"),
        (dict(topk=2), "topk"),
        (dict(error_feedback=1), "error_feedback"),
    ):
        args = dict(hub=tmp_path / "hub", node_id="w0", inner_steps=2)
        args.update(kwargs)
        with pytest.raises(ValueError, match=name):
            DiLoCo(acc, model, **args)
    from diloco_lightning.worker.options import WorkerOptions  # the options whole: the same worker

    whole = DiLoCo(acc, model, tmp_path / "hub", "w0", options=WorkerOptions(inner_steps=2, sync="lockstep"), enabled=False)
    assert whole.options == DiLoCo(acc, model, tmp_path / "hub", "w0", 2, sync="lockstep", enabled=False).options


def test_accelerate_fragments_one_argument_equals_plain_training(tmp_path):
    """``fragments=`` (two pattern groups: the two linear layers): a boundary every 2 steps sends one
    layer's delta (its tensors only, tokens since that layer's last delta); with lockstep delay 0 and
    Nesterov lr 1 without momentum the run still equals plain training."""
    acc, model, opt, loader = setup()
    train(acc, model, opt, loader, 12)
    plain = weights(model)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()

    root = tmp_path / "hub"
    hub = RecordingHub(root, tmp_path / "sent")
    acc, model, opt, loader = setup()
    frags = [["0"], ["2"]]
    with running_master(root, tmp_path / "master", outer_lr=1.0, outer_momentum=0.0, fragments=frags):
        with DiLoCo(acc, model, hub, "w0", inner_steps=4, sync="lockstep", fragments=frags, **FAST) as diloco:
            train(acc, model, opt, loader, 12, diloco)
        m = FileHub(root).read_manifest()
        assert m.outer_step == 6 and [f["outer_step"] for f in m.fragments] == [3, 3]
    sent = hub.sent()
    assert [(d.header.local_step, d.header.extra["fragment"], d.header.num_tokens) for d in sent] == [
        (1, "1", 8), (2, "0", 16), (3, "1", 16), (4, "0", 16), (5, "1", 16), (6, "0", 16)
    ]
    assert set(sent[0].tensors) == {"2.weight", "2.bias"} and set(sent[1].tensors) == {"0.weight", "0.bias"}
    now = weights(model)
    for k in plain:
        assert torch.allclose(plain[k], now[k], rtol=1e-5, atol=1e-6), k


def test_accelerate_exit_installs_the_newest_global_with_the_last_delta(tmp_path):
    """Async: at the ``with`` block's end the model holds the hub's newest global, bit for bit, and it
    contains the worker's last delta (issue 41)."""
    from diloco_lightning.hub.versions import load_global

    acc, model, opt, loader = setup()
    root = tmp_path / "hub"
    root.mkdir()
    with running_master(root, tmp_path / "master"):
        with DiLoCo(acc, model, str(root), "w0", inner_steps=4, **FAST) as diloco:
            train(acc, model, opt, loader, 12, diloco)
        manifest, state = load_global(FileHub(root))
    assert manifest.ledger["w0"] == 3
    got = weights(acc.unwrap_model(model))
    assert got.keys() == state.keys()
    for k in state:
        assert torch.equal(got[k], state[k]), k
