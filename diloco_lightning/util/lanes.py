"""Independent pieces of one job run side by side on a few threads: the master round's lanes.

A round's big costs (a delta's bytes read from the page cache, its norm, the sum, the mean's
finiteness check) are loops over tensors that release the GIL (``preadv``, torch's kernels), so
``n`` threads run ``n`` contiguous groups of them at once. :meth:`Lanes.run` splits a list of
items into at most ``n`` contiguous groups of about equal weight (bytes), runs the first on the
calling thread and the others on threads the object keeps, and returns every item's result in
the items' order: a caller that folds the results in that order (a sum of per-tensor norms)
gets exactly the bits of the one-thread loop, whatever ``n``.

One lane (``n == 1``) is the plain loop on the calling thread, with no thread at all. Unlike
torch's own intra-op threads (OpenMP, whose barriers spin and stall when the cores are shared
with other processes), each lane is one whole group of work: a lane that is descheduled delays
the end of its group, never every step of the others.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

__all__ = ["Lanes", "default_lanes", "split_by_weight"]

T = TypeVar("T")
R = TypeVar("R")

#: below this many bytes of work a job runs on the calling thread alone (a thread hand-off costs ~50 us)
MIN_PARALLEL_BYTES = 4 << 20
#: bytes of one tensor a lane takes at a time in :meth:`Lanes.over_spans` (small enough that the lanes end together)
SPAN_BYTES = 8 << 20


def default_lanes(cap: int = 4) -> int:
    """The cores this process may run on, at most ``cap``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cap, cores))


def split_by_weight(weights: Sequence[int], parts: int) -> list[range]:
    """At most ``parts`` contiguous, non-empty index ranges covering ``weights`` in order, each
    closing once its share of the total (``total * (i + 1) / parts``) is reached."""
    n = len(weights)
    if n == 0:
        return []
    parts = max(1, min(parts, n))
    total = sum(max(0, w) for w in weights)
    out: list[range] = []
    start, acc = 0, 0
    for i, w in enumerate(weights):
        acc += max(0, w)
        left = n - i - 1  # items after this one
        need = parts - len(out) - 1  # groups still to open after this one closes
        if need > 0 and (acc * parts >= total * (len(out) + 1) or left == need):
            out.append(range(start, i + 1))
            start = i + 1
    out.append(range(start, n))
    return [r for r in out if len(r)]


class Lanes:
    """``n`` lanes: the calling thread and ``n - 1`` kept threads (see the module docstring).

    Args:
        n: the lanes (None: :func:`default_lanes`).
        min_weight: a job of less total weight runs on the calling thread alone.
    """

    def __init__(self, n: int | None = None, min_weight: int = MIN_PARALLEL_BYTES) -> None:
        self.n = default_lanes() if n is None else int(n)
        self.min_weight = min_weight
        if self.n < 1:
            raise ValueError(f"lanes must be >= 1, got {n!r}")
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.n - 1, thread_name_prefix="diloco-lane")
            return self._pool

    def run(self, fn: Callable[[T], R], items: Sequence[T], weights: Sequence[int] | None = None) -> list[R]:
        """``[fn(x) for x in items]``, the items in contiguous groups of about equal ``weights``
        run side by side. Every group ends before this returns; the first group's exception (in
        the items' order) is raised."""
        if weights is None:
            weights = [1] * len(items)
        if self.n == 1 or len(items) < 2 or sum(weights) < self.min_weight:
            return [fn(x) for x in items]
        groups = split_by_weight(weights, self.n)
        if len(groups) == 1:
            return [fn(x) for x in items]

        def run_group(r: range) -> list[R]:
            return [fn(items[i]) for i in r]

        pool = self._executor()
        futures: list[Future] = [pool.submit(run_group, r) for r in groups[1:]]
        results: list[list[R]] = []
        first_error: BaseException | None = None
        try:
            results.append(run_group(groups[0]))
        except BaseException as e:  # the other groups still end before this raises
            first_error = e
        for fut in futures:
            try:
                results.append(fut.result())
            except BaseException as e:
                if first_error is None:
                    first_error = e
        if first_error is not None:
            raise first_error
        return [r for group in results for r in group]

    def over_spans(self, fn: Callable[[Any, Any], R], pairs: Sequence[tuple[Any, Any]],
                   span_bytes: int | None = None) -> list[list[R]] | None:
        """``fn(a, b)`` over spans of ``span_bytes`` of each pair of flattened tensors (``b`` may be
        None), side by side; per pair, its spans' results in order. For elementwise work (a sum, a
        copy, a scale) the bits are those of whole tensors; a reduction folds the results in order.
        None (nothing run) when a tensor is not contiguous or a pair's sizes differ: the caller then
        takes the pairs whole."""
        import torch

        step_bytes = SPAN_BYTES if span_bytes is None else span_bytes
        for a, b in pairs:
            if not (isinstance(a, torch.Tensor) and a.is_contiguous() and (b is None or (
                    isinstance(b, torch.Tensor) and b.is_contiguous() and b.numel() == a.numel()))):
                return None
        spans: list[tuple[int, Any, Any]] = []
        for i, (a, b) in enumerate(pairs):
            step = max(1, step_bytes // a.element_size())
            fa, fb = a.view(-1), None if b is None else b.view(-1)
            spans += [(i, fa[lo:lo + step], None if fb is None else fb[lo:lo + step]) for lo in range(0, a.numel(), step)]
        results = self.run(lambda sp: fn(sp[1], sp[2]), spans, [sp[1].numel() * sp[1].element_size() for sp in spans])
        out: list[list[R]] = [[] for _ in pairs]
        for (i, _, _), r in zip(spans, results):
            out[i].append(r)
        return out

    def close(self) -> None:
        """End the kept threads (a later :meth:`run` starts them again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
