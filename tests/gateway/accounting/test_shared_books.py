"""Shared GPU-time books on real Redis: three gateways' meters in one process, random work, random
sync order, late bookings, a gateway leaving early and one going silent: conserved to 1e-6."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest
import redis

from tests.conftest import drop_redis_keys
from usefulwork.config import ScaleOut
from usefulwork.gateway.accounting.costing import PoolMeter, Share
from usefulwork.gateway.accounting.shared import SharedBooks

DT = 0.5
RATE = 3.6  # $/h


@pytest.mark.parametrize("scaling", [False, True], ids=["fixed-bill", "bill-follows-replicas"])
def test_three_meters_conserve_with_late_work_and_leaving_gateways(redis_url, scaling):
    """``scaling``: the pool's bill changes twice (gpu.per_replica under discovery), and each gateway sees
    each change at a different moment (its own discovery poll), so their meters disagree on some
    intervals' bill: the gateway that settles an interval decides it, and every gateway pays from it."""
    prefix = f"usefulwork:test14b:{uuid.uuid4().hex[:8]}"
    rng = random.Random(7)

    async def main() -> tuple[dict, list[Share], list[PoolMeter]]:
        cfg = ScaleOut(redis_url=redis_url, prefix=prefix, gateway_ttl_s=2.0)
        books = [SharedBooks(cfg, DT) for _ in range(3)]
        t0 = 1_000_000.0
        meters = [PoolMeter("p", RATE, t0 + i * 0.123, DT) for i in range(3)]  # different local starts
        for b, m in zip(books, meters):
            await b.join({"p": m})
        assert len({m.started_at for m in meters}) == 1  # the fleet's alignment
        shares: list[Share] = []
        now = t0
        for step in range(60):
            now += DT * rng.uniform(0.3, 1.5)
            if scaling and step in (15, 35):  # 1 -> 3 replicas, then 3 -> 2: seen up to 1.3 intervals apart
                for i, m in enumerate(meters):
                    m.set_rate(now + i * DT * 0.65, RATE * (3 if step == 15 else 2))
            for i, (b, m) in enumerate(zip(books, meters)):
                if (i == 2 and step >= 40) or (i == 1 and step > 30):
                    continue  # 2 goes silent (its floor expires after gateway_ttl_s of Redis time); 1 has left
                for _ in range(rng.randint(0, 4)):
                    s = Share(key=len(shares), tenant=rng.choice("ab"))
                    a = now - rng.uniform(0, 6)  # some start before the fleet's frontier: booked late
                    m.book(s, [(a, a + rng.uniform(0, 2), rng.uniform(1, 50)), (a + 2, now, rng.uniform(0, 80))])
                    shares.append(s)
                if i == 1 and step == 30:
                    await b.leave({"p": m}, now)  # stops early, while the others keep booking
                    continue
                await b.sync(m, now - rng.uniform(0, 3), now=now)
            if step == 40:
                await asyncio.sleep(2.2)  # gateway 2's floor is now stale
        await books[0].leave({"p": meters[0]}, now + 1)
        for _ in range(5):  # back from silence with late work: it moves to the first open interval, conserved
            s = Share(key=len(shares), tenant="a")
            meters[2].book(s, [(now - 20, now - 10, 30.0)])
            shares.append(s)
        await books[2].leave({"p": meters[2]}, now + 2)
        for b in books:
            await b.close()
        return meters[0].fleet_books, shares, meters

    try:
        fleet, shares, meters = asyncio.run(main())
        raw = {k.decode(): float(v) for k, v in
               redis.Redis.from_url(redis_url).hgetall(f"{prefix}:gpu:{{p}}:books").items()}
    finally:
        drop_redis_keys(redis_url, f"{prefix}:")
    assert all(s.pending == 0 for s in shares) and len(shares) > 200
    paid = sum(s.usd for s in shares)
    assert abs(raw["attributed_usd"] + raw["idle_usd"] - raw["cost_usd"]) < 1e-6, raw
    assert abs(paid - raw["attributed_usd"]) < 1e-6
    if scaling:  # each interval billed at one of the rates in force around it, whole
        assert raw["settled_k"] * DT * RATE / 3600 * 1.3 < raw["cost_usd"] < raw["settled_k"] * DT * 3 * RATE / 3600
    else:
        assert abs(raw["cost_usd"] - raw["settled_k"] * DT * RATE / 3600) < 1e-9
    assert raw["idle_usd"] > 0 and paid > 0
    assert sum(m.attributed_usd for m in meters) == paid or abs(sum(m.attributed_usd for m in meters) - paid) < 1e-9


