"""The heuristic router: signals, weights, threshold, and its config errors."""

from __future__ import annotations

import pytest

from usefulwork import config
from usefulwork.routers.config import HeuristicCfg
from usefulwork.routers.heuristic import HeuristicRouter, last_user_text


def chat(text: str, *earlier: str) -> dict:
    msgs = [{"role": "user", "content": e} for e in earlier]
    return {"messages": [*msgs, {"role": "user", "content": text}]}


def test_simple_question_goes_small_and_code_request_goes_large():
    r = HeuristicRouter(HeuristicCfg())
    d = r.decide_body(chat("What is the capital of France?"))
    assert d.tier == "small" and "no signal" in d.reason
    d = r.decide_body(chat("Please write code for an LRU cache, and explain why it is O(1)."))
    assert d.tier == "large" and "write code" in d.reason and "explain why" in d.reason


def test_length_signal_is_proportional_and_capped():
    r = HeuristicRouter(HeuristicCfg(weights={"length": 1.0}, long_prompt_chars=100, threshold=1.0))
    assert r.score(chat("x" * 50))[0] == pytest.approx(0.5)
    assert r.score(chat("x" * 500))[0] == pytest.approx(1.0)
    assert r.decide_body(chat("x" * 100)).tier == "large"
    # the whole conversation counts for length; keywords only in the last user message
    assert r.score(chat("short", "x" * 80))[0] == pytest.approx(0.85)


def test_several_questions_and_phrases_are_case_insensitive():
    r = HeuristicRouter(HeuristicCfg(weights={"several questions": 0.7, "Step By Step": 0.4}, threshold=1.0))
    s, hits = r.score(chat("Why? How? Go STEP BY STEP."))
    assert s == pytest.approx(1.1) and hits == ["several questions", "step by step"]
    assert r.score(chat("Only one?"))[0] == 0.0


def test_completions_prompt_and_content_parts():
    assert last_user_text({"prompt": "abc"}) == ("abc", 3)
    assert last_user_text({"prompt": ["ab", "cd"]}) == ("ab\ncd", 5)
    body = {"messages": [{"role": "system", "content": "sys"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert last_user_text(body) == ("hi", 5)


def test_a_responses_request_is_read_as_its_messages():
    """The Responses API's input items (and instructions, the system message vLLM makes of them) are read
    as chat messages are: before, an item list read as an empty prompt, and every such request went small."""
    r = HeuristicRouter(HeuristicCfg())
    hard = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Please write code for an LRU "
                                                     "cache, and explain why it is O(1)."}]}]}
    d = r.decide_body(hard)
    assert d.tier == "large" and "write code" in d.reason
    body = {"instructions": "sys", "input": [{"role": "user", "content": "hi"}, {"type": "function_call_output",
                                                                               "call_id": "c", "output": "42"}]}
    assert last_user_text(body) == ("hi", 5)
    assert last_user_text({"instructions": "sys", "input": "hello"}) == ("hello", 8)
    assert last_user_text({"input": "hello"}) == ("hello", 5)


@pytest.mark.parametrize("tree, field", [
    ({"threshold": -0.1}, "heuristic.threshold"),
    ({"threshold": 101}, "heuristic.threshold"),
    ({"weights": {"analyze": -1}}, "weights.analyze"),
    ({"long_prompt_chars": 0}, "heuristic.long_prompt_chars"),
])
def test_out_of_range_settings_name_the_field(tree, field):
    vm = {"name": "auto", "small_pool": "s", "large_pool": "l", "heuristic": tree}
    with pytest.raises(config.ConfigError, match=field.replace(".", r"\.")):
        config.from_mapping({"routing": {"virtual_models": [vm]}}, environ={})
