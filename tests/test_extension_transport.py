"""A new transport is one class and one registration (issue 37): ``mem://<name>``, a hub held in this
process's memory, written here and nowhere else, passes the whole hub contract
(``tests/test_hub_contract.py``, imported below so that every contract test runs on it too) and
carries a real master and two workers through rounds, opened by its URL, with no other file of
the package or the tests touched.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any, ClassVar, Iterable, Mapping

import pytest
import torch

from diloco_lightning.hub import TRANSPORTS, open_hub, register_transport, transport_for
from diloco_lightning.hub.base import (
    ClaimConflictError,
    DeltaExistsError,
    DeltaRef,
    Hub,
    HubError,
    HubFileTooLargeError,
    HubNotFoundError,
    LeaseConflictError,
    Publication,
    PublishConflictError,
    default_cache_dir,
    own_options,
)
from diloco_lightning.hub.transports import unregister_transport
from diloco_lightning.wire.claims import ClaimError, NodeClaim
from diloco_lightning.wire.manifest import Lease, Manifest
from diloco_lightning.wire.names import (
    GLOBAL_DIR,
    LEASE_PATH,
    MANIFEST_PATH,
    NODES_DIR,
    InvalidNameError,
    claim_path,
    delta_path,
    init_path,
    parse_delta_path,
    parse_init_path,
    validate_hub_path,
)

from support.workers import run_two_workers

from test_hub_contract import *  # noqa: F403 - every contract test, run here on mem:// (its make_hub below)
from test_hub_contract import _delta, _version


class MemHub(Hub):
    """A hub in this process's memory: every handle of ``mem://<name>`` shares one dict of files."""

    scheme = "mem"
    url_forms = ("mem://name",)
    creatable = True
    stores: ClassVar[dict[str, dict[str, bytes]]] = {}
    locks: ClassVar[dict[str, threading.Lock]] = {}

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "MemHub":
        return cls(url[len("mem://"):], **own_options(cls, "the memory hub", url, options))

    def __init__(self, name: str, *, cache_dir: str | os.PathLike | None = None, create: bool = True) -> None:
        if name not in self.stores:
            if not create:
                raise HubNotFoundError(f"mem://{name} does not exist (create=False)")
            self.stores[name], self.locks[name] = {}, threading.Lock()
        self.url = f"mem://{name}"
        self.files, self.lock = self.stores[name], self.locks[name]
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(self.url)

    def _put_new(self, path: str, src: str | os.PathLike | bytes) -> bool:
        data = src if isinstance(src, bytes) else Path(src).read_bytes()
        with self.lock:
            if path in self.files:
                return False
            self.files[path] = data
            return True

    def _under(self, folder: str) -> list[str]:
        with self.lock:
            return sorted(p for p in self.files if p.startswith(folder + "/"))

    def upload_delta(self, local_file: str | os.PathLike, node_id: str, local_step: int) -> str:
        path = delta_path(node_id, local_step)
        if not self._put_new(path, local_file):
            raise DeltaExistsError(f"{path} already exists on {self.url}")
        return path

    def upload_init(self, local_file: str | os.PathLike, node_id: str) -> str:
        path = init_path(node_id)
        self._put_new(path, local_file)
        return path

    def list_deltas(self, after: Mapping[str, int] | None = None) -> list[DeltaRef]:
        refs = []
        for path in self._under(NODES_DIR):
            d = parse_delta_path(path)
            if d is not None and d.local_step > (after or {}).get(d.node_id, -1):
                refs.append(DeltaRef(d.node_id, d.local_step, path, len(self.files[path])))
        return sorted(refs)

    def list_inits(self) -> list[str]:
        return sorted(n for n in map(parse_init_path, self._under(NODES_DIR)) if n is not None)

    def list_global(self) -> list[str]:
        return self._under(GLOBAL_DIR)

    def download(self, hub_path: str, *, max_bytes: int | None = None) -> Path:
        path = validate_hub_path(hub_path)
        with self.lock:
            data = self.files.get(path)
        if data is None:
            raise HubNotFoundError(f"{path} is not on {self.url}")
        if max_bytes is not None and len(data) > max_bytes:
            raise HubFileTooLargeError(f"{path} on {self.url}: {len(data)} bytes, more than {max_bytes}")
        out = Path(self.cache_dir) / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
        return out

    def read_manifest_bytes(self) -> bytes | None:
        with self.lock:
            return self.files.get(MANIFEST_PATH)

    def _publish(self, pub: Publication) -> None:
        data = pub.manifest.to_json().encode()
        with self.lock:
            current = self.files.get(MANIFEST_PATH)
            if pub.expected_digest is not None:
                if current is None or hashlib.sha256(current).hexdigest() != pub.expected_digest:
                    raise PublishConflictError(pub.expected_outer_step, None, "the manifest being replaced changed")
            else:
                found = None if current is None else Manifest.from_json(current).outer_step
                if found != pub.expected_outer_step:
                    raise PublishConflictError(pub.expected_outer_step, found)
            if any(p in self.files for p in pub.files):
                raise HubError(f"{sorted(pub.files)}: global file names must be unique")
            if any(p not in self.files and p not in pub.files for p in pub.manifest.files()):
                raise HubError("the manifest names a file that is neither uploaded now nor on the hub")
            self.files.update({p: Path(src).read_bytes() for p, src in pub.files.items()})
            self.files[MANIFEST_PATH] = data
            for p, src in pub.mirrors.items():
                self.files[p] = src if isinstance(src, bytes) else Path(src).read_bytes()
            for p in pub.delete:
                self.files.pop(p, None)

    def delete(self, paths: Iterable[str]) -> None:
        paths = [validate_hub_path(p) for p in paths]
        with self.lock:
            for p in paths:
                self.files.pop(p, None)

    def _swap(self, path: str, parse: Any, new: bytes | None, expected: Any, conflict: type[HubError]) -> None:
        with self.lock:
            data = self.files.get(path)
            if (None if data is None else parse(data)) != expected:
                raise conflict(f"{path} changed on {self.url}")
            if new is None:
                self.files.pop(path, None)
            else:
                self.files[path] = new

    def read_lease(self) -> Lease | None:
        with self.lock:
            data = self.files.get(LEASE_PATH)
        return None if data is None else Lease.from_hub_bytes(data)

    def write_lease(self, lease: Lease | None, *, expected: Lease | None) -> None:
        self._swap(LEASE_PATH, Lease.from_hub_bytes, None if lease is None else lease.to_json().encode(), expected,
                   LeaseConflictError)

    def read_claim(self, node_id: str) -> NodeClaim | None:
        with self.lock:
            data = self.files.get(claim_path(node_id))
        try:
            return None if data is None else NodeClaim.from_json(data, node_id=node_id)
        except ClaimError:
            return None

    def write_claim(self, node_id: str, claim: NodeClaim | None, *, expected: NodeClaim | None) -> None:
        self._swap(claim_path(node_id), lambda data: NodeClaim.from_json(data, node_id=node_id),
                   None if claim is None else claim.to_json().encode(), expected, ClaimConflictError)

    def list_claims(self) -> dict[str, NodeClaim]:
        nodes = {p.split("/")[1] for p in self._under(NODES_DIR) if p == claim_path(p.split("/")[1])}
        claims = {n: self.read_claim(n) for n in sorted(nodes)}
        return {n: c for n, c in claims.items() if c is not None}


