"""Open-loop arrival processes: when each request is *planned* to be sent.

Every process turns a seeded ``numpy.random.Generator`` into planned send offsets (seconds from the
start of the run). The runner sends each request at its planned time and records how late it
really went out (schedule lag), so the load generator never hides its own queueing.

- ``constant``: one request every 1/rate seconds.
- ``poisson``: exponential gaps (coefficient of variation 1).
- ``gamma``: gamma-distributed gaps with ``burstiness`` as the shape, as ``vllm bench serve`` does:
  shape = burstiness, scale = 1 / (rate * burstiness). burstiness 1 is Poisson; below 1 is burstier
  (CV = 1/sqrt(burstiness)); above 1 is smoother.
- ``onoff``: a Poisson process whose rate switches between ``base_rate`` (off) and ``peak_rate``
  (on) every ``period_s``; the on-phase lasts ``duty * period_s`` at the start of each period.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Protocol

import numpy as np


class ArrivalError(ValueError):
    """A bad arrival specification; the message names the field."""


class ArrivalProcess(Protocol):
    name: str

    def offsets(self, rng: np.random.Generator) -> Iterator[float]:
        """Planned send offsets in seconds, increasing, without end."""
        ...

    @property
    def mean_rate(self) -> float: ...

    def describe(self) -> dict[str, Any]: ...


def _positive(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ArrivalError(f"arrival {name} must be a positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Constant:
    rate: float
    name: str = "constant"

    def __post_init__(self) -> None:
        _positive("rate", self.rate)

    def offsets(self, rng: np.random.Generator) -> Iterator[float]:
        gap = 1.0 / self.rate
        i = 0
        while True:
            yield i * gap
            i += 1

    @property
    def mean_rate(self) -> float:
        return self.rate

    def describe(self) -> dict[str, Any]:
        return {"process": self.name, "rate": self.rate}


@dataclass(frozen=True)
class Gamma:
    """Gamma gaps; ``Poisson`` is the burstiness-1 special case."""

    rate: float
    burstiness: float = 1.0
    name: str = "gamma"

    def __post_init__(self) -> None:
        _positive("rate", self.rate)
        _positive("burstiness", self.burstiness)

    def offsets(self, rng: np.random.Generator) -> Iterator[float]:
        theta = 1.0 / (self.rate * self.burstiness)
        t = 0.0
        while True:
            # Draw in blocks: one numpy call per 256 arrivals keeps the generator cheap.
            for gap in rng.gamma(shape=self.burstiness, scale=theta, size=256):
                t += float(gap)
                yield t

    @property
    def mean_rate(self) -> float:
        return self.rate

    def describe(self) -> dict[str, Any]:
        return {"process": self.name, "rate": self.rate, "burstiness": self.burstiness}


def Poisson(rate: float) -> Gamma:  # noqa: N802 - reads like a class at call sites
    return Gamma(rate=rate, burstiness=1.0, name="poisson")


@dataclass(frozen=True)
class OnOff:
    """Poisson arrivals with a square-wave rate: ``peak_rate`` for ``duty*period_s``, then ``base_rate``."""

    base_rate: float
    peak_rate: float
    period_s: float
    duty: float
    name: str = "onoff"

    def __post_init__(self) -> None:
        if not isinstance(self.base_rate, (int, float)) or self.base_rate < 0:
            raise ArrivalError(f"arrival base_rate must be >= 0, got {self.base_rate!r}")
        _positive("peak_rate", self.peak_rate)
        _positive("period_s", self.period_s)
        if not isinstance(self.duty, (int, float)) or not 0 < self.duty <= 1:
            raise ArrivalError(f"arrival duty must be in (0, 1], got {self.duty!r}")

    def rate_at(self, t: float) -> float:
        return self.peak_rate if (t % self.period_s) < self.duty * self.period_s else self.base_rate

    def offsets(self, rng: np.random.Generator) -> Iterator[float]:
        # Exact inversion of the piecewise-constant cumulative intensity: draw an Exp(1) amount of
        # "intensity" and walk through the on/off segments until it is used up. The walk counts
        # segments (period ``k``, on or off) rather than taking ``t % period_s``: with a period that is
        # not a round number (an experiment's periods divided by its calibrated pace, 30 / 1.4533 s) the
        # remainder at a segment's end could come out a hair short of it, that segment's end then
        # rounded back to ``t`` itself, and the walk never moved again (a loadtest hung in its burst cell).
        t = 0.0
        k, on = 0, True
        on_len = self.duty * self.period_s
        while True:
            need = float(rng.exponential(1.0))
            while True:
                rate = self.peak_rate if on else self.base_rate
                seg_end = k * self.period_s + (on_len if on else self.period_s)
                room = max(0.0, seg_end - t) * rate
                if rate > 0 and need <= room:
                    t += need / rate
                    break
                need -= room
                t = max(t, seg_end)
                if on:
                    on = False
                else:
                    k, on = k + 1, True
            yield t

    @property
    def mean_rate(self) -> float:
        return self.peak_rate * self.duty + self.base_rate * (1 - self.duty)

    def describe(self) -> dict[str, Any]:
        return {"process": self.name, "base_rate": self.base_rate, "peak_rate": self.peak_rate,
                "period_s": self.period_s, "duty": self.duty}


PROCESSES = ("constant", "poisson", "gamma", "onoff")


def from_spec(spec: Mapping[str, Any]) -> ArrivalProcess:
    """Build a process from a mapping like ``{"process": "gamma", "rate": 2, "burstiness": 0.5}``."""
    kind = spec.get("process", "poisson")
    known = {"process"}
    try:
        if kind == "constant":
            known |= {"rate"}
            proc: ArrivalProcess = Constant(rate=spec["rate"])
        elif kind == "poisson":
            known |= {"rate"}
            proc = Poisson(spec["rate"])
        elif kind == "gamma":
            known |= {"rate", "burstiness"}
            proc = Gamma(rate=spec["rate"], burstiness=spec.get("burstiness", 1.0))
        elif kind == "onoff":
            known |= {"base_rate", "peak_rate", "period_s", "duty"}
            proc = OnOff(base_rate=spec.get("base_rate", 0.0), peak_rate=spec["peak_rate"],
                         period_s=spec["period_s"], duty=spec["duty"])
        else:
            raise ArrivalError(f"unknown arrival process {kind!r}; choose one of {', '.join(PROCESSES)}")
    except KeyError as exc:
        raise ArrivalError(f"arrival process {kind!r} needs field {exc.args[0]!r}") from None
    extra = set(spec) - known
    if extra:
        raise ArrivalError(f"arrival process {kind!r} does not take {', '.join(sorted(extra))}")
    return proc


def paced(spec: Mapping[str, Any] | None, factor: float, clock: float | None = None) -> dict[str, Any] | None:
    """The same arrivals at ``factor`` times the rate: rates times ``factor``, on/off periods divided by
    ``clock`` (by default ``factor``: the same arrivals, squeezed or stretched in time)."""
    if spec is None:
        return None
    clock = factor if clock is None else clock
    return {k: v * factor if k in ("rate", "base_rate", "peak_rate") else v / clock if k == "period_s" else v
            for k, v in spec.items()}


def planned_offsets(process: ArrivalProcess, rng: np.random.Generator, *, duration_s: float | None = None,
                    count: int | None = None) -> list[float]:
    """The first offsets, stopping at ``count`` arrivals or before ``duration_s`` (whichever first)."""
    if duration_s is None and count is None:
        raise ArrivalError("an open-loop run needs a duration or a request count")
    out: list[float] = []
    for t in process.offsets(rng):
        if (duration_s is not None and t >= duration_s) or (count is not None and len(out) >= count):
            break
        out.append(t)
    return out
