"""What a round does with the deltas it accepted: pure functions of tensors, nothing else.

docs/spec.md, "Master round": over the accepted deltas, with weights ``w_i`` (1, or ``num_tokens``)
and gates ``sigma(tau_i)``::

    g = sum_i w_i * sigma(tau_i) * delta_i / sum_i w_i

:class:`RoundSum` accumulates that sum one delta at a time into one FP32 buffer per key
(complex64 for complex keys), so a round holds one sum and one delta whatever their number.
An encoded delta (``docs/encoding.md``) is decoded into the sum key by key, a chunk at a time
(:func:`~diloco_lightning.encoding.decode_add_`): no decoded copy of it is ever held, so a round
over int8 deltas holds one sum and one delta's codes.
Weights are counted in units of ``scale``, the smallest power of two at or above the largest
weight so far: every coefficient is then at most 1, so the sum is bounded by its deltas
whatever a header claims, and rescaling by a power of two is exact (the result is bit for bit
the plain formula's for integer weights). :func:`mean_of` is the same as one call, for a
simulator or a test. Arrival mode (one outer step per delta) takes deltas in
:func:`arrival_order`.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import torch

from diloco_lightning.util.errors import DiLoCoError
from diloco_lightning.util.lanes import Lanes
from diloco_lightning.encoding import EncodedTensor, decode_add_
from diloco_lightning.master.validation import Accepted, max_abs
from diloco_lightning.outer import gates_per_fragment

R = TypeVar("R")

__all__ = [
    "Accepted",
    "FragmentSums",
    "NonFiniteAggregate",
    "OpenRound",
    "RoundSum",
    "arrival_order",
    "arrival_step",
    "cap_round_robin",
    "delta_scales",
    "mean_of",
    "merge_marks",
    "round_step",
]


class NonFiniteAggregate(DiLoCoError, ValueError):
    """The round's mean has a NaN or an infinity in ``key``."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"the aggregate of key {key!r} is not finite")


def _is_synced(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class RoundSum:
    """``sum_i (w_i / scale) * coef_i * delta_i`` in FP32, and ``sum_i w_i / scale`` (see the module docstring).

    Args:
        like: the global state: one buffer per floating (complex) key, allocated at the first delta.
        storage: tensors of those shapes (FP32, complex64) to hold the sum instead.
        lanes: the threads the keys are summed on (:class:`~diloco_lightning.util.lanes.Lanes`; each
            key's arithmetic is the same whichever thread does it: the bits do not depend on it).
    """

    def __init__(self, like: Mapping[str, torch.Tensor], storage: Mapping[str, torch.Tensor] | None = None,
                 lanes: Lanes | None = None) -> None:
        self._like = like
        self._lanes = lanes
        self._storage = storage  # tensors to hold the sum (reused memory), else allocated at the first delta
        self.sum: dict[str, torch.Tensor] | None = None
        self.scale = 1.0
        self.total_weight = 0.0

    def _rescale(self, weight: float) -> None:
        if weight <= self.scale:
            return
        scale = 2.0 ** math.ceil(math.log2(weight))
        if self.sum is not None:
            for t in self.sum.values():
                t.mul_(self.scale / scale)
        self.total_weight *= self.scale / scale
        self.scale = scale

    def add(self, tensors: Mapping[str, torch.Tensor | EncodedTensor], weight: float = 1.0, coef: float = 1.0) -> None:
        """Fold ``weight * coef * tensors`` into the sum (``coef``: the gate, or 1 when the
        optimizer gates itself); ``weight`` also counts in the denominator. A value may be an
        :class:`~diloco_lightning.encoding.EncodedTensor`: it is decoded into the sum in chunks
        (``sum + fl32(c * decode(x))``, the same bits as adding its decoded tensor)."""
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"weight must be a positive finite number, got {weight!r}")
        self._rescale(weight)
        w = weight / self.scale
        c = w * coef
        first = self.sum is None
        if first:
            storage, self._storage = self._storage, None
            self.sum = {
                k: storage[k] if storage is not None else
                torch.empty(v.shape, dtype=torch.complex64 if v.is_complex() else torch.float32)
                for k, v in self._like.items()
                if _is_synced(v)
            }
        assert self.sum is not None

        def add_to(s: torch.Tensor, d: torch.Tensor | EncodedTensor) -> None:
            if isinstance(d, EncodedTensor):
                if first:
                    s.zero_()
                decode_add_(s, d, c)
            elif first:
                s.copy_(d)
                if c != 1.0:
                    s.mul_(c)
            else:
                s.add_(d, alpha=c)

        self._each_span(add_to, [(self.sum[k], d) for k, d in tensors.items()])
        self.total_weight += w

    def take_mean(self) -> dict[str, torch.Tensor]:
        """The weighted mean, computed in place; the sum is handed over (this object is empty
        after). Raises :class:`NonFiniteAggregate` (and drops the sum) if a value is not finite."""
        out, self.sum = self.sum, None
        if out is None:
            raise ValueError("no delta was added")
        total = self.total_weight

        def mean_of_span(s: torch.Tensor, _: None) -> bool:
            if total != 1.0:
                s.div_(total)
            return math.isfinite(max_abs(s))

        for k, finite in zip(out, self._each_span(mean_of_span, [(t, None) for t in out.values()])):
            if not finite:
                raise NonFiniteAggregate(k)
        return out

    def _each_span(self, fn: Callable[[torch.Tensor, Any], bool | None], pairs: list[tuple[torch.Tensor, Any]]) -> list[bool]:
        """``fn(sum, value)`` for each key's pair; on the lanes (when there are some) over spans of
        the flattened tensors (``Lanes.over_spans``: elementwise, the same bits as whole tensors).
        Per pair, whether no call returned False. Encoded values are taken whole, one at a time
        (their decoders make no promise about threads)."""
        spans = None if self._lanes is None else self._lanes.over_spans(fn, pairs)
        if spans is None:
            return [fn(s, d) is not False for s, d in pairs]
        return [all(r is not False for r in results) for results in spans]


