"""The :class:`~diloco_lightning.hub.base.Hub` contract, once, on every transport: a folder
(``file``), the loopback Hugging Face Hub (``hf``: one repository; ``hf_nodes``: a repository per
node, ``layout=per_node``) and S3 (moto behind the proxy, ``s3``): the ``transport`` fixture.

What every transport promises, seen only through the interface (each test reads back with a
second hub instance, as another process would): a delta is stored and read back bit-exact, and
never overwritten (one winner when writers race); a node's init file is its first writer's; a
publication is compare-and-swap on the published outer step, exactly one racer wins, and what it
published is what any reader gets; the master's lease is compare-and-swap too; a bad node id
writes nothing. What only one transport does (its retries, request counts, its layout on disk,
crash points, process races) stays in its own file (tests/test_hub_<transport>.py).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from diloco_lightning.hub.base import DeltaExistsError, Hub, HubNotFoundError, LeaseConflictError, PublishConflictError
from diloco_lightning.wire.delta import read_delta, write_delta
from diloco_lightning.wire.claims import NodeClaim
from diloco_lightning.wire.manifest import Lease, Manifest
from diloco_lightning.wire.names import InvalidNameError, global_outer_state_path, global_weights_path

MakeHub = Callable[[], Hub]


@pytest.fixture
def make_hub(transport) -> MakeHub:
    """A factory of hub handles on one fresh store of each transport (``tests/support/transports.py``;
    each handle with its own cache, as another machine would open it)."""
    made: list[Hub] = []

    def make() -> Hub:
        hub = transport.open()
        made.append(hub)
        return hub

    yield make
    for hub in made:
        hub.close()


# ----------------------------------------------------------------------------- helpers


def _delta(tmp_path: Path, node: str, step: int, seed: int, dtype=torch.float32) -> tuple[Path, dict]:
    g = torch.Generator().manual_seed(seed)
    tensors = {"w": torch.randn(8, 4, generator=g).to(dtype), "b": torch.randn(4, generator=g).to(dtype)}
    path = tmp_path / "local" / f"{node}_{step}_{seed}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_delta(path, tensors, node_id=node, local_step=step, base_outer_step=0, num_tokens=seed)
    return path, tensors


def _blob(tmp_path: Path, name: str, size: int = 300, seed: int = 0) -> Path:
    p = tmp_path / "local" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(hashlib.sha256(f"{name}{seed}".encode()).digest() * (size // 32 + 1))
    return p


def _version(tmp_path: Path, step: int, token: str) -> tuple[Manifest, dict[str, Path]]:
    """A version's manifest and its two files (opaque bytes: the hub checks names and hashes, not content)."""
    w, s = global_weights_path(step, token), global_outer_state_path(step, token)
    files = {w: _blob(tmp_path, f"w{step}{token}", seed=step), s: _blob(tmp_path, f"s{step}{token}", 100, seed=step)}
    sha = {k: hashlib.sha256(p.read_bytes()).hexdigest() for k, p in files.items()}
    m = Manifest(outer_step=step, weights=w, weights_sha256=sha[w], model_fingerprint="0" * 64, ledger={"a": step},
                 outer_state=s, outer_state_sha256=sha[s], optimizer={"name": "nesterov"}, history=[],
                 master={"holder": f"m-{token}", "epoch": 1}, published_at=1000.0 + step)
    return m, files


def _race(n: int, attempt: Callable[[int], object]) -> list[object]:
    """``attempt(i)`` on ``n`` threads released together; each one's result or exception."""
    barrier = threading.Barrier(n)
    out: list[object] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            out[i] = attempt(i)
        except Exception as e:  # noqa: BLE001 - the test looks at which kind
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


# ----------------------------------------------------------------------------- deltas


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_delta_reads_back_bit_exact(make_hub, tmp_path, dtype):
    writer, reader = make_hub(), make_hub()
    path, tensors = _delta(tmp_path, "a", 3, seed=1, dtype=dtype)
    assert writer.upload_delta(path, "a", 3) == "nodes/a/delta_3.safetensors"
    refs = reader.list_deltas()
    assert [r.identity for r in refs] == [("a", 3)]
    assert reader.list_deltas(after={"a": 3}) == []
    got = reader.download_delta(refs[0])
    assert got.read_bytes() == path.read_bytes() and refs[0].size == got.stat().st_size
    delta = read_delta(got, hub_path=refs[0].path)
    assert delta.header == read_delta(path).header
    assert all(torch.equal(delta.tensors[k], tensors[k]) and delta.tensors[k].dtype == dtype for k in tensors)
    with pytest.raises(HubNotFoundError):
        reader.download("nodes/a/delta_4.safetensors")


