"""Tenant limits: requests per minute, tokens per minute, $ per UTC day.

rpm and tpm are token buckets (capacity = the per-minute limit, refilled continuously). A request
takes 1 from the rpm bucket and its expected tokens (prompt + max_tokens) from the tpm bucket at
admission; when it ends, ``settle`` corrects the tpm bucket to the actual tokens and adds its cost
to the day's spend. A request is refused while the day's spend has reached the budget.

Two stores, one interface (``check`` / ``settle``):

- ``LocalLimits``: in this process (the embedded default, and the fallback);
- ``RedisLimits``: shared by every gateway process, each check one atomic Lua script (read the
  buckets and the spend, take only if everything passes), with Redis's own clock so processes on
  different hosts agree. redis-py's ``Script`` (EVALSHA, re-loading the script after a restart).
  ``LeasedLimits`` (lease.py, the default with Redis) takes grants from the same buckets in batches
  and admits from them in the process, so most checks do not wait on Redis.

``FailoverLimits`` uses Redis while it answers. When it does not, it logs once and either keeps
serving with per-process limits (``on_redis_down: open``) or refuses with 503 (``closed``), tries
Redis again every ``redis_retry_s`` and logs once more when it is back.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Callable, Protocol

from usefulwork.gateway.tenants import TenantCfg

log = logging.getLogger("usefulwork.admission")


@dataclass(slots=True)
class Verdict:
    ok: bool
    reason: str = ""  # rpm | tpm | tpm_too_large | budget
    retry_after_s: float = 0.0


OK = Verdict(True)

# What a tenant may still send, per limit: (requests, tokens) left in its rpm / tpm buckets now, as this
# process knows them (None: no such limit, or nothing known yet). Sent as OpenAI's x-ratelimit-* headers.
Headroom = tuple[float | None, float | None]
NO_HEADROOM: Headroom = (None, None)


def refilled(level: float, cap: int, elapsed_s: float) -> float:
    """A bucket's level ``elapsed_s`` after it was ``level`` (refilled continuously up to ``cap``)."""
    return min(float(cap), level + max(0.0, elapsed_s) * cap / 60.0)


def go_duration(s: float) -> str:
    """Seconds as OpenAI writes its x-ratelimit-reset-* values (Go's durations): 20ms, 8.64s, 1m0s."""
    if s < 1.0:
        return f"{max(0, round(s * 1000.0))}ms"
    m, sec = divmod(round(s, 3), 60.0)
    text = f"{sec:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(m)}m{text}" if m else text


_RL_NAMES = ((b"x-ratelimit-limit-requests", b"x-ratelimit-remaining-requests", b"x-ratelimit-reset-requests"),
             (b"x-ratelimit-limit-tokens", b"x-ratelimit-remaining-tokens", b"x-ratelimit-reset-tokens"))


def whole_left(level: float, cap: int) -> int:
    """Whole requests (or tokens) a bucket at ``level`` still lets through: 0 below one, never above ``cap``."""
    return int(min(level, cap)) if level > 0.0 else 0


def ratelimit_headers(cfg: TenantCfg, left: Headroom) -> list[tuple[bytes, bytes]]:
    """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` for the tenant's rpm / tpm:
    the limit per minute, what is left now (this request's share taken) and when the bucket is full
    again. Remaining and reset are left out while not known."""
    out: list[tuple[bytes, bytes]] = []
    for (limit, remaining, reset), cap, lvl in zip(_RL_NAMES, (cfg.rpm, cfg.tpm), left):
        if cap is None:
            continue
        out.append((limit, b"%d" % cap))
        if lvl is not None:
            out.append((remaining, b"%d" % whole_left(lvl, cap)))
            # (below 0 after a long answer: longer than a minute to refill)
            out.append((reset, go_duration((cap - min(lvl, cap)) * 60.0 / cap).encode()))
    return out


_DAY: tuple[int, str] = (-1, "")  # (UTC day since the epoch, its key): the last day asked for


