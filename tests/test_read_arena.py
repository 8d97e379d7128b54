"""Deltas read into one reused buffer (``wire/arena.py``; issue 42: the master round's speed).

The round reads every delta into the same owned memory (never a map of the file) and sums the
squares of its values as it reads them: the values, the checks and the norm must be exactly what
a fresh read gives, a short file still a rejection, and the memory one delta's.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from diloco_lightning.master.validation import delta_norm
from diloco_lightning.wire.arena import ReadArena
from diloco_lightning.wire.delta import UnreadableDeltaError, read_delta, write_delta


def _state() -> dict[str, torch.Tensor]:
    return {"emb": torch.zeros(3000, 17), "b": torch.zeros(5), "w": torch.zeros(64, 33)}


def _write(path, seed: int, dtype=torch.float32, node: str = "n0") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = {k: torch.randn(v.shape, generator=g).to(dtype) for k, v in _state().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_delta(path, d, node_id=node, local_step=0, base_outer_step=0)
    return d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_read_into_the_arena_is_a_fresh_read(tmp_path, dtype):
    arena = ReadArena()
    p = tmp_path / "nodes" / "n0" / "delta_0.safetensors"
    sent = _write(p, 0, dtype)
    fresh = read_delta(p, reference=_state())
    reused = read_delta(p, reference=_state(), arena=arena)
    assert fresh.sumsq is None and reused.sumsq is not None
    for k, v in sent.items():
        assert torch.equal(reused.tensors[k], v) and torch.equal(fresh.tensors[k], v)
    assert arena.nbytes == sum(v.numel() * v.element_size() for v in sent.values())
    assert math.isclose(math.sqrt(reused.sumsq), delta_norm(fresh.tensors), rel_tol=1e-5)


def test_the_arena_is_reused_and_each_read_replaces_the_last(tmp_path):
    arena = ReadArena()
    a, b = tmp_path / "a" / "nodes" / "n0" / "delta_0.safetensors", tmp_path / "b" / "nodes" / "n0" / "delta_0.safetensors"
    sa, sb = _write(a, 1), _write(b, 2)
    da = read_delta(a, reference=_state(), arena=arena)
    first = {k: t.data_ptr() for k, t in da.tensors.items()}
    assert torch.equal(da.tensors["emb"], sa["emb"])
    db = read_delta(b, reference=_state(), arena=arena)
    assert {k: t.data_ptr() for k, t in db.tensors.items()} == first  # the same memory, no allocation
    assert torch.equal(db.tensors["emb"], sb["emb"]) and torch.equal(da.tensors["emb"], sb["emb"])  # views: the last read
    arena.release()
    assert arena.nbytes == 0


def test_a_non_finite_value_makes_the_sum_non_finite(tmp_path):
    p = tmp_path / "nodes" / "n0" / "delta_0.safetensors"
    d = {k: torch.ones(v.shape) for k, v in _state().items()}
    d["emb"][1234, 5] = float("nan")
    write_delta(p, d, node_id="n0", local_step=0, base_outer_step=0)
    got = read_delta(p, reference=_state(), arena=ReadArena(), check_finite=False)
    assert math.isnan(got.sumsq)


def test_a_file_cut_short_is_unreadable_not_a_crash(tmp_path):
    p = tmp_path / "nodes" / "n0" / "delta_0.safetensors"
    _write(p, 3)
    os.truncate(p, os.path.getsize(p) - 1000)
    with pytest.raises(UnreadableDeltaError):
        read_delta(p, reference=_state(), arena=ReadArena())
