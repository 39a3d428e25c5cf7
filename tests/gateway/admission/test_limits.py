"""Tenant limits against the real Redis: atomic buckets shared by processes, budgets, and a Redis
that dies and comes back (a redis-server started here on a free port)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import drop_redis_keys, free_port
from usefulwork.gateway.admission.lease import LeasedLimits
from usefulwork.gateway.admission.limits import (FailoverLimits, LocalLimits, RedisLimits, StoreDown, go_duration,
                                                ratelimit_headers)
from usefulwork.gateway.tenants import TenantCfg


def test_local_bucket_refills_on_the_virtual_clock():
    now = [0.0]
    lim = LocalLimits(clock=lambda: now[0])
    cfg = TenantCfg(rpm=60)

    async def go():
        got = [(await lim.check("t", cfg, 10)).ok for _ in range(61)]
        assert got.count(True) == 60 and not got[-1]
        v = await lim.check("t", cfg, 10)
        assert v.reason == "rpm" and v.retry_after_s == pytest.approx(1.0)
        now[0] = 1.0  # one request's worth refilled
        assert (await lim.check("t", cfg, 10)).ok
        assert not (await lim.check("t", cfg, 10)).ok

    asyncio.run(go())


def test_headroom_becomes_openais_ratelimit_headers_on_the_virtual_clock():
    now = [0.0]
    lim = LocalLimits(clock=lambda: now[0])
    cfg = TenantCfg(rpm=60, tpm=1000)

    async def go():
        assert (await lim.check("t", cfg, 100)).ok
        assert lim.headroom("t", cfg) == (59.0, 900.0)
        h = dict(ratelimit_headers(cfg, lim.headroom("t", cfg)))
        assert h == {b"x-ratelimit-limit-requests": b"60", b"x-ratelimit-remaining-requests": b"59",
                     b"x-ratelimit-reset-requests": b"1s", b"x-ratelimit-limit-tokens": b"1000",
                     b"x-ratelimit-remaining-tokens": b"900", b"x-ratelimit-reset-tokens": b"6s"}
        now[0] = 0.5  # refilled: half a request, 8.33 tokens
        assert lim.headroom("t", cfg) == (pytest.approx(59.5), pytest.approx(908.333, abs=1e-3))
        await lim.settle("t", cfg, 2000, 0.0)  # the answer was 2000 tokens longer than reserved: below zero
        h = dict(ratelimit_headers(cfg, lim.headroom("t", cfg)))
        assert h[b"x-ratelimit-remaining-tokens"] == b"0" and h[b"x-ratelimit-reset-tokens"] == b"2m5.5s"
        assert (await lim.check("u", TenantCfg(rpm=10), 1)).ok  # an rpm-only tenant: no token headers
        assert set(dict(ratelimit_headers(TenantCfg(rpm=10), lim.headroom("u", TenantCfg(rpm=10))))) == {
            b"x-ratelimit-limit-requests", b"x-ratelimit-remaining-requests", b"x-ratelimit-reset-requests"}
        # (nothing known yet: the limit alone)
        assert ratelimit_headers(cfg, (None, None)) == [(b"x-ratelimit-limit-requests", b"60"),
                                                        (b"x-ratelimit-limit-tokens", b"1000")]

    asyncio.run(go())
    assert [go_duration(s) for s in (0.0, 0.0204, 0.9996, 1.0, 8.64, 59.9999, 60.0, 65.5)] == \
        ["0ms", "20ms", "1000ms", "1s", "8.64s", "1m0s", "1m0s", "1m5.5s"]


@pytest.mark.parametrize("store", [RedisLimits, LeasedLimits])
def test_headroom_is_the_fleets_as_of_the_last_script_call(redis_url, store):
    """Two processes' stores on one prefix: what each reports left counts the other's takes up to its own
    last call to Redis (leased: plus the grant it holds)."""
    prefix = f"uwtest:{uuid.uuid4().hex}"
    a, b = store(redis_url, prefix), store(redis_url, prefix)
    cfg = TenantCfg(rpm=600, tpm=100_000)

    async def go():
        try:
            assert a.headroom("t", cfg) == (None, None)  # nothing known before the first call
            for _ in range(5):
                assert (await a.check("t", cfg, 100)).ok
            for _ in range(3):
                assert (await b.check("t", cfg, 100)).ok
            r, k = b.headroom("t", cfg)
            # 8 taken by both (+ 10 per second refilled while the test ran; leased: less what a holds unused)
            assert 592 - 7 <= r <= 592 + 3 and 99_200 - 700 <= k <= 99_200 + 600, (r, k)
            r_a, _ = a.headroom("t", cfg)
            assert r_a >= r  # a's last call was before b's three takes
        finally:
            await a.close()
            await b.close()
            drop_redis_keys(redis_url, prefix)

    asyncio.run(go())


@pytest.mark.parametrize("store", [RedisLimits, LeasedLimits])
def test_redis_limits_rpm_tpm_budget(redis_url, store):
    prefix = f"uwtest:{uuid.uuid4().hex}"
    lim = store(redis_url, prefix)
    cfg = TenantCfg(rpm=5, tpm=1000, budget_usd_per_day=1.0)

    async def go():
        try:
            got = [(await lim.check("t", cfg, 100)) for _ in range(6)]
            assert [v.ok for v in got] == [True] * 5 + [False] and got[5].reason == "rpm"
            assert 0 < got[5].retry_after_s <= 12.0
            await lim.settle("t", cfg, 600, 0.6)  # actual tokens 600 more than reserved; $0.60
            assert await lim.spent_today("t") == pytest.approx(0.6)
            v = await lim.check("t2", TenantCfg(tpm=1000), 2000)
            assert v.reason == "tpm_too_large"
            await lim.settle("t", cfg, 0, 0.5)
            v = await lim.check("t", cfg, 1)
            assert (v.ok, v.reason) == (False, "budget") and v.retry_after_s > 0
        finally:
            keys = await lim.r.keys(prefix + "*")
            if keys:
                await lim.r.delete(*keys)
            await lim.close()

    asyncio.run(go())


_WORKER = r"""
import asyncio, sys, time
from usefulwork.gateway.admission.lease import LeasedLimits
from usefulwork.gateway.admission.limits import RedisLimits
from usefulwork.gateway.tenants import TenantCfg
url, prefix, n, start_at, kind = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
async def main():
    # atomicity under test, not timeouts (a loaded CI box); leases of up to 5% of the limit
    lim = (LeasedLimits(url, prefix, timeout_s=5.0, max_fraction=0.05) if kind == "lease"
           else RedisLimits(url, prefix, timeout_s=5.0))
    cfg = TenantCfg(rpm=1000)
    while time.time() < start_at:
        await asyncio.sleep(0.001)
    ok = 0
    async def one():
        nonlocal ok
        v = await lim.check("burst", cfg, 1)
        ok += v.ok
    await asyncio.gather(*(one() for _ in range(n)))
    print(ok, time.time())
    await lim.close()
