"""Where ledger records go: an append-only JSONL file and/or a Redis Stream.

One small interface (``write(batch)``, ``close()``), several implementations, as httpx does with
transports. The accountant calls ``write`` with a batch of already-encoded records (orjson bytes,
one JSON object each) from its background task, never from a request. A sink that fails keeps
its batch and the ledger retries it at the next flush (bounded, see ``Ledger``); a retry never
adds a record twice (``RedisStreamSink``).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Protocol


class Sink(Protocol):
    name: str

    async def write(self, batch: list[bytes]) -> None: ...

    async def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per line; each batch is written and fsync'ed in a worker thread."""

    name = "jsonl"

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: concurrent writers (several gateway processes) never interleave inside a line.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        os.fsync(self._fd)

    async def write(self, batch: list[bytes]) -> None:
        if batch:
            await asyncio.to_thread(self._write, b"\n".join(batch) + b"\n")

    async def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# Add each record once: its digest is its idempotency key, remembered for DEDUPE_TTL_S. Runs
# atomically, so a chunk whose answer was lost either landed whole (a retry adds nothing) or not.
_ADD_ONCE = """
local added = 0
for i = 2, #ARGV, 2 do
  if redis.call('SET', KEYS[1] .. ':seen:' .. ARGV[i], '1', 'NX', 'EX', ARGV[1]) then
    redis.call('XADD', KEYS[1], '*', 'record', ARGV[i + 1])
    added = added + 1
  end
end
return added
"""
DEDUPE_TTL_S = 86_400  # a record retried within a day of its first try is never added twice
CHUNK = 500  # records per script call (one round trip each)


class RedisStreamSink:
    """XADDs each record (field ``record``: the JSON bytes) to a stream, exactly once.

    Writes are idempotent, not blindly retried: a record's key is the BLAKE2b digest of its bytes
    (records carry a unique id and timestamp), kept as ``<stream>:seen:<digest>`` for
    ``DEDUPE_TTL_S``; a server-side script adds only records whose key is new. So a retry after a
    write whose answer was lost (timeout, dropped connection, redis-py's own reconnect retry) adds
    nothing twice. Cost: one small key per record for a day.
    """

    name = "redis"

    def __init__(self, url: str, stream: str):
        import redis.asyncio as aioredis

        self.stream = stream
        self.client = aioredis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self._add_once = self.client.register_script(_ADD_ONCE)

    async def write(self, batch: list[bytes]) -> None:
        for i in range(0, len(batch), CHUNK):
            args: list[bytes | int] = [DEDUPE_TTL_S]
            for rec in batch[i:i + CHUNK]:
                args.append(hashlib.blake2b(rec, digest_size=16).hexdigest().encode())
                args.append(rec)
            await self._add_once(keys=[self.stream], args=args)

    async def close(self) -> None:
        await self.client.aclose()


class MemorySink:
    """Keeps records in a list: the ``/usefulwork`` tests and embedding programs read it back."""

    name = "memory"

    def __init__(self) -> None:
        self.records: list[bytes] = []

    async def write(self, batch: list[bytes]) -> None:
        self.records.extend(batch)

    async def close(self) -> None:
        return None


def from_config(jsonl_path: str | None, redis_url: str | None, redis_stream: str) -> list[Sink]:
    sinks: list[Sink] = []
    if jsonl_path:
        sinks.append(JsonlSink(jsonl_path))
    if redis_url:
        sinks.append(RedisStreamSink(redis_url, redis_stream))
    return sinks
