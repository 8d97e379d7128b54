"""Per-round metrics of the master: a dict per round, a JSONL file, and a one-line progress text."""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable
from diloco_lightning.util.jsondoc import dumps_json

__all__ = ["RoundMetrics", "MetricsSink", "format_progress"]

log = logging.getLogger(__name__)


@dataclass
class RoundMetrics:
    """What one ``sync_once()`` did.

    ``outer_step`` is the master's version after the call; ``published`` counts the versions
    it published (0 or 1 in round mode, one per applied delta in arrival mode);
    ``staleness_histogram`` maps a staleness (as a string, for JSON) to the number of
    applied deltas with that staleness; ``applied`` lists them as ``node/local_step``.
    """

    outer_step: int = 0
    published: int = 0
    accepted: int = 0
    rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    staleness_histogram: dict[str, int] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    listed: int = 0
    downloads: int = 0
    bytes_downloaded: int = 0
    pending: int = 0
    waiting: bool = False
    paced: float = 0.0  #: seconds the hub's commit budget asked to wait before this publication (0: none)
    standby: bool = False
    conflict: bool = False
    adopted: int | None = None
    #: a standby's round (``warm_standby``): the outer step it holds loaded, ready for a takeover
    warm: int | None = None
    #: the round that took the lease over from another master (or a fresh hub's first): its epoch
    took_over: int | None = None
    aggregation: str = "round"
    optimizer: str = ""
    holder: str = ""
    epoch: int | None = None
    round_seconds: float = 0.0
    #: the live nodes (claims with a recent heartbeat), the quorum they made, the deadline (seconds)
    live_nodes: int | None = None
    #: per node, the inner phases it reported trained and dropped (replays of delivered work after a
    #: restart from an older checkpoint; its heartbeat's ``replayed``), when any
    replayed: dict[str, int] = field(default_factory=dict)
    quorum: int | None = None
    deadline: float | None = None
    time: float = field(default_factory=time.time)

    def reject(self, reason: str) -> None:
        self.rejected += 1
        self.rejected_by_reason[reason] = self.rejected_by_reason.get(reason, 0) + 1

    def apply(self, ident: str, staleness: int) -> None:
        self.accepted += 1
        self.applied.append(ident)
        key = str(staleness)
        self.staleness_histogram[key] = self.staleness_histogram.get(key, 0) + 1

    @property
    def eventful(self) -> bool:
        """Worth a progress line: something was published, rejected, adopted, or is pending."""
        return bool(self.published or self.rejected or self.accepted or self.adopted is not None or self.conflict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["staleness_histogram"] = dict(sorted(self.staleness_histogram.items(), key=lambda kv: int(kv[0])))
        d["rejected_by_reason"] = dict(sorted(self.rejected_by_reason.items()))
        return d


def format_progress(m: dict[str, Any]) -> str:
    """``outer_step 12 | accepted 3 | rejected 1 (too_stale=1) | staleness [0:2 1:1] | round 0.41 s | read 312.5 MB``
    (``read``: the bytes of deltas this round downloaded from the hub)."""
    rej = m.get("rejected_by_reason") or {}
    rej_text = " ".join(f"{k}={v}" for k, v in rej.items())
    hist = m.get("staleness_histogram") or {}
    hist_text = " ".join(f"{k}:{v}" for k, v in hist.items())
    flags = []
    if m.get("standby"):
        flags.append("standby")
    if m.get("paced"):
        flags.append(f"publication paced by the commit budget ({m.get('pending', 0)} pending, next in {m['paced']:.0f}s)")
    elif m.get("waiting"):
        of = f" of {m['quorum']}" if m.get("quorum") is not None else ""
        live = f", {m['live_nodes']} live" if m.get("live_nodes") is not None else ""
        flags.append(f"waiting for quorum ({m.get('pending', 0)}{of} pending{live})")
    if m.get("conflict"):
        flags.append("publication conflict")
    if m.get("adopted") is not None:
        flags.append(f"adopted hub version {m['adopted']}")
    return (
        f"outer_step {m.get('outer_step')} | accepted {m.get('accepted', 0)}"
        f" | rejected {m.get('rejected', 0)}{' (' + rej_text + ')' if rej_text else ''}"
        f" | staleness [{hist_text}] | round {m.get('round_seconds', 0.0):.2f} s"
        f" | read {m.get('bytes_downloaded', 0) / 1e6:.1f} MB"
        + (" | " + ", ".join(flags) if flags else "")
    )


class MetricsSink:
    """Delivers each round's metrics: appended to a JSONL file, and handed to ``logger``.

    ``logger`` is either a :class:`logging.Logger` (gets the progress line at INFO) or a
    callable receiving the metrics dict; None logs the progress line on this module's logger.
    A failing sink is logged, never raised: metrics must not break a published round.
    """

    def __init__(self, path: str | os.PathLike | None, logger: logging.Logger | Callable[[dict], Any] | None) -> None:
        if logger is not None and not isinstance(logger, logging.Logger) and not callable(logger):
            raise ValueError(f"logger must be a logging.Logger, a callable taking the metrics dict, or None; got {logger!r}")
        self.path = Path(path) if path is not None else None
        self.logger = logger
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, metrics: RoundMetrics) -> None:
        d = metrics.to_dict()
        if self.path is not None:
            try:
                line = dumps_json(d, sort_keys=True)
                with self._lock, open(self.path, "a", encoding="utf-8") as f:
                    f.write(line + "\n")
            except Exception as e:  # noqa: BLE001
                log.warning("could not append metrics to %s: %s", self.path, e)
        try:
            if self.logger is None:
                log.info("%s", format_progress(d))
            elif isinstance(self.logger, logging.Logger):
                self.logger.info("%s", format_progress(d))
            else:
                self.logger(d)
        except Exception as e:  # noqa: BLE001
            log.warning("metrics logger failed: %s", e)
