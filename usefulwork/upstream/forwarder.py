"""The last handler of the chain: send the call to a replica of its pool and produce the Reply.

Replica order comes from the pool's picker. Failure rules:
- a replica that fails before any byte of its answer arrived (connect refused, connection closed
  before a status line, 502/503/504) is marked down and the next replica is tried;
- an upstream timeout before the answer is a 504 (the request may be running: never re-sent);
- a failure after streaming began surfaces from ``reply.chunks`` as an ``UpstreamError``: the
  endpoint ends the stream with an error event (the replica is marked down here first).

Every attempt holds a ``Fleet.lease`` on its replica: released when the attempt fails, or when the
reply is closed (the endpoint always closes it). Client-facing error messages never name a
replica address; the ledger keeps it (``ctx.replica``).
"""

from __future__ import annotations

import time
from typing import AsyncIterator

import orjson

from usefulwork.gateway.errors import GatewayError
from usefulwork.gateway.pipeline import Call, Reply
from usefulwork.gateway.sse import ResponsesSSE, SSEFilter
from usefulwork.gateway.stored import LocalOwners, Owner
from usefulwork.upstream.fleet import Fleet, Replica
from usefulwork.upstream.http1 import (ConnectFailed, Response, UpstreamClosed, UpstreamError, UpstreamTimeout,
                                      UpstreamTooLarge)
from usefulwork.upstream.pickers import Picker
from usefulwork.upstream.pieces import PIECES_SENT, PREFILL_CHUNK, prefill_in_pieces

RETRY_STATUSES = frozenset({502, 503, 504})
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_PASSED_HEADERS = (b"retry-after",)  # upstream response headers a client may act on


