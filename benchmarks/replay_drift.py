"""Replay schedule drift: how late `usefulwork replay` sends requests versus the recorded timing.

Writes a traffic log of ``--rate`` req/s (Poisson arrivals, recorded bodies, streaming completions)
for ``--duration`` seconds, replays it at speed 1 against the zero-think-time mock backend
(benchmarks/mock_openai.py, so the target never limits the sender) or, with ``--backend sim``,
against the vLLM simulator, and prints the schedule lag (actual send - recorded offset) percentiles,
the earliest send (negative: ahead of schedule), the replay process's CPU per request and the load
average before and after. Target: p99 <= 5 ms at 100 req/s (issue #13).

    python benchmarks/replay_drift.py --rate 100 --duration 30 [--backend sim]
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

import httpx
import numpy as np

from usefulwork.loadtest.replay import load_workload, replay
from usefulwork.loadtest.runner import Target

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_log(path: Path, rate: float, duration: float, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    t, n, t0 = 0.0, 0, 1_700_000_000.0
    with path.open("w") as f:
        while True:
            t += rng.exponential(1.0 / rate)
            if t >= duration:
                return n
            f.write(json.dumps({"v": 1, "ts": t0 + t, "op": "completions", "tenant": "bench", "outcome": "ok",
                                "body": {"model": "mock", "prompt": f"request {n}", "max_tokens": 16}}) + "\n")
            n += 1


def start_backend(kind: str, tmp: Path):
    """(url, stop) of the zero-think-time mock or a fast simulator (time scale 20, short outputs)."""
    port = free_port()
    if kind == "sim":
        from usefulwork.backends.sim.process import SimProcess

        sim = SimProcess(port=port, gpu="A100-80G", model="Llama-3.1-8B", served_name="mock", time_scale=20.0,
                         log_path=tmp / "sim.log")
        sim.start()
        sim.wait_ready(120)
        return sim.base_url, sim.stop
    mock = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "mock_openai.py"), "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            httpx.get(url + "/health", timeout=0.5)
            break
        except httpx.HTTPError:
            time.sleep(0.1)

    def stop() -> None:
        mock.terminate()
        mock.wait(10)
    return url, stop


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--backend", choices=("mock", "sim"), default="mock")
    ap.add_argument("--target-p99-ms", type=float, default=5.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url, stop = start_backend(args.backend, Path(tmp))
        try:
            log = Path(tmp) / "traffic.jsonl"
            n = write_log(log, args.rate, args.duration)
            workload, _ = load_workload(log)
            load0 = os.getloadavg()[0]
            cpu0 = time.process_time()
            try:
                import uvloop

                out, _ = uvloop.run(replay(workload, Target(url, "")))
            except ImportError:
                out, _ = asyncio.run(replay(workload, Target(url, "")))
            cpu_us = (time.process_time() - cpu0) / max(1, n) * 1e6
        finally:
            stop()
    signed = np.array([r.sent - r.planned for r in out.results]) * 1000.0
    lags = np.maximum(signed, 0.0)
    ok = sum(r.outcome == "ok" for r in out.results)
    p50, p99, mx = np.percentile(lags, 50), np.percentile(lags, 99), lags.max()
    print(f"replay drift ({args.backend}): {n} requests at {args.rate:g} req/s for {args.duration:g} s, {ok} ok; "
          f"schedule lag p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {mx:.2f} ms, earliest {signed.min():+.2f} ms "
          f"(target p99 <= {args.target_p99_ms:g} ms: {'met' if p99 <= args.target_p99_ms else 'MISSED'}); "
          f"replay CPU {cpu_us:.0f} us/request; load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after, "
          f"on {os.cpu_count()} cores")
    return 0 if p99 <= args.target_p99_ms else 1


if __name__ == "__main__":
    sys.exit(main())
