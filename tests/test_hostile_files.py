"""No file a hub writer can put there crashes, stalls or misleads a process, on every transport.

* a delta truncated by its writer while the master reads it (class 2: a memory map of a file
  another writer can change dies with SIGBUS);
* JSON documents of any size and depth (manifest, lease, claim, ``step_count.json``, a
  safetensors header): each parse failure is the documented rejection;
* claims: signed in a signed run; the master's bounds from its own configuration; absurd
  expiries; a vanished or overwritten claim is taken again;
* numbering: a worker takes no decision from a file it has not authenticated;
* numbers of any size, documents shaped to be slow to parse, documents over their size, any
  number of junk names: a rejection with a reason, in linear time and bounded memory; and no JSON
  of the package is parsed but by ``util/jsondoc.load_json`` or from the project's own local files.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from diloco_lightning.hub.local import FileHub
from diloco_lightning.master import MasterOuterLoop
from diloco_lightning.util.jsondoc import JSONDocumentError, load_json
from diloco_lightning.wire.claims import NodeClaim
from diloco_lightning.wire.delta import write_delta
from diloco_lightning.wire.names import MAX_STEP
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.worker import DiLoCoWorker
from diloco_lightning.worker.claim import ClaimKeeper, NodeIdTakenError

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


# ============================================================================ a truncated delta (SIGBUS)

_TRUNCATE = textwrap.dedent('''
    import os, sys, tempfile
    from pathlib import Path
    import torch
    import diloco_lightning.wire.delta.read as reader
    from diloco_lightning.hub.local import FileHub
    from diloco_lightning.master import MasterOuterLoop
    from diloco_lightning.wire.delta import write_delta

    root = Path(sys.argv[1])
    hub = FileHub(root / "hub")
    state = {"w": torch.zeros(1 << 18)}  # 1 MiB of FP32
    m = MasterOuterLoop(hub, state, node_state_dir=root / "m", outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0,
                        norm_global_ratio=None)
    assert m.sync_once()
    write_delta(root / "d.safetensors", {"w": torch.ones(1 << 18)}, node_id="evil", local_step=1, base_outer_step=0)
    hub.upload_delta(root / "d.safetensors", "evil", 1)
    target = root / "hub" / "nodes" / "evil" / "delta_1.safetensors"

    # the writer truncates its own delta at the worst moment for the reader: right after the master
    # mapped it (or, reading it into its own memory, right before the tensor bytes are read)
    def truncate():
        os.truncate(target, 100)

    real_map, real_read, real_span = reader.map_tensors, reader.read_tensor, reader.read_span
    def map_then_truncate(f, layout):
        out = real_map(f, layout)
        truncate()
        return out
    first = [True]
    def truncating(real):
        def read(f, info, *args, **kw):  # the reused read buffer's slot, the norm's hook (wire/arena.py), a lane's span
            if first[0]:
                first[0] = False
                truncate()
            return real(f, info, *args, **kw)
        return read
    reader.map_tensors, reader.read_tensor = map_then_truncate, truncating(real_read)
    reader.read_span = truncating(real_span)
    m.sync_once()
    print("survived", m.last_metrics["rejected_by_reason"], m.outer_step, flush=True)
''')


def test_a_delta_truncated_under_the_master_is_a_rejection_not_a_crash(tmp_path):
    """The folder hub reads deltas in place, so their writer can truncate one while the master reads it.
    Mapped, the master died of SIGBUS (4 of 4 tries with 64 MiB deltas); read into the master's own
    memory, the short read is the ``unreadable`` rejection and the master goes on."""
    r = subprocess.run([sys.executable, "-c", _TRUNCATE, str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, f"the master died ({r.returncode}): {r.stderr[-2000:]}"
    assert "survived {'unreadable': 1} 0" in r.stdout, r.stdout + r.stderr[-2000:]


# ============================================================================ JSON of any size and depth

#: 60 KB of nested brackets: what made every round raise RecursionError
NESTED = b"[" * 30_000 + b"]" * 30_000


def nested_object(key: str, size: int = 60_000) -> bytes:
    """About ``size`` bytes of ``{"key": {"key": ... 1}}``."""
    depth = size // (len(key) + 7)
    return (f'{{"{key}": ' * depth + "1" + "}" * depth).encode()


def small_master(hub, tmp: Path, name: str = "m", **kw) -> MasterOuterLoop:
    opts = dict(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0, lease_ttl=30.0, poll_interval=0.02, norm_global_ratio=None)
    opts.update(kw)
    return MasterOuterLoop(hub, {"w": torch.zeros(4)}, node_state_dir=tmp / name, **opts)


@pytest.mark.parametrize("doc", [NESTED, b"[1e999]", b'{"a": NaN}', b"\xff\xfe", b"{" * 100],
                         ids=["nested", "huge_float", "nan", "not_utf8", "unclosed"])
def test_load_json_refuses_what_json_loads_would_crash_on_or_accept(doc):
    with pytest.raises(JSONDocumentError):
        load_json(doc, max_bytes=1 << 20)
    with pytest.raises(JSONDocumentError, match="more than the 10"):
        load_json(b"[1, 2, 3, 4, 5]", max_bytes=10)
    assert load_json(b'{"s": "[[[[[[[[[[", "x": [[1]]}', max_bytes=100, max_depth=3) == {"s": "[" * 10, "x": [[1]]}


#: 1 MiB hostile documents, one of each shape a parse could be slow on
MIB_SHAPES = {
    "escaped_quotes": '"' + '\\"' * (1 << 19),  # an unterminated string of \": n**2/2 steps of the old depth scan
    "escaped_backslashes": '"' + "\\\\" * (1 << 19),
    "quotes": '"' * (1 << 20),
    "deep_nesting": "[" * (1 << 20),
    "deep_objects": '{"a":' * ((1 << 20) // 5),
    "long_string": '"' + "a" * (1 << 20),
    "long_number": "1" * (1 << 20),
    "brackets_in_strings": '["' + "[{" * (1 << 19),
}


@pytest.mark.parametrize("shape", sorted(MIB_SHAPES))
def test_a_hostile_document_is_refused_in_linear_time(shape):
    """24 KB of escaped quotes took the depth scan 5.7 s (every thread of the master stalled: the scan
    held the GIL); 1 MiB would have taken an hour. Each 1 MiB shape is refused in well under a second
    (the bound is 2 s for a loaded machine)."""
    doc = MIB_SHAPES[shape].encode()
    start = time.perf_counter()
    with pytest.raises(JSONDocumentError):
        load_json(doc, max_bytes=16 << 20)
    took = time.perf_counter() - start
    print(f"{shape}: {len(doc)} bytes refused in {took:.3f} s")
    assert took < 2.0


def test_a_nested_manifest_is_replaced_in_a_signed_run(transport, tmp_path):
    key = RunKey("the-run-key")
    m = small_master(transport.open("m"), tmp_path, signing_key=key)
    assert m.sync_once()
    transport.put("global/manifest.json", nested_object("format"))
    assert m.sync_once() is True  # replaced by its last authentic version, not a RecursionError
    man = m.hub.read_manifest()
    assert man.outer_step == 0 and man.verify(key)
    transport.put("global/manifest.json", NESTED)
    assert m.sync_once() is True and m.hub.read_manifest().verify(key)
    m.close()


def test_a_nested_lease_counts_as_expired(transport, tmp_path):
    key = RunKey("the-run-key")
    transport.put("global/lease.json", NESTED)
    m = small_master(transport.open("m"), tmp_path, signing_key=key)
    assert m.sync_once() and m.is_leader
    assert m.hub.read_lease().holder == m.holder and m.hub.read_lease().verify(key)
    m.close()


def _claim(node: str, holder: str, ttl: float = 60.0) -> NodeClaim:
    now = time.time()
    return NodeClaim(node, holder, 1, now, now, now + ttl, {})


def test_a_nested_claim_is_ignored_and_never_hides_the_others(transport, tmp_path, caplog):
    """One nested ``claim.json`` made ``list_claims`` raise on every transport: the master saw no live
    node (quorum 1) and the victim could not start. Now it is ignored with a reason, the other claims
    are read, and the victim takes its id back."""
    hub = transport.open("m")
    for node in ("a", "b"):
        hub.write_claim(node, _claim(node, f"elsewhere:1:{node}"), expected=None)
    transport.put("nodes/victim/claim.json", nested_object("info"))
    with caplog.at_level(logging.WARNING):
        claims = transport.open("reader").list_claims()
    assert sorted(claims) == ["a", "b"]
    assert any("victim" in r.getMessage() and "nested" in r.getMessage() for r in caplog.records)
    m = small_master(hub, tmp_path, min_deltas=1.0)
    assert m.sync_once()
    assert m.membership.live() == ["a", "b"]
    params = {"w": torch.nn.Parameter(torch.zeros(4))}
    w = DiLoCoWorker(transport.open("victim"), "victim", params, poll_interval=0.01, wait_timeout=20)
    w.start()  # claims its id over the unreadable file
    assert transport.open("reader2").read_claim("victim").holder == w.heartbeat.keeper.holder
    w.close()
    m.close()


def test_a_nested_step_count_is_refused_with_a_reason(transport, tmp_path):
    from diloco_lightning.master.compat import SpeedtronicAdoptionError

    transport.put("global/step_count.json", nested_object("outer_step"))
    m = small_master(transport.open("m"), tmp_path, compat="speedtronic")
    with pytest.raises(SpeedtronicAdoptionError, match="not a Speedtronic step_count.json.*nested"):
        m.sync_once()  # the serve loop reports this one line and tries again later
    m.close()


# ============================================================================ claims: signed, bounded, taken back

def _forged(node: str, *, renewed: float | None = None, expires: float | None = None, holder: str = "mallory:1:x"):
    now = time.time()
    renewed = now if renewed is None else renewed
    return NodeClaim(node, holder, 7, renewed, renewed, renewed + 86400 if expires is None else expires,
                     {"step_rate": 1.0})


def test_claims_are_signed_in_a_signed_run_and_forged_ones_are_no_claim(transport, tmp_path):
    """A signed run's worker signs its claim; the master's membership ignores a forged (unsigned) one,
    and a forged claim on a worker's id does not stop the worker from starting."""
    key = RunKey("the-run-key")
    m = small_master(transport.open("m"), tmp_path, signing_key=key, min_deltas=1.0)
    assert m.sync_once()
    transport.open("forger").write_claim("ghost", _forged("ghost"), expected=None)
    transport.open("forger2").write_claim("w0", _forged("w0"), expected=None)
    w = DiLoCoWorker(transport.open("w0"), "w0", {"w": torch.nn.Parameter(torch.zeros(4))}, signing_key=key,
                     poll_interval=0.01, wait_timeout=20)
    w.start()  # the forged claim on w0 is no claim: taken over
    claim = transport.open("reader").read_claim("w0")
    assert claim.holder == w.heartbeat.keeper.holder and claim.signature is not None and claim.verify(key)
    m.membership.refresh(force=True)
    assert m.membership.live() == ["w0"]  # the ghost is not a node of this run
    w.close()
    m.close()


