"""benchmarks/compression_study.py's tuning: a row's outer-lr grid grows past an edge that wins
(``benchmarks/tuning.py: bracket``) until its best is interior, and the row's seeds wait for it.
Runs nothing: results are written as a finished run would leave them."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from support.benchmarks import load_benchmark


@pytest.fixture
def cs() -> Iterator[ModuleType]:
    yield from load_benchmark("compression_study")


@pytest.fixture
def tuning() -> Iterator[ModuleType]:
    yield from load_benchmark("tuning")


def test_bracket_extends_past_a_winning_edge_and_waits_for_runs(tuning):
    losses = {1.0: 2.0, 2.0: 2.1, 4.0: 2.3}
    grid, settled = tuning.bracket([1.0, 2.0, 4.0], lambda p: losses.get(p, math.nan), lambda p: p / 2,
                                   lambda p: p * 2, 3)
    assert (grid, settled) == ([0.5, 1.0, 2.0, 4.0], False)  # the lowest won: 0.5 is to run
    losses[0.5] = 1.9
    losses[0.25] = 1.95
    assert tuning.bracket([1.0, 2.0, 4.0], lambda p: losses.get(p, math.nan), lambda p: p / 2,
                          lambda p: p * 2, 3) == ([0.25, 0.5, 1.0, 2.0, 4.0], True)
    # the highest won and the next diverged: settled on the edge's neighbour
    up = {1.0: 3.0, 2.0: 2.5, 4.0: math.inf}
    assert tuning.bracket([1.0, 2.0], up.__getitem__, lambda p: p / 2, lambda p: p * 2, 3) == ([1.0, 2.0, 4.0], True)
    # everything diverged: go down; the extension limit ends it
    assert tuning.bracket([1, 2], lambda p: math.inf, lambda p: p - 1, lambda p: p + 1, 2) == ([-1, 0, 1, 2], True)


def _study(cs, root: Path, **kw) -> object:
    args = argparse.Namespace(quick=False, small=True, long=False, root=str(root), rows="float32-plain", settings="a4", seeds=None,
                              lr_from=None, grid=None, steps=None, jobs=1, out=None)
    vars(args).update(kw)
    return cs.CompressionStudy(args)


def _done(study, job: dict, loss: float) -> None:
    folder = study.root / "runs" / job["id"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps({"eval_loss": loss, "diverged": not math.isfinite(loss)}))


def test_a_row_is_tuned_past_its_grid_edge_before_its_seeds_run(cs, tmp_path):
    study = _study(cs, tmp_path)
    first = study.grid("float32-plain", "a4")[0]
    assert first == list(cs.SMALL["grids"]["plain@a4"])  # the profile's grid for the setting
    for i, j in enumerate(study.tuning_jobs()):
        _done(study, j, 2.0 + i)  # the smallest lr wins
    assert study.best_lr("float32-plain", "a4") is None and study.seed_jobs() == []
    ext = [j for j in study.tuning_jobs() if study.results(j) is None]
    assert [j["lr"] for j in ext] == [first[0] / 2]
    _done(study, ext[0], 2.5)  # worse than the old edge: the best is interior now
    assert study.best_lr("float32-plain", "a4") == first[0]
    assert {j["seed"] for j in study.seed_jobs()} == {1, 2}
    assert {j["seed"] for j in _study(cs, tmp_path, seeds=5).seed_jobs()} == {1, 2, 3, 4}
    # --grid gives a row its first grid
    assert _study(cs, tmp_path, grid="float32-plain=1/2").grid("float32-plain", "r0")[0][-2:] == [1.0, 2.0]


def test_every_profile_plans_its_rows(cs, tmp_path):
    """The full design, --small, --long and --quick each plan their first tuning runs in every setting."""
    for kw in ({"small": False}, {"small": True}, {"small": False, "long": True}, {"small": False, "quick": True}):
        study = _study(cs, tmp_path / str(len(kw)) / str(sorted(kw.items())), rows=None, settings=None, **kw)
        jobs = study.tuning_jobs()
        assert {j["setting"] for j in jobs} == set(study.settings) and jobs, kw
        assert {j["row"] for j in jobs} <= set(cs.ROWS)
