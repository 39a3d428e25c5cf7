"""Histograms aggregated in-process, handed to OpenTelemetry's readers at collection time.

The SDK's ``Histogram.record`` cleans and hashes the attribute set on every call (about 70% of the
accounting's CPU per request, profiled: six records per request). The SDK has no observable
histogram, so the ledger's histograms are kept here instead: ``record`` is a dict lookup on a
tuple of attribute pairs plus a bisect. When a reader collects (a Prometheus scrape, an OTLP
export, a test's in-memory reader), ``attach`` appends these histograms, as the SDK's own data
model (cumulative temporality), to what the SDK collected. ``_receive_metrics`` is the hook the
SDK documents for reader subclasses; ``attach`` wraps it on the reader instance. The SDK calls it
only when it collected something: the gateway always has observable series (each pool's GPU cost).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from typing import Any, Iterable

from opentelemetry.sdk.metrics.export import (AggregationTemporality, Histogram, HistogramDataPoint, Metric,
                                              MetricReader, MetricsData, ResourceMetrics, ScopeMetrics)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

Attrs = tuple[tuple[str, Any], ...]


class _Series:
    __slots__ = ("bounds", "counts", "sum", "min", "max")

    def __init__(self, bounds: list[float]):
        self.bounds = bounds  # the histogram's (shared, never changed)
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.min = float("inf")
        self.max = float("-inf")

    def add(self, value: float) -> None:
        # OTel explicit buckets are (previous bound, bound]: bisect_left puts a value equal to a bound in its bucket.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        if value < self.min:
            self.min = value
        if value > self.max:
            self.max = value


class _Histogram:
    __slots__ = ("name", "unit", "description", "bounds", "series")

    def __init__(self, name: str, unit: str, description: str, bounds: list[float]):
        self.name = name
        self.unit = unit
        self.description = description
        self.bounds = list(bounds)
        self.series: dict[Attrs, _Series] = {}


class HistogramBook:
    """Named histograms with fixed bucket bounds; ``record`` runs on the event loop, reads in any thread."""

    def __init__(self, scope: str = "usefulwork.gateway.histograms"):  # its own scope: OTLP groups by scope
        self.scope = InstrumentationScope(scope)
        self._hists: dict[str, _Histogram] = {}
        self._start_ns = time.time_ns()
        self._lock = threading.Lock()  # series are added on the loop and read by reader threads

    def define(self, name: str, unit: str, description: str, bounds: Iterable[float]) -> _Histogram:
        h = self._hists[name] = _Histogram(name, unit, description, list(bounds))
        return h

    def record(self, name: str, value: float, attrs: Attrs = ()) -> None:
        h = self._hists[name]
        s = h.series.get(attrs)
        if s is None:
            s = self.series(name, attrs)
        s.add(value)

    def series(self, name: str, attrs: Attrs = ()) -> _Series:
        """One attribute set's series (made on first use), for a caller that records into it directly."""
        h = self._hists[name]
        s = h.series.get(attrs)
        if s is None:
            with self._lock:  # a reader thread may be iterating the series
                s = h.series[attrs] = _Series(h.bounds)
        return s

    def metrics(self) -> list[Metric]:
        now = time.time_ns()
        out = []
        with self._lock:
            for h in self._hists.values():
                points = [  # a series made ahead of its first value (``series``) is not shown until it has one
                    HistogramDataPoint(attributes=dict(attrs), start_time_unix_nano=self._start_ns, time_unix_nano=now,
                                       count=n, sum=s.sum, bucket_counts=list(s.counts),
                                       explicit_bounds=list(h.bounds), min=s.min, max=s.max)
                    for attrs, s in list(h.series.items()) if (n := sum(s.counts))
                ]
                if points:
                    out.append(Metric(name=h.name, description=h.description, unit=h.unit,
                                      data=Histogram(data_points=points,
                                                     aggregation_temporality=AggregationTemporality.CUMULATIVE)))
        return out

    def merge(self, data: MetricsData) -> MetricsData:
        extra = self.metrics()
        if not extra or not data.resource_metrics:
            return data
        first = data.resource_metrics[0]
        merged = ResourceMetrics(resource=first.resource, schema_url=first.schema_url,
                                 scope_metrics=[*first.scope_metrics, ScopeMetrics(self.scope, extra, "")])
        return MetricsData(resource_metrics=[merged, *data.resource_metrics[1:]])

    def attach(self, reader: MetricReader) -> None:
        """Make ``reader`` deliver these histograms with everything else it collects."""
        receive = reader._receive_metrics

        def receive_with_histograms(metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> None:
            receive(self.merge(metrics_data) if metrics_data is not None else metrics_data,
                    timeout_millis=timeout_millis, **kwargs)

        reader._receive_metrics = receive_with_histograms  # type: ignore[method-assign]
