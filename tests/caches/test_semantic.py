"""The semantic cache in-process: real all-MiniLM-L6-v2 embeddings, fake upstream ``next``."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from usefulwork.caches.config import CacheCfg, SemanticCfg
from usefulwork.caches.filter import CacheFilter
from usefulwork.caches.keys import Keys
from usefulwork.caches.store import Entry
from tests.faults import HeldEmbedder, SlowLoadingEmbedder
from usefulwork.config import ConfigError, from_mapping
from usefulwork.embedding import shared_embedder

from .helpers import FakeUpstream, drive, make_call, stream_text

# Lookup before the upstream (no race): these tests check what hits, not who is faster.
SEQUENTIAL = CacheCfg(semantic=SemanticCfg(parallel=False))


@pytest.fixture(autouse=True, scope="module")
def loaded_embedder():
    """The filters here use the shared embedder, which loads in the background: load it first."""
    shared_embedder().load()


async def ask(f, up, call):
    reply, body = await drive(lambda c: f(c, up), call)
    await f.drain()
    return reply, body


async def test_paraphrase_hits_and_negation_is_refused():
    f, up = CacheFilter(cfg=SEQUENTIAL), FakeUpstream("Paris.", delay_s=2.0)
    await ask(f, up, make_call("What is the capital of France?"))
    r, body = await ask(f, up, make_call("Which city is the capital of France?"))
    cache = r.header(b"x-usefulwork-cache").decode()
    assert cache.startswith("hit-semantic;score=") and float(cache.split("=")[1]) >= 0.91
    assert orjson.loads(body)["choices"][0]["message"]["content"] == "Paris."
    r, _ = await ask(f, up, make_call("Is the capital of France not Paris?"))
    assert r.header(b"x-usefulwork-cache") == b"miss"
    r, _ = await ask(f, up, make_call("What is the capital of Germany?"))
    assert r.header(b"x-usefulwork-cache") == b"miss"
    assert f.stats()["requests"]["hit-semantic"] == 1 and f.stats()["requests"]["miss"] == 3


def held(up: FakeUpstream, emb: HeldEmbedder) -> None:
    """The next lookup's embedding starts only once the upstream has answered: the upstream wins."""
    up.answered = emb.hold = asyncio.Event()


async def test_upstream_and_semantic_lookup_race():
    f, up = CacheFilter(cfg=CacheCfg(), embedder=HeldEmbedder(shared_embedder())), FakeUpstream("Paris.")
    await ask(f, up, make_call("What is the capital of France?"))
    # a complete JSON answer that arrives before the embedding wins: a miss, no wait for the lookup
    held(up, f.embedder)
    r, _ = await ask(f, up, make_call("Which city is the capital of France?", headers=[(b"cache-control", b"no-store")]))
    assert r.header(b"x-usefulwork-cache") == b"miss"
    # a stream whose first chunk comes before the lookup's answer wins too: a miss costs no wait
    held(up, f.embedder)
    r, body = await ask(f, up, make_call("Which city is the capital of France?", stream=True,
                                         headers=[(b"cache-control", b"no-store")]))
    assert r.header(b"x-usefulwork-cache") == b"miss" and stream_text(body) == "Paris. "
    # a stream whose first token is slow (a long prefill) loses to the lookup, which closes it
    closed = up.closed
    up.answered = f.embedder.hold = None
    up.first_chunk_delay_s = 10.0
    c = make_call("Which city is the capital of France?", stream=True)
    r, body = await ask(f, up, c)
    assert r.header(b"x-usefulwork-cache").startswith(b"hit-semantic") and b"Paris." in body
    assert up.closed == closed + 1 and c.ctx.replica is None
    # sequential mode: the upstream is asked only on a miss
    g, up2 = CacheFilter(cfg=CacheCfg(semantic=SemanticCfg(parallel=False))), FakeUpstream("Paris.")
    await ask(g, up2, make_call("What is the capital of France?"))
    r, _ = await ask(g, up2, make_call("Which city is the capital of France?"))
    assert r.header(b"x-usefulwork-cache").startswith(b"hit-semantic") and up2.calls == 1


async def test_a_lookup_the_upstream_beats_finishes_in_the_background_and_does_not_pay():
    f, up = CacheFilter(cfg=CacheCfg(), embedder=HeldEmbedder(shared_embedder())), FakeUpstream("Paris.")
    await ask(f, up, make_call("What is the capital of France?"))
    before, computed = f.stats(), f.embedder.embedded
    for stream in (False, True):  # a whole JSON answer, then a stream's first chunk, before the embedding
        held(up, f.embedder)
        r, _ = await ask(f, up, make_call(f"Which city is the capital of France{'!' if stream else '?'}", stream=stream))
        assert r.header(b"x-usefulwork-cache") == b"miss"
    st = f.stats()
    # each late lookup's vector is the one stored with the answer: one embedding per request, not two
    assert f.embedder.embedded - computed == 2 and st["embeddings"] - before["embeddings"] == 2
    assert st["vectors"] == 3 and st["stored"] == 3
    assert st["semantic_late"] == 2 and st["semantic_late_hits"] == 2 and list(f._lookups) == [False, False]
    up.answered = f.embedder.hold = None
    assert (await ask(f, up, make_call("Which city is the capital of France!", stream=True)))[0].header(
        b"x-usefulwork-cache") == b"hit-exact"  # stored whole


