"""A master hand-over, for real: two ``diloco-master`` processes on one folder hub, the lease holder
killed with SIGKILL, and the standby's takeover timed (``tests/test_standby.py``,
``benchmarks/handover.py``).

The deltas are written by this process straight onto the hub, one at a time (each waits for its
publication), so the run's outer steps are a known sequence: with Nesterov (lr 0.7, momentum 0.9)
in arrival mode, one outer step per delta, the final global equals, bit for bit, an uninterrupted
master's over the same deltas only when no delta was lost or applied twice and the momentum went
over to the standby intact.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from support.env import repo_env
from support.master_crash_script import initial_state

__all__ = ["Handover", "handover", "reference_state"]

OUTER = ["outer=nesterov", "outer.lr=0.7"]
NESTEROV = dict(outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9, aggregation="arrival",
                arrival_publish="each")


@dataclass
class Handover:
    seconds: float  #: from the kill -9 of the lease holder to the standby's publication of the next outer step
    lease_ttl: float
    poll_interval: float
    outer_step: int  #: the hub's final outer step
    ledger: dict[str, int]
    holder: str  #: the master that published the final version
    state: dict[str, torch.Tensor]  #: the hub's final global weights
    standby_log: str
    deltas: list[tuple[str, int]] = field(default_factory=list)

    @property
    def warm(self) -> bool:
        """The takeover round found its state current (no version loaded at takeover)."""
        return "state held warm" in self.standby_log


def _delta(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return {k: (torch.randn(v.shape, generator=g) * 0.01).to(v.dtype) for k, v in initial_state(0).items()
            if v.is_floating_point()}


def _put(hub, tmp: Path, i: int, node: str, step: int) -> None:
    from diloco_lightning.wire.delta import model_fingerprint, write_delta

    p = tmp / f"{node}_{step}.safetensors"
    write_delta(p, _delta(i), node_id=node, local_step=step, base_outer_step=0,
                model_fingerprint=model_fingerprint(initial_state(0)))
    hub.upload_delta(p, node, step)


def _wait(what: str, cond, timeout: float, procs: list[subprocess.Popen]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"waiting for {what}: a master exited with status {p.returncode}")
        time.sleep(0.01)
    raise AssertionError(f"waited {timeout:g} s for {what}")


def _manifest(hub):
    try:
        return hub.read_manifest()
    except Exception:  # noqa: BLE001 - a publication in progress: read again
        return None


def _master(hub_dir: Path, tmp: Path, name: str, init: Path, ttl: float, poll: float, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "diloco_lightning.app.master", f"hub.url={hub_dir}", f"init={init}",
           f"node_state_dir={tmp / ('state_' + name)}", f"holder={name}", f"poll_interval={poll}", f"lease_ttl={ttl}",
           "min_deltas=1", "aggregation=arrival", "arrival_publish=each", "until_finished=false", *OUTER]
    return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=repo_env(tmp))


def deltas_of(before: int, after: int) -> list[tuple[str, int]]:
    """``before + after`` deltas from three nodes, in the order they are written."""
    nodes, out, steps = ("a", "b", "c"), [], {"a": 0, "b": 0, "c": 0}
    for i in range(before + after):
        n = nodes[i % 3]
        out.append((n, steps[n]))
        steps[n] += 1
    return out


def reference_state(tmp: Path, deltas: list[tuple[str, int]]) -> tuple[int, dict[str, torch.Tensor]]:
    """An uninterrupted master (in this process) over the same deltas, one at a time."""
    from diloco_lightning.hub.local import FileHub
    from diloco_lightning.master import MasterOuterLoop

    hub = FileHub(tmp / "ref_hub", create=True, cache_dir=tmp / "ref_cache")
    m = MasterOuterLoop(hub, initial_state(0), node_state_dir=tmp / "ref_state", lease=False, **NESTEROV)
    m.sync_once()
    for i, (node, step) in enumerate(deltas):
        _put(hub, tmp / "ref_w", i, node, step)
        m.sync_once()
    return m.snapshot()


def handover(tmp: Path, *, lease_ttl: float = 2.0, poll_interval: float = 0.1, before: int = 3,
             after: int = 2) -> Handover:
    """Master ``A`` publishes ``before`` deltas while standby ``B`` follows; ``A`` is killed with SIGKILL
    as the next delta is written; ``B`` must take the lease and publish it, then the last ones."""
    from diloco_lightning.hub.local import FileHub
    from diloco_lightning.wire.statefile import save_weights_file
    from diloco_lightning.hub.versions import load_global

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "w").mkdir(exist_ok=True)
    hub_dir = tmp / "hub"
    hub_dir.mkdir(exist_ok=True)
    init = tmp / "init.safetensors"
    save_weights_file(init, initial_state(0))
    hub = FileHub(hub_dir, cache_dir=tmp / "test_cache")
    deltas = deltas_of(before, after)
    a = _master(hub_dir, tmp, "A", init, lease_ttl, poll_interval, tmp / "A.log")
    procs = [a]
    b = None
    try:
        _wait("master A's outer step 0", lambda: _manifest(hub), 120, procs)
        b = _master(hub_dir, tmp, "B", init, lease_ttl, poll_interval, tmp / "B.log")
        procs.append(b)
        _wait("B standing by", lambda: "standing by" in (tmp / "B.log").read_text(errors="replace"), 120, procs)
        for i, (node, step) in enumerate(deltas[:before]):
            _put(hub, tmp / "w", i, node, step)
            _wait(f"delta {node}/{step} applied", lambda n=i + 1: (m := _manifest(hub)) is not None and m.outer_step == n,
                  30, procs)
        _wait(f"B holding outer_step {before} warm",
              lambda: f"holding outer_step {before} warm" in (tmp / "B.log").read_text(errors="replace"), 30, procs)
        a.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        a.wait()
        procs.remove(a)
        node, step = deltas[before]
        _put(hub, tmp / "w", before, node, step)
        hm = _wait("the standby's first publication",
                   lambda: (m := _manifest(hub)) is not None and m.outer_step == before + 1 and m, 60, procs)
        seconds = time.monotonic() - t_kill
        assert (hm.master or {}).get("holder") == "B", hm.master
        for i, (node, step) in enumerate(deltas[before + 1:], start=before + 1):
            _put(hub, tmp / "w", i, node, step)
            _wait(f"delta {node}/{step} applied", lambda n=i + 1: (m := _manifest(hub)) is not None and m.outer_step == n,
                  30, procs)
        b.send_signal(signal.SIGTERM)
        b.wait(60)
        hm = hub.read_manifest()
        _, state = load_global(hub, hm)
        return Handover(seconds=seconds, lease_ttl=lease_ttl, poll_interval=poll_interval, outer_step=hm.outer_step,
                        ledger=dict(hm.ledger), holder=str((hm.master or {}).get("holder")), state=state,
                        standby_log=(tmp / "B.log").read_text(errors="replace"), deltas=deltas)
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        hub.close()


def took_over_line(log: str) -> str | None:
    m = re.search(r"^\[master\] took over the lease.*$", log, re.M)
    return m.group(0) if m else None
