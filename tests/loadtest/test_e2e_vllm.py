"""The streaming client and runner against the real vLLM server (short, small counts)."""

import pytest

from usefulwork.loadtest import arrivals, workloads
from usefulwork.loadtest.metrics import SLOSpec
from usefulwork.loadtest.results import run_result
from usefulwork.loadtest.runner import LoadSpec, Target, run_sync

pytestmark = pytest.mark.vllm


def test_open_loop_poisson_measures_every_request(vllm_server):
    wl = workloads.from_spec({"type": "synthetic", "prompt_tokens": 64, "output_tokens": 16})
    load = LoadSpec(arrival=arrivals.Poisson(4.0), num_requests=6, timeout_s=60, seed=1)
    out = run_sync(Target(vllm_server.base_url, vllm_server.model), wl, load)
    assert [r.outcome for r in out.results] == ["ok"] * 6, [r.error for r in out.results]
    g = out.generator
    assert g["ticks"] > 0 and g["runqueue_ms"] is not None, g
    # The runner sends on time whenever its loop can run: what it is late by beyond the time the kernel kept
    # the loop's thread waiting for a CPU (this test shares two cores with vLLM) is its own fault.
    starved_s = g["runqueue_ms"] / 1000.0
    sends = [(round(r.planned, 3), round(r.sent, 3)) for r in out.results]
    for r in out.results:
        assert r.prompt_tokens == 64  # one word per token: the planned length is the real length
        assert r.output_tokens == 16 and r.usage_seen
        assert 0 < r.ttft < r.e2el
        assert len(r.itl) == r.chunks - 1 and r.chunks >= 2
        assert r.tpot == pytest.approx((r.e2el - r.ttft) / 15)
        assert r.schedule_lag < 0.5 + starved_s, (sends, g)
    planned = [r.planned for r in out.results]
    assert planned == sorted(planned) and planned[0] > 0
    res = run_result(out, slo=SLOSpec(), usd_per_hour=0.1)
    assert res["completed"] == 6 and res["total_output_tokens"] == 96 and res["input_lens"] == [64] * 6
    assert res["usd_per_1k_successful"] == pytest.approx(0.1 * res["duration"] / 3600 / 6 * 1000)


def test_closed_loop_and_timeout_outcome(vllm_server):
    target = Target(vllm_server.base_url + "/v1", vllm_server.model)  # /v1 suffix is accepted
    wl = workloads.from_spec({"type": "synthetic", "prompt_tokens": 32, "output_tokens": 8})
    out = run_sync(target, wl, LoadSpec(concurrency=2, num_requests=4, timeout_s=60))
    assert len(out.results) == 4 and all(r.outcome == "ok" for r in out.results)
    res = run_result(out, slo=SLOSpec(), usd_per_hour=0.0)
    assert res["max_concurrent_requests"] == 2 and res["max_concurrency"] == 2
    # 400 tokens cannot stream in 0.5 s on this CPU: the client gives up and says so
    slow = workloads.from_spec({"type": "synthetic", "prompt_tokens": 32, "output_tokens": 400})
    out = run_sync(target, slow, LoadSpec(concurrency=1, num_requests=1, timeout_s=0.5))
    assert out.results[0].outcome == "timeout" and "0.5s" in out.results[0].error


def test_realistic_chat_set_and_http_errors(vllm_server):
    wl = workloads.realistic()
    out = run_sync(Target(vllm_server.base_url, vllm_server.model), wl,
                   LoadSpec(concurrency=2, num_requests=3, timeout_s=120, seed=3))
    assert all(r.outcome == "ok" and r.output_tokens > 0 for r in out.results), [r.error for r in out.results]
    # an unknown model is an HTTP error outcome with the server's message, not an exception
    out = run_sync(Target(vllm_server.base_url, "no-such-model"), wl, LoadSpec(concurrency=1, num_requests=1))
    r = out.results[0]
    assert r.outcome == "error" and r.status == 404 and "HTTP 404" in r.error