def test_a_ghost_claim_holds_a_round_no_longer_than_the_masters_own_bound(tmp_path):
    """One forged claim with a ttl of a day used to hold every round for 86,400 s (max_wait=auto is
    capped by the live nodes' timeouts, which came from the claims): the bound is the master's own
    (its node_timeout, or the transport's claim ttl), whatever the claim says."""
    root = tmp_path / "hub"
    hub = FileHub(root)
    m = small_master(FileHub(root), tmp_path, min_deltas=1.0, max_wait="auto")
    assert m.sync_once()
    hub.write_claim("ghost", _forged("ghost"), expected=None)
    hub.write_claim("w0", NodeClaim("w0", "h:1:w0", 1, time.time(), time.time(), time.time() + 60, {}), expected=None)
    write_delta(tmp_path / "d.safetensors", {"w": torch.ones(4)}, node_id="w0", local_step=1, base_outer_step=0)
    hub.upload_delta(tmp_path / "d.safetensors", "w0", 1)
    m.membership.refresh(force=True)
    m.sync_once()
    got = m.last_metrics
    assert got["waiting"] and got["live_nodes"] == 2 and got["deadline"] == 60.0  # not 86400
    m2 = small_master(FileHub(root), tmp_path, name="m2", min_deltas=1.0, max_wait="auto", node_timeout=0.3, lease=False)
    m2.sync_once()
    time.sleep(0.35)
    assert m2.sync_once() and m2.last_metrics["applied"] == ["w0/1"]  # the deadline passed: applied below quorum
    m.close()
    m2.close()


