"""How a delta is gated (the optimizer's ``sigma(tau)``), and what checking a fragment's delta needs.

:func:`delta_gates` answers, for a master's round and for the simulator alike, the gate of a delta by
its staleness, and with fragments the :class:`FragmentView` that computes a fragment delta's
staleness (its fragment's outer steps since the delta's base), gate and norm scale. PA-CGAD's gate is
``gate(max(tau, age_f))`` of the delta's fragment (arXiv 2605.09126); :func:`legacy_pa` names the one
run shape that keeps the older PA-CGAD rule.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch

from diloco_lightning.outer import gates_per_fragment
from diloco_lightning.util.errors import DeltaRejected
from diloco_lightning.wire.fragments import FragmentError, FragmentPlan, parse_fragment_header

__all__ = ["FragmentView", "delta_gates", "legacy_pa"]


class FragmentView:
    """What checking a fragment's delta needs of the run: its fragments, each one's outer step
    count now (``steps``), and the gate of a fragment's delta (``gate(fragment, tau)``)."""

    def __init__(self, plan: FragmentPlan, steps: Mapping[str, int], gate: Callable[[str, int], float]) -> None:
        self.plan = plan
        self.steps = dict(steps)
        self.gate = gate
        self._scale: dict[str, float] = {}

    def norm_scale(self, name: str, state: Mapping[str, torch.Tensor]) -> float:
        if name not in self._scale:
            total = sum(t.numel() for t in state.values() if t.is_floating_point() or t.is_complex())
            self._scale[name] = math.sqrt(max(total, 1) / max(self.plan.numel(name, state), 1))
        return self._scale[name]

    def staleness(self, extra: Mapping[str, str], base_outer_step: int, outer_step: int) -> tuple[str, int]:
        """``(fragment, tau)`` of a header (its entries beyond the standard ones), or :class:`DeltaRejected`.

        ``tau`` = the fragment's outer steps now - ``base_fragment_step``. A fragment is updated at
        most once per version, so an honest ``base_fragment_step`` is at most ``base_outer_step`` and
        at least the count now minus the versions since ``base_outer_step``."""
        try:
            parsed = parse_fragment_header(extra)
        except FragmentError as e:
            raise DeltaRejected("fragment", str(e)) from None
        if parsed is None:
            raise DeltaRejected("fragment", f"this run syncs {self.plan.count} fragments; the delta names none")
        name, count, fbase = parsed
        if count != self.plan.count:
            raise DeltaRejected("fragment", f"the delta is of a run with {count} fragments; this one has {self.plan.count}")
        now = self.steps[name]
        if base_outer_step <= outer_step and (fbase > base_outer_step or fbase < now - (outer_step - base_outer_step)):
            raise DeltaRejected(
                "fragment", f"base_fragment_step {fbase} cannot be fragment {name}'s at base_outer_step {base_outer_step} "
                f"(it has {now} outer steps at version {outer_step})"
            )
        return name, (now - fbase if base_outer_step <= outer_step else outer_step - base_outer_step)


def legacy_pa(outer_optimizer: str, plan: FragmentPlan | None, opt: Any) -> bool:
    """PA-CGAD given fragments of its own (``outer_options``) in a run without fragments: the older
    round rule (average ungated, gate each fragment on ``max(tau_max, age_f)``)."""
    return gates_per_fragment(outer_optimizer) and plan is None and len(opt.fragments) > 1


def delta_gates(opt: Any, outer_optimizer: str, plan: FragmentPlan | None,
                fragment_steps: Mapping[str, int]) -> tuple[Callable[[int], float], FragmentView | None]:
    """The gate of a delta by staleness, and (a run with fragments: ``plan``, each fragment's outer
    step count now ``fragment_steps``) the view that checks and gates a fragment's delta: PA-CGAD's
    gate is ``gate(max(tau, age_f))`` of the delta's fragment (arXiv 2605.09126). The master's
    rounds and the simulator both ask here."""
    pa = gates_per_fragment(outer_optimizer)
    if plan is not None:
        def by_fragment(name: str, tau: int) -> float:
            return opt.fragment_gate(name, tau) if pa else opt.gate(tau)
        return opt.gate, FragmentView(plan, fragment_steps, by_fragment)
    if pa and not legacy_pa(outer_optimizer, plan, opt):
        only = opt.fragments[0]
        return (lambda tau: opt.fragment_gate(only, tau)), None
    return opt.gate, None
