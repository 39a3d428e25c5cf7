"""The Redis store's lookup channel: one TCP connection, commands pipelined, replies matched in order.

Why by hand, next to redis-py (which the store uses for everything else): an exact lookup is on
every cacheable request's path, with a target of 0.2 ms p99 (issue 12), and redis-py's per-call
client CPU was most of it. Measured interleaved (docs/benchmarks.md section 9), p50 of a whole
lookup: redis-py ``Script`` through its pool ~0.25 ms; a redis-py ``Connection`` held by the caller,
the command packed by the caller, ~0.13 ms (hiredis ~0.12), but usable by one caller at a time;
this channel ~0.12 ms, and with 8 concurrent lookups ~0.3 ms against ~1.0 ms through the pool,
because concurrent lookups share one connection and one write (redis-py cannot pipeline
independent concurrent commands).

What it speaks is small: commands go out as packed RESP bytes (the caller packs them); replies are
simple strings, errors, integers, and bulk strings or nil: all a GET script, AUTH and SELECT answer.
Callers bound their wait (``asyncio.timeout``); on a timeout the store closes the channel (a reply
may still be on its way, and a hung Redis should not collect a queue), and every caller still
waiting fails: the cache is bypassed for those requests and the next lookup connects afresh.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError


def pack(*args: bytes) -> bytes:
    """One command as a RESP array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class LookupChannel(asyncio.Protocol):
    def __init__(self) -> None:
        self.waiting: deque[asyncio.Future] = deque()
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.closed = False

    @classmethod
    async def open(cls, host: str, port: int, db: int = 0, username: str | None = None,
                   password: str | None = None) -> LookupChannel:
        _, ch = await asyncio.get_running_loop().create_connection(cls, host, port)
        try:
            if password is not None:
                await ch.send(pack(b"AUTH", *([username.encode()] if username else []), password.encode()))
            if db:
                await ch.send(pack(b"SELECT", str(db).encode()))
        except BaseException:
            ch.close()
            raise
        return ch

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def send(self, cmd: bytes) -> asyncio.Future:
        """Send packed bytes; the future gets the reply (replies come back in the order sent)."""
        if self.closed or self.transport is None:
            raise RedisConnectionError("redis lookup channel closed")
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        self.transport.write(cmd)
        return fut

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.waiting:
            b = self.buf
            i = b.find(b"\r\n")
            if i < 0:
                return
            kind, line = b[:1], b[1:i]
            if kind == b"$":
                n = int(line)
                end = i + 2 if n < 0 else i + 4 + n
                if len(b) < end:
                    return
                value: Any = None if n < 0 else b[i + 2:end - 2]
            else:
                end = i + 2
                if kind == b"-":
                    msg = line.decode(errors="replace")
                    value = NoScriptError(msg) if msg.startswith("NOSCRIPT") else ResponseError(msg)
                elif kind == b":":
                    value = int(line)
                elif kind == b"+":
                    value = line
                else:  # a reply this channel does not speak: its state is unknown from here on
                    self.close()
                    return
            self.buf = b[end:]
            fut = self.waiting.popleft()
            if fut.done():  # its caller gave up (cancelled): the reply is dropped, in order
                continue
            if isinstance(value, Exception):
                fut.set_exception(value)
            else:
                fut.set_result(value)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(RedisConnectionError(f"redis lookup channel lost: {exc!r}"))

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()  # connection_lost fails whoever still waits
