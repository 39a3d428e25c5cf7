"""The request path, top to bottom: intake, the filter chain, sending, the ledger.

::

    Endpoint (raw ASGI, one per OpenAI operation)
      1. identify the tenant (401), read the body (413, 408), parse and validate (400, 422), resolve the
         model's pool (404) -> Call
      2. reply = await handler(call)        handler = chain(filters from config, Forwarder)
      3. send_reply(reply)                   the only code that writes to the client
      4. book usage, close the reply (leases, upstream connection), classify the outcome -> ledger

Written as raw ASGI (no Request/Response objects) because this is the hot path; the overhead
benchmark (benchmarks/overhead.py) measures it. A client that disconnects cancels the request at
once (``run_until_disconnect``): the reply is closed, so the upstream connection drops and vLLM
aborts the sequence. A stream that fails after it began, or that is still running when the
gateway is stopped, ends with an error event the client can see, and its record says so.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Coroutine

from usefulwork.gateway.context import Accountant, RequestContext
from usefulwork.gateway.errors import GatewayError, error_body, model_not_found, send_error, send_json
from usefulwork.gateway.pipeline import DISCONNECT, Call, ClientGone, Handler, Reply, classify
from usefulwork.gateway.sse import DONE_EVENT, ResponsesSSE, SSEFilter, first_token_in
from usefulwork.gateway.tenants import Tenants
from usefulwork.gateway.validation import (max_tokens_of, parse_json, validate_chat, validate_completion,
                                           validate_embeddings, validate_responses)
from usefulwork.upstream.fleet import Fleet
from usefulwork.upstream.http1 import UpstreamError, UpstreamTimeout

log = logging.getLogger("usefulwork.proxy")


class _RequestIds:
    """Random request ids (96 bits, hex), cut from one ``os.urandom`` read per 1024 ids instead of a
    ``getrandom`` syscall per request. A forked child starts a fresh block (``os.register_at_fork``),
    so two worker processes never hand out the same ids."""

    BLOCK = 12 * 1024

    def __init__(self) -> None:
        self._block = b""
        self._at = 0
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self._block, self._at = b"", 0

    def __call__(self) -> str:
        at = self._at
        if at >= len(self._block):
            self._block, at = os.urandom(self.BLOCK), 0
        self._at = at + 12
        return self._block[at:at + 12].hex()


new_request_id = _RequestIds()


@dataclass(frozen=True, slots=True)
class Operation:
    """One OpenAI operation the gateway serves."""

    name: str  # ledger "endpoint": chat | completions | responses | embeddings
    path: str
    validate: Callable[[dict], None]
    prompt_key: str  # where the prompt lives in the body (token estimates when upstream gave no usage)
    streams: bool = True


OPERATIONS = (
    Operation("chat", "/v1/chat/completions", validate_chat, "messages"),
    Operation("completions", "/v1/completions", validate_completion, "prompt"),
    Operation("responses", "/v1/responses", validate_responses, "input"),
    Operation("embeddings", "/v1/embeddings", validate_embeddings, "input", streams=False),
)


class Intake:
    """Everything the endpoints share: limits, tenants, the fleet's model map, the chain, the ledger."""

    def __init__(self, fleet: Fleet, accountant: Accountant, tenants: Tenants, handler: Handler, *,
                 max_body: int, body_timeout_s: float, virtual_models: set[str] | frozenset[str] = frozenset()):
        self.fleet = fleet
        self.accountant = accountant
        self.tenants = tenants
        self.handler = handler
        self.max_body = max_body
        self.body_timeout_s = body_timeout_s
        self.virtual_models = virtual_models

    async def read_body(self, content_length: bytes | None, receive) -> bytes:
        if content_length is not None and content_length.isdigit() and int(content_length) > self.max_body:
            raise GatewayError(413, f"request body is {int(content_length)} bytes; the limit is {self.max_body}",
                               code="request_too_large")
        msg = await receive()  # a small body is already here: no deadline needed for the common case
        if msg["type"] == "http.disconnect":
            raise ClientGone()
        body = msg.get("body", b"")
        if not msg.get("more_body", False):
            if len(body) > self.max_body:
                raise GatewayError(413, f"request body exceeds the limit of {self.max_body} bytes",
                                   code="request_too_large")
            return body
        try:
            async with asyncio.timeout(self.body_timeout_s):
                return await self._read_rest(body, receive)
        except TimeoutError:
            raise GatewayError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                               code="request_timeout") from None

    async def _read_rest(self, first: bytes, receive) -> bytes:
        chunks = [first]
        size = len(first)
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ClientGone()
            body = msg.get("body", b"")
            if body:
                size += len(body)
                if size > self.max_body:
                    raise GatewayError(413, f"request body exceeds the limit of {self.max_body} bytes",
                                       code="request_too_large")
                chunks.append(body)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    def call(self, op: Operation, ctx: RequestContext, raw: bytes, headers: list) -> Call:
        body = parse_json(raw)
        if isinstance(body.get("model"), str):
            ctx.model = body["model"]
        op.validate(body)
        pool = self.fleet.pool_for_model(ctx.model)
        if pool is None and ctx.model not in self.virtual_models or (
                (allowed := self.tenants.models_of(ctx.tenant)) is not None and ctx.model not in allowed):
            raise model_not_found(ctx.model)
        ctx.stream = op.streams and body.get("stream") is True
        ctx.max_tokens = max_tokens_of(body)
        ctx.prompt_payload = body.get(op.prompt_key)
        if ctx.stream:
            so = body.get("stream_options")
            ctx.include_usage = op.name == "responses" or bool(isinstance(so, dict) and so.get("include_usage"))
        ctx.t_validated = time.perf_counter()
        return Call(ctx=ctx, op=op.name, path=op.path.encode(), body=body, raw=raw, pool=pool, headers=headers)


