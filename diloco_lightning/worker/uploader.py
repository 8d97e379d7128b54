"""The worker's background uploader: one thread, one delta in flight, nothing ever lost.

The training thread hands the uploader a :class:`Job`: the pseudo-gradient of one or more
inner phases, usually still *lazy* (``anchor - snapshot``, two CPU FP32 copies that the
training thread made at the boundary), so the subtraction, the encoding, the norm, the
file write and the upload all happen off the training thread.

Encoding and error feedback
---------------------------
What is sent is :class:`~diloco_lightning.encoding.feedback.ErrorFeedback`'s encoding of the
pseudo-gradient plus the residual the previous encodings dropped (``encoding/feedback.py``: the one
"delta -> what is sent" step). The residual is the uploader's state (the worker checkpoints it),
per key: a fragment's delta renews its own keys' residual only. It becomes the new one only when
the delta is delivered. When an upload fails, the delta that comes back to be merged or retried
already holds the old residual, so the residual of its keys is zero until their next delivery;
when a doubtful upload turns out to have landed, its residual is computed again from its content
(encoding is deterministic) and kept. A pseudo-gradient with
NaN or inf values (a diverged worker) cannot be quantized: it is sent in plain FP32 (the master
rejects it: ``non_finite``) and the residual is left as it was.

Exactly-once delivery
---------------------
A delta's ``local_step`` is the last boundary it covers plus the node's ``step_offset``
(0 in a clean run: ``delta_<r>`` is the r-th boundary's). So it is strictly increasing (a
node's deltas appear in order and the master's per-node high-water mark works), and it says
how far the node's delivered progress goes: a delta at step s holds every phase up to
boundary ``s - step_offset`` that was not delivered before it. A worker restarted from an
older checkpoint reads the highest step the hub has seen for it and does not send again the
boundaries it replays up to there (see ``worker/core.py``). When an upload fails the
uploader asks the hub whether the file landed anyway (a remote commit can time out after it
succeeded):

* it landed: success;
* it did not: the job comes back to the worker as *failed* with its content materialized, and
  the worker merges it into the next delta (the sum of two pseudo-gradients is the cumulative
  one, with the older ``base_outer_step``), which is uploaded under a new ``local_step``;
* the hub cannot say (it is down): the content is kept as a *doubt* with its ``local_step``.
  Before anything else is uploaded, the doubt is resolved by asking again: landed -> dropped,
  absent -> merged into what is sent next. While it cannot be resolved nothing new is
  attempted, so at most one doubtful delta and one merged pending delta are ever held.

A hub with a write rate limit (the Hugging Face Hub's commits: ``Hub.commit_wait``) paces this:
the worker holds a delta back while the budget asks to wait and merges the next boundary's into
it (the same merge as after a failure), and a failed ``lockstep`` upload is retried no sooner
than the budget or the server's ``Retry-After`` allows.

A ``DeltaExistsError`` on a fresh ``local_step`` means another writer uses this node id (or
a file was put there by someone else): the uploader raises ``step_offset`` past that file, or
past the node's highest *authentic* delta or ledger entry when that is higher (``hub_high_step``:
never past a file it has not authenticated, so two planted files cannot push the numbering to
the largest step), warns, and retries at once. Failed attempts are retried with a doubling pause
(``retry_pause``), never in a storm.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any
from pathlib import Path

import torch

from diloco_lightning.util import faults
from diloco_lightning.encoding.feedback import ErrorFeedback
from diloco_lightning.wire.delta import write_delta
from diloco_lightning.encoding import EncodedTensor, EncodingSpec
from diloco_lightning.hub.base import DeltaExistsError, Hub
from diloco_lightning.wire.manifest import Manifest
from diloco_lightning.wire.names import MAX_STEP
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.worker.jobs import Job, Part, UploadReport, job_keys, merge_jobs, merge_parts

log = logging.getLogger(__name__)

__all__ = ["Part", "Job", "UploadReport", "Uploader", "merge_parts", "merge_jobs", "retry_pause", "MAX_RETRY_PAUSE"]

#: the longest pause between two attempts of a failing upload
MAX_RETRY_PAUSE = 30.0


def retry_pause(base: float, failures: int, cap: float = MAX_RETRY_PAUSE) -> float:
    """Seconds before the next attempt after ``failures`` failed ones in a row: ``base``, doubling
    with each failure up to ``cap`` (a hub that keeps refusing is asked less and less often)."""
    return min(max(base, cap), base * 2.0 ** min(max(0, failures - 1), 30))


# ----------------------------------------------------------------------------- the thread


class Uploader:
    """Writes and uploads delta files on one background thread, in submission order.

    ``async`` use (``persistent=False``): the worker submits one job at a time (only when not
    :attr:`busy`); a failed job comes back in its report (``remaining``) to be merged.

    ``lockstep`` use (``persistent=True``): every boundary's job is queued with a gate
    (``not_before``: upload only once the hub's outer_step reaches it) and never merged; a
    failed job stays at the head of the queue and is retried every ``retry_interval`` seconds.
    Jobs waiting for their gate are materialized meanwhile (one FP32 copy each instead of two).

    A delta's ``local_step`` is ``part.boundary + step_offset``; only the uploader thread
    raises ``step_offset`` (on a collision), so read it when :attr:`busy` is False.
    """

    def __init__(
        self,
        hub: Hub,
        node_id: str,
        *,
        step_offset: int,
        spool_dir: str | os.PathLike,
        feedback: ErrorFeedback | None = None,
        model_fingerprint: str | None = None,
        signing_key: RunKey | None = None,
        hub_high_step: Callable[[], int] | None = None,
        persistent: bool = False,
        retry_interval: float = 1.0,
        read_manifest: Callable[[], Manifest | None] | None = None,
        fragments: int = 1,
    ) -> None:
        self.hub = hub
        #: the run's fragment count (written in the header of a fragment's delta)
        self.fragments = int(fragments)
        self.node_id = node_id
        self.step_offset = int(step_offset)
        self.spool_dir = Path(spool_dir)
        #: the encoding and its error-feedback residual (see the module docstring); float32 by default
        self.feedback = feedback if feedback is not None else ErrorFeedback(EncodingSpec("float32"), enabled=False)
        self._feedback_lock = threading.Lock()
        self.model_fingerprint = model_fingerprint
        self.signing_key = signing_key
        self.persistent = persistent
        self.retry_interval = retry_interval
        self._hub_high_step = hub_high_step
        self._read_manifest = read_manifest or hub.read_manifest
        self._cond = threading.Condition()
        self._queue: deque[tuple[Job, int | None]] = deque()
        self._active = False
        self._active_phases = 0
        #: the job being processed (popped from the queue), whether its doubt turned out to have landed, and
        #: once encoded the part it sends (the residual added): what :meth:`snapshot` reports of it
        self._inflight: Job | None = None
        self._doubt_landed = False
        self._sent: tuple[Part, bool] | None = None  # and whether it was encoded (its residual renewed)
        self._closed = False
        self._results: list[UploadReport] = []
        self._failures_in_row = 0
        self._thread = threading.Thread(target=self._run, name=f"diloco-upload-{node_id}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training-thread side

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._active or bool(self._queue)

    @property
    def queued_phases(self) -> int:
        """Phases handed over and not yet reported (in flight or queued)."""
        with self._cond:
            return sum(j.phases for j, _ in self._queue) + (self._active_phases if self._active else 0)

    def feedback_state(self) -> dict:
        """The error-feedback state for a checkpoint: the live residual when the uploader is idle,
        a copy taken under its lock while it is encoding (the thread updates it in place)."""
        if not self.busy:
            return self.feedback.state_dict()
        with self._feedback_lock:
            st = self.feedback.state_dict()
            if st["residual"] is not None:
                st["residual"] = {k: v.clone() for k, v in st["residual"].items()}
            return st

    def snapshot(self) -> tuple[Job | None, dict[str, Any]] | None:
        """What a checkpoint records of the uploader, without waiting for the network: ``(job, feedback)``.

        ``job`` is what the job in flight still owes the hub: once its delta is encoded, that delta as a
        *doubt* at the ``local_step`` it is sent under (holding the residual it carries, which ``feedback``,
        the error-feedback state, then no longer owes); before that, the job as it was handed over (an
        earlier doubt it is settling, and its fresh part with the residual still owed), less a doubt
        found to have landed. A worker restarted from the checkpoint asks the hub whether a doubt landed
        (then what its encoding dropped is owed again) or sends it again, as after an upload whose answer
        was lost. ``job`` is None when nothing is in flight. None when it cannot be told this way
        (lockstep's queue, fragments): the caller waits for the upload instead."""
        with self._cond:  # the thread cannot report (and end) the job while this is held
            if not self._active and not self._queue:
                with self._feedback_lock:
                    return None, self.feedback.state_without(())
            job = self._inflight if self._inflight is not None else self._queue[0][0]
            waiting = len(self._queue) - (0 if self._inflight is not None else 1)
            part = job.fresh if job.fresh is not None else job.doubt[1] if job.doubt is not None else None
            if self.persistent or waiting or part is None or part.fragment is not None:
                return None
            with self._feedback_lock:
                sent = self._sent
                if sent is None:  # not encoded yet: the residual is still owed to it
                    feedback = self.feedback.state_without(())
                    if self._doubt_landed:
                        job = Job(fresh=job.fresh)
                    return (None if job.empty else job), feedback
                part, encoded = sent
                assert part.residual is not None  # a materialized part
                content = {k: v.clone() for k, v in part.residual.items()}
                feedback = self.feedback.state_without(content if encoded else ())
            step = part.boundary + self.step_offset
        return Job(doubt=(step, dataclasses.replace(part, residual=content))), feedback

    def submit(self, job: Job, not_before: int | None = None) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the uploader is closed")
            if not self.persistent and (self._active or self._queue):
                raise RuntimeError("an upload is already in flight")
            self._queue.append((job, not_before))
            self._cond.notify_all()

    def collect(self) -> list[UploadReport]:
        """Reports of the jobs finished (or attempts failed) since the last call."""
        with self._cond:
            out, self._results = self._results, []
        return out

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or in flight (True) or ``timeout`` seconds pass (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._active or self._queue:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread (a job in flight finishes; queued ones are dropped: flush first)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ uploader thread

    def _sleep(self, seconds: float) -> bool:
        """Sleep unless closed; False when closed."""
        with self._cond:
            if not self._closed:
                self._cond.wait(seconds)
            return not self._closed

    def _gate_open(self, not_before: int) -> bool:
        try:
            m = self._read_manifest()
        except Exception as e:
            log.debug("cannot read the manifest on %s: %s", self.hub.url, e)
            return False
        return m is not None and m.outer_step >= not_before

    def _materialize_queued(self) -> None:
        with self._cond:
            lazy = [i for i, (j, _) in enumerate(self._queue) if j.fresh is not None and j.fresh.anchor is not None]
        for i in lazy:
            with self._cond:
                if i >= len(self._queue):
                    return
                job, gate = self._queue[i]
            if job.fresh is None or job.fresh.anchor is None:
                continue
            done = Job(fresh=job.fresh.materialized(), doubt=job.doubt)
            with self._cond:
                if i < len(self._queue) and self._queue[i][0] is job:
                    self._queue[i] = (done, gate)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job, gate = self._queue[0]
                self._active = True
                self._active_phases = job.phases
            if gate is not None and not self._gate_open(gate):
                self._materialize_queued()
                with self._cond:
                    self._active = False
                if not self._sleep(self.retry_interval):
                    return
                continue
            with self._cond:
                job, gate = self._queue.popleft()
                self._inflight, self._sent, self._doubt_landed = job, None, False
            try:
                report = self._process(job)
            except BaseException as e:  # never let the thread die with a job: hand it back
                log.exception("delta uploader crashed on node %s", self.node_id)
                with self._feedback_lock:  # possibly half updated: the job is resent without it
                    self.feedback.forget(job_keys(job))
                report = UploadReport(ok=False, error=f"{type(e).__name__}: {e}", remaining=job)
            retry = False
            self._failures_in_row = 0 if report.ok else self._failures_in_row + 1
            with self._cond:
                if self.persistent and not report.ok and report.remaining is not None and report.fatal is None:
                    self._queue.appendleft((report.remaining, None))  # its gate was open: retry as is
                    report.remaining = None
                    retry = True
                self._results.append(report)
                self._active = False
                self._inflight = self._sent = None
                self._doubt_landed = False
                self._cond.notify_all()
            if retry and not self._sleep(max(retry_pause(self.retry_interval, self._failures_in_row), self._commit_wait())):
                return

    def _commit_wait(self) -> float:
        """Seconds before the hub's commit budget (or a Retry-After) allows this node's next write."""
        try:
            return max(0.0, float(self.hub.commit_wait(self.node_id)))
        except Exception:  # noqa: BLE001 - advice only
            return 0.0

    def _landed(self, local_step: int) -> bool | None:
        """Whether ``nodes/<node>/delta_<local_step>`` reached the hub: it is listed there, or the
        manifest's ledger (read *after* the listing, so a delta the master applied and deleted
        in between is not missed) is at or above it; None when the hub cannot say.

        The ledger is what makes this safe across an outage: a delta whose answer was lost may be
        applied and deleted by the master before the worker can ask again; the listing alone would
        then say "never landed" and its phases would be merged into the next delta and applied twice.
        Only accepted deltas move the ledger, and nothing later of this node is sent while this
        question is open, so a ledger at or above ``local_step`` means this very delta was applied."""
        try:
            refs = self.hub.list_node_deltas(self.node_id, local_step - 1)
            if any(r.node_id == self.node_id and r.local_step == local_step for r in refs):
                return True
            manifest = self._read_manifest()
        except Exception as e:
            log.debug("cannot tell whether delta_%d landed on %s: %s", local_step, self.hub.url, e)
            return None
        return manifest is not None and manifest.ledger.get(self.node_id, -1) >= local_step

    def _process(self, job: Job) -> UploadReport:
        """One job: settle its doubt (did an earlier attempt land?), then encode and send what is
        left; the report says what was delivered, including a doubt that landed after all."""
        t0 = time.perf_counter()
        settled = self._settle(job)
        if settled is None:
            assert job.doubt is not None
            return UploadReport(
                ok=False,
                error=f"hub {self.hub.url} unreachable (cannot tell whether delta_{job.doubt[0]} landed)",
                seconds=time.perf_counter() - t0,
                remaining=job,
            )
        fresh, recovered = settled
        report = UploadReport(ok=True) if fresh is None else self._send(fresh, *self._encode(fresh))
        if recovered is not None:
            report.recovered_steps, report.recovered_phases = [recovered[0]], recovered[1]
        report.seconds = time.perf_counter() - t0
        return report

    def _settle(self, job: Job) -> tuple[Part | None, tuple[int, int] | None] | None:
        """What is left to send of ``job`` once its doubt is settled, and the doubt's ``(local_step,
        phases)`` when it did land; None when the hub cannot say (nothing is attempted then)."""
        if job.doubt is None:
            return job.fresh, None
        step, part = job.doubt
        landed = self._landed(step)
        if landed is None:
            return None
        if not landed:
            return merge_parts(part, job.fresh), None
        log.info("node %s: delta_%d did land after all; not sending it again", self.node_id, step)
        with self._feedback_lock:  # what its encoding dropped is owed to the next delta
            self.feedback.absorb(part.residual if part.anchor is None and part.residual is not None
                                 else part.materialize())
            self._doubt_landed = True
        return job.fresh, (step, part.phases)

    def _encode(self, fresh: Part) -> tuple[Mapping[str, torch.Tensor | EncodedTensor], Part, float, bool]:
        """``fresh``'s pseudo-gradient as sent (the residual added, encoded), the part that comes
        back if it is not delivered (holding that residual), its L2 norm, and whether it was
        encoded (a non-finite one is sent in plain FP32, for the master to refuse)."""
        delta = fresh.materialize()
        sq = 0.0
        for d in delta.values():
            if d.numel():
                sq += float(torch.linalg.vector_norm(d).double()) ** 2
        norm = math.sqrt(sq)
        encoded = math.isfinite(norm) or all(bool(torch.isfinite(d).all()) for d in delta.values())
        tensors: Mapping[str, torch.Tensor | EncodedTensor]
        content = Part(fresh.base_outer_step, fresh.num_tokens, fresh.phases, residual=delta, boundary=fresh.boundary,
                       fragment=fresh.fragment, base_fragment_step=fresh.base_fragment_step)
        if not encoded:
            log.error("node %s: the pseudo-gradient has NaN or inf values (diverged?); sending it in plain float32, "
                      "the master will refuse it", self.node_id)
        with self._feedback_lock:  # delta += residual, in place: what comes back on a failure holds it
            tensors = self.feedback.encode(delta, in_place=True) if encoded else delta
            self._sent = (content, encoded)  # in the same hold: a snapshot sees the residual renewed and what holds it
        return tensors, content, norm, encoded

    def _forget_residual(self, content: Part, encoded: bool) -> None:
        """An undelivered delta comes back holding the residual of its keys (``content``): it is
        owed no more."""
        if encoded:
            with self._feedback_lock:
                self.feedback.forget(content.residual)

    def _send(self, fresh: Part, tensors: Mapping[str, torch.Tensor | EncodedTensor], content: Part, norm: float,
              encoded: bool) -> UploadReport:
        """Write and upload ``tensors`` as ``delta_<boundary + step_offset>``: a collision raises
        the offset and tries again (three times); a failed upload asks the hub whether it landed."""
        extra = {"phases": str(fresh.phases)}
        if fresh.fragment is not None:  # docs/spec.md, "Fragments"
            extra.update(fragment=fresh.fragment, fragments=str(self.fragments),
                         base_fragment_step=str(fresh.base_fragment_step))
        sent = UploadReport(ok=False, base_outer_step=fresh.base_outer_step, num_tokens=fresh.num_tokens,
                            phases=fresh.phases, delta_norm=norm)  # what every report of this delta says
        for _attempt in range(3):
            step = fresh.boundary + self.step_offset
            local = self.spool_dir / f"delta_{step}.safetensors"
            nbytes = 0
            try:
                nbytes = write_delta(local, tensors, node_id=self.node_id, local_step=step,
                                     base_outer_step=fresh.base_outer_step, num_tokens=fresh.num_tokens,
                                     model_fingerprint=self.model_fingerprint, signing_key=self.signing_key,
                                     extra_metadata=extra)
                faults.point("worker.uploading")
                hub_path = self.hub.upload_delta(local, self.node_id, step)
                faults.point("worker.uploaded")
            except DeltaExistsError:
                # past the file in the way, or past this node's highest *authentic* delta (or its ledger)
                # if that is higher: a file anyone put there never moves the numbering further
                try:
                    high = self._hub_high_step() if self._hub_high_step is not None else step
                except Exception as e:  # noqa: BLE001 - the hub cannot say: step past the file in the way only
                    log.debug("cannot read this node's highest step on %s: %s", self.hub.url, e)
                    high = step
                target = max(step, high) + 1
                if target > MAX_STEP:
                    self._forget_residual(content, encoded)
                    return dataclasses.replace(
                        sent, remaining=Job(fresh=content),
                        fatal=(f"node {self.node_id}: cannot number its next delta: this node's deltas on {self.hub.url} "
                               f"already reach local_step {max(step, high)}, the largest a delta may have; give this "
                               f"worker another node_id"),
                    )
                self.step_offset += target - step
                log.warning(
                    "node %s: delta_%d already exists on %s (another process with this node_id, or a file someone "
                    "else put there?); sending as delta_%d instead",
                    self.node_id, step, self.hub.url, fresh.boundary + self.step_offset,
                )
                continue
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                landed = self._landed(step)
                if not landed:
                    self._forget_residual(content, encoded)
                    remaining = Job(fresh=content) if landed is False else Job(doubt=(step, content))
                    return dataclasses.replace(sent, local_step=step, error=error, remaining=remaining)
                log.info("node %s: upload of delta_%d reported %s but the file landed", self.node_id, step, error)
                hub_path = None
            finally:
                try:
                    local.unlink()
                except FileNotFoundError:
                    pass
            return dataclasses.replace(sent, ok=True, local_step=step, hub_path=hub_path, nbytes=nbytes)
        self._forget_residual(content, encoded)
        return UploadReport(
            ok=False,
            error=f"delta_{fresh.boundary + self.step_offset} kept colliding with existing deltas on {self.hub.url}",
            remaining=Job(fresh=content),
        )