@pytest.fixture(autouse=True)
def mem_transport():
    """``mem://`` registered for the test (one registration), and forgotten after it."""
    register_transport(MemHub)
    yield
    unregister_transport("mem")
    MemHub.stores.clear()
    MemHub.locks.clear()


@pytest.fixture
def make_hub(tmp_path, request):
    """Handles of one fresh ``mem://`` hub, each with its own cache (the contract tests' factory)."""
    name = f"t{abs(hash(request.node.nodeid))}"
    made: list[Hub] = []

    def make() -> Hub:
        hub = open_hub(f"mem://{name}", cache_dir=tmp_path / f"cache-{len(made)}")
        made.append(hub)
        return hub

    yield make
    for hub in made:
        hub.close()


def test_every_registered_transport_has_a_test_store():  # noqa: F811 - the contract's, with mem:// registered
    """mem:// is this file's own store (``make_hub`` above), not one of tests/support's."""
    assert TRANSPORTS["mem"] is MemHub


def test_the_registry_opens_it_by_url_and_asks_its_capabilities(tmp_path):
    assert transport_for("mem://x") is MemHub and transport_for("mem://x").creatable
    hub = open_hub("mem://x", cache_dir=tmp_path, token=None)  # another transport's option, unset: ignored
    assert isinstance(hub, MemHub) and hub.url == "mem://x"
    with pytest.raises(ValueError, match=r"\['token'\] do not apply to the memory hub"):
        open_hub("mem://x", token="hf_secret")
    with pytest.raises(HubNotFoundError):
        open_hub("mem://absent", create=False)
    unregister_transport("mem")
    with pytest.raises(ValueError, match="unsupported URL scheme.*hf://org/repo or s3://bucket/prefix$"):
        open_hub("mem://x")
    register_transport(MemHub)
    with pytest.raises(ValueError, match="mem://name"):  # the error lists every registered transport's URL forms
        open_hub("gs://bucket/x")
    with pytest.raises(ValueError, match="already"):
        register_transport(type("Other", (MemHub,), {}))


