"""Pre-aggregated histograms export exactly what the SDK's own histogram would, through any reader."""

from __future__ import annotations

import random

from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from usefulwork.gateway.accounting.histograms import HistogramBook

BOUNDS = [0.01, 0.1, 1.0, 10.0]


def _provider(reader: InMemoryMetricReader) -> MeterProvider:
    """A provider with one always-present series, as the gateway has (each pool's GPU cost):
    the SDK hands a reader nothing at all when it collected nothing."""
    mp = MeterProvider(metric_readers=[reader])
    mp.get_meter("t").create_observable_counter("always", callbacks=[lambda options: [Observation(1.0)]])
    return mp


def _points(reader: InMemoryMetricReader, name: str) -> dict:
    data = reader.get_metrics_data()
    return {tuple(sorted(p.attributes.items())): p
            for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics if m.name == name
            for p in m.data.data_points}


def test_same_buckets_sum_min_max_as_the_sdk_histogram():
    rng = random.Random(7)
    values = [rng.choice([0.01, 0.1, 1.0, 10.0]) if i % 5 == 0 else rng.lognormvariate(-1, 2) for i in range(2000)]
    attrs = [(("op", "chat"),), (("op", "chat"), ("error.type", "timeout"))]

    sdk_reader, book_reader = InMemoryMetricReader(), InMemoryMetricReader()
    sdk_hist = MeterProvider(metric_readers=[sdk_reader]).get_meter("t").create_histogram(
        "sdk", explicit_bucket_boundaries_advisory=BOUNDS)
    book = HistogramBook()
    book.define("book", "s", "test", BOUNDS)
    book.attach(book_reader)
    _provider(book_reader)
    for i, v in enumerate(values):
        a = attrs[i % 2]
        sdk_hist.record(v, dict(a))
        book.record("book", v, a)

    sdk, ours = _points(sdk_reader, "sdk"), _points(book_reader, "book")
    assert set(sdk) == set(ours) and len(ours) == 2
    for key, p in sdk.items():
        q = ours[key]
        assert list(q.bucket_counts) == list(p.bucket_counts)
        assert q.count == p.count and abs(q.sum - p.sum) < 1e-9 and q.min == p.min and q.max == p.max
        assert list(q.explicit_bounds) == BOUNDS


def test_cumulative_across_collections_and_nothing_before_the_first_record():
    reader = InMemoryMetricReader()
    book = HistogramBook()
    book.define("h", "s", "test", BOUNDS)
    book.attach(reader)
    _provider(reader)
    assert _points(reader, "h") == {}
    book.record("h", 0.5)
    book.record("h", 5.0)
    assert _points(reader, "h")[()].count == 2
    book.record("h", 50.0)
    p = _points(reader, "h")[()]
    assert p.count == 3 and list(p.bucket_counts) == [0, 0, 1, 1, 1]


def test_a_series_made_ahead_of_its_first_value_is_not_exported_until_it_has_one():
    book = HistogramBook()
    book.define("h", "s", "d", [1.0, 10.0])
    ahead = book.series("h", (("k", "v"),))
    assert book.metrics() == []
    ahead.add(0.5)
    book.record("h", 5.0, (("k", "w"),))
    points = {tuple(p.attributes.items()): p for m in book.metrics() for p in m.data.data_points}
    assert points[(("k", "v"),)].count == 1 and points[(("k", "v"),)].bucket_counts == [1, 0, 0]
    assert points[(("k", "w"),)].sum == 5.0
