"""Two real workers on threads against a real master on one folder hub (``tests/test_worker.py``,
``tests/test_rebase.py``): each trains by adding seeded noise to ``layer.weight`` between its
boundaries, then flushes; the master is stopped once it reached a given outer step (or 10 s after
the workers end). A worker's error fails the test with the error itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from diloco_lightning.hub.local import FileHub
from diloco_lightning.worker import DiLoCoWorker

__all__ = ["run_crash_script", "run_two_workers"]

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]

#: a worker that polls often and gives up on a wait soon (the tests' hubs are local folders)
FAST = dict(poll_interval=0.01, wait_timeout=10.0)


def run_two_workers(master: Any, root: Path | None, init: Mapping[str, torch.Tensor], *, outer_steps: int,
                    phases: int = 8, pause: float = 0.0, hub_for: Callable[[str], Any] | None = None,
                    **options: Any) -> dict[str, DiLoCoWorker]:
    """Run workers ``w0`` and ``w1`` (``DiLoCoWorker(FileHub(root), node, params, **FAST, **options)``,
    each on its own copy of ``init``, its noise seeded by its number) for ``phases`` boundaries each,
    ``pause`` seconds after each; then wait for the started ``master`` to reach ``outer_steps`` and
    stop it. Returns the (closed) workers by node. ``hub_for(node)``: a worker's hub (an open one or a
    URL) instead of ``FileHub(root)``."""
    errors: list[BaseException] = []
    workers: dict[str, DiLoCoWorker] = {}

    def run(node: str) -> None:
        try:
            params = {k: (torch.nn.Parameter(v.clone()) if v.is_floating_point() else v.clone()) for k, v in init.items()}
            g = torch.Generator().manual_seed(int(node[1:]))
            weight = params["layer.weight"]
            hub = FileHub(root) if hub_for is None else hub_for(node)
            with DiLoCoWorker(hub, node, params, **{**FAST, **options}) as w:
                workers[node] = w
                for _ in range(phases):
                    with torch.no_grad():
                        weight.add_(torch.randn(tuple(weight.shape), generator=g) * 0.01)
                    w.boundary()
                    if pause:
                        time.sleep(pause)
                assert w.flush()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(n,)) for n in ("w0", "w1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    deadline = time.monotonic() + 10
    while master.outer_step < outer_steps and time.monotonic() < deadline:
        time.sleep(0.02)
    master.stop()
    if errors:
        raise errors[0]
    return workers


def run_crash_script(cfg: dict, faults: str | None, timeout: float) -> subprocess.CompletedProcess:
    """``support/worker_crash_script.py`` with ``cfg`` in a process of its own, with the crash points
    ``faults`` armed (``DILOCO_FAULTS``; None: none)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("DILOCO_FAULTS", None)
    if faults:
        env["DILOCO_FAULTS"] = faults
    return subprocess.run([sys.executable, str(SUPPORT / "worker_crash_script.py"), json.dumps(cfg)],
                          capture_output=True, text=True, timeout=timeout, env=env)
