"""The master's intake: which deltas to read, fetching them, and remembering what it refused.

* **Listing** asks the hub only for deltas above the ledger (a processed delta is never
  downloaded again), drops what was refused before (by path and the hub's version token:
  a different file put at that path later is read), refuses at once a file listed larger
  than a delta of this model can honestly be, and flags a delta listed at or below the
  marks as a ``replay``.
* **Fetching** downloads a few ahead of the consumer (``prefetch``) on a bounded pool
  (``download_workers``), each download capped at the honest size. A failed download blocks
  the node's later deltas for this round (the ledger is a per-node high-water mark: a later
  one applied first would hide the failed one for ever), and after
  ``max_download_attempts`` the delta is refused (``download``); an authentication error
  aborts the round; a file that vanished (processed by another master) blocks the node.
* **Refusals** (:meth:`Intake.refuse`) are logged, counted, remembered (bounded) and queued
  for deletion with the next publication. They never move the ledger.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict, deque
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from diloco_lightning.hub.base import DeltaRef, Hub, HubAuthError, HubFileTooLargeError, HubNotFoundError
from diloco_lightning.master.config import MasterConfig
from diloco_lightning.master.metrics import RoundMetrics
from diloco_lightning.wire.names import parse_delta_path

__all__ = ["Intake", "REFUSED_MEMORY"]

log = logging.getLogger(__name__)

#: refused files remembered (path, version token), so they are never read twice; bounded
REFUSED_MEMORY = 100_000
_REPLAY_MEMORY = 10_000


class Intake:
    """See the module docstring. ``pending`` lists the hub paths refused since the last
    publication (the next one deletes them)."""

    def __init__(self, hub: Hub, config: MasterConfig) -> None:
        self.hub = hub
        self.config = config
        self.pending: list[str] = []
        self._refused: OrderedDict[tuple[str, str | None], None] = OrderedDict()
        self._replays_seen: OrderedDict[str, None] = OrderedDict()
        self._failures: dict[tuple[str, int], int] = {}

    # ------------------------------------------------------------------ refusals

    def refuse(self, ref: DeltaRef, reason: str, detail: str, m: RoundMetrics) -> None:
        """Refuse a delta: logged, counted, remembered (never read again), deleted with the next
        publication. It does not move the ledger: only accepted deltas do, so a file anyone put
        under a node's name cannot hide that node's later work."""
        log.warning("rejecting %s: %s: %s", ref.path, reason, detail)
        m.reject(reason)
        self._refused[(ref.path, ref.version)] = None
        while len(self._refused) > REFUSED_MEMORY:
            self._refused.popitem(last=False)
        self.pending.append(ref.path)

    def refused_step(self, node_id: str, local_step: int) -> bool:
        """Whether a delta of ``node_id`` at ``local_step`` or later was refused (the ledger never reaches it)."""
        for path, _version in reversed(self._refused):
            ident = parse_delta_path(path)
            if ident is not None and ident.node_id == node_id and ident.local_step >= local_step:
                return True
        return False

    def published(self, ledger: Mapping[str, int]) -> None:
        """A publication carried ``ledger`` and deleted the pending refusals."""
        self.pending = []
        for key in [k for k in self._failures if k[1] <= ledger.get(k[0], -1)]:
            del self._failures[key]

    # ------------------------------------------------------------------ listing

    def list_new(self, marks: Mapping[str, int], max_bytes: int, m: RoundMetrics) -> list[DeltaRef]:
        """The deltas to read this round, sorted by node then step."""
        refs = self.hub.list_deltas(after=marks)
        m.listed = len(refs)
        out: list[DeltaRef] = []
        seen: set[tuple[str, int]] = set()
        for ref in refs:
            if (ref.path, ref.version) in self._refused:
                continue  # refused before: never read twice (a new file at that path has a new version)
            if ref.size is not None and ref.size > max_bytes:
                self.refuse(ref, "size", f"{ref.size} bytes listed; a delta of this model is at most {max_bytes}", m)
                continue
            key = (ref.node_id, ref.local_step)
            if ref.local_step <= marks.get(ref.node_id, -1) or key in seen:
                # a hub that lists what it was told to leave out, or lists a delta twice: never re-download
                if ref.path not in self._replays_seen:
                    self._replays_seen[ref.path] = None
                    while len(self._replays_seen) > _REPLAY_MEMORY:
                        self._replays_seen.popitem(last=False)
                    log.warning("rejecting %s: replay of an already processed delta", ref.path)
                    m.reject("replay")
                continue
            seen.add(key)
            out.append(ref)
        out.sort()
        return out

    # ------------------------------------------------------------------ fetching

    def fetch(self, refs: list[DeltaRef], blocked: set[str], max_bytes: int, m: RoundMetrics) -> Iterator[tuple[DeltaRef, Path]]:
        """``(ref, local path)`` of the deltas to process, in order, downloads running ``prefetch``
        ahead; failed downloads are classified (module docstring) and a node blocked meanwhile is
        skipped. Release each path with :meth:`release` once read."""
        for ref, path, err in self._pool(refs, blocked, max_bytes, m):
            if err is not None:
                self._download_error(ref, err, blocked, m)
                continue
            assert path is not None  # a download without an error has its file
            if ref.node_id in blocked:
                self.release(path)
                continue
            yield ref, path

    def _pool(
        self, refs: list[DeltaRef], blocked: set[str], max_bytes: int, m: RoundMetrics
    ) -> Iterator[tuple[DeltaRef, Path | None, BaseException | None]]:
        if not refs:
            return
        it = iter(refs)
        window: deque = deque()
        ex = ThreadPoolExecutor(max_workers=self.config.download_workers, thread_name_prefix="diloco-master-dl")

        def submit() -> None:
            for ref in it:
                if ref.node_id in blocked:
                    continue
                window.append((ref, ex.submit(self.hub.download, ref.path, max_bytes=max_bytes)))
                return

        try:
            for _ in range(self.config.prefetch):
                submit()
            while window:
                ref, fut = window.popleft()
                submit()
                try:
                    path = fut.result()
                except BaseException as e:  # noqa: BLE001 - classified by the caller
                    yield ref, None, e
                    continue
                m.downloads += 1
                try:
                    m.bytes_downloaded += ref.size if ref.size is not None else os.path.getsize(path)
                except OSError:
                    pass
                yield ref, path, None
        finally:
            for _, fut in window:
                fut.cancel()
            ex.shutdown(wait=True, cancel_futures=True)

    def _download_error(self, ref: DeltaRef, err: BaseException, blocked: set[str], m: RoundMetrics) -> None:
        if isinstance(err, HubAuthError):
            raise err
        if isinstance(err, HubFileTooLargeError):
            self.refuse(ref, "size", str(err), m)
            return
        if isinstance(err, HubNotFoundError):
            blocked.add(ref.node_id)  # later deltas of this node wait: the ledger is a high-water mark
            log.info("%s vanished before it was downloaded (processed elsewhere?): %s", ref.path, err)
            return
        key = (ref.node_id, ref.local_step)
        n = self._failures.get(key, 0) + 1
        self._failures[key] = n
        if n >= self.config.max_download_attempts:
            del self._failures[key]
            self.refuse(ref, "download", f"{n} failed attempts, last: {err}", m)
        else:
            blocked.add(ref.node_id)
            log.warning("download of %s failed (attempt %d of %d): %s", ref.path, n, self.config.max_download_attempts, err)

    def release(self, path: Path | None) -> None:
        """A downloaded copy is no longer needed (the transport decides what that means)."""
        if path is not None:
            self.hub.release(path)
