"""An HTTP proxy on 127.0.0.1 that counts what passes through it and injects faults.

It sits between a client (obstore) and a real server started by the test suite (moto,
fake-gcs-server, Azurite). Every request is recorded (method, path, query, status, body bytes
each way, the access key the request was signed with), so tests can assert how many bytes a
load moved and how often a file was fetched. A ``rate`` fraction of requests, drawn by a seeded generator, gets
a fault; the kinds take turns:

- ``"503"``: answer ``503 SlowDown`` without forwarding (S3's throttling reply);
- ``"500"``: answer ``500 InternalError`` without forwarding;
- ``"reset"``: reset the TCP connection before forwarding;
- ``"cut"``: forward, then send the headers and half the body, and reset (GET only);
- ``"lost"``: forward, then reset instead of answering: the server acted, the client cannot
  know (not GET).

``limit`` caps the number of faults injected. ``deny(pattern, status)`` answers every request
whose ``path?query`` matches with a permanent error instead. ``corrupt(pattern, at=n)`` flips
bits of byte ``n`` of an object in every successful GET answer that carries it, status,
headers and length left as the server sent them (its own checks passed): only a checksum of
the content can tell.

The proxy is a thread per connection with HTTP/1.1 keep-alive, forwarding over one persistent
upstream connection per thread. Bodies are held in memory: it is for tests, not for speed.
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

__all__ = ["FaultyProxy", "Record", "Response"]

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}
_SIGNED_KEY = re.compile(r"Credential=([^/,\s]+)/\d+/([^/]+)/")  # AWS SigV4: key id, date, region
_SHARED_KEY = re.compile(r"SharedKey ([^:\s]+):")  # Azure shared key


@dataclass(frozen=True)
class Record:
    method: str
    path: str  # unquoted path, no query
    query: str
    status: int  # 0 when the connection was reset before any answer
    sent: int  # request body bytes from the client
    received: int  # response body bytes sent back to the client
    fault: str | None
    key_id: str | None  # the access key / account that signed the request, or "bearer:<token>"
    region: str | None  # the region in an AWS SigV4 credential scope
    start: float  # time.monotonic() when the request had been read, and when the answer was sent
    end: float


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]]
    body: bytes = b""
    reason: str = ""


@dataclass
class _Plan:
    rate: float = 0.0
    kinds: tuple[str, ...] = ()
    methods: frozenset[str] | None = None
    path: re.Pattern | None = None
    limit: int | None = None
    injected: Counter = field(default_factory=Counter)
    denied: list[list] = field(default_factory=list)  # [pattern, methods, status, requests still let through]
    corrupted: list[list] = field(default_factory=list)  # [pattern, object byte or None, mask, answers left or None]
    delayed: list[list] = field(default_factory=list)  # [pattern, methods, seconds]


class FaultyProxy:
    """Forward ``http://127.0.0.1:<port>`` to ``upstream``; see the module docstring."""

    def __init__(self, upstream: str, *, seed: int = 0) -> None:
        parts = urlsplit(upstream)
        self.upstream_host = parts.hostname or "127.0.0.1"
        self.upstream_port = parts.port or 80
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._plan = _Plan()
        self.records: list[Record] = []
        self._local = threading.local()
        proxy = self

        class Handler(_Handler):
            owner = proxy

        server_class = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 128})  # many ranks connect at once
        self._server = server_class(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.handle_error = lambda request, client_address: None  # resets are on purpose
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"proxy-{self.port}", daemon=True)

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self) -> FaultyProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # --- configuration -----------------------------------------------------------------------

    def faults(
        self, rate: float, kinds: tuple[str, ...] = ("503", "reset"), *, methods=None, path: str | None = None,
        limit: int | None = None,
    ) -> None:
        """Inject one of ``kinds`` into a ``rate`` fraction of matching requests (0 turns it off)."""
        unknown = set(kinds) - {"503", "500", "reset", "cut", "lost"}
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}")
        with self._lock:
            self._plan.rate = rate
            self._plan.kinds = tuple(kinds)
            self._plan.methods = frozenset(methods) if methods else None
            self._plan.path = re.compile(path) if path else None
            self._plan.limit = limit
            self._plan.injected = Counter()

    def deny(self, path: str, status: int = 403, *, methods=None, after: int = 0) -> None:
        """Answer every request whose ``path?query`` matches ``path`` (a regex) with ``status``,
        for good, once ``after`` matching requests have been let through."""
        with self._lock:
            self._plan.denied.append([re.compile(path), frozenset(methods) if methods else None, status, after])

    def delay(self, seconds: float, *, path: str = "", methods=None) -> None:
        """Hold every matching request ``seconds`` before forwarding it (its record includes the
        wait): requests a client sends at once then overlap, however busy the machine is."""
        with self._lock:
            self._plan.delayed.append([re.compile(path), frozenset(methods) if methods else None, seconds])

    def _delay_for(self, method: str, path: str) -> float:
        with self._lock:
            return sum(s for pattern, methods, s in self._plan.delayed if pattern.search(path) and (methods is None or method in methods))

    def corrupt(self, path: str, *, at: int | None = None, mask: int = 0x01, limit: int | None = None) -> None:
        """Flip the bits ``mask`` of byte ``at`` of every object whose path matches ``path`` (a
        regex) in each successful GET answer that carries that byte (ranged or whole), for at
        most ``limit`` answers (None: no limit). ``at=None``: a byte of the body drawn by the
        seeded generator. Records of those answers have ``fault="corrupt"``."""
        if not 0 < mask < 256:
            raise ValueError(f"mask must flip some bits of one byte, got {mask:#x}")
        with self._lock:
            self._plan.corrupted.append([re.compile(path), at, mask, limit])

    def _corruption(self, path: str, start: int, length: int) -> tuple[int, int] | None:
        """Body position and mask to flip in a GET answer for object bytes [start, start+length)."""
        with self._lock:
            for rule in self._plan.corrupted:
                pattern, at, mask, left = rule
                if not pattern.search(path) or left == 0 or length == 0:
                    continue
                if at is None:
                    pos = self._rng.randrange(length)
                elif start <= at < start + length:
                    pos = at - start
                else:
                    continue
                if left is not None:
                    rule[3] -= 1
                return pos, mask
        return None

    def clear(self) -> None:
        """No faults, no denials; the records are kept."""
        with self._lock:
            self._plan = _Plan()

    def reset_records(self) -> None:
        with self._lock:
            self.records = []

    def snapshot(self) -> list[Record]:
        with self._lock:
            return list(self.records)

    # --- decisions, called from handler threads ----------------------------------------------

    def _decide(self, method: str, path: str, query: str) -> tuple[str | None, int | None]:
        with self._lock:
            plan = self._plan
            for rule in plan.denied:
                pattern, methods, status, free = rule
                if pattern.search(f"{path}?{query}") and (methods is None or method in methods):
                    if free > 0:
                        rule[3] -= 1
                        continue
                    return None, status
            if plan.rate <= 0 or (plan.methods and method not in plan.methods):
                return None, None
            if plan.path is not None and not plan.path.search(path):
                return None, None
            if plan.limit is not None and sum(plan.injected.values()) >= plan.limit:
                return None, None
            if self._rng.random() >= plan.rate:
                return None, None
            kinds = [k for k in plan.kinds if (k != "cut" or method == "GET") and (k != "lost" or method != "GET")]
            if not kinds:
                return None, None
            kind = min(kinds, key=lambda k: plan.injected[k])  # each kind in turn: every one gets exercised
            plan.injected[kind] += 1
            return kind, None

    def _record(self, rec: Record) -> None:
        with self._lock:
            self.records.append(rec)

    # --- forwarding (a subclass may answer some requests itself) -----------------------------

    def forward(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> Response:
        """Send the request upstream and return the whole answer."""
        for attempt in range(2):  # a kept-alive upstream connection may have been closed meanwhile
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=120)
                conn.connect()
                conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._local.conn = conn
            try:
                conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
                conn.putheader("Host", f"{self.upstream_host}:{self.upstream_port}")
                for k, v in headers:
                    if k.lower() not in _HOP and k.lower() not in ("content-length", "host"):
                        conn.putheader(k, v)
                if body or method in ("PUT", "POST"):
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body if body else None)
                resp = conn.getresponse()
                data = resp.read()
            except (ConnectionError, http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
                continue
            out = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP]
            if resp.will_close:
                conn.close()
                self._local.conn = None
            return Response(resp.status, out, data, resp.reason)
        raise AssertionError("unreachable")


