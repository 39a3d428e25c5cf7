"""Arrival processes, checked statistically on fixed seeds (rate and coefficient of variation)."""

import numpy as np
import pytest

from usefulwork.loadtest import arrivals
from usefulwork.loadtest.arrivals import ArrivalError, Constant, Gamma, OnOff, Poisson, from_spec, planned_offsets


def _gaps(proc, n=20000, seed=1):
    t = np.array(planned_offsets(proc, np.random.default_rng(seed), count=n))
    return t, np.diff(t)


def test_constant_is_exactly_periodic():
    t, gaps = _gaps(Constant(rate=4.0), n=100)
    assert t[0] == 0.0
    assert np.allclose(gaps, 0.25)


def test_poisson_rate_and_cv():
    _, gaps = _gaps(Poisson(5.0))
    assert 1 / gaps.mean() == pytest.approx(5.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0, 4.0])
def test_gamma_burstiness_sets_cv(burstiness):
    _, gaps = _gaps(Gamma(rate=3.0, burstiness=burstiness))
    assert 1 / gaps.mean() == pytest.approx(3.0, rel=0.04)
    # vLLM bench's gamma: shape = burstiness -> CV = 1/sqrt(burstiness)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)


def test_onoff_rates_per_phase():
    proc = OnOff(base_rate=1.0, peak_rate=10.0, period_s=20.0, duty=0.25)
    t = np.array(planned_offsets(proc, np.random.default_rng(3), duration_s=4000.0))
    phase = t % 20.0
    on = np.count_nonzero(phase < 5.0)
    off = len(t) - on
    # 200 periods: 1000 s on at 10/s, 3000 s off at 1/s
    assert on / 1000.0 == pytest.approx(10.0, rel=0.05)
    assert off / 3000.0 == pytest.approx(1.0, rel=0.06)
    assert len(t) / 4000.0 == pytest.approx(proc.mean_rate, rel=0.04)
    assert proc.mean_rate == pytest.approx(3.25)


def test_onoff_zero_base_rate_sends_only_in_bursts():
    proc = OnOff(base_rate=0.0, peak_rate=5.0, period_s=10.0, duty=0.3)
    t = np.array(planned_offsets(proc, np.random.default_rng(0), duration_s=500.0))
    assert len(t) > 500
    assert np.all(t % 10.0 < 3.0)


def test_same_seed_same_schedule_and_stop_rules():
    a = planned_offsets(Poisson(2.0), np.random.default_rng(42), count=50)
    b = planned_offsets(Poisson(2.0), np.random.default_rng(42), count=50)
    assert a == b and len(a) == 50
    d = planned_offsets(Poisson(2.0), np.random.default_rng(42), duration_s=10.0)
    assert all(x < 10.0 for x in d) and d == a[: len(d)]
    with pytest.raises(ArrivalError):
        planned_offsets(Poisson(2.0), np.random.default_rng(0))


def test_from_spec_and_errors():
    assert from_spec({"process": "gamma", "rate": 2, "burstiness": 0.5}).describe() == {
        "process": "gamma", "rate": 2, "burstiness": 0.5}
    assert from_spec({"process": "poisson", "rate": 1}).name == "poisson"
    with pytest.raises(ArrivalError, match="unknown arrival process 'zipf'"):
        from_spec({"process": "zipf", "rate": 1})
    with pytest.raises(ArrivalError, match="needs field 'rate'"):
        from_spec({"process": "poisson"})
    with pytest.raises(ArrivalError, match="rate must be a positive"):
        from_spec({"process": "constant", "rate": 0})
    with pytest.raises(ArrivalError, match="duty"):
        from_spec({"process": "onoff", "peak_rate": 1, "period_s": 5, "duty": 1.5})
    with pytest.raises(ArrivalError, match="does not take burstiness"):
        from_spec({"process": "poisson", "rate": 1, "burstiness": 2})
    assert set(arrivals.PROCESSES) == {"constant", "poisson", "gamma", "onoff"}


def test_onoff_walks_past_segment_ends_that_floating_point_cannot_reach():
    """A period that is not a round number (the experiment's 30 s divided by a calibrated pace of 1.4533):
    ``t % period_s`` at a segment's end came out a hair short of it, the segment's end rounded back to
    ``t``, and the walk spun forever inside the loadtest's burst cell."""
    proc = from_spec(arrivals.paced({"process": "onoff", "base_rate": 0.2, "peak_rate": 2.0, "period_s": 30,
                                     "duty": 0.5}, 1.4532509664933468))
    t = np.array(planned_offsets(proc, np.random.default_rng(7919), duration_s=2000.0))
    on = np.count_nonzero(t % proc.period_s < proc.duty * proc.period_s)
    assert len(t) / 2000.0 == pytest.approx(proc.mean_rate, rel=0.08)
    assert on / len(t) == pytest.approx(proc.peak_rate / (proc.peak_rate + proc.base_rate), abs=0.03)
    assert np.all(np.diff(t) > 0)
