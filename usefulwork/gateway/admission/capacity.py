"""How much work a pool can take now, measured online; no hand-set capacity number is needed.

The limit is a number of requests in flight per pool, adapted like a congestion window (AIMD):

- each admitted request that ends is a sample of the pool's service: TTFT (sent upstream -> first
  token), TPOT and E2E without the gateway's queue wait, kept as running means;
- while the means stay under ``target_fraction`` of the SLO and the replicas are not saturated, the
  limit grows (by one per sample until the first overload, "slow start"; then by one per limit's
  worth of samples);
- a sample over target shrinks it by 10%, at most once per service time; a replica queueing more
  than a quarter of its running requests inside vLLM (``vllm:num_requests_waiting``) or a KV cache
  over ``kv_high`` holds it (no growth);
- the replicas' KV-cache size (``vllm:cache_config_info`` blocks x block size) caps it at the
  number of sequences of the measured length that fit; ``max_concurrency`` may cap it further.

The drain rate (requests that leave per second when the pool is full) is Little's law on the
same measurements: limit / mean service time. The clock is a parameter: tests run it virtually.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from usefulwork.gateway.admission.config import AdmissionCfg

EWMA = 0.1  # weight of a new sample in the running means


@dataclass(slots=True)
class Sample:
    """One finished request, as admission saw it (seconds; None where it produced no token)."""

    ttft: float | None  # sent upstream -> first token
    tpot: float | None
    service: float  # admitted -> finished (the slot's hold time)
    tokens: int  # prompt + completion
    ok: bool  # ended with a complete answer (an error or cancel is not a service sample)
    inflight_at_admit: int  # requests in flight when it was admitted (was the limit being tested?)


class Capacity:
    """The adaptive in-flight limit and the service-time estimates of one pool."""

    def __init__(self, cfg: AdmissionCfg, slo_ttft_s: float, slo_tpot_s: float, slo_e2e_s: float,
                 replicas: Callable[[], Iterable] = tuple, replica_count: Callable[[], int] | None = None):
        self.cfg = cfg
        self.replicas = replicas  # live replica state (running, waiting, kv_usage, num_gpu_blocks, block_size)
        self._count = replica_count or (lambda: max(1, sum(1 for r in self.replicas() if getattr(r, "healthy", True))))
        f = cfg.target_fraction
        self.slo_e2e_s = slo_e2e_s
        self.ttft_target = slo_ttft_s * f
        self.tpot_target = slo_tpot_s * f
        self.e2e_target = slo_e2e_s * f
        self.limit = float(cfg.initial_concurrency * self._count())
        self.slow_start = True
        self.last_decrease = -1e18
        self.svc_ttft: float | None = None  # EWMA of service TTFT (s)
        self.tpot: float | None = None
        self.service: float | None = None  # EWMA of a slot's hold time (s)
        self.tokens: float | None = None  # EWMA of tokens per request
        self.samples = 0
        self.decreases = 0

    # -- reads --
    def saturated(self) -> bool:
        """A replica queues a real share of its work inside vLLM, or its KV cache is nearly full.

        A few waiting requests at a scrape are normal under load (new arrivals wait one engine step
        for a chunked prefill), so they only stop growth when they exceed a quarter of the running."""
        return any(getattr(r, "waiting", 0.0) > max(1.0, 0.25 * getattr(r, "running", 0.0))
                   or getattr(r, "kv_usage", 0.0) > self.cfg.kv_high for r in self.replicas())

    def kv_cap(self) -> float | None:
        """Sequences of the measured mean length that fit in the pool's KV caches (None: unknown)."""
        if not self.tokens:
            return None
        total = 0.0
        for r in self.replicas():
            blocks = getattr(r, "num_gpu_blocks", 0.0)
            size = getattr(r, "block_size", 0.0)
            if not (blocks and size):
                return None
            total += blocks * size / self.tokens
        return total or None

    def current(self) -> int:
        """The limit to apply now (whole requests, within the configured and KV caps)."""
        lim = self.limit
        kv = self.kv_cap()
        if kv is not None:
            lim = min(lim, kv)
        if self.cfg.max_concurrency is not None:
            lim = min(lim, self.cfg.max_concurrency)
        return max(self.cfg.min_concurrency, int(lim))

    def drain_rate(self) -> float | None:
        """Requests per second that leave a full pool. Before the first measurement, a slot is
        assumed held for the whole E2E SLO (cautious: a cold gateway sheds early rather than late)."""
        service = self.service or self.slo_e2e_s
        return self.current() / service if service else None

    def est_ttft(self) -> float:
        return self.svc_ttft or 0.0

    def est_e2e(self, max_tokens: int | None) -> float:
        """Expected service time of a request that may produce ``max_tokens`` tokens."""
        if self.tpot is not None and max_tokens:
            return self.est_ttft() + self.tpot * max(0, max_tokens - 1)
        return self.service or 0.0

    # -- writes --
    def observe(self, s: Sample, now: float) -> None:
        self.service = _ewma(self.service, s.service)
        if s.tokens:
            self.tokens = _ewma(self.tokens, float(s.tokens))
        if not s.ok:
            return  # failures say nothing about the pool's speed
        self.samples += 1
        if s.ttft is not None:
            self.svc_ttft = _ewma(self.svc_ttft, s.ttft)
        if s.tpot is not None:
            self.tpot = _ewma(self.tpot, s.tpot)
        # Judged on the running means, not one sample: a single slow answer (a host hiccup) must not
        # cut the limit that many good ones built.
        over = ((self.svc_ttft is not None and self.svc_ttft > self.ttft_target)
                or (self.tpot is not None and self.tpot > self.tpot_target)
                or self.service > self.e2e_target)
        if over:
            if now - self.last_decrease >= (self.service or 0.0):
                self.limit = max(float(self.cfg.min_concurrency), self.limit * 0.9)
                self.last_decrease = now
                self.slow_start = False
                self.decreases += 1
            return
        if self.saturated():  # the replicas say "full" before the SLO does: hold, do not grow
            return
        if s.inflight_at_admit + 1 >= int(self.limit):  # only a limit that was reached has been tested
            self.limit += 1.0 if self.slow_start else 1.0 / self.limit
            if self.cfg.max_concurrency is not None:
                self.limit = min(self.limit, float(self.cfg.max_concurrency))

    def stats(self) -> dict:
        return {"limit": self.current(), "limit_raw": round(self.limit, 2), "slow_start": self.slow_start,
                "service_s": self.service, "service_ttft_s": self.svc_ttft, "tpot_s": self.tpot,
                "drain_per_s": self.drain_rate(), "kv_cap": self.kv_cap(), "saturated": self.saturated(),
                "samples": self.samples, "decreases": self.decreases}


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + EWMA * (new - old)
