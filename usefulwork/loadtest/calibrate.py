"""A server's capacity at the SLO, estimated from a probe of seconds, to scale an experiment's rates.

An experiment on the local CPU vLLM sizes its rates for one server: ``admission-vllm``'s "capacity" cells
bracket what that server holds within the SLO, its burst and "2x" cells are multiples of it. CPUs differ
by several times (an AMX host holds ~0.85 req/s at 512/128, an AVX2 host well under 0.1), so fixed
rates made no overload on one host and a collapse from the first cell on another. An experiment with a
``calibrate:`` block (``sized_for_rps``: the capacity its rates were sized for) sends each cell's traffic
at ``F = estimated capacity / sized_for_rps`` times the rate (rates x F; durations and periods / F on a
slower server, as written on a faster one: ``Experiment.scale_rates``, ``experiment.clock_for``):

1. **Probe** (straight to the first profile's backend, before any cell): a one-word prompt (the API's
   own time and one step), one prompt of the first shape alone (its first token ``P``; its token gaps,
   one sequence's decode step ``D(1)``), then ``concurrency`` prompts at once (the time to the last one's
   first token: full prefill steps; the gaps after it: the step with that many sequences ``D(n)``).
   With ``repeats: N`` the lone prompt and the prompts together go ``N`` times in turn, each figure the
   median of its passes, every pass with prompts of its own (one sent again is a prefix-cache hit).
2. **Step model** (``StepModel.fit``): a step costs ``a + c (sequences in it) + b x + q x^2`` for ``x``
   prompt tokens in it: ``c`` from ``D(n) - D(1)``, ``a`` from ``D(1)``, ``b`` from the lone prompt and
   ``q`` from the prompts sent together (a full step costs more per token than a lone prompt's on a GPU).
3. **Capacity** (``capacity``): the server on the simulator's virtual clock (``sim/engine.py``: vLLM V1's
   scheduler, running sequences first, then waiting prompts in chunks under a 2,048-token budget) with
   those step times, Poisson arrivals of the first shape: the largest rate at which 95% of the requests
   meet the SLO's TTFT, TPOT and E2E (the loadtest's attainment), over three arrival seeds. With
   ``speed_margin: m`` the steps are ``1 + m`` times as long as probed: near its capacity a slow server's
   attainment moves ~15 points for a 10-15% change in its speed, and the probe is a minute's sample of a
   host that also runs the gateway and the load generator during the cells.

Why a simulation: the closed form it replaced (Little's law, prefills as a share of the engine's time,
the in-flight count at its 95th percentile) missed what sets a slow server's tail: how many prompts a
request finds ahead of its own, and how many prefills stall its decode. On an AVX2 host (a 2.2 s prefill,
61 ms a token alone, 141 with 8) it said 0.082 req/s, where cells at 0.0756 and 0.1004 req/s met the SLO
for 86.5% and 88.2% of their requests; simulated, the same probe gives 0.059 req/s, and 89-93% / 77-82%
at those rates (docs/benchmarks.md section 7, session 26). On the simulated A100 it gives 9.6 req/s from
a probe through HTTP (12.4 from the engine's own step times), where the admission experiment measures
11.13 (the closed form: 10.7).

The run records the probe, the step model, the estimate and the scale (``results.json`` ``calibration``).
The estimate sizes the cells; the capacity the verdicts use is still the one the capacity cells measure
(where the estimate is right, the cell under it meets the SLO and the one over it does not).
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from usefulwork.backends.sim.catalog import build_spec
from usefulwork.backends.sim.engine import SimEngine
from usefulwork.loadtest.metrics import percentile
from usefulwork.loadtest.runner import LoadSpec, RunOutput, Target, run_sync
from usefulwork.loadtest.workloads import Workload

BUDGET_TOKENS = 2048  # vLLM V1's max_num_batched_tokens for its OpenAI server (GPU and CPU defaults)
MAX_SEQS = 128  # vLLM's CPU default max_num_seqs (a GPU's larger default does not bind at the SLO's concurrency)
REQUESTS = 600  # simulated requests per arrival seed (the first ``WARM`` are not judged: an empty server)
WARM = 50
SEEDS = (0, 1, 2)
TARGET = 0.95  # the attainment the capacity holds
SCALE_RANGE = (0.02, 10.0)  # a scale outside this is a broken probe, not a server


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
    prompt_tokens: int = 512
    together_first_s: float = 0.0  # from sending ``concurrency`` prompts at once to the last one's first token
    samples: dict[str, list[float]] = field(default_factory=dict)  # each repeat's figures (the fields are their medians)

    @property
    def stall_s(self) -> float:
        """How long a prompt's prefill holds the engine beyond a decode step (the tokens of every running
        sequence wait that long): a lone prompt's first token less a one-word prompt's."""
        return max(0.0, self.prefill_s - self.base_s)

    @property
    def slope(self) -> float:
        """A decode step's cost per sequence in it."""
        return max(0.0, (self.decode_n_s - self.decode_1_s) / max(1, self.concurrency - 1))


