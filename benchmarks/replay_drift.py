"""Replay schedule drift: how late `usefulwork replay` sends requests versus the recorded timing.

Writes a traffic log of ``--rate`` req/s (Poisson arrivals, recorded bodies, streaming completions)
for ``--duration`` seconds, replays it at speed 1 against the zero-think-time mock backend
(benchmarks/mock_openai.py, so the target never limits the sender), and prints the schedule lag
(actual send - recorded offset) percentiles. Target: p99 <= 5 ms at 100 req/s (issue #13).

    python benchmarks/replay_drift.py --rate 100 --duration 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--target-p99-ms", type=float, default=5.0)
    args = ap.parse_args()
    port = free_port()
    mock = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "mock_openai.py"), "--port", str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(url + "/health", timeout=0.5)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "traffic.jsonl"
            n = write_log(log, args.rate, args.duration)
            workload, _ = load_workload(log)
            try:
                import uvloop

                out, _ = uvloop.run(replay(workload, Target(url, "")))
            except ImportError:
                out, _ = asyncio.run(replay(workload, Target(url, "")))
        lags = np.array([r.schedule_lag for r in out.results]) * 1000.0
        ok = sum(r.outcome == "ok" for r in out.results)
        p50, p99, mx = np.percentile(lags, 50), np.percentile(lags, 99), lags.max()
        print(f"replay drift: {n} requests at {args.rate:g} req/s for {args.duration:g} s, {ok} ok; "
              f"schedule lag p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {mx:.2f} ms "
              f"(target p99 <= {args.target_p99_ms:g} ms: {'met' if p99 <= args.target_p99_ms else 'MISSED'})")
        return 0 if p99 <= args.target_p99_ms else 1
    finally:
        mock.terminate()
        mock.wait(10)


if __name__ == "__main__":
    sys.exit(main())
