"""The simulated server's HTTP API: vLLM's OpenAI-compatible endpoints, /health and /metrics.

Routes: POST /v1/chat/completions, POST /v1/completions, POST /v1/responses (the Responses API,
streamed as typed events), POST /v1/embeddings (a deterministic vector per input, timed as a
prefill), GET /v1/models, GET /health, GET /metrics, GET /version, GET /sim/info (simulator-only:
the resolved spec).

The handlers validate like vLLM (same error JSON shape and status codes), hand the request to the
engine and wait on a per-request sink. Streams coalesce every token that arrived since the last
write into one chunk, as vLLM V1's output collector does when the client side lags: a busy host
sends fewer, larger chunks instead of falling further behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from usefulwork.backends.sim import metrics
from usefulwork.backends.sim.engine import SimEngine
from usefulwork.backends.sim.realtime import RealtimeRunner
from usefulwork.backends.sim.scheduler import SimRequest
from usefulwork.backends.sim.tokens import SimTokenizer, synthetic_logprobs

SIM_VERSION = "0.32.0+usefulwork-sim"  # the vLLM API version this simulator follows
SYSTEM_FINGERPRINT = "vllm-sim-0.32.0"


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def error_response(status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


@dataclass(eq=False)
class StreamSink:
    """Receives tokens from the engine loop; the handler awaits it."""

    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def on_tokens(self, req: SimRequest, token_ids: list[int], finished: bool) -> None:
        self.tokens.extend(token_ids)
        if finished:
            self.finished = True
        self.event.set()

    async def drain(self) -> tuple[list[int], bool]:
        """Wait for new tokens; return them (possibly several) and whether the request ended."""
        while not self.tokens and not self.finished:
            self.event.clear()
            await self.event.wait()
        out, self.tokens = self.tokens, []
        return out, self.finished


@dataclass
class ParsedRequest:
    kind: str  # "chat" | "completion"
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    ignore_eos: bool
    logprobs: int | None  # number of top alternatives (0 = only the sampled token), None = off
    seed: int | None
    priority: int = 0  # vLLM's request priority (lower first; only with --scheduling-policy priority)
    messages: list[dict[str, Any]] | None = None  # responses: the conversation so far (a stored one's included)


class SimServer:
    """State shared by the routes: the engine, its real-time runner and the tokenizer."""

    def __init__(self, engine: SimEngine, tokenizer: SimTokenizer, served_model_name: str, time_scale: float = 1.0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.runner = RealtimeRunner(engine, time_scale)
        self.created = int(time.time())
        self.max_model_len = engine.spec.max_model_len
        self.max_logprobs = engine.spec.flags.max_logprobs
        self.by_priority = engine.spec.flags.scheduling_policy == "priority"
        # The Responses API's store, as vLLM's: off unless VLLM_ENABLE_RESPONSES_API_STORE=1, in this process's
        # memory only (a stored response is known to the one server that made it), never evicted.
        self.store_enabled = bool(int(os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "0") or "0"))
        self.response_store: dict[str, dict[str, Any]] = {}
        self.stored_messages: dict[str, list[dict[str, Any]]] = {}

    def store_response(self, body: dict[str, Any], parsed: ParsedRequest, obj: dict[str, Any], text: str) -> None:
        if self.store_enabled and body.get("store", True) is not False:
            self.response_store[obj["id"]] = obj
            self.stored_messages[obj["id"]] = [*(m for m in parsed.messages or () if m["role"] != "system"),
                                               {"role": "assistant", "content": text}]

    # -- validation (vLLM's rules and messages) --
    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist. Valid aliases: {self.served_model_name}.",
                           "NotFoundError", "model")

    def _max_tokens(self, body: dict[str, Any], prompt_len: int, kind: str) -> int:
        # vLLM: above max_model_len is an error; otherwise clamped to the room the prompt leaves.
        key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
        value = body.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise APIError(400, f"{key} must be an integer. (parameter={key}, value={value})", param=key)
        if value is not None and value > self.max_model_len:
            raise APIError(
                400,
                f"{key}={value} cannot be greater than max_model_len={self.max_model_len}. Please request fewer "
                f"output tokens. (parameter={key}, value={value})",
                param=key,
            )
        room = self.max_model_len - prompt_len
        n = room if value is None else min(value, room)
        if n < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {n}. (parameter=max_tokens, value={n})",
                           param="max_tokens")
        return n

    def _check_prompt_len(self, n: int) -> None:
        if n > self.max_model_len:
            # vLLM tokenizes with truncation at max_model_len + 1, hence "at least".
            shown = min(n, self.max_model_len + 1)
            qualifier = "at least " if shown == self.max_model_len + 1 else ""
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt contains "
                f"{qualifier}{shown} input tokens, which exceeds this limit even without any output tokens. Please "
                f"reduce the length of the input prompt. (parameter=input_tokens, value={shown})",
                param="input_tokens",
            )
        if n == 0:
            raise APIError(400, "The prompt cannot be empty. (parameter=prompt)", param="prompt")

    def _stream_opts(self, body: dict[str, Any]) -> tuple[bool, bool, bool]:
        stream = bool(body.get("stream", False))
        opts = body.get("stream_options") or {}
        if opts and not stream:
            raise APIError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
        return stream, bool(opts.get("include_usage", False)), bool(opts.get("continuous_usage_stats", False))

    def priority(self, body: dict[str, Any]) -> int:
        """vLLM's ``priority`` extra parameter: an integer; non-zero only under the priority policy."""
        p = body.get("priority", 0)
        if p is None:
            return 0
        if not isinstance(p, int) or isinstance(p, bool):
            raise APIError(400, f"priority must be an integer. (parameter=priority, value={p!r})", param="priority")
        if p != 0 and not self.by_priority:
            raise APIError(400, f"Got priority {p} but Priority scheduling is not enabled.", param="priority")
        return p

    def _common(self, body: dict[str, Any]) -> None:
        n = body.get("n", 1)
        if n not in (None, 1):
            raise APIError(400, "The simulator supports n=1 only.", param="n")
        temp = body.get("temperature")
        if temp is not None and (not isinstance(temp, (int, float)) or temp < 0):
            raise APIError(400, "temperature must be non-negative.", param="temperature")

    @staticmethod
    def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise APIError(400, "messages must be a non-empty list of message objects.", param="messages")
        for m in messages:
            if not isinstance(m.get("role"), str):
                raise APIError(400, "every message needs a string `role`.", param="messages")
        return messages

    def tokenize(self, body: dict[str, Any]) -> list[int]:
        """vLLM's ``/tokenize``: the tokens a chat (``messages``) or a completion's string ``prompt`` is
        prefilled with, as the request itself would be."""
        self._check_model(body)
        if "messages" in body:
            return self.tokenizer.encode_chat(self._messages(body),
                                              add_generation_prompt=bool(body.get("add_generation_prompt", True)))
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(400, "prompt must be a string (or give messages).", param="prompt")
        return self.tokenizer.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))

    def parse_chat(self, body: dict[str, Any]) -> ParsedRequest:
        self._check_model(body)
        self._common(body)
        messages = self._messages(body)
        top = body.get("top_logprobs")
        want_lp = bool(body.get("logprobs", False))
        if top is not None:
            if not isinstance(top, int) or isinstance(top, bool) or top < 0:
                raise APIError(400, "`top_logprobs` must be a positive value.", param="top_logprobs")
            if top > 0 and not want_lp:
                raise APIError(400, "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)",
                               param="top_logprobs")
            if top > self.max_logprobs:
                raise APIError(
                    400, f"Requested sample logprobs of {top}, which is greater than max allowed: "
                    f"{self.max_logprobs} (parameter=logprobs, value={top})", param="logprobs",
                )
        ids = self.tokenizer.encode_chat(messages, add_generation_prompt=bool(body.get("add_generation_prompt", True)))
        self._check_prompt_len(len(ids))
        stream, include_usage, continuous = self._stream_opts(body)
        return ParsedRequest(
            kind="chat", prompt_ids=ids, max_tokens=self._max_tokens(body, len(ids), "chat"), stream=stream,
            include_usage=include_usage, continuous_usage=continuous, ignore_eos=bool(body.get("ignore_eos", False)),
            logprobs=(top or 0) if want_lp else None, seed=_int_or_none(body.get("seed")), priority=self.priority(body),
        )

    def parse_completion(self, body: dict[str, Any]) -> ParsedRequest:
        self._check_model(body)
        self._common(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise APIError(400, "The simulator supports one prompt per request.", param="prompt")
        else:
            raise APIError(400, "prompt must be a string or a list of token ids.", param="prompt")
        lp = body.get("logprobs")
        if lp is not None:
            if not isinstance(lp, int) or isinstance(lp, bool) or lp < 0:
                raise APIError(400, "`logprobs` must be a positive value.", param="logprobs")
            if lp > self.max_logprobs:
                raise APIError(
                    400, f"Requested sample logprobs of {lp}, which is greater than max allowed: "
                    f"{self.max_logprobs} (parameter=logprobs, value={lp})", param="logprobs",
                )
        self._check_prompt_len(len(ids))
        stream, include_usage, continuous = self._stream_opts(body)
        return ParsedRequest(
            kind="completion", prompt_ids=ids, max_tokens=self._max_tokens(body, len(ids), "completion"),
            stream=stream, include_usage=include_usage, continuous_usage=continuous,
            ignore_eos=bool(body.get("ignore_eos", False)), logprobs=lp, seed=_int_or_none(body.get("seed")),
            priority=self.priority(body),
        )

    def parse_responses(self, body: dict[str, Any]) -> ParsedRequest:
        """``/v1/responses``: ``input`` (a string or message items) and ``instructions`` -> a chat prompt."""
        self._check_model(body)
        self._common(body)
        inp = body.get("input")
        if isinstance(inp, str):
            messages = [{"role": "user", "content": inp}]
        elif isinstance(inp, list) and inp and all(isinstance(m, dict) for m in inp):
            messages = [{"role": m.get("role", "user"), "content": _item_text(m.get("content"))} for m in inp]
        else:
            raise APIError(400, "input must be a string or a non-empty list of input items.", param="input")
        prev = body.get("previous_response_id")
        if prev is not None:  # as vLLM: the stored conversation (its instructions not carried over), then the input
            if prev not in self.stored_messages:
                raise APIError(404, f"Response with id '{prev}' not found.", "invalid_request_error", "response_id")
            messages = [*self.stored_messages[prev], *messages]
        if isinstance(body.get("instructions"), str):
            messages.insert(0, {"role": "system", "content": body["instructions"]})
        ids = self.tokenizer.encode_chat(messages)
        self._check_prompt_len(len(ids))
        limit = body.get("max_output_tokens")
        return ParsedRequest(kind="responses", prompt_ids=ids,
                             max_tokens=self._max_tokens({"max_tokens": limit}, len(ids), "responses"),
                             stream=bool(body.get("stream", False)), include_usage=True, continuous_usage=False,
                             ignore_eos=bool(body.get("ignore_eos", False)), logprobs=None,
                             seed=_int_or_none(body.get("seed")), messages=messages)

    def responses_usage(self, req: SimRequest) -> dict[str, Any]:
        p, c = req.num_prompt_tokens, req.num_output_tokens
        return {"input_tokens": p, "input_tokens_details": {"cached_tokens": max(0, req.num_cached_tokens)},
                "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}

    # -- responses --
    def usage(self, req: SimRequest) -> dict[str, Any]:
        p, c = req.num_prompt_tokens, req.num_output_tokens
        return {
            "prompt_tokens": p,
            "total_tokens": p + c,
            "completion_tokens": c,
            "prompt_tokens_details": {"cached_tokens": max(0, req.num_cached_tokens), "created_cache_tokens": 0,
                                      "multimodal_tokens": None},
            "completion_tokens_details": None,
        }

    def chat_logprobs(self, req: SimRequest, start: int, token_ids: list[int], k: int) -> dict[str, Any]:
        content = []
        for i, tid in enumerate(token_ids, start):
            lp, top = synthetic_logprobs(req.rng_seed, i, tid, self.tokenizer.vocab_ids, max(k, 1))
            piece = self.tokenizer.piece(tid).text
            content.append({
                "token": piece,
                "logprob": lp,
                "bytes": list(piece.encode()),
                "top_logprobs": [
                    {"token": (t := self.tokenizer.piece(a).text), "logprob": v, "bytes": list(t.encode())}
                    for a, v in top[:k]
                ],
            })
        return {"content": content}

    def completion_logprobs(self, req: SimRequest, start: int, token_ids: list[int], k: int, offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for i, tid in enumerate(token_ids, start):
            lp, top = synthetic_logprobs(req.rng_seed, i, tid, self.tokenizer.vocab_ids, max(k, 1))
            piece = self.tokenizer.piece(tid).text
            tokens.append(piece)
            token_lps.append(lp)
            offsets.append(offset)
            offset += len(piece)
            tops.append({self.tokenizer.piece(a).text: v for a, v in top[: max(k, 1)]} if k >= 0 else None)
        return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}

    def text(self, token_ids: list[int]) -> str:
        piece = self.tokenizer.piece
        return "".join(piece(t).text for t in token_ids)


def _item_text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))  # as vLLM joins text parts
    return content if isinstance(content, str) else ""


