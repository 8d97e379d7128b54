"""Encoded pseudo-gradients end to end (issue 14): what a worker sends, the file, the master.

* ``compression.encode_delta`` / ``ErrorFeedback`` against the NumPy reference of
  ``tests/test_encoding.py`` bit for bit, on real pseudo-gradients (a small Llama after AdamW
  steps), over two rounds of error feedback;
* plain float32/bfloat16/float16 files written by a worker are, entry for entry and byte for byte,
  the files the code before encodings wrote (digests taken from commit f2b314e);
* every malformed encoding a hub writer can put on the hub is a rejection with the reason
  ``encoding`` (or the existing one), the round goes on, and a file declaring a huge part costs
  nothing to refuse; a tampered scale byte or header parameter breaks the signature;
* the residual: nothing is lost across failed, doubtful and landed-after-all uploads, and a
  checkpoint/resume continues with exactly the bits an uninterrupted worker sends;
* a mixed run (workers on float32, bfloat16, int8, int4, top-k) applies the mean of the decoded
  deltas, in round and arrival modes; ``train.py diloco.delta_dtype=int4`` trains and sends ~8x
  fewer bytes than float32.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from diloco_lightning.encoding.feedback import ErrorFeedback, decode_delta, encode_delta
from diloco_lightning.wire.delta import DeltaHeader, model_fingerprint, read_delta, write_delta
from diloco_lightning.encoding import EncodingSpec, decode
from diloco_lightning.hub.local import FileHub
from diloco_lightning.master import MasterOuterLoop
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.worker import DiLoCoWorker

from test_encoding import bits, ref_decode, ref_encode
from test_worker import FlakyHub, LandsThenFails, Publisher, make_params, snapshot

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(poll_interval=0.01, wait_timeout=10.0)
LOSSY = [
    EncodingSpec("int8"),
    EncodingSpec("int4"),
    EncodingSpec("topk", topk=0.01, topk_values="int8"),
    EncodingSpec("topk", topk=0.03, topk_values="int4"),
    EncodingSpec("bfloat16"),
    EncodingSpec("ctopk", chunk=64, chunk_k=2, topk_values="int2"),
    EncodingSpec("ctopk", chunk=256, chunk_k=8, topk_values="sign"),
]


def spec_id(spec: EncodingSpec) -> str:
    if spec.name == "ctopk":
        return f"ctopk-c{spec.chunk}-k{spec.chunk_k}-{spec.topk_values}"
    return spec.name + (f"-{spec.topk_values}-{spec.topk}" if spec.name == "topk" else "")


@functools.lru_cache(maxsize=None)
def _real_deltas(rounds: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """Pseudo-gradients of a small Llama (~50k parameters) after ``steps`` AdamW steps each."""
    from diloco_lightning.models.llama import Llama, llama_config

    torch.manual_seed(0)
    model = Llama(llama_config("tiny", d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96,
                               vocab_size=256), device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    zipf = 1.0 / torch.arange(1, 257, dtype=torch.float64)
    out = []
    for _ in range(rounds):
        anchor = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
        for _ in range(steps):
            tokens = torch.multinomial(zipf, 4 * 33, replacement=True).view(4, 33)
            loss = model.loss(tokens[:, :-1], tokens[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
        out.append({k: anchor[k] - v.detach() for k, v in model.state_dict().items() if k in anchor})
    return out


def real_deltas(rounds: int = 2, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in d.items()} for d in _real_deltas(rounds, steps)]


# ============================================================================ 1. bit-exact against the reference


@pytest.mark.parametrize("spec", LOSSY, ids=spec_id)
def test_error_feedback_rounds_match_the_reference_bit_for_bit(spec):
    """Two rounds on real pseudo-gradients: round 2 encodes delta_2 + residual_1, where the reference's
    residual is x - ref_decode(ref_encode(x)) in NumPy float32; codes, scales, positions, residuals equal."""
    rounds = real_deltas()
    fb = ErrorFeedback(spec)
    ref_residual: dict[str, np.ndarray] = {}
    for delta in rounds:
        kept = {k: v.clone() for k, v in delta.items()}
        sent = fb.encode(kept, in_place=True)  # the worker's path: kept buffers, updated in place
        for k, d in delta.items():
            x = d.numpy().astype(np.float32).reshape(-1)
            if k in ref_residual:
                x = (x + ref_residual[k]).astype(np.float32)  # float32 addition, as the worker does
            xt = torch.from_numpy(x).view(d.shape)
            if spec.name == "bfloat16":
                q = xt.to(torch.bfloat16)
                assert torch.equal(bits(sent[k].parts["q"]), bits(q)), k
                dec = q.float().numpy().reshape(-1)
            else:
                want = ref_encode(xt, spec)
                for part, arr in want.items():
                    assert np.array_equal(sent[k].parts[part].numpy().view(arr.dtype), arr), (k, part)
                dec = ref_decode(want, spec, x.size)
            ref_residual[k] = (x - dec).astype(np.float32)
            assert np.array_equal(fb.residual[k].numpy().reshape(-1).view(np.int32),
                                  ref_residual[k].view(np.int32)), k
            assert np.array_equal(kept[k].numpy().reshape(-1).view(np.int32), x.view(np.int32))  # delta += residual
    # the pure function (what a simulator calls) gives the same bits without kept buffers
    enc, res = encode_delta(rounds[0], spec)
    enc2, _ = encode_delta(rounds[1], spec, res)
    for k in rounds[1]:
        for part, t in enc2[k].parts.items():
            assert torch.equal(bits(t), bits(sent[k].parts[part])), (k, part)


@pytest.mark.parametrize("name", ["bfloat16", "float16", "int8", "int4", "ctopk", "topk"])
def test_the_residual_added_in_the_encoders_pass_gives_the_same_bits(name):
    """The worker's step, ``delta += residual`` then encode, with the addition done chunk by chunk
    inside the encoder's own pass (``add=``): the same codes, scales and residual as the two steps
    apart, over several chunks with a short tail, for a complex key and a non-contiguous one."""
    from diloco_lightning.encoding import encode_with_residual
    from diloco_lightning.encoding.format import CHUNK

    spec = (EncodingSpec("ctopk", chunk=64, chunk_k=4, topk_values="int2") if name == "ctopk"
            else EncodingSpec("topk", topk=0.01, topk_values="int8") if name == "topk" else EncodingSpec(name))
    g = torch.Generator().manual_seed(3)
    real = torch.randn(2 * CHUNK + 1001, generator=g) * 1e-3
    cases = [real, torch.view_as_complex(torch.randn(CHUNK + 77, 2, generator=g)),
             torch.randn(300, 200, generator=g).t()]  # the last one is not contiguous
    for delta in cases:
        r = (torch.randn(delta.shape, dtype=delta.dtype, generator=g) * 1e-4).contiguous()
        apart, r_apart = delta.clone().add_(r), r.clone()
        want, want_res = encode_with_residual(apart, spec, out=r_apart)
        fused, r_fused = delta.clone(), r.clone()
        got, got_res = encode_with_residual(fused, spec, out=r_fused, add=r_fused)
        assert got_res is r_fused
        assert torch.equal(bits(fused), bits(apart))  # delta now holds x, as the worker needs
        assert torch.equal(bits(got_res), bits(want_res))
        for part, t in want.parts.items():
            assert torch.equal(bits(got.parts[part]), bits(t)), part
    with pytest.raises(ValueError, match="add must be"):
        encode_with_residual(real.clone(), spec, add=torch.zeros(3))
    with pytest.raises(ValueError, match="add must be"):
        encode_with_residual(real.double(), spec, add=real.double())


@pytest.mark.parametrize("decay", [0.95, 0.5])
def test_decayed_error_feedback_is_sparselocos_buffer_bit_for_bit(decay):
    """SparseLoCo: e = beta * e + delta; send Q(e); e = e - Q(e). Three rounds on real deltas, in
    NumPy float32 (beta * e rounded, then added): what is sent and what is owed, bit for bit."""
    spec = EncodingSpec("ctopk", chunk=64, chunk_k=4, topk_values="int2")
    rounds = real_deltas(3, 2)
    fb = ErrorFeedback(spec, decay=decay)
    e: dict[str, np.ndarray] = {}
    for delta in rounds:
        sent = fb.encode({k: v.clone() for k, v in delta.items()}, in_place=True)
        for k, d in delta.items():
            x = d.numpy().reshape(-1).astype(np.float32)
            if k in e:
                x = (x + (e[k] * np.float32(decay)).astype(np.float32)).astype(np.float32)
            want = ref_encode(torch.from_numpy(x), spec)
            for part, arr in want.items():
                assert np.array_equal(sent[k].parts[part].numpy().view(np.uint8), arr.view(np.uint8)), (k, part)
            e[k] = (x - ref_decode(want, spec, x.size)).astype(np.float32)
            assert np.array_equal(fb.residual[k].numpy().reshape(-1).view(np.int32), e[k].view(np.int32)), k
    with pytest.raises(ValueError, match="decay"):
        ErrorFeedback(spec, decay=0.0)
    with pytest.raises(ValueError, match="decay"):
        encode_delta(rounds[0], spec, decay=1.5)


def test_error_feedback_keeps_a_residual_per_key_for_partial_deltas():
    """A delta of some keys (a fragment) adds and renews their residual only; forget() and absorb()
    touch the keys they are given; state_dict round-trips what is owed."""
    spec = EncodingSpec("int4")
    d = real_deltas(1, 2)[0]
    keys = sorted(d)
    half, rest = keys[: len(keys) // 2], keys[len(keys) // 2 :]
    fb = ErrorFeedback(spec)
    fb.encode({k: d[k].clone() for k in half})
    assert sorted(fb.residual) == half
    before = {k: fb.residual[k].clone() for k in half}
    fb.encode({k: d[k].clone() for k in rest})
    assert sorted(fb.residual) == keys and all(torch.equal(fb.residual[k], before[k]) for k in half)
    fb.forget(rest)
    assert sorted(fb.residual) == half
    state = fb.state_dict()
    fb2 = ErrorFeedback(spec)
    fb2.load_state_dict(state)
    assert sorted(fb2.residual) == half and all(torch.equal(fb2.residual[k], before[k]) for k in half)
    fb2.absorb({k: d[k].clone() for k in rest})  # a delta of ``rest`` landed after all: its dropped part is owed
    _, dropped = encode_delta({k: d[k].clone() for k in rest}, spec)
    assert sorted(fb2.residual) == keys and all(torch.equal(fb2.residual[k], dropped[k]) for k in rest)
    fb2.forget()
    assert fb2.residual is None and fb2.state_dict() == {"residual": None}


def test_lossless_and_disabled_feedback_keep_no_residual():
    d = real_deltas(1, 1)[0]
    enc, res = encode_delta(d, EncodingSpec("float32"))
    assert res is None and all(enc[k].parts["q"] is d[k] for k in d)  # float32: the tensor itself, no copy
    enc, res = encode_delta(d, EncodingSpec("int8"), error_feedback=False)
    assert res is None
    fb = ErrorFeedback(EncodingSpec("int4"), enabled=False)
    fb.encode(d)
    assert fb.residual is None and fb.state_dict() == {"residual": None}


# ============================================================================ 2. the file


# canonical digests (header JSON with sorted keys + data bytes; safetensors writes the header's
# entries in no fixed order) of what /tmp/golden.py's worker run wrote with the code of commit
# f2b314e, before encodings existed: a signed worker, 2 boundaries, a complex key included
GOLDEN = {
    "float32/1": "a149f6dc3e7c06221c8dfb5a79f31e1420bf2104a15b33b6da9d42bc7cdc9df9",
    "float32/2": "39f440abfe60abb0fd633a3149fac591fc964b2b426fedd165690f3e39b58419",
    "bfloat16/1": "3fd0d7f3845d7ddf5a22e2527f9f0bb29f9823af837d11beec78e0b139a0ad9f",
    "bfloat16/2": "3f22f4b49400b1eab5805a62a08550fb0cdb55fe292aaff92a93cf3f37df4329",
    "float16/1": "dee84f507590485e86c97622e8fab16820212c366132e66f44f6c32e05bcbd2d",
    "float16/2": "04bd3b05f50c22aa3bd9ac8945cf468c0991d7ef224e6e5dce82a4504a1dd2d9",
}


def canonical_digest(data: bytes) -> str:
    n = int.from_bytes(data[:8], "little")
    return hashlib.sha256(json.dumps(json.loads(data[8 : 8 + n]), sort_keys=True).encode() + data[8 + n :]).hexdigest()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_plain_files_are_those_written_before_encodings_existed(tmp_path, dtype):
    hub = FileHub(tmp_path / "hub")
    params = make_params(3)
    params["cplx"] = torch.complex(torch.arange(6.0).view(2, 3) / 7, torch.ones(2, 3) / 3)
    key = RunKey("golden")
    Publisher(hub, tmp_path / "pub", key=key).publish(snapshot(params))
    w = DiLoCoWorker(hub, "w0", params, delta_dtype=dtype, signing_key=key, **FAST)
    assert w.error_feedback is False  # the float casts keep today's behaviour by default
    w.start()
    for i in range(2):
        with torch.no_grad():
            params["layer.weight"].mul_(1.0 + 1 / 3).add_(0.1)
            params["layer.bias"].sub_(1 / 7)
            params["cplx"].mul_(1j)
        w.boundary(num_tokens=100 + i)
    assert w.flush()
    w.close()
    got = {f"{dtype}/{r.local_step}": canonical_digest((hub.root / r.path).read_bytes()) for r in hub.list_deltas()}
    assert got == {k: v for k, v in GOLDEN.items() if k.startswith(dtype + "/")}


def test_encoded_file_layout_on_disk(tmp_path):
    """What docs/spec.md promises another implementation: header entries, part names, dtypes, shapes."""
    ref = {"w": torch.zeros(40, 33), "b": torch.zeros(7), "s": torch.zeros(()), "c": torch.zeros(3, 2, dtype=torch.complex64)}
    delta = {k: torch.randn(v.shape, dtype=v.dtype) * 1e-3 for k, v in ref.items()}
    spec = EncodingSpec("topk", topk=0.05, topk_values="int4")
    enc, _ = encode_delta(delta, spec)
    path = tmp_path / "nodes" / "w0" / "delta_3.safetensors"
    path.parent.mkdir(parents=True)
    size = write_delta(path, enc, node_id="w0", local_step=3, base_outer_step=1, model_fingerprint=model_fingerprint(ref))
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    md = header.pop("__metadata__")
    assert md["encoding"] == "topk" and md["encoding_block_size"] == "128"
    assert md["encoding_topk"] == "0.05" and md["encoding_topk_values"] == "int4"
    assert md["format"] == "diloco-delta/1" and md["base_outer_step"] == "1"
    k = round(0.05 * 1320)
    assert header["w"]["dtype"] == "U8" and header["w"]["shape"] == [(k + 1) // 2]
    assert header["w::scale"] == {**header["w::scale"], "dtype": "F32", "shape": [1]}
    assert header["w::idx"]["dtype"] == "I16" and header["w::idx"]["shape"] == [k]
    assert header["w::count"]["dtype"] == "I32" and header["w::count"]["shape"] == [1]
    assert header["c"]["shape"] == [1] and header["s::idx"]["shape"] == [1]  # complex: 12 real values, k = 1
    assert size == len(raw) == 8 + n + sum(t.nbytes for e in enc.values() for t in e.parts.values())
    d = read_delta(path, reference=ref)
    for key in ref:
        assert torch.equal(bits(decode(d.encoded[key])), bits(decode(enc[key])))


def test_ctopk_file_layout_on_disk(tmp_path):
    """The chunked top-k as docs/encoding.md lays it out: chunk and k in the header, three parts per key."""
    ref = {"w": torch.zeros(40, 33), "b": torch.zeros(7), "s": torch.zeros(()), "c": torch.zeros(3, 2, dtype=torch.complex64)}
    delta = {k: torch.randn(v.shape, dtype=v.dtype) * 1e-3 for k, v in ref.items()}
    spec = EncodingSpec("ctopk", chunk=256, chunk_k=4, topk_values="int2")
    enc, _ = encode_delta(delta, spec)
    path = tmp_path / "nodes" / "w0" / "delta_3.safetensors"
    path.parent.mkdir(parents=True)
    size = write_delta(path, enc, node_id="w0", local_step=3, base_outer_step=1, model_fingerprint=model_fingerprint(ref))
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    md = header.pop("__metadata__")
    assert {k: md[k] for k in md if k.startswith("encoding")} == {
        "encoding": "ctopk", "encoding_chunk": "256", "encoding_chunk_k": "4", "encoding_topk_values": "int2"}
    kept = 5 * 4 + 1  # 1320 values: 5 chunks of 256, a tail of 40 keeping ceil(4 * 40 / 256) = 1
    assert header["w"]["dtype"] == "U8" and header["w"]["shape"] == [math.ceil(kept * 2 / 8)]
    assert header["w::idx"]["dtype"] == "U8" and header["w::idx"]["shape"] == [kept]  # 8-bit offsets
    assert header["w::scale"]["dtype"] == "F32" and header["w::scale"]["shape"] == [6, 2]
    assert sorted(header) == sorted(f"{k}{p}" for k in ref for p in ("", "::idx", "::scale"))
    assert header["c::scale"]["shape"] == [1, 2] and header["s::idx"]["shape"] == [1]  # complex: 12 real values
    assert size == len(raw) == 8 + n + sum(t.nbytes for e in enc.values() for t in e.parts.values())
    d = read_delta(path, reference=ref)
    for key in ref:
        assert torch.equal(bits(decode(d.encoded[key])), bits(decode(enc[key])))


# ============================================================================ 3. malformed encodings at the master


S0 = {"w": torch.full((40, 33), 0.5), "b": torch.ones(7), "s": torch.tensor(2.0), "steps": torch.tensor(7)}
FP = model_fingerprint(S0)


def honest(seed: int = 0, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * scale for k, v in S0.items() if v.is_floating_point()}


def encoded_bytes(tmp: Path, node: str, spec: EncodingSpec, mutate=None, *, step: int = 0, key: RunKey | None = None,
                  delta: dict | None = None) -> bytes:
    """A delta file's bytes, written as any hub writer could: the honest parts of ``spec`` after
    ``mutate(tensors, metadata)`` (file names -> tensors, header entries), signed with ``key``."""
    enc, _ = encode_delta(delta if delta is not None else honest(), spec)
    tensors = {name: t.clone() for k, e in enc.items() for name, t in e.file_tensors(k).items()}
    md = DeltaHeader("x" if node is None else node, step, 0, model_fingerprint=FP, encoding=spec).to_metadata()
    if mutate is not None:
        mutate(tensors, md)
    if key is not None:
        md["signature"] = key.sign(md, tensors)
    p = tmp / f"mk-{node}-{time.monotonic_ns()}.safetensors"
    save_file(tensors, str(p), metadata=md)
    return p.read_bytes()


def _set(name, i, value):
    def fn(t, md):
        t[name].view(-1)[i] = value
    return fn


def _replace(name, value):
    def fn(t, md):
        t[name] = value(t[name]) if callable(value) else value
    return fn


def _header(**entries):
    def fn(t, md):
        md.update(entries)
        for k, v in entries.items():
            if v is None:
                del md[k]
    return fn


INT8, INT4 = EncodingSpec("int8"), EncodingSpec("int4")
TOPK = EncodingSpec("topk", topk=0.05, topk_values="int8")
CTOPK = EncodingSpec("ctopk", chunk=64, chunk_k=3, topk_values="int2")  # w: 1320 values, 20 chunks + a tail of 40


def _ctopk_offsets(name, fn):
    """Re-pack the 6-bit offsets of ``name`` after ``fn`` changed them (a writer that knows the format)."""
    from diloco_lightning.encoding.bits import pack_bits, unpack_bits

    def mutate(t, md):
        count = t[name].numel() * 8 // 6
        t[name] = pack_bits(fn(unpack_bits(t[name], 6, 0, count)), 6)
    return mutate


MALFORMED = {
    # the header's encoding
    "unknown encoding": (INT8, _header(encoding="int3"), "encoding"),
    "block size not a power of two": (INT8, _header(encoding_block_size="100"), "encoding"),
    "block size of 5000 digits": (INT8, _header(encoding_block_size="9" * 5000), "encoding"),
    "topk fraction NaN": (TOPK, _header(encoding_topk="nan"), "encoding"),
    "topk fraction of 50k digits": (TOPK, _header(encoding_topk="0." + "1" * 50_000), "encoding"),
    "a header beyond the budget": (TOPK, _header(encoding_topk="0." + "1" * 200_000), "size"),
    "topk fraction above 1": (TOPK, _header(encoding_topk="2"), "encoding"),
    "topk values int2": (TOPK, _header(encoding_topk_values="int2"), "encoding"),
    "encoding params without encoding": (INT8, _header(encoding=None), "encoding"),
    "plain file claiming int8": (EncodingSpec("float32"), _header(encoding="int8", encoding_block_size="128"), "encoding"),
    # the parts, from the header alone
    "one scale too few": (INT8, _replace("w::scale", lambda s: s[:-1]), "encoding"),
    "one scale too many": (INT8, _replace("w::scale", lambda s: torch.cat([s, s[:1]])), "encoding"),
    "codes of another dtype": (INT8, _replace("w", lambda q: q.to(torch.int16)), "encoding"),
    "int4 codes one byte short": (INT4, _replace("b", lambda q: q[:-1]), "encoding"),
    "missing scale part": (INT8, lambda t, md: t.pop("b::scale"), "encoding"),
    "extra part": (INT8, _replace("w::bogus", torch.zeros(3)), "encoding"),
    "codes under an explicit ::q name": (INT8, lambda t, md: t.update({"b::q": t.pop("b")}), "encoding"),
    "top-k with one position too many": (TOPK, _replace("w::idx", lambda i: torch.cat([i, i[-1:]])), "encoding"),
    "extra key": (INT8, _replace("zz::scale", torch.zeros(1)), "extra_key"),
    "missing key": (INT8, lambda t, md: [t.pop(n) for n in ("s", "s::scale")], "missing_key"),
    # the values
    "NaN scale": (INT8, _set("w::scale", 2, float("nan")), "encoding"),
    "negative scale": (INT4, _set("w::scale", 0, -1.0), "encoding"),
    "scale that decodes to inf": (INT8, _set("b::scale", 0, 3e38), "encoding"),
    "int8 code -128": (INT8, _set("w", 5, -128), "encoding"),
    "int4 nibble 0": (INT4, _set("w", 5, 0x70), "encoding"),
    "int4 padding nibble": (INT4, _set("b", 3, 0x98), "encoding"),
    "top-k position out of range": (TOPK, _set("w::idx", -1, 1320), "encoding"),
    "duplicate top-k positions": (TOPK, lambda t, md: t["w::idx"].__setitem__(3, t["w::idx"][2]), "encoding"),
    "top-k counts not summing to k": (TOPK, _set("w::count", 0, 5), "encoding"),
    "negative top-k count": (TOPK, _set("b::count", 0, -1), "encoding"),
    "NaN in a cast": (EncodingSpec("bfloat16"), _set("w", 0, float("nan")), "non_finite"),
    # the chunked top-k: its header, then its parts, then its values
    "ctopk chunk not a power of two": (CTOPK, _header(encoding_chunk="100"), "encoding"),
    "ctopk chunk of 5000 digits": (CTOPK, _header(encoding_chunk="9" * 5000), "encoding"),
    "ctopk without chunk_k": (CTOPK, _header(encoding_chunk_k=None), "encoding"),
    "ctopk chunk_k above the chunk": (CTOPK, _header(encoding_chunk_k="65"), "encoding"),
    "ctopk chunk_k 0": (CTOPK, _header(encoding_chunk_k="0"), "encoding"),
    "ctopk values fp4": (CTOPK, _header(encoding_topk_values="fp4"), "encoding"),
    "ctopk claiming more kept values": (CTOPK, _header(encoding_chunk_k="4"), "encoding"),
    "ctopk offsets one byte short": (CTOPK, _replace("w::idx", lambda i: i[:-1]), "encoding"),
    "ctopk offsets of another dtype": (CTOPK, _replace("w::idx", lambda i: i.to(torch.int16)), "encoding"),
    "ctopk one scale pair too few": (CTOPK, _replace("w::scale", lambda s: s[:-1]), "encoding"),
    "ctopk with a paged count": (CTOPK, _replace("w::count", torch.zeros(1, dtype=torch.int32)), "encoding"),
    "ctopk NaN scale": (CTOPK, _set("w::scale", 3, float("nan")), "encoding"),
    "ctopk negative step": (CTOPK, _set("w::scale", 1, -1.0), "encoding"),
    "ctopk levels that decode to inf": (CTOPK, lambda t, md: t["b::scale"].fill_(3e38), "encoding"),
    "ctopk offsets not increasing": (CTOPK, _ctopk_offsets("w::idx", lambda o: o.flip(0)), "encoding"),
    "ctopk duplicate offsets": (CTOPK, _ctopk_offsets("w::idx", lambda o: o.index_fill_(0, torch.tensor([1]), int(o[0]))),
                                "encoding"),
    "ctopk offset beyond the last chunk": (CTOPK, _ctopk_offsets("w::idx", lambda o: o.index_fill_(0, torch.tensor(
        [o.numel() - 1]), 63)), "encoding"),
    "ctopk non-zero padding bits": (CTOPK, lambda t, md: t["b::idx"].__setitem__(-1, int(t["b::idx"][-1]) | 0x80),
                                    "encoding"),
    # decoded values within the format but far beyond an honest delta: the norm bounds, as for plain ones
    "valid codes, absurd scale": (INT8, _set("w::scale", 0, 1e10), "norm_global"),
    "decoded norm overflows": (INT8, lambda t, md: t["w::scale"].fill_(2e36), "norm"),
}


def test_every_malformed_encoding_is_a_rejection_with_its_reason(tmp_path):
    hub = FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache")
    m = MasterOuterLoop(hub, S0, node_state_dir=tmp_path / "m", outer_lr=1.0, outer_momentum=0.0, lease_ttl=30.0,
                        poll_interval=0.02)
    assert m.sync_once()
    put = lambda path, data: (hub.root / path).parent.mkdir(parents=True, exist_ok=True) or (hub.root / path).write_bytes(data)  # noqa: E731
    for i, (case, (spec, mutate, reason)) in enumerate(MALFORMED.items()):
        put(f"nodes/x{i}/delta_0.safetensors", encoded_bytes(tmp_path, f"x{i}", spec, mutate))
        put(f"nodes/good/delta_{i}.safetensors", encoded_bytes(tmp_path, "good", INT4, step=i))
        assert m.sync_once() is True, case  # the round goes on: the honest delta is applied
        assert m.last_metrics["applied"] == [f"good/{i}"], case
        assert m.last_metrics["rejected_by_reason"] == {reason: 1}, case
    assert m.sync_once() is False and m.last_metrics["rejected"] == 0  # never read twice


def test_a_huge_declared_part_is_refused_unread(tmp_path):
    """A 1 GiB int8 part (sparse on disk) under an int8 header: refused for its size, or, with the
    size limit lifted, for its layout, from the header alone: the reader's memory does not grow."""
    path = tmp_path / "nodes" / "x" / "delta_0.safetensors"
    path.parent.mkdir(parents=True)
    md = {"format": "diloco-delta/1", "node_id": "x", "local_step": "0", "base_outer_step": "0",
          "encoding": "int8", "encoding_block_size": "128"}
    header = {"__metadata__": md,
              "b": {"dtype": "I8", "shape": [3], "data_offsets": [0, 3]},
              "b::scale": {"dtype": "F32", "shape": [1], "data_offsets": [3, 7]},
              "w": {"dtype": "I8", "shape": [1 << 30], "data_offsets": [7, 7 + (1 << 30)]},
              "w::scale": {"dtype": "F32", "shape": [1], "data_offsets": [7 + (1 << 30), 11 + (1 << 30)]}}
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + 11 + (1 << 30))
    code = f"""
import resource, sys, torch
sys.path.insert(0, {str(ROOT)!r})
from diloco_lightning.wire.delta import read_delta, DeltaFileError
ref = {{"w": torch.zeros(4, 3), "b": torch.zeros(3)}}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = []
for kw in (dict(reference=ref), dict(reference=ref, max_file_bytes=1 << 31)):
    try:
        read_delta({str(path)!r}, **kw)
    except DeltaFileError as e:
        out.append((e.reason, str(e)[-80:]))
print(out)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    got = eval(lines[0])  # noqa: S307 - our own subprocess's repr of a list of tuples
    assert [r for r, _ in got] == ["size", "encoding"]
    assert "part 'q' is torch.int8 [1073741824], expected torch.int8 [12]" in got[1][1]
    assert int(lines[1]) < 50_000  # kB: well under 50 MB for a 1 GiB file


def test_signature_covers_encoded_bytes_and_encoding_header(tmp_path):
    key = RunKey("run-key")
    hub = FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache")
    m = MasterOuterLoop(hub, S0, node_state_dir=tmp_path / "m", outer_lr=1.0, outer_momentum=0.0, lease_ttl=30.0,
                        poll_interval=0.02, signing_key=key)
    assert m.sync_once()
    spec = EncodingSpec("topk", topk=0.05)

    def put(node: str, data: bytes) -> None:
        (hub.root / "nodes" / node).mkdir(parents=True, exist_ok=True)
        (hub.root / "nodes" / node / "delta_0.safetensors").write_bytes(data)

    good = encoded_bytes(tmp_path, "good", spec, key=key)
    tampered = bytearray(encoded_bytes(tmp_path, "scale", spec, key=key))
    n = int.from_bytes(tampered[:8], "little")
    start = json.loads(tampered[8 : 8 + n])["w::scale"]["data_offsets"][0]
    tampered[8 + n + start] ^= 0x01  # one bit of w's first scale, in the data area
    put("scale", bytes(tampered))
    put("param", _edit_header(encoded_bytes(tmp_path, "param", spec, key=key)))
    put("unsigned", encoded_bytes(tmp_path, "unsigned", spec))
    put("good", good)
    assert m.sync_once() is True
    assert m.last_metrics["applied"] == ["good/0"]
    assert m.last_metrics["rejected_by_reason"] == {"signature": 3}


def _edit_header(data: bytes) -> bytes:
    """The same file with ``encoding_topk`` 0.05 -> 0.0500001 in its header: the same layout (every k
    is the same), the same tensors, the signature of the original header."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["__metadata__"]["encoding_topk"] = "0.0500001"
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + n :]


