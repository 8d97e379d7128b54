"""The Hugging Face Hub at scale, against the loopback Hub (tests/support/hf_server.py, several repositories):
the per-node layout end to end (a real master and real workers), the commit budget pacing uploads and
publications, and a 429's ``Retry-After`` (seconds and HTTP date) honoured by workers and the master."""

from __future__ import annotations

import email.utils
import logging
import os
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from support.hf_server import FakeHubServer  # noqa: E402

from diloco_lightning.wire.delta import write_delta  # noqa: E402
from diloco_lightning.hub.versions import stage_global  # noqa: E402
from diloco_lightning.hub import open_hub  # noqa: E402
from diloco_lightning.hub.hf_nodes import HFNodesHub  # noqa: E402
from diloco_lightning.master import MasterOuterLoop  # noqa: E402
from diloco_lightning.wire.names import InvalidNameError  # noqa: E402
from diloco_lightning.wire.signing import RunKey  # noqa: E402
from diloco_lightning.worker import DiLoCoWorker  # noqa: E402

REPO = "org/run"
TOKEN = "hf_nodesTESTtoken0123456789"


@pytest.fixture(autouse=True)
def _online(monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False, raising=False)


@pytest.fixture
def server():
    with FakeHubServer(page_size=3) as s:  # small pages: the discovery listing is paginated
        yield s


def _open(server, tmp_path: Path, name: str, layout: str = "per_node", **kw):
    opts = dict(endpoint=server.endpoint, token=TOKEN, cache_dir=tmp_path / f"cache_{name}", max_retries=2,
                retry_base_delay=0.001, retry_max_delay=0.05, timeout=10, commits_per_hour=0)
    if layout == "per_node":
        opts["layout"] = "per_node"
    opts.update(kw)
    return open_hub(f"hf://{REPO}", **opts)


def _master(hub, tmp_path: Path, **kw) -> MasterOuterLoop:
    opts = dict(outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0, norm_ratio=None, norm_global_ratio=None, poll_interval=0.02)
    opts.update(kw)
    return MasterOuterLoop(hub, {"w": torch.zeros(4, 3)}, node_state_dir=tmp_path / "master", **opts)


def _worker(hub, node: str, **kw) -> tuple[DiLoCoWorker, dict]:
    params = {"w": torch.nn.Parameter(torch.zeros(4, 3))}
    w = DiLoCoWorker(hub, node, params, poll_interval=0.01, wait_timeout=20.0, **kw)
    w.start()
    return w, params


def _phase(w: DiLoCoWorker, params: dict, c: float) -> None:
    """One inner phase that moves the weights by +c: its pseudo-gradient is exactly -c, whatever was installed."""
    with torch.no_grad():
        params["w"].add_(c)
    w.boundary()


def _commits(server, repo: str) -> list:
    return [r for r in server.requests if r.route == "commit" and r.repo == repo]


# ----------------------------------------------------------------------------- the per-node layout


def test_per_node_layout_end_to_end(server, tmp_path):
    """A master and 4 workers: each worker commits only to its own repository, the master only to its
    own; every delta is applied exactly once; the workers remove their processed deltas in their upload
    commits; a round lists only the node repositories whose head moved."""
    master = _master(_open(server, tmp_path, "m"), tmp_path)
    assert master.sync_once() and master.outer_step == 0
    workers = [_worker(_open(server, tmp_path, f"w{i}"), f"w{i}") for i in range(4)]
    for _ in range(3):
        for i, (w, p) in enumerate(workers):
            _phase(w, p, float(i + 1))
        for w, _ in workers:
            assert w.flush()
        assert master.sync_once()
    assert master.outer_step == 3 and master.ledger == {f"w{i}": 3 for i in range(4)}
    assert torch.equal(master.snapshot()[1]["w"], torch.full((4, 3), 3 * 2.5))  # 3 rounds of mean(1, 2, 3, 4)

    # the repositories: the master's holds global/ only, each node's its own nodes/<node>/ only
    assert sorted(server.repos) == [REPO] + [f"{REPO}-w{i}" for i in range(4)]
    assert all(p == ".gitattributes" or p.startswith("global/") for p in server.files(REPO))
    for i in range(4):
        files = server.files(f"{REPO}-w{i}")
        assert all(p == ".gitattributes" or p.startswith(f"nodes/w{i}/") for p in files), files
        deltas = sorted(p for p in files if "/delta_" in p)
        assert "nodes/w%d/delta_1.safetensors" % i not in deltas and len(deltas) <= 2, deltas  # cleaned by the worker
        summaries = [c.summary for c in server.commits(f"{REPO}-w{i}")[1:]]
        assert all(s.startswith(("upload delta", "claim")) for s in summaries), summaries  # nobody else committed there
    assert all(not c.summary.startswith("upload") for c in server.commits(REPO))

    # a round after only w0 and w1 uploaded lists only their two trees (plus the paginated discovery)
    for w, p in workers[:2]:
        _phase(w, p, 1.0)
        assert w.flush()
    server.reset_log()
    assert master.sync_once() and master.ledger == {"w0": 4, "w1": 4, "w2": 3, "w3": 3}
    trees = [r.path for r in server.requests if r.route == "tree"]
    assert server.count("models") == 2 and len(trees) == 2 and all("run-w0" in t or "run-w1" in t for t in trees), trees
    for w, _ in workers:
        w.close()
    master.close()