def test_a_gateway_with_nothing_open_leaves_through_the_shared_books(redis_url):
    """Leaving with no open interval and no new work (an idle gateway at SIGTERM) still goes through
    Redis: before the fix, computing the forced frontier raised, and the gateway settled alone."""
    prefix = f"usefulwork:test14c:{uuid.uuid4().hex[:8]}"

    async def main() -> dict:
        b = SharedBooks(ScaleOut(redis_url=redis_url, prefix=prefix, gateway_ttl_s=2.0), DT)
        m = PoolMeter("p", RATE, 1_000_000.0, DT)
        await b.join({"p": m})
        assert not m.open_ks()
        await b.leave({"p": m}, 1_000_003.0)  # raised TypeError before the fix
        await b.close()
        return m.fleet_books

    try:
        fleet = asyncio.run(main())
        assert fleet["cost_usd"] > 0 and abs(fleet["idle_usd"] - fleet["cost_usd"]) < 1e-12  # all idle, booked once
    finally:
        drop_redis_keys(redis_url, f"{prefix}:")


def test_work_moved_past_a_peers_leave_is_settled_when_its_gateway_leaves_too(redis_url):
    """Two workers stopped by one SIGTERM: A leaves first and moves the fleet's frontier past the current
    interval; B's last request (booked there, not yet pushed) moves to the first open interval, which B's
    own leave must settle too. Before the fix it stayed open: the share kept ``pending`` > 0 and the ledger
    never wrote that request's record (tests/gateway/test_workers.py lost 1 of 51 now and then)."""
    prefix = f"usefulwork:test14d:{uuid.uuid4().hex[:8]}"

    async def main() -> tuple[Share, dict]:
        cfg = ScaleOut(redis_url=redis_url, prefix=prefix, gateway_ttl_s=5.0)
        a, b = SharedBooks(cfg, DT), SharedBooks(cfg, DT)
        t0 = 1_000_000.0
        ma, mb = PoolMeter("p", RATE, t0, DT), PoolMeter("p", RATE, t0, DT)
        await a.join({"p": ma})
        await b.join({"p": mb})
        now = t0 + 10 * DT + 0.1
        s = Share(key="last", tenant="t")
        mb.book(s, [(now - 0.3, now, 40.0)])  # finished just before the SIGTERM, in the current interval
        await a.leave({"p": ma}, now)
        await b.leave({"p": mb}, now)  # same instant, same interval
        for x in (a, b):
            await x.close()
        return s, mb.fleet_books

    try:
        share, fleet = asyncio.run(main())
    finally:
        drop_redis_keys(redis_url, f"{prefix}:")
    assert share.pending == 0 and share.usd > 0
    assert abs(fleet["attributed_usd"] + fleet["idle_usd"] - fleet["cost_usd"]) < 1e-9, fleet


def test_two_gateways_late_work_moved_past_a_peers_leave_shares_that_intervals_bill(redis_url):
    """A leaves and moves the fleet's frontier past the current interval; B and C each had work there, not
    yet pushed. C pushes (its work moves to the first open interval), then B leaves and settles that
    interval, then C. B must pay its share of the fleet's work there (40 of 70), not the whole bill from
    its own work alone: it did, and C paid its 30 of 70 too, so the fleet paid 0.43 of an interval twice
    (CI: test_shared.py's three gateways, attributed + idle over the bill by 0.28 of an interval, once in
    many runs)."""
    prefix = f"usefulwork:test14e:{uuid.uuid4().hex[:8]}"

    async def main() -> tuple[Share, Share, dict]:
        cfg = ScaleOut(redis_url=redis_url, prefix=prefix, gateway_ttl_s=5.0)
        a, b, c = SharedBooks(cfg, DT), SharedBooks(cfg, DT), SharedBooks(cfg, DT)
        t0 = 1_000_000.0
        ma, mb, mc = (PoolMeter("p", RATE, t0, DT) for _ in range(3))
        for x, m in ((a, ma), (b, mb), (c, mc)):
            await x.join({"p": m})
        now = t0 + 10 * DT + 0.1
        sb, sc = Share(key="b", tenant="t"), Share(key="c", tenant="t")
        mb.book(sb, [(now - 0.3, now, 40.0)])
        mc.book(sc, [(now - 0.3, now, 30.0)])
        await a.leave({"p": ma}, now)
        await c.sync(mc, mc._t(mc.settled_k), now=now)
        await b.leave({"p": mb}, now)
        await c.leave({"p": mc}, now)
        for x in (a, b, c):
            await x.close()
        return sb, sc, mc.fleet_books

    try:
        sb, sc, fleet = asyncio.run(main())
    finally:
        drop_redis_keys(redis_url, f"{prefix}:")
    usd = RATE / 3600 * DT
    assert sb.usd == pytest.approx(usd * 40 / 70, rel=1e-9) and sc.usd == pytest.approx(usd * 30 / 70, rel=1e-9)
    assert sb.pending == sc.pending == 0
    assert abs(fleet["attributed_usd"] + fleet["idle_usd"] - fleet["cost_usd"]) < 1e-9, fleet
