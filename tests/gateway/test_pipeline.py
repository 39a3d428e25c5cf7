"""The chain and the outcome classifier, in-process (filters with a fake ``next``)."""

from __future__ import annotations

import asyncio

import pytest

from usefulwork.config import from_mapping, ConfigError
from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.filters import FILTERS, build_filters
from usefulwork.gateway.filters.noop import NoopFilter
from usefulwork.gateway.pipeline import Call, ClientGone, Reply, Services, chain, classify
from usefulwork.upstream.http1 import UpstreamClosed, UpstreamTimeout


def make_call(body: dict | None = None) -> Call:
    ctx = RequestContext(id="r1", endpoint="chat", model="m", stream=False)
    return Call(ctx=ctx, op="chat", path=b"/v1/chat/completions", body=body or {"model": "m"}, raw=b"{}",
                pool=None, headers=[])


class Recorder:
    def __init__(self, name: str, log: list[str], answer: Reply | None = None):
        self.name = name
        self.log = log
        self.answer = answer

    async def __call__(self, call, next):
        self.log.append(f"{self.name}>")
        if self.answer is not None:
            return self.answer
        reply = await next(call)
        self.log.append(f"<{self.name}")
        return reply


async def test_filters_run_in_order_and_see_the_reply_in_reverse():
    log: list[str] = []

    async def last(call):
        log.append("forward")
        return Reply(200, body=b"{}")

    handler = chain([Recorder("a", log), Recorder("b", log)], last)
    reply = await handler(make_call())
    assert reply.status == 200
    assert log == ["a>", "b>", "forward", "<b", "<a"]


async def test_a_filter_can_answer_early_and_nothing_after_it_runs():
    log: list[str] = []

    async def last(call):
        raise AssertionError("the forwarder must not run")

    hit = Reply(200, body=b'{"cached":true}')
    handler = chain([Recorder("a", log), Recorder("cache", log, answer=hit), Recorder("c", log)], last)
    assert await handler(make_call()) is hit
    assert log == ["a>", "cache>", "<a"]


async def test_a_filter_can_change_the_call_and_call_next_again():
    seen: list[str] = []

    async def last(call):
        seen.append(call.body["model"])
        return Reply(200 if call.body["model"] == "large" else 500, body=b"")

    class Escalate:
        name = "escalate"

        async def __call__(self, call, next):
            reply = await next(call)
            if reply.status != 200:
                await reply.aclose()
                call.set_body({**call.body, "model": "large"})
                reply = await next(call)
            return reply

    call = make_call({"model": "small"})
    reply = await chain([Escalate()], last)(call)
    assert reply.status == 200 and seen == ["small", "large"]
    assert call.raw is None  # the forwarder re-encodes a changed body


async def test_a_filter_can_wrap_the_chunks():
    async def chunks():
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"

    async def last(call):
        return Reply(200, chunks=chunks())

    class Upper:
        name = "upper"

        async def __call__(self, call, next):
            reply = await next(call)
            inner = reply.chunks

            async def wrapped():
                async for c in inner:
                    yield c.replace(b"data:", b"DATA:")
            reply.chunks = wrapped()
            return reply

    reply = await chain([Upper()], last)(make_call())
    assert [c async for c in reply.chunks] == [b"DATA: 1\n\n", b"DATA: 2\n\n"]


async def test_reply_closers_run_once_last_added_first_sync_or_async():
    order: list[str] = []
    reply = Reply(200)
    reply.on_close(lambda: order.append("lease"))

    async def flush():
        await asyncio.sleep(0)
        order.append("cache fill")
    reply.on_close(flush)
    await reply.aclose()
    await reply.aclose()
    assert order == ["cache fill", "lease"]


@pytest.mark.parametrize("status,exc,outcome", [
    (200, None, "ok"),
    (201, None, "ok"),
    (400, None, "rejected"),
    (401, None, "rejected"),
    (404, None, "rejected"),
    (413, None, "rejected"),
    (422, None, "rejected"),
    (429, None, "shed"),  # the gateway's own 429 (or an upstream's): capacity, not the client's input
    (500, None, "error"),
    (502, None, "error"),
    (503, None, "error"),
    (504, None, "timeout"),
    (200, ClientGone(), "client_cancelled"),
    (499, ClientGone(), "client_cancelled"),
    (200, UpstreamTimeout("read"), "timeout"),
    (200, UpstreamClosed("cut"), "error"),
    (200, asyncio.CancelledError(), "error"),
    (500, RuntimeError("bug"), "error"),
])
def test_classify(status, exc, outcome):
    assert classify(status, exc) == outcome


def test_unknown_filter_name_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError) as err:
        from_mapping({"filters": ["noop", "cahce"]}, "gw.yaml", environ={})
    msg = str(err.value)
    assert "gw.yaml: filters" in msg and "cahce" in msg and "noop" in msg


def test_filters_are_built_in_config_order():
    cfg = from_mapping({"filters": ["noop", "noop"]}, environ={})
    assert set(FILTERS) >= {"noop"}
    built = build_filters(cfg.filters, Services(cfg=cfg, fleet=None, accountant=None))
    assert [f.name for f in built] == ["noop", "noop"] and all(isinstance(f, NoopFilter) for f in built)