@dataclass(frozen=True)
class StepModel:
    """A step's seconds: ``step_s + per_seq_s x sequences + per_token_s x t + per_token2_s x t^2`` for ``t``
    prompt tokens in it; ``front_end_s``: a request's time in the API before the engine sees it."""

    step_s: float
    per_seq_s: float
    per_token_s: float
    per_token2_s: float
    front_end_s: float

    @classmethod
    def fit(cls, p: Probe, budget: int = BUDGET_TOKENS) -> StepModel:
        c = p.slope
        a = max(1e-4, p.decode_1_s - c)
        front = max(0.0, p.base_s - p.decode_1_s)
        n_tok = max(1, p.prompt_tokens)
        one = max(1e-6, p.prefill_s - front - a - c)  # a lone prompt's step less its fixed costs: b n + q n^2
        b, q = one / n_tok, 0.0
        if p.together_first_s > 0 and p.concurrency > 1:
            # The prompts sent together fill whole steps; what those took beyond ``b`` per token is ``q``.
            chunks, left = [], p.concurrency * n_tok
            while left > 0:
                chunks.append(min(budget, left))
                left -= chunks[-1]
            seqs = [min(p.concurrency, math.ceil((i + 1) * budget / n_tok)) for i in range(len(chunks))]
            rest = p.together_first_s - front - sum(a + c * s for s in seqs)
            sx, sx2 = sum(chunks), sum(x * x for x in chunks)
            if sx2 > n_tok * sx:  # (steps larger than one prompt: else ``q`` is not seen)
                q = max(0.0, (rest - one / n_tok * sx) / (sx2 - n_tok * sx))
                b = max(0.0, (one - q * n_tok * n_tok) / n_tok)
        return cls(a, c, b, q, front)

    def slower(self, margin: float) -> StepModel:
        """Every time ``1 + margin`` times as long."""
        f = 1.0 + margin
        return StepModel(self.step_s * f, self.per_seq_s * f, self.per_token_s * f, self.per_token2_s * f, self.front_end_s * f)

    def seconds(self, plan: Any) -> float:
        t = plan.num_prefill_tokens
        return self.step_s + self.per_seq_s * len(plan.items) + self.per_token_s * t + self.per_token2_s * t * t


def engine(model: StepModel, max_len: int, seed: int = 0, scheduling_policy: str = "fcfs",
           prefix_caching: bool = False) -> SimEngine:
    """The probed server on the simulator's virtual clock: vLLM V1's scheduler (its CPU defaults) with
    ``model``'s step times, requests of up to ``max_len`` tokens, never bound by its KV cache (not probed;
    with ``prefix_caching``, room for as many blocks again to stay cached)."""
    block = 16
    spec = build_spec(model="Llama-3.1-8B", profile="cpu", overrides={
        "max_num_seqs": MAX_SEQS, "max_num_batched_tokens": BUDGET_TOKENS, "max_model_len": max_len,
        "block_size": block, "enable_prefix_caching": prefix_caching, "scheduling_policy": scheduling_policy,
        "num_gpu_blocks_override": (1 + prefix_caching) * (MAX_SEQS + 1) * math.ceil(max_len / block)})
    return SimEngine(spec, seed=seed, timer=model, request_overhead_s=model.front_end_s)


