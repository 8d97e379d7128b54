"""A script of ``benchmarks/`` imported as a module under test (``tests/test_study_plan.py``,
``tests/test_sim_stragglers_plan.py``): its folder on ``sys.path`` (the scripts import each other),
registered under a name of its own (dataclasses look their module up) and removed afterwards."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(script: str) -> Iterator[ModuleType]:
    """Yield ``benchmarks/<script>.py`` as a module (a generator: use it as a pytest fixture's body)."""
    sys.path.insert(0, str(BENCHMARKS))
    name = f"{script}_under_test"
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{script}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(name, None)
