"""How fast a master applies deltas on each transport, against how fast they arrive (arrival mode).

    python benchmarks/master_throughput.py                         # file, s3, hf; 4 nodes at 4 deltas/s; 40 s each
    python benchmarks/master_throughput.py --transports s3 --rate 8 --seconds 60 --numel 1000000
    python benchmarks/master_throughput.py --publish each          # one publication per delta only

A feeder process plays N asynchronous workers: every ``1 / rate`` seconds one of them (round-robin)
reads the manifest, as a worker that just installed the newest version would, and uploads a delta
made from it (``base_outer_step`` = that version). The master runs in this process, in arrival mode
(every delta its own outer step), on the same hub through its own handle: S3 is moto behind the
fault proxy of ``tests/support/s3_proxy.py`` (no faults injected), hf the loopback Hub of
``tests/support/hf_server.py``. It prints, per transport: deltas uploaded and applied per second, versions
published per second, the staleness of the applied deltas (mean, p95, max), the backlog left at the
end, and where the master's time went (listing the deltas, downloading them, publishing, the rest:
the outer step, checks, local state), from wrappers around the hub's calls.

The master keeps up when deltas applied per second matches deltas uploaded per second; its bound is
``1 / (seconds per pass)`` passes a second, and what a pass costs is in the split. Each transport
runs once per ``--publish`` value, the master's ``arrival_publish``: ``each`` publishes every delta
as its own version (one publication per delta bounds the rate), ``pass`` (the default) applies the
deltas one pass finds as consecutive outer steps and publishes once (``master/arrival.py``), so the
two runs show the bound and what lifting it does to the backlog and the staleness.

Results go to ``runs/perf/master_throughput.json`` (one entry per run, flushed as each ends).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "support"
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

REPO = "bench/throughput"
TOKEN = "hf_benchTHROUGHPUTtoken0123456789"


# ----------------------------------------------------------------------------- the stores


class Stores:
    """The loopback servers (in this process) and how to open a hub on each transport."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.hf = None
        self.moto = None
        self.proxy = None

    def start(self, kinds: list[str]) -> None:
        sys.path.insert(0, str(TESTS))
        import logging

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        if "hf" in kinds:
            from hf_server import FakeHubServer

            self.hf = FakeHubServer().start()
        if "s3" in kinds:
            os.environ.update(AWS_ACCESS_KEY_ID="AKIDBENCH0000000001", AWS_SECRET_ACCESS_KEY="benchSECRET0123456789",
                              AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true")
            from moto.server import ThreadedMotoServer
            from s3_proxy import S3Proxy

            self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            self.moto.start()
            host, port = self.moto.get_host_and_port()
            self.proxy = S3Proxy(f"http://{host}:{port}").start()

    def stop(self) -> None:
        for s in (self.proxy, self.hf):
            if s is not None:
                s.stop()
        if self.moto is not None:
            self.moto.stop()

    def hub_spec(self, kind: str, run: str) -> tuple[str, dict[str, Any]]:
        """(url, options) of a fresh hub ``run`` on ``kind``, for any process."""
        if kind == "file":
            return str(self.tmp / run / "hub"), {}
        if kind == "s3":
            import boto3

            boto3.client("s3", endpoint_url=self.proxy.endpoint, region_name="us-east-1").create_bucket(Bucket=run)
            return f"s3://{run}/run", {"endpoint_url": self.proxy.endpoint, "addressing_style": "path"}
        self.hf.create_repo(f"{REPO}-{run}")
        return f"hf://{REPO}-{run}", {"endpoint": self.hf.endpoint, "token": TOKEN, "commits_per_hour": 0}


# ----------------------------------------------------------------------------- the feeder (another process)


def _feed(url: str, options: dict, cache: str, numel: int, nodes: int, rate: float, seconds: float, out) -> None:
    from diloco_lightning.hub import open_hub
    from diloco_lightning.wire.delta import write_delta

    hub = open_hub(url, cache_dir=cache, **options)
    tmp = Path(tempfile.mkdtemp(prefix="feed-"))
    # one delta per node, each its own (identical deltas of two nodes make the master warn of shared data)
    per_node = [{"w": torch.randn(numel, generator=torch.Generator().manual_seed(n)) * 1e-3} for n in range(nodes)]
    steps = [0] * nodes
    hub.read_manifest()  # connected: the clock starts now
    sent, t0, i = 0, time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        due = t0 + i / rate
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        node = i % nodes
        i += 1
        try:
            m = hub.read_manifest()
            base = m.outer_step if m is not None else 0
            steps[node] += 1
            p = tmp / f"d{node}.safetensors"
            write_delta(p, per_node[node], node_id=f"w{node}", local_step=steps[node], base_outer_step=base)
            hub.upload_delta(p, f"w{node}", steps[node])
            sent += 1
        except Exception as e:  # noqa: BLE001 - a benchmark feeder: count it and go on
            print(f"feeder: {type(e).__name__}: {e}", file=sys.stderr)
    shutil.rmtree(tmp, ignore_errors=True)
    out.put((sent, t0, time.monotonic()))  # CLOCK_MONOTONIC is one clock for every process of the machine


# ----------------------------------------------------------------------------- the master, timed


class Timed:
    """Seconds spent in each of a hub's calls (wrapped in place)."""

    CALLS = {"list_deltas": "list", "download": "download", "publish": "publish", "delete": "gc", "list_global": "gc",
             "sweep": "gc", "read_manifest": "read", "read_lease": "lease",
             "write_lease": "lease", "list_claims": "claims"}

    def __init__(self, hub) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()
        for name, kind in self.CALLS.items():
            fn = getattr(hub, name, None)
            if fn is not None:
                setattr(hub, name, self._wrap(fn, kind))

    def _wrap(self, fn, kind):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                with self._lock:
                    self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - t0
                    self.calls[kind] = self.calls.get(kind, 0) + 1
        return timed


def run_one(stores: Stores, kind: str, args, publish: str) -> dict[str, Any]:
    from diloco_lightning.hub import open_hub
    from diloco_lightning.master import MasterOuterLoop

    run = f"t{kind}{publish}{int(time.time() * 1000) % 10**8}"
    url, options = stores.hub_spec(kind, run)
    hub = open_hub(url, cache_dir=str(stores.tmp / run / "cache-m"), **({"create": True} if kind == "file" else options))
    timed = Timed(hub)
    m = MasterOuterLoop(hub, {"w": torch.zeros(args.numel)}, node_state_dir=stores.tmp / run / "master",
                        outer_optimizer="nesterov", outer_lr=0.1, outer_momentum=0.9, aggregation="arrival",
                        arrival_publish=publish, poll_interval=0.02, norm_global_ratio=None, norm_ratio=None,
                        lease_ttl=60, torch_threads=1)
    assert m.sync_once()  # version 0
    q: mp.Queue = mp.get_context("spawn").Queue()
    feeder = mp.get_context("spawn").Process(target=_feed, args=(url, options, str(stores.tmp / run / "cache-f"),
                                                                   args.numel, args.nodes, args.rate, args.seconds, q))
    passes: list[tuple[float, float, int, list[int]]] = []  # (start, seconds, published, staleness of applied)
    feeder.start()
    while feeder.is_alive():
        p0 = time.monotonic()
        m.sync_once()
        got = m.last_metrics or {}
        taus = [int(tau) for tau, n in (got.get("staleness_histogram") or {}).items() for _ in range(int(n))]
        passes.append((p0, time.monotonic() - p0, int(got.get("published") or 0), taus))
        time.sleep(0.02)
    sent, f0, f1 = q.get(timeout=60)
    feeder.join(30)
    backlog = len(hub.list_deltas(after=m.ledger))  # what the feeder sent that the master had not applied
    m.close()
    window = [p for p in passes if f0 <= p[0] < f1]  # the passes while deltas arrived
    elapsed = f1 - f0
    staleness = sorted(t for p in window for t in p[3])
    published = sum(p[2] for p in window)
    busy = sum(p[1] for p in window)
    staleness.sort()
    res = {
        "transport": kind, "publish": publish, "nodes": args.nodes, "rate": args.rate, "numel": args.numel,
        "seconds": round(elapsed, 1), "uploaded_per_s": round(sent / elapsed, 2),
        "applied_per_s": round(len(staleness) / elapsed, 2), "versions_per_s": round(published / elapsed, 2),
        "passes_per_s": round(len(window) / elapsed, 2), "backlog_at_end": backlog,
        "staleness_mean": round(statistics.fmean(staleness), 2) if staleness else None,
        "staleness_p95": staleness[int(0.95 * (len(staleness) - 1))] if staleness else None,
        "staleness_max": staleness[-1] if staleness else None,
        "master_busy_fraction": round(busy / elapsed, 3),
        # the whole run (the feeder's start-up included): shares, not rates
        "seconds_by_call": {k: round(v, 2) for k, v in sorted(timed.seconds.items())},
        "calls": dict(sorted(timed.calls.items())),
        "seconds_per_publication": round(timed.seconds.get("publish", 0.0) / max(1, timed.calls.get("publish", 0)), 4),
    }
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transports", default="file,s3,hf")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rate", type=float, default=4.0, help="deltas per second, all nodes together")
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--numel", type=int, default=250_000, help="values in the model (FP32: 1 MB per 250k)")
    ap.add_argument("--publish", default="each,pass", help="the master's arrival_publish values to run")
    ap.add_argument("--out", default=str(ROOT / "runs" / "perf" / "master_throughput.json"))
    args = ap.parse_args(argv)
    kinds = [k for k in args.transports.split(",") if k]
    tmp = Path(tempfile.mkdtemp(prefix="throughput-"))
    stores = Stores(tmp)
    stores.start(kinds)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out.read_text()) if out.exists() else []
    try:
        for kind in kinds:
            for publish in [b for b in args.publish.split(",") if b]:
                res = run_one(stores, kind, args, publish)
                results.append(res)
                out.write_text(json.dumps(results, indent=2))
                print(f"{kind:4s} publish={publish:<4s} uploaded {res['uploaded_per_s']:.2f}/s applied "
                      f"{res['applied_per_s']:.2f}/s versions {res['versions_per_s']:.2f}/s | staleness mean "
                      f"{res['staleness_mean']} p95 {res['staleness_p95']} max {res['staleness_max']} | backlog "
                      f"{res['backlog_at_end']} | {res['seconds_per_publication'] * 1000:.0f} ms per publication | "
                      f"seconds by call {res['seconds_by_call']}", flush=True)
    finally:
        stores.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
