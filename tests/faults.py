"""Fault injection: a TCP forwarder that can be killed mid-run (a replica dying under load).

It forwards bytes unchanged to a real upstream; ``kill()`` closes the listener and resets every
open connection, as a crashed server would. Used only to inject failures, never to fake a feature.
"""

from __future__ import annotations

import asyncio
import socket
import threading


class KillableForwarder:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.loop = asyncio.new_event_loop()
        self.server: asyncio.base_events.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.port = 0
        self.connections = 0
        self.streams = 0  # event-stream answers carried back (their response head passed through here)
        self.killed = False
        self.drop_replies = False  # set: answers are lost on the way back (the request was served)
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "KillableForwarder":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, reply: bool = False) -> None:
        head = b""  # a reply's response head so far (it may come in more than one read)
        try:
            while data := await r.read(65536):
                if reply and (head or data.startswith(b"HTTP/")):
                    head += data
                    if (end := head.find(b"\r\n\r\n")) >= 0 or len(head) > 65536:
                        if head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head[:end]:
                            self.streams += 1
                        head = b""
                if reply and self.drop_replies:
                    w.transport.abort()  # the target did the work; its answer never arrives
                    return
                w.write(data)
                await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            ur, uw = await asyncio.open_connection(*self.target)
        except OSError:
            cw.close()
            return
        if self.killed:  # accepted just before the kill, its upstream connected just after: dies with the rest
            _reset(cw)
            _reset(uw)
            return
        self.writers.update((cw, uw))
        await asyncio.gather(self._pipe(cr, uw), self._pipe(ur, cw, reply=True))

    async def _kill(self) -> None:
        self.killed = True
        if self.server:
            self.server.close()
        for w in list(self.writers):
            _reset(w)
        self.writers.clear()

    def kill(self) -> None:
        asyncio.run_coroutine_threadsafe(self._kill(), self.loop).result(10)

    def close(self) -> None:
        self.kill()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def _reset(w: asyncio.StreamWriter) -> None:
    sock = w.get_extra_info("socket")
    if sock is not None:
        try:  # RST rather than FIN: an abrupt crash
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except OSError:
            pass
    w.transport.abort()


class FaultUpstream:
    """A vLLM stand-in that misbehaves on purpose, on its own thread and event loop.

    ``GET /health`` and ``GET /metrics`` answer 200 (so the gateway's fleet marks it healthy);
    every other request is read whole (head and Content-Length body) and handed to
    ``respond(head, body, writer)``, an async function that writes whatever the fault calls for
    and returns True to keep the connection open for the next request. ``posts`` counts the
    non-probe requests received.
    """

    def __init__(self, respond):
        self.respond = respond
        self.loop = asyncio.new_event_loop()
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self.posts = 0
        self.heads: list[bytes] = []
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FaultUpstream":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, limit=1 << 20)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                n = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        n = int(line.split(b":", 1)[1])
                body = await r.readexactly(n) if n else b""
                if head.startswith((b"GET /health ", b"GET /metrics ")):
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    await w.drain()
                    continue
                self.posts += 1
                self.heads.append(head)
                if not await self.respond(head, body, w):
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            w.close()

    def close(self) -> None:
        async def stop() -> None:
            if self.server:
                self.server.close()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


def json_response(status: int, body: bytes, extra: bytes = b"") -> bytes:
    """A complete keep-alive HTTP/1.1 response with a JSON body."""
    return (b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
            % (status, len(body), extra, body))


class HeldEmbedder:
    """Wraps an embedder: while ``hold`` is an ``asyncio.Event``, a request's embedding starts only once it
    is set (a lookup slower than the upstream, injected: which side of a race wins is then certain, where
    a zero-delay fake upstream and a real ~1 ms embedding otherwise race on the host's scheduling)."""

    def __init__(self, inner):
        self.inner = inner
        self.hold: asyncio.Event | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def embed_call(self, call, *args, **kw):
        if self.hold is not None:
            await self.hold.wait()
        return await self.inner.embed_call(call, *args, **kw)


class SlowLoadingEmbedder:
    """Builds the real embedder whose model load is held until ``release()`` (a slow start-up, injected)."""

    def __new__(cls, **kw):
        from usefulwork.embedding import Embedder

        class _Slow(Embedder):
            def __init__(self, **kw):
                super().__init__(**kw)
                self.gate = threading.Event()

            def release(self) -> None:
                self.gate.set()

            def load(self):
                if not self.gate.wait(120):
                    raise TimeoutError("the test never released the load")
                return super().load()

        return _Slow(**kw)
