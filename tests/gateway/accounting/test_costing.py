"""Cost views: the price sheet, and GPU-time attribution with its conservation law."""

from __future__ import annotations

import random

import pytest

from usefulwork.config import CostCfg, Pool, Prices
from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.accounting.costing import PoolMeter, Share, price_sheet_cost, request_spans, work_units


def _ctx(**kw) -> RequestContext:
    base = dict(id="r", endpoint="chat", model="m", stream=False, pool="p")
    base.update(kw)
    return RequestContext(**base)


def test_price_sheet_charges_input_cached_and_output_tokens():
    pool = Pool(name="p", models=["m"], replicas=["http://h:1"],
                prices=Prices(input_per_1m=2.0, output_per_1m=10.0, cached_input_per_1m=0.5))
    ctx = _ctx(prompt_tokens=1000, cached_tokens=400, completion_tokens=300)
    assert price_sheet_cost(pool, ctx) == pytest.approx((600 * 2.0 + 400 * 0.5 + 300 * 10.0) / 1e6)
    # No cached price: cached input is billed as input. A cache hit costs nothing.
    plain = Pool(name="p", models=["m"], replicas=["http://h:1"], prices=Prices(input_per_1m=2.0))
    assert price_sheet_cost(plain, ctx) == pytest.approx(1000 * 2.0 / 1e6)
    assert price_sheet_cost(pool, _ctx(prompt_tokens=10, completion_tokens=10, cache="hit-exact")) == 0.0
    assert price_sheet_cost(None, ctx) == 0.0


def test_work_units_use_configured_weights_and_skip_cached_prefill():
    cost = CostCfg(prefill_weight=0.25, decode_weight=2.0)
    assert work_units(cost, _ctx(prompt_tokens=100, cached_tokens=20, completion_tokens=10)) == (20.0, 20.0)
    assert work_units(cost, _ctx(prompt_tokens=100, completion_tokens=10, cache="hit-semantic")) == (0.0, 0.0)
    assert work_units(cost, _ctx(pool=None, prompt_tokens=100)) == (0.0, 0.0)


def test_request_spans_map_perf_counter_to_wall_clock():
    ctx = _ctx(wall_start=1000.0, t_start=50.0, t_forwarded=50.5, t_first_token=51.0, t_end=53.0)
    assert request_spans(ctx, 7.0, 9.0) == [(1000.5, 1001.0, 7.0), (1001.0, 1003.0, 9.0)]
    # never got a first token: everything is prefill time
    ctx = _ctx(wall_start=1000.0, t_start=50.0, t_end=52.0)
    assert request_spans(ctx, 7.0, 0.0) == [(1000.0, 1002.0, 7.0), (1002.0, 1002.0, 0.0)]


def test_one_interval_is_split_by_share_of_work_and_empty_ones_are_idle():
    m = PoolMeter("p", usd_per_hour=3.6, started_at=0.0, interval_s=1.0)  # $0.001 per second
    a, b = Share("a", "t1"), Share("b", "t2")
    m.book(a, [(0.2, 0.4, 30.0)])
    m.book(b, [(0.5, 0.9, 10.0)])
    settled = m.settle(3.0)
    assert [s.start for s in settled] == [0.0, 1.0, 2.0]
    assert a.usd == pytest.approx(0.00075) and b.usd == pytest.approx(0.00025)
    assert settled[0].by_tenant == pytest.approx({"t1": 0.00075, "t2": 0.00025})
    assert m.idle_usd == pytest.approx(0.002)
    assert a.pending == 0 and b.pending == 0


def test_work_spread_over_intervals_in_proportion_to_time():
    m = PoolMeter("p", usd_per_hour=3.6, started_at=0.0, interval_s=1.0)
    long, short = Share("long", "t"), Share("short", "t")
    m.book(long, [(0.0, 4.0, 40.0)])  # 10 work per interval
    m.book(short, [(1.0, 2.0, 30.0)])  # all in interval 1
    m.settle(4.0)
    # intervals 0, 2, 3 are all `long`'s; interval 1 is 10:30
    assert long.usd == pytest.approx(0.003 + 0.001 * 10 / 40)
    assert short.usd == pytest.approx(0.001 * 30 / 40)
    assert m.idle_usd == 0.0


