import pytest

from usefulwork.gateway.errors import GatewayError
from usefulwork.gateway.validation import parse_json, validate_chat, validate_completion

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
