"""One ``python train.py ...`` run for the benchmark scripts: its ``results.json`` or a RuntimeError."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def train_results(overrides: list[str], run_root: Path | str, run_id: str = "r", timeout: float = 3600) -> dict[str, Any]:
    """Run ``train.py`` with ``overrides`` (which must name ``run_root`` and ``run_id``) in the
    repository root; return its ``<run_root>/<run_id>/results.json``. A failed run raises
    RuntimeError with the tails of its output."""
    proc = subprocess.run([sys.executable, "train.py", *overrides], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"train.py {' '.join(overrides)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads((Path(run_root) / run_id / "results.json").read_text())
