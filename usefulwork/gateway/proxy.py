"""The request path: parse, validate, pick a replica, forward, stream back, account.

Written as raw ASGI (no Request/Response objects) because this is the hot path; the overhead
benchmark (benchmarks/overhead.py) measures it.

Failure rules:
- a replica that fails before any byte reached the client (connect error, 502/503/504) is marked
  down and the request is retried on the next candidate;
- a failure after streaming began ends the stream with an SSE error event and ``[DONE]``;
- a client that disconnects cancels the upstream request at once (the upstream connection is
  closed, so vLLM aborts the sequence and frees its KV blocks).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Awaitable, Callable

import orjson

from usefulwork.upstream.fleet import Fleet, Replica
from usefulwork.upstream.http1 import ConnectFailed, Response, UpstreamClosed, UpstreamError, UpstreamTimeout
from usefulwork.config import Config
from usefulwork.gateway.context import Accountant, RequestContext
from usefulwork.gateway.errors import GatewayError, error_body, send_error, send_json
from usefulwork.gateway.sse import SSEFilter, error_event
from usefulwork.gateway.validation import parse_json, validate_chat, validate_completion

log = logging.getLogger("usefulwork.proxy")

RETRY_STATUSES = frozenset({502, 503, 504})
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class ClientGone(Exception):
    """The client disconnected; the request is abandoned."""


def _header(scope: dict, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


def _new_id() -> str:
    return os.urandom(12).hex()


class Proxy:
    """One instance per app; ``chat`` and ``completions`` are its two ASGI endpoints."""

    def __init__(self, cfg: Config, fleet: Fleet, accountant: Accountant):
        self.cfg = cfg
        self.fleet = fleet
        self.accountant = accountant
        self.max_body = cfg.limits.max_body_bytes
        self.tenants = dict(cfg.auth.api_keys)
        self.chat = _Endpoint(self, "chat", "/v1/chat/completions", validate_chat)
        self.completions = _Endpoint(self, "completions", "/v1/completions", validate_completion)

    # -- request intake --
    async def read_body(self, scope: dict, receive) -> bytes:
        cl = _header(scope, b"content-length")
        if cl is not None and cl.isdigit() and int(cl) > self.max_body:
            raise GatewayError(413, f"request body is {int(cl)} bytes; the limit is {self.max_body}",
                               code="request_too_large")
        chunks = []
        size = 0
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
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def tenant_of(self, scope: dict) -> str:
        if not self.tenants:
            return "default"
        auth = _header(scope, b"authorization") or b""
        key = auth[7:].decode("latin-1").strip() if auth[:7].lower() == b"bearer " else ""
        tenant = self.tenants.get(key)
        if tenant is None:
            raise GatewayError(401, "invalid or missing API key", code="invalid_api_key")
        return tenant

    @staticmethod
    def upstream_headers(ctx: RequestContext, pool_key: str | None) -> bytes:
        h = b"content-type: application/json\r\nx-request-id: " + ctx.id.encode("latin-1") + b"\r\n"
        if pool_key:
            h += b"authorization: Bearer " + pool_key.encode("latin-1") + b"\r\n"
        return h

    # -- forwarding --
    async def open_upstream(self, ctx: RequestContext, path: bytes, body: bytes) -> tuple[Replica, Response]:
        """Send to the best replica, retrying on another one while nothing reached the client.

        The returned replica has ``inflight`` incremented: the caller must call ``done``.
        """
        pool = self.fleet.pool_for_model(ctx.model)
        assert pool is not None
        ctx.pool = pool.name
        candidates = sorted(self.fleet.candidates(pool), key=lambda r: r.load)
        if not candidates:
            raise GatewayError(503, f"no replica available for model {ctx.model!r}", code="no_replica",
                               headers=[(b"retry-after", b"5")])
        headers = self.upstream_headers(ctx, pool.cfg.api_key)
        last_error = "no replica tried"
        for replica in candidates:
            ctx.attempts += 1
            ctx.replica = replica.url
            replica.inflight += 1
            try:
                resp = await replica.http.request(b"POST", path, body, headers)
            except (ConnectFailed, UpstreamClosed) as exc:
                replica.inflight -= 1
                last_error = f"{replica.url}: {exc}"
                self.fleet.mark_down(replica, f"request failed: {type(exc).__name__}")
                continue
            except UpstreamTimeout:
                replica.inflight -= 1
                raise GatewayError(504, f"upstream {replica.url} timed out before answering",
                                   code="upstream_timeout") from None
            except BaseException:
                replica.inflight -= 1
                raise
            if resp.status in RETRY_STATUSES:
                replica.inflight -= 1
                resp.close()
                last_error = f"{replica.url}: HTTP {resp.status}"
                self.fleet.mark_down(replica, f"answered {resp.status}")
                continue
            return replica, resp
        raise GatewayError(502, f"no replica could serve the request ({last_error})", code="upstream_unavailable",
                           headers=[(b"retry-after", b"1")])

    @staticmethod
    def done(replica: Replica, resp: Response) -> None:
        replica.inflight -= 1
        resp.close()  # back to the pool if complete; aborted (upstream cancels) if not

    def take_usage(self, ctx: RequestContext, usage: dict[str, Any] | None) -> None:
        if not usage:
            return
        ctx.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        ctx.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        ctx.cached_tokens = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
        ctx.usage_source = "backend"

    async def forward_unary(self, ctx: RequestContext, path: bytes, raw: bytes, send) -> None:
        replica, resp = await self.open_upstream(ctx, path, raw)
        try:
            data = await resp.read()
        except UpstreamTimeout:
            raise GatewayError(504, "upstream timed out", code="upstream_timeout") from None
        except UpstreamError as exc:
            self.fleet.mark_down(replica, f"read failed: {type(exc).__name__}")
            raise GatewayError(502, f"upstream failed while answering: {exc}", code="upstream_error") from None
        finally:
            self.done(replica, resp)
        ctx.t_first_token = time.perf_counter()
        ctx.status_code = resp.status
        if resp.status == 200:
            try:
                self.take_usage(ctx, orjson.loads(data).get("usage"))
            except (orjson.JSONDecodeError, AttributeError):
                pass
        else:
            ctx.outcome = "rejected" if resp.status < 500 else "error"
            ctx.error = data[:500].decode("utf-8", "replace")
        ctx.closing = True
        await send({"type": "http.response.start", "status": resp.status, "headers": [
            (b"content-type", resp.header(b"content-type") or b"application/json"),
            (b"content-length", str(len(data)).encode()), (b"x-request-id", ctx.id.encode())]})
        await send({"type": "http.response.body", "body": data})

    async def forward_stream(self, ctx: RequestContext, path: bytes, body: dict[str, Any], send) -> None:
        # Always ask upstream for usage so it is never lost; strip it later if the client did not ask.
        so = body.get("stream_options")
        if not (isinstance(so, dict) and so.get("include_usage")):
            body["stream_options"] = {**(so or {}), "include_usage": True}
        replica, resp = await self.open_upstream(ctx, path, orjson.dumps(body))
        try:
            if resp.status != 200:
                try:
                    data = await resp.read()
                except UpstreamError as exc:
                    raise GatewayError(502, f"upstream failed while answering: {exc}", code="upstream_error") from None
                ctx.status_code = resp.status
                ctx.outcome = "rejected" if resp.status < 500 else "error"
                ctx.error = data[:500].decode("utf-8", "replace")
                ctx.closing = True
                await send_json(send, resp.status, data, [(b"x-request-id", ctx.id.encode())])
                return
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*_SSE_HEADERS, (b"x-request-id", ctx.id.encode())]})
            filt = SSEFilter(keep_usage=ctx.include_usage)
            events: list[bytes] = []
            ctx.streamed_events = events
            try:
                while (chunk := await resp.read_chunk()) is not None:
                    out = filt.feed(chunk)
                    if out:
                        if ctx.t_first_token is None:
                            ctx.t_first_token = time.perf_counter()
                        events.append(out)
                        if filt.done:  # [DONE] is in this write: a client closing after it got everything
                            ctx.closing = True
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                tail = filt.flush()
                if tail:
                    await send({"type": "http.response.body", "body": tail, "more_body": True})
                if not filt.done:
                    raise UpstreamClosed("upstream closed the stream before [DONE]")
            except UpstreamError as exc:
                timeout = isinstance(exc, UpstreamTimeout)
                ctx.outcome = "timeout" if timeout else "error"
                ctx.status_code = 504 if timeout else 502
                ctx.error = f"stream failed after it began: {exc}"
                if not timeout:
                    self.fleet.mark_down(replica, f"stream failed: {type(exc).__name__}")
                ctx.closing = True
                await send({"type": "http.response.body", "more_body": False,
                            "body": error_event(f"upstream stream failed: {exc}", 504 if timeout else 502,
                                                "timeout_error" if timeout else "upstream_error")})
                return
            ctx.chunks = filt.events
            self.take_usage(ctx, filt.usage)
            if ctx.usage_source == "backend":
                ctx.streamed_events = None  # usage is known: no need to keep the text
            ctx.closing = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.done(replica, resp)


class _Endpoint:
    """A raw ASGI endpoint for one OpenAI operation."""

    def __init__(self, proxy: Proxy, name: str, path: str, validate: Callable[[dict], None]):
        self.proxy = proxy
        self.name = name
        self.path = path
        self.path_b = path.encode()
        self.validate = validate

    async def __call__(self, scope, receive, send) -> None:
        if scope["method"] != "POST":
            await send_json(send, 405, error_body(405, f"use POST for {self.path}"), [(b"allow", b"POST")])
            return
        proxy = self.proxy
        rid = _header(scope, b"x-request-id")
        ctx = RequestContext(id=rid.decode("latin-1")[:128] if rid else _new_id(), endpoint=self.name,
                             model="", stream=False)
        proxy.accountant.begin(ctx)
        try:
            ctx.tenant = proxy.tenant_of(scope)
            raw = await proxy.read_body(scope, receive)
            await run_until_disconnect(self._handle(ctx, raw, send), receive, ctx)
        except ClientGone:
            ctx.outcome = "client_cancelled"
            ctx.status_code = 499
        except GatewayError as err:
            ctx.status_code = err.status
            ctx.outcome = "rejected" if err.status < 500 else ("timeout" if err.status == 504 else "error")
            ctx.error = err.message
            await send_error(send, err, [(b"x-request-id", ctx.id.encode())])
        except Exception as exc:  # never a stack trace to the client; never a crash
            log.exception("internal error on %s", self.path)
            ctx.status_code = 500
            ctx.outcome = "error"
            ctx.error = f"internal error: {type(exc).__name__}"
            try:
                await send_json(send, 500, error_body(500, "internal gateway error", code="internal_error"))
            except Exception:
                pass  # response already started; nothing more can be said
        finally:
            ctx.t_end = time.perf_counter()
            proxy.accountant.finish(ctx)

    async def _handle(self, ctx: RequestContext, raw: bytes, send) -> None:
        proxy = self.proxy
        body = parse_json(raw)
        if isinstance(body.get("model"), str):
            ctx.model = body["model"]
        self.validate(body)
        if proxy.fleet.pool_for_model(ctx.model) is None:
            raise GatewayError(404, f"The model '{ctx.model}' does not exist or is not served by this gateway",
                               param="model", code="model_not_found")
        ctx.stream = bool(body.get("stream"))
        ctx.max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        ctx.prompt_payload = body.get("messages") if self.name == "chat" else body.get("prompt")
        ctx.t_validated = ctx.t_forwarded = time.perf_counter()
        if ctx.stream:
            so = body.get("stream_options")
            ctx.include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
            await proxy.forward_stream(ctx, self.path_b, body, send)
        else:
            await proxy.forward_unary(ctx, self.path_b, raw, send)


async def run_until_disconnect(coro: Awaitable[None], receive, ctx: RequestContext) -> None:
    """Run the handler in the current task; if the client disconnects first, cancel it.

    Cancelling unwinds the handler, whose ``finally`` closes the upstream response: the upstream
    connection drops, and vLLM aborts the sequence. One extra task per request (the watcher);
    the body has been read already, so the next ASGI message can only be the disconnect. Once the
    last body message is being sent (``ctx.closing``) a disconnect no longer cancels anything:
    servers also report ``http.disconnect`` once a response is complete.
    """
    me = asyncio.current_task()
    gone = False

    async def watch() -> None:
        nonlocal gone
        msg = await receive()
        if msg["type"] == "http.disconnect" and not ctx.closing:
            gone = True
            me.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        await coro
    except asyncio.CancelledError:
        if gone:
            me.uncancel()
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()
