"""The forwarder against upstreams that misbehave on purpose (fault injection: canned HTTP answers)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from usefulwork.config import from_mapping
from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.errors import GatewayError
from usefulwork.gateway.pipeline import Call
from usefulwork.gateway.proxy import book_usage
from usefulwork.upstream.fleet import Fleet
from usefulwork.upstream.forwarder import Forwarder
from usefulwork.upstream.http1 import UpstreamClosed
from usefulwork.upstream.pickers import build_pickers


class Canned:
    """An HTTP/1.1 server that answers every request with the same bytes (optionally cutting the connection)."""

    def __init__(self, answer: bytes, cut: bool = False):
        self.answer = answer
        self.cut = cut
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> "Canned":
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: the same answer to each request on the connection, until the client goes
                head = await r.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append(head + await r.readexactly(length))
                w.write(self.answer)
                await w.drain()
                if self.cut:
                    w.transport.abort()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()


def http(status: str, body: bytes, *headers: str) -> bytes:
    extra = "".join(f"{h}\r\n" for h in headers)
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
            ).encode() + body


def sse(events: list[bytes], done: bool = True) -> bytes:
    body = b"".join(b"data: " + e + b"\n\n" for e in events) + (b"data: [DONE]\n\n" if done else b"")
    chunk = f"{len(body):x}\r\n".encode() + body + b"\r\n"
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + chunk
            + (b"0\r\n\r\n" if done else b""))


def fleet_of(*urls: str) -> Fleet:
    cfg = from_mapping({"pools": [{"name": "p", "models": ["m"], "replicas": list(urls)}],
                        "timeouts": {"connect_s": 2, "first_byte_s": 5, "read_s": 5}}, environ={})
    fleet = Fleet(cfg)
    for r in fleet.replicas:
        fleet.mark_up(r)
    return fleet


def make_call(fleet: Fleet, stream: bool = False, include_usage: bool = False) -> Call:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    ctx = RequestContext(id="gw-id-1", endpoint="chat", model="m", stream=stream, include_usage=include_usage)
    return Call(ctx=ctx, op="chat", path=b"/v1/chat/completions", body=body, raw=orjson.dumps(body),
                pool=fleet.pool_for_model("m"), headers=[])


OK = orjson.dumps({"choices": [{"message": {"content": "hi"}}],
                   "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})


async def test_a_503_replica_is_skipped_marked_down_and_every_lease_released():
    async with Canned(http("503 Service Unavailable", b"{}")) as bad, Canned(http("200 OK", OK)) as good:
        fleet = fleet_of(bad.url, good.url)
        call = make_call(fleet)
        reply = await Forwarder(fleet, {"p": _InOrder()})(call)
        await reply.aclose()
        assert reply.status == 200 and reply.usage["completion_tokens"] == 1
        assert call.ctx.attempts == 2 and call.ctx.replica == good.url
        b, g = fleet.replicas
        assert not b.healthy and g.healthy
        assert b.inflight == 0 and g.inflight == 0
        assert b"x-request-id: gw-id-1" in good.requests[0]  # the gateway's unique id goes upstream
        await _close(fleet)


async def test_no_replica_left_is_502_without_any_replica_address():
    async with Canned(http("503 Service Unavailable", b"{}")) as bad:
        fleet = fleet_of(bad.url)
        with pytest.raises(GatewayError) as err:
            await Forwarder(fleet, build_pickers(fleet.cfg, fleet))(make_call(fleet))
        assert err.value.status == 502
        assert "127.0.0.1" not in err.value.message and bad.url not in err.value.body().decode()
        assert fleet.replicas[0].inflight == 0
        await _close(fleet)


async def test_upstream_429_passes_its_retry_after_to_the_client():
    body = orjson.dumps({"error": {"message": "slow down", "type": "rate_limit_error"}})
    async with Canned(http("429 Too Many Requests", body, "retry-after: 7")) as up:
        fleet = fleet_of(up.url)
        call = make_call(fleet)
        reply = await Forwarder(fleet, build_pickers(fleet.cfg, fleet))(call)
        await reply.aclose()
        assert reply.status == 429 and reply.header(b"retry-after") == b"7"
        assert fleet.replicas[0].healthy  # a 429 is the server's answer, not a failure
        await _close(fleet)


async def test_malformed_usage_passes_the_answer_through_and_is_not_booked():
    bad = orjson.dumps({"choices": [], "usage": {"prompt_tokens": "abc", "completion_tokens": [1]}})
    async with Canned(http("200 OK", bad)) as up:
        fleet = fleet_of(up.url)
        call = make_call(fleet)
        reply = await Forwarder(fleet, build_pickers(fleet.cfg, fleet))(call)
        await reply.aclose()
        assert reply.status == 200 and reply.body == bad
        book_usage(call.ctx, reply.usage)
        assert call.ctx.usage_source == "none"  # the ledger estimates instead
        await _close(fleet)


async def test_stream_relays_events_notes_usage_and_strips_it_when_not_asked():
    usage = b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}'
    events = [b'{"choices":[{"delta":{"content":"a"}}]}', b'{"choices":[{"delta":{"content":"b"}}]}', usage]
    async with Canned(sse(events)) as up:
        fleet = fleet_of(up.url)
        call = make_call(fleet, stream=True)
        reply = await Forwarder(fleet, build_pickers(fleet.cfg, fleet))(call)
        parts, at_end = [], None
        async for c in reply.chunks:
            parts.append(c)
            if c.endswith(b"data: [DONE]\n\n"):
                at_end = reply.usage  # what the endpoint books just before it writes the end event
        out = b"".join(parts)
        assert at_end == orjson.loads(usage)["usage"]  # known before the last write, not only at the relay's end
        assert fleet.replicas[0].inflight == 1  # the lease is held until the reply is closed
        await reply.aclose()
        assert fleet.replicas[0].inflight == 0
        assert b'"usage"' not in out and out.endswith(b"data: [DONE]\n\n")
        assert reply.usage["completion_tokens"] == 2 and call.ctx.chunks == 2
        assert b'"include_usage":true' in up.requests[0]  # always asked upstream
        await _close(fleet)


async def test_stream_cut_midway_raises_and_marks_the_replica_down():
    async with Canned(sse([b'{"choices":[{"delta":{"content":"a"}}]}'], done=False), cut=True) as up:
        fleet = fleet_of(up.url)
        call = make_call(fleet, stream=True)
        reply = await Forwarder(fleet, build_pickers(fleet.cfg, fleet))(call)
        got = []
        with pytest.raises(UpstreamClosed):
            async for c in reply.chunks:
                got.append(c)
        await reply.aclose()
        assert len(got) == 1 and not fleet.replicas[0].healthy and fleet.replicas[0].inflight == 0
        await _close(fleet)


async def test_a_virtual_model_nobody_routed_is_404():
    fleet = fleet_of("http://127.0.0.1:9")
    call = make_call(fleet)
    call.pool = None
    with pytest.raises(GatewayError) as err:
        await Forwarder(fleet, build_pickers(fleet.cfg, fleet))(call)
    assert err.value.status == 404
    await _close(fleet)


class _InOrder:
    def pick(self, call, replicas):
        return list(replicas)


async def _close(fleet: Fleet) -> None:
    await fleet.stop()
