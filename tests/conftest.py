"""Fixtures shared by several test files."""

from __future__ import annotations

import logging
import os

import pytest


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
