"""Live state of the vLLM fleet: replicas, health, and load scraped from each replica's /metrics.

Other steps read this state (routers, admission, accounting); only this module writes it. A
background loop probes ``/health`` and scrapes ``/metrics`` every ``timeouts.health_interval_s``.
The proxy reports failures (``mark_down``) so a dead replica leaves rotation at once instead of at
the next probe; a down replica is re-probed after ``retry_after_down_s`` and comes back on success.

A pool with ``discovery`` has its replicas found at run time (upstream/discovery.py): one loop per
such pool reads its source and ``reconcile`` adds and removes replicas. ``PoolState.replicas`` is
replaced, never changed in place, so a reader holding the old list iterates a consistent one.
Listeners (``on_change``: the pickers' per-replica state, the GPU bill) hear of every change.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import httpx

from usefulwork.upstream.http1 import UpstreamPool
from usefulwork.config import Config, Pool
from usefulwork.tasks import cancel_and_wait
from usefulwork.upstream.discovery import Source, build_source

log = logging.getLogger("usefulwork.fleet")

# vLLM V1 metric names we read (sums over label sets; one engine per server in practice).
SCRAPED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # pre-V1 name
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    # cumulative; a replica keeps the mean over its last few scrape intervals (``Replica.itl_live``)
    "vllm:inter_token_latency_seconds_sum": "itl_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
    # cumulative, observed per request when its first token comes (``Replica.prefill_live``)
    "vllm:request_prefill_time_seconds_sum": "prefill_sum",
    "vllm:request_prefill_time_seconds_count": "prefill_count",
    # cumulative, observed per request when it ends (``Replica.e2e_live``)
    "vllm:e2e_request_latency_seconds_sum": "e2e_sum",
    "vllm:e2e_request_latency_seconds_count": "e2e_count",
}


ITL_WINDOW = 3  # scrape intervals in Replica.itl_live (and prefill_live, e2e_live)
ITL_MIN_TOKENS = 32  # decoded tokens in that window for a figure
PREFILL_MIN = 2  # prefills in that window for a figure
E2E_MIN = 2  # ended requests in that window for a figure


@dataclass(slots=True, eq=False)
class Replica:
    url: str  # base URL without /v1
    pool: str
    healthy: bool = False  # becomes True after the first successful probe
    ever_healthy: bool = False
    down_reason: str | None = None
    down_until: float = 0.0
    inflight: int = 0  # requests this gateway has outstanding on it right now
    consecutive_failures: int = 0
    # scraped from /metrics
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0
    num_gpu_blocks: float = 0.0  # vllm:cache_config_info labels: the KV cache's size (admission's cap)
    block_size: float = 0.0
    itl_sum: float = 0.0  # vllm:inter_token_latency_seconds (sum, count): cumulative, observed per decoded token
    itl_count: float = 0.0
    # The mean inter-token latency over the last ITL_WINDOW scrape intervals: the decode speed now, seen
    # seconds before any request ends (admission's live TPOT). None: under ITL_MIN_TOKENS decoded, or no figure.
    itl_live: float | None = None
    itl_window: deque = field(default_factory=lambda: deque(maxlen=ITL_WINDOW))  # (d_sum, d_count) per interval
    prefill_sum: float = 0.0  # vllm:request_prefill_time_seconds (sum, count): cumulative, per request
    prefill_count: float = 0.0
    # One prefill's time (scheduled -> first token) over the last ITL_WINDOW scrape intervals: what admission
    # deems a unary request's prefill place takes (no first token is seen on a unary answer). None: too few.
    prefill_live: float | None = None
    prefill_window: deque = field(default_factory=lambda: deque(maxlen=ITL_WINDOW))
    e2e_sum: float = 0.0  # vllm:e2e_request_latency_seconds (sum, count): cumulative, per ended request
    e2e_count: float = 0.0
    # One request's time in the server (arrival -> end, its queue inside vLLM included) over the last ITL_WINDOW
    # scrape intervals, whoever sent it: what a cold gateway deems a slot is held before it has timed one of
    # its own (``Capacity.slot_hold``). None: too few ended.
    e2e_live: float | None = None
    e2e_window: deque = field(default_factory=lambda: deque(maxlen=ITL_WINDOW))
    scrapes: int = 0  # /metrics reads so far (a reader judges each one once)
    last_scrape: float = 0.0
    http: UpstreamPool | None = None  # the data-path connection pool (set by Fleet)
    discovered: bool = False  # found by the pool's discovery source (else listed in the config)
    removed: bool = False  # no longer in its pool (discovery dropped it); in-flight requests finish

    def take_metrics(self, values: dict[str, float]) -> None:
        """Apply one /metrics read (``parse_metrics``): gauges as read, the histograms as deltas."""
        itl0, prefill0 = (self.itl_sum, self.itl_count), (self.prefill_sum, self.prefill_count)
        e2e0 = (self.e2e_sum, self.e2e_count)
        for attr, value in values.items():
            setattr(self, attr, value)
        # Over a few intervals, not one: one token's gap spans any prefill that ran in its step (0.7 s for a
        # 512-token prompt on a CPU), so a 2 s interval with few tokens read as a slow decode and cut the limit.
        self.itl_live = self._windowed(self.itl_window, itl0, (self.itl_sum, self.itl_count), ITL_MIN_TOKENS)
        self.prefill_live = self._windowed(self.prefill_window, prefill0, (self.prefill_sum, self.prefill_count),
                                           PREFILL_MIN)
        self.e2e_live = self._windowed(self.e2e_window, e2e0, (self.e2e_sum, self.e2e_count), E2E_MIN)
        self.scrapes += 1
        self.last_scrape = time.time()

    def _windowed(self, window: deque, before: tuple[float, float], now: tuple[float, float], least: int) -> float | None:
        """A cumulative histogram's mean over the last scrape intervals (None: under ``least`` observations)."""
        d_sum, d_count = now[0] - before[0], now[1] - before[1]
        if d_count < 0 or d_sum < 0:
            window.clear()  # the server restarted: its counters went back
        elif self.scrapes:  # (the first read has no interval)
            window.append((d_sum, d_count))
        n = sum(c for _, c in window)
        return sum(x for x, _ in window) / n if n >= least else None

    @property
    def load(self) -> float:
        """Outstanding work: our own in-flight count, or the server's if other clients load it too."""
        return max(float(self.inflight), self.running + self.waiting)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class Lease:
    """One request outstanding on a replica (see ``Fleet.lease``)."""

    __slots__ = ("replica", "_held")

    def __init__(self, replica: Replica):
        self.replica = replica
        self._held = True
        replica.inflight += 1

    def release(self) -> None:
        if self._held:
            self._held = False
            self.replica.inflight -= 1

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(slots=True, eq=False)
class PoolState:
    cfg: Pool
    replicas: list[Replica]
    started_at: float = field(default_factory=time.time)
    source: Source | None = None  # discovery (None: the configured replicas only)
    discovery_errors: int = 0  # failed reads of the source in a row (the replicas last found are kept)
    discovered_at: float = 0.0  # wall time of the last successful read

    @property
    def name(self) -> str:
        return self.cfg.name

    def healthy_replicas(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]


