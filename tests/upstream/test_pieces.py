"""A low-band prompt prefilled in pieces through the replica's prefix cache (usefulwork/upstream/pieces.py), on
the real vLLM (CPU build), and the ways it stands down."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import orjson
import pytest

from tests.upstream.test_forwarder import Canned, http
from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.pipeline import Call
from usefulwork.upstream.fleet import Replica
from usefulwork.upstream.http1 import UpstreamPool
from usefulwork.upstream.pieces import piece_tokens, prefill_in_pieces, tokenize_body


def chat_call(model: str, content: str, **extra) -> Call:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0,
            **extra}
    ctx = RequestContext(id=f"r-{uuid.uuid4().hex[:8]}", endpoint="chat", model=model, stream=False)
    return Call(ctx=ctx, op="chat", path=b"/v1/chat/completions", body=body, raw=orjson.dumps(body), pool=None, headers=[])


def replica(url: str, block_size: float = 0.0) -> Replica:
    r = Replica(url, "p", healthy=True, block_size=block_size)
    r.http = UpstreamPool(url)
    return r


def prefix_counters(base_url: str) -> tuple[float, float]:
    """vLLM's prefix-cache (queries, hits) in tokens, summed over its labels."""
    q = h = 0.0
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:prefix_cache_queries_total"):
            q += float(line.split()[-1])
        elif line.startswith("vllm:prefix_cache_hits_total"):
            h += float(line.split()[-1])
    return q, h


def test_pieces_are_whole_kv_blocks():
    assert piece_tokens(64, 128.0) == 128 and piece_tokens(64, 32.0) == 64 and piece_tokens(100, 32.0) == 128
    assert piece_tokens(64, 0.0) == 64  # a replica that reports no block size: as configured


def test_what_shapes_a_chat_prompts_tokens_goes_to_tokenize_and_nothing_else():
    c = chat_call("m", "hi", tools=[{"type": "function", "function": {"name": "f"}}], add_generation_prompt=True)
    tb = tokenize_body(c)
    assert tb == {"model": "m", "messages": c.body["messages"], "tools": c.body["tools"], "add_generation_prompt": True}
    ctx = RequestContext(id="r", endpoint="embeddings", model="m", stream=False)
    assert tokenize_body(Call(ctx=ctx, op="embeddings", path=b"/v1/embeddings", body={"model": "m", "input": "x"},
                                raw=None, pool=None, headers=[])) is None