def test_discovery_names_and_hostile_repositories(server, tmp_path, caplog):
    hub = _open(server, tmp_path, "m")
    assert isinstance(hub, HFNodesHub) and hub.node_repo_id("w7") == "org/run-w7"
    server.reset_log()
    for bad in ("a--b", "x-", "y.", "a/b", "", "..", "x" * 65):
        with pytest.raises(InvalidNameError, match="node_id"):
            hub.upload_delta(tmp_path / "nothing", bad, 1)
    assert server.count("commit") == server.count("create") == 0
    p = tmp_path / "d.safetensors"
    write_delta(p, {"w": torch.ones(4, 3)}, node_id="w1", local_step=5, base_outer_step=0)
    # a repository that matches the pattern but holds another node's files, one whose name is no node id,
    # an unrelated one, and the master's own: only nodes/<node>/ of the node's own repository counts
    for rid in ("org/run-w1", "org/run-evil", "org/run-bad--name", "org/other-w1", "elsewhere/run-w1"):
        server.create_repo(rid)
    server.commit_files("org/run-w1", {"nodes/w1/delta_5.safetensors": p.read_bytes()})
    server.commit_files("org/run-evil", {"nodes/w1/delta_9.safetensors": p.read_bytes(), "nodes/evil/x.bin": b"x"})
    server.commit_files("org/other-w1", {"nodes/w1/delta_7.safetensors": p.read_bytes()})
    server.commit_files("elsewhere/run-w1", {"nodes/w1/delta_8.safetensors": p.read_bytes()})
    with caplog.at_level(logging.WARNING):
        refs = hub.list_deltas()
    assert [(r.node_id, r.local_step, r.size) for r in refs] == [("w1", 5, p.stat().st_size)]
    assert "nodes/evil/x.bin in org/run-evil: not a delta path" in caplog.text  # only nodes/evil/ of run-evil is read
    assert hub.download(refs[0].path).read_bytes() == p.read_bytes()
    assert hub.list_deltas(after={"w1": 5}) == []
    with pytest.raises(ValueError, match="node"):
        HFNodesHub(REPO, node_repo="{repo}-x", endpoint=server.endpoint, token=TOKEN, cache_dir=tmp_path / "x")
    with pytest.raises(ValueError, match="revision"):
        open_hub(f"hf://{REPO}", layout="per_node", revision="dev", endpoint=server.endpoint, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="layout"):
        open_hub(f"hf://{REPO}", layout="star", endpoint=server.endpoint, cache_dir=tmp_path)


