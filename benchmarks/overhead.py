"""Gateway overhead: the same zero-think-time mock measured directly and through the gateway.

Layout (2 cores): the gateway runs as ONE uvicorn worker pinned to core 0; the mock backend and
the load generator share core 1. For each mode (non-streaming, streaming with 16 chunks) and
concurrency (1, 16, 64) it runs the load directly against the mock, then through the gateway, in
the same run, and reports requests/s and the latency the gateway adds (p50, p99).

The load generator is a raw HTTP/1.1 keep-alive client on asyncio Protocols (uvloop), so it is
never the bottleneck: it parses just enough (Content-Length or chunked framing) to know where a
response ends, and checks every stream carried all 16 content events and [DONE].

    python benchmarks/overhead.py [--duration 8] [--accounting off] [--markdown FILE] [--json FILE]
        [--variant NAME=SRC_DIR[:filter+filter...]] ...

Each ``--variant`` is a gateway measured in the same run, interleaved with the others at every point:
SRC_DIR is a checkout of usefulwork (``.`` for this one; a ``git worktree`` of an older commit for a
before/after comparison) and the optional filter list is put in its config (``noop+noop+noop+noop``
measures what four filters cost). Without ``--variant``: one variant, this checkout, no filters.
``--overlay NAME=JSON`` deep-merges a config fragment into that variant's config (the string
``{mock}`` in it becomes the mock's URL), for filters that need settings (a router's virtual model,
a cache without its semantic stage). ``--unique`` makes every request's prompt different (a counter
in the message, same length), so a cache measures its miss path rather than serving hits.
``--prompt-kb K`` sends prompts of K KB of English-like text (a RAG prompt) instead of two words: what
the gateway parses, validates, counts and hashes per request grows with the body.

Besides latency, it reports the gateway's CPU time per request (utime + stime of the gateway process
over the run, from /proc, divided by every request it served then, the warm-up's included): robust to
other load on the machine, where
throughput is not. ``--accounting off`` swaps the accountant for a no-op to measure the proxy alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
NONCE = b"000000000000"  # --unique: replaced in each request by a counter of the same width
FILLER = "the quick brown fox jumps over the lazy dog while the model reads a long retrieved passage. "


def request_body(stream: bool, prompt_kb: float = 0.0) -> bytes:
    """A chat completion's body: a short prompt, or one of ``prompt_kb`` KB of English-like text (a RAG
    prompt: what the gateway parses, validates, counts and hashes grows with it)."""
    text = "hello " + NONCE.decode()
    if prompt_kb > 0:
        n = int(prompt_kb * 1024)
        text += " " + (FILLER * (n // len(FILLER) + 1))[:n]
    body = {"model": "mock", "messages": [{"role": "user", "content": text}], "max_tokens": 16}
    if stream:
        body["stream"] = True
    return json.dumps(body, separators=(",", ":")).encode()


_sent = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Conn(asyncio.Protocol):
    """One keep-alive connection issuing requests back to back."""

    def __init__(self, request: bytes, stream: bool, deadline: float, lat: list, bad: list, done: asyncio.Future,
                 unique: bool = False):
        self.request = request
        self.unique = request.index(NONCE) if unique else -1
        self.stream = stream
        self.deadline = deadline
        self.lat = lat
        self.bad = bad
        self.done = done
        self.buf = b""
        self.t0 = 0.0
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._send()

    def _send(self) -> None:
        if time.perf_counter() >= self.deadline:
            self.transport.close()
            return
        self.buf = b""
        request = self.request
        if self.unique >= 0:
            global _sent
            _sent += 1
            request = b"%b%012d%b" % (request[:self.unique], _sent, request[self.unique + len(NONCE):])
        self.t0 = time.perf_counter()
        self.transport.write(request)

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].lower()
        body = self.buf[end + 4:]
        if b"transfer-encoding: chunked" in head:
            if not body.endswith(b"0\r\n\r\n"):
                return
            ok = head.startswith(b"http/1.1 200") and body.count(b"data: {") == 16 and b"data: [DONE]" in body
        else:
            i = head.find(b"content-length:")
            n = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None])
            if len(body) < n:
                return
            ok = head.startswith(b"http/1.1 200")
        self.lat.append(time.perf_counter() - self.t0)
        if not ok:
            self.bad.append(self.buf[:300])
        self._send()


async def load(port: int, stream: bool, concurrency: int, duration: float, unique: bool = False,
               prompt_kb: float = 0.0) -> dict:
    body = request_body(stream, prompt_kb)
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
           b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    bad: list[bytes] = []
    # warm-up (connections, caches), not measured
    warm_done = [loop.create_future() for _ in range(concurrency)]
    wend = time.perf_counter() + 1.0
    warm: list[float] = []
    for f in warm_done:
        await loop.create_connection(lambda f=f: Conn(req, stream, wend, warm, [], f, unique), "127.0.0.1", port)
    await asyncio.gather(*warm_done)
    futures = [loop.create_future() for _ in range(concurrency)]
    t_start = time.perf_counter()
    deadline = t_start + duration
    for f in futures:
        await loop.create_connection(lambda f=f: Conn(req, stream, deadline, lat, bad, f, unique), "127.0.0.1", port)
    await asyncio.gather(*futures)
    elapsed = time.perf_counter() - t_start
    a = np.array(lat) * 1000.0
    return {"requests": len(lat), "warmup_requests": len(warm), "errors": len(bad), "rps": len(lat) / elapsed,
            "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "sample_error": bad[0].decode("latin-1") if bad else None}


def run_load_process(port: int, stream: bool, concurrency: int, duration: float, core: str,
                     unique: bool = False, prompt_kb: float = 0.0) -> dict:
    """Run the load generator in its own process pinned to `core` (keeps the benchmark process idle)."""
    code = (f"import asyncio,json,sys; sys.path.insert(0,{str(ROOT)!r});"
            "import uvloop; uvloop.install();"
            "from benchmarks.overhead import load;"
            f"print(json.dumps(asyncio.run(load({port},{stream},{concurrency},{duration},{unique},{prompt_kb}))))")
    out = subprocess.run(["taskset", "-c", core, sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_seconds(pid: int) -> float:
    """CPU time of the process and of its live children (the workers of `serve --workers N`)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") + sum(cpu_seconds(int(k)) for k in kids)


