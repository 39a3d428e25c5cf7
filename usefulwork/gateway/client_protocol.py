"""The client-facing HTTP/1.1 protocol: uvicorn's httptools protocol with limits for hostile clients.

uvicorn (0.54) bounds neither the size of a request head nor the time a client may take to send
it: one 64 MB header cost seconds of CPU (httptools joins a value's pieces, quadratic) and slowloris
connections stayed open for ever. This subclass, handed to uvicorn as its ``http`` protocol by
``usefulwork serve``, adds:

- ``limits.max_header_bytes`` on the request line plus headers: 431 (414 when the URL alone is over),
  checked after every network read, so the work done on an oversized head is bounded;
- ``timeouts.client_header_s``: a connection must deliver a complete head within that time of
  connecting, or, on a kept-alive connection, of the head's first byte (of the previous response's
  end for a head begun while that response was pending); else 408 (or a plain close when a new
  connection sent nothing at all). Idle kept-alive connections are closed by the keep-alive
  timeout alone (``timeouts.client_keep_alive_s``, 75 s), which must outlast the clients' own idle
  expiry: a connection closed while a client sends on it loses that request to a connection error;
- framing errors (bad Content-Length, Content-Length with Transfer-Encoding, control characters
  in a header, ...) answered as OpenAI-style JSON 400 instead of uvicorn's plain text.

What makes its common case cheaper than uvicorn's (docs/benchmarks.md section 11):

- a response with a Content-Length sends its head with its body, in one write (one syscall, one
  TCP segment): uvicorn writes the head as soon as ``http.response.start`` comes. Streams (no
  Content-Length) still get their head at once;
- a lost connection is reported to the running request through the ``usefulwork.disconnect`` scope
  extension (``pipeline.DisconnectWatch``, which also names the request's task), so the endpoint
  needs no task waiting on ``receive()`` and no ``current_task()`` lookup;
- the keep-alive timeout is one timer per connection whose deadline each response moves (uvicorn
  schedules a timer per response and cancels it at the next request's first bytes), as the head
  deadline is;
- the cycle's message event is a ``_Signal`` (no ``asyncio.Event`` per request).

These replace uvicorn methods with copies of uvicorn 0.54's (``on_headers_complete``,
``on_response_complete``, ``_start_asgi_task``, the head built in ``GatewayCycle.send``), which is why
pyproject.toml bounds uvicorn to 0.54.x: a newer uvicorn's fixes in those methods would not reach them.

Every refusal is answered, then the connection is half-closed and the client's remaining bytes are
discarded until it closes (at most 2 s / 1 MB: no RST can discard the answer), and it is counted in ``usefulwork_http_rejected_total{reason}``
(``/metrics``). Body size is the endpoints' job (``limits.max_body_bytes``, 413).
"""

from __future__ import annotations

import urllib.parse

import httptools
import prometheus_client
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import (HEADER_RE, HEADER_VALUE_RE, STATUS_LINE, HttpToolsProtocol,
                                                   RequestResponseCycle)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from usefulwork.config import Config
from usefulwork.gateway.errors import error_body
from usefulwork.gateway.pipeline import DISCONNECT, DisconnectWatch
from usefulwork.timers import MovingDeadline

REJECTED = prometheus_client.Counter(
    "usefulwork_http_rejected", "Client connections refused at the HTTP layer, by reason.", ["reason"])

_REASONS = {  # status -> (reason label, error code, status text)
    400: ("malformed", "invalid_http_request", b"Bad Request"),
    408: ("header_timeout", "request_timeout", b"Request Timeout"),
    414: ("uri_too_long", "uri_too_long", b"URI Too Long"),
    431: ("header_too_large", "request_header_fields_too_large", b"Request Header Fields Too Large"),
}


