"""One OpenAI/vLLM API contract, checked against the simulator and the real vLLM (see conftest)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import VLLMServer
from usefulwork.backends.local import cpu_lacks_bf16
from usefulwork.upstream.fleet import SCRAPED, parse_metrics

pytestmark = pytest.mark.vllm

REQUIRED_METRICS = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:iteration_tokens_total_bucket",
    "vllm:cache_config_info",
]
# A prompt longer than one 128-token KV block (vLLM CPU's block size): prefix caching can hit it.
LONG_SYSTEM = " ".join(f"rule {i}: answer briefly and politely." for i in range(60))


def client(server: VLLMServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(server: VLLMServer, content: str = "Say hello.", **kw):
    return client(server).chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": content}], **kw
    )


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [server.model]
    raw = httpx.get(f"{server.base_url}/v1/models", timeout=5).json()
    assert raw["object"] == "list" and raw["data"][0]["max_model_len"] == 2048
    assert raw["data"][0]["owned_by"] == "vllm"
    assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200


def test_chat_non_stream_usage_and_max_tokens(server):
    r = chat(server, max_tokens=7, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == server.model
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens == 33  # SmolLM2 chat template + "Say hello." with the real tokenizer
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_with_usage(server):
    stream = chat(server, max_tokens=6, stream=True, stream_options={"include_usage": True},
                  extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 6 and last.usage.prompt_tokens == 33
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_completions_non_stream_and_stream(server):
    c = client(server)
    r = c.completions.create(model=server.model, prompt="The capital of France is", max_tokens=5,
                             extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length" and isinstance(r.choices[0].text, str)
    chunks = list(c.completions.create(model=server.model, prompt="The capital of France is", max_tokens=4,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices)


def test_completions_accepts_token_ids(server):
    r = client(server).completions.create(model=server.model, prompt=[504, 3575, 282, 4649, 314], max_tokens=2,
                                          extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 2


def test_chat_logprobs(server):
    r = chat(server, max_tokens=4, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for tok in content:
        assert tok.logprob <= 0 and isinstance(tok.token, str) and tok.bytes is not None
        assert len(tok.top_logprobs) == 3
        assert all(t.logprob <= 0 for t in tok.top_logprobs)
    # Without logprobs: none returned.
    assert chat(server, max_tokens=2).choices[0].logprobs is None


def test_chat_stream_logprobs(server):
    chunks = list(chat(server, max_tokens=3, stream=True, logprobs=True, top_logprobs=1,
                       extra_body={"ignore_eos": True}))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 3 and all(len(e.top_logprobs) == 1 for e in entries)


def test_completion_logprobs(server):
    r = client(server).completions.create(model=server.model, prompt="Once upon a time", max_tokens=3, logprobs=2,
                                          extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(lp.top_logprobs) == 3
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(d) >= 2 for d in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_cached_tokens_on_a_repeated_prefix(server):
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "first question"}]
    c = client(server)
    first = c.chat.completions.create(model=server.model, messages=messages, max_tokens=2)
    messages[1]["content"] = "second question"
    second = c.chat.completions.create(model=server.model, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens > 400
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The shared system prompt spans several full 128-token blocks: they hit.
    assert cached >= 256 and cached % 128 == 0 and cached < second.usage.prompt_tokens


def test_prompt_too_long_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as err:
        client(server).completions.create(model=server.model, prompt="hello " * 2100, max_tokens=3)
    body = err.value.body
    assert err.value.status_code == 400
    assert "maximum context length is 2048 tokens" in body["message"]
    assert body["type"] == "BadRequestError" and body["param"] == "input_tokens"
    with pytest.raises(openai.BadRequestError):
        chat(server, "hello " * 2100, max_tokens=3)


def test_max_tokens_beyond_max_model_len_is_a_400(server):
    with pytest.raises(openai.BadRequestError) as err:
        client(server).completions.create(model=server.model, prompt="hi", max_tokens=3000)
    assert err.value.body["param"] == "max_tokens"


def test_error_shapes(server):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=10,
                   json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "NotFoundError" and err["code"] == 404
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=10,
                   json={"model": server.model, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=10, json={
        "model": server.model, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30})
    assert r.status_code == 400 and "greater than max allowed: 20" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=10, content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_metrics_names_and_movement(server, request):
    text = httpx.get(f"{server.base_url}/metrics", timeout=5).text
    for name in REQUIRED_METRICS:
        assert any(line.startswith(name) for line in text.splitlines()), name
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    # 2 GiB of KV cache in 128-token blocks of SmolLM2's 23,040 bytes per token in bfloat16: 728 blocks.
    # The launcher runs the real server in float32 on a CPU without native bfloat16 (backends/local.py),
    # which doubles each block's bytes; the simulator's cpu profile models the bfloat16 server.
    float32 = request.node.callspec.params["server"] == "vllm" and cpu_lacks_bf16()
    assert 'block_size="128"' in info and f'num_gpu_blocks="{364 if float32 else 728}"' in info, info
    gen0 = server.metric("vllm:generation_tokens_total")
    prompt0 = server.metric("vllm:prompt_tokens_total")
    q0 = server.metric("vllm:prefix_cache_queries_total")
    ttft0 = server.metric("vllm:time_to_first_token_seconds_count")
    before = parse_metrics(text)
    chat(server, max_tokens=5, extra_body={"ignore_eos": True})
    assert server.metric("vllm:generation_tokens_total") - gen0 == 5
    assert server.metric("vllm:prompt_tokens_total") - prompt0 == 33
    assert server.metric("vllm:prefix_cache_queries_total") - q0 == 33
    assert server.metric("vllm:time_to_first_token_seconds_count") - ttft0 == 1
    assert server.metric("vllm:num_requests_running") == 0
    assert 0.0 <= server.metric("vllm:kv_cache_usage_perc") <= 1.0
    # The figures the gateway's fleet reads (admission's live decode speed, prefill and request time) move
    # by this one request: its 5 tokens' 4 gaps, one prefill, one ended request.
    after = parse_metrics(httpx.get(f"{server.base_url}/metrics", timeout=5).text)
    assert set(SCRAPED.values()) <= after.keys(), sorted(after)
    assert after["itl_count"] - before["itl_count"] == 4 and after["itl_sum"] > before["itl_sum"]
    assert after["prefill_count"] - before["prefill_count"] == 1 and after["prefill_sum"] > before["prefill_sum"]
    assert after["e2e_count"] - before["e2e_count"] == 1
    assert after["e2e_sum"] - before["e2e_sum"] >= after["prefill_sum"] - before["prefill_sum"]
