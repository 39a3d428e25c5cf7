"""The endpoint in-process: one place sends, one function classifies, every request reaches the ledger.

The chain is replaced by a fake handler (the forwarder has its own tests); the ASGI channel is
driven directly, so disconnects and a server's shutdown cancel can be placed exactly.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from usefulwork.config import from_mapping
from usefulwork.gateway.errors import GatewayError
from usefulwork.gateway.pipeline import DISCONNECT, DisconnectWatch, Reply
from usefulwork.gateway.proxy import OPERATIONS, Endpoint, Intake
from usefulwork.gateway.tenants import Tenants
from usefulwork.upstream.fleet import Fleet
from usefulwork.upstream.http1 import UpstreamClosed

CHAT = next(op for op in OPERATIONS if op.name == "chat")
RESPONSES = next(op for op in OPERATIONS if op.name == "responses")
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


class Ledger:
    def __init__(self):
        self.begun, self.done = [], []

    def begin(self, ctx):
        self.begun.append(ctx)

    def answered(self, ctx):  # (the journal's row: its order is tested with the real ledger, test_journal.py)
        return None

    def finish(self, ctx):
        self.done.append(ctx)


class Client:
    """Drives one ASGI request: body messages in, response messages out."""

    def __init__(self, body: bytes, headers=(), more: bool = False):
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.inbox.put_nowait({"type": "http.request", "body": body, "more_body": more})
        self.sent: list[dict] = []
        self.scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                      "headers": [(b"content-type", b"application/json"), *headers]}

    async def receive(self):
        return await self.inbox.get()

    async def send(self, msg):
        self.sent.append(msg)

    def disconnect(self):
        self.inbox.put_nowait({"type": "http.disconnect"})

    @property
    def status(self) -> int:
        return next(m["status"] for m in self.sent if m["type"] == "http.response.start")

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    def header(self, name: bytes) -> bytes | None:
        start = next(m for m in self.sent if m["type"] == "http.response.start")
        return dict(start["headers"]).get(name)


def endpoint(handler, op=CHAT, **cfg_extra) -> tuple[Endpoint, Ledger]:
    cfg = from_mapping({"pools": [{"name": "p", "models": ["m"], "replicas": ["http://127.0.0.1:9"]}], **cfg_extra},
                       environ={})
    ledger = Ledger()
    intake = Intake(Fleet(cfg), ledger, Tenants(cfg), handler, max_body=cfg.limits.max_body_bytes,
                    body_timeout_s=cfg.limits.body_timeout_s)
    return Endpoint(intake, op), ledger


def closed_flag(reply: Reply) -> list[int]:
    closed: list[int] = []
    reply.on_close(lambda: closed.append(1))
    return closed


async def test_ok_reply_is_sent_once_classified_ok_and_closed():
    reply = Reply(200, [(b"content-type", b"application/json")], body=b'{"ok":1}',
                  usage={"prompt_tokens": 4, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}})
    closed = closed_flag(reply)

    async def handler(call):
        return reply

    ep, ledger = endpoint(handler)
    c = Client(BODY, [(b"x-request-id", b"client-7")])
    await ep(c.scope, c.receive, c.send)
    assert c.status == 200 and c.body == b'{"ok":1}' and closed == [1]
    (ctx,) = ledger.done
    assert ctx.outcome == "ok" and (ctx.prompt_tokens, ctx.completion_tokens, ctx.cached_tokens) == (4, 2, 3)
    assert ctx.usage_source == "backend" and ctx.client_request_id == "client-7"
    assert c.header(b"x-request-id") == ctx.id.encode() and ctx.id != "client-7"


async def test_repeated_client_request_ids_still_get_unique_ledger_ids():
    async def handler(call):
        return Reply(200, body=b"{}")

    ep, ledger = endpoint(handler)
    for _ in range(3):
        c = Client(BODY, [(b"x-request-id", b"same")])
        await ep(c.scope, c.receive, c.send)
    assert len({ctx.id for ctx in ledger.done}) == 3
    assert {ctx.client_request_id for ctx in ledger.done} == {"same"}


async def test_gateway_429_is_shed_with_its_retry_after():
    async def handler(call):
        raise GatewayError(429, "over capacity", code="shed", headers=[(b"retry-after", b"3")])

    ep, ledger = endpoint(handler)
    c = Client(BODY)
    await ep(c.scope, c.receive, c.send)
    assert c.status == 429 and c.header(b"retry-after") == b"3"
    assert orjson.loads(c.body)["error"]["type"] == "rate_limit_error"
    assert ledger.done[0].outcome == "shed"


@pytest.mark.parametrize("body,status", [(b"{", 400), (b'{"model":"m"}', 422), (b'{"model":"x","messages":[]}', 422),
                                         (orjson.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}), 404)])
async def test_bad_input_is_rejected_before_the_chain(body, status):
    async def handler(call):
        raise AssertionError("nothing may be forwarded")

    ep, ledger = endpoint(handler)
    c = Client(body)
    await ep(c.scope, c.receive, c.send)
    assert c.status == status and ledger.done[0].outcome == "rejected"
    assert len(ledger.begun) == len(ledger.done) == 1


async def test_bad_key_is_401_and_booked():
    async def handler(call):
        raise AssertionError("nothing may be forwarded")

    ep, ledger = endpoint(handler, auth={"api_keys": {"k1": "team-a"}})
    c = Client(BODY, [(b"authorization", b"Bearer wrong")])
    await ep(c.scope, c.receive, c.send)
    assert c.status == 401 and ledger.done[0].outcome == "rejected"


async def test_stream_failing_after_it_began_ends_with_an_error_event_and_done():
    async def chunks():
        yield b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
        raise UpstreamClosed("replica died")

    reply = Reply(200, [(b"content-type", b"text/event-stream")], chunks=chunks())
    closed = closed_flag(reply)

    async def handler(call):
        call.ctx.stream = True
        return reply

    ep, ledger = endpoint(handler)
    c = Client(BODY)
    await ep(c.scope, c.receive, c.send)
    assert c.status == 200
    assert b'"error"' in c.body and c.body.endswith(b"data: [DONE]\n\n")
    assert c.sent[-1]["more_body"] is False
    (ctx,) = ledger.done
    assert ctx.outcome == "error" and ctx.status_code == 502 and closed == [1]


async def test_responses_stream_failure_uses_the_responses_error_event():
    async def chunks():
        yield b'event: response.created\ndata: {"type":"response.created"}\n\n'
        raise UpstreamClosed("replica died")

    async def handler(call):
        call.ctx.stream = True
        return Reply(200, chunks=chunks())

    ep, ledger = endpoint(handler, op=RESPONSES)
    c = Client(orjson.dumps({"model": "m", "input": "hi", "stream": True}))
    await ep(c.scope, c.receive, c.send)
    assert b"event: error\ndata: " in c.body and b"[DONE]" not in c.body
    assert ledger.done[0].outcome == "error"


async def _long_stream_in_flight(watch: DisconnectWatch | None = None):
    """An endpoint serving a stream that sends one event, then generates for a long time (``watch``: the
    disconnect extension the gateway's own HTTP protocol offers)."""
    started = asyncio.Event()

    async def chunks():
        yield b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
        started.set()
        await asyncio.sleep(30)  # a long generation
        yield b"data: [DONE]\n\n"

    reply = Reply(200, chunks=chunks())
    closed = closed_flag(reply)

    async def handler(call):
        return reply

    ep, ledger = endpoint(handler)
    c = Client(BODY)
    if watch is not None:
        c.scope["extensions"] = {DISCONNECT: watch}
    task = asyncio.ensure_future(ep(c.scope, c.receive, c.send))
    await started.wait()
    return task, c, ledger, closed


async def test_client_disconnect_cancels_the_stream_and_closes_the_reply():
    task, c, ledger, closed = await _long_stream_in_flight()
    c.disconnect()
    await asyncio.wait_for(task, 5)
    assert ledger.done[0].outcome == "client_cancelled" and closed == [1]


async def test_the_protocols_disconnect_report_cancels_the_stream_without_a_watcher_task():
    watch = DisconnectWatch()
    task, c, ledger, closed = await _long_stream_in_flight(watch)
    assert watch.callback is not None and len(asyncio.all_tasks()) == 2  # this test and the endpoint: no watcher
    watch.fire()  # what GuardedHttpToolsProtocol.connection_lost does
    await asyncio.wait_for(task, 5)
    assert ledger.done[0].outcome == "client_cancelled" and closed == [1] and watch.callback is None


async def test_a_client_gone_before_the_handler_started_is_cancelled_with_nothing_forwarded():
    async def handler(call):
        raise AssertionError("nothing may be forwarded")

    ep, ledger = endpoint(handler)
    c = Client(BODY)
    watch = DisconnectWatch()
    watch.fire()
    c.scope["extensions"] = {DISCONNECT: watch}
    await asyncio.wait_for(ep(c.scope, c.receive, c.send), 5)
    assert ledger.done[0].outcome == "client_cancelled" and ledger.done[0].status_code == 499 and not c.sent


async def test_a_disconnect_reported_once_the_response_is_complete_cancels_nothing():
    async def handler(call):
        return Reply(200, [(b"content-type", b"application/json")], body=b"{}")

    ep, ledger = endpoint(handler)
    c = Client(BODY)
    watch = DisconnectWatch()
    c.scope["extensions"] = {DISCONNECT: watch}
    await asyncio.wait_for(ep(c.scope, c.receive, c.send), 5)
    watch.fire()  # the connection closes after the response: the callback was withdrawn
    assert ledger.done[0].outcome == "ok" and c.status == 200 and watch.callback is None


async def test_stream_cut_by_server_shutdown_tells_the_client_and_is_not_ok():
    """uvicorn cancels requests still running when its shutdown grace ends (issue 9, item 2)."""
    task, c, ledger, closed = await _long_stream_in_flight()
    task.cancel()  # what the server does to a request still running past its grace
    with pytest.raises(asyncio.CancelledError):
        await task
    assert b'"error"' in c.body and c.body.endswith(b"data: [DONE]\n\n") and c.sent[-1]["more_body"] is False
    (ctx,) = ledger.done
    assert ctx.outcome == "error" and "shut down" in ctx.error and closed == [1]


async def test_a_body_that_never_completes_gets_408():
    async def handler(call):
        raise AssertionError("nothing may be forwarded")

    ep, ledger = endpoint(handler, limits={"body_timeout_s": 0.2})
    c = Client(BODY[:5], more=True)  # the rest never comes
    await asyncio.wait_for(ep(c.scope, c.receive, c.send), 5)
    assert c.status == 408 and ledger.done[0].outcome == "rejected"


async def test_oversized_body_is_413_by_header_and_by_count():
    async def handler(call):
        raise AssertionError("nothing may be forwarded")

    ep, ledger = endpoint(handler, limits={"max_body_bytes": 10})
    c = Client(BODY, [(b"content-length", str(len(BODY)).encode())])
    await ep(c.scope, c.receive, c.send)
    c2 = Client(BODY)  # no content-length (chunked upload): counted while reading
    await ep(c2.scope, c2.receive, c2.send)
    assert c.status == c2.status == 413


async def test_an_internal_bug_is_500_without_a_trace_and_booked():
    async def handler(call):
        raise KeyError("secret internals")

    ep, ledger = endpoint(handler)
    c = Client(BODY)
    await ep(c.scope, c.receive, c.send)
    assert c.status == 500 and b"secret" not in c.body and b"Traceback" not in c.body
    assert ledger.done[0].outcome == "error"
