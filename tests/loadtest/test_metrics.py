"""Metric formulas on hand-computed examples."""

import pytest

from usefulwork.loadtest.client import RequestResult
from usefulwork.loadtest.metrics import (SLOSpec, cost_figures, is_good, max_concurrency, p_word, percentile,
                                         summarize, timeline)


def _r(i, sent, end, ttft, out, outcome="ok", itl=None, prompt=100, planned=None):
    return RequestResult(index=i, kind="", planned=sent if planned is None else planned, sent=sent, end=end,
                         outcome=outcome, ttft=ttft, itl=itl or [], prompt_tokens=prompt if outcome == "ok" else 0,
                         output_tokens=out if outcome == "ok" else 0)


def test_percentile_linear_interpolation():
    # sorted [1,2,3,4]: p50 at rank 1.5 -> 2.5; p95 at rank 2.85 -> 3.85; p99 -> 3.97
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([4, 1, 3, 2], 95) == pytest.approx(3.85)
    assert percentile([4, 1, 3, 2], 99) == pytest.approx(3.97)
    assert percentile([], 99) == 0.0
    assert p_word(99) == "p99" and p_word(99.9) == "p99.9"


def test_tpot_definition():
    r = _r(0, sent=1.0, end=3.0, ttft=0.5, out=11)
    # (E2EL - TTFT) / (n - 1) = (2.0 - 0.5) / 10 = 0.15 s
    assert r.e2el == pytest.approx(2.0)
    assert r.tpot == pytest.approx(0.15)
    assert _r(1, 0, 1, 0.5, 1).tpot is None


def test_summary_hand_computed():
    results = [
        _r(0, sent=0.0, end=2.0, ttft=0.2, out=11, itl=[0.1, 0.3]),    # e2el 2.0, tpot 0.18
        _r(1, sent=1.0, end=5.0, ttft=1.0, out=31, itl=[0.1]),         # e2el 4.0, tpot 0.1
        _r(2, sent=2.0, end=3.0, ttft=0.0, out=0, outcome="shed"),
        _r(3, sent=3.0, end=10.0, ttft=0.0, out=0, outcome="timeout"),
    ]
    slo = SLOSpec(ttft_ms=500, tpot_ms=200, e2e_ms=3000, attainment=0.5)
    s = summarize(results, slo=slo, usd_per_hour=3.6)
    assert s["duration"] == pytest.approx(10.0)
    assert s["completed"] == 2 and s["failed"] == 2 and s["dropped"] == 2
    assert s["outcome_counts"] == {"ok": 2, "shed": 1, "error": 0, "timeout": 1, "client_cancelled": 0}
    assert s["total_input_tokens"] == 200 and s["total_output_tokens"] == 42
    assert s["request_throughput"] == pytest.approx(0.2)
    assert s["output_throughput"] == pytest.approx(4.2)
    assert s["total_token_throughput"] == pytest.approx(24.2)
    # only request 0 is good (request 1: ttft 1000 ms > 500, e2e 4000 > 3000)
    assert s["good"] == 1 and s["request_goodput"] == pytest.approx(0.1)
    assert s["slo_pass_rate"] == pytest.approx(0.25) and s["slo_passed"] is False
    assert s["mean_ttft_ms"] == pytest.approx(600.0)
    assert s["median_e2el_ms"] == pytest.approx(3000.0)
    assert s["p99_e2el_ms"] == pytest.approx(3980.0)
    assert s["mean_tpot_ms"] == pytest.approx(140.0)
    assert s["mean_itl_ms"] == pytest.approx(500 / 3)
    results[3].chunks = 7  # the timed-out request had streamed 7 chunks: wasted work
    assert summarize(results, slo=slo, usd_per_hour=3.6)["wasted_output_tokens"] == 7
    assert s["max_concurrent_requests"] == 2  # [0,2] [1,5] [2,3] [3,10]: never three at once
    # cost: $3.6/h for 10 s = $0.01
    assert s["cost_usd"] == pytest.approx(0.01)
    assert s["usd_per_1k_successful"] == pytest.approx(5.0)
    assert s["usd_per_1k_good"] == pytest.approx(10.0)
    assert s["usd_per_1m_generated_tokens"] == pytest.approx(0.01 / 42 * 1e6)


def test_is_good_and_slo_pass():
    slo = SLOSpec(ttft_ms=1000, tpot_ms=50, e2e_ms=5000)
    assert is_good(_r(0, 0, 2.0, 0.5, 31), slo)          # tpot 50 ms: exactly on target passes
    assert not is_good(_r(0, 0, 2.1, 0.5, 31), slo)      # tpot 53 ms
    assert not is_good(_r(0, 0, 1.0, 0.0, 0, outcome="error"), slo)
    ok = [_r(i, i, i + 1.0, 0.1, 10) for i in range(19)] + [_r(19, 19, 29.0, 0.1, 10, outcome="timeout")]
    s = summarize(ok, slo=SLOSpec(attainment=0.95), usd_per_hour=1.0)
    assert s["slo_pass_rate"] == pytest.approx(0.95) and s["slo_passed"] is True


def test_max_concurrency_end_frees_before_start():
    rs = [_r(0, 0, 1, 0.1, 2), _r(1, 1, 2, 0.1, 2), _r(2, 1.5, 3, 0.1, 2)]
    assert max_concurrency(rs) == 2


def test_cost_figures_without_successes():
    c = cost_figures(2.0, 1800.0, 0, 0, 0)
    assert c["cost_usd"] == pytest.approx(1.0)
    assert c["usd_per_1k_successful"] is None and c["usd_per_1m_generated_tokens"] is None


def test_schedule_lag_reported():
    rs = [_r(0, sent=0.01, end=1, ttft=0.1, out=2, planned=0.0), _r(1, sent=1.5, end=2, ttft=0.1, out=2, planned=1.0)]
    s = summarize(rs, slo=SLOSpec(), usd_per_hour=0)
    assert s["mean_schedule_lag_ms"] == pytest.approx(255.0)
    assert s["max_schedule_lag_ms"] == pytest.approx(500.0)


def test_timeline_series():
    rs = [_r(0, sent=0.2, end=2.2, ttft=0.2, out=20), _r(1, sent=1.1, end=1.9, ttft=0.1, out=0, outcome="error")]
    tl = timeline(rs, step_s=1.0)
    assert tl["t"] == [0.5, 1.5, 2.5]
    assert tl["sent_per_s"] == [1.0, 1.0, 0.0]
    assert tl["ok_per_s"] == [0.0, 0.0, 1.0]
    assert tl["in_flight"] == [1.0, 2.0, 0.0]
    # 20 tokens spread over [0.4, 2.2]: 0.6/1.8, 1/1.8, 0.2/1.8 of them
    assert tl["output_tokens_per_s"] == pytest.approx([20 * 0.6 / 1.8, 20 / 1.8, 20 * 0.2 / 1.8])