def test_a_forged_ledger_deletes_nothing_in_a_signed_run(server, tmp_path, monkeypatch):
    """A worker cleans up to the ledger of the manifest it read; in a signed run only a manifest with the
    run key's signature counts, so a forged one cannot make workers delete unprocessed deltas."""
    monkeypatch.setenv("DILOCO_RUN_KEY", "the-run-key-0123456789abcdef")
    hub = _open(server, tmp_path, "w0")
    for step in (1, 2):
        p = tmp_path / f"d{step}.safetensors"
        write_delta(p, {"w": torch.ones(4, 3)}, node_id="w0", local_step=step, base_outer_step=0)
        hub.upload_delta(p, "w0", step)
    staged = stage_global(tmp_path / "stage", 1, {"w": torch.zeros(4, 3)})
    forged = staged.manifest(ledger={"w0": 2})
    server.commit_files(REPO, {"global/manifest.json": forged.to_json().encode(),
                               **{k: Path(v).read_bytes() for k, v in staged.files.items()}})
    assert hub.read_manifest().ledger == {"w0": 2}
    p = tmp_path / "d3.safetensors"
    write_delta(p, {"w": torch.ones(4, 3)}, node_id="w0", local_step=3, base_outer_step=0)
    hub.upload_delta(p, "w0", 3)
    assert sorted(x for x in server.files(f"{REPO}-w0") if "delta" in x) == [f"nodes/w0/delta_{s}.safetensors" for s in (1, 2, 3)]
    signed = forged.signed(RunKey("the-run-key-0123456789abcdef"))
    server.commit_files(REPO, {"global/manifest.json": signed.to_json().encode()})
    hub.read_manifest()
    p = tmp_path / "d4.safetensors"
    write_delta(p, {"w": torch.ones(4, 3)}, node_id="w0", local_step=4, base_outer_step=0)
    hub.upload_delta(p, "w0", 4)
    assert sorted(x for x in server.files(f"{REPO}-w0") if "delta" in x) == [f"nodes/w0/delta_{s}.safetensors" for s in (3, 4)]


# ----------------------------------------------------------------------------- the commit budget


@pytest.mark.parametrize("layout", ["per_node", "shared"])
def test_worker_uploads_are_paced_and_merged_never_lost(server, tmp_path, layout):
    """A budget of two commits a second: a worker with a boundary every 0.05 s holds its deltas back and
    merges them (no 429, never two commits within the budget's spacing); every phase arrives exactly once."""
    repo = f"{REPO}-w0" if layout == "per_node" else REPO
    master = _master(_open(server, tmp_path, "m", layout), tmp_path, aggregation="arrival")
    assert master.sync_once()
    w, params = _worker(_open(server, tmp_path, "w0", layout, commits_per_hour=7200, commit_burst=1,
                              retry_max_delay=2.0), "w0")
    server.reset_log()
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < 1.5:
        _phase(w, params, 1.0)
        n += 1
        time.sleep(0.05)
    assert w.flush()
    ups = _commits(server, repo)  # the uploads (the claim was taken before)
    times = [c.at for c in ups]
    assert all(c.status == 200 for c in ups)
    assert all(b - a >= 0.45 for a, b in zip(times, times[1:])), [round(b - a, 3) for a, b in zip(times, times[1:])]
    assert w.totals["deltas_uploaded_total"] <= 5 < n and w.totals["uploads_paced_total"] >= n - 6
    assert w.totals["phases_delivered_total"] == n and w.totals["upload_failures_total"] == 0
    while master.sync_once(force=True):
        pass
    assert torch.equal(master.snapshot()[1]["w"], torch.full((4, 3), float(n)))  # every phase once
    w.close()
    master.close()


def _retry_after_header(kind: str, seconds: int) -> str:
    # an HTTP date has whole seconds: one more, so that the wait is at least ``seconds``
    return str(seconds) if kind == "seconds" else email.utils.formatdate(time.time() + seconds + 1, usegmt=True)


@pytest.mark.parametrize("kind", ["seconds", "http-date"])
def test_a_429_on_a_worker_upload_holds_its_deltas_until_retry_after(server, tmp_path, kind):
    repo = f"{REPO}-w0"
    master = _master(_open(server, tmp_path, "m"), tmp_path, aggregation="arrival")
    assert master.sync_once()
    w, params = _worker(_open(server, tmp_path, "w0"), "w0")
    # a first phase before the 429: its boundary sends the worker's first heartbeat at once (a claim
    # commit from another thread, which may already be on its way when the 429 is answered)
    first = w.heartbeat.keeper.claim.renewed_at
    _phase(w, params, 2.0)
    assert w.flush()
    deadline = time.monotonic() + 30
    while w.heartbeat.keeper.claim.renewed_at == first and time.monotonic() < deadline:
        time.sleep(0.01)
    server.reset_log()
    server.inject("commit", 429, count=1, headers={"Retry-After": _retry_after_header(kind, 1)})
    t0 = time.monotonic()
    n = 1
    while time.monotonic() - t0 < 1.8:
        _phase(w, params, 2.0)
        n += 1
        time.sleep(0.05)
    assert w.flush()
    commits = _commits(server, repo)
    assert commits[0].status == 429 and all(c.status == 200 for c in commits[1:])
    assert commits[1].at - commits[0].at >= 0.95  # nothing was committed before the server's time
    assert w.totals["uploads_paced_total"] > 5 and w.totals["phases_delivered_total"] == n
    while master.sync_once(force=True):
        pass
    assert torch.equal(master.snapshot()[1]["w"], torch.full((4, 3), 2.0 * n))
    w.close()
    master.close()


