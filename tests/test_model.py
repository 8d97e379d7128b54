"""Llama model (geometry, attention maths, init) and its LightningModule (real Trainer runs)."""

from __future__ import annotations

import importlib
import logging
import math
import sysconfig
from pathlib import Path

import lightning as L
import pytest
import torch

from diloco_lightning.models import MODEL_PRESETS, Llama, LlamaConfig, count_parameters, llama_config
from diloco_lightning.models.llama import Attention, rope_cos_sin

SMALL = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64)


# ----------------------------------------------------------------------------- geometry


def test_preset_parameter_counts_on_meta():
    counts = {name: count_parameters(Llama(cfg, device="meta")) for name, cfg in MODEL_PRESETS.items()}
    # Published totals: TinyLlama-1.1B and Llama-2-7B.
    assert counts["llama1b"] == 1_100_048_384
    assert f"{counts['llama1b']:.3g}" == "1.1e+09"
    assert counts["llama7b"] == 6_738_415_616
    assert f"{counts['llama7b']:.3g}" == "6.74e+09"
    assert 23.0e6 < counts["llama25m"] < 24.5e6
    assert counts["tiny"] < 2e6
    m = Llama(MODEL_PRESETS["llama7b"], device="meta")
    assert all(p.device.type == "meta" for p in m.parameters())


def test_tiny_preset_vocab_matches_default_tokenizer():
    from diloco_lightning.data import DEFAULT_VOCAB_SIZE

    assert MODEL_PRESETS["tiny"].vocab_size == DEFAULT_VOCAB_SIZE


def test_forward_shapes_and_loss():
    cfg = LlamaConfig(**SMALL)
    model = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, cfg.vocab_size) and logits.dtype == torch.float32
    loss = model.loss(tokens, tokens)
    assert loss.ndim == 0 and torch.isfinite(loss)
    # Near-uniform predictions at init: loss close to ln(V).
    assert abs(model.loss(tokens[:, :-1], tokens[:, 1:]).item() - math.log(cfg.vocab_size)) < 0.5
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, cfg.max_seq_len + 1, dtype=torch.long))


def test_causal():
    model = Llama(LlamaConfig(**SMALL))
    a = torch.randint(0, 97, (1, 12))
    b = a.clone()
    b[0, 8:] = (b[0, 8:] + 1) % 97  # change only the future
    with torch.no_grad():
        la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :8], lb[:, :8])
    assert not torch.allclose(la[:, 8:], lb[:, 8:])


# ----------------------------------------------------------------------------- attention


