"""Live useful-work windows (1 min, 5 min, 1 h, since start) per pool, per tenant and fleet-wide.

Counters live in a ring of 5-second buckets covering one hour (plus running totals for "since
start"), one ring per scope. A window is a whole number of buckets ending with the current one, and
its GPU cost is the pools' cost over exactly that span, so counts and dollars always describe the
same seconds. The JSON produced by :meth:`Stats.snapshot` is documented in docs/accounting.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from usefulwork.gateway.accounting.costing import PoolMeter, Settled

BUCKET_S = 5.0
RING = 720  # one hour of 5-second buckets
WINDOWS: dict[str, int | None] = {"1m": 12, "5m": 60, "1h": 720, "all": None}

COLUMNS = (
    "requests", "ok", "good", "judged", "shed", "error", "timeout", "client_cancelled", "rejected",
    "prompt_tokens", "completion_tokens", "cached_tokens", "generated_tokens_ok", "estimated",
    "price_usd", "attributed_usd", "idle_usd",
    "cache_miss", "cache_hit_exact", "cache_hit_semantic", "cache_bypass",
)
C = {name: i for i, name in enumerate(COLUMNS)}
_CACHE_COL = {"miss": C["cache_miss"], "hit-exact": C["cache_hit_exact"], "hit-semantic": C["cache_hit_semantic"],
              "bypass": C["cache_bypass"]}


@dataclass(slots=True)
class FinishedRow:
    """What the windows need from one finished request (built by the accountant)."""

    t_end: float  # wall clock
    tenant: str
    pool: str | None
    outcome: str
    slo_met: bool | None
    cache: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    estimated: bool
    price_usd: float


class Ring:
    """Per-bucket counters for one scope plus running totals."""

    def __init__(self) -> None:
        self.data = np.zeros((RING, len(COLUMNS)))
        self.stamp = np.full(RING, -1, dtype=np.int64)
        self.total = np.zeros(len(COLUMNS))

    def add(self, t: float, row: np.ndarray) -> None:
        b = int(t // BUCKET_S)
        slot = b % RING
        if self.stamp[slot] != b:
            self.data[slot] = 0.0
            self.stamp[slot] = b
        self.data[slot] += row
        self.total += row

    def window(self, b_now: int, n: int | None) -> np.ndarray:
        if n is None:
            return self.total.copy()
        mask = (self.stamp > b_now - n) & (self.stamp <= b_now)
        return self.data[mask].sum(axis=0)


def counters(outcome: str, slo_met: bool | None, cache: str, estimated: bool, n: int, prompt_tokens: float,
         completion_tokens: float, cached_tokens: float, price_usd: float) -> np.ndarray:
    """The counters of ``n`` finished requests with the same labels (token and price columns: their sums)."""
    r = np.zeros(len(COLUMNS))
    r[C["requests"]] = n
    if outcome in ("ok", "shed", "error", "timeout", "client_cancelled", "rejected"):
        r[C[outcome]] = n
    if outcome != "rejected":
        r[C["judged"]] = n  # bad input is the client's failure, not the service's: out of the SLO rate
    if slo_met:
        r[C["good"]] = n
    r[C["prompt_tokens"]] = prompt_tokens
    r[C["completion_tokens"]] = completion_tokens
    r[C["cached_tokens"]] = cached_tokens
    if outcome == "ok":
        r[C["generated_tokens_ok"]] = completion_tokens
    r[C["estimated"]] = n if estimated else 0
    r[C["price_usd"]] = price_usd
    col = _CACHE_COL.get(cache)
    if col is not None:
        r[col] = n
    return r


def _per(usd: float, n: float, unit: float) -> float | None:
    return usd * unit / n if n > 0 else None


def figures(v: np.ndarray, gpu_usd: float, idle_usd: float, window_s: float) -> dict:
    ok, good, judged = v[C["ok"]], v[C["good"]], v[C["judged"]]
    gen = v[C["generated_tokens_ok"]]
    price = float(v[C["price_usd"]])
    dropped = v[C["shed"]] + v[C["error"]] + v[C["timeout"]]
    hits = v[C["cache_hit_exact"]] + v[C["cache_hit_semantic"]]
    return {
        "window_s": round(window_s, 3),
        "requests": int(v[C["requests"]]),
        "ok": int(ok),
        "good": int(good),
        "shed": int(v[C["shed"]]),
        "error": int(v[C["error"]]),
        "timeout": int(v[C["timeout"]]),
        "client_cancelled": int(v[C["client_cancelled"]]),
        "rejected": int(v[C["rejected"]]),
        "dropped": int(dropped),
        "slo_pass_rate": float(good / judged) if judged > 0 else None,
        "prompt_tokens": int(v[C["prompt_tokens"]]),
        "completion_tokens": int(v[C["completion_tokens"]]),
        "cached_tokens": int(v[C["cached_tokens"]]),
        "generated_tokens_ok": int(gen),
        "estimated_usage": int(v[C["estimated"]]),
        "cache": {
            "miss": int(v[C["cache_miss"]]),
            "hit_exact": int(v[C["cache_hit_exact"]]),
            "hit_semantic": int(v[C["cache_hit_semantic"]]),
            "bypass": int(v[C["cache_bypass"]]),
            "hit_share": float(hits / v[C["requests"]]) if v[C["requests"]] > 0 else None,
        },
        "gpu": {
            "cost_usd": gpu_usd,
            "idle_usd": idle_usd,
            "attributed_usd": gpu_usd - idle_usd,
            "usd_per_1k_ok": _per(gpu_usd, ok, 1e3),
            "usd_per_1k_good": _per(gpu_usd, good, 1e3),
            "usd_per_1m_generated": _per(gpu_usd, gen, 1e6),
        },
        "price_sheet": {
            "cost_usd": price,
            "usd_per_1k_ok": _per(price, ok, 1e3),
            "usd_per_1k_good": _per(price, good, 1e3),
            "usd_per_1m_generated": _per(price, gen, 1e6),
        },
    }


class Stats:
    """The live windows. Single-threaded: only the event loop touches it."""

    def __init__(self, meters: dict[str, PoolMeter]):
        self.meters = meters
        self.fleet = Ring()
        self.pools: dict[str, Ring] = {name: Ring() for name in meters}
        self.tenants: dict[str, Ring] = {}
        self.started_at = min((m.started_at for m in meters.values()), default=None)
        self._memo: dict[tuple, tuple[float, dict[str, float]]] = {}

    def _tenant(self, name: str) -> Ring:
        ring = self.tenants.get(name)
        if ring is None:
            ring = self.tenants[name] = Ring()
        return ring

    # -- writes --
    def add(self, o: FinishedRow) -> None:
        self.add_many((o,))

    def add_many(self, rows: Iterable[FinishedRow]) -> None:
        """``add`` for a batch (the ledger's pass): rows in the same bucket with the same labels are summed
        first, so each ring takes one numpy update per group instead of one per request."""
        groups: dict[tuple, list] = {}
        for o in rows:
            key = (int(o.t_end // BUCKET_S), o.tenant, o.pool, o.outcome, o.slo_met, o.cache, o.estimated)
            g = groups.get(key)
            if g is None:
                groups[key] = [o.t_end, 1, o.prompt_tokens, o.completion_tokens, o.cached_tokens, o.price_usd]
                if self.started_at is None:
                    self.started_at = o.t_end
            else:
                g[1] += 1
                g[2] += o.prompt_tokens
                g[3] += o.completion_tokens
                g[4] += o.cached_tokens
                g[5] += o.price_usd
        for (_, tenant, pool, outcome, slo_met, cache, estimated), (t, n, prompt, completion, cached, price) in groups.items():
            row = counters(outcome, slo_met, cache, estimated, n, prompt, completion, cached, price)
            self.fleet.add(t, row)
            self._tenant(tenant).add(t, row)
            if pool is not None:
                ring = self.pools.get(pool)
                if ring is None:
                    ring = self.pools[pool] = Ring()
                ring.add(t, row)

    def add_settled(self, items: Iterable[Settled]) -> None:
        for s in items:
            row = np.zeros(len(COLUMNS))
            row[C["idle_usd"]] = s.idle_usd
            row[C["attributed_usd"]] = s.usd - s.idle_usd
            self.fleet.add(s.start, row)
            self.pools[s.pool].add(s.start, row)
            for tenant, usd in s.by_tenant.items():
                trow = np.zeros(len(COLUMNS))
                trow[C["attributed_usd"]] = usd
                self._tenant(tenant).add(s.start, trow)

    # -- reads --
    def _span(self, now: float, n: int | None) -> tuple[int, float]:
        b_now = int(now // BUCKET_S)
        if n is None:
            return b_now, self.started_at if self.started_at is not None else now
        return b_now, (b_now - n + 1) * BUCKET_S

    def _provisional(self, name: str, a: float, b: float) -> tuple[float, dict[str, float]]:
        """A pool's open-interval split of [a, b], memoized for the snapshot being built."""
        key = (name, a, b)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self.meters[name].provisional(a, b)
        return hit

    def _gpu(self, pools: Iterable[str], a: float, b: float, v: np.ndarray) -> tuple[float, float]:
        """(cost, idle) of the given pools over [a, b]: time-based cost, settled + provisional idle."""
        cost = idle = 0.0
        for name in pools:
            m = self.meters.get(name)
            if m is None:
                continue
            cost += m.cost_between(a, b)
            idle += self._provisional(name, a, b)[0]
        return cost, idle + float(v[C["idle_usd"]])

    def _tenant_usd(self, tenant: str, a: float, b: float, v: np.ndarray) -> float:
        usd = float(v[C["attributed_usd"]])
        for name in self.meters:
            usd += self._provisional(name, a, b)[1].get(tenant, 0.0)
        return usd

    def _vec(self, kind: str, name: str | None, b_now: int, n: int | None, label: str) -> np.ndarray:
        """A scope's counters over the window of ``n`` buckets ending at ``b_now`` (``label``: its name)."""
        ring = self.fleet if kind == "fleet" else (self.pools if kind == "pool" else self.tenants)[name]
        return ring.window(b_now, n)

    def _svec(self, kind: str, name: str | None, b: int, trailing: int) -> np.ndarray:
        """A scope's counters over the ``trailing`` buckets ending at ``b`` (a series point)."""
        return self._vec(kind, name, b, trailing, "")

    def windows(self, kind: str, name: str | None, now: float) -> dict:
        out = {}
        for label, n in WINDOWS.items():
            b_now, a = self._span(now, n)
            v = self._vec(kind, name, b_now, n, label)
            if kind == "fleet":
                cost, idle = self._gpu(self.meters, a, now, v)
            elif kind == "pool":
                cost, idle = self._gpu([name], a, now, v)
            else:
                cost, idle = self._tenant_usd(name, a, now, v), 0.0
            out[label] = figures(v, cost, idle, now - max(a, self.started_at or a))
        return out

    def series(self, now: float, points: int = 60, step_buckets: int = 2, trailing: int = 12) -> dict:
        """Fleet figures over time for the dashboard: each point covers the trailing minute."""
        b_now = int(now // BUCKET_S)
        out: dict[str, list] = {k: [] for k in (
            "t", "usd_per_1k_ok", "usd_per_1k_good", "usd_per_1m_generated", "slo_pass_rate", "dropped",
            "requests", "cache_hit_share")}
        shares: dict[str, list] = {p: [] for p in self.pools}
        for i in range(points - 1, -1, -1):
            b = b_now - i * step_buckets
            t_end = min((b + 1) * BUCKET_S, now)
            a = (b - trailing + 1) * BUCKET_S
            if self.started_at is None or t_end <= self.started_at:
                continue
            v = self._svec("fleet", None, b, trailing)
            cost = sum(m.cost_between(a, t_end) for m in self.meters.values())
            f = figures(v, cost, 0.0, t_end - a)
            out["t"].append(round(t_end, 3))
            out["usd_per_1k_ok"].append(f["gpu"]["usd_per_1k_ok"])
            out["usd_per_1k_good"].append(f["gpu"]["usd_per_1k_good"])
            out["usd_per_1m_generated"].append(f["gpu"]["usd_per_1m_generated"])
            out["slo_pass_rate"].append(f["slo_pass_rate"])
            out["dropped"].append(f["dropped"])
            out["requests"].append(f["requests"])
            out["cache_hit_share"].append(f["cache"]["hit_share"])
            for p in self.pools:
                n = self._svec("pool", p, b, trailing)[C["requests"]]
                shares[p].append(float(n / v[C["requests"]]) if v[C["requests"]] > 0 else None)
        out["route_share"] = shares
        return out

    def conservation(self) -> dict:
        """Settled books: attributed + idle == cost of the settled up-time, per pool and in total."""
        pools = {}
        for name, m in self.meters.items():
            settled_until = m.closed_at if m.closed else m.frontier
            pools[name] = {
                "settled_until": settled_until,
                "cost_usd": m.cost_between(m.started_at, settled_until),
                "attributed_usd": m.attributed_usd,
                "idle_usd": m.idle_usd,
            }
        tot = {k: sum(p[k] for p in pools.values()) for k in ("cost_usd", "attributed_usd", "idle_usd")}
        return {"pools": pools, **tot}

    def raw(self, now: float, points: int = 60, step_buckets: int = 2, trailing: int = 12) -> dict:
        """This process's counters, for the fleet-wide merge (``MergedStats``): every window of every
        scope, and the series points; a tenant's ``attributed_usd`` includes its provisional share."""
        self._memo = {}
        b_now = int(now // BUCKET_S)

        def wins(kind: str, name: str | None) -> dict:
            out = {}
            for label, n in WINDOWS.items():
                v = self._vec(kind, name, b_now, n, label)
                if kind == "tenant":
                    v = v.copy()
                    v[C["attributed_usd"]] = self._tenant_usd(name, self._span(now, n)[1], now, v)
                out[label] = v.tolist()
            return out

        def series(kind: str, name: str | None) -> list:
            return [self._svec(kind, name, b_now - i * step_buckets, trailing).tolist() for i in range(points)]

        out = {"b": b_now, "started_at": self.started_at,
               "fleet": {"w": wins("fleet", None), "s": series("fleet", None)},
               "pools": {p: {"w": wins("pool", p), "s": series("pool", p)} for p in self.pools},
               "tenants": {t: {"w": wins("tenant", t)} for t in self.tenants}}
        self._memo = {}
        return out

    def snapshot(self, now: float, with_series: bool = False) -> dict:
        self._memo = {}
        out = {
            "now": now,
            "started_at": self.started_at,
            "uptime_s": now - self.started_at if self.started_at is not None else 0.0,
            "bucket_s": BUCKET_S,
            "fleet": self.windows("fleet", None, now),
            "pools": {
                name: {
                    "usd_per_hour": self.meters[name].rate * 3600.0 if name in self.meters else 0.0,
                    "started_at": self.meters[name].started_at if name in self.meters else None,
                    "windows": self.windows("pool", name, now),
                }
                for name in self.pools if name in self.meters
            },
            "tenants": {name: {"windows": self.windows("tenant", name, now)} for name in sorted(self.tenants)},
            "conservation": self.conservation(),
        }
        if with_series:
            out["series"] = self.series(now)
        self._memo = {}
        return out



class MergedStats(Stats):
    """The fleet's windows: the sum of the live gateways' published ``Stats.raw`` (accounting/shared.py).

    GPU cost is still time-based from this process's meters (the pools' shared start), idle is the
    sum of the idle intervals each gateway settled for the fleet plus the open part's idle by the
    fleet's work; tenants' dollars are the sums of their published shares.
    """

    def __init__(self, meters: dict[str, PoolMeter], raws: list[dict]):
        super().__init__(meters)
        self.raws = raws
        self.pools = {p: None for r in raws for p in r["pools"]}  # type: ignore[misc] (names only)
        self.tenants = {t: None for r in raws for t in r["tenants"]}  # type: ignore[misc]
        starts = [r["started_at"] for r in raws if r.get("started_at") is not None]
        if starts:
            self.started_at = min(starts + ([self.started_at] if self.started_at is not None else []))

    def _scope(self, r: dict, kind: str, name: str | None) -> dict | None:
        return r["fleet"] if kind == "fleet" else r["pools" if kind == "pool" else "tenants"].get(name)

    def _vec(self, kind: str, name: str | None, b_now: int, n: int | None, label: str) -> np.ndarray:
        v = np.zeros(len(COLUMNS))
        for r in self.raws:
            sc = self._scope(r, kind, name)
            if sc is not None:
                v += np.asarray(sc["w"][label])
        return v

    def _svec(self, kind: str, name: str | None, b: int, trailing: int, step_buckets: int = 2) -> np.ndarray:
        v = np.zeros(len(COLUMNS))
        for r in self.raws:
            sc = self._scope(r, kind, name)
            if sc is None:
                continue
            j = round((r["b"] - b) / step_buckets)  # the publisher's nearest point (clocks a bucket apart)
            if 0 <= j < len(sc["s"]):
                v += np.asarray(sc["s"][j])
        return v

    def _tenant_usd(self, tenant: str, a: float, b: float, v: np.ndarray) -> float:
        return float(v[C["attributed_usd"]])  # provisional shares are in the published figures

    def conservation(self) -> dict:
        """The fleet's books (Redis, as of this gateway's last sync)."""
        pools = {name: dict(m.fleet_books) for name, m in self.meters.items() if m.fleet_books is not None}
        tot = {k: sum(p[k] for p in pools.values()) for k in ("cost_usd", "attributed_usd", "idle_usd")}
        return {"pools": pools, **tot}
