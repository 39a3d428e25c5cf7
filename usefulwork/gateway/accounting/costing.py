"""The two cost views: the price sheet, and GPU time attributed to the requests that used it.

Price sheet: a request costs its pool's $ per 1M input / cached-input / output tokens.

GPU time: a pool costs ``gpu.count x gpu.usd_per_hour`` for every second it is up, served or not.
Time is cut into intervals of ``cost.interval_s`` (aligned on the pool's start). A finished request
books its *work* into the intervals it ran in: prefill work (``prefill_weight x`` uncached prompt
tokens) spread evenly over [start, first token], decode work (``decode_weight x`` completion
tokens) spread evenly over [first token, end]. When an interval is *settled*, its cost is split
between the requests that booked work in it, by their share of its work; an interval with no work
goes to the pool's explicit ``idle`` bucket. So, exactly (floating point aside)::

    sum(attributed to requests) + idle == usd_per_hour x settled up-time

An interval can only be settled once no request still running can book work in it: the caller
passes the *frontier* (everything before it is final). Work a late request would book before the
frontier is spread over the part of its span after the frontier instead (or, if none, into the
first open interval): totals stay conserved, only the split between intervals shifts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

from usefulwork.config import CostCfg, Pool
from usefulwork.gateway.context import RequestContext


def price_sheet_cost(pool: Pool | None, ctx: RequestContext) -> float:
    """$ for one request from its pool's price sheet (0 when no price is set or no pool served it)."""
    if pool is None or ctx.cache.startswith("hit"):
        return 0.0
    p = pool.prices
    cached = min(ctx.cached_tokens, ctx.prompt_tokens)
    uncached = ctx.prompt_tokens - cached
    inp = p.input_per_1m or 0.0
    cached_price = p.cached_input_per_1m if p.cached_input_per_1m is not None else inp
    return (uncached * inp + cached * cached_price + ctx.completion_tokens * (p.output_per_1m or 0.0)) / 1e6


def work_units(cost: CostCfg, ctx: RequestContext) -> tuple[float, float]:
    """(prefill work, decode work) of a request; a cache hit did no GPU work."""
    if ctx.pool is None or ctx.cache.startswith("hit"):
        return 0.0, 0.0
    uncached = max(ctx.prompt_tokens - ctx.cached_tokens, 0)
    return cost.prefill_weight * uncached, cost.decode_weight * ctx.completion_tokens


@dataclass(slots=True)
class Share:
    """What one request booked in a pool; ``usd`` grows as its intervals settle."""

    key: object  # the caller's handle for the request (its ledger record)
    tenant: str
    usd: float = 0.0
    pending: int = 0  # intervals booked but not yet settled


@dataclass(slots=True)
class _Interval:
    work: float = 0.0
    by_share: dict[int, float] = field(default_factory=dict)  # id(Share) -> work
    shares: dict[int, Share] = field(default_factory=dict)
    by_tenant: dict[str, float] = field(default_factory=dict)  # for the live (provisional) view


@dataclass(slots=True)
class Settled:
    """One settled interval, for the caller to fold into its books."""

    pool: str
    start: float  # wall-clock seconds
    end: float
    usd: float
    idle_usd: float
    by_tenant: dict[str, float]