def test_a_delta_is_never_overwritten(make_hub, tmp_path):
    first, _ = _delta(tmp_path, "a", 5, seed=1)
    second, _ = _delta(tmp_path, "a", 5, seed=2)
    make_hub().upload_delta(first, "a", 5)
    other = make_hub()
    with pytest.raises(DeltaExistsError):
        other.upload_delta(second, "a", 5)
    assert make_hub().download("nodes/a/delta_5.safetensors").read_bytes() == first.read_bytes()
    other.upload_delta(second, "b", 5)  # the same step of another node is another file
    assert sorted(r.identity for r in make_hub().list_deltas()) == [("a", 5), ("b", 5)]


def test_racing_writers_of_one_delta_one_wins(make_hub, tmp_path):
    hubs = [make_hub() for _ in range(4)]
    paths = [_delta(tmp_path, "a", 1, seed=i)[0] for i in range(4)]
    out = _race(4, lambda i: hubs[i].upload_delta(paths[i], "a", 1))
    winners = [i for i, r in enumerate(out) if isinstance(r, str)]
    assert len(winners) == 1, out
    assert all(isinstance(r, DeltaExistsError) for i, r in enumerate(out) if i != winners[0]), out
    assert make_hub().download("nodes/a/delta_1.safetensors").read_bytes() == paths[winners[0]].read_bytes()


def test_an_init_file_is_its_first_writers(make_hub, tmp_path):
    a, b = _blob(tmp_path, "i1", seed=1), _blob(tmp_path, "i2", seed=2)
    assert make_hub().upload_init(a, "n0") == "nodes/n0/init.safetensors"
    assert make_hub().upload_init(b, "n0") == "nodes/n0/init.safetensors"  # no error: the first one stands
    reader = make_hub()
    assert reader.list_inits() == ["n0"] and reader.list_deltas() == []
    assert reader.download("nodes/n0/init.safetensors").read_bytes() == a.read_bytes()


@pytest.mark.parametrize("node", ["../x", "a/b", "", "x" * 65, ".hidden", "bad name"])
def test_a_bad_node_id_writes_nothing(make_hub, tmp_path, node):
    hub = make_hub()
    path, _ = _delta(tmp_path, "a", 1, seed=1)
    with pytest.raises(InvalidNameError, match="node_id"):
        hub.upload_delta(path, node, 1)
    with pytest.raises(InvalidNameError, match="node_id"):
        hub.upload_init(path, node)
    reader = make_hub()
    assert reader.list_deltas() == [] and reader.list_inits() == []


# ----------------------------------------------------------------------------- publications and the lease


def test_a_publication_is_what_every_reader_gets_and_needs_the_expected_version(make_hub, tmp_path):
    master = make_hub()
    assert master.read_manifest() is None
    m0, files0 = _version(tmp_path, 0, "0a0a0a0a")
    master.publish(m0, files0, expected_outer_step=None)
    reader = make_hub()
    assert reader.read_manifest() == m0
    for path, local in files0.items():
        assert reader.download(path).read_bytes() == local.read_bytes()
    assert set(files0) <= set(reader.list_global())
    m1, files1 = _version(tmp_path, 1, "1b1b1b1b")
    with pytest.raises(PublishConflictError) as e:
        reader.publish(m1, files1, expected_outer_step=None)  # it is not the first version any more
    assert e.value.found == 0
    reader.publish(m1, files1, expected_outer_step=0)
    assert make_hub().read_manifest() == m1


def test_racing_publications_one_wins(make_hub, tmp_path):
    make_hub().publish(*_version(tmp_path, 0, "0a0a0a0a"), expected_outer_step=None)
    hubs = [make_hub() for _ in range(4)]
    versions = [_version(tmp_path, 1, f"{i}c{i}c{i}c{i}c") for i in range(4)]
    out = _race(4, lambda i: hubs[i].publish(*versions[i], expected_outer_step=0))
    losers = [r for r in out if isinstance(r, PublishConflictError)]
    assert len(losers) == 3, out
    won = next(i for i, r in enumerate(out) if not isinstance(r, Exception))
    assert make_hub().read_manifest() == versions[won][0]


