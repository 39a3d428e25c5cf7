"""A lean HTTP/1.1 keep-alive client for the proxy's data path.

Why not httpx here (httpx still does health checks and /metrics scrapes): profiled under the
overhead benchmark, httpcore's connection pool re-scans every pooled connection on each request
(``is_idle``/``has_expired``, each with a ``select.poll`` on the socket) and routes every read
through anyio's stream layers; that was ~45% of the gateway's CPU per request. This module keeps
a LIFO list of idle connections per replica and parses responses with httptools (llhttp, the C
parser uvicorn uses), so parsing and chunked decoding stay in C and a request costs a few
microseconds of Python. The numbers before and after are in docs/benchmarks.md.

Semantics the proxy relies on:
- ``request`` returns once the status line and headers arrived; body chunks are read with
  ``read_chunk`` (None at the end) or ``read`` (all);
- ``close`` on an unfinished response aborts the connection, so the upstream server sees the
  disconnect and (vLLM) aborts the sequence at once; a finished keep-alive one goes back to the pool;
- ``read`` stops at ``max_body_bytes`` (``UpstreamTooLarge``): a huge answer fails that request only;
- interim 1xx responses are skipped; a response with neither Content-Length nor chunking ends
  when the server closes the connection (both valid HTTP/1.1);
- a request is written at most once per call. A POST is not idempotent: when a reused connection
  closes before any response byte, the server may have processed it, so it is NOT re-sent here;
  ``UpstreamClosed.maybe_processed`` says so and the caller decides (another replica, recorded).
  Idempotent methods are retried once on a fresh connection. Connections idle longer than
  ``idle_s`` (below vLLM's/uvicorn's 5 s keep-alive) are not reused, so a server closing an idle
  connection as we write to it is rare;
- the Host header is ``host[:port]``: credentials in the URL never go upstream.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from urllib.parse import urlsplit

import httptools

from usefulwork.timers import MovingDeadline


IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE"})  # RFC 9110 9.2.2


class UpstreamError(Exception):
    """Base of the data-path failures the proxy maps to retries or client errors."""


class ConnectFailed(UpstreamError):
    """Could not open a connection (refused, unreachable, connect timeout)."""


class UpstreamTimeout(UpstreamError):
    """No byte arrived within the read timeout."""


class UpstreamClosed(UpstreamError):
    """The connection ended (or the response was malformed) before the response completed.

    ``maybe_processed``: the whole request had been written, so the server may have acted on it.
    """

    maybe_processed = False


class UpstreamTooLarge(UpstreamError):
    """The upstream's answer (a non-streaming body, or one SSE event) exceeds the configured limit."""