class _Handler(BaseHTTPRequestHandler):
    owner: FaultyProxy
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        # headers and body go out in two writes: without this, Nagle and delayed ACKs add 40 ms
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format, *args):  # noqa: A002 - quiet
        pass

    def do_GET(self):
        self._proxy()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_GET

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _reset(self) -> None:
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.connection.close()

    def _proxy(self) -> None:
        owner = self.owner
        body = self._body()
        split = urlsplit(self.path)
        path, query = split.path, split.query

        upath = unquote(path)
        start = time.monotonic()
        wait = owner._delay_for(self.command, upath)
        if wait:
            time.sleep(wait)
        auth = self.headers.get("Authorization", "")
        m = _SIGNED_KEY.search(auth) or _SHARED_KEY.search(auth)
        key_id = m.group(1) if m else (f"bearer:{auth[7:]}" if auth.startswith("Bearer ") and auth[7:].strip() else None)
        region = m.group(2) if m and m.re is _SIGNED_KEY else None
        fault, denied = owner._decide(self.command, upath, query)

        def record(status: int, received: int, what: str | None) -> None:
            owner._record(Record(self.command, upath, query, status, len(body), received, what, key_id, region, start, time.monotonic()))

        # each record is made before the answer goes out: a client that reads the log right
        # after its call returned must find its requests there
        if denied is not None:
            record(denied, len(_error_xml(denied)), f"deny-{denied}")
            self._send(Response(denied, [("Content-Type", "application/xml")], _error_xml(denied)))
            return
        if fault == "reset":
            record(0, 0, fault)
            self._reset()
            return
        if fault in ("503", "500"):
            status = int(fault)
            payload = _error_xml(status)
            record(status, len(payload), fault)
            self._send(Response(status, [("Content-Type", "application/xml")], payload))
            return
        headers = [(k, v) for k, v in self.headers.items()]
        resp = owner.forward(self.command, self.path, headers, body)
        if fault == "lost":
            record(0, 0, fault)
            self._reset()
            return
        if fault == "cut" and len(resp.body) >= 2:
            half = resp.body[: len(resp.body) // 2]
            record(resp.status, len(half), fault)
            self._send(resp, body_override=half)
            self._reset()
            return
        if self.command == "GET" and resp.status in (200, 206):
            flip = owner._corruption(upath, _content_start(resp), len(resp.body))
            if flip is not None:
                pos, mask = flip
                body = bytearray(resp.body)
                body[pos] ^= mask
                record(resp.status, len(body), "corrupt")
                self._send(resp, body_override=bytes(body))
                return
        record(resp.status, 0 if self.command == "HEAD" else len(resp.body), None)
        self._send(resp)

    def _send(self, resp: Response, body_override: bytes | None = None) -> None:
        self.send_response(resp.status, resp.reason or None)
        has_length = False
        for k, v in resp.headers:
            if k.lower() == "content-length":
                if self.command != "HEAD":
                    continue
                has_length = True
            self.send_header(k, v)
        if not has_length:
            self.send_header("Content-Length", str(len(resp.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(resp.body if body_override is None else body_override)
        self.wfile.flush()


def _content_start(resp: Response) -> int:
    """Offset in the object of the first byte of a GET answer's body (``Content-Range`` of a 206)."""
    if resp.status != 206:
        return 0
    for k, v in resp.headers:
        if k.lower() == "content-range":
            m = re.match(r"\s*bytes\s+(\d+)-", v)
            if m:
                return int(m.group(1))
    return 0


_CODES = {
    403: ("AccessDenied", "Access Denied"),
    404: ("NoSuchBucket", "The specified bucket does not exist"),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


def _error_xml(status: int) -> bytes:
    code, message = _CODES.get(status, ("Error", "Injected error"))
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
        f"<RequestId>injected</RequestId></Error>"
    ).encode()
