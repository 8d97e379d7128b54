"""Rebasing a simulated worker onto its own deltas (``sim.rebase``).

Why: under an imposed delay of at least one of its own arrivals (``tau >= K`` arrivals with K
workers, or ``tau >= 1`` round in lockstep rounds) a worker's phase starts from a version made
before its own previous deltas were applied, so it learns again what it has just sent while the
master applies both. The rebase removes that part of the staleness, the part the worker can know.

The rule: worker k's phase from version ``b`` starts from

    start = version_b - sum_j scale_j * delta_j

over k's own deltas ``j`` that version ``b`` does not contain (applied by a later version, or not
applied yet): each delta as the master received it, ``scale_j`` what the master's step multiplied
it by (``lr * gate(tau_j) * w_j / sum(w)``: the step must be momentum-free SGD,
:meth:`~diloco_lightning.outer.base.OuterOptimizer.linear_rate`), a delta not applied yet
taking the worker's last applied scale (0 before its first). So the start is what the global
will be once the worker's own deltas are in, the others' left as they are. A refused delta never
counts. The phase's anchor is that start, so its delta
(``start - local``) never counts the subtracted ones twice.

When a start is computed decides what the worker knows. Lockstep in arrival mode computes a phase
when its delta arrives (:mod:`~diloco_lightning.sim.runners`), after every earlier delta of its
worker was applied or refused, so every scale is known. Elsewhere the start is computed when the
phase begins: a delta still travelling then is not known yet and is not subtracted, and one
refused after it was subtracted stays subtracted. Asynchronously with instant transfers a worker's
own delta is always in the version it starts from, so the rebase changes nothing there.

With ``lookahead`` (the product's ``diloco.lookahead``) each missing delta stands for one delta of
every worker with a delta applied so far (this one included): its scale is multiplied by their
number, as the product worker's ``WorkerOwnDeltas.scale`` does with its ledger's nodes.

The product's async worker has the same rule (``worker/rebase.py``, the scales from the manifest's
``master.delta_scales``); this one lets the study measure it under imposed delays. Only the
bookkeeping is the simulator's own: the start is computed by the worker's
:func:`~diloco_lightning.worker.rebase.rebase_start`, the same arithmetic as the product's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from diloco_lightning.util.options import OptionError
from diloco_lightning.worker.rebase import rebase_start

__all__ = ["OwnDeltas", "SimOwnDeltas"]


@dataclass
class _Own:
    ident: str
    tensors: Mapping[str, Tensor]  # as the master received them
    version: int | None = None  # the version whose step applied it (None: not applied yet)
    scale: float | None = None  # what that step multiplied it by


class SimOwnDeltas:
    """Each simulated worker's deltas that some version it may still start from does not contain,
    learnt from the simulated master's record of what each version applied.

    Args:
        workers: the number of workers.
        lr: the outer step's rate (``OuterOptimizer.linear_rate``); None: the step is not a
            momentum-free SGD and publishes no scales, so each delta counts with the product
            worker's fallback, ``1 / nodes`` of the ledger (:func:`~diloco_lightning.worker.rebase.fallback_scale`).
        lookahead: each missing delta stands for one of every node's (module docstring).
    """

    def __init__(self, workers: int, lr: float | None, *, lookahead: bool = False) -> None:
        self.lr = None if lr is None else float(lr)
        self.lookahead = bool(lookahead)
        self._nodes: set[int] = set()  # workers with a delta applied so far (the ledger's nodes)
        self._own: list[list[_Own]] = [[] for _ in range(workers)]
        self._last: list[float] = [0.0] * workers  # each worker's last applied scale
        self._open: dict[str, tuple[int, _Own]] = {}  # reached the master, neither applied nor refused

    @classmethod
    def build(cls, opt: Any, workers: int, fragments: bool, *, fallback: bool = False,
              lookahead: bool = False) -> SimOwnDeltas:
        """The rebase of a run whose master steps with ``opt``; an OptionError naming ``rebase`` when
        the run has fragments, or its step is not momentum-free SGD and ``fallback`` is False
        (``sim.rebase``); with ``fallback`` (the product's ``diloco.rebase``) such a step gets the
        product worker's ``1 / nodes`` scales."""
        lr = opt.linear_rate()
        if lr is None and not fallback:
            raise OptionError("rebase", f"needs a momentum-free SGD outer step (staleness_sgd, nesterov or "
                              f"poly_nesterov with momentum 0); this run's is {opt.name} {dict(opt.options)}")
        if fragments:
            raise OptionError("rebase", "is not composed with fragments (each fragment would need its own scales)")
        return cls(workers, lr, lookahead=lookahead)

    def sent(self, worker: int, ident: str, tensors: Mapping[str, Tensor]) -> None:
        """Worker ``worker``'s delta ``ident`` reached the master, which will apply or refuse it."""
        own = _Own(ident, tensors)
        self._own[worker].append(own)
        self._open[ident] = (worker, own)

    def refused(self, ident: str) -> None:
        """Delta ``ident`` was refused: it never reaches the global, so no start counts it."""
        found = self._open.pop(ident, None)
        if found is not None:
            self._own[found[0]].remove(found[1])

    def published(self, version: int, factors: Mapping[str, float]) -> None:
        """``version`` is published: the deltas in ``factors`` were applied by its step, each
        multiplied by ``lr * factors[ident]``; every other delta that reached the master before was
        in the refused round (or refused already)."""
        for ident in list(self._open):
            worker, own = self._open.pop(ident)
            if ident in factors:
                self._nodes.add(worker)
                scale = 1.0 / len(self._nodes) if self.lr is None else self.lr * float(factors[ident])
                own.version, own.scale = version, scale
                self._last[worker] = own.scale
            else:
                self._own[worker].remove(own)

    def start(self, worker: int, base: int, state: Mapping[str, Tensor], floor: int) -> Mapping[str, Tensor]:
        """The start of ``worker``'s phase from version ``base`` (``state``): ``state`` itself when
        it contains every own delta, else a new dict with the missing ones subtracted
        (:func:`~diloco_lightning.worker.rebase.rebase_start`). ``floor``: the oldest version any phase
        may still start from (a delta applied by it is in every later base, and is forgotten)."""
        own = self._own[worker]
        own[:] = [o for o in own if o.version is None or o.version > floor]
        missing = self._missing(worker, base)
        if not missing:
            return state
        nodes = len(self._nodes | {worker}) if self.lookahead else 1
        return rebase_start(state, [((o.scale if o.scale is not None else self._last[worker]) * nodes, o.tensors)
                                    for o in missing])

    def _missing(self, worker: int, base: int) -> list[_Own]:
        """``worker``'s own deltas that version ``base`` does not contain (applied later, or not yet)."""
        return [o for o in self._own[worker] if o.version is None or o.version > base]

    def missing(self, worker: int, base: int) -> int:
        """How many of ``worker``'s own deltas version ``base`` lacks (what :meth:`start` subtracts)."""
        return len(self._missing(worker, base))

    def held(self, worker: int) -> int:
        """How many deltas of ``worker`` are kept (each a model-sized copy)."""
        return len(self._own[worker])

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "last": list(self._last), "nodes": sorted(self._nodes),
                "own": [[{"ident": o.ident, "version": o.version, "scale": o.scale,
                          "tensors": {k: t.clone() for k, t in o.tensors.items()}} for o in own] for own in self._own]}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        if len(sd["own"]) != len(self._own):
            raise ValueError(f"state_dict: {len(sd['own'])} workers, this run has {len(self._own)}")
        self.lr = None if sd["lr"] is None else float(sd["lr"])
        self._nodes = set(int(w) for w in sd.get("nodes", ()))
        self._last = [float(x) for x in sd["last"]]
        self._own = [[_Own(o["ident"], {k: torch.as_tensor(t).clone() for k, t in o["tensors"].items()},
                           o["version"], o["scale"]) for o in own] for own in sd["own"]]
        self._open = {o.ident: (w, o) for w, own in enumerate(self._own) for o in own if o.version is None}


#: :class:`SimOwnDeltas` under its older name, kept importable (docs/simulator.md named it)
OwnDeltas = SimOwnDeltas