class _Exchange:
    """What one request's endpoint run has done so far (read by its error handling)."""

    __slots__ = ("reply", "started", "gone")

    def __init__(self) -> None:
        self.reply: Reply | None = None
        self.started = False  # http.response.start was sent: no other status can follow
        self.gone = False  # the client disconnected (our own cancel, not a shutdown's)


class Endpoint:
    """The raw ASGI endpoint of one operation."""

    def __init__(self, intake: Intake, op: Operation):
        self.intake = intake
        self.op = op
        self.final_marker = b"event: response.completed" if op.name == "responses" else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["method"] != "POST":
            await send_json(send, 405, error_body(405, f"use POST for {self.op.path}"), [(b"allow", b"POST")])
            return
        intake = self.intake
        headers = scope["headers"]
        auth = length = client_id = None
        for k, v in headers:  # one scan for the three headers intake needs
            if k == b"authorization":
                auth = v
            elif k == b"content-length":
                length = v
            elif k == b"x-request-id":
                client_id = v
        ctx = RequestContext(id=new_request_id(), endpoint=self.op.name, model="", stream=False)
        if client_id:
            ctx.client_request_id = client_id.decode("latin-1")[:128]
        intake.accountant.begin(ctx)
        ex = _Exchange()
        ended: BaseException | None = None
        try:
            ctx.tenant = intake.tenants.identify(auth)
            raw = await intake.read_body(length, receive)
            call = intake.call(self.op, ctx, raw, headers)
            await run_until_disconnect(self._serve(call, send, ex), receive, ctx, ex, scope)
        except GatewayError as err:
            ctx.status_code = err.status
            ctx.error = err.message
            if not ex.started:
                self._answer(ctx)
                await send_error(send, err, [(b"x-request-id", ctx.id.encode())])
        except ClientGone as exc:
            ended = exc
            ctx.status_code = 499
        except UpstreamError as exc:  # a stream failed after it began; send_reply told the client
            ended = exc
        except asyncio.CancelledError as exc:  # the server stopped past its grace (streams: see send_reply)
            ended = exc
            if ctx.error is None:
                ctx.error = "cut: the gateway shut down before the request ended"
            if not ex.started:
                ctx.status_code = 503
                self._answer(ctx)
                try:
                    await send_json(send, 503, error_body(503, "the gateway is shutting down", code="shutting_down"))
                except Exception:
                    pass
            raise
        except Exception as exc:  # never a stack trace to the client; never a crash
            log.exception("internal error on %s", self.op.path)
            ended = exc
            ctx.status_code = 500
            ctx.error = f"internal error: {type(exc).__name__}"
            if not ex.started:
                self._answer(ctx)
                try:
                    await send_json(send, 500, error_body(500, "internal gateway error", code="internal_error"))
                except Exception:
                    pass
        finally:
            if ex.reply is not None:
                book_usage(ctx, ex.reply.usage)
                try:
                    await ex.reply.aclose()
                except Exception:
                    log.exception("closing a reply failed on %s", self.op.path)
            ctx.outcome = classify(ctx.status_code, ended)
            ctx.t_end = time.perf_counter()
            intake.accountant.finish(ctx)

    async def _serve(self, call: Call, send, ex: _Exchange) -> None:
        ex.reply = reply = await self.intake.handler(call)
        await self.send_reply(call.ctx, reply, send, ex)

    async def send_reply(self, ctx: RequestContext, reply: Reply, send, ex: _Exchange) -> None:
        """The only place that writes a response."""
        ctx.status_code = reply.status
        rid = (b"x-request-id", ctx.id.encode())
        if reply.chunks is None:
            body = reply.body or b""
            if ctx.t_first_token is None:
                ctx.t_first_token = time.perf_counter()
            if reply.status >= 400 and ctx.error is None:
                ctx.error = body[:500].decode("utf-8", "replace")
            self._answer(ctx, reply)
            ex.started = True
            await send({"type": "http.response.start", "status": reply.status,
                        "headers": [*reply.headers, (b"content-length", str(len(body)).encode()), rid]})
            await send({"type": "http.response.body", "body": body})
            return
        ex.started = True
        await send({"type": "http.response.start", "status": reply.status, "headers": [*reply.headers, rid]})
        events: list[bytes] = []
        ctx.streamed_events = events
        marker = self.final_marker
        try:
            async for out in reply.chunks:
                if ctx.t_first_token is None and first_token_in(self.op.name, out):
                    ctx.t_first_token = time.perf_counter()
                    if ctx.on_first_token is not None:
                        ctx.on_first_token()
                events.append(out)
                if out.endswith(DONE_EVENT) or (marker is not None and marker in out):
                    self._answer(ctx, reply)  # a client closing after this write got everything
                await send({"type": "http.response.body", "body": out, "more_body": True})
        except UpstreamError as exc:
            timeout = isinstance(exc, UpstreamTimeout)
            ctx.status_code = 504 if timeout else 502
            ctx.error = f"stream failed after it began: {exc}"
            self._answer(ctx)
            await send({"type": "http.response.body", "more_body": False, "body": self._error_event(
                "the model server's stream failed", 504 if timeout else 502,
                "timeout_error" if timeout else "upstream_error")})
            raise
        except asyncio.CancelledError:
            if not ex.gone:  # the server is stopping and its grace ran out: say so before the cut
                ctx.status_code = 503
                ctx.error = "stream cut: the gateway shut down before it ended"
                self._answer(ctx)
                try:
                    await send({"type": "http.response.body", "more_body": False, "body": self._error_event(
                        "the gateway is shutting down; the stream was cut", 503, "service_unavailable")})
                except Exception:
                    pass
            raise
        if reply.usage is not None:
            ctx.streamed_events = None  # usage is known: no need to keep the text for an estimate
        if not ctx.closing:  # no end event came: the stream's end is its last bytes
            self._answer(ctx, reply)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _answer(self, ctx: RequestContext, reply: Reply | None = None) -> None:
        """The response's last bytes go next: the record as it stands now is journaled first, so a client
        holding its whole answer never outruns the record (a gateway killed right after the write, even
        with the OS running the client first, still leaves it: accounting/journal.py). ``finish`` writes
        the row again only if something changes after this."""
        ctx.closing = True  # a disconnect from here on is not a cancel
        if reply is not None:
            book_usage(ctx, reply.usage)
        if ctx.on_answer is not None:  # (a filter's last fields of the record, so the row holds them)
            ctx.on_answer()
        ctx.outcome = classify(ctx.status_code)
        ctx.t_end = time.perf_counter()
        self.intake.accountant.answered(ctx)

    def _error_event(self, message: str, code: int, type_: str) -> bytes:
        flavour = ResponsesSSE if self.op.name == "responses" else SSEFilter
        return flavour.error_event(message, code, type_)


