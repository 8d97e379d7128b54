"""The tensors a worker syncs and installs into, and copying a global state into them.

:func:`module_state` names them (the global state's keys); :func:`copy_into` installs a global
state in place (``tensor.data.copy_``: optimizer and DDP references stay valid). The worker
installs versions with it, and so does anything else that loads a global state into a model
(the product's evaluation), so there is one way to do it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

__all__ = ["module_state", "copy_into"]

log = logging.getLogger(__name__)


def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a worker syncs and installs into: ``named_parameters()`` (tied weights once,
    under their first name) and the persistent buffers (``state_dict`` ones). These keys are the
    global state's keys."""
    out: dict[str, torch.Tensor] = dict(module.named_parameters())
    persistent = set(module.state_dict(keep_vars=True))
    for name, buf in module.named_buffers():
        if name in persistent and name not in out:
            out[name] = buf
    return out


def copy_into(params: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], *, what: str = "the global state",
              required: list[str] | None = None) -> list[str]:
    """Copy ``state`` into ``params`` in place, after checking every key of ``required`` (default:
    every key of ``params``) is there and every shape matches (``ValueError`` naming the first
    that is not, nothing copied). Keys of ``params`` that ``state`` lacks and that are not required
    (integer buffers, which never travel) are kept and returned."""
    required = list(params) if required is None else required
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(f"{what} lacks key(s) {missing[:5]} of this model")
    unexpected = [k for k in state if k not in params]
    if unexpected:
        raise ValueError(f"{what} has key(s) {unexpected[:5]} this model does not")
    for k, t in params.items():
        src = state.get(k)
        if src is not None and tuple(src.shape) != tuple(t.shape):
            raise ValueError(f"{what}: key {k!r} has shape {list(src.shape)}, the model's is {list(t.shape)}")
    kept = []
    with torch.no_grad():
        for k, t in params.items():
            src = state.get(k)
            if src is None:
                kept.append(k)
                continue
            t.data.copy_(src, non_blocking=src.is_pinned())
    return kept
