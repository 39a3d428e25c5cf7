"""The semantic cache in-process: real all-MiniLM-L6-v2 embeddings, fake upstream ``next``."""

from __future__ import annotations

import orjson
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from usefulwork.caches.config import CacheCfg, SemanticCfg
from usefulwork.caches.filter import CacheFilter
from usefulwork.config import ConfigError, from_mapping

from .helpers import FakeUpstream, drive, make_call, stream_text


async def ask(f, up, call):
    reply, body = await drive(lambda c: f(c, up), call)
    await f.drain()
    return reply, body


async def test_paraphrase_hits_and_negation_is_refused():
    f, up = CacheFilter(cfg=CacheCfg()), FakeUpstream("Paris.", delay_s=2.0)
    await ask(f, up, make_call("What is the capital of France?"))
    r, body = await ask(f, up, make_call("Which city is the capital of France?"))
    cache = r.header(b"x-usefulwork-cache").decode()
    assert cache.startswith("hit-semantic;score=") and float(cache.split("=")[1]) >= 0.92
    assert orjson.loads(body)["choices"][0]["message"]["content"] == "Paris."
    r, _ = await ask(f, up, make_call("Is the capital of France not Paris?"))
    assert r.header(b"x-usefulwork-cache") == b"miss"
    r, _ = await ask(f, up, make_call("What is the capital of Germany?"))
    assert r.header(b"x-usefulwork-cache") == b"miss"
    assert f.stats()["requests"]["hit-semantic"] == 1 and f.stats()["requests"]["miss"] == 3


async def test_upstream_and_semantic_lookup_race():
    f, up = CacheFilter(cfg=CacheCfg()), FakeUpstream("Paris.")
    await ask(f, up, make_call("What is the capital of France?"))
    # a complete JSON answer that arrives before the embedding wins: a miss, no wait for the lookup
    r, _ = await ask(f, up, make_call("Which city is the capital of France?", headers=[(b"cache-control", b"no-store")]))
    assert r.header(b"x-usefulwork-cache") == b"miss"
    # a stream whose first chunk comes before the lookup's answer wins too: a miss costs no wait
    r, body = await ask(f, up, make_call("Which city is the capital of France?", stream=True,
                                         headers=[(b"cache-control", b"no-store")]))
    assert r.header(b"x-usefulwork-cache") == b"miss" and stream_text(body) == "Paris. "
    # a stream whose first token is slow (a long prefill) loses to the lookup, which closes it
    closed = up.closed
    up.first_chunk_delay_s = 1.0
    c = make_call("Which city is the capital of France?", stream=True)
    r, body = await ask(f, up, c)
    assert r.header(b"x-usefulwork-cache").startswith(b"hit-semantic") and b"Paris." in body
    assert up.closed == closed + 1 and c.ctx.replica is None
    # sequential mode: the upstream is asked only on a miss
    g, up2 = CacheFilter(cfg=CacheCfg(semantic=SemanticCfg(parallel=False))), FakeUpstream("Paris.")
    await ask(g, up2, make_call("What is the capital of France?"))
    r, _ = await ask(g, up2, make_call("Which city is the capital of France?"))
    assert r.header(b"x-usefulwork-cache").startswith(b"hit-semantic") and up2.calls == 1


async def test_requests_that_cannot_hit_skip_the_embedding():
    f, up = CacheFilter(cfg=CacheCfg()), FakeUpstream()
    await ask(f, up, make_call("hello there", headers=[(b"cache-control", b"no-store")]))  # empty partition
    await ask(f, up, make_call("hello there", temperature=1.0))  # not cacheable
    assert f.stats()["embeddings"] == 0
    await ask(f, up, make_call("hello there"))  # stored: embedded once, off the request path
    assert f.stats()["embeddings"] == 1 and f.stats()["vectors"] == 1


async def test_semantic_partitions_by_tenant_and_system_prompt():
    f, up = CacheFilter(cfg=CacheCfg()), FakeUpstream(delay_s=2.0)
    await ask(f, up, make_call("How do I reverse a list in Python?", tenant="A", system="be brief"))
    probe = "How can I reverse a Python list?"
    for kw in ({"tenant": "B", "system": "be brief"}, {"tenant": "A", "system": "be verbose"}, {"tenant": "A"}):
        r, _ = await ask(f, up, make_call(probe, headers=[(b"cache-control", b"no-store")], **kw))
        assert r.header(b"x-usefulwork-cache") == b"miss", kw
    r, _ = await ask(f, up, make_call(probe, tenant="A", system="be brief"))
    assert r.header(b"x-usefulwork-cache").startswith(b"hit-semantic")


