"""What a simulated run produced, and what the master receives from the wire."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from diloco_lightning.encoding.feedback import decode_delta

__all__ = ["SimResult", "as_received"]


def as_received(wire: Mapping[str, Any]) -> dict[str, Tensor]:
    """What the master adds to its sum from what a worker put on the wire: the tensors themselves,
    or, for an encoded value (``diloco_lightning.encoding.EncodedTensor``), its FP32 decoding."""
    return decode_delta(wire)



@dataclass
class SimResult:
    """What a simulated run produced (the product turns it into ``results.json``)."""

    outer_steps: int
    final_state: dict[str, Tensor]
    records: list[dict[str, Any]]  # one per published version (and refusals in between)
    eval_curve: list[list[float]]
    sim_time: float
    wall_seconds: float
    inner_steps: int  # inner steps taken, all workers
    bytes_sent: int
    deltas: int
    staleness_histogram: dict[str, int] = field(default_factory=dict)
    eval_times: list[float] = field(default_factory=list)  # simulated time of each eval_curve point
    lost_phases: int = 0  # phases in flight when their worker left or was preempted
    eval_tokens: list[int] = field(default_factory=list)  # tokens delivered to the master by each eval_curve point
    #: per worker, simulated time spent: computing finished phases, computing lost (or abandoned) ones, down
    time_use: list[dict[str, float]] = field(default_factory=list)
    comm: dict[str, Any] = field(default_factory=dict)  # what the communication cost (Transfers.comm_summary)
    stopped_early: bool = False  # an evaluation was above options.stop_above: the run stopped there
