"""The Lightning callback end to end: real Trainers, a real folder hub, the real master.

Workers use a ``RecordingHub`` (a ``FileHub`` that keeps a copy of every delta it uploads,
because the master deletes the deltas it has processed) and the master runs in a thread on
the same folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers.logger import Logger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from diloco_lightning import DiLoCo
from diloco_lightning.wire.delta import model_fingerprint, read_delta
from diloco_lightning.hub.local import FileHub
from diloco_lightning.master import MasterOuterLoop
from diloco_lightning.worker import module_state

FAST = dict(poll_interval=0.01, wait_timeout=60.0)


# ----------------------------------------------------------------------------- helpers


class RecordingHub(FileHub):
    """A worker's view of a folder hub that keeps a copy of every delta it uploads."""

    def __init__(self, root, record: Path, **kw) -> None:
        super().__init__(root, **kw)
        self.record = Path(record)
        self.record.mkdir(parents=True, exist_ok=True)
        self.down = False

    def _check(self):
        if self.down:
            raise ConnectionError("hub unreachable (injected)")

    def upload_delta(self, local_file, node_id, local_step):
        self._check()
        path = super().upload_delta(local_file, node_id, local_step)
        shutil.copyfile(local_file, self.record / f"{node_id}__{local_step:06d}.safetensors")
        return path

    def list_deltas(self, after=None):
        self._check()
        return super().list_deltas(after)

    def read_manifest(self):
        self._check()
        return super().read_manifest()

    def download(self, hub_path, **kw):
        self._check()
        return super().download(hub_path, **kw)

    def sent(self, node: str = "w0"):
        return [read_delta(p) for p in sorted(self.record.glob(f"{node}__*.safetensors"))]


class MemLogger(Logger):
    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "mem"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


@contextlib.contextmanager
def running_master(root: Path, workdir: Path, **kw):
    """The real master in a thread on the folder hub at ``root`` (adopts the first init by default)."""
    rounds: list[dict] = []
    opts = dict(poll_interval=0.02, keep_globals=8, norm_ratio=None)
    opts.update(kw)
    state = opts.pop("state", None)
    master = MasterOuterLoop(FileHub(root), state, node_state_dir=workdir, logger=rounds.append, **opts)
    master.start()
    try:
        yield SimpleNamespace(master=master, rounds=rounds)
    finally:
        master.stop()


