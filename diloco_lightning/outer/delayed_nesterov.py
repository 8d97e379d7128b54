"""Delayed Nesterov (DN): Liu et al. 2024, "Asynchronous Local-SGD Training for Language Modeling".

arXiv 2401.09135, Algorithm 3. Each :meth:`DelayedNesterov.step` is one arriving pseudo-gradient
``g``; ``t`` counts arrivals from 0, ``N`` is ``buffer_size``, ``c`` the momentum ``activation``::

    A += g
    if (t + 1) % N == 0:                       # the momentum moves once per N arrivals
        m = beta*m + A/N
        state -= lr * ((1 - c*N + c)*beta*m + g/N)
        A = 0
    else:
        state -= lr * (c*beta*m + g/N)

With ``N = 1`` this is DiLoCo's Nesterov step. The paper uses ``c = 0`` by default (``c = 0.1``
performed about the same). Staleness is validated but not used (``gate`` is 1): the momentum is
delayed instead.

Implementation: instead of ``A`` the optimizer keeps ``Q = beta*m + A/N``, the momentum the
window's last arrival will install (``accumulator``), stored as ``Q = accumulator_scale * Q_hat``
with a per-key scalar scale. An arrival inside a window is ``Q += g/N`` and
``state -= lr*(c*beta*m + g/N)`` (two multi-tensor passes); the last arrival of a window
(``m' = Q + g/N``, ``state -= lr*(k*beta*m' + g/N)`` with ``k = 1 - c*N + c``) is a single
fused SGD call (``kernels.nesterov_step_``) with ``Q_hat`` as its momentum buffer (kernel momentum
``q/q'``, dampening ``1 - 1/(N*q')``, lr ``lr/N``, new scale ``q' = sqrt(q/(N*k*beta))``), and the
next window's ``Q = beta*m'`` is a change of scale only. With ``c = 0`` no separate ``m`` is
kept at all (one FP32 buffer); with ``c > 0``, ``m`` (``momentum``, scaled by ``momentum_scales``)
is copied from ``Q`` at each window's end.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from diloco_lightning.outer import kernels
from diloco_lightning.outer.base import (
    OuterOptimizer,
    check_int,
    check_real,
)
from diloco_lightning.outer.gates import check_staleness
from diloco_lightning.outer.work import Item, Work

__all__ = ["DelayedNesterov"]

logger = logging.getLogger(__name__)


class DelayedNesterov(OuterOptimizer):
    """Delayed Nesterov momentum (Liu et al. 2024, arXiv 2401.09135, Algorithm 3).

    Args:
        state: the global state (its floating keys get a zero ``accumulator`` buffer, and a
            ``momentum`` buffer when ``activation > 0``).
        lr: outer learning rate.
        momentum: beta, in ``[0, 1)``.
        buffer_size: N, the arrivals between two momentum updates (the paper: the number of
            workers), an integer ``>= 1``.
        activation: c, the fraction of the momentum applied between momentum updates, in ``[0, 1]``.

    Keys a delta does not carry are left untouched, their buffers too. ``state_dict()`` holds
    ``step`` (arrivals so far), ``accumulator/<key>`` and ``accumulator_scales``
    (``accumulator_scale * accumulator = beta*m + A/N``), and with ``activation > 0``
    ``momentum/<key>`` and ``momentum_scales`` (``momentum_scale * momentum = m``).
    """

    name = "delayed_nesterov"
    STATE_KINDS = ("delayed_nesterov",)

    def __init__(
        self,
        state: Mapping[str, Tensor],
        lr: float,
        momentum: float = 0.9,
        *,
        buffer_size: int,
        activation: float = 0.0,
    ) -> None:
        lr = check_real("lr", lr, low=0.0, low_open=True)
        momentum = check_real("momentum", momentum, low=0.0, high=1.0, high_open=True)
        buffer_size = check_int("buffer_size", buffer_size, low=1)
        activation = check_real("activation", activation, low=0.0, high=1.0)
        # The separate momentum m only exists when c > 0.
        buffers: dict[str, bool] = {"accumulator": True}
        key_scalars: dict[str, tuple[str, Any]] = {"accumulator_scales": ("positive", 1.0)}
        if activation != 0.0:
            buffers["momentum"] = True
            key_scalars["momentum_scales"] = ("positive", 1.0)
        options = {"lr": lr, "momentum": momentum, "buffer_size": buffer_size, "activation": activation}
        super().__init__(state, options, buffers=buffers, key_scalars=key_scalars)
        self.lr = lr
        self.momentum = momentum
        self.buffer_size = buffer_size
        self.activation = activation
        self._t = 0

    def gate(self, staleness: float) -> float:
        check_staleness(staleness)
        return 1.0

    def _apply(self, items: list[Item], tau: float, gated: bool, fragment: str | None) -> bool:
        n, beta, c, lr = self.buffer_size, self.momentum, self.activation, self.lr
        k = 1.0 - c * n + c
        boundary = (self._t + 1) % n == 0
        names = ("accumulator_scales", "momentum_scales") if c else ("accumulator_scales",)
        new_acc_scales: dict[str, float] = {}
        new_mom_scales: dict[str, float] = {}

        def fn(batch: list[Work]) -> None:
            for scales, works in self._group(batch, names).items():
                q = scales[0]
                params = [w.p for w in works]
                grads = [w.g for w in works]
                accs = [w.bufs["accumulator"] for w in works]
                moms = [w.bufs["momentum"] for w in works] if c else []
                if not boundary:
                    kernels.add_(accs, grads, alpha=1.0 / (n * q))
                    if c:
                        kernels.add_(params, moms, alpha=-lr * c * beta * scales[1])
                    kernels.add_(params, grads, alpha=-lr / n)
                    continue
                # Last arrival of the window: m' = Q + g/N; state -= lr*(k*beta*m' + g/N).
                if k * beta > 0.0:
                    q_new = math.sqrt(q / (n * k * beta))
                    kernels.nesterov_step_(params, grads, accs, momentum=q / q_new, lr=lr / n, dampening=1.0 - 1.0 / (n * q_new))
                else:
                    q_new = q
                    kernels.add_(accs, grads, alpha=1.0 / (n * q))
                    if k * beta != 0.0:
                        kernels.add_(params, accs, alpha=-lr * k * beta * q)
                    kernels.add_(params, grads, alpha=-lr / n)
                if c:
                    kernels.copy_(moms, accs)
                    new_mom_scales.update((w.key, q_new) for w in works)
                # The next window starts from Q = beta*m' (A = 0): a change of scale.
                q_next = beta * q_new
                if q_next == 0.0:  # beta == 0: no momentum carries over
                    kernels.zero_(accs)
                    q_next = 1.0
                new_acc_scales.update((w.key, q_next) for w in works)

        self._run(items, fn)
        self._key_scalars["accumulator_scales"].update(new_acc_scales)
        if c:
            self._key_scalars["momentum_scales"].update(new_mom_scales)
        self._t += 1
        return True

    @property
    def arrivals(self) -> int:
        """``t``: the pseudo-gradients applied so far."""
        return self._t

    def _scalar_state(self) -> dict[str, Any]:
        return {"step": self._t}

    def _check_scalar_state(self, scalars: dict[str, Any]) -> dict[str, Any]:
        unexpected = sorted(set(scalars) - {"step"})
        if unexpected:
            raise ValueError(f"unexpected entries in delayed_nesterov state_dict: {unexpected}")
        return {"step": check_int("step", scalars.get("step", 0), low=0)}

    def _set_scalar_state(self, scalars: dict[str, Any]) -> None:
        self._t = scalars["step"]