# ============================================================================ 4. the residual in the worker


def total_sent(hub: FileHub, ref: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in ref.items()}
    for r in sorted(hub.list_deltas()):
        d = read_delta(hub.root / r.path, reference=ref)
        for k, t in decode_delta(d.by_key()).items():
            out[k] += t.double()
    return out


def synced(params):
    return {k: v.detach().clone() for k, v in params.items() if v.is_floating_point()}


def _phase(params, i):
    g = torch.Generator().manual_seed(100 + i)
    with torch.no_grad():
        for k in ("layer.weight", "layer.bias", "norm.running_mean"):
            params[k].add_(torch.randn(params[k].shape, generator=g) * 0.05)


def _assert_nothing_lost(hub, v0, params, w):
    """Everything sent plus the residual still owed is the whole pseudo-gradient (to FP32 rounding)."""
    sent = total_sent(hub, v0)
    owed = w._uploader.feedback.residual or {}
    for k in v0:
        truth = (v0[k] - params[k].detach()).double()
        torch.testing.assert_close(sent[k] + (owed[k].double() if k in owed else 0), truth, rtol=0, atol=2e-6)


@pytest.mark.parametrize("spec", ["int4", "topk"])
def test_failed_and_doubtful_uploads_lose_nothing(tmp_path, spec):
    hub = FlakyHub(tmp_path / "hub")
    params = make_params()
    Publisher(hub, tmp_path / "pub").publish(snapshot(params))
    v0 = synced(params)
    w = DiLoCoWorker(hub, "w0", params, delta_dtype=spec, topk=0.3, **FAST)
    w.start()
    _phase(params, 0)
    w.boundary()
    w._uploader.wait_idle(5)
    hub.down = True  # failed, the hub says it is not there: merged into the next delta
    _phase(params, 1)
    w.boundary()
    w._uploader.wait_idle(5)
    hub.list_down = True  # failed and the hub cannot say: a doubt
    _phase(params, 2)
    w.boundary()
    w._uploader.wait_idle(5)
    hub.down = hub.list_down = False
    for i in (3, 4):
        _phase(params, i)
        w.boundary()
        assert w.flush()
    assert w.totals["upload_failures_total"] == 2
    assert w._uploader.feedback.residual is not None  # lossy: something is owed
    _assert_nothing_lost(hub, v0, params, w)
    w.close()


