"""A server's capacity at the SLO, estimated from a probe of seconds, to scale an experiment's rates.

An experiment on the local CPU vLLM sizes its rates for one server: ``admission-vllm``'s "capacity" cells
bracket what that server holds within the SLO, its burst and "2x" cells are multiples of it. CPUs differ
by several times (an AMX host holds ~0.85 req/s at 512/128, an AVX2 host a fraction of 0.6), so fixed
rates made no overload on one host and a collapse from the first cell on another. An experiment with a
``calibrate:`` block (``sized_for_rps``: the capacity its rates were sized for) sends each cell's traffic
at ``F = estimated capacity / sized_for_rps`` times the pace (rates x F, durations and periods / F:
``Experiment.scale_rates``):

1. **Probe** (straight to the first profile's backend, before any cell): one request alone (its first
   token is a prompt's prefill time ``P``, its token gaps the decode step of one sequence ``D(1)``), then
   ``concurrency`` requests at once (the gaps after the last first token: the step with that many
   sequences decoding, ``D(n)``). Decode steps grow linearly with the sequences in them:
   ``D(L) = D(1) + (D(n) - D(1)) (L - 1) / (n - 1)``.
2. **Model.** At ``lam`` requests/s each prompt's prefill holds the engine ``P`` (a share ``u = lam P``
   of its time), so every token waits ``D(L) / (1 - u)`` and a request takes
   ``E2E = (P + (out - 1) D(L)) / (1 - u)``; Little's law closes it (``L = lam E2E``, linear in ``L``).
   Poisson arrivals leave a Poisson number in flight: the capacity is the largest ``lam`` whose TTFT,
   TPOT and E2E meet the SLO with ``L + 1.645 sqrt(L)`` in flight (its 95th percentile: a 95%
   attainment). A slow server runs few requests at once, so its count swings more: on an AVX2 host
   (a 2.2 s prefill, 60 ms a token) the mean alone said 0.16 req/s, the 95th percentile 0.08 (still
   high there: cells at 0.92x and 1.23x of it met the SLO for 86-88% of their requests).

The run records the probe, the estimate and the scale (``results.json`` ``calibration``). The estimate
sizes the cells; the capacity the verdicts use is still the one the capacity cells measure (where the
estimate is right, the cell under it meets the SLO and the one over it does not).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from usefulwork.loadtest.runner import LoadSpec, RunOutput, Target, run_sync
from usefulwork.loadtest.workloads import Workload

Z95 = 1.645  # the in-flight count's 95th percentile, in standard deviations (a 95% attainment)
SCALE_RANGE = (0.1, 10.0)  # a scale outside this is a broken probe, not a server


class CalibrationError(RuntimeError):
    pass


@dataclass
class Probe:
    prefill_s: float  # a lone prompt's time to first token
    decode_1_s: float  # a lone sequence's time per token
    concurrency: int
    decode_n_s: float  # the time per token with ``concurrency`` sequences decoding together
    output_tokens: int
    base_s: float = 0.0  # a lone one-word prompt's time to first token: the API's own time and one step

    @property
    def stall_s(self) -> float:
        """How long a prompt's prefill holds the engine beyond a decode step (the tokens of every running
        sequence wait that long): a lone prompt's first token less a one-word prompt's."""
        return max(0.0, self.prefill_s - self.base_s)

    def decode_s(self, sequences: float) -> float:
        """The decode step with ``sequences`` in it (linear between the two measured points, beyond them too)."""
        return self.decode_1_s + self.slope * (max(1.0, sequences) - 1.0)

    @property
    def slope(self) -> float:
        return max(0.0, (self.decode_n_s - self.decode_1_s) / max(1, self.concurrency - 1))


def operating_point(p: Probe, lam: float) -> dict[str, float] | None:
    """(in flight, TTFT, TPOT, E2E) at ``lam`` requests/s by the model; None where the server cannot keep up."""
    u = lam * p.stall_s
    if u >= 1.0:
        return None
    out = max(1, p.output_tokens - 1)
    # L = lam E2E, E2E = (P + out (D1 + s (L - 1))) / (1 - u): linear in L
    c0 = lam * (p.prefill_s + out * (p.decode_1_s - p.slope)) / (1.0 - u)
    c1 = lam * out * p.slope / (1.0 - u)
    if c1 >= 1.0:
        return None
    inflight = c0 / (1.0 - c1)
    if inflight < 1.0:  # (fewer than one sequence on average: the step of one)
        inflight = lam * (p.prefill_s + out * p.decode_1_s) / (1.0 - u)
    return _point(p, inflight, u)


def _point(p: Probe, inflight: float, u: float) -> dict[str, float]:
    """TTFT, TPOT and E2E with ``inflight`` sequences while prefills hold the engine a share ``u`` of its time."""
    tpot = p.decode_s(inflight) / (1.0 - u)
    ttft = p.prefill_s / (1.0 - u)
    return {"inflight": inflight, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": ttft + max(1, p.output_tokens - 1) * tpot}


def at_p95(p: Probe, lam: float, z: float = Z95) -> dict[str, float] | None:
    """The operating point at ``lam`` requests/s with the in-flight count at its 95th percentile
    (``L + z sqrt(L)``: Poisson arrivals leave a Poisson number in flight), arrivals and prefills in the
    same proportion; None where the server cannot keep up."""
    mean = operating_point(p, lam)
    if mean is None:
        return None
    n = mean["inflight"] + z * math.sqrt(mean["inflight"])
    u = lam * n / mean["inflight"] * p.stall_s
    return None if u >= 1.0 else _point(p, n, u)


def capacity(p: Probe, ttft_s: float, tpot_s: float, e2e_s: float, z: float = Z95) -> float:
    """The largest arrival rate (requests/s) whose TTFT, TPOT and E2E meet the SLO with the in-flight
    count at its 95th percentile (``at_p95``): the rate a 95% attainment holds."""
    def ok(lam: float) -> bool:
        pt = at_p95(p, lam, z)
        return pt is not None and pt["ttft_s"] <= ttft_s and pt["tpot_s"] <= tpot_s and pt["e2e_s"] <= e2e_s

    if not ok(1e-6):
        return 0.0
    lo, hi = 1e-6, 1.0 / max(p.stall_s, 1e-3)  # beyond that the prefills alone fill the engine
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _ok(out: RunOutput, want: int) -> list:
    good = [r for r in out.results if r.outcome == "ok" and r.ttft > 0 and r.itl]
    if len(good) < want:
        bad = [f"{r.outcome} {r.status} {r.error}".strip() for r in out.results if r not in good]
        raise CalibrationError(f"the probe needs {want} streamed answers, got {len(good)}: {'; '.join(bad[:3])}")
    return good


def probe(url: str, model: str, workload: Workload, concurrency: int, timeout_s: float, tiny: Workload,
          time_scale: float = 1.0, seed: int = 0) -> Probe:
    """Measure ``Probe`` on the server at ``url`` with ``workload``'s prompts (``tiny``: a one-word prompt,
    two tokens out; ``time_scale``: a simulator's simulated seconds per wall second, the figures come back
    in simulated seconds). Times per token are means over spans (a stream may deliver several tokens in
    one read), not medians of gaps."""
    from usefulwork.loadtest.experiment import rescale

    target = Target(url, model)

    def run(n: int, s: int, wl: Workload = workload) -> list:
        load = LoadSpec(concurrency=n, num_requests=n, timeout_s=timeout_s / time_scale, drain_s=timeout_s / time_scale,
                        seed=s)
        return _ok(rescale(run_sync(target, wl, load), time_scale), n)

    base = run(1, seed + 2, tiny)[0]  # a fresh server's first answer is slower: counted only if it is not
    base = min(base, run(1, seed + 3, tiny)[0], key=lambda r: r.ttft)
    alone = run(1, seed)[0]
    together = run(concurrency, seed + 1)
    last_first = max(r.sent + r.ttft for r in together)
    span, tokens = 0.0, 0
    for r in together:
        t = r.sent + r.ttft
        for g in r.itl:
            if t >= last_first:  # a step begun after every prompt's prefill
                span += g
                tokens += 1
            t += g
    if not tokens:
        raise CalibrationError("no token came after the last prompt's prefill: raise output_tokens or lower concurrency")
    return Probe(prefill_s=alone.ttft, decode_1_s=sum(alone.itl) / len(alone.itl), concurrency=concurrency,
                 decode_n_s=span / tokens, output_tokens=alone.output_tokens or len(alone.itl) + 1, base_s=base.ttft)


def scale_for(p: Probe, sized_for_rps: float, slo: Any) -> dict[str, Any]:
    """The calibration record: the probe, the estimated capacity and the scale for the rates."""
    est = capacity(p, slo.ttft_ms / 1e3, slo.tpot_ms / 1e3, slo.e2e_ms / 1e3)
    scale = est / sized_for_rps
    if not SCALE_RANGE[0] <= scale <= SCALE_RANGE[1]:
        raise CalibrationError(f"estimated capacity {est:.3g} req/s against rates sized for {sized_for_rps:g}: "
                               f"scale {scale:.3g} is outside {SCALE_RANGE}; probe {asdict(p)}")
    return {"probe": asdict(p), "estimated_capacity_rps": est, "sized_for_rps": sized_for_rps, "rate_scale": scale,
            "at_capacity": {"mean": operating_point(p, est), "p95": at_p95(p, est)}}
