"""OpenTelemetry export, checked with the SDK's in-memory reader and exporter, and the Prometheus
registry that the gateway's /metrics serves."""

from __future__ import annotations

import asyncio

import prometheus_client
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from usefulwork.gateway.accounting.telemetry import Telemetry
from tests.gateway.accounting.test_ledger import T0, ctx_at, make_accountant, make_cfg


def _points(reader: InMemoryMetricReader) -> dict[str, list]:
    out: dict[str, list] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


async def _run(cfg, ctxs, clock_end: float):
    acc, sink, clock = make_accountant(cfg)
    acc.fleet.replicas[0].inflight = 1  # busy fleet: settlement holds back ledger.max_hold_s
    reader, spans = InMemoryMetricReader(), InMemorySpanExporter()
    acc.telemetry = Telemetry(cfg, acc.meters, prometheus=True, metric_readers=[reader], span_exporters=[spans],
                              clock=clock)
    await acc.start()
    for c in ctxs:
        acc.finish(c)
    clock.t = clock_end
    await asyncio.sleep(0.3)
    prom_text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    pts = _points(reader)
    finished = spans.get_finished_spans()
    await acc.stop()
    return pts, finished, prom_text


async def test_genai_and_usefulwork_metrics_and_one_span_per_request():
    cfg = make_cfg()
    ok = ctx_at(T0 + 1, prompt=100, completion=20, tenant="a")
    ok.prompt_payload = [{"role": "user", "content": "secret prompt text"}]
    err = ctx_at(T0 + 2, prompt=50, completion=0, outcome="error", error="upstream 500", tenant="b")
    shed = ctx_at(T0 + 3, pool=None, prompt=0, completion=0, outcome="shed")
    pts, spans, prom = await _run(cfg, [ok, err, shed], T0 + 60)

    usage = pts["gen_ai.client.token.usage"]
    by_type = {}
    for p in usage:
        by_type[p.attributes["gen_ai.token.type"]] = by_type.get(p.attributes["gen_ai.token.type"], 0) + p.sum
    assert by_type == {"input": 150, "output": 20}
    assert all(p.attributes["gen_ai.request.model"] == "s" for p in usage)
    assert all(p.attributes["gen_ai.operation.name"] == "chat" for p in usage)
    assert sum(p.count for p in pts["gen_ai.client.operation.duration"]) == 3
    assert sum(p.count for p in pts["gen_ai.server.time_to_first_token"]) == 1  # only ok requests
    reqs = {p.attributes["outcome"]: p.value for p in pts["usefulwork.requests"]}
    assert reqs == {"ok": 1, "error": 1, "shed": 1}
    price = sum(p.value for p in pts["usefulwork.cost.usd"] if p.attributes["view"] == "price_sheet")
    assert price == pytest.approx((150 * 1.0 + 20 * 2.0) / 1e6)
    gpu = {p.attributes["pool"]: p.value for p in pts["usefulwork.gpu.cost.usd"]}
    assert gpu == pytest.approx({"small": 3.6 / 3600 * 60, "large": 7.2 / 3600 * 60})
    assert {p.attributes["decision"] for p in pts["usefulwork.admission.decisions"]} == {"admitted", "shed"}
    assert {p.attributes["result"] for p in pts["usefulwork.cache.lookups"]} == {"miss"}

    assert len(spans) == 3
    s = next(sp for sp in spans if sp.attributes["usefulwork.id"] == ok.id)
    assert s.name == "chat s"
    assert s.attributes["gen_ai.usage.input_tokens"] == 100 and s.attributes["gen_ai.usage.output_tokens"] == 20
    assert s.attributes["usefulwork.outcome"] == "ok" and s.attributes["usefulwork.slo_met"] is True
    assert s.start_time == int((T0 + 1) * 1e9) and s.end_time - s.start_time == pytest.approx(2e9, rel=1e-6)
    assert all("secret prompt text" not in str(dict(sp.attributes)) for sp in spans)  # privacy by default
    e = next(sp for sp in spans if sp.attributes["usefulwork.id"] == err.id)
    assert e.status.status_code.name == "ERROR" and e.attributes["error.type"] == "error"

    # The same figures reach Prometheus, once (a second Telemetry replaced the first registration).
    assert prom.count("# TYPE usefulwork_requests_total counter") == 1
    assert 'usefulwork_requests_total{cache="miss",outcome="ok",pool="small",slo_met="true",tenant="a"} 1.0' in prom
    assert "usefulwork_gpu_cost_usd_total" in prom and "gen_ai_client_token_usage_bucket" in prom


