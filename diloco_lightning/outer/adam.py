"""Adam-family outer optimizers: CGAD, Adam-Decay and plain Adam.

CGAD (Cosine-Gated Adam-Decay; Shah & Sun 2026, arXiv 2605.09126) gates the pseudo-gradient by
staleness before it enters Adam's moments, then takes a bias-corrected Adam step (``t`` counts
steps taken)::

    g = gate(tau) * delta
    m = b1*m + (1-b1)*g
    v = b2*v + (1-b2)*g*conj(g)
    state -= lr * (m / (1-b1**t)) / (sqrt(v / (1-b2**t)) + eps)

with ``gate(tau) = 0.5*(1 + cos(pi*tau/tau_cut)) * exp(-alpha*tau)`` on ``[0, tau_cut]``, 0 beyond
(:func:`~diloco_lightning.outer.gates.cgad_gate`). A step whose gate is 0 changes nothing (not
the state, not m, v or t) and returns ``False``. :class:`AdamDecay` drops the cosine cut
(``gate = exp(-alpha*tau)``); :class:`OuterAdam` (``"adam"``) is ``alpha = 0``: plain Adam, equal to
``torch.optim.Adam`` fed ``grad = g`` (DiLoCo's outer-Adam ablation, arXiv 2311.08105).

Implementation: one fused Adam call (``kernels.adam_step_``) per batch of tensors, so a step reads the state,
delta, m and v once and writes state, m and v once, like ``torch.optim.Adam(fused=True)``. The
gate is folded into the kernel's scalars instead of scaling the delta (the kernel's
``grad_scale`` would write the scaled gradient back into the caller's delta and costs an extra
pass): the moments are stored normalised, ``m = exp_avg_scale * M`` and
``v = exp_avg_sq_scale * V``, with scalar scales ``a`` and ``b`` that start at 0 and follow
``a' = b1*a + (1-b1)*s`` and ``b' = b2*b + (1-b2)*s**2`` for a gate ``s``. The kernel then runs with
``beta1' = b1*a/a'``, ``beta2' = b2*b/b'`` (so ``M' = beta1'*M + (1-beta1')*g`` holds
``m' = a'*M'`` up to rounding), its own bias correction switched off (a huge step count), and the
learning rate and eps rescaled so that its ``lr'*M'/(sqrt(V') + eps')`` is the update above.
The step count ``t`` and the scales are kept per key (``state_dict()``: ``keys``, ``steps``,
``exp_avg_scales``, ``exp_avg_sq_scales``; ``step`` counts the steps applied).
Complex keys (``v`` real, ``g*conj(g)``) take a plain in-place path with the same scalars.

``state_layout="naive"`` keeps ``m`` and ``v`` themselves as the buffers, which the gated delta
``gate * g`` enters directly (the layout of ``torch.optim.Adam`` and of the CGAD paper's master):
the same update in exact arithmetic, but in a low-precision buffer (``state_dtype="bfloat16"`` or
``"int8"``) a small ``gate * g`` meets the buffer's own resolution there, which the scaled layout's
FP32 scalars keep away from it. It exists to test that mechanism (docs/study.md); ``"scaled"`` is
the default.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from diloco_lightning.outer.base import (
    OuterOptimizer,
    check_betas,
    check_int,
    check_real,
)
from diloco_lightning.outer.gates import cgad_gate, check_staleness, exp_gate
from diloco_lightning.outer.kernels import adam_step_
from diloco_lightning.outer.work import Item, Work

__all__ = ["CGAD", "STATE_LAYOUTS", "AdamDecay", "OuterAdam", "adam_kernel_constants"]

#: ``scaled``: normalised moments with FP32 scales (the default); ``naive``: m and v themselves
STATE_LAYOUTS = ("scaled", "naive")

logger = logging.getLogger(__name__)

# Largest beta handed to the kernel: keeps 1 - beta**step == 1 for the "huge" step count below.
_BETA_MAX = 1.0 - 2.0**-52
# Step count that switches the kernel's bias correction off: 1 - beta**1e30 == 1 for beta < 1.


def adam_kernel_constants(
    betas: tuple[float, float],
    lr: float,
    eps: float,
    step: int,
    exp_avg_scale: float,
    exp_avg_sq_scale: float,
    gate: float,
) -> tuple[float, float, float, float, float, float]:
    """Kernel scalars for one Adam step on ``gate * g`` with normalised moments.

    Returns ``(beta1', beta2', lr', eps', exp_avg_scale', exp_avg_sq_scale')`` (see the module
    docstring); ``step`` is the bias-correction count of this step (``t`` after incrementing).
    """
    beta1, beta2 = betas
    a, b = exp_avg_scale, exp_avg_sq_scale
    a_new = beta1 * a + (1.0 - beta1) * gate
    b_new = beta2 * b + (1.0 - beta2) * gate * gate
    kernel_beta1 = min(beta1 * a / a_new, _BETA_MAX)
    kernel_beta2 = min(beta2 * b / b_new, _BETA_MAX)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    root = math.sqrt(b_new / bias_correction2)
    kernel_lr = lr * (a_new / bias_correction1) / root
    kernel_eps = eps / root
    return kernel_beta1, kernel_beta2, kernel_lr, kernel_eps, a_new, b_new


def check_cgad_gate_args(alpha: Any, tau_cut: Any) -> tuple[float, float]:
    """The CGAD gate's ``alpha >= 0`` and ``tau_cut > 0``, checked; an integral ``tau_cut`` comes
    back as an int (as the options record it). Shared by :class:`CGAD` and PA-CGAD."""
    alpha = check_real("alpha", alpha, low=0.0)
    tau_cut_f = check_real("tau_cut", tau_cut, low=0.0, low_open=True)
    return alpha, (int(tau_cut) if float(tau_cut).is_integer() else tau_cut_f)


class AdamBase(OuterOptimizer):
    """Bias-corrected Adam on gated pseudo-gradients; subclasses choose the gate.

    Step counts and moment scales are kept per key, so a key a delta does not carry is left
    exactly as it was (like a parameter without a gradient in ``torch.optim.Adam``).
    """

    BUFFERS: ClassVar[dict[str, bool]] = {"exp_avg": True, "exp_avg_sq": False}
    KEY_SCALARS: ClassVar[dict[str, tuple[str, Any]]] = {
        "steps": ("count", 0),
        "exp_avg_scales": ("scale", 0.0),
        "exp_avg_sq_scales": ("scale", 0.0),
    }
    STATE_KINDS: ClassVar[tuple[str, ...]] = ("cgad", "adam_decay", "adam")
    NONNEGATIVE = frozenset({"exp_avg_sq"})

    def __init__(
        self,
        state: Mapping[str, Tensor],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        extra_options: dict[str, Any],
        state_layout: str = "scaled",
    ) -> None:
        lr = check_real("lr", lr, low=0.0, low_open=True)
        betas = check_betas(betas)
        eps = check_real("eps", eps, low=0.0, low_open=True)
        if state_layout not in STATE_LAYOUTS:
            raise ValueError(f"state_layout must be one of {list(STATE_LAYOUTS)}, got {state_layout!r}")
        naive = state_layout == "naive"
        options = {"lr": lr, "betas": list(betas), "eps": eps, **extra_options}
        if naive:
            options["state_layout"] = "naive"
        super().__init__(state, options, key_scalars={"steps": ("count", 0)} if naive else None)
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.naive = naive
        self._t = 0

    def _apply(self, items: list[Item], tau: float, gated: bool, fragment: str | None) -> bool:
        gate = self.gate(tau)
        if gate == 0.0:
            return False
        (self._naive_update if self.naive else self._adam_update)(items, 1.0 if gated else gate)
        self._t += 1
        return True

    def _naive_update(self, items: list[Item], gate: float) -> None:
        """One Adam step with ``gate * delta`` entering ``m`` and ``v`` as they are (no scales): the
        kernel's lr and eps carry the bias correction, ``lr*sqrt(bc2)/bc1`` and ``eps*sqrt(bc2)``."""
        beta1, beta2 = self.betas
        steps: dict[str, int] = {}

        def fn(batch: list[Work]) -> None:
            for (t,), works in self._group(batch, ("steps",)).items():
                root = math.sqrt(1.0 - beta2 ** (t + 1))
                lr, eps = self.lr * root / (1.0 - beta1 ** (t + 1)), self.eps * root
                grads = [w.g if gate == 1.0 else w.g * gate for w in works]  # a scaled copy: w.g is the caller's
                real = [(w, g) for w, g in zip(works, grads) if not w.is_complex]
                if real:
                    adam_step_([w.p for w, _ in real], [g for _, g in real], [w.bufs["exp_avg"] for w, _ in real],
                               [w.bufs["exp_avg_sq"] for w, _ in real], lr=lr, beta1=beta1, beta2=beta2, eps=eps)
                for w, g in zip(works, grads):
                    if w.is_complex:
                        self._complex_update(w, beta1, beta2, lr, eps, g)
                    steps[w.key] = t + 1

        self._run(items, fn)
        self._key_scalars["steps"].update(steps)

    def _adam_update(self, items: list[Item], gate: float) -> None:
        """One Adam step on ``gate * delta`` for ``items`` (each key's own step count and scales)."""
        names = ("steps", "exp_avg_scales", "exp_avg_sq_scales")
        updates: dict[str, tuple[int, float, float]] = {}

        def fn(batch: list[Work]) -> None:
            for (t, a, b), works in self._group(batch, names).items():
                beta1, beta2, lr, eps, a_new, b_new = adam_kernel_constants(
                    self.betas, self.lr, self.eps, t + 1, a, b, gate
                )
                real = [w for w in works if not w.is_complex]
                if real:
                    adam_step_(
                        [w.p for w in real],
                        [w.g for w in real],
                        [w.bufs["exp_avg"] for w in real],
                        [w.bufs["exp_avg_sq"] for w in real],
                        lr=lr,
                        beta1=beta1,
                        beta2=beta2,
                        eps=eps,
                    )
                for w in works:
                    if w.is_complex:
                        self._complex_update(w, beta1, beta2, lr, eps)
                    updates[w.key] = (t + 1, a_new, b_new)

        self._run(items, fn)
        for key, values in updates.items():
            for name, value in zip(names, values):
                self._key_scalars[name][key] = value

    @staticmethod
    def _complex_update(w: Work, beta1: float, beta2: float, lr: float, eps: float, g: Tensor | None = None) -> None:
        # v accumulates g*conj(g) = |g|^2 (real); m is complex. Same normalised scalars as the kernel.
        g = w.g if g is None else g
        exp_avg = torch.view_as_complex(w.bufs["exp_avg"])
        exp_avg_sq = w.bufs["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(torch.view_as_complex(g), alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).add_(g.square().sum(-1), alpha=1.0 - beta2)
        denom = exp_avg_sq.sqrt().add_(eps).unsqueeze(-1)
        w.p.addcdiv_(w.bufs["exp_avg"], denom, value=-lr)

    # ------------------------------------------------------------------ state
    def _scalar_state(self) -> dict[str, Any]:
        return {"step": self._t, **({"state_layout": "naive"} if self.naive else {})}

    def _check_scalar_state(self, scalars: dict[str, Any]) -> dict[str, Any]:
        layout = scalars.pop("state_layout", "scaled")
        if layout != ("naive" if self.naive else "scaled"):
            raise ValueError(f"the {self.name} state_dict was saved with state_layout={layout!r}; this optimizer uses "
                             f"{'naive' if self.naive else 'scaled'}")
        unexpected = sorted(set(scalars) - {"step"})
        if unexpected:
            raise ValueError(f"unexpected entries in {self.name} state_dict: {unexpected}")
        return {"step": check_int("step", scalars.get("step", 0), low=0)}

    def _set_scalar_state(self, scalars: dict[str, Any]) -> None:
        self._t = scalars["step"]

    @property
    def steps_taken(self) -> int:
        """``t``: the Adam steps applied (fully gated steps do not count)."""
        return self._t


class CGAD(AdamBase):
    """Cosine-Gated Adam-Decay (Shah & Sun 2026, arXiv 2605.09126).

    Args:
        state: the global state (its floating keys get zero ``exp_avg``/``exp_avg_sq`` buffers).
        lr: outer learning rate.
        betas: Adam's ``(beta1, beta2)``, each in ``[0, 1)``.
        eps: Adam's epsilon, ``> 0``.
        alpha: decay rate of the gate's exponential, ``>= 0`` (paper default 0.2).
        tau_cut: staleness at and beyond which the gate is 0, ``> 0`` (paper default 32).
        state_layout: ``"scaled"`` (default) or ``"naive"`` (m and v themselves; see the module docstring).
    """

    name = "cgad"

    def __init__(
        self,
        state: Mapping[str, Tensor],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        alpha: float = 0.2,
        tau_cut: float = 32,
        state_layout: str = "scaled",
    ) -> None:
        alpha, tau_cut = check_cgad_gate_args(alpha, tau_cut)
        super().__init__(state, lr, betas, eps, {"alpha": alpha, "tau_cut": tau_cut}, state_layout)
        self.alpha = alpha
        self.tau_cut = tau_cut

    def gate(self, staleness: float) -> float:
        """``0.5*(1 + cos(pi*tau/tau_cut)) * exp(-alpha*tau)`` for ``tau <= tau_cut``, else 0."""
        return cgad_gate(staleness, self.alpha, self.tau_cut)


class AdamDecay(AdamBase):
    """Adam-Decay: CGAD without the cosine cut, ``gate = exp(-alpha*tau)`` (arXiv 2605.09126).

    Args: as :class:`CGAD`, without ``tau_cut``.
    """

    name = "adam_decay"

    def __init__(
        self,
        state: Mapping[str, Tensor],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        alpha: float = 0.2,
        state_layout: str = "scaled",
    ) -> None:
        alpha = check_real("alpha", alpha, low=0.0)
        super().__init__(state, lr, betas, eps, {"alpha": alpha} if type(self) is AdamDecay else {}, state_layout)
        self.alpha = alpha

    def gate(self, staleness: float) -> float:
        """``exp(-alpha*tau)``."""
        if self.alpha == 0.0:
            check_staleness(staleness)
            return 1.0
        return exp_gate(staleness, self.alpha)


class OuterAdam(AdamDecay):
    """Plain bias-corrected Adam on the pseudo-gradient (``"adam"``): Adam-Decay with ``alpha = 0``.

    Equal to ``torch.optim.Adam(lr=lr, betas=betas, eps=eps)`` fed ``grad = g``; staleness is
    validated but ignored.
    """

    name = "adam"

    def __init__(
        self,
        state: Mapping[str, Tensor],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        state_layout: str = "scaled",
    ) -> None:
        super().__init__(state, lr, betas, eps, alpha=0.0, state_layout=state_layout)