class Response:
    __slots__ = ("_conn", "status", "headers", "_chunks", "_waiter", "complete", "_exc", "_keep_alive",
                 "_timeout", "got_bytes", "_headers_done", "_closed", "_buffered", "max_body", "until_close")

    def __init__(self, conn: "_Conn", timeout: float, max_body: int = 1 << 62):
        self._conn = conn
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self.complete = False
        self._exc: BaseException | None = None
        self._keep_alive = False
        self._timeout = timeout
        self.got_bytes = False
        self._headers_done = False
        self._closed = False
        self.max_body = max_body
        self.until_close = False  # no Content-Length, not chunked: the body ends at connection close

    # -- fed by the protocol --
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _push(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > 1 << 20:  # a slow client: stop reading upstream until it catches up
            self._conn.pause()
        self._wake()

    def _finish(self, keep_alive: bool) -> None:
        self.complete = True
        self._keep_alive = keep_alive
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self.complete and self._exc is None:
            self._exc = exc
            self._wake()

    async def _wait(self) -> None:
        conn = self._conn
        self._waiter = fut = conn.loop.create_future()
        conn.watch(fut, self._timeout)
        try:
            await fut
        finally:
            conn.waiting = None
            conn.deadline.disarm()
            self._waiter = None

    # -- used by the proxy --
    async def wait_headers(self) -> None:
        while not self._headers_done:
            if self._exc is not None:
                raise self._exc
            await self._wait()

    async def read_chunk(self) -> bytes | None:
        """Next body bytes as they arrived (several network reads joined), or None at the end."""
        while True:
            if self._chunks:
                chunks = self._chunks
                self._chunks = []
                self._buffered = 0
                self._conn.resume()
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if self.complete:
                return None
            if self._exc is not None:
                raise self._exc
            await self._wait()

    async def read(self) -> bytes:
        """The whole body; ``UpstreamTooLarge`` (nothing more read) once it exceeds ``max_body``."""
        limit = self.max_body
        declared = self.header(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise UpstreamTooLarge(f"upstream answer declares {int(declared)} bytes; the limit is {limit}")
        parts = []
        size = 0
        while (chunk := await self.read_chunk()) is not None:
            size += len(chunk)
            if size > limit:
                raise UpstreamTooLarge(f"upstream answer exceeds the limit of {limit} bytes")
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def close(self) -> None:
        """Return the connection to the pool if the response is complete, else abort it."""
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        conn.resp = None
        if self.complete and self._keep_alive and not self._chunks and not conn.closed:
            conn.pool._release(conn)
        else:
            conn.abort()


class _Conn(asyncio.Protocol):
    __slots__ = ("pool", "loop", "transport", "parser", "closed", "resp", "_paused", "_interim", "idle_since",
                 "waiting", "deadline", "_timeout")

    def __init__(self, pool: "UpstreamPool", loop: asyncio.AbstractEventLoop):
        self.pool = pool
        self.loop = loop  # the connection's own loop (asyncio.get_running_loop() costs a getpid() per call)
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.resp: Response | None = None
        self._paused = False
        self._interim = False  # parsing a 1xx interim response (skipped)
        self.idle_since = 0.0
        # The read timeout: one timer per connection whose deadline each wait moves (a timer scheduled
        # and cancelled per wait cost ~1.6% of the gateway's CPU per unary request). ``waiting``: the
        # response's future while a wait is on, else None.
        self.waiting: asyncio.Future | None = None
        self._timeout = 0.0
        self.deadline = MovingDeadline(loop, self._expired)

    def watch(self, fut: asyncio.Future, timeout: float) -> None:
        """Fail ``fut`` with UpstreamTimeout unless it is done (or the wait ends) within ``timeout``."""
        self.waiting = fut
        self._timeout = timeout
        self.deadline.arm(timeout)

    def _expired(self) -> None:
        fut = self.waiting
        if fut is not None and not fut.done():
            fut.set_exception(UpstreamTimeout(f"no data from upstream for {self._timeout:.0f}s"))

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None:  # bytes on an idle connection: the server is misbehaving; drop it
            self.abort()
            return
        resp.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            resp._fail(UpstreamClosed(f"malformed response from upstream: {exc}"))
            self.abort()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.deadline.cancel()
        resp = self.resp
        if resp is not None:
            if resp.until_close and exc is None and not self._interim:
                resp._finish(False)  # a close-delimited body ends here
            else:
                resp._fail(UpstreamClosed("upstream closed the connection" + (f": {exc}" if exc else "")))
        self.pool._discard(self)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.resp.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        resp = self.resp
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # interim (100 Continue, 103 Early Hints): skip it
            self._interim = True
            resp.headers.clear()
            return
        resp.status = status
        resp._headers_done = True
        if status not in (204, 304) and resp.header(b"content-length") is None:
            te = resp.header(b"transfer-encoding")
            resp.until_close = te is None or b"chunked" not in te.lower()
        resp._wake()

    def on_body(self, body: bytes) -> None:
        self.resp._push(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.resp._finish(self.parser.should_keep_alive())

    # flow control / teardown
    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class UpstreamPool:
    """Keep-alive connections to one upstream base URL (``http://host:port`` or ``https://``)."""

    def __init__(self, base_url: str, connect_timeout: float = 5.0, read_timeout: float = 600.0,
                 header_timeout: float = 600.0, max_idle: int = 1024, max_body_bytes: int = 64 << 20,
                 idle_s: float = 4.0):
        u = urlsplit(base_url)
        self.host = u.hostname or "127.0.0.1"
        self.tls = u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.prefix = u.path.rstrip("/")
        self._prefix = self.prefix.encode()
        host = f"[{self.host}]" if ":" in self.host else self.host  # never user:password@
        self.host_header = (host if u.port is None else f"{host}:{u.port}").encode()
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.header_timeout = header_timeout
        self.max_idle = max_idle
        self.max_body_bytes = max_body_bytes
        self.idle_s = idle_s
        self._idle: list[_Conn] = []
        self._all: set[_Conn] = set()
        self.retired = False  # see retire()
        self._ssl = ssl.create_default_context() if self.tls else None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(self, loop), self.host, self.port, ssl=self._ssl,
                                       server_hostname=self.host if self.tls else None),
                self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {type(exc).__name__}") from None
        self._all.add(conn)
        return conn

    def _release(self, conn: _Conn) -> None:
        if len(self._idle) < self.max_idle and not self.retired:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.abort()

    def _discard(self, conn: _Conn) -> None:
        self._all.discard(conn)

    async def request(self, method: bytes, path: bytes, body: bytes, headers: bytes = b"") -> Response:
        """Send a request; return once the response headers arrived. ``headers``: raw header lines."""
        data = b"".join((method, b" ", self._prefix, path, b" HTTP/1.1\r\nhost: ", self.host_header,
                         b"\r\ncontent-length: %d\r\n" % len(body), headers, b"\r\n", body))
        idempotent = method in IDEMPOTENT
        for attempt in (0, 1):
            conn = None
            fresh_after = time.monotonic() - self.idle_s
            while self._idle:
                c = self._idle.pop()
                if not c.closed and c.idle_since >= fresh_after:
                    conn = c
                    break
                c.abort()  # closed, or idle so long the server may be closing it right now
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            resp = Response(conn, self.header_timeout, self.max_body_bytes)
            conn.resp = resp
            conn.transport.write(data)
            try:
                await resp.wait_headers()
                resp._timeout = self.read_timeout
                return resp
            except UpstreamClosed as exc:
                resp.close()
                if reused and attempt == 0 and not resp.got_bytes and idempotent:
                    continue  # a stale keep-alive connection: safe to send again
                exc.maybe_processed = True  # written whole: the server may have acted on it
                raise
            except BaseException:
                resp.close()  # timeout or cancellation: abort so the upstream stops working on it
                raise
        raise AssertionError("unreachable")

    def retire(self) -> None:
        """The replica left its pool: close the idle connections now, each busy one when its response ends."""
        self.retired = True
        for conn in self._idle:
            conn.abort()
        self._idle.clear()

    def close(self) -> None:
        for conn in list(self._all):
            conn.abort()
        self._idle.clear()
        self._all.clear()