def test_an_upload_that_landed_after_all_keeps_its_residual(tmp_path):
    hub = LandsThenFails(tmp_path / "hub")
    params = make_params()
    Publisher(hub, tmp_path / "pub").publish(snapshot(params))
    v0 = synced(params)
    w = DiLoCoWorker(hub, "w0", params, delta_dtype="topk", topk=0.3, **FAST)
    w.start()
    _phase(params, 0)
    w.boundary()
    w._uploader.wait_idle(5)
    assert w._uploader.feedback.residual is None  # the doubt holds it for now
    hub.list_down = False
    _phase(params, 1)
    w.boundary()
    assert w.flush()
    assert len(hub.list_deltas()) == 2
    _assert_nothing_lost(hub, v0, params, w)
    w.close()


def _resume_run(tmp_path: Path, name: str, crash: bool, spec: str = "int4") -> tuple[bytes, dict]:
    """Three boundaries; with ``crash``, a checkpoint after the second, a new worker from it for the third."""
    hub = FileHub(tmp_path / name / "hub")
    params = make_params()
    Publisher(hub, tmp_path / name / "pub").publish(snapshot(params))
    w = DiLoCoWorker(hub, "w0", params, delta_dtype=spec, topk=0.3, **FAST)
    w.start()
    for i in range(2):
        _phase(params, i)
        w.boundary()
        assert w.flush()
    if crash:
        ckpt = tmp_path / name / "ckpt.pt"
        torch.save({"worker": w.state_dict(), "anchor": w.anchor_state(), "params": snapshot(params)}, ckpt)
        w.close()
        state = torch.load(ckpt, weights_only=True)
        assert state["anchor"]["residual"] is not None  # the residual is in the checkpoint
        params = state["params"]
        w = DiLoCoWorker(hub, "w0", params, delta_dtype=spec, topk=0.3, **FAST)
        w.load_state_dict(state["worker"])
        w.load_anchor_state(state["anchor"])
    _phase(params, 2)
    w.boundary()
    assert w.flush()
    owed = {k: v.clone() for k, v in (w._uploader.feedback.residual or {}).items()}
    w.close()
    last = max(hub.list_deltas())
    data = (hub.root / last.path).read_bytes()
    n = int.from_bytes(data[:8], "little")
    return data[8 + n :], owed


