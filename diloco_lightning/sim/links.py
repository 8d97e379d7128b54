"""Communication on the simulated clock: each worker's link to the hub, and what a transfer costs.

A transfer of ``n`` bytes over worker ``k``'s link that starts at ``t`` ends at
``t + latency_k + (the time the link's bandwidth takes to integrate to n)``: ``n / bandwidth_k``
at a constant bandwidth; with a trace (``[[time, bytes per unit], ...]`` change points, like a
speed trace) the bandwidth changes over time and a transfer that spans a change point integrates
it (:func:`~diloco_lightning.sim.options.phase_end`, the same integral as a phase's). No bandwidth
(None) is an infinitely fast link: a transfer costs its latency only.

A link is full duplex, as an uplink and a downlink are: an upload and a download proceed side by
side at the full bandwidth each; two uploads (or two downloads) of one worker never overlap (the
product's worker has one uploader thread and one fetcher thread), so each direction keeps the
time it is busy until (:class:`Link`).

Bytes: an upload is the delta as the worker's encoding puts it on the wire (float casts, int8,
int4, top-k; with fragments, one fragment's keys), measured by encoding it
(:func:`wire_bytes`); a download is a whole global version in its dtype, as the product's worker
loads one (with fragments too: the worker reads the version's file and installs one fragment of
it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from diloco_lightning.sim.options import phase_end

__all__ = ["Link", "state_bytes", "wire_bytes"]


def wire_bytes(wire: Mapping[str, Any]) -> int:
    """Bytes of an encoded delta: its tensors' (a plain float delta) or its encoded parts'."""
    total = 0
    for v in wire.values():
        if isinstance(v, Tensor):
            total += v.numel() * v.element_size()
        else:  # an encoded tensor: its parts
            total += v.nbytes
    return total


def state_bytes(state: Mapping[str, Tensor]) -> int:
    """Bytes of a global version as the master publishes it (every tensor, in its dtype)."""
    return sum(t.numel() * t.element_size() for t in state.values())


class Link:
    """One worker's link to the hub: ``latency`` (units of simulated time per transfer) and a
    bandwidth in bytes per unit: a number, a trace (``[[0, b0], [t1, b1], ...]``: ``b0`` from time 0,
    ``b1`` from ``t1`` on ...) or None (unlimited)."""

    def __init__(self, latency: float = 0.0, bandwidth: float | list[list[float]] | None = None) -> None:
        self.latency = float(latency)
        self.trace: list[list[float]] | None = None
        self.bandwidth: float | None = None
        if isinstance(bandwidth, list):
            self.trace = [[float(t), float(b)] for t, b in bandwidth]
            self.bandwidth = self.trace[0][1]
        elif bandwidth is not None:
            self.bandwidth = float(bandwidth)
        self.up_free = 0.0  # the upload direction is busy until then
        self.down_free = 0.0  # and the download direction

    @property
    def instant(self) -> bool:
        """Whether every transfer takes no time."""
        return self.latency == 0.0 and self.bandwidth is None

    def end_of(self, start: float, nbytes: int) -> float:
        """When a transfer of ``nbytes`` that starts at ``start`` ends (see the module docstring)."""
        t = start + self.latency
        if nbytes <= 0 or self.bandwidth is None:
            return t
        return phase_end(t, float(nbytes), self.bandwidth, self.trace)

    def upload(self, ready: float, nbytes: int) -> tuple[float, float]:
        """An upload that can start at ``ready``: ``(start, end)``, after the previous upload."""
        start = max(ready, self.up_free)
        end = self.end_of(start, nbytes)
        self.up_free = end
        return start, end

    def download(self, ready: float, nbytes: int) -> tuple[float, float]:
        """A download that can start at ``ready``: ``(start, end)``, after the previous download."""
        start = max(ready, self.down_free)
        end = self.end_of(start, nbytes)
        self.down_free = end
        return start, end

    def uploading(self, t: float) -> bool:
        """Whether an upload is still running at ``t``."""
        return self.up_free > t

    def downloading(self, t: float) -> bool:
        """Whether a download is still running at ``t``."""
        return self.down_free > t

    def seconds(self, nbytes: int) -> float:
        """The time a transfer of ``nbytes`` takes at the link's first bandwidth (for reports)."""
        return self.latency + (0.0 if self.bandwidth is None else nbytes / self.bandwidth)
