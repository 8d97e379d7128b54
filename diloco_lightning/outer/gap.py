"""Gap-aware and delay-compensated outer SGD: a stale delta corrected coordinate by coordinate.

A delta of staleness tau was computed from version ``theta_base = theta_{t - tau}`` and is applied
to ``theta_now = theta_t``. Both optimizers here correct it by how far each coordinate of the
global state moved in between, ``diff = theta_now - theta_base``, then take an SGD step with
Nesterov momentum ``m`` (default 0: none) on the corrected ``g'``::

    buf = m*buf + g';   state -= lr * (g' + m*buf)          (state -= lr * g' without momentum)

- :class:`GapAware` (Barkai, Hakimi & Schuster 2020, "Gap-Aware Mitigation of Gradient Staleness",
  arXiv 1909.10802): ``g'_i = g_i / G_i`` with the gap ``G_i = max(1, |diff_i| / C_i)``, ``C_i``
  the average size of one of this optimizer's steps on coordinate i. A coordinate that moved
  no more than one typical step since the base is not penalised; one that moved k typical
  steps is divided by k. A coordinate that drifts steadily is penalised about like Zhang et
  al.'s ``lr / tau``; a coordinate that only jitters (its moves cancel) much less.
- :class:`DelayCompensated` (DC-ASGD, Zheng et al. 2017, arXiv 1609.08326):
  ``g'_i = g_i + lam * g_i * g_i * diff_i / mean(g * g)``: the delayed gradient carried from
  ``theta_base`` to ``theta_now`` by the diagonal ``g (.) g`` approximation of the Hessian. The
  paper's adaptive lambda divides by a running mean square of the gradient; a pseudo-gradient is
  a displacement (parameter units), so here each tensor's ``g * g * diff`` is divided by that
  tensor's mean of ``g * g``, which makes ``lam`` a pure number (0: plain SGD).

**Where theta_base comes from.** The master holds ``theta_now`` only. Two sources:

* ``history=W > 0``: the optimizer keeps FP32 copies of the state as it was before each of its
  last W steps (per key, so a key a delta does not carry keeps its older copies), which makes
  ``diff`` exact for ``tau <= W``: W model-sized FP32 buffers whatever ``state_dtype`` (the gap
  is a small difference of two states), 27 GB each for a 7B model (too many for a 7B master;
  meant for small masters and for measuring what the estimate loses).
* otherwise (``history=0``, or ``tau`` beyond the history): a running per-coordinate estimate,
  ``diff ~ tau * D_hat``, ``D`` the exponential average (decay ``beta``, bias-corrected) of this
  optimizer's own signed steps. One model-sized buffer (``drift``) for DC-ASGD; Gap-Aware also
  keeps ``C`` (``step_size``, the same average of ``|step|``): two FP32 buffers, 2 x 27 GB at 7B,
  or together one FP32-sized buffer with ``state_dtype="bfloat16"`` (2 x 13.5 GB), which the
  coarse gap tolerates (it only scales a clamp).

Both assume that every version is one step of this optimizer, as the master's rounds and the
simulator apply them (a round's mean is stepped with the round's largest staleness:
:data:`OuterOptimizer.STEP_USES_STALENESS`). A step with ``tau = 0``, or the first step (no
version but the state is known yet), applies ``g`` unchanged. ``gate(tau)`` is 1: the correction
is per coordinate, inside the step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from diloco_lightning.outer.base import OuterOptimizer, check_int, check_real
from diloco_lightning.outer.gates import check_staleness
from diloco_lightning.outer.work import Item, Work, real_view

__all__ = ["DelayCompensated", "GapAware"]

logger = logging.getLogger(__name__)


class _StaleCorrected(OuterOptimizer):
    """SGD (Nesterov momentum) on a delta corrected by ``diff = theta_now - theta_base``; subclasses
    say how (:meth:`_correct`) and which running buffers they keep."""

    STEP_USES_STALENESS = True
    #: running buffers the subclass keeps besides ``drift`` (the estimate of diff) and ``momentum``
    RUNNING: ClassVar[tuple[str, ...]] = ()

    def __init__(self, state: Mapping[str, Tensor], lr: float, momentum: float, history: int, beta: float,
                 extra_options: Mapping[str, Any]) -> None:
        lr = check_real("lr", lr, low=0.0, low_open=True)
        momentum = check_real("momentum", momentum, low=0.0, high=1.0, high_open=True)
        history = check_int("history", history, low=0)
        beta = check_real("beta", beta, low=0.0, high=1.0, high_open=True)
        buffers = {"drift": True, **{name: True for name in self.RUNNING}}
        if momentum:
            buffers["momentum"] = True
        options = {"lr": lr, "momentum": momentum, "history": history, "beta": beta, **extra_options}
        super().__init__(state, options, buffers=buffers, key_scalars={})
        self.lr, self.momentum, self.history, self.beta = lr, momentum, history, beta
        self._t = 0
        #: per key: [(u, FP32 flat copy of the key before step u)], oldest first, at most ``history``
        self._past: dict[str, list[tuple[int, Tensor]]] = {}
        #: per key: the oldest version the history can still give (older ones fell out)
        self._since: dict[str, int] = {}

    def gate(self, staleness: float) -> float:
        check_staleness(staleness)
        return 1.0

    @property
    def steps_taken(self) -> int:
        """``t``: the steps applied so far (the version the state is, counted from this optimizer's start)."""
        return self._t

    # ------------------------------------------------------------------ theta_base
    def _flat_size(self, key: str) -> int:
        shape, is_complex = self._store.specs[key]
        return math.prod(shape) * (2 if is_complex else 1)

    def _diff(self, w: Work, tau: float) -> Tensor | None:
        """``theta_now - theta_base`` for this work unit (FP32, shaped like ``w.p``), or None when it is 0."""
        if tau == 0 or self._t == 0:
            return None
        version = self._t - int(round(tau))
        if self.history and version >= self._since.get(w.key, 0):
            for u, copy in self._past.get(w.key, []):
                if u >= version:  # the key's value at `version` is its value before its next step
                    off = w.start * (2 if w.is_complex else 1)
                    return w.p - copy[off:off + w.p.numel()].view_as(w.p)
            return None  # the key did not change since `version`
        bias = 1.0 - self.beta ** self._t
        return w.bufs["drift"] * (tau / bias)

    def _record(self, w: Work) -> None:
        """Keep ``w``'s state before this step as the key's value before step ``t``."""
        past = self._past.setdefault(w.key, [])
        if not past or past[-1][0] != self._t:
            reuse = None
            if len(past) >= self.history:  # the oldest copy falls out: versions up to its step are gone
                dropped, reuse = past.pop(0)
                self._since[w.key] = max(self._since.get(w.key, 0), dropped + 1)
            past.append((self._t, reuse if reuse is not None else torch.empty(self._flat_size(w.key))))
        off = w.start * (2 if w.is_complex else 1)
        past[-1][1][off:off + w.p.numel()].copy_(w.p.reshape(-1))

    # ------------------------------------------------------------------ the step
    def _correct(self, w: Work, g: Tensor, diff: Tensor) -> Tensor:
        """The corrected delta (a new tensor; ``g`` is the caller's and is never changed)."""
        raise NotImplementedError

    def _apply(self, items: list[Item], tau: float, gated: bool, fragment: str | None) -> bool:
        beta, lr, m = self.beta, self.lr, self.momentum

        def fn(batch: list[Work]) -> None:
            for w in batch:
                diff = self._diff(w, tau)
                g = w.g if diff is None else self._correct(w, w.g, diff)
                if self.history:
                    self._record(w)
                if m:
                    buf = w.bufs["momentum"]
                    buf.mul_(m).add_(g)
                    update = torch.add(g, buf, alpha=m)
                else:
                    update = g if g is not w.g else g.clone()
                update.mul_(-lr)  # the step itself
                w.p.add_(update)
                w.bufs["drift"].mul_(beta).add_(update, alpha=1.0 - beta)
                if "step_size" in w.bufs:
                    w.bufs["step_size"].mul_(beta).add_(update.abs_(), alpha=1.0 - beta)

        self._run(items, fn)
        self._t += 1
        return True

    # ------------------------------------------------------------------ state
    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """Buffers, ``step``, and with a history its copies (``history/<u>/<key>``: the key before step
        u) and ``history_since`` (``[[key, oldest version it can give], ...]``)."""
        out = super().state_dict(copy)
        if self.history:
            for key, past in self._past.items():
                for u, t in past:
                    out[f"history/{u}/{key}"] = t.clone() if copy else t
            out["history_since"] = [[k, v] for k, v in sorted(self._since.items())]
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        rest = {k: v for k, v in state_dict.items() if not k.startswith("history/") and k != "history_since"}
        past: dict[str, list[tuple[int, Tensor]]] = {}
        for name, tensor in state_dict.items():
            if not name.startswith("history/"):
                continue
            _, u_text, key = name.split("/", 2)
            spec = self._store.specs.get(key)
            if spec is None or not isinstance(tensor, Tensor) or not u_text.isdigit():
                raise ValueError(f"unexpected entry {name!r} in {self.name} state_dict")
            size = self._flat_size(key)
            if tensor.numel() != size:
                raise ValueError(f"state_dict entry {name!r} has {tensor.numel()} values, expected {size}")
            past.setdefault(key, []).append((int(u_text), tensor.detach().to("cpu", torch.float32).reshape(-1).clone()))
        since_raw = state_dict.get("history_since", [])
        try:
            since = {str(k): check_int(f"history_since[{k!r}]", v, low=0) for k, v in since_raw}
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self.name} state_dict 'history_since' must be [[key, version], ...]: {e}") from None
        if past and not self.history:
            raise ValueError(f"{self.name} state_dict has a version history but this optimizer keeps none (history=0)")
        super().load_state_dict(rest)
        self._past = {k: sorted(v, key=lambda x: x[0])[-self.history:] for k, v in past.items()} if self.history else {}
        self._since = since

    def _scalar_state(self) -> dict[str, Any]:
        return {"step": self._t}

    def _check_scalar_state(self, scalars: dict[str, Any]) -> dict[str, Any]:
        unexpected = sorted(set(scalars) - {"step"})
        if unexpected:
            raise ValueError(f"unexpected entries in {self.name} state_dict: {unexpected}")
        return {"step": check_int("step", scalars.get("step", 0), low=0)}

    def _set_scalar_state(self, scalars: dict[str, Any]) -> None:
        self._t = scalars["step"]


