"""The file formats: delta files (write, validate, sign), state files, the manifest and the lease.

Every rejection is exercised with a real malformed file on disk, and checks the
exception class, its stable ``reason`` code and that the message names the file.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import diloco_lightning.wire.delta.write as delta_write  # where write_delta calls save_file
from diloco_lightning.wire.delta import (
    FORMAT,
    DeltaFileError,
    DtypeError,
    ExtraKeyError,
    FingerprintMismatchError,
    FormatError,
    HeaderError,
    MissingKeyError,
    NodeIdError,
    NonFiniteError,
    PathMismatchError,
    ShapeMismatchError,
    SignatureError,
    UnreadableDeltaError,
    model_fingerprint,
    read_delta,
    read_delta_header,
    synced_keys,
    write_delta,
)
from diloco_lightning.wire.manifest import GlobalVersion, Lease, Manifest, ManifestError
from diloco_lightning.wire.names import (
    InvalidNameError,
    delta_path,
    global_weights_path,
    parse_delta_path,
    validate_global_data_path,
    validate_hub_path,
    validate_node_id,
)
from diloco_lightning.wire.signing import ENV_KEY, ENV_KEY_FILE, RunKey, load_run_key
from diloco_lightning.wire.statefile import (
    StateFileError,
    load_state_file,
    load_weights_file,
    pack_state_dict,
    save_state_file,
    save_weights_file,
    unpack_state_dict,
)

SHA_A = "a" * 64
SHA_B = "b" * 64


# ----------------------------------------------------------------------------- helpers


def _global_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "layer.weight": torch.randn(4, 3, generator=g),
        "layer.bias": torch.randn(3, generator=g),
        "scale": torch.tensor(1.5),
        "rot": torch.randn(2, dtype=torch.complex64, generator=g),
        "num_batches": torch.tensor(7),  # integer buffer: never in deltas
    }


def _delta_tensors(state: dict[str, torch.Tensor], dtype=torch.float32) -> dict[str, torch.Tensor]:
    out = {}
    for k in synced_keys(state):
        t = state[k]
        out[k] = (t * 0.01) if t.is_complex() else (t * 0.01).to(dtype)
    return out


def _node_file(tmp_path, node="w0", step=3):
    p = tmp_path / "nodes" / node / f"delta_{step}.safetensors"
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def _write_valid(path, state=None, **kw):
    state = state if state is not None else _global_state()
    ident = parse_delta_path("/".join(path.parts[-3:]))
    kw.setdefault("node_id", ident.node_id if ident else "w0")
    kw.setdefault("local_step", ident.local_step if ident else 3)
    kw.setdefault("base_outer_step", 2)
    write_delta(path, _delta_tensors(state), **kw)
    return path


def _raw(path, tensors, metadata):
    """A file written with safetensors directly, bypassing write_delta's checks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def _md(node="w0", step=3, **over):
    md = {"format": FORMAT, "node_id": node, "local_step": str(step), "base_outer_step": "2"}
    md.update(over)
    return {k: v for k, v in md.items() if v is not None}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _expect(exc_cls, reason, path, fn, *args, **kw):
    with pytest.raises(exc_cls) as ei:
        fn(*args, **kw)
    e = ei.value
    assert isinstance(e, DeltaFileError)
    assert e.reason == reason, (e.reason, str(e))
    assert e.path == str(path)
    assert str(path) in str(e)
    assert reason in str(e)
    return e


