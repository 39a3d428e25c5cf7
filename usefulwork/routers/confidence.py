"""The confidence gate: the small tier answers first, with token logprobs; an unsure answer is
discarded and the large tier asked instead.

"Unsure" means the mean token logprob is below ``min_mean_logprob`` or any token's logprob is below
``min_token_logprob``. For a stream, the first ``hold_tokens`` tokens are held back and judged before
any byte is released; after release the answer is never escalated. The cascade filter
(``usefulwork/gateway/filters/router.py``) does the asking; this module only judges and reshapes bodies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from usefulwork.routers import Decision

if TYPE_CHECKING:
    from usefulwork.gateway.pipeline import Call
    from usefulwork.routers.config import ConfidenceCfg


def token_logprobs(choice: dict[str, Any]) -> list[float]:
    """The sampled tokens' logprobs of one choice (chat: logprobs.content; completions: token_logprobs)."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return []
    content = lp.get("content")
    if isinstance(content, list):
        return [float(t["logprob"]) for t in content if isinstance(t, dict) and t.get("logprob") is not None]
    tl = lp.get("token_logprobs")
    if isinstance(tl, list):
        return [float(x) for x in tl if x is not None]
    return []


def strip_logprobs(obj: dict[str, Any]) -> None:
    """Blank every choice's logprobs (the gate asked for them; the client did not): ``null``, as vLLM
    answers a request without logprobs."""
    for ch in obj.get("choices") or ():
        if isinstance(ch, dict) and "logprobs" in ch:
            ch["logprobs"] = None


def client_asked_logprobs(body: dict[str, Any]) -> bool:
    v = body.get("logprobs")
    return v is not None and v is not False


def with_logprobs(body: dict[str, Any], op: str) -> dict[str, Any]:
    """A copy of ``body`` that asks for the sampled tokens' logprobs (keeps what the client asked)."""
    out = dict(body)
    if not client_asked_logprobs(body):
        out["logprobs"] = True if op == "chat" else 1
    return out


class ConfidenceGate:
    name = "confidence-gated"
    gated = True  # the cascade filter asks the small tier first and calls ``judge``

    def __init__(self, cfg: ConfidenceCfg):
        self.cfg = cfg

    async def decide(self, call: Call) -> Decision:
        return Decision("small", "confidence-gated: small tier first")

    def judge(self, lps: list[float]) -> tuple[bool, str, float | None]:
        """(confident?, reason, mean logprob) for the tokens seen."""
        if not lps:
            return False, "confidence-gated: small tier returned no tokens", None
        mean = sum(lps) / len(lps)
        low = min(lps)
        c = self.cfg
        if mean < c.min_mean_logprob:
            return False, f"confidence-gated: mean logprob {mean:.2f} < {c.min_mean_logprob:g} over {len(lps)} tokens", mean
        if low < c.min_token_logprob:
            return False, f"confidence-gated: min logprob {low:.2f} < {c.min_token_logprob:g} over {len(lps)} tokens", mean
        return True, f"confidence-gated: kept small (mean {mean:.2f}, min {low:.2f} over {len(lps)} tokens)", mean
