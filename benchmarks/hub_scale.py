"""Hub scale: the real master against 64 and 256 simulated workers on every transport.

    python benchmarks/hub_scale.py                          # 64 and 256 workers x file, hf, hf_nodes, s3 (~15 min)
    python benchmarks/hub_scale.py --workers 64 --transports hf_nodes s3 --rounds 3 --period 3
    python benchmarks/hub_scale.py --json runs/perf/hub_scale.json --markdown   # + the table of docs/performance.md

Transports: ``file`` (a folder), ``hf`` (the loopback Hub, tests/support/hf_server.py: one repository),
``hf_nodes`` (the same, ``layout=per_node``: the master's repository plus one per node) and ``s3``
(moto's S3 server behind tests/support/s3_proxy.py). Each server runs in a process of its own and counts
the requests it answers; the simulated workers run in another (16 threads, a hub handle each);
the master (``MasterOuterLoop``: round aggregation, quorum 1, poll 0.05 s, the default 4 parallel
downloads, no commit budget: the loopback servers have no rate limit) in this one. A delta is tiny
(64 FP32 values, ~0.5 kB): what is measured is the hub's request and listing cost, not bytes.

Per transport and number of workers N:

1. *steady state*: the workers write one delta per node every ``--period`` seconds for ``--rounds``
   rounds while the master serves; then it drains. Reported: deltas applied per second over the run
   (first write to last application), the master's rounds and their mean time, the workers' write
   time per round, and the lag after the last write.
2. *one round of N deltas, the master alone*: its seconds and every request it made, by kind. Its
   capacity, N / those seconds, is where it saturates: rounds shorter than N / capacity seconds
   cannot be kept up with (the master then takes several workers' rounds in one of its own: still
   correct, only staler).
3. *the idle poll*: the requests of a round that finds nothing new.
4. *listing as the hub grows*: ``list_deltas`` with N and with 4N deltas pending (time, requests),
   and a second listing with nothing changed; then one round of the 4N.
5. *the ledger check*: every (node, step) written is applied exactly once (the master's per-round
   ``applied`` lists) and the published ledger names every node's last step.

Times are loopback times on whatever machine runs this, with the emulators' own CPU cost included;
the request counts are what a real store or Hub would see (multiply by its latency).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
sys.path.insert(0, str(ROOT))

TRANSPORTS = ("file", "hf", "hf_nodes", "s3")
DIM = 64
WRITER_THREADS = 16
FAKE_AWS = {"AWS_ACCESS_KEY_ID": "AKIDSCALEBENCH000001", "AWS_SECRET_ACCESS_KEY": "scaleBENCHsecret0123456789",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


# ----------------------------------------------------------------------------- the servers (a process each)


def _s3_kind(req: Any) -> str:
    if req.method == "GET" and "list-type" in req.query:
        return "LIST"
    return req.method


def _server_main(kind: str, conn: Any) -> None:
    os.environ.update(FAKE_AWS)
    sys.path.insert(0, str(TESTS))
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    if kind == "hf":
        from support.hf_server import FakeHubServer

        srv = FakeHubServer(page_size=1000).start()
        endpoint = srv.endpoint

        def counts() -> dict[str, int]:
            with srv._lock:
                return dict(collections.Counter(r.route for r in srv.requests))

        reset, stop = srv.reset_log, srv.stop
    else:
        import boto3
        from moto.server import ThreadedMotoServer
        from support.s3_proxy import S3Proxy

        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
        host, port = moto.get_host_and_port()
        boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1").create_bucket(Bucket="scale")
        proxy = S3Proxy(f"http://{host}:{port}").start()
        endpoint = proxy.endpoint

        def counts() -> dict[str, int]:
            return dict(collections.Counter(_s3_kind(r) for r in proxy.log()))

        def stop() -> None:
            proxy.stop()
            moto.stop()

        reset = proxy.reset_log
    conn.send(endpoint)
    while True:
        cmd = conn.recv()
        if cmd == "counts":
            conn.send(counts())
        elif cmd == "reset":
            reset()
            conn.send(True)
        else:
            break
    stop()


class Server:
    """A loopback server in a child process (None for the folder hub): its endpoint, its request counts."""

    def __init__(self, transport: str) -> None:
        self.kind = {"hf": "hf", "hf_nodes": "hf", "s3": "s3"}.get(transport)
        self.endpoint: str | None = None
        if self.kind is None:
            return
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_server_main, args=(self.kind, child), daemon=True)
        self.proc.start()
        self.endpoint = self.conn.recv()

    def counts(self) -> dict[str, int]:
        if self.kind is None:
            return {}
        self.conn.send("counts")
        return self.conn.recv()

    def reset(self) -> None:
        if self.kind is not None:
            self.conn.send("reset")
            self.conn.recv()

    def close(self) -> None:
        if self.kind is not None:
            self.conn.send("stop")
            self.proc.join(10)


# ----------------------------------------------------------------------------- hubs and the writers


def open_spec(spec: dict, cache: Path) -> Any:
    from diloco_lightning.hub import open_hub

    t = spec["transport"]
    if t == "file":
        return open_hub(spec["path"], cache_dir=cache)
    if t in ("hf", "hf_nodes"):
        extra = {"layout": "per_node"} if t == "hf_nodes" else {}
        return open_hub("hf://org/scale", endpoint=spec["endpoint"], token="hf_scale", cache_dir=cache,
                        commits_per_hour=0, max_retries=5, retry_base_delay=0.05, retry_max_delay=1.0, timeout=120,
                        **extra)
    return open_hub("s3://scale/run", endpoint_url=spec["endpoint"], addressing_style="path", cache_dir=cache,
                    check_conditional_writes=False, max_retries=5, retry_base_delay=0.05, retry_max_delay=1.0)


def _writer_main(spec: dict, nodes: list[str], conn: Any) -> None:
    """The simulated workers: one tiny delta per node per round, WRITER_THREADS at a time."""
    os.environ.update(FAKE_AWS)
    import torch

    from diloco_lightning.wire.delta import write_delta

    tmp = Path(tempfile.mkdtemp(prefix="hub-scale-writers-"))
    hubs = [open_spec(spec, tmp / f"cache{i}") for i in range(WRITER_THREADS)]
    tensors = {"w": torch.full((DIM,), 1e-3)}

    def write(i: int, mine: list[str], step: int) -> tuple[int, int]:
        hub = hubs[i]
        m = hub.read_manifest()  # a worker knows its base version (and, per node, the ledger it may clean up to)
        base = m.outer_step if m is not None else 0
        retries = 0
        for node in mine:
            p = tmp / f"{node}_{step}.safetensors"
            write_delta(p, tensors, node_id=node, local_step=step, base_outer_step=base,
                        model_fingerprint=spec["fingerprint"])
            for attempt in range(5):  # a worker would merge a failed upload into its next delta; here: retried
                try:
                    hub.upload_delta(p, node, step)
                    break
                except Exception:  # noqa: BLE001 - counted
                    retries += 1
                    if attempt == 4:
                        raise
            p.unlink()
        return len(mine), retries

    groups = [nodes[i::WRITER_THREADS] for i in range(WRITER_THREADS)]
    with concurrent.futures.ThreadPoolExecutor(WRITER_THREADS) as pool:
        while True:
            cmd = conn.recv()
            if cmd is None:
                break
            t0 = time.perf_counter()
            done = list(pool.map(lambda ig: write(ig[0], ig[1], cmd), enumerate(groups)))
            conn.send({"seconds": time.perf_counter() - t0, "written": sum(d[0] for d in done),
                       "retries": sum(d[1] for d in done)})
    shutil.rmtree(tmp, ignore_errors=True)


class Writers:
    def __init__(self, spec: dict, nodes: list[str]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_writer_main, args=(spec, nodes, child), daemon=True)
        self.proc.start()

    def round(self, step: int) -> dict:
        self.conn.send(step)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(30)


# ----------------------------------------------------------------------------- one measurement


def _timed(server: Server, fn) -> tuple[Any, float, dict[str, int]]:
    server.reset()
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, server.counts()


def measure(transport: str, n: int, rounds: int, period: float) -> dict:
    import torch

    from diloco_lightning.wire.delta import model_fingerprint
    from diloco_lightning.master import MasterOuterLoop

    os.environ.update(FAKE_AWS)
    tmp = Path(tempfile.mkdtemp(prefix=f"hub-scale-{transport}-{n}-"))
    server = Server(transport)
    init = {"w": torch.zeros(DIM)}
    spec = {"transport": transport, "endpoint": server.endpoint, "path": str(tmp / "hub"),
            "fingerprint": model_fingerprint(init)}
    nodes = [f"w{i:03d}" for i in range(n)]
    applied: list[str] = []
    metrics: list[dict] = []

    def log(d: dict) -> None:
        metrics.append(d)
        applied.extend(d.get("applied", []))

    if transport == "file":
        (tmp / "hub").mkdir()
    hub = open_spec(spec, tmp / "master-cache")
    master = MasterOuterLoop(hub, init, node_state_dir=tmp / "master", outer_lr=1.0, outer_momentum=0.0,
                             norm_ratio=None, norm_global_ratio=None, poll_interval=0.05, keep_globals=2,
                             torch_threads=1, logger=log, lease_ttl=600.0)
    writers = Writers(spec, nodes)
    out: dict[str, Any] = {"transport": transport, "workers": n, "rounds": rounds, "period": period}
    try:
        assert master.sync_once()  # version 0
        # 1. steady state
        master.start()
        t_first = time.perf_counter()
        writes = []
        for r in range(rounds):
            t0 = time.perf_counter()
            writes.append(writers.round(r))
            time.sleep(max(0.0, period - (time.perf_counter() - t0)))
        t_written = time.perf_counter()
        want = {node: rounds - 1 for node in nodes}
        deadline = time.monotonic() + 600
        while master.ledger != want and time.monotonic() < deadline:
            time.sleep(0.02)
        t_done = time.perf_counter()
        master.stop()
        eventful = [d for d in metrics if d.get("accepted")]
        out["steady"] = {
            "applied_per_s": len(applied) / (t_done - t_first), "applied": len(applied),
            "master_rounds": len(eventful), "mean_round_s": sum(d["round_seconds"] for d in eventful) / max(1, len(eventful)),
            "mean_deltas_per_round": len(applied) / max(1, len(eventful)),
            "write_s": max(w["seconds"] for w in writes), "write_retries": sum(w["retries"] for w in writes),
            "lag_s": t_done - t_written, "caught_up": master.ledger == want,
        }
        # 2. one round of N deltas, the master alone (first, a listing of the M = N pending by another handle,
        # as a second master would list: the master's own listing is part of its round below)
        writers.round(rounds)
        lister = open_spec(spec, tmp / "lister-cache")
        refs, list_s, list_req = _timed(server, lambda: lister.list_deltas(after=master.ledger))
        assert len(refs) == n, (len(refs), n)
        _, round_s, round_req = _timed(server, lambda: master.sync_once(force=True))
        out["round_n"] = {"deltas": n, "seconds": round_s, "requests": round_req, "capacity_per_s": n / round_s,
                          "list_s": list_s, "list_requests": list_req}
        # 3. the idle poll
        _, idle_s, idle_req = _timed(server, lambda: master.sync_once())
        out["idle"] = {"seconds": idle_s, "requests": idle_req}
        # 4. listing as the hub grows: 4N pending, listed twice, then one round
        for r in range(rounds + 1, rounds + 5):
            writers.round(r)
        refs, list_s, list_req = _timed(server, lambda: lister.list_deltas(after=master.ledger))
        assert len(refs) == 4 * n
        _, list2_s, list2_req = _timed(server, lambda: lister.list_deltas(after=master.ledger))
        _, round4_s, round4_req = _timed(server, lambda: master.sync_once(force=True))
        out["grown"] = {"deltas": 4 * n, "list_s": list_s, "list_requests": list_req, "relist_s": list2_s,
                        "relist_requests": list2_req, "round_s": round4_s, "round_requests": round4_req,
                        "capacity_per_s": 4 * n / round4_s}
        # 5. the ledger check
        last = rounds + 4
        expected = collections.Counter(f"{node}/{s}" for node in nodes for s in range(last + 1))
        got = collections.Counter(applied)
        manifest = hub.read_manifest()
        out["ledger_ok"] = got == expected and manifest.ledger == {node: last for node in nodes}
        out["applied_twice"] = sum(1 for k, c in got.items() if c > 1)
        out["lost"] = sum(1 for k in expected if k not in got)
    finally:
        master.stop()
        writers.close()
        master.close()
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------- report


def _req(d: dict[str, int]) -> str:
    total = sum(d.values())
    if not d:
        return "—"
    return f"{total} ({', '.join(f'{k} {v}' for k, v in sorted(d.items(), key=lambda kv: -kv[1]))})"


def render_markdown(results: list[dict], command: str, when: str, load: tuple[float, float]) -> str:
    """The section of docs/performance.md (also used by benchmarks/run_all.py)."""
    L = ["## Hub scale: 64 and 256 workers on every transport", ""]
    L.append(f"Command: `{command}` ({when}; load average {load[0]:.2f} before, {load[1]:.2f} after). "
             "Loopback servers, each in a process of its own (the Hub: `tests/support/hf_server.py`; S3: moto behind "
             "`tests/support/s3_proxy.py`), the simulated workers in another (16 threads), the real master "
             "(`MasterOuterLoop`, round aggregation, quorum 1, 4 parallel downloads) in a third; tiny deltas (64 "
             "FP32 values). `hf`: one repository; `hf_nodes`: `layout=per_node`. Requests are counted by the "
             "servers; times are loopback times on this shared 2-core machine, emulator CPU included: multiply "
             "the request counts by a real store's latency for a real deployment.")
    L.append("")
    L.append("| transport | workers | steady state: applied/s | master rounds (mean deltas, mean s) | workers' write s/round | "
             "one round of N alone: s | capacity deltas/s | requests of that round | idle poll requests | "
             "list N pending: s, requests | list 4N: s, requests | relist unchanged: requests | round of 4N: capacity/s | "
             "ledger |")
    L.append("|" + "---|" * 14)
    for r in results:
        s, rn, g = r["steady"], r["round_n"], r["grown"]
        L.append(
            f"| {r['transport']} | {r['workers']} | {s['applied_per_s']:.1f} | {s['master_rounds']} ({s['mean_deltas_per_round']:.0f}, "
            f"{s['mean_round_s']:.2f}) | {s['write_s']:.2f}{' (' + str(s['write_retries']) + ' retried)' if s['write_retries'] else ''} | "
            f"{rn['seconds']:.2f} | {rn['capacity_per_s']:.0f} | {_req(rn['requests'])} | {_req(r['idle']['requests'])} | "
            f"{rn['list_s']:.2f}, {sum(rn['list_requests'].values()) if rn['list_requests'] else '—'} | "
            f"{g['list_s']:.2f}, {sum(g['list_requests'].values()) if g['list_requests'] else '—'} | "
            f"{sum(g['relist_requests'].values()) if g['relist_requests'] else '—'} | {g['capacity_per_s']:.0f} | "
            f"{'exact' if r['ledger_ok'] else 'LOST ' + str(r['lost']) + ' / TWICE ' + str(r['applied_twice'])} |")
    L.append("")
    L.extend(_findings(results))
    return "\n".join(L)


def _findings(results: list[dict]) -> list[str]:
    """What the table says, computed from it: requests per round as a + b N, where the master saturates."""
    out = ["How to read it. *Steady state* is the offered load (N deltas every period) whenever the master and "
           "the writers keep up; below it, the workers' write time per round exceeded the period (their uploads "
           "contend) or the master lagged. *Capacity* (N over the time of one round of N, the master alone) is "
           "where the master saturates: workers syncing every T seconds need N / T below it, and beyond it the "
           "master's rounds simply take more deltas each (staler, never lost). A round's requests grow "
           "linearly in N:", ""]
    by: dict[str, dict[int, dict]] = collections.defaultdict(dict)
    for r in results:
        by[r["transport"]][r["workers"]] = r
    for t, rows in by.items():
        ns = sorted(rows)
        if len(ns) < 2 or not rows[ns[0]]["round_n"]["requests"]:
            continue
        (n0, n1), (q0, q1) = (ns[0], ns[-1]), (sum(rows[ns[0]]["round_n"]["requests"].values()),
                                                sum(rows[ns[-1]]["round_n"]["requests"].values()))
        b = (q1 - q0) / (n1 - n0)
        out.append(f"* `{t}`: {q0 - b * n0:.0f} + {b:.2f} N requests per round of N deltas, 3 per idle poll.")
    out += ["",
            "So the download of each delta dominates everywhere (one GET each; 4 at a time by default: "
            "`master.download_workers`), and `hf_nodes` adds one tree listing per node repository whose head moved "
            "(16 at a time). Against a real store, a round of N costs about (N / 4) x the latency of one request "
            "(plus N / 16 for `hf_nodes`): at 50 ms, 256 deltas take ~3.2 s (~4 s with `hf_nodes`), so 256 "
            "workers need rounds of a few seconds or more, or more download workers. The S3 publication removes what "
            "it processed with one `DeleteObjects` per 1000 files (measured once on this machine before that change, "
            "`--workers 256 --transports s3`: a round of 256 took 529 requests, 258 of them `DELETE`, and 2.72 s). On the Hugging Face "
            "Hub the commit limit comes first (README, \"Hubs at scale\"): one repository cannot take 256 workers at "
            "any round length; one repository per node can, at rounds of 30 s or more.", ""]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--workers", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    ap.add_argument("--rounds", type=int, default=3, help="steady-state rounds (default 3)")
    ap.add_argument("--period", type=float, default=3.0, help="seconds between the workers' rounds (default 3)")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--markdown", action="store_true", help="print the docs/performance.md section too")
    ap.add_argument("--from-json", help="run nothing: print the section from the results of an earlier --json")
    args = ap.parse_args(argv)
    if args.from_json:
        d = json.loads(Path(args.from_json).read_text())
        print(render_markdown(d["results"], d["command"], d["when"], tuple(d["load"])))
        return 0
    load0 = os.getloadavg()[0]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = []
    for n in args.workers:
        for t in args.transports:
            t0 = time.perf_counter()
            r = measure(t, n, args.rounds, args.period)
            r["wall"] = time.perf_counter() - t0
            results.append(r)
            s, rn = r["steady"], r["round_n"]
            print(f"{t:9s} N={n:4d}  steady {s['applied_per_s']:7.1f} applied/s ({s['master_rounds']} rounds, "
                  f"{s['mean_round_s']:.2f} s each, writes {s['write_s']:.2f} s/round, lag {s['lag_s']:.1f} s)  "
                  f"round of N {rn['seconds']:.2f} s = {rn['capacity_per_s']:.0f}/s, requests {_req(rn['requests'])}  "
                  f"idle {_req(r['idle']['requests'])}  list 4N {r['grown']['list_s']:.2f} s "
                  f"{_req(r['grown']['list_requests'])}, relist {_req(r['grown']['relist_requests'])}  "
                  f"ledger {'exact' if r['ledger_ok'] else 'WRONG'}  ({r['wall']:.0f} s)", flush=True)
    command = "python benchmarks/hub_scale.py" + ("" if argv is None and len(sys.argv) == 1 else " " + " ".join(argv or sys.argv[1:]))
    payload = {"results": results, "command": command, "when": when, "load": [load0, os.getloadavg()[0]]}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=1))
    if args.markdown:
        print()
        print(render_markdown(results, command, when, (payload["load"][0], payload["load"][1])))
    return 0 if all(r["ledger_ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