def _data_offset(path) -> int:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return 8 + n


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_bit_exact(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(5, 7, generator=g)
    base[0, :4] = torch.tensor([-0.0, 0.0, 1e-40, -3.0e-39])  # signed zero and subnormals
    tensors = {
        "w": base.to(dtype),
        "scalar": torch.tensor(-0.0, dtype=dtype),  # 0-d
        "empty": torch.zeros(0, 3, dtype=dtype),
        "c": torch.randn(3, 2, dtype=torch.complex64, generator=g),
        "c0": torch.tensor(1 - 2j, dtype=torch.complex64),
        "strided": torch.randn(6, 4, generator=g).to(dtype).t(),  # non-contiguous view
    }
    path = _node_file(tmp_path, "node-1", 12)
    size = write_delta(
        path, tensors, node_id="node-1", local_step=12, base_outer_step=9, num_tokens=4096,
        model_fingerprint=SHA_A, extra_metadata={"note": "hello"},
    )
    assert size == path.stat().st_size
    d = read_delta(path)
    assert (d.node_id, d.local_step, d.base_outer_step) == ("node-1", 12, 9)
    assert d.header.num_tokens == 4096 and d.header.model_fingerprint == SHA_A
    assert d.header.extra == {"note": "hello"} and d.header.signature is None
    assert sorted(d.tensors) == sorted(tensors)
    for k, t in tensors.items():
        got = d.tensors[k]
        assert got.dtype == t.dtype and got.shape == t.shape, k
        assert _bytes(got) == _bytes(t), k
    assert d.tensors["scalar"].dim() == 0 and math.copysign(1.0, float(d.tensors["scalar"])) == -1.0
    assert d.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    # the header alone
    h = read_delta_header(path)
    assert h == d.header
    # cloned tensors outlive the file
    path.unlink()
    assert _bytes(d.tensors["w"]) == _bytes(tensors["w"])


def test_round_trip_against_reference_and_signed(tmp_path):
    state = _global_state()
    key = RunKey(b"k" * 32)
    path = _node_file(tmp_path)
    delta = _delta_tensors(state, torch.bfloat16)
    write_delta(path, delta, node_id="w0", local_step=3, base_outer_step=2,
                model_fingerprint=model_fingerprint(state), signing_key=key)
    d = read_delta(path, reference=state, hub_path="nodes/w0/delta_3.safetensors",
                   expected_fingerprint=model_fingerprint(state), signing_key=key)
    assert sorted(d.tensors) == synced_keys(state) and "num_batches" not in d.tensors
    assert all(_bytes(d.tensors[k]) == _bytes(delta[k]) for k in delta)
    assert d.header.signature is not None
    # clone=False: a reader that consumes at once gets the same values
    d2 = read_delta(path, reference=state, signing_key=key, clone=False)
    assert all(_bytes(d2.tensors[k]) == _bytes(delta[k]) for k in delta)


def test_write_refuses_bad_input_and_writes_nothing(tmp_path):
    path = tmp_path / "d.safetensors"
    ok = {"w": torch.zeros(2)}
    bad_calls = [
        (dict(tensors={"w": torch.zeros(2, dtype=torch.int64)}, node_id="a", local_step=1, base_outer_step=0), ValueError),
        (dict(tensors={"w": torch.zeros(2, dtype=torch.float64)}, node_id="a", local_step=1, base_outer_step=0), ValueError),
        (dict(tensors=ok, node_id="a/b", local_step=1, base_outer_step=0), InvalidNameError),
        (dict(tensors=ok, node_id=".a", local_step=1, base_outer_step=0), InvalidNameError),
        (dict(tensors=ok, node_id="a", local_step=-1, base_outer_step=0), InvalidNameError),
        (dict(tensors=ok, node_id="a", local_step=True, base_outer_step=0), InvalidNameError),
        (dict(tensors=ok, node_id="a", local_step=1, base_outer_step=-2), InvalidNameError),
        (dict(tensors=ok, node_id="a", local_step=1, base_outer_step=0, num_tokens=-5), InvalidNameError),
    ]
    for kw, exc in bad_calls:
        tensors = kw.pop("tensors")
        with pytest.raises(exc):
            write_delta(path, tensors, **kw)
    assert list(tmp_path.iterdir()) == []


def test_write_handles_shared_tensors(tmp_path):
    w = torch.randn(3, 3)
    path = tmp_path / "d.safetensors"
    write_delta(path, {"a": w, "b": w}, node_id="a", local_step=0, base_outer_step=0)
    d = read_delta(path)
    assert torch.equal(d.tensors["a"], w) and torch.equal(d.tensors["b"], w)


# ----------------------------------------------------------------------------- rejections


def test_reject_truncated(tmp_path):
    path = _write_valid(_node_file(tmp_path))
    data = path.read_bytes()
    for cut in (len(data) - 1, _data_offset(path) + 3, _data_offset(path), 20, 7, 0):
        path.write_bytes(data[:cut])
        _expect(UnreadableDeltaError, "unreadable", path, read_delta, path)
        _expect(UnreadableDeltaError, "unreadable", path, read_delta_header, path)


def test_reject_garbage_and_missing(tmp_path):
    path = _node_file(tmp_path)
    path.write_bytes(os.urandom(4096))
    _expect(UnreadableDeltaError, "unreadable", path, read_delta, path)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    _expect(UnreadableDeltaError, "unreadable", path, read_delta, path)
    path.unlink()
    _expect(UnreadableDeltaError, "unreadable", path, read_delta, path)
    _expect(UnreadableDeltaError, "unreadable", tmp_path, read_delta, tmp_path)  # a folder


def test_reject_wrong_format(tmp_path):
    path = _node_file(tmp_path)
    t = {"w": torch.zeros(2)}
    for md in (_md(format="diloco-delta/2"), _md(format=None), None, {"node_id": "w0"}):
        _raw(path, t, md)
        e = _expect(FormatError, "format", path, read_delta, path)
        assert "format" in e.detail
    # a global weights file is not a delta
    save_weights_file(path, {"w": torch.zeros(2)})
    _expect(FormatError, "format", path, read_delta, path)


@pytest.mark.parametrize(
    "md",
    [
        _md(base_outer_step=None),
        _md(local_step=None),
        _md(base_outer_step="-1"),
        _md(base_outer_step="1.0"),
        _md(base_outer_step="01"),
        _md(local_step="03"),
        _md(local_step="+3"),
        _md(num_tokens="many"),
        _md(model_fingerprint="abc"),
        _md(model_fingerprint="A" * 64),
    ],
)
def test_reject_bad_header(tmp_path, md):
    path = _raw(_node_file(tmp_path), {"w": torch.zeros(2)}, md)
    _expect(HeaderError, "header", path, read_delta, path)


@pytest.mark.parametrize("node", ["../x", "a/b", ".hidden", "", "x" * 65, "a b", "é", "a\n"])
def test_reject_bad_node_id_in_header(tmp_path, node):
    path = _raw(_node_file(tmp_path), {"w": torch.zeros(2)}, _md(node=node))
    e = _expect(NodeIdError, "node_id", path, read_delta, path)
    assert "node_id" in e.detail


def test_reject_header_path_mismatch(tmp_path):
    state = _global_state()
    path = _write_valid(_node_file(tmp_path, "w0", 3), state, node_id="w1")
    e = _expect(PathMismatchError, "path_mismatch", path, read_delta, path)
    assert "'w1'" in e.detail and "'w0'" in e.detail
    path = _write_valid(_node_file(tmp_path, "w0", 4), state, local_step=5)
    e = _expect(PathMismatchError, "path_mismatch", path, read_delta, path)
    assert "5" in e.detail and "4" in e.detail
    # a file downloaded elsewhere: the hub path given explicitly is what counts
    elsewhere = tmp_path / "cache.safetensors"
    _write_valid(elsewhere, state, node_id="w0", local_step=3)
    read_delta(elsewhere, hub_path="nodes/w0/delta_3.safetensors")
    _expect(PathMismatchError, "path_mismatch", elsewhere, read_delta, elsewhere, hub_path="nodes/w0/delta_4.safetensors")
    _expect(PathMismatchError, "path_mismatch", elsewhere, read_delta, elsewhere, hub_path="nodes/w9/delta_3.safetensors")
    _expect(PathMismatchError, "path_mismatch", elsewhere, read_delta, elsewhere, hub_path="global/x")


def test_reject_missing_and_extra_key(tmp_path):
    state = _global_state()
    delta = _delta_tensors(state)
    path = _node_file(tmp_path)
    _raw(path, {k: v for k, v in delta.items() if k != "layer.bias"}, _md())
    e = _expect(MissingKeyError, "missing_key", path, read_delta, path, reference=state)
    assert "layer.bias" in e.detail
    _raw(path, {**delta, "ghost": torch.zeros(1)}, _md())
    e = _expect(ExtraKeyError, "extra_key", path, read_delta, path, reference=state)
    assert "ghost" in e.detail
    # an integer buffer of the global state never travels in a delta
    _raw(path, {**delta, "num_batches": torch.tensor(7.0)}, _md())
    e = _expect(ExtraKeyError, "extra_key", path, read_delta, path, reference=state)
    assert "num_batches" in e.detail


def test_reject_wrong_shape(tmp_path):
    state = _global_state()
    path = _node_file(tmp_path)
    for bad in (torch.zeros(3, 4), torch.zeros(12), torch.zeros(4, 3, 1)):
        _raw(path, {**_delta_tensors(state), "layer.weight": bad}, _md())
        e = _expect(ShapeMismatchError, "shape", path, read_delta, path, reference=state)
        assert "layer.weight" in e.detail
    _raw(path, {**_delta_tensors(state), "scale": torch.zeros(1)}, _md())  # 0-d expected
    _expect(ShapeMismatchError, "shape", path, read_delta, path, reference=state)


@pytest.mark.parametrize(
    "key,bad",
    [
        ("layer.bias", torch.zeros(3, dtype=torch.int64)),
        ("layer.bias", torch.zeros(3, dtype=torch.int32)),
        ("layer.bias", torch.zeros(3, dtype=torch.uint8)),
        ("layer.bias", torch.zeros(3, dtype=torch.bool)),
        ("layer.bias", torch.zeros(3, dtype=torch.float64)),
        ("layer.bias", torch.zeros(3, dtype=torch.complex64)),  # complex for a real key
        ("rot", torch.zeros(2, dtype=torch.float32)),  # real for a complex key
    ],
)
def test_reject_dtype(tmp_path, key, bad):
    state = _global_state()
    path = _raw(_node_file(tmp_path), {**_delta_tensors(state), key: bad}, _md())
    e = _expect(DtypeError, "dtype", path, read_delta, path, reference=state)
    assert key in e.detail and str(bad.dtype).removeprefix("torch.") in e.detail
    if bad.dtype in (torch.int64, torch.float64):  # never a valid delta dtype, reference or not
        _expect(DtypeError, "dtype", path, read_delta, path)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.complex64])