def day_key(now: float | None = None) -> str:
    """The UTC day of ``now`` (wall seconds; None: now) as ``YYYYMMDD``. (Asked on every request of a tenant
    with a budget, and formatting a date costs microseconds: the last day's key is kept. A Unix day is
    86,400 s, so its number is the timestamp's floor division.)"""
    global _DAY
    now = time.time() if now is None else now
    day = int(now // 86400)
    if day != _DAY[0]:
        _DAY = (day, datetime.fromtimestamp(day * 86400, timezone.utc).strftime("%Y%m%d"))
    return _DAY[1]


def seconds_to_midnight(now: float | None = None) -> float:
    t = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc)
    nxt = (t + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return (nxt - t).total_seconds()


class Limits(Protocol):
    async def check(self, tenant: str, cfg: TenantCfg, tokens: int) -> Verdict: ...

    async def settle(self, tenant: str, cfg: TenantCfg, token_delta: int, usd: float) -> None: ...

    async def spent_today(self, tenant: str) -> float | None:
        """US dollars booked against the tenant's budget this UTC day (None: not known now)."""
        ...

    def headroom(self, tenant: str, cfg: TenantCfg) -> Headroom:
        """What the tenant may still send now, as this process knows it (no I/O)."""
        ...

    async def close(self) -> None: ...


class LocalLimits:
    """Per-process buckets and spend; ``clock`` is monotonic seconds (virtual in tests)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.clock = clock
        self.wall = wall
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}  # (tenant, kind) -> (level, ts)
        self._spend: dict[tuple[str, str], float] = {}  # (tenant, day) -> usd

    def _level(self, key: tuple[str, str], cap: int, now: float) -> float:
        level, ts = self._buckets.get(key, (float(cap), now))
        return refilled(level, cap, now - ts)

    def headroom(self, tenant: str, cfg: TenantCfg) -> Headroom:
        now = self.clock()
        return (None if cfg.rpm is None else self._level((tenant, "rpm"), cfg.rpm, now),
                None if cfg.tpm is None else self._level((tenant, "tpm"), cfg.tpm, now))

    async def check(self, tenant: str, cfg: TenantCfg, tokens: int) -> Verdict:
        if not cfg.limited:
            return OK
        now = self.clock()
        if cfg.budget_usd_per_day is not None:
            if self._spend.get((tenant, day_key(self.wall())), 0.0) >= cfg.budget_usd_per_day:
                return Verdict(False, "budget", seconds_to_midnight(self.wall()))
        r_lvl = t_lvl = 0.0
        if cfg.rpm is not None:
            r_lvl = self._level((tenant, "rpm"), cfg.rpm, now)
            if r_lvl < 1.0:
                return Verdict(False, "rpm", (1.0 - r_lvl) * 60.0 / cfg.rpm)
        if cfg.tpm is not None:
            if tokens > cfg.tpm:
                return Verdict(False, "tpm_too_large", 60.0)
            t_lvl = self._level((tenant, "tpm"), cfg.tpm, now)
            if t_lvl < tokens:
                return Verdict(False, "tpm", (tokens - t_lvl) * 60.0 / cfg.tpm)
        if cfg.rpm is not None:
            self._buckets[(tenant, "rpm")] = (r_lvl - 1.0, now)
        if cfg.tpm is not None:
            self._buckets[(tenant, "tpm")] = (t_lvl - tokens, now)
        return OK

    async def settle(self, tenant: str, cfg: TenantCfg, token_delta: int, usd: float) -> None:
        if cfg.tpm is not None and token_delta:
            now = self.clock()
            self._buckets[(tenant, "tpm")] = (self._level((tenant, "tpm"), cfg.tpm, now) - token_delta, now)
        if cfg.budget_usd_per_day is not None and usd:
            k = (tenant, day_key(self.wall()))
            self._spend[k] = self._spend.get(k, 0.0) + usd

    async def spent_today(self, tenant: str) -> float | None:
        return self._spend.get((tenant, day_key(self.wall())), 0.0)

    async def close(self) -> None:
        return None


# Redis's clock, and a bucket's level now (refilled continuously up to its capacity): shared by the scripts.
LUA_LEVEL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, cap)
  local v = redis.call('HMGET', key, 'level', 'ts')
  local lvl, ts = tonumber(v[1]), tonumber(v[2])
  if lvl == nil then return cap end
  return math.min(cap, lvl + (now - ts) * cap / 60.0)
end
"""

_CHECK = LUA_LEVEL + """
local rpm, tpm, cost, budget = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if budget >= 0 then
  local spent = tonumber(redis.call('GET', KEYS[3]) or '0')
  if spent >= budget then return {0, 'budget', '-1', '', ''} end
end
local r, k = 0, 0
if rpm > 0 then r = level(KEYS[1], rpm) end
if tpm > 0 then k = level(KEYS[2], tpm) end
local rs, ks = tostring(r), tostring(k)
if rpm > 0 and r < 1 then return {0, 'rpm', tostring((1 - r) * 60.0 / rpm), rs, ks} end
if tpm > 0 then
  if cost > tpm then return {0, 'tpm_too_large', '60', rs, ks} end
  if k < cost then return {0, 'tpm', tostring((cost - k) * 60.0 / tpm), rs, ks} end
end
if rpm > 0 then redis.call('HSET', KEYS[1], 'level', tostring(r - 1), 'ts', tostring(now)); redis.call('EXPIRE', KEYS[1], 120) end
if tpm > 0 then redis.call('HSET', KEYS[2], 'level', tostring(k - cost), 'ts', tostring(now)); redis.call('EXPIRE', KEYS[2], 120) end
return {1, '', '0', tostring(r - 1), tostring(k - cost)}
"""

_SETTLE = """
local tpm, delta, usd = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and delta ~= 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
  local v = redis.call('HMGET', KEYS[1], 'level', 'ts')
  local lvl, ts = tonumber(v[1]), tonumber(v[2])
  if lvl == nil then lvl, ts = tpm, now end
  lvl = math.min(tpm, lvl + (now - ts) * tpm / 60.0) - delta
  redis.call('HSET', KEYS[1], 'level', tostring(lvl), 'ts', tostring(now))
  redis.call('EXPIRE', KEYS[1], 120)
end
if usd > 0 then
  redis.call('INCRBYFLOAT', KEYS[2], ARGV[3])
  redis.call('EXPIRE', KEYS[2], 172800)
end
return 1
"""


class RedisLimits:
    """The same buckets and spend in Redis, shared by every gateway process using ``prefix``."""

    def __init__(self, url: str, prefix: str = "usefulwork:admission", timeout_s: float = 1.0):
        import redis.asyncio as aioredis  # noqa: PLC0415 (only when Redis is configured)

        # A bounded pool that waits for a free connection: the default pool raises "Too many
        # connections" under a burst (measured: 1500 concurrent checks from one process).
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=32, timeout=timeout_s * 4,
                                                        socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.r = aioredis.Redis(connection_pool=pool)
        self.prefix = prefix
        self.clock: Callable[[], float] = time.monotonic
        self._check = self.r.register_script(_CHECK)
        self._settle = self.r.register_script(_SETTLE)
        self._seen: dict[str, tuple[float | None, float | None, float]] = {}  # tenant -> (rpm, tpm levels, at)

    def _saw(self, tenant: str, cfg: TenantCfg, rpm_level, tpm_level) -> None:
        """Keep the fleet's bucket levels a script call returned (empty: not read), for ``headroom``."""
        if rpm_level in (b"", "") and tpm_level in (b"", ""):
            return  # (refused on its budget before the buckets were read: what was known stands)
        self._seen[tenant] = (float(rpm_level) if cfg.rpm is not None else None,
                              float(tpm_level) if cfg.tpm is not None else None, self.clock())

    def headroom(self, tenant: str, cfg: TenantCfg) -> Headroom:
        """The levels of the tenant's last script call here, refilled since: other processes' takes since
        then are not in it."""
        seen = self._seen.get(tenant)
        if seen is None:
            return NO_HEADROOM
        r, k, at = seen
        dt = self.clock() - at
        return (None if r is None or cfg.rpm is None else refilled(r, cfg.rpm, dt),
                None if k is None or cfg.tpm is None else refilled(k, cfg.tpm, dt))

    def _keys(self, tenant: str) -> list[str]:
        p = f"{self.prefix}:{tenant}"
        return [f"{p}:rpm", f"{p}:tpm", f"{p}:usd:{day_key()}"]

    async def check(self, tenant: str, cfg: TenantCfg, tokens: int) -> Verdict:
        if not cfg.limited:
            return OK
        budget = -1.0 if cfg.budget_usd_per_day is None else cfg.budget_usd_per_day
        ok, reason, retry, rpm_level, tpm_level = await self._check(
            keys=self._keys(tenant), args=[cfg.rpm or 0, cfg.tpm or 0, tokens, repr(float(budget))])
        self._saw(tenant, cfg, rpm_level, tpm_level)
        if ok:
            return OK
        reason = reason.decode() if isinstance(reason, bytes) else reason
        r = float(retry)
        return Verdict(False, reason, seconds_to_midnight() if r < 0 else r)

    async def settle(self, tenant: str, cfg: TenantCfg, token_delta: int, usd: float) -> None:
        if not cfg.settles:
            return
        k = self._keys(tenant)
        await self._settle(keys=[k[1], k[2]], args=[cfg.tpm or 0, token_delta,
                                                     repr(float(usd if cfg.budget_usd_per_day is not None else 0.0))])

    async def spent_today(self, tenant: str) -> float:
        v = await self.r.get(self._keys(tenant)[2])
        return float(v or 0.0)

    async def close(self) -> None:
        await self.r.aclose()
        await self.r.connection_pool.disconnect()


class StoreDown(Exception):
    """The shared store is unreachable and the config says fail closed."""


class FailoverLimits:
    """Redis while it answers; per-process limits (fail-open) or ``StoreDown`` (fail-closed) when not."""

    def __init__(self, shared: Limits, local: Limits, fail_closed: bool = False, retry_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        self.shared = shared
        self.local = local
        self.fail_closed = fail_closed
        self.retry_s = retry_s
        self.clock = clock
        self.down_since: float | None = None
        self._retry_at = 0.0
        self.failures = 0

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        now = self.clock()
        if self.down_since is None:
            self.down_since = now
            log.warning("admission: Redis unreachable (%s: %s); %s until it answers again", type(exc).__name__, exc,
                        "refusing requests (on_redis_down: closed)" if self.fail_closed else "using per-process limits")
        self._retry_at = now + self.retry_s

    def _recovered(self) -> None:
        if self.down_since is not None:
            log.warning("admission: Redis is back after %.1fs; limits are shared again", self.clock() - self.down_since)
            self.down_since = None

    def _use_shared(self) -> bool:
        return self.down_since is None or self.clock() >= self._retry_at

    async def check(self, tenant: str, cfg: TenantCfg, tokens: int) -> Verdict:
        if not cfg.limited:
            return OK
        if self._use_shared():
            try:
                v = await self.shared.check(tenant, cfg, tokens)
            except Exception as exc:  # noqa: BLE001 - any store failure (connection, timeout, script) fails over
                self._failed(exc)
            else:
                self._recovered()
                return v
        if self.fail_closed:
            raise StoreDown()
        return await self.local.check(tenant, cfg, tokens)

    async def settle(self, tenant: str, cfg: TenantCfg, token_delta: int, usd: float) -> None:
        if getattr(self.shared, "buffered_settle", False):
            # (LeasedLimits: kept until Redis takes it, so the fleet's spend stays whole; while down the
            # per-process limits count it too)
            await self.shared.settle(tenant, cfg, token_delta, usd)
            if self.down:
                await self.local.settle(tenant, cfg, token_delta, usd)
            return
        if self._use_shared():
            try:
                await self.shared.settle(tenant, cfg, token_delta, usd)
                self._recovered()
                return
            except Exception as exc:  # noqa: BLE001
                self._failed(exc)
        await self.local.settle(tenant, cfg, token_delta, usd)

    def headroom(self, tenant: str, cfg: TenantCfg) -> Headroom:
        return (self.local if self.down else self.shared).headroom(tenant, cfg)

    async def spent_today(self, tenant: str) -> float | None:
        """The fleet's figure from Redis; None while it does not answer (this process's own count since
        then is not the day's spend)."""
        try:
            return await self.shared.spent_today(tenant)
        except Exception:  # noqa: BLE001 - any store failure: not known now
            return None

    async def close(self) -> None:
        await self.shared.close()


RETURN_WINDOW_S = 10.0  # a retry that found no place is matched to a place let go within this

# Per key (a pool, tenant and shed count): drop returns older than the window, add ARGV's count of new
# ones (members named by the call), then pop as many as asked (places let go): how many were popped.
_RETURNS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window, id = tonumber(ARGV[1]), ARGV[2]
local out = {}
for i, key in ipairs(KEYS) do
  local add, want = tonumber(ARGV[2 * i + 1]), tonumber(ARGV[2 * i + 2])
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
  for j = 1, add do redis.call('ZADD', key, now, id .. ':' .. i .. ':' .. j) end
  local got = 0
  if want > 0 then got = #redis.call('ZPOPMIN', key, want) / 2 end
  if redis.call('EXISTS', key) == 1 then redis.call('EXPIRE', key, math.ceil(window)) end
  out[i] = got
end
return out
"""


class FairShareSync:
    """Virtual Token Counters shared by gateway processes: each process adds what it served since the
    last sync to a Redis hash per pool and takes the fleet-wide sums back (every ``interval_s``).

    A tenant served by another gateway then waits its turn here too. Between syncs a process works on
    its local view; a failed sync keeps the local counters and tries again next time. The same loop
    settles the retries' returns across processes (``returns``)."""

    def __init__(self, r, prefix: str, interval_s: float = 1.0):
        self.r = r  # a redis.asyncio.Redis (RedisLimits.r)
        self.prefix = prefix
        self.interval_s = interval_s
        self._synced: dict[str, dict[str, float]] = {}  # pool -> counters as of the last sync
        self._returns = r.register_script(_RETURNS)
        self.return_window_s = RETURN_WINDOW_S
        self._id, self._calls = os.urandom(6).hex(), 0  # (names this process's returns in the ledger)

    async def sync(self, pool: str, counters: dict[str, float]) -> None:
        base = self._synced.get(pool, {})
        deltas = {t: v - base.get(t, 0.0) for t, v in counters.items() if v != base.get(t, 0.0)}
        key = f"{self.prefix}:vtc:{pool}"
        pipe = self.r.pipeline(transaction=True)
        for t, d in deltas.items():
            pipe.hincrbyfloat(key, t, d)
        pipe.expire(key, 86400)
        pipe.hgetall(key)
        res = await pipe.execute()
        fleet = {k.decode(): float(v) for k, v in res[-1].items()}
        # Local changes made while the round trip was in flight are kept on top of the fleet's sums.
        late = {t: counters.get(t, 0.0) - base.get(t, 0.0) - deltas.get(t, 0.0) for t in counters}
        for t, v in fleet.items():
            counters[t] = v + late.get(t, 0.0)
        self._synced[pool] = {t: counters[t] - late.get(t, 0.0) for t in counters}

    async def returns(self, pool: str, placeless: dict[tuple[str, int], int],
                      unclaimed: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """The fleet's ledger of retry returns (``PoolQueue.take_returns``): add this replica's retries that
        found no place for their tenant, per (tenant, shed count), and take back as many as it let places
        go unclaimed (each such retry's place was held by another replica, or here). One script call; a
        return older than ``return_window_s`` is dropped unmatched (a place is let go within its grace and
        a sync of the retry's arrival). Returns how many of ``unclaimed`` came back, per key."""
        keys = sorted(set(placeless) | set(unclaimed))
        if not keys:
            return {}
        self._calls += 1
        argv: list = [self.return_window_s, f"{self._id}:{self._calls}"]
        for k in keys:
            argv += [placeless.get(k, 0), unclaimed.get(k, 0)]
        got = await self._returns(keys=[f"{self.prefix}:returns:{pool}:{t}:{n}" for t, n in keys], args=argv)
        return {k: int(g) for k, g in zip(keys, got) if int(g)}