def reference_attention(attn: Attention, x: torch.Tensor, theta: float) -> torch.Tensor:
    """Loop-over-heads attention with an explicit causal mask and rotary embedding."""
    B, T, _ = x.shape
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = (x @ attn.wq.weight.T).view(B, T, H, D)
    k = (x @ attn.wk.weight.T).view(B, T, Hkv, D)
    v = (x @ attn.wv.weight.T).view(B, T, Hkv, D)

    def rope(t: torch.Tensor) -> torch.Tensor:  # rotate (t_i, t_{i+D/2}) by pos * theta^(-2i/D)
        out = t.clone()
        for pos in range(T):
            for i in range(D // 2):
                ang = pos * theta ** (-2 * i / D)
                c, s = math.cos(ang), math.sin(ang)
                a, b = t[:, pos, :, i], t[:, pos, :, i + D // 2]
                out[:, pos, :, i] = a * c - b * s
                out[:, pos, :, i + D // 2] = a * s + b * c
        return out

    q, k = rope(q), rope(k)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    heads = []
    for h in range(H):
        kv = h // (H // Hkv)  # query head h shares K/V head kv
        scores = q[:, :, h] @ k[:, :, kv].transpose(1, 2) / math.sqrt(D)  # (B, T, T)
        scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, :, kv])  # (B, T, D)
    return torch.cat(heads, dim=-1) @ attn.wo.weight.T


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_attention_matches_reference(n_kv_heads):
    cfg = LlamaConfig(**{**SMALL, "n_kv_heads": n_kv_heads})
    attn = Llama(cfg).layers[0].attention
    x = torch.randn(2, 7, cfg.d_model)
    cos, sin = rope_cos_sin(7, cfg.head_dim, cfg.rope_theta, x.device)
    with torch.no_grad():
        expected = reference_attention(attn, x, cfg.rope_theta)
        torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-4, atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = Llama(LlamaConfig(**SMALL))  # 4 query heads, 2 KV heads
    mha = Llama(LlamaConfig(**{**SMALL, "n_kv_heads": 4}))
    sd = gqa.state_dict()
    rep, D = 2, gqa.config.head_dim
    for name in list(sd):
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            w = sd[name].view(2, D, -1)  # (Hkv, D, C)
            sd[name] = w.repeat_interleave(rep, dim=0).reshape(4 * D, -1)  # (H * D, C)
    mha.load_state_dict(sd)
    tokens = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- init


def test_init_deterministic_and_independent_of_global_rng():
    cfg = LlamaConfig(**SMALL, seed=7)
    rng_before = torch.get_rng_state()
    a = Llama(cfg).state_dict()
    assert torch.equal(torch.get_rng_state(), rng_before), "init must not consume the global RNG"
    torch.manual_seed(12345)  # the global seed must not matter
    b = Llama(cfg).state_dict()
    c = Llama(LlamaConfig(**SMALL, seed=8)).state_dict()
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    matrices = [k for k in a if a[k].ndim == 2]
    assert all(not torch.equal(a[k], c[k]) for k in matrices)
    # Distinct tensors get distinct draws, and the stds follow the documented scheme.
    assert not torch.equal(a["layers.0.attention.wq.weight"][:8, :8], a["layers.1.attention.wq.weight"][:8, :8])
    assert torch.equal(a["norm.weight"], torch.ones(cfg.d_model))


def test_meta_init_then_materialise_matches_eager():
    cfg = LlamaConfig(**SMALL, seed=3)
    eager = Llama(cfg)
    lazy = Llama(cfg, device="meta")
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    lazy.init_weights()
    for (n, p), (_, q) in zip(eager.named_parameters(), lazy.named_parameters()):
        assert torch.equal(p, q), n
    # bf16 construction draws the same values, rounded.
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            half = Llama(cfg)
        finally:
            torch.set_default_dtype(torch.float32)
    assert half.tok_embeddings.weight.dtype == torch.bfloat16
    torch.testing.assert_close(half.tok_embeddings.weight.float(), eager.tok_embeddings.weight, rtol=1e-2, atol=1e-3)


def test_tied_embeddings_share_storage():
    tied = Llama(LlamaConfig(**SMALL, tie_embeddings=True))
    untied = Llama(LlamaConfig(**SMALL, tie_embeddings=False))
    assert tied.output is None
    assert tied.output_weight is tied.tok_embeddings.weight
    assert tied.output_weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    assert "output.weight" not in tied.state_dict()
    assert untied.output_weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()
    assert count_parameters(untied) - count_parameters(tied) == SMALL["vocab_size"] * SMALL["d_model"]
    # Editing the embedding changes the head: same tensor, not a copy.
    tokens = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        before = tied(tokens)
        tied.tok_embeddings.weight[3].mul_(3.0)
        assert not torch.allclose(before[..., 3], tied(tokens)[..., 3])
    # Both uses of the matrix receive gradient.
    tied.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    assert tied.tok_embeddings.weight.grad is not None


@pytest.mark.parametrize(
    "field, value",
    [("d_model", 0), ("n_heads", 3), ("n_kv_heads", 3), ("vocab_size", -5), ("norm_eps", 0.0), ("seed", -1),
     ("tie_embeddings", "yes"), ("init_std", -0.1)],
)
def test_config_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        LlamaConfig(**{**SMALL, field: value})


def test_presets_and_overrides():
    cfg = llama_config("tiny", vocab_size=257)
    assert cfg.vocab_size == 257 and cfg.d_model == MODEL_PRESETS["tiny"].d_model
    assert MODEL_PRESETS["tiny"].vocab_size != 257  # presets are not mutated
    with pytest.raises(ValueError, match="name"):
        llama_config("gpt5")
    with pytest.raises(ValueError, match="bogus"):
        llama_config("tiny", bogus=1)
    assert LlamaConfig.from_dict(cfg.to_dict()) == cfg


# ----------------------------------------------------------------------------- Lightning


def _write_corpus(root: Path, n_bytes: int = 300_000) -> str:
    """Copy some real text (stdlib modules) into ``root``; returns a glob pattern."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root.mkdir(parents=True, exist_ok=True)
    total = 0
    for name in ("argparse.py", "typing.py", "dataclasses.py", "textwrap.py", "functools.py", "enum.py", "pathlib.py"):
        if (stdlib / name).exists() and total < n_bytes:
            text = (stdlib / name).read_text(encoding="utf-8")
            (root / f"{name}.txt").write_text(text, encoding="utf-8")
            total += len(text)
    assert total > 50_000
    return str(root / "*.txt")


def _trainer(**kw):
    defaults = dict(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    return L.Trainer(**{**defaults, **kw})


class _LossRecorder(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def test_trainer_loss_goes_down(tmp_path, caplog):
    import time

    from diloco_lightning.data import TextDataModule
    from diloco_lightning.models.lit_module import LlamaLightningModule

    caplog.set_level(logging.INFO)
    dm = TextDataModule(
        text_files=_write_corpus(tmp_path / "text"), vocab_size=512, seq_len=64, batch_size=16,
        cache_dir=tmp_path / "cache",
    )
    module = LlamaLightningModule(
        llama_config("tiny", vocab_size=dm.vocab_size, max_seq_len=64), lr=3e-3, warmup_steps=3, weight_decay=0.01
    )
    assert module.hparams.model_config["vocab_size"] == 512
    rec = _LossRecorder()
    trainer = _trainer(
        max_steps=30, gradient_clip_val=1.0, callbacks=[rec],
        limit_val_batches=2, val_check_interval=30, check_val_every_n_epoch=None,
    )
    t0 = time.perf_counter()
    trainer.fit(module, dm)
    elapsed = time.perf_counter() - t0
    first, last = rec.losses[0], sum(rec.losses[-5:]) / 5
    logging.getLogger(__name__).info("tiny model: loss %.3f -> %.3f, %.1f steps/s", first, last, 30 / elapsed)
    assert len(rec.losses) == 30
    assert abs(first - math.log(512)) < 0.6
    assert last < first - 0.5, (first, last)
    assert module.tokens_seen == 30 * 16 * 64
    assert trainer.callback_metrics["train/tokens"].item() == 30 * 16 * 64
    assert "val/loss" in trainer.callback_metrics
    opt = trainer.optimizers[0]
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.1)  # cosine reached its floor at max_steps
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert all(p.ndim == 1 for p in opt.param_groups[1]["params"])


def _few_steps(tmp_path, **kw):
    from diloco_lightning.data import TextDataModule
    from diloco_lightning.models.lit_module import LlamaLightningModule

    precision = kw.pop("precision", "32-true")
    dm = TextDataModule(
        text_files=_write_corpus(tmp_path / "text", 60_000), tokenizer="byte", seq_len=32, batch_size=4,
        cache_dir=tmp_path / "cache",
    )
    module = LlamaLightningModule(dict(preset="tiny", vocab_size=dm.vocab_size, n_layers=2), warmup_steps=1, **kw)
    before = {n: p.detach().float().clone() for n, p in module.model.named_parameters()}
    rec = _LossRecorder()
    trainer = _trainer(max_steps=4, precision=precision, callbacks=[rec])
    trainer.fit(module, dm)
    assert len(rec.losses) == 4 and all(math.isfinite(x) for x in rec.losses)
    unchanged = [n for n, p in module.model.named_parameters() if torch.equal(before[n], p.detach().float())]
    # In bf16-true, RMSNorm gains (~1.0, bf16 spacing 2**-7) swallow updates of ~lr=3e-4: expected.
    assert not [n for n in unchanged if before[n].ndim >= 2], unchanged
    return module, trainer


def _bnb_import_error() -> str | None:
    try:
        importlib.import_module("bitsandbytes")
    except Exception as e:  # noqa: BLE001 - any failure means "not usable here"
        return f"bitsandbytes not importable: {e}"
    return None


@pytest.mark.skipif(_bnb_import_error() is not None, reason=str(_bnb_import_error()))
def test_adamw8bit_runs(tmp_path):
    import bitsandbytes as bnb

    _, trainer = _few_steps(tmp_path, optimizer="adamw8bit")
    assert isinstance(trainer.optimizers[0], bnb.optim.AdamW8bit)


def test_bf16_true_runs(tmp_path):
    module, trainer = _few_steps(tmp_path, precision="bf16-true")
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())


def test_bf16_mixed_runs(tmp_path):
    module, _ = _few_steps(tmp_path, precision="bf16-mixed")
    assert all(p.dtype == torch.float32 for p in module.parameters())


def test_lit_module_validation_and_schedule():
    from diloco_lightning.models.lit_module import LlamaLightningModule, WarmupCosine, build_inner_optimizer

    with pytest.raises(ValueError, match="optimizer"):
        LlamaLightningModule(SMALL, optimizer="sgd")
    with pytest.raises(ValueError, match="lr"):
        LlamaLightningModule(SMALL, lr=0)
    with pytest.raises(ValueError, match="model_config"):
        LlamaLightningModule(42)
    with pytest.raises(ValueError, match="optimizer"):
        build_inner_optimizer("lion", [{"params": [torch.nn.Parameter(torch.zeros(2))]}], 1e-3, (0.9, 0.95), 1e-8)
    s = WarmupCosine(warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert s(0) == pytest.approx(0.1) and s(9) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.55) and s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)
    assert WarmupCosine(0, None, 0.1)(10**6) == 1.0
    m = LlamaLightningModule({"preset": "tiny", "vocab_size": 300, "n_layers": 1})
    assert m.model.config.vocab_size == 300 and m.hparams.model_config["n_layers"] == 1
