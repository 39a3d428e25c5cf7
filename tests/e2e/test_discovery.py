"""Per-pod routing: a real gateway whose pool's replicas come from discovery (a file, the system resolver),
two real simulator servers joining and leaving under traffic, and the GPU bill following them."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.conftest import free_port
from tests.e2e.conftest import start_gateway
from usefulwork.backends.sim.process import SimProcess

MODEL = "sim-model"
USD_H = 3.6  # per GPU; one GPU per replica


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("discovery-sims")
    procs = [SimProcess(gpu="A10G", model="Llama-3.1-8B", served_name=MODEL, port=free_port(), time_scale=5,
                        seed=i, eos_median_tokens=100_000, log_path=tmp / f"sim{i}.log") for i in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.wait_ready(60)
        yield procs
    finally:
        for p in procs:
            p.stop()


def _cfg(tmp_path, discovery: dict) -> dict:
    return {
        "pools": [{"name": "p", "models": [MODEL], "discovery": {"interval_s": 0.2, **discovery},
                   "gpu": {"type": "A10G", "usd_per_hour": USD_H, "per_replica": 1}}],
        "timeouts": {"health_interval_s": 0.3, "retry_after_down_s": 1.0},
        "ledger": {"jsonl_path": str(tmp_path / "ledger.jsonl"), "flush_interval_s": 0.1},
    }


def _wait(pred, timeout: float = 15.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _ready(gw) -> dict:
    return httpx.get(gw.url + "/readyz", timeout=5).json()


def _healthy_urls(gw) -> set[str]:
    return {r["url"] for r in _ready(gw)["pools"]["p"]["replicas"] if r["healthy"]}


def _usd_per_hour(gw) -> float:
    return httpx.get(gw.url + "/usefulwork/stats", timeout=5).json()["pools"]["p"]["usd_per_hour"]


def _ledger(tmp_path) -> list[dict]:
    path = tmp_path / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_replicas_join_and_leave_under_traffic_and_the_bill_follows(sims, tmp_path):
    a, b = sims
    listing = tmp_path / "replicas.txt"
    listing.write_text(f"{a.base_url}\n")
    gw = start_gateway(tmp_path, _cfg(tmp_path, {"file": str(listing)}))
    client = openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0)
    ask = lambda i, n=8: client.chat.completions.create(  # noqa: E731
        model=MODEL, messages=[{"role": "user", "content": f"question {i}"}], max_tokens=n)
    try:
        assert _healthy_urls(gw) == {a.base_url}
        assert _usd_per_hour(gw) == pytest.approx(USD_H)
        assert ask(0).choices[0].message.content

        listing.write_text(f"{a.base_url}\n{b.base_url}\n")  # scale-out: b joins
        _wait(lambda: _healthy_urls(gw) == {a.base_url, b.base_url}, what="b to join and pass its probe")
        assert _usd_per_hour(gw) == pytest.approx(2 * USD_H)
        metrics = httpx.get(gw.url + "/metrics", timeout=5).text
        assert 'usefulwork_pool_replicas{pool="p"} 2.0' in metrics
        assert 'usefulwork_pool_healthy_replicas{pool="p"} 2.0' in metrics
        with ThreadPoolExecutor(8) as ex:
            assert all(r.choices[0].message.content for r in ex.map(ask, range(1, 25)))

        # scale-in while streams run: a leaves the pick at once, its running streams finish whole
        with ThreadPoolExecutor(6) as ex:
            streams = [ex.submit(lambda i=i: list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"long {i}"}], max_tokens=300, stream=True)))
                for i in range(6)]
            time.sleep(0.5)
            t_left = time.time()
            listing.write_text(f"{b.base_url}\n")
            _wait(lambda: {r["url"] for r in _ready(gw)["pools"]["p"]["replicas"]} == {b.base_url}, what="a to leave")
            done = [f.result(60) for f in streams]
        # every stream is whole: 300 tokens and a finish reason, also those still running on a when it left
        assert all(any(c.choices and c.choices[0].finish_reason == "length" for c in chunks) for chunks in done)
        assert _usd_per_hour(gw) == pytest.approx(USD_H)
        with ThreadPoolExecutor(4) as ex:
            assert all(r.choices[0].message.content for r in ex.map(ask, range(100, 112)))
        t_end = time.time()
    finally:
        assert gw.stop() == 0
    records = _ledger(tmp_path)
    assert len(records) == 1 + 24 + 6 + 12 and all(r["outcome"] == "ok" for r in records)
    by_replica = {}
    for r in records:
        by_replica.setdefault(r["replica"], []).append(r)
    assert set(by_replica) == {a.base_url, b.base_url}
    assert len(by_replica[b.base_url]) >= 5  # the joined replica took part of the burst
    late = [r for r in records if r["ts"] > t_left + 0.5 and r["ts"] < t_end]
    assert late and all(r["replica"] == b.base_url for r in late)  # nothing new reached a after it left
    drained = [r for r in by_replica[a.base_url] if r["stream"] and r["ts"] + r["e2e_ms"] / 1000 > t_left + 0.3]
    assert drained and all(r["completion_tokens"] == 300 for r in drained)  # ran on a past its removal, whole


def test_dns_discovery_serves_through_the_resolved_address_and_an_unresolvable_name_is_not_ready(sims, tmp_path):
    a, _ = sims
    gw = start_gateway(tmp_path, _cfg(tmp_path, {"dns": "localhost", "port": a.port}))
    try:
        assert f"http://127.0.0.1:{a.port}" in _healthy_urls(gw)
        r = httpx.post(gw.v1 + "/chat/completions", json={"model": MODEL, "max_tokens": 4,
                                                           "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        gw.stop()
    bad = start_gateway(tmp_path, _cfg(tmp_path, {"dns": "no-such-vllm.invalid"}), wait_ready=False)
    try:
        ready = httpx.get(bad.url + "/readyz", timeout=5)
        assert ready.status_code == 503
        disc = ready.json()["pools"]["p"]["discovery"]
        assert disc["source"] == "dns no-such-vllm.invalid:8000" and disc["failed_reads_in_a_row"] >= 1
        r = httpx.post(bad.v1 + "/chat/completions", json={"model": MODEL, "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
        assert "discovery (dns no-such-vllm.invalid:8000) failed" in bad.log_text()
        metrics = httpx.get(bad.url + "/metrics", timeout=5).text
        assert 'usefulwork_pool_replicas{pool="p"} 0.0' in metrics
        assert float(metrics.split('usefulwork_pool_discovery_failures{pool="p"} ')[1].split()[0]) >= 1
    finally:
        assert bad.stop() == 0