def test_a_429_on_a_publication_is_waited_out_by_the_serving_master(server, tmp_path):
    """The master's publication meets a 429 with an HTTP-date Retry-After: the serve loop waits that
    long (no commit meanwhile), then publishes; nothing is lost or applied twice."""
    master = _master(_open(server, tmp_path, "m"), tmp_path)
    assert master.sync_once()
    w, params = _worker(_open(server, tmp_path, "w0"), "w0")
    _phase(w, params, 3.0)
    assert w.flush()
    server.reset_log()
    server.inject("commit", 429, count=1, headers={"Retry-After": _retry_after_header("http-date", 1)})
    master.start()
    deadline = time.monotonic() + 15
    while master.outer_step < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    master.stop()
    commits = [c for c in _commits(server, REPO) if c.status in (200, 429)]
    assert [c.status for c in commits][:2] == [429, 200], [c.status for c in commits]
    assert commits[1].at - commits[0].at >= 0.95
    assert master.outer_step == 1 and master.ledger == {"w0": 1}
    assert torch.equal(master.snapshot()[1]["w"], torch.full((4, 3), 3.0))
    w.close()


def test_a_spent_budget_paces_the_master_round(server, tmp_path):
    """The master's repository budget is spent: the round stays open (paced), gathers what arrives, and is
    published once the budget allows: one publication for both deltas."""
    master = _master(_open(server, tmp_path, "m", commits_per_hour=7200, commit_burst=1, retry_max_delay=2.0), tmp_path)
    assert master.sync_once()  # the lease, then version 0 half a second later (slept in the call): the budget is spent
    wa, pa = _worker(_open(server, tmp_path, "wa"), "wa")
    wb, pb = _worker(_open(server, tmp_path, "wb"), "wb")
    _phase(wa, pa, 1.0)
    assert wa.flush()
    assert master.sync_once() is False and master.last_metrics["paced"] > 0 and master.last_metrics["pending"] == 1
    _phase(wb, pb, 3.0)
    assert wb.flush()
    time.sleep(master.hub.commit_wait())
    assert master.sync_once() and master.outer_step == 1 and master.ledger == {"wa": 1, "wb": 1}
    assert torch.equal(master.snapshot()[1]["w"], torch.full((4, 3), 2.0))  # one round: the mean of both
    for w in (wa, wb):
        w.close()
    master.close()


def test_a_short_retry_after_is_slept_inside_the_call(server, tmp_path):
    hub = _open(server, tmp_path, "m", retry_max_delay=2.0)
    server.reset_log()
    server.inject("models", 429, count=1, headers={"Retry-After": "1"})
    t0 = time.monotonic()
    assert hub.list_deltas() == []
    assert time.monotonic() - t0 >= 1.0 and server.count("models") == 2


def test_after_a_long_retry_after_no_request_is_sent_until_it_passes(server, tmp_path):
    """A read answered 429 with a Retry-After longer than a retry may wait: the call raises at once with
    ``retry_after``, and the next calls raise too without sending anything until that time has passed."""
    from diloco_lightning.hub import HubUnavailableError

    hub = _open(server, tmp_path, "m", retry_max_delay=0.05)
    server.reset_log()
    server.inject("resolve", 429, count=1, headers={"Retry-After": "1"})
    with pytest.raises(HubUnavailableError) as ei:
        hub.read_manifest()
    assert 0.9 <= ei.value.retry_after <= 1.0 and server.count("resolve") == 1
    with pytest.raises(HubUnavailableError, match="left of its Retry-After"):
        hub.read_lease()
    assert server.count() == 1  # nothing was sent
    time.sleep(1.0)
    assert hub.read_manifest() is None and server.count("resolve") == 2
