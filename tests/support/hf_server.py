"""A fake Hugging Face Hub: a real HTTP server on 127.0.0.1 speaking the part of the
Hub's HTTP API that ``huggingface_hub.HfApi`` uses for the ``hf://`` transport.

Routes (model repositories, one branch ``main``, a linear history per repo)::

    POST      /api/repos/create                                 create_repo
    GET       /api/models?author=&search=&expand=               list_models (``id``, ``sha`` = head; paginated)
    GET       /api/models/{ns}/{name}[/revision/{rev}]          repo_info / model_info (``sha`` = head)
    POST      /api/models/{ns}/{name}/preupload/{rev}           preupload (always ``uploadMode: regular``)
    POST      /api/models/{ns}/{name}/commit/{rev}              create_commit (NDJSON; ``parentCommit`` -> 412 if stale)
    GET       /api/models/{ns}/{name}/tree/{rev}[/{path}]       list_repo_tree (paginated with a ``Link`` header)
    POST      /api/models/{ns}/{name}/paths-info/{rev}          get_paths_info (form ``paths=...``)
    HEAD/GET  /{ns}/{name}/resolve/{rev}/{path}                 file metadata / content (``X-Repo-Commit``, ``ETag``)

Errors carry ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``) like
the real Hub, and a missing file on ``resolve`` still answers ``X-Repo-Commit``.

Test helpers: :meth:`FakeHubServer.inject` (the next K requests to a route answer a given
status, or stall), an outage (:attr:`FakeHubServer.down`: while true every connection is cut
without an answer, as an unreachable Hub would), a request log (:attr:`FakeHubServer.requests`, :meth:`FakeHubServer.count`),
direct access to the repositories (:meth:`FakeHubServer.commit_files`, :meth:`FakeHubServer.files`,
:meth:`FakeHubServer.commits`), and an optional required token (401 otherwise).

Use it as a context manager::

    with FakeHubServer() as server:
        api = HfApi(endpoint=server.endpoint, token="x")
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

__all__ = ["Commit", "FakeHubServer", "Request", "git_blob_sha1"]


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob (what the Hub calls a regular file's ``oid`` / ``ETag``)."""
    h = hashlib.sha1()
    h.update(b"blob %d\0" % len(data))
    h.update(data)
    return h.hexdigest()


@dataclass
class Commit:
    oid: str
    parent: str | None
    files: dict[str, bytes]  # full snapshot: path -> content
    summary: str = ""
    added: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)


@dataclass
class Request:
    method: str
    route: str  # create, info, preupload, commit, tree, paths_info, resolve, unknown
    path: str
    status: int
    repo: str | None = None
    at: float = field(default_factory=time.monotonic)  # when it arrived (time.monotonic)


@dataclass
class _Fault:
    route: str
    status: int
    remaining: int
    method: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    apply: bool = False
    then_down: bool = False


class _Repo:
    def __init__(self, repo_id: str, private: bool = False) -> None:
        self.repo_id = repo_id
        self.private = private
        self.lock = threading.Lock()
        first = Commit(_new_oid(repo_id, None, 0), None, {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"},
                       "initial commit", [".gitattributes"], [])
        self.commits: list[Commit] = [first]

    @property
    def head(self) -> Commit:
        return self.commits[-1]

    def at(self, rev: str) -> Commit | None:
        if rev == "main":
            return self.head
        for c in self.commits:
            if c.oid == rev:
                return c
        return None

    def commit(self, parent: str | None, adds: dict[str, bytes], deletes: list[str], summary: str) -> Commit:
        """Apply a commit on ``main`` (caller holds ``self.lock``)."""
        files = dict(self.head.files)
        for p in deletes:
            files.pop(p, None)
        files.update(adds)
        c = Commit(_new_oid(self.repo_id, self.head.oid, len(self.commits)), self.head.oid, files, summary, sorted(adds), sorted(deletes))
        self.commits.append(c)
        return c


def _new_oid(repo_id: str, parent: str | None, n: int) -> str:
    return hashlib.sha1(f"{repo_id}|{parent}|{n}|{os.urandom(8).hex()}".encode()).hexdigest()


def _dirs_of(files: dict[str, bytes]) -> set[str]:
    out = set()
    for p in files:
        parts = p.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            out.add("/".join(parts[:i]))
    return out


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}


