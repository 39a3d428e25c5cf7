"""Several gateways as one: shared GPU-time books and fleet-wide live stats in Redis.

**GPU time** (docs/accounting.md, "Several gateways"). Every gateway sending work to a pool books
its requests' work per interval locally (as alone), and once per ledger pass pushes the work it
booked since the last pass, per interval, into the pool's shared totals ``W_k`` with one server-side
script (one round trip per pool per pass). The same script keeps the fleet's settlement frontier
``K`` (intervals before it are final) as the minimum of the live gateways' published floors (a
gateway promises to book nothing before its floor: its own settlement frontier), and when it moves
``K`` forward it books the fleet's bill for the newly settled intervals, and their idle cost when no
gateway booked work in them, exactly once. Work pushed for an interval that is already settled
(a gateway that was silent past ``gateway_ttl_s``, or a peer that stopped) moves to the first open
interval, as a single gateway does with a late request. A settled ``W_k`` never changes, so each
gateway pays its own requests ``usd_k x w / W_k`` and the shares of all gateways add up to ``usd_k``::

    sum over gateways of attributed + idle == the pool's bill for [started_at, K)   (floating point)

A gateway that stops pushes everything, then moves ``K`` past its last interval (others' work still
running there moves to the next interval) and settles its own requests before it exits.

**Live stats**. Every ``publish_interval_s`` a gateway writes its raw window vectors (stats.py) to a
Redis hash with the time it did; ``/usefulwork/stats`` merges the entries younger than
``gateway_ttl_s`` (``?scope=replica``: this process alone).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

import orjson

from usefulwork.config import ScaleOut
from usefulwork.gateway.accounting.costing import PoolMeter, Settled

log = logging.getLogger("usefulwork.shared")
PRUNE_INTERVALS = 3600  # settled totals kept this many intervals (a gateway later than that pays by its own work)

# KEYS: work hash, floors hash, seen hash, books hash, epoch key
# ARGV: gid, floor (-1: leave), force (-1: none), u0, ttl_s, attributed delta,
#       n deltas, (k, w) x n, nu, usd of intervals u0 .. u0 + nu - 1 (this gateway's bill), wanted ks...
# The work hash also keeps each settled interval's bill as field "u<k>": whoever settles k decides it
# (from its own view of the pool's replicas), and every gateway pays its requests from that figure.
_SYNC = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local gid, floor, force = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local u0, ttl, paid, n = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local nu = tonumber(ARGV[8 + 2 * n])
local function bill(k)  -- as given (a string: stored exactly as the gateway wrote it)
  return ARGV[9 + 2 * n + math.max(0, math.min(k - u0, nu - 1))]
end
redis.call('EXPIRE', KEYS[5], math.ceil(ttl * 2))
local k0 = tonumber(redis.call('HGET', KEYS[4], 'settled_k') or '0')
local kmax = -1
for i = 0, n - 1 do
  local k = tonumber(ARGV[8 + 2 * i])
  if k < k0 then k = k0 end
  if k > kmax then kmax = k end
  redis.call('HINCRBYFLOAT', KEYS[1], tostring(k), ARGV[9 + 2 * i])
end
-- a leaving gateway settles every interval it booked into, including late work moved to k0 just now
if force >= 0 and force <= kmax then force = kmax + 1 end
if tonumber(paid) ~= 0 then redis.call('HINCRBYFLOAT', KEYS[4], 'attributed_usd', paid) end
if floor >= 0 then
  redis.call('HSET', KEYS[2], gid, floor)
  redis.call('HSET', KEYS[3], gid, now)
else
  redis.call('HDEL', KEYS[2], gid)
  redis.call('HDEL', KEYS[3], gid)
end
local target = nil
local seen = redis.call('HGETALL', KEYS[3])
for i = 1, #seen, 2 do
  if now - tonumber(seen[i + 1]) > ttl then
    redis.call('HDEL', KEYS[2], seen[i])
    redis.call('HDEL', KEYS[3], seen[i])
  else
    local f = tonumber(redis.call('HGET', KEYS[2], seen[i]) or '0')
    if target == nil or f < target then target = f end
  end
end
if force >= 0 and (target == nil or force > target) then target = force end
local k1 = k0
local idle = {}
local worked = {}  -- intervals this call settled that had work
if target ~= nil and target > k0 then
  local cost, idl = 0, 0
  for k = k0, target - 1 do
    local usd = tonumber(bill(k))
    cost = cost + usd
    redis.call('HSET', KEYS[1], 'u' .. k, bill(k))
    local w = tonumber(redis.call('HGET', KEYS[1], tostring(k)) or '0')
    if w <= 0 then
      idl = idl + usd
      idle[#idle + 1] = k
    else
      worked[#worked + 1] = k
    end
    if k - PRUNE >= 0 then redis.call('HDEL', KEYS[1], tostring(k - PRUNE), 'u' .. (k - PRUNE)) end
  end
  redis.call('HINCRBYFLOAT', KEYS[4], 'cost_usd', cost)
  redis.call('HINCRBYFLOAT', KEYS[4], 'idle_usd', idl)
  redis.call('HSET', KEYS[4], 'settled_k', target)
  k1 = target
end
local w = {}
for i = 9 + 2 * n + nu, #ARGV do
  local k = tonumber(ARGV[i])
  w[#w + 1] = ARGV[i]
  w[#w + 1] = redis.call('HGET', KEYS[1], tostring(k)) or '0'
  w[#w + 1] = redis.call('HGET', KEYS[1], 'u' .. k) or ''
end
for _, k in ipairs(idle) do
  w[#w + 1] = tostring(k)
  w[#w + 1] = '0'
  w[#w + 1] = redis.call('HGET', KEYS[1], 'u' .. k) or ''
end
-- every interval this call settled that worked: the gateway's pushed work may have moved into one it did
-- not ask for (k0: late work, or a leaving peer's frontier), and it pays its share there from the fleet's
-- total, not from its own work alone (which paid the whole bill where another gateway's work shared it)
for _, k in ipairs(worked) do
  w[#w + 1] = tostring(k)
  w[#w + 1] = redis.call('HGET', KEYS[1], tostring(k))
  w[#w + 1] = redis.call('HGET', KEYS[1], 'u' .. k) or ''
end
local books = redis.call('HMGET', KEYS[4], 'cost_usd', 'idle_usd', 'attributed_usd')
return {k0, k1, idle, w, books}
""".replace("PRUNE", str(PRUNE_INTERVALS))