async def test_requests_that_cannot_hit_skip_the_embedding():
    f, up = CacheFilter(cfg=CacheCfg()), FakeUpstream()
    await ask(f, up, make_call("hello there", headers=[(b"cache-control", b"no-store")]))  # empty partition
    await ask(f, up, make_call("hello there", temperature=1.0))  # not cacheable
    assert f.stats()["embeddings"] == 0
    await ask(f, up, make_call("hello there"))  # stored: embedded once, off the request path
    assert f.stats()["embeddings"] == 1 and f.stats()["vectors"] == 1


async def test_semantic_partitions_by_tenant_and_system_prompt():
    f, up = CacheFilter(cfg=SEQUENTIAL), FakeUpstream(delay_s=2.0)
    await ask(f, up, make_call("How do I reverse a list in Python?", tenant="A", system="be brief"))
    probe = "How can I reverse a Python list?"
    for kw in ({"tenant": "B", "system": "be brief"}, {"tenant": "A", "system": "be verbose"}, {"tenant": "A"}):
        r, _ = await ask(f, up, make_call(probe, headers=[(b"cache-control", b"no-store")], **kw))
        assert r.header(b"x-usefulwork-cache") == b"miss", kw
    r, _ = await ask(f, up, make_call(probe, tenant="A", system="be brief"))
    assert r.header(b"x-usefulwork-cache").startswith(b"hit-semantic")


async def test_feedback_on_a_bad_hit_raises_that_entry_threshold():
    f, up = CacheFilter(cfg=SEQUENTIAL), FakeUpstream(delay_s=2.0)
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
    from types import SimpleNamespace
    from usefulwork.gateway.tenants import hash_key
    cfg = from_mapping({"auth": {"api_keys": {"k-a": "A", "k-b": "B"}},
                        "access": {"admin_key_hashes": [hash_key("k-admin")]}, "filters": ["cache"],
                        "cache": {"semantic": {"enabled": False}}}, environ={})
    f = CacheFilter(SimpleNamespace(cfg=cfg, meter=None))
    up = FakeUpstream()
    for tenant in ("A", "B"):
        await ask(f, up, make_call("q", tenant=tenant))
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
        # feedback needs the caller's own tenant key
        assert client.post("/usefulwork/cache/feedback", json={"request_id": "x"}).status_code == 401
    assert (await ask(f, up, make_call("q", tenant="A")))[0].header(b"x-usefulwork-cache") == b"miss"
    assert (await ask(f, up, make_call("q", tenant="B")))[0].header(b"x-usefulwork-cache") == b"hit-exact"


async def test_semantic_lookups_back_off_while_they_do_not_pay():
    f, up = CacheFilter(cfg=CacheCfg(semantic=SemanticCfg(min_hit_share=0.5, parallel=False))), FakeUpstream()
    await ask(f, up, make_call("What is the capital of France?"))
    f._lookups.extend([False] * 200)  # 200 lookups without a hit: below the 50% asked for
    before = f.stats()["embeddings"]
    for i in range(20):
        await ask(f, up, make_call(f"unrelated question number {i} about gardening", headers=[(b"cache-control", b"no-store")]))
    st = f.stats()
    assert st["embeddings"] - before == 2 and st["semantic_skipped_unpaid"] == 18  # one in ten still looks


async def test_before_the_embedder_loads_exact_caching_works_and_semantic_lookups_are_skipped():
    emb = SlowLoadingEmbedder()
    f, up = CacheFilter(cfg=SEQUENTIAL, embedder=emb), FakeUpstream("Paris.")
    await f.start()  # returns at once: the model loads in the background (readiness never waits for it)
    assert not emb.loaded
    await ask(f, up, make_call("What is the capital of France?"))
    r, _ = await ask(f, up, make_call("What is the capital of France?"))
    assert r.header(b"x-usefulwork-cache") == b"hit-exact"
    st = f.stats()
    assert st["embedder_loaded"] is False and st["vectors"] == 0 and st["semantic_skipped_loading"] == 1  # the store
    # a partition with vectors (filed by another replica): the lookup is skipped, counted, a miss
    para = make_call("Which city is the capital of France?")
    keys = Keys.of(para.ctx.tenant, para.op, para.body)
    await f.store.put(Entry("other", keys.partition, keys.tenant, keys.model, "chat", "user: What is the capital "
                            "of France?", {"message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"},
                            None, shared_embedder().encode(["user: What is the capital of France?"])[0]))
    r, _ = await ask(f, up, para)
    assert r.header(b"x-usefulwork-cache") == b"miss" and f.stats()["semantic_skipped_loading"] == 3
    emb.release()
    await emb.wait_loaded(120)
    await ask(f, up, make_call("What is the capital of Italy?"))  # stored with its vector now
    r, _ = await ask(f, up, make_call("Which city is the capital of Italy?"))
    assert r.header(b"x-usefulwork-cache").startswith(b"hit-semantic")
    assert f.stats()["embedder_loaded"] is True
    await f.stop()
