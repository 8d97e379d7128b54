"""Processes released at the same instant, to race for one name on a hub (the first-writer-wins
and compare-and-swap tests): each runs ``script`` with its JSON arguments, prints ``READY`` and
waits for the ``go`` file; when all are ready the file is made."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from support.env import ROOT, repo_env

__all__ = ["run_racers"]


def run_racers(script: str, arg_list: list[dict], go: Path, timeout: float = 60.0) -> list[tuple[int, str]]:
    """Start one process per ``arg_list`` entry (``script`` gets ``{**args, "go": go}``), release them
    together; ``(exit status, last line of stdout, or the end of stderr)`` of each, in order."""
    procs = [
        subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), json.dumps({**a, "go": str(go)})],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=repo_env(), cwd=ROOT)
        for a in arg_list
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stderr is not None
            assert p.stdout.readline().strip() == "READY", p.stderr.read()
        go.touch()
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            lines = stdout.strip().splitlines()
            out.append((p.returncode, lines[-1] if lines else stderr.strip()[-2000:]))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