def parse_variant(spec: str) -> tuple[str, Path, list[str]]:
    name, _, rest = spec.partition("=")
    src, _, filters = rest.partition(":")
    return name, (Path(src) if src else ROOT).resolve(), [f for f in filters.split("+") if f]


def merge(base: dict, overlay: dict) -> dict:
    """Deep-merge a config fragment (mappings merge; lists and scalars replace)."""
    out = dict(base)
    for k, v in overlay.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def gateway_child(config_path: str, port: int, accounting: str) -> None:
    """Run the gateway in this process (used as the benchmark's gateway subprocess)."""
    from usefulwork.config import load
    from usefulwork.gateway import accounting as acct
    from usefulwork.gateway.context import NullAccountant
    from usefulwork.gateway.serve import run_gateway

    if accounting == "off":
        acct.build = lambda cfg, fleet: acct.AccountingBundle(accountant=NullAccountant())
    cfg = load(config_path)
    run_gateway(cfg.model_copy(update={"listen": cfg.listen.model_copy(update={"port": port})}))


def filter_counts(port: int) -> dict:
    """The gateway's per-filter counters (``/usefulwork/stats``), flattened to ``filter.name``: numbers only."""
    import urllib.request  # noqa: PLC0415

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/usefulwork/stats", timeout=5) as r:
            filters = json.loads(r.read()).get("filters") or {}
    except OSError:
        return {}
    return {f"{f}.{k}": v for f, st in filters.items() if isinstance(st, dict)
            for k, v in st.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def wait_http(url: str, timeout: float = 30) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--gateway-core", default="0")
    ap.add_argument("--client-core", default="1")
    ap.add_argument("--accounting", choices=["on", "off"], default="on",
                    help="off: a no-op accountant, to measure the proxy alone")
    ap.add_argument("--workers", type=int, default=1,
                    help="gateway worker processes (`usefulwork serve --workers N`; give --gateway-core room, e.g. 0,1)")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=SRC_DIR[:filter+filter...]: a gateway to measure (repeatable; see the module doc)")
    ap.add_argument("--overlay", action="append", default=[],
                    help="NAME=JSON: a config fragment merged into that variant's config ({mock}: the mock's URL)")
    ap.add_argument("--unique", action="store_true", help="a different prompt in every request (cache misses)")
    ap.add_argument("--prompt-kb", type=float, default=0.0,
                    help="prompts of this many KB of English-like text (default: a two-word prompt)")
    ap.add_argument("--gateway-child", nargs=2, metavar=("CONFIG", "PORT"), help=argparse.SUPPRESS)
    ap.add_argument("--markdown", type=Path, help="write the results table to this file")
    ap.add_argument("--json", type=Path, help="write raw results here")
    args = ap.parse_args()
    if args.gateway_child:
        gateway_child(args.gateway_child[0], int(args.gateway_child[1]), args.accounting)
        return 0
    if args.workers > 1 and args.accounting == "off":
        ap.error("--accounting off needs --workers 1 (the workers run `usefulwork serve`)")
    conc = [int(c) for c in args.concurrency.split(",")]
    variants = [parse_variant(v) for v in args.variant] or [("gateway", ROOT, [])]
    overlays = {name: text for name, _, text in (o.partition("=") for o in args.overlay)}
    unknown = set(overlays) - {name for name, _, _ in variants}
    if unknown:
        ap.error(f"--overlay names no variant: {', '.join(sorted(unknown))}")
    mock_port = free_port()
    procs = []
    tmp = Path(tempfile.mkdtemp(prefix="uw-overhead-"))
    try:
        procs.append(subprocess.Popen(["taskset", "-c", args.client_core, sys.executable,
                                       str(ROOT / "benchmarks" / "mock_openai.py"), "--port", str(mock_port)]))
        gateways = {}
        for name, src, filters in variants:
            cfg = tmp / f"{name}.yaml"
            cfg_tree: dict = {"pools": [{"name": "mock", "models": ["mock"],
                                         "replicas": [f"http://127.0.0.1:{mock_port}"]}],
                              "timeouts": {"health_interval_s": 5}}
            if filters:
                cfg_tree["filters"] = filters
            if name in overlays:
                cfg_tree = merge(cfg_tree, json.loads(overlays[name].replace("{mock}", f"http://127.0.0.1:{mock_port}")))
            cfg.write_text(json.dumps(cfg_tree))
            port = free_port()
            # The variant's own checkout provides both the gateway and its child entry point.
            child = ["-m", "usefulwork.cli", "serve", "--config", str(cfg), "--port", str(port), "--workers",
                     str(args.workers)] if args.workers > 1 else \
                [str(src / "benchmarks" / "overhead.py"), "--accounting", args.accounting, "--gateway-child", str(cfg), str(port)]
            gw = subprocess.Popen(["taskset", "-c", args.gateway_core, sys.executable, *child],
                                  stdout=open(tmp / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONPATH": str(src)}, cwd=src)
            procs.append(gw)
            gateways[name] = (gw, port)
        wait_http(f"http://127.0.0.1:{mock_port}/health")
        for _, port in gateways.values():
            wait_http(f"http://127.0.0.1:{port}/readyz")
        rows = []
        for stream in (False, True):
            for c in conc:
                direct = run_load_process(mock_port, stream, c, args.duration, args.client_core, args.unique, args.prompt_kb)
                for name, (gw, port) in gateways.items():
                    # the CPU window holds the warm-up's requests and the measured ones, and neither stats read
                    counts0 = filter_counts(port)
                    cpu0 = cpu_seconds(gw.pid)
                    via = run_load_process(port, stream, c, args.duration, args.client_core, args.unique, args.prompt_kb)
                    cpu1 = cpu_seconds(gw.pid)
                    counts1 = filter_counts(port)
                    # what the filters counted during this point (gauges such as loop_lag_ms: the value after it)
                    via["filters"] = {k: v - counts0.get(k, 0) if isinstance(v, int) else v for k, v in counts1.items()}
                    served = via["requests"] + via.get("warmup_requests", 0)
                    via["cpu_us_per_req"] = (cpu1 - cpu0) / max(served, 1) * 1e6
                    row = {"variant": name, "mode": "stream-16" if stream else "unary", "concurrency": c,
                           "direct": direct, "gateway": via, "added_p50_ms": via["p50_ms"] - direct["p50_ms"],
                           "added_p99_ms": via["p99_ms"] - direct["p99_ms"]}
                    rows.append(row)
                    print(f"{name:>10} {row['mode']:>9} c={c:<3} direct {direct['rps']:8.0f} req/s p50 "
                          f"{direct['p50_ms']:.3f} p99 {direct['p99_ms']:.3f} | gateway {via['rps']:8.0f} req/s p50 "
                          f"{via['p50_ms']:.3f} p99 {via['p99_ms']:.3f} | added p50 {row['added_p50_ms']:.3f} ms p99 "
                          f"{row['added_p99_ms']:.3f} ms | gateway CPU {via['cpu_us_per_req']:.0f} us/req"
                          f" | errors {direct['errors']}/{via['errors']}", flush=True)
                    if via["errors"] or direct["errors"]:
                        print("   sample error:", via["sample_error"] or direct["sample_error"])
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{platform.machine()}, "
            f"{os.cpu_count()} cores, Python {platform.python_version()}", "duration_s": args.duration,
            "command": "python benchmarks/overhead.py " + " ".join(sys.argv[1:]), "accounting": args.accounting}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    if args.markdown:
        lines = [f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; machine: {meta['machine']}; gateway: "
                 f"{args.workers} uvicorn worker(s) pinned to core(s) {args.gateway_core}; mock + load generator on core {args.client_core}; "
                 f"{args.duration:.0f} s per point.", "",
                 "| variant | mode | conc. | direct req/s | gateway req/s | direct p50 / p99 ms | gateway p50 / p99 ms | added p50 ms | added p99 ms | gateway CPU us/req |",
                 "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            d, g = r["direct"], r["gateway"]
            lines.append(f"| {r['variant']} | {r['mode']} | {r['concurrency']} | {d['rps']:.0f} | {g['rps']:.0f} | {d['p50_ms']:.3f} / "
                         f"{d['p99_ms']:.3f} | {g['p50_ms']:.3f} / {g['p99_ms']:.3f} | {r['added_p50_ms']:.3f} | "
                         f"{r['added_p99_ms']:.3f} | {g['cpu_us_per_req']:.0f} |")
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