class _Refuse(Exception):
    """Raised from a parser callback to stop parsing; data_received answers with ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


LINGER_S = 2.0  # after a refusal, how long the client's remaining bytes are read and discarded
LINGER_BYTES = 1 << 20  # ... and how many


class _Signal:
    """What the cycle needs of an ``asyncio.Event`` (``set``, ``clear``, ``is_set``, ``wait``), made per
    request without the Event's loop binding and deque: a future exists only while a request waits for
    body bytes that have not arrived (a small body is complete before the request's task first runs)."""

    __slots__ = ("_loop", "_set", "_waiters")

    def __init__(self, loop) -> None:
        self._loop = loop
        self._set = False
        self._waiters: list | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            if self._waiters:
                for fut in self._waiters:
                    if not fut.done():
                        fut.set_result(True)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> bool:
        if self._set:
            return True
        fut = self._loop.create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(fut)
        try:
            await fut
            return True
        finally:
            self._waiters.remove(fut)


class GatewayCycle(RequestResponseCycle):
    """uvicorn's request/response cycle; a response with a Content-Length writes its head with its body.

    ``send`` builds and validates the head as uvicorn's does (same checks, same errors); a sized
    response's head is kept and written in front of the body's bytes, in one ``write``. A client can use
    a Content-Length response only once its body arrived anyway. Streams (no Content-Length) get their
    head at once, and their body messages go to uvicorn's ``send``.
    """

    _head: bytes | None = None

    async def send(self, message) -> None:
        if self.response_started:
            head = self._head
            if head is None:
                await super().send(message)
                return
            if self.flow.write_paused and not self.disconnected:
                await self.flow.drain()  # pragma: no cover - a held head: nothing was written yet
            if self.disconnected:
                return
            self._head = None
            if message["type"] != "http.response.body":
                self.transport.write(head)
                raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{message['type']}'.")
            body = message.get("body", b"")
            more_body = message.get("more_body", False)
            if self.scope["method"] == "HEAD":
                self.expected_content_length = 0
                self.transport.write(head)
            else:
                n = len(body)
                if n > self.expected_content_length:
                    self.transport.write(head)
                    raise RuntimeError("Response content longer than Content-Length")
                self.expected_content_length -= n
                self.transport.write(head + body if body else head)
            if not more_body:
                if self.expected_content_length != 0:
                    raise RuntimeError("Response content shorter than Content-Length")
                self.response_complete = True
                self.message_event.set()
                if not self.keep_alive:
                    self.transport.close()
                self.on_response()
            return
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()  # pragma: no cover
        if self.disconnected:
            return
        # http.response.start: uvicorn's head, built the same way
        if message["type"] != "http.response.start":
            raise RuntimeError(f"Expected ASGI message 'http.response.start', but got '{message['type']}'.")
        self.response_started = True
        self.waiting_for_100_continue = False
        status_code = message["status"]
        if self.access_log:
            self.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(self.scope), self.scope["method"],
                                    get_path_with_query_string(self.scope), self.scope["http_version"], status_code)
        content = [STATUS_LINE[status_code]]
        has_connection_close = False
        for headers in (self.default_headers, message.get("headers", ())):
            for name, value in headers:
                if HEADER_RE.search(name):
                    raise RuntimeError("Invalid HTTP header name.")
                if HEADER_VALUE_RE.search(value):
                    raise RuntimeError("Invalid HTTP header value.")
                name = name.lower()
                if name == b"content-length" and self.chunked_encoding is None:
                    self.expected_content_length = int(value.decode())
                    self.chunked_encoding = False
                elif name == b"transfer-encoding" and value.lower() == b"chunked":
                    self.expected_content_length = 0
                    self.chunked_encoding = True
                elif name == b"connection":
                    connection = [token.lower().strip() for token in value.split(b",")]
                    if b"close" in connection:
                        self.keep_alive = False
                        has_connection_close = True
                content.extend((name, b": ", value, b"\r\n"))
        if not self.keep_alive and not has_connection_close:
            content.append(b"connection: close\r\n")
        sized = self.chunked_encoding is False
        if self.chunked_encoding is None and self.scope["method"] != "HEAD" and status_code not in (204, 304):
            self.chunked_encoding = True  # neither content-length nor transfer-encoding
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        if sized:
            self._head = b"".join(content)
        else:
            self.transport.write(b"".join(content))


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus the limits in the module doc (class attributes, set by
    ``protocol_class``)."""

    max_header_bytes = 32 * 1024
    header_timeout_s = 10.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # the next bytes belong to a request head (also a pipelined one)
        self._head_bytes = 0  # bytes received for the current head
        self._head_begun = False  # the parser has begun a head it has not finished (a pipelined one included)
        self._url_bytes = 0
        self._fields_bytes = 0
        # the loop time by which the awaited request head must be complete
        self._head_deadline = MovingDeadline(self.loop, self._head_timeout)
        self._lingering: int | None = None  # refused: bytes still to discard before closing (see _linger)
        self._linger_timer = None
        self._running: RequestResponseCycle | None = None  # the request whose app task runs now
        # uvicorn's keep-alive timeout, kept the way the head deadline is (uvicorn schedules and cancels a
        # timer per response)
        self._keep_alive = MovingDeadline(self.loop, self.timeout_keep_alive_handler)

    # -- waiting for a head --
    # A kept-alive connection arms the head deadline after every response and disarms it at the next
    # head: that only moves the deadline of one timer (``MovingDeadline``).
    def _arm(self) -> None:
        self._head_deadline.arm(self.header_timeout_s)

    def _disarm(self) -> None:
        self._head_deadline.disarm()

    def _head_timeout(self) -> None:
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        if self._head_bytes:
            self._refuse(408, f"the request head did not arrive within {self.header_timeout_s:g}s")
        else:  # nothing asked, nothing to answer
            REJECTED.labels("idle_no_request").inc()
            self.transport.close()

    # -- keep-alive: idle after a response --
    def _unset_keepalive_if_required(self) -> None:  # uvicorn's hook: bytes came, or the connection ended
        self._keep_alive.disarm()

    def _refuse(self, status: int, message: str) -> None:
        reason, code, text = _REASONS[status]
        REJECTED.labels(reason).inc()
        self._disarm()
        if self.transport.is_closing():
            return
        body = error_body(status, message, code=code)
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, text, len(body), body))
        self._linger()

    def _linger(self) -> None:
        """Close after the answer without losing it: closing a socket that still has unread request bytes
        (the rest of a 40 KB head) makes the kernel send RST, which can discard the answer before the
        client reads it. So: half-close (FIN after the answer), discard what the client still sends, and
        close at its EOF, after ``LINGER_S``, or past ``LINGER_BYTES`` (Apache's "lingering close")."""
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self._lingering = LINGER_BYTES
        self.transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

    # -- asyncio.Protocol --
    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_deadline.cancel()
        self._keep_alive.cancel()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)
        running = self._running
        if running is not None and not running.response_complete:
            running.scope["extensions"][DISCONNECT].fire()

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:  # refused and answered: the rest is discarded
            self._lingering -= len(data)
            if self._lingering < 0:
                self.transport.close()
            return
        self._unset_keepalive_if_required()
        if self._in_head:
            if not self._head_bytes and self._head_deadline.deadline is None:
                self._arm()  # a kept-alive connection's next head: its deadline runs from its first byte
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # as uvicorn does (the gateway serves no websockets)
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as exc:
            refuse = exc.__context__ if isinstance(exc.__context__, _Refuse) else None
            if refuse is not None:
                self._refuse(refuse.status, refuse.message)
            else:
                self.send_400_response(f"Invalid HTTP request received: {exc}")
            return
        except _Refuse as refuse:
            self._refuse(refuse.status, refuse.message)
            return
        if self._in_head and self._head_bytes > self.max_header_bytes:
            self._too_large()

    def _too_large(self) -> None:
        if self._url_bytes > self.max_header_bytes:
            self._refuse(414, f"the request URL exceeds {self.max_header_bytes} bytes")
        else:
            self._refuse(431, f"the request line and headers exceed {self.max_header_bytes} bytes")

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg)

    def _start_asgi_task(self, cycle: RequestResponseCycle, app) -> None:
        self._running = cycle
        if self.config.reset_contextvars:  # uvicorn's opt-in: a fresh context per task (the watch names no task)
            super()._start_asgi_task(cycle, app)
            return
        task = self.loop.create_task(cycle.run_asgi(app))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        watch = cycle.scope["extensions"].get(DISCONNECT)
        if watch is not None:
            watch.task = task

    # -- parser callbacks --
    def on_message_begin(self) -> None:
        self._url_bytes = self._fields_bytes = 0
        self._head_begun = True
        super().on_message_begin()
        self.scope["extensions"] = {**(self.scope.get("extensions") or {}), DISCONNECT: DisconnectWatch()}

    def on_url(self, url: bytes) -> None:
        self._url_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields_bytes += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._head_begun = False
        self._in_head = False
        self._head_bytes = 0
        if self._url_bytes + self._fields_bytes > self.max_header_bytes:
            status = 414 if self._url_bytes > self.max_header_bytes else 431
            raise _Refuse(status, f"the request {'URL' if status == 414 else 'line and headers'} exceed "
                                  f"{self.max_header_bytes} bytes")
        # uvicorn's on_headers_complete, making a GatewayCycle with a _Signal for its message event
        parser = self.parser
        http_version = parser.get_http_version()
        scope = self.scope
        scope["method"] = parser.get_method().decode("ascii")
        if http_version != "1.1":
            scope["http_version"] = http_version
        if parser.should_upgrade() and self._should_upgrade():
            return
        parsed_url = httptools.parse_url(self.url)
        raw_path = parsed_url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope["path"] = self.root_path + path
        scope["raw_path"] = self.root_path.encode("ascii") + raw_path
        scope["query_string"] = parsed_url.query or b""
        if self.limit_concurrency is not None and (
                len(self.connections) >= self.limit_concurrency or len(self.tasks) >= self.limit_concurrency):
            app = service_unavailable
            self.logger.warning("Exceeded concurrency limit.")
        else:
            app = self.app
        existing_cycle = self.cycle
        self.cycle = GatewayCycle(
            scope=scope, transport=self.transport, flow=self.flow, logger=self.logger,
            access_logger=self.access_logger, access_log=self.access_log,
            default_headers=self.server_state.default_headers, message_event=_Signal(self.loop),
            expect_100_continue=self.expect_100_continue,
            keep_alive=http_version != "1.0" and parser.should_keep_alive(), on_response=self.on_response_complete)
        if existing_cycle is None or existing_cycle.response_complete:
            self._start_asgi_task(self.cycle, app)
        else:  # pipelined: queued until the running response completes
            self.flow.pause_reading()
            self.pipeline.appendleft((self.cycle, app))

    def on_message_complete(self) -> None:
        self._in_head = True  # what follows is the next request's head
        super().on_message_complete()

    def on_response_complete(self) -> None:  # uvicorn's, with the keep-alive timer kept per connection
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self._keep_alive.disarm()
        self.flow.resume_reading()
        if self.pipeline:  # start the next pipelined request
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        else:  # idle until the next head's first byte: only the keep-alive timeout closes it
            self._keep_alive.arm(self.timeout_keep_alive)
            if self._head_begun:  # ...unless part of the next head came during this response: its deadline runs now
                self._arm()


def protocol_class(cfg: Config) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for uvicorn's ``http=``, with this config's limits."""
    return type("GatewayHttpProtocol", (GuardedHttpToolsProtocol,), {
        "max_header_bytes": cfg.limits.max_header_bytes,
        "header_timeout_s": cfg.timeouts.client_header_s,
    })
