"""A loopback HTTP proxy in front of a real S3 server (moto's ``ThreadedMotoServer``), for the
``s3://`` tests: it forwards every request unchanged and can, on request,

* answer the next K matching requests with an S3 error (``inject(503, code="SlowDown")``), stall
  them past the client's timeout (``delay=``), drop the connection without an answer
  (``drop=True``), cut the body of the answer short (``truncate=True``), or forward them and
  then lose the answer (``apply=True``: the write happened, the client sees an error);
* strip ``If-None-Match`` / ``If-Match`` from what it forwards (``strip_conditionals``): a store
  that ignores conditional writes;
* cut every connection without an answer while :attr:`S3Proxy.down` is true (an outage: the
  store unreachable);
* fail a random share of the requests (:meth:`S3Proxy.random_faults`: seeded; a 503, a stall, a
  dropped connection, or a write whose answer is lost);
* log every request (:attr:`S3Proxy.requests`, :meth:`S3Proxy.count`).

Writes (PUT, POST, DELETE) are forwarded one at a time. moto evaluates ``If-None-Match`` /
``If-Match`` and then stores the object without holding a lock, so two racing conditional
writes can in principle both succeed there, while S3 evaluates the condition and the write
atomically. Serialising writes here gives the store S3's guarantee, so the race tests check
the client's logic rather than that gap of the emulator. Reads are not serialised.
"""

from __future__ import annotations

import contextlib
import http.client
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import urlsplit

__all__ = ["S3Proxy", "Request"]

_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect",
        "content-length"}
_CODES = {500: "InternalError", 503: "SlowDown", 429: "TooManyRequests", 403: "AccessDenied", 404: "NoSuchKey",
          412: "PreconditionFailed", 409: "ConditionalRequestConflict", 400: "InvalidRequest", 501: "NotImplemented"}


@dataclass
class Request:
    method: str
    path: str  # /bucket/key (path-style addressing)
    query: str
    status: int
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return f"{self.path}?{self.query}" if self.query else self.path


@dataclass
class _Fault:
    status: int
    remaining: int
    method: str | None
    match: str | Callable[[Request], bool] | None
    code: str
    apply: bool = False
    delay: float = 0.0
    drop: bool = False
    truncate: bool = False
    then_down: bool = False

    def hits(self, req: Request) -> bool:
        if self.method is not None and req.method != self.method:
            return False
        if self.match is None:
            return True
        return self.match(req) if callable(self.match) else self.match in req.target


