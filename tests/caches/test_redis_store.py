"""The Redis store against real Redis: two cache filters (two gateway replicas) share one Redis."""

from __future__ import annotations

import asyncio
import os

import pytest
import redis

from tests.conftest import drop_redis_keys, free_port
from usefulwork.caches.config import CacheCfg, SemanticCfg
from usefulwork.caches.filter import CacheFilter
from usefulwork.caches.redis_store import RedisStore

from .helpers import FakeUpstream, drive, make_call


@pytest.fixture
def ns(redis_url):
    name = f"uwtest:{os.urandom(4).hex()}"
    yield name
    drop_redis_keys(redis_url, name + ":")  # (test cleanup only; the store itself never scans)


def cfg(redis_url, ns, **kw):
    semantic = kw.pop("semantic", SemanticCfg(parallel=False))  # lookup first: what hits, not who is faster
    kw.setdefault("redis_timeout_s", 2.0)  # the shared test machine can be very loaded
    return CacheCfg(redis_url=redis_url, namespace=ns, semantic=semantic, **kw)


async def ask(f, up, call):
    reply, body = await drive(lambda c: f(c, up), call)
    await f.drain()
    return reply, body


async def wait_for(pred, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


async def test_an_answer_cached_through_one_replica_is_served_by_the_other(redis_url, ns):
    a, b = CacheFilter(cfg=cfg(redis_url, ns)), CacheFilter(cfg=cfg(redis_url, ns))
    await a.start()
    await b.start()
    await a.embedder.wait_loaded()  # it loads in the background; this test is about hits, not start-up
    try:
        up_a, up_b = FakeUpstream("from A"), FakeUpstream("from B", delay_s=1.0)
        await ask(a, up_a, make_call("What is the capital of France?"))
        r, body = await ask(b, up_b, make_call("What is the capital of France?"))
        assert r.header(b"x-usefulwork-cache") == b"hit-exact" and b"from A" in body and up_b.calls == 0  # exact: never raced
        await wait_for(lambda: b.index.size(next(iter(a.index._parts))) == 1)  # B follows A's log
        r, body = await ask(b, up_b, make_call("Which city is the capital of France?"))
        assert r.header(b"x-usefulwork-cache").startswith(b"hit-semantic") and b"from A" in body
        # a third replica started later rebuilds its index from Redis
        c = CacheFilter(cfg=cfg(redis_url, ns))
        await c.start()
        try:
            await wait_for(lambda: len(c.index) == 1)
        finally:
            await c.stop()
        # tenants never share: B's tenant t2 misses the same words
        r, _ = await ask(b, up_b, make_call("What is the capital of France?", tenant="t2"))
        assert r.header(b"x-usefulwork-cache") == b"miss"
    finally:
        await a.stop()
        await b.stop()


async def test_ttl_expiry_and_lru_eviction(redis_url, ns):
    exact = SemanticCfg(enabled=False)
    f = CacheFilter(cfg=cfg(redis_url, ns, ttl_s=0.5, max_entries_per_partition=2, semantic=exact))
    await f.start()
    try:
        up = FakeUpstream()
        for q in ("a", "b"):
            await ask(f, up, make_call(q))
        await ask(f, up, make_call("a"))  # touch a
        await ask(f, up, make_call("c"))  # evicts b, the least recently used
        assert f.store.evicted == 1
        assert (await ask(f, up, make_call("a")))[0].header(b"x-usefulwork-cache") == b"hit-exact"
        assert (await ask(f, up, make_call("b")))[0].header(b"x-usefulwork-cache") == b"miss"
        await asyncio.sleep(0.7)
        assert (await ask(f, up, make_call("a")))[0].header(b"x-usefulwork-cache") == b"miss"
    finally:
        await f.stop()


async def test_lru_order_holds_for_uses_within_one_millisecond(redis_url, ns):
    """Uses were scored by wall-clock ms: puts and touches in the same ms tied, and ZPOPMIN then evicted
    by key order, now and then the entry just written (test_ttl_expiry_and_lru_eviction failed about
    one run in two on a quiet machine). Redis's own sequence orders them; ten partitions, no sleeps."""
    f = CacheFilter(cfg=cfg(redis_url, ns, max_entries_per_partition=2, semantic=SemanticCfg(enabled=False)))
    await f.start()
    try:
        up = FakeUpstream()
        for i in range(10):
            tenant = f"t{i}"
            for q in ("a", "b", "a", "c"):  # the third use of a touches it; c evicts b
                await ask(f, up, make_call(q, tenant=tenant))
            got = [(await ask(f, up, make_call(q, tenant=tenant)))[0].header(b"x-usefulwork-cache") for q in "ca"]
            assert got == [b"hit-exact", b"hit-exact"], (tenant, got)
            assert (await ask(f, up, make_call("b", tenant=tenant)))[0].header(b"x-usefulwork-cache") == b"miss"
        assert f.store.evicted == 20  # b in each partition, then the c or a that b's return pushed out
    finally:
        await f.stop()


async def test_purge_on_one_replica_empties_the_others_index(redis_url, ns):
    a, b = CacheFilter(cfg=cfg(redis_url, ns)), CacheFilter(cfg=cfg(redis_url, ns))
    await a.start()
    await b.start()
    try:
        up = FakeUpstream()
        await ask(a, up, make_call("hello world", tenant="t1"))
        await ask(a, up, make_call("hello world", tenant="t2"))
        await wait_for(lambda: len(b.index) == 2)
        assert await a.store.purge(tenant="t1") == 1
        await wait_for(lambda: len(b.index) == 1)
        assert (await ask(b, up, make_call("hello world", tenant="t1")))[0].header(b"x-usefulwork-cache") == b"miss"
        assert (await ask(b, up, make_call("hello world", tenant="t2")))[0].header(b"x-usefulwork-cache") == b"hit-exact"
    finally:
        await a.stop()
        await b.stop()


async def test_redis_down_never_fails_a_request():
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    f = CacheFilter(cfg=CacheCfg(redis_url=dead, semantic=SemanticCfg(enabled=False)))
    await f.start()
    try:
        up = FakeUpstream("still answered")
        for _ in range(3):
            r, body = await ask(f, up, make_call("q"))
            assert r.status == 200 and r.header(b"x-usefulwork-cache") == b"bypass" and b"still answered" in body
        assert f.stats()["store_errors"] == 3 and f.stats()["bypass_reasons"] == {"store_error": 3}
    finally:
        await f.stop()


async def test_store_round_trip_keeps_the_vector_for_other_replicas(redis_url, ns):
    s = RedisStore(cfg(redis_url, ns))
    try:
        assert await s.get("p", "missing") is None
        assert await s.purge(tenant="nobody") == 0
    finally:
        await s.stop()


async def test_lookups_survive_a_script_flush_and_concurrency(redis_url, ns):
    from usefulwork.caches.store import Entry
    s = RedisStore(cfg(redis_url, ns))
    try:
        entries = [Entry(f"k{i}", "p", "t", "m", "chat", f"q{i}", {"message": {"content": f"a{i}"}}, {}) for i in range(8)]
        for e in entries:
            await s.put(e)
        redis.Redis.from_url(redis_url).script_flush()  # as after a Redis restart: EVALSHA answers NOSCRIPT
        assert (await s.get("p", "k0")).text == "q0"
        got = await asyncio.gather(*(s.get("p", e.key) for e in entries))  # one on the store's connection, the rest pooled
        assert [g.text for g in got] == [e.text for e in entries]
        assert await s.get("p", "missing") is None
    finally:
        await s.stop()


async def test_a_hung_redis_times_out_and_the_request_bypasses():
    async def silent(reader, writer):  # accepts, reads, never answers
        await reader.read(1 << 20)
    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    f = CacheFilter(cfg=CacheCfg(redis_url=f"redis://127.0.0.1:{port}/0", redis_timeout_s=0.2,
                                 semantic=SemanticCfg(enabled=False)))
    await f.start()
    try:
        up = FakeUpstream("still answered")
        for _ in range(2):
            t = asyncio.get_running_loop().time()
            r, body = await ask(f, up, make_call("q"))
            assert r.status == 200 and r.header(b"x-usefulwork-cache") == b"bypass" and b"still answered" in body
            assert asyncio.get_running_loop().time() - t < 2.0
        assert f.stats()["bypass_reasons"] == {"store_error": 2}
    finally:
        await f.stop()
        server.close()


async def test_a_lookup_that_times_out_starts_a_fresh_channel(redis_url, ns):
    from usefulwork.caches.store import Entry
    s = RedisStore(cfg(redis_url, ns, redis_timeout_s=0.1))
    try:
        await s.put(Entry("k", "p", "t", "m", "chat", "q", {"message": {"content": "a"}}, {}))
        assert (await s.get("p", "k")).text == "q"
        first = s._chan
        redis.Redis.from_url(redis_url).client_pause(400)  # the real Redis stops answering for 400 ms
        with pytest.raises(TimeoutError):
            await s.get("p", "k")
        await asyncio.sleep(0.5)
        assert (await s.get("p", "k")).text == "q" and s._chan is not first and first.closed
    finally:
        await s.stop()


def test_the_lookup_channel_reads_replies_split_anywhere():
    from redis.exceptions import NoScriptError, ResponseError

    from usefulwork.caches.redis_lookup import LookupChannel

    async def run():
        ch = LookupChannel()
        ch.connection_made(type("Sink", (), {"write": lambda self, b: None})())  # the replies are fed below
        futs = [ch.send(b"") for _ in range(6)]
        stream = b"$5\r\nhello\r\n$-1\r\n+OK\r\n:42\r\n-NOSCRIPT No matching script\r\n-ERR bad\r\n"
        for i in range(len(stream)):  # one byte at a time
            ch.data_received(stream[i:i + 1])
        assert [f.result() for f in futs[:4]] == [b"hello", None, b"OK", 42]
        assert isinstance(futs[4].exception(), NoScriptError) and type(futs[5].exception()) is ResponseError
        assert not ch.waiting and ch.buf == b""
    asyncio.run(run())
