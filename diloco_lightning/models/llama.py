"""A Llama-style decoder-only transformer in one readable file.

Pieces (as in Llama 2 / TinyLlama): token embedding -> ``n_layers`` pre-norm blocks of
[RMSNorm -> grouped-query attention with rotary embeddings] + [RMSNorm -> SwiGLU MLP]
-> final RMSNorm -> linear head (optionally tied to the embedding). No biases anywhere.

Shapes in comments use B = batch, T = sequence length, C = d_model, H = query heads,
Hkv = key/value heads, D = head dim (C // H), V = vocab size, F = ffn hidden size.

Initialisation is a pure function of ``config.seed`` and each parameter's name, drawn
from a private CPU ``torch.Generator``: it never touches the global RNG, gives the same
weights on every device and dtype, and lets a model be built on the ``meta`` device,
moved with ``to_empty`` and initialised later (``init_weights``) -- which is how the
1B/7B geometries are instantiated without allocating memory twice.
"""

from __future__ import annotations

import logging
import math
import zlib
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

__all__ = [
    "LlamaConfig",
    "Llama",
    "MODEL_PRESETS",
    "llama_config",
    "count_parameters",
]

# F.scaled_dot_product_attention(enable_gqa=...) exists from torch 2.5; before that we
# expand the K/V heads ourselves (same maths, more memory).
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


# ----------------------------------------------------------------------------- config


@dataclass
class LlamaConfig:
    """Model geometry and init. Defaults are the ``tiny`` preset (CPU-trainable)."""

    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 344
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive number, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"LlamaConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"LlamaConfig.seed must be a non-negative int, got {self.seed!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(f"LlamaConfig.n_heads ({self.n_heads}) must divide d_model ({self.d_model})")
        if (self.d_model // self.n_heads) % 2 != 0:
            raise ValueError(
                f"LlamaConfig.n_heads: head dim d_model/n_heads = {self.d_model // self.n_heads} must be even (RoPE)"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"LlamaConfig.n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def parameter_count(self) -> int:
        """Parameters of a model of this geometry, from the config alone (nothing is built):
        embedding V*C; per block wq, wo (C*C each), wk, wv (C*Hkv*D each), w1, w2, w3 (C*F each)
        and two RMSNorm gains; the final norm; the output head V*C unless tied."""
        c, kv = self.d_model, self.n_kv_heads * self.head_dim
        per_block = 2 * c * c + 2 * c * kv + 3 * c * self.ffn_hidden + 2 * c
        head = 0 if self.tie_embeddings else self.vocab_size * c
        return self.vocab_size * c + self.n_layers * per_block + c + head

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """Build from a mapping; unknown keys raise ValueError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"LlamaConfig: unknown field(s) {unknown}")
        return cls(**d)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A named geometry from ``MODEL_PRESETS`` with fields overridden (e.g. ``vocab_size``)."""
        return llama_config(name, **overrides)


# Named geometries. Parameter counts (tied embeddings counted once):
#   tiny     ~1.25M  (0.73M without the 4096x128 embedding) - trains on a laptop CPU in minutes
#   llama25m ~23.5M  (d=320, 6 layers, tied, GPT-2-sized 50k vocab padded to a multiple of 64)
#   llama1b  1.10B   TinyLlama-1.1B geometry (GQA 32q/4kv heads, untied)
#   llama7b  6.74B   Llama-2-7B geometry (full multi-head attention, untied)
MODEL_PRESETS: dict[str, LlamaConfig] = {
    # vocab 4096 == diloco_lightning.data.DEFAULT_VOCAB_SIZE (the default stdlib BPE tokenizer).
    "tiny": LlamaConfig(),
    "llama25m": LlamaConfig(
        vocab_size=50304, d_model=320, n_layers=6, n_heads=5, n_kv_heads=5, ffn_hidden=864,
        max_seq_len=1024, tie_embeddings=True,
    ),
    "llama1b": LlamaConfig(
        vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_hidden=5632,
        max_seq_len=2048, tie_embeddings=False,
    ),
    "llama7b": LlamaConfig(
        vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden=11008,
        max_seq_len=4096, tie_embeddings=False,
    ),
}


def llama_config(name: str, **overrides: Any) -> LlamaConfig:
    """Copy of preset ``name`` with ``overrides`` applied (validated again)."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"name: unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    known = {f.name for f in fields(LlamaConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"LlamaConfig: unknown field(s) {unknown}")
    return replace(MODEL_PRESETS[name], **overrides)


# ----------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    """x / rms(x) * weight. Statistics in float32 so bf16 activations stay stable."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables, each (T, D), float32.

    Computed per forward rather than stored as buffers: it costs T*D/2 multiplies, keeps
    the state_dict free of derived tensors, and stays correct after meta-device init.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))  # (D/2,)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)  # (T,)
    freqs = torch.outer(t, inv_freq)  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D): same angle for dims i and i + D/2
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+D/2}) by position-dependent angles; x is (B, h, T, D).

    The "rotate half" pairing (rather than adjacent pairs) matches Hugging Face Llama
    checkpoints, so TinyLlama / Llama-2 weights load without permuting q/k projections.
    """
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)  # (B, h, T, D/2) each
    rotated = torch.cat((-x2, x1), dim=-1)  # (B, h, T, D)
    return (xf * cos + rotated * sin).type_as(x)  # cos/sin (T, D) broadcast over B, h


class Attention(nn.Module):
    """Causal grouped-query attention: H query heads share Hkv key/value heads (H % Hkv == 0)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_heads == self.n_heads:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        elif _SDPA_HAS_GQA:
            # Query head h reads K/V head h // (H / Hkv), i.e. repeat_interleave semantics.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, T, D)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, C)
        return self.wo(y)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). Three matrices, hence F ~ 8/3 C rather than 4 C."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, F) -> (B, T, C)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)  # (B, T, C)
        return x + self.feed_forward(self.ffn_norm(x))  # (B, T, C)