@pytest.mark.parametrize("forged", ["expires_1e300", "renewed_in_the_future"])
def test_an_absurd_expiry_blocks_a_node_id_for_a_day_at_most(tmp_path, forged):
    hub = FileHub(tmp_path / "hub")
    now = time.time()
    claim = (_forged("w0", renewed=now - 86401, expires=1e300) if forged == "expires_1e300"
             else _forged("w0", renewed=now + 1e9, expires=1e300))
    hub.write_claim("w0", claim, expected=None)
    keeper = ClaimKeeper(hub, "w0", ttl=60)
    keeper.acquire()  # the id is not blocked
    assert hub.read_claim("w0").holder == keeper.holder
    keeper.release()
    hub.write_claim("w0", _forged("w0", expires=1e300), expected=None)  # a fresh heartbeat: live, for now
    with pytest.raises(NodeIdTakenError):
        ClaimKeeper(hub, "w0", ttl=60).acquire()


def test_a_worker_whose_claim_vanished_or_was_overwritten_claims_it_again(transport, tmp_path):
    """Any writer could stop a running worker by deleting or overwriting its claim (the heartbeat's
    compare-and-swap failed and the worker stopped at its next boundary). A claim that vanished, or a
    live one overwritten, is claimed again; only a takeover after this worker's own claim expired stops it."""
    m = small_master(transport.open("m"), tmp_path)
    assert m.sync_once()
    params = {"w": torch.nn.Parameter(torch.zeros(4))}
    w = DiLoCoWorker(transport.open("w0"), "w0", params, poll_interval=0.01, wait_timeout=20, claim_ttl=600)
    w.start()
    keeper = w.heartbeat.keeper
    reader = transport.open("reader")
    transport.delete("nodes/w0/claim.json")
    assert keeper.renew() and reader.read_claim("w0").holder == keeper.holder  # vanished: claimed again
    other = transport.open("other")
    other.write_claim("w0", _forged("w0"), expected=reader.read_claim("w0"))
    assert keeper.renew() and reader.read_claim("w0").holder == keeper.holder  # overwritten while live: taken back
    transport.put("nodes/w0/claim.json", b"not a claim")
    assert keeper.renew() and reader.read_claim("w0").holder == keeper.holder  # garbage: claimed again
    with torch.no_grad():
        params["w"].add_(1.0)
    w.boundary()  # still running
    assert w.flush()
    w.close()
    m.close()


