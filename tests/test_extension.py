"""Extension by one class and one registration (issue 37, item 2): a toy encoding and a toy outer
optimizer, each defined here in one class and registered (then unregistered), run through the
worker's encoding, the delta file and the master's decoding and step, touching no package file.

Files touched to add one, in the package: an encoding 5+ before the registry (``encoding/spec.py``
for its name, options and header entries, ``codec.py`` for its encode/decode branches, ``format.py``
for its layout and checks, ``worker/options.py`` for ``delta_dtype``, a kernels file), 0 now (its own
file; here, this test); an outer optimizer 2 before (its file and ``outer/__init__.py``'s list, which
could not be added to from outside), 0 now.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from typing import ClassVar

import pytest
import torch
from torch import Tensor

from diloco_lightning.encoding import Encoding, EncodingSpec, decode, encoding_names, register_encoding
from diloco_lightning.encoding import unregister_encoding
from diloco_lightning.encoding.base import PartLayout, value_chunks
from diloco_lightning.encoding.feedback import ErrorFeedback
from diloco_lightning.hub.local import FileHub
from diloco_lightning.master import MasterOuterLoop
from diloco_lightning.outer import OUTER_OPTIMIZERS, OuterOptimizer, build_outer_optimizer, gates_per_fragment
from diloco_lightning.outer import register_outer_optimizer, unregister_outer_optimizer
from diloco_lightning.outer.base import Item, Work
from diloco_lightning.wire.delta import EncodingFileError, model_fingerprint, read_delta, write_delta
from diloco_lightning.worker import DiLoCoWorker

FAST = dict(poll_interval=0.01, wait_timeout=10.0)


# ============================================================================ a toy encoding


class SignMean(Encoding):
    """signSGD with one scale per tensor: ``q = sign(x)`` (int8), ``scale = mean |x|``; decodes to
    ``q * scale``. Lossy (error feedback on by default), dense, quantized parts in the encoded format."""

    name = "toy_sign_mean"

    def encode(self, flat: Tensor, real_shape: tuple[int, ...], res: Tensor | None,
               add: Tensor | None) -> dict[str, Tensor]:
        x = flat.to(torch.float32)
        if not bool(torch.isfinite(x).all()):
            raise ValueError("cannot encode a tensor with NaN or inf values")
        scale = x.abs().mean().reshape(1) if x.numel() else torch.zeros(1)
        q = torch.sign(x).to(torch.int8)
        if res is not None:
            torch.sub(x, q.to(torch.float32) * scale, out=res)
        return {"q": q, "scale": scale}

    def layout(self, real_shape: tuple[int, ...]) -> PartLayout:
        return {"q": (torch.int8, (math.prod(real_shape),)), "scale": (torch.float32, (1,))}

    def check(self, parts: Mapping[str, Tensor], real_shape: tuple[int, ...]) -> str | None:
        scale, q = parts["scale"], parts["q"]
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            return "part 'scale' is negative, NaN or inf"
        if q.numel() and (int(q.amin()) < -1 or int(q.amax()) > 1):
            return "part 'q' has a code other than -1, 0, 1"
        return None

    def chunks(self, parts: Mapping[str, Tensor], numel: int, device: torch.device
               ) -> Iterator[tuple[slice | Tensor, Tensor]]:
        q, scale = parts["q"], parts["scale"]
        for start, stop, vals in value_chunks(numel, device, lambda s, w: w.copy_(q[s : s + w.numel()]).mul_(scale)):
            yield slice(start, stop), vals


@pytest.fixture
def toy_encoding():
    register_encoding(SignMean)
    try:
        yield SignMean.name
    finally:
        unregister_encoding(SignMean.name)
    assert SignMean.name not in encoding_names()


def _model(seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 33, generator=g), "b": torch.randn(7, generator=g),
            "c": torch.randn(3, 2, dtype=torch.complex64, generator=g), "steps": torch.tensor(3)}


def _sign_mean(x: Tensor) -> Tensor:
    real = torch.view_as_real(x).reshape(-1) if x.is_complex() else x.reshape(-1)
    out = torch.sign(real) * real.abs().mean()
    return torch.view_as_complex(out.view(*x.shape, 2)) if x.is_complex() else out.view(x.shape)


def test_a_registered_encoding_has_a_spec_a_header_and_capabilities(toy_encoding):
    spec = EncodingSpec(toy_encoding)
    assert spec.cast_dtype is None and spec.feedback_by_default and not spec.lossless
    assert spec.to_metadata() == {"encoding": toy_encoding}
    assert EncodingSpec.from_metadata(spec.to_metadata()) == spec
    with pytest.raises(ValueError, match="toy_sign_mean"):  # the error lists it among the valid names
        EncodingSpec("no_such_encoding")
    with pytest.raises(ValueError, match="already registered"):
        register_encoding(type("Other", (SignMean,), {}))


def test_a_toy_encoding_round_trips_through_the_workers_encoding_and_the_delta_file(toy_encoding, tmp_path):
    spec = EncodingSpec(toy_encoding)
    ref = _model()
    delta = {k: torch.randn(v.shape, dtype=v.dtype) * 1e-3 for k, v in ref.items() if v.is_floating_point() or v.is_complex()}
    ef = ErrorFeedback(spec)  # what the worker's uploader encodes with
    sent = ef.encode({k: v.clone() for k, v in delta.items()})
    for k, x in delta.items():
        assert torch.equal(decode(sent[k]), _sign_mean(x))
        assert torch.equal(ef.residual[k], x - decode(sent[k]))  # error feedback: what it dropped is owed
    path = tmp_path / "nodes" / "w0" / "delta_1.safetensors"
    path.parent.mkdir(parents=True)
    write_delta(path, sent, node_id="w0", local_step=1, base_outer_step=0, model_fingerprint=model_fingerprint(ref))
    d = read_delta(path, reference=ref)  # the master's read: parts checked against the toy's layout
    assert d.encoding == spec
    for k in delta:
        assert torch.equal(decode(d.encoded[k]), decode(sent[k]))
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    start = json.loads(raw[8 : 8 + n])["w"]["data_offsets"][0]  # the first sign code of "w"
    raw[8 + n + start] = 7  # a code the toy's check refuses
    path.write_bytes(bytes(raw))
    with pytest.raises(EncodingFileError, match="other than -1, 0, 1"):
        read_delta(path, reference=ref)


def test_a_toy_encoding_runs_a_worker_and_a_master_end_to_end(toy_encoding, tmp_path):
    hub = FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache")
    s0 = _model()
    m = MasterOuterLoop(hub, s0, node_state_dir=tmp_path / "m", outer_optimizer="nesterov", outer_lr=1.0,
                        outer_momentum=0.0, lease_ttl=30.0, poll_interval=0.02, min_deltas=1, norm_ratio=None)
    assert m.sync_once()
    params = {k: v.clone() for k, v in s0.items()}
    w = DiLoCoWorker(hub, "w0", params, delta_dtype=toy_encoding, **FAST)
    w.start()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for k in ("w", "b", "c"):
            params[k].add_(torch.randn(params[k].shape, dtype=params[k].dtype, generator=g) * 0.01)
    x = {k: s0[k] - params[k] for k in ("w", "b", "c")}  # the pseudo-gradient, anchor - local
    w.boundary()
    assert w.flush()
    (ref,) = hub.list_deltas()
    assert read_delta(hub.root / ref.path, reference=s0).encoding == EncodingSpec(toy_encoding)
    while m.sync_once():
        pass
    assert m.last_metrics["rejected"] == 0 and m.run.outer_step == 1
    for k, xk in x.items():  # nesterov, lr 1, momentum 0, one delta: state = s0 - decode(delta)
        assert torch.equal(m.run.state[k], s0[k] - _sign_mean(xk))
    assert torch.equal(m.run.state["steps"], s0["steps"])
    w.close()


# ============================================================================ a toy outer optimizer


class HeavyBall(OuterOptimizer):
    """Polyak's heavy ball: ``v = beta * v + g``; ``state -= lr * v`` (one buffer family, no scalars)."""

    name = "toy_heavy_ball"
    BUFFERS: ClassVar[dict[str, bool]] = {"velocity": True}
    STATE_KINDS = ("toy_heavy_ball",)

    def __init__(self, state: Mapping[str, Tensor], lr: float, beta: float = 0.5) -> None:
        super().__init__(state, {"lr": float(lr), "beta": float(beta)})
        self.lr, self.beta = float(lr), float(beta)

    def _apply(self, items: list[Item], tau: float, gated: bool, fragment: str | None) -> bool:
        gate = 1.0 if gated else self.gate(tau)

        def fn(batch: list[Work]) -> None:
            for w in batch:
                v = w.bufs["velocity"]
                v.mul_(self.beta).add_(w.g, alpha=gate)
                w.p.sub_(v, alpha=self.lr)

        self._run(items, fn)
        return True


