"""A real Prometheus server (Debian package `prometheus`) scrapes a real gateway in front of real
vLLM and answers PromQL for cost per 1K successful requests, which must equal /usefulwork/stats."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import free_port
from tests.gateway.accounting.test_accounting import serve_gateway

COST_PER_1K_OK = '1000 * sum(usefulwork_gpu_cost_usd_total) / sum(usefulwork_requests_total{outcome="ok"})'


def _query(prom: str, q: str) -> list:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": q}, timeout=10)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def _scalar(prom: str, q: str) -> float | None:
    res = _query(prom, q)
    return float(res[0]["value"][1]) if res else None


@pytest.fixture
def prometheus_bin() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.fail("the `prometheus` server is not installed (apt-get install prometheus)")
    return path


def test_promql_cost_per_1k_successful_matches_stats(vllm_server, prometheus_bin, tmp_path):
    with serve_gateway(vllm_server.base_url, vllm_server.model, tmp_path) as gw:
        port = free_port()
        gw_hostport = gw.url.removeprefix("http://")
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "usefulwork", "static_configs": [{"targets": [gw_hostport]}]}],
        }))
        prom_log = open(tmp_path / "prometheus.log", "wb")
        proc = subprocess.Popen([prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                                 "--log.level=warn"], stdout=prom_log, stderr=subprocess.STDOUT)
        prom = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
                try:
                    if httpx.get(f"{prom}/-/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "prometheus did not become ready"
                time.sleep(0.2)

            client = gw.client()
            for i in range(2):
                client.completions.create(model=vllm_server.model, prompt=f"{i} + {i} =", max_tokens=6)
            # let Prometheus see the series first, so that rate() over the window sees the rest grow
            deadline = time.monotonic() + 30
            while _scalar(prom, 'sum(usefulwork_requests_total{outcome="ok"})') != 2:
                assert time.monotonic() < deadline, _query(prom, "usefulwork_requests_total")
                time.sleep(0.3)
            for i in range(2, 5):
                client.completions.create(model=vllm_server.model, prompt=f"{i} + {i} =", max_tokens=6)
            r = httpx.post(f"{gw.url}/v1/completions", json={"model": "no-such-model", "prompt": "x"}, timeout=10)
            assert r.status_code == 404
            deadline = time.monotonic() + 20
            while gw.stats()["fleet"]["all"]["requests"] < 6:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            ok = gw.stats()["fleet"]["all"]["ok"]
            assert ok == 5

            # wait until Prometheus has scraped the final counts: all six requests, not only the five ok ones
            # (a scrape between the fifth answer and the 404's record already shows ok == 5)
            deadline = time.monotonic() + 30
            while (_scalar(prom, 'sum(usefulwork_requests_total{outcome="ok"})'),
                   _scalar(prom, "sum(usefulwork_requests_total)")) != (ok, 6):
                assert time.monotonic() < deadline, _query(prom, "usefulwork_requests_total")
                time.sleep(0.5)

            per_1k = _scalar(prom, COST_PER_1K_OK)
            (sample,) = _query(prom, "usefulwork_gpu_cost_usd_total")
            scraped_at = float(_query(prom, "timestamp(usefulwork_gpu_cost_usd_total)")[0]["value"][1])
            s = gw.stats()
            # /usefulwork/stats answers "now"; take its cost back to the instant Prometheus scraped.
            rate = s["pools"]["local"]["usd_per_hour"] / 3600.0
            cost_at_scrape = s["fleet"]["all"]["gpu"]["cost_usd"] - rate * (s["now"] - scraped_at)
            assert float(sample["value"][1]) == pytest.approx(cost_at_scrape, rel=0.02)
            assert per_1k == pytest.approx(cost_at_scrape * 1000 / ok, rel=0.02)
            # and the stats' own figure, moments later, is the same quantity
            assert s["fleet"]["all"]["gpu"]["usd_per_1k_ok"] == pytest.approx(per_1k, rel=0.25)

            # GenAI semantic-convention metrics made it through as well
            out_tokens = _scalar(prom, 'sum(gen_ai_client_token_usage_sum{gen_ai_token_type="output"})')
            assert out_tokens == s["fleet"]["all"]["completion_tokens"]
            assert _scalar(prom, 'sum(usefulwork_requests_total{outcome="rejected"})') == 1
            assert _scalar(prom, "sum(gen_ai_client_operation_duration_seconds_count)") == 6

            _check_grafana_queries(prom)
        finally:
            proc.terminate()
            proc.wait(timeout=20)


def _check_grafana_queries(prom: str) -> None:
    """Every query of deploy/grafana/usefulwork.json is valid PromQL on this server, and the
    cost-per-useful-work panels have data."""
    dash = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "usefulwork.json").read_text())
    checked = 0
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$pool", ".*")
            result = _query(prom, expr)  # raises on invalid PromQL
            if panel["title"].startswith(("$ per 1K successful", "$ per 1M generated", "Fleet $ / hour")):
                assert result and float(result[0]["value"][1]) > 0, (panel["title"], expr, result)
            checked += 1
    assert checked >= 20
