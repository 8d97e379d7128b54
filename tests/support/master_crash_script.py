"""A master that kills itself (SIGKILL) at a chosen point of a round: the kill -9 half of the
crash tests in tests/test_master_crash.py. Not a test module (no ``test_`` prefix).

    python tests/support/master_crash_script.py '<json config>'

Config keys: ``hub`` ({"kind": "file", "path": ...}, {"kind": "hf" or "hf_nodes" (the per-node
layout), "endpoint": ..., "repo": ..., "token": ..., "cache_dir": ...} or {"kind": "s3", "url": ...,
"endpoint": ..., "cache_dir": ...}), ``state_dir``, ``seed`` (initial state),
``crash`` (a label of ``MasterOuterLoop.fault`` or of the hub's ``fault``; a label ending in
``*`` matches by prefix), ``occurrence`` (kill at the k-th time the label is reached),
``master`` (constructor keywords). Without a crash, it runs rounds until nothing is left
and prints ``done <outer_step>``. No ``import lightning`` here: it has to start fast.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from diloco_lightning.util import faults  # noqa: E402
from diloco_lightning.master import MasterOuterLoop  # noqa: E402


def initial_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "emb.weight": torch.randn(16, 8, generator=g),
        "layer.weight": torch.randn(8, 8, generator=g),
        "layer.bias": torch.randn(8, generator=g),
        "norm.weight": torch.ones(8).to(torch.bfloat16),
        "step_count": torch.tensor(3),
    }


def open_hub(spec: dict):
    if spec["kind"] == "file":
        from diloco_lightning.hub.local import FileHub

        return FileHub(spec["path"], cache_dir=spec.get("cache_dir"))
    if spec["kind"] == "s3":
        from diloco_lightning.hub import open_hub as open_url

        return open_url(spec["url"], endpoint_url=spec["endpoint"], addressing_style="path", cache_dir=spec.get("cache_dir"),
                        max_retries=2, retry_base_delay=0.01, retry_max_delay=0.05, check_conditional_writes=False)
    if spec["kind"] == "hf_nodes":
        from diloco_lightning.hub import open_hub as open_url

        return open_url(f"hf://{spec['repo']}", layout="per_node", endpoint=spec["endpoint"], token=spec.get("token"),
                        cache_dir=spec.get("cache_dir"), max_retries=2, retry_base_delay=0.01, retry_max_delay=0.05,
                        commits_per_hour=0)
    from diloco_lightning.hub.hf import HFHub

    return HFHub(
        spec["repo"], endpoint=spec["endpoint"], token=spec.get("token"), cache_dir=spec.get("cache_dir"),
        max_retries=2, retry_base_delay=0.01, retry_max_delay=0.05, commits_per_hour=0,
    )


def main() -> None:
    cfg = json.loads(sys.argv[1])
    hub = open_hub(cfg["hub"])
    master = MasterOuterLoop(hub, initial_state(cfg.get("seed", 0)), node_state_dir=cfg["state_dir"], **cfg.get("master", {}))
    crash = cfg.get("crash")
    want = int(cfg.get("occurrence", 1))
    seen = [0]

    def fault(label: str) -> None:
        if crash is None:
            return
        hit = label.startswith(crash[:-1]) if crash.endswith("*") else label == crash
        if hit:
            seen[0] += 1
            if seen[0] == want:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    faults.install(master, fault)
    faults.install(hub, fault)
    for _ in range(100):
        master.sync_once(force=True)
        if not hub.list_deltas(after=master.ledger):
            break
    print(f"done {master.outer_step}", flush=True)


if __name__ == "__main__":
    main()
