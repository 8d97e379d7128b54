"""The hub transports of the exactly-once and hostile-file tests, each with the failures it can have.
Not a test module (no ``test_`` prefix).

:class:`Transport` is one hub on one transport: ``"file"`` (a folder), ``"hf"`` (one repository on
the loopback Hugging Face server of ``tests/support/hf_server.py``), ``"hf_nodes"`` (the same server with
``layout="per_node"``: the master's repository and one per node) or ``"s3"`` (moto behind the
fault proxy of ``tests/support/s3_proxy.py``). It opens handles as separate machines would (each with its
own cache), writes raw files as any hub writer could (:meth:`Transport.put`), and fails as a real
store does:

* :meth:`Transport.lose_next_delta_answer`: the next delta upload lands on the hub, its answer is
  lost, and an outage starts right after (every retry, listing and manifest read fails);
* :meth:`Transport.down` / :meth:`Transport.up`: the store unreachable (connections cut without an
  answer on hf and s3; every call of the folder hub raises ``ConnectionError``, for the in-process
  handles :meth:`Transport.open` made).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from diloco_lightning.hub.local import FileHub

REPO = "org/exactly"
TOKEN = "hf_exactlyONCEtoken0123456789"
#: the test stores of each registered transport's scheme (``diloco_lightning.hub.TRANSPORTS``)
KINDS_OF_SCHEME = {"file": ("file",), "hf": ("hf", "hf_nodes"), "s3": ("s3",)}
KINDS = tuple(kind for kinds in KINDS_OF_SCHEME.values() for kind in kinds)
#: the stores only CI's slow run covers (seconds a case)
SLOW_KINDS = frozenset({"hf_nodes", "s3"})

#: remote handles retry little and fast in tests (an outage must surface in well under a second)
FAST_REMOTE = {"max_retries": 1, "retry_base_delay": 0.01, "retry_max_delay": 0.05, "timeout": 5}


class _State:
    down = False
    lose_next = False


class FlakyFileHub(FileHub):
    """A folder hub whose calls fail while its transport is down (a network filesystem that went away)."""

    def __init__(self, root, state: _State, **kw) -> None:
        super().__init__(root, **kw)
        self._state = state

    def _check(self) -> None:
        if self._state.down:
            raise ConnectionError(f"{self.url} unreachable (injected outage)")

    def upload_delta(self, local_file, node_id, local_step):
        self._check()
        path = super().upload_delta(local_file, node_id, local_step)
        if self._state.lose_next:
            self._state.lose_next, self._state.down = False, True
            raise TimeoutError("the upload's answer was lost (injected); it landed")
        return path


def _flaky(name: str):
    def method(self, *args, **kw):
        self._check()
        return getattr(FileHub, name)(self, *args, **kw)

    method.__name__ = name
    return method


for _name in ("upload_init", "list_deltas", "list_node_deltas", "list_inits", "list_global", "download",
              "read_manifest_bytes", "read_manifest", "publish", "delete", "read_lease", "write_lease", "read_claim",
              "write_claim", "list_claims"):
    setattr(FlakyFileHub, _name, _flaky(_name))


class Transport:
    """One hub on one transport (module docstring). ``server``: a ``FakeHubServer`` (hf, hf_nodes);
    ``s3``: moto's endpoint and ``proxy`` the ``S3Proxy`` in front of it (s3)."""

    def __init__(self, kind: str, tmp: Path, *, server: Any = None, s3: str | None = None, proxy: Any = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown transport {kind!r}: no test store for it (add one to KINDS_OF_SCHEME and Transport "
                             "in tests/support/transports.py)")
        self.kind, self.tmp, self.server, self.s3, self.proxy = kind, Path(tmp), server, s3, proxy
        self.root = self.tmp / "hub"
        self._state = _State()
        self._n = 0
        if kind == "s3":
            import boto3

            self.client = boto3.client("s3", endpoint_url=s3, region_name="us-east-1")
            self.bucket = f"x-{uuid.uuid4().hex[:16]}"
            self.client.create_bucket(Bucket=self.bucket)
            proxy.clear_faults()
            proxy.down = False
        if kind in ("hf", "hf_nodes"):
            server.down = False
            server.create_repo(REPO)

    # ------------------------------------------------------------------ handles

    @property
    def url(self) -> str:
        if self.kind == "file":
            return self.root.as_uri()
        if self.kind == "s3":
            return f"s3://{self.bucket}/run"
        return f"hf://{REPO}"

    def options(self, name: str = "opts") -> dict[str, Any]:
        """``open_hub`` options of a handle named ``name`` (its own cache), e.g. for a subprocess worker."""
        cache = str(self.tmp / f"cache-{name}")
        if self.kind == "file":
            return {"cache_dir": cache}
        if self.kind == "s3":
            return {"endpoint_url": self.proxy.endpoint, "addressing_style": "path", "cache_dir": cache, **FAST_REMOTE}
        opts = {"endpoint": self.server.endpoint, "token": TOKEN, "cache_dir": cache, "commits_per_hour": 0,
                **FAST_REMOTE}
        if self.kind == "hf_nodes":
            opts["layout"] = "per_node"
        return opts

    def open(self, name: str | None = None):
        """A new handle (as another machine would open the hub)."""
        self._n += 1
        name = name or f"h{self._n}"
        if self.kind == "file":
            return FlakyFileHub(self.root, self._state, cache_dir=self.tmp / f"cache-{name}")
        from diloco_lightning.hub import open_hub

        return open_hub(self.url, **self.options(name))

    # ------------------------------------------------------------------ failures

    def lose_next_delta_answer(self) -> None:
        """The next delta upload lands, its answer is lost, then the store goes down (see module docstring)."""
        if self.kind == "file":
            self._state.lose_next = True
        elif self.kind == "s3":
            self.proxy.inject(503, method="PUT", match="/nodes/", apply=True, then_down=True)
        else:
            self.server.inject("commit", 503, apply=True, then_down=True)

    def down(self) -> None:
        if self.kind == "file":
            self._state.down = True
        elif self.kind == "s3":
            self.proxy.down = True
        else:
            self.server.down = True

    def up(self) -> None:
        if self.kind == "file":
            self._state.down = False
        elif self.kind == "s3":
            self.proxy.down = False
            self.proxy.clear_faults()
        else:
            self.server.down = False
            self.server.clear_faults()

    @property
    def is_down(self) -> bool:
        if self.kind == "file":
            return self._state.down
        return bool(self.proxy.down if self.kind == "s3" else self.server.down)

    # ------------------------------------------------------------------ raw writes (any hub writer)

    def _repo_of(self, path: str) -> str:
        if self.kind == "hf_nodes" and path.startswith("nodes/"):
            node = path.split("/")[1]
            self.server.create_repo(f"{REPO}-{node}")
            return f"{REPO}-{node}"
        return REPO

    def put(self, path: str, data: bytes) -> None:
        if self.kind == "file":
            p = self.root / path
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        elif self.kind == "s3":
            self.client.put_object(Bucket=self.bucket, Key=f"run/{path}", Body=data)
        else:
            self.server.commit_files(self._repo_of(path), adds={path: data})

    def delete(self, path: str) -> None:
        if self.kind == "file":
            (self.root / path).unlink()
        elif self.kind == "s3":
            self.client.delete_object(Bucket=self.bucket, Key=f"run/{path}")
        else:
            self.server.commit_files(self._repo_of(path), deletes=[path])

    def exists(self, path: str) -> bool:
        if self.kind == "file":
            return (self.root / path).exists()
        if self.kind == "s3":
            r = self.client.list_objects_v2(Bucket=self.bucket, Prefix=f"run/{path}")
            return any(o["Key"] == f"run/{path}" for o in r.get("Contents") or [])
        return path in self.server.files(self._repo_of(path))
