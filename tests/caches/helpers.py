"""In-process harness for the cache filter: a fake upstream ``next`` and an endpoint-like driver."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import orjson

from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.pipeline import Call, Reply

MODEL = "m1"


def make_call(content: str | list[dict], *, tenant: str = "t1", stream: bool = False, include_usage: bool = False,
              headers: list[tuple[bytes, bytes]] | None = None, system: str | None = None, **params: Any) -> Call:
    if isinstance(content, str):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    else:
        messages = content
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "temperature": 0, **params}
    if stream:
        body["stream"] = True
        if include_usage:
            body["stream_options"] = {"include_usage": True}
    ctx = RequestContext(id=os.urandom(6).hex(), endpoint="chat", model=MODEL, stream=stream, tenant=tenant,
                         include_usage=include_usage)
    return Call(ctx, "chat", b"/v1/chat/completions", body, orjson.dumps(body), None, headers or [])


class FakeUpstream:
    """Answers like vLLM: ``answer`` for every request (JSON, or vLLM-shaped SSE chunks)."""

    def __init__(self, answer: str = "the answer", status: int = 200, delay_s: float = 0.0):
        self.answer = answer
        self.status = status
        self.delay_s = delay_s  # time to the response (headers for a stream, the whole answer for JSON)
        self.calls = 0
        self.closed = 0  # replies closed (a stream's close is what cancels the upstream request)
        self.first_chunk_delay_s = 0.0  # a stream's time to its first chunk (the prefill)
        self.answered: asyncio.Event | None = None  # when a test sets one: set as the first token leaves

    async def __call__(self, call: Call) -> Reply:
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        usage = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
        if self.status != 200:
            return Reply(self.status, [(b"content-type", b"application/json")], body=b'{"error": {}}')
        if not call.body.get("stream"):
            body = {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": MODEL,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": self.answer},
                                 "logprobs": None, "finish_reason": "stop", "stop_reason": None}], "usage": usage}
            self._answer()
            return Reply(200, [(b"content-type", b"application/json")], body=orjson.dumps(body), usage=usage)
        reply = Reply(200, [(b"content-type", b"text/event-stream")], usage=None)

        async def chunks():
            def ev(choices, **extra):
                return b"data: " + orjson.dumps({"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1,
                                                 "model": MODEL, "choices": choices, **extra}) + b"\n\n"
            if self.first_chunk_delay_s:
                await asyncio.sleep(self.first_chunk_delay_s)
            self._answer()
            yield ev([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            for word in self.answer.split(" "):
                yield ev([{"index": 0, "delta": {"content": word + " "}, "finish_reason": None}])
            yield ev([{"index": 0, "delta": {}, "finish_reason": "stop"}])
            reply.usage = usage
            if call.ctx.include_usage:
                yield ev([], usage=usage)
            yield b"data: [DONE]\n\n"

        reply.chunks = chunks()
        reply.on_close(self._closed)
        return reply

    def _answer(self) -> None:
        if self.answered is not None:
            self.answered.set()

    def _closed(self) -> None:
        self.closed += 1


async def drive(handler, call: Call) -> tuple[Reply, bytes]:
    """What the endpoint does: run the handler, read the whole reply, settle the outcome, close."""
    reply = await handler(call)
    if reply.chunks is not None:
        body = b"".join([c async for c in reply.chunks])
    else:
        body = reply.body or b""
    call.ctx.status_code = reply.status
    call.ctx.outcome = "ok" if reply.status < 400 else "error"
    await reply.aclose()
    return reply, body


def stream_text(body: bytes) -> str:
    out = []
    for ev in body.split(b"\n\n"):
        if ev.startswith(b"data: {"):
            for c in orjson.loads(ev[6:])["choices"]:
                out.append((c.get("delta") or {}).get("content") or "")
    return "".join(out)