@pytest.mark.parametrize("spec", ["int4", "topk"])
def test_residual_survives_a_checkpoint_and_resume_exactly(tmp_path, spec):
    straight, owed_straight = _resume_run(tmp_path, "straight", crash=False, spec=spec)
    resumed, owed_resumed = _resume_run(tmp_path, "resumed", crash=True, spec=spec)
    assert resumed == straight  # the third delta's bytes: the same codes, scales and positions
    assert owed_resumed.keys() == owed_straight.keys()
    for k in owed_straight:
        assert torch.equal(bits(owed_resumed[k]), bits(owed_straight[k]))


def test_a_residual_already_sent_before_a_crash_is_not_sent_twice(tmp_path):
    """Checkpoint after boundary 1; the worker sends boundary 2 (with the residual) and dies; resumed
    from the checkpoint it replays boundary 2 (not sent again) and starts boundary 3 from zero."""
    hub = FileHub(tmp_path / "hub")
    params = make_params()
    Publisher(hub, tmp_path / "pub").publish(snapshot(params))
    w = DiLoCoWorker(hub, "w0", params, delta_dtype="int4", **FAST)
    w.start()
    _phase(params, 0)
    w.boundary()
    assert w.flush()
    state = {"worker": w.state_dict(), "anchor": w.anchor_state(), "params": snapshot(params)}
    state["anchor"]["residual"] = {k: v.clone() for k, v in state["anchor"]["residual"].items()}
    _phase(params, 1)
    w.boundary()
    assert w.flush()
    w.close()
    params = state["params"]
    w = DiLoCoWorker(hub, "w0", params, delta_dtype="int4", **FAST)
    w.load_state_dict(state["worker"])
    w.load_anchor_state(state["anchor"])
    w.start()
    assert w._feedback.residual is None  # it went out with delta_2
    w.close()


