"""Leased limits: each gateway process takes rpm / tpm grants from the shared Redis buckets in batches
and admits from them locally, so the common request never waits on Redis.

A grant is debited from the shared buckets up front, in one atomic script call (the same buckets and
the same Redis clock as ``RedisLimits``), so the fleet never admits more than the buckets allow: what a
process has not used is given back (added to the bucket, never above its capacity). Per tenant:

- **sizing**: ``k = ceil(rate x lease_horizon_s)`` requests, ``rate`` being this process's recent
  arrivals for the tenant (decayed over ``RATE_TAU_S``), at most ``lease_max_fraction`` of the rpm
  limit (and of the tpm limit in requests of the recent size), and, for a tenant with a budget, at most
  ``lease_max_fraction`` of the remaining budget at the recent cost per request; never under 1. The
  tpm part is the request's own tokens plus the recent mean for each further one.
- **refill** in the background once half the grant is used, when at least two more requests are
  expected within ``lease_idle_s`` (a slower tenant takes one request's grant per request, one script
  call, as without leases). A request waits on Redis only when its process has nothing left.
- **give-back** every ``settle_flush_s``: all of it after ``lease_idle_s`` without a request of that
  tenant here, and the part over twice the current size when the tenant's rate fell.
- **settles**: token corrections are added up per tenant and sent with the next grant or flush (every
  ``settle_flush_s``) and on close; a budget tenant's spend is sent when its answer ends, as without
  leases (kept and sent later if Redis fails), so the fleet's budget view does not lag.
- **budget**: every script call returns the fleet's spend today; a process refuses locally once the
  last spend it saw plus its own unsent spend reaches the budget, and the script grants nothing then.

The budget's overshoot bound is in docs/admission.md ("Limits across gateway processes").
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

from usefulwork.gateway.admission.limits import (LUA_LEVEL, OK, Headroom, RedisLimits, Verdict, day_key,
                                                seconds_to_midnight)
from usefulwork.gateway.tenants import TenantCfg
from usefulwork.tasks import cancel_and_wait

log = logging.getLogger("usefulwork.admission")

RATE_TAU_S = 0.5  # the arrival rate's memory

# Settle (delta, usd), give back (give_r, give_t), then take up to ``want`` requests (the first needs
# ``need`` tokens, each further one ``each``): {requests, tokens, spent today, refusal reason, retry-after,
# the rpm and tpm buckets' levels after it}.
_LEASE = LUA_LEVEL + """
local rpm, tpm, budget = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local delta, usd = tonumber(ARGV[4]), tonumber(ARGV[5])
local give_r, give_t = tonumber(ARGV[6]), tonumber(ARGV[7])
local want, need, each = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local function put(key, lvl)
  redis.call('HSET', key, 'level', tostring(lvl), 'ts', tostring(now))
  redis.call('EXPIRE', key, 120)
end
if rpm > 0 and give_r > 0 then put(KEYS[1], math.min(rpm, level(KEYS[1], rpm) + give_r)) end
if tpm > 0 and (give_t > 0 or delta ~= 0) then put(KEYS[2], math.min(tpm, level(KEYS[2], tpm) + give_t) - delta) end
local spent = 0
if usd > 0 then
  spent = tonumber(redis.call('INCRBYFLOAT', KEYS[3], ARGV[5]))
  redis.call('EXPIRE', KEYS[3], 172800)
elseif budget >= 0 then
  spent = tonumber(redis.call('GET', KEYS[3]) or '0')
end
local s = tostring(spent)
local r, k = 0, 0
if rpm > 0 then r = level(KEYS[1], rpm) end
if tpm > 0 then k = level(KEYS[2], tpm) end
local rs, ks = tostring(r), tostring(k)
if want <= 0 then return {0, '0', s, '', '0', rs, ks} end
if budget >= 0 and spent >= budget then return {0, '0', s, 'budget', '-1', rs, ks} end
local n, toks = want, 0
if rpm > 0 then
  if r < 1 then return {0, '0', s, 'rpm', tostring((1 - r) * 60.0 / rpm), rs, ks} end
  n = math.min(n, math.floor(r))
