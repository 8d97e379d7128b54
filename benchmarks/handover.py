"""Master hand-over: how long a run goes without a master when the lease holder is killed with SIGKILL.

    python benchmarks/handover.py                          # lease_ttl 2 s, poll 0.1 s, 3 runs
    python benchmarks/handover.py --lease-ttl 5 --poll 0.5 --runs 5

Two ``diloco-master`` processes on a folder hub (``tests/support/handover.py``): ``A`` holds the lease
and publishes, ``B`` stands by with ``warm_standby`` (the default) following every version; ``A`` is
killed as a delta arrives, and the figure is the time from the kill to ``B``'s publication of that
delta. The bound is one lease period plus a poll (the lease has at most ``lease_ttl`` left at the
kill; the standby looks every ``poll_interval``). Each run also checks the ledger and that the final
global equals an uninterrupted master's bit for bit; exit status 1 when any run misses either.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lease-ttl", type=float, default=2.0)
    ap.add_argument("--poll", type=float, default=0.1)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)

    import torch

    from support.handover import handover, reference_state

    times, bad = [], 0
    for r in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="handover-") as tmp:
            h = handover(Path(tmp) / "run", lease_ttl=args.lease_ttl, poll_interval=args.poll)
            _, ref = reference_state(Path(tmp) / "ref", h.deltas)
            exact = h.outer_step == len(h.deltas) and all(torch.equal(h.state[k], v) for k, v in ref.items())
            bad += not exact or h.seconds > args.lease_ttl + args.poll
            times.append(h.seconds)
            print(f"run {r + 1}: kill -9 of the lease holder -> standby's next outer step in {h.seconds:.2f} s "
                  f"(lease_ttl {args.lease_ttl:g} s, poll {args.poll:g} s; warm {'yes' if h.warm else 'no'}; "
                  f"ledger {h.ledger}, {'exact' if exact else 'NOT EXACT'})", flush=True)
    print(f"hand-over: median {statistics.median(times):.2f} s, max {max(times):.2f} s over {len(times)} run(s); "
          f"bound lease_ttl + poll = {args.lease_ttl + args.poll:.2f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
