"""A round's procedure: list, fetch, check, aggregate, apply, publish, in either aggregation.

* ``round`` (docs/spec.md, "Master round"): the accepted deltas of a round, gated by their own
  staleness, make one weighted mean (:class:`~diloco_lightning.master.aggregation.RoundSum`,
  kept across polls until the quorum), then one outer step with ``gated=True``, then one
  publication. ``pa_cgad`` gates each delta on ``max(tau_i, age_f)`` before it is averaged, as the
  paper defines it (``age_f``: outer steps since the delta's fragment was last updated), then steps
  without gating again (only a run without fragments whose PA-CGAD was given fragments of its own in
  ``outer_options`` keeps the older rule: average ungated, gate each fragment on ``max(tau_max, age_f)``).
* Fragments (``diloco_lightning/wire/fragments.py``): each fragment's deltas make their own mean
  (:class:`~diloco_lightning.master.aggregation.FragmentSums`), with the fragment's staleness (its
  outer steps since the delta's base) and gate; the step updates the fragments that had deltas,
  and the manifest counts one more outer step for each of them.
* ``arrival``: every accepted delta is its own outer step, with its own staleness, taken in
  :func:`~diloco_lightning.master.aggregation.arrival_order`, and its own published version while
  the master keeps up; a pass that finds several (the master is behind) publishes them as one
  version (:mod:`~diloco_lightning.master.arrival`; ``arrival_publish="each"``: one each always).

Every step is taken on a second buffer and published before it is swapped in; anything that
fails rolls the optimizer back and forgets what was processed but not published (it will be
processed again). A non-finite result publishes nothing and refuses the round's deltas.

When a round is applied is decided by :mod:`diloco_lightning.master.quorum` (``min_deltas``: a
count, or a fraction of the live nodes of :mod:`diloco_lightning.master.membership`;
``max_wait``: fixed, or ``"auto"`` from the recent arrival offsets); each accepted delta is also
a sign of life of its node.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from diloco_lightning.util import faults
from diloco_lightning.encoding.feedback import decode_delta
from diloco_lightning.wire.delta import Delta, is_synced
from diloco_lightning.hub.base import DeltaRef, Hub, PublishConflictError
from diloco_lightning.master.aggregation import (
    FragmentSums,
    NonFiniteAggregate,
    OpenRound,
    RoundSum,
    arrival_order,
    arrival_step,
    cap_round_robin,
    delta_scales,
    merge_marks,
    round_step,
)
from diloco_lightning.master.arrival import apply_pass
from diloco_lightning.master.config import MasterConfig
from diloco_lightning.master.gating import FragmentView, delta_gates, legacy_pa
from diloco_lightning.master.health import RunHealth
from diloco_lightning.master.intake import Intake
from diloco_lightning.master.membership import Membership
from diloco_lightning.master.metrics import RoundMetrics
from diloco_lightning.master.publication import LeaseLost, Publisher
from diloco_lightning.master.runstate import RunState
from diloco_lightning.master.weights import owns_its_memory, update_distance
from diloco_lightning.master.quorum import AUTO, ArrivalDeadline, is_fraction, quorum_count, quorum_size
from diloco_lightning.master.validation import Accepted, DeltaRejected, DeltaValidator, max_abs, state_norm

__all__ = ["Rounds"]

log = logging.getLogger(__name__)


class Rounds:
    """The round procedures of one master, given its parts (each owns its state); ``open`` is the
    round being gathered, kept across polls until its quorum, and :meth:`discard` forgets it.

    Args:
        config, hub, run, intake, validator, publisher, membership: the master's parts.
        on_published: called after each publication (the master's ``on_global_update``).
        owner: receives the crash points (``listed``, ``downloaded``, ``stepped``, ``swapped``: util/faults.py).
    """

    def __init__(self, config: MasterConfig, hub: Hub, run: RunState, intake: Intake, validator: DeltaValidator,
                 publisher: Publisher, membership: Membership, *, on_published: Callable[[], None],
                 health: RunHealth | None = None, owner: Any = None) -> None:
        self.config, self.hub, self.run = config, hub, run
        self.intake, self.validator, self.publisher, self.membership = intake, validator, publisher, membership
        #: what no single delta shows (identical deltas, divergence): told each publication
        self.health = health if health is not None else RunHealth()
        self.on_published = on_published
        self.owner = owner
        self.open: OpenRound | None = None
        self.arrival_wait_since: float | None = None
        #: the arrival offsets behind ``max_wait="auto"``
        self.deadline = ArrivalDeadline()
        self._refreshed_for: set[str] = set()

    # ------------------------------------------------------------------ quorum and deadline

    def discard(self) -> None:
        """Forget everything processed but not published (it will be processed again): the open
        round, dropped unapplied (a conflict, an adopted version: nothing is learned from it), and
        the deltas refused since the last publication."""
        self.forget_open()
        self.intake.pending = []

    def forget_open(self) -> None:
        """The open round is dropped unapplied: nothing is learned from it."""
        self.open = None
        self.arrival_wait_since = None
        self.deadline.closed(())

    def _heard(self, node: str, now: float) -> None:
        """An accepted delta: a sign of life of ``node``, and an arrival offset. A node the membership
        does not know makes it read the claims at once (once per node: one without a claim stays unknown)."""
        ms = self.membership
        if not ms.heard(node, now) and self._first_time(node):
            if ms.refresh(force=True):
                ms.heard(node, now)
        self.deadline.arrived(node, now)

    def _first_time(self, node: str) -> bool:
        """Whether an unknown ``node`` is seen for the first time (the claims are read at once for it;
        a node that holds no claim does not make every round read them)."""
        if node in self._refreshed_for:
            return False
        if len(self._refreshed_for) >= 100_000:
            self._refreshed_for.clear()
        self._refreshed_for.add(node)
        return True

    def _wait_limit(self) -> float | None:
        """Seconds after a round's first delta before it is applied below the quorum (None: no limit)."""
        mw = self.config.max_wait
        if mw != AUTO:
            return mw
        poll = float(self.config.poll_interval)
        return self.deadline.deadline(cap=self.membership.cap(), floor=poll, resolution=poll)

    def _quorum(self, nodes: list[str], waited: float, force: bool, m: RoundMetrics) -> tuple[bool, list[str]]:
        """Whether a round holding deltas of ``nodes`` (one entry per delta) that waited ``waited``
        seconds is applied now; also returns the live nodes."""
        cfg = self.config
        live = self.membership.live()
        need = quorum_size(cfg.min_deltas, len(live))
        have = quorum_count(cfg.min_deltas, nodes)
        limit = self._wait_limit()
        m.live_nodes, m.quorum, m.deadline = len(live), need, limit
        m.replayed = {n: st.report.replayed for n, st in self.membership.nodes.items() if st.report.replayed}
        timed_out = limit is not None and waited >= limit
        if not (force or have >= need or timed_out):
            log.debug("waiting for the quorum: %d of %d %s (%d live)", have, need,
                      "nodes" if is_fraction(cfg.min_deltas) else "deltas", len(live))
            return False, live
        if timed_out and have < need:
            log.info("applying %d of %d %s after %.1fs (the deadline)", have, need,
                     "nodes" if is_fraction(cfg.min_deltas) else "deltas", waited)
        return True, live

    def _marks(self) -> dict[str, int]:
        return merge_marks(self.run.ledger, self.open.marks if self.open else {})

    def _limits(self) -> tuple[int, int]:
        assert self.run.state is not None and self.run.fingerprint is not None
        return self.validator.size_limits(self.run.state, self.run.fingerprint)

    def _legacy_pa(self) -> bool:
        """PA-CGAD given fragments of its own in a run without fragments: the older round rule."""
        run = self.run
        return legacy_pa(self.config.outer_optimizer, run.plan, run.opt)

    def _gates(self) -> tuple[Callable[[int], float], FragmentView | None]:
        """The gate of a delta by staleness, and (a run with fragments) the view that checks and gates
        a fragment's delta: PA-CGAD's gate is ``gate(max(tau, age_f))`` of the delta's fragment."""
        run = self.run
        return delta_gates(run.opt, self.config.outer_optimizer, run.plan,
                           {n: c for n, (c, _) in run.fragment_steps.items()})

    def check(self, ref: DeltaRef, path: Path, outer_step: int, *, reuse: bool = False) -> tuple[Delta, Accepted]:
        """Validate the downloaded delta ``path`` as applied at ``outer_step`` (raises ``DeltaRejected``).
        ``reuse``: read it into the validator's reused buffer (valid until the next such check)."""
        run = self.run
        # rounds run only once the run has a global state (given, adopted or installed at start)
        assert run.state is not None and run.fingerprint is not None
        gate, view = self._gates()
        return self.validator.check(ref, path, state=run.state, fingerprint=run.fingerprint, outer_step=outer_step,
                                    gate=gate, fragments=view, arena=self.validator.arena if reuse else None)

    # ------------------------------------------------------------------ round mode

    def round(self, m: RoundMetrics, force: bool) -> None:
        run = self.run
        self.membership.refresh()
        if self.open is None or self.open.outer_step != run.outer_step:
            if self.open is not None:
                self.forget_open()
            storage = run.take_sum_storage()
            assert run.state is not None
            lanes = self.validator.arena.lanes
            sums = (RoundSum(run.state, storage, lanes) if run.plan is None else
                    FragmentSums(run.plan, run.state, storage, lanes))
            self.open = OpenRound(run.outer_step, sums)
        rnd = self.open
        max_bytes, _ = self._limits()
        refs = self.intake.list_new(self._marks(), max_bytes, m)
        faults.point("listed", self.owner)
        blocked: set[str] = set()
        legacy = self._legacy_pa()
        for ref, path in self.intake.fetch(refs, blocked, max_bytes, m):
            try:
                try:
                    # one delta at a time, folded into the sum before the next is read: one reused buffer
                    delta, acc = self.check(ref, path, rnd.outer_step, reuse=True)
                except DeltaRejected as e:
                    self.intake.refuse(ref, e.reason, e.detail, m)
                    continue
                try:
                    coef = 1.0 if legacy else acc.gate  # the older PA-CGAD rule gates each fragment itself
                    if isinstance(rnd.acc, FragmentSums):
                        rnd.acc.add(delta.by_key(), acc.weight, coef, fragment=acc.fragment or "")
                    else:
                        rnd.acc.add(delta.by_key(), acc.weight, coef)
                except BaseException:
                    self.open = None  # a partial sum is worthless: the round starts over
                    raise
                del delta
                rnd.accepted.append(acc)
                rnd.marks[ref.node_id] = max(ref.local_step, rnd.marks.get(ref.node_id, -1))
                now = time.monotonic()
                if rnd.first_at is None:
                    rnd.first_at = now
                self._heard(ref.node_id, now)
            finally:
                self.intake.release(path)
        faults.point("downloaded", self.owner)
        m.pending = len(rnd.accepted)
        if not rnd.accepted:
            return
        now = time.monotonic()
        waited = now - (rnd.first_at or now)
        ready, live = self._quorum([a.ref.node_id for a in rnd.accepted], waited, force, m)
        if not ready:
            m.waiting = True
            return
        if not force and self._paced(m):
            return  # the round stays open: what arrives meanwhile joins it, one publication for all
        self._commit_round(rnd, m, legacy)
        self.deadline.closed(live, now)

    def _paced(self, m: RoundMetrics) -> bool:
        """Whether the hub's commit budget (or a 429's Retry-After) asks the publication to wait
        (``Hub.commit_wait``): then the round is not applied yet and gathers more deltas."""
        try:
            wait = max(0.0, float(self.hub.commit_wait(None)))
        except Exception as e:  # noqa: BLE001 - pacing is advice
            log.debug("no commit budget from %s: %s", self.hub.url, e)
            return False
        if wait > 0:
            m.waiting, m.paced = True, wait
            log.debug("publication paced: the commit budget of %s allows it in %.1fs", self.hub.url, wait)
        return wait > 0

    def _commit_round(self, rnd: OpenRound, m: RoundMetrics, legacy: bool) -> None:
        self.open = None
        accepted = list(rnd.accepted)
        updated = rnd.acc.fragments if isinstance(rnd.acc, FragmentSums) else []
        try:
            mean = rnd.acc.take_mean()
        except NonFiniteAggregate as e:
            self._refuse_round(accepted, str(e), m)
            return
        tau_max = max(a.staleness for a in accepted)
        # the only reference to the mean is popped by the step, so it is freed before the
        # optimizer state is copied for publication (the round's peak stays one buffer lower)
        box = [mean]
        # its memory is the next round's read buffer (wire/arena.py): held by the arena once the step used it
        spent = {k: t for k, t in mean.items() if owns_its_memory(t)}
        del mean
        stepper = round_step(self.run.opt, self.config.outer_optimizer, legacy=legacy, tau_max=tau_max)

        def step(buf):
            return stepper(buf, box.pop())
        new_ledger = merge_marks(self.run.ledger, rnd.marks)
        processed = self.intake.pending + [a.ref.path for a in accepted]
        # what each node's delta entered the state with (a fragment's delta or PA-CGAD's rule: not said)
        scales = None if legacy or updated else delta_scales(
            self.run.opt.linear_rate(), [(a.ref.node_id, a.weight, a.gate) for a in accepted])
        published = self._apply_and_publish(step, new_ledger, processed, [a.norm for a in accepted], m, accepted,
                                            updated, scales=scales)
        self.validator.arena.adopt(spent)  # after the step (published or not): nothing else uses the mean
        if published:
            for a in accepted:
                m.apply(a.ident, a.staleness)

    def _refuse_round(self, accepted: list[Accepted], detail: str, m: RoundMetrics) -> None:
        log.error("refusing the %d delta(s) of this round (%s): %s; nothing is published",
                  len(accepted), ", ".join(a.ident for a in accepted[:8]), detail)
        for a in accepted:
            self.intake.refuse(a.ref, "non_finite_update", detail, m)

    # ------------------------------------------------------------------ arrival mode

    def arrival(self, m: RoundMetrics, force: bool) -> None:
        run = self.run
        self.membership.refresh()
        if not force and self._paced(m):  # each delta is a publication: none before the budget allows
            return
        max_bytes, _ = self._limits()
        refs = self.intake.list_new(self._marks(), max_bytes, m)
        faults.point("listed", self.owner)
        if not refs:
            self.arrival_wait_since = None
            return
        now = time.monotonic()
        if self.arrival_wait_since is None:
            self.arrival_wait_since = now
        for node in sorted({r.node_id for r in refs}):  # arrival offsets: when each node was first listed
            self._heard_listed(node, now)
        ready, live = self._quorum([r.node_id for r in refs], now - self.arrival_wait_since, force, m)
        if not ready:
            m.waiting, m.pending = True, len(refs)
            return
        self.arrival_wait_since = None
        self.deadline.closed(live, now)
        refs = cap_round_robin(refs, self.config.arrival_batch)
        blocked: set[str] = set()
        fetched: list[tuple[DeltaRef, Path, int]] = []
        try:
            for ref, path in self.intake.fetch(refs, blocked, max_bytes, m):
                # rounds run only once the run has a global state (given, adopted or installed at start)
                assert run.state is not None and run.fingerprint is not None
                fetched.append((ref, path, self.validator.header_base(path, run.state, run.fingerprint)))
            faults.point("downloaded", self.owner)
            order = [(ref, path) for ref, path, _ in arrival_order(fetched) if ref.node_id not in blocked]
            if self.config.arrival_publish == "pass" and run.plan is None and len(order) > 1:
                apply_pass(self, order, blocked, m)  # behind: one optimizer step each, one publication
                return
            for ref, path in order:
                if ref.node_id in blocked:
                    continue
                try:
                    delta, acc = self.check(ref, path, run.outer_step)
                except DeltaRejected as e:
                    self.intake.refuse(ref, e.reason, e.detail, m)
                    continue
                # an encoded delta is decoded (FP32) for its own outer step: one delta at a time
                tensors = delta.tensors if delta.encoded is None else decode_delta(delta.encoded)
                del delta
                new_ledger = merge_marks(run.ledger, {ref.node_id: ref.local_step})
                processed = self.intake.pending + [ref.path]
                def step(buf, t=tensors, tau=acc.staleness, opt=run.opt, f=acc.fragment,
                         name=self.config.outer_optimizer):
                    return arrival_step(opt, name, buf, t, tau, f)

                scales = None if acc.fragment is not None else delta_scales(
                    run.opt.linear_rate(), [(ref.node_id, 1.0, run.opt.gate(acc.staleness))])
                ok = self._apply_and_publish(step, new_ledger, processed, [acc.norm], m, [acc],
                                             [acc.fragment] if acc.fragment is not None else [], scales=scales)
                del tensors, step
                if not ok:
                    break
                self.membership.heard(ref.node_id)
                m.apply(acc.ident, acc.staleness)
                self.intake.release(path)
        finally:
            for _, path, _ in fetched:
                self.intake.release(path)

    def _heard_listed(self, node: str, now: float) -> None:
        """Arrival mode: a node's delta is listed (the arrival offset; life is counted once accepted)."""
        if not self.membership.knows(node) and self._first_time(node):
            self.membership.refresh(force=True)
        self.deadline.arrived(node, now)

    # ------------------------------------------------------------------ apply + publish

    def _apply_and_publish(
        self,
        step: Callable[[dict[str, torch.Tensor]], bool],
        new_ledger: dict[str, int],
        processed: list[str],
        norms: list[float],
        m: RoundMetrics,
        accepted: list[Accepted],
        updated: list[str] | None = None,
        *,
        scales: Mapping[str, float] | None = None,
    ) -> bool:
        """One outer step on a copy of the state, then publication; rollback of everything on failure.
        ``scales``: per node, the factor its delta got (published as ``master.delta_scales``)."""
        run = self.run
        buf, backup = self.take_buffer()
        try:
            applied = step(run.opt_state(buf))  # by piece when the fragments split a tensor (runstate.py)
            if applied is False:  # fully gated (e.g. PA-CGAD fragments all too old): nothing changed
                run.give_back(buf)
                for a in accepted:
                    self.intake.refuse(a.ref, "too_stale", "the optimizer gated the whole step to 0", m)
                return False
            norm = self.finite_or_refuse(buf, backup, accepted, m)
            if norm is None:
                return False
            faults.point("stepped", self.owner)
        except BaseException:
            self.roll_back(buf, backup)
            raise
        return self.publish_stepped(buf, backup, run.outer_step + 1, new_ledger, processed, norms, m, accepted,
                                    updated, norm=norm, scales=scales)

    def take_buffer(self) -> tuple[dict[str, torch.Tensor], Any]:
        """The spare buffer a step is taken on, and what rolls the optimizer back (None: its committed file)."""
        run = self.run
        assert run.state is not None
        # the round's read buffer becomes the state buffer stepped on (no memory faulted in; wire/arena.py)
        storage = self.validator.arena.give(run.state)
        return (run.spare_buffer(storage, self.validator.arena.lanes),
                None if run.committed_outer_file is not None else run.opt.state_dict())

    def roll_back(self, buf: dict[str, torch.Tensor], backup: Any) -> None:
        """Undo steps taken on ``buf`` and forget what was processed but not published."""
        self.run.give_back(buf)
        self.run.restore_optimizer(backup)
        self.discard()

    def finite_or_refuse(self, buf: dict[str, torch.Tensor], backup: Any, accepted: list[Accepted],
                         m: RoundMetrics) -> tuple[float, int] | None:
        """The stepped state's L2 norm and size (one pass: finite, and the bound of the next deltas); a
        non-finite state gives the buffer back, restores the optimizer and refuses ``accepted`` (None)."""
        norm, numel = state_norm(buf)
        if math.isfinite(norm):
            return norm, numel
        bad = next((k for k, t in buf.items() if is_synced(t) and not math.isfinite(max_abs(t))), "?")
        self.run.give_back(buf)
        self.run.restore_optimizer(backup)
        self._refuse_round(accepted, f"the outer step made key {bad!r} of the state non-finite", m)
        return None

    def publish_stepped(self, buf: dict[str, torch.Tensor], backup: Any, new_step: int, new_ledger: dict[str, int],
                        processed: list[str], norms: list[float], m: RoundMetrics, accepted: list[Accepted],
                        updated: list[str] | None = None, *, norm: tuple[float, int],
                        applied_at: list[int] | None = None, scales: Mapping[str, float] | None = None) -> bool:
        """Publish the stepped ``buf`` as version ``new_step`` and swap it in (``norm``: its norm and size;
        ``applied_at``: the outer step each of ``accepted`` was applied at, default the one before
        ``new_step``; ``scales``: the factor each node's delta got, ``master.delta_scales``); a conflict, a
        lost lease or any error rolls everything back."""
        run = self.run
        try:
            payload = {**self.validator.state_with(norms), "aggregation": self.config.aggregation,
                       "weighting": self.config.weighting}
            manifest, record = self.publisher.publish(run, buf, new_step, new_ledger, processed, payload,
                                                             updated_fragments=updated or (), delta_scales=scales)
        except PublishConflictError as e:
            log.warning("%s; discarding this round and re-reading the hub", e)
            m.conflict = True
            self.roll_back(buf, backup)
            return False
        except LeaseLost:
            m.standby = True
            self.roll_back(buf, backup)
            return False
        except BaseException:
            self.roll_back(buf, backup)
            raise
        update = update_distance(buf, run.state, self.validator.arena.lanes) if run.state is not None else math.nan
        at = applied_at if applied_at is not None else [new_step - 1] * len(accepted)
        # per outer step: a pass of several steps is not a sign of divergence (health.py compares versions)
        update /= max(1, new_step - run.outer_step)
        run.committed(buf, new_step, new_ledger, manifest, record)
        self.health.note_deltas((a.ref.node_id, (s - a.staleness, a.fragment), a.norm) for a, s in zip(accepted, at))
        l2, numel = norm
        self.health.note_version(new_step, update, l2)
        self.health.note_losses(new_step, {n: st.report.train_loss for n, st in self.membership.nodes.items()
                                           if st.report.train_loss is not None})
        self.validator.accept(norms)
        self.validator.note_global(buf, new_step, l2, numel)
        self.intake.published(new_ledger)
        faults.point("swapped", self.owner)
        m.published += 1
        self.on_published()
        return True
