"""The s3:// transport against a real S3 server on 127.0.0.1 (moto's ``ThreadedMotoServer``),
reached through a fault-injecting loopback proxy (tests/support/s3_proxy.py) that also logs requests.

Races use real threads and real processes; crashes are simulated by raising from
``S3Hub.fault`` and by ``kill -9`` of a subprocess at each point of a publication. Each test
gets a bucket of its own; credentials are fake and set for this module only.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import unquote

import pytest
import torch

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

from support.s3_proxy import S3Proxy  # noqa: E402

from diloco_lightning.util import faults  # noqa: E402
from diloco_lightning.wire.delta import read_delta, write_delta  # noqa: E402
from diloco_lightning.util.fileio import sha256_file  # noqa: E402
from diloco_lightning.hub.versions import load_global, load_outer_state, stage_global  # noqa: E402
from diloco_lightning.hub import (  # noqa: E402
    DeltaExistsError,
    DeltaRef,
    HubAuthError,
    HubError,
    HubNotFoundError,
    LeaseConflictError,
    PublishConflictError,
    open_hub,
)
from diloco_lightning.hub.s3 import HubUnavailableError, S3Hub, parse_s3_url  # noqa: E402
from diloco_lightning.wire.manifest import GlobalVersion, Lease, ManifestError  # noqa: E402
from diloco_lightning.wire.names import InvalidNameError  # noqa: E402
from support.racers import run_racers  # noqa: E402

ACCESS_KEY = "AKIDLOOPBACKTEST0001"
SECRET_KEY = "loopbackSECRETvalue0123456789abcdef"
MiB = 1 << 20
PREFIX = "runs/r1"


# ----------------------------------------------------------------------------- the store


@pytest.fixture(scope="session")
def aws_env():
    """Fake credentials, no config files, no instance metadata: nothing real is ever reached."""
    fake = {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_EC2_METADATA_DISABLED": "true",
    }
    drop = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
            "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "AWS_REGION")
    saved = {k: os.environ.get(k) for k in (*fake, *drop)}
    os.environ.update(fake)
    for k in drop:
        os.environ.pop(k, None)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def moto_endpoint(aws_env):
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="session")
def _proxy(moto_endpoint):
    with S3Proxy(moto_endpoint) as p:
        yield p


@pytest.fixture
def proxy(_proxy):
    _proxy.clear_faults()
    _proxy.reset_log()
    yield _proxy
    _proxy.clear_faults()


class Store:
    """Direct access to the bucket, bypassing the hub and the proxy."""

    def __init__(self, endpoint: str) -> None:
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        self.bucket = f"t-{uuid.uuid4().hex[:16]}"
        self.client.create_bucket(Bucket=self.bucket)

    def keys(self, prefix: str = "") -> list[str]:
        out, kw = [], {"Bucket": self.bucket, "Prefix": prefix}
        while True:
            page = self.client.list_objects_v2(**kw)
            out += [o["Key"] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return sorted(out)
            kw["ContinuationToken"] = page["NextContinuationToken"]

    def hub_paths(self) -> list[str]:
        return [k[len(PREFIX) + 1:] for k in self.keys(PREFIX + "/")]

    def get(self, hub_path: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=f"{PREFIX}/{hub_path}")["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def uploads(self) -> list[str]:
        return [u["Key"] for u in self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])]


@pytest.fixture
def store(moto_endpoint) -> Store:
    return Store(moto_endpoint)


@pytest.fixture
def make_hub(store, proxy, tmp_path):
    n = [0]

    def make(prefix: str = PREFIX, **kw) -> S3Hub:
        """Another machine's hub on the same store (the ``hub`` fixture probed the store already)."""
        n[0] += 1
        opts = {"endpoint_url": proxy.endpoint, "addressing_style": "path", "cache_dir": tmp_path / f"cache{n[0]}",
                "max_retries": 3, "retry_base_delay": 0.001, "retry_max_delay": 0.01, "timeout": 10,
                "check_conditional_writes": False}
        opts.update(kw)
        return open_hub(f"s3://{store.bucket}/{prefix}", **opts)

    return make


@pytest.fixture
def hub(make_hub) -> S3Hub:
    return make_hub(check_conditional_writes=True)  # every test opens one hub the way users do


# ----------------------------------------------------------------------------- helpers