@pytest.fixture
def toy_outer():
    register_outer_optimizer(HeavyBall)
    try:
        yield HeavyBall.name
    finally:
        unregister_outer_optimizer(HeavyBall.name)
    assert HeavyBall.name not in OUTER_OPTIMIZERS


def test_a_registered_outer_optimizer_builds_steps_and_resumes(toy_outer):
    state = {"w": torch.ones(5), "z": torch.zeros(2, dtype=torch.complex64)}
    opt = build_outer_optimizer(toy_outer, state, lr=0.5, beta=0.5)
    assert not gates_per_fragment(toy_outer) and gates_per_fragment("pa_cgad")
    g = {"w": torch.full((5,), 2.0), "z": torch.full((2,), 1 + 1j, dtype=torch.complex64)}
    assert opt.step(state, g) and opt.step(state, g)
    # v1 = 2, w1 = 1 - 1 = 0; v2 = 0.5 * 2 + 2 = 3, w2 = 0 - 1.5 = -1.5
    assert torch.equal(state["w"], torch.full((5,), -1.5))
    again = build_outer_optimizer(opt.name, {k: v.clone() for k, v in state.items()}, **opt.options)
    again.load_state_dict(opt.state_dict())
    s1, s2 = {k: v.clone() for k, v in state.items()}, {k: v.clone() for k, v in state.items()}
    opt.step(s1, g)
    again.step(s2, g)
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    with pytest.raises(ValueError, match="unknown option"):
        build_outer_optimizer(toy_outer, state, lr=0.5, momentum=0.9)


def test_a_toy_outer_optimizer_steps_a_masters_round(toy_outer, tmp_path):
    hub = FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache")
    s0 = _model()
    m = MasterOuterLoop(hub, s0, node_state_dir=tmp_path / "m", outer_optimizer=toy_outer, outer_lr=0.5,
                        outer_options={"beta": 0.25}, lease_ttl=30.0, poll_interval=0.02, min_deltas=1, norm_ratio=None)
    assert m.sync_once()
    params = {k: v.clone() for k, v in s0.items()}
    w = DiLoCoWorker(hub, "w0", params, **FAST)  # float32 deltas: sent exactly
    w.start()
    with torch.no_grad():
        params["w"].add_(0.01)
    x = s0["w"] - params["w"]
    w.boundary()
    assert w.flush()
    while m.sync_once():
        pass
    assert m.run.outer_step == 1 and isinstance(m.run.opt, HeavyBall) and m.run.opt.beta == 0.25
    assert torch.equal(m.run.state["w"], s0["w"] - 0.5 * x)  # v = g on the first step
    assert torch.equal(m.run.state["b"], s0["b"])
    w.close()