# ============================================================================ numbering from authenticated files only


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_planted_files_never_push_a_workers_numbering(transport, tmp_path, signed, caplog):
    """Two 1-byte files, ``delta_<the victim's next step>`` and ``delta_999999999999999999``, made every
    later upload of the victim fail (it renumbered past the highest step listed, authentic or not, to
    10**18, which no delta may have: ~100 retries a second, each logged; 2 of 5 phases applied in a
    signed run). Now it steps past the file in the way only, and all 5 phases are applied."""
    key = RunKey("the-run-key") if signed else None
    m = small_master(transport.open("m"), tmp_path, signing_key=key, aggregation="arrival")
    assert m.sync_once()
    params = {"w": torch.nn.Parameter(torch.zeros(4))}
    w = DiLoCoWorker(transport.open("w0"), "w0", params, signing_key=key, poll_interval=0.01, wait_timeout=30)
    w.start()
    assert w.next_local_step == 1
    transport.put("nodes/w0/delta_1.safetensors", b"x")
    transport.put("nodes/w0/delta_999999999999999999.safetensors", b"x")
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            with torch.no_grad():
                params["w"].add_(1.0)
            w.boundary()
            assert w.flush(timeout=30)
    w.close()
    failures = [r for r in caplog.records if "upload failed" in r.getMessage()]
    assert len(failures) <= 2, [r.getMessage() for r in failures]
    for _ in range(20):
        m.sync_once(force=True)
    assert float(m.snapshot()[1]["w"][0]) == 5.0  # every phase applied once, each +1
    assert m.ledger["w0"] == 6  # delta_1 was in the way: the phases went out as delta_2 ... delta_6


# ============================================================================ the compat master trusts nothing it adopts


@pytest.fixture(params=["file", "hf", "s3"])
def compat_transport(request, tmp_path):
    """The transports a Speedtronic run lives on (its workers write to one repository or prefix)."""
    from conftest import _transport

    t = _transport(request, tmp_path, request.param)
    yield t
    t.up()


def _speedtronic_delta(tmp: Path, node: str, step: int, base: int, tensors: dict) -> bytes:
    p = tmp / f"st-{node}-{step}-{time.monotonic_ns()}.safetensors"
    save_file(tensors, str(p), metadata={"node_id": node, "local_step": str(step), "base_outer_step": str(base)})
    return p.read_bytes()


def _speedtronic_hub(t, tmp: Path, outer_step: int, state: dict) -> None:
    p = tmp / "latest.safetensors"
    save_file(state, str(p))
    t.put("global/latest.safetensors", p.read_bytes())
    t.put("global/step_count.json", json.dumps({"outer_step": outer_step, "model_file": "global/latest.safetensors",
                                                "updated_at": "2026-01-01T00:00:00"}).encode())


def test_compat_adoption_moves_a_ledger_only_on_valid_deltas(compat_transport, tmp_path):
    """One garbage file named as the victim's ``delta_10**17`` (a Speedtronic header made from an old
    version, but not a delta of this model) set the victim's ledger at adoption, and 0 of its 3 later
    deltas were applied. Only a valid delta moves a ledger, in adoption as in every round."""
    t = compat_transport
    state = {"w": torch.zeros(4)}
    _speedtronic_hub(t, tmp_path, 3, state)
    for step in (5, 6, 7):  # made from the adopted version 3: to apply
        t.put(f"nodes/victim/delta_{step}.safetensors", _speedtronic_delta(tmp_path, "victim", step, 3, {"w": -torch.ones(4)}))
    t.put("nodes/victim/delta_100000000000000000.safetensors",
          _speedtronic_delta(tmp_path, "victim", 10**17, 1, {"w": torch.zeros(9)}))  # the wrong shape
    m = small_master(t.open("m"), tmp_path, compat="speedtronic", aggregation="arrival")
    for _ in range(10):
        m.sync_once(force=True)
    assert m.ledger.get("victim") == 7, m.ledger
    assert torch.equal(m.snapshot()[1]["w"], torch.full((4,), 3.0))  # the 3 deltas, once each
    m.close()


def test_compat_refuses_a_version_that_leaves_no_room_to_run(compat_transport, tmp_path):
    from diloco_lightning.master.compat import SpeedtronicAdoptionError

    _speedtronic_hub(compat_transport, tmp_path, MAX_STEP, {"w": torch.zeros(4)})
    m = small_master(compat_transport.open("m"), tmp_path, compat="speedtronic")
    with pytest.raises(SpeedtronicAdoptionError, match="leaves fewer than"):
        m.sync_once()  # refused with the reason, instead of adopted and then failing every round
    assert compat_transport.open("r").read_manifest() is None
    m.close()


def test_no_master_adopts_a_manifest_that_leaves_no_room_to_run(transport, tmp_path):
    m = small_master(transport.open("m"), tmp_path)
    assert m.sync_once()
    raw = json.loads(transport.open("r").read_manifest_bytes())
    raw["outer_step"] = MAX_STEP
    transport.put("global/manifest.json", json.dumps(raw).encode())
    assert m.sync_once() and transport.open("r2").read_manifest().outer_step == 0  # replaced, not adopted
    m.close()