def mean_of(
    like: Mapping[str, torch.Tensor], deltas: Iterable[tuple[Mapping[str, torch.Tensor], float, float]]
) -> dict[str, torch.Tensor]:
    """``sum(w_i * coef_i * delta_i) / sum(w_i)`` over ``(tensors, weight, coef)`` triples: what a
    round applies (``coef`` the gate), exactly as the master computes it."""
    acc = RoundSum(like)
    for tensors, weight, coef in deltas:
        acc.add(tensors, weight, coef)
    return acc.take_mean()


class FragmentSums:
    """A round's sums in a run with fragments: one :class:`RoundSum` per fragment that has deltas,
    so each fragment's mean is over its own deltas (``sum_i w_i g_i delta_i / sum_i w_i`` over the
    deltas of that fragment), and :meth:`take_mean` gives every such fragment's keys (the others
    are absent: the outer step leaves them, and their optimizer state, untouched)."""

    def __init__(self, plan: Any, like: Mapping[str, torch.Tensor], storage: Mapping[str, torch.Tensor] | None = None,
                 lanes: Lanes | None = None) -> None:
        self.plan = plan
        self._like = like
        self._storage = storage
        self._lanes = lanes
        self.sums: dict[str, RoundSum] = {}

    def add(self, tensors: Mapping[str, torch.Tensor | EncodedTensor], weight: float = 1.0, coef: float = 1.0, *,
            fragment: str) -> None:
        acc = self.sums.get(fragment)
        if acc is None:
            # by piece name: a split tensor's rows sum into the rows of the storage (views, disjoint per fragment)
            storage = None if self._storage is None else self.plan.substate(fragment, self._storage)
            acc = self.sums[fragment] = RoundSum(self.plan.substate(fragment, self._like), storage, self._lanes)
        acc.add(tensors, weight, coef)

    @property
    def fragments(self) -> list[str]:
        """The fragments that have deltas in this round, in the run's order."""
        return [n for n in self.plan.names if n in self.sums]

    def take_mean(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        sums, self.sums = self.sums, {}
        for name in self.plan.names:
            if name in sums:
                out.update(sums[name].take_mean())
        if not out:
            raise ValueError("no delta was added")
        return out


def round_step(opt: Any, outer_optimizer: str, *, legacy: bool,
               tau_max: int) -> Callable[[dict[str, torch.Tensor], Mapping[str, torch.Tensor]], bool]:
    """How a round's mean is applied, ``(state, mean) -> applied``: with the older PA-CGAD rule
    (``legacy``) gated per fragment on ``max(tau_max, age_f)``; PA-CGAD's deltas were each gated on
    ``max(tau_i, age_f)`` before the mean (``step_pregated``); any other optimizer's were gated by
    their own staleness (``gated=True``), and an optimizer whose step corrects per coordinate
    (``STEP_USES_STALENESS``: gap-aware, DC-ASGD) is told the round's largest staleness (exact when
    every delta of the round has the same). The master's rounds and the simulator both step here."""
    if legacy:
        return lambda state, mean: opt.step(state, mean, staleness=tau_max)
    if gates_per_fragment(outer_optimizer):
        return lambda state, mean: opt.step_pregated(state, mean)
    tau = tau_max if getattr(opt, "STEP_USES_STALENESS", False) else 0
    return lambda state, mean: opt.step(state, mean, staleness=tau, gated=True)


def delta_scales(rate: float | None, deltas: list[tuple[str, float, float]]) -> dict[str, float] | None:
    """Per node, the factor its delta entered the state with, for a step ``state -= rate * mean``
    of the round's weighted mean of gated deltas (``deltas``: ``(node, weight, gate)``):
    ``scale_i = rate * gate_i * w_i / sum(w)`` (one delta in arrival mode: ``rate * gate``). None
    when the step is not such a multiple (``rate`` None: momentum, Adam). A node with two deltas in
    one round keeps the last one's. What the manifest's ``master.delta_scales`` publishes."""
    if rate is None or not deltas:
        return None
    total = sum(w for _, w, _ in deltas)
    return {node: float(rate * gate * w / total) for node, w, gate in deltas}


def arrival_step(opt: Any, outer_optimizer: str, state: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor],
                 tau: int, fragment: str | None) -> bool:
    """Arrival mode: one outer step for one delta of staleness ``tau`` (PA-CGAD: of ``fragment``,
    gated on ``max(tau, age_f)``)."""
    return opt.step(state, tensors, staleness=tau, fragment=fragment if gates_per_fragment(outer_optimizer) else None)