def embedding_of(token_ids: list[int], dim: int = 384) -> list[float]:
    """A deterministic unit vector per token sequence (same input, same vector; no model behind it)."""
    import numpy as np  # noqa: PLC0415

    seed = int.from_bytes(orjson.dumps(token_ids)[-8:].ljust(8, b"\0"), "little") ^ len(token_ids)
    v = np.random.default_rng(seed).standard_normal(dim)
    return (v / np.linalg.norm(v)).round(6).tolist()


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"Invalid JSON body: {exc}", param=None) from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    return data


def build_app(server: SimServer) -> Starlette:
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await _generate(request, "completion")

    async def _generate(request: Request, kind: str) -> Response:
        try:
            body = await _body(request)
            parsed = server.parse_chat(body) if kind == "chat" else server.parse_completion(body)
        except APIError as e:
            return error_response(e.status, e.message, e.type, e.param)
        sink = StreamSink()
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        rid = prefix + uuid.uuid4().hex
        req = server.runner.submit(
            parsed.prompt_ids, parsed.max_tokens, ignore_eos=parsed.ignore_eos, seed=parsed.seed, sink=sink,
            request_id=rid, priority=parsed.priority,
        )
        created = int(time.time())
        if parsed.stream:
            gen = _stream_chat(req, sink, parsed, rid, created) if kind == "chat" else _stream_completion(
                req, sink, parsed, rid, created)
            return StreamingResponse(gen, media_type="text/event-stream")
        tokens = await _collect(request, req, sink)
        if tokens is None:  # the client went away: vLLM aborts the request too
            return Response(status_code=499)
        text = server.text(tokens)
        if kind == "chat":
            lp = server.chat_logprobs(req, 0, tokens, parsed.logprobs) if parsed.logprobs is not None else None
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                            "audio": None, "function_call": None, "reasoning": None},
                "logprobs": lp, "finish_reason": req.finish_reason, "stop_reason": None, "token_ids": None,
                "routed_experts": None,
            }
            obj = "chat.completion"
        else:
            lp = (server.completion_logprobs(req, 0, tokens, parsed.logprobs, 0)
                  if parsed.logprobs is not None else None)
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": req.finish_reason,
                      "stop_reason": None, "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                      "routed_experts": None}
            obj = "text_completion"
        return _json({
            "id": rid, "object": obj, "created": created, "model": server.served_model_name,
            "choices": [choice], "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": server.usage(req), "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        })

    async def _collect(request: Request, req: SimRequest, sink: StreamSink) -> list[int] | None:
        """All tokens of a non-streamed request, or None if the client disconnected first."""

        async def tokens() -> list[int]:
            out: list[int] = []
            while True:
                new, done = await sink.drain()
                out.extend(new)
                if done:
                    return out

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(tokens())
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if work.done():
            return work.result()
        work.cancel()
        server.runner.abort(req)
        return None

    def _sse(obj: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    async def _stream(req: SimRequest, sink: StreamSink, p: ParsedRequest, base: dict[str, Any],
                      choice_for: Callable[[list[int], int, bool], dict[str, Any]],
                      first: dict[str, Any] | None = None) -> AsyncIterator[bytes]:
        """The token loop both endpoints share; ``choice_for(new, sent, done)`` shapes one chunk's choice."""
        sent = 0
        try:
            while True:
                new, done = await sink.drain()
                if first is not None:  # as vLLM: the role chunk comes with the first output, after the prefill
                    yield _sse(first)
                    first = None
                if new:
                    choice = choice_for(new, sent, done)
                    sent += len(new)
                    chunk = {**base, "choices": [choice]}
                    if p.continuous_usage:
                        chunk["usage"] = _partial_usage(req, sent)
                    yield _sse(chunk)
                if done:
                    break
            if p.include_usage:
                yield _sse({**base, "choices": [], "usage": server.usage(req), "system_fingerprint": SYSTEM_FINGERPRINT})
            yield b"data: [DONE]\n\n"
        finally:
            if not sink.finished:
                server.runner.abort(req)  # client went away: free the simulated KV cache

    def _stream_chat(req: SimRequest, sink: StreamSink, p: ParsedRequest, rid: str, created: int) -> AsyncIterator[bytes]:
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": server.served_model_name}
        first = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]}
        if p.continuous_usage:
            first["usage"] = {"prompt_tokens": req.num_prompt_tokens, "total_tokens": req.num_prompt_tokens,
                              "completion_tokens": 0}
        first["prompt_token_ids"] = None
        first["prompt_text"] = None

        def choice_for(new: list[int], sent: int, done: bool) -> dict[str, Any]:
            choice: dict[str, Any] = {
                "index": 0, "delta": {"content": server.text(new)},
                "logprobs": server.chat_logprobs(req, sent, new, p.logprobs) if p.logprobs is not None else None,
                "finish_reason": req.finish_reason if done else None,
            }
            if done:
                choice["stop_reason"] = None
            choice["token_ids"] = None
            return choice

        return _stream(req, sink, p, base, choice_for, first)

    def _stream_completion(req: SimRequest, sink: StreamSink, p: ParsedRequest, rid: str, created: int) -> AsyncIterator[bytes]:
        base = {"id": rid, "object": "text_completion", "created": created, "model": server.served_model_name}
        offset = 0  # characters already sent: completions logprobs carry text offsets

        def choice_for(new: list[int], sent: int, done: bool) -> dict[str, Any]:
            nonlocal offset
            text = server.text(new)
            lp = server.completion_logprobs(req, sent, new, p.logprobs, offset) if p.logprobs is not None else None
            offset += len(text)
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": req.finish_reason if done else None,
                    "stop_reason": None, "prompt_token_ids": None, "token_ids": None}

        return _stream(req, sink, p, base, choice_for)

    def _partial_usage(req: SimRequest, sent: int) -> dict[str, int]:
        return {"prompt_tokens": req.num_prompt_tokens, "total_tokens": req.num_prompt_tokens + sent,
                "completion_tokens": sent}

    async def responses(request: Request) -> Response:
        try:
            body = await _body(request)
            parsed = server.parse_responses(body)
        except APIError as e:
            return error_response(e.status, e.message, e.type, e.param)
        sink = StreamSink()
        rid = "resp_" + uuid.uuid4().hex
        req = server.runner.submit(parsed.prompt_ids, parsed.max_tokens, ignore_eos=parsed.ignore_eos, seed=parsed.seed,
                                   sink=sink, request_id=rid)
        created = int(time.time())
        msg_id = "msg_" + uuid.uuid4().hex

        def response_obj(status: str, text: str | None, usage: dict[str, Any] | None) -> dict[str, Any]:
            output = [] if text is None else [{"id": msg_id, "type": "message", "role": "assistant", "status": "completed",
                                               "content": [{"type": "output_text", "text": text, "annotations": []}]}]
            return {"id": rid, "object": "response", "created_at": created, "model": server.served_model_name,
                    "status": status, "output": output, "usage": usage, "error": None,
                    "incomplete_details": {"reason": "max_output_tokens"} if req.finish_reason == "length" and text is not None
                    else None, "parallel_tool_calls": True, "tool_choice": "none", "tools": []}

        def event(seq: int, obj: dict[str, Any]) -> bytes:
            obj["sequence_number"] = seq
            return b"event: " + obj["type"].encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"

        async def stream() -> AsyncIterator[bytes]:
            seq = 0
            text = ""
            try:
                # as vLLM: created and in_progress at once, the message's item and part with the first output
                opening = ({"type": "response.output_item.added", "output_index": 0,
                            "item": {"id": msg_id, "type": "message", "role": "assistant", "status": "in_progress",
                                     "content": []}},
                           {"type": "response.content_part.added", "item_id": msg_id, "output_index": 0,
                            "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
                for obj in ({"type": "response.created", "response": response_obj("in_progress", None, None)},
                            {"type": "response.in_progress", "response": response_obj("in_progress", None, None)}):
                    yield event(seq, obj)
                    seq += 1
                while True:
                    new, done = await sink.drain()
                    for obj in opening:
                        yield event(seq, obj)
                        seq += 1
                    opening = ()
                    if new:
                        delta = server.text(new)
                        text += delta
                        yield event(seq, {"type": "response.output_text.delta", "item_id": msg_id, "output_index": 0,
                                          "content_index": 0, "delta": delta, "logprobs": []})
                        seq += 1
                    if done:
                        break
                final = response_obj("completed", text, server.responses_usage(req))
                server.store_response(body, parsed, final, text)
                for obj in ({"type": "response.output_text.done", "item_id": msg_id, "output_index": 0,
                             "content_index": 0, "text": text, "logprobs": []},
                            {"type": "response.output_item.done", "output_index": 0, "item": final["output"][0]},
                            {"type": "response.completed", "response": final}):
                    yield event(seq, obj)
                    seq += 1
            finally:
                if not sink.finished:
                    server.runner.abort(req)

        if parsed.stream:
            return StreamingResponse(stream(), media_type="text/event-stream")
        tokens = await _collect(request, req, sink)
        if tokens is None:
            return Response(status_code=499)
        text = server.text(tokens)
        final = response_obj("completed", text, server.responses_usage(req))
        server.store_response(body, parsed, final, text)
        return _json(final)

    async def retrieve_response(request: Request) -> Response:
        rid = request.path_params["response_id"]
        obj = server.response_store.get(rid)
        if obj is None:
            return error_response(404, f"Response with id '{rid}' not found.", "invalid_request_error", "response_id")
        return _json(obj)

    async def embeddings(request: Request) -> Response:
        try:
            body = await _body(request)
            server._check_model(body)
            inp = body.get("input")
            items = [inp] if isinstance(inp, str) or (isinstance(inp, list) and inp and isinstance(inp[0], int)) else inp
            if not isinstance(items, list) or not items:
                raise APIError(400, "input must be a string, a list of strings, or token id lists.", param="input")
            ids = [server.tokenizer.encode(x, add_special_tokens=True) if isinstance(x, str) else list(x) for x in items]
            for one in ids:
                server._check_prompt_len(len(one))
        except APIError as e:
            return error_response(e.status, e.message, e.type, e.param)
        # Timed as the prefill it is: one token generated per input, then discarded.
        for one in ids:
            sink = StreamSink()
            req = server.runner.submit(one, 1, ignore_eos=True, seed=None, sink=sink,
                                       request_id="embd-" + uuid.uuid4().hex)
            if await _collect(request, req, sink) is None:
                return Response(status_code=499)
        n = sum(len(one) for one in ids)
        return _json({"object": "list", "model": server.served_model_name,
                      "data": [{"object": "embedding", "index": i, "embedding": embedding_of(one)}
                               for i, one in enumerate(ids)],
                      "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def tokenize(request: Request) -> Response:
        try:
            ids = server.tokenize(await _body(request))
        except APIError as e:
            return error_response(e.status, e.message, e.type, e.param)
        return _json({"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": None})

    async def models(request: Request) -> Response:
        return _json({"object": "list", "data": [{
            "id": server.served_model_name, "object": "model", "created": server.created, "owned_by": "vllm",
            "root": server.engine.spec.model.name, "parent": None, "max_model_len": server.max_model_len,
            "permission": [{
                "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": server.created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False,
            }],
        }]})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.render(server.engine, server.served_model_name),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def version(request: Request) -> Response:
        return _json({"version": SIM_VERSION})

    async def sim_info(request: Request) -> Response:
        info = server.engine.spec.describe()
        info.update(time_scale=server.runner.time_scale, seed=server.engine.seed, sim_now=server.runner.sim_now(),
                    lag_s=server.runner.lag_s, tokenizer_exact=server.tokenizer.exact,
                    served_model_name=server.served_model_name)
        return _json(info)

    async def not_found(request: Request, exc: Exception) -> Response:
        return error_response(404, "Not Found", "NotFoundError")

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        return error_response(405, "Method Not Allowed", "MethodNotAllowed")

    async def server_error(request: Request, exc: Exception) -> Response:
        return error_response(500, "Internal server error", "InternalServerError")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        server.runner.start()
        try:
            yield
        finally:
            await server.runner.stop()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_route, methods=["GET"]),
            Route("/version", version, methods=["GET"]),
            Route("/sim/info", sim_info, methods=["GET"]),
        ],
        exception_handlers={404: not_found, 405: method_not_allowed, 500: server_error},
        lifespan=lifespan,
    )
    app.state.sim = server  # tests and tools reach the engine through here
    return app
