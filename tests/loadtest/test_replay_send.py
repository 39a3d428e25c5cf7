"""The replay's lean sender: one timer loop whose lateness never accumulates, no encoding on the send
path, and every failure of the target (429, 500, a cut stream, an error event, a stall) an outcome."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from benchmarks.replay_drift import start_backend
from usefulwork.loadtest import replay_send as rs
from usefulwork.loadtest.replay import ReplayWorkload, replay
from usefulwork.loadtest.runner import Target


def records(n: int, gap_s: float) -> list[dict]:
    return [{"v": 1, "ts": 1000.0 + i * gap_s, "op": "completions", "tenant": "t", "outcome": "ok",
             "body": {"model": "mock", "prompt": f"p {i}", "max_tokens": 4}} for i in range(n)]


def test_lateness_does_not_accumulate_and_nothing_goes_out_early():
    due = [i * 0.01 for i in range(30)]
    fired: list[float] = []

    def launch(at: float) -> None:
        fired.append(time.perf_counter() - clock0)
        if len(fired) == 5:
            time.sleep(0.06)  # one slow launch: the five items due meanwhile go at once, then on time again

    async def go() -> None:
        await rs.fire_on_schedule(due, lambda x: x, launch, clock0)

    clock0 = time.perf_counter()
    asyncio.run(go())
    lag = [f - d for f, d in zip(fired, due)]
    assert min(lag) >= -rs.EARLY_S - 1e-4
    assert all(x > 0.01 for x in lag[5:9])  # due during the stall: late, sent in the same tick after it
    assert sorted(lag[12:])[-3] < 0.01, lag  # caught up: no drift carried past the stall


@pytest.fixture(scope="module")
def mock_backend(tmp_path_factory):
    url, stop = start_backend("mock", tmp_path_factory.mktemp("mock"))
    try:
        yield url
    finally:
        stop()


def test_every_body_is_encoded_before_the_first_send(mock_backend, monkeypatch):
    """The send path only writes bytes: no JSON encoding of a request once the clock runs (the old
    sender built and encoded each body in the request's task, competing with the schedule)."""
    from usefulwork.loadtest.replay import ReplaySpec

    calls: list[float] = []
    real = ReplaySpec.body

    def body(self, model):
        calls.append(time.time())
        return real(self, model)

    monkeypatch.setattr(ReplaySpec, "body", body)
    wl = ReplayWorkload(records=records(20, 0.01), source="t")
    out, interrupted = asyncio.run(replay(wl, Target(mock_backend, ""), timeout_s=10))
    assert not interrupted and [r.outcome for r in out.results] == ["ok"] * 20
    assert all(r.output_tokens == 16 and r.ttft > 0 and len(r.itl) == 15 for r in out.results)
    assert len(calls) == 20 and max(calls) <= out.wall_start  # all before the clock started


class Scripted:
    """Fault injection: an HTTP server answering each POST with the next scripted raw reply."""

    def __init__(self, replies: list[bytes | None]):
        self.replies = list(replies)

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = await r.readuntil(b"\r\n\r\n")
        length = int(next(x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")).split(b":")[1])
        await r.readexactly(length)
        reply = self.replies.pop(0)
        if reply is None:  # stall: hold the connection, never answer
            await asyncio.sleep(30)
            return
        w.write(reply)
        await w.drain()
        w.close()


def sse(*events: bytes, cut: bool = False) -> bytes:
    body = b"".join(b"data: " + e + b"\n\n" for e in events)
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    if cut:  # a chunked body that ends without its terminating chunk: the connection just closes
        return head + b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(body), body)
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


TOKEN = json.dumps({"choices": [{"index": 0, "text": "a"}]}).encode()
USAGE = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}).encode()


@pytest.mark.parametrize("reply, outcome, error", [
    (b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 2\r\nx-usefulwork-shed-reason: queue_full\r\n"
     b"content-length: 4\r\n\r\nbusy", "shed", "HTTP 429: busy"),
    (b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 4\r\n\r\noops", "error", "HTTP 500: oops"),
    (sse(TOKEN, cut=True), "error", "UpstreamClosed"),
    (sse(TOKEN, b'{"error": {"message": "engine died"}}'), "error", "error event: engine died"),
    (sse(TOKEN, b"{not json"), "error", "unparseable SSE data"),
    (sse(TOKEN, USAGE, b"[DONE]"), "ok", ""),
    (None, "timeout", "no complete answer within 0.5s"),
])
def test_a_failing_target_becomes_an_outcome(reply, outcome, error):
    async def go():
        url = await Scripted([reply]).start()
        sender = rs.Sender(Target(url, "m", "key"), timeout_s=0.5)
        wl = ReplayWorkload(records=records(1, 1.0), source="t")
        try:
            return await sender.send(sender.prepare(wl.specs()[0]), time.perf_counter())
        finally:
            sender.close()

    res = asyncio.run(go())
    assert res.outcome == outcome and error in res.error, (res.outcome, res.error)
    if outcome == "shed":
        assert res.retry_after_s == 2.0 and res.shed_reason == "queue_full"
    if outcome == "ok":
        assert res.output_tokens == 1 and res.prompt_tokens == 3 and res.ttft > 0 and res.usage_seen
