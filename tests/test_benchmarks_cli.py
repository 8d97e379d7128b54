"""Every benchmark script answers ``--help``: the figures in the docs are printed by these, and a
reader's first command is ``python benchmarks/<x>.py --help``.

One child process runs them all (``runpy``, as ``python <script> --help`` would), so the test costs
one interpreter start, not one per script.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(path, run_name="__main__")
        out[path] = ["no exit", "usage:" in buf.getvalue()]
    except SystemExit as e:
        out[path] = [e.code or 0, "usage:" in buf.getvalue()]
    except BaseException as e:  # noqa: BLE001 - reported, not raised: every script is tried
        out[path] = [repr(e)[-300:], False]
print("RESULT " + json.dumps(out))
"""


def test_every_benchmark_script_prints_its_help(tmp_path):
    scripts = sorted(str(p) for p in (ROOT / "benchmarks").glob("*.py")
                     if "__main__" in p.read_text())  # not the helpers they import (compression_report, ...)
    assert len(scripts) > 10
    proc = subprocess.run([sys.executable, "-c", CHILD, *scripts], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    results = json.loads(line[len("RESULT "):])
    bad = {Path(p).name: r for p, r in results.items() if r != [0, True]}  # exit 0 with a usage line
    assert not bad, bad