def test_a_checkpoint_residual_that_does_not_fit_is_an_error(tmp_path):
    from diloco_lightning.worker import WorkerError

    hub = FileHub(tmp_path / "hub")
    params = make_params()
    Publisher(hub, tmp_path / "pub").publish(snapshot(params))
    with DiLoCoWorker(hub, "w0", params, delta_dtype="int8", **FAST) as w:
        _phase(params, 0)
        w.boundary()
        assert w.flush()
        state = w.anchor_state()
    state["residual"] = {**state["residual"], "layer.bias": torch.zeros(4)}
    w2 = DiLoCoWorker(hub, "w0", make_params(), delta_dtype="int8", **FAST)
    with pytest.raises(WorkerError, match="residual does not fit.*layer.bias"):
        w2.load_anchor_state(state)


# ============================================================================ 5. mixed runs


MIXED = {"w0": dict(delta_dtype="float32"), "w1": dict(delta_dtype="bfloat16"), "w2": dict(delta_dtype="int8"),
         "w3": dict(delta_dtype="int4", error_feedback=False), "w4": dict(delta_dtype="topk", topk=0.2, topk_values="int4")}


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 33, generator=g), "b": torch.randn(7, generator=g), "s": torch.tensor(0.5),
            "c": torch.randn(3, 2, dtype=torch.complex64, generator=g), "steps": torch.tensor(3)}