@dataclass
class OpenRound:
    """A round being gathered (kept across polls while waiting for the quorum)."""

    outer_step: int
    acc: RoundSum | FragmentSums
    accepted: list[Accepted] = field(default_factory=list)
    marks: dict[str, int] = field(default_factory=dict)
    first_at: float | None = None


def merge_marks(*marks: Mapping[str, int]) -> dict[str, int]:
    """Per-node maxima of several ledgers (high-water marks)."""
    out: dict[str, int] = {}
    for m in marks:
        for node, step in m.items():
            if step > out.get(node, -1):
                out[node] = step
    return out


def cap_round_robin(refs: list[R], cap: int) -> list[R]:
    """At most ``cap`` of ``refs`` (sorted by node then step), taken round-robin over nodes, each
    node's lowest steps first: one busy node never starves the others."""
    if len(refs) <= cap:
        return refs
    by_node: dict[str, deque] = {}
    for r in refs:
        by_node.setdefault(r.node_id, deque()).append(r)  # type: ignore[attr-defined]
    out: list[R] = []
    while len(out) < cap:
        for node in sorted(by_node):
            q = by_node[node]
            if q and len(out) < cap:
                out.append(q.popleft())
    return sorted(out)  # type: ignore[type-var]


def arrival_order(items: list[tuple[Any, Any, int]]) -> list[tuple[Any, Any, int]]:
    """The order of arrival mode over ``(ref, payload, base_outer_step)``: oldest anchor first
    (``base_outer_step``, then node id), never reordering one node's deltas (each node's are taken
    in ``local_step`` order, as uploaded). A deterministic stand-in for upload order, which no
    hub reports reliably."""
    by_node: dict[str, deque] = {}
    for it in sorted(items, key=lambda x: x[0]):
        by_node.setdefault(it[0].node_id, deque()).append(it)
    heap = [(q[0][2], node) for node, q in by_node.items()]
    heapq.heapify(heap)
    out = []
    while heap:
        _, node = heapq.heappop(heap)
        q = by_node[node]
        out.append(q.popleft())
        if q:
            heapq.heappush(heap, (q[0][2], node))
    return out