class Forwarder:
    name = "forward"

    def __init__(self, fleet: Fleet, pickers: dict[str, Picker], owners: LocalOwners | None = None):
        self.fleet = fleet
        self.pickers = pickers
        self.owners = owners if owners is not None else LocalOwners(100_000)  # stored Responses: id -> Owner

    async def __call__(self, call: Call) -> Reply:
        ctx = call.ctx
        pool = call.pool
        if pool is None:
            raise GatewayError(404, f"The model '{ctx.model}' is not routed to any pool", param="model",
                               code="model_not_found")
        ctx.pool = pool.name
        picker = self.pickers[pool.name]
        if call.op == "responses" and (prev := call.body.get("previous_response_id")) is not None:
            candidates = await self._holder(call, prev, "previous_response_id", pool.name)
        else:
            candidates = self.fleet.candidates(pool)
        ordered = picker.pick(call, candidates) if candidates else candidates
        if not ordered:
            raise GatewayError(503, f"no replica available for model {ctx.model!r}", code="no_replica",
                               headers=[(b"retry-after", b"5")])
        body = _upstream_body(call)
        headers = _upstream_headers(ctx.id, pool.cfg.api_key)
        chunk = call.memo.get(PREFILL_CHUNK)
        last_error = "no replica tried"
        for replica in ordered:
            ctx.attempts += 1
            ctx.replica = replica.url
            lease = self.fleet.lease(replica)
            if ctx.t_forwarded is None:
                ctx.t_forwarded = time.perf_counter()
            try:
                if chunk and ctx.attempts == 1:  # (the admission filter's: a low-band prompt while top-band work is about)
                    pieces = await prefill_in_pieces(call, replica, headers, chunk)
                    call.memo[PIECES_SENT] = pieces
                resp = await replica.http.request(b"POST", call.path, body, headers)
            except (ConnectFailed, UpstreamClosed) as exc:
                lease.release()
                last_error = type(exc).__name__
                ctx.error = f"{replica.url}: {exc}"
                if getattr(exc, "maybe_processed", False):  # http1 never re-sends a POST to the same replica
                    ctx.error += " (the request had been sent whole: it may have been processed there)"
                self.fleet.mark_down(replica, f"request failed: {type(exc).__name__}")
                continue
            except UpstreamTimeout:
                lease.release()
                raise GatewayError(504, "the model server timed out before answering", code="upstream_timeout") from None
            except BaseException:
                lease.release()
                raise
            if resp.status in RETRY_STATUSES:
                lease.release()
                resp.close()
                last_error = f"HTTP {resp.status}"
                ctx.error = f"{replica.url}: HTTP {resp.status}"
                self.fleet.mark_down(replica, f"answered {resp.status}")
                continue
            reply = await self._reply(call, replica, resp, lease)
            feedback = getattr(picker, "feedback", None)
            if feedback is not None:
                reply.on_close(lambda: feedback(call, replica))
            return reply
        raise GatewayError(502, f"no replica could serve the request (last error: {last_error})",
                           code="upstream_unavailable", headers=[(b"retry-after", b"1")])

    # -- stored Responses (usefulwork/gateway/stored.py) --
    async def _holder(self, call: Call, response_id: str, param: str, pool: str | None = None) -> list[Replica]:
        """The replica holding a stored response of the caller's tenant (as a one-replica candidate list).

        An id this gateway does not know, or another tenant's, is answered 404 in vLLM's words, the same
        for both, and nothing is forwarded."""
        owner = await self.owners.owner(response_id)
        if owner is None or owner.tenant != call.ctx.tenant:
            raise GatewayError(404, f"Response with id '{response_id}' not found.", param=param, code="not_found")
        if pool is not None and owner.pool != pool:
            raise GatewayError(400, f"response '{response_id}' was made by another model's servers (pool "
                               f"{owner.pool!r}), which alone hold it: continue it with a model that pool serves",
                               param=param, code="invalid_value")
        state = self.fleet.pools.get(owner.pool)
        held = [r for r in (state.replicas if state is not None else ()) if r.url == owner.replica]
        if not held:  # the server left the pool (discovery): what it stored went with it
            raise GatewayError(404, f"Response with id '{response_id}' not found (the server that held it has "
                               "left the pool).", param=param, code="not_found")
        if not held[0].healthy and held[0] not in self.fleet.candidates(state):
            raise GatewayError(503, f"the server holding response '{response_id}' is not answering now",
                               code="no_replica", headers=[(b"retry-after", b"5")])
        call.ctx.pool = owner.pool
        return held

    def _note(self, call: Call, replica: Replica, response_id: object) -> None:
        if isinstance(response_id, str) and response_id and call.body.get("store") is not False:
            self.owners.note(response_id, Owner(call.ctx.tenant, call.ctx.pool or "", replica.url))

    async def retrieve(self, call: Call, response_id: str) -> Reply:
        """``GET /v1/responses/{id}``: from the replica holding it, for its own tenant only."""
        replica = (await self._holder(call, response_id, "response_id"))[0]
        call.ctx.replica = replica.url
        lease = self.fleet.lease(replica)
        state = self.fleet.pools[call.ctx.pool]
        try:
            resp = await replica.http.request(b"GET", call.path, b"", _upstream_headers(call.ctx.id, state.cfg.api_key))
        except (ConnectFailed, UpstreamClosed, UpstreamTimeout):
            lease.release()
            raise GatewayError(502, "the server holding the response failed to answer", code="upstream_unavailable",
                               headers=[(b"retry-after", b"1")]) from None
        return await self._reply(call, replica, resp, lease)

    async def _reply(self, call: Call, replica: Replica, resp: Response, lease) -> Reply:
        if call.ctx.stream and resp.status == 200:
            flavour = ResponsesSSE if call.op == "responses" else SSEFilter
            reply = Reply(200, list(SSE_HEADERS))
            filt = flavour(keep_usage=call.ctx.include_usage, max_event_bytes=self.fleet.cfg.limits.max_sse_event_bytes)
            reply.chunks = self._relay(call, replica, resp, filt, reply)
            reply.on_close(lease.release)
            reply.on_close(resp.close)  # back to the pool if complete; aborted (upstream cancels) if not
            if call.op == "responses":
                reply.on_close(lambda: self._note(call, replica, filt.response_id))
            return reply
        try:
            data = await resp.read()
        except UpstreamTimeout:
            raise GatewayError(504, "the model server timed out while answering", code="upstream_timeout") from None
        except UpstreamTooLarge as exc:  # the answer, not the replica, is at fault: it stays in rotation
            raise GatewayError(502, str(exc), code="upstream_too_large") from None
        except UpstreamError as exc:
            self.fleet.mark_down(replica, f"read failed: {type(exc).__name__}")
            raise GatewayError(502, "the model server failed while answering", code="upstream_error") from None
        finally:
            lease.release()
            resp.close()
        headers = [(b"content-type", resp.header(b"content-type") or b"application/json")]
        for name in _PASSED_HEADERS:
            value = resp.header(name)
            if value is not None:
                headers.append((name, value))
        reply = Reply(resp.status, headers, body=data)
        if resp.status == 200:
            answer = _json_of(data)
            usage = answer.get("usage")
            reply.usage = usage if isinstance(usage, dict) else None
            if call.op == "responses":
                self._note(call, replica, answer.get("id"))
        else:
            call.ctx.error = data[:500].decode("utf-8", "replace")
        return reply

    async def _relay(self, call: Call, replica: Replica, resp: Response, filt: SSEFilter,
                     reply: Reply) -> AsyncIterator[bytes]:
        """Upstream bytes -> complete SSE events (usage noted, and stripped if the client did not ask)."""
        try:
            while (chunk := await resp.read_chunk()) is not None:
                out = filt.feed(chunk)
                if out:
                    # usage comes in the event before the end event, often in the same chunk: the reply
                    # holds it before that chunk goes out, so the journal's row at the last write does too
                    reply.usage = filt.usage
                    yield out
            tail = filt.flush()
            if tail:
                reply.usage = filt.usage
                yield tail
            if not filt.done:
                raise UpstreamClosed("upstream closed the stream before it ended")
        except UpstreamError as exc:
            if not isinstance(exc, (UpstreamTimeout, UpstreamTooLarge)):
                self.fleet.mark_down(replica, f"stream failed: {type(exc).__name__}")
            raise
        finally:
            call.ctx.chunks = filt.events
            reply.usage = filt.usage


def _upstream_body(call: Call) -> bytes:
    body = call.body
    if call.ctx.stream and call.op != "responses":
        # Always ask upstream for usage so it is never lost; the relay strips it if the client did not ask.
        so = body.get("stream_options")
        if not (isinstance(so, dict) and so.get("include_usage")):
            call.set_body({**body, "stream_options": {**(so or {}), "include_usage": True}})
    return call.raw if call.raw is not None else orjson.dumps(call.body)


def _upstream_headers(request_id: str, pool_key: str | None) -> bytes:
    h = b"content-type: application/json\r\nx-request-id: " + request_id.encode("latin-1") + b"\r\n"
    if pool_key:
        h += b"authorization: Bearer " + pool_key.encode("latin-1") + b"\r\n"
    return h


def _json_of(data: bytes) -> dict:
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return {}
    return obj if isinstance(obj, dict) else {}
