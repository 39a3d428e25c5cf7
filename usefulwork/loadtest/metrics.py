"""From per-request results to the run's figures: latency percentiles, goodput, SLO, cost.

Field names follow ``vllm bench serve``'s saved JSON where they overlap (``completed``, ``failed``,
``request_throughput``, ``output_throughput``, ``mean_ttft_ms``, ``p99_itl_ms``, ``ttfts``, ...).
Percentiles use linear interpolation (numpy's default, as vLLM's) over SUCCESSFUL requests only.

Definitions:
- duration: run start to the end of the last request (any outcome): the window the fleet was
  paid for. Cost = fleet $/hour x duration.
- good request: ok AND ttft <= slo.ttft_ms AND tpot <= slo.tpot_ms (when defined) AND e2el <= slo.e2e_ms.
- SLO pass rate: good / all requests sent (dropped work counts against it). The run passes its SLO
  when the pass rate is at least ``slo.attainment`` (0.95: "95% of requests meet the targets").
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from usefulwork.loadtest.client import OUTCOMES, RequestResult

DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


@dataclass(frozen=True)
class SLOSpec:
    ttft_ms: float = 2000.0
    tpot_ms: float = 200.0
    e2e_ms: float = 30000.0
    attainment: float = 0.95

    @classmethod
    def from_mapping(cls, m: dict[str, Any] | None, base: "SLOSpec | None" = None) -> "SLOSpec":
        base = base or cls()
        if not m:
            return base
        unknown = set(m) - {"ttft_ms", "tpot_ms", "e2e_ms", "attainment"}
        if unknown:
            raise ValueError(f"slo does not take {', '.join(sorted(unknown))}")
        merged = {**asdict(base), **{k: float(v) for k, v in m.items()}}
        if not 0 < merged["attainment"] <= 1:
            raise ValueError("slo.attainment must be in (0, 1]")
        return cls(**merged)


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolation percentile (numpy's default); 0.0 for no values, like vLLM bench."""
    if len(values) == 0:
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=float), p))


def p_word(p: float) -> str:
    """vLLM's key spelling: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def is_good(r: RequestResult, slo: SLOSpec) -> bool:
    if r.outcome != "ok":
        return False
    if r.ttft * 1000.0 > slo.ttft_ms or r.e2el * 1000.0 > slo.e2e_ms:
        return False
    tpot = r.tpot
    return tpot is None or tpot * 1000.0 <= slo.tpot_ms


def max_concurrency(results: Iterable[RequestResult]) -> int:
    """Largest number of requests in flight at once (sweep over send/end events)."""
    events: list[tuple[float, int]] = []
    for r in results:
        events.append((r.sent, 1))
        events.append((r.end, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # an end at the same instant frees its slot first
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def _stats(prefix: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values_s]
    out = {
        f"mean_{prefix}_ms": float(np.mean(ms)) if ms else 0.0,
        f"median_{prefix}_ms": percentile(ms, 50),
        f"std_{prefix}_ms": float(np.std(ms)) if ms else 0.0,
    }
    for p in percentiles:
        out[f"{p_word(p)}_{prefix}_ms"] = percentile(ms, p)
    return out


def cost_figures(usd_per_hour: float, duration_s: float, completed: int, good: int, output_tokens: int) -> dict[str, Any]:
    cost = usd_per_hour * duration_s / 3600.0

    def per(n: int, unit: float) -> float | None:
        return cost / n * unit if n else None

    return {
        "fleet_usd_per_hour": usd_per_hour,
        "cost_usd": cost,
        "usd_per_1k_successful": per(completed, 1e3),
        "usd_per_1k_good": per(good, 1e3),
        "usd_per_1m_generated_tokens": per(output_tokens, 1e6),
    }


def summarize(results: Sequence[RequestResult], *, slo: SLOSpec, usd_per_hour: float,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    """The run's figures (no per-request arrays; see ``per_request_arrays``)."""
    ok = [r for r in results if r.outcome == "ok"]
    # The window starts when the run starts (offset 0), not at the first send: an open-loop run's
    # first arrival comes a random gap later, and the fleet is paid for that gap too (vLLM bench
    # measures its duration the same way).
    start = 0.0
    end = max((r.end for r in results), default=0.0)
    duration = max(end - start, 1e-9) if results else 0.0
    good = sum(1 for r in results if is_good(r, slo))
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    outcomes = {o: 0 for o in OUTCOMES}
    for r in results:
        outcomes[r.outcome] += 1
    lags = [r.schedule_lag for r in results]
    out: dict[str, Any] = {
        "duration": duration,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "dropped": len(results) - len(ok),
        "outcome_counts": outcomes,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "request_goodput": good / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        "max_concurrent_requests": max_concurrency(results),
        # Tokens streamed to requests that then failed (timed out mid-answer, ...): paid-for waste.
        "wasted_output_tokens": sum(r.chunks for r in results if r.outcome != "ok"),
        "good": good,
        "slo_pass_rate": good / len(results) if results else 0.0,
        "slo": asdict(slo),
    }
    out["slo_passed"] = bool(results) and out["slo_pass_rate"] >= slo.attainment
    out.update(_stats("ttft", [r.ttft for r in ok], percentiles))
    out.update(_stats("tpot", [t for r in ok if (t := r.tpot) is not None], percentiles))
    out.update(_stats("itl", [g for r in ok for g in r.itl], percentiles))
    out.update(_stats("e2el", [r.e2el for r in ok], percentiles))
    out.update({
        "mean_schedule_lag_ms": float(np.mean(lags)) * 1000.0 if lags else 0.0,
        "p99_schedule_lag_ms": percentile(lags, 99) * 1000.0,
        "max_schedule_lag_ms": max(lags, default=0.0) * 1000.0,
    })
    out.update(cost_figures(usd_per_hour, duration, len(ok), good, total_out))
    return out


