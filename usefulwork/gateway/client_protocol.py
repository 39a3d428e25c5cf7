"""The client-facing HTTP/1.1 protocol: uvicorn's httptools protocol with limits for hostile clients.

uvicorn (0.54) bounds neither the size of a request head nor the time a client may take to send
it: one 64 MB header cost seconds of CPU (httptools joins a value's pieces, quadratic) and slowloris
connections stayed open for ever. This subclass, handed to uvicorn as its ``http`` protocol by
``usefulwork serve``, adds:

- ``limits.max_header_bytes`` on the request line plus headers: 431 (414 when the URL alone is over),
  checked after every network read, so the work done on an oversized head is bounded;
- ``timeouts.client_header_s``: a connection must deliver a complete head within that time of
  connecting, or of the end of its previous response; else 408 (or a plain close when it sent
  nothing at all). Idle kept-alive connections are still closed by uvicorn's keep-alive timeout;
- framing errors (bad Content-Length, Content-Length with Transfer-Encoding, control characters
  in a header, ...) answered as OpenAI-style JSON 400 instead of uvicorn's plain text.

Two things make its common case cheaper than uvicorn's (docs/benchmarks.md section 11):

- a response with a Content-Length sends its head with its body, in one write (one syscall, one
  TCP segment): uvicorn writes the head as soon as ``http.response.start`` comes. Streams (no
  Content-Length) still get their head at once;
- a lost connection is reported to the running request through the ``usefulwork.disconnect`` scope
  extension (``pipeline.DisconnectWatch``), so the endpoint needs no task waiting on ``receive()``.

Every refusal is answered, then the connection is half-closed and the client's remaining bytes are
discarded until it closes (at most 2 s / 1 MB: no RST can discard the answer), and it is counted in ``usefulwork_http_rejected_total{reason}``
(``/metrics``). Body size is the endpoints' job (``limits.max_body_bytes``, 413).
"""

from __future__ import annotations

import httptools
import prometheus_client
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from usefulwork.config import Config
from usefulwork.gateway.errors import error_body
from usefulwork.gateway.pipeline import DISCONNECT, DisconnectWatch

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


class _Keep:
    """Stands in for the transport while uvicorn writes a response head that is to be held."""

    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data: bytes | None = None

    def write(self, data: bytes) -> None:
        self.data = data


class _HeadFirst:
    """Stands in for the transport while the body after a held head is sent: the head goes out with
    the first bytes written (or alone, before a close or at the end: ``flush``)."""

    __slots__ = ("transport", "head")

    def __init__(self, transport, head: bytes):
        self.transport = transport
        self.head: bytes | None = head

    def write(self, data: bytes) -> None:
        head = self.head
        if head is not None:
            self.head = None
            data = head + data
        self.transport.write(data)

    def flush(self) -> None:
        if self.head is not None:
            head, self.head = self.head, None
            if not self.transport.is_closing():
                self.transport.write(head)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()


def _sized(message: dict) -> bool:
    return any(name.lower() == b"content-length" for name, _ in message.get("headers", ()))


class GatewayCycle(RequestResponseCycle):
    """uvicorn's request/response cycle; a response with a Content-Length writes its head with its body.

    The head uvicorn builds for ``http.response.start`` (validated as uvicorn does) is kept, and the
    next ``send`` writes it in front of the body's bytes. Nothing else changes: a client can use a
    Content-Length response only once its body arrived anyway.
    """

    _head: bytes | None = None

    async def send(self, message) -> None:
        head = self._head
        if head is not None:
            self._head = None
            transport = self.transport
            self.transport = first = _HeadFirst(transport, head)
            try:
                await super().send(message)
            finally:
                self.transport = transport
                if not self.disconnected:
                    first.flush()  # no body bytes were written (HEAD, an empty body, an error)
            return
        if message["type"] == "http.response.start" and not self.response_started and _sized(message):
            transport = self.transport
            self.transport = keep = _Keep()
            try:
                await super().send(message)
            finally:
                self.transport = transport
            self._head = keep.data
            return
        await super().send(message)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus the limits in the module doc (class attributes, set by
    ``protocol_class``)."""

    max_header_bytes = 32 * 1024
    header_timeout_s = 10.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # the next bytes belong to a request head (also a pipelined one)
        self._head_bytes = 0  # bytes received for the current head
        self._url_bytes = 0
        self._fields_bytes = 0
        self._head_timer = None  # scheduled while a head deadline is (or was recently) armed
        self._head_deadline: float | None = None  # loop time by which the awaited request head must be complete
        self._lingering: int | None = None  # refused: bytes still to discard before closing (see _linger)
        self._linger_timer = None
        self._running: RequestResponseCycle | None = None  # the request whose app task runs now

    # -- waiting for a head --
    # A kept-alive connection arms the head deadline after every response and disarms it at the next
    # head: that only moves ``_head_deadline``. One timer stays scheduled; when it fires early (the
    # deadline moved on since) it is set again for the new deadline, when disarmed it does nothing.
    def _arm(self) -> None:
        self._head_deadline = self.loop.time() + self.header_timeout_s
        if self._head_timer is None:
            self._head_timer = self.loop.call_at(self._head_deadline, self._head_timeout)

    def _disarm(self) -> None:
        self._head_deadline = None

    def _cancel_timer(self) -> None:
        self._head_deadline = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        deadline = self._head_deadline
        if deadline is None:
            return
        if self.loop.time() < deadline:  # armed again since this timer was set
            self._head_timer = self.loop.call_at(deadline, self._head_timeout)
            return
        self._head_deadline = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        if self._head_bytes:
            self._refuse(408, f"the request head did not arrive within {self.header_timeout_s:g}s")
        else:  # nothing asked, nothing to answer
            REJECTED.labels("idle_no_request").inc()
            self.transport.close()

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
        self._cancel_timer()
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
        cycle.__class__ = GatewayCycle  # made by uvicorn's on_headers_complete; its task has not run yet
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    # -- parser callbacks --
    def on_message_begin(self) -> None:
        self._url_bytes = self._fields_bytes = 0
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
        self._in_head = False
        self._head_bytes = 0
        if self._url_bytes + self._fields_bytes > self.max_header_bytes:
            status = 414 if self._url_bytes > self.max_header_bytes else 431
            raise _Refuse(status, f"the request {'URL' if status == 414 else 'line and headers'} exceed "
                                  f"{self.max_header_bytes} bytes")
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head = True  # what follows is the next request's head
        super().on_message_complete()

    def on_response_complete(self) -> None:
        queued = bool(self.pipeline)
        super().on_response_complete()
        if not queued and not self.transport.is_closing():
            self._arm()  # the next request's head must arrive in time too


def protocol_class(cfg: Config) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for uvicorn's ``http=``, with this config's limits."""
    return type("GatewayHttpProtocol", (GuardedHttpToolsProtocol,), {
        "max_header_bytes": cfg.limits.max_header_bytes,
        "header_timeout_s": cfg.timeouts.client_header_s,
    })
