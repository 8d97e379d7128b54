"""A round's lanes (``util/lanes.py``; issue 42: the master round's speed).

The master reads, checks and sums a delta's tensors on a few threads. What a user relies on:
the global and every norm are exactly the one-thread result (bit for bit), a short or hostile
file is still the same rejection, an error in any lane reaches the caller only after every lane
ended, and the staged files are unchanged by asking the disk to start early.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from diloco_lightning.master.aggregation import NonFiniteAggregate, RoundSum
from diloco_lightning.master.staging import write_safetensors_hashed
from diloco_lightning.util.fileio import sha256_file, start_writeback
from diloco_lightning.util.lanes import Lanes, split_by_weight
from diloco_lightning.wire.arena import ReadArena
from diloco_lightning.wire.delta import UnreadableDeltaError, read_delta, write_delta


def _state() -> dict[str, torch.Tensor]:
    return {f"k{i:02d}": torch.zeros(97 * (i + 1), 31) for i in range(12)} | {"b": torch.zeros(5)}


def _delta(seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=g) * (1 + seed)).to(dtype) for k, v in _state().items()}


@pytest.mark.parametrize("weights, parts, want", [
    ([1, 1, 1, 1], 2, [range(0, 2), range(2, 4)]),
    ([10, 1, 1, 1, 1], 2, [range(0, 1), range(1, 5)]),
    ([1, 1, 1, 10], 2, [range(0, 3), range(3, 4)]),
    ([1, 1, 1], 4, [range(0, 1), range(1, 2), range(2, 3)]),
    ([5], 3, [range(0, 1)]),
    ([], 2, []),
    ([0, 0, 0, 0], 2, [range(0, 1), range(1, 4)]),
])
def test_groups_are_contiguous_cover_every_item_and_balance_weight(weights, parts, want):
    got = split_by_weight(weights, parts)
    assert got == want
    assert [i for r in got for i in r] == list(range(len(weights)))


def test_results_keep_the_items_order_and_run_on_several_threads():
    lanes = Lanes(3, min_weight=0)
    seen: set[int] = set()

    def fn(x: int) -> int:
        seen.add(threading.get_ident())
        time.sleep(0.01)
        return x * x

    try:
        assert lanes.run(fn, list(range(9))) == [x * x for x in range(9)]
        assert len(seen) == 3
        assert Lanes(1).run(fn, [1, 2]) == [1, 4]
    finally:
        lanes.close()
    with pytest.raises(ValueError, match="lanes must be >= 1"):
        Lanes(0)


def test_an_error_in_a_lane_is_raised_after_every_lane_ended():
    lanes = Lanes(2, min_weight=0)
    done: list[int] = []

    def fn(x: int) -> int:
        if x == 3:
            raise KeyError("lane two")
        time.sleep(0.02)
        done.append(x)
        return x

    try:
        with pytest.raises(KeyError, match="lane two"):
            lanes.run(fn, [0, 1, 2, 3])
        assert sorted(done) == [0, 1, 2]  # the first lane finished before the error came out
    finally:
        lanes.close()


@pytest.fixture(params=["whole", "spans"])
def small_spans(request, monkeypatch):
    """Lanes over whole tensors (the default spans, larger than these tensors), or over spans of a
    few read chunks each (several per tensor, one ending inside a tensor)."""
    if request.param == "spans":
        import diloco_lightning.util.lanes as lanes
        import diloco_lightning.wire.delta.read as read
        import diloco_lightning.wire.layout as layout

        monkeypatch.setattr(layout, "_READ_CHUNK", 4096)
        monkeypatch.setattr(read, "_SPAN", 3 * 4096)
        monkeypatch.setattr(lanes, "SPAN_BYTES", 5000)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_read_on_lanes_is_bit_for_bit_the_one_thread_read(tmp_path, dtype, small_spans):
    p = tmp_path / "nodes" / "n0" / "delta_0.safetensors"
    p.parent.mkdir(parents=True)
    sent = _delta(3, dtype)
    write_delta(p, sent, node_id="n0", local_step=0, base_outer_step=0)
    lanes = Lanes(2, min_weight=0)
    try:
        one = read_delta(p, reference=_state(), arena=ReadArena())
        one_tensors = {k: v.clone() for k, v in one.tensors.items()}
        two = read_delta(p, reference=_state(), arena=ReadArena(lanes))
    finally:
        lanes.close()
    assert two.sumsq is not None and two.sumsq == one.sumsq  # the same float, not a close one
    for k, v in sent.items():
        assert torch.equal(two.tensors[k], v) and torch.equal(one_tensors[k], v)


def test_a_file_cut_short_is_still_unreadable_on_lanes(tmp_path, small_spans):
    p = tmp_path / "nodes" / "n0" / "delta_0.safetensors"
    p.parent.mkdir(parents=True)
    write_delta(p, _delta(1), node_id="n0", local_step=0, base_outer_step=0)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 1000])
    lanes = Lanes(2, min_weight=0)
    try:
        with pytest.raises(UnreadableDeltaError):
            read_delta(p, reference=_state(), arena=ReadArena(lanes))
    finally:
        lanes.close()


def test_a_sum_on_lanes_is_bit_for_bit_the_one_thread_sum(small_spans):
    like = _state()
    deltas = [(_delta(s), w, c) for s, w, c in ((0, 3.0, 1.0), (1, 1.0, 0.5), (2, 7.0, 0.25))]
    lanes = Lanes(2, min_weight=0)
    try:
        one, two = RoundSum(like), RoundSum(like, lanes=lanes)
        for d, w, c in deltas:
            one.add(d, w, c)
            two.add(d, w, c)
        a, b = one.take_mean(), two.take_mean()
        assert all(torch.equal(a[k], b[k]) for k in like)
        bad = RoundSum(like, lanes=lanes)
        d = _delta(4)
        d["k07"][3, 3] = math.inf
        d["k02"][0, 0] = math.nan
        bad.add(d)
        with pytest.raises(NonFiniteAggregate) as e:
            bad.take_mean()
        assert e.value.key == "k02"  # the first key in order, as one thread reports it
    finally:
        lanes.close()


def test_starting_the_writeback_early_changes_no_byte(tmp_path, monkeypatch):
    import diloco_lightning.master.staging as staging

    monkeypatch.setattr(staging, "_WRITEBACK", 1 << 16)  # many early writebacks on a small file
    tensors = _delta(5)
    p = tmp_path / "w.safetensors"
    digest = write_safetensors_hashed(p, tensors, {"outer_step": "3"})
    assert digest == sha256_file(p)
    from safetensors.torch import load_file

    back = load_file(str(p))
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    start_writeback(-1, 0, 10)  # a bad descriptor: nothing happens, nothing raises


@pytest.mark.parametrize("slice_values", [1 << 20, 1000])
def test_the_update_norm_on_lanes_is_the_one_thread_float(monkeypatch, slice_values):
    import diloco_lightning.master.weights as weights

    monkeypatch.setattr(weights, "_DISTANCE_SLICE", slice_values)
    new, old = _delta(6), _delta(7)
    new["half"], old["half"] = torch.randn(3000).to(torch.bfloat16), torch.randn(3000).to(torch.bfloat16)
    lanes = Lanes(2, min_weight=0)
    try:
        fp32 = {k: v for k, v in new.items() if k != "half"}
        assert weights.update_distance(fp32, old, lanes) == weights.update_distance(fp32, old)
        assert weights.update_distance(new, old, lanes) == weights.update_distance(new, old)  # a BF16 key: taken one way
        want = math.sqrt(sum(float(torch.dist(new[k].float(), old[k].float())) ** 2 for k in new))
        assert math.isclose(weights.update_distance(new, old, lanes), want, rel_tol=1e-6)
    finally:
        lanes.close()