def _delta(tmp_path: Path, node: str, step: int, dtype=torch.float32, seed: int = 0, base: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    tensors = {"layer.weight": torch.randn(8, 5, generator=g).to(dtype), "layer.bias": torch.randn(5, generator=g).to(dtype)}
    p = tmp_path / "local" / f"{node}_{step}_{seed}_{uuid.uuid4().hex[:6]}.safetensors"
    write_delta(p, tensors, node_id=node, local_step=step, base_outer_step=base)
    return p


def _blob(tmp_path: Path, name: str, size: int = 300, seed: int = 0) -> Path:
    p = tmp_path / "local" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    block = hashlib.sha256(f"{name}{seed}".encode()).digest()
    p.write_bytes((block * (size // 32 + 1))[:size])
    return p


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g), "count": torch.tensor(seed)}


def _outer(seed: int) -> dict:
    return {"t": seed, "m": {"w": torch.full((8, 4), float(seed))}}


def _same_state(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _publish_v0(hub: S3Hub, tmp_path: Path):
    s0 = stage_global(tmp_path / "stage0", 0, _state(0), _outer(0))
    m0 = s0.manifest(ledger={"a": 1})
    hub.publish(m0, s0.files, expected_outer_step=None)
    return s0, m0


_PRELUDE = """
import json, os, sys, time
from diloco_lightning.hub.s3 import S3Hub
from diloco_lightning.hub.base import DeltaExistsError, PublishConflictError
from diloco_lightning.wire.manifest import Manifest
args = json.loads(sys.argv[1])
hub = S3Hub(args["bucket"], args["prefix"], endpoint_url=args["endpoint"], addressing_style="path",
            cache_dir=args["cache"], max_retries=3, retry_base_delay=0.001, retry_max_delay=0.01,
            check_conditional_writes=False)
print("READY", flush=True)
deadline = time.monotonic() + 30
while not os.path.exists(args["go"]):
    if time.monotonic() > deadline:
        sys.exit("no go signal")
    time.sleep(0.0005)
"""

_UPLOAD = _PRELUDE + """
try:
    hub.upload_delta(args["src"], args["node"], args["step"])
    result = "WIN"
except DeltaExistsError:
    result = "EXISTS"
assert "torch" not in sys.modules and "lightning" not in sys.modules
print(result, flush=True)
"""

_PUBLISH = _PRELUDE + """
import signal
kill_at = args.get("kill_at")
if kill_at is not None:
    seen = []
    def fault(at):
        seen.append(at)
        if len(seen) - 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    from diloco_lightning.util import faults
    faults.install(hub, fault)
manifest = Manifest.from_json(open(args["manifest"]).read())
try:
    hub.publish(manifest, args["files"], expected_outer_step=args["expected"], delete=args.get("delete", []))
    result = "WIN"
except PublishConflictError as e:
    result = "CONFLICT " + str(e)
print(result, flush=True)
"""


def _proc_args(store: Store, proxy: S3Proxy, tmp_path: Path, prefix: str = PREFIX, **kw) -> dict:
    return dict(bucket=store.bucket, prefix=prefix, endpoint=proxy.endpoint, cache=str(tmp_path / f"pc_{uuid.uuid4().hex}"), **kw)


# ----------------------------------------------------------------------------- opening


def test_urls_and_options(store, proxy, tmp_path):
    assert parse_s3_url("s3://bkt") == ("bkt", "")
    assert parse_s3_url("s3://bkt/") == ("bkt", "")
    assert parse_s3_url("s3://my.bucket-1/a/b_c/d=1/") == ("my.bucket-1", "a/b_c/d=1")
    for bad in ("s3://", "s3://b", "s3://-bkt/x", "s3://bkt/a//b", "s3://bkt/a/../b", "s3://bkt/./x", "s3://bkt/x?y=1",
                "s3://bkt/x#f", "s3://bkt/a b", "s3://bk..t/x", "s3://bkt/ü"):
        with pytest.raises(ValueError, match="S3 URL|bucket"):
            parse_s3_url(bad)
    common = dict(endpoint_url=proxy.endpoint, addressing_style="path", cache_dir=tmp_path / "c")
    hub = open_hub(f"s3://{store.bucket}/{PREFIX}/", **common, token=None, endpoint=None)  # unset hf options are fine
    assert isinstance(hub, S3Hub) and hub.url == f"s3://{store.bucket}/{PREFIX}" and hub.store.prefix == PREFIX
    assert hub.cache_dir == tmp_path / "c" and hub.store.conditional_multipart
    assert not store.keys()  # the probe object is gone
    default = open_hub(f"s3://{store.bucket}", endpoint_url=proxy.endpoint, addressing_style="path")
    assert default.url == f"s3://{store.bucket}" and default.cache_dir != hub.cache_dir
    with pytest.raises(ValueError, match=r"\['endpoint'\].*endpoint_url"):
        open_hub(f"s3://{store.bucket}/x", endpoint="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="addressing_style"):
        open_hub(f"s3://{store.bucket}/x", addressing_style="sideways")
    with pytest.raises(ValueError, match="part_size"):
        open_hub(f"s3://{store.bucket}/x", part_size=1 * MiB)
    with pytest.raises(ValueError, match="endpoint_url"):
        open_hub(f"s3://{store.bucket}/x", endpoint_url="ftp://x")
    with pytest.raises(ValueError, match="unsupported URL scheme.*s3://bucket/prefix"):
        open_hub("gs://bucket/x")


def test_without_boto3_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 now raises ImportError
    with pytest.raises(HubError, match=r"pip install 'diloco-lightning\[s3\]'"):
        open_hub("s3://bkt/x")


def test_missing_bucket_is_not_found(proxy, tmp_path):
    with pytest.raises(HubNotFoundError, match="does not exist"):
        open_hub("s3://no-such-bucket-here/x", endpoint_url=proxy.endpoint, addressing_style="path", cache_dir=tmp_path)
    assert proxy.count() == 1  # refused at the first request, not retried


def test_store_ignoring_conditional_writes_is_refused(store, moto_endpoint, tmp_path):
    with S3Proxy(moto_endpoint, strip_conditionals=True) as bad:
        with pytest.raises(HubError, match="does not honour conditional writes.*If-None-Match") as ei:
            open_hub(f"s3://{store.bucket}/{PREFIX}", endpoint_url=bad.endpoint, addressing_style="path", cache_dir=tmp_path)
        assert "If-Match" in str(ei.value) and "412" in str(ei.value)
    assert not store.keys()  # the probe cleaned up after itself


def test_store_ignoring_if_match_only_is_refused(store, moto_endpoint, tmp_path):
    with S3Proxy(moto_endpoint, strip_conditionals=lambda r: "if-match" in r.headers) as bad:
        with pytest.raises(HubError, match="'If-Match: <another etag>' succeeded"):
            open_hub(f"s3://{store.bucket}/{PREFIX}", endpoint_url=bad.endpoint, addressing_style="path", cache_dir=tmp_path)


# ----------------------------------------------------------------------------- deltas


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_delta_round_trip_bit_exact(store, hub, tmp_path, dtype):
    local = {(n, s): _delta(tmp_path, n, s, dtype, seed=10 * i + s) for i, n in enumerate(("w0", "w1")) for s in (0, 7)}
    for (n, s), p in local.items():
        assert hub.upload_delta(p, n, s) == f"nodes/{n}/delta_{s}.safetensors"
    assert store.keys() == sorted(f"{PREFIX}/nodes/{n}/delta_{s}.safetensors" for n, s in local)
    refs = hub.list_deltas()
    assert [(r.node_id, r.local_step) for r in refs] == sorted(local)
    for r in refs:
        got = hub.download_delta(r)
        assert got == hub.cache_dir / r.path and got.read_bytes() == local[r.identity].read_bytes()
        assert r.size == got.stat().st_size
        d, ref = read_delta(got, hub_path=r.path), read_delta(local[r.identity])
        assert d.header == ref.header
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert all(d.tensors[k].dtype == dtype and d.tensors[k].view(bits).equal(t.view(bits)) for k, t in ref.tensors.items())


def test_listing_numeric_ledger_pages_and_junk(store, proxy, hub, tmp_path, caplog):
    steps = [0, 1, 2, 9, 10, 11, 25, 99, 100, 250, 1000]
    src = _delta(tmp_path, "a", 0)
    for s in steps:
        hub.upload_delta(src, "a", s)
    hub.upload_delta(src, "b", 3)
    hub.upload_init(src, "a")
    for key in (f"{PREFIX}/nodes/bad node/delta_1.safetensors", f"{PREFIX}/nodes/a/delta_01.safetensors",
                f"{PREFIX}/nodes/a/notes.txt", f"{PREFIX}/nodes/.hidden/delta_1.safetensors",
                f"{PREFIX}/nodes/a/sub/delta_4.safetensors", f"{PREFIX}/global/sub/x", f"{PREFIX}/global/.hidden",
                f"{PREFIX}x/nodes/a/delta_5.safetensors", f"{PREFIX}/other/delta_6.safetensors",
                "runs/r2/nodes/a/delta_7.safetensors", f"{PREFIX}/global/weights_000000001_abcdef01.safetensors"):
        store.put(key, b"junk")
    hub.store.list_page_size = 4
    proxy.reset_log()
    with caplog.at_level(logging.WARNING, logger="diloco_lightning.hub.s3"):
        for _ in range(2):
            refs = hub.list_deltas()
    assert [(r.node_id, r.local_step) for r in refs] == [("a", s) for s in steps] + [("b", 3)]
    assert all(isinstance(r, DeltaRef) and r.size == src.stat().st_size for r in refs)
    pages = proxy.log("GET", "list-type=2")
    assert len(pages) == proxy.count() > 4 and all("prefix=runs/r1/nodes/" in unquote(r.query) for r in pages)
    warned = [r.getMessage() for r in caplog.records]
    assert sum("delta_01" in w for w in warned) == 1 and any("notes.txt" in w for w in warned)
    # the ledger is numeric: delta_10 and delta_100 sort before delta_9 and delta_25 as text, and are still new
    assert [r.local_step for r in hub.list_deltas(after={"a": 9}) if r.node_id == "a"] == [10, 11, 25, 99, 100, 250, 1000]
    assert [r.local_step for r in hub.list_deltas(after={"a": 99, "b": 3})] == [100, 250, 1000]
    assert hub.list_deltas(after={"a": 1000, "b": 3}) == []
    assert hub.list_inits() == ["a"]
    assert hub.list_global() == ["global/weights_000000001_abcdef01.safetensors"]


def test_delta_never_overwritten_and_retry_is_idempotent(store, proxy, hub, make_hub, tmp_path):
    p1, p2 = _delta(tmp_path, "a", 5, seed=1), _delta(tmp_path, "a", 5, seed=2)
    hub.upload_delta(p1, "a", 5)
    other = make_hub()
    with pytest.raises(DeltaExistsError, match="never rewritten"):
        other.upload_delta(p2, "a", 5)
    assert store.get("nodes/a/delta_5.safetensors") == p1.read_bytes()
    proxy.reset_log()
    assert other.upload_delta(p1, "a", 5) == "nodes/a/delta_5.safetensors"  # the same bytes: an earlier attempt, done
    assert [(r.method, r.status) for r in proxy.requests] == [("PUT", 412), ("HEAD", 200)]  # decided by the ETag
    assert store.hub_paths() == ["nodes/a/delta_5.safetensors"]


def test_delta_upload_race_threads(store, make_hub, tmp_path):
    hubs = [make_hub() for _ in range(4)]
    for step in range(6):
        paths = [_delta(tmp_path, "a", step, seed=10 * step + i) for i in range(4)]
        results: list = [None] * 4
        barrier = threading.Barrier(4)

        def run(i):
            barrier.wait()
            try:
                hubs[i].upload_delta(paths[i], "a", step)
                results[i] = "WIN"
            except DeltaExistsError:
                results[i] = "EXISTS"

        ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        assert sorted(results) == ["EXISTS"] * 3 + ["WIN"], results
        assert store.get(f"nodes/a/delta_{step}.safetensors") == paths[results.index("WIN")].read_bytes()


def test_delta_upload_race_processes(store, proxy, tmp_path):
    for step in range(2):
        srcs = [_delta(tmp_path, "a", step, seed=10 * step + i) for i in range(2)]
        out = run_racers(_UPLOAD, [_proc_args(store, proxy, tmp_path, src=str(s), node="a", step=step) for s in srcs],
                          tmp_path / f"go_upload_{step}")
        assert all(rc == 0 for rc, _ in out), out
        results = [line for _, line in out]
        assert sorted(results) == ["EXISTS", "WIN"], out
        assert store.get(f"nodes/a/delta_{step}.safetensors") == srcs[results.index("WIN")].read_bytes()


def test_multipart_upload_conflict_and_part_retry(store, proxy, make_hub, tmp_path):
    hub = make_hub(multipart_threshold=5 * MiB, part_size=5 * MiB)
    big, other = _blob(tmp_path, "big", 11 * MiB + 7, seed=1), _blob(tmp_path, "other", 11 * MiB + 7, seed=2)
    proxy.reset_log()
    proxy.inject(503, 1, method="PUT", match="partNumber=2")
    assert hub.upload_delta(big, "a", 1) == "nodes/a/delta_1.safetensors"
    assert store.get("nodes/a/delta_1.safetensors") == big.read_bytes()
    parts = [(r.query.split("partNumber=")[1], r.status) for r in proxy.log("PUT", "partNumber=")]
    assert sorted(parts) == [("1", 200), ("2", 200), ("2", 503), ("3", 200)]  # only the failed part was sent again
    assert all("x-amz-checksum-crc32" in r.headers for r in proxy.log("PUT", "partNumber="))  # declared at the start
    complete = proxy.log("POST", "uploadId=")
    assert len(complete) == 1 and complete[0].headers.get("if-none-match") == "*"
    with pytest.raises(DeltaExistsError):
        hub.upload_delta(other, "a", 1)
    assert hub.upload_delta(big, "a", 1) == "nodes/a/delta_1.safetensors"  # same bytes: multipart ETag matches
    assert store.get("nodes/a/delta_1.safetensors") == big.read_bytes()
    assert store.uploads() == []  # the refused uploads were aborted
    # a completion that landed but whose answer was lost counts as done
    proxy.inject(503, 1, method="POST", match="uploadId=", apply=True)
    assert hub.upload_delta(big, "a", 2) == "nodes/a/delta_2.safetensors"
    assert store.get("nodes/a/delta_2.safetensors") == big.read_bytes() and store.uploads() == []


def test_multipart_without_request_checksums(store, proxy, make_hub, tmp_path, monkeypatch):
    """For stores that reject botocore's default checksums: AWS_REQUEST_CHECKSUM_CALCULATION=when_required."""
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    hub = make_hub(multipart_threshold=5 * MiB, part_size=5 * MiB)
    big = _blob(tmp_path, "big", 6 * MiB)
    proxy.reset_log()
    hub.upload_delta(big, "a", 1)
    assert proxy.count("PUT", "partNumber=") == 2 and proxy.count("POST", "uploadId=") == 1
    assert not any(k.startswith("x-amz-checksum") for r in proxy.requests for k in r.headers)
    assert store.get("nodes/a/delta_1.safetensors") == big.read_bytes()


def test_store_without_conditional_multipart_uses_single_puts(store, moto_endpoint, tmp_path):
    def on_complete(r):
        return r.method == "POST" and "uploadId=" in r.query

    with S3Proxy(moto_endpoint, strip_conditionals=on_complete) as p:
        hub = open_hub(f"s3://{store.bucket}/{PREFIX}", endpoint_url=p.endpoint, addressing_style="path",
                       cache_dir=tmp_path / "c", multipart_threshold=5 * MiB, part_size=5 * MiB)
        assert hub.store.conditional_multipart is False
        big = _blob(tmp_path, "big", 6 * MiB)
        p.reset_log()
        hub.upload_delta(big, "a", 1)
        assert [r.method for r in p.requests] == ["PUT"] and "uploadId" not in p.requests[0].query
        with pytest.raises(DeltaExistsError):
            hub.upload_delta(_blob(tmp_path, "big2", 6 * MiB, seed=3), "a", 1)
    assert store.get("nodes/a/delta_1.safetensors") == big.read_bytes()


# ----------------------------------------------------------------------------- cache


def test_cache_per_node_reused_mutable_refetched(store, proxy, hub, make_hub, tmp_path):
    pa, pb = _delta(tmp_path, "a", 3, seed=1), _delta(tmp_path, "b", 3, seed=2)
    hub.upload_delta(pa, "a", 3)
    hub.upload_delta(pb, "b", 3)
    _publish_v0(hub, tmp_path)
    reader = make_hub()
    da, db = reader.download("nodes/a/delta_3.safetensors"), reader.download("nodes/b/delta_3.safetensors")
    assert da != db and da.read_bytes() == pa.read_bytes() and db.read_bytes() == pb.read_bytes()
    proxy.reset_log()
    for r in reader.list_deltas():
        reader.download_delta(r)
    assert proxy.count("GET") == 1 and proxy.count("GET", "list-type") == 1  # the listing only: both cached
    reader.download("global/manifest.json")
    reader.download("global/manifest.json")
    assert proxy.count("GET", "manifest.json") == 2  # mutable: fetched every time
    # a cached copy that does not match the listed size is fetched again
    da.write_bytes(b"stale")
    ref = next(r for r in reader.list_deltas() if r.node_id == "a")
    assert reader.download_delta(ref).read_bytes() == pa.read_bytes()
    assert not [p for p in reader.cache_dir.rglob("*") if p.name.startswith(".")]  # no temporary file left


def test_truncated_and_dropped_downloads_are_retried(store, proxy, hub, tmp_path):
    p = _blob(tmp_path, "w", 3 * MiB)
    hub.upload_delta(p, "a", 1)
    proxy.reset_log()
    proxy.inject(200, 1, method="GET", match="delta_1", truncate=True)
    proxy.inject(0, 1, method="GET", match="delta_1", drop=True)
    got = hub.download("nodes/a/delta_1.safetensors")
    assert got.read_bytes() == p.read_bytes()
    assert proxy.count("GET", "delta_1") == 3
    assert sorted(x.name for x in got.parent.iterdir()) == ["delta_1.safetensors"]


# ----------------------------------------------------------------------------- publishing


def test_publish_and_load_global(store, hub, make_hub, tmp_path):
    assert hub.read_manifest() is None
    s0, m0 = _publish_v0(hub, tmp_path)
    reader = make_hub()
    assert reader.read_manifest() == m0
    m, state = load_global(reader)
    assert m == m0 and _same_state(state, _state(0))
    assert load_outer_state(reader, m)["t"] == 0
    assert store.hub_paths() == sorted(["global/manifest.json", *s0.files])
    s1 = stage_global(tmp_path / "stage1", 1, _state(1))
    m1 = s1.manifest(ledger={"a": 3}, history=[GlobalVersion(0, s0.weights, s0.outer_state)])
    hub.publish(m1, s1.files, expected_outer_step=0)
    assert _same_state(load_global(reader)[1], _state(1)) and _same_state(load_global(reader, m0)[1], _state(0))
    assert reader.list_global() == sorted(["global/manifest.json", *s0.files, *s1.files])
    with pytest.raises(PublishConflictError) as ei:
        hub.publish(s1.manifest(), s1.files, expected_outer_step=None)
    assert (ei.value.expected, ei.value.found) == (None, 1)
    with pytest.raises(HubNotFoundError, match="not found"):
        reader.download("global/weights_000000009_deadbeef.safetensors")


def test_bad_publications_write_nothing(store, proxy, hub, tmp_path):
    s0, m0 = _publish_v0(hub, tmp_path)
    s1 = stage_global(tmp_path / "stage1", 1, _state(1), _outer(1))
    m1 = s1.manifest()
    before = store.hub_paths()
    proxy.reset_log()

    def refused(exc, manifest, files, match=None, **kw):
        with pytest.raises(exc, match=match):
            hub.publish(manifest, files, expected_outer_step=kw.pop("expected", 0), **kw)
        assert store.hub_paths() == before and proxy.count("PUT") == proxy.count("DELETE") == 0

    for bad_path in ("nodes/a/delta_1.safetensors", "global/sub/x", "../x", "global/manifest.json", "global/.probe"):
        refused(InvalidNameError, m1, {**s1.files, bad_path: s1.files[s1.weights]})
    bad = s1.manifest()
    bad.weights = "../../etc/passwd"
    refused(ManifestError, bad, s1.files)
    refused(HubError, m1, {s1.outer_state: s1.files[s1.outer_state]}, match=s1.weights)  # names a missing file
    clash = s1.manifest(weights=s0.weights, outer_state=None, outer_state_sha256=None)
    refused(HubError, clash, {s0.weights: s1.files[s1.weights]}, match="already exists")
    refused(InvalidNameError, m1, s1.files, delete=["global/manifest.json"])
    refused(InvalidNameError, m1, s1.files, delete=[s1.weights])
    refused(ValueError, s0.manifest(), {}, match="must exceed")
    s7 = stage_global(tmp_path / "stage7", 7, _state(7))
    refused(PublishConflictError, s7.manifest(), s7.files, expected=5)
    assert hub.read_manifest() == m0
    hub.publish(m1, s1.files, expected_outer_step=0, delete=list(s0.files))
    assert store.hub_paths() == sorted(["global/manifest.json", *s1.files])


def test_deletions_go_in_batches_and_fall_back_one_by_one(store, proxy, hub, tmp_path):
    """A publication's deletions are one DeleteObjects request (not one request per delta); a store that
    refuses DeleteObjects gets one DeleteObject per object from then on, and nothing is left behind."""
    s0, m0 = _publish_v0(hub, tmp_path)
    deltas = [hub.upload_delta(_delta(tmp_path, f"n{i}", 1), f"n{i}", 1) for i in range(6)]
    s1 = stage_global(tmp_path / "stage1", 1, _state(1))
    proxy.reset_log()
    hub.publish(s1.manifest(ledger={f"n{i}": 1 for i in range(6)}), s1.files, expected_outer_step=0,
                delete=[*s0.files, *deltas])
    assert proxy.count("DELETE") == 0 and proxy.count("POST", "?delete") == 1
    assert store.hub_paths() == sorted(["global/manifest.json", *s1.files])
    more = [hub.upload_delta(_delta(tmp_path, f"m{i}", 1), f"m{i}", 1) for i in range(3)]
    proxy.reset_log()
    proxy.inject(501, 1, method="POST", match="?delete", code="NotImplemented")
    hub.delete([*more, "nodes/m9/delta_1.safetensors"])  # an absent file is no error either way
    assert proxy.count("POST", "?delete") == 1 and proxy.count("DELETE") == 4 and hub.store.batch_delete is False
    assert store.hub_paths() == sorted(["global/manifest.json", *s1.files])


def _cas_check(store: Store, hub: S3Hub, staged: list, results: list, old_files: list[str]) -> None:
    assert results.count("WIN") == 1, results
    assert all(r == "WIN" or r.startswith("CONFLICT") for r in results), results
    win = results.index("WIN")
    m = hub.read_manifest()
    assert m.weights == staged[win].weights and m.ledger == {"winner": win}
    assert _same_state(load_global(hub)[1], _state(1000 + win))
    # the losers' files were removed, the winner's and the older ones kept
    assert hub.list_global() == sorted(["global/manifest.json", *old_files, *staged[win].files])


def test_publish_cas_race_threads(store, make_hub, tmp_path):
    _publish_v0(make_hub(), tmp_path)
    n = 6
    hubs = [make_hub() for _ in range(n)]
    for version in (1, 2):
        old = [p for p in hubs[0].list_global() if p != "global/manifest.json"]
        staged = [stage_global(tmp_path / f"v{version}_{i}", version, _state(1000 + i), _outer(i)) for i in range(n)]
        barrier = threading.Barrier(n)
        results: list = [None] * n

        def run(i):
            barrier.wait()
            try:
                hubs[i].publish(staged[i].manifest(ledger={"winner": i}), staged[i].files, expected_outer_step=version - 1)
                results[i] = "WIN"
            except PublishConflictError as e:
                assert (e.expected, e.found) == (version - 1, version)
                results[i] = "CONFLICT"

        ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        _cas_check(store, hubs[0], staged, results, old)


def test_publish_cas_race_processes(store, proxy, hub, tmp_path):
    _publish_v0(hub, tmp_path)
    old = [p for p in hub.list_global() if p != "global/manifest.json"]
    n = 3
    staged = [stage_global(tmp_path / f"p{i}", 1, _state(1000 + i), _outer(i)) for i in range(n)]
    args = []
    for i, s in enumerate(staged):
        mpath = tmp_path / f"manifest_{i}.json"
        mpath.write_text(s.manifest(ledger={"winner": i}).to_json())
        args.append(_proc_args(store, proxy, tmp_path, manifest=str(mpath), files={k: str(v) for k, v in s.files.items()},
                               expected=0))
    out = run_racers(_PUBLISH, args, tmp_path / "go_publish")
    assert all(rc == 0 for rc, _ in out), out
    results = [line for _, line in out]
    assert all("expected current outer_step 0, hub has 1" in r for r in results if r != "WIN"), results
    _cas_check(store, hub, staged, results, old)


def test_publication_refuses_files_collected_before_the_swap(store, hub, make_hub, tmp_path):
    s0, m0 = _publish_v0(hub, tmp_path)
    s1 = stage_global(tmp_path / "stage1", 1, _state(1), _outer(1))
    other = make_hub()

    def collect(at):
        if at == "files":  # another process collects what it sees as orphans
            other.delete([p for p in other.list_global() if p not in m0.files() and p != "global/manifest.json"])

    faults.install(hub, collect)
    with pytest.raises(HubError, match="vanished"):
        hub.publish(s1.manifest(), s1.files, expected_outer_step=0)
    faults.install(hub, None)
    assert hub.read_manifest() == m0 and hub.list_global() == sorted(["global/manifest.json", *s0.files])
    hub.publish(s1.manifest(), s1.files, expected_outer_step=0)
    assert hub.read_manifest().outer_step == 1


# ----------------------------------------------------------------------------- crashes


def _crash_scenario(make_hub, tmp_path: Path, name: str, hub: S3Hub | None = None):
    """Version 0 under the prefix ``name``, a delta, and version 1 staged to be published while
    collecting both. Each scenario has a prefix of its own, so they can run side by side."""
    hub = hub or make_hub(prefix=name)
    s0, m0 = _publish_v0(hub, tmp_path / name)
    hub.upload_delta(_delta(tmp_path, "a", 1), "a", 1)
    s1 = stage_global(tmp_path / name / "stage1", 1, _state(1), _outer(1))
    return hub, s0, s1, s1.manifest(ledger={"a": 1}), [*s0.files, "nodes/a/delta_1.safetensors"]


def _labels(make_hub, tmp_path: Path) -> list[str]:
    hub, s0, s1, m1, dels = _crash_scenario(make_hub, tmp_path, "labels")
    seen: list[str] = []
    faults.install(hub, seen.append)
    hub.publish(m1, s1.files, expected_outer_step=0, delete=dels)
    assert seen == [*(f"file:{p}" for p in s1.files), "files", "locked", "manifest", *(f"delete:{p}" for p in dels), "deleted"]
    return seen


def _assert_consistent(reader: S3Hub, after_swap: bool, s0, s1) -> None:
    """The hub holds one whole version: the old one before the swap, the new one after."""
    m = reader.read_manifest()
    staged, seed = (s1, 1) if after_swap else (s0, 0)
    assert m.outer_step == seed and m.weights == staged.weights
    got_m, state = load_global(reader)  # sha256 and fingerprint verified: never a mix
    assert got_m == m and _same_state(state, _state(seed))
    assert load_outer_state(reader, m)["t"] == seed


def _assert_recovers(make_hub, tmp_path: Path, after_swap: bool, s0, s1, name: str) -> None:
    """Consistent, orphans are collectable, and the next publication goes through."""
    fresh = make_hub(prefix=name)
    _assert_consistent(fresh, after_swap, s0, s1)
    m = fresh.read_manifest()
    orphans = [p for p in fresh.list_global() if p not in m.files() and p != "global/manifest.json"]
    s2 = stage_global(tmp_path / f"stage2_{name}", m.outer_step + 1, _state(2))
    fresh.publish(s2.manifest(), s2.files, expected_outer_step=m.outer_step, delete=[*m.files(), *orphans])
    assert fresh.list_global() == sorted(["global/manifest.json", *s2.files])
    assert _same_state(load_global(fresh)[1], _state(2))


class _Crash(Exception):
    pass


def test_crash_at_every_point_raising(hub, store, make_hub, tmp_path):
    labels = _labels(make_hub, tmp_path)
    crashing = make_hub(prefix="raise")
    reader = make_hub(prefix="raise")
    for i, label in enumerate(labels):
        for key in store.keys("raise/"):
            store.client.delete_object(Bucket=store.bucket, Key=key)
        faults.install(crashing, None)
        _, s0, s1, m1, dels = _crash_scenario(make_hub, tmp_path, f"raise{i}", hub=crashing)
        seen: list[str] = []

        def fault(at, i=i, seen=seen):
            seen.append(at)
            if len(seen) - 1 == i:
                raise _Crash(at)

        faults.install(crashing, fault)
        with pytest.raises(_Crash):
            crashing.publish(m1, s1.files, expected_outer_step=0, delete=dels)
        after_swap = i >= labels.index("manifest")
        if not after_swap:  # an interrupted publication cleans up what it uploaded
            assert reader.list_global() == sorted(["global/manifest.json", *s0.files])
        _assert_consistent(reader, after_swap, s0, s1)  # recovery is checked after a real kill, below


@pytest.mark.slow  # starts processes for a whole run: CI's slow run (tests/speed.py)
def test_crash_at_every_point_kill9(hub, store, proxy, make_hub, tmp_path):
    """One subprocess per point of the publication, all at once (each on a prefix of its own),
    each killed with SIGKILL at its point; then each hub recovers."""
    labels = _labels(make_hub, tmp_path)

    def prepare(i: int):
        _, s0, s1, m1, dels = _crash_scenario(make_hub, tmp_path, f"kill{i}")
        mpath = tmp_path / f"kill{i}" / "m1.json"
        mpath.write_text(m1.to_json())
        args = _proc_args(store, proxy, tmp_path, prefix=f"kill{i}", manifest=str(mpath),
                          files={k: str(v) for k, v in s1.files.items()}, expected=0, delete=dels, kill_at=i)
        return args, s0, s1

    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # the scenarios are independent: set them up side by side
        scenarios = list(pool.map(prepare, range(len(labels))))
        out = run_racers(_PUBLISH, [a for a, _, _ in scenarios], tmp_path / "go_kill")
        for i, (rc, line) in enumerate(out):
            assert rc == -signal.SIGKILL, (labels[i], rc, line)
        list(pool.map(lambda i: _assert_recovers(make_hub, tmp_path, i >= labels.index("manifest"), scenarios[i][1],
                                                 scenarios[i][2], f"kill{i}"), range(len(labels))))


# ----------------------------------------------------------------------------- lease


def test_lease_compare_and_swap_on_the_store(store, make_hub):
    """S3's side of the lease (the race is the contract's, tests/test_hub_contract.py): a stale
    expectation names the holder, a released lease is an empty object."""
    a, b = make_hub(), make_hub()
    la, lb = Lease("host:1:a", 1, 2000.0, 1000.0), Lease("host:2:b", 2, 3000.0, 1000.0)
    assert a.read_lease() is None
    a.write_lease(la, expected=None)
    with pytest.raises(LeaseConflictError):
        b.write_lease(lb, expected=None)
    assert b.read_lease() == la
    b.write_lease(lb, expected=la)
    with pytest.raises(LeaseConflictError, match="host:2:b"):
        a.write_lease(Lease("host:1:a", 3, 4000.0, 2000.0), expected=la)  # a stale expectation
    with pytest.raises(LeaseConflictError):
        a.write_lease(None, expected=la)
    b.write_lease(None, expected=lb)  # released: an empty object, read as "no lease"
    assert a.read_lease() is None and store.get("global/lease.json") == b""


# ----------------------------------------------------------------------------- retries and errors


def test_lost_answers_to_applied_writes_are_idempotent(store, proxy, hub, tmp_path):
    """A write lands but its answer is lost (503): the retry gets 412, reads back its own bytes, succeeds."""
    proxy.inject(503, 1, method="PUT", match="manifest.json", apply=True)
    s0, m0 = _publish_v0(hub, tmp_path)
    assert hub.read_manifest() == m0 and store.hub_paths() == sorted(["global/manifest.json", *s0.files])
    s1 = stage_global(tmp_path / "stage1", 1, _state(1))
    proxy.inject(503, 1, method="PUT", match="manifest.json", apply=True)
    hub.publish(s1.manifest(), s1.files, expected_outer_step=0, delete=list(s0.files))
    assert hub.read_manifest().outer_step == 1 and store.hub_paths() == sorted(["global/manifest.json", *s1.files])
    proxy.inject(503, 1, method="PUT", match="lease.json", apply=True)
    lease = Lease("h:1", 1, 10.0, 1.0)
    hub.write_lease(lease, expected=None)
    assert hub.read_lease() == lease
    statuses = [r.status for r in proxy.log("PUT", "manifest.json")]
    assert statuses == [503, 412, 503, 412]


def test_5xx_and_throttling_are_retried_with_backoff(store, proxy, hub, tmp_path):
    p = _delta(tmp_path, "a", 1)
    proxy.reset_log()
    proxy.inject(503, 1, method="PUT", code="SlowDown")
    proxy.inject(500, 1, method="PUT", code="InternalError")
    hub.upload_delta(p, "a", 1)
    assert [r.status for r in proxy.log("PUT")] == [503, 500, 200]
    proxy.inject(429, 1, method="GET")
    proxy.inject(400, 1, method="GET", code="RequestTimeout")  # S3's idle-connection answer
    proxy.inject(409, 1, method="GET", code="ConditionalRequestConflict")
    assert [r.local_step for r in hub.list_deltas()] == [1]
    assert [r.status for r in proxy.log("GET")] == [429, 400, 409, 200]


def test_retries_are_bounded_and_botocore_does_not_add_its_own(store, proxy, make_hub):
    hub = make_hub(max_retries=2)
    proxy.reset_log()
    proxy.inject(503, 50, method="GET")
    with pytest.raises(HubUnavailableError, match="3 attempt"):
        hub.list_deltas()
    assert proxy.count("GET") == 3
    proxy.clear_faults()
    flat = make_hub(max_retries=0)
    proxy.reset_log()
    proxy.inject(503, 5, method="GET")
    with pytest.raises(HubUnavailableError, match="1 attempt"):
        flat.read_manifest()
    assert proxy.count("GET") == 1  # no retry of botocore's underneath ours


def test_backoff_is_jittered_exponential_and_capped(make_hub):
    hub = make_hub(retry_base_delay=1.0, retry_max_delay=8.0)
    for attempt, full in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)]:
        ds = [hub.store.backoff(attempt) for _ in range(200)]
        assert all(full / 2 <= d <= full for d in ds) and len(set(ds)) > 100
    assert hub.store.backoff(1, retry_after=5.0) == 5.0 and hub.store.backoff(1, retry_after=100.0) == 8.0


def test_timeouts_and_dropped_connections_are_retried(store, proxy, make_hub, tmp_path):
    hub = make_hub(timeout=0.3)
    _publish_v0(hub, tmp_path)
    proxy.reset_log()
    proxy.inject(200, 1, method="GET", match="manifest.json", delay=0.8)  # stalls past the client's timeout
    proxy.inject(0, 1, method="GET", match="manifest.json", drop=True)
    assert hub.read_manifest().outer_step == 0
    deadline = time.monotonic() + 3
    while proxy.count("GET", "manifest.json") < 3 and time.monotonic() < deadline:  # the stalled one logs when it ends
        time.sleep(0.05)
    assert proxy.count("GET", "manifest.json") == 3


def test_403_is_an_auth_error_at_once_without_credentials(store, proxy, hub, tmp_path):
    for code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        proxy.reset_log()
        proxy.inject(403, 5, method="PUT", code=code)
        with pytest.raises(HubAuthError) as ei:
            hub.upload_delta(_delta(tmp_path, "a", 1), "a", 1)
        proxy.clear_faults()
        msg = str(ei.value)
        assert proxy.count("PUT") == 1 and "403" in msg and code in msg and "credentials" in msg
        assert SECRET_KEY not in msg and ACCESS_KEY not in msg
    proxy.inject(403, 1, method="GET", code="AccessDenied")
    with pytest.raises(HubAuthError, match="s3:ListBucket"):
        hub.list_deltas()


def test_no_credentials_is_a_clear_auth_error(store, proxy, tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(HubAuthError, match="no usable AWS credentials.*AWS_ACCESS_KEY_ID"):
        open_hub(f"s3://{store.bucket}/{PREFIX}", endpoint_url=proxy.endpoint, addressing_style="path", cache_dir=tmp_path)
    assert proxy.count() == 0


def test_bad_names_and_paths_are_refused_before_any_request(proxy, hub, tmp_path):
    p = _delta(tmp_path, "ok", 1)
    proxy.reset_log()
    for node in ("a/b", "..", ".hidden", "a b", "x" * 65, "", "ü", "a\\b", "../global"):
        with pytest.raises(InvalidNameError, match="node_id"):
            hub.upload_delta(p, node, 1)
        with pytest.raises(InvalidNameError, match="node_id"):
            hub.upload_init(p, node)
    for step in (-1, True, 1.0, "1"):
        with pytest.raises(InvalidNameError, match="local_step"):
            hub.upload_delta(p, "a", step)
    for path in ("nodes/a/x.bin", "global/../x", "global/sub/x", "../x", "/etc/passwd", "README.md", "nodes/a/../../x"):
        with pytest.raises(InvalidNameError):
            hub.download(path)
        with pytest.raises(InvalidNameError):
            hub.delete([path])
    for reserved in ("global/manifest.json", "global/lease.json"):
        with pytest.raises(InvalidNameError):
            hub.delete([reserved])
    assert proxy.count() == 0


def test_hostile_manifest_on_the_store(store, hub, tmp_path):
    s0, m0 = _publish_v0(hub, tmp_path)
    store.put(f"{PREFIX}/global/manifest.json", m0.to_json().replace(m0.weights, "../../etc/passwd").encode())
    with pytest.raises(ManifestError, match="passwd"):
        hub.read_manifest()
    store.put(f"{PREFIX}/global/manifest.json", b" " * (17 * MiB))  # never read into memory: a malformed manifest
    with pytest.raises(ManifestError, match="17825792 bytes, more than the 16777216"):
        hub.read_manifest()
    assert len(hub.read_manifest_bytes()) < 200  # a stand-in naming its size and ETag, not the content


# ----------------------------------------------------------------------------- end to end


def test_master_round_with_a_worker_on_s3(store, make_hub, tmp_path):
    """MasterOuterLoop and DiLoCoWorker on one s3:// hub (each with its own client and cache)."""
    from diloco_lightning.master import MasterOuterLoop
    from diloco_lightning.worker import DiLoCoWorker

    init = {"layer.weight": torch.zeros(4, 3), "layer.bias": torch.zeros(3), "steps": torch.tensor(7)}
    master = MasterOuterLoop(make_hub(check_conditional_writes=True), init, node_state_dir=tmp_path / "master",
                             outer_optimizer="nesterov", outer_lr=1.0, outer_momentum=0.0, norm_ratio=None, poll_interval=0.02, keep_globals=2)
    assert master.sync_once() is True and master.outer_step == 0  # publishes version 0
    params = {k: (torch.nn.Parameter(v.clone()) if v.is_floating_point() else v.clone()) for k, v in init.items()}
    with DiLoCoWorker(make_hub(), "w0", params, poll_interval=0.01, wait_timeout=10.0) as w:
        w.start()
        assert w.outer_step == 0
        for k in range(1, 4):
            with torch.no_grad():
                params["layer.weight"].add_(0.25)
                params["layer.bias"].sub_(0.5)
            w.boundary(num_tokens=10)
            assert w.flush()
            assert master.sync_once() is True and master.outer_step == k
        last_step = w.next_local_step - 1
    step, snap = master.snapshot()
    assert step == 3 and torch.equal(snap["layer.weight"], torch.full((4, 3), 0.75))  # lr 1: the worker's own progress
    assert torch.equal(snap["layer.bias"], torch.full((3,), -1.5)) and int(snap["steps"]) == 7
    reader = make_hub()
    man, state = load_global(reader)
    assert man.outer_step == 3 and man.ledger == {"w0": last_step} and _same_state(state, snap)
    assert reader.list_deltas() == []  # processed deltas are deleted with each publication
    assert len(man.history) == 2  # keep_globals=2
    assert sorted(p for p in reader.list_global() if "weights_" in p) == sorted([man.weights, *(v.weights for v in man.history)])
    assert sha256_file(reader.download(man.weights)) == man.weights_sha256
    master.close()
