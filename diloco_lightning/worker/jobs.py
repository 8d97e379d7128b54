"""What the worker hands its uploader: a :class:`Part` (the pseudo-gradient of one or more inner
phases, lazy until the uploader thread computes it), a :class:`Job` (fresh content and/or a
doubtful earlier attempt), and what comes back (:class:`UploadReport`).

Two parts merge into the cumulative pseudo-gradient with the older base (``merge_parts``): what a
failed or paced delta becomes when the next boundary's is added to it (``worker/uploader.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Part", "Job", "UploadReport", "merge_parts", "merge_jobs", "job_keys", "Tensors"]

Tensors = dict[str, torch.Tensor]


@dataclass
class Part:
    """A pseudo-gradient covering ``phases`` inner phases: ``residual + (anchor - snapshot)``.

    ``residual`` is materialized FP32 (complex64 for complex keys); ``anchor``/``snapshot`` is
    the lazy part. Neither dict is ever modified in place once built (the worker's anchor may be
    the very same dict), so a part can be read by the uploader while training goes on.
    ``event``: a CUDA event that completes when ``snapshot``'s non-blocking copies are done.
    ``boundary``: the last boundary (the worker's count) this part covers.
    """

    base_outer_step: int
    num_tokens: int | None
    phases: int
    residual: Tensors | None = None
    anchor: Tensors | None = None
    snapshot: Tensors | None = None
    event: Any = None  # a torch.cuda.Event (or None)
    boundary: int = 0
    #: the fragment this part carries (``diloco_lightning/wire/fragments.py``; None: every synced key)
    fragment: str | None = None
    #: the fragment's outer step count at the anchor (the master's staleness of a fragment delta)
    base_fragment_step: int | None = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def materialize(self) -> Tensors:
        """The FP32 pseudo-gradient (fresh tensors, never aliases of the anchor or snapshot)."""
        self.wait()
        out: Tensors = {}
        if self.anchor is not None:
            assert self.snapshot is not None  # built together with the anchor
            for k, a in self.anchor.items():
                d = a - self.snapshot[k]
                if self.residual is not None:
                    d.add_(self.residual[k])
                out[k] = d
        elif self.residual is not None:
            out = {k: v.clone() for k, v in self.residual.items()}
        return out

    def materialized(self) -> "Part":
        return Part(self.base_outer_step, self.num_tokens, self.phases, residual=self.materialize(), boundary=self.boundary,
                    fragment=self.fragment, base_fragment_step=self.base_fragment_step)


def _sum_tokens(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a + b


def merge_parts(old: Part | None, new: Part | None) -> Part | None:
    """One part covering both (``old`` first): the cumulative pseudo-gradient, the older base.

    When ``new`` starts where ``old`` ended (``new.anchor is old.snapshot``: no install in
    between) the lazy parts telescope and nothing is computed; otherwise ``old`` is
    materialized into the residual.
    """
    if old is None:
        return new
    if new is None:
        return old
    if old.fragment != new.fragment:  # pragma: no cover - the worker holds one job per fragment
        raise AssertionError(f"merging parts of fragments {old.fragment!r} and {new.fragment!r}")
    base = min(old.base_outer_step, new.base_outer_step)
    tokens = _sum_tokens(old.num_tokens, new.num_tokens)
    phases = old.phases + new.phases
    boundary = max(old.boundary, new.boundary)
    frag = old.fragment
    fbase = None if old.base_fragment_step is None or new.base_fragment_step is None else \
        min(old.base_fragment_step, new.base_fragment_step)
    if old.anchor is not None and new.anchor is not None and new.anchor is old.snapshot:
        residual = _add(old.residual, new.residual)
        return Part(base, tokens, phases, residual, old.anchor, new.snapshot, new.event, boundary, frag, fbase)
    # ``old`` is owned by the merge (never read again), so its residual is reused, not copied
    residual = old.materialize() if old.anchor is not None else old.residual
    residual = _add(residual, new.residual)
    return Part(base, tokens, phases, residual, new.anchor, new.snapshot, new.event, boundary, frag, fbase)


def _add(a: Tensors | None, b: Tensors | None) -> Tensors | None:
    if a is None:
        return None if b is None else {k: v.clone() for k, v in b.items()}
    if b is None:
        return a
    out = {}
    for k, v in a.items():
        out[k] = v + b[k]
    return out


@dataclass
class Job:
    """What the uploader works on: a doubtful earlier attempt (``local_step``, content) and/or fresh content."""

    fresh: Part | None = None
    doubt: tuple[int, Part] | None = None

    @property
    def empty(self) -> bool:
        return self.fresh is None and self.doubt is None

    @property
    def phases(self) -> int:
        return (self.fresh.phases if self.fresh else 0) + (self.doubt[1].phases if self.doubt else 0)


def job_keys(job: Job) -> set[str] | None:
    """The keys a job's parts carry (None: unknown, so every key)."""
    keys: set[str] = set()
    for part in (job.fresh, job.doubt[1] if job.doubt else None):
        if part is None:
            continue
        source = part.anchor if part.anchor is not None else part.residual
        if source is None:
            return None
        keys.update(source)
    return keys


def merge_jobs(old: Job | None, new: Job | None) -> Job | None:
    """``old`` (e.g. a failed job that came back) followed by ``new`` (never attempted)."""
    if old is None or old.empty:
        return new
    if new is None or new.empty:
        return old
    if old.doubt is not None and new.doubt is not None:  # pragma: no cover - one job in flight at a time
        raise AssertionError("two doubtful deltas at once")
    return Job(fresh=merge_parts(old.fresh, new.fresh), doubt=old.doubt or new.doubt)


@dataclass
class UploadReport:
    """The outcome of one uploader run (one delta written, or one failed attempt)."""

    ok: bool
    local_step: int | None = None
    hub_path: str | None = None
    base_outer_step: int | None = None
    num_tokens: int | None = None
    phases: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    delta_norm: float | None = None
    error: str | None = None
    #: a doubtful earlier attempt that turned out to have landed (its phases were delivered)
    recovered_steps: list[int] = field(default_factory=list)
    recovered_phases: int = 0
    #: what must be merged into the next delta after a failure (None on success)
    remaining: Job | None = None
    #: a failure that retrying cannot fix (the message the worker stops with), None otherwise
    fatal: str | None = None
