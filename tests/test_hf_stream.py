"""The hf:// transport's HTTP branches for each client ``huggingface_hub`` may share (issue 42, item 3).

The pinned range (``huggingface_hub>=0.34``) includes 0.34-0.x, whose shared client is a
``requests.Session``; the installed one (1.0 and later) shares an ``httpx`` client (``httpx2`` in 2.x). Both branches
of ``hub/hf_stream.py`` (streamed GET, capped read, chunked body) and of the guard
(``hf_guard.guard_client``) run here with a real client of each library against the loopback Hub
server, so the branch the installed ``huggingface_hub`` does not take is tested too.
"""

from __future__ import annotations

import pytest

from support.hf_server import FakeHubServer

from diloco_lightning.hub.hf_guard import _GUARD, _GuardOptions, _TransientError, guard_client
from diloco_lightning.hub.hf_stream import is_requests_session, iter_body, read_capped, stream_get

REPO = "org/run"
BODY = bytes(range(256)) * 1024  # 256 KiB, several chunks


def _requests_session():
    requests = pytest.importorskip("requests")
    return requests.Session()


def _httpx_client():
    """The kind of client the installed ``huggingface_hub`` shares (``httpx``, or its fork ``httpx2``)."""
    from huggingface_hub.utils import get_session

    shared = get_session()
    if is_requests_session(shared):  # huggingface_hub < 1.0: take httpx itself if it is there
        return pytest.importorskip("httpx").Client()
    return type(shared)()


CLIENTS = {"requests": _requests_session, "httpx": _httpx_client}


@pytest.fixture
def server():
    with FakeHubServer() as s:
        s.create_repo(REPO)
        s.commit_files(REPO, {"global/manifest.json": BODY})
        yield s


def _url(server: FakeHubServer, path: str = "global/manifest.json") -> str:
    return f"{server.endpoint}/{REPO}/resolve/main/{path}"


@pytest.mark.parametrize("kind", sorted(CLIENTS))
def test_a_streamed_get_reads_the_whole_body_in_chunks(server, kind):
    session = CLIENTS[kind]()
    assert is_requests_session(session) == (kind == "requests")
    with stream_get(session, _url(server), {}) as r:
        assert r.status_code == 200
        assert r.headers.get("X-Repo-Commit") == server.head(REPO)
        chunks = list(iter_body(r, 4096))
    assert b"".join(chunks) == BODY
    assert len(chunks) >= len(BODY) // 4096 and max(len(c) for c in chunks) <= 4096


@pytest.mark.parametrize("kind", sorted(CLIENTS))
def test_a_capped_read_keeps_at_most_the_cap(server, kind):
    session = CLIENTS[kind]()
    with stream_get(session, _url(server), {}) as r:
        got = read_capped(r, 1000, chunk=256)
    assert got == BODY[:1000]
    with stream_get(session, _url(server), {}) as r:
        assert read_capped(r, 10 * len(BODY)) == BODY  # a cap above the size: the whole body


@pytest.mark.parametrize("kind", sorted(CLIENTS))
def test_a_missing_file_answers_404_on_either_client(server, kind):
    session = CLIENTS[kind]()
    with stream_get(session, _url(server, "global/absent.json"), {}) as r:
        assert r.status_code == 404
        assert r.headers.get("X-Error-Code") == "EntryNotFound"


@pytest.mark.parametrize("kind", sorted(CLIENTS))
def test_the_guard_raises_a_retryable_answer_only_under_our_calls(server, kind):
    session = CLIENTS[kind]()
    guard_client(session)
    guard_client(session)  # once: a second call wraps nothing again
    if kind == "requests":
        assert all(getattr(a, "_diloco_guard", False) for a in session.adapters.values())
    server.inject("resolve", 503, count=1, headers={"Retry-After": "7"})
    with stream_get(session, _url(server), {}) as r:  # not under our guard: passed through as it came
        assert r.status_code == 503
    server.inject("resolve", 503, count=1, headers={"Retry-After": "7"})
    token = _GUARD.set(_GuardOptions(timeout=5.0))
    try:
        with pytest.raises(_TransientError) as e:
            with stream_get(session, _url(server), {}):
                pass
        assert e.value.status == 503 and e.value.retry_after == 7.0
        with stream_get(session, _url(server), {}) as r:  # the next answer is a plain 200
            assert read_capped(r, len(BODY)) == BODY
    finally:
        _GUARD.reset(token)