class GapAware(_StaleCorrected):
    """Gap-Aware SGD (Barkai, Hakimi & Schuster 2020, arXiv 1909.10802): ``g / max(1, |diff| / C)``.

    Args:
        state: the global state.
        lr: outer learning rate.
        momentum: Nesterov momentum in ``[0, 1)`` (default 0: none, no buffer).
        history: versions kept for an exact ``theta_base`` (0: the running estimate only; see the module docstring).
        beta: decay of the running averages ``C`` and ``D``, in ``[0, 1)`` (default 0.9: about the last 10 steps).
    """

    name = "gap_aware"
    STATE_KINDS = ("gap_aware",)
    RUNNING = ("step_size",)
    NONNEGATIVE = frozenset({"step_size"})

    def __init__(self, state: Mapping[str, Tensor], lr: float, momentum: float = 0.0, history: int = 0,
                 beta: float = 0.9) -> None:
        super().__init__(state, lr, momentum, history, beta, {})

    def _correct(self, w: Work, g: Tensor, diff: Tensor) -> Tensor:
        typical = w.bufs["step_size"] / (1.0 - self.beta ** self._t)
        gap = diff.abs_()
        # g * min(1, C / |diff|), and 1 where |diff| <= C (0 / 0 included)
        scale = torch.where(gap > typical, typical / gap, torch.ones_like(gap))
        return g * scale


