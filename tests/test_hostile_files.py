"""No file a hub writer can put there crashes, stalls or misleads a process, on every transport.

* a delta truncated by its writer while the master reads it (class 2: a memory map of a file
  another writer can change dies with SIGBUS);
* JSON documents of any size and depth (manifest, lease, claim, ``step_count.json``, a
  safetensors header): each parse failure is the documented rejection;
* claims: signed in a signed run; the master's bounds from its own configuration; absurd
  expiries; a vanished or overwritten claim is taken again;
* numbering: a worker takes no decision from a file it has not authenticated.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from diloco_lightning.master import MasterOuterLoop
from diloco_lightning.util.jsondoc import JSONDocumentError, load_json
from diloco_lightning.wire.claims import NodeClaim
from diloco_lightning.wire.signing import RunKey
from diloco_lightning.worker import DiLoCoWorker

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
    m = MasterOuterLoop(hub, state, node_state_dir=root / "m", outer_lr=1.0, outer_momentum=0.0,
                        norm_global_ratio=None)
    assert m.sync_once()
    write_delta(root / "d.safetensors", {"w": torch.ones(1 << 18)}, node_id="evil", local_step=1, base_outer_step=0)
    hub.upload_delta(root / "d.safetensors", "evil", 1)
    target = root / "hub" / "nodes" / "evil" / "delta_1.safetensors"

    # the writer truncates its own delta at the worst moment for the reader: right after the master
    # mapped it (or, reading it into its own memory, right before the tensor bytes are read)
    def truncate():
        os.truncate(target, 100)

    real_map, real_read = reader.map_tensors, reader.read_tensor
    def map_then_truncate(f, layout):
        out = real_map(f, layout)
        truncate()
        return out
    first = [True]
    def truncate_then_read(f, info):
        if first[0]:
            first[0] = False
            truncate()
        return real_read(f, info)
    reader.map_tensors, reader.read_tensor = map_then_truncate, truncate_then_read
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
    opts = dict(outer_lr=1.0, outer_momentum=0.0, lease_ttl=30.0, poll_interval=0.02, norm_global_ratio=None)
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
    assert transport.open("reader2").read_claim("victim").holder == w._claim_keeper.holder
    w.close()
    m.close()


def test_a_nested_step_count_is_refused_with_a_reason(transport, tmp_path):
    from diloco_lightning.master.compat import SpeedtronicAdoptionError

    transport.put("global/step_count.json", nested_object("outer_step"))
    m = small_master(transport.open("m"), tmp_path, compat="speedtronic")
    with pytest.raises(SpeedtronicAdoptionError, match="not a Speedtronic step_count.json.*nested"):
        m.sync_once()  # the serve loop reports this one line and tries again later
    m.close()