def test_the_lease_is_compare_and_swap(make_hub):
    a, b = make_hub(), make_hub()
    la, lb = Lease("host:1:a", 1, 2000.0, 1000.0), Lease("host:2:b", 2, 3000.0, 1000.0)
    assert a.read_lease() is None
    a.write_lease(la, expected=None)
    with pytest.raises(LeaseConflictError):
        b.write_lease(lb, expected=None)
    assert b.read_lease() == la
    b.write_lease(lb, expected=la)
    with pytest.raises(LeaseConflictError):
        a.write_lease(Lease("host:1:a", 1, 4000.0, 2000.0), expected=la)
    b.write_lease(None, expected=lb)
    assert a.read_lease() is None
    hubs = [make_hub() for _ in range(4)]
    leases = [Lease(f"h:{i}", 3, 5000.0 + i, 1.0) for i in range(4)]
    out = _race(4, lambda i: hubs[i].write_lease(leases[i], expected=None))
    won = [i for i, r in enumerate(out) if r is None]
    assert len(won) == 1 and all(isinstance(r, LeaseConflictError) for r in out if r is not None), out
    assert make_hub().read_lease() == leases[won[0]]


# ----------------------------------------------------------------------------- every transport is covered


def test_every_registered_transport_has_a_test_store():
    """The ``transport`` fixture runs every registered transport: each needs a store in tests/support."""
    from support.transports import KINDS_OF_SCHEME

    from diloco_lightning.hub import TRANSPORTS

    assert set(TRANSPORTS) <= set(KINDS_OF_SCHEME), "a registered transport has no test store"


# ----------------------------------------------------------------------------- the rest of the interface


def test_a_nodes_deltas_and_its_own_listing(make_hub, tmp_path):
    writer, reader = make_hub(), make_hub()
    for node, step in [("a", 1), ("a", 2), ("b", 1)]:
        writer.upload_delta(_delta(tmp_path, node, step, seed=step)[0], node, step)
    assert [r.identity for r in reader.list_node_deltas("a")] == [("a", 1), ("a", 2)]
    assert [r.identity for r in reader.list_node_deltas("a", after=1)] == [("a", 2)]
    assert reader.list_node_deltas("c") == []
    assert [r.identity for r in reader.list_deltas(after={"a": 1})] == [("a", 2), ("b", 1)]


def test_the_manifest_bytes_are_what_was_published(make_hub, tmp_path):
    master = make_hub()
    assert master.read_manifest_bytes() is None
    m0, files0 = _version(tmp_path, 0, "0a0a0a0a")
    master.publish(m0, files0, expected_outer_step=None)
    data = make_hub().read_manifest_bytes()
    assert data is not None and Manifest.from_json(data) == m0


def test_a_publication_may_replace_a_manifest_by_its_digest(make_hub, tmp_path):
    master = make_hub()
    master.publish(*_version(tmp_path, 0, "0a0a0a0a"), expected_outer_step=None)
    digest = hashlib.sha256(master.read_manifest_bytes() or b"").hexdigest()
    m1, files1 = _version(tmp_path, 1, "1b1b1b1b")
    with pytest.raises(PublishConflictError):
        master.publish(m1, files1, expected_outer_step=None, expected_digest="0" * 64)
    make_hub().publish(m1, files1, expected_outer_step=None, expected_digest=digest)
    assert make_hub().read_manifest() == m1


def test_a_publication_deletes_and_writes_its_mirrors(make_hub, tmp_path):
    from diloco_lightning.wire.names import MIRROR_PATHS

    master = make_hub()
    m0, files0 = _version(tmp_path, 0, "0a0a0a0a")
    master.publish(m0, files0, expected_outer_step=None)
    m1, files1 = _version(tmp_path, 1, "1b1b1b1b")
    latest, count = sorted(MIRROR_PATHS)
    weights = _blob(tmp_path, "latest", seed=9)
    master.publish(m1, files1, expected_outer_step=0, delete=sorted(files0), mirrors={latest: weights, count: b'{"n": 1}'})
    reader = make_hub()
    assert reader.read_manifest() == m1
    left = set(reader.list_global())
    assert not left & set(files0) and set(files1) <= left
    assert reader.download(latest).read_bytes() == weights.read_bytes()
    assert reader.download(count).read_bytes() == b'{"n": 1}'
    m2, files2 = _version(tmp_path, 2, "2c2c2c2c")
    with pytest.raises(InvalidNameError):  # a refused publication (it deletes what it names) writes nothing
        master.publish(m2, files2, expected_outer_step=1, delete=sorted(files2))
    with pytest.raises(InvalidNameError):  # a mirror is no file of a publication's
        master.publish(m2, {**files2, latest: weights}, expected_outer_step=1)
    reader = make_hub()
    assert reader.read_manifest() == m1 and not set(files2) & set(reader.list_global())