end
if tpm > 0 then
  if need > tpm then return {0, '0', s, 'tpm_too_large', '60', rs, ks} end
  if k < need then return {0, '0', s, 'tpm', tostring((need - k) * 60.0 / tpm), rs, ks} end
  toks = math.min(k, need + (n - 1) * each)
end
if rpm > 0 then put(KEYS[1], r - n) end
if tpm > 0 then put(KEYS[2], k - toks) end
return {n, tostring(toks), s, '', '0', tostring(r - n), tostring(k - toks)}
"""


def grant_size(rate: float, horizon_s: float, cfg: TenantCfg, tokens_each: float, max_fraction: float,
               remaining_usd: float | None = None, usd_each: float = 0.0) -> int:
    """Requests to take in one grant: ``rate`` (req/s) x the horizon, capped by ``max_fraction`` of the
    rpm limit, of the tpm limit (in requests of ``tokens_each``) and of the remaining budget (at
    ``usd_each`` per request, once known); at least 1."""
    k = math.ceil(rate * horizon_s - 1e-9)
    if cfg.rpm is not None:
        k = min(k, max(1, int(cfg.rpm * max_fraction)))
    if cfg.tpm is not None and tokens_each > 0:
        k = min(k, max(1, int(cfg.tpm * max_fraction / tokens_each)))
    if remaining_usd is not None and usd_each > 0:
        k = min(k, max(1, int(max(0.0, remaining_usd) * max_fraction / usd_each)))
    return max(1, k)


@dataclass(slots=True)
class _Lease:
    cfg: TenantCfg
    req: int = 0  # granted requests not yet used
    tok: float = 0.0  # granted tpm tokens not yet used
    rate: float = 0.0  # arrivals per second here, decayed over RATE_TAU_S, as of ``seen``
    seen: float = 0.0  # the last arrival (monotonic)
    each: float = 0.0  # recent tokens per request
    usd_each: float = 0.0  # recent cost per settled request
    delta: float = 0.0  # token corrections not yet sent
    usd: float = 0.0  # spend not yet sent
    spent: float = 0.0  # the fleet's spend on ``day`` at the last script call
    day: str = ""
    refill: asyncio.Task | None = None


class LeasedLimits(RedisLimits):
    """``RedisLimits`` whose checks admit from grants held by this process (see the module's text)."""

    buffered_settle = True  # settle never does I/O (FailoverLimits keeps its health to the checks)

    def __init__(self, url: str, prefix: str = "usefulwork:admission", timeout_s: float = 1.0, *,
                 horizon_s: float = 0.2, max_fraction: float = 0.01, idle_s: float = 0.5, flush_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(url, prefix, timeout_s)
        self.horizon_s = horizon_s
        self.max_fraction = max_fraction
        self.idle_s = idle_s
        self.flush_s = flush_s
        self.clock = clock
        self._lease = self.r.register_script(_LEASE)
        self.leases: dict[str, _Lease] = {}
        self.calls = {"grant": 0, "refill": 0, "flush": 0, "local": 0}  # script calls by purpose; local admits
        self._loop: asyncio.Task | None = None
        self.failing = False  # the last script call failed

    # -- the request path --
    async def check(self, tenant: str, cfg: TenantCfg, tokens: int) -> Verdict:
        if not cfg.limited:
            return OK
        self._start()
        now = self.clock()
        st = self.leases.get(tenant)
        if st is None:
            st = self.leases[tenant] = _Lease(cfg, rate=0.0, seen=now, each=float(tokens))
        st.cfg = cfg
        st.rate = st.rate * math.exp((st.seen - now) / RATE_TAU_S) + 1.0 / RATE_TAU_S
        st.seen = now
        st.each += 0.2 * (tokens - st.each)
        if cfg.budget_usd_per_day is not None and self._known_spend(st) >= cfg.budget_usd_per_day:
            return Verdict(False, "budget", seconds_to_midnight())
        if cfg.tpm is not None and tokens > cfg.tpm:
            return Verdict(False, "tpm_too_large", 60.0)
        if self._take(st, cfg, tokens):
            self.calls["local"] += 1
            self._prefetch(tenant, st, cfg)
            return OK
        while True:  # one script call in flight per tenant: the others wait for its grant
            task = st.refill
            if task is None:
                self.calls["grant"] += 1
                task = self._fetch(tenant, st, cfg, self._size(st, cfg), tokens, quiet=False)
            await asyncio.wait([task])  # (a request cancelled meanwhile leaves the grant to the others)
            if self._take(st, cfg, tokens):
                return OK
            got = task.result()  # Redis failed: raised here (FailoverLimits fails over)
            if got is None or got[0].ok:  # a failed top-up, or the others used this grant: ask again
                continue
            v, need = got
            if v.reason != "tpm" or tokens >= need:  # refused now for this request too
                return v

    def _start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.create_task(self._flush_loop(), name="admission-lease-flush")

    @staticmethod
    def _take(st: _Lease, cfg: TenantCfg, tokens: int) -> bool:
        if st.req < 1 or (cfg.tpm is not None and st.tok < tokens):
            return False
        st.req -= 1
        if cfg.tpm is not None:
            st.tok -= tokens
        return True

    def _size(self, st: _Lease, cfg: TenantCfg) -> int:
        remaining = None
        if cfg.budget_usd_per_day is not None:
            remaining = cfg.budget_usd_per_day - self._known_spend(st)
        return grant_size(st.rate, self.horizon_s, cfg, st.each, self.max_fraction, remaining, st.usd_each)

    def _known_spend(self, st: _Lease) -> float:
        return (st.spent if st.day == day_key() else 0.0) + st.usd

    def _prefetch(self, tenant: str, st: _Lease, cfg: TenantCfg) -> None:
        """Top the grant up in the background once half of it is used, if two more requests are
        expected before an idle grant would be given back."""
        if st.refill is not None or st.rate * self.idle_s < 2.0:
            return
        k = self._size(st, cfg)
        if 2 * st.req >= k and (cfg.tpm is None or 2 * st.tok >= k * st.each):
            return
        self.calls["refill"] += 1
        self._fetch(tenant, st, cfg, max(1, k - st.req), max(1, math.ceil(st.each)), quiet=True)

    def _fetch(self, tenant: str, st: _Lease, cfg: TenantCfg, want: int, need: int, quiet: bool) -> asyncio.Task:
        """Start the tenant's one grant call (``st.refill`` until it ends): its result is (verdict,
        need), or None when ``quiet`` and Redis failed (the next request without a grant asks itself)."""

        async def fetch():
            try:
                return await self._call(tenant, st, cfg, want=want, need=need), need
            except Exception as exc:
                if not quiet:
                    raise
                log.debug("admission: lease top-up for %s failed: %s", tenant, exc)
                return None
            finally:
                st.refill = None

        task = st.refill = asyncio.ensure_future(fetch())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (retrieved: no warning at exit)
        return task

    async def _call(self, tenant: str, st: _Lease, cfg: TenantCfg, want: int = 0, need: int = 0,
                    give_req: int = 0, give_tok: float = 0.0) -> Verdict:
        """One script call: send the pending settles and ``give_*`` back, take up to ``want`` requests.
        The pending amounts and the given-back grant return to this process if the call fails."""
        delta, usd = st.delta, st.usd
        st.delta = st.usd = 0.0
        st.req -= give_req
        st.tok -= give_tok
        budget = -1.0 if cfg.budget_usd_per_day is None else cfg.budget_usd_per_day
        day = day_key()
        try:
            n, toks, spent, reason, retry, rpm_level, tpm_level = await self._lease(
                keys=self._keys(tenant), args=[cfg.rpm or 0, cfg.tpm or 0, repr(float(budget)), repr(float(delta)),
                                               repr(float(usd)), give_req, repr(float(give_tok)), want, need,
                                               repr(float(st.each))])
        except BaseException:
            self.failing = True
            st.delta += delta
            st.usd += usd
            st.req += give_req
            st.tok += give_tok
            raise
        self.failing = False
        self._saw(tenant, cfg, rpm_level, tpm_level)
        st.req += int(n)
        st.tok += float(toks)
        st.spent, st.day = float(spent), day
        if not reason:
            return OK
        r = float(retry)
        return Verdict(False, reason.decode() if isinstance(reason, bytes) else reason,
                       seconds_to_midnight() if r < 0 else r)

    # -- after the answer --
    async def settle(self, tenant: str, cfg: TenantCfg, token_delta: int, usd: float) -> None:
        if not cfg.settles:
            return
        self._start()
        st = self.leases.get(tenant)
        if st is None:
            st = self.leases[tenant] = _Lease(cfg, seen=self.clock() - self.idle_s)
        if cfg.tpm is not None:
            st.delta += token_delta
        if cfg.budget_usd_per_day is not None and usd:
            # Spend is sent at once (after the answer, as without leases): every process's next grant sees
            # it. Kept pending, and sent with the next call, if Redis fails (while it fails, the flush
            # loop's calls retry it, not every answer).
            st.usd += usd
            st.usd_each += 0.2 * (usd - st.usd_each) if st.usd_each else usd
            if not self.failing:
                await self._flush_one(tenant, st, give=False)

    # -- background --
    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def flush(self, give_all: bool = False) -> bool:
        """Send every tenant's pending settles and give back idle (or, with ``give_all``, all) grants;
        False if a call failed (what it carried stays pending)."""
        ok = True
        for tenant, st in list(self.leases.items()):
            ok = await self._flush_one(tenant, st, give=True, give_all=give_all) and ok
        return ok

    async def _flush_one(self, tenant: str, st: _Lease, give: bool, give_all: bool = False) -> bool:
        give_req, give_tok = 0, 0.0
        if give and st.refill is None and (st.req > 0 or st.tok > 0):
            now = self.clock()
            if give_all or now - st.seen >= self.idle_s:
                give_req, give_tok = st.req, st.tok
            else:  # the rate fell: keep twice the current size
                keep = 2 * grant_size(st.rate * math.exp((st.seen - now) / RATE_TAU_S), self.horizon_s, st.cfg,
                                      st.each, self.max_fraction)
                if st.req > keep:
                    give_req = st.req - keep
                    give_tok = st.tok * give_req / st.req if st.cfg.tpm is not None else 0.0
        if not (give_req or give_tok or st.delta or st.usd):
            return True
        try:
            self.calls["flush"] += 1
            await self._call(tenant, st, st.cfg, give_req=give_req, give_tok=give_tok)
            return True
        except Exception as exc:  # noqa: BLE001 - kept pending; sent with the next call that succeeds
            log.debug("admission: lease flush for %s failed: %s", tenant, exc)
            return False

    def headroom(self, tenant: str, cfg: TenantCfg) -> Headroom:
        """The fleet's buckets as of this process's last script call, refilled since, plus the grant it
        holds: other processes' unused grants and their takes since then are not in it."""
        r, k = super().headroom(tenant, cfg)
        st = self.leases.get(tenant)
        if st is None:
            return r, k
        return (None if r is None else r + st.req, None if k is None else k + st.tok)

    async def spent_today(self, tenant: str) -> float:
        st = self.leases.get(tenant)
        return await super().spent_today(tenant) + (st.usd if st is not None else 0.0)

    async def close(self) -> None:
        """Give every grant back and send every pending settle (SIGTERM loses none while Redis answers)."""
        await cancel_and_wait(self._loop)
        for st in self.leases.values():
            if st.refill is not None:
                await asyncio.wait([st.refill])
        if not await self.flush(give_all=True):
            lost = {t: (st.delta, st.usd) for t, st in self.leases.items() if st.delta or st.usd}
            log.warning("admission: Redis did not take the last settles at shutdown (tenant: tokens, usd): %s", lost)
        await super().close()
