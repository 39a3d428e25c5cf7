"""The cache filter in-process, with a fake upstream ``next`` (exact cache; the semantic one in test_semantic)."""

from __future__ import annotations

import orjson
import pytest

from usefulwork.caches.config import CacheCfg, SemanticCfg
from usefulwork.caches.filter import CacheFilter, parse_cache_control
from usefulwork.caches.store import MemoryStore
from usefulwork.gateway.errors import GatewayError

from .helpers import FakeUpstream, drive, make_call, stream_text

EXACT_ONLY = CacheCfg(semantic=SemanticCfg(enabled=False))


async def ask(f, up, call):
    reply, body = await drive(lambda c: f(c, up), call)
    await f.drain()
    return reply, body


async def test_second_identical_request_is_an_exact_hit_with_the_same_answer():
    f, up = CacheFilter(cfg=EXACT_ONLY), FakeUpstream("Paris is the capital")
    r1, b1 = await ask(f, up, make_call("capital of France?"))
    c2 = make_call("capital of France?")
    r2, b2 = await ask(f, up, c2)
    assert up.calls == 1
    assert r1.header(b"x-usefulwork-cache") == b"miss" and r2.header(b"x-usefulwork-cache") == b"hit-exact"
    j1, j2 = orjson.loads(b1), orjson.loads(b2)
    assert j2["choices"][0]["message"] == j1["choices"][0]["message"]
    assert j2["usage"] == j1["usage"] and j2["object"] == "chat.completion" and j2["id"] != j1["id"]
    assert c2.ctx.cache == "hit-exact" and c2.ctx.prompt_tokens == 0 and c2.ctx.completion_tokens == 0
    assert f.stats()["requests"] == {"miss": 1, "hit-exact": 1, "hit-semantic": 0, "bypass": 0}
    assert f.stats()["hit_share"] == 0.5


async def test_streamed_miss_serves_json_hit_and_json_miss_serves_streamed_hit():
    f, up = CacheFilter(cfg=EXACT_ONLY), FakeUpstream("one two three")
    await ask(f, up, make_call("count", stream=True))
    r, body = await ask(f, up, make_call("count"))
    assert r.header(b"x-usefulwork-cache") == b"hit-exact"
    assert orjson.loads(body)["choices"][0]["message"]["content"] == "one two three "
    await ask(f, up, make_call("json first"))
    r, body = await ask(f, up, make_call("json first", stream=True, include_usage=True))
    assert r.header(b"x-usefulwork-cache") == b"hit-exact" and r.header(b"content-type") == b"text/event-stream"
    assert stream_text(body) == "one two three" and body.endswith(b"data: [DONE]\n\n")
    last = orjson.loads(body.split(b"\n\n")[-3][6:])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
    assert up.calls == 2


async def test_stream_hit_has_no_usage_chunk_unless_asked():
    f, up = CacheFilter(cfg=EXACT_ONLY), FakeUpstream("a b")
    await ask(f, up, make_call("q"))
    _, body = await ask(f, up, make_call("q", stream=True))
    assert b'"usage"' not in body


@pytest.mark.parametrize("change", [
    {"tenant": "t2"}, {"max_tokens": 5}, {"system": "be terse"}, {"stop": ["x"]}, {"seed": 1},
])
async def test_anything_that_changes_the_answer_changes_the_key(change):
    f, up = CacheFilter(cfg=EXACT_ONLY), FakeUpstream()
    await ask(f, up, make_call("same words"))
    r, _ = await ask(f, up, make_call("same words", **change))
    assert r.header(b"x-usefulwork-cache") == b"miss" and up.calls == 2