def test_delete_removes_files_and_ignores_missing_ones(make_hub, tmp_path):
    writer = make_hub()
    writer.upload_delta(_delta(tmp_path, "a", 1, seed=1)[0], "a", 1)
    writer.upload_delta(_delta(tmp_path, "a", 2, seed=2)[0], "a", 2)
    make_hub().delete(["nodes/a/delta_1.safetensors", "nodes/a/delta_9.safetensors"])
    reader = make_hub()
    assert [r.identity for r in reader.list_deltas()] == [("a", 2)]
    with pytest.raises(HubNotFoundError):
        reader.download("nodes/a/delta_1.safetensors")
    with pytest.raises(InvalidNameError):
        reader.delete(["../outside"])


def test_a_download_over_its_limit_is_refused(make_hub, tmp_path):
    from diloco_lightning.hub.base import HubFileTooLargeError

    path, _ = _delta(tmp_path, "a", 1, seed=1)
    make_hub().upload_delta(path, "a", 1)
    reader = make_hub()
    size = path.stat().st_size
    with pytest.raises(HubFileTooLargeError):
        reader.download("nodes/a/delta_1.safetensors", max_bytes=size - 1)
    assert reader.download("nodes/a/delta_1.safetensors", max_bytes=size).read_bytes() == path.read_bytes()


def test_a_released_copy_and_a_swept_cache_leave_the_hub_as_it_was(make_hub, tmp_path):
    path, _ = _delta(tmp_path, "a", 1, seed=1)
    make_hub().upload_delta(path, "a", 1)
    reader = make_hub()
    ref = reader.list_deltas()[0]
    got = reader.download_delta(ref)
    reader.release(got)
    assert got.exists() != reader.private_downloads  # a private copy is gone; a file in place stays
    again = reader.download_delta(ref)
    assert again.read_bytes() == path.read_bytes()
    swept = reader.sweep_cache(0.0) + reader.sweep(0.0)
    assert all(isinstance(p, str) for p in swept)
    assert make_hub().download_delta(ref).read_bytes() == path.read_bytes()


def test_without_a_write_limit_a_writer_need_not_wait(make_hub):
    hub = make_hub()  # the test stores set no commit budget (commits_per_hour=0)
    assert hub.commit_wait() == 0.0 and hub.commit_wait("a") == 0.0


def test_a_closed_handle_and_a_context_managed_one(make_hub, tmp_path):
    with make_hub() as hub:
        assert isinstance(hub, Hub)
        hub.upload_init(_blob(tmp_path, "i", seed=1), "n0")
    hub.close()  # closing twice is harmless
    assert make_hub().list_inits() == ["n0"]


# ----------------------------------------------------------------------------- node claims


def _claim(node: str, holder: str, epoch: int = 1) -> NodeClaim:
    now = time.time()
    return NodeClaim(node, holder, epoch, now, now, now + 600, {"steps": epoch})


def test_a_claim_is_compare_and_swap(make_hub):
    from diloco_lightning.hub.base import ClaimConflictError

    a, b = make_hub(), make_hub()
    assert a.read_claim("n0") is None and a.list_claims() == {}
    ca, cb = _claim("n0", "host:1:a"), _claim("n0", "host:2:b", 2)
    a.write_claim("n0", ca, expected=None)
    with pytest.raises(ClaimConflictError):
        b.write_claim("n0", cb, expected=None)
    assert b.read_claim("n0") == ca
    b.write_claim("n0", cb, expected=ca)
    with pytest.raises(ClaimConflictError):
        a.write_claim("n0", _claim("n0", "host:1:a", 3), expected=ca)
    other = _claim("n1", "host:3:c")
    a.write_claim("n1", other, expected=None)
    assert make_hub().list_claims() == {"n0": cb, "n1": other}
    b.write_claim("n0", None, expected=cb)
    reader = make_hub()
    assert reader.read_claim("n0") is None and reader.list_claims() == {"n1": other}


def test_racing_claims_one_wins(make_hub):
    from diloco_lightning.hub.base import ClaimConflictError

    hubs = [make_hub() for _ in range(4)]
    claims = [_claim("n0", f"h:{i}:w") for i in range(4)]
    out = _race(4, lambda i: hubs[i].write_claim("n0", claims[i], expected=None))
    won = [i for i, r in enumerate(out) if r is None]
    assert len(won) == 1 and all(isinstance(r, ClaimConflictError) for r in out if r is not None), out
    assert make_hub().read_claim("n0") == claims[won[0]]