# KEYS: epoch key, work hash, books hash; ARGV: now, ttl_s. A fleet with no live gateway for 2 x ttl
# starts a new epoch: intervals restart at its first gateway's start (downtime is not billed).
_EPOCH = """
local s = redis.call('GET', KEYS[1])
if not s then
  s = ARGV[1]
  redis.call('SET', KEYS[1], s, 'EX', math.ceil(tonumber(ARGV[2]) * 2))
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[3], 'settled_k', 0)
end
return {s, redis.call('HGET', KEYS[3], 'settled_k') or '0'}
"""


def gateway_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class SharedBooks:
    """The Redis side of the shared GPU books and the published live windows (see the module doc)."""

    def __init__(self, cfg: ScaleOut, interval_s: float):
        import redis.asyncio as aioredis

        self.cfg = cfg
        self.dt = interval_s
        self.gid = gateway_id()
        self.redis = aioredis.Redis.from_url(cfg.redis_url, socket_timeout=5, socket_connect_timeout=5)
        self._sync = self.redis.register_script(_SYNC)
        self._epoch = self.redis.register_script(_EPOCH)
        self._paid: dict[str, float] = {}  # attributed $ settled locally, not yet added to the fleet books
        self.stats_key = f"{cfg.prefix}:stats"

    def _keys(self, pool: str) -> list[str]:
        p = f"{self.cfg.prefix}:gpu:{{{pool}}}"
        return [f"{p}:work", f"{p}:floors", f"{p}:seen", f"{p}:books", f"{p}:epoch"]

    async def join(self, meters: dict[str, PoolMeter]) -> None:
        """Adopt each pool's shared start (interval alignment) and switch the meters to shared books."""
        for name, m in meters.items():
            keys = self._keys(name)
            started, k = await self._epoch(keys=[keys[4], keys[0], keys[3]],
                                           args=[repr(m.started_at), self.cfg.gateway_ttl_s])
            m.started_at = float(started)
            m.settled_k = m.floor_k = int(k)
            m.pending = []

    async def sync(self, m: PoolMeter, floor_t: float | None, force_t: float | None = None,
                   now: float | None = None) -> list[Settled]:
        """Push this gateway's new work, publish its floor (None: leave), settle what the fleet settled."""
        entries, deltas = m.take_pending()
        floor = -1 if floor_t is None else m._k(floor_t)
        if floor >= 0:
            m.floor_k = max(m.floor_k, floor)
        force = -1 if force_t is None else max([m._k(force_t) + 1, *(k + 1 for k in m.open_ks()), *(k + 1 for k in deltas)])
        k_now = m._k(now if now is not None else time.time())
        wanted = sorted(set(m.open_ks()) | set(deltas) | set(range(m.settled_k, k_now + 1)))
        # this gateway's bill per interval, from where the fleet has surely settled (its last view of K)
        k_hi = max(k_now, force, *wanted, m.settled_k)
        u0 = max(m.settled_k, k_hi - PRUNE_INTERVALS)
        bills = [m.usd_between(m._t(k), m._t(k + 1)) for k in range(u0, k_hi + 1)]
        args: list = [self.gid, floor, force, u0, self.cfg.gateway_ttl_s,
                      repr(self._paid.get(m.name, 0.0)), len(deltas)]
        for k, w in deltas.items():
            args += [k, repr(w)]
        args += [len(bills), *map(repr, bills)]
        args += wanted
        try:
            k0, k1, idle, w, books = await self._sync(keys=self._keys(m.name), args=args)
        except BaseException:
            m.pending = entries + (m.pending or [])  # nothing was applied: push again next pass
            raise
        self._paid[m.name] = 0.0
        m.fold(entries, int(k0))
        fleet_w = {int(w[i]): float(w[i + 1]) for i in range(0, len(w), 3)}
        fleet_usd = {int(w[i]): float(w[i + 2]) for i in range(0, len(w), 3) if w[i + 2] not in (b"", "")}
        before = m.attributed_usd
        out = m.settle_shared(int(k1), fleet_w, [int(k) for k in idle], fleet_usd)
        self._paid[m.name] = m.attributed_usd - before
        m.fleet_books = {"settled_until": m._t(int(k1)), "cost_usd": float(books[0] or 0),
                         "idle_usd": float(books[1] or 0), "attributed_usd": float(books[2] or 0)}
        return out

    async def leave(self, meters: dict[str, PoolMeter], now: float) -> list[Settled]:
        """Stop: push everything, settle the fleet past this gateway's last interval, report, leave."""
        out: list[Settled] = []
        for m in meters.values():
            out += await self.sync(m, None, force_t=now, now=now)
            await self.sync(m, None, now=now)  # the attributed $ of that last settlement
        return out

    # -- live windows --
    async def publish(self, raw: dict) -> None:
        body = orjson.dumps({"t": time.time(), "raw": raw}, option=orjson.OPT_SERIALIZE_NUMPY)
        await self.redis.hset(self.stats_key, self.gid, body)

    async def fleet_raws(self, own: dict) -> list[dict]:
        """The live gateways' published windows, this one's (``own``) fresh; stale entries are removed."""
        entries = await self.redis.hgetall(self.stats_key)
        now = time.time()
        out, stale = [own], []
        for gid, body in entries.items():
            item = orjson.loads(body)
            if now - item["t"] > self.cfg.gateway_ttl_s:
                stale.append(gid)
            elif gid.decode() != self.gid:
                out.append(item["raw"])
        if stale:
            await self.redis.hdel(self.stats_key, *stale)
        return out

    async def withdraw(self) -> None:
        await self.redis.hdel(self.stats_key, self.gid)

    async def close(self) -> None:
        await self.redis.aclose()


async def publish_loop(books: SharedBooks, raw, interval_s: float) -> None:
    while True:
        try:
            await books.publish(raw())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - Redis down: the fleet view lacks this gateway until it is back
            log.warning("publishing live windows failed: %s", exc)
        await asyncio.sleep(interval_s)