def parse_metrics(text: str) -> dict[str, float]:
    """Sum the samples of the vLLM metrics we care about (cheap line scan, no full parser)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        end = line.find("{")
        if end < 0:
            end = line.find(" ")
        name = line[:end]
        if name == "vllm:cache_config_info":
            out.update(_cache_config(line))
            continue
        attr = SCRAPED.get(name)
        if attr is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        out[attr] = out.get(attr, 0.0) + value
    return out


def _cache_config(line: str) -> dict[str, float]:
    """``num_gpu_blocks`` and ``block_size`` from the labels of ``vllm:cache_config_info``."""
    out = {}
    for key in ("num_gpu_blocks", "block_size"):
        i = line.find(f'{key}="')
        if i >= 0:
            j = line.find('"', i + len(key) + 2)
            try:
                out[key] = float(line[i + len(key) + 2:j])
            except ValueError:
                pass
    return out


class Fleet:
    def __init__(self, cfg: Config, client: httpx.AsyncClient | None = None):
        self.cfg = cfg
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        self._own_client = client is None
        self.pools: dict[str, PoolState] = {
            p.name: PoolState(p, [self._replica(url, p.name) for url in p.replicas],
                              source=build_source(p.discovery) if p.discovery is not None else None)
            for p in cfg.pools
        }
        self._by_model: dict[str, PoolState] = {m: self.pools[p.name] for p in cfg.pools for m in p.models}
        self.listeners: list[Callable[[PoolState, list[Replica], list[Replica]], None]] = []
        self._task: asyncio.Task | None = None
        self._discovery_tasks: list[asyncio.Task] = []
        self._probes: set[asyncio.Task] = set()  # first probes of replicas discovery just added
        self._draining: set[Replica] = set()  # removed by discovery with requests still running on them

    def _replica(self, url: str, pool: str, discovered: bool = False) -> Replica:
        t = self.cfg.timeouts
        r = Replica(url, pool, discovered=discovered)
        r.http = UpstreamPool(url, connect_timeout=t.connect_s, read_timeout=t.read_s,
                              header_timeout=t.first_byte_s, max_body_bytes=self.cfg.limits.max_upstream_body_bytes)
        return r

    # -- reads --
    def pool_for_model(self, model: str) -> PoolState | None:
        return self._by_model.get(model)

    @property
    def replicas(self) -> list[Replica]:
        return [r for p in self.pools.values() for r in p.replicas]

    def any_inflight(self) -> bool:
        """Some request of this gateway is outstanding on a replica (also one discovery removed since)."""
        self._draining = {r for r in self._draining if r.inflight > 0}
        return bool(self._draining) or any(r.inflight > 0 for r in self.replicas)

    def ready(self) -> bool:
        """Every serving pool has at least one healthy replica (a shadow pool only mirrors: it never gates)."""
        shadow = self.cfg.shadow.pool if self.cfg.shadow is not None else None
        return bool(self.pools) and all(p.healthy_replicas() for name, p in self.pools.items() if name != shadow)

    def candidates(self, pool: PoolState) -> list[Replica]:
        """Replicas a picker may choose from: the healthy ones, else those whose back-off expired."""
        healthy = [r for r in pool.replicas if r.healthy]
        if healthy:
            return healthy
        # Nothing known healthy (start-up, or all failing): try the ones whose back-off expired.
        now = time.monotonic()
        return [r for r in pool.replicas if r.down_until <= now] or list(pool.replicas)

    # -- writes --
    @staticmethod
    def lease(replica: Replica) -> Lease:
        """Count one request on ``replica`` until ``release()`` (idempotent; also a context manager).

        The only writer of ``Replica.inflight``: an early return or an exception cannot leak a count.
        """
        return Lease(replica)

    def mark_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            log.warning("replica %s marked down: %s", replica.url, reason)
        replica.healthy = False
        replica.down_reason = reason
        replica.consecutive_failures += 1
        replica.down_until = time.monotonic() + self.cfg.timeouts.retry_after_down_s

    def mark_up(self, replica: Replica) -> None:
        if not replica.healthy:
            log.info("replica %s is up", replica.url)
        replica.healthy = True
        replica.ever_healthy = True
        replica.down_reason = None
        replica.consecutive_failures = 0
        replica.down_until = 0.0

    def on_change(self, listener: Callable[[PoolState, list[Replica], list[Replica]], None]) -> None:
        """Call ``listener(pool, added, removed)`` after every change of a pool's replicas."""
        self.listeners.append(listener)

    # -- discovery --
    def reconcile(self, pool: PoolState, urls: list[str]) -> tuple[list[Replica], list[Replica]]:
        """Make the pool's discovered replicas exactly ``urls`` (configured ones always stay).

        A new replica is unhealthy until its first probe (started here) passes, so it takes no
        traffic before vLLM answers ``/health``. A removed one leaves the pick at once; its idle
        connections close now and its busy ones when their requests end.
        """
        static = {r.url for r in pool.replicas if not r.discovered}
        want = [u for u in dict.fromkeys(urls) if u not in static]
        have = {r.url: r for r in pool.replicas if r.discovered}
        added = [self._replica(u, pool.name, discovered=True) for u in want if u not in have]
        keep = set(want)
        removed = [r for u, r in have.items() if u not in keep]
        if not (added or removed):
            return added, removed
        gone = {r.url for r in removed}
        pool.replicas = [r for r in pool.replicas if r.url not in gone] + added
        for r in removed:
            r.removed = True
            r.healthy = False
            r.down_reason = "removed by discovery"
            r.http.retire()
            if r.inflight > 0:
                self._draining.add(r)
        log.info("pool %s: %d replica(s) (+%d %s, -%d %s)", pool.name, len(pool.replicas), len(added),
                 ", ".join(r.url for r in added) or "", len(removed), ", ".join(r.url for r in removed) or "")
        for listener in self.listeners:
            try:
                listener(pool, added, removed)
            except Exception:  # one listener's fault must not stop discovery or the others
                log.exception("fleet listener failed")
        for r in added:
            task = asyncio.get_running_loop().create_task(self.probe(r), name=f"probe {r.url}")
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)
        return added, removed

    async def discover_once(self, pool: PoolState) -> bool:
        """Read the pool's source once and reconcile; on failure keep the replicas (False)."""
        try:
            urls = await asyncio.wait_for(pool.source.urls(), max(pool.cfg.discovery.interval_s, 1.0))
        except Exception as exc:  # resolver, file or parse error: keep what we have
            pool.discovery_errors += 1
            if pool.discovery_errors == 1 or pool.discovery_errors % 60 == 0:
                log.warning("pool %s: discovery (%s) failed %d time(s) in a row, keeping its %d replica(s): %s",
                            pool.name, pool.source.describe(), pool.discovery_errors, len(pool.replicas),
                            f"{type(exc).__name__}: {exc}")
            return False
        if pool.discovery_errors:
            log.info("pool %s: discovery (%s) works again", pool.name, pool.source.describe())
        pool.discovery_errors = 0
        pool.discovered_at = time.time()
        self.reconcile(pool, urls)
        return True

    async def _discover_loop(self, pool: PoolState) -> None:
        while True:
            await asyncio.sleep(pool.cfg.discovery.interval_s)
            try:
                await self.discover_once(pool)
            except Exception:  # never let discovery die
                log.exception("pool %s: discovery loop error", pool.name)

    # -- probing --
    async def probe(self, replica: Replica) -> bool:
        if not replica.healthy and replica.ever_healthy and time.monotonic() < replica.down_until:
            return False
        try:
            r = await self.client.get(f"{replica.url}/health", timeout=self.cfg.timeouts.connect_s)
            ok = r.status_code == 200
        except httpx.HTTPError as exc:
            ok = False
            reason = f"health check failed: {type(exc).__name__}"
        else:
            reason = f"health check returned {r.status_code}"
        if replica.removed:
            return False  # discovery dropped it while the probe ran
        if not ok:
            self.mark_down(replica, reason)
            return False
        self.mark_up(replica)
        try:
            m = await self.client.get(f"{replica.url}/metrics", timeout=self.cfg.timeouts.connect_s)
            if m.status_code == 200:
                replica.take_metrics(parse_metrics(m.text))
        except httpx.HTTPError:
            pass  # metrics are best effort; health decides up/down
        return True

    async def check_once(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in self.replicas))

    async def _loop(self) -> None:
        while True:
            try:
                await self.check_once()
            except Exception:  # never let the prober die
                log.exception("fleet probe loop error")
            await asyncio.sleep(self.cfg.timeouts.health_interval_s)

    async def start(self) -> None:
        discovered = [p for p in self.pools.values() if p.source is not None]
        await asyncio.gather(*(self.discover_once(p) for p in discovered))
        await self.check_once()
        self._task = asyncio.create_task(self._loop(), name="fleet-prober")
        self._discovery_tasks = [asyncio.create_task(self._discover_loop(p), name=f"discovery {p.name}")
                                 for p in discovered]

    async def stop(self) -> None:
        for t in [*self._discovery_tasks, *self._probes]:
            await cancel_and_wait(t)
        await cancel_and_wait(self._task)
        for r in self.replicas:
            r.http.close()
        if self._own_client:
            await self.client.aclose()