class DelayCompensated(_StaleCorrected):
    """DC-ASGD (Zheng et al. 2017, arXiv 1609.08326): ``g + lam * g * g * diff / mean(g * g)`` per tensor.

    Args: as :class:`GapAware`, plus ``lam`` (lambda >= 0, the variance-control parameter; 0 is plain SGD).
    """

    name = "dc_asgd"
    STATE_KINDS = ("dc_asgd",)

    def __init__(self, state: Mapping[str, Tensor], lr: float, lam: float = 1.0, momentum: float = 0.0,
                 history: int = 0, beta: float = 0.9) -> None:
        lam = check_real("lam", lam, low=0.0)
        super().__init__(state, lr, momentum, history, beta, {"lam": lam})
        self.lam = lam
        self._mean_square: dict[str, float] = {}

    def _correct(self, w: Work, g: Tensor, diff: Tensor) -> Tensor:
        mean_square = self._mean_square.get(w.key, 0.0)
        if mean_square == 0.0:
            return g.clone()
        return torch.addcmul(g, g * g, diff, value=self.lam / mean_square)

    def _apply(self, items: list[Item], tau: float, gated: bool, fragment: str | None) -> bool:
        # each key's mean of g * g over the whole tensor (a chunk alone would see part of it)
        self._mean_square = {it.key: float(real_view(it.delta.detach()).double().square().mean()) if it.delta.numel()
                             else 0.0 for it in items}
        return super()._apply(items, tau, gated, fragment)
