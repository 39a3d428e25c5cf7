"""What the ``record`` filter costs a request, measured in-process (robust to a busy machine).

Runs N calls through the chain [filter] -> a fake upstream, closing each reply the way the endpoint
does, once with the ``noop`` filter and once with ``record`` (sample 1.0, redaction off and on),
and reports the per-request time on the event loop (p50/p99 of each call's chain + close) and the
writer thread's CPU per record (serialisation, prefix hashes, file write). Target (issue #13):
recording adds at most 1 ms p99 to a request. The end-to-end figure (through uvicorn) is
``benchmarks/overhead.py --variant none=. --variant record=.:record``.

    python benchmarks/record_cost.py [--requests 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time

import numpy as np

from usefulwork.config import from_mapping
from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.filters import build_filters
from usefulwork.gateway.pipeline import Call, Reply, Services

PROMPT = "Explain how a KV cache works in a transformer, step by step. " * 40  # ~2.4K characters


async def measure(names: list[str], record: dict, n: int) -> tuple[np.ndarray, dict]:
    cfg = from_mapping({"filters": names, "record": record}, environ={})
    [f] = build_filters(cfg.filters, Services(cfg=cfg, fleet=None, accountant=None))
    if hasattr(f, "start"):
        await f.start()

    async def upstream(call: Call) -> Reply:
        return Reply(200, body=b"{}")

    lat = np.empty(n)
    for i in range(n):
        ctx = RequestContext(id=str(i), endpoint="chat", model="m", stream=False)
        call = Call(ctx=ctx, op="chat", path=b"/v1/chat/completions", raw=None, pool=None, headers=[],
                    body={"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 64})
        t = time.perf_counter()
        reply = await f(call, upstream)
        await reply.aclose()
        ctx.t_end = time.perf_counter()
        lat[i] = ctx.t_end - t
        if i % 200 == 0:
            await asyncio.sleep(0)  # let the drain task run, as a live loop would
    if hasattr(f, "stop"):
        await f.stop()
    return lat * 1e6, (f.stats() if hasattr(f, "stats") else {})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [("noop", ["noop"], {}), ("record", ["record"], {"dir": tmp + "/a"}),
                ("record redact", ["record"], {"dir": tmp + "/b", "redact": True})]
        for label, names, rec in rows:
            t0 = time.process_time()
            lat, st = asyncio.run(measure(names, rec, args.requests))
            cpu = (time.process_time() - t0) / args.requests * 1e6
            print(f"{label:14} per request on the loop: p50 {np.percentile(lat, 50):6.1f} us  p99 "
                  f"{np.percentile(lat, 99):6.1f} us   process CPU {cpu:6.1f} us/request (incl. writer)  "
                  f"written {st.get('written', 0)}, dropped (queue full) {st.get('dropped_queue', 0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
