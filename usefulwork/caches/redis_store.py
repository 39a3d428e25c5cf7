"""The Redis store: cache entries shared by every gateway replica (plain Redis 7, no modules).

Keys (``ns`` = ``cache.namespace``)::

    {ns}:e:{key}         the entry (JSON), expires ttl_s after it was written       GET / SET PX
    {ns}:lru:{part}      the partition's keys scored by last use (a sequence)       ZADD / ZPOPMIN
    {ns}:seq             the use sequence (INCR in the scripts)                      INCR
    {ns}:v:{part}        the partition's vectors (float32 bytes) by key              rebuild at start
    {ns}:parts           partition -> tenant and model                               purge, rebuild
    {ns}:log             stream of add / del / purge events (with vectors)           replicas follow it

A lookup is one round trip (GET the entry + ZADD XX its use, one script), by key: nothing
scans keys. A use is scored by a sequence Redis itself counts, not by a clock: within one
millisecond (a whole test, or a busy second's burst) wall-clock scores tied, and ZPOPMIN then evicted
by key order, sometimes the entry just written; gateways' clocks also differ. Lookups go over a pipelined connection of their own (``usefulwork.caches.redis_lookup``:
why by hand is said there); everything else through redis-py.
A write is one Lua script: store the entry, its vector and its use time, then pop the partition's
least recently used beyond ``max_entries_per_partition`` and log every change. Each replica keeps
its vector index in memory (``usefulwork.caches.index``): rebuilt from ``{ns}:v:*`` of the
partitions in ``{ns}:parts`` at start, then kept in sync by reading ``{ns}:log`` (XREAD BLOCK).
An entry that expired (TTL) while its vector is still indexed is found missing by the GET and
forgotten then. (The script names evicted entry keys it was not given in KEYS: fine on one Redis
or a replica set, not on Redis Cluster.)
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.connection import parse_url
from redis.exceptions import NoScriptError

from usefulwork.caches.config import CacheCfg
from usefulwork.caches.redis_lookup import LookupChannel
from usefulwork.caches.store import Entry, StoreListener
from usefulwork.embedding import DIM
from usefulwork.tasks import cancel_and_wait

log = logging.getLogger("usefulwork.cache.redis")

LOG_MAXLEN = 100_000
_SEP = "\x1f"

# An exact lookup is one command: the entry, and its LRU touch when it exists (a two-command
# pipeline costs redis-py about 40% more client CPU per lookup; docs/benchmarks.md section 9).
_GET = """
local v = redis.call('GET', KEYS[1])
if v then redis.call('ZADD', KEYS[2], 'XX', redis.call('INCR', KEYS[3]), ARGV[1]) end
return v
"""

_PUT = """
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], ARGV[3]) end
redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[6]), ARGV[1])
redis.call('HSET', KEYS[4], ARGV[6], ARGV[7])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
local over = redis.call('ZCARD', KEYS[3]) - tonumber(ARGV[5])
local n = 0
if over > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[3], over)
  for i = 1, #popped, 2 do
    local m = popped[i]
    redis.call('DEL', ARGV[8] .. m)
    redis.call('HDEL', KEYS[2], m)
    redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[9], '*', 'op', 'del', 'p', ARGV[6], 'k', m)
    n = n + 1
  end