asyncio.run(main())
"""


@pytest.mark.parametrize("kind", ["plain", "lease"])
def test_two_processes_share_one_limit_without_overshoot(redis_url, kind):
    """Two processes fire 1500 checks each at once against rpm=1000: what they admit together
    stays within 1% of the limit plus what refilled while they ran (one script per check, or leased
    grants: LeasedLimits)."""
    prefix = f"uwtest:{uuid.uuid4().hex}"
    start_at = time.time() + 1.5
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, redis_url, prefix, "1500", str(start_at), kind],
                              stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0].split() for p in procs]
    admitted = sum(int(o[0]) for o in outs)
    elapsed = max(float(o[1]) for o in outs) - start_at
    allowed = 1000 + 1000 / 60 * elapsed
    assert admitted >= 1000  # the limit is reachable
    assert admitted <= allowed * 1.01, (admitted, elapsed)
    drop_redis_keys(redis_url, prefix)


def _start_redis(port: int, tmp) -> subprocess.Popen:
    p = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port).ping()
            return p
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                p.kill()
                raise
            time.sleep(0.05)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed (make test installs it)")
@pytest.mark.parametrize("store", [RedisLimits, LeasedLimits])
def test_redis_killed_and_restarted_fails_open_logs_once_and_recovers(tmp_path, caplog, store):
    port = free_port()
    server = _start_redis(port, tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    cfg = TenantCfg(rpm=1000)
    caplog.set_level(logging.WARNING, logger="usefulwork.admission")

    async def go():
        lim = FailoverLimits(store(url, "uw"), LocalLimits(), retry_s=0.3)
        try:
            assert (await lim.check("t", cfg, 1)).ok and not lim.down
            server.kill()
            server.wait()
            results = [await lim.check("t", cfg, 1) for _ in range(50)]  # served by per-process limits
            assert all(v.ok for v in results) and lim.down
            await lim.settle("t", TenantCfg(budget_usd_per_day=1.0), 0, 0.1)  # also falls back, no raise
            down_logs = [r for r in caplog.records if "unreachable" in r.getMessage()]
            assert len(down_logs) == 1
            restarted = _start_redis(port, tmp_path)
            try:
                await asyncio.sleep(0.35)
                assert (await lim.check("t", cfg, 1)).ok and not lim.down
                assert any("is back" in r.getMessage() for r in caplog.records)
                import redis.asyncio as aioredis

                r = aioredis.Redis.from_url(url)
                assert await r.exists("uw:t:rpm")  # the shared bucket is in use again
                await r.aclose()
            finally:
                restarted.kill()
                restarted.wait()
        finally:
            await lim.close()

    try:
        asyncio.run(go())
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.parametrize("store", [RedisLimits, LeasedLimits])
def test_fail_closed_raises_store_down_while_redis_is_unreachable(store):
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there

    async def go():
        lim = FailoverLimits(store(url, "uw"), LocalLimits(), fail_closed=True)
        try:
            with pytest.raises(StoreDown):
                await lim.check("t", TenantCfg(rpm=10), 1)
            assert (await lim.check("t", TenantCfg(), 1)).ok  # no limits configured: no store needed
        finally:
            await lim.close()

    asyncio.run(go())


def test_fair_share_counters_are_shared_through_redis(redis_url):
    """Two processes' queues (here two syncers) converge on the fleet-wide tokens served per tenant."""
    import redis.asyncio as aioredis

    from usefulwork.gateway.admission.limits import FairShareSync

    prefix = f"uwtest:{uuid.uuid4().hex}"

    async def go():
        r = aioredis.Redis.from_url(redis_url)
        a, b = FairShareSync(r, prefix), FairShareSync(r, prefix)
        ca, cb = {"heavy": 3000.0}, {"quiet": 100.0}
        await a.sync("p", ca)
        await b.sync("p", cb)
        await a.sync("p", ca)
        assert ca == cb == {"heavy": 3000.0, "quiet": 100.0}
        ca["heavy"] += 500.0  # served more in A since; B learns it at its next sync
        cb["quiet"] += 50.0
        await a.sync("p", ca)
        await b.sync("p", cb)
        assert cb == {"heavy": 3500.0, "quiet": 150.0}
        await a.sync("p", ca)
        assert ca == cb
        await r.delete(f"{prefix}:vtc:p")
        await r.aclose()

    asyncio.run(go())


