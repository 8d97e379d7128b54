"""The tensors a worker syncs and installs into, copying a global state into them, and copying them out.

:func:`module_state` names them (the global state's keys); :func:`copy_into` installs a global
state in place (``tensor.data.copy_``: optimizer and DDP references stay valid). The worker
installs versions with it, and so does anything else that loads a global state into a model
(the product's evaluation), so there is one way to do it. :func:`anchor_copy` and :func:`snapshot`
are the worker's CPU FP32 copies (its anchor, and the weights exported at a boundary).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from diloco_lightning.wire.delta import model_fingerprint, synced_keys
from diloco_lightning.wire.fragments import FragmentPlan, build_plan

__all__ = ["LocalModel", "module_state", "copy_into", "anchor_copy", "snapshot"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalModel:
    """A worker's model as its phases see it: ``params`` (the tensors synced and installed into),
    ``synced`` (the floating keys, the ones in deltas), ``fingerprint`` (the model's, in every
    delta header), ``plan`` (the fragments, None: one delta of every key) and ``pin`` (CUDA
    weights: the CPU copies are pinned, copied without blocking)."""

    params: dict[str, torch.Tensor]
    synced: list[str]
    fingerprint: str
    plan: FragmentPlan | None
    pin: bool

    @classmethod
    def of(cls, params: Any, fragments: Any = None) -> "LocalModel":
        """The model of ``params`` (``name -> tensor``), split by the ``fragments`` option;
        ``ValueError`` for params that are not a mapping of tensors with a floating one."""
        if not isinstance(params, Mapping) or not params:
            raise ValueError("params must be a non-empty mapping name -> tensor (e.g. module_state(model))")
        for k, t in params.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"params[{k!r}] is a {type(t).__name__}, not a tensor")
        tensors = dict(params)
        synced = synced_keys(tensors)
        if not synced:
            raise ValueError("params has no floating-point tensor to sync")
        pin = any(t.device.type == "cuda" for t in tensors.values()) and torch.cuda.is_available()
        plan = build_plan(fragments, {k: tensors[k] for k in synced})
        return cls(tensors, synced, model_fingerprint(tensors), plan, pin)

    def synced_state(self) -> dict[str, torch.Tensor]:
        """The synced tensors, detached (no autograd views), by key."""
        return {k: self.params[k].detach() for k in self.synced}


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


def anchor_copy(t: torch.Tensor, pin: bool = False, own: bool = False) -> torch.Tensor:
    """``t`` as a CPU FP32 tensor (complex64 for complex ones), pinned when ``pin``; ``t`` itself
    when it is one already (an anchor is never written to in place). ``own``: a view of a larger
    tensor (a fragment's row range) is copied, so the anchor never keeps the whole tensor alive
    nor saves it whole in a checkpoint."""
    target = torch.complex64 if t.is_complex() else torch.float32
    out = t.detach()
    if out.device.type != "cpu" or out.dtype != target:
        out = out.to("cpu", target)
    if pin:
        out = out.pin_memory()
    if own and out.untyped_storage().nbytes() > out.numel() * out.element_size():
        out = out.clone(memory_format=torch.contiguous_format)
    return out


def snapshot(params: Mapping[str, torch.Tensor], keys: Sequence[str], pin: bool = False
             ) -> tuple[dict[str, torch.Tensor], Any]:
    """A CPU FP32 copy of ``params[k]`` for every key of ``keys`` (the weights a worker exports at
    a boundary; a new tensor each, never a view of the model). With ``pin`` (a CUDA model) the
    copies are pinned and non-blocking, and the returned ``torch.cuda.Event`` completes when they
    are done (None otherwise): the training thread does not wait for them."""
    snap: dict[str, torch.Tensor] = {}
    event = None
    with torch.no_grad():
        for k in keys:
            t = params[k].detach()
            target = torch.complex64 if t.is_complex() else torch.float32
            if t.device.type == "cuda":
                buf = torch.empty(t.shape, dtype=target, pin_memory=pin)
                buf.copy_(t, non_blocking=True)
            elif t.dtype == target:
                buf = t.clone(memory_format=torch.contiguous_format)
            else:
                buf = t.to(dtype=target, memory_format=torch.contiguous_format)
            snap[k] = buf
        if pin:
            event = torch.cuda.Event()
            event.record()
    return snap, event
