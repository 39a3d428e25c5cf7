"""The real `openai` SDK (sync and async) against the gateway in front of real vLLM."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

pytestmark = pytest.mark.vllm

CHAT = [{"role": "user", "content": "Say hello in three words."}]


@pytest.fixture
def client(gateway):
    with openai.OpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
async def aclient(gateway):
    async with openai.AsyncOpenAI(base_url=gateway.v1, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_models_is_union_of_pools(client, vllm_server):
    ids = [m.id for m in client.models.list().data]
    assert ids == [vllm_server.model]
    m = client.models.retrieve(vllm_server.model)
    assert m.id == vllm_server.model and m.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.code == "model_not_found"


def test_chat_non_streaming_has_usage(client, vllm_server):
    r = client.chat.completions.create(model=vllm_server.model, messages=CHAT, max_tokens=8)
    assert r.choices[0].message.content
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 8


def test_chat_stream_without_usage_request_leaks_no_usage(client, vllm_server):
    chunks = list(client.chat.completions.create(model=vllm_server.model, messages=CHAT, max_tokens=8, stream=True))
    assert chunks, "no chunks streamed"
    assert all(c.usage is None for c in chunks), "usage leaked to a client that did not ask for it"
    assert all(c.choices for c in chunks), "usage-only chunk (no choices) was not stripped"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text


def test_chat_stream_with_usage_gets_it_last(client, vllm_server):
    chunks = list(client.chat.completions.create(model=vllm_server.model, messages=CHAT, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.usage is not None and last.choices == []
    assert last.usage.completion_tokens == sum(1 for c in chunks[:-1] for ch in c.choices if ch.delta.content) or \
        last.usage.completion_tokens > 0


def test_completions_stream_and_not(client, vllm_server):
    r = client.completions.create(model=vllm_server.model, prompt="The capital of France is", max_tokens=5)
    assert r.choices[0].text and r.usage.completion_tokens > 0
    chunks = list(client.completions.create(model=vllm_server.model, prompt="One, two,", max_tokens=5, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert all(c.usage is None for c in chunks)


async def test_async_client_stream_and_not(aclient, vllm_server):
    r = await aclient.chat.completions.create(model=vllm_server.model, messages=CHAT, max_tokens=6)
    assert r.usage.completion_tokens > 0
    stream = await aclient.chat.completions.create(model=vllm_server.model, messages=CHAT, max_tokens=6, stream=True,
                                                   stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].usage is not None


async def test_async_concurrent_streams(aclient, vllm_server):
    async def one(i):
        s = await aclient.chat.completions.create(model=vllm_server.model, max_tokens=6, stream=True,
                                                  messages=[{"role": "user", "content": f"Count to {i}"}])
        return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])

    texts = await asyncio.gather(*(one(i) for i in range(8)))
    assert all(texts)


# -- bad input: OpenAI error classes and status codes, no stack traces --

def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert e.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("kwargs, param", [
    ({"messages": [], "max_tokens": 5}, "messages"),
    ({"messages": CHAT, "max_tokens": -3}, "max_tokens"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
])
def test_invalid_fields_are_422(client, vllm_server, kwargs, param):
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(model=vllm_server.model, **kwargs)
    assert e.value.body["param"] == param
    assert e.value.body["type"] == "invalid_request_error"


def test_malformed_json_is_400(gateway):
    r = httpx.post(gateway.v1 + "/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and "Traceback" not in r.text


def test_oversized_body_is_413(client, vllm_server):
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=vllm_server.model, messages=[{"role": "user", "content": "x" * 70000}])
    assert e.value.status_code == 413


def test_prompt_longer_than_context_is_upstream_400(client, vllm_server):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=vllm_server.model, prompt="hello " * 3000, max_tokens=5)


def test_wrong_method_and_unknown_path(gateway):
    assert httpx.get(gateway.v1 + "/chat/completions").status_code == 405
    r = httpx.get(gateway.url + "/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_health_ready_metrics(gateway, vllm_server):
    assert httpx.get(gateway.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(gateway.url + "/readyz").json()
    assert ready["ready"] is True
    text = httpx.get(gateway.url + "/metrics").text
    assert f'usefulwork_replica_up{{pool="local",replica="{vllm_server.base_url}"}} 1.0' in text


def test_responses_api_non_streaming_is_proxied_and_booked(client, gateway, vllm_server):
    r = client.responses.create(model=vllm_server.model, input="Say hello.", max_output_tokens=8)
    assert r.output_text and r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 8


def test_responses_api_stream_reaches_response_completed_with_usage(client, vllm_server):
    types, final = [], None
    with client.responses.create(model=vllm_server.model, input="Count to three.", max_output_tokens=8,
                                 stream=True) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.completed":
                final = event.response
    assert types[0] == "response.created" and "response.output_text.delta" in types
    assert types[-1] == "response.completed" and final.usage.output_tokens > 0


def test_responses_api_helper_stream(client, vllm_server):
    with client.responses.stream(model=vllm_server.model, input="Say hi.", max_output_tokens=6) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text and final.usage.total_tokens > 0
