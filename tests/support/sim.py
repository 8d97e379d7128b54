"""A configured run on the simulator, every version kept (``tests/test_sim.py``, ``tests/test_sim_batched.py``)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["simulate_keeping_versions"]


def simulate_keeping_versions(cfg: Any) -> tuple[Any, Any]:
    """``(simulator, result)`` of ``build_simulator(cfg)`` run with one thread per op (as each real
    worker ran) and no version pruned (``sim.master.versions`` holds every one, to compare)."""
    from diloco_lightning.app.sim import build_simulator

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sim = build_simulator(cfg)
        sim.master.prune = lambda keep_from: None  # keep every version to compare
        return sim, sim.run()
    finally:
        torch.set_num_threads(threads)
