"""The meter filters and pickers get (``Services.meter``): counters and histograms summed in-process.

An OpenTelemetry SDK ``Counter.add`` validates, cleans and hashes its attribute set and takes a lock
on every call: profiled through the gateway, the cache filter's two ``add`` calls per request cost
about as much as the rest of the filter. ``FastMeter`` keeps the SDK's instrument API
(``create_counter(...).add(value, attributes)``, ``create_histogram(...).record(value, attributes)``)
but a counter is a dict update, read by the SDK through an observable counter only when a reader
collects (a Prometheus scrape, an OTLP export); a histogram goes to the ``HistogramBook`` the
ledger's own histograms use. Exported data is the same kind: a monotonic cumulative sum, a
histogram with explicit buckets. Anything else (gauges, observable instruments) goes to the SDK
meter unchanged.

Attribute sets are keyed by their items in the order the caller wrote them: one call site always
writes the same order, and two orders of the same set would only split a series, never lose counts.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from opentelemetry.metrics import CallbackOptions, Observation

from usefulwork.gateway.accounting.histograms import HistogramBook

# The SDK's default explicit bucket bounds, for a histogram created without advice.
DEFAULT_BOUNDS = (0.0, 5.0, 10.0, 25.0, 50.0, 75.0, 100.0, 250.0, 500.0, 750.0, 1000.0, 2500.0, 5000.0, 7500.0,
                  10000.0)


class SummedCounter:
    """A monotonic counter: per attribute set, a running sum."""

    __slots__ = ("sums",)

    def __init__(self) -> None:
        self.sums: dict[tuple, float] = {}

    def add(self, amount: float, attributes: Mapping[str, Any] | None = None) -> None:
        if amount < 0:  # a counter only grows (the SDK drops negative adds too)
            return
        key = tuple(attributes.items()) if attributes else ()
        self.sums[key] = self.sums.get(key, 0) + amount

    def add_key(self, amount: float, key: tuple) -> None:
        """``add`` with the attribute set already a tuple of pairs (the ledger's own hot path)."""
        self.sums[key] = self.sums.get(key, 0) + amount

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        # list(): one C-level copy, safe against the loop adding a key meanwhile (a reader thread)
        return [Observation(v, dict(k)) for k, v in list(self.sums.items())]


class BookHistogram:
    __slots__ = ("book", "name")

    def __init__(self, book: HistogramBook, name: str):
        self.book = book
        self.name = name

    def record(self, amount: float, attributes: Mapping[str, Any] | None = None, context: Any = None) -> None:
        self.book.record(self.name, amount, tuple(attributes.items()) if attributes else ())


class FastMeter:
    def __init__(self, meter: Any, histograms: HistogramBook, seconds_bounds: Iterable[float] | None = None):
        self._meter = meter
        self._histograms = histograms
        self._seconds_bounds = tuple(seconds_bounds) if seconds_bounds else None  # for unit "s" without advice

    def create_counter(self, name: str, unit: str = "", description: str = "") -> SummedCounter:
        counter = SummedCounter()
        self._meter.create_observable_counter(name, callbacks=[counter.observe], unit=unit, description=description)
        return counter

    def create_histogram(self, name: str, unit: str = "", description: str = "",
                         explicit_bucket_boundaries_advisory: Iterable[float] | None = None) -> BookHistogram:
        bounds = explicit_bucket_boundaries_advisory or (unit == "s" and self._seconds_bounds) or DEFAULT_BOUNDS
        self._histograms.define(name, unit, description, bounds)
        return BookHistogram(self._histograms, name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._meter, name)
