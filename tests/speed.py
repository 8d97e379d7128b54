"""Which cases of a slow parametrised test run by default.

The default run (``python -m pytest -q``, the README's test command) must stay under 10 minutes on
2 cores; a test whose every case starts Python processes (``train.py``, ``diloco-master``, a crash
script: 3-10 s each before any work) keeps its first cases there and marks the rest ``slow``,
which CI's second command (``python -m pytest -q -m slow``) runs, every case of every test.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import Any

import pytest


def default_first(cases: Iterable[Any], keep: int | Container[int] = 1) -> list[Any]:
    """``cases`` for ``pytest.mark.parametrize``, the first ``keep`` (or the cases at the indexes in
    ``keep``) in the default run, the rest slow. A case may be a tuple of arguments, a single value,
    or a ``pytest.param`` (its marks are kept)."""
    kept = range(keep) if isinstance(keep, int) else keep
    out = []
    for i, case in enumerate(cases):
        if i in kept:
            out.append(case)
            continue
        if isinstance(case, type(pytest.param(None))):
            out.append(pytest.param(*case.values, marks=[*case.marks, pytest.mark.slow], id=case.id))
        else:
            values: Sequence[Any] = case if isinstance(case, tuple) else (case,)
            out.append(pytest.param(*values, marks=pytest.mark.slow))
    return out