def test_reject_non_finite(tmp_path, value, dtype):
    t = torch.zeros(4, 3, dtype=dtype)
    t[2, 1] = value
    path = _raw(_node_file(tmp_path), {"w": t}, _md())
    e = _expect(NonFiniteError, "non_finite", path, read_delta, path)
    assert "'w'" in e.detail
    assert read_delta(path, check_finite=False).tensors["w"].shape == (4, 3)


def test_reject_fingerprint_mismatch(tmp_path):
    state = _global_state()
    fp = model_fingerprint(state)
    path = _write_valid(_node_file(tmp_path), state, model_fingerprint=SHA_B)
    _expect(FingerprintMismatchError, "fingerprint", path, read_delta, path, reference=state, expected_fingerprint=fp)
    # no fingerprint in the header: optional for the worker, accepted
    path2 = _write_valid(_node_file(tmp_path, "w0", 4), state)
    assert read_delta(path2, reference=state, expected_fingerprint=fp).header.model_fingerprint is None


def test_reject_unsigned_in_signed_run(tmp_path):
    state = _global_state()
    path = _write_valid(_node_file(tmp_path), state)
    e = _expect(SignatureError, "signature", path, read_delta, path, signing_key=RunKey("s"))
    assert "no signature" in e.detail
    # an unsigned run ignores signatures
    signed = _write_valid(_node_file(tmp_path, "w0", 4), state, signing_key=RunKey("s"))
    read_delta(signed, reference=state)


