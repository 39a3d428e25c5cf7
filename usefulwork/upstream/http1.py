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
- a reused idle connection that the server had closed is retried once on a fresh connection
  (no response byte was received, so the server never processed the request).
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

import httptools


class UpstreamError(Exception):
    """Base of the data-path failures the proxy maps to retries or client errors."""


class ConnectFailed(UpstreamError):
    """Could not open a connection (refused, unreachable, connect timeout)."""


class UpstreamTimeout(UpstreamError):
    """No byte arrived within the read timeout."""


class UpstreamClosed(UpstreamError):
    """The connection ended (or the response was malformed) before the response completed."""


class Response:
    __slots__ = ("_conn", "status", "headers", "_chunks", "_waiter", "complete", "_exc", "_keep_alive",
                 "_timeout", "got_bytes", "_headers_done", "_closed", "_buffered")

    def __init__(self, conn: "_Conn", timeout: float):
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
        loop = asyncio.get_running_loop()
        self._waiter = fut = loop.create_future()
        timer = loop.call_later(self._timeout, self._on_timeout, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._waiter = None

    def _on_timeout(self, fut: asyncio.Future) -> None:
        if not fut.done():
            fut.set_exception(UpstreamTimeout(f"no data from upstream for {self._timeout:.0f}s"))

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
        parts = []
        while (chunk := await self.read_chunk()) is not None:
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
    __slots__ = ("pool", "transport", "parser", "closed", "resp", "_paused")

    def __init__(self, pool: "UpstreamPool"):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.resp: Response | None = None
        self._paused = False

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
        if self.resp is not None:
            self.resp._fail(UpstreamClosed("upstream closed the connection" + (f": {exc}" if exc else "")))
        self.pool._discard(self)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.resp.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        resp = self.resp
        resp.status = self.parser.get_status_code()
        resp._headers_done = True
        resp._wake()

    def on_body(self, body: bytes) -> None:
        self.resp._push(body)

    def on_message_complete(self) -> None:
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
                 header_timeout: float = 600.0, max_idle: int = 1024):
        u = urlsplit(base_url)
        self.host = u.hostname or "127.0.0.1"
        self.tls = u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.prefix = u.path.rstrip("/")
        self.host_header = (u.netloc or self.host).encode()
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.header_timeout = header_timeout
        self.max_idle = max_idle
        self._idle: list[_Conn] = []
        self._all: set[_Conn] = set()
        self._ssl = ssl.create_default_context() if self.tls else None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Conn(self), self.host, self.port, ssl=self._ssl,
                                       server_hostname=self.host if self.tls else None),
                self.connect_timeout)
        except (OSError, asyncio.TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {type(exc).__name__}") from None
        self._all.add(conn)
        return conn

    def _release(self, conn: _Conn) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn.abort()

    def _discard(self, conn: _Conn) -> None:
        self._all.discard(conn)

    async def request(self, method: bytes, path: bytes, body: bytes, headers: bytes = b"") -> Response:
        """Send a request; return once the response headers arrived. ``headers``: raw header lines."""
        data = b"".join((method, b" ", self.prefix.encode(), path, b" HTTP/1.1\r\nhost: ", self.host_header,
                         b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n", headers, b"\r\n", body))
        for attempt in (0, 1):
            conn = None
            while self._idle:
                c = self._idle.pop()
                if not c.closed:
                    conn = c
                    break
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            resp = Response(conn, self.header_timeout)
            conn.resp = resp
            conn.transport.write(data)
            try:
                await resp.wait_headers()
                resp._timeout = self.read_timeout
                return resp
            except UpstreamClosed:
                resp.close()
                if reused and attempt == 0 and not resp.got_bytes:
                    continue  # a stale keep-alive connection: the server never saw the request
                raise
            except BaseException:
                resp.close()  # timeout or cancellation: abort so the upstream stops working on it
                raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        for conn in list(self._all):
            conn.abort()
        self._idle.clear()
        self._all.clear()