# ----------------------------------------------------------------------------- model


class Llama(nn.Module):
    """Llama decoder. ``forward(tokens) -> logits``; ``loss(tokens, targets)`` for training.

    Args:
        config: geometry and seed.
        device: where to allocate. ``"meta"`` allocates nothing and skips init (call
            ``to_empty(device=...)`` then ``init_weights()`` later). ``None`` uses torch's
            current default device.
    """

    def __init__(self, config: LlamaConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        target = torch.device(device) if device is not None else torch.get_default_device()
        # Build on meta so nn.Linear/nn.Embedding do not run their own (global-RNG) init:
        # it would be thrown away, cost seconds at 7B, and perturb the caller's RNG stream.
        with torch.device("meta"):
            self.tok_embeddings = nn.Embedding(config.vocab_size, config.d_model)
            self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.norm = RMSNorm(config.d_model, config.norm_eps)
            # Tied: the head *is* the embedding matrix, used functionally in forward, so there
            # is exactly one Parameter (no re-tying needed after .to_empty / load_state_dict).
            self.output = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        if target.type != "meta":
            self.to_empty(device=target)
            self.init_weights()

    @property
    def output_weight(self) -> torch.Tensor:
        """The (V, C) matrix that maps hidden states to logits."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise every parameter deterministically from ``seed`` (default ``config.seed``).

        Each tensor gets its own CPU generator seeded from (seed, crc32(name)), so values
        do not depend on device, dtype, parameter order or the global RNG. Scheme (GPT-2 /
        nanoGPT): N(0, init_std) for embeddings and matrices, N(0, init_std / sqrt(2 L))
        for the two residual-output projections (wo, w2) so the residual stream's variance
        does not grow with depth, ones for RMSNorm gains.
        """
        seed = self.config.seed if seed is None else seed
        std = self.config.init_std
        resid_std = std / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            g = torch.Generator(device="cpu")
            g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
            s = resid_std if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else std
            w = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, s, generator=g)
            p.copy_(w)  # casts to p.dtype / moves to p.device

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, V) in the model's dtype."""
        B, T = tokens.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds LlamaConfig.max_seq_len={self.config.max_seq_len}")
        cos, sin = rope_cos_sin(T, self.config.head_dim, self.config.rope_theta, tokens.device)  # (T, D) each
        x = self.tok_embeddings(tokens)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.norm(x)  # (B, T, C)
        return F.linear(x, self.output_weight)  # (B, T, V)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; logits upcast to float32 for a stable log-softmax."""
        logits = self(tokens)  # (B, T, V)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        return count_parameters(self, exclude_embeddings=exclude_embeddings)


def count_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Unique parameter count (a tied matrix counts once); works on the meta device.

    ``exclude_embeddings`` subtracts the input embedding matrix (not an untied output head).
    """
    n = sum(p.numel() for p in model.parameters())
    if exclude_embeddings and isinstance(model, Llama):
        n -= model.tok_embeddings.weight.numel()
    return n