@pytest.mark.parametrize("compat", [None, "speedtronic"], ids=["plain", "compat"])
def test_a_deleted_manifest_never_makes_a_master_adopt_its_own_publication(compat_transport, tmp_path, compat):
    """A deleted manifest made the compat master re-adopt its own ``step_count.json`` as Speedtronic's:
    the optimizer state reset and a pending delta was dropped (outer step 4, w 9.95, where the plain
    master reaches 5 and 16.83). Both now republish their own version and go on identically."""
    t = compat_transport
    m = small_master(t.open("m"), tmp_path, compat=compat, aggregation="arrival", outer_momentum=0.9)
    assert m.sync_once()
    hub = m.hub
    for step in range(1, 5):
        p = tmp_path / f"d{step}.safetensors"
        write_delta(p, {"w": -torch.ones(4)}, node_id="a", local_step=step, base_outer_step=step - 1)
        hub.upload_delta(p, "a", step)
        assert m.sync_once()
    assert m.outer_step == 4
    p = tmp_path / "d5.safetensors"
    write_delta(p, {"w": -torch.ones(4)}, node_id="a", local_step=5, base_outer_step=4)
    hub.upload_delta(p, "a", 5)  # pending when the manifest goes
    t.delete("global/manifest.json")
    for _ in range(5):
        m.sync_once()
    assert m.outer_step == 5 and m.ledger == {"a": 5}
    w = float(m.snapshot()[1]["w"][0])
    # Nesterov (lr 1, momentum 0.9) fed g = -1 five times, its momentum never reset
    buf, expect = 0.0, 0.0
    for _ in range(5):
        buf = 0.9 * buf - 1.0
        expect -= -1.0 + 0.9 * buf
    assert w == pytest.approx(expect, rel=1e-6), (w, expect)
    m.close()


# ============================================================================ numbers of any size (class 9)

#: a 401-digit integer: Python's JSON reads it (up to 4,300 digits), no float holds it
HUGE_INT = "9" * 401


def _with_huge(doc: dict, *keys: str) -> bytes:
    """``doc`` as JSON with the entry at the path ``keys`` replaced by :data:`HUGE_INT`."""
    doc = json.loads(json.dumps(doc))
    inner = doc
    for k in keys[:-1]:
        inner = inner.setdefault(k, {})
    inner[keys[-1]] = "@HUGE@"
    return json.dumps(doc).replace('"@HUGE@"', HUGE_INT).encode()


def test_load_json_bounds_every_number_by_its_digits():
    """A 401-digit integer parsed, then the caller's ``math.isfinite``, ``float()`` or ``:.3g`` raised
    ``OverflowError``, which none of them catches. Every number the parser returns converts to a float."""
    from diloco_lightning.util.jsondoc import MAX_INT_DIGITS

    big = int("9" * MAX_INT_DIGITS)
    assert load_json(f"[{big}, -{big}, 1e308]".encode(), max_bytes=100) == [big, -big, 1e308]
    for doc in (f"[{HUGE_INT}]", f"[-{HUGE_INT}]", f'{{"a": {"1" * (MAX_INT_DIGITS + 1)}}}', "[1e999]", "[-1e999]"):
        with pytest.raises(JSONDocumentError, match="digits|not a finite number"):
            load_json(doc, max_bytes=1 << 20)


def test_a_state_file_never_holds_a_number_its_reader_refuses(tmp_path):
    from diloco_lightning.util.jsondoc import MAX_INT_DIGITS
    from diloco_lightning.wire.statefile import load_state_file, save_state_file

    ok = {"step": 10**MAX_INT_DIGITS - 1, "w": torch.ones(2)}
    save_state_file(tmp_path / "ok.safetensors", ok)
    assert load_state_file(tmp_path / "ok.safetensors")[0]["step"] == ok["step"]
    with pytest.raises(ValueError, match="more than 20 digits"):
        save_state_file(tmp_path / "big.safetensors", {"step": 10**MAX_INT_DIGITS})


def test_a_manifest_with_a_huge_number_is_replaced(transport, tmp_path, caplog):
    """A 401-digit ``published_at`` made every master round raise ``OverflowError``."""
    m = small_master(transport.open("m"), tmp_path)
    assert m.sync_once()
    doc = json.loads(transport.open("reader").read_manifest_bytes())
    transport.put("global/manifest.json", _with_huge(doc, "published_at"))
    with caplog.at_level(logging.WARNING):
        assert m.sync_once() is True  # the round completes: the manifest is malformed, replaced
    assert any("manifest.json is not a valid manifest" in r.getMessage() and "401 digits" in r.getMessage()
               for r in caplog.records)
    assert m.hub.read_manifest().outer_step == 0
    m.close()


def test_a_lease_with_a_huge_number_counts_as_expired(transport, tmp_path, caplog):
    """A 401-digit ``expires_at`` made every master round raise ``OverflowError``."""
    from diloco_lightning.wire.manifest import Lease

    transport.put("global/lease.json", _with_huge(Lease("mallory:1:x", 1, 0.0).to_doc(), "expires_at"))
    m = small_master(transport.open("m"), tmp_path)
    with caplog.at_level(logging.WARNING):
        assert m.sync_once() and m.is_leader
    assert any("lease.json is not a valid lease" in r.getMessage() and "401 digits" in r.getMessage()
               for r in caplog.records)
    assert m.hub.read_lease().holder == m.holder
    m.close()


@pytest.mark.parametrize("keys", [("claimed_at",), ("info", "local_step"), ("info", "step_rate")],
                         ids=["claimed_at", "local_step", "step_rate"])
