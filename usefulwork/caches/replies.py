"""Cached answers in and out: what a miss's reply leaves to store, and a hit's reply as a miss would look.

One stored form serves both transports: the choice (chat: ``message`` + ``finish_reason``;
completions: ``text`` + ``finish_reason``) and the usage. A hit is rendered as vLLM renders an
answer: a JSON body, or SSE chunks in vLLM's chunk shape (a role chunk, the content, a closing
chunk with ``finish_reason``, the usage chunk when ``stream_options.include_usage`` asked, then
``[DONE]``). Parsing a miss happens after its reply closed, off the request path.
"""

from __future__ import annotations

import os
import time
from typing import Any, AsyncIterator

import orjson

from usefulwork.gateway.pipeline import Reply

SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
JSON_HEADERS = [(b"content-type", b"application/json")]
_DONE = b"data: [DONE]\n\n"


# -- miss -> stored answer --
def answer_from_json(op: str, body: bytes) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """(choice, usage) of a complete JSON answer, or None when it is not one answer to keep."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    c = choices[0]
    if op == "chat":
        message = c.get("message")
        if not isinstance(message, dict):
            return None
        choice = {"message": message, "finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason")}
    else:
        if not isinstance(c.get("text"), str):
            return None
        choice = {"text": c["text"], "finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason")}
    return choice, obj.get("usage")


def answer_from_events(op: str, events: list[bytes], usage: dict[str, Any] | None
                       ) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """(choice, usage) from a streamed answer's SSE bytes; None when it did not end well."""
    parts: list[str] = []
    finish = stop = None
    done = False
    for event in b"".join(events).split(b"\n\n"):
        if not event.startswith(b"data: "):
            continue
        data = event[6:]
        if data == b"[DONE]":
            done = True
            continue
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        if "error" in obj:
            return None
        if usage is None and isinstance(obj.get("usage"), dict):
            usage = obj["usage"]
        for c in obj.get("choices") or ():
            if c.get("index", 0) != 0:
                return None
            if op == "chat":
                delta = c.get("delta") or {}
                if delta.get("tool_calls"):
                    return None  # tool calls are kept only from JSON answers
                parts.append(delta.get("content") or "")
            else:
                parts.append(c.get("text") or "")
            if c.get("finish_reason") is not None:
                finish, stop = c["finish_reason"], c.get("stop_reason")
    if not done or finish is None:
        return None
    text = "".join(parts)
    if op == "chat":
        return {"message": {"role": "assistant", "content": text}, "finish_reason": finish, "stop_reason": stop}, usage
    return {"text": text, "finish_reason": finish, "stop_reason": stop}, usage


# -- stored answer -> hit reply --
def _ids(op: str) -> tuple[str, str, str]:
    rid = os.urandom(12).hex()
    if op == "chat":
        return f"chatcmpl-{rid}", "chat.completion", "chat.completion.chunk"
    return f"cmpl-{rid}", "text_completion", "text_completion"


def hit_reply(op: str, model: str, choice: dict[str, Any], usage: dict[str, Any] | None, *, stream: bool,
              include_usage: bool, headers: list[tuple[bytes, bytes]]) -> Reply:
    rid, obj_json, obj_chunk = _ids(op)
    created = int(time.time())
    if not stream:
        c = {"index": 0, **choice, "logprobs": None}
        body = {"id": rid, "object": obj_json, "created": created, "model": model, "choices": [c], "usage": usage}
        return Reply(200, [*JSON_HEADERS, *headers], body=orjson.dumps(body))
    return Reply(200, [*SSE_HEADERS, *headers],
                 chunks=_stream(op, rid, obj_chunk, created, model, choice, usage if include_usage else None))


async def _stream(op: str, rid: str, obj: str, created: int, model: str, choice: dict[str, Any],
                  usage: dict[str, Any] | None) -> AsyncIterator[bytes]:
    def event(choices: list, **extra: Any) -> bytes:
        return b"data: " + orjson.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                         "choices": choices, **extra}) + b"\n\n"

    end = {"finish_reason": choice.get("finish_reason"), "stop_reason": choice.get("stop_reason")}
    if op == "chat":
        message = choice.get("message") or {}
        out = event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
        delta: dict[str, Any] = {"content": message.get("content") or ""}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **tc} for i, tc in enumerate(message["tool_calls"])]
        out += event([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])
        out += event([{"index": 0, "delta": {}, "logprobs": None, **end}])
    else:
        out = event([{"index": 0, "text": choice.get("text") or "", "logprobs": None, "finish_reason": None,
                      "stop_reason": None}])
        out += event([{"index": 0, "text": "", "logprobs": None, **end}])
    if usage is not None:
        out += event([], usage=usage)
    yield out + _DONE