def simulate(p: Probe, lam: float, slo_s: tuple[float, float, float], requests: int = REQUESTS, seed: int = 0,
             model: StepModel | None = None) -> dict[str, float]:
    """The probe's server at ``lam`` requests/s (Poisson, the probe's prompt and output lengths) on the
    simulator's virtual clock: the share of requests within the SLO (``slo_s``: TTFT, TPOT, E2E seconds)
    and the 95th percentiles, the first ``WARM`` requests not judged."""
    m = model or StepModel.fit(p)
    n_in, n_out = max(1, p.prompt_tokens), max(2, p.output_tokens)
    eng = engine(m, n_in + n_out, seed=seed)
    rng, t, reqs = random.Random(seed), 0.0, []
    for i in range(requests):
        t += rng.expovariate(lam)
        reqs.append(eng.add_request([1000 + i] * n_in, n_out, ignore_eos=True, arrival_time=t))  # (no prefix cache)
    eng.run_until_idle()
    lat = [(r.first_token_time - r.arrival_time, (r.finish_time - r.first_token_time) / (n_out - 1),
            r.finish_time - r.arrival_time) for r in reqs[min(WARM, requests // 4):]]  # (TTFT, TPOT, E2E)
    ok = sum(1 for x in lat if all(v <= limit for v, limit in zip(x, slo_s)))
    p95 = [percentile([x[i] for x in lat], 95) for i in range(3)]  # (as the loadtest's reports compute them)
    return {"rps": lam, "attainment": ok / len(lat), "p95_ttft_s": p95[0], "p95_tpot_s": p95[1], "p95_e2e_s": p95[2]}


def attainment(p: Probe, lam: float, slo_s: tuple[float, float, float], requests: int = REQUESTS,
               seeds: tuple[int, ...] = SEEDS, model: StepModel | None = None) -> float:
    """Mean share of requests within the SLO at ``lam`` requests/s over ``seeds`` (``simulate``)."""
    m = model or StepModel.fit(p)
    return sum(simulate(p, lam, slo_s, requests, s, m)["attainment"] for s in seeds) / len(seeds)


def capacity(p: Probe, ttft_s: float, tpot_s: float, e2e_s: float, requests: int = REQUESTS,
             seeds: tuple[int, ...] = SEEDS, target: float = TARGET, margin: float = 0.0) -> float:
    """The largest arrival rate (requests/s) at which ``target`` of the requests meet the SLO on the
    simulated server (``attainment``), its steps ``1 + margin`` times as long as probed; 0 where even a
    lone request misses it. The same arrivals are scaled for every rate tried, so the attainment falls
    with the rate and a bisection finds the edge."""
    m, slo = StepModel.fit(p).slower(margin), (ttft_s, tpot_s, e2e_s)
    hi = 1.0 / max(p.stall_s, 1e-3)  # beyond that the prefills alone fill the engine
    lo = hi / 1000.0
    if attainment(p, lo, slo, requests, seeds, m) < target:
        return 0.0
    for _ in range(10):  # (geometric over three orders of magnitude: to within 0.7%)
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if attainment(p, mid, slo, requests, seeds, m) >= target else (lo, mid)
    return lo


def lone_misses(p: Probe, slo_s: tuple[float, float, float], margin: float = 0.0) -> str:
    """Why a server has no capacity at the SLO: the SLO terms a request alone on it misses (its p95 at a
    trickle on the simulated server, steps ``1 + margin`` times as long as probed), with the figures. A slow
    host's lone sequence may already decode slower than the TPOT SLO (an AVX2 host at 141 ms a token
    against 150 ms, plus the margin), which no rate and no admission can change."""
    r = simulate(p, 1e-3 / max(p.prefill_s + p.output_tokens * p.decode_1_s, 1e-3), slo_s, requests=WARM + 20,
                 model=StepModel.fit(p).slower(margin))
    got = (r["p95_ttft_s"], r["p95_tpot_s"], r["p95_e2e_s"])
    terms = [f"{name} {g * 1e3:.0f} ms > {limit * 1e3:.0f} ms" for name, g, limit in zip(("TTFT", "TPOT", "E2E"), got, slo_s)
             if g > limit]
    slower = f", steps {margin:.0%} slower than probed" if margin else ""
    if not terms:  # (the p95s pass, the tail does not)
        terms = [f"{r['attainment']:.0%} of requests within it"]
    return (f"a request alone on this server misses the SLO (p95{slower}): {', '.join(terms)}; no rate meets it (a "
            "looser SLO, or --rate-scale to run the cells as written anyway)")


def _ok(out: RunOutput, want: int) -> list:
    good = [r for r in out.results if r.outcome == "ok" and r.ttft > 0 and r.itl]
    if len(good) < want:
        bad = [f"{r.outcome} {r.status} {r.error}".strip() for r in out.results if r not in good]
        raise CalibrationError(f"the probe needs {want} streamed answers, got {len(good)}: {'; '.join(bad[:3])}")
    return good


def probe(url: str, model: str, workload: Workload, concurrency: int, timeout_s: float, tiny: Workload,
          time_scale: float = 1.0, seed: int = 0, prompt_tokens: int = 512, repeats: int = 1) -> Probe:
    """Measure ``Probe`` on the server at ``url`` with ``workload``'s prompts of ``prompt_tokens`` (``tiny``: a one-word prompt,
    two tokens out; ``time_scale``: a simulator's simulated seconds per wall second, the figures come back
    in simulated seconds). Times per token are means over spans (a stream may deliver several tokens in
    one read), not medians of gaps.

    With ``repeats`` > 1 the lone prompt and the prompts sent together are sent that many times in turn and
    each figure is the median of its repeats (``samples`` keeps them all): one pass is a few seconds of a
    shared host, and the slope of the decode step (``D(n) - D(1)``, a difference of two such samples) sets
    the capacity of a decode-bound server."""
    from usefulwork.loadtest.experiment import rescale

    target = Target(url, model)

    def run(n: int, s: int, wl: Workload = workload) -> list:
        load = LoadSpec(concurrency=n, num_requests=n, timeout_s=timeout_s / time_scale, drain_s=timeout_s / time_scale,
                        seed=s)
        return _ok(rescale(run_sync(target, wl, load), time_scale), n)

    base = run(1, seed + 2, tiny)[0]  # a fresh server's first answer is slower: counted only if it is not
    base = min(base, run(1, seed + 3, tiny)[0], key=lambda r: r.ttft)
    samples: dict[str, list[float]] = {"prefill_s": [], "decode_1_s": [], "decode_n_s": [], "together_first_s": []}
    output_tokens = 0
    for k in range(max(1, repeats)):
        s = seed + 10 * k
        alone = run(1, s)[0]
        together = run(concurrency, s + 1)
        first, decode_n = _together(together)
        samples["prefill_s"].append(alone.ttft)
        samples["decode_1_s"].append(sum(alone.itl) / len(alone.itl))
        samples["decode_n_s"].append(decode_n)
        samples["together_first_s"].append(first)
        output_tokens = output_tokens or alone.output_tokens or len(alone.itl) + 1  # (the first pass's)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return Probe(prefill_s=med["prefill_s"], decode_1_s=med["decode_1_s"], concurrency=concurrency,
                 decode_n_s=med["decode_n_s"], output_tokens=output_tokens, base_s=base.ttft, prompt_tokens=prompt_tokens,
                 together_first_s=med["together_first_s"], samples=samples if repeats > 1 else {})


def _together(together: list) -> tuple[float, float]:
    """Prompts sent at once: the time to the last one's first token, and the mean time per token of the
    steps begun after it (every prompt's prefill done)."""
    last_first = max(r.sent + r.ttft for r in together)
    sent = min(r.sent for r in together)
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
    return last_first - sent, span / tokens


def scale_for(p: Probe, sized_for_rps: float, slo: Any, margin: float = 0.0) -> dict[str, Any]:
    """The calibration record: the probe, the step model, the estimated capacity (steps ``1 + margin``
    times as long as probed) and the scale for the rates."""
    slo_s = (slo.ttft_ms / 1e3, slo.tpot_ms / 1e3, slo.e2e_ms / 1e3)
    est = capacity(p, *slo_s, margin=margin)
    scale = est / sized_for_rps
    if not SCALE_RANGE[0] <= scale <= SCALE_RANGE[1]:
        why = f"; {lone_misses(p, slo_s, margin)}" if est == 0.0 else ""
        raise CalibrationError(f"estimated capacity {est:.3g} req/s against rates sized for {sized_for_rps:g}: "
                               f"scale {scale:.3g} is outside {SCALE_RANGE}{why}; probe {asdict(p)}")
    m = StepModel.fit(p)
    return {"probe": asdict(p), "step_model": asdict(m), "speed_margin": margin, "estimated_capacity_rps": est,
            "sized_for_rps": sized_for_rps, "rate_scale": scale,
            "at_capacity": simulate(p, est, slo_s, model=m.slower(margin))}