async def test_prompts_on_spans_only_when_configured():
    cfg = make_cfg(telemetry={"record_prompts": True})
    ok = ctx_at(T0 + 1)
    ok.prompt_payload = [{"role": "user", "content": "visible prompt"}]
    _, spans, _ = await _run(cfg, [ok], T0 + 10)
    assert "visible prompt" in spans[0].attributes["gen_ai.input.messages"]


async def test_gpu_attributed_and_idle_cost_counters_add_up_to_the_fleet_cost():
    cfg = make_cfg()
    pts, _, _ = await _run(cfg, [ctx_at(T0 + 1, tenant="a"), ctx_at(T0 + 5, tenant="b", pool="large")], T0 + 100)
    # the accountant's stop() settles everything: read the counters after it via a fresh run's numbers
    by_view: dict[str, float] = {}
    for p in pts["usefulwork.cost.usd"]:
        by_view[p.attributes["view"]] = by_view.get(p.attributes["view"], 0.0) + p.value
    settled_cost = by_view["gpu_attributed"] + by_view["gpu_idle"]
    # settled so far = fleet cost up to the frontier (now - the longest hold, ledger.max_hold_s)
    assert settled_cost == pytest.approx((3.6 + 7.2) / 3600 * (100 - cfg.ledger.max_hold_s), abs=1e-9)
    assert by_view["gpu_attributed"] > 0


async def test_otlp_http_export_when_configured(tmp_path):
    """Spans and metrics are pushed over OTLP/HTTP (protobuf) to the configured endpoint: here a
    real HTTP server on our port range that decodes what it receives."""
    import http.server
    import threading

    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from tests.conftest import free_port

    got: dict[str, list] = {"/v1/traces": [], "/v1/metrics": []}

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            body = self.rfile.read(int(self.headers["content-length"]))
            msg = ExportTraceServiceRequest() if self.path == "/v1/traces" else ExportMetricsServiceRequest()
            msg.ParseFromString(body)
            got.setdefault(self.path, []).append(msg)
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = make_cfg(telemetry={"otlp_endpoint": f"http://127.0.0.1:{port}", "service_name": "uw-test"})
        acc, _, clock = make_accountant(cfg)
        acc.telemetry = Telemetry(cfg, acc.meters, prometheus=False, clock=clock)
        await acc.start()
        acc.finish(ctx_at(T0 + 1))
        clock.t = T0 + 5
        await acc.stop()  # shuts the providers down, which flushes both exporters
    finally:
        server.shutdown()
    spans = [s for req in got["/v1/traces"] for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert [s.name for s in spans] == ["chat s"]
    names = {m.name for req in got["/v1/metrics"] for rm in req.resource_metrics for sm in rm.scope_metrics
             for m in sm.metrics}
    assert {"usefulwork.requests", "gen_ai.client.token.usage", "usefulwork.gpu.cost.usd"} <= names
    service = {a.value.string_value for req in got["/v1/traces"] for rs in req.resource_spans
               for a in rs.resource.attributes if a.key == "service.name"}
    assert service == {"uw-test"}


def test_a_replaced_prometheus_reader_shuts_down_without_error():
    """A second gateway in one process replaces the first's Prometheus reader (unregistering its
    collector); shutting the first down afterwards raised MeterProvider's KeyError exception, and a
    never-shut one printed it from its atexit hook after the test run."""
    cfg = make_cfg()
    first, second = Telemetry(cfg, {}), Telemetry(cfg, {})
    first.shutdown()  # raised: "PrometheusMetricReader: KeyError(<..._CustomCollector ...>)"
    assert second._prom._collector in prometheus_client.REGISTRY._collector_to_names  # /metrics still served
    second.shutdown()
    assert second._prom._collector not in prometheus_client.REGISTRY._collector_to_names
    second.shutdown()  # twice: nothing raised either (the SDK only warns)


def test_no_shutdown_exception_at_exit_with_two_gateways_in_one_process():
    import subprocess
    import sys
    from pathlib import Path

    code = ("from tests.gateway.accounting.test_ledger import make_cfg\n"
            "from usefulwork.gateway.accounting.telemetry import Telemetry\n"
            "cfg = make_cfg()\n"
            "a, b = Telemetry(cfg, {}), Telemetry(cfg, {})\n")  # neither shut down: the atexit hooks do it
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Exception" not in out.stderr and "KeyError" not in out.stderr, out.stderr
