"""The SGD family of outer optimizers: DiLoCo's Nesterov SGD, Poly, and staleness-scaled SGD.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105) applies the averaged pseudo-gradient ``g`` with
SGD + Nesterov momentum (lr 0.7, momentum 0.9)::

    buf = momentum * buf + g
    state -= lr * (g + momentum * buf)

which is ``torch.optim.SGD(lr=lr, momentum=momentum, nesterov=True)`` fed ``grad = g``, and the
behaviour of Speedtronic's DumbDiLoCo master (CPU FP32 buffers, state updated in its own dtype).

:class:`PolyNesterov` is the "Poly" baseline of Liu et al. 2024 (arXiv 2401.09135): the same step
fed ``g * (1 + tau) ** -0.5``. :class:`StalenessSGD` is the same step fed ``g * (1 + tau) ** -power``
with ``momentum`` 0 by default: with ``power = 1`` and no momentum it is Zhang et al.'s
staleness-aware SGD (2016, arXiv 1511.05950: the learning rate divided by the staleness, here
``1 + tau`` so that a fresh delta keeps the full rate); ``power=0.5, momentum=0.9`` is Poly and
``power=0`` is DiLoCo's Nesterov. :class:`FedAvg` is DiLoCo's Nesterov under its own name with
FedAvg's server step as its defaults (lr 1, no momentum: the plain mean of the deltas).

All run as one fused SGD call (``kernels.nesterov_step_``) per batch of tensors (memory-bandwidth speed). The gate
is folded into the kernel's scalars rather than applied to the delta: the momentum buffer is kept
as ``buf = momentum_scale * B`` with a per-key scalar ``momentum_scale`` (always 1 for plain Nesterov), and
a step with gate ``s`` on scale ``c`` runs the kernel with ``c' = sqrt(s*c)``,
``momentum' = momentum*sqrt(c/s)``, ``dampening' = 1 - sqrt(s/c)``, ``lr' = lr*s``, which gives
(up to rounding) ``buf' = momentum*buf + s*g`` and ``state -= lr*(s*g + momentum*buf')`` without reading or
writing the delta more than once (the fused kernel's own ``grad_scale`` writes the scaled gradient
back into the caller's delta, so it is not used).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from torch import Tensor

from diloco_lightning.outer.base import OuterOptimizer, check_real
from diloco_lightning.outer.gates import check_staleness, poly_gate
from diloco_lightning.outer.kernels import nesterov_step_
from diloco_lightning.outer.work import Item, Work

__all__ = ["FedAvg", "NesterovOuterOptimizer", "PolyNesterov", "StalenessSGD"]

logger = logging.getLogger(__name__)


def sgd_kernel_constants(momentum: float, lr: float, gate: float, scale: float) -> tuple[float, float, float, float]:
    """Scalars for the fused SGD kernel (``kernels.nesterov_step_``) applying a Nesterov step to ``gate * g``.

    The momentum buffer is stored as ``buf = scale * B``. Returns ``(momentum', dampening', lr',
    new_scale)`` such that the kernel's ``B' = momentum'*B + (1 - dampening')*g`` and
    ``state -= lr'*(g + momentum'*B')`` equal ``buf' = momentum*buf + gate*g`` (with
    ``buf' = new_scale * B'``) and ``state -= lr*(gate*g + momentum*buf')``.
    """
    if momentum == 0.0 or gate == scale:
        return momentum, 0.0, lr * gate, scale
    new_scale = math.sqrt(gate * scale)
    return momentum * math.sqrt(scale / gate), 1.0 - math.sqrt(gate / scale), lr * gate, new_scale


class _NesterovBase(OuterOptimizer):
    BUFFERS: ClassVar[dict[str, bool]] = {"momentum": True}

    def __init__(self, state: Mapping[str, Tensor], lr: float, momentum: float = 0.9,
                 extra_options: Mapping[str, Any] | None = None, *, momentum_free: bool = False,
                 negative_momentum: bool = False) -> None:
        """``momentum_free``: keep no momentum buffer when ``momentum`` is 0 (it would hold nothing);
        ``negative_momentum``: momentum may be in ``(-1, 0)`` too."""
        lr = check_real("lr", lr, low=0.0, low_open=True)
        momentum = check_real("momentum", momentum, low=-1.0 if negative_momentum else 0.0, high=1.0,
                              low_open=negative_momentum, high_open=True)
        layout: dict[str, Any] = {}
        if momentum_free and momentum == 0.0:
            layout = {"buffers": {}, "key_scalars": {}}
        super().__init__(state, {"lr": lr, "momentum": momentum, **(extra_options or {})}, **layout)
        self.lr = lr
        self.momentum = momentum

    def linear_rate(self) -> float | None:
        return self.lr if self.momentum == 0.0 else None

    def lookahead(self, steps: float) -> dict[str, Tensor] | None:
        """The momentum's share of the next ``steps`` outer steps: with no new delta the buffer decays
        by ``momentum`` a step and step ``k`` moves the state by ``-lr * momentum**(k+1) * buf``, so

            sum_{k=1..n} = -lr * momentum**2 * (1 - momentum**n) / (1 - momentum) * buf

        (a fractional ``n`` continues the geometric sum). None without momentum."""
        if self.momentum == 0.0 or "momentum" not in self._store.buffers:
            return None
        m = self.momentum
        factor = -self.lr * m * m * (1.0 - m ** max(0.0, float(steps))) / (1.0 - m)
        scales = self._key_scalars.get("momentum_scales", {})  # the true buffer is scale * B (module docstring)
        return {key: self._store.values("momentum", key) * (factor * float(scales.get(key, 1.0)))
                for key in self._store.buffers["momentum"]}

    def _apply(self, items: list[Item], tau: float, gated: bool, fragment: str | None) -> bool:
        gate = self.gate(tau)
        if gate == 0.0:
            return False
        gate = 1.0 if gated else gate
        scaled = "momentum_scales" in self._scalar_kinds
        new_scales: dict[str, float] = {}

        def fn(batch: list[Work]) -> None:
            groups = self._group(batch, ("momentum_scales",)) if scaled else {(1.0,): batch}
            for (scale,), works in groups.items():
                momentum, dampening, lr, new_scale = sgd_kernel_constants(self.momentum, self.lr, gate, scale)
                nesterov_step_(
                    [w.p for w in works],
                    [w.g for w in works],
                    [w.bufs["momentum"] for w in works] if momentum != 0.0 else [],
                    momentum=momentum,
                    lr=lr,
                    dampening=dampening,
                )
                new_scales.update((w.key, new_scale) for w in works)

        self._run(items, fn)
        if scaled:
            self._key_scalars["momentum_scales"].update(new_scales)
        return True


class NesterovOuterOptimizer(_NesterovBase):
    """DiLoCo's outer Nesterov SGD, exactly as Speedtronic's DumbDiLoCo master applies it.

    ``buf = momentum*buf + g``; ``state -= lr*(g + momentum*buf)`` for every floating/complex delta
    key (Douillard et al. 2023, arXiv 2311.08105; equal to ``torch.optim.SGD(nesterov=True)`` fed
    ``grad = g``). Staleness is validated but ignored (``gate`` is 1). Keys a delta does not carry
    are left untouched. With ``momentum=0`` the buffer is not kept (it would only hold the last ``g``).

    ``state_dict()`` is Speedtronic's: ``{key: momentum buffer}`` (cloned CPU tensors) only;
    ``load_state_dict()`` replaces the buffers with CPU FP32 (complex64) copies.

    Args:
        state: the global state (its floating keys get a zero momentum buffer).
        lr: outer learning rate (DiLoCo: 0.7).
        momentum: Nesterov momentum in ``[0, 1)`` (DiLoCo: 0.9).
    """

    name = "nesterov"
    STATE_KINDS: ClassVar[tuple[str, ...]] = ("nesterov",)

    def gate(self, staleness: float) -> float:
        check_staleness(staleness)
        return 1.0

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        store = self._store
        out: dict[str, Any] = {key: buf.clone() if copy else buf for key, buf in store.buffers["momentum"].items()}
        for key, amax in store.absmax["momentum"].items():  # 8-bit buffers (not a Speedtronic option): their maxima
            out[f"momentum.absmax/{key}"] = amax.clone() if copy else amax
        if store.stochastic:  # not a Speedtronic option: its step count rides along
            out["rounding_step"] = store.rounding_step
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        tensors = {}
        rounding_step = self._pop_rounding_step({"rounding_step": state_dict.get("rounding_step", 0)})
        for key, value in state_dict.items():
            if (key == "optimizer" and value == self.name) or key == "rounding_step":
                continue
            if not isinstance(value, Tensor):
                raise ValueError(f"nesterov state_dict entry {key!r} is not a tensor: {type(value).__name__}")  # noqa: TRY004
            tensors[key if key.startswith("momentum.absmax/") else f"momentum/{key}"] = value
        self._store.load_state_dict(tensors)
        self._store.rounding_step = rounding_step


class FedAvg(NesterovOuterOptimizer):
    """Plain averaging, FedAvg's server step (McMahan et al. 2017, arXiv 1602.05629): the Nesterov step
    of :class:`NesterovOuterOptimizer` with ``lr=1`` and ``momentum=0`` as defaults, so each update
    moves the state by the (weighted) mean of its deltas; with ``power > 0`` a stale one is gated::

        state -= lr * sum_i w_i * g_i / (1 + tau_i) ** power / sum_i w_i

    ``power`` (default 0: the plain mean) is Zhang et al.'s staleness-aware rate (2016, arXiv
    1511.05950) at ``power=1``; it needs ``momentum=0`` (a gated momentum step is ``staleness_sgd``).
    Synchronous rounds (every tau 0) are the same either way. Measured with asynchronous workers
    (docs/scaling.md, "The plugin's asynchronous workers"): ``power=1`` was 0.35 nats better than the
    plain mean in the simulator at K = 4 and 0.08 worse on GPT-2 with 2 real worker processes, so the
    default stays the plain mean.

    The same step and state as ``nesterov`` at ``power=0``: a run published as ``nesterov`` resumes
    as ``fedavg`` and back (:data:`diloco_lightning.outer.SAME_STEP`).

    Args:
        state: the global state.
        lr: outer learning rate (default 1: the mean of the deltas).
        momentum: Nesterov momentum in ``[0, 1)`` (default 0: none, and no buffer kept).
        power: the staleness gate's exponent ``p >= 0`` in ``(1 + tau) ** -p`` (default 0: no gate; a
            positive one needs momentum 0).
    """

    name = "fedavg"
    STATE_KINDS = ("fedavg", "nesterov")

    def __init__(self, state: Mapping[str, Tensor], lr: float = 1.0, momentum: float = 0.0,
                 power: float = 0.0) -> None:
        super().__init__(state, lr, momentum)
        power = check_real("power", power, low=0.0)
        if power > 0.0 and self.momentum != 0.0:
            raise ValueError(f"fedavg: a staleness gate (power {power:g}) needs momentum 0, got momentum "
                             f"{self.momentum:g}; use power=0, or staleness_sgd for a gated momentum step")
        self.power = power
        self.options["power"] = power

    def gate(self, staleness: float) -> float:
        return poly_gate(staleness, self.power) if self.power else super().gate(staleness)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if isinstance(state_dict, Mapping) and state_dict.get("optimizer") in self.STATE_KINDS:
            state_dict = {k: v for k, v in state_dict.items() if k != "optimizer"}
        super().load_state_dict(state_dict)


class PolyNesterov(_NesterovBase):
    """Nesterov fed ``g * (1 + tau) ** -0.5``: the "Poly" baseline of Liu et al. 2024 (arXiv 2401.09135).

    ``state_dict()``: ``momentum/<key>`` tensors, ``keys`` and ``momentum_scales`` (per key; the
    true momentum buffer is ``momentum_scale * momentum/<key>``, see the module docstring).
    """

    name = "poly_nesterov"
    STATE_KINDS = ("poly_nesterov",)
    KEY_SCALARS: ClassVar[dict[str, tuple[str, Any]]] = {"momentum_scales": ("positive", 1.0)}

    def gate(self, staleness: float) -> float:
        return poly_gate(staleness, 0.5)


class StalenessSGD(_NesterovBase):
    """Staleness-scaled SGD: the Nesterov step fed ``g * (1 + tau) ** -power``, momentum 0 by default.

    With the defaults (``momentum=0``, ``power=1``) a delta of staleness tau moves the state by
    ``lr * g / (1 + tau)``: Zhang et al.'s staleness-aware SGD (2016, arXiv 1511.05950), the
    learning rate divided by the staleness, which keeps synchronous SGD's convergence. Equal to
    ``torch.optim.SGD(lr=lr, momentum=momentum, nesterov=momentum > 0)`` fed
    ``grad = g * (1 + tau) ** -power``. ``power=0.5, momentum=0.9`` is ``poly_nesterov``;
    ``power=0`` is ``nesterov``. With ``momentum=0`` no buffer is kept (nothing but the state).

    A negative momentum (in ``(-1, 0)``) is allowed: asynchrony itself acts like momentum on the
    update (Mitliagkas et al. 2016, "Asynchrony begets momentum", arXiv 1605.09774), which a
    negative explicit momentum can partly cancel.

    ``state_dict()``: ``{"optimizer": "staleness_sgd"}``, plus with momentum the ``momentum/<key>``
    tensors, ``keys`` and ``momentum_scales`` (as :class:`PolyNesterov`).

    Args:
        state: the global state.
        lr: outer learning rate.
        momentum: Nesterov momentum in ``(-1, 1)`` (default 0: none).
        power: the gate's exponent p >= 0 in ``(1 + tau) ** -p`` (default 1).
    """

    name = "staleness_sgd"
    STATE_KINDS = ("staleness_sgd",)
    KEY_SCALARS: ClassVar[dict[str, tuple[str, Any]]] = {"momentum_scales": ("positive", 1.0)}

    def __init__(self, state: Mapping[str, Tensor], lr: float, momentum: float = 0.0, power: float = 1.0) -> None:
        power = check_real("power", power, low=0.0)
        super().__init__(state, lr, momentum, {"power": power}, momentum_free=True, negative_momentum=True)
        self.power = power

    def gate(self, staleness: float) -> float:
        """``(1 + tau) ** -power``."""
        return poly_gate(staleness, self.power)
