"""Muon for the hidden matrices, AdamW for the rest: ``optim.name=muon`` (MuLoCo, arXiv 2505.23725).

Muon (Jordan et al. 2024) keeps a momentum of each 2-D weight's gradient and steps along its
orthogonalised form (the nearest semi-orthogonal matrix, ``U V^T`` of its SVD, approximated by
five quintic Newton-Schulz iterations). MuLoCo uses it as DiLoCo's inner optimizer. Here:

* the parameters of a group with ``muon=True`` (the model's 2-D hidden weights: attention and MLP
  matrices; never the embedding / output head) take Muon's step: Nesterov momentum ``mu`` (0.95),
  the orthogonalised update scaled by ``0.2 * sqrt(max(rows, cols))`` (Moonlight, arXiv 2502.16982:
  the update's RMS matches AdamW's, ~0.2, so the same ``lr`` and ``weight_decay`` serve both), and
  decoupled weight decay;
* the others (the embedding, RMSNorm gains) take AdamW's step with the group's betas and eps.

One optimizer object, so the product's schedule (``LambdaLR``), clipping, checkpoints and the
simulator's inner loop treat it as they treat AdamW.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["MUON_MOMENTUM", "MuonAdamW", "orthogonalize"]

#: Muon's momentum (Keller Jordan's and MuLoCo's 0.95), Nesterov
MUON_MOMENTUM = 0.95
#: the quintic Newton-Schulz coefficients (Jordan et al.): fast convergence of singular values to ~1
_NS = (3.4445, -4.7750, 2.0315)


def orthogonalize(g: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """An approximation of ``U V^T`` for ``g = U S V^T`` (2-D), by ``steps`` quintic Newton-Schulz
    iterations in FP32 (the singular values land in about [0.7, 1.2], which is what Muon needs)."""
    if g.ndim != 2:
        raise ValueError(f"orthogonalize needs a matrix, got shape {tuple(g.shape)}")
    a, b, c = _NS
    x = g.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * (s @ s)) @ x
    return (x.T if tall else x).to(g.dtype)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups with ``muon=True``, AdamW on the others (see the module docstring).

    Args:
        params: parameter groups (dicts with ``params`` and optionally ``muon``, ``weight_decay``, ``lr``).
        lr: the peak learning rate of both (Muon's scaled to AdamW's update RMS).
        betas, eps: AdamW's, for the non-Muon groups.
        weight_decay: decoupled, ``p *= 1 - lr * weight_decay`` (a group's own value wins).
        momentum: Muon's Nesterov momentum.
        ns_steps: Newton-Schulz iterations.
    """

    def __init__(self, params: Iterable[Any], lr: float = 3e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, momentum: float = MUON_MOMENTUM, ns_steps: int = 5) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr!r}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, muon=False, momentum=momentum,
                        ns_steps=ns_steps)
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("MuonAdamW: a muon=True group holds only 2-D weights")

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if group["muon"]:
                    mu = group["momentum"]
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    buf = state["momentum_buffer"]
                    buf.mul_(mu).add_(g)
                    update = orthogonalize(g.add(buf, alpha=mu), group["ns_steps"])
                    scale = 0.2 * math.sqrt(max(p.shape))
                    p.mul_(1.0 - lr * wd)
                    p.add_(update, alpha=-lr * scale)
                    continue
                b1, b2 = group["betas"]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(g, 1.0 - b1)
                v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                denom = (v / (1.0 - b2 ** t)).sqrt_().add_(group["eps"])
                p.mul_(1.0 - lr * wd)
                p.addcdiv_(m, denom, value=-lr / (1.0 - b1 ** t))
        return loss