def test_reject_tampered_tensor_byte(tmp_path):
    state = _global_state()
    key = RunKey("run-secret")
    path = _write_valid(_node_file(tmp_path), state, signing_key=key)
    read_delta(path, reference=state, signing_key=key)
    data = bytearray(path.read_bytes())
    data[_data_offset(path)] ^= 0x01  # lowest mantissa bit of the first value: still finite
    path.write_bytes(bytes(data))
    d = read_delta(path, reference=state)  # structurally fine ...
    assert all(bool(torch.isfinite(t).all()) for t in d.tensors.values())
    e = _expect(SignatureError, "signature", path, read_delta, path, reference=state, signing_key=key)  # ... but altered
    assert "altered" in e.detail


def test_reject_tampered_header(tmp_path):
    state = _global_state()
    key = RunKey("run-secret")
    path = _write_valid(_node_file(tmp_path), state, signing_key=key, base_outer_step=2)
    data = path.read_bytes()
    assert data.count(b'"base_outer_step":"2"') == 1
    path.write_bytes(data.replace(b'"base_outer_step":"2"', b'"base_outer_step":"7"'))  # same length
    assert read_delta(path).base_outer_step == 7
    _expect(SignatureError, "signature", path, read_delta, path, signing_key=key)
    # an added header entry breaks it too
    tensors = read_delta(path).tensors
    md = dict(safe_open(str(path), framework="pt").metadata())
    md["base_outer_step"] = "2"
    read_delta(_raw(path, tensors, md), signing_key=key)
    _raw(path, tensors, {**md, "note": "x"})
    _expect(SignatureError, "signature", path, read_delta, path, signing_key=key)


