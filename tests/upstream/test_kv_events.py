"""The precise prefix picker: its index from KV-cache events (unit), and end to end from a real
simulator process publishing vLLM's ZMQ wire format; its predictions checked against cached_tokens."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from tests.conftest import free_port
from usefulwork.backends.sim.process import SimProcess
from usefulwork.backends.sim.tokens import load_tokenizer
from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.pipeline import Call
from usefulwork.routers.config import PickerCfg
from usefulwork.upstream.fleet import Replica
from usefulwork.upstream.kv_events import PrecisePrefixPicker
from usefulwork.upstream.pickers import BlockHasher


def picker(endpoints: dict[str, str], block: int = 4) -> PrecisePrefixPicker:
    return PrecisePrefixPicker(PickerCfg(kind="precise-prefix", block_tokens=block, kv_events_endpoints=endpoints),
                               tokenizer=load_tokenizer(None))


def test_events_build_the_index_under_the_gateways_own_hashes():
    p = picker({"http://a": "tcp://127.0.0.1:1"})
    ids = list(range(100, 112))  # three blocks of 4
    ours = BlockHasher(4, 4.0).token_hashes(ids)
    p.apply("http://a", [{"type": "BlockStored", "block_hashes": [b"x1", b"x2"], "parent_block_hash": None,
                          "token_ids": ids[:8], "block_size": 4, "lora_id": None, "medium": "GPU"}])
    p.apply("http://a", [{"type": "BlockStored", "block_hashes": [b"x3"], "parent_block_hash": b"x2",
                          "token_ids": ids[8:], "block_size": 4, "lora_id": None, "medium": "GPU"}])
    idx = p.index["http://a"]
    assert idx.matched(ours) == 3
    p.apply("http://a", [{"type": "BlockRemoved", "block_hashes": [b"x3"], "medium": "GPU"}])
    assert idx.matched(ours) == 2
    p.apply("http://a", [{"type": "BlockStored", "block_hashes": [b"y"], "parent_block_hash": b"unknown",
                          "token_ids": ids[:4], "block_size": 4, "lora_id": None, "medium": "GPU"},
                         {"type": "BlockStored", "block_hashes": [b"z"], "parent_block_hash": None,
                          "token_ids": ids[:4], "block_size": 4, "lora_id": None, "medium": "CPU"}])
    assert p.unchained == 1 and len(idx.blocks) == 2  # missed parent, and an offloaded tier: not indexed
    p.apply("http://a", [{"type": "AllBlocksCleared"}])
    assert idx.matched(ours) == 0 and not p.ours["http://a"]


def test_precise_needs_a_tokenizer_and_endpoints():
    with pytest.raises(ValueError, match="tokenizer"):
        PrecisePrefixPicker(PickerCfg(kind="precise-prefix", kv_events_endpoints={"http://a": "tcp://x:1"}))
    with pytest.raises(ValueError, match="kv_events_endpoints"):
        PrecisePrefixPicker(PickerCfg(kind="precise-prefix"), tokenizer=load_tokenizer(None))


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    logs = tmp_path_factory.mktemp("kv")
    procs = []
    for i in range(2):
        zport = free_port()
        cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{zport}"})
        procs.append((SimProcess(gpu="A100-80G", model="Llama-3.1-8B", served_name="llama", port=free_port(),
                                 time_scale=50, seed=i, extra={"kv_events_config": cfg},
                                 log_path=logs / f"sim{i}.log"), f"tcp://127.0.0.1:{zport}"))
    with procs[0][0], procs[1][0]:
        yield procs


def chat(text: str) -> dict:
    return {"model": "llama", "messages": [{"role": "system", "content": "Policy handbook. " + " ".join(f"Rule {i} holds for every order." for i in range(40))},
                                           {"role": "user", "content": text}], "max_tokens": 4}


async def test_simulator_events_make_predictions_match_cached_tokens(sims):
    (s0, e0), (s1, e1) = sims
    p = picker({s0.base_url: e0, s1.base_url: e1}, block=16)  # the simulated A100's block size
    rs = [Replica(s0.base_url, "p", healthy=True), Replica(s1.base_url, "p", healthy=True)]
    p.start()
    await asyncio.sleep(0.3)  # ZMQ slow joiner: let the subscriptions settle
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.post(f"{s1.base_url}/v1/chat/completions", json=chat("first question"))
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for _ in range(50):
            if p.index.get(s1.base_url) and p.index[s1.base_url].blocks:
                break
            await asyncio.sleep(0.05)
        body = chat("second question")
        c = Call(RequestContext(id="x", endpoint="chat", model="llama", stream=False), "chat",
                 b"/v1/chat/completions", body, None, None, [])
        ordered = p.pick(c, rs)
        assert ordered[0].url == s1.base_url  # the replica that holds the prefix, learned from its events
        predicted = c.ctx.predicted_cached_tokens
        r = await client.post(f"{s1.base_url}/v1/chat/completions", json=body)
        actual = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert predicted > 0 and predicted == actual, (predicted, actual)
    c.ctx.usage_source, c.ctx.cached_tokens = "backend", actual
    p.feedback(c, ordered[0])
    assert p.accurate == 1 and p.events > 0
    await p.stop()


async def test_a_discovered_replica_is_subscribed_on_kv_events_port_and_dropped_when_it_leaves(sims):
    """Replicas found by discovery have no kv_events_endpoints entry: kv_events_port names their publisher."""
    (s1, e1) = sims[1]
    p = PrecisePrefixPicker(PickerCfg(kind="precise-prefix", block_tokens=16, kv_events_port=int(e1.rsplit(":", 1)[1])),
                            tokenizer=load_tokenizer(None))
    p.start()
    r = Replica(s1.base_url, "p", healthy=True, discovered=True)
    p.replicas_changed([r], [])
    assert p.endpoints == {s1.base_url: e1}
    await asyncio.sleep(0.3)  # ZMQ slow joiner
    async with httpx.AsyncClient(timeout=30) as client:
        fresh = {"model": "llama", "max_tokens": 4, "messages": [  # blocks no earlier test stored (chained from root)
            {"role": "user", "content": " ".join(f"Pod {i} joined the pool at step {i * 7}." for i in range(40))}]}
        await client.post(f"{s1.base_url}/v1/chat/completions", json=fresh)
    for _ in range(50):
        if p.index.get(s1.base_url) and p.index[s1.base_url].blocks:
            break
        await asyncio.sleep(0.05)
    assert p.index[s1.base_url].blocks
    task = p._tasks[s1.base_url]
    p.replicas_changed([], [r])
    await asyncio.sleep(0)
    assert s1.base_url not in p.index and s1.base_url not in p.endpoints and task.done()
    await p.stop()


async def test_real_vllm_events_predict_its_cached_tokens(vllm_server):
    """The real vLLM (CPU build) publishing its KV-cache events: the wire format decodes, the block size
    is taken from the events (CPU vLLM stores 128-token blocks; block_tokens is left at its default 16),
    and the prediction for a shared prefix equals the cached_tokens vLLM then reports."""
    if not vllm_server.kv_events:
        pytest.fail("this vLLM publishes no KV-cache events: set USEFULWORK_TEST_VLLM_KV_EVENTS (tests/conftest.py)")
    from usefulwork.backends.model import ensure_model
    from usefulwork.upstream.pickers import load_tokenizer as model_tokenizer

    url = vllm_server.base_url
    p = PrecisePrefixPicker(PickerCfg(kind="precise-prefix", kv_events_endpoints={url: vllm_server.kv_events}),
                            tokenizer=model_tokenizer(str(ensure_model())))
    assert p.hasher.block_tokens == 16
    rs = [Replica("http://127.0.0.1:9", "p", healthy=True), Replica(url, "p", healthy=True)]
    nonce = os.urandom(6).hex()  # a prefix no earlier request left in vLLM's cache
    handbook = f"Ticket {nonce}. " + " ".join(f"Rule {i} holds for order {nonce}-{i}." for i in range(60))

    def ask(question: str) -> dict:
        return {"model": vllm_server.model, "max_tokens": 2,
                "messages": [{"role": "system", "content": handbook}, {"role": "user", "content": question}]}

    p.start()
    await asyncio.sleep(0.5)  # ZMQ slow joiner
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            r = await client.post(f"{url}/v1/chat/completions", json=ask("first question"))
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            for _ in range(100):
                if p.index.get(url) and p.index[url].blocks:
                    break
                await asyncio.sleep(0.05)
            assert p.events > 0 and p.unchained == 0
            assert p.hasher.block_tokens != 16  # adopted from the events (vLLM's CPU build: 128)
            body = ask("second question")
            c = Call(RequestContext(id="x", endpoint="chat", model=vllm_server.model, stream=False), "chat",
                     b"/v1/chat/completions", body, None, None, [])
            ordered = p.pick(c, rs)
            predicted = c.ctx.predicted_cached_tokens
            r = await client.post(f"{url}/v1/chat/completions", json=body)
            actual = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    finally:
        await p.stop()
    assert ordered[0].url == url  # the replica that holds the prefix, learned from its own events
    assert predicted > 0 and predicted == actual, (predicted, actual)