def book_usage(ctx: RequestContext, usage: Any) -> None:
    """Take the upstream's usage into the record; malformed usage is ignored (the ledger estimates)."""
    if not isinstance(usage, dict) or ctx.usage_source != "none":
        return
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    if not all(_count(x) for x in (prompt, completion, cached or 0)):
        log.debug("ignoring malformed upstream usage on %s", ctx.id)
        return
    ctx.prompt_tokens = prompt
    ctx.completion_tokens = completion or 0
    ctx.cached_tokens = cached or 0
    ctx.usage_source = "backend"


def _count(x: Any) -> bool:
    return type(x) is int and x >= 0


async def run_until_disconnect(coro: Coroutine[Any, Any, None], receive, ctx: RequestContext, ex: _Exchange,
                               scope: dict | None = None) -> None:
    """Run the handler in the current task; if the client disconnects first, cancel it.

    Cancelling unwinds the handler; the endpoint then closes the reply, which drops the upstream
    connection, and vLLM aborts the sequence. Once the last body message is being sent
    (``ctx.closing``) a disconnect no longer cancels anything: servers also report
    ``http.disconnect`` once a response is complete.

    The gateway's own HTTP protocol reports the disconnect through a scope extension
    (``DisconnectWatch``): a callback, no task. Under any other ASGI server, one extra task per
    request watches ``receive()``: the body has been read already, so the next ASGI message can only
    be the disconnect.
    """
    watch = (scope.get("extensions") or {}).get(DISCONNECT) if scope is not None else None
    # the protocol names the task it runs this request in (no current_task() lookup per request)
    me = watch.task if watch is not None and watch.task is not None else asyncio.current_task()

    def gone() -> None:
        if not ctx.closing:
            ex.gone = True
            me.cancel()

    if watch is not None:
        if watch.gone:  # left before the handler started: nothing to cancel
            coro.close()
            ex.gone = True
            raise ClientGone()
        watch.callback = gone
        watcher = None
    else:
        async def wait_disconnect() -> None:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                gone()

        watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await coro
    except asyncio.CancelledError:
        if ex.gone:
            me.uncancel()
            raise ClientGone() from None
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
        else:
            watch.callback = None
