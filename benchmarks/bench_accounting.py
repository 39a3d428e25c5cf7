"""Accounting overhead: the hot-path cost of ``Ledger.finish`` and the background pass's throughput.

    flock /tmp/usefulwork-cpu.lock .venv/bin/python benchmarks/bench_accounting.py [--n 50000]

Prints one JSON object: finish() ns per call; background records/s (token usage known, OTel
metrics, JSONL sink with fsync; ``--spans``: plus a span per request); /usefulwork/stats snapshot ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time

from usefulwork import config
from usefulwork.upstream.fleet import Fleet
from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.accounting.ledger import Ledger
from usefulwork.gateway.accounting.sinks import JsonlSink
from usefulwork.gateway.accounting.telemetry import Telemetry


def make_ctxs(n: int, t0: float) -> list[RequestContext]:
    out = []
    for i in range(n):
        start = t0 + i * 0.001
        out.append(RequestContext(
            id=f"r{i}", endpoint="chat", model="m", stream=bool(i % 2), tenant=f"t{i % 10}", pool="p",
            replica="http://127.0.0.1:1", wall_start=start, t_start=0.0, t_forwarded=0.001, t_first_token=0.2,
            t_end=1.5, prompt_tokens=500, completion_tokens=128, usage_source="backend",
            outcome="ok" if i % 20 else "error"))
    return out


async def main(n: int, spans: bool) -> dict:
    cfg = config.from_mapping({"pools": [{"name": "p", "models": ["m"], "replicas": ["http://127.0.0.1:1"],
                                          "gpu": {"count": 1, "usd_per_hour": 2.0}}],
                               "ledger": {"flush_interval_s": 3600}}, environ={})
    fleet = Fleet(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        sink = JsonlSink(os.path.join(tmp, "ledger.jsonl"))
        acc = Ledger(cfg, fleet, [sink], settle_hold_s=0.0)
        exporters = []
        if spans:  # a span per request into the SDK's in-memory exporter (stands in for OTLP)
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

            exporters.append(InMemorySpanExporter())
        acc.telemetry = Telemetry(cfg, acc.meters, span_exporters=exporters)
        t0 = time.time()
        ctxs = make_ctxs(n, t0)

        # hot path: finish() only (no background task running)
        start = time.perf_counter_ns()
        for c in ctxs:
            acc.finish(c)
        finish_ns = (time.perf_counter_ns() - start) / n

        # the background pass over everything queued (accounting, telemetry, settlement, JSONL write)
        start = time.perf_counter()
        await acc._process()
        process_s = time.perf_counter() - start
        # worst case for the live view: most intervals still open (unsettled), 10 tenants
        s0 = time.perf_counter()
        acc.snapshot(with_series=True)
        open_snapshot_ms = (time.perf_counter() - s0) * 1000
        open_intervals = sum(len(m._open) for m in acc.meters.values())
        start = time.perf_counter()
        acc.clock = lambda: t0 + n * 0.001 + 3600  # settle everything
        await acc._process()
        process_s += time.perf_counter() - start

        start = time.perf_counter()
        reps = 20
        for _ in range(reps):
            acc.snapshot(with_series=True)
        snapshot_ms = (time.perf_counter() - start) / reps * 1000
        written = acc.written["jsonl"]
        await acc.stop()
    return {
        "n": n,
        "spans": spans,
        "finish_ns_per_call": round(finish_ns, 1),
        "background_records_per_s": round(n / process_s),
        "records_written": written,
        "stats_snapshot_with_series_ms": round(snapshot_ms, 2),
        "stats_snapshot_open_intervals_ms": round(open_snapshot_ms, 2),
        "open_intervals": open_intervals,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--spans", action="store_true", help="also build and export a span per request")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(main(args.n, args.spans)), indent=2))
