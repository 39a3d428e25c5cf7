"""Retries behind several gateway processes, on the wall clock: the admission experiment's burst-retry cell
sent through N real gateways (`usefulwork serve`, the admission filter on) in front of one simulated
A100-80G (Llama-3.1-8B, 512 prompt / 128 output tokens), each attempt to the next gateway (a load balancer's
round robin per request, Envoy's default), so a client's retry reaches another gateway than the one that
shed it n - 1 times in n.

The cell (as `benchmarks/admission_virtual.py --retry`, in simulated seconds): 40 s at 13 req/s and 20 s at
2 req/s from a tenant whose clients never retry (the gateways learn the pool), then 9 s at 25 req/s and 36 s
at 2 req/s from another tenant's clients, which wait out Retry-After (``retry-after-ms``) and retry up to 3
times, numbering each attempt in ``x-stainless-retry-count`` as the OpenAI SDKs do. Figures: the share of
first retries admitted (the issue's target: 80%), the retrying clients' answers within the SLO from
each attempt's own send, and their time from the first send to the answer's end. The simulator runs at half speed (``--time-scale``, as the admission experiment:
this 2-core host cannot relay a full batch in real time); rates, durations and the SLO are converted.

    python benchmarks/gateways_retry.py --gateways 3
    PYTHONPATH=/path/to/other/checkout python benchmarks/gateways_retry.py --gateways 3   # its gateways' code
    USEFULWORK_GATEWAY_LOG_LEVEL=debug python benchmarks/gateways_retry.py --gateways 3 --keep DIR  # each shed's figures
    python benchmarks/gateways_retry.py --gateways 3 --redis URL [--no-lend]  # shared through Redis [no places lent]

The gateway processes run whatever ``usefulwork`` the environment's PYTHONPATH gives them; the client is
this file's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from usefulwork.backends.sim.process import SimProcess  # noqa: E402
from usefulwork.gateway.tenants import hash_key  # noqa: E402
from usefulwork.loadtest.client import retry_after  # noqa: E402
from usefulwork.loadtest.experiment import Gateway, _admission_in_wall_time, free_port  # noqa: E402
from usefulwork.loadtest.workloads import random_text  # noqa: E402

MODEL = "llama"
SLO = (2.0, 0.1, 5.0)  # TTFT, TPOT, E2E (simulated seconds): the admission experiment's
PHASES = [(40.0, 13.0, "warm"), (20.0, 2.0, "warm"), (9.0, 25.0, "retrying"), (36.0, 2.0, "retrying")]
KEYS = {"warm": "uw-gr-warm", "retrying": "uw-gr-retrying"}
ADMIN = "uw-gr-admin"  # reads each gateway's /usefulwork/stats at the end
MAX_RETRIES = 3


def arrivals(seed: int) -> list[tuple[float, str]]:
    """(simulated send time, tenant) per request: Poisson within each phase."""
    rng, out, t0 = random.Random(seed), [], 0.0
    for length, rate, tenant in PHASES:
        t = t0
        while (t := t + rng.expovariate(rate)) < t0 + length:
            out.append((t, tenant))
        t0 += length
    return out


class Balancer:
    """Each attempt goes to the next gateway (``sticky``: every attempt of a request to one gateway, as a
    client that keeps its connection: the control)."""

    def __init__(self, urls: list[str], sticky: bool = False):
        self.urls, self.n, self.sticky = urls, 0, sticky

    def next(self, i: int) -> str:
        url = self.urls[(i if self.sticky else self.n) % len(self.urls)]
        self.n += 1
        return url


async def attempt(client: httpx.AsyncClient, url: str, body: dict, headers: dict
                  ) -> tuple[int, float | None, float | None, float, str | None]:
    """One streamed attempt: (status, Retry-After s, TTFT s, E2E s from its own send, shed reason)."""
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return (r.status_code, retry_after(r.headers), None, time.perf_counter() - t0,
                    r.headers.get("x-usefulwork-shed-reason"))
        async for chunk in r.aiter_bytes():
            if ttft is None and b'"text"' in chunk:
                ttft = time.perf_counter() - t0
    return 200, None, ttft, time.perf_counter() - t0, None


async def request(client: httpx.AsyncClient, lb: Balancer, i: int, tenant: str, at: float, scale: float,
                  t_start: float, rng: np.random.Generator) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t_start + at / scale - time.perf_counter()))
    first_send = time.perf_counter()
    body = {"model": MODEL, "prompt": f"{i} " + random_text(rng, 511), "max_tokens": 128, "ignore_eos": True,
            "stream": True}
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    retries = MAX_RETRIES if tenant == "retrying" else 0
    out: dict[str, Any] = {"tenant": tenant, "attempts": 0, "first_retry": "", "outcome": "shed"}
    for n in range(retries + 1):
        if retries:
            headers["x-stainless-retry-count"] = str(n)  # (0 on the first attempt, as the SDKs send)
        status, wait, ttft, e2e, reason = await attempt(client, lb.next(i), body, headers)
        out["attempts"] += 1
        if n == 0 and wait is not None:
            out["told_s"] = wait * scale
        if n == 1:
            out["first_retry"] = "shed" if status == 429 else "admitted"
            out["first_retry_reason"] = reason
        if status != 429:
            out["outcome"] = "ok" if status == 200 else f"http {status}"
            out["ttft_s"], out["e2e_s"] = (ttft or e2e) * scale, e2e * scale  # simulated seconds
            out["answer_s"] = (time.perf_counter() - first_send) * scale  # from the first send to the end
            break
        if wait is None or n == retries:
            break
        await asyncio.sleep(wait)
    return out


def _drop_keys(url: str, prefix: str) -> None:
    import redis

    r = redis.Redis.from_url(url)
    try:
        keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            r.delete(*keys)
    finally:
        r.close()


def run(n_gateways: int, seed: int, scale: float, workdir: Path, sticky: bool = False,
        redis_url: str | None = None, lend: bool = True) -> dict[str, Any]:
    sim = SimProcess(gpu="A100-80G", model="Llama-3.1-8B", served_name=MODEL, port=free_port(), time_scale=scale,
                     log_path=workdir / "sim.log")
    sim.start()
    gateways: list[Gateway] = []
    prefix = f"uw-gr-{time.time_ns()}"  # this run's Redis keys, removed when it ends
    try:
        sim.wait_ready(timeout_s=60)
        cfg = {"pools": [{"name": "a100", "models": [MODEL], "replicas": [sim.base_url]}],
               "filters": ["admission"],
               "slo": {"ttft_ms": SLO[0] * 1e3 / scale, "tpot_ms": SLO[1] * 1e3 / scale, "e2e_ms": SLO[2] * 1e3 / scale},
               "admission": _admission_in_wall_time({"redis_url": redis_url, "redis_prefix": prefix, "lend_places": lend}
                                                    if redis_url else {}, scale),
               "tenants": {t: {"key_hashes": [hash_key(k)]} for t, k in KEYS.items()},
               "access": {"admin_key_hashes": [hash_key(ADMIN)]},
               "timeouts": {"first_byte_s": 600.0, "read_s": 600.0}}
        for _ in range(n_gateways):
            gateways.append(Gateway({**cfg, "listen": {"host": "127.0.0.1", "port": free_port()}}, workdir).start())
        lb = Balancer([g.base_url for g in gateways], sticky)
        rng = np.random.default_rng(seed)

        async def go() -> list[dict[str, Any]]:
            limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256)
            async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
                t_start = time.perf_counter() + 0.5
                return await asyncio.gather(*(request(client, lb, i, tenant, at, scale, t_start, rng)
                                              for i, (at, tenant) in enumerate(arrivals(seed))))

        reqs = asyncio.run(go())
        pools = [httpx.get(g.base_url + "/usefulwork/stats", headers={"authorization": f"Bearer {ADMIN}"}
                           ).json()["filters"]["admission"]["pools"]["a100"] for g in gateways]
    finally:
        for g in gateways:
            g.stop()
        sim.stop()
        if redis_url:
            _drop_keys(redis_url, prefix)
    back = [r for r in reqs if r["tenant"] == "retrying"]
    retried = [r for r in back if r["first_retry"]]
    served = [r for r in back if r["outcome"] == "ok"]
    good = [r for r in served if r["ttft_s"] <= SLO[0] and r["e2e_s"] <= SLO[2]]
    return {"gateways": n_gateways, "balance": "sticky" if sticky else "round-robin", "redis": bool(redis_url), "seed": seed, "time_scale": scale, "sent": len(back), "served": len(served),
            "first_retries": len(retried), "admitted_on_first_retry": sum(r["first_retry"] == "admitted" for r in retried),
            "within_slo_of_served": len(good) / len(served) if served else None,
            "errors": sum(1 for r in reqs if r["outcome"].startswith("http")),
            "first_retry_shed_reasons": {x: sum(1 for r in retried if r.get("first_retry_reason") == x)
                                         for x in {r.get("first_retry_reason") for r in retried if r["first_retry"] == "shed"}},
            "answer_s_p50_p95": ([round(float(x), 3) for x in np.percentile([r["answer_s"] for r in served], [50, 95])]
                                 if served else None),
            "told_s_median": float(np.median([r["told_s"] for r in back if "told_s" in r])) if any("told_s" in r for r in back) else None,
            "per_gateway": [{"retries_honoured": p["retries_honoured"], "retries_placeless": p.get("retries_placeless"),
                             "retries_unproven": p.get("retries_unproven"), "places_borrowed": p.get("places_borrowed"),
                             "places_claimed": p.get("places_claimed"), "shed": p["shed"],
                             "retry_return_rate": p["retry_return_rate"], "limit": p["capacity"]["limit"]} for p in pools]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gateways", type=int, default=3)
    ap.add_argument("--seeds", default="1", help="comma-separated seeds, one run each")
    ap.add_argument("--time-scale", type=float, default=0.5, help="simulated seconds per wall second")
    ap.add_argument("--sticky", action="store_true", help="every attempt of a request to one gateway (the control)")
    ap.add_argument("--redis", default=None, metavar="URL",
                    help="the gateways share limits, fair-share counters and the retries' returns through this Redis")
    ap.add_argument("--no-lend", action="store_true", help="with --redis: the gateways lend no places (lend_places: false)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None, metavar="DIR",
                    help="keep each run's gateway and simulator logs under DIR/seed-S (with "
                         "USEFULWORK_GATEWAY_LOG_LEVEL=debug: a line per shed at arrival, with what it read)")
    args = ap.parse_args()
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        if args.keep is not None:
            d = args.keep / f"seed-{seed}"
            d.mkdir(parents=True, exist_ok=True)
            r = run(args.gateways, seed, args.time_scale, d, args.sticky, args.redis, not args.no_lend)
        else:
            with tempfile.TemporaryDirectory() as d:
                r = run(args.gateways, seed, args.time_scale, Path(d), args.sticky, args.redis, not args.no_lend)
        rows.append(r)
        share = r["admitted_on_first_retry"] / max(1, r["first_retries"])
        within = "-" if r["within_slo_of_served"] is None else f"{r['within_slo_of_served']:.1%}"
        print(f"gateways {r['gateways']} ({r['balance']}) seed {seed}: retrying clients sent {r['sent']}, served {r['served']}, "
              f"first retries admitted {r['admitted_on_first_retry']} of {r['first_retries']} ({share:.1%}), "
              f"served within the SLO {within}, errors {r['errors']}; first retries shed: {r['first_retry_shed_reasons']}; "
              f"Retry-After median {r['told_s_median']} s; first send to answer p50/p95 {r['answer_s_p50_p95']} s; per gateway {r['per_gateway']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