def test_settlement_waits_for_the_frontier_and_late_work_moves_forward():
    m = PoolMeter("p", usd_per_hour=3.6, started_at=0.0, interval_s=1.0)
    m.settle(2.5)  # intervals 0 and 1 become idle
    assert m.frontier == 2.0 and m.idle_usd == pytest.approx(0.002)
    late = Share("late", "t")
    m.book(late, [(0.0, 3.0, 30.0)])  # its work before t=2 is spread over [2, 3)
    m.settle(3.0)
    assert late.usd == pytest.approx(0.001)
    past = Share("past", "t")
    m.book(past, [(0.5, 1.0, 5.0)])  # wholly before the frontier: first open interval
    m.settle(4.0)
    assert past.usd == pytest.approx(0.001)


def test_provisional_view_of_open_intervals():
    m = PoolMeter("p", usd_per_hour=3.6, started_at=0.0, interval_s=1.0)
    m.book(Share("a", "t1"), [(1.0, 2.0, 1.0)])
    idle, by_tenant = m.provisional(0.0, 2.5)
    assert idle == pytest.approx(0.0015) and by_tenant == pytest.approx({"t1": 0.001})


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_conservation_attributed_plus_idle_equals_fleet_cost(seed):
    """Random traffic over several pools: sum(request shares) + idle == GPU cost, to 1e-6."""
    rng = random.Random(seed)
    t0 = 1_700_000_000.0
    meters = {name: PoolMeter(name, usd_per_hour=rng.uniform(0.5, 40.0), started_at=t0 + rng.uniform(0, 5),
                              interval_s=rng.choice([0.25, 1.0, 2.0]))
              for name in ("small", "large", "spare")}
    shares: list[Share] = []
    now = t0
    for _ in range(3000):
        now += rng.expovariate(20.0)
        pool = rng.choice(["small", "large"])  # "spare" never serves: all idle
        dur = rng.uniform(0.01, 40.0)
        start = now - dur
        first = start + rng.uniform(0, dur)
        s = Share(len(shares), rng.choice(["a", "b", "c"]))
        meters[pool].book(s, [(start, first, rng.uniform(0, 2000)), (first, now, rng.uniform(0, 500))])
        shares.append(s)
        if rng.random() < 0.05:
            for m in meters.values():
                m.settle(now - rng.uniform(0, 30))
    end = now + 3.7
    for m in meters.values():
        m.settle_all(end)
    fleet_cost = sum(m.rate * (end - m.started_at) for m in meters.values())
    attributed = sum(s.usd for s in shares)
    idle = sum(m.idle_usd for m in meters.values())
    assert attributed + idle == pytest.approx(fleet_cost, abs=1e-6, rel=0)
    assert sum(m.attributed_usd for m in meters.values()) == pytest.approx(attributed, abs=1e-6, rel=0)
    assert meters["spare"].idle_usd == pytest.approx(meters["spare"].rate * (end - meters["spare"].started_at))
    assert all(s.pending == 0 for s in shares)
    assert all(s.usd >= 0 for s in shares)


def test_the_bill_follows_rate_changes_inside_intervals_and_stays_conserved():
    """gpu.per_replica under discovery: the rate changes at any moment (also mid-interval); each interval
    costs the integral of the rate over it, and attributed + idle == that bill."""
    rng = random.Random(4)
    t0 = 1_700_000_000.0
    m = PoolMeter("p", usd_per_hour=3.6, started_at=t0, interval_s=1.0)
    changes = [(t0 + 10.5, 7.2), (t0 + 10.5, 10.8), (t0 + 30.25, 3.6), (t0 + 29.0, 0.0)]  # a tie; one "earlier"
    for t, usd_h in changes:
        m.set_rate(t, usd_h)
    # 3.6 $/h until 10.5, 10.8 until 30.25 (the 7.2 lasted no time), then 0 (the late change is put at 30.25)
    expected = lambda a, b: sum(r / 3600 * max(0.0, min(b, hi) - max(a, lo))  # noqa: E731
                                for lo, hi, r in [(t0, t0 + 10.5, 3.6), (t0 + 10.5, t0 + 30.25, 10.8),
                                                  (t0 + 30.25, t0 + 1e9, 0.0)])
    assert m.cost_between(t0 + 10, t0 + 11) == pytest.approx(expected(t0 + 10, t0 + 11), abs=1e-12)
    assert m.cost_between(t0, t0 + 40) == pytest.approx(expected(t0, t0 + 40), abs=1e-12)
    shares = []
    for i in range(400):
        a = t0 + rng.uniform(0, 38)
        s = Share(i, "t")
        m.book(s, [(a, a + rng.uniform(0, 2), rng.uniform(0, 10))])
        shares.append(s)
    m.settle(t0 + 20)
    m.settle_all(t0 + 40.3)
    assert sum(s.usd for s in shares) + m.idle_usd == pytest.approx(expected(t0, t0 + 40.3), abs=1e-9)
