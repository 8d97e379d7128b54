"""``optim.name=muon``: Muon on the blocks' matrices, AdamW on the rest (MuLoCo's inner optimizer)."""

from __future__ import annotations

import math

import pytest
import torch

from diloco_lightning.models.lit_module import LlamaLightningModule
from diloco_lightning.models.muon import MUON_MOMENTUM, MuonAdamW, orthogonalize

SMALL = {"preset": "tiny", "d_model": 32, "n_layers": 2, "ffn_hidden": 64, "n_heads": 2, "n_kv_heads": 1, "vocab_size": 257}


@pytest.mark.parametrize("shape", [(8, 8), (16, 6), (6, 16)])
def test_orthogonalize_lands_the_singular_values_near_one_keeping_the_singular_vectors(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    o = orthogonalize(g)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    so = torch.linalg.svdvals(o)
    assert so.min() > 0.6 and so.max() < 1.25  # Newton-Schulz's quintic: ~[0.7, 1.2], not exactly 1
    # the same singular vectors: o = U diag(f(s)) V^T
    torch.testing.assert_close(o, u @ torch.diag(torch.diag(u.T @ o @ vh.T)) @ vh, rtol=0, atol=1e-4)
    torch.testing.assert_close(orthogonalize(3.0 * g), o, rtol=0, atol=1e-5)  # scale-free


def test_the_muon_step_by_hand_and_the_adamw_groups_are_adamw():
    gen = torch.Generator().manual_seed(1)
    w0, b0 = torch.randn(6, 4, generator=gen), torch.randn(4, generator=gen)
    w, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
    bref = torch.nn.Parameter(b0.clone())
    lr, wd = 0.01, 0.1
    opt = MuonAdamW([{"params": [w], "muon": True, "weight_decay": wd}, {"params": [b], "weight_decay": wd}], lr=lr)
    ref = torch.optim.AdamW([bref], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    grads = [torch.randn(6, 4, generator=gen) for _ in range(3)]
    gbs = [torch.randn(4, generator=gen) for _ in range(3)]
    want, buf = w0.clone(), torch.zeros(6, 4)
    for g, gb in zip(grads, gbs):
        w.grad, b.grad, bref.grad = g.clone(), gb.clone(), gb.clone()
        opt.step()
        ref.step()
        buf = MUON_MOMENTUM * buf + g
        want = want * (1 - lr * wd) - lr * 0.2 * math.sqrt(6) * orthogonalize(g + MUON_MOMENTUM * buf)
    torch.testing.assert_close(w.detach(), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(b.detach(), bref.detach(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="2-D"):
        MuonAdamW([{"params": [b], "muon": True}])


def test_the_module_gives_muon_the_blocks_matrices_and_adamw_the_embedding_and_gains():
    m = LlamaLightningModule(SMALL, optimizer="muon", total_steps=10)
    opt = m.configure_optimizers()["optimizer"]
    assert isinstance(opt, MuonAdamW)
    names = {id(p): n for n, p in m.model.named_parameters()}
    muon = {names[id(p)] for g in opt.param_groups if g["muon"] for p in g["params"]}
    rest = {names[id(p)] for g in opt.param_groups if not g["muon"] for p in g["params"]}
    assert muon == {n for n, p in m.model.named_parameters() if p.ndim == 2 and n.startswith("layers.")}
    assert "tok_embeddings.weight" in rest and muon.isdisjoint(rest) and len(muon | rest) == len(names)
    x = torch.randint(0, 257, (2, 9))
    loss0 = m.model.loss(x[:, :-1], x[:, 1:])
    for _ in range(5):
        opt.zero_grad()
        m.model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
    assert m.model.loss(x[:, :-1], x[:, 1:]) < loss0


def test_train_py_accepts_optim_name_muon():
    from hydra import compose, initialize_config_dir

    from diloco_lightning.app.config import CONFIG_DIR, ConfigError, register_configs, validate

    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        validate(compose("train", overrides=["recipe=tiny", "launch=sim", "optim.name=muon"]))
        group = compose("train", overrides=["recipe=tiny", "launch=sim", "optim=muon"])  # configs/optim/muon.yaml
        validate(group)
        assert group.optim.name == "muon" and group.optim.lr == 0.032
        with pytest.raises(ConfigError, match="muon"):
            validate(compose("train", overrides=["recipe=tiny", "launch=sim", "optim.name=sgd"]))
