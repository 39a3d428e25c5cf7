"""Ledger sinks against the real things: a JSONL file and a real Redis Stream."""

from __future__ import annotations

import uuid

import orjson
import redis

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
