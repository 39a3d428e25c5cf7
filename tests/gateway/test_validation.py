import orjson
import pytest

from usefulwork.gateway.errors import GatewayError
from usefulwork.gateway.validation import MAX_JSON_DEPTH, parse_json, validate_chat, validate_completion

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_valid_chat_and_completion_pass():
    validate_chat(dict(CHAT, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    validate_completion({"model": "m", "prompt": "x"})
    validate_completion({"model": "m", "prompt": [1, 2, 3]})
    validate_chat({"model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": [{}]}]})


@pytest.mark.parametrize("raw", [b"", b"{not json", b"[1,2]", b'"str"'])
def test_malformed_json_is_400(raw):
    with pytest.raises(GatewayError) as e:
        parse_json(raw)
    assert e.value.status == 400


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": 3, "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": "hi"}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
    (dict(CHAT, max_tokens=-1), "max_tokens"),
    (dict(CHAT, max_tokens=0), "max_tokens"),
    (dict(CHAT, max_tokens="10"), "max_tokens"),
    (dict(CHAT, max_tokens=True), "max_tokens"),
    (dict(CHAT, temperature=5), "temperature"),
    (dict(CHAT, stream="yes"), "stream"),
    (dict(CHAT, stream_options=[1]), "stream_options"),
    (dict(CHAT, n=0), "n"),
    (dict(CHAT, stop=[1]), "stop"),
])
def test_bad_chat_fields_are_422_naming_param(body, param):
    with pytest.raises(GatewayError) as e:
        validate_chat(body)
    assert e.value.status == 422
    assert e.value.param == param


@pytest.mark.parametrize("prompt", [None, [], [1, "a"], 5, {"a": 1}])
def test_bad_prompt_is_422(prompt):
    body = {"model": "m"} if prompt is None else {"model": "m", "prompt": prompt}
    with pytest.raises(GatewayError) as e:
        validate_completion(body)
    assert e.value.status == 422 and e.value.param == "prompt"


def _nested(depth: int, leaf="x") -> object:
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize("field, depth", [("max_tokens", 990), ("n", 990), ("temperature", 990), ("role", 990),
                                          ("content", 254), ("content", 1000)])
def test_deeply_nested_values_are_a_400_not_a_recursion_error(field, depth):
    """Issue #9.5: repr() of a ~990-deep value hit the recursion limit; orjson cannot re-encode 254+."""
    msg = {"role": "user", "content": "hi"}
    body = {"model": "m", "messages": [msg], "stream": True}
    if field in ("role", "content"):
        msg[field] = _nested(depth)
    else:
        body[field] = _nested(depth)
    raw = orjson.dumps(body) if depth < 254 else _dumps_deep(body)
    with pytest.raises(GatewayError) as e:
        validate_chat(parse_json(raw))
    assert e.value.status == 400 and "nest" in e.value.message


def _dumps_deep(obj) -> bytes:
    """json.dumps without orjson's depth limit (the attacker's encoder)."""
    import json
    import sys

    sys.setrecursionlimit(10_000)
    try:
        return json.dumps(obj).encode()
    finally:
        sys.setrecursionlimit(1000)


def test_every_accepted_body_can_be_re_encoded():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                                      "x": _nested(MAX_JSON_DEPTH - 6)}]}]}
    parsed = parse_json(orjson.dumps(body))
    validate_chat(parsed)
    assert orjson.loads(orjson.dumps(parsed)) == body  # the streaming path re-encodes the body


def test_error_messages_do_not_echo_huge_values():
    with pytest.raises(GatewayError) as e:
        validate_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9" * 100_000})
    assert len(e.value.message) < 300


async def test_deep_body_through_the_app_is_400_without_traceback(caplog):
    import httpx

    from usefulwork import config
    from usefulwork.gateway.app import build_app

    cfg = config.from_mapping({"pools": [{"name": "p", "models": ["m"], "replicas": ["http://127.0.0.1:9"]}]},
                              environ={})
    app = build_app(cfg)
    raw = _dumps_deep({"model": "m", "stream": True, "messages": [{"role": "user", "content": _nested(254)}]})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        r = await client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert "Traceback" not in caplog.text


def test_the_output_limit_is_read_and_set_in_each_endpoints_own_field():
    from usefulwork.gateway.validation import max_tokens_of, with_max_tokens

    assert max_tokens_of({"max_tokens": 10, "max_completion_tokens": 20}) == 20  # (as vLLM reads a chat request)
    assert max_tokens_of({"max_tokens": 10}) == 10 and max_tokens_of({"max_output_tokens": 7}) == 7
    assert max_tokens_of({}) is None and max_tokens_of({"max_tokens": True}) is None
    chat = {"model": "m", "max_tokens": 10, "max_completion_tokens": 20}
    assert with_max_tokens(chat, "chat", 5) == {"model": "m", "max_tokens": 5} and chat["max_completion_tokens"] == 20
    assert with_max_tokens({"model": "m"}, "completions", 5) == {"model": "m", "max_tokens": 5}
    assert with_max_tokens({"model": "m", "max_output_tokens": 9}, "responses", 5) == {"model": "m", "max_output_tokens": 5}


@pytest.mark.parametrize("extra, status, param", [
    ({"previous_response_id": ""}, 422, "previous_response_id"),
    ({"previous_response_id": 7}, 422, "previous_response_id"),
    ({"background": True}, 400, "background"),
])
def test_a_responses_request_names_a_stored_response_by_its_id_and_is_never_background(extra, status, param):
    from usefulwork.gateway.validation import validate_responses

    validate_responses({"model": "m", "input": "x", "previous_response_id": "resp_1", "background": False})
    with pytest.raises(GatewayError) as e:
        validate_responses({"model": "m", "input": "x", **extra})
    assert (e.value.status, e.value.param) == (status, param)


def test_a_responses_string_input_is_the_users_message_when_the_operation_says_so():
    from usefulwork.gateway.validation import messages_of

    assert messages_of({"input": "q"}) is None  # an embeddings input reads the same: a plain prompt
    assert messages_of({"input": "q"}, "responses") == [("user", "q")]
    assert messages_of({"input": "q"}, "embeddings") is None
    assert messages_of({"instructions": "s", "input": "q"}) == [("system", "s"), ("user", "q")]
