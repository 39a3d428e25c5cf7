"""The meter filters get (FastMeter) exports what the SDK's own instruments would, through any reader."""

from __future__ import annotations

import random

from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from tests.gateway.accounting.test_histograms import _points
from usefulwork.gateway.accounting.histograms import HistogramBook
from usefulwork.gateway.accounting.instruments import DEFAULT_BOUNDS, FastMeter


def _meters() -> tuple[InMemoryMetricReader, object, InMemoryMetricReader, FastMeter]:
    sdk_reader, fast_reader = InMemoryMetricReader(), InMemoryMetricReader()
    sdk = MeterProvider(metric_readers=[sdk_reader]).get_meter("t")
    book = HistogramBook()
    book.attach(fast_reader)
    fast = FastMeter(MeterProvider(metric_readers=[fast_reader]).get_meter("t"), book, seconds_bounds=[0.1, 1.0])
    return sdk_reader, sdk, fast_reader, fast


def test_counters_and_histograms_match_the_sdks():
    sdk_reader, sdk, fast_reader, fast = _meters()
    rng = random.Random(3)
    instruments = [(sdk.create_counter("c"), fast.create_counter("c")),
                   (sdk.create_histogram("h", unit="ms"), fast.create_histogram("h", unit="ms"))]
    for i in range(3000):
        attrs = {"result": rng.choice(["hit", "miss", "bypass"]), "model": "m"} if i % 7 else None
        v = rng.choice([0.0, 1.0, 5.0, 12.5, 900.0, 20000.0])
        instruments[0][0].add(v, attrs)
        instruments[0][1].add(v, attrs)
        instruments[1][0].record(v, attrs)
        instruments[1][1].record(v, attrs)
    instruments[0][1].add(-1.0, {"result": "hit", "model": "m"})  # a counter never goes down (the SDK drops it too)
    for _ in range(2):  # cumulative: a second collection sees the same totals
        sdk_c, fast_c = _points(sdk_reader, "c"), _points(fast_reader, "c")
        assert set(sdk_c) == set(fast_c) and len(fast_c) == 4
        for key, p in sdk_c.items():
            assert fast_c[key].value == p.value
        sdk_h, fast_h = _points(sdk_reader, "h"), _points(fast_reader, "h")
        assert set(sdk_h) == set(fast_h)
        for key, p in sdk_h.items():
            q = fast_h[key]
            assert list(q.bucket_counts) == list(p.bucket_counts) and q.count == p.count and q.sum == p.sum
            assert list(q.explicit_bounds) == list(DEFAULT_BOUNDS) == list(p.explicit_bounds)


def test_seconds_histograms_get_duration_buckets_and_other_instruments_pass_through():
    _, _, fast_reader, fast = _meters()
    fast.create_histogram("wait", unit="s").record(0.5, {"pool": "p"})
    fast.create_histogram("advised", unit="s", explicit_bucket_boundaries_advisory=[2.0]).record(3.0)
    seen = []
    fast.create_observable_gauge("g", [lambda options: seen.append(1) or [Observation(1.0)]])  # the SDK's own
    assert list(_points(fast_reader, "wait")[(("pool", "p"),)].explicit_bounds) == [0.1, 1.0]
    assert list(_points(fast_reader, "advised")[()].explicit_bounds) == [2.0]
    assert seen
