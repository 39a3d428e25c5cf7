"""What a filter costs by itself: the chain with N no-op filters against the bare handler, in-process.

The end-to-end benchmark (overhead.py) measures a gateway with four no-op filters, but on a shared
2-core machine its run-to-run spread (tens of microseconds of CPU per request) hides a cost of a
few microseconds. This times the chain alone: ``chain([NoopFilter()] * n, last)(call)`` awaited in a
loop, the same call object each time, ``last`` returning a prepared Reply.

    python benchmarks/filter_chain.py [--filters 4] [--calls 200000] [--repeats 5]

Reports the median over repeats of the per-call time with n filters, with none, and the difference
per filter.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.filters.noop import NoopFilter
from usefulwork.gateway.pipeline import Call, Reply, chain


async def _time(handler, call: Call, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        await handler(call)
    return (time.perf_counter() - t0) / calls * 1e6


async def main_async(n: int, calls: int, repeats: int) -> dict:
    reply = Reply(200, body=b"{}")

    async def last(call: Call) -> Reply:
        return reply

    ctx = RequestContext(id="bench", endpoint="chat", model="m", stream=False)
    call = Call(ctx=ctx, op="chat", path=b"/v1/chat/completions", body={}, raw=b"{}", pool=None, headers=[])
    bare, with_filters = chain([], last), chain([NoopFilter() for _ in range(n)], last)
    a, b = [], []
    for _ in range(repeats):  # interleaved, so drift on a shared machine hits both alike
        a.append(await _time(bare, call, calls))
        b.append(await _time(with_filters, call, calls))
    none_us, with_us = statistics.median(a), statistics.median(b)
    return {"filters": n, "bare_us": none_us, "with_filters_us": with_us,
            "added_us": with_us - none_us, "per_filter_us": (with_us - none_us) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--filters", type=int, default=4)
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    r = asyncio.run(main_async(args.filters, args.calls, args.repeats))
    print(f"bare chain {r['bare_us']:.3f} us/call; with {r['filters']} no-op filters {r['with_filters_us']:.3f} us/call; "
          f"added {r['added_us']:.3f} us ({r['per_filter_us']:.3f} us per filter)")


if __name__ == "__main__":
    main()
