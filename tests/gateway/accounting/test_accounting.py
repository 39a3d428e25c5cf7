"""Accounting wired into a real `usefulwork serve` process in front of real vLLM: the ledger in
JSONL and a real Redis Stream, nothing lost on a real SIGTERM, cut streams estimated with the
tokenizer, and /usefulwork/stats agreeing with the ledger."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import openai
import orjson
import pytest
import redis
import yaml

from tests.conftest import free_port


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen
    jsonl: Path
    stream: str
    log: Path

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/usefulwork/stats", timeout=10).json()

    def ledger(self) -> list[dict]:
        if not self.jsonl.exists():
            return []
        return [orjson.loads(line) for line in self.jsonl.read_bytes().splitlines() if line.strip()]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)


@contextlib.contextmanager
def serve_gateway(vllm_url: str, model: str, tmp: Path, redis_url: str | None = None,
                  extra: dict | None = None) -> Iterator[Gateway]:
    """A real `usefulwork serve --config` process on a port of our range, ready when yielded."""
    port = free_port()
    stream = f"usefulwork:test:{uuid.uuid4().hex}"
    cfg = {
        "pools": [{"name": "local", "models": [model], "replicas": [vllm_url],
                   "gpu": {"type": "cpu-2core", "count": 1, "usd_per_hour": 0.10},
                   # an illustrative price sheet so that both cost views have numbers
                   "prices": {"input_per_1m": 0.05, "output_per_1m": 0.20, "cached_input_per_1m": 0.025}}],
        "ledger": {"jsonl_path": str(tmp / "ledger.jsonl"), "redis_url": redis_url, "redis_stream": stream,
                   "flush_interval_s": 0.2},
        "timeouts": {"health_interval_s": 1.0},
    }
    cfg.update(extra or {})
    cfg_path = tmp / "gateway.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    log = tmp / "gateway.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "usefulwork.cli", "serve", "--config", str(cfg_path),
                                 "--host", "127.0.0.1", "--port", str(port), "--log-level", "info"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    gw = Gateway(f"http://127.0.0.1:{port}", proc, tmp / "ledger.jsonl", stream, log)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"gateway exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{gw.url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"gateway not ready in 60 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield gw
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if redis_url:
            redis.Redis.from_url(redis_url).delete(stream)


def stop(gw: Gateway, timeout: float = 30) -> int:
    """SIGTERM and wait; `usefulwork serve` exits 0 after a graceful shutdown."""
    gw.proc.send_signal(signal.SIGTERM)
    return gw.proc.wait(timeout=timeout)


def test_sigterm_loses_no_record_jsonl_and_redis(vllm_server, redis_url, tmp_path):
    with serve_gateway(vllm_server.base_url, vllm_server.model, tmp_path, redis_url) as gw:
        client = gw.client()
        ids = []
        for i in range(4):
            kw = dict(model=vllm_server.model, max_tokens=8, messages=[{"role": "user", "content": f"Count to {i + 3}."}])
            resp = client.chat.completions.with_raw_response.create(stream=bool(i % 2), **kw)
            ids.append(resp.headers["x-request-id"])
            if i % 2:
                for _ in resp.parse():
                    pass
        with pytest.raises((openai.BadRequestError, openai.UnprocessableEntityError)):
            client.chat.completions.create(model=vllm_server.model, messages="not a list")
        # A stream still running when SIGTERM arrives must be accounted for too.
        streaming = threading.Event()

        def long_stream():
            try:
                for _ in client.completions.create(model=vllm_server.model, prompt="Once upon a time",
                                                   max_tokens=120, stream=True, extra_body={"ignore_eos": True}):
                    streaming.set()
            except Exception:
                pass
            streaming.set()

        t = threading.Thread(target=long_stream)
        t.start()
        deadline = time.monotonic() + 30
        while gw.stats()["ledger"]["finished"] < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert streaming.wait(30)
        time.sleep(0.6)  # a ledger pass while the stream runs: finished records are held back
        held = gw.stats()["ledger"]["held_for_settlement"]
        rc = stop(gw)
        t.join(timeout=30)
        assert rc == 0, gw.log.read_text()[-2000:]
        recs = gw.ledger()
        assert held > 0  # records were still in memory when the signal came: stop() had to flush them
        assert len(recs) == 6, [r["outcome"] for r in recs]
        assert set(ids) <= {r["id"] for r in recs}
        outcomes = sorted(r["outcome"] for r in recs)
        assert outcomes.count("rejected") == 1 and outcomes.count("ok") >= 4
        for r in recs:
            if r["outcome"] == "ok":
                assert r["usage_source"] == "backend" and r["prompt_tokens"] > 0 and r["completion_tokens"] > 0
                assert r["gpu_cost_usd"] > 0 and r["slo_met"] in (True, False)
        entries = redis.Redis.from_url(redis_url).xrange(gw.stream)
        assert sorted(orjson.loads(f[b"record"])["id"] for _, f in entries) == sorted(r["id"] for r in recs)


def test_cut_stream_is_estimated_and_stats_match_the_ledger(vllm_server, tmp_path):
    with serve_gateway(vllm_server.base_url, vllm_server.model, tmp_path) as gw:
        client = gw.client()
        for _ in range(2):
            client.completions.create(model=vllm_server.model, prompt="The capital of France is", max_tokens=6)
        # Read a few chunks, then hang up: the gateway must count what it streamed.
        with httpx.stream("POST", f"{gw.url}/v1/chat/completions", timeout=60, json={
                "model": vllm_server.model, "stream": True, "max_tokens": 200, "extra_body": None,
                "messages": [{"role": "user", "content": "Write a long story about a cat."}]}) as r:
            cut_id = r.headers["x-request-id"]
            seen = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    seen += 1
                if seen >= 5:
                    break
        deadline = time.monotonic() + 20
        while gw.stats()["fleet"]["all"]["requests"] < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        s = gw.stats()
        f = s["fleet"]["all"]
        assert f["requests"] == 3 and f["ok"] == 2 and f["client_cancelled"] == 1
        deadline = time.monotonic() + 15
        while gw.stats()["ledger"]["held_for_settlement"] and time.monotonic() < deadline:
            time.sleep(0.2)  # nothing in flight: the requests' seconds settle within a few seconds
        books = gw.stats()["conservation"]
        assert books["attributed_usd"] > 0
        assert books["attributed_usd"] + books["idle_usd"] == pytest.approx(books["cost_usd"], abs=1e-12)
        assert len(gw.ledger()) == 3  # written before shutdown
        assert f["estimated_usage"] == 1 and s["ledger"]["token_estimator"] == "tokenizer"
        assert f["gpu"]["cost_usd"] == pytest.approx(0.10 / 3600 * s["uptime_s"], rel=0.05)
        assert stop(gw) == 0
        recs = {r["id"]: r for r in gw.ledger()}
        cut = recs[cut_id]
        assert cut["outcome"] == "client_cancelled" and cut["usage_source"] == "estimate"
        assert cut["completion_tokens"] >= 4 and cut["prompt_tokens"] > 10
        ok = [r for r in recs.values() if r["outcome"] == "ok"]
        assert f["generated_tokens_ok"] == sum(r["completion_tokens"] for r in ok)
        assert f["prompt_tokens"] == sum(r["prompt_tokens"] for r in recs.values())


def test_dashboard_route_serves_the_page(vllm_server, tmp_path):
    with serve_gateway(vllm_server.base_url, vllm_server.model, tmp_path) as gw:
        r = httpx.get(f"{gw.url}/usefulwork/dashboard", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "cost per useful work" in r.text and "stats?series=1" in r.text
        s = httpx.get(f"{gw.url}/usefulwork/stats?series=1", timeout=10).json()
        assert set(s["fleet"]) == {"1m", "5m", "1h", "all"} and "series" in s
        assert set(s["pools"]) == {"local"} and s["pools"]["local"]["usd_per_hour"] == pytest.approx(0.10)