def test_a_claim_with_a_huge_number_is_rejected_with_a_reason(transport, tmp_path, caplog, keys):
    """A 401-digit ``claimed_at`` made ``list_claims`` raise (the master's membership went blind), an
    ``info.local_step`` made every master round raise, an ``info.step_rate`` made a DyLU worker raise
    at its boundary. Now the claim is ignored with a reason, and the others are read."""
    hub = transport.open("m")
    hub.write_claim("a", _claim("a", "elsewhere:1:a"), expected=None)
    transport.put("nodes/evil/claim.json", _with_huge(_claim("evil", "mallory:1:x").to_doc(), *keys))
    m = small_master(hub, tmp_path, min_deltas=1.0)
    with caplog.at_level(logging.WARNING):
        assert m.sync_once()
    assert m.membership.live() == ["a"]
    assert any("evil" in r.getMessage() and "401 digits" in r.getMessage() for r in caplog.records)
    keeper = ClaimKeeper(transport.open("w0"), "w0", ttl=60, watch_peers=True)
    keeper._read_peers()
    assert sorted(keeper.peer_reports()) == ["a"]  # what a DyLU worker reads at its boundary
    m.close()


def test_a_step_count_with_a_huge_number_is_refused_with_a_reason(transport, tmp_path):
    from diloco_lightning.master.compat import SpeedtronicAdoptionError

    transport.put("global/step_count.json", _with_huge({"model_file": "global/latest.safetensors"}, "outer_step"))
    m = small_master(transport.open("m"), tmp_path, compat="speedtronic")
    with pytest.raises(SpeedtronicAdoptionError, match="not a Speedtronic step_count.json.*401 digits"):
        m.sync_once()  # the serve loop reports this one line and tries again later
    m.close()


# ============================================================================ warn-once memory (class 10)


