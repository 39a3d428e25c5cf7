"""The HTML report and the JSON result shape, from hand-made results (no server needed)."""

import json

from usefulwork.loadtest import report
from usefulwork.loadtest.client import RequestResult
from usefulwork.loadtest.metrics import SLOSpec
from usefulwork.loadtest.results import run_result
from usefulwork.loadtest.runner import RunOutput

VLLM_KEYS = {"date", "backend", "label", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
             "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
             "request_goodput", "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts",
             "itls", "latencies", "start_times", "errors", "max_output_tokens_per_s", "max_concurrent_requests",
             "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
             "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms"}


def _output() -> RunOutput:
    rs = []
    for i in range(20):
        ok = i % 5 != 4
        rs.append(RequestResult(index=i, kind="", planned=i * 0.5, sent=i * 0.5 + 0.001, end=i * 0.5 + 2.0,
                                outcome="ok" if ok else "timeout", ttft=0.2 if ok else 0.0,
                                itl=[0.05] * 9 if ok else [], prompt_tokens=64 if ok else 0,
                                output_tokens=10 if ok else 0, planned_input_tokens=64, chunks=10 if ok else 0))
    return RunOutput(results=rs, wall_start=1.7e9, wall_end=1.7e9 + 11.5,
                     load={"mode": "open", "arrival": {"process": "poisson", "rate": 2.0}, "concurrency": None},
                     workload={"type": "synthetic", "endpoint": "completions"},
                     target={"base_url": "http://x", "model": "m"})


def test_result_uses_vllm_bench_names():
    r = run_result(_output(), slo=SLOSpec(), usd_per_hour=1.0, label="t")
    assert VLLM_KEYS <= set(r)
    assert r["backend"] == "openai" and r["request_rate"] == 2.0 and r["model_id"] == "m"
    assert r["completed"] == 16 and r["failed"] == 4 and r["outcome_counts"]["timeout"] == 4
    assert r["duration"] == 11.5  # run start (0) to the last end
    assert len(r["ttfts"]) == 20 and r["outcomes"].count("ok") == 16
    json.dumps(r)  # serializable as is


def test_html_report_is_self_contained(tmp_path):
    r = run_result(_output(), slo=SLOSpec(), usd_per_hour=1.0, label="run a")
    p = report.write_html({"runs": [r, dict(r, label="run b")]}, tmp_path / "r.html")
    text = p.read_text()
    assert text.count("data:image/png;base64,") == 3
    assert "<script" not in text and "http://" not in text.replace("http://x", "")
    assert "run a" in text and "run b" in text and "$ / 1K successful" in text