class PoolMeter:
    """GPU-time attribution for one pool (see the module doc)."""

    def __init__(self, name: str, usd_per_hour: float, started_at: float, interval_s: float):
        self.name = name
        self.rate = usd_per_hour / 3600.0  # $ per second, now (see set_rate)
        self._rate0 = self.rate  # the rate before the first change below
        self._changes: list[tuple[float, float]] = []  # (wall time, $ per second from then on), ascending
        self.started_at = started_at
        self.dt = interval_s
        self._open: dict[int, _Interval] = {}
        self.settled_k = 0  # intervals [0, settled_k) are final
        self.attributed_usd = 0.0
        self.idle_usd = 0.0
        self.closed = False
        self.closed_at: float | None = None
        # shared (fleet-wide) books, docs/accounting.md "Several gateways": set by accounting/shared.py
        self.pending: list[tuple[int, Share, float]] | None = None  # booked, not yet pushed to the fleet
        self.floor_k = 0  # this gateway's published promise: it books nothing before interval floor_k
        self.fleet_w: dict[int, float] = {}  # the fleet's work per open interval, as of the last sync
        self.fleet_books: dict[str, float] | None = None  # the fleet's settled books, as of the last sync

    # -- time <-> interval index --
    def _k(self, t: float) -> int:
        return max(int(math.floor((t - self.started_at) / self.dt)), 0)

    def _t(self, k: int) -> float:
        return self.started_at + k * self.dt

    @property
    def frontier(self) -> float:
        return self._t(self.settled_k)

    def cost_between(self, a: float, b: float) -> float:
        """The pool's GPU cost over [a, b] (0 before it started or after it was closed)."""
        a = max(a, self.started_at)
        if self.closed_at is not None:
            b = min(b, self.closed_at)
        return self.usd_between(a, b)

    # -- the bill's rate (gpu.per_replica: it follows the pool's replicas) --
    def set_rate(self, t: float, usd_per_hour: float) -> None:
        """From wall time ``t`` on, the pool costs ``usd_per_hour`` (a change is never put before an earlier one)."""
        rate = usd_per_hour / 3600.0
        if rate == self.rate:
            return
        if self._changes:
            t = max(t, self._changes[-1][0])
        self._changes.append((t, rate))
        self.rate = rate
        horizon = self._t(self.settled_k) - 86_400.0  # settled a day ago: only windows' look-backs read older
        while len(self._changes) > 1 and self._changes[1][0] <= horizon:
            self._rate0 = self._changes.pop(0)[1]

    def usd_between(self, a: float, b: float) -> float:
        """The bill over [a, b] at the rates in force then."""
        if b <= a:
            return 0.0
        rate, lo, total = self._rate0, a, 0.0
        for t, after in self._changes:
            if t <= lo:
                rate = after
                continue
            if t >= b:
                break
            total += rate * (t - lo)
            lo, rate = t, after
        return total + rate * (b - lo)

    # -- booking --
    def book(self, share: Share, spans: Iterable[tuple[float, float, float]]) -> None:
        """Book work given as (start, end, work) spans (wall-clock seconds)."""
        if self.closed:
            return  # after shutdown's final settlement nothing can be paid any more
        lo = self._t(max(self.settled_k, self.floor_k))
        for a, b, w in spans:
            if w <= 0:
                continue
            if b <= lo:
                a = b = lo  # entirely before the frontier: into the first open interval
            elif a < lo:
                a = lo
            self._spread(share, a, b, w)

    def _spread(self, share: Share, a: float, b: float, w: float) -> None:
        ka, kb = self._k(a), self._k(b)
        if kb == ka or b - a <= 1e-12:
            self._add(ka, share, w)
            return
        density = w / (b - a)
        for k in range(ka, kb + 1):
            lo, hi = max(a, self._t(k)), min(b, self._t(k + 1))
            if hi > lo:
                self._add(k, share, density * (hi - lo))

    def _add(self, k: int, share: Share, w: float) -> None:
        if self.pending is not None:  # shared books: held until pushed (the fleet may move it later)
            self.pending.append((k, share, w))
            share.pending += 1
            return
        self._fold(k, share, w)

    def _fold(self, k: int, share: Share, w: float, counted: bool = False) -> None:
        iv = self._open.get(k)
        if iv is None:
            iv = self._open[k] = _Interval()
        sid = id(share)
        if sid not in iv.shares:
            iv.shares[sid] = share
            iv.by_share[sid] = 0.0
            if not counted:
                share.pending += 1
        elif counted:
            share.pending -= 1  # counted once per pending entry, but the share was already in this interval
        iv.by_share[sid] += w
        iv.work += w
        iv.by_tenant[share.tenant] = iv.by_tenant.get(share.tenant, 0.0) + w

    # -- settlement --
    def settle(self, frontier: float) -> list[Settled]:
        """Settle every whole interval that ends at or before ``frontier``."""
        out: list[Settled] = []
        while not self.closed and self._t(self.settled_k + 1) <= frontier + 1e-9:
            k = self.settled_k
            out.append(self._close(k, self._t(k), self._t(k + 1), [self._open.pop(k)] if k in self._open else []))
            self.settled_k += 1
        return out

    def settle_all(self, now: float) -> list[Settled]:
        """Final settlement (shutdown): whole intervals, then the partial one up to ``now``.

        Open intervals past ``now`` (work booked with a skewed clock) are folded into that last,
        partial interval so that no booked work is left unpaid. The meter is closed afterwards.
        """
        out = self.settle(now)
        if self.closed:
            return out
        k = self.settled_k
        end = max(now, self._t(k))
        rest = [self._open.pop(j) for j in sorted(self._open)]
        out.append(self._close(k, self._t(k), end, rest))
        self.closed = True
        self.closed_at = end
        return out

    def _close(self, k: int, start: float, end: float, ivs: list[_Interval]) -> Settled:
        usd = self.usd_between(start, end)
        work = sum(iv.work for iv in ivs)
        by_tenant: dict[str, float] = {}
        idle = 0.0
        if work <= 0:
            idle = usd
        for iv in ivs:
            for sid, share in iv.shares.items():
                share.pending -= 1
                if work > 0:
                    part = usd * iv.by_share[sid] / work
                    share.usd += part
                    by_tenant[share.tenant] = by_tenant.get(share.tenant, 0.0) + part
        self.idle_usd += idle
        self.attributed_usd += usd - idle
        return Settled(self.name, start, end, usd, idle, by_tenant)

    # -- shared books (several gateways; accounting/shared.py does the Redis side) --
    def take_pending(self) -> tuple[list[tuple[int, Share, float]], dict[int, float]]:
        """The entries booked since the last sync and their work per interval (to push)."""
        entries, self.pending = self.pending or [], []
        deltas: dict[int, float] = {}
        for k, _, w in entries:
            deltas[k] = deltas.get(k, 0.0) + w
        return entries, deltas

    def fold(self, entries: list[tuple[int, Share, float]], k_min: int) -> None:
        """Pushed entries into the local intervals; those the fleet had settled meanwhile went to k_min."""
        for k, share, w in entries:
            self._fold(max(k, k_min), share, w, counted=True)

    def settle_shared(self, k_new: int, fleet_w: dict[int, float], idle_ks: list[int],
                      fleet_usd: dict[int, float] | None = None) -> list[Settled]:
        """Settle local intervals before the fleet's ``k_new``: each share gets ``usd_k x w / W_k`` with the
        fleet's total work ``W_k`` and bill ``usd_k`` (as the gateway that settled k billed it; this meter's
        own rate where the fleet's figure was pruned); ``idle_ks`` are the idle intervals this gateway
        settled for the fleet."""
        out: list[Settled] = []
        fleet_usd = fleet_usd or {}

        def bill(k: int) -> float:
            usd = fleet_usd.get(k)
            return usd if usd is not None else self.usd_between(self._t(k), self._t(k + 1))

        for k in sorted(j for j in self._open if j < k_new):
            usd = bill(k)
            iv = self._open.pop(k)
            total = fleet_w.get(k) or iv.work  # a pruned total (a gateway stuck for an hour): local work only
            by_tenant: dict[str, float] = {}
            paid = 0.0
            for sid, share in iv.shares.items():
                share.pending -= 1
                part = usd * iv.by_share[sid] / total if total > 0 else 0.0
                share.usd += part
                paid += part
                by_tenant[share.tenant] = by_tenant.get(share.tenant, 0.0) + part
            self.attributed_usd += paid
            out.append(Settled(self.name, self._t(k), self._t(k + 1), paid, 0.0, by_tenant))
        for k in idle_ks:
            usd = bill(k)
            self.idle_usd += usd
            out.append(Settled(self.name, self._t(k), self._t(k + 1), usd, usd, {}))
        self.settled_k = max(self.settled_k, k_new)
        self.fleet_w = {k: w for k, w in fleet_w.items() if k >= self.settled_k}
        return out

    def open_ks(self) -> list[int]:
        return sorted(self._open)

    # -- live (unsettled) view --
    def provisional(self, a: float, b: float) -> tuple[float, dict[str, float]]:
        """(idle $, $ by tenant) of the still-open part of [a, b], split by the work booked so far."""
        idle = 0.0
        by_tenant: dict[str, float] = {}
        if self.closed:
            return idle, by_tenant
        lo = max(a, self.frontier)
        if b <= lo:
            return 0.0, by_tenant
        for k in range(self._k(lo), self._k(b) + 1):
            s, e = max(lo, self._t(k)), min(b, self._t(k + 1))
            if e <= s:
                continue
            usd = self.usd_between(s, e)
            iv = self._open.get(k)
            total = iv.work if iv is not None else 0.0
            if self.pending is not None:  # shared books: the fleet's work decides idle and shares
                total = max(total, self.fleet_w.get(k, 0.0))
            if total <= 0:
                idle += usd
                continue
            for tenant, w in (iv.by_tenant.items() if iv is not None else ()):
                by_tenant[tenant] = by_tenant.get(tenant, 0.0) + usd * w / total
        return idle, by_tenant


def request_spans(ctx: RequestContext, prefill: float, decode: float) -> list[tuple[float, float, float]]:
    """Wall-clock spans in which the request's prefill and decode work happened."""
    if ctx.t_end is None:
        return []
    base = ctx.wall_start - ctx.t_start  # perf_counter -> wall clock
    start = base + (ctx.t_forwarded if ctx.t_forwarded is not None else ctx.t_start)
    end = base + ctx.t_end
    first = base + ctx.t_first_token if ctx.t_first_token is not None else end
    first = min(max(first, start), end)
    return [(start, first, prefill), (first, end, decode)]