@pytest.mark.parametrize("params,reason", [
    ({"temperature": 0.7}, "temperature"), ({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
])
async def test_unsound_reuse_bypasses(params, reason):
    f, up = CacheFilter(cfg=EXACT_ONLY), FakeUpstream()
    for _ in range(2):
        c = make_call("q", **params)
        r, _ = await ask(f, up, c)
        assert r.header(b"x-usefulwork-cache") == b"bypass" and c.ctx.cache == "bypass"
    assert up.calls == 2 and f.stats()["bypass_reasons"] == {reason: 2}


async def test_hot_sampling_with_a_seed_is_cached_per_seed():
    f, up = CacheFilter(cfg=EXACT_ONLY), FakeUpstream()
    await ask(f, up, make_call("q", temperature=0.9, seed=7))
    r, _ = await ask(f, up, make_call("q", temperature=0.9, seed=7))
    assert r.header(b"x-usefulwork-cache") == b"hit-exact"
    r, _ = await ask(f, up, make_call("q", temperature=0.9, seed=8))
    assert r.header(b"x-usefulwork-cache") == b"miss"


async def test_cache_control_no_cache_refreshes_and_no_store_does_not_store():
    f, up = CacheFilter(cfg=EXACT_ONLY), FakeUpstream("old")
    await ask(f, up, make_call("q"))
    up.answer = "new"
    r, _ = await ask(f, up, make_call("q", headers=[(b"cache-control", b"no-cache")]))
    assert r.header(b"x-usefulwork-cache") == b"miss" and up.calls == 2
    _, body = await ask(f, up, make_call("q"))
    assert orjson.loads(body)["choices"][0]["message"]["content"] == "new"  # no-cache stored the fresh answer
    await ask(f, up, make_call("other", headers=[(b"cache-control", b"no-store")]))
    r, _ = await ask(f, up, make_call("other"))
    assert r.header(b"x-usefulwork-cache") == b"miss"
    r, _ = await ask(f, up, make_call("other", headers=[(b"cache-control", b"no-cache, no-store")]))
    assert r.header(b"x-usefulwork-cache") == b"bypass"


@pytest.mark.parametrize("raw", [b"no-cache;;", b"max-age=abc", b"=x", b"no cache", "no-cach\u00e9".encode()])
def test_malformed_cache_control_is_a_400(raw):
    with pytest.raises(GatewayError) as e:
        parse_cache_control(raw)
    assert e.value.status == 400 and e.value.param == "cache-control"


def test_cache_control_parsing():
    assert parse_cache_control(b"No-Cache, max-age=60") == (True, False, 60.0)
    assert parse_cache_control(b'no-store, foo="bar baz",') == (False, True, None)


async def test_errors_and_failed_streams_are_not_stored():
    f, up = CacheFilter(cfg=EXACT_ONLY), FakeUpstream(status=502)
    r, _ = await ask(f, up, make_call("q"))
    assert r.header(b"x-usefulwork-cache") == b"miss"
    up.status = 200
    r, _ = await ask(f, up, make_call("q"))
    assert r.header(b"x-usefulwork-cache") == b"miss" and f.stats()["stored"] == 1


async def test_ttl_expiry_and_lru_eviction_in_memory():
    now = [0.0]
    store = MemoryStore(ttl_s=10, max_entries=2, clock=lambda: now[0])
    f, up = CacheFilter(cfg=EXACT_ONLY, store=store), FakeUpstream()
    for q in ("a", "b"):
        await ask(f, up, make_call(q))
    await ask(f, up, make_call("a"))  # a is now the most recently used
    await ask(f, up, make_call("c"))  # evicts b
    assert store.evicted == 1
    assert (await ask(f, up, make_call("a")))[0].header(b"x-usefulwork-cache") == b"hit-exact"
    assert (await ask(f, up, make_call("b")))[0].header(b"x-usefulwork-cache") == b"miss"
    now[0] = 11.0
    assert (await ask(f, up, make_call("a")))[0].header(b"x-usefulwork-cache") == b"miss"
    assert store.expired >= 1


class BrokenStore(MemoryStore):
    async def get(self, partition, key):
        raise ConnectionError("store down")

    async def put(self, entry):
        raise ConnectionError("store down")


async def test_a_failing_store_never_fails_the_request():
    f, up = CacheFilter(cfg=EXACT_ONLY, store=BrokenStore(10, 10)), FakeUpstream("fine")
    for _ in range(2):
        r, body = await ask(f, up, make_call("q"))
        assert r.status == 200 and r.header(b"x-usefulwork-cache") == b"bypass"
        assert orjson.loads(body)["choices"][0]["message"]["content"] == "fine"
    assert f.stats()["store_errors"] == 2 and f.stats()["bypass_reasons"] == {"store_error": 2}


async def test_cross_tenant_isolation_in_100k_probes():
    """Tenant B asks exactly what tenant A cached, 100k times over 1000 questions: never a hit."""
    f, up = CacheFilter(cfg=EXACT_ONLY), FakeUpstream()
    questions = [f"question number {i}" for i in range(1000)]
    for q in questions:
        await ask(f, up, make_call(q, tenant="A"))
    assert f.stats()["stored"] == 1000
    hits = 0
    for i in range(100_000):  # no-store: B looks up every time but never fills its own entries
        c = make_call(questions[i % 1000], tenant="B", headers=[(b"cache-control", b"no-store")])
        reply = await f(c, up)
        hits += c.ctx.cache != "miss"
        await reply.aclose()
    assert hits == 0
    r, _ = await ask(f, up, make_call(questions[0], tenant="A"))
    assert r.header(b"x-usefulwork-cache") == b"hit-exact"  # the entries were there all along
