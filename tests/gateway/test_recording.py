"""The record filter in-process (fake ``next``): what a record holds, redaction, rotation, sampling, and
that a slow writer or a failing disk drops records and counts them without delaying a request."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import orjson
import pytest

from usefulwork.config import from_mapping
from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.pipeline import Call, Reply, Services
from usefulwork.gateway.recording import BLOCK_CHARS, RecordFilter, TrafficLog, block_hashes


def services(tmp_path, **record) -> Services:
    cfg = from_mapping({"pools": [{"name": "p", "models": ["m"], "replicas": ["http://127.0.0.1:9"],
                                   "prices": {"input_per_1m": 1.0, "output_per_1m": 2.0}},
                                  ],
                        "filters": ["record"],
                        "record": {"dir": str(tmp_path / "traffic"), "flush_interval_s": 0.01, **record}},
                       environ={})
    return Services(cfg=cfg, fleet=None, accountant=None)


def make_call(prompt: str = "hello", tenant: str = "acme") -> Call:
    ctx = RequestContext(id="r1", endpoint="completions", model="m", stream=False, tenant=tenant)
    body = {"model": "m", "prompt": prompt, "max_tokens": 5}
    return Call(ctx=ctx, op="completions", path=b"/v1/completions", body=body, raw=None, pool=None, headers=[])


async def finish(f: RecordFilter, call: Call, status: int = 200, outcome: str = "ok") -> None:
    """What the endpoint does: run the chain, book usage, close the reply, classify, end."""
    async def upstream(c: Call) -> Reply:
        c.ctx.pool = "p"
        c.ctx.route = "p"
        return Reply(status, body=b"{}")

    reply = await f(call, upstream)
    call.ctx.prompt_tokens, call.ctx.completion_tokens = 1000, 500
    call.ctx.usage_source = "backend"
    call.ctx.t_first_token = call.ctx.t_start + 0.010
    await reply.aclose()
    call.ctx.status_code, call.ctx.outcome = status, outcome
    call.ctx.t_end = call.ctx.t_start + 0.050


def read(tmp_path) -> list[dict]:
    return [orjson.loads(line) for p in sorted((tmp_path / "traffic").glob("*.jsonl"))
            for line in p.read_bytes().splitlines()]


async def test_a_record_holds_the_final_outcome_tokens_latency_and_cost(tmp_path):
    f = RecordFilter(services(tmp_path))
    await f.start()
    await finish(f, make_call(), status=429, outcome="shed")
    await f.stop()
    [rec] = read(tmp_path)
    assert rec["tenant"] == "acme" and rec["op"] == "completions" and rec["route"] == "p"
    assert rec["outcome"] == "shed" and rec["status"] == 429
    assert rec["prompt_tokens"] == 1000 and rec["completion_tokens"] == 500
    assert rec["ttft_ms"] == pytest.approx(10.0) and rec["e2e_ms"] == pytest.approx(50.0)
    assert rec["cost_usd"] == pytest.approx((1000 * 1.0 + 500 * 2.0) / 1e6)
    assert rec["body"]["prompt"] == "hello" and rec["redacted"] is False
    assert f.stats()["written"] == 1


async def test_redaction_keeps_lengths_and_prefix_hashes_only(tmp_path):
    f = RecordFilter(services(tmp_path, redact=True))
    await f.start()
    shared = "x" * (2 * BLOCK_CHARS)
    await finish(f, make_call(shared + "first question"))
    await finish(f, make_call(shared + "second question, different"))
    await f.stop()
    a, b = read(tmp_path)
    assert "body" not in a and a["redacted"] is True
    assert "question" not in orjson.dumps(a).decode()
    assert a["prompt_chars"] == len(shared) + len("first question")
    assert a["hash_ids"][:2] == b["hash_ids"][:2] and a["hash_ids"][2] != b["hash_ids"][2]


def test_block_hashes_chain_so_equal_ids_mean_equal_prefixes():
    x = block_hashes("a" * BLOCK_CHARS + "b" * BLOCK_CHARS)
    y = block_hashes("c" * BLOCK_CHARS + "b" * BLOCK_CHARS)
    assert len(x) == 2 and x[1] != y[1]  # same second block, different prefix: different id


async def test_sampling_zero_records_nothing(tmp_path):
    f = RecordFilter(services(tmp_path, sample=0.0))
    await f.start()
    for _ in range(5):
        await finish(f, make_call())
    await f.stop()
    assert read(tmp_path) == [] and f.stats()["sampled_out"] == 5


async def test_a_failing_call_is_recorded_with_its_outcome(tmp_path):
    f = RecordFilter(services(tmp_path))
    await f.start()
    call = make_call()

    async def boom(c):
        raise RuntimeError("upstream down")

    with pytest.raises(RuntimeError):
        await f(call, boom)
    call.ctx.status_code, call.ctx.outcome, call.ctx.t_end = 500, "error", time.perf_counter()
    await f.stop()
    [rec] = read(tmp_path)
    assert rec["outcome"] == "error" and rec["status"] == 500


async def test_rotates_by_size(tmp_path):
    f = RecordFilter(services(tmp_path, rotate_bytes=600))
    await f.start()
    for _ in range(6):
        await finish(f, make_call())
        await asyncio.sleep(0.03)  # separate writes
    await f.stop()
    files = list((tmp_path / "traffic").glob("*.jsonl"))
    assert len(files) >= 3 and len(read(tmp_path)) == 6


async def test_a_stalled_writer_drops_and_counts_without_delaying_requests(tmp_path, monkeypatch):
    gate = threading.Event()
    real_write = TrafficLog._write

    def stalled(self, batch):
        gate.wait(30)
        real_write(self, batch)

    monkeypatch.setattr(TrafficLog, "_write", stalled)
    f = RecordFilter(services(tmp_path, queue_size=4))
    await f.start()
    lat = []
    for _ in range(200):
        t = time.perf_counter()
        await finish(f, make_call())
        lat.append(time.perf_counter() - t)
        if len(lat) % 20 == 0:
            await asyncio.sleep(0.02)  # let the drain run
    st = f.stats()
    assert st["dropped_queue"] > 150 and st["written"] == 0
    # The request path never waited for the writer: a wait would last until the gate opens (30 s).
    # A fixed sub-millisecond bound on p99 read a GC pause or a preempted core as a wait (1.15 ms
    # once in CI); the median shows the path stays cheap, the maximum that nothing blocked.
    assert statistics.median(lat) < 0.001 and max(lat) < 1.0
    gate.set()
    await f.stop()
    assert f.stats()["written"] + f.stats()["dropped_queue"] == 200


async def test_a_failing_disk_drops_and_counts(tmp_path):
    (tmp_path / "traffic").write_text("a file where the log directory should be")
    f = RecordFilter(services(tmp_path))
    await f.start()
    await finish(f, make_call())
    await f.stop()
    assert f.stats()["dropped_write"] == 1 and f.stats()["written"] == 0