class FakeHubServer:
    """In-memory Hub on ``http://127.0.0.1:<port>``. See the module docstring."""

    def __init__(self, *, token: str | None = None, page_size: int = 1000) -> None:
        self.token = token
        self.page_size = page_size
        self.repos: dict[str, _Repo] = {}
        self.requests: list[Request] = []
        self._faults: list[_Fault] = []
        #: an outage: every request is answered by cutting the connection
        self.down = False
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FakeHubServer:
        server = self

        class Handler(_Handler):
            hub = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02},
                                        name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> FakeHubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        assert self._httpd is not None, "server not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    # ------------------------------------------------------------------ test helpers

    def inject(self, route: str, status: int = 503, count: int = 1, *, method: str | None = None,
               headers: dict[str, str] | None = None, delay: float = 0.0, apply: bool = False,
               then_down: bool = False) -> None:
        """The next ``count`` requests to ``route`` (optionally only ``method``) answer ``status``
        (after sleeping ``delay`` seconds; ``status=0`` only stalls, then serves normally).
        ``apply=True``: the request is carried out first and only its answer is lost (a commit
        that landed although the client saw a 503). ``then_down``: an outage starts right after
        it (:attr:`down`)."""
        with self._lock:
            self._faults.append(_Fault(route, status, count, method, dict(headers or {}), delay, apply, then_down))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def count(self, route: str | None = None, method: str | None = None, *, path_prefix: str | None = None) -> int:
        with self._lock:
            return sum(
                1
                for r in self.requests
                if (route is None or r.route == route)
                and (method is None or r.method == method)
                and (path_prefix is None or r.path.startswith(path_prefix))
            )

    def reset_log(self) -> None:
        with self._lock:
            self.requests.clear()

    def create_repo(self, repo_id: str, private: bool = False) -> None:
        with self._lock:
            self.repos.setdefault(repo_id, _Repo(repo_id, private))

    def commit_files(self, repo_id: str, adds: dict[str, bytes] | None = None, deletes: list[str] | tuple = (), summary: str = "test") -> str:
        """Commit directly (no HTTP), e.g. to plant a hostile file. Returns the new head."""
        repo = self.repos[repo_id]
        with repo.lock:
            return repo.commit(None, dict(adds or {}), list(deletes), summary).oid

    def head(self, repo_id: str) -> str:
        return self.repos[repo_id].head.oid

    def files(self, repo_id: str, rev: str = "main") -> dict[str, bytes]:
        c = self.repos[repo_id].at(rev)
        assert c is not None
        return dict(c.files)

    def commits(self, repo_id: str) -> list[Commit]:
        return list(self.repos[repo_id].commits)

    # ------------------------------------------------------------------ internals used by the handler

    def _take_fault(self, route: str, method: str) -> _Fault | None:
        with self._lock:
            for f in self._faults:
                if f.route == route and (f.method is None or f.method == method) and f.remaining > 0:
                    f.remaining -= 1
                    if f.remaining == 0:
                        self._faults.remove(f)
                    return f
        return None

    def _log(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHubServer  # set on the per-server subclass
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # else each small response waits ~40 ms for the client's delayed ACK

    def log_message(self, format, *args) -> None:  # quiet
        pass

    def handle(self) -> None:
        try:
            super().handle()
        except (ConnectionError, TimeoutError):  # the client gave up (a timeout test): nothing to answer
            self.close_connection = True

    # ------------------------------------------------------------------ plumbing

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        if getattr(self, "_swallow", False):  # an ``apply`` fault: the answer is replaced by the fault's
            return
        self._log_once(status)  # before answering: a client that got its answer finds its request logged
        self.send_response(status)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        hdrs["Content-Length"] = hdrs.get("Content-Length") or str(len(body))
        for k, v in hdrs.items():
            self.send_header(k, v)
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        segs = split.path.strip("/").split("/")
        query = parse_qs(split.query)
        route, repo_id, handler = self._route(method, segs)
        self._pending = Request(method, route, split.path, 500, repo_id)
        body = self._body() if method == "POST" else b""
        if self.hub.down:  # unreachable: no answer at all
            self._pending = None
            self.close_connection = True
            try:
                self.connection.shutdown(2)
            except OSError:
                pass
            return
        try:
            fault = self.hub._take_fault(route, method)
            if fault is not None:
                if fault.delay:
                    time.sleep(fault.delay)
                if fault.status and fault.apply and handler is not None:
                    self._swallow = True
                    try:
                        handler(method, segs, query, body, repo_id)
                    except _HTTPError:
                        pass
                    finally:
                        self._swallow = False
                        if fault.then_down:
                            self.hub.down = True
                    raise _HTTPError(fault.status, f"injected {fault.status} (request applied)", headers=fault.headers)
                if fault.status:
                    raise _HTTPError(fault.status, f"injected {fault.status}", headers=fault.headers)
            if self.hub.token is not None and self.headers.get("Authorization") != f"Bearer {self.hub.token}":
                raise _HTTPError(401, "Invalid credentials in Authorization header")
            if handler is None:
                raise _HTTPError(404, f"no route for {method} {split.path}")
            handler(method, segs, query, body, repo_id)
        except _HTTPError as e:
            hdrs = dict(e.headers)
            if e.code:
                hdrs["X-Error-Code"] = e.code
            hdrs["X-Error-Message"] = e.message
            try:
                self._json(e.status, {"error": e.message}, hdrs)
            except OSError:
                pass
        finally:
            self._log_once(500)

    def _log_once(self, status: int) -> None:
        req, self._pending = getattr(self, "_pending", None), None
        if req is not None:
            req.status = status
            self.hub._log(req)

    def _route(self, method: str, segs: list[str]):
        s = [unquote(x) for x in segs]
        if method == "POST" and s[:3] == ["api", "repos", "create"]:
            return "create", None, self._create
        if method == "GET" and s == ["api", "models"]:
            return "models", None, self._models
        if len(s) >= 4 and s[:2] == ["api", "models"]:
            repo_id = f"{s[2]}/{s[3]}"
            rest = s[4:]
            if method == "GET" and (not rest or (len(rest) == 2 and rest[0] == "revision")):
                return "info", repo_id, self._info
            if method == "POST" and len(rest) == 2 and rest[0] == "preupload":
                return "preupload", repo_id, self._preupload
            if method == "POST" and len(rest) == 2 and rest[0] == "commit":
                return "commit", repo_id, self._commit
            if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
                return "tree", repo_id, self._tree
            if method == "POST" and len(rest) == 2 and rest[0] == "paths-info":
                return "paths_info", repo_id, self._paths_info
            return "unknown", repo_id, None
        if len(s) >= 5 and s[2] == "resolve" and method in ("GET", "HEAD"):
            return "resolve", f"{s[0]}/{s[1]}", self._resolve
        return "unknown", None, None

    def _repo(self, repo_id: str) -> _Repo:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            raise _HTTPError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def _commit_at(self, repo: _Repo, rev: str) -> Commit:
        c = repo.at(rev)
        if c is None:
            raise _HTTPError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return c

    @staticmethod
    def _entry(path: str, files: dict[str, bytes]) -> dict:
        if path in files:
            return {"type": "file", "oid": git_blob_sha1(files[path]), "size": len(files[path]), "path": path}
        return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path}

    # ------------------------------------------------------------------ routes

    def _create(self, method, segs, query, body, repo_id):
        doc = json.loads(body or b"{}")
        if doc.get("type") not in (None, "model"):
            raise _HTTPError(400, "only model repositories are supported by the fake hub")
        repo_id = f"{doc.get('organization') or 'user'}/{doc['name']}"
        with self.hub._lock:
            exists = repo_id in self.hub.repos
            if not exists:
                self.hub.repos[repo_id] = _Repo(repo_id, doc.get("visibility") == "private" or bool(doc.get("private")))
        if exists:  # the real Hub's 409 carries the URL too (create_repo(exist_ok=True) reads it)
            msg = "You already created this model repo"
            return self._json(409, {"error": msg, "url": f"{self.hub.endpoint}/{repo_id}"}, {"X-Error-Message": msg})
        self._json(200, {"url": f"{self.hub.endpoint}/{repo_id}", "name": repo_id, "id": repo_id})

    def _models(self, method, segs, query, body, repo_id):
        author = (query.get("author") or [None])[0]
        search = (query.get("search") or [""])[0].lower()
        with self.hub._lock:
            repos = sorted(self.hub.repos.items())
        items = [{"id": rid, "modelId": rid, "sha": repo.head.oid, "private": repo.private}
                 for rid, repo in repos
                 if (author is None or rid.split("/")[0] == author) and search in rid.split("/")[1].lower()]
        start = int((query.get("cursor") or ["0"])[0])
        page = items[start : start + self.hub.page_size]
        headers = {}
        if start + self.hub.page_size < len(items):
            host = self.headers.get("Host") or f"127.0.0.1:{self.server.server_address[1]}"
            rest = urlencode([(k, v) for k, vs in query.items() if k != "cursor" for v in vs]
                             + [("cursor", start + self.hub.page_size)])
            headers["Link"] = f'<http://{host}/api/models?{rest}>; rel="next"'
        self._json(200, page, headers)

    def _info(self, method, segs, query, body, repo_id):
        repo = self._repo(repo_id)
        rest = [unquote(x) for x in segs[4:]]
        c = self._commit_at(repo, rest[1] if rest else "main")
        self._json(200, {
            "id": repo_id, "modelId": repo_id, "sha": c.oid, "private": repo.private,
            "siblings": [{"rfilename": p} for p in sorted(c.files)],
        })

    def _preupload(self, method, segs, query, body, repo_id):
        repo = self._repo(repo_id)
        c = self._commit_at(repo, unquote(segs[5]))
        doc = json.loads(body)
        out = []
        for f in doc.get("files", []):
            existing = c.files.get(f["path"])
            out.append({"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                        "oid": git_blob_sha1(existing) if existing is not None else None})
        self._json(200, {"files": out, "commitOid": c.oid})

    def _commit(self, method, segs, query, body, repo_id):
        repo = self._repo(repo_id)
        rev = unquote(segs[5])
        if rev != "main":
            raise _HTTPError(400, f"the fake hub only commits to 'main', not {rev!r}")
        lines = [json.loads(x) for x in body.splitlines() if x.strip()]
        if not lines or lines[0].get("key") != "header":
            raise _HTTPError(400, "first NDJSON line must be the header")
        header = lines[0]["value"]
        adds: dict[str, bytes] = {}
        deletes: list[str] = []
        for item in lines[1:]:
            key, value = item.get("key"), item.get("value") or {}
            if key == "file":
                if value.get("encoding") != "base64":
                    raise _HTTPError(400, "only base64 file content is supported")
                adds[value["path"]] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                deletes.append(value["path"].rstrip("/"))
            elif key == "lfsFile":
                raise _HTTPError(400, "LFS is not supported by the fake hub (preupload answers 'regular')")
            else:
                raise _HTTPError(400, f"unknown commit operation {key!r}")
        with repo.lock:
            parent = header.get("parentCommit")
            if parent is not None and parent != repo.head.oid:
                raise _HTTPError(412, f"A commit has happened since. Please refresh and try again. (parent {parent[:8]} is not the head {repo.head.oid[:8]})")
            expanded = []
            for p in deletes:
                if p in repo.head.files:
                    expanded.append(p)
                else:
                    under = [q for q in repo.head.files if q.startswith(p + "/")]
                    if not under:
                        raise _HTTPError(404, f"A file with this name doesn't exist: {p}", "EntryNotFound")
                    expanded.extend(under)
            c = repo.commit(parent, adds, expanded, header.get("summary", ""))
        self._json(200, {"success": True, "commitOid": c.oid, "commitUrl": f"https://huggingface.co/{repo_id}/commit/{c.oid}",  # as the real Hub answers
                         "pullRequestUrl": None})

    def _tree(self, method, segs, query, body, repo_id):
        repo = self._repo(repo_id)
        c = self._commit_at(repo, unquote(segs[5]))
        base = "/".join(unquote(x) for x in segs[6:]).strip("/")
        recursive = (query.get("recursive") or ["false"])[0].lower() in ("1", "true")
        files = c.files
        dirs = _dirs_of(files)
        if base and base not in dirs:
            raise _HTTPError(404, f"Entry not found: {base}", "EntryNotFound", {"X-Repo-Commit": c.oid})
        prefix = base + "/" if base else ""
        entries = []
        for p in sorted(set(files) | dirs):
            if not p.startswith(prefix):
                continue
            rel = p[len(prefix):]
            if not recursive and "/" in rel:
                continue
            entries.append(self._entry(p, files))
        start = int((query.get("cursor") or ["0"])[0])
        page = entries[start : start + self.hub.page_size]
        headers = {"X-Repo-Commit": c.oid}
        if start + self.hub.page_size < len(entries):
            host = self.headers.get("Host") or f"127.0.0.1:{self.server.server_address[1]}"
            path = urlsplit(self.path).path
            nxt = f"http://{host}{path}?recursive={str(recursive).lower()}&expand=false&cursor={start + self.hub.page_size}"
            headers["Link"] = f'<{nxt}>; rel="next"'
        self._json(200, page, headers)

    def _paths_info(self, method, segs, query, body, repo_id):
        repo = self._repo(repo_id)
        c = self._commit_at(repo, unquote(segs[5]))
        ctype = self.headers.get("Content-Type", "")
        if "json" in ctype:
            paths = json.loads(body).get("paths", [])
        else:
            paths = parse_qs(body.decode()).get("paths", [])
        dirs = _dirs_of(c.files)
        out = [self._entry(p, c.files) for p in paths if p in c.files or p in dirs]
        self._json(200, out)

    def _resolve(self, method, segs, query, body, repo_id):
        repo = self._repo(repo_id)
        c = self._commit_at(repo, unquote(segs[3]))
        path = "/".join(unquote(x) for x in segs[4:])
        data = c.files.get(path)
        if data is None:
            raise _HTTPError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": c.oid})
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Length": str(len(data)),
            "ETag": f'"{git_blob_sha1(data)}"',
            "X-Repo-Commit": c.oid,
            "Accept-Ranges": "bytes",
        }
        self._send(200, data, headers)
