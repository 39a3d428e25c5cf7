"""`usefulwork cost`: the seed's cost model, as functions and as the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from usefulwork import costmodel as cm


def test_master_formula_matches_the_seed_example():
    # A100 80GB at $3.50/hour generating 1,000 tokens/s: $0.97 per 1M tokens.
    assert cm.usd_per_1m_tokens(3.5, 1000) == pytest.approx(0.9722, abs=1e-4)
    assert cm.tokens_per_s_for(3.5, cm.usd_per_1m_tokens(3.5, 1234.0)) == pytest.approx(1234.0)
    with pytest.raises(cm.CostModelError):
        cm.usd_per_1m_tokens(3.5, 0)


def test_breakeven_and_capacity():
    # $2/hour always on = $1460/month; at an API price of $1 per 1M that is 1.46B tokens/month.
    assert cm.breakeven_tokens_per_month(2.0, 1.0) == pytest.approx(1.46e9)
    assert cm.monthly_capacity_tokens(100.0, utilization=0.5) == pytest.approx(100 * 0.5 * 3600 * 730)
    res = cm.evaluate(cm.Inputs(usd_per_hour=2.0, tokens_per_s=100.0, api_usd_per_1m=1.0))
    on_demand = res["tiers"][0]
    assert on_demand["name"] == "on-demand" and on_demand["breakeven_within_capacity"] is False  # 263M < 1.46B


def test_tiers_default_discounts_and_overrides():
    res = cm.evaluate(cm.Inputs(usd_per_hour=10.0, tokens_per_s=1000.0, utilization=0.5, target_usd_per_1m=1.0,
                                spot_usd_per_hour=2.0))
    tiers = {t["name"]: t for t in res["tiers"]}
    assert tiers["reserved"]["usd_per_hour"] == pytest.approx(10.0 * (1 - cm.RESERVED_DISCOUNT))
    assert tiers["spot"]["usd_per_hour"] == 2.0
    # half utilization doubles the price per token and the throughput a target needs
    assert tiers["on-demand"]["usd_per_1m_tokens"] == pytest.approx(2 * cm.usd_per_1m_tokens(10.0, 1000.0))
    assert tiers["on-demand"]["tokens_per_s_for_target"] == pytest.approx(2 * cm.tokens_per_s_for(10.0, 1.0))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "usefulwork.cli", "cost", *args], capture_output=True, text=True,
                          timeout=60)


def test_cli_from_flags_json_and_table():
    p = _cli("--gpu-usd-per-hour", "1.75", "--gpus", "2", "--tokens-per-s", "1000", "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["inputs"]["usd_per_hour"] == 3.5
    assert res["tiers"][0]["usd_per_1m_tokens"] == pytest.approx(0.97222, abs=1e-5)
    p = _cli("--usd-per-hour", "3.5", "--tokens-per-s", "1000", "--api-usd-per-1m", "2")
    assert p.returncode == 0 and "on-demand" in p.stdout and "0.9722" in p.stdout and "1,277,500,000" in p.stdout


def test_cli_reads_a_loadtest_result_file(tmp_path):
    runs = {"runs": [
        {"label": "naive", "output_throughput": 37.0, "fleet_usd_per_hour": 0.1},
        {"label": "optimized", "output_throughput": 301.0, "fleet_usd_per_hour": 0.1},
    ]}
    f = tmp_path / "results.json"
    f.write_text(json.dumps(runs))
    p = _cli("--from-result", str(f), "--run", "optimized", "--json")
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["inputs"]["tokens_per_s"] == 301.0
    assert res["tiers"][0]["usd_per_1m_tokens"] == pytest.approx(cm.usd_per_1m_tokens(0.1, 301.0))
    # flags override the file
    p = _cli("--from-result", str(f), "--run", "naive", "--usd-per-hour", "1.0", "--json")
    assert json.loads(p.stdout)["tiers"][0]["usd_per_1m_tokens"] == pytest.approx(cm.usd_per_1m_tokens(1.0, 37.0))


@pytest.mark.parametrize("args, message", [
    ((), "no $/hour"),
    (("--usd-per-hour", "1", "--tokens-per-s", "0"), "tokens/s must be > 0"),
    (("--usd-per-hour", "1", "--utilization", "1.5"), "utilization"),
    (("--from-result", "/nonexistent/results.json"), "cannot read"),
])
def test_cli_errors_are_one_line_and_exit_2(args, message):
    p = _cli(*args)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr


def test_cli_multi_run_file_needs_a_run(tmp_path):
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"runs": [{"label": "a"}, {"label": "b"}]}))
    p = _cli("--from-result", str(f))
    assert p.returncode == 2 and "choose one with --run" in p.stderr