def per_request_arrays(results: Sequence[RequestResult]) -> dict[str, list[Any]]:
    """vLLM bench's per-request lists (seconds), plus our outcome and timing columns."""
    return {
        "input_lens": [r.prompt_tokens or r.planned_input_tokens for r in results],
        "output_lens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.e2el for r in results],
        "errors": [r.error for r in results],
        "outcomes": [r.outcome for r in results],
        "start_times": [r.sent for r in results],
        "planned_times": [r.planned for r in results],
        "end_times": [r.end for r in results],
        "kinds": [r.kind for r in results],
        "request_ids": [r.request_id for r in results],
    }


def timeline(results: Sequence[RequestResult], step_s: float = 1.0) -> dict[str, list[float]]:
    """Per-step series for plots: sent/s, ok/s, output tokens/s and requests in flight."""
    if not results:
        return {"t": [], "sent_per_s": [], "ok_per_s": [], "output_tokens_per_s": [], "in_flight": []}
    end = max(r.end for r in results)
    n = max(1, math.ceil(end / step_s))
    t = [(i + 0.5) * step_s for i in range(n)]
    sent = np.zeros(n)
    ok = np.zeros(n)
    tok = np.zeros(n)
    for r in results:
        sent[min(n - 1, int(r.sent / step_s))] += 1
        if r.outcome == "ok":
            ok[min(n - 1, int(r.end / step_s))] += 1
            # Spread the output evenly from first token to end: a fair picture at 1 s resolution.
            first, last = r.sent + r.ttft, r.end
            if r.output_tokens and last > first:
                a, b = int(first / step_s), min(n - 1, int(last / step_s))
                for i in range(a, b + 1):
                    lo, hi = max(first, i * step_s), min(last, (i + 1) * step_s)
                    tok[i] += r.output_tokens * max(0.0, hi - lo) / (last - first)
            elif r.output_tokens:
                tok[min(n - 1, int(last / step_s))] += r.output_tokens
    sends = np.array([r.sent for r in results])
    ends = np.array([r.end for r in results])
    inflight = np.array([np.count_nonzero((sends <= x) & (ends > x)) for x in t], dtype=float)
    return {"t": t, "sent_per_s": list(sent / step_s), "ok_per_s": list(ok / step_s),
            "output_tokens_per_s": list(tok / step_s), "in_flight": list(inflight)}
