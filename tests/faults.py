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

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
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
        self.writers.update((cw, uw))
        await asyncio.gather(self._pipe(cr, uw), self._pipe(ur, cw))

    async def _kill(self) -> None:
        if self.server:
            self.server.close()
        for w in list(self.writers):
            sock = w.get_extra_info("socket")
            if sock is not None:
                try:  # RST rather than FIN: an abrupt crash
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                except OSError:
                    pass
            w.transport.abort()
        self.writers.clear()

    def kill(self) -> None:
        asyncio.run_coroutine_threadsafe(self._kill(), self.loop).result(10)

    def close(self) -> None:
        self.kill()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