end
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[9], '*', 'op', 'add', 'p', ARGV[6], 'k', ARGV[1], 'v', ARGV[3])
return n
"""


class _Stub:
    """What the index needs of an entry another replica wrote (partition, key, vector)."""

    __slots__ = ("partition", "key", "vector")

    def __init__(self, partition: str, key: str, vector: np.ndarray | None):
        self.partition, self.key, self.vector = partition, key, vector


def _vec(raw: bytes | None) -> np.ndarray | None:
    if not raw or len(raw) != DIM * 4:
        return None
    return np.frombuffer(raw, dtype=np.float32).copy()


class RedisStore:
    def __init__(self, cfg: CacheCfg, url: str | None = None):
        self.cfg = cfg
        self.url = url or cfg.redis_url
        self.ns = cfg.namespace
        self.ttl_ms = int(cfg.ttl_s * 1000)
        self.listener: StoreListener | None = None
        # Short timeouts on the request path: a slow Redis means a bypass, not a slow request.
        self.r = aioredis.Redis.from_url(self.url, socket_timeout=cfg.redis_timeout_s,
                                         socket_connect_timeout=cfg.redis_timeout_s)
        self._put = self.r.register_script(_PUT)
        self._get = self.r.register_script(_GET)
        # the lookup channel (TCP URLs; a unix socket or TLS URL looks up through redis-py's pool)
        u = parse_url(self.url)
        self._chan_args = ({"host": u["host"], "port": u.get("port") or 6379, "db": u.get("db") or 0,
                            "username": u.get("username"), "password": u.get("password")}
                           if "host" in u and not u.get("connection_class") else None)
        self._chan: LookupChannel | None = None
        self._chan_opening: asyncio.Future | None = None
        self._get_head = b"*7\r\n$7\r\nEVALSHA\r\n$40\r\n" + self._get.sha.encode() + b"\r\n$1\r\n3\r\n"
        self._tail: asyncio.Task | None = None
        self._warm: asyncio.Task | None = None
        self._stopping = False
        self._last_id = "0-0"
        self.evicted = 0
        self.synced = 0  # events applied from the log

    @property
    def _seq(self) -> str:
        return f"{self.ns}:seq"

    def _k(self, kind: str, name: str = "") -> str:
        return f"{self.ns}:{kind}:{name}" if name else f"{self.ns}:{kind}"

    async def get(self, partition: str, key: str) -> Entry | None:
        """The entry under ``key`` (touching its LRU use time), or None.

        The request path's hot call (issue 12: p99 <= 0.2 ms): EVALSHA of the lookup script, packed
        here and sent on the lookup channel, under one ``asyncio.timeout`` (a slow or absent Redis
        fails the lookup, and the request bypasses the cache). docs/benchmarks.md section 9.
        """
        ek, lk = self._k("e", key), self._k("lru", partition)
        if self._chan_args is None:
            raw = await self._get(keys=[ek, lk, self._seq], args=[key])
        else:
            args = (ek.encode(), lk.encode(), self._seq.encode(), key.encode())
            cmd = self._get_head + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
            try:
                async with asyncio.timeout(self.cfg.redis_timeout_s):
                    raw = await (await self._channel()).send(cmd)
            except NoScriptError:  # Redis restarted (its script cache is empty): the Script loads it again
                raw = await self._get(keys=[ek, lk, self._seq], args=[key])
            except TimeoutError:  # a reply may still come: start afresh (those still waiting fail over)
                if self._chan is not None:
                    self._chan.close()
                raise
        return None if raw is None else Entry.from_bytes(raw)

    async def _channel(self) -> LookupChannel:
        ch = self._chan
        if ch is not None and not ch.closed:
            return ch
        if self._chan_opening is None:  # one connect for every lookup waiting on it
            self._chan_opening = asyncio.ensure_future(
                asyncio.wait_for(LookupChannel.open(**self._chan_args), max(2.0, self.cfg.redis_timeout_s)))
        opening = self._chan_opening
        try:
            self._chan = await asyncio.shield(opening)
        finally:
            if opening.done() and self._chan_opening is opening:
                self._chan_opening = None
        return self._chan

    async def put(self, entry: Entry) -> None:
        vec = b"" if entry.vector is None else np.asarray(entry.vector, dtype=np.float32).tobytes()
        evicted = await self._put(
            keys=[self._k("e", entry.key), self._k("v", entry.partition), self._k("lru", entry.partition),
                  self._k("parts"), self._k("log"), self._seq],
            args=[entry.key, entry.to_bytes(), vec, self.ttl_ms,
                  self.cfg.max_entries_per_partition, entry.partition, entry.tenant + _SEP + entry.model,
                  self._k("e") + ":", LOG_MAXLEN])
        self.evicted += int(evicted)
        if self.listener is not None:
            self.listener.added(entry)

    async def forget(self, partition: str, key: str) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.zrem(self._k("lru", partition), key)
        pipe.hdel(self._k("v", partition), key)
        pipe.xadd(self._k("log"), {"op": "del", "p": partition, "k": key}, maxlen=LOG_MAXLEN, approximate=True)
        await pipe.execute()
        if self.listener is not None:
            self.listener.removed(partition, key)

    async def purge(self, tenant: str | None = None, model: str | None = None) -> int:
        parts = await self.r.hgetall(self._k("parts"))
        gone = []
        for p, owner in parts.items():
            t, _, m = owner.decode().partition(_SEP)
            if (tenant is None or t == tenant) and (model is None or m == model):
                gone.append(p.decode())
        for p in gone:
            keys = await self.r.zrange(self._k("lru", p), 0, -1)
            pipe = self.r.pipeline(transaction=True)
            for k in keys:
                pipe.delete(self._k("e", k.decode()))
            pipe.delete(self._k("lru", p), self._k("v", p))
            pipe.hdel(self._k("parts"), p)
            pipe.xadd(self._k("log"), {"op": "purge", "p": p}, maxlen=LOG_MAXLEN, approximate=True)
            await pipe.execute()
        if gone and self.listener is not None:
            self.listener.purged(gone)
        return len(gone)

    # -- keeping this replica's index in sync --
    async def start(self) -> None:
        """Rebuild the index from Redis, then follow the log. Redis down: start empty, keep trying.

        The lookup channel is opened now too: a first lookup that had to connect did so inside its
        ``redis_timeout_s`` (0.1 s), and a connect slower than that on a busy host bypassed the cache
        for that request (a flaky two-gateway test in CI: ``bypass`` where ``hit-exact`` was due)."""
        self._tail = asyncio.get_running_loop().create_task(self._follow(), name="usefulwork-cache-sync")
        if self._chan_args is not None:
            self._warm = asyncio.get_running_loop().create_task(self._open_quietly(), name="usefulwork-cache-channel")

    async def _open_quietly(self) -> None:
        try:
            await self._channel()
        except Exception as exc:  # Redis down at start: the first lookup tries again (and bypasses)
            log.debug("cache lookup channel not opened at start: %r", exc)

    async def _rebuild(self, r: aioredis.Redis) -> None:
        newest = await r.xrevrange(self._k("log"), count=1)
        self._last_id = newest[0][0].decode() if newest else "0-0"
        if self.listener is None:
            return
        parts = await r.hgetall(self._k("parts"))
        for p in parts:
            p = p.decode()
            vecs = await r.hgetall(self._k("v", p))
            if not vecs:
                await r.hdel(self._k("parts"), p)
            for k, raw in vecs.items():
                self.listener.added(_Stub(p, k.decode(), _vec(raw)))

    async def _follow(self) -> None:
        r = aioredis.Redis.from_url(self.url, socket_timeout=10.0, socket_connect_timeout=2.0)
        backoff = 0.5
        need_rebuild = True
        try:
            while not self._stopping:
                try:
                    if need_rebuild:
                        await self._rebuild(r)
                        need_rebuild = False
                    got = await r.xread({self._k("log"): self._last_id}, block=1000, count=1000)
                    backoff = 0.5
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # Redis away: try again, and rebuild (events may be lost)
                    if self._stopping:  # redis-py may turn our cancel into a connection error
                        break
                    log.debug("cache sync: %r", exc)
                    need_rebuild = True
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 10.0)
                    continue
                for _, events in got or ():
                    for eid, fields in events:
                        self._last_id = eid.decode()
                        self._apply(fields)
        finally:
            await r.aclose()

    def _apply(self, f: dict[bytes, bytes]) -> None:
        self.synced += 1
        if self.listener is None:
            return
        op, p = f.get(b"op"), f.get(b"p", b"").decode()
        if op == b"add":
            self.listener.added(_Stub(p, f[b"k"].decode(), _vec(f.get(b"v"))))
        elif op == b"del":
            self.listener.removed(p, f[b"k"].decode())
        elif op == b"purge":
            self.listener.purged([p])

    async def stop(self) -> None:
        self._stopping = True
        await cancel_and_wait(self._tail)
        await cancel_and_wait(self._warm)
        if self._chan is not None:
            self._chan.close()
        await self.r.aclose()
