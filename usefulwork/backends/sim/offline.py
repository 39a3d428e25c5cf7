"""Drive a SimEngine with a closed-loop client on the virtual clock (no HTTP, no wall time).

Used by the calibration benchmark and tests: N clients, each sends its next request as soon as its
previous one finished (llmperf's and vLLM's `--max-concurrency` shape).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from statistics import mean

from usefulwork.backends.sim.catalog import SimSpec
from usefulwork.backends.sim.engine import SimEngine
from usefulwork.backends.sim.scheduler import SimRequest


@dataclass
class RequestResult:
    ttft: float
    e2e: float
    output_tokens: int

    @property
    def itl(self) -> float:
        """Mean gap between output tokens after the first (vLLM benchmark's TPOT)."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass
class LoadResult:
    requests: list[RequestResult]
    duration: float  # first send to last finish, simulated seconds
    output_tokens: int

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.duration if self.duration else 0.0

    @property
    def mean_ttft(self) -> float:
        return mean(r.ttft for r in self.requests)

    @property
    def mean_itl(self) -> float:
        return mean(r.itl for r in self.requests)

    @property
    def mean_e2e(self) -> float:
        return mean(r.e2e for r in self.requests)


def _prompt(rng: random.Random, n: int) -> list[int]:
    # Random ids: distinct prompts, so no accidental prefix-cache hits between clients.
    return [rng.randrange(1000, 50000) for _ in range(n)]


def closed_loop(
    spec: SimSpec,
    concurrency: int,
    n_requests: int,
    prompt_len: int,
    output_len: int,
    seed: int = 0,
    prompt_stddev: int = 0,
    output_stddev: int = 0,
    client_overhead_s: float = 0.0,
) -> LoadResult:
    engine = SimEngine(spec, seed=seed)
    rng = random.Random(seed)

    def submit(at: float) -> SimRequest:
        p = max(1, int(rng.gauss(prompt_len, prompt_stddev))) if prompt_stddev else prompt_len
        o = max(1, int(rng.gauss(output_len, output_stddev))) if output_stddev else output_len
        return engine.add_request(_prompt(rng, p), o, ignore_eos=True, arrival_time=at)

    active = [submit(0.0) for _ in range(min(concurrency, n_requests))]
    sent = len(active)
    done: list[RequestResult] = []
    while active:
        if engine.step() is None and not engine.has_work():
            break
        still = []
        for r in active:
            if r.finish_time is None:
                still.append(r)
                continue
            done.append(RequestResult(r.first_token_time - r.arrival_time + client_overhead_s,
                                      r.finish_time - r.arrival_time + client_overhead_s, r.num_output_tokens))
            if sent < n_requests:
                still.append(submit(r.finish_time + client_overhead_s))
                sent += 1
        active = still
    return LoadResult(done, engine.now, sum(r.output_tokens for r in done))


@dataclass
class OpenLoopResult:
    ok: list[RequestResult]  # finished within the client timeout
    dropped: int  # timed out at the client (aborted on the server, as a disconnect does)

    def percentile_e2e(self, q: float) -> float:
        xs = sorted(r.e2e for r in self.ok)
        return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


def poisson_arrivals(rate: float, duration_s: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t > duration_s:
            return out
        out.append(t)


def open_loop(
    spec: SimSpec,
    arrivals: list[float],
    prompt_len: int,
    output_len: int,
    timeout_s: float = 30.0,
    seed: int = 0,
) -> OpenLoopResult:
    """Requests at fixed times (e.g. Poisson); a request not finished `timeout_s` after it was sent
    is dropped by the client, and the server aborts it (frees its batch slot and KV blocks)."""
    engine = SimEngine(spec, seed=seed)
    rng = random.Random(seed)
    reqs = [engine.add_request(_prompt(rng, prompt_len), output_len, ignore_eos=True, arrival_time=t)
            for t in arrivals]
    deadlines = sorted(reqs, key=lambda r: r.arrival_time + timeout_s)
    i = 0
    while engine.has_work():
        # Abort every request whose client gave up before the next step starts.
        while i < len(deadlines) and deadlines[i].arrival_time + timeout_s <= engine.now:
            if deadlines[i].finish_time is None:
                engine.abort(deadlines[i])
            i += 1
        if engine.step() is None:
            break
    ok = [RequestResult(r.first_token_time - r.arrival_time, r.finish_time - r.arrival_time, r.num_output_tokens)
          for r in reqs if r.finish_reason in ("length", "stop") and r.finish_time - r.arrival_time <= timeout_s]
    return OpenLoopResult(ok, len(reqs) - len(ok))