def _reference_decode(path: Path, ref: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A delta's values decoded by the NumPy reference (plain files: the stored values, widened)."""
    d = read_delta(path, reference=ref)
    out = {}
    for k, t in ref.items():
        if not t.is_floating_point() and not t.is_complex():
            continue
        if d.encoded is None:
            v = d.tensors[k]
            out[k] = (torch.view_as_real(v) if v.is_complex() else v.float()).numpy().astype(np.float64).reshape(-1)
        else:
            e = d.encoded[k]
            n = t.numel() * (2 if t.is_complex() else 1)
            parts = {p: x.numpy() for p, x in e.parts.items()}
            out[k] = ref_decode(parts, e.spec, n).astype(np.float64)
    return out


@pytest.mark.parametrize("aggregation", ["round", "arrival"])
def test_a_mixed_run_applies_the_decoded_mean(tmp_path, aggregation):
    hub = FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache")
    s0 = _model()
    m = MasterOuterLoop(hub, s0, node_state_dir=tmp_path / "m", outer_optimizer="nesterov", outer_lr=1.0,
                        outer_momentum=0.0, lease_ttl=30.0, poll_interval=0.02, aggregation=aggregation,
                        min_deltas=len(MIXED), norm_ratio=None)
    assert m.sync_once()
    workers = {}
    for i, (node, kw) in enumerate(MIXED.items()):
        params = {k: v.clone() for k, v in s0.items()}
        workers[node] = (DiLoCoWorker(hub, node, params, **kw, **FAST), params)
        workers[node][0].start()
        g = torch.Generator().manual_seed(10 + i)
        with torch.no_grad():
            for k in ("w", "b", "s", "c"):
                params[k].add_(torch.randn(params[k].shape, dtype=params[k].dtype, generator=g) * 0.01)
        workers[node][0].boundary()
        assert workers[node][0].flush()
    refs = sorted(hub.list_deltas())
    sizes = {r.node_id: r.size for r in refs}
    assert sizes["w2"] < 0.45 * sizes["w0"] and sizes["w3"] < 0.3 * sizes["w0"]  # small model: headers weigh
    decoded = [_reference_decode(hub.root / r.path, s0) for r in refs]
    while m.sync_once():
        pass
    metrics = m.last_metrics
    assert metrics["rejected"] == 0
    assert m.run.outer_step == (1 if aggregation == "round" else len(MIXED))
    for k in ("w", "b", "s", "c"):
        total = sum(d[k] for d in decoded)
        step = total / len(decoded) if aggregation == "round" else total  # arrival: one outer step per delta
        v0 = s0[k]
        want = (torch.view_as_real(v0) if v0.is_complex() else v0).numpy().astype(np.float64).reshape(-1) - step
        got = m.run.state[k]
        got = (torch.view_as_real(got) if got.is_complex() else got).numpy().reshape(-1)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)  # FP32 rounding of |x| ~ 3, a few steps
    for w, _ in workers.values():
        w.close()


