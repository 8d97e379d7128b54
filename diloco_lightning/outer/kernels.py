"""The few fused torch kernels the outer optimizers run, behind one guard with public fallbacks.

``torch._fused_adam_`` and ``torch._fused_sgd_`` read the state, the delta and the buffers
once per step (memory-bandwidth speed: 10 ms instead of 170 ms for a 25M-parameter Adam step
here), but they are private: their names or semantics may change in a torch release. So the
optimizers call :func:`adam_step_` and :func:`nesterov_step_` here, which use the fused kernel
only after it has passed a known-answer check against the public formula (once per process,
on a few small tensors), and otherwise, or when asked (:func:`use_public_kernels`, or
``DILOCO_PUBLIC_KERNELS=1``), run the same update with public tensor ops. A test runs both
and compares.

Both updates use Adam / SGD without bias correction and without weight decay: the callers fold
bias correction, the staleness gate and buffer scales into the scalars (see ``adam.py`` and
``nesterov.py``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["adam_step_", "nesterov_step_", "add_", "copy_", "zero_", "use_public_kernels", "fused_kernels_in_use"]

log = logging.getLogger(__name__)

_NO_BIAS_CORRECTION = torch.tensor(1e30, dtype=torch.float32)  # 1 - beta**1e30 == 1: no correction
_lock = threading.Lock()
_forced_public = os.environ.get("DILOCO_PUBLIC_KERNELS", "") not in ("", "0")
_fused_ok: dict[str, bool] = {}


def use_public_kernels(public: bool = True) -> None:
    """Run the public formulas instead of the fused kernels (tests, or a torch whose fused
    kernels misbehave)."""
    global _forced_public
    _forced_public = public


def fused_kernels_in_use() -> dict[str, bool]:
    """Which fused kernels passed their check in this process (``{}`` before the first step)."""
    return {k: v and not _forced_public for k, v in _fused_ok.items()}


# ----------------------------------------------------------------------------- public formulas


def _adam_public(params, grads, exp_avgs, exp_avg_sqs, lr: float, beta1: float, beta2: float, eps: float) -> None:
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)


def _sgd_public(params, grads, bufs, momentum: float, lr: float, dampening: float) -> None:
    for i, (p, g) in enumerate(zip(params, grads)):
        if momentum != 0.0:
            b = bufs[i]
            b.mul_(momentum).add_(g, alpha=1.0 - dampening)
            p.add_(g, alpha=-lr).add_(b, alpha=-lr * momentum)  # Nesterov: g + momentum * buf
        else:
            p.add_(g, alpha=-lr)


# ----------------------------------------------------------------------------- fused kernels


def _adam_fused(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps) -> None:
    torch._fused_adam_(  # type: ignore[attr-defined]
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), [],
        [_NO_BIAS_CORRECTION] * len(params), lr=lr, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps,
        amsgrad=False, maximize=False,
    )


def _sgd_fused(params, grads, bufs, momentum, lr, dampening) -> None:
    torch._fused_sgd_(  # type: ignore[attr-defined]
        list(params), list(grads), list(bufs) if momentum != 0.0 else [], weight_decay=0.0, momentum=momentum,
        lr=lr, dampening=dampening, nesterov=True, maximize=False, is_first_step=False,
    )


def _known_answer(name: str) -> bool:
    """Run the fused kernel and the public formula on the same small tensors; True if they agree."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (0,)]
    try:
        if name == "adam":
            args = [[torch.randn(s, generator=g) for s in shapes] for _ in range(2)]
            m0 = [torch.randn(s, generator=g) for s in shapes]
            v0 = [torch.rand(s, generator=g) for s in shapes]
            runs = []
            for adam in (_adam_fused, _adam_public):
                p, m, v = [t.clone() for t in args[0]], [t.clone() for t in m0], [t.clone() for t in v0]
                adam(p, args[1], m, v, 0.01, 0.9, 0.95, 1e-8)
                runs.append(p + m + v)
        else:
            args = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
            runs = []
            for sgd in (_sgd_fused, _sgd_public):
                p, b = [t.clone() for t in args[0]], [t.clone() for t in args[2]]
                sgd(p, args[1], b, 0.9, 0.1, 0.25)
                runs.append(p + b)
        return all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(*runs))
    except Exception as e:  # noqa: BLE001 - absent or changed: the public formula serves
        log.info("torch's fused %s kernel is not usable here (%s: %s); using the public formula", name,
                 type(e).__name__, e)
        return False


def _fused(name: str) -> bool:
    if _forced_public:
        return False
    ok = _fused_ok.get(name)
    if ok is None:
        with _lock:
            ok = _fused_ok.get(name)
            if ok is None:
                ok = _fused_ok[name] = _known_answer(name)
                if not ok:
                    log.warning("torch's fused %s kernel did not pass its check; the outer optimizer uses the "
                                "(slower) public formula", name)
    return ok


def adam_step_(params: Sequence[Tensor], grads: Sequence[Tensor], exp_avgs: Sequence[Tensor],
               exp_avg_sqs: Sequence[Tensor], *, lr: float, beta1: float, beta2: float, eps: float) -> None:
    """In place, for each tensor: ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*g*g``;
    ``p -= lr * m / (sqrt(v) + eps)`` (no bias correction, no weight decay). FP32 CPU tensors."""
    if not params:
        return
    (_adam_fused if _fused("adam") else _adam_public)(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps)


def nesterov_step_(params: Sequence[Tensor], grads: Sequence[Tensor], bufs: Sequence[Tensor], *,
                   momentum: float, lr: float, dampening: float) -> None:
    """In place, for each tensor: ``buf = momentum*buf + (1-dampening)*g``;
    ``p -= lr * (g + momentum*buf)`` (``bufs`` unused when ``momentum`` is 0)."""
    if not params:
        return
    (_sgd_fused if _fused("sgd") else _sgd_public)(params, grads, bufs, momentum, lr, dampening)


def add_(dsts: Sequence[Tensor], srcs: Sequence[Tensor], alpha: float = 1.0) -> None:
    """``d += alpha * s`` for each pair (``torch._foreach_add_`` when there is one)."""
    if not dsts:
        return
    if not _forced_public and hasattr(torch, "_foreach_add_"):
        torch._foreach_add_(list(dsts), list(srcs), alpha=alpha)
    else:
        for d, s in zip(dsts, srcs):
            d.add_(s, alpha=alpha)


def copy_(dsts: Sequence[Tensor], srcs: Sequence[Tensor]) -> None:
    """``d[:] = s`` for each pair."""
    if not _forced_public and hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(list(dsts), list(srcs))
    else:
        for d, s in zip(dsts, srcs):
            d.copy_(s)


def zero_(dsts: Sequence[Tensor]) -> None:
    if not _forced_public and hasattr(torch, "_foreach_zero_"):
        torch._foreach_zero_(list(dsts))
    else:
        for d in dsts:
            d.zero_()
