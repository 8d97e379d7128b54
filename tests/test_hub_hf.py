"""The hf:// transport against a real HTTP server on 127.0.0.1 that speaks the part of the
Hub's HTTP API ``huggingface_hub.HfApi`` uses (tests/support/hf_server.py)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from support.hf_server import FakeHubServer

from diloco_lightning.util import faults  # noqa: E402
from diloco_lightning.wire.delta import read_delta, write_delta
from diloco_lightning.hub import (
    DeltaExistsError,
    DeltaRef,
    HubAuthError,
    HubError,
    HubNotFoundError,
    PublishConflictError,
    open_hub,
)
from diloco_lightning.hub.hf import HFHub, HubUnavailableError
from diloco_lightning.wire.manifest import GlobalVersion, Lease, Manifest, ManifestError
from diloco_lightning.wire.names import InvalidNameError, global_outer_state_path, global_weights_path

REPO = "org/diloco-run"
TOKEN = "hf_secretTOKENvalue0123456789"


@pytest.fixture(autouse=True)
def _online(monkeypatch):
    """The transport must work with telemetry off and HF_HUB_OFFLINE unset."""
    import huggingface_hub.constants as c

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False, raising=False)


@pytest.fixture
def server():
    with FakeHubServer(page_size=4) as s:
        yield s


@pytest.fixture
def make_hub(server, tmp_path):
    n = [0]

    def make(**kw) -> HFHub:
        n[0] += 1
        opts = {"endpoint": server.endpoint, "token": TOKEN, "cache_dir": tmp_path / f"cache{n[0]}", "max_retries": 3,
                "retry_base_delay": 0.001, "retry_max_delay": 0.01, "commits_per_hour": 0}  # no budget on loopback
        opts.update(kw)
        return open_hub(f"hf://{REPO}", **opts)

    return make


@pytest.fixture
def hub(make_hub) -> HFHub:
    return make_hub()


def _delta(tmp_path: Path, node: str, step: int, dtype=torch.float32, seed: int = 0, base: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    tensors = {"layer.weight": torch.randn(8, 5, generator=g).to(dtype), "layer.bias": torch.randn(5, generator=g).to(dtype)}
    p = tmp_path / "local" / f"{node}_{step}_{seed}.safetensors"
    write_delta(p, tensors, node_id=node, local_step=step, base_outer_step=base)
    return p


def _blob(tmp_path: Path, name: str, size: int = 300, seed: int = 0) -> Path:
    p = tmp_path / "local" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(hashlib.sha256(f"{name}{seed}".encode()).digest() * (size // 32 + 1))
    return p


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _version(tmp_path: Path, step: int, token: str, ledger=None, history=()) -> tuple[Manifest, dict[str, Path]]:
    w, s = global_weights_path(step, token), global_outer_state_path(step, token)
    files = {w: _blob(tmp_path, f"w{step}{token}", seed=step), s: _blob(tmp_path, f"s{step}{token}", 100, seed=step)}
    m = Manifest(
        outer_step=step, weights=w, weights_sha256=_sha(files[w]), model_fingerprint="0" * 64, ledger=dict(ledger or {}),
        outer_state=s, outer_state_sha256=_sha(files[s]), optimizer={"name": "nesterov"}, history=list(history),
        master={"holder": f"m-{token}", "epoch": 1}, published_at=1000.0 + step,
    )
    return m, files


def _publish(hub: HFHub, tmp_path: Path, step: int, token: str, expected, **kw) -> Manifest:
    m, files = _version(tmp_path, step, token, **{k: v for k, v in kw.items() if k in ("ledger", "history")})
    hub.publish(m, files, expected_outer_step=expected, delete=kw.get("delete", ()))
    return m


# ----------------------------------------------------------------------------- deltas


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_delta_round_trip_bit_exact(hub, tmp_path, dtype):
    local = {(n, s): _delta(tmp_path, n, s, dtype, seed=10 * i + s) for i, n in enumerate(("w0", "w1")) for s in (0, 7)}
    for (n, s), p in local.items():
        assert hub.upload_delta(p, n, s) == f"nodes/{n}/delta_{s}.safetensors"
    refs = hub.list_deltas()
    assert [(r.node_id, r.local_step) for r in refs] == sorted(local)
    for r in refs:
        got = hub.download_delta(r)
        assert got.read_bytes() == local[(r.node_id, r.local_step)].read_bytes()
        assert r.size == got.stat().st_size
        d, ref = read_delta(got, hub_path=r.path), read_delta(local[(r.node_id, r.local_step)])
        assert d.header == ref.header
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        for k, t in ref.tensors.items():
            assert d.tensors[k].dtype == dtype
            assert d.tensors[k].view(bits).equal(t.view(bits))  # bit-exact, not just numerically equal


def test_listing_sorted_ledger_filtered_touches_only_nodes(server, hub, tmp_path):
    for n, s in [("b", 3), ("a", 10), ("a", 2), ("b", 1), ("a", 9), ("c", 0)]:
        hub.upload_delta(_delta(tmp_path, n, s), n, s)
    hub.upload_init(_blob(tmp_path, "init"), "a")
    server.commit_files(REPO, {
        "nodes/bad node/delta_1.safetensors": b"x", "nodes/a/notes.txt": b"x", "nodes/a/delta_01.safetensors": b"x",
        "global/weights_000000001_abcdef01.safetensors": b"w", "README.md": b"hi",
    })
    server.reset_log()
    refs = hub.list_deltas()
    assert refs == sorted(refs)
    assert [(r.node_id, r.local_step) for r in refs] == [("a", 2), ("a", 9), ("a", 10), ("b", 1), ("b", 3), ("c", 0)]
    assert all(isinstance(r, DeltaRef) and r.size and r.size > 0 for r in refs)
    after = hub.list_deltas(after={"a": 9, "b": 3})
    assert [(r.node_id, r.local_step) for r in after] == [("a", 10), ("c", 0)]
    assert hub.list_inits() == ["a"]
    # only the tree of nodes/ was read (paginated: page_size=4), no file content
    assert server.count() == server.count("tree", path_prefix=f"/api/models/{REPO}/tree/main/nodes") > 3
    assert server.count("resolve") == 0
    assert hub.list_global() == ["global/weights_000000001_abcdef01.safetensors"]


def test_listing_empty_repo(hub):
    assert hub.list_deltas() == [] and hub.list_inits() == [] and hub.list_global() == []
    assert hub.read_manifest() is None and hub.read_lease() is None


def test_cache_is_per_node(hub, make_hub, tmp_path):
    pa, pb = _delta(tmp_path, "a", 3, seed=1), _delta(tmp_path, "b", 3, seed=2)
    hub.upload_delta(pa, "a", 3)
    hub.upload_delta(pb, "b", 3)
    reader = make_hub()
    da, db = reader.download("nodes/a/delta_3.safetensors"), reader.download("nodes/b/delta_3.safetensors")
    assert da != db and da.parent.parent == db.parent.parent == reader.cache_dir / "nodes"
    assert da.read_bytes() == pa.read_bytes() and db.read_bytes() == pb.read_bytes() and pa.read_bytes() != pb.read_bytes()
    assert not [p for p in reader.cache_dir.rglob("*") if p.name.endswith(".part")]


def test_cached_copy_reused_mutable_files_refetched(server, hub, tmp_path):
    hub.upload_delta(_delta(tmp_path, "a", 1), "a", 1)
    _publish(hub, tmp_path, 0, "00000000", None)
    hub.download("nodes/a/delta_1.safetensors")
    server.reset_log()
    hub.download("nodes/a/delta_1.safetensors")
    assert server.count() == 0
    hub.download("global/manifest.json")
    hub.download("global/manifest.json")
    assert server.count("resolve") == 2


def test_delta_never_overwritten(server, hub, make_hub, tmp_path):
    p1, p2 = _delta(tmp_path, "a", 5, seed=1), _delta(tmp_path, "a", 5, seed=2)
    hub.upload_delta(p1, "a", 5)
    other = make_hub()
    with pytest.raises(DeltaExistsError, match="never rewritten"):
        other.upload_delta(p2, "a", 5)
    assert server.files(REPO)["nodes/a/delta_5.safetensors"] == p1.read_bytes()
    n = len(server.commits(REPO))
    assert other.upload_delta(p1, "a", 5) == "nodes/a/delta_5.safetensors"  # same bytes: an earlier attempt, done
    assert len(server.commits(REPO)) == n


# ----------------------------------------------------------------------------- publishing


def test_publish_read_manifest_download_globals(server, hub, make_hub, tmp_path):
    m0, files0 = _version(tmp_path, 0, "0a0a0a0a")
    hub.publish(m0, files0, expected_outer_step=None)
    reader = make_hub()
    got = reader.read_manifest()
    assert got == m0
    for path, local in files0.items():
        assert reader.download(path).read_bytes() == local.read_bytes()
    assert reader.list_global() == sorted([*files0, "global/manifest.json"])
    with pytest.raises(PublishConflictError) as ei:
        _publish(hub, tmp_path, 1, "1b1b1b1b", None)
    assert ei.value.expected is None and ei.value.found == 0
    with pytest.raises(HubNotFoundError):
        reader.download("global/weights_000000009_deadbeef.safetensors")


def test_cas_race_exactly_one_winner(server, make_hub, tmp_path):
    _publish(make_hub(), tmp_path, 0, "00000000", None)
    n = 6
    hubs = [make_hub() for _ in range(n)]
    versions = [_version(tmp_path, 1, f"{i:08x}") for i in range(n)]
    results: list = [None] * n
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait()
        try:
            hubs[i].publish(versions[i][0], versions[i][1], expected_outer_step=0)
            results[i] = "won"
        except PublishConflictError as e:
            results[i] = e

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    winners = [i for i, r in enumerate(results) if r == "won"]
    assert len(winners) == 1, results
    w = winners[0]
    assert all(isinstance(r, PublishConflictError) and r.found == 1 for i, r in enumerate(results) if i != w)
    assert make_hub().read_manifest() == versions[w][0]
    on_hub = server.files(REPO)
    for i, (m, files) in enumerate(versions):  # losers wrote nothing: the commit is the only write
        assert all((p in on_hub) == (i == w) for p in files)
    assert sum("publish outer_step 1" in c.summary for c in server.commits(REPO)) == 1


def test_worker_commits_during_publication_do_not_fail_it(server, make_hub, tmp_path):
    master, worker = make_hub(), make_hub()
    _publish(master, tmp_path, 0, "00000000", None)
    fired = []

    def interleave(label):
        if label == "files" and len(fired) < 2:  # a worker commits between our read and our commit, twice
            fired.append(worker.upload_delta(_delta(tmp_path, "w", len(fired)), "w", len(fired)))

    faults.install(master, interleave)
    server.reset_log()
    m1 = _publish(master, tmp_path, 1, "11111111", 0)
    assert len(fired) == 2 and master.read_manifest() == m1
    assert [r.status for r in server.requests if r.route == "commit" and r.path.endswith("/commit/main")].count(412) == 2
    assert {"nodes/w/delta_0.safetensors", "nodes/w/delta_1.safetensors"} <= set(server.files(REPO))


def test_deletions_ride_in_the_publication_commit(server, hub, tmp_path):
    m0 = _publish(hub, tmp_path, 0, "00000000", None)
    hub.upload_delta(_delta(tmp_path, "a", 1), "a", 1)
    gone = "nodes/a/delta_99.safetensors"  # never existed: must not fail the commit
    before = len(server.commits(REPO))
    m1 = _publish(hub, tmp_path, 1, "11111111", 0, delete=[m0.weights, m0.outer_state, "nodes/a/delta_1.safetensors", gone])
    commits = server.commits(REPO)
    assert len(commits) == before + 1
    c = commits[-1]
    assert set(c.added) == {m1.weights, m1.outer_state, "global/manifest.json"}
    assert set(c.deleted) == {m0.weights, m0.outer_state, "nodes/a/delta_1.safetensors"}
    assert hub.list_deltas() == []
    with pytest.raises(InvalidNameError):
        hub.publish(m1, {}, expected_outer_step=0, delete=["global/manifest.json"])


def test_publish_keeps_history_files_and_checks_they_exist(server, hub, tmp_path):
    m0 = _publish(hub, tmp_path, 0, "00000000", None)
    hist = [GlobalVersion(0, m0.weights, m0.outer_state)]
    m1 = _publish(hub, tmp_path, 1, "11111111", 0, history=hist)
    assert hub.read_manifest().history == hist
    n = len(server.commits(REPO))
    m1b, files1b = _version(tmp_path, 2, "11111111")  # reuses a file name already on the hub
    files1b = {m1.weights: files1b[m1b.weights]}
    with pytest.raises(Exception, match="must be unique"):
        hub.publish(Manifest(**{**m1b.__dict__, "weights": m1.weights, "outer_state": None, "outer_state_sha256": None}),
                    files1b, expected_outer_step=1)
    assert len(server.commits(REPO)) == n
    m2, files2 = _version(tmp_path, 2, "22222222", history=[GlobalVersion(0, "global/weights_000000000_99999999.safetensors")])
    n = len(server.commits(REPO))
    with pytest.raises(Exception, match="neither uploaded now nor on"):
        hub.publish(m2, files2, expected_outer_step=1)
    assert len(server.commits(REPO)) == n and hub.read_manifest() == m1


def test_pinned_reads_survive_a_later_publication(server, make_hub, tmp_path):
    master, reader = make_hub(), make_hub()
    m0 = _publish(master, tmp_path, 0, "00000000", None)
    assert reader.read_manifest() == m0
    _publish(master, tmp_path, 1, "11111111", 0, delete=[m0.weights, m0.outer_state])
    assert m0.weights not in server.files(REPO)
    # the reader still gets the version it read: its files are fetched at the manifest's commit
    assert reader.download(m0.weights).read_bytes() == _version(tmp_path, 0, "00000000")[1][m0.weights].read_bytes()


@pytest.mark.parametrize("label", ["files", "locked", "committed", "manifest", "deleted"])
def test_a_crash_anywhere_in_a_publication_leaves_a_readable_hub(server, make_hub, tmp_path, label):
    """"files"/"locked" fire before the commit (old version stays), the others after it (new one)."""
    master = make_hub()
    m0 = _publish(master, tmp_path, 0, "00000000", None)
    master.upload_delta(_delta(tmp_path, "a", 1), "a", 1)
    n = len(server.commits(REPO))

    def crash(at):
        if at == label:
            raise KeyboardInterrupt(f"simulated crash at {at}")

    faults.install(master, crash)
    m1, files1 = _version(tmp_path, 1, "11111111", ledger={"a": 1})
    with pytest.raises(KeyboardInterrupt):
        master.publish(m1, files1, expected_outer_step=0, delete=[m0.weights, "nodes/a/delta_1.safetensors"])
    reader = make_hub()
    committed = label not in ("files", "locked")
    assert len(server.commits(REPO)) == n + committed
    current, local = (m1, files1) if committed else (m0, _version(tmp_path, 0, "00000000")[1])
    assert reader.read_manifest() == current
    assert all(reader.download(p).read_bytes() == local[p].read_bytes() for p in current.files())
    assert [r.path for r in reader.list_deltas()] == ([] if committed else ["nodes/a/delta_1.safetensors"])
    if not committed:  # the next attempt publishes normally
        faults.install(master, None)
        m1b = _publish(master, tmp_path, 1, "22222222", 0)
        assert reader.read_manifest() == m1b


# ----------------------------------------------------------------------------- lease


# ----------------------------------------------------------------------------- retries and errors


def test_503_twice_then_success(server, hub, tmp_path):
    server.reset_log()
    server.inject("commit", 503, count=2)
    hub.upload_delta(_delta(tmp_path, "a", 1), "a", 1)
    assert server.count("commit") == 3
    assert [r.status for r in server.requests if r.route == "commit"] == [503, 503, 200]


def test_lost_answers_to_applied_commits_are_idempotent(server, make_hub, tmp_path):
    """A commit lands but its answer is lost (503): the retry sees 412, re-reads, finds its own write."""
    hub = make_hub()
    _publish(hub, tmp_path, 0, "00000000", None)
    server.inject("commit", 503, count=1, apply=True)
    m1 = _publish(hub, tmp_path, 1, "11111111", 0)
    assert hub.read_manifest() == m1
    assert sum("publish outer_step 1" in c.summary for c in server.commits(REPO)) == 1
    server.inject("commit", 503, count=1, apply=True)
    p = _delta(tmp_path, "a", 1)
    assert hub.upload_delta(p, "a", 1) == "nodes/a/delta_1.safetensors"
    assert server.files(REPO)["nodes/a/delta_1.safetensors"] == p.read_bytes()
    server.inject("commit", 503, count=1, apply=True)
    lease = Lease("h:1", 1, 10.0, 1.0)
    hub.write_lease(lease, expected=None)
    assert hub.read_lease() == lease
    assert [r.status for r in server.requests if r.route == "commit"][-2:] == [503, 412]


def test_backoff_is_jittered_exponential_and_capped(make_hub):
    hub = make_hub(retry_base_delay=1.0, retry_max_delay=8.0)
    for attempt, full in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)]:
        ds = [hub.http.backoff(attempt) for _ in range(200)]
        assert all(full / 2 <= d <= full for d in ds) and len(set(ds)) > 100
    assert hub.http.backoff(1, retry_after=5.0) == 5.0 and hub.http.backoff(1, retry_after=100.0) == 100.0  # honoured
    from diloco_lightning.hub.hf import _retry_after

    assert _retry_after({"Retry-After": "7"}) == 7.0 and _retry_after({"RateLimit": '"api";r=0;t=42'}) == 42.0
    assert _retry_after({"RateLimit": '"api";r=5;t=42'}) is None and _retry_after({}) is None


def test_huggingface_hub_internal_retries_do_not_multiply_ours(server, hub, tmp_path):
    # tree pages and preupload go through huggingface_hub's own http_backoff (1 s, 2 s ... sleeps)
    server.reset_log()
    server.inject("tree", 503, count=2)
    server.inject("preupload", 502, count=1)
    t0 = time.monotonic()
    hub.upload_delta(_delta(tmp_path, "a", 1), "a", 1)
    assert hub.list_deltas()[0].local_step == 1
    assert time.monotonic() - t0 < 0.9  # no 1 s internal sleep happened
    assert server.count("tree") == 3 and server.count("preupload") == 2


def test_429_is_retried(server, hub, tmp_path):
    server.reset_log()
    server.inject("preupload", 429, count=1)
    server.inject("resolve", 429, count=1, method="GET")
    _publish(hub, tmp_path, 0, "00000000", None)
    assert server.count("preupload") == 2
    assert hub.read_manifest().outer_step == 0


def test_timeouts_are_retried(server, make_hub, tmp_path):
    hub = make_hub(timeout=0.2)
    server.inject("info", 0, count=1, delay=0.6)  # stalls past the client's timeout once
    server.reset_log()
    assert hub.http.head_commit() == server.head(REPO)
    deadline = time.monotonic() + 2
    while server.count("info") < 2 and time.monotonic() < deadline:  # the stalled request logs when it ends
        time.sleep(0.05)
    assert server.count("info") == 2


def test_retries_are_bounded(server, make_hub):
    hub = make_hub(max_retries=2)
    server.inject("tree", 503, count=50)
    server.reset_log()
    with pytest.raises(HubUnavailableError, match="3 attempt"):
        hub.list_deltas()
    assert server.count("tree") == 3


def test_401_surfaces_at_once_without_the_token(server, hub, tmp_path):
    server.reset_log()
    server.inject("commit", 401, count=5)
    with pytest.raises(HubAuthError) as ei:
        hub.upload_delta(_delta(tmp_path, "a", 1), "a", 1)
    assert server.count("commit") == 1
    assert "token" in str(ei.value) and TOKEN not in str(ei.value) and "401" in str(ei.value)
    server.clear_faults()
    server.inject("preupload", 403, count=1)
    with pytest.raises(HubAuthError, match="403"):
        hub.upload_delta(_delta(tmp_path, "a", 2), "a", 2)


def test_wrong_token_is_an_auth_error(tmp_path):
    with FakeHubServer(token="right-token") as s:
        s.create_repo(REPO)
        with pytest.raises(HubAuthError) as ei:
            open_hub(f"hf://{REPO}", endpoint=s.endpoint, token=TOKEN, cache_dir=tmp_path, max_retries=3)
        # no retry: create_repo's own fallback (401 on create -> repo_info) is the only second call
        assert TOKEN not in str(ei.value) and s.count("create") == 1 and s.count() <= 2
        ok = open_hub(f"hf://{REPO}", endpoint=s.endpoint, token="right-token", cache_dir=tmp_path)
        assert ok.list_deltas() == []


@pytest.mark.parametrize("status", [404, 409, 412])
def test_no_retry_on_client_errors(server, hub, status):
    server.reset_log()
    server.inject("info", status, count=5)
    with pytest.raises(HubError) as ei:
        hub.http.head_commit()
    assert not isinstance(ei.value, HubUnavailableError)
    assert server.count("info") == 1


def test_missing_repo_is_not_found(server, tmp_path):
    with pytest.raises(HubNotFoundError, match="not found"):
        open_hub("hf://org/missing", endpoint=server.endpoint, token=TOKEN, cache_dir=tmp_path, create=False)
    assert server.count("info") == 1
    hub = open_hub("hf://org/created", endpoint=server.endpoint, token=TOKEN, cache_dir=tmp_path)
    assert "org/created" in server.repos and hub.read_manifest() is None


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("node", ["a/b", "..", ".hidden", "a b", "x" * 65, "", "ü", "a\\b", "../global"])
def test_bad_node_ids_write_nothing(server, hub, tmp_path, node):
    p = _delta(tmp_path, "ok", 1)
    server.reset_log()
    with pytest.raises(InvalidNameError, match="node_id"):
        hub.upload_delta(p, node, 1)
    with pytest.raises(InvalidNameError):
        hub.upload_init(p, node)
    assert server.count() == 0


@pytest.mark.parametrize("path", ["nodes/a/x.bin", "global/../x", "global/sub/x", "../x", "/etc/passwd", "README.md",
                                  "global/manifest.json", "nodes/a/../../x"])
def test_paths_outside_the_layout_are_refused(server, hub, tmp_path, path):
    m, files = _version(tmp_path, 0, "00000000")
    server.reset_log()
    with pytest.raises(InvalidNameError):
        hub.publish(m, {**files, path: files[m.weights]}, expected_outer_step=None)
    if path != "global/manifest.json":
        with pytest.raises(InvalidNameError):
            hub.download(path)
    assert server.count() == 0
    assert not hub.cache_dir.exists() or not any(hub.cache_dir.rglob("*"))


def test_manifest_naming_a_file_outside_global(server, hub, tmp_path):
    m, files = _version(tmp_path, 0, "00000000")
    bad = Manifest(**{**m.__dict__, "weights": "../x"})
    server.reset_log()
    with pytest.raises((ManifestError, InvalidNameError), match=r"\.\./x"):
        hub.publish(bad, files, expected_outer_step=None)
    assert server.count() == 0
    # a hostile manifest planted on the hub: a clear error, nothing downloaded or written
    doc = m.to_json().replace(m.weights, "../../etc/passwd")
    server.commit_files(REPO, {"global/manifest.json": doc.encode()})
    with pytest.raises(ManifestError, match="passwd"):
        hub.read_manifest()
    n = len(server.commits(REPO))
    with pytest.raises(ManifestError):
        hub.publish(m, files, expected_outer_step=None)
    assert len(server.commits(REPO)) == n
    assert not hub.cache_dir.exists() or not any(hub.cache_dir.rglob("*"))


def test_bad_repo_ids_and_options(server, tmp_path):
    for bad in ("hf://a/b/c", "hf://nobody", "hf://a/..b", "hf://a/b--c", "hf:///"):
        with pytest.raises(ValueError, match="repo id"):
            open_hub(bad, endpoint=server.endpoint, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="endpoint"):
        open_hub(f"hf://{REPO}", endpoint="ftp://x", cache_dir=tmp_path)
    assert server.count() == 0


# ----------------------------------------------------------------------------- cost


def test_request_counts(server, hub, tmp_path):
    """HTTP calls per operation (a regression here costs rate limit on the real Hub). huggingface_hub
    < 1.0 adds a repo_info call (xet check) per preupload_lfs_files; 2.x does not."""

    def routes():
        got = [r.route for r in server.requests]
        assert got.count("info") <= 2
        server.reset_log()
        return [r for r in got if r != "info"]

    _publish(hub, tmp_path, 0, "00000000", None)
    p = _delta(tmp_path, "a", 1)
    server.reset_log()
    hub.upload_delta(p, "a", 1)
    assert routes() == ["resolve", "preupload", "commit"]  # HEAD (absent? + head sha), upload mode, commit
    m0 = hub.read_manifest()
    server.reset_log()
    _publish(hub, tmp_path, 1, "11111111", 0, delete=[m0.weights, m0.outer_state])
    assert routes() == ["resolve", "paths_info", "preupload", "commit"]  # manifest + head, deletions, upload, commit
    _publish(hub, tmp_path, 2, "22222222", 1)
    assert routes() == ["resolve", "paths_info", "preupload", "commit"]
    hub.list_deltas()
    assert routes() == ["tree"]