# ============================================================================ 6. train.py end to end


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_train_int4_end_to_end(tmp_path):
    """``python train.py recipe=tiny diloco.delta_dtype=int4``: the run trains, every delta is
    accepted, and each file on the hub is ~8x smaller than the FP32 delta of the same model."""
    import os

    env = dict(os.environ)
    env["DILOCO_CACHE_DIR"] = str(tmp_path / "cache")
    env["DILOCO_CACHE"] = str(tmp_path / "hubcache")
    cmd = [sys.executable, str(ROOT / "train.py"), "recipe=tiny", "diloco.delta_dtype=int4", "trainer.max_steps=16",
           "run_id=int4", f"run_root={tmp_path / 'runs'}", "data.max_bytes=1000000", "data.seq_len=64",
           "data.vocab_size=1024", "trainer.log_every_n_steps=4"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "runs" / "int4" / "results.json").read_text())
    assert r["outer_steps"] == 2 and r["deltas_accepted"] == 4 and r["deltas_rejected"] == 0
    curve = r["train_curve"]
    assert curve[0][1] > curve[-1][1] and math.isfinite(r["eval_loss"]) and r["eval_loss"] < r["chance_loss"]
    ckpt = torch.load(tmp_path / "runs" / "int4" / "nodes" / "w0" / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=True)
    anchor = next(v for k, v in ckpt.items() if k.startswith("diloco"))
    params = sum(t.numel() for t in anchor["anchor"].values())
    assert anchor["residual"] is not None and set(anchor["residual"]) == set(anchor["anchor"])
    fp32_bytes = 4 * params  # the FP32 file's data alone: its header only adds to the ratio below
    per_delta = r["bytes_sent"] / sum(s["deltas_sent"] for s in r["workers_summary"])
    assert per_delta < 0.14 * fp32_bytes, (per_delta, fp32_bytes)


