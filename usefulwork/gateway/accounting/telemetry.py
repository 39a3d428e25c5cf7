"""OpenTelemetry export of the ledger: metrics (GenAI semantic conventions + usefulwork's own) and a
span per request.

Metrics always reach Prometheus: the OTel Prometheus reader registers with
``prometheus_client.REGISTRY``, which the gateway's ``/metrics`` serves. OTLP/HTTP export (metrics
and spans) is added only when ``telemetry.otlp_endpoint`` is set. Everything here runs in the
accountant's background task, never in a request.

Names (Prometheus form in brackets):
- ``gen_ai.client.token.usage`` [gen_ai_client_token_usage] histogram, ``gen_ai.token.type`` = input|output
- ``gen_ai.client.operation.duration`` [gen_ai_client_operation_duration_seconds] histogram
- ``gen_ai.server.time_to_first_token`` [gen_ai_server_time_to_first_token_seconds] histogram
- ``gen_ai.server.time_per_output_token`` [gen_ai_server_time_per_output_token_seconds] histogram
- ``usefulwork.requests`` [usefulwork_requests_total] by outcome, pool, tenant, cache, slo_met
- ``usefulwork.generated.tokens`` [usefulwork_generated_tokens_total] completion tokens by outcome
- ``usefulwork.cost.usd`` [usefulwork_cost_usd_total] by view = price_sheet | gpu_attributed | gpu_idle
- ``usefulwork.gpu.cost.usd`` [usefulwork_gpu_cost_usd_total] each pool's GPU cost since it came up (live)
- ``usefulwork.cache.lookups`` [usefulwork_cache_lookups_total] by result
- ``usefulwork.routing.decisions`` [usefulwork_routing_decisions_total] by pool, route, reason
- ``usefulwork.admission.decisions`` [usefulwork_admission_decisions_total] by decision = admitted|shed|rejected
- ``usefulwork.request.intake`` [usefulwork_request_intake_seconds] histogram: reading + validating the body
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import orjson
import prometheus_client
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from usefulwork.config import Config
from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.accounting.costing import PoolMeter, Settled
from usefulwork.gateway.accounting.histograms import HistogramBook
from usefulwork.gateway.accounting.instruments import FastMeter, SummedCounter

log = logging.getLogger("usefulwork.telemetry")

# GenAI semconv advisory buckets.
TOKEN_BUCKETS = [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864]
DURATION_BUCKETS = [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92]
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]

OPERATION = {"chat": "chat", "completions": "text_completion"}
MAX_PLANS = 4096  # label sets remembered by Telemetry.record (see _plan)

# The Prometheus reader of the most recently built app. Registering a second one would make
# /metrics repeat every series (tests build several apps in one process): the newest replaces it.
# The replaced reader's collector is then no longer registered, so its own shutdown (the SDK's, from
# Telemetry.shutdown or the MeterProvider's atexit hook) must not unregister it again: the exporter's
# shutdown raises KeyError there, and MeterProvider.shutdown turns that into an exception.
_prom_lock = threading.Lock()
_prom_current: Any = None


def _install_prometheus_reader() -> MetricReader:
    global _prom_current
    from opentelemetry.exporter.prometheus import PrometheusMetricReader

    class _Reader(PrometheusMetricReader):
        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            _unregister(self)  # a replaced reader's collector is already gone

    with _prom_lock:
        if _prom_current is not None:
            _unregister(_prom_current)
        reader = _Reader(disable_target_info=True, scope_info_enabled=False)
        _prom_current = reader
        return reader


def _unregister(reader: Any) -> None:
    collector = getattr(reader, "_collector", None)
    if collector is None:
        return
    try:
        getattr(reader, "_registry", prometheus_client.REGISTRY).unregister(collector)
    except KeyError:
        pass  # already gone


def _release_prometheus_reader(reader: Any) -> None:
    global _prom_current
    with _prom_lock:
        if _prom_current is reader:
            _unregister(reader)
            _prom_current = None


class Telemetry:
    """Owns the OTel providers of one gateway; ``record`` turns a finished request into metrics + a span."""

    def __init__(self, cfg: Config, meters: dict[str, PoolMeter], *, prometheus: bool = True,
                 metric_readers: Sequence[MetricReader] = (), span_exporters: Sequence[SpanExporter] = (),
                 clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.record_prompts = cfg.telemetry.record_prompts
        self._meters = meters
        self._clock = clock
        resource = Resource.create({"service.name": cfg.telemetry.service_name})
        readers: list[MetricReader] = list(metric_readers)
        self._prom = _install_prometheus_reader() if prometheus else None
        if self._prom is not None:
            readers.append(self._prom)
        tracer_provider = TracerProvider(resource=resource)
        # A span nobody exports is pure cost: build them only when an exporter is configured.
        self.spans = bool(span_exporters) or bool(cfg.telemetry.otlp_endpoint)
        for exp in span_exporters:
            tracer_provider.add_span_processor(SimpleSpanProcessor(exp))
        endpoint = cfg.telemetry.otlp_endpoint
        if endpoint:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            base = endpoint.rstrip("/")
            readers.append(PeriodicExportingMetricReader(
                OTLPMetricExporter(endpoint=f"{base}/v1/metrics"),
                export_interval_millis=cfg.telemetry.export_interval_s * 1000))
            tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{base}/v1/traces")))
        # Histograms are aggregated in-process (histograms.py) and handed to every reader at collection.
        self.histograms = HistogramBook()
        for reader in readers:
            self.histograms.attach(reader)
        self.meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        self.tracer_provider = tracer_provider
        self.tracer = tracer_provider.get_tracer("usefulwork.gateway")
        self._instruments()

    def _instruments(self) -> None:
        m = self.meter = self.meter_provider.get_meter("usefulwork.gateway")
        self.fast_meter = FastMeter(m, self.histograms, DURATION_BUCKETS)  # what filters and pickers make their instruments on
        h = self.histograms
        h.define("gen_ai.client.token.usage", "{token}", "Input and output tokens per request.", TOKEN_BUCKETS)
        h.define("gen_ai.client.operation.duration", "s", "End-to-end request duration.", DURATION_BUCKETS)
        h.define("gen_ai.server.time_to_first_token", "s", "Time to the first generated token.", TTFT_BUCKETS)
        h.define("gen_ai.server.time_per_output_token", "s", "Time per output token after the first.", TPOT_BUCKETS)
        h.define("usefulwork.request.intake", "s", "Time to read, parse and validate a request body.", DURATION_BUCKETS)
        # Counters are summed here, per attribute set, and read by the SDK only when it collects
        # (a scrape, an OTLP export): one dict update per request instead of an SDK call with
        # attribute validation and hashing for each counter (measured: benchmarks/bench_accounting.py;
        # instruments.py).
        self._sums: dict[str, SummedCounter] = {}
        for name, unit, desc in (
            ("usefulwork.requests", "{request}", "Finished client requests by outcome."),
            ("usefulwork.generated.tokens", "{token}", "Completion tokens by outcome (ok = useful)."),
            ("usefulwork.cost.usd", "{USD}", "Dollars by view: price_sheet, gpu_attributed, gpu_idle."),
            ("usefulwork.cache.lookups", "{lookup}", "Cache outcomes."),
            ("usefulwork.routing.decisions", "{decision}", "Pool chosen per request, with the router's reason."),
            ("usefulwork.admission.decisions", "{decision}", "Admission outcome per request."),
        ):
            self._sums[name] = self.fast_meter.create_counter(name, unit=unit, description=desc)
        self._requests = self._sums["usefulwork.requests"]
        self._generated = self._sums["usefulwork.generated.tokens"]
        self._cost = self._sums["usefulwork.cost.usd"]
        self._lookups = self._sums["usefulwork.cache.lookups"]
        self._routing = self._sums["usefulwork.routing.decisions"]
        self._admission = self._sums["usefulwork.admission.decisions"]
        self._intake = h.series("usefulwork.request.intake")
        self._plans: dict[tuple, tuple] = {}  # a request's labels -> where it is counted (``_plan``)
        m.create_observable_counter("usefulwork.gpu.cost.usd", callbacks=[self._gpu_cost], unit="{USD}",
                                    description="Each pool's GPU cost since it came up (its GPUs x $/GPU-hour; "
                                    "with gpu.per_replica, following its replicas).")

    def _add(self, name: str, value: float, attrs: tuple) -> None:
        self._sums[name].add_key(value, attrs)

    def _gpu_cost(self, options: CallbackOptions) -> Iterable[Observation]:
        now = self._clock()
        return [Observation(m.cost_between(m.started_at, now), {"pool": name}) for name, m in self._meters.items()]

    # -- per request --
    def record(self, ctx: RequestContext, times: tuple, rec: dict | None = None) -> None:
        """A finished request: ``times`` are its ledger ``timings`` (intake, ttft, tpot, e2e ms); ``rec`` its
        ledger record, needed when spans are exported (``spans``)."""
        slo = "n/a" if ctx.slo_met is None else ("true" if ctx.slo_met else "false")
        key = (ctx.endpoint, ctx.model, ctx.outcome, ctx.usage_source, ctx.pool, ctx.tenant, ctx.cache, slo,
               ctx.route, ctx.route_reason)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(key)
        usage_in, usage_out, duration, ttft_s, tpot_s, requests, generated, price, lookups, routing, admission = plan
        if usage_in is not None:
            usage_in.add(ctx.prompt_tokens)
            usage_out.add(ctx.completion_tokens)
        intake, ttft, tpot, e2e = times
        if e2e is not None:
            duration.add(e2e / 1000.0)
        if ttft is not None and ttft_s is not None:
            ttft_s.add(ttft / 1000.0)
        if tpot is not None and tpot_s is not None:
            tpot_s.add(tpot / 1000.0)
        sums = self._requests.sums
        sums[requests] = sums.get(requests, 0) + 1
        if ctx.completion_tokens:
            sums = self._generated.sums
            sums[generated] = sums.get(generated, 0) + ctx.completion_tokens
        if ctx.cost_usd:
            sums = self._cost.sums
            sums[price] = sums.get(price, 0) + ctx.cost_usd
        if lookups is not None:
            sums = self._lookups.sums
            sums[lookups] = sums.get(lookups, 0) + 1
        if routing is not None:
            sums = self._routing.sums
            sums[routing] = sums.get(routing, 0) + 1
        sums = self._admission.sums
        sums[admission] = sums.get(admission, 0) + 1
        if ctx.t_validated is not None:
            self._intake.add(intake / 1000.0)
        if self.spans:
            self._span(ctx, rec, OPERATION.get(ctx.endpoint, ctx.endpoint))

    def _plan(self, key: tuple) -> tuple:
        """Where a request with these labels is counted: its histogram series and counter keys, made once per
        label set (``record`` then costs a few dict updates instead of building every attribute set again)."""
        endpoint, model, outcome, usage_source, pool_name, tenant, cache, slo, route, route_reason = key
        op = OPERATION.get(endpoint, endpoint)
        pool = pool_name or "none"
        genai: tuple = (("gen_ai.operation.name", op), ("gen_ai.provider.name", "vllm"), ("gen_ai.request.model", model))
        if outcome != "ok":
            genai += (("error.type", outcome),)
        series = self.histograms.series
        usage_in = usage_out = None
        if usage_source != "none":
            src = genai + (("usefulwork.usage_source", usage_source),)
            usage_in = series("gen_ai.client.token.usage", src + (("gen_ai.token.type", "input"),))
            usage_out = series("gen_ai.client.token.usage", src + (("gen_ai.token.type", "output"),))
        ok = outcome == "ok"
        decision = "shed" if outcome == "shed" else "rejected" if outcome == "rejected" else "admitted"
        plan = (
            usage_in, usage_out,
            series("gen_ai.client.operation.duration", genai),
            series("gen_ai.server.time_to_first_token", genai) if ok else None,
            series("gen_ai.server.time_per_output_token", genai) if ok else None,
            (("outcome", outcome), ("pool", pool), ("tenant", tenant), ("cache", cache), ("slo_met", slo)),
            (("outcome", outcome), ("pool", pool), ("tenant", tenant)),
            (("view", "price_sheet"), ("pool", pool), ("tenant", tenant)),
            (("result", cache),) if outcome != "rejected" else None,
            (("pool", pool_name), ("route", route or "default"), ("reason", route_reason or "none"))
            if pool_name is not None else None,
            (("decision", decision),),
        )
        if len(self._plans) >= MAX_PLANS:  # label sets a client can vary (a model name sent to a 404): bounded
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def record_settled(self, items: Iterable[Settled]) -> None:
        for s in items:
            if s.idle_usd:
                self._add("usefulwork.cost.usd", s.idle_usd, (("view", "gpu_idle"), ("pool", s.pool), ("tenant", "idle")))
            for tenant, usd in s.by_tenant.items():
                self._add("usefulwork.cost.usd", usd, (("view", "gpu_attributed"), ("pool", s.pool), ("tenant", tenant)))

    def _span(self, ctx: RequestContext, rec: dict, op: str) -> None:
        start_ns = int(ctx.wall_start * 1e9)
        end_ns = start_ns + int((rec["e2e_ms"] or 0.0) * 1e6)
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": op,
            "gen_ai.provider.name": "vllm",
            "gen_ai.request.model": ctx.model,
            "gen_ai.usage.input_tokens": ctx.prompt_tokens,
            "gen_ai.usage.output_tokens": ctx.completion_tokens,
        }
        if ctx.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = ctx.max_tokens
        if ctx.replica:
            attrs["server.address"] = ctx.replica
        for key, value in rec.items():
            if value is not None and key not in ("model",):
                attrs[f"usefulwork.{key}"] = value
        if self.record_prompts and ctx.prompt_payload is not None:
            attrs["gen_ai.input.messages"] = orjson.dumps(ctx.prompt_payload, default=str).decode()[:16384]
        span = self.tracer.start_span(f"{op} {ctx.model}", kind=SpanKind.SERVER, start_time=start_ns,
                                      attributes=attrs)
        if ctx.outcome in ("error", "timeout"):
            span.set_status(Status(StatusCode.ERROR, ctx.error or ctx.outcome))
            span.set_attribute("error.type", ctx.outcome)
        span.end(end_time=max(end_ns, start_ns))

    def shutdown(self) -> None:
        try:
            self.tracer_provider.shutdown()
            self.meter_provider.shutdown()
        finally:
            if self._prom is not None:
                _release_prometheus_reader(self._prom)
