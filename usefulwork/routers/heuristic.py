"""The heuristic router: length and keyword signals with configurable weights (microseconds per call).

Signals (``HeuristicCfg.weights``):
- ``length``: the prompt's length in characters over ``long_prompt_chars``, capped at 1;
- ``several questions``: two or more '?' in the last user message;
- any other key: a phrase ("analyze", "compare", "explain why", "step by step", "write code", ...)
  found in the last user message, case-insensitive.

score = sum of weight x signal; the large tier when score >= ``threshold``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from usefulwork.gateway.validation import messages_of, prompt_of
from usefulwork.routers import Decision

if TYPE_CHECKING:
    from usefulwork.gateway.pipeline import Call
    from usefulwork.routers.config import HeuristicCfg


def last_user_text(body: dict[str, Any]) -> tuple[str, int]:
    """(the last user message's text, total characters of the prompt): chat messages, a Responses
    request's instructions and input items, or a plain prompt."""
    messages = messages_of(body)
    if messages is None:
        prompt = prompt_of(body)
        return prompt, len(prompt)
    total, last = 0, ""
    for role, text in messages:
        if text is None:
            continue
        total += len(text)
        if role == "user":
            last = text
    return last, total


class HeuristicRouter:
    name = "heuristic"

    def __init__(self, cfg: HeuristicCfg):
        self.cfg = cfg
        w = cfg.weights
        self._length_w = w.get("length", 0.0)
        self._questions_w = w.get("several questions", 0.0)
        self._phrases = [(k.lower(), v) for k, v in w.items() if k not in ("length", "several questions") and v]

    def score(self, body: dict[str, Any]) -> tuple[float, list[str]]:
        text, total = last_user_text(body)
        low = text.lower()
        score = 0.0
        hits: list[str] = []
        if self._length_w:
            share = min(1.0, total / self.cfg.long_prompt_chars)
            score += self._length_w * share
            if share >= 0.5:
                hits.append(f"length {total}")
        if self._questions_w and low.count("?") >= 2:
            score += self._questions_w
            hits.append("several questions")
        for phrase, weight in self._phrases:
            if phrase in low:
                score += weight
                hits.append(phrase)
        return score, hits

    def decide_body(self, body: dict[str, Any]) -> Decision:
        score, hits = self.score(body)
        large = score >= self.cfg.threshold
        why = ", ".join(hits) if hits else "no signal"
        op = ">=" if large else "<"
        return Decision("large" if large else "small", f"heuristic {score:.2f} {op} {self.cfg.threshold:g} ({why})", score)

    async def decide(self, call: Call) -> Decision:
        return self.decide_body(call.body)
