"""Exactly-once under kill -9: a master subprocess (tests/support/master_crash_script.py) is killed for
real (SIGKILL) at each step of a round, a fresh master restarts on the same hub (same local
state folder, or another machine's master taking over the lease), and the final global
state must equal, bit for bit, that of an uninterrupted master over the same deltas
(Nesterov lr 0.7 momentum 0.9: a lost or re-applied delta, or a reset momentum, shows).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from speed import default_first
import torch

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")

from diloco_lightning.wire.delta import model_fingerprint, write_delta  # noqa: E402
from diloco_lightning.hub.local import FileHub  # noqa: E402
from diloco_lightning.master import MasterOuterLoop  # noqa: E402

from support.master_crash_script import initial_state  # noqa: E402

SCRIPT = Path(__file__).parent / "support" / "master_crash_script.py"
MASTER = dict(outer_lr=0.7, outer_momentum=0.9, lease_ttl=0.5, norm_ratio=4.0, poll_interval=0.02)
DELTAS = [("a", 0), ("a", 1), ("b", 0), ("c", 0), ("c", 1), ("b", 1)]
TOKEN = "hf_crashTESTtoken0123456789"


def _delta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    st = initial_state(0)
    return {k: (torch.randn(v.shape, generator=g) * 0.01).to(v.dtype) for k, v in st.items() if v.is_floating_point()}


def _put_all(hub, tmp: Path, deltas=DELTAS) -> None:
    fp = model_fingerprint(initial_state(0))
    tmp.mkdir(parents=True, exist_ok=True)
    for i, (node, step) in enumerate(deltas):
        p = tmp / f"{node}_{step}.safetensors"
        write_delta(p, _delta(i), node_id=node, local_step=step, base_outer_step=0, model_fingerprint=fp)
        hub.upload_delta(p, node, step)


def _finish(master: MasterOuterLoop, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        master.sync_once(force=True)
        if master.is_leader and not master.hub.list_deltas(after=master.ledger):
            return
        time.sleep(0.05)
    raise AssertionError("the restarted master did not finish")


_REFS: dict[str, tuple[int, dict]] = {}

#: the master's modes: arrival with one publication per delta (the per-delta crash matrices below), arrival
#: with the deltas one pass finds published as one version (the default; all six deltas wait, so one pass
#: applies them: what a master that falls behind does), rounds
MODES = {"arrival": {"aggregation": "arrival", "arrival_publish": "each"}, "arrival_pass": {"aggregation": "arrival"},
         "round": {"aggregation": "round"}}


def _reference(tmp_factory, aggregation: str) -> tuple[int, dict[str, torch.Tensor]]:
    if aggregation not in _REFS:
        tmp = tmp_factory.mktemp(f"ref_{aggregation}")
        hub = FileHub(tmp / "hub", cache_dir=tmp / "cache")
        m = MasterOuterLoop(hub, initial_state(0), node_state_dir=tmp / "m", **MODES[aggregation], **MASTER)
        m.sync_once()
        _put_all(hub, tmp / "w")
        _finish(m)
        _REFS[aggregation] = m.snapshot()
    return _REFS[aggregation]


def _run_script(cfg: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("DILOCO_RUN_KEY", None)
    env.pop("DILOCO_RUN_KEY_FILE", None)
    return subprocess.run([sys.executable, str(SCRIPT), json.dumps(cfg)], capture_output=True, text=True, timeout=120, env=env)


def _crash_and_restart(tmp: Path, hub_spec: dict, open_hub, crash: str, occurrence: int, aggregation: str,
                       restart_dir: str = "m") -> MasterOuterLoop:
    hub = open_hub()
    _put_all(hub, tmp / "w")
    cfg = {
        "hub": hub_spec, "state_dir": str(tmp / "m"), "seed": 0, "crash": crash, "occurrence": occurrence,
        "master": dict(MASTER, **MODES[aggregation]),
    }
    proc = _run_script(cfg)
    assert proc.returncode == -signal.SIGKILL, (crash, proc.returncode, proc.stdout, proc.stderr[-3000:])
    m = MasterOuterLoop(open_hub(), initial_state(0), node_state_dir=tmp / restart_dir, **MODES[aggregation], **MASTER)
    _finish(m)
    return m


def _assert_same(m: MasterOuterLoop, ref: tuple[int, dict[str, torch.Tensor]], what: str) -> None:
    step, snap = m.snapshot()
    assert step == ref[0], what
    for k, v in ref[1].items():
        assert torch.equal(snap[k], v), (what, k)
    man = m.hub.read_manifest()
    assert man.ledger == {"a": 1, "b": 1, "c": 1}, what
    assert man.outer_step == ref[0]


ARRIVAL_POINTS = [
    ("listed", 1), ("downloaded", 1), ("stepped", 3), ("staged", 3),
    ("file:*", 5), ("files", 3), ("locked", 3), ("manifest", 3), ("delete:*", 3), ("deleted", 3),
    ("published", 3), ("saved", 3), ("swapped", 3),
]


# every point in the slow run; the default run keeps one before the commit (stepped), one at it
# (manifest) and one after it (published)
@pytest.mark.parametrize("crash, occurrence", default_first(ARRIVAL_POINTS, keep={2, 7, 10}), ids=[f"{c}#{o}" for c, o in ARRIVAL_POINTS])
def test_kill9_at_every_step_arrival_mode(tmp_path, tmp_path_factory, crash, occurrence):
    ref = _reference(tmp_path_factory, "arrival")
    spec = {"kind": "file", "path": str(tmp_path / "hub"), "cache_dir": str(tmp_path / "cache")}
    m = _crash_and_restart(tmp_path, spec, lambda: FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache2"),
                           crash, occurrence, "arrival")
    _assert_same(m, ref, f"{crash}#{occurrence}")


#: the master killed in a pass of six deltas: after one and after four of its optimizer steps, and at each
#: step of its one publication (file: the first two in the default run; hf and s3: slow)
PASS_POINTS = {
    "file": [("stepped", 4), ("manifest", 1), ("stepped", 1), ("staged", 1), ("files", 1), ("deleted", 1),
             ("published", 1), ("saved", 1), ("swapped", 1)],
    "hf": [("stepped", 4), ("committed", 1), ("published", 1)],
    "s3": [("stepped", 4), ("files", 1), ("delete:*", 1)],
}
PASS_CASES = [pytest.param(t, c, o, marks=[] if t == "file" and i < 2 else [pytest.mark.slow], id=f"{t}-{c}#{o}")
              for t, points in PASS_POINTS.items() for i, (c, o) in enumerate(points)]


@pytest.mark.parametrize("transport, crash, occurrence", PASS_CASES)
def test_kill9_in_a_pass_of_several_deltas(request, tmp_path, tmp_path_factory, transport, crash, occurrence):
    """The six deltas one pass finds are six optimizer and outer steps published as one version: killed
    after some of the steps, or at any step of the publication, the restarted master ends bit for bit
    where the uninterrupted one does, which is where the master publishing every delta ends (the same
    steps, the same outer step 6), with every delta in the ledger once."""
    ref = _reference(tmp_path_factory, "arrival_pass")
    each = _reference(tmp_path_factory, "arrival")
    assert ref[0] == each[0] == len(DELTAS)
    for k, v in each[1].items():
        assert torch.equal(ref[1][k], v), k
    with _transport(request, tmp_path, transport) as (spec, open_hub):
        m = _crash_and_restart(tmp_path, spec, open_hub, crash, occurrence, "arrival_pass")
        _assert_same(m, ref, f"{transport} pass {crash}#{occurrence}")
        assert [v.outer_step for v in m.hub.read_manifest().history] == [0]  # one version for the pass


@contextlib.contextmanager
def _transport(request, tmp: Path, kind: str):
    """A hub of ``kind`` for the crash script (its spec) and for the restarted master (a fresh handle each)."""
    n = [0]
    if kind == "file":
        yield ({"kind": "file", "path": str(tmp / "hub"), "cache_dir": str(tmp / "cache")},
               lambda: FileHub(tmp / "hub", cache_dir=tmp / "cache2"))
    elif kind == "hf":
        from support.hf_server import FakeHubServer

        from diloco_lightning.hub.hf import HFHub

        with FakeHubServer() as server:
            def open_hf():
                n[0] += 1
                return HFHub("org/crash", endpoint=server.endpoint, token=TOKEN, cache_dir=tmp / f"c{n[0]}",
                             max_retries=2, retry_base_delay=0.01, retry_max_delay=0.05, timeout=10, commits_per_hour=0)

            yield ({"kind": "hf", "endpoint": server.endpoint, "repo": "org/crash", "token": TOKEN,
                    "cache_dir": str(tmp / "script_cache")}, open_hf)
    else:
        from diloco_lightning.hub import open_hub as open_url

        endpoint, bucket = request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket")
        url = f"s3://{bucket}/run"

        def open_s3():
            n[0] += 1
            return open_url(url, endpoint_url=endpoint, addressing_style="path", cache_dir=tmp / f"c{n[0]}",
                            max_retries=2, retry_base_delay=0.01, retry_max_delay=0.05,
                            check_conditional_writes=n[0] == 1)

        yield {"kind": "s3", "url": url, "endpoint": endpoint, "cache_dir": str(tmp / "script_cache")}, open_s3


ROUND_POINTS = [("downloaded", 1), ("stepped", 1), ("files", 2), ("manifest", 2), ("deleted", 2), ("published", 1), ("saved", 1)]


@pytest.mark.parametrize("crash, occurrence", default_first(ROUND_POINTS, keep=2), ids=[f"{c}#{o}" for c, o in ROUND_POINTS])
def test_kill9_at_every_step_round_mode(tmp_path, tmp_path_factory, crash, occurrence):
    ref = _reference(tmp_path_factory, "round")
    spec = {"kind": "file", "path": str(tmp_path / "hub"), "cache_dir": str(tmp_path / "cache")}
    m = _crash_and_restart(tmp_path, spec, lambda: FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache2"),
                           crash, occurrence, "round")
    _assert_same(m, ref, f"{crash}#{occurrence}")


@pytest.mark.parametrize("crash, occurrence", default_first([("manifest", 3), ("stepped", 4)]))
def test_kill9_then_another_master_takes_over(tmp_path, tmp_path_factory, crash, occurrence):
    """The killed master never comes back: a master on another machine (no local state) waits
    for the lease to expire and continues from the published optimizer state."""
    ref = _reference(tmp_path_factory, "arrival")
    spec = {"kind": "file", "path": str(tmp_path / "hub"), "cache_dir": str(tmp_path / "cache")}
    t0 = time.monotonic()
    m = _crash_and_restart(tmp_path, spec, lambda: FileHub(tmp_path / "hub", cache_dir=tmp_path / "cache2"),
                           crash, occurrence, "arrival", restart_dir="other_machine")
    _assert_same(m, ref, f"takeover after {crash}#{occurrence}")
    assert m.hub.read_lease().epoch == 2
    assert time.monotonic() - t0 >= MASTER["lease_ttl"] * 0.5


@pytest.mark.parametrize("crash, occurrence", default_first([("files", 3), ("committed", 3), ("published", 3)], keep={1}))
def test_kill9_on_the_hugging_face_hub(tmp_path, tmp_path_factory, crash, occurrence):
    from support.hf_server import FakeHubServer

    from diloco_lightning.hub.hf import HFHub

    ref = _reference(tmp_path_factory, "arrival")
    with FakeHubServer() as server:
        n = [0]

        def open_hub():
            n[0] += 1
            return HFHub("org/crash", endpoint=server.endpoint, token=TOKEN, cache_dir=tmp_path / f"c{n[0]}",
                         max_retries=2, retry_base_delay=0.01, retry_max_delay=0.05, timeout=10, commits_per_hour=0)

        spec = {"kind": "hf", "endpoint": server.endpoint, "repo": "org/crash", "token": TOKEN,
                "cache_dir": str(tmp_path / "script_cache")}
        m = _crash_and_restart(tmp_path, spec, open_hub, crash, occurrence, "arrival")
        _assert_same(m, ref, f"hf {crash}#{occurrence}")


@pytest.mark.parametrize("crash, occurrence", [pytest.param("files", 3, marks=pytest.mark.slow), ("delete:*", 3)],
                         ids=["before-swap", "after-swap"])
def test_kill9_on_s3(tmp_path, tmp_path_factory, s3_endpoint, s3_bucket, crash, occurrence):
    """A master killed before and after the manifest's conditional PUT on s3://: the restarted master
    ends bit-exact with the uninterrupted one (orphans and undeleted deltas are collected, never applied)."""
    from diloco_lightning.hub import open_hub as open_url

    ref = _reference(tmp_path_factory, "arrival")
    url = f"s3://{s3_bucket}/run"
    n = [0]

    def open_hub():
        n[0] += 1
        return open_url(url, endpoint_url=s3_endpoint, addressing_style="path", cache_dir=tmp_path / f"c{n[0]}",
                        max_retries=2, retry_base_delay=0.01, retry_max_delay=0.05, check_conditional_writes=n[0] == 1)

    spec = {"kind": "s3", "url": url, "endpoint": s3_endpoint, "cache_dir": str(tmp_path / "script_cache")}
    m = _crash_and_restart(tmp_path, spec, open_hub, crash, occurrence, "arrival")
    _assert_same(m, ref, f"s3 {crash}#{occurrence}")


@pytest.mark.parametrize("crash, occurrence", [("committed", 3), pytest.param("published", 3, marks=pytest.mark.slow)])
def test_kill9_on_the_per_node_layout(tmp_path, tmp_path_factory, crash, occurrence):
    """The same on hf:// with a repository per node: the workers' deltas in their own repositories, the
    master's publication in its own."""
    from support.hf_server import FakeHubServer

    from diloco_lightning.hub import open_hub as open_url

    ref = _reference(tmp_path_factory, "arrival")
    with FakeHubServer() as server:
        n = [0]

        def open_hub():
            n[0] += 1
            return open_url("hf://org/crash", layout="per_node", endpoint=server.endpoint, token=TOKEN,
                            cache_dir=tmp_path / f"c{n[0]}", max_retries=2, retry_base_delay=0.01, retry_max_delay=0.05,
                            timeout=10, commits_per_hour=0)

        spec = {"kind": "hf_nodes", "endpoint": server.endpoint, "repo": "org/crash", "token": TOKEN,
                "cache_dir": str(tmp_path / "script_cache")}
        m = _crash_and_restart(tmp_path, spec, open_hub, crash, occurrence, "arrival")
        _assert_same(m, ref, f"hf per-node {crash}#{occurrence}")
        assert sorted(server.repos) == ["org/crash", "org/crash-a", "org/crash-b", "org/crash-c"]