def test_reject_wrong_key_and_malformed_signature(tmp_path):
    state = _global_state()
    path = _write_valid(_node_file(tmp_path), state, signing_key=RunKey("key-one"))
    _expect(SignatureError, "signature", path, read_delta, path, signing_key=RunKey("key-two"))
    tensors = read_delta(path).tensors
    for sig in ("", "zz", "é" * 64, "A" * 64):
        _raw(path, tensors, _md(signature=sig))
        _expect(SignatureError, "signature", path, read_delta, path, signing_key=RunKey("key-one"))


def test_signature_is_the_documented_hmac(tmp_path):
    """Recompute the HMAC from the signing module's documented message, independently."""
    key = b"\x00shared-run-key\xff"
    t = {"b": torch.tensor([1.0, -2.0], dtype=torch.bfloat16), "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
         "s": torch.tensor(0.5)}
    path = tmp_path / "nodes" / "n1" / "delta_5.safetensors"
    write_delta(path, t, node_id="n1", local_step=5, base_outer_step=4, num_tokens=10, signing_key=RunKey(key))
    md = dict(safe_open(str(path), framework="pt").metadata())
    sig = md.pop("signature")
    msg = b"diloco-sig/1\n" + json.dumps(md, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    msg += b"a\0float32\x002,3\0" + struct.pack("<6f", 0, 1, 2, 3, 4, 5)
    msg += b"b\0bfloat16\x002\0" + bytes([0x80, 0x3F, 0x00, 0xC0])  # 1.0, -2.0 in bfloat16, little-endian
    msg += b"s\0float32\0\0" + struct.pack("<f", 0.5)
    assert md == {"format": FORMAT, "node_id": "n1", "local_step": "5", "base_outer_step": "4", "num_tokens": "10"}
    assert sig == hmac.new(key, msg, hashlib.sha256).hexdigest()


# ----------------------------------------------------------------------------- fingerprint


def test_fingerprint_exact_value():
    state = {"b": torch.tensor(2.0), "a": torch.zeros(4, 3), "steps": torch.tensor(3), "mask": torch.ones(2, dtype=torch.bool)}
    assert model_fingerprint(state) == hashlib.sha256("a|4,3|float32\nb||float32".encode()).hexdigest()
    mixed = {
        "z.w": torch.zeros(2, 5, 1, dtype=torch.bfloat16),
        "m.c": torch.zeros(3, dtype=torch.complex64),
        "h": torch.zeros(1, dtype=torch.float16),
        "é": torch.zeros(2),
    }
    text = "h|1|float16\nm.c|3|complex64\nz.w|2,5,1|bfloat16\né|2|float32"
    assert model_fingerprint(mixed) == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert model_fingerprint(dict(reversed(list(mixed.items())))) == model_fingerprint(mixed)
    assert model_fingerprint({}) == hashlib.sha256(b"").hexdigest()


# ----------------------------------------------------------------------------- run key


def test_run_key_from_env_and_file(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_KEY, raising=False)
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    assert load_run_key() is None

    monkeypatch.setenv(ENV_KEY, "env-secret-123")
    k = load_run_key()
    assert k.key == b"env-secret-123"
    assert "env-secret-123" not in repr(k) and "env-secret-123" not in str(k) and "env-secret-123" not in f"{k}"
    assert "env-secret" not in repr([k, {"key": k}])

    key_file = tmp_path / "run.key"
    key_file.write_bytes(b"file-secret-456\n")
    monkeypatch.delenv(ENV_KEY)
    monkeypatch.setenv(ENV_KEY_FILE, str(key_file))
    k2 = load_run_key()
    assert k2.key == b"file-secret-456"  # one trailing newline dropped
    assert "file-secret" not in repr(k2)
    # explicit arguments win over the environment
    assert load_run_key("explicit").key == b"explicit"
    assert load_run_key(key_file=key_file).key == b"file-secret-456"
    assert load_run_key(k) is k
    # signatures do not depend on where the key came from
    t = {"w": torch.ones(2)}
    md = _md()
    assert k2.sign(md, t) == RunKey(b"file-secret-456").sign(md, t) != RunKey(b"other").sign(md, t)

    key_file.write_bytes(b"\n")
    with pytest.raises(ValueError, match="empty"):
        load_run_key()
    monkeypatch.setenv(ENV_KEY_FILE, str(tmp_path / "missing.key"))
    with pytest.raises(ValueError, match="missing.key"):
        load_run_key()
    with pytest.raises(ValueError):
        RunKey("")


# ----------------------------------------------------------------------------- atomic writes


def test_atomic_write_leaves_no_temp_files(tmp_path):
    path = _write_valid(_node_file(tmp_path))
    assert sorted(os.listdir(path.parent)) == [path.name]
    _write_valid(path)  # rewriting a local file (never done on the hub) is still atomic
    assert sorted(os.listdir(path.parent)) == [path.name]


def test_failed_write_keeps_old_file(tmp_path, monkeypatch):
    path = _write_valid(_node_file(tmp_path))
    before = path.read_bytes()

    def broken_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(delta_write, "save_file", broken_save)
    with pytest.raises(OSError, match="No space"):
        _write_valid(path, base_outer_step=5)
    assert path.read_bytes() == before
    assert sorted(os.listdir(path.parent)) == [path.name]
    assert read_delta(path).base_outer_step == 2


def test_rewrite_never_touches_an_open_file(tmp_path):
    """os.replace gives the new file a new inode: a reader holding the old one still sees it whole."""
    path = _write_valid(_node_file(tmp_path))
    before = path.read_bytes()
    with open(path, "rb") as held:
        ino = os.fstat(held.fileno()).st_ino
        _write_valid(path, base_outer_step=9)
        assert os.stat(path).st_ino != ino
        assert held.read() == before
    assert read_delta(path).base_outer_step == 9


# ----------------------------------------------------------------------------- state files


def _optimizer_like_state():
    g = torch.Generator().manual_seed(3)
    return {
        "state": {
            "layer.weight": {"m": torch.randn(4, 3, generator=g), "v": torch.rand(4, 3, generator=g), "step": torch.tensor(3.0)},
            "layer.bias": {"m": torch.randn(3, generator=g).bfloat16(), "v": torch.zeros(3), "step": torch.tensor(3.0)},
        },
        "t": 17,
        "lr": 0.7,
        "betas": (0.9, 0.999),
        "bounds": [float("inf"), float("-inf"), -0.0, 1e-300],
        "name": "cgad",
        "flags": {"nesterov": True, "amsgrad": False, "none": None},
        "history": [[1, 2], {"tau": 3, "buf": torch.arange(5)}],
        "empty": {},
        "looks_like_marker": {"__tensor__": "state/layer.weight/m"},
        "looks_like_float": {"__float__": "inf"},
        "unicode é": "ünïcödé",
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }


def _assert_same(a, b, where="root"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert _bytes(a) == _bytes(b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, list) and len(a) == len(b), where  # tuples read back as lists
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, float):
        assert isinstance(b, float) and (a == b or (math.isnan(a) and math.isnan(b))), where
        assert math.copysign(1, a) == math.copysign(1, b), where
    else:
        assert type(a) is type(b) and a == b, where


def test_state_file_round_trip(tmp_path):
    sd = _optimizer_like_state()
    sd["nan"] = float("nan")
    tensors, skeleton = pack_state_dict(sd)
    _assert_same(sd, unpack_state_dict(tensors, skeleton))
    path = tmp_path / "outer.safetensors"
    size = save_state_file(path, sd, metadata={"outer_step": 4})
    assert size == path.stat().st_size and os.listdir(tmp_path) == [path.name]
    back, md = load_state_file(path)
    _assert_same(sd, back)
    assert md == {"format": "diloco-state/1", "outer_step": "4"}
    path.unlink()  # tensors were cloned out of the file
    assert back["state"]["layer.weight"]["m"].sum().isfinite()


def test_state_file_refusals(tmp_path):
    with pytest.raises(TypeError, match="keys must be strings"):
        pack_state_dict({1: torch.zeros(1)})
    with pytest.raises(TypeError, match="object"):
        pack_state_dict({"x": object()})
    with pytest.raises(ValueError, match="same name"):
        pack_state_dict({"a/b": torch.zeros(1), "a": {"b": torch.zeros(1)}})
    path = tmp_path / "s.safetensors"
    save_weights_file(path, {"w": torch.zeros(2)})
    with pytest.raises(StateFileError, match="not a diloco-state/1") as ei:
        load_state_file(path)
    assert str(path) in str(ei.value)
    save_file({"w": torch.zeros(2)}, str(path), metadata={"format": "diloco-state/1", "state": '{"x":{"__tensor__":"nope"}}'})
    with pytest.raises(StateFileError, match="corrupt state skeleton"):
        load_state_file(path)
    save_file({"w": torch.zeros(2)}, str(path), metadata={"format": "diloco-state/1", "state": '{"x":{"__tensor__":[1]}}'})
    with pytest.raises(StateFileError, match="corrupt state skeleton"):
        load_state_file(path)
    save_file({"w": torch.zeros(2)}, str(path), metadata={"format": "diloco-state/1", "state": "{not json"})
    with pytest.raises(StateFileError, match="corrupt state skeleton"):
        load_state_file(path)
    path.write_bytes(b"garbage" * 10)
    with pytest.raises(StateFileError, match="unreadable"):
        load_state_file(path)
    with pytest.raises(StateFileError, match="unreadable"):
        load_weights_file(path)


def test_weights_file_round_trip_with_tied_weights(tmp_path):
    emb = torch.randn(6, 4)
    state = {"embed.weight": emb, "lm_head.weight": emb, "norm": torch.ones(4, dtype=torch.bfloat16),
             "steps": torch.tensor(3), "fused": torch.randn(8, 4)[2:6]}
    path = tmp_path / "w.safetensors"
    save_weights_file(path, state, metadata={"outer_step": 3})
    back, md = load_weights_file(path)
    assert md == {"outer_step": "3"}
    _assert_same(state, back)
    assert back["embed.weight"].data_ptr() != back["lm_head.weight"].data_ptr()


# ----------------------------------------------------------------------------- names


def test_names():
    for ok in ("a", "A-b_c.d", "0", "x" * 64, "a..b", "-"):
        assert validate_node_id(ok) == ok
    for bad in ("", ".a", "..", "a/b", "x" * 65, "a b", "é", "a\n", None, 3):
        with pytest.raises(InvalidNameError):
            validate_node_id(bad)
    assert delta_path("n", 0) == "nodes/n/delta_0.safetensors"
    assert parse_delta_path("nodes/n/delta_12.safetensors") == ("n", 12)
    for bad in ("nodes/n/delta_012.safetensors", "nodes/n/delta_-1.safetensors", "nodes/.n/delta_1.safetensors",
                "nodes/n/x/delta_1.safetensors", "/nodes/n/delta_1.safetensors", "nodes/n/delta_1.safetensors\n"):
        assert parse_delta_path(bad) is None, bad
    assert global_weights_path(12, "0123abcd") == "global/weights_000000012_0123abcd.safetensors"
    for bad in ("global/../x", "global/.lock", "global/sub/x", "/etc/passwd", "nodes/a/x", "global/", "x"):
        with pytest.raises(InvalidNameError):
            validate_hub_path(bad)
    for reserved in ("global/manifest.json", "global/lease.json"):
        assert validate_hub_path(reserved) == reserved
        with pytest.raises(InvalidNameError, match="reserved"):
            validate_global_data_path(reserved)


# ----------------------------------------------------------------------------- manifest and lease


def _manifest(**over) -> Manifest:
    kw = dict(
        outer_step=12,
        weights="global/weights_000000012_1a2b3c4d.safetensors",
        weights_sha256=SHA_A,
        model_fingerprint=SHA_B,
        ledger={"worker-0": 37, "worker-1": 0},
        outer_state="global/outer_state_000000012_1a2b3c4d.safetensors",
        outer_state_sha256="c" * 64,
        optimizer={"name": "cgad", "options": {"lr": 0.7, "betas": [0.9, 0.999]}},
        history=[GlobalVersion(11, "global/weights_000000011_ffff0000.safetensors", None),
                 GlobalVersion(10, "global/weights_000000010_eeee0000.safetensors",
                               "global/outer_state_000000010_eeee0000.safetensors", "d" * 64, "e" * 64)],
        master={"holder": "host:1:abc", "epoch": 3},
        published_at=1764430000.25,
    )
    kw.update(over)
    return Manifest(**kw)


def test_manifest_round_trip():
    m = _manifest()
    text = m.to_json()
    doc = json.loads(text)
    assert doc["format"] == "diloco-manifest/1" and doc["ledger"] == {"worker-0": 37, "worker-1": 0}
    back = Manifest.from_json(text)
    assert back == m
    assert Manifest.from_json(text.encode()) == m
    assert m.files() == [m.weights, m.outer_state, m.history[0].weights, m.history[1].weights, m.history[1].outer_state]
    assert back.history[1].weights_sha256 == "d" * 64 and back.history[0].weights_sha256 is None
    assert m.validate() is m
    minimal = Manifest(0, "global/w.safetensors", SHA_A, SHA_B)
    assert Manifest.from_json(minimal.to_json()) == minimal


def _doc(**over):
    doc = json.loads(_manifest().to_json())
    doc.update(over)
    return json.dumps(doc)


@pytest.mark.parametrize(
    "text,needle",
    [
        (_doc(weights="../x"), "../x"),
        (_doc(weights="nodes/a/delta_1.safetensors"), "nodes/a/delta_1"),
        (_doc(weights="/etc/passwd"), "/etc/passwd"),
        (_doc(weights="global/sub/x"), "global/sub/x"),
        (_doc(weights="global/../../etc/passwd"), "passwd"),
        (_doc(weights="global/manifest.json"), "reserved"),
        (_doc(outer_state="global/lease.json"), "reserved"),
        (_doc(outer_state="../../state"), "state"),
        (_doc(history=[{"outer_step": 1, "weights": "/etc/shadow"}]), "history[0]"),
        (_doc(history=[{"outer_step": 1, "weights": "global/w", "outer_state": "global/a/b"}]), "history[0]"),
        (_doc(history=["global/w"]), "history[0]"),
        (_doc(history=[{"outer_step": 1, "weights": "global/w", "weights_sha256": "xyz"}]), "history[0]"),
        (_doc(history=[{"outer_step": 1, "weights": "global/w", "outer_state_sha256": SHA_A}]), "history[0]"),
        (_doc(weights=None), "weights"),
        (_doc(ledger={"a/b": 1}), "a/b"),
        (_doc(ledger={"..": 1}), ".."),
        (_doc(ledger={".hidden": 1}), ".hidden"),
        (_doc(ledger={"x" * 65: 1}), "xxxx"),
        (_doc(ledger={"": 1}), "node_id"),
        (_doc(ledger={"a": -1}), "ledger"),
        (_doc(ledger={"a": "3"}), "ledger"),
        (_doc(ledger={"a": True}), "ledger"),
        (_doc(ledger=[["a", 1]]), "ledger"),
        (_doc(format="diloco-manifest/2"), "format"),
        (_doc(format=None), "format"),
        (_doc(outer_step=-1), "outer_step"),
        (_doc(outer_step=1.5), "outer_step"),
        (_doc(weights_sha256="xyz"), "weights_sha256"),
        (_doc(model_fingerprint="A" * 64), "model_fingerprint"),
        (_doc(outer_state=None), "outer_state_sha256"),
        (_doc(published_at="yesterday"), "published_at"),
        (_doc(optimizer=[1]), "optimizer"),
        ("[1, 2]", "format"),
        ("{not json", "JSON"),
        (b"\xff\xfe", "UTF-8"),  # the bounded reader (util/jsondoc.py) says what is wrong with the bytes
    ],
)
def test_manifest_rejections(text, needle):
    with pytest.raises(ManifestError) as ei:
        Manifest.from_json(text, source="hub/global/manifest.json")
    assert needle in str(ei.value)
    assert "hub/global/manifest.json" in str(ei.value)


def test_manifest_validate_refuses_bad_paths_built_in_code():
    for bad in (dict(weights="../x"), dict(outer_state="/etc/passwd"), dict(ledger={"a/b": 1}),
                dict(history=[GlobalVersion(1, "nodes/a/delta_1.safetensors")]), dict(published_at=float("nan"))):
        with pytest.raises(ManifestError):
            _manifest(**bad).validate()


def test_lease_round_trip_and_rejections():
    lease = Lease("host:12:abc", 4, 1764430100.5, 1764430000.0)
    assert Lease.from_json(lease.to_json()) == lease
    assert lease.expired(now=1764430100.5) and not lease.expired(now=1764430100.0)
    good = json.loads(lease.to_json())
    for bad in ({**good, "format": "x"}, {**good, "holder": ""}, {**good, "epoch": -1}, {**good, "expires_at": "soon"},
                {**good, "expires_at": True}, {k: v for k, v in good.items() if k != "expires_at"}):
        with pytest.raises(ManifestError):
            Lease.from_json(json.dumps(bad))
    with pytest.raises(ManifestError):
        Lease.from_json('{"expires_at": Infinity, "format": "diloco-lease/1", "holder": "h", "epoch": 1}')
