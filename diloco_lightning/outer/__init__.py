"""Outer optimizers: how a master turns pseudo-gradients into global updates.

=====================  ==============================  ============================================
name                   class                           reference
=====================  ==============================  ============================================
``nesterov``           :class:`NesterovOuterOptimizer`  DiLoCo, arXiv 2311.08105 (Speedtronic's step)
``fedavg``             :class:`FedAvg`                 ``nesterov`` with lr 1, momentum 0: FedAvg's mean
``poly_nesterov``      :class:`PolyNesterov`           "Poly", Liu et al. 2024, arXiv 2401.09135
``staleness_sgd``      :class:`StalenessSGD`           Zhang et al. 2016, arXiv 1511.05950 (lr / staleness)
``gap_aware``          :class:`GapAware`               Barkai et al. 2020, arXiv 1909.10802
``dc_asgd``            :class:`DelayCompensated`       DC-ASGD, Zheng et al. 2017, arXiv 1609.08326
``delayed_nesterov``   :class:`DelayedNesterov`        Liu et al. 2024, arXiv 2401.09135, Alg. 3
``cgad``               :class:`CGAD`                   Shah & Sun 2026, arXiv 2605.09126
``adam_decay``         :class:`AdamDecay`              CGAD without the cosine cut
``adam``               :class:`OuterAdam`              plain Adam (``torch.optim.Adam``)
``pa_cgad``            :class:`PACGAD`                 CGAD gated per fragment
=====================  ==============================  ============================================

Every optimizer takes the global state (``dict[str, Tensor]``) and offers ``gate(tau)``,
``step(state, delta, staleness=0, *, gated=False, fragment=None) -> bool``, ``state_dict()``,
``load_state_dict()``, ``name`` and ``options`` (see :class:`OuterOptimizer`).
:func:`build_outer_optimizer` builds one by name, so configs can pick it; every one also takes
``state_dtype`` (``"float32"`` or ``"bfloat16"`` buffers) and ``stochastic_rounding``
(:meth:`OuterOptimizer.set_state_precision`).

A new outer optimizer is one file (a subclass of :class:`OuterOptimizer`) and one
:func:`register_outer_optimizer`; callers ask its capabilities (``GATES_PER_FRAGMENT``,
``STEP_USES_STALENESS``, :meth:`OuterOptimizer.linear_rate`), never its name.

``fedavg`` is ``nesterov`` under the name a user chose, with its own defaults: the same step and
state, so a run published under one name resumes under the other (:func:`same_step`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from torch import Tensor

from diloco_lightning.outer.adam import CGAD, AdamDecay, OuterAdam
from diloco_lightning.outer.base import OuterOptimizer
from diloco_lightning.outer.delayed_nesterov import DelayedNesterov
from diloco_lightning.outer.gap import DelayCompensated, GapAware
from diloco_lightning.outer.gates import cgad_gate, check_staleness, exp_gate, poly_gate
from diloco_lightning.outer.nesterov import FedAvg, NesterovOuterOptimizer, PolyNesterov, StalenessSGD
from diloco_lightning.outer.pacgad import PACGAD
from diloco_lightning.util.registry import Registry

__all__ = [
    "check_outer_options",
    "CGAD",
    "OUTER_OPTIMIZERS",
    "PACGAD",
    "PRECISION_OPTIONS",
    "AdamDecay",
    "DelayCompensated",
    "DelayedNesterov",
    "FedAvg",
    "GapAware",
    "NesterovOuterOptimizer",
    "OuterAdam",
    "OuterOptimizer",
    "PolyNesterov",
    "SAME_STEP",
    "StalenessSGD",
    "build_outer_optimizer",
    "cgad_gate",
    "check_staleness",
    "exp_gate",
    "gates_per_fragment",
    "outer_optimizer_options",
    "poly_gate",
    "register_outer_optimizer",
    "same_step",
    "unregister_outer_optimizer",
]

_REGISTRY = Registry("outer optimizer", OuterOptimizer, (
    NesterovOuterOptimizer, FedAvg, CGAD, AdamDecay, OuterAdam, DelayedNesterov, PACGAD, PolyNesterov, StalenessSGD,
    GapAware, DelayCompensated))
#: Registry name -> class (a read-only view; :func:`register_outer_optimizer` adds to it).
OUTER_OPTIMIZERS: Mapping[str, type[OuterOptimizer]] = _REGISTRY.classes
#: Make a class (an :class:`OuterOptimizer` subclass with a name) the outer optimizer of its name; returns it.
#: Its options are its constructor's keywords after ``state`` (:func:`outer_optimizer_options`).
register_outer_optimizer = _REGISTRY.register
#: Forget the outer optimizer of a name (a test's or a plugin's); ``ValueError`` on an unknown name.
unregister_outer_optimizer = _REGISTRY.unregister


#: A name registered for another's step and state, with defaults of its own -> that other name.
SAME_STEP: Mapping[str, str] = MappingProxyType({"fedavg": "nesterov"})


def same_step(a: Any, b: Any) -> bool:
    """Whether the outer optimizers named ``a`` and ``b`` are one step with one state (equal names, or
    ``fedavg`` and ``nesterov``): a run published by one resumes with the other."""
    return SAME_STEP.get(a, a) == SAME_STEP.get(b, b)


#: Options every outer optimizer takes (:meth:`OuterOptimizer.set_state_precision`): the buffers' dtype
#: and their rounding.
PRECISION_OPTIONS: Mapping[str, Any] = MappingProxyType({"state_dtype": "float32", "stochastic_rounding": False})


def gates_per_fragment(name: Any) -> bool:
    """Whether the outer optimizer registered as ``name`` gates each fragment on its own age
    (:attr:`OuterOptimizer.GATES_PER_FRAGMENT`: PA-CGAD); False for an unknown name."""
    cls = OUTER_OPTIMIZERS.get(name) if isinstance(name, str) else None
    return cls is not None and cls.GATES_PER_FRAGMENT


def outer_optimizer_options(name: str) -> dict[str, Any]:
    """The options ``name`` accepts, each mapped to its default (``inspect.Parameter.empty`` if required):
    its constructor's, then :data:`PRECISION_OPTIONS`.

    Raises:
        ValueError: on an unknown name, listing the valid ones.
    """
    cls = _lookup(name)
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, state
    return {**{p.name: p.default for p in params}, **PRECISION_OPTIONS}


def _lookup(name: str) -> type[OuterOptimizer]:
    cls = OUTER_OPTIMIZERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown outer optimizer {name!r}; valid names: {', '.join(sorted(OUTER_OPTIMIZERS))}")
    return cls


def build_outer_optimizer(name: str, state: Mapping[str, Tensor], **options: Any) -> OuterOptimizer:
    """Build the outer optimizer registered as ``name`` over ``state`` with ``options``.

    ``build_outer_optimizer(opt.name, state, **opt.options)`` rebuilds an equivalent optimizer.

    Raises:
        ValueError: on an unknown name (listing the valid names), an unknown option or a missing
            required one (listing the valid options), or a bad option value (naming it).
    """
    cls = _lookup(name)
    accepted = outer_optimizer_options(name)
    described = ", ".join(k if v is inspect.Parameter.empty else f"{k}={v!r}" for k, v in accepted.items())
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for outer optimizer {name!r}; valid options: {described}")
    missing = [k for k, v in accepted.items() if v is inspect.Parameter.empty and k not in options]
    if missing:
        raise ValueError(f"outer optimizer {name!r} requires option(s) {missing}; valid options: {described}")
    precision = {k: options.pop(k) for k in PRECISION_OPTIONS if k in options}
    opt = cls(state, **options)
    if precision:
        opt.set_state_precision(**precision)
    return opt


def check_outer_options(name: str, **options: Any) -> None:
    """Raise the ``ValueError`` :func:`build_outer_optimizer` would (naming the option) for ``name``
    with ``options``, by building it once on a 2-value probe state: configurations are checked when
    they are given, not when the first global state arrives. ``fragments`` (a run's, matched against
    its keys) is left to the run."""
    import torch

    options = {k: v for k, v in options.items() if k != "fragments"}
    build_outer_optimizer(name, {"probe": torch.zeros(2)}, **options)
