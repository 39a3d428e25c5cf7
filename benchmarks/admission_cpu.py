"""What the admission filter costs per request by itself, in-process: the CPU of its decision and release.

``overhead.py`` measures admission through a real gateway, where a 2-core host's run-to-run spread (up to
30% of a ~300 us request) hides the filter's own share. This times the filter alone, as the gateway calls
it: ``AdmissionFilter(call, next)`` for a fresh call, ``next`` answering at once with usage (a backend's
first token and end stamped), the reply closed ``--inflight`` requests later, so that many are in flight
when each is offered (the overhead benchmark's c=16). The same loop through a no-op filter is the baseline;
the difference is the filter's cost per request.

    python benchmarks/admission_cpu.py [--requests 20000] [--repeats 5] [--inflight 16] [--tenant] [--stream]
        [--body-kb N]

``--tenant``: the requests carry a tenant with rpm, tpm and a budget (the limits' and the budget's
bookkeeping, in-process); ``--stream``: streamed requests (a first token each, its hook called);
``--body-kb``: each request's body about that many KB (a long conversation; each body its own bytes, as
each request's are).
Reports the median over repeats of the per-request time with the filter and with the no-op, in us.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from usefulwork.config import from_mapping  # noqa: E402
from usefulwork.gateway.admission.filter import AdmissionFilter  # noqa: E402
from usefulwork.gateway.context import NullAccountant, RequestContext  # noqa: E402
from usefulwork.gateway.filters.noop import NoopFilter  # noqa: E402
from usefulwork.gateway.pipeline import Call, Reply, Services  # noqa: E402
from usefulwork.upstream.fleet import Fleet  # noqa: E402

MODEL = "m"


def body_of(kb: float) -> tuple[dict, bytes]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * max(8, int(kb * 1024 / 6))}],
            "max_tokens": 16}
    return body, orjson.dumps(body)


def build(tenant: bool) -> tuple[AdmissionFilter, Fleet]:
    tenants = {"t": {"key_hashes": [], "rpm": 10**9, "tpm": 10**12, "budget_usd_per_day": 1e12}} if tenant else {}
    cfg = from_mapping({"pools": [{"name": "p", "models": [MODEL], "replicas": ["http://127.0.0.1:9"],
                                   "prices": {"input_per_1m": 1.0, "output_per_1m": 1.0}}],
                        "tenants": tenants}, environ={})
    fleet = Fleet(cfg)
    return AdmissionFilter(Services(cfg=cfg, fleet=fleet, accountant=NullAccountant())), fleet


async def backend(call: Call) -> Reply:
    ctx = call.ctx
    ctx.t_forwarded = ctx.t_first_token = time.perf_counter()
    if ctx.on_first_token is not None:
        ctx.on_first_token()
    ctx.prompt_tokens, ctx.completion_tokens = 20, 16
    ctx.usage_source = "backend"
    ctx.outcome = "ok"
    ctx.status_code = 200
    return Reply(200, body=b"{}")


async def run(flt, fleet: Fleet, requests: int, inflight: int, tenant: bool, stream: bool, kb: float = 0.0) -> float:
    pool = fleet.pool_for_model(MODEL)
    body, raw = body_of(kb)
    raws = [bytes(bytearray(raw)) for _ in range(64)]  # (a bytes object caches its hash: fresh ones, reused)
    headers = [(b"content-type", b"application/json")]
    name = "t" if tenant else "default"
    open_replies: list[Reply] = []
    t0 = time.perf_counter()
    for i in range(requests):
        ctx = RequestContext(id="r", endpoint="chat", model=MODEL, stream=stream, tenant=name)
        call = Call(ctx=ctx, op="chat", path=b"/v1/chat/completions", body=body, raw=bytes(bytearray(raws[i % 64])),
                    pool=pool, headers=headers)
        reply = await flt(call, backend)
        open_replies.append(reply)
        if len(open_replies) > inflight:
            await open_replies.pop(0).aclose()
    for r in open_replies:
        await r.aclose()
    return (time.perf_counter() - t0) / requests * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--tenant", action="store_true")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--body-kb", type=float, default=0.0)
    a = ap.parse_args()

    async def go():
        adm, fleet = build(a.tenant)
        noop = NoopFilter()
        await run(adm, fleet, 2000, a.inflight, a.tenant, a.stream, a.body_kb)  # warm: the capacity has samples
        with_f, without = [], []
        for _ in range(a.repeats):
            without.append(await run(noop, fleet, a.requests, a.inflight, a.tenant, a.stream, a.body_kb))
            with_f.append(await run(adm, fleet, a.requests, a.inflight, a.tenant, a.stream, a.body_kb))
        return statistics.median(with_f), statistics.median(without), adm

    w, wo, adm = asyncio.run(go())
    print(f"admission {w:.1f} us/request, no-op {wo:.1f} us/request: the filter costs {w - wo:.1f} us "
          f"(inflight {a.inflight}, tenant {a.tenant}, stream {a.stream}, body {a.body_kb:g} KB; decisions {dict(adm.decisions)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