def test_the_configuration_accepts_its_url():
    from omegaconf import OmegaConf

    from diloco_lightning.app.checks import validate_hub

    validate_hub(OmegaConf.create({"url": "mem://cfg", "create": True}))


def test_a_master_and_two_workers_meet_on_it(tmp_path):
    """The real master and two real workers (tests/support/workers.py) run a round on it."""
    from diloco_lightning.master import MasterOuterLoop

    rounds: list[dict] = []
    g = torch.Generator().manual_seed(0)
    init = {"layer.weight": torch.randn(4, 3, generator=g), "layer.bias": torch.randn(3, generator=g)}
    master = MasterOuterLoop(open_hub("mem://run", cache_dir=tmp_path / "m"), init, node_state_dir=tmp_path / "master", poll_interval=0.02,
                             min_deltas=2, keep_globals=8, norm_ratio=None, logger=rounds.append)
    master.start()
    # each worker opens mem://run by its URL (with a cache of its own)
    run_two_workers(master, None, init, outer_steps=1, hub_for=lambda node: open_hub("mem://run", cache_dir=tmp_path / node))
    assert master.outer_step >= 1  # version 0 from the master's init, then a round of both workers' deltas
    applied = [d for r in rounds for d in r.get("applied") or []]
    assert {d.split("/")[0] for d in applied} == {"w0", "w1"}
    hub = open_hub("mem://run", cache_dir=tmp_path / "r")
    manifest = hub.read_manifest()
    assert manifest is not None and manifest.outer_step == master.outer_step
    assert set(manifest.ledger) == {"w0", "w1"}
    assert {r.node_id for r in hub.list_deltas()} <= {"w0", "w1"}


def test_a_bad_node_id_is_refused_before_any_write(tmp_path):
    hub = open_hub("mem://names", cache_dir=tmp_path)
    path, _ = _delta(tmp_path, "a", 1, seed=1)
    with pytest.raises(InvalidNameError):
        hub.upload_delta(path, "../x", 1)
    m, files = _version(tmp_path, 0, "0a0a0a0a")
    hub.publish(m, files, expected_outer_step=None)
    assert hub.read_manifest() == m
