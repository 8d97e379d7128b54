"""The master's part of a simulated run: the product's own checks, round mean and outer step, without a hub.

What a real master (:mod:`diloco_lightning.master.rounds`) does to a delta, in the same order,
with the same code: the staleness checks and the gate
(:func:`~diloco_lightning.master.validation.check_staleness`, the outer optimizer's ``gate``),
the norm bounds (:class:`~diloco_lightning.master.validation.NormGuard` with the global-relative
bound of the current version), then either

* ``aggregation="round"``: the gated weighted mean of the round's accepted deltas
  (:class:`~diloco_lightning.master.aggregation.RoundSum`) and one outer step
  (:func:`~diloco_lightning.master.aggregation.round_step`: ``gated=True``; PA-CGAD's deltas each
  gated on ``max(tau_i, age_f)`` before the mean, :func:`~diloco_lightning.master.gating.delta_gates`), or
* ``aggregation="arrival"``: one outer step per accepted delta with its own staleness;

With fragments (``config.fragments``, Streaming DiLoCo): a delta carries one fragment's keys and
its header entries; its staleness is that fragment's outer steps since its base
(:meth:`~diloco_lightning.master.gating.FragmentView.staleness`), its gate the fragment's
(PA-CGAD: ``max(tau, a_f)``), its norm scaled as the product scales it; each fragment's deltas make
their own mean (:class:`~diloco_lightning.master.aggregation.FragmentSums`), the step updates the
fragments that had deltas, and each version records its fragments' outer step counts
(:attr:`SimMaster.version_steps`, what a worker reads in the manifest).

then the new state's finiteness (a non-finite update is refused, the optimizer rolled back) and
the norm window. Each step publishes a *version* (kept in memory while some worker may still
start from it). Where the product's lockstep master would wait forever (every delta of a round
refused), the simulator publishes the unchanged state as the next version (a "null round"), so
the schedule goes on; it is counted in the metrics.

Besides the master's own metrics (``staleness_histogram``, ``rejected_by_reason`` ...), each
version records the outer step's size: the L2 norm and the RMS of ``new - old`` over the
floating keys, and the RMS in units of the outer learning rate; with low-precision outer buffers
(``state_dtype`` bf16 or int8), ``outer_state``: per buffer, the fraction of values at the
quantisation floor (stored as 0 though not 0) and stuck (the step's change rounded away).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from diloco_lightning.wire.delta import is_synced
from diloco_lightning.wire.fragments import build_plan, stepped_state
from diloco_lightning.master.aggregation import FragmentSums, NonFiniteAggregate, RoundSum, arrival_step, round_step
from diloco_lightning.master.config import MasterConfig, with_run_fragments
from diloco_lightning.master.metrics import RoundMetrics
from diloco_lightning.master.gating import FragmentView, delta_gates, legacy_pa
from diloco_lightning.master.validation import DeltaRejected, NormGuard, check_staleness, delta_norm, state_norm
from diloco_lightning.outer import build_outer_optimizer
from diloco_lightning.sim.trend import Trend

__all__ = ["SimMaster"]

log = logging.getLogger(__name__)


def _clone(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


class SimMaster:
    """See the module docstring.

    Args:
        state: the initial global state (version 0), copied to CPU.
        config: the master's options (outer optimizer, ``aggregation``, ``weighting``, bounds).
    """

    def __init__(self, state: Mapping[str, Tensor], config: MasterConfig) -> None:
        self.config = config.validate()
        self.state = _clone(state)
        #: the fragments (None: every delta carries the whole model)
        self.plan = build_plan(config.fragments, self.state)
        self.opt = build_outer_optimizer(config.outer_optimizer, stepped_state(self.plan, self.state),
                                         **with_run_fragments(config.outer_optimizer, config.optimizer_options(), self.plan))
        self.lr = float(self.opt.options.get("lr", float("nan")))
        # low-precision buffers: record what their precision does at each step (the version's ``outer_state``)
        self.opt.track_precision = self.opt.state_dtype != torch.float32
        self.legacy = legacy_pa(config.outer_optimizer, self.plan, self.opt)
        self.outer_step = 0
        self.versions: dict[int, dict[str, Tensor]] = {0: _clone(self.state)}
        #: per fragment: (outer steps that updated it, the version that last did), as the manifest has them
        self.fragment_steps: dict[str, tuple[int, int]] = {n: (0, 0) for n in (self.plan.names if self.plan else ())}
        #: per version: its fragments' outer step counts (with fragments)
        self.version_steps: dict[int, dict[str, int]] = {0: self._counts()}
        self._updated: list[str] = []  # the fragments the outer step being published updated
        self.norms = NormGuard(config.max_delta_norm, config.norm_ratio, config.norm_window, config.norm_min_history,
                               config.norm_global_ratio)
        self.norms.set_global(*state_norm(self.state))
        self.records: list[dict[str, Any]] = []  # one per published version
        self._acc: RoundSum | FragmentSums | None = None
        self._accepted: list[tuple[str, int, float]] = []  # (ident, staleness, norm) of the open round
        self._coefs: dict[str, tuple[float, float]] = {}  # ident -> (gate, weight) in the open round
        #: what the last outer step multiplied each delta it applied by, before the lr (the gate times
        #: the delta's share of the round's weight; {} when the step applied nothing): sim.rebase's scales
        self.applied_factors: dict[str, float] = {}
        self._processed = 0  # deltas of the open round, accepted or not
        self._m = self._new_metrics()
        self.null_rounds = 0
        self._prev: dict[str, Tensor] | None = None  # the state before the last outer step
        #: sim.lookahead_trend: the prediction published with each version (None: off; the simulator sets it)
        self.trend: Trend | None = None
        self._taus: list[int] = []  # the staleness of the deltas the last outer step applied
        self._step_seconds = 0.0

    def _new_metrics(self) -> RoundMetrics:
        return RoundMetrics(aggregation=self.config.aggregation, optimizer=self.config.outer_optimizer, holder="sim")

    # ------------------------------------------------------------------ checks (the order of DeltaValidator._check)

    def _counts(self) -> dict[str, int]:
        return {n: c for n, (c, _) in self.fragment_steps.items()}

    def _gates(self) -> tuple[Any, FragmentView | None]:
        return delta_gates(self.opt, self.config.outer_optimizer, self.plan, self._counts())

    def fragment_staleness(self, base_outer_step: int, extra: Mapping[str, str]) -> tuple[str, int]:
        """``(fragment, tau)`` of a fragment delta whose header has ``base_outer_step`` and the fragment
        entries ``extra``, checked now (:meth:`~diloco_lightning.master.gating.FragmentView.staleness`)."""
        _, view = self._gates()
        assert view is not None, "fragment_staleness needs a run with fragments"
        return view.staleness(extra, base_outer_step, self.outer_step)

    def _check(self, tensors: Mapping[str, Tensor], tau: int, num_tokens: int | None,
               fragment: str | None = None) -> tuple[float, float, float]:
        """``(gate, weight, norm)`` of an acceptable delta, else :class:`DeltaRejected`."""
        if (fragment is None) != (self.plan is None):
            raise ValueError(f"this run has {'no' if self.plan is None else self.plan.count} fragments; "
                             f"the delta names {fragment!r}")
        by_tau, view = self._gates()
        if view is None or fragment is None:
            gate = float(by_tau(tau)) if tau >= 0 else 0.0
        else:
            gate = float(view.gate(fragment, tau)) if tau >= 0 else 0.0
        check_staleness(tau, max_staleness=self.config.max_staleness, gate=gate)
        weight = 1.0
        if self.config.weighting == "tokens":
            if not num_tokens:
                raise DeltaRejected("num_tokens", "weighting='tokens' needs a positive num_tokens")
            weight = float(num_tokens)
        norm = delta_norm(tensors) * (view.norm_scale(fragment, self.state) if view is not None and fragment else 1.0)
        self.norms.check(norm, tensors)
        return gate, weight, norm

    # ------------------------------------------------------------------ round mode

    @property
    def open_deltas(self) -> int:
        """Deltas processed (accepted or refused) in the open round."""
        return self._processed

    def add(self, ident: str, tensors: Mapping[str, Tensor], tau: int, *, num_tokens: int | None = None,
            fragment: str | None = None) -> bool:
        """Round mode: check a delta of staleness ``tau`` (of ``fragment``, with fragments) and fold it
        into the open round; False if refused."""
        self._processed += 1
        try:
            gate, weight, norm = self._check(tensors, tau, num_tokens, fragment)
        except DeltaRejected as e:
            self._m.reject(e.reason)
            log.debug("refused %s (staleness %d): %s", ident, tau, e)
            return False
        coef = 1.0 if self.legacy else gate  # the older PA-CGAD rule gates each fragment itself
        if self._acc is None:
            self._acc = RoundSum(self.state) if self.plan is None else FragmentSums(self.plan, self.state)
        if isinstance(self._acc, FragmentSums):
            assert fragment is not None  # _check refuses a delta without one in a run with fragments
            self._acc.add(tensors, weight, coef, fragment=fragment)
        else:
            self._acc.add(tensors, weight, coef)
        self._accepted.append((ident, tau, norm))
        self._coefs[ident] = (coef, weight)
        return True

    def close_round(self, now: float = 0.0) -> dict[str, Any]:
        """Apply the open round's mean (one outer step) and publish the next version; a round with
        nothing to apply publishes the unchanged state (a null round). Returns the version's record."""
        accepted, acc, coefs = self._accepted, self._acc, self._coefs
        self._accepted, self._acc, self._processed, self._coefs = [], None, 0, {}
        self.applied_factors = {}
        applied = False
        if accepted and acc is not None:
            updated = acc.fragments if isinstance(acc, FragmentSums) else []
            try:
                mean = acc.take_mean()
            except NonFiniteAggregate as e:
                self._refuse(accepted, str(e))
            else:
                step = round_step(self.opt, self.config.outer_optimizer, legacy=self.legacy,
                                  tau_max=max(t for _, t, _ in accepted))
                applied = self._step(lambda: step(stepped_state(self.plan, self.state), mean), accepted, updated)
        if applied:
            total = sum(w for _, w in coefs.values())
            self.applied_factors = {i: g * w / total for i, (g, w) in coefs.items()}
        if not applied:
            self.null_rounds += 1
        return self._publish(now, applied)

    # ------------------------------------------------------------------ arrival mode

    def arrive(self, ident: str, tensors: Mapping[str, Tensor], tau: int, *, num_tokens: int | None = None,
               now: float = 0.0, fragment: str | None = None) -> dict[str, Any] | None:
        """Arrival mode: one outer step for this delta (of ``fragment``, with fragments) and a new
        version (its record), or None if refused."""
        self.applied_factors = {}
        try:
            gate, _, norm = self._check(tensors, tau, num_tokens, fragment)
        except DeltaRejected as e:
            self._m.reject(e.reason)
            return None
        if not self._step(lambda: arrival_step(self.opt, self.config.outer_optimizer,
                                                         stepped_state(self.plan, self.state), tensors, tau, fragment),
                          [(ident, tau, norm)], [fragment] if fragment is not None else []):
            return None
        self.applied_factors = {ident: gate}
        return self._publish(now, True)

    # ------------------------------------------------------------------ apply and publish

    def _step(self, step, accepted: list[tuple[str, int, float]], updated: list[str] | None = None) -> bool:
        """Run one outer step on the state; roll it back and refuse the deltas if the result is not finite.
        ``updated``: the fragments the step updates (counted when it is published)."""
        backup_opt = self.opt.state_dict()
        self._prev = _clone(self.state)
        t0 = time.perf_counter()
        applied = step()
        self._step_seconds = time.perf_counter() - t0
        if applied is False:  # fully gated (PA-CGAD): nothing changed
            for _ in accepted:
                self._m.reject("too_stale")
            return False
        norm, numel = state_norm(self.state)
        if not math.isfinite(norm):
            self.state = self._prev
            self.opt.load_state_dict(backup_opt)
            self._refuse(accepted, "the outer step made the state non-finite")
            return False
        self.norms.extend(n for _, _, n in accepted)
        self.norms.set_global(norm, numel)
        for ident, tau, _ in accepted:
            self._m.apply(ident, tau)
        self._taus = [tau for _, tau, _ in accepted]
        self._updated = list(updated or [])
        return True

    def _refuse(self, accepted: list[tuple[str, int, float]], detail: str) -> None:
        log.warning("refusing %d delta(s) at outer_step %d: %s", len(accepted), self.outer_step, detail)
        for _ in accepted:
            self._m.reject("non_finite_update")

    def _publish(self, now: float, applied: bool) -> dict[str, Any]:
        self.outer_step += 1
        before = self.versions.get(self.outer_step - 1)
        self.versions[self.outer_step] = _clone(self.state)
        if self.trend is not None and before is not None:
            self.trend.published(self.outer_step, before, self.versions[self.outer_step],
                                 self._taus if applied else [], self.opt)
        self._taus = []
        updated, self._updated = (self._updated if applied else []), []
        for n in updated:
            self.fragment_steps[n] = (self.fragment_steps[n][0] + 1, self.outer_step)
        self.version_steps[self.outer_step] = self._counts()
        m, self._m = self._m, self._new_metrics()
        m.outer_step, m.published = self.outer_step, 1
        rec = m.to_dict()
        rec.update(time=now, round_seconds=self._step_seconds if applied else 0.0, null_round=not applied)
        rec.update(self._update_size(applied))
        if applied and self.opt.precision_stats:
            rec["outer_state"] = {f: dict(v) for f, v in self.opt.precision_stats.items()}
        self.records.append(rec)
        return rec

    def _update_size(self, applied: bool) -> dict[str, float]:
        """L2 norm and RMS of ``new - old`` over the floating keys (0 for a null round)."""
        prev = self._prev
        if not applied or prev is None:
            return {"update_norm": 0.0, "update_rms": 0.0, "update_rms_over_lr": 0.0}
        total, n = 0.0, 0
        for k, t in self.state.items():
            if is_synced(t) and t.numel():
                d = torch.linalg.vector_norm(t.to(torch.float32) - prev[k].to(torch.float32)).item()
                total += d * d
                n += t.numel()
        rms = math.sqrt(total / max(n, 1))
        self._prev = None
        return {"update_norm": math.sqrt(total), "update_rms": rms, "update_rms_over_lr": rms / self.lr if self.lr else 0.0}

    def refuse(self, reason: str) -> None:
        """Count a delta refused before its checks (the simulator's own rule, e.g. ``late``)."""
        self._m.reject(reason)

    def pending_record(self) -> dict[str, Any] | None:
        """Refusals since the last version (arrival mode), as a record, or None."""
        if not self._m.rejected:
            return None
        m, self._m = self._m, self._new_metrics()
        m.outer_step = self.outer_step
        return m.to_dict()

    def prune(self, keep_from: int) -> None:
        """Forget the versions below ``keep_from`` (no worker can start from them any more)."""
        for v in [v for v in self.versions if v < keep_from]:
            del self.versions[v]
            self.version_steps.pop(v, None)
        if self.trend is not None:
            self.trend.prune(keep_from)
