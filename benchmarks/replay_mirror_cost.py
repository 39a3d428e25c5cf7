"""Mirroring's cost on the primary: the latency the ``mirror`` filter adds to the primary's answers.

For each shadow (``healthy``: a second zero-think-time mock; ``stalled``: a server that answers health
probes and never answers a request) and each ``shadow.sample``, it runs ``benchmarks/overhead.py`` with
three gateway variants in the same run, interleaved at every point: ``none`` (no filter), ``mirror``, and
``none-again`` (a second identical ``none``: its difference from ``none`` is the run's noise floor, the
"A/A" column); all have the shadow pool in their config. It prints the primary's added p50/p99 for each and the
difference mirror - none (target, issue #13: at most 1 ms p99 added), with the gateway's CPU per request and
how many requests were mirrored or not (by the mirror filter's own counters: mirrored / dropped for loop lag /
dropped for the process's CPU / other drops).
The healthy shadow mock runs on the client core (with the primary mock and the load generator), as a
shadow fleet would run elsewhere; the gateway keeps its own core.

    python benchmarks/replay_mirror_cost.py --duration 5 --concurrency 1,16 --samples 0.1,1.0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.overhead import free_port, wait_http  # noqa: E402


class Staller(asyncio.Protocol):
    """Answers every GET (health, metrics) with an empty 200 and never answers a POST."""

    def connection_made(self, transport) -> None:
        self.t = transport

    def data_received(self, data: bytes) -> None:
        if data.startswith(b"GET"):
            self.t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")


async def stall_forever(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Staller, "127.0.0.1", port, backlog=4096)
    async with server:
        await server.serve_forever()


def start_shadow(kind: str, core: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if kind == "healthy":
        cmd = [sys.executable, str(ROOT / "benchmarks" / "mock_openai.py"), "--port", str(port)]
    else:
        cmd = [sys.executable, __file__, "--stall-server", str(port)]
    proc = subprocess.Popen(["taskset", "-c", core, *cmd])
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health")
    return proc, url


def run_pair(shadow_url: str, sample: float, args, tmp: Path) -> list[dict]:
    overlay = json.dumps({"pools": [{"name": "mock", "models": ["mock"], "replicas": ["{mock}"]},
                                    {"name": "candidate", "models": ["mock-shadow"], "replicas": [shadow_url]}],
                          "shadow": {"pool": "candidate", "sample": sample, "dir": str(tmp / f"shadow-{sample:g}")}})
    out = tmp / "rows.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--duration", str(args.duration),
                    "--concurrency", args.concurrency, "--variant", "none=.", "--variant", "mirror=.:mirror",
                    "--variant", "none-again=.", "--overlay", f"none={overlay}", "--overlay", f"mirror={overlay}",
                    "--overlay", f"none-again={overlay}", "--json", str(out)],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["rows"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--samples", default="0.1,1.0")
    ap.add_argument("--shadows", default="healthy,stalled")
    ap.add_argument("--client-core", default="1")
    ap.add_argument("--target-p99-ms", type=float, default=1.0)
    ap.add_argument("--stall-server", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stall_server:
        asyncio.run(stall_forever(args.stall_server))
        return 0
    worst = float("-inf")
    floors: list[float] = []
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    print(f"{'shadow':8} {'sample':>6} {'mode':>9} {'conc':>4} | {'none p50/p99 ms':>16} | {'mirror p50/p99 ms':>17} | "
          f"{'mirror-none p99':>15} | {'A/A p99':>8} | {'CPU us/req none/mirror':>22} | errors | "
          "mirrored / gateway lag / gateway CPU / other drops")
    with tempfile.TemporaryDirectory() as tmp_s:
        for kind in args.shadows.split(","):
            proc, url = start_shadow(kind, args.client_core)
            try:
                for sample in (float(x) for x in args.samples.split(",")):
                    rows = run_pair(url, sample, args, Path(tmp_s))
                    by = {(r["variant"], r["mode"], r["concurrency"]): r for r in rows}
                    for (variant, mode, c), r in by.items():
                        if variant != "mirror":
                            continue
                        n = by[("none", mode, c)]
                        d99 = r["added_p99_ms"] - n["added_p99_ms"]
                        aa = by[("none-again", mode, c)]["added_p99_ms"] - n["added_p99_ms"]  # the noise floor
                        floors.append(abs(aa))
                        fc = r["gateway"].get("filters", {})
                        gw_busy = ("mirror.dropped_gateway_busy", "mirror.dropped_gateway_cpu")
                        others = sum(v for k, v in fc.items() if k.startswith("mirror.dropped_") and k not in gw_busy)
                        worst = max(worst, d99)
                        print(f"{kind:8} {sample:6g} {mode:>9} {c:4d} | {n['added_p50_ms']:7.3f} / {n['added_p99_ms']:6.3f} "
                              f"| {r['added_p50_ms']:8.3f} / {r['added_p99_ms']:6.3f} | {d99:+15.3f} | {aa:+8.3f} | "
                              f"{n['gateway']['cpu_us_per_req']:10.0f} / {r['gateway']['cpu_us_per_req']:9.0f} | "
                              f"{n['gateway']['errors']}/{r['gateway']['errors']} | {fc.get('mirror.mirrored', 0)} / "
                              f"{fc.get('mirror.dropped_gateway_busy', 0)} / {fc.get('mirror.dropped_gateway_cpu', 0)} / {others}",
                              flush=True)
            finally:
                proc.terminate()
                proc.wait(10)
    print(f"worst mirror-minus-none added p99 {worst:+.3f} ms (target <= {args.target_p99_ms:g} ms: "
          f"{'met' if worst <= args.target_p99_ms else 'MISSED'}); noise floor (none-again minus none, same run): "
          f"largest |A/A| {max(floors, default=0):.3f} ms, median {sorted(floors)[len(floors) // 2] if floors else 0:.3f} ms; "
          f"load average {os.getloadavg()[0]:.1f}")
    return 0 if worst <= args.target_p99_ms else 1


if __name__ == "__main__":
    sys.exit(main())