def trainer(max_steps: int, callbacks=(), **kw) -> L.Trainer:
    opts = dict(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    opts.update(kw)
    return L.Trainer(callbacks=list(callbacks), **opts)


def floating(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module_state(module).items() if v.is_floating_point()}


class Slow(Callback):
    """Gives the master and the prefetcher time to act between boundaries (async tests)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args):
        time.sleep(self.seconds)


class Tokens(Dataset):
    def __init__(self, n=64, seq=9, vocab=31):
        self.data = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i]}


class TinyLM(L.LightningModule):
    """A small causal transformer with tied embeddings and an integer buffer; knows nothing of DiLoCo."""

    def __init__(self, vocab=31, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        # no biases: the attention key bias has a zero gradient, which Adam turns into rounding-noise-sized
        # steps amplified to lr size, so two runs equal up to rounding would part ways on it
        layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True, bias=False)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("batches_seen", torch.zeros((), dtype=torch.long))

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        x, y = ids[:, :-1], ids[:, 1:]
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.norm(self.enc(self.emb(x), mask=mask, is_causal=True))
        self.batches_seen += 1
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        return DataLoader(Tokens(), batch_size=4)


# ----------------------------------------------------------------------------- tests


def test_boring_model_async_end_to_end(tmp_path):
    root = tmp_path / "hub"
    hub = RecordingHub(root, tmp_path / "sent")
    log = MemLogger()
    L.seed_everything(0)
    model = BoringModel()
    fp = model_fingerprint(module_state(model))
    cb = DiLoCo(hub=hub, node_id="w0", inner_steps=4, **FAST)
    with running_master(root, tmp_path / "master") as m:
        trainer(40, [cb, Slow(0.02)], logger=log).fit(model)
        deadline = time.monotonic() + 60  # quick on a quiet machine; room for a loaded one
        while m.master.ledger.get("w0", -1) < hub.sent()[-1].local_step and time.monotonic() < deadline:
            time.sleep(0.02)
    sent = hub.sent()
    assert [d.header.local_step for d in sent] == list(range(1, len(sent) + 1))
    assert sum(int(d.header.extra["phases"]) for d in sent) == 10  # every boundary's phase, once
    for d in sent:
        assert d.header.node_id == "w0" and d.header.model_fingerprint == fp
        assert set(d.tensors) == {"layer.weight", "layer.bias"}
    bases = [d.header.base_outer_step for d in sent]
    assert bases == sorted(bases) and bases[-1] >= 2  # the worker installed newer versions
    assert m.master.outer_step >= 3 and m.master.ledger["w0"] == sent[-1].local_step  # the master applied them
    applied = [a for r in m.rounds for a in r.get("applied", [])]
    assert applied == [f"w0/{d.header.local_step}" for d in sent]
    logged = {k for _, row in log.rows for k in row}
    assert {"diloco/outer_step", "diloco/installed_outer_step", "diloco/install_staleness", "diloco/delta_norm",
            "diloco/upload_bytes", "diloco/upload_seconds", "diloco/boundary_seconds"} <= logged
    assert [s for s, _ in log.rows] == [4 * i for i in range(1, 11)]
    assert cb.metrics["deltas_uploaded_total"] == len(sent) and cb.metrics["bytes_uploaded_total"] > 0


@pytest.mark.parametrize("kind", ["boring", "transformer"])
def test_lockstep_delay0_with_plain_nesterov_equals_plain_training(tmp_path, kind):
    """One worker, lockstep delay 0, Nesterov lr=1 momentum=0: global = anchor - (anchor - local) = local."""
    make = BoringModel if kind == "boring" else TinyLM
    steps, h = 12, 4
    L.seed_everything(0)
    plain = make()
    trainer(steps, limit_train_batches=8).fit(plain)

    root = tmp_path / "hub"
    hub = RecordingHub(root, tmp_path / "sent")
    L.seed_everything(0)
    model = make()
    # the plain run's data order: the node keeps the script's seed (seed_per_node=False)
    cb = DiLoCo(hub=hub, node_id="w0", inner_steps=h, sync="lockstep", delay=0, seed_per_node=False, **FAST)
    with running_master(root, tmp_path / "master", outer_lr=1.0, outer_momentum=0.0, outer_optimizer="nesterov"):
        trainer(steps, [cb], limit_train_batches=8).fit(model)
    sent = hub.sent()
    assert [d.header.base_outer_step for d in sent] == [0, 1, 2]
    if kind == "transformer":
        assert [d.header.num_tokens for d in sent] == [h * 4 * 9] * 3
        assert "head.weight" not in sent[0].tensors and "batches_seen" not in sent[0].tensors
    a, b = floating(plain), floating(model)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6), k
    assert cb.metrics["installs_total"] == 4  # outer step 0, then one per boundary


def test_gradient_accumulation_exports_once_per_h_optimizer_steps(tmp_path):
    root = tmp_path / "hub"
    hub = RecordingHub(root, tmp_path / "sent")
    log = MemLogger()
    L.seed_everything(0)
    cb = DiLoCo(hub=hub, node_id="w0", inner_steps=2, sync="lockstep", **FAST)
    with running_master(root, tmp_path / "master"):
        trainer(8, [cb], accumulate_grad_batches=3, logger=log).fit(BoringModel())
    assert len(hub.sent()) == 4
    assert [s for s, row in log.rows] == [2, 4, 6, 8]
    assert all(d.header.extra["phases"] == "1" for d in hub.sent())


class SameBatch(BoringModel):
    """BoringModel training on one fixed batch, without its per-epoch StepLR: where Lightning resumes in
    the data (it does not fast-forward a plain DataLoader, and re-runs a batch after an end-of-epoch
    checkpoint) then does not matter, so an interrupted run can be compared with a straight one."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 4), batch_size=4)


def test_kill_and_resume_gives_the_same_deltas(tmp_path):
    def run(name: str, stops: list[int]):
        root = tmp_path / name / "hub"
        hub = RecordingHub(root, tmp_path / name / "sent")
        ckdir = tmp_path / name / "ckpt"
        L.seed_everything(0)
        model = SameBatch()
        with running_master(root, tmp_path / name / "master"):
            ckpt = None
            for i, stop in enumerate(stops):  # each fit is a process that dies at `stop` (no final boundary)
                if i:
                    L.seed_everything(0)
                    model = SameBatch()  # a new process: a fresh model, restored from the checkpoint
                cb = DiLoCo(hub=hub, node_id="w0", inner_steps=3, sync="lockstep", **FAST)
                save = ModelCheckpoint(dirpath=ckdir, every_n_train_steps=16, save_top_k=-1)
                trainer(stop, [cb, save], enable_checkpointing=True).fit(model, ckpt_path=ckpt)
                ckpt = str(ckdir / "epoch=15-step=16.ckpt")
        return hub.sent(), floating(model)

    straight, w_straight = run("straight", [24])
    resumed, w_resumed = run("resumed", [17, 24])  # killed at step 17, mid-phase (boundaries at 15, 18)
    assert [d.header.local_step for d in resumed] == [d.header.local_step for d in straight] == list(range(1, 9))
    for a, b in zip(straight, resumed):
        assert a.header.base_outer_step == b.header.base_outer_step
        for k in a.tensors:
            assert torch.allclose(a.tensors[k], b.tensors[k], rtol=1e-6, atol=1e-7), (a.header.local_step, k)
    for k in w_straight:
        assert torch.allclose(w_straight[k], w_resumed[k], rtol=1e-6, atol=1e-7)


def test_lockstep_delay_2_staleness_is_exact(tmp_path):
    root = tmp_path / "hub"
    hub = RecordingHub(root, tmp_path / "sent")
    cb = DiLoCo(hub=hub, node_id="w0", inner_steps=2, sync="lockstep", delay=2, **FAST)
    L.seed_everything(0)
    with running_master(root, tmp_path / "master") as m:
        trainer(16, [cb]).fit(BoringModel())
        deadline = time.monotonic() + 60  # quick on a quiet machine; room for a loaded one
        while m.master.outer_step < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
    stale = {}
    for r in m.rounds:
        assert r.get("rejected", 0) == 0
        for ident in r.get("applied", []):
            stale[int(ident.split("/")[1])] = None
        hist = r.get("staleness_histogram") or {}
        if r.get("applied"):
            assert len(r["applied"]) == 1 and len(hist) == 1  # one delta per round
            stale[int(r["applied"][0].split("/")[1])] = int(next(iter(hist)))
    assert list(stale) == list(range(1, 9))
    assert [stale[r] for r in range(1, 9)] == [0, 1, 2, 2, 2, 2, 2, 2]  # exactly 2 once version 0 is 2 behind


def test_hub_outage_does_not_stop_training_and_every_delta_arrives(tmp_path):
    root = tmp_path / "hub"
    hub = RecordingHub(root, tmp_path / "sent")

    class Outage(Callback):
        def on_train_batch_end(self, trainer, *args):
            hub.down = 9 <= trainer.global_step < 21

    cb = DiLoCo(hub=hub, node_id="w0", inner_steps=4, **FAST)
    L.seed_everything(0)
    model = BoringModel()
    w0 = floating(model)
    # the plain mean (nesterov lr 1, momentum 0: no staleness gate, unlike fedavg's default)
    with running_master(root, tmp_path / "master", outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0) as m:
        t = trainer(32, [cb, Outage(), Slow(0.01)])
        t.fit(model)
        deadline = time.monotonic() + 60  # quick on a quiet machine; room for a loaded one
        while m.master.ledger.get("w0", -1) < hub.sent()[-1].local_step and time.monotonic() < deadline:
            time.sleep(0.02)
        final_global = m.master.snapshot()[1]
    assert t.global_step == 32
    assert cb.metrics["upload_failures_total"] >= 2
    sent = hub.sent()
    assert sum(int(d.header.extra["phases"]) for d in sent) == 8  # no phase lost, none counted twice
    assert any(int(d.header.extra["phases"]) >= 3 for d in sent)  # the outage's phases went out merged
    # lr=1, momentum=0: the global is w0 minus each round's mean delta (a round that found two of
    # w0's deltas averages them); every delta sent was applied once
    assert all(r.get("rejected", 0) == 0 for r in m.rounds)
    by_step = {d.header.local_step: d for d in sent}
    rounds = [[int(i.split("/")[1]) for i in r["applied"]] for r in m.rounds if r.get("applied")]
    assert sorted(s for r in rounds for s in r) == sorted(by_step)
    total = {k: sum(sum(by_step[s].tensors[k] for s in r) / len(r) for r in rounds) for k in w0}
    for k in w0:
        assert torch.allclose(final_global[k], w0[k] - total[k], atol=1e-5)
    _ = floating(model)


def test_arguments_are_validated_with_their_names(tmp_path):
    ok = dict(hub=str(tmp_path / "hub"), node_id="w0", inner_steps=4)
    for bad, name in (
        (dict(hub=""), "hub"),
        (dict(hub=3), "hub"),
        (dict(node_id="a/b"), "node_id"),
        (dict(inner_steps=0), "inner_steps"),
        (dict(inner_steps=2.5), "inner_steps"),
        (dict(sync="eventually"), "sync"),
        (dict(delay=-1), "delay"),
        (dict(delay=[1, 2], node_id="worker"), "node_index"),
        (dict(delta_dtype="int2"), "delta_dtype"),
        (dict(topk=0.0), "topk"),
        (dict(topk_values="int3"), "topk_values"),
        (dict(error_feedback="yes"), "error_feedback"),
        (dict(reset_inner_optimizer="yes"), "reset_inner_optimizer"),
        (dict(hub_options=[1]), "hub_options"),
        (dict(signing_key=""), "signing_key"),
        (dict(wait_timeout=0), "wait_timeout"),
        (dict(poll_interval="1"), "poll_interval"),
        (dict(token_counter=3), "token_counter"),
    ):
        with pytest.raises(ValueError, match=name):
            DiLoCo(**{**ok, **bad})
    DiLoCo(**ok, sync="lockstep", delay={"distribution": "uniform", "high": 4}, node_index=2)


def test_the_options_are_one_object_passed_whole(tmp_path):
    from diloco_lightning.worker.options import WorkerOptions

    opts = WorkerOptions(inner_steps=4, sync="lockstep", delay=1, delta_dtype="bf16")
    cb = DiLoCo(str(tmp_path / "hub"), "w0", options=opts)
    assert cb.options == DiLoCo(str(tmp_path / "hub"), "w0", 4, sync="lockstep", delay=1, delta_dtype="bf16").options
    assert cb.options.delta_dtype == "bfloat16" and opts.delta_dtype == "bf16"  # the caller's object is not changed
    with pytest.raises(TypeError, match="either options= or option keywords"):
        DiLoCo(str(tmp_path / "hub"), "w0", options=opts, sync="async")
    with pytest.raises(ValueError, match="sync"):
        DiLoCo(str(tmp_path / "hub"), "w0", options=WorkerOptions(sync="eventually"))


def test_sharded_strategies_are_refused():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    cb = DiLoCo(hub="/tmp/unused-hub", node_id="w0", inner_steps=4)
    with pytest.raises(ValueError, match="FSDPStrategy.*strategy='ddp'"):
        cb.setup(SimpleNamespace(strategy=FSDPStrategy()), BoringModel(), "fit")
    cb.setup(SimpleNamespace(strategy=DDPStrategy()), BoringModel(), "fit")


@pytest.mark.slow
def test_ddp_two_gloo_processes(tmp_path):
    """strategy='ddp', 2 CPU processes: one upload per boundary, identical weights on both ranks."""
    root = tmp_path / "hub"
    FileHub(root)
    script = Path(__file__).parent / "support" / "ddp_callback_script.py"
    with running_master(root, tmp_path / "master"):
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(
            [sys.executable, str(script), str(root), str(tmp_path / "out")],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    sent = sorted((tmp_path / "out" / "sent").glob("*.safetensors"))
    assert len(sent) == 3  # 12 steps, H=4: one upload per boundary, from rank 0 only
    r0 = torch.load(tmp_path / "out" / "rank0.pt")
    r1 = torch.load(tmp_path / "out" / "rank1.pt")
    assert r0.keys() == r1.keys()
    for k in r0:
        assert torch.equal(r0[k], r1[k]), k
    g = torch.load(tmp_path / "out" / "global.pt")
    for k in g:
        assert torch.equal(r0[k], g[k]), k  # lockstep: both ranks hold exactly the last installed version


def test_an_error_on_rank_0_is_raised_on_every_rank():
    cb = DiLoCo(hub="/tmp/unused-hub", node_id="w0", inner_steps=4)
    sent = []

    def broadcast(obj, src=0):
        sent.append(obj)
        return ("error", "WorkerError: the hub holds another model") if obj is None else obj

    other_rank = SimpleNamespace(is_global_zero=False, world_size=2, strategy=SimpleNamespace(broadcast=broadcast))
    with pytest.raises(RuntimeError, match="rank 0 failed: WorkerError: the hub holds another model"):
        cb._rank0(other_rank, lambda: pytest.fail("only rank 0 runs the worker"))
    rank0 = SimpleNamespace(is_global_zero=True, world_size=2, strategy=SimpleNamespace(broadcast=broadcast))
    with pytest.raises(KeyError):
        cb._rank0(rank0, lambda: {}["boom"])
    assert sent[-1][0] == "error" and "KeyError" in sent[-1][1]  # rank 0 told the others before raising


class AdamBoring(BoringModel):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def test_reset_inner_optimizer_clears_its_state_at_each_install(tmp_path):
    root = tmp_path / "hub"
    seen = []

    class Probe(Callback):
        def on_train_batch_end(self, trainer, *args):
            seen.append((trainer.global_step, len(trainer.optimizers[0].state)))

    cb = DiLoCo(hub=str(root), node_id="w0", inner_steps=3, sync="lockstep", reset_inner_optimizer=True, **FAST)
    with running_master(root, tmp_path / "master"):
        trainer(6, [cb, Probe()]).fit(AdamBoring())
    assert seen == [(1, 2), (2, 2), (3, 0), (4, 2), (5, 2), (6, 0)]