class S3Proxy:
    def __init__(self, upstream: str, *, strip_conditionals: bool | Callable[[Request], bool] = False) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.strip_conditionals = strip_conditionals
        self.requests: list[Request] = []
        #: an outage: every request is answered by cutting the connection
        self.down = False
        self._faults: list[_Fault] = []
        self._random: tuple[float, Any, float] | None = None
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle

    def start(self) -> "S3Proxy":
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="s3-proxy")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)
            self._server = None

    def __enter__(self) -> "S3Proxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # ------------------------------------------------------------------ test helpers

    def inject(self, status: int = 503, count: int = 1, *, method: str | None = None,
               match: str | Callable[[Request], bool] | None = None, code: str | None = None, apply: bool = False,
               delay: float = 0.0, drop: bool = False, truncate: bool = False, then_down: bool = False) -> None:
        """The next ``count`` requests matching ``method`` and ``match`` (a substring of
        ``/bucket/key?query`` or a predicate) get ``status`` with S3 error ``code``; ``then_down``:
        an outage starts right after (:attr:`down`)."""
        with self._lock:
            self._faults.append(_Fault(status, count, method, match, code or _CODES.get(status, "InternalError"),
                                       apply, delay, drop, truncate, then_down))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def random_faults(self, rate: float, seed: int = 0, stall: float = 3.0) -> None:
        """From now on each request fails with probability ``rate`` (0: never), the kind drawn with a
        ``random.Random(seed)``: a 503 SlowDown, a stall of ``stall`` seconds (then served), a connection
        cut without an answer, or (writes) the write applied and its answer lost (benchmarks/chaos.py)."""
        import random

        with self._lock:
            self._random = (float(rate), random.Random(seed), float(stall)) if rate > 0 else None

    def _draw(self, req: Request) -> _Fault | None:
        with self._lock:
            if self._random is None:
                return None
            rate, rng, stall = self._random
            if rng.random() >= rate:
                return None
            kinds = ("503", "stall", "drop", "lost") if req.method in ("PUT", "POST", "DELETE") else ("503", "stall", "drop")
            kind = rng.choice(kinds)
        if kind == "503":
            return _Fault(503, 1, None, None, "SlowDown")
        if kind == "stall":
            return _Fault(0, 1, None, None, "", delay=stall)
        if kind == "drop":
            return _Fault(503, 1, None, None, "", drop=True)
        return _Fault(503, 1, None, None, "SlowDown", apply=True)

    def reset_log(self) -> None:
        with self._lock:
            self.requests.clear()

    def log(self, method: str | None = None, match: str | Callable[[Request], bool] | None = None) -> list[Request]:
        with self._lock:
            reqs = list(self.requests)
        return [r for r in reqs if _Fault(0, 0, method, match, "").hits(r)]

    def count(self, method: str | None = None, match: str | Callable[[Request], bool] | None = None) -> int:
        return len(self.log(method, match))

    def _take(self, req: Request) -> _Fault | None:
        with self._lock:
            for f in self._faults:
                if f.remaining > 0 and f.hits(req):
                    f.remaining -= 1
                    return f
        return None

    def _record(self, req: Request) -> None:
        with self._lock:
            self.requests.append(req)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in separate writes: no 40 ms delayed-ACK stalls
    owner: S3Proxy

    def log_message(self, format, *args) -> None:  # quiet
        pass

    def handle(self) -> None:
        with contextlib.suppress(ConnectionError, TimeoutError):
            super().handle()

    def do_GET(self) -> None:
        self._proxy()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _reply(self, status: int, headers: dict[str, str], body: bytes, length: int | None = None) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)
        self.wfile.flush()

    def _error(self, fault: _Fault) -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
                f"<Message>injected by the test proxy</Message><RequestId>proxy</RequestId></Error>").encode()
        self._reply(fault.status, {"Content-Type": "application/xml"}, body if self.command != "HEAD" else b"")

    def _hang_up(self, req: Request) -> None:
        """No answer at all (the store unreachable, or a dropped connection): recorded as status -1."""
        req.status = -1
        self.owner._record(req)
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(2)

    def _proxy(self) -> None:
        owner = self.owner
        body = self._body()
        url = urlsplit(self.path)
        req = Request(self.command, url.path, url.query, 0, {k.lower(): v for k, v in self.headers.items()})
        if owner.down:  # unreachable: no answer at all
            self._hang_up(req)
            return
        fault = owner._take(req) or owner._draw(req)
        if fault is not None and fault.delay:
            time.sleep(fault.delay)
        if fault is not None and fault.drop:
            self._hang_up(req)
            return
        if fault is not None and fault.status == 0:  # a stall only: then served as usual
            fault = None
        if fault is not None and not fault.apply and not fault.truncate:
            req.status = fault.status
            owner._record(req)
            self._error(fault)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        strip = owner.strip_conditionals
        if strip is True or (callable(strip) and strip(req)):
            headers = {k: v for k, v in headers.items() if k.lower() not in ("if-none-match", "if-match")}
        writes = self.command in ("PUT", "POST", "DELETE")
        with owner._write_lock if writes else contextlib.nullcontext():
            conn = http.client.HTTPConnection(*owner.upstream, timeout=120)
            try:
                conn.request(self.command, self.path, body=body if body or writes else None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                out_headers = {k: v for k, v in resp.getheaders() if k.lower() not in _HOP}
                status, length = resp.status, resp.getheader("Content-Length")
            finally:
                conn.close()
        if fault is not None and fault.apply:  # the write happened; its answer is lost
            req.status = fault.status
            owner._record(req)
            if fault.then_down:
                owner.down = True
            self._error(fault)
            return
        req.status = status
        owner._record(req)
        if fault is not None and fault.truncate and self.command == "GET" and len(data) > 1:
            self.close_connection = True
            self._reply(status, out_headers, data[: len(data) // 2], length=len(data))
            return
        head_length = int(length) if self.command == "HEAD" and length and length.isdigit() else None
        self._reply(status, out_headers, data, length=head_length)