async def test_feedback_on_a_bad_hit_raises_that_entry_threshold():
    f, up = CacheFilter(cfg=CacheCfg()), FakeUpstream(delay_s=2.0)
    await ask(f, up, make_call("What is the capital of France?", tenant="default"))
    c = make_call("Which city is the capital of France?", tenant="default", headers=[(b"cache-control", b"no-store")])
    r, _ = await ask(f, up, c)
    assert r.header(b"x-usefulwork-cache").startswith(b"hit-semantic")
    app = Starlette(routes=f.routes)
    with TestClient(app) as client:
        bad = client.post("/usefulwork/cache/feedback", json={"request_id": "nope"})
        assert bad.status_code == 404 and bad.json()["error"]["param"] == "request_id"
        assert client.post("/usefulwork/cache/feedback", content=b"{").status_code == 400
        ok = client.post("/usefulwork/cache/feedback", json={"request_id": c.ctx.id})
        assert ok.status_code == 200, ok.text
    c2 = make_call("Which city is the capital of France?", tenant="default", headers=[(b"cache-control", b"no-store")])
    r, _ = await ask(f, up, c2)
    assert r.header(b"x-usefulwork-cache") == b"miss"
    assert f.stats()["bad_hit_reports"] == 1


def test_threshold_out_of_range_names_the_field():
    with pytest.raises(ConfigError, match="cache.semantic.threshold"):
        from_mapping({"cache": {"semantic": {"threshold": 1.5}}}, environ={})
    with pytest.raises(ConfigError, match="cache.semantic.thresholds"):
        from_mapping({"cache": {"semantic": {"thresholds": {"m1": 0}}}}, environ={})
    assert from_mapping({"cache": {"semantic": {"thresholds": {"m1": 0.95}}}}, environ={}).cache.semantic.threshold_for("m1") == 0.95


async def test_purge_needs_an_admin_key_and_a_known_tenant():
    cfg = from_mapping({"auth": {"api_keys": {"k-admin": "admin", "k-a": "A", "k-b": "B"}}}, environ={})
    f = CacheFilter(cfg=CacheCfg(semantic=SemanticCfg(enabled=False)))
    f._admin_keys, f._known_tenants = {"k-admin"}, {"admin", "A", "B"}
    up = FakeUpstream()
    for tenant in ("A", "B"):
        await ask(f, up, make_call("q", tenant=tenant))
    assert cfg.auth.api_keys["k-admin"] == "admin"
    with TestClient(Starlette(routes=f.routes)) as client:
        assert client.post("/usefulwork/cache/purge", json={"tenant": "A"}).status_code == 403
        assert client.post("/usefulwork/cache/purge", json={"tenant": "A"},
                           headers={"authorization": "Bearer k-a"}).status_code == 403
        admin = {"authorization": "Bearer k-admin"}
        r = client.post("/usefulwork/cache/purge", json={"tenant": "nobody"}, headers=admin)
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_tenant"
        assert client.post("/usefulwork/cache/purge", json={}, headers=admin).status_code == 422
        r = client.post("/usefulwork/cache/purge", json={"tenant": "A"}, headers=admin)
        assert r.status_code == 200 and r.json()["purged_partitions"] == 1
    assert (await ask(f, up, make_call("q", tenant="A")))[0].header(b"x-usefulwork-cache") == b"miss"
    assert (await ask(f, up, make_call("q", tenant="B")))[0].header(b"x-usefulwork-cache") == b"hit-exact"


def test_admin_keys_come_from_the_gateway_config():
    from types import SimpleNamespace
    cfg = from_mapping({"auth": {"api_keys": {"k-admin": "admin", "k-a": "A"}}, "filters": ["cache"]}, environ={})
    f = CacheFilter(SimpleNamespace(cfg=cfg, meter=None))
    assert f._admin_keys == {"k-admin"} and f._known_tenants == {"admin", "A"}
