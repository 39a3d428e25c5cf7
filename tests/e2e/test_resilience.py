"""Disconnect cancels upstream work; a replica dying mid-run never hangs a client."""

from __future__ import annotations

import concurrent.futures as cf
import time
from urllib.parse import urlparse

import httpx
import openai
import pytest

from tests.e2e.conftest import pool_cfg, start_gateway
from tests.faults import KillableForwarder

pytestmark = pytest.mark.vllm

LONG = {"messages": [{"role": "user", "content": "Write a very long story about a lighthouse."}],
        "max_tokens": 1500, "ignore_eos": True, "stream": True}


def _wait_running(vllm_server, target: float, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    value = vllm_server.metric("vllm:num_requests_running")
    while time.monotonic() < deadline:
        value = vllm_server.metric("vllm:num_requests_running")
        if value <= target:
            return value
        time.sleep(0.2)
    return value


def _stream_through(fwd: KillableForwarder, gw, create, tries: int = 3):
    """A stream that rides the forwarder (whose first chunk has arrived).

    Both replicas front the same vLLM, so the picker may place the stream on either: the one whose last
    /metrics scrape saw fewer requests running, or the direct one while the forwarder is judged down (a
    stall of this process, where the forwarder's thread runs, times its health check out). A stream placed
    elsewhere is closed and placed again once the gateway sees both replicas healthy. It rode the forwarder
    when its answer's head came back through it: a POST carried there may still have failed before its
    answer (a kept-alive connection vLLM was closing) and been served by the other replica."""
    for _ in range(tries):
        deadline = time.monotonic() + 30
        while not all(r["healthy"] for r in httpx.get(gw.url + "/readyz").json()["pools"]["local"]["replicas"]):
            assert time.monotonic() < deadline, "the gateway never saw both replicas healthy"
            time.sleep(0.2)
        streams = fwd.streams
        stream = create()
        assert next(iter(stream)) is not None
        if fwd.streams > streams:
            return stream
        stream.close()
    pytest.fail(f"no stream rode the forwarder in {tries} tries")


def test_client_disconnect_cancels_upstream(gateway, vllm_server):
    baseline = _wait_running(vllm_server, 0, 30)
    body = dict(LONG, model=vllm_server.model)
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", gateway.v1 + "/chat/completions", json=body) as r:
            assert r.status_code == 200
            # Keep reading while vLLM's gauge (updated about every 0.5 s) shows the request running.
            deadline = time.monotonic() + 10
            running = baseline
            for line in r.iter_lines():
                running = vllm_server.metric("vllm:num_requests_running")
                if running >= baseline + 1 or time.monotonic() > deadline:
                    break
            assert running >= baseline + 1, "the long request should be running on vLLM"
        # leaving the block closes the connection mid-stream: the client is gone
    after = _wait_running(vllm_server, baseline, 10)
    assert after <= baseline, f"vLLM still runs the abandoned request (running={after}, baseline={baseline})"


def test_failover_when_a_replica_dies_mid_run(vllm_server, tmp_path):
    u = urlparse(vllm_server.base_url)
    fwd = KillableForwarder(u.hostname, u.port).start()
    gw = start_gateway(tmp_path, pool_cfg(vllm_server.model, [fwd.url, vllm_server.base_url]))
    try:
        client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0, timeout=60)

        def unary(i):
            r = client.chat.completions.create(model=vllm_server.model, max_tokens=4,
                                               messages=[{"role": "user", "content": f"Number {i}?"}])
            return r.choices[0].message.content is not None

        with cf.ThreadPoolExecutor(4) as ex:
            before = list(ex.map(unary, range(4)))
            # The stream starts after the unary calls and the replica dies as soon as its first chunk is in, so
            # it is mid-run at the kill: CI at 92d06c2 (a slow host) saw a 400-token stream started before them
            # end without the error, either finished while they ran or served by the direct replica after its
            # POST passed the forwarder (which _stream_through now tells apart by the answer's head).
            doomed = _stream_through(fwd, gw, lambda: client.chat.completions.create(
                model=vllm_server.model, messages=LONG["messages"], max_tokens=LONG["max_tokens"], stream=True,
                extra_body={"ignore_eos": True}))
            fwd.kill()  # the replica dies: resets every open connection, refuses new ones
            t0 = time.monotonic()
            chunks = 0
            with pytest.raises(openai.APIError):
                for _ in doomed:  # must end with the SSE error event, never hang
                    chunks += 1
                pytest.fail(f"the stream ended whole ({chunks} more chunks) after its replica died")
            assert time.monotonic() - t0 < 30
            after = list(ex.map(unary, range(12)))
        assert all(before) and all(after), "requests after the failure must be served by the surviving replica"
        ready = httpx.get(gw.url + "/readyz").json()
        states = {r["url"]: r["healthy"] for r in ready["pools"]["local"]["replicas"]}
        assert states[fwd.url] is False and states[vllm_server.base_url] is True
    finally:
        gw.stop()
        fwd.close()


def test_retry_before_first_byte_hides_a_dead_replica(vllm_server, tmp_path):
    """A replica that is down from the start: every request still succeeds (retried on the other)."""
    u = urlparse(vllm_server.base_url)
    fwd = KillableForwarder(u.hostname, u.port).start()
    dead = fwd.url
    fwd.close()  # nothing listens there any more
    gw = start_gateway(tmp_path, pool_cfg(vllm_server.model, [dead, vllm_server.base_url]))
    try:
        client = openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0, timeout=60)
        for i in range(5):
            stream = client.completions.create(model=vllm_server.model, prompt=f"{i} +", max_tokens=3, stream=True)
            assert "".join(c.choices[0].text for c in stream if c.choices) is not None
    finally:
        gw.stop()


def test_client_closing_right_after_done_is_not_a_cancel(vllm_server, tmp_path):
    """A client that hangs up the moment it has [DONE] got everything: the ledger says ok."""
    import json
    import socket

    ledger = tmp_path / "ledger.jsonl"
    gw = start_gateway(tmp_path, pool_cfg(vllm_server.model, [vllm_server.base_url],
                                          ledger={"jsonl_path": str(ledger), "flush_interval_s": 0.1}))
    try:
        body = json.dumps({"model": vllm_server.model, "prompt": "Hi", "max_tokens": 4, "stream": True}).encode()
        port = int(gw.url.rsplit(":", 1)[1])
        for _ in range(10):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n%s" % (len(body), body))
            got = b""
            while b"data: [DONE]" not in got:
                chunk = s.recv(65536)
                assert chunk, "connection closed before [DONE]"
                got += chunk
            s.close()  # abrupt close right after [DONE], before the terminating chunk
    finally:
        gw.stop()
    records = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert len(records) == 10
    assert [r["outcome"] for r in records] == ["ok"] * 10
