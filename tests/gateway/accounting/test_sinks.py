"""Ledger sinks against the real things: a JSONL file and a real Redis Stream."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
import uuid

import orjson
import pytest
import redis

from tests.conftest import free_port
from tests.faults import KillableForwarder
from usefulwork.gateway.accounting.sinks import JsonlSink, RedisStreamSink, from_config


async def test_jsonl_sink_appends_lines(tmp_path):
    path = tmp_path / "sub" / "ledger.jsonl"
    sink = JsonlSink(path)
    await sink.write([orjson.dumps({"id": 1}), orjson.dumps({"id": 2})])
    await sink.write([])
    await sink.close()
    again = JsonlSink(path)  # reopening appends, never truncates
    await again.write([orjson.dumps({"id": 3})])
    await again.close()
    assert [orjson.loads(line)["id"] for line in path.read_bytes().splitlines()] == [1, 2, 3]


async def test_redis_stream_sink_xadds_each_record(redis_url):
    stream = f"usefulwork:test:{uuid.uuid4().hex}"
    sink = RedisStreamSink(redis_url, stream)
    try:
        await sink.write([orjson.dumps({"id": i}) for i in range(5)])
    finally:
        await sink.close()
    client = redis.Redis.from_url(redis_url)
    try:
        entries = client.xrange(stream)
        assert [orjson.loads(fields[b"record"])["id"] for _, fields in entries] == list(range(5))
    finally:
        client.delete(stream)


async def test_from_config_builds_the_configured_sinks(tmp_path, redis_url):
    assert from_config(None, None, "s") == []
    sinks = from_config(str(tmp_path / "l.jsonl"), redis_url, "s")
    assert [s.name for s in sinks] == ["jsonl", "redis"]
    for s in sinks:
        await s.close()


@pytest.fixture
def own_redis(tmp_path):
    """A Redis server of our own (free port, no persistence) that the test may stop and hang."""
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    yield proc, port
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait(10)


async def test_redis_write_whose_answer_was_lost_is_not_duplicated_on_retry(own_redis):
    """Issue #9.4: a retried write whose first try reached Redis (answer lost) added the records twice."""
    _, port = own_redis
    fwd = KillableForwarder("127.0.0.1", port).start()
    sink = RedisStreamSink(fwd.url.replace("http://", "redis://"), "ledger")
    batch = [orjson.dumps({"id": "same-client-id", "n": i}) for i in range(50)]
    try:
        fwd.drop_replies = True
        with pytest.raises(redis.exceptions.ConnectionError):
            await sink.write(batch)
        fwd.drop_replies = False
        await sink.write(batch)  # what the ledger does at its next flush
        await sink.write(batch[:10])  # and again: still once each
    finally:
        await sink.close()
        fwd.close()
    entries = redis.Redis(port=port).xrange("ledger")
    assert sorted(orjson.loads(f[b"record"])["n"] for _, f in entries) == list(range(50))


async def test_hung_redis_bounds_shutdown_and_the_log_tells_the_truth(own_redis, tmp_path, caplog):
    """Issue #9.4: with Redis hung, shutdown took 22.5 s and logged "could not be written" though
    Redis later had every record."""
    from tests.gateway.accounting.test_ledger import T0, ctx_at, make_accountant, make_cfg

    proc, port = own_redis
    cfg = make_cfg(ledger={"flush_interval_s": 0.05, "shutdown_timeout_s": 1.0})
    jsonl = JsonlSink(tmp_path / "l.jsonl")
    acc, _, _ = make_accountant(cfg, sinks=[jsonl, RedisStreamSink(f"redis://127.0.0.1:{port}", "ledger")])
    await acc.start()
    proc.send_signal(signal.SIGSTOP)
    for _ in range(50):
        acc.finish(ctx_at(T0 + 1, pool=None, outcome="rejected", prompt=0, completion=0))
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    await acc.stop()
    took = time.monotonic() - t0
    assert took < 3.0, f"shutdown took {took:.1f}s with Redis hung"
    assert len((tmp_path / "l.jsonl").read_bytes().splitlines()) == 50
    text = caplog.text
    assert "could not be written" not in text
    assert "redis: 50 records not confirmed" in text
    proc.send_signal(signal.SIGCONT)
    client = redis.Redis(port=port)
    time.sleep(0.5)
    assert client.xlen("ledger") in (0, 50)  # a timed-out write landed whole or not at all, never twice
