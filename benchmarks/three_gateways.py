"""Scale-out: three gateway processes sharing Redis in front of the zero-think-time mock.

Each gateway is a real `usefulwork serve --config` process with the fleet-wide setup: the admission
filter with tenant limits in Redis, the response cache in Redis (exact keys), the shared GPU books
and live stats (``scale_out.redis_url``) and its own JSONL ledger. Phases, in one run:

1. **latency**: open-loop load at ``--rate`` req/s in total (fixed spacing), round-robin over the
   three gateways, then the same straight to the mock; added = via gateways - direct (p50, p99).
2. **cache**: a request through gateway 0 (miss, stored), the same through gateways 1 and 2 (hits).
3. **bursts**: a tenant with ``rpm`` R sends ``--bursts`` bursts of 2R requests spread over the three
   gateways; admitted vs the token bucket's allowance (R + R/60 x elapsed): overshoot.
4. **kill**: the latency load again; half-way, SIGTERM to gateway 2 (the client moves to the other
   two on a refused or dropped connection). Every request the client got a 200 for must have a
   ledger record (matched by ``x-request-id``); the dead gateway's records are in its ledger file.
   Then the same with SIGKILL on a fresh trio (its own GPU books): what a hard kill loses.

    flock /tmp/usefulwork-bench.lock python benchmarks/three_gateways.py [--rate 300] [--duration 20]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import redis
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.overhead import free_port, wait_http  # noqa: E402
from usefulwork.gateway.tenants import hash_key  # noqa: E402

REDIS = os.environ.get("USEFULWORK_BENCH_REDIS_URL", "redis://127.0.0.1:6379/14")
BODY = {"model": "mock", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16, "temperature": 0.7}


def _request(body: dict, key: str, rid: str) -> bytes:
    raw = json.dumps(body, separators=(",", ":")).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + key.encode() + b"\r\nx-request-id: " + rid.encode() +
            b"\r\ncontent-length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)


async def _exchange(conn, req: bytes) -> tuple[int, bool]:
    """Send one request, read its (Content-Length) answer: (status, connection reusable)."""
    reader, writer = conn
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    low = head.lower()
    i = low.find(b"content-length:")
    await reader.readexactly(int(low[i + 15:low.find(b"\r\n", i)]))
    return int(head[9:12]), b"connection: close" not in low


class OpenLoop:
    """Fixed-rate arrivals over several ports (round robin), keep-alive connections per port; a port
    that refuses or drops a connection before the answer is skipped and the request goes to the next."""

    def __init__(self, ports: list[int]):
        self.ports = ports
        self.idle: dict[int, list] = {p: [] for p in ports}
        self.dead: set[int] = set()
        self.lat: list[float] = []
        self.acked: dict[int, list[str]] = {p: [] for p in ports}
        self.status: dict[int, int] = {}
        self.failovers = 0

    async def one(self, i: int, req_of, slot: int) -> None:
        for attempt in range(len(self.ports)):
            port = self.ports[(slot + attempt) % len(self.ports)]
            if port in self.dead:
                continue
            rid = f"r{i}-{attempt}"
            conn = self.idle[port].pop() if self.idle[port] else None
            t0 = time.perf_counter()
            try:
                if conn is None:
                    conn = await asyncio.open_connection("127.0.0.1", port)
                status, reuse = await _exchange(conn, req_of(rid))
            except (OSError, asyncio.IncompleteReadError):  # refused, or dropped before the answer
                if conn is not None:
                    conn[1].close()
                self.failovers += 1
                try:
                    _, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 0.2)
                    w.close()
                except (OSError, asyncio.TimeoutError):
                    self.dead.add(port)  # refuses new connections: gone
                continue
            self.lat.append(time.perf_counter() - t0)
            self.status[status] = self.status.get(status, 0) + 1
            if status == 200:
                self.acked[port].append(rid)
            if reuse:
                self.idle[port].append(conn)
            else:
                conn[1].close()
            return

    async def run(self, rate: float, duration: float, req_of, at=None) -> dict:
        n = int(rate * duration)
        t0 = time.perf_counter()
        tasks = []
        for i in range(n):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if at is not None and i == n // 2:
                at()
            tasks.append(asyncio.create_task(self.one(i, req_of, i % len(self.ports))))
        await asyncio.gather(*tasks)
        for conns in self.idle.values():
            for _, w in conns:
                w.close()
        self.idle = {p: [] for p in self.ports}
        a = np.array(self.lat) * 1000
        return {"requests": n, "answered": len(self.lat), "achieved_rps": len(self.lat) / (time.perf_counter() - t0),
                "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
                "status": dict(self.status), "failovers": self.failovers}


VARIANTS = {
    "scale-out": "admission (tenant limits in Redis) + cache (Redis) + shared GPU books and stats (Redis)",
    "per-process-stats": "the same filters, no scale_out.redis_url (each gateway its own stats and GPU books)",
    "bare": "no filters, no Redis: the proxy and the ledger only",
    "admission-only": "the admission filter (tenant limits in Redis) alone, no scale_out",
    "cache-only": "the cache filter (Redis, the request not cacheable: bypass) alone, no scale_out",
}


def gateway_cfg(tmp: Path, name: str, mock_port: int, prefix: str, variant: str = "scale-out") -> Path:
    cfg = {
        "pools": [{"name": "mock", "models": ["mock"], "replicas": [f"http://127.0.0.1:{mock_port}"],
                   "gpu": {"type": "A100-80G", "count": 1, "usd_per_hour": 3.6}}],
        "timeouts": {"health_interval_s": 5},
        "filters": ["admission", "cache"],
        "tenants": {"bench": {"key_hashes": [hash_key("bench-key")], "rpm": 10_000_000},
                    "burst": {"key_hashes": [hash_key("burst-key")], "rpm": 600}},
        "admission": {"redis_url": REDIS, "redis_prefix": f"{prefix}:adm", "initial_concurrency": 256},
        "cache": {"redis_url": REDIS, "namespace": f"{prefix}:cache", "semantic": {"enabled": False}},
        "scale_out": {"redis_url": REDIS, "prefix": f"{prefix}:fleet"},
        # one journal directory for the trio: a survivor writes a killed gateway's records (docs/reliability.md)
        "ledger": {"jsonl_path": str(tmp / f"{name}.jsonl"), "journal_dir": str(tmp / "journal")},
    }
    if variant != "scale-out":
        del cfg["scale_out"]
    if variant == "bare":
        for k in ("filters", "tenants", "admission", "cache"):
            del cfg[k]
    if variant.endswith("-only"):
        cfg["filters"] = [variant.removesuffix("-only")]
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def ledger(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_bytes().splitlines() if x.strip()] if path.exists() else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=300.0, help="req/s in total over the three gateways")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per latency phase")
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--variants", default="scale-out,per-process-stats,bare",
                    help="gateway setups whose latency is measured (scale-out is always the one of the other phases)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import uvloop

    uvloop.install()
    prefix = f"uwbench:{uuid.uuid4().hex[:8]}"
    tmp = Path(tempfile.mkdtemp(prefix="uw-3gw-"))
    mock_port = free_port()
    procs: list[subprocess.Popen] = []
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rate": args.rate,
                 "duration_s": args.duration, "command": "python benchmarks/three_gateways.py " + " ".join(sys.argv[1:])}
    try:
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "mock_openai.py"), "--port", str(mock_port)]))
        wait_http(f"http://127.0.0.1:{mock_port}/health")

        def start(variant: str, tag: str, pfx: str = prefix) -> tuple[list[subprocess.Popen], list[int]]:
            gws, ports = [], []
            for i in range(3):
                port = free_port()
                gw = subprocess.Popen([sys.executable, "-m", "usefulwork.cli", "serve", "--config",
                                       str(gateway_cfg(tmp, f"{tag}gw{i}", mock_port, pfx, variant)), "--port", str(port)],
                                      stdout=open(tmp / f"{tag}gw{i}.log", "wb"), stderr=subprocess.STDOUT,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)})
                procs.append(gw)
                gws.append(gw)
                ports.append(port)
            for p in ports:
                wait_http(f"http://127.0.0.1:{p}/readyz", timeout=60)
            return gws, ports

        def bench_req(rid: str) -> bytes:
            return _request(BODY, "bench-key", rid)

        # 1. latency: through the gateways, then direct (same rate, same client), per variant
        out["latency"] = {}
        for variant in args.variants.split(","):
            if variant == "scale-out":
                continue  # measured last, on the gateways the other phases use
            vg, vp = start(variant, variant)
            asyncio.run(OpenLoop(vp).run(args.rate, 2.0, bench_req))  # warm-up
            via = asyncio.run(OpenLoop(vp).run(args.rate, args.duration, bench_req))
            for gw in vg:
                gw.send_signal(signal.SIGTERM)
                gw.wait(30)
            out["latency"][variant] = {"via": via}
        gws, ports = start("scale-out", "")
        asyncio.run(OpenLoop(ports).run(args.rate, 2.0, bench_req))  # warm-up
        out["latency"]["scale-out"] = {"via": asyncio.run(OpenLoop(ports).run(args.rate, args.duration, bench_req))}
        direct = asyncio.run(OpenLoop([mock_port] * 3).run(args.rate, args.duration, bench_req))
        for variant, row in out["latency"].items():
            row.update(direct=direct, added_p50_ms=row["via"]["p50_ms"] - direct["p50_ms"],
                       added_p99_ms=row["via"]["p99_ms"] - direct["p99_ms"], what=VARIANTS[variant])
            print("latency", variant, f"added p50 {row['added_p50_ms']:.3f} ms p99 {row['added_p99_ms']:.3f} ms;",
                  json.dumps(row["via"]), flush=True)
        out["latency_loadavg"] = os.getloadavg()
        print("direct", json.dumps(direct), "loadavg", out["latency_loadavg"], flush=True)

        # 2. cache: stored through gateway 0, served by 1 and 2
        body = {**BODY, "temperature": 0, "messages": [{"role": "user", "content": f"cache probe {uuid.uuid4()}"}]}
        hdr = {"authorization": "Bearer bench-key"}
        seen = []
        for p in ports:
            r = httpx.post(f"http://127.0.0.1:{p}/v1/chat/completions", json=body, headers=hdr, timeout=10)
            seen.append(r.headers.get("x-usefulwork-cache"))
            time.sleep(0.3)  # the miss is stored off the request path
        out["cache"] = {"headers": seen, "hit_by_others": seen[0] == "miss" and seen[1:] == ["hit-exact"] * 2}
        print("cache", out["cache"], flush=True)

        # 3. bursts against a fleet-wide rpm limit
        rpm = 600
        loop = OpenLoop(ports)
        t_first = time.time()
        for b in range(args.bursts):
            asyncio.run(loop.run(2000.0, 2 * rpm / 2000.0, lambda rid, b=b: _request(BODY, "burst-key", f"b{b}-{rid}")))
            time.sleep(1.0)
        elapsed = time.time() - t_first
        admitted = loop.status.get(200, 0)
        allowed = rpm + rpm / 60.0 * elapsed
        out["bursts"] = {"rpm": rpm, "sent": args.bursts * 2 * rpm, "admitted": admitted, "refused_429": loop.status.get(429, 0),
                         "elapsed_s": elapsed, "allowed_max": allowed,
                         "overshoot": max(0.0, admitted - allowed) / allowed, "loadavg": os.getloadavg()}
        print("bursts", out["bursts"], flush=True)

        # 4. kill one gateway mid-run: no acknowledged request without its ledger record (SIGTERM; then
        # SIGKILL on a fresh trio with its own books: the survivors write the killed one's journaled records,
        # marked recovered, without GPU $; its share of the books dies with it)
        def kill_phase(gws, ports, sig, tag: str, books_prefix: str) -> dict:
            kill_loop = OpenLoop(ports)
            res = asyncio.run(kill_loop.run(args.rate, args.duration, bench_req, at=lambda: gws[2].send_signal(sig)))
            rc2 = gws[2].wait(timeout=60)
            time.sleep(1.0)
            for gw in gws[:2]:
                gw.send_signal(signal.SIGTERM)
            rcs = [gw.wait(timeout=60) for gw in gws[:2]] + [rc2]
            recs = [r for i in range(3) for r in ledger(tmp / f"{tag}gw{i}.jsonl")]
            ids = {r.get("client_request_id") for r in recs}
            acked = [rid for p in ports for rid in kill_loop.acked[p]]
            lost = [rid for rid in acked if rid not in ids]
            r = redis.Redis.from_url(REDIS)
            books = {k.decode(): float(v) for k, v in r.hgetall(f"{books_prefix}:fleet:gpu:{{mock}}:books").items()}
            paid = sum(x["gpu_cost_usd"] or 0.0 for x in recs)
            return {**res, "signal": signal.Signals(sig).name, "exit_codes": rcs, "acknowledged": len(acked),
                    "acknowledged_by_killed": len(kill_loop.acked[ports[2]]), "lost": len(lost), "lost_sample": lost[:5],
                    "recovered": sum(1 for r in recs if r.get("recovered")),
                    "written_twice": len(recs) - len({r["id"] for r in recs}),
                    "gpu_books": {**books, "ledger_gpu_cost_usd": paid, "conservation_error": books.get("attributed_usd", 0)
                                  + books.get("idle_usd", 0) - books.get("cost_usd", 0)},
                    "loadavg": os.getloadavg()}

        out["kill"] = kill_phase(gws, ports, signal.SIGTERM, "", prefix)
        print("kill", json.dumps(out["kill"]), flush=True)
        kgws, kports = start("scale-out", "k9", f"{prefix}:k9")
        asyncio.run(OpenLoop(kports).run(args.rate, 2.0, bench_req))  # warm-up
        out["kill9"] = kill_phase(kgws, kports, signal.SIGKILL, "k9", f"{prefix}:k9")
        print("kill9", json.dumps(out["kill9"]), flush=True)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        r = redis.Redis.from_url(REDIS)
        for key in r.scan_iter(f"{prefix}:*"):
            r.delete(key)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
