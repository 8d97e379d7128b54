"""Fixtures shared by several test files.

* Every test runs without a run key, crash points or offline mode from the caller's shell
  (``clean_env``, automatic), and with Hugging Face telemetry, progress bars and implicit
  tokens off (set once for the session, subprocesses inherit it).
* ``hydra_configs``: the schema and recipes registered in Hydra's ConfigStore (what
  ``train.py`` does at start), for tests that compose a configuration in-process.
* ``hf_server``: the loopback fake Hugging Face Hub (``tests/support/hf_server.py``).
* ``s3_endpoint``: a real S3 server on loopback (moto); ``s3_proxy``: the fault-injecting proxy in
  front of it (tests/support/s3_proxy.py); ``s3_bucket``: a fresh bucket there.
* ``transport``: one hub on each registered transport (file, hf, hf per node, s3) with its failures
  (``tests/support/transports.py``).
* ``one_thread``: one intra-op torch thread for a module of tiny-tensor tests
  (``pytestmark = pytest.mark.usefixtures("one_thread")``).
"""

from __future__ import annotations

import logging
import os

import pytest

for _k in ("HF_HUB_DISABLE_TELEMETRY", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_IMPLICIT_TOKEN"):
    os.environ.setdefault(_k, "1")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No run key, crash point or offline mode leaks in from the environment of the caller."""
    for k in ("DILOCO_RUN_KEY", "DILOCO_RUN_KEY_FILE", "DILOCO_FAULTS", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    try:
        import huggingface_hub.constants as c

        monkeypatch.setattr(c, "HF_HUB_OFFLINE", False, raising=False)
    except ImportError:  # pragma: no cover
        pass


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread while a module runs: on tiny tensors more threads only add contention
    on a shared 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def hydra_configs():
    """The schema and recipes registered in Hydra's ConfigStore; yields the config folder."""
    from diloco_lightning.app.config import CONFIG_DIR, register_configs

    register_configs()
    return CONFIG_DIR


@pytest.fixture
def hf_server():
    """A fresh loopback fake Hugging Face Hub (``tests/support/hf_server.py``)."""
    from support.hf_server import FakeHubServer

    with FakeHubServer() as server:
        yield server


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 server on 127.0.0.1 (moto's ``ThreadedMotoServer``) with fake credentials set for the
    session (subprocesses inherit them); nothing real is ever reached."""
    pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    fake = {"AWS_ACCESS_KEY_ID": "AKIDCLAIMSTEST000001", "AWS_SECRET_ACCESS_KEY": "claimsSECRET0123456789",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true"}
    drop = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN")
    saved = {k: os.environ.get(k) for k in (*fake, *drop)}
    os.environ.update(fake)
    for k in drop:
        os.environ.pop(k, None)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def s3_proxy(s3_endpoint):
    """The loopback proxy of tests/support/s3_proxy.py in front of ``s3_endpoint``: it serialises writes, which gives
    moto's conditional writes S3's atomicity (races between writers need it), and can inject faults."""
    from support.s3_proxy import S3Proxy

    with S3Proxy(s3_endpoint) as proxy:
        yield proxy


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket on ``s3_endpoint`` (its name)."""
    import uuid

    import boto3

    name = f"t-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


def _transport(request, tmp_path, kind: str):
    from support.transports import Transport

    if kind == "s3":
        return Transport("s3", tmp_path, s3=request.getfixturevalue("s3_endpoint"),
                         proxy=request.getfixturevalue("s3_proxy"))
    if kind in ("hf", "hf_nodes"):
        return Transport(kind, tmp_path, server=request.getfixturevalue("hf_server"))
    return Transport(kind, tmp_path)


def _transport_params() -> list:
    """One case per registered transport (``diloco_lightning.hub.TRANSPORTS``) and each of its test stores
    (``support.transports.KINDS_OF_SCHEME``: hf has two layouts). A transport registered without a test
    store is a case whose Transport refuses it by name: a new transport is never left out silently. The
    default run covers the folder and one HF repository; CI's slow run adds the per-node layout and S3
    (moto behind the proxy: seconds a case), so every test still runs on every transport in CI."""
    from diloco_lightning.hub import TRANSPORTS
    from support.transports import KINDS_OF_SCHEME, SLOW_KINDS

    kinds = [kind for scheme in TRANSPORTS for kind in KINDS_OF_SCHEME.get(scheme, (scheme,))]
    return [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_KINDS else k for k in kinds]


@pytest.fixture(params=_transport_params())
def transport(request, tmp_path):
    """One hub on each transport with its failures (``tests/support/transports.py``): the folder, one Hugging Face
    repository, a repository per node, S3 behind the fault proxy."""
    t = _transport(request, tmp_path, request.param)
    yield t
    t.up()


@pytest.fixture
def slurm_cluster(tmp_path_factory):
    """A one-node SLURM cluster (``tests/support/slurm_cluster.py``: munged, slurmctld, slurmd from Debian's
    packages), skipped with the reason where the packages are missing or this is not root."""
    from support.slurm_cluster import SlurmCluster, missing

    lacking = missing()
    if lacking:
        pytest.skip(f"no SLURM here: {', '.join(lacking)} missing (apt-get install slurm-wlm munge; .ci/run does)")
    if os.geteuid() != 0:
        pytest.skip("the SLURM test cluster runs its daemons as root")
    pytest.importorskip("submitit", reason="launch=submitit needs submitit (pip install submitit; .ci/run does)")
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