@pytest.mark.vllm
def test_a_prompt_prefilled_in_pieces_is_found_in_the_prefix_cache_and_answered_the_same(vllm_server):
    """On the real vLLM: the prompt's tokens from its /tokenize, each whole-block prefix sent as a one-token
    completion; the request itself then finds all those blocks cached (its own ``cached_tokens``) and answers
    exactly as the same request sent without pieces (greedy decoding)."""
    base = vllm_server.base_url
    block = int(httpx.get(f"{base}/metrics", timeout=10).text.split('block_size="', 1)[1].split('"', 1)[0])
    words = " ".join(f"w{i}" for i in range(400))

    async def go(content: str, pieces: bool) -> tuple[int, dict]:
        c = chat_call(vllm_server.model, content)
        r = replica(base, float(block))
        try:
            sent = await prefill_in_pieces(c, r, b"content-type: application/json\r\n", 64) if pieces else 0
        finally:
            r.http.close()
        answer = httpx.post(f"{base}/v1/chat/completions", json=c.body, timeout=120).json()
        return sent, answer

    q0, h0 = prefix_counters(base)
    tag = uuid.uuid4().hex  # (a prompt of its own: nothing cached before)
    sent, pieced = asyncio.run(go(f"{tag} {words}", True))
    q1, h1 = prefix_counters(base)
    n = pieced["usage"]["prompt_tokens"]
    step = piece_tokens(64, block)
    assert n >= 2 * step and sent == len(range(step, n, step)), (n, step, sent)
    cached = pieced["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (n - 1) // step * step - block, (cached, n, step)  # every whole piece found (less the last block at most)
    assert h1 - h0 >= cached  # (the pieces' own hits on each other are counted there too)
    _, plain = asyncio.run(go(f"{tag} {words}", False))  # the same prompt again, now all cached: same answer
    other_tag = uuid.uuid4().hex
    _, cold = asyncio.run(go(f"{other_tag} {words}", False))
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] < cached  # (what the pieces bought)
    assert pieced["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def test_a_replica_that_cannot_tokenize_gets_no_pieces_and_the_request_goes_as_it_is():
    """Fault injection (a canned 404 for /tokenize, as a server without it answers): no piece is sent."""

    async def go():
        async with Canned(http("404 Not Found", b'{"error": "no"}')) as up:
            r = replica(up.url, 16.0)
            sent = await prefill_in_pieces(chat_call("m", "x " * 600), r, b"content-type: application/json\r\n", 64)
            r.http.close()
            return sent, up.requests

    sent, requests = asyncio.run(go())
    assert sent == 0 and len(requests) == 1 and requests[0].startswith(b"POST /tokenize ")


def test_a_piece_that_fails_ends_the_pieces():
    """Fault injection: /tokenize answers 600 tokens, then every completion fails (500): one piece tried."""
    tokens = orjson.dumps({"tokens": list(range(600)), "count": 600})

    async def go():
        async with Canned(http("200 OK", tokens)) as tok:
            # (the same canned answer for every path: a 200 whose body is not a completion still counts as sent,
            # so a server that answers 500 is what ends them)
            async with Canned(http("500 Internal Server Error", b"{}")) as bad:
                r = replica(tok.url, 16.0)
                ids = (await prefill_in_pieces(chat_call("m", "x"), r, b"", 64), len(tok.requests))
                r.http.close()
                r2 = replica(bad.url, 16.0)
                c = chat_call("m", "x")
                c.op, c.body = "completions", {"model": "m", "prompt": list(range(600)), "max_tokens": 4}
                failed = (await prefill_in_pieces(c, r2, b"", 64), len(bad.requests))
                r2.http.close()
                return ids, failed

    (sent, asked), (failed, tried) = asyncio.run(go())
    assert (sent, asked) == (len(range(64, 600, 64)), 1 + len(range(64, 600, 64)))  # /tokenize, then each piece
    assert (failed, tried) == (0, 1)  # token ids given: no /tokenize; the first piece failed and ended them


@pytest.mark.vllm
async def test_the_forwarder_prefills_a_marked_call_in_pieces_on_the_replica_it_sends_it_to(vllm_server):
    """A call the admission filter marked (``Call.memo[PREFILL_CHUNK]``): the Forwarder sends the pieces to
    the replica it picked, then the request, whose answer says its whole pieces were cached; unmarked, the
    same kind of prompt finds nothing cached."""
    from usefulwork.config import from_mapping
    from usefulwork.upstream.fleet import Fleet
    from usefulwork.upstream.forwarder import Forwarder
    from usefulwork.upstream.pickers import build_pickers
    from usefulwork.upstream.pieces import PIECES_SENT, PREFILL_CHUNK

    block = int(httpx.get(f"{vllm_server.base_url}/metrics", timeout=10).text.split('block_size="', 1)[1].split('"', 1)[0])
    cfg = from_mapping({"pools": [{"name": "p", "models": [vllm_server.model], "replicas": [vllm_server.base_url]}]},
                       environ={})
    fleet = Fleet(cfg)
    for r in fleet.replicas:
        fleet.mark_up(r)
        r.block_size = float(block)  # (as its /metrics says; the fleet's scraper is not running here)
    fwd = Forwarder(fleet, build_pickers(cfg, fleet))
    words = " ".join(f"v{i}" for i in range(300))
    cached = {}
    try:
        for marked in (True, False):
            c = chat_call(vllm_server.model, f"{uuid.uuid4().hex} {words}")
            c.pool = fleet.pool_for_model(vllm_server.model)
            if marked:
                c.memo[PREFILL_CHUNK] = 64
            reply = await fwd(c)
            await reply.aclose()
            assert reply.status == 200
            cached[marked] = (reply.usage["prompt_tokens"], reply.usage["prompt_tokens_details"]["cached_tokens"],
                              c.memo.get(PIECES_SENT))
            assert fleet.replicas[0].inflight == 0  # (the lease held over the pieces is released)
    finally:
        await fleet.stop()
    n, hit, pieces = cached[True]
    step = piece_tokens(64, block)
    assert pieces == len(range(step, n, step)) and hit >= (n - 1) // step * step - block, cached
    assert cached[False][1] < step and cached[False][2] is None, cached


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    """The simulated A100 (the ``admission`` experiment's engine) at 20x real time: prefix cache on, 16-token blocks."""
    from tests.conftest import free_port
    from usefulwork.backends.sim.process import SimProcess

    s = SimProcess(gpu="A100-80G", model="Llama-3.1-8B", profile="optimized-batched", served_name="llama",
                   port=free_port(), time_scale=20.0, seed=0, log_path=tmp_path_factory.mktemp("sim") / "sim.log")
    with s:
        yield s


def test_the_simulator_tokenizes_as_it_prefills_and_a_pieced_prompt_finds_its_pieces_cached(sim):
    """The simulator answers vLLM's /tokenize with the tokens the chat request itself is prefilled with, so
    the pieces (each a one-token completion of those tokens) land in its prefix cache and the request finds
    every whole piece there; bad bodies get vLLM's 400."""
    base = sim.base_url
    block = int(httpx.get(f"{base}/metrics", timeout=10).text.split('block_size="', 1)[1].split('"', 1)[0])
    content = f"{uuid.uuid4().hex} " + " ".join(f"w{i}" for i in range(500))
    tok = httpx.post(f"{base}/tokenize", json={"model": "llama", "messages": [{"role": "user", "content": content}]},
                     timeout=10).json()
    c = chat_call("llama", content)

    async def go() -> int:
        r = replica(base, float(block))
        try:
            return await prefill_in_pieces(c, r, b"content-type: application/json\r\n", 64)
        finally:
            r.http.close()

    sent = asyncio.run(go())
    answer = httpx.post(f"{base}/v1/chat/completions", json=c.body, timeout=60).json()
    n = answer["usage"]["prompt_tokens"]
    step = piece_tokens(64, block)
    assert tok["count"] == len(tok["tokens"]) == n and n >= 2 * step
    assert sent == len(range(step, n, step))
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= (n - 1) // step * step, answer["usage"]
    plain = httpx.post(f"{base}/tokenize", json={"model": "llama", "prompt": "one two three"}, timeout=10).json()
    assert plain["count"] == len(plain["tokens"]) > 0
    for bad in ({"model": "llama", "prompt": 7}, {"model": "llama", "messages": []}, {"model": "nope", "prompt": "x"}):
        r = httpx.post(f"{base}/tokenize", json=bad, timeout=10)
        assert r.status_code in (400, 404) and r.json()["error"]["message"], (bad, r.text)


def test_each_piece_waits_for_the_hold_before_it_is_sent():
    """``Call.memo[PIECE_HOLD]`` (the admission filter's wait for the top band's pending prompts) is awaited
    before every piece: with a hold that lets one piece through per release, the pieces go one per release."""
    from usefulwork.upstream.pieces import PIECE_HOLD

    tokens = orjson.dumps({"tokens": list(range(300)), "count": 300})

    async def go():
        async with Canned(http("200 OK", tokens)) as up:
            r = replica(up.url, 16.0)
            gate = asyncio.Semaphore(0)
            c = chat_call("m", "x")
            c.memo[PIECE_HOLD] = gate.acquire
            task = asyncio.create_task(prefill_in_pieces(c, r, b"", 64))
            seen = []
            for _ in range(4):
                await asyncio.sleep(0.05)
                seen.append(len(up.requests))
                gate.release()
            sent = await asyncio.wait_for(task, 5)
            r.http.close()
            return seen, sent

    seen, sent = asyncio.run(go())
    assert seen == [1, 2, 3, 4] and sent == len(range(64, 300, 64)) == 4  # /tokenize, then one piece per release
