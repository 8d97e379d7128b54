"""Streaming fragments (issue 15): the assignment, the delta header, the worker's schedule and
installs, the master's per-fragment staleness, gate and counters, F=1 bit for bit."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from diloco_lightning.wire.delta import read_delta_header, write_delta
from diloco_lightning.wire.fragments import FragmentError, block_index, build_plan, check_fragments_option, parse_fragment_header
from diloco_lightning.hub.local import FileHub
from diloco_lightning.wire.manifest import Manifest
from diloco_lightning.util.options import OptionError
from diloco_lightning.outer import PACGAD, NesterovOuterOptimizer
from diloco_lightning.wire.layout import read_layout
from diloco_lightning.worker import DiLoCoWorker
from diloco_lightning.worker.options import WorkerOptions
from diloco_lightning.worker.pacing import Pacing

FAST = dict(poll_interval=0.01, wait_timeout=20.0)


def llama_like(blocks: int = 4, d: int = 4, vocab: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"embed.weight": torch.randn(vocab, d, generator=g)}
    for i in range(blocks):
        out[f"layers.{i}.attn.weight"] = torch.randn(d, d, generator=g)
        out[f"layers.{i}.norm.weight"] = torch.randn(d, generator=g)
    out["norm.weight"] = torch.randn(d, generator=g)
    out["head.weight"] = torch.randn(vocab, d, generator=g)
    out["steps"] = torch.tensor(3, dtype=torch.long)  # an integer buffer: in no fragment
    return out


# ----------------------------------------------------------------------------- the assignment


def test_strided_assignment_and_where_the_rest_goes():
    state = llama_like(blocks=8, d=8, vocab=8)  # no tensor without a block index is large: nothing split
    plan = build_plan(4, state)
    assert plan is not None and plan.names == ("0", "1", "2", "3") and not plan.split and plan.rows == {}
    for i in range(8):
        assert {f"layers.{i}.attn.weight", f"layers.{i}.norm.weight"} <= set(plan.keys[str(i % 4)])
    # embeddings, final norm and head (no block index) go, largest first, to the lightest fragment
    assert "embed.weight" in plan.keys["0"] and "head.weight" in plan.keys["1"] and "norm.weight" in plan.keys["2"]
    assert "steps" not in [k for ks in plan.keys.values() for k in ks]
    assert sorted(k for ks in plan.keys.values() for k in ks) == sorted(k for k in state if k != "steps")
    assert block_index("model.layers.12.mlp.w1.weight") == 12 and block_index("lm_head.weight") is None
    assert build_plan(2, llama_like(blocks=4, d=8, vocab=8)).keys["1"] == (
        "head.weight", "layers.1.attn.weight", "layers.1.norm.weight", "layers.3.attn.weight", "layers.3.norm.weight")
    # F = 1, None and a one-group list: no fragments at all
    assert build_plan(1, state) is None and build_plan(None, state) is None and build_plan([["layers"]], state) is None


def test_large_tensors_without_a_block_are_split_by_rows_into_even_fragments():
    """Embedding and head of llama_like() are 128 of 340 values each (> 1/(2F) for F = 2, 4): each is
    split into F row ranges, range p in fragment p; a tensor with fewer than F rows stays whole."""
    state = llama_like()  # embed 32x4, head 32x4, 4 blocks of 4x4 + 4, norm 4
    plan = build_plan(4, state)
    assert plan.split and plan.keys["0"] == ("embed.weight[0:8]", "head.weight[0:8]", "layers.0.attn.weight",
                                             "layers.0.norm.weight", "norm.weight")
    for p in range(4):
        assert plan.keys[str(p)][:2] == (f"embed.weight[{8 * p}:{8 * p + 8}]", f"head.weight[{8 * p}:{8 * p + 8}]")
        assert plan.rows[f"embed.weight[{8 * p}:{8 * p + 8}]"] == ("embed.weight", 8 * p, 8 * p + 8)
        assert plan.base_keys(str(p))[:2] == ("embed.weight", "head.weight")
    assert [plan.numel(n, state) for n in plan.names] == [88, 84, 84, 84]  # even: 340 / 4 = 85
    sub = plan.substate("2", state)  # views: an in-place update writes into the full tensor
    assert sub["embed.weight[16:24]"].shape == (8, 4) and sub["layers.2.attn.weight"] is state["layers.2.attn.weight"]
    sub["embed.weight[16:24]"].add_(1.0)
    assert torch.equal(state["embed.weight"][16:24], llama_like()["embed.weight"][16:24] + 1.0)
    assert torch.equal(state["embed.weight"][:16], llama_like()["embed.weight"][:16])
    pieces = plan.pieces(state)  # every piece once, in the state's key order, rows in order
    assert list(pieces)[:5] == ["embed.weight[0:8]", "embed.weight[8:16]", "embed.weight[16:24]",
                                "embed.weight[24:32]", "layers.0.attn.weight"]
    assert sum(t.numel() for t in pieces.values()) == 340 and len(pieces) == 2 * 4 + 2 * 4 + 1
    assert plan.optimizer_fragments()["3"] == list(plan.keys["3"]) and plan.fragment_of("head.weight[24:32]") == "3"
    # uneven rows: 30 rows into 4 ranges of 8, 8, 7, 7 (leftover rows to the lowest index); the
    # digest covers the piece names
    odd = {**state, "embed.weight": torch.zeros(30, 4)}
    assert [p for p in build_plan(4, odd).keys["1"] if "embed" in p] == ["embed.weight[8:16]"]
    assert build_plan(4, odd).digest("0") != plan.digest("0")
    # uneven blocks (3 over F = 2): the rows even the fragments out, not n/F each
    three = llama_like(blocks=3, d=4, vocab=40)  # blocks 0, 2 in fragment 0: 20 values more
    plan3 = build_plan(2, three)
    assert plan3.keys["0"][:2] == ("embed.weight[0:18]", "head.weight[0:20]")
    assert plan3.keys["1"][:2] == ("embed.weight[18:40]", "head.weight[20:40]")
    assert [plan3.numel(n, three) for n in plan3.names] == [192, 192]  # 384 / 2
    # F = 2: still split (128 > 340 / 4); 64 rows of a 64-row tensor over F = 128 is not (fewer rows than F)
    assert build_plan(2, state).keys["1"][:2] == ("embed.weight[16:32]", "head.weight[16:32]")
    wide = {"embed.weight": torch.zeros(2, 400), "layers.0.w": torch.zeros(10), "layers.1.w": torch.zeros(10),
            "layers.2.w": torch.zeros(10)}
    assert not build_plan(3, wide).split  # 2 rows < 3 fragments: kept whole
    # pattern groups place whole tensors
    assert not build_plan([["embed", "layers.0", "layers.2", "norm.weight", "layers.3"], ["head", "layers.1"]],
                          state).split


def test_pattern_groups_and_errors():
    state = llama_like(blocks=2)
    plan = build_plan([["layers.0.attn", "embed"], "layers.1.attn", ["*norm*", "head.weight"]], state)
    assert plan.keys["0"] == ("embed.weight", "layers.0.attn.weight")
    assert plan.keys["1"] == ("layers.1.attn.weight",)
    assert plan.keys["2"] == ("head.weight", "layers.0.norm.weight", "layers.1.norm.weight", "norm.weight")
    with pytest.raises(FragmentError, match="matches no fragment pattern"):
        build_plan([["layers"], ["embed"]], state)
    with pytest.raises(FragmentError, match="matches the patterns of fragments"):
        build_plan([["layers", "embed", "norm", "head"], ["layers.0"]], state)
    with pytest.raises(FragmentError, match="without parameters"):
        build_plan(64, state)
    for bad in (0, -1, True, "4", [], [[]], [[""]], 10**6):
        with pytest.raises(FragmentError):
            check_fragments_option(bad)


def test_worker_options_refuse_what_does_not_compose():
    WorkerOptions(inner_steps=8, fragments=4).validate()
    for kw, msg in (
        (dict(inner_steps=6, fragments=4), "multiple of 4"),
        (dict(inner_steps="auto", fragments=2), "inner_steps=auto"),
        (dict(inner_steps=8, fragments=0), "fragments"),
    ):
        with pytest.raises(OptionError, match=msg) as e:
            WorkerOptions(**kw).validate()
        assert e.value.option == "fragments"
    WorkerOptions(inner_steps=8, fragments=2, delta_dtype="int8", error_feedback=False).validate()
    WorkerOptions(inner_steps=8, fragments=2, delta_dtype="ctopk", error_feedback_decay=0.95).validate()  # per fragment
    # a boundary every H/F steps
    p = Pacing(8, fragments=4)
    assert [s for s in range(1, 17) if p.due(s, s - 1)] == [2, 4, 6, 8, 10, 12, 14, 16]


def test_fragment_header_parsing():
    assert parse_fragment_header({"phases": "1"}) is None
    assert parse_fragment_header({"fragment": "2", "fragments": "4", "base_fragment_step": "7"}) == ("2", 4, 7)
    for md in ({"fragment": "1"}, {"fragment": "4", "fragments": "4", "base_fragment_step": "0"},
               {"fragment": "01", "fragments": "4", "base_fragment_step": "0"},
               {"fragment": "0", "fragments": "1", "base_fragment_step": "0"},
               {"fragment": "0", "fragments": "2", "base_fragment_step": "9" * 19},
               {"fragment": "0", "fragments": "2", "base_fragment_step": "-1"}):
        with pytest.raises(FragmentError):
            parse_fragment_header(md)


def test_manifest_fragments_round_trip_and_old_manifests_load():
    base = dict(outer_step=3, weights="global/w.safetensors", weights_sha256="a" * 64, model_fingerprint="b" * 64)
    plain = Manifest(**base)
    assert "fragments" not in json.loads(plain.to_json())
    frags = [{"name": "0", "keys_sha256": "c" * 64, "outer_step": 2, "updated_at": 3},
             {"name": "1", "keys_sha256": "d" * 64, "outer_step": 1, "updated_at": 2}]
    m = Manifest(**base, fragments=frags)
    back = Manifest.from_json(m.to_json())
    assert back.fragments == frags and back.fragment_steps_at(3) == {"0": 2, "1": 1}
    bad = json.loads(m.to_json())
    bad["fragments"][1]["updated_at"] = 4  # after the version itself
    with pytest.raises(ValueError, match="ahead of outer_step"):
        Manifest.from_json(json.dumps(bad))


# ----------------------------------------------------------------------------- worker + master


def _module_params(state):
    return {k: (torch.nn.Parameter(v.clone()) if v.is_floating_point() else v.clone()) for k, v in state.items()}


def _run_lockstep(tmp_path: Path, fragments, *, boundaries: int, outer: str = "nesterov", seed: int = 1, **worker):
    """One worker, lockstep delay 0, a real master (quorum 1): returns (master state, manifest,
    the delta headers and tensor names seen on the hub, in order)."""
    from diloco_lightning.master import MasterOuterLoop

    root = tmp_path / "hub"
    init = llama_like(blocks=2)
    master = MasterOuterLoop(FileHub(root), init, node_state_dir=tmp_path / "master", poll_interval=0.01, min_deltas=1,
                             keep_globals=8, norm_ratio=None, outer_optimizer=outer,
                             outer_options={} if outer == "nesterov" else {"lr": 0.01},
                             fragments=fragments)
    seen: list[tuple[dict, list[str]]] = []
    worker_hub = FileHub(root)
    upload = worker_hub.upload_delta

    def recording_upload(path, node, step):  # every delta file as the worker sends it
        h, names = read_delta_header(path), sorted(read_layout(path).tensors)  # the file's tensor names
        extra = dict(h.extra, local_step=str(h.local_step), base=str(h.base_outer_step))
        if h.encoding is not None:
            extra["encoding"] = h.encoding.name
        seen.append((extra, names))
        return upload(path, node, step)

    worker_hub.upload_delta = recording_upload  # type: ignore[method-assign]
    params = _module_params(init)
    g = torch.Generator().manual_seed(seed)
    master.start()
    with DiLoCoWorker(worker_hub, "w0", params, sync="lockstep", fragments=fragments, **FAST, **worker) as w:
        for _ in range(boundaries):
            with torch.no_grad():
                for v in params.values():
                    if v.is_floating_point():
                        v.add_(torch.randn(v.shape, generator=g) * 0.01)
            w.boundary()
        assert w.flush()
    deadline = time.monotonic() + 20
    while master.outer_step < boundaries and time.monotonic() < deadline:
        time.sleep(0.01)
    master.stop()
    state = {k: v.clone() for k, v in master.run.state.items()}
    return state, FileHub(root).read_manifest(), sorted(seen, key=lambda s: int(s[0]["local_step"])), params


def test_fragments_1_is_todays_run_bit_for_bit(tmp_path):
    a, ma, da, pa = _run_lockstep(tmp_path / "unset", None, boundaries=4)
    b, mb, db, pb = _run_lockstep(tmp_path / "one", 1, boundaries=4)
    assert ma.outer_step == mb.outer_step == 4
    for k in a:
        assert torch.equal(a[k], b[k]), k
        assert torch.equal(pa[k], pb[k]), k
    assert ma.weights_sha256 == mb.weights_sha256 and ma.fragments is None and mb.fragments is None
    assert "fragments" not in json.loads(mb.to_json()) and all("fragment_steps" not in h for h in
                                                                 json.loads(mb.to_json())["history"])
    assert da == db and all("fragment" not in h for h, _ in db)  # the same headers and tensors


def test_lockstep_fragments_send_one_fragment_each_and_match_a_reference(tmp_path):
    """F=2, one worker in lockstep, Nesterov: boundary r sends fragment r mod 2 (its pieces only, its
    own base), the master applies it to that fragment's pieces; the result equals a hand-run
    reference (the same inner updates, the same optimizer, fragment by fragment). Embedding and head
    are split by rows (rows 0-15 in fragment 0, 16-31 in fragment 1), so each row range has its own
    anchor, momentum and schedule."""
    init = llama_like(blocks=2)
    state, m, seen, params = _run_lockstep(tmp_path, 2, boundaries=6)
    plan = build_plan(2, init)
    assert m.outer_step == 6
    assert [f["outer_step"] for f in m.fragments] == [3, 3] and [f["updated_at"] for f in m.fragments] == [6, 5]
    assert [h["fragment"] for h, _ in seen] == ["1", "0", "1", "0", "1", "0"]
    for h, names in seen:
        assert names == sorted(plan.keys[h["fragment"]]) and h["fragments"] == "2"
    assert "embed.weight[16:32]" in seen[0][1] and "head.weight[0:16]" in seen[1][1]
    # fragment 1 first syncs at boundary 1 from version 0; later syncs from the version that applied its last delta
    assert [(h["base"], h["base_fragment_step"]) for h, _ in seen] == [("0", "0"), ("0", "0"), ("1", "1"), ("2", "1"),
                                                                       ("3", "2"), ("4", "2")]
    # the reference: the worker's local weights, its per-fragment anchors, the master's Nesterov per
    # fragment; the row ranges written out here, not taken from the plan
    half = {"0": slice(0, 16), "1": slice(16, 32)}
    whole = {"0": ["layers.0.attn.weight", "layers.0.norm.weight", "norm.weight"],
             "1": ["layers.1.attn.weight", "layers.1.norm.weight"]}

    def pieces(f, t):  # fragment f's tensors of t (views of the rows of embed / head)
        out = {f"{k}[{half[f].start}:{half[f].stop}]": t[k][half[f]] for k in ("embed.weight", "head.weight")}
        return {**out, **{k: t[k] for k in whole[f]}}

    ref = {k: v.clone() for k, v in init.items()}
    opt = NesterovOuterOptimizer({**pieces("0", ref), **pieces("1", ref)}, lr=0.7, momentum=0.9)
    local = {k: v.clone() for k, v in init.items()}
    anchor = {k: v.clone() for k, v in init.items() if v.is_floating_point()}
    g = torch.Generator().manual_seed(1)
    for r in range(1, 7):
        for v in local.values():
            if v.is_floating_point():
                v.add_(torch.randn(v.shape, generator=g) * 0.01)
        f = plan.fragment_at(r)
        a, lo, gl = pieces(f, anchor), pieces(f, local), pieces(f, ref)
        assert sorted(gl) == sorted(plan.keys[f])
        assert opt.step(gl, {k: a[k] - lo[k] for k in gl}, staleness=0)
        for k in gl:
            lo[k].copy_(gl[k])
            a[k].copy_(gl[k])
    for k in ref:
        assert torch.allclose(state[k], ref[k], atol=1e-6, rtol=0), k
        assert torch.allclose(params[k].detach(), local[k], atol=1e-6, rtol=0), k


def test_encoded_fragment_deltas_with_and_without_error_feedback(tmp_path):
    state, m, seen, _ = _run_lockstep(tmp_path / "off", 2, boundaries=4, delta_dtype="int8", error_feedback=False)
    assert m.outer_step == 4 and [f["outer_step"] for f in m.fragments] == [2, 2]
    assert all(h["encoding"] == "int8" for h, _ in seen)
    state, m, seen, _ = _run_lockstep(tmp_path / "on", 2, boundaries=6, delta_dtype="ctopk", topk=0.25, topk_chunk=16)
    assert m.outer_step == 6 and [f["outer_step"] for f in m.fragments] == [3, 3]
    assert all(h["encoding"] == "ctopk" for h, _ in seen)


# ----------------------------------------------------------------------------- error feedback per fragment


def _frag_worker(tmp_path: Path, hub: FileHub, params, **kw) -> DiLoCoWorker:
    """A worker of a 2-fragment run whose master published version 0 only (nothing is installed,
    so each fragment's deltas add up to its start minus its end)."""
    from diloco_lightning.master import MasterOuterLoop

    if hub.read_manifest() is None:
        m = MasterOuterLoop(FileHub(hub.root), {k: v.detach() for k, v in params.items()}, node_state_dir=tmp_path / "m",
                            fragments=2, norm_ratio=None, outer_lr=1.0, outer_momentum=0.0, poll_interval=0.01)
        assert m.sync_once()
    return DiLoCoWorker(hub, "w0", params, fragments=2, delta_dtype="ctopk", topk=0.25, topk_chunk=16, **kw, **FAST)


def _frag_phase(params, i):
    g = torch.Generator().manual_seed(200 + i)
    with torch.no_grad():
        for v in params.values():
            if v.is_floating_point():
                v.add_(torch.randn(v.shape, generator=g) * 0.05)


def _assert_each_fragment_loses_nothing(hub: FileHub, w: DiLoCoWorker, start):
    """Per piece: what its fragment's deltas carried (decoded) plus its residual still owed is its whole
    pseudo-gradient (start - the fragment's anchor, its last export), to FP32 rounding: each fragment
    keeps its own residual."""
    from diloco_lightning.encoding.feedback import decode_delta
    from diloco_lightning.wire.delta import read_delta

    assert w.plan is not None
    sent = {n: {p: torch.zeros(t.shape, dtype=torch.float64) for p, t in w.plan.substate(n, start).items()}
            for n in w.plan.names}
    for ref in hub.list_deltas():
        h = read_delta_header(hub.root / ref.path)
        name = h.extra["fragment"]
        d = read_delta(hub.root / ref.path, reference=w.plan.substate(name, start))
        for p, t in decode_delta(d.by_key()).items():
            sent[name][p] += t.double()
    owed = w._uploader.feedback.residual or {}
    assert w.anchor is not None
    for name in w.plan.names:
        truth = {p: (a - w.anchor[p]).double() for p, a in w.plan.substate(name, start).items()}
        for p in truth:
            torch.testing.assert_close(sent[name][p] + (owed[p].double() if p in owed else 0), truth[p], rtol=0,
                                       atol=2e-6)


def test_each_fragment_keeps_its_own_residual_through_failed_and_doubtful_uploads(tmp_path):
    from test_worker import FlakyHub

    hub = FlakyHub(tmp_path / "hub")
    params = _module_params(llama_like(blocks=2))
    start = {k: v.detach().clone() for k, v in params.items() if v.is_floating_point()}
    w = _frag_worker(tmp_path, hub, params)
    w.start()
    for i in range(2):  # both fragments sent once: each owes its own residual
        _frag_phase(params, i)
        w.boundary()
        assert w.flush()
    owed = w._uploader.feedback.residual
    assert owed is not None and sorted(owed) == sorted(w.plan.keys["0"] + w.plan.keys["1"])
    hub.down = True  # fragment 1's next delta fails: only its residual went into what is retried
    _frag_phase(params, 2)
    w.boundary()
    w._uploader.wait_idle(5)
    assert sorted(w._uploader.feedback.residual) == sorted(w.plan.keys["0"])
    hub.list_down = True  # the retry fails so that the hub cannot say whether it landed: a doubt
    _frag_phase(params, 3)
    w.boundary()
    w._uploader.wait_idle(5)
    hub.down = hub.list_down = False
    for i in (4, 5, 6):
        _frag_phase(params, i)
        w.boundary()
        assert w.flush()
    assert w.totals["upload_failures_total"] >= 2
    _assert_each_fragment_loses_nothing(hub, w, start)
    w.close()


def _frag_resume(tmp_path: Path, name: str, crash: bool, decay: float) -> tuple[list, dict]:
    """Five boundaries; with ``crash``, a checkpoint after the third, a new worker from it for the rest."""
    hub = FileHub(tmp_path / name / "hub")
    params = _module_params(llama_like(blocks=2))
    w = _frag_worker(tmp_path / name, hub, params, error_feedback_decay=decay)
    w.start()
    for i in range(3):
        _frag_phase(params, i)
        w.boundary()
        assert w.flush()
    if crash:
        ckpt = tmp_path / name / "ckpt.pt"
        torch.save({"worker": w.state_dict(), "anchor": w.anchor_state(),
                    "params": {k: v.detach().clone() for k, v in params.items()}}, ckpt)
        w.close()
        state = torch.load(ckpt, weights_only=True)
        assert sorted(state["anchor"]["residual"]) == sorted(w.plan.keys["0"] + w.plan.keys["1"])  # both, by piece
        params = _module_params(state["params"])
        w = _frag_worker(tmp_path / name, hub, params, error_feedback_decay=decay)
        w.load_state_dict(state["worker"])
        w.load_anchor_state(state["anchor"])
    for i in (3, 4):  # one delta of each fragment: each adds its own fragment's residual
        _frag_phase(params, i)
        w.boundary()
        assert w.flush()
    owed = {k: v.clone() for k, v in (w._uploader.feedback.residual or {}).items()}
    w.close()
    out = []
    for r in sorted(hub.list_deltas())[-2:]:  # each file's header entries (in any order) and its tensor bytes
        data = (hub.root / r.path).read_bytes()
        n = int.from_bytes(data[:8], "little")
        out.append((json.loads(data[8 : 8 + n])["__metadata__"], data[8 + n :]))
    return out, owed


@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_fragment_residuals_survive_a_checkpoint_and_resume_exactly(tmp_path, decay):
    straight, owed_straight = _frag_resume(tmp_path, "straight", crash=False, decay=decay)
    resumed, owed_resumed = _frag_resume(tmp_path, "resumed", crash=True, decay=decay)
    assert resumed == straight  # the last delta of each fragment: the same header and bytes
    assert owed_resumed.keys() == owed_straight.keys()
    for k in owed_straight:
        assert torch.equal(owed_resumed[k], owed_straight[k]), k


def test_a_fragment_residual_already_sent_before_a_crash_is_not_sent_twice(tmp_path):
    """Checkpoint after boundaries 1-2 (both fragments owe a residual); boundary 3 (fragment 1) goes
    out with its residual and the worker dies; resumed, fragment 1 owes nothing, fragment 0 its own."""
    hub = FileHub(tmp_path / "hub")
    params = _module_params(llama_like(blocks=2))
    w = _frag_worker(tmp_path, hub, params)
    w.start()
    for i in range(2):
        _frag_phase(params, i)
        w.boundary()
        assert w.flush()
    state = {"worker": w.state_dict(), "anchor": w.anchor_state(),
             "params": {k: v.detach().clone() for k, v in params.items()}}
    state["anchor"]["residual"] = {k: v.clone() for k, v in state["anchor"]["residual"].items()}
    assert w.plan is not None and w.plan.fragment_at(3) == "1"
    _frag_phase(params, 2)
    w.boundary()
    assert w.flush()
    w.close()
    w = _frag_worker(tmp_path, hub, _module_params(state["params"]))
    w.load_state_dict(state["worker"])
    w.load_anchor_state(state["anchor"])
    w.start()
    assert sorted(w._feedback.residual or {}) == sorted(w.plan.keys["0"])  # fragment 1's went out with delta_3
    for k in w.plan.keys["0"]:
        assert torch.equal(w._feedback.residual[k], state["anchor"]["residual"][k])
    w.close()


def test_e2e_pa_cgad_fragments_lockstep(tmp_path):
    state, m, seen, _ = _run_lockstep(tmp_path, 4, boundaries=8, outer="pa_cgad")
    assert m.outer_step == 8 and [f["outer_step"] for f in m.fragments] == [2, 2, 2, 2]
    assert m.optimizer["name"] == "pa_cgad" and sorted(m.optimizer["options"]["fragments"]) == ["0", "1", "2", "3"]


# ----------------------------------------------------------------------------- the master's checks and gates


def _put(hub: FileHub, tmp: Path, node: str, step: int, tensors, base: int, frag=None, fp=None) -> None:
    from diloco_lightning.wire.delta import model_fingerprint

    extra = {} if frag is None else {"fragment": frag[0], "fragments": str(frag[1]), "base_fragment_step": str(frag[2])}
    p = tmp / f"{node}-{step}.safetensors"
    write_delta(p, tensors, node_id=node, local_step=step, base_outer_step=base, extra_metadata=extra,
                model_fingerprint=fp or model_fingerprint(llama_like(blocks=2)))
    hub.upload_delta(p, node, step)


def test_master_checks_a_fragment_delta_against_its_fragment_only(tmp_path):
    from diloco_lightning.master import MasterOuterLoop

    init = llama_like(blocks=2)
    plan = build_plan(2, init)
    hub = FileHub(tmp_path / "hub")
    m = MasterOuterLoop(hub, init, node_state_dir=tmp_path / "m", fragments=2, norm_ratio=None, outer_lr=1.0,
                        outer_momentum=0.0, poll_interval=0.01)
    assert m.sync_once()
    man = hub.read_manifest()
    assert [f["outer_step"] for f in man.fragments] == [0, 0] and man.fragments[0]["keys_sha256"] == plan.digest("0")

    def frag(name, scale=0.01):
        return {k: torch.full_like(v, scale) for k, v in plan.substate(name, init).items()}

    full = {k: torch.zeros_like(v) for k, v in init.items() if v.is_floating_point()}
    _put(hub, tmp_path, "a", 1, frag("0"), 0, ("0", 2, 0))  # good
    _put(hub, tmp_path, "b", 1, frag("0"), 0, ("1", 2, 0))  # names fragment 1, carries fragment 0's keys
    _put(hub, tmp_path, "c", 1, full, 0)  # no fragment in a run with fragments
    _put(hub, tmp_path, "d", 1, frag("1"), 0, ("1", 4, 0))  # another fragment count
    _put(hub, tmp_path, "e", 1, frag("1"), 0, ("1", 2, 1))  # a base_fragment_step its base version cannot have
    m.sync_once(force=True)
    got = m.last_metrics["rejected_by_reason"]
    assert got == {"missing_key": 1, "fragment": 3}, got
    man = hub.read_manifest()
    assert man.outer_step == 1 and man.ledger == {"a": 1}
    assert [(f["outer_step"], f["updated_at"]) for f in man.fragments] == [(1, 1), (0, 0)]
    state = m.snapshot()[1]
    for k, v in plan.substate("0", init).items():
        assert torch.equal(plan.view(k, state), v - 0.01), k
    for k, v in plan.substate("1", init).items():
        assert torch.equal(plan.view(k, state), v), k
    # a delta of a fragment run is refused by a master without fragments, and the reverse
    hub2 = FileHub(tmp_path / "hub2")
    m2 = MasterOuterLoop(hub2, init, node_state_dir=tmp_path / "m2", norm_ratio=None, poll_interval=0.01)
    assert m2.sync_once()
    _put(hub2, tmp_path, "a", 1, frag("0"), 0, ("0", 2, 0))
    m2.sync_once(force=True)
    assert m2.last_metrics["rejected_by_reason"] == {"fragment": 1}
    params = _module_params(init)
    with pytest.raises(Exception, match="syncs no fragments, this worker 2 fragments"):
        DiLoCoWorker(hub2, "w9", params, fragments=2, claim=False, **FAST).start()
    with pytest.raises(Exception, match="syncs 2 fragments, this worker no fragments"):
        DiLoCoWorker(hub, "w9", params, claim=False, **FAST).start()


def test_pa_cgad_gates_each_delta_on_max_tau_and_age_before_averaging(tmp_path):
    """Round mode, F=2: fragment 1 is 2 outer steps old when two of its deltas (staleness 0 and 3)
    arrive: each is gated on max(tau_i, age_f) before the mean, then one Adam step (no second gate)."""
    from diloco_lightning.master import MasterOuterLoop

    init = llama_like(blocks=2)
    plan = build_plan(2, init)
    hub = FileHub(tmp_path / "hub")
    opts = {"lr": 0.01, "alpha": 0.2, "tau_cut": 32}
    m = MasterOuterLoop(hub, init, node_state_dir=tmp_path / "m", fragments=2, norm_ratio=None,
                        outer_optimizer="pa_cgad", outer_options=opts, poll_interval=0.01)
    assert m.sync_once()
    g = torch.Generator().manual_seed(3)

    def frag(name):
        return {k: torch.randn(v.shape, generator=g) * 0.01 for k, v in plan.substate(name, init).items()}

    ref_full = {k: v.clone() for k, v in init.items()}
    ref_state = plan.pieces(ref_full)  # embed and head are split: PA-CGAD steps on the pieces (views)
    ref = PACGAD(ref_state, fragments=plan.optimizer_fragments(), **opts)
    sent = []
    for step in (1, 2, 3):  # three rounds of fragment 0: fragment 1 ages
        d = frag("0")
        _put(hub, tmp_path, "a", step, d, step - 1, ("0", 2, step - 1))
        m.sync_once(force=True)
        assert ref.step_pregated(ref_state, {k: v * ref.fragment_gate("0", 0) for k, v in d.items()})
        sent.append(d)
    assert ref.age("1") == 3
    d_fresh, d_stale = frag("1"), frag("1")
    _put(hub, tmp_path, "a", 4, d_fresh, 3, ("1", 2, 0))  # its fragment was never updated: tau 0
    _put(hub, tmp_path, "b", 1, d_stale, 0, ("1", 2, 0))
    m.sync_once(force=True)
    assert m.last_metrics["staleness_histogram"] == {"0": 2}
    g0 = ref.fragment_gate("1", 0)
    assert g0 == ref.gate(3) < 1.0  # the age gate, not the staleness one, decides here
    mean = {k: (d_fresh[k] * g0 + d_stale[k] * g0) / 2 for k in d_fresh}
    assert ref.step_pregated(ref_state, mean)
    state = m.snapshot()[1]
    for k in ref_full:
        assert torch.allclose(state[k], ref_full[k], atol=1e-7, rtol=0), k
    man = hub.read_manifest()
    assert [(f["outer_step"], f["updated_at"]) for f in man.fragments] == [(3, 3), (1, 4)]
    assert man.history[0].fragment_steps == [3, 0]


# ----------------------------------------------------------------------------- the async worker


def test_async_worker_installs_only_its_fragments_newer_version_and_resumes(tmp_path):
    from diloco_lightning.master import MasterOuterLoop

    init = llama_like(blocks=2)
    plan = build_plan(2, init)
    root = tmp_path / "hub"
    m = MasterOuterLoop(FileHub(root), init, node_state_dir=tmp_path / "m", fragments=2, norm_ratio=None,
                        outer_lr=1.0, outer_momentum=0.0, poll_interval=0.01)
    assert m.sync_once()
    params = _module_params(init)
    w = DiLoCoWorker(FileHub(root), "w0", params, fragments=2, **FAST)
    w.start()

    def train(amount):
        with torch.no_grad():
            for v in params.values():
                if v.is_floating_point():
                    v.add_(amount)

    train(1.0)
    r1 = w.boundary()  # fragment 1: sent; nothing newer to install
    assert r1.installed is None and w.flush()
    m.sync_once(force=True)  # applies fragment 1's delta: version 1
    train(1.0)
    deadline = time.monotonic() + 10
    while w._fetcher.newest_seen < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    r2 = w.boundary()  # fragment 0: version 1 did not update it, so nothing is installed
    assert r2.installed is None
    before = {k: params[k].detach().clone() for k in params}
    train(1.0)
    r3 = w.boundary()  # fragment 1 again: version 1 updated it: installed, the rest kept
    assert r3.installed is not None and r3.installed.outer_step == 1
    g = m.snapshot()[1]
    for k in plan.keys["1"]:  # embed and head rows 16-31 are fragment 1's, rows 0-15 fragment 0's
        assert torch.equal(plan.view(k, params), plan.view(k, g)), k
    for k in plan.keys["0"]:
        assert torch.equal(plan.view(k, params), plan.view(k, before) + 1.0), k
    assert w.fragment_base == {"0": (0, 0), "1": (1, 1)}
    saved = w.anchor_state()
    counters = w.state_dict()
    assert saved["fragment_bases"] == {"0": [0, 0], "1": [1, 1]} and w.flush()
    w.close()
    # a resumed worker keeps its per-fragment bases; one without fragments refuses the checkpoint
    w2 = DiLoCoWorker(FileHub(root), "w0", params, fragments=2, **FAST)
    w2.load_state_dict(counters)
    w2.load_anchor_state(saved)
    assert w2.fragment_base == w.fragment_base
    w3 = DiLoCoWorker(FileHub(root), "w0", params, claim=False, **FAST)
    with pytest.raises(Exception, match="written with 2 fragments"):
        w3.load_anchor_state(saved)
    m.sync_once(force=True)
    got = sorted((r.local_step) for r in FileHub(root).list_deltas())
    assert got == [] and m.ledger == {"w0": 3}
    w2.close()


# ----------------------------------------------------------------------------- kill -9 in the middle of fragment traffic


@pytest.fixture(params=["file", "hf"])
def frag_hubs(request, tmp_path):
    from test_hardening import Hubs

    if request.param == "file":
        yield Hubs("file", tmp_path)
    else:
        from support.hf_server import FakeHubServer

        with FakeHubServer() as server:
            yield Hubs("hf", tmp_path, server)


WORKER_POINTS = [
    # every point is in CI's slow run (a Lightning worker's kill -9 runs by default in test_exactly_once.py)
    pytest.param("file", "worker.uploaded", marks=pytest.mark.slow),
    pytest.param("hf", "worker.uploading", marks=pytest.mark.slow),
    pytest.param("file", "worker.exported", marks=pytest.mark.slow),
    pytest.param("file", "worker.uploading", marks=pytest.mark.slow),
    pytest.param("hf", "worker.exported", marks=pytest.mark.slow),
    pytest.param("hf", "worker.uploaded", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("frag_hubs, point", WORKER_POINTS, indirect=["frag_hubs"])
def test_worker_kill9_in_fragment_traffic_loses_and_duplicates_nothing(frag_hubs, tmp_path, point):
    """A Lightning worker with 2 fragments (vectors p and q, +1 per step each; H=4, a boundary every
    2 steps) is killed at its 3rd boundary (before, while and after a fragment's delta is sent),
    resumes from its checkpoint, and a master applies everything (arrival, Nesterov lr 1, no
    momentum). p and q are split by rows (half of the model each): rows 0-3 (fragment 0, synced at
    steps 4, 8, ..., 20) end at exactly 10 + 20, rows 4-7 (fragment 1, steps 2, 6, ..., 18) at
    10 + 18: no fragment's progress lost or applied twice."""
    _kill9_fragment_run(frag_hubs, tmp_path, point)


@pytest.mark.parametrize("frag_hubs, point", [pytest.param("file", "worker.uploaded", marks=pytest.mark.slow),
                                              pytest.param("file", "worker.exported", marks=pytest.mark.slow)],
                         indirect=["frag_hubs"])
def test_worker_kill9_with_per_fragment_error_feedback(frag_hubs, tmp_path, point):
    """The same with ctopk and error feedback on (each fragment's residual checkpointed and settled
    on its own after the kill): every 4-value piece is one dense chunk of equal values, so its
    2-bit codes are exact (lo = hi) and the totals stay exact."""
    _kill9_fragment_run(frag_hubs, tmp_path, point, encoding=dict(delta_dtype="ctopk", topk_chunk=16, topk=1.0,
                                                                  topk_values="int2", error_feedback=True))


def _kill9_fragment_run(frag_hubs, tmp_path, point, encoding=None):
    from support.workers import run_crash_script

    from diloco_lightning.master import MasterOuterLoop

    hub = frag_hubs.open()
    init = {"p": torch.full((8,), 10.0), "q": torch.full((8,), 10.0)}
    m = MasterOuterLoop(hub, init, node_state_dir=tmp_path / "m", outer_lr=1.0, outer_momentum=0.0,
                        aggregation="arrival", lease_ttl=30, fragments=2)
    assert m.sync_once()
    # no commit budget on the loopback Hub: 10 deltas would be paced 28 s apart after the burst
    # (with fragments a paced delta waits instead of merging: docs/design.md, "Streaming fragments")
    options = dict(frag_hubs.options, commits_per_hour=0) if frag_hubs.kind == "hf" else frag_hubs.options
    cfg = dict(hub=frag_hubs.url, hub_options=options, ckpt_dir=str(tmp_path / "ckpt"), max_steps=20,
               inner_steps=4, fragments=2, encoding=encoding or {})
    first = run_crash_script(cfg, f"{point}:3", timeout=180)
    assert first.returncode == -9, first.stderr[-3000:]
    second = run_crash_script(cfg, None, timeout=180)
    assert second.returncode == 0 and "done 20" in second.stdout, second.stderr[-3000:]
    for _ in range(50):
        m.sync_once(force=True)
        if not hub.list_deltas(after=m.ledger):
            break
    assert m.ledger["w0"] == 10
    state = m.snapshot()[1]
    want = torch.tensor([30.0] * 4 + [28.0] * 4)
    assert torch.equal(state["p"], want), state["p"]
    assert torch.equal(state["q"], want), state["q"]
    man = hub.read_manifest()
    assert [f["outer_step"] for f in man.fragments] == [5, 5]


def _frag_deltas():
    from support.master_crash_script import initial_state

    st = initial_state(0)
    plan = build_plan(2, st)
    out = []
    for i, (node, step, frag) in enumerate([("a", 0, "0"), ("a", 1, "1"), ("b", 0, "1"), ("c", 0, "0"), ("c", 1, "1"),
                                            ("b", 1, "0")]):
        g = torch.Generator().manual_seed(2000 + i)
        out.append((node, step, frag, {k: (torch.randn(v.shape, generator=g) * 0.01).to(v.dtype)
                                       for k, v in plan.substate(frag, st).items()}))
    return out


def _put_frag_deltas(hub, tmp: Path) -> None:
    from support.master_crash_script import initial_state

    from diloco_lightning.wire.delta import model_fingerprint

    fp = model_fingerprint(initial_state(0))
    tmp.mkdir(parents=True, exist_ok=True)
    for node, step, frag, tensors in _frag_deltas():
        p = tmp / f"{node}_{step}.safetensors"
        write_delta(p, tensors, node_id=node, local_step=step, base_outer_step=0, model_fingerprint=fp,
                    extra_metadata={"fragment": frag, "fragments": "2", "base_fragment_step": "0"})
        hub.upload_delta(p, node, step)


MASTER_POINTS = [
    pytest.param("file", "arrival", "published", 3),
    pytest.param("file", "round", "stepped", 1),
    pytest.param("hf", "arrival", "files", 3),
    pytest.param("file", "arrival", "stepped", 3, marks=pytest.mark.slow),
    pytest.param("file", "arrival", "swapped", 3, marks=pytest.mark.slow),
    pytest.param("file", "round", "published", 1, marks=pytest.mark.slow),
    pytest.param("hf", "arrival", "published", 3, marks=pytest.mark.slow),
    pytest.param("hf", "round", "files", 1, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("frag_hubs, aggregation, crash, occurrence", MASTER_POINTS, indirect=["frag_hubs"])
def test_master_kill9_in_fragment_traffic_applies_every_fragment_delta_once(frag_hubs, tmp_path, aggregation, crash,
                                                                            occurrence):
    """A master (2 fragments, Nesterov lr 0.7 momentum 0.9) is killed for real in the middle of six
    fragment deltas; a restarted master must end bit for bit where an uninterrupted one does, with
    the same per-fragment counters."""
    from support.master_crash_script import initial_state
    from test_master_crash import MASTER, _finish, _run_script

    from diloco_lightning.master import MasterOuterLoop

    opts = dict(MASTER, aggregation=aggregation, fragments=2)
    ref_hub = FileHub(tmp_path / "ref_hub")
    ref = MasterOuterLoop(ref_hub, initial_state(0), node_state_dir=tmp_path / "ref_m", **opts)
    ref.sync_once()
    _put_frag_deltas(ref_hub, tmp_path / "ref_w")
    _finish(ref)
    hub = frag_hubs.open()
    _put_frag_deltas(hub, tmp_path / "w")
    spec = ({"kind": "file", "path": str(frag_hubs.root), "cache_dir": str(tmp_path / "sc")} if frag_hubs.kind == "file"
            else {"kind": "hf", "endpoint": frag_hubs.server.endpoint, "repo": _repo(),
                  "token": _token(), "cache_dir": str(tmp_path / "sc")})
    proc = _run_script({"hub": spec, "state_dir": str(tmp_path / "m"), "seed": 0, "crash": crash,
                        "occurrence": occurrence, "master": opts})
    assert proc.returncode == -9, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    m = MasterOuterLoop(frag_hubs.open(), initial_state(0), node_state_dir=tmp_path / "m", **opts)
    _finish(m)
    step, snap = m.snapshot()
    rstep, rsnap = ref.snapshot()
    assert step == rstep
    for k, v in rsnap.items():
        assert torch.equal(snap[k], v), k
    man, rman = m.hub.read_manifest(), ref_hub.read_manifest()
    assert man.ledger == rman.ledger == {"a": 1, "b": 1, "c": 1}
    assert [f["outer_step"] for f in man.fragments] == [f["outer_step"] for f in rman.fragments]
    assert sum(f["outer_step"] for f in man.fragments) == (6 if aggregation == "arrival" else 2)


def _repo() -> str:
    from test_hardening import REPO

    return REPO


def _token() -> str:
    from test_hardening import TOKEN

    return TOKEN


# ----------------------------------------------------------------------------- Hydra


def test_hydra_fragments_compose_and_reach_worker_and_master(hydra_configs):
    from hydra import compose, initialize_config_dir

    from diloco_lightning.app.config import CONFIG_DIR, ConfigError, master_config, validate, worker_options

    def cfg_of(*overrides):
        with initialize_config_dir(str(CONFIG_DIR), version_base=None):
            return compose("train", overrides=["recipe=tiny", *overrides])

    cfg = validate(cfg_of("diloco.fragments=4", "outer=pa_cgad"))
    assert worker_options(cfg.diloco)["fragments"] == 4
    assert master_config(cfg.master, cfg.outer, fragments=cfg.diloco.fragments).fragments == 4
    cfg = validate(cfg_of("diloco.fragments=[[layers.0,layers.2],[layers.1,layers.3,tok_embeddings,norm]]"))
    assert worker_options(cfg.diloco)["fragments"] == [["layers.0", "layers.2"], ["layers.1", "layers.3", "tok_embeddings",
                                                                                    "norm"]]
    with pytest.raises(ConfigError) as e:
        validate(cfg_of("diloco.fragments=3"))  # inner_steps 8
    assert e.value.key == "diloco.fragments" and "multiple of 3" in str(e.value)


# ----------------------------------------------------------------------------- row pieces: bad deltas, a changed split


def test_a_delta_whose_pieces_are_not_the_fragments_is_refused_and_the_round_goes_on(tmp_path):
    """Embedding and head are split by rows (F=2): a fragment delta must carry exactly its pieces,
    each of its piece's shape; a wrong shape, an unknown piece name, or the whole tensor where a row
    range is expected is refused with a reason, and the good delta of the round is applied."""
    from diloco_lightning.master import MasterOuterLoop

    init = llama_like(blocks=2)
    plan = build_plan(2, init)
    hub = FileHub(tmp_path / "hub")
    m = MasterOuterLoop(hub, init, node_state_dir=tmp_path / "m", fragments=2, norm_ratio=None, outer_lr=1.0,
                        outer_momentum=0.0, poll_interval=0.01)
    assert m.sync_once()
    good = {k: torch.full_like(v, 0.01) for k, v in plan.substate("0", init).items()}
    short = {**good, "embed.weight[0:16]": torch.zeros(15, 4)}  # a piece of the wrong shape
    unknown = {k if k != "embed.weight[0:16]" else "embed.weight[0:17]": v for k, v in good.items()}
    unknown["embed.weight[0:17]"] = torch.zeros(17, 4)
    whole = {k: v for k, v in good.items() if k != "embed.weight[0:16]"}
    whole["embed.weight"] = torch.zeros(32, 4)  # the whole tensor where its rows are expected
    extra = {**good, "embed.weight[16:32]": torch.zeros(16, 4)}  # another fragment's piece too
    for node, tensors in (("a", good), ("b", short), ("c", unknown), ("d", whole), ("e", extra)):
        _put(hub, tmp_path, node, 1, tensors, 0, ("0", 2, 0))
    m.sync_once(force=True)
    got = m.last_metrics["rejected_by_reason"]
    # the wrong shape; the row range 0:16 missing (unknown name, whole tensor); another fragment's piece
    assert got == {"shape": 1, "missing_key": 2, "extra_key": 1}, got
    man = hub.read_manifest()
    assert man.outer_step == 1 and man.ledger == {"a": 1}
    state = m.snapshot()[1]
    assert torch.equal(state["embed.weight"][:16], init["embed.weight"][:16] - 0.01)
    assert torch.equal(state["embed.weight"][16:], init["embed.weight"][16:])  # fragment 1's rows untouched


def test_a_run_split_otherwise_is_refused_on_resume(tmp_path):
    """A run whose fragments held whole tensors (what this build did before splitting rows; here the
    same assignment as patterns) cannot be continued by a master or a worker that splits rows: the
    manifest's keys_sha256 covers the piece names, a checkpoint's anchor is named by piece."""
    from diloco_lightning.master import MasterConfigError, MasterOuterLoop

    init = llama_like(blocks=2)
    old = [["embed.weight", "layers.0", "norm.weight"], ["head.weight", "layers.1"]]  # whole tensors
    assert not build_plan(old, init).split and build_plan(2, init).split
    root = tmp_path / "hub"
    m = MasterOuterLoop(FileHub(root), init, node_state_dir=tmp_path / "m", fragments=old, norm_ratio=None,
                        outer_lr=1.0, outer_momentum=0.0, poll_interval=0.01)
    assert m.sync_once()
    params = _module_params(init)
    w = DiLoCoWorker(FileHub(root), "w0", params, fragments=old, **FAST)
    w.start()
    with torch.no_grad():
        params["embed.weight"].add_(1.0)
    w.boundary()
    assert w.flush()
    saved = w.anchor_state()
    w.close()
    m.sync_once(force=True)
    assert FileHub(root).read_manifest().outer_step == 1
    sd = m.state_dict()
    m.stop()  # releases the lease: the next master would take over at once
    m4 = MasterOuterLoop(FileHub(tmp_path / "hub4"), init, node_state_dir=tmp_path / "m4", fragments=2, lease=False)
    with pytest.raises(ValueError, match="split the model otherwise: resume with the same fragments"):
        m4.load_state_dict(sd)  # a master checkpoint: its optimizer state is named by whole key
    for state_dir in ("m", "fresh"):  # its own local copy, or the hub's version
        with pytest.raises(MasterConfigError, match="another way"):
            MasterOuterLoop(FileHub(root), None, node_state_dir=tmp_path / state_dir, fragments=2, norm_ratio=None,
                            poll_interval=0.01).sync_once()
    w2 = DiLoCoWorker(FileHub(root), "w1", _module_params(init), fragments=2, claim=False, **FAST)
    with pytest.raises(Exception, match="split another way"):
        w2.start()
    w3 = DiLoCoWorker(FileHub(root), "w0", _module_params(init), fragments=2, claim=False, **FAST)
    with pytest.raises(Exception, match="split into fragments otherwise: resume with the same fragments"):
        w3.load_anchor_state(saved)


def test_master_state_dict_keeps_each_fragments_counters(tmp_path):
    """MasterOuterLoop.state_dict() carries each fragment's outer step count and the version that
    last updated it (what the staleness and age a_f of its next deltas are counted from); a master
    loaded from it continues them instead of restarting them at the outer step."""
    from diloco_lightning.master import MasterOuterLoop

    init = llama_like(blocks=2)
    plan = build_plan(2, init)
    hub = FileHub(tmp_path / "hub")
    m = MasterOuterLoop(hub, init, node_state_dir=tmp_path / "m", fragments=2, norm_ratio=None, outer_lr=1.0,
                        outer_momentum=0.0, poll_interval=0.01, aggregation="arrival")
    assert m.sync_once()
    for step, frag, base_fragment_step in ((1, "0", 0), (2, "0", 1), (3, "1", 0)):
        tensors = {k: torch.full_like(v, 0.01) for k, v in plan.substate(frag, init).items()}
        _put(hub, tmp_path, "a", step, tensors, step - 1, (frag, 2, base_fragment_step))
        m.sync_once(force=True)
    counters = {f["name"]: (f["outer_step"], f["updated_at"]) for f in hub.read_manifest().fragments}
    assert counters == {"0": (2, 2), "1": (1, 3)}, counters
    sd = m.state_dict()
    assert [(f["name"], f["outer_step"], f["updated_at"]) for f in sd["fragments"]] == [("0", 2, 2), ("1", 1, 3)]
    m.stop()
    m2 = MasterOuterLoop(FileHub(tmp_path / "hub2"), init, node_state_dir=tmp_path / "m2", fragments=2, lease=False,
                         norm_ratio=None, outer_lr=1.0, outer_momentum=0.0)
    m2.load_state_dict(sd)
    assert m2.run.fragment_steps == {"0": (2, 2), "1": (1, 3)}
    m3 = MasterOuterLoop(FileHub(tmp_path / "hub3"), init, node_state_dir=tmp_path / "m3", fragments=3, lease=False,
                         norm_ratio=None, outer_lr=1.0, outer_momentum=0.0)
    with pytest.raises(ValueError, match="resume with the same fragments"):
        m3.load_state_dict(sd)
    bad = {**sd, "fragments": [{"name": "0", "keys_sha256": "x" * 10**6}]}
    with pytest.raises(ValueError, match="fragments"):
        m2.load_state_dict(bad)


@pytest.mark.parametrize("outer", ["nesterov", "cgad"])
def test_a_run_without_fragments_is_continued_by_a_master_that_splits_rows(tmp_path, outer):
    """spec: a master with fragments may adopt a version without them. When its fragments split a
    tensor by rows, the version's optimizer state (named by whole key) is cut into the pieces,
    exactly (the buffers are elementwise; per-key counters repeat), and training goes on."""
    from diloco_lightning.master import MasterOuterLoop

    init = llama_like(blocks=2)
    plan = build_plan(2, init)
    assert plan.split
    hub = FileHub(tmp_path / "hub")
    kw = {"outer_optimizer": outer, "norm_ratio": None, "poll_interval": 0.01}
    m = MasterOuterLoop(hub, init, node_state_dir=tmp_path / "m", outer_lr=0.5, **kw)
    assert m.sync_once()
    whole = {k: torch.randn_like(v) * 0.01 for k, v in init.items() if v.is_floating_point()}
    _put(hub, tmp_path, "a", 1, whole, 0)
    m.sync_once(force=True)
    before = m.run.opt.state_dict()
    m.stop()
    m2 = MasterOuterLoop(hub, init, node_state_dir=tmp_path / "m2", fragments=2, outer_lr=0.5, **kw)
    m2.sync_once()
    assert m2.run.outer_step == 1
    after = m2.run.opt.state_dict()
    for piece, (key, start, stop) in plan.rows.items():
        got = {n: t for n, t in after.items() if isinstance(t, torch.Tensor) and n.split("/")[-1] == piece}
        want = {n: t for n, t in before.items() if isinstance(t, torch.Tensor) and n.split("/")[-1] == key}
        assert len(got) == len(want) >= 1
        for n, t in want.items():
            assert torch.equal(got[n.replace(key, piece)], t[start:stop])
    fragment = plan.fragment_of("embed.weight[0:16]")
    _put(hub, tmp_path, "a", 2, {k: torch.full_like(v, 0.01) for k, v in plan.substate(fragment, init).items()}, 1,
         (fragment, 2, 0))
    m2.sync_once(force=True)
    man = hub.read_manifest()
    assert man.outer_step == 2 and man.ledger == {"a": 2}


def test_splitting_a_hostile_optimizer_state_ends_in_the_loads_refusal():
    """A hub's outer state is a writer's bytes: a buffer of the wrong size for a split key is not
    cut (no IndexError, no silent slice of a bigger tensor) but passed on for the load to refuse."""
    from diloco_lightning.wire.fragments import split_optimizer_state, stepped_state
    from diloco_lightning.outer import build_outer_optimizer

    init = llama_like(blocks=2)
    plan = build_plan(2, init)
    opt = build_outer_optimizer("nesterov", stepped_state(plan, {k: v.clone() for k, v in init.items()}), lr=0.1)
    for bad in (torch.tensor(1.0), torch.zeros(40, 4), torch.zeros(31, 4), torch.zeros(32, 5)):
        with pytest.raises(ValueError, match="embed.weight"):
            opt.load_state_dict(split_optimizer_state(plan, {"embed.weight": bad}))
    good = torch.arange(128.0).reshape(32, 4)
    opt.load_state_dict(split_optimizer_state(plan, {"embed.weight": good}))
    sd = opt.state_dict()
    assert torch.equal(sd["embed.weight[0:16]"], good[:16]) and torch.equal(sd["embed.weight[16:32]"], good[16:])