def test_warn_once_remembers_at_most_its_cap_and_still_warns_with_a_count(caplog):
    """Every transport remembered every junk name it warned about, for good (80,000 names: a master
    40 MiB larger). Past its cap a warner remembers nothing more, and still logs one warning an
    interval with the count of those it left out."""
    from diloco_lightning.util.warnonce import WarnOnce

    now = [0.0]
    w = WarnOnce(logging.getLogger("test.warnonce"), cap=100, interval=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.warnonce"):
        for i in range(10_000):
            w.warn(f"junk-{i}", "ignoring %s", f"junk-{i}")
        assert len(w) == 100 and len(w._keys) == 100
        assert [r.getMessage() for r in caplog.records[:100]] == [f"ignoring junk-{i}" for i in range(100)]
        assert len(caplog.records) == 101 and "0 more warning(s)" in caplog.records[100].getMessage()
        assert not w.warn("junk-0", "again") and not w.warn("junk-20000", "within the interval")
        now[0] = 61.0
        assert w.warn("junk-20001", "ignoring %s", "junk-20001")
    last = caplog.records[-1].getMessage()
    assert last.startswith("ignoring junk-20001") and "9900 more warning(s)" in last  # 9,899 + junk-20000
    assert len(w) == 100


def test_junk_names_on_a_hub_never_grow_a_readers_memory(transport, tmp_path, monkeypatch, caplog):
    from diloco_lightning.util import warnonce

    monkeypatch.setattr(warnonce, "DEFAULT_CAP", 20)
    junk = {f"nodes/a/junk_{i}.bin": b"x" for i in range(100)}
    if transport.kind in ("hf", "hf_nodes"):
        transport.server.commit_files(transport._repo_of("nodes/a/x"), adds=junk)
    else:
        for path, data in junk.items():
            transport.put(path, data)
    hub = transport.open("m")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert hub.list_deltas() == []
    warned = hub._warned
    assert len(warned) == 20
    junk_warnings = [r.getMessage() for r in caplog.records if "junk_" in r.getMessage()]
    assert 20 < len(junk_warnings) < 30 and any("more warning(s)" in m for m in junk_warnings)


# ============================================================================ documents over their size (class 11)

#: more than any hub document is read up to (S3 reads a small object up to 16 MiB)
OVERSIZE = b"{" + b" " * (16 << 20) + b"}"


def test_an_oversize_manifest_is_replaced_in_a_signed_run(transport, tmp_path, caplog):
    """On S3 a manifest over 16 MiB raised a plain ``HubError`` that the malformed-manifest path did not
    take: every round of a signed master raised. On every transport it is a malformed manifest, replaced;
    the folder and the Hugging Face transports read it up to one byte past the limit, not whole."""
    key = RunKey("the-run-key")
    m = small_master(transport.open("m"), tmp_path, signing_key=key)
    assert m.sync_once()
    transport.put("global/manifest.json", OVERSIZE)
    from diloco_lightning.wire.manifest import MAX_MANIFEST_BYTES

    assert len(transport.open("reader").read_manifest_bytes()) <= MAX_MANIFEST_BYTES + 1  # never read whole
    with caplog.at_level(logging.WARNING):
        assert m.sync_once() is True
    assert any("manifest.json is not a valid manifest" in r.getMessage() and "bytes, more than" in r.getMessage()
               for r in caplog.records)
    man = transport.open("reader").read_manifest()
    assert man.outer_step == 0 and man.verify(key)
    m.close()


def test_an_oversize_lease_or_claim_is_expired_or_no_claim(transport, tmp_path, caplog):
    """On S3 a lease over 16 MiB made every round of a master raise, and a claim over 16 MiB made
    ``list_claims`` raise (the membership went blind). The lease counts as expired, the claim as none."""
    key = RunKey("the-run-key")
    transport.put("global/lease.json", OVERSIZE)
    transport.put("nodes/evil/claim.json", OVERSIZE)
    hub = transport.open("m")
    hub.write_claim("a", _claim("a", "elsewhere:1:a").signed(key), expected=None)
    m = small_master(hub, tmp_path, signing_key=key, min_deltas=1.0)
    with caplog.at_level(logging.WARNING):
        assert m.sync_once() and m.is_leader
    assert m.hub.read_lease().holder == m.holder and m.hub.read_lease().verify(key)
    assert m.membership.live() == ["a"]
    with caplog.at_level(logging.WARNING):
        assert transport.open("reader").read_claim("evil") is None
    messages = [r.getMessage() for r in caplog.records]
    assert any("lease.json is not a valid lease" in s and "bytes, more than" in s for s in messages)
    assert any("evil" in s and "claim" in s and "bytes, more than" in s for s in messages)
    m.close()


# ============================================================================ special files on a folder hub

#: what a writer of a folder hub can put where a file should be: a FIFO (a reader's open blocks until someone
#: writes), a link to ``/dev/zero`` (endless zeros)
SPECIAL = ["fifo", "dev_zero"]


def _plant(path: Path, kind: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "sparse":  # 256 MiB of nothing on disk
        with open(path, "wb") as f:
            f.truncate(256 << 20)
    else:
        path.symlink_to("/dev/zero")
    return path


def _within(call, *fifos: Path, seconds: float = 2.0):
    """``call()``'s result (or exception) if it returns within ``seconds``; else the test fails (the call,
    in its own thread, is freed first: each FIFO opened for writing and closed, so a reader stalled on it
    reads an end of file and no thread stays blocked)."""
    out: dict = {}

    def run():
        try:
            out["value"] = call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        for f in fifos:
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(5.0)
        pytest.fail(f"{getattr(call, '__name__', call)} did not return within {seconds} s (stalled on a special file)")
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.mark.parametrize("kind", [*SPECIAL, "sparse"])
def test_a_special_file_as_manifest_is_replaced_without_a_stall(tmp_path, kind, caplog):
    """A FIFO as ``global/manifest.json`` stalled the master's round indefinitely; a link to ``/dev/zero``
    and a sparse 256 MiB file were read 16 MiB deep (the sparse one added 768 MiB to the master's peak
    memory, ``/dev/zero`` ended in a MemoryError). Each is refused before a byte is read: a malformed
    manifest, replaced by the master's last version."""
    from diloco_lightning.wire.manifest import ManifestError

    root = tmp_path / "hub"
    m = small_master(FileHub(root), tmp_path)
    assert m.sync_once()
    f = _plant(root / "global" / "manifest.json", kind)
    reader = FileHub(root)
    why = "268435456 bytes, more than" if kind == "sparse" else "not a regular file"
    with pytest.raises(ManifestError, match=f"manifest.json is (a FIFO, |a symbolic link, )?{why}"):
        _within(reader.read_manifest, f)
    assert len(_within(reader.read_manifest_bytes, f)) < 1000  # a stand-in, never the file's content
    with caplog.at_level(logging.WARNING):
        assert _within(m.sync_once, f) is True  # the round goes on: the manifest is replaced
    assert any("manifest.json is not a valid manifest" in r.getMessage() and why in r.getMessage()
               for r in caplog.records)
    assert not f.is_symlink() and f.is_file() and reader.read_manifest().outer_step == 0
    m.close()


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_special_file_as_lease_counts_as_expired_without_a_stall(tmp_path, kind, caplog):
    root = tmp_path / "hub"
    hub = FileHub(root)
    f = _plant(root / "global" / "lease.json", kind)
    with caplog.at_level(logging.WARNING):
        lease = _within(hub.read_lease, f)
    assert lease.unreadable and lease.expired()
    assert any("lease.json is not a valid lease" in r.getMessage() and "not a regular file" in r.getMessage()
               for r in caplog.records)
    m = small_master(hub, tmp_path)
    assert _within(m.sync_once, f) and m.is_leader  # taken over as an expired lease
    assert not f.is_symlink() and hub.read_lease().holder == m.holder
    m.close()


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_special_file_as_another_nodes_claim_is_no_claim_without_a_stall(tmp_path, kind, caplog):
    root = tmp_path / "hub"
    hub = FileHub(root)
    hub.write_claim("a", _claim("a", "elsewhere:1:a"), expected=None)
    f = _plant(root / "nodes" / "evil" / "claim.json", kind)
    with caplog.at_level(logging.WARNING):
        assert _within(lambda: hub.read_claim("evil"), f) is None
    assert sorted(_within(hub.list_claims, f)) == ["a"]
    assert any("nodes/evil/claim.json" in r.getMessage() and "not a regular file" in r.getMessage()
               for r in caplog.records)
    m = small_master(hub, tmp_path, min_deltas=1.0)
    assert _within(m.sync_once, f)
    assert m.membership.live() == ["a"]
    m.close()


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_special_file_as_a_workers_own_claim_never_freezes_it(tmp_path, kind):
    """A FIFO put over a running worker's ``claim.json`` froze its training: the heartbeat blocked reading it
    while holding the keeper's lock, which the training thread takes at each boundary. The heartbeat now
    finds no claim there and claims its id again."""
    root = tmp_path / "hub"
    hub = FileHub(root)
    keeper = ClaimKeeper(hub, "w0", ttl=60)
    keeper.acquire()
    f = _plant(root / "nodes" / "w0" / "claim.json", kind)
    assert _within(keeper.renew, f) is True
    assert not f.is_symlink() and f.is_file() and hub.read_claim("w0").holder == keeper.holder
    _within(lambda: keeper.set_info({"local_step": 1}), f)  # what the training thread does at a boundary
    keeper.release()
    assert not f.exists()


@pytest.mark.parametrize("kind", SPECIAL)
def test_a_special_file_as_a_delta_is_rejected_without_a_stall(tmp_path, kind, monkeypatch, caplog):
    """A listing skips what is not a regular file, but a writer can swap a delta for a FIFO after the listing
    (or after ``download``'s look at it): the read blocked on it. It is refused at once, with a reason."""
    from diloco_lightning.hub.base import DeltaRef, HubError
    from diloco_lightning.wire.delta import UnreadableDeltaError, read_delta

    root = tmp_path / "hub"
    hub = FileHub(root)
    m = small_master(hub, tmp_path)
    assert m.sync_once()
    hub_path = "nodes/evil/delta_5.safetensors"
    f = _plant(root / hub_path, kind)
    with pytest.raises(UnreadableDeltaError, match="not a regular file"):
        _within(lambda: read_delta(f, reference={"w": torch.zeros(4)}, hub_path=hub_path), f)
    with pytest.raises(HubError, match="FIFO, not a regular file" if kind == "fifo" else "symbolic link"):
        _within(lambda: hub.download(hub_path), f)
    # the round's listing saw a regular file there, and download's look too: swapped just before the read
    monkeypatch.setattr(hub, "list_deltas", lambda after=None: [DeltaRef("evil", 5, hub_path, 100, "swapped")])
    monkeypatch.setattr(hub, "download", lambda path, max_bytes=None: root / path)
    with caplog.at_level(logging.WARNING):
        assert _within(lambda: m.sync_once(force=True), f) is not None
    assert any("rejecting " + hub_path in r.getMessage() and "not a regular file" in r.getMessage()
               for r in caplog.records), caplog.text
    assert m.outer_step == 0
    m.close()


# ============================================================================ one parser for hub JSON

#: the files of the package that parse JSON themselves, each only the project's own local files
#: (never a byte from a hub): how many ``json.load(s)`` calls, and why they are trusted
JSON_OUTSIDE_THE_PARSER = {
    "master/localstate.py": (2, "the master's own record in its node_state_dir (master.json), and a manifest "
                                "it serialised itself (to_json) turned back into a dict"),
    "app/launches.py": (2, "launches.json and its lines, written by this run's launcher in the run folder"),
    "app/slurm.py": (1, "metrics.jsonl lines the run's own master writes in the run folder"),
    "app/worker.py": (1, "summary.json, written by the supervised worker process this command started, in the run folder"),
    "app/summarize.py": (1, "results.json files this package's runs wrote under a results folder"),
    "app/local.py": (2, "results.json and the workers' summary.json in the run folder (not the hub: it is "
                        "<run>/hub, the summaries <run>/nodes/<id>/summary.json)"),
}


def test_no_code_parses_hub_json_but_the_bounded_parser():
    """Every JSON document from a hub goes through ``util/jsondoc.load_json`` (bounded size, depth,
    digits; linear time): a ``json.loads`` anywhere else in the package is one of the allow-listed
    parses of the project's own local files, each with its reason."""
    import ast
    import re

    pkg = ROOT / "diloco_lightning"
    found: dict[str, int] = {}
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg).as_posix()
        if rel == "util/jsondoc.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases = {"json"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {a.asname for a in node.names if a.name == "json" and a.asname}
            elif isinstance(node, ast.ImportFrom) and node.module == "json":
                bad = [a.name for a in node.names if a.name in ("load", "loads", "JSONDecoder", "decoder")]
                assert not bad, f"{rel}: from json import {bad}: parse hub JSON with util.jsondoc.load_json"
        n = sum(1 for node in ast.walk(tree)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("load", "loads", "raw_decode")
                and isinstance(node.func.value, ast.Name) and node.func.value.id in aliases)
        n += len(re.findall(r"\bJSONDecoder\s*\(", path.read_text(encoding="utf-8")))
        if n:
            found[rel] = n
    allowed = {rel: count for rel, (count, _) in JSON_OUTSIDE_THE_PARSER.items()}
    assert found == allowed, (
        f"JSON parsed outside util/jsondoc.py: {found}; allowed: {allowed}. Parse hub bytes with load_json; "
        "add a file here only if it parses the project's own local files, with the reason"
    )