# ============================================================================ 7. the device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU/CUDA bit equality of each codec "
                                                           "is also in tests/test_encoding.py)")
@pytest.mark.parametrize("spec", LOSSY, ids=spec_id)
def test_cuda_tensors_send_the_same_bits_as_cpu_ones(spec):
    rounds = real_deltas()
    cpu, gpu = ErrorFeedback(spec), ErrorFeedback(spec)
    for delta in rounds:
        a = cpu.encode({k: v.clone() for k, v in delta.items()}, in_place=True)
        b = gpu.encode({k: v.cuda() for k, v in delta.items()}, in_place=True)
        for k in delta:
            assert all(t.device.type == "cuda" for t in b[k].parts.values())
            for part, t in a[k].parts.items():
                assert torch.equal(bits(b[k].parts[part]), bits(t)), (k, part)
            assert torch.equal(bits(gpu.residual[k]), bits(cpu.residual[k]))
    from diloco_lightning.encoding import decode_add_

    key = next(iter(rounds[0]))  # the master's sum on either device: the same bits
    sums = [torch.zeros(rounds[0][key].shape, device=dev) for dev in ("cpu", "cuda")]
    for s in sums:
        decode_add_(s, a[key], 0.3)
    assert torch.equal(bits(sums[0]), bits(sums[1]))
