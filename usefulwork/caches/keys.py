"""When a request's answer may be reused, and the keys it is filed under.

- ``uncacheable(body, op, cfg)``: why a request must not be served from (or stored in) the cache,
  or None. Reuse is sound only for a deterministic answer: temperature at most
  ``cache.max_temperature`` (absent counts as 1.0, vLLM's default) unless the request fixes a
  ``seed`` (the seed is part of the key), one choice, no tools unless configured, no logprobs.
- ``Keys``: the **partition** (tenant + endpoint + model + system prompt + every output-changing
  parameter) and the **exact key** (partition + the messages or prompt). Parameters that only shape
  the transport (``stream``, ``stream_options``, ``user``, ...) are left out, so a streamed answer
  can serve a non-streamed request and the other way round. The tenant is inside both hashes: no
  lookup can cross tenants, whatever the text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

from usefulwork.caches.config import CacheCfg

# Body fields that do not change the generated text (transport, bookkeeping, scheduling).
TRANSPORT_FIELDS = frozenset({"stream", "stream_options", "user", "metadata", "store", "service_tier",
                              "request_id", "priority", "parallel_tool_calls"})
CONVERSATION_FIELDS = ("messages", "prompt")
CACHEABLE_OPS = frozenset({"chat", "completions"})
SYSTEM_ROLES = frozenset({"system", "developer"})


def uncacheable(body: dict[str, Any], op: str, cfg: CacheCfg) -> str | None:
    """The reason this request's answer cannot be reused, or None when it can."""
    if op not in CACHEABLE_OPS:
        return "endpoint"
    n = body.get("n")
    if n not in (None, 1):
        return "n"
    if body.get("best_of") not in (None, 1):
        return "best_of"
    if (body.get("tools") or body.get("functions")) and not cfg.cache_tools:
        return "tools"
    if body.get("logprobs") or body.get("top_logprobs") or body.get("prompt_logprobs"):
        return "logprobs"
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0
    if temperature > cfg.max_temperature and body.get("seed") is None:
        return "temperature"
    prompt = body.get("prompt")
    if isinstance(prompt, list) and (len(prompt) != 1 or not isinstance(prompt[0], str)):
        return "prompt_batch"
    return None


def _digest(obj: Any) -> str:
    return hashlib.blake2b(orjson.dumps(obj, option=orjson.OPT_SORT_KEYS), digest_size=16).hexdigest()


def system_prompt(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return ""
    return "\n".join(str(m.get("content", "")) for m in messages
                     if isinstance(m, dict) and m.get("role") in SYSTEM_ROLES)


@dataclass(frozen=True, slots=True)
class Keys:
    tenant: str
    model: str
    partition: str  # hex digest: tenant + op + model + system prompt + output-changing parameters
    exact: str  # hex digest: partition + conversation

    @classmethod
    def of(cls, tenant: str, op: str, body: dict[str, Any]) -> Keys:
        model = str(body.get("model", ""))
        params = {k: v for k, v in body.items() if k not in TRANSPORT_FIELDS and k not in CONVERSATION_FIELDS}
        partition = _digest([tenant, op, params, system_prompt(body)])
        conversation = body.get("messages") if "messages" in body else body.get("prompt")
        if isinstance(conversation, list) and len(conversation) == 1 and isinstance(conversation[0], str):
            conversation = conversation[0]  # prompt ["x"] and "x" are the same request
        return cls(tenant, model, partition, _digest([partition, conversation]))