def test_retry_returns_are_matched_across_processes_through_redis(redis_url):
    """The fleet's ledger of returns: retries that found no place on one replica are taken back by the
    replicas that let places of that tenant and shed count go, each at most once, and only within the
    window."""
    import redis.asyncio as aioredis

    from usefulwork.gateway.admission.limits import FairShareSync

    prefix = f"uwtest:{uuid.uuid4().hex}"

    async def go():
        r = aioredis.Redis.from_url(redis_url)
        a, b = FairShareSync(r, prefix), FairShareSync(r, prefix)
        assert await b.returns("p", {("acme", 1): 2, ("acme", 2): 1}, {}) == {}  # B: three place-less retries
        got = await a.returns("p", {}, {("acme", 1): 3, ("other", 1): 1})  # A let four places go
        assert got == {("acme", 1): 2}
        assert await a.returns("p", {}, {("acme", 1): 1, ("acme", 2): 1}) == {("acme", 2): 1}  # each once
        a.return_window_s = b.return_window_s = 0.2
        await b.returns("p", {("acme", 1): 1}, {})
        await asyncio.sleep(0.4)
        assert await a.returns("p", {}, {("acme", 1): 1}) == {}  # too old to be this place's client
        keys = await r.keys(prefix + "*")
        if keys:
            await r.delete(*keys)
        await r.aclose()

    asyncio.run(go())


def test_the_day_key_is_the_utc_date_on_both_sides_of_midnight():
    """``day_key`` keeps the last day's key (formatting a date on every budget tenant's request cost
    microseconds): it must still turn at UTC midnight, forwards and back."""
    from datetime import datetime, timezone

    from usefulwork.gateway.admission.limits import day_key

    midnight = datetime(2026, 12, 3, tzinfo=timezone.utc).timestamp()
    for t in (midnight - 1e-3, midnight, midnight + 1e-3, midnight - 86400.0, midnight + 86399.999, midnight - 1e-3,
              midnight + 7 * 86400.0 + 3600.0, 0.0):
        assert day_key(t) == datetime.fromtimestamp(t, timezone.utc).strftime("%Y%m%d")
    assert day_key(midnight - 1e-3) == "20261202" and day_key(midnight) == "20261203"
