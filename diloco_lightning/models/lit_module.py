"""``LlamaLightningModule``: next-token training of ``models.Llama`` with the inner optimizer.

Framework-thin on purpose: the model is a plain ``nn.Module`` at ``self.model``; this
module adds the loss, logging, the inner optimizer and its LR schedule. What DiLoCo does
between inner steps lives in the ``DiLoCo`` callback, not here.

Trainer options that matter here:

* ``precision="32-true"`` (fp32 weights), ``"bf16-mixed"`` (fp32 weights, bf16 autocast)
  or ``"bf16-true"`` (bf16 weights and optimizer state: half the memory, but updates
  smaller than bf16's resolution are rounded away). The loss is always computed from
  float32 logits.
* ``gradient_clip_val=1.0`` (with the default ``gradient_clip_algorithm="norm"``) clips
  the global gradient norm before each inner step; clipping is a Trainer feature, so it
  is not a parameter of this module.
* ``accumulate_grad_batches``: the schedule counts optimizer steps, not batches.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch

from diloco_lightning.models.llama import Llama, LlamaConfig, llama_config

log = logging.getLogger(__name__)

__all__ = ["LlamaLightningModule", "WarmupCosine", "build_inner_optimizer", "resolve_model_config", "OPTIMIZERS"]

OPTIMIZERS = ("adamw", "adamw8bit", "muon")


def resolve_model_config(model_config: LlamaConfig | Mapping[str, Any] | str) -> LlamaConfig:
    """A ``LlamaConfig`` from itself, a preset name, or a mapping of fields.

    A mapping may name a ``preset`` whose fields the other keys override, e.g.
    ``{"preset": "tiny", "vocab_size": 257}`` (handy in Hydra configs).
    """
    if isinstance(model_config, LlamaConfig):
        return model_config
    if isinstance(model_config, str):
        return llama_config(model_config)
    if isinstance(model_config, Mapping):
        d = dict(model_config)
        preset = d.pop("preset", None)
        return llama_config(preset, **d) if preset is not None else LlamaConfig.from_dict(d)
    raise ValueError(f"model_config must be a LlamaConfig, preset name or mapping, got {type(model_config).__name__}")


class WarmupCosine:
    """LR multiplier: linear warmup over ``warmup_steps``, cosine decay to ``min_lr_ratio`` at ``total_steps``.

    ``step`` counts optimizer steps from 0; multiplier is ``(step + 1) / warmup_steps``
    during warmup (never 0, so the first step already moves), ``min_lr_ratio`` after
    ``total_steps``. ``total_steps=None`` keeps the peak LR after warmup.
    """

    def __init__(self, warmup_steps: int, total_steps: int | None, min_lr_ratio: float) -> None:
        self.warmup_steps, self.total_steps, self.min_lr_ratio = warmup_steps, total_steps, min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.total_steps is None:
            return 1.0
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_inner_optimizer(
    name: str,
    param_groups: Sequence[dict[str, Any]],
    lr: float,
    betas: tuple[float, float],
    eps: float,
) -> torch.optim.Optimizer:
    """``"adamw"``: torch AdamW, fused kernel if the params' device/dtype support it, else foreach.
    ``"adamw8bit"``: ``bitsandbytes.optim.AdamW8bit`` (8-bit moments; also runs on CPU tensors).
    ``"muon"``: :class:`~diloco_lightning.models.muon.MuonAdamW`, Muon on the groups marked
    ``muon=True`` (2-D hidden weights), AdamW on the rest (MuLoCo's inner optimizer).
    """
    if name == "muon":
        from diloco_lightning.models.muon import MuonAdamW

        return MuonAdamW(param_groups, lr=lr, betas=betas, eps=eps)
    if name == "adamw":
        try:
            return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, fused=True)
        except (RuntimeError, ValueError, TypeError) as e:  # device/dtype without a fused kernel
            log.info("fused AdamW unavailable (%s); using foreach", e)
            return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, foreach=True)
    if name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except Exception as e:  # ImportError, or a broken native library
            raise ImportError(
                "optimizer='adamw8bit' needs bitsandbytes (pip install 'diloco-lightning[bnb]'); "
                f"importing it failed: {e}"
            ) from e
        return bnb.optim.AdamW8bit(param_groups, lr=lr, betas=betas, eps=eps)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {name!r}")


class LlamaLightningModule(L.LightningModule):
    """Causal LM training of a ``Llama``.

    Args:
        model_config: ``LlamaConfig``, preset name (``"tiny"``, ``"llama25m"``, ...) or mapping
            (see ``resolve_model_config``); its ``vocab_size`` must cover the data's ids.
        optimizer: inner optimizer, ``"adamw"``, ``"adamw8bit"`` or ``"muon"`` (Muon on the attention
            and MLP matrices, AdamW on the embedding / head and the gains: MuLoCo's).
        lr: peak learning rate.
        betas, eps: Adam coefficients.
        weight_decay: decoupled weight decay for matrices and the embedding (params with
            ``ndim >= 2``, as in nanoGPT); RMSNorm gains (1-D) are never decayed.
        warmup_steps: linear warmup length in optimizer steps.
        total_steps: end of the cosine decay; ``None`` uses ``Trainer(max_steps)`` (or the
            Trainer's estimate), and keeps the LR constant after warmup if neither is finite.
        min_lr_ratio: final LR as a fraction of ``lr``.

    Batches are ``(B, T + 1)`` token tensors (inputs ``[:, :-1]``, targets ``[:, 1:]``) or
    ``(inputs, targets)`` pairs. Logs ``train/loss``, ``train/lr``, ``train/tokens`` and
    ``val/loss``. ``tokens_seen`` counts input tokens of this process's training batches
    (micro-batches included) and is stored in checkpoints.
    """

    def __init__(
        self,
        model_config: LlamaConfig | Mapping[str, Any] | str = "tiny",
        *,
        optimizer: str = "adamw",
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        warmup_steps: int = 100,
        total_steps: int | None = None,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        cfg = resolve_model_config(model_config)
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise ValueError(f"lr must be a positive number, got {lr!r}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if not eps > 0:
            raise ValueError(f"eps must be positive, got {eps!r}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if total_steps is not None and (type(total_steps) is not int or total_steps < 1):
            raise ValueError(f"total_steps must be a positive int or None, got {total_steps!r}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
        # Plain values only (config as a dict): hparams.yaml stays readable, checkpoints load
        # with torch.load(weights_only=True), and load_from_checkpoint rebuilds the config.
        self.save_hyperparameters(
            {
                "model_config": cfg.to_dict(), "optimizer": optimizer, "lr": float(lr),
                "betas": tuple(float(b) for b in betas), "eps": float(eps), "weight_decay": float(weight_decay),
                "warmup_steps": warmup_steps, "total_steps": total_steps, "min_lr_ratio": float(min_lr_ratio),
            }
        )
        self.model_config = cfg
        self.model = Llama(cfg)
        self.tokens_seen = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V)."""
        return self.model(tokens)

    @staticmethod
    def inputs_targets(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(batch, (tuple, list)):
            x, y = batch
            return x, y
        return batch[:, :-1], batch[:, 1:]  # (B, T) each, from (B, T + 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = self.inputs_targets(batch)
        loss = self.model.loss(x, y)
        self.tokens_seen += x.numel()
        self.log("train/loss", loss, prog_bar=True, batch_size=x.shape[0])
        self.log("train/tokens", float(self.tokens_seen), batch_size=x.shape[0])
        if self._trainer is not None and self.trainer.optimizers:
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=x.shape[0])
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = self.inputs_targets(batch)
        loss = self.model.loss(x, y)
        self.log("val/loss", loss, prog_bar=True, on_epoch=True, sync_dist=True, batch_size=x.shape[0])
        return loss

    def _total_steps(self) -> int | None:
        hp: Any = self.hparams
        if hp.total_steps is not None:
            return hp.total_steps
        if self._trainer is None:
            return None
        if self.trainer.max_steps and self.trainer.max_steps > 0:
            return self.trainer.max_steps
        est = self.trainer.estimated_stepping_batches
        return int(est) if est is not None and math.isfinite(est) else None

    def configure_optimizers(self) -> Any:
        hp: Any = self.hparams
        decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.ndim < 2]
        groups: list[dict[str, Any]] = [
            {"params": decay, "weight_decay": hp.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        if hp.optimizer == "muon":  # Muon on the blocks' matrices; the embedding / head stay with AdamW
            hidden = [p for n, p in self.model.named_parameters()
                      if p.requires_grad and p.ndim == 2 and n.startswith("layers.")]
            ids = {id(p) for p in hidden}
            groups = [{"params": hidden, "weight_decay": hp.weight_decay, "muon": True},
                      {"params": [p for p in decay if id(p) not in ids], "weight_decay": hp.weight_decay},
                      groups[1]]
        opt = build_inner_optimizer(hp.optimizer, groups, hp.lr, tuple(hp.betas), hp.eps)
        total = self._total_steps()
        if total is None:
            log.warning("no total_steps and no finite Trainer max_steps: LR stays at peak after warmup")
        schedule = WarmupCosine(hp.warmup_steps, total, hp.min_lr_ratio)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokens_seen = int(checkpoint.get("tokens_seen", 0))
