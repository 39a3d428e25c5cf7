"""Paired comparison: the same recorded traffic sent to a baseline and a candidate, difference by difference.

Each recorded request goes to both targets at its recorded (scaled) time, the two sends launched in
the same tick in a random order (neither side always goes first). Then for every figure the
difference candidate - baseline is computed over the same requests, with a paired bootstrap
confidence interval (the same resampled requests on both sides). A baseline-vs-baseline pass
(the baseline target against itself, same schedule) gives each figure's noise floor: the largest
difference its own 95% interval admits when nothing changed. A difference is *real* when its size is
above the noise floor and its interval excludes 0 at the family-wise level: with 12 figures tested
at once, the decision uses the Bonferroni interval (1 - 0.05/12, ~99.6%), so that "no difference"
holds for all figures together 95% of the time (the reported interval stays the plain 95% one).

A latency quantile is only judged over enough successful requests on each side (``min_requests``): its
distribution-free interval at the decision's level must lie inside the sample (``p**n <= alpha/2``: 9
requests for a p50, 121 for a p95, 615 for a p99 at the default level). With fewer, all of a sample's
requests lie below the true p99 more often than the decision may err, and the bootstrap, which only
resamples the handful of requests at the top, calls a difference made by one or two slow requests
real (docs/replay.md: the study). Such a figure is reported with its interval and ``judged: false``,
never as real. ``alpha`` (``--alpha``) sets the family-wise level.

Figures (in total, per tenant and per route):
- ``usd_per_1k_successful``, ``usd_per_1m_tokens``: each side's fleet cost (``usd_per_hour`` x the
  pass's window, start to the last answer on either side: both fleets carry the same traffic over
  the same hours) attributed to requests in proportion to their work (prompt + generated tokens).
  So cost differs by the $/hour, by failures (fewer successful requests share the bill) and by
  tokens generated; a slower setup at the same $/hour shows as latency, not cost.
- ``p50/p95/p99`` of TTFT and end-to-end latency (ms, successful requests), ``slo_pass_rate``
  (``metrics.is_good``), ``error_rate`` (not ok / all).
- output agreement (candidate vs baseline, requests both answered): ``exact_match`` and
  ``embedding_similarity`` (cosine, all-MiniLM-L6-v2 via ``usefulwork.embedding``); its difference is
  taken against the baseline-vs-baseline agreement of the same requests (a sampled model does not agree
  with itself either).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from usefulwork.loadtest.client import RequestResult
from usefulwork.loadtest.loopwatch import freeze_heap
from usefulwork.loadtest.metrics import SLOSpec, is_good
from usefulwork.loadtest.replay import ReplaySpec, ReplayWorkload
from usefulwork.loadtest.results import run_result
from usefulwork.loadtest.runner import LoadSpec, RunOutput, Target

SIDE_FIGURES = ("usd_per_1k_successful", "usd_per_1m_tokens", "p50_ttft_ms", "p95_ttft_ms", "p99_ttft_ms",
                "p50_e2e_ms", "p95_e2e_ms", "p99_e2e_ms", "slo_pass_rate", "error_rate")
AGREEMENT = ("exact_match", "embedding_similarity")


@dataclass
class Pass:
    """One paired pass: per request, the two sides' results (index-aligned with the workload)."""

    a: list[RequestResult]
    b: list[RequestResult]
    wall_start: float
    interrupted: bool = False


async def paired_pass(workload: ReplayWorkload, a: Target, b: Target, *, timeout_s: float = 120.0,
                      seed: int = 0) -> Pass:
    """Send every request to both targets at its planned time, the order of the two drawn at random.

    Through the replay's lean sender (``replay_send``): both sides' requests are encoded before the
    clock starts and fired from one timer loop, so neither side's sends wait on the other's CPU work.
    """
    from usefulwork.loadtest import replay_send as rs  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    send_a = rs.Sender(a, timeout_s=timeout_s, keep_text=True)
    send_b = rs.Sender(b, timeout_s=timeout_s, keep_text=True)
    pairs = [(send_a.prepare(s), send_b.prepare(s), bool(rng.random() < 0.5)) for s in workload.specs()]
    tasks: list[tuple[asyncio.Task, asyncio.Task]] = []
    interrupted = False

    def launch(pair) -> None:
        pa, pb, a_first = pair
        if a_first:
            ta = asyncio.create_task(send_a.send(pa, clock0))
            tb = asyncio.create_task(send_b.send(pb, clock0))
        else:
            tb = asyncio.create_task(send_b.send(pb, clock0))
            ta = asyncio.create_task(send_a.send(pa, clock0))
        tasks.append((ta, tb))

    unfreeze = freeze_heap()  # the prepared requests out of the collector's scans while sending
    wall0 = time.time()
    clock0 = time.perf_counter()
    try:
        await rs.fire_on_schedule(pairs, _due, launch, clock0)
        pending = [t for pair in tasks for t in pair]
        if pending:
            await asyncio.wait(pending, timeout=timeout_s + 1.0)
    except asyncio.CancelledError:
        interrupted = True
    finally:
        unfreeze()
        for pair in tasks:
            for t in pair:
                if not t.done():
                    t.cancel()
        left = [t for pair in tasks for t in pair if not t.done()]
        if left:
            await asyncio.wait(left, timeout=5.0)
        send_a.close()
        send_b.close()
    pa, pb = [], []
    for ta, tb in tasks:
        if ta.done() and not ta.cancelled() and tb.done() and not tb.cancelled():
            pa.append(ta.result())
            pb.append(tb.result())
    return Pass(a=pa, b=pb, wall_start=wall0, interrupted=interrupted)


def _due(pair) -> float:
    return pair[0].spec.at


# -- per-request columns --------------------------------------------------------------------------

@dataclass
class Side:
    ok: np.ndarray
    good: np.ndarray
    ttft_ms: np.ndarray  # nan unless ok
    e2e_ms: np.ndarray  # nan unless ok
    out_tokens: np.ndarray  # 0 unless ok
    cost: np.ndarray  # $ attributed to each request

    @classmethod
    def of(cls, results: list[RequestResult], slo: SLOSpec, usd_per_hour: float, window: float) -> "Side":
        ok = np.array([r.outcome == "ok" for r in results], dtype=bool)
        # Work = prompt + generated tokens (the ledger attributes GPU time by work the same way); the
        # same request does the same work on both sides, so a paired resample compares like with like.
        work = np.array([(r.prompt_tokens or r.planned_input_tokens) + r.output_tokens for r in results], dtype=float)
        total = usd_per_hour * window / 3600.0
        n = len(results)
        cost = total * work / work.sum() if work.sum() > 0 else np.full(n, total / n if n else 0.0)
        return cls(ok=ok, good=np.array([is_good(r, slo) for r in results], dtype=bool),
                   ttft_ms=np.where(ok, [r.ttft * 1000.0 for r in results], np.nan),
                   e2e_ms=np.where(ok, [r.e2el * 1000.0 for r in results], np.nan),
                   out_tokens=np.where(ok, [r.output_tokens for r in results], 0).astype(float), cost=cost)


def _ratio(num: np.ndarray, den: np.ndarray, scale: float) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1) * scale, np.nan)


def _pct(v: np.ndarray, idx: np.ndarray, p: float, cache: dict | None = None) -> np.ndarray:
    """Row-wise linear-interpolation percentile ignoring nan (numpy's default method, vectorised)."""
    key = (id(v), id(idx))
    m = None if cache is None else cache.get(key)
    if m is None:
        m = np.sort(v[idx], axis=1)  # nan sorts last
        if cache is not None:
            cache[key] = m
    k = (~np.isnan(m)).sum(1)
    pos = np.maximum(k - 1, 0) * (p / 100.0)
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, np.maximum(k - 1, 0))
    rows = np.arange(m.shape[0])
    val = m[rows, lo] + (m[rows, hi] - m[rows, lo]) * (pos - lo)
    return np.where(k > 0, val, np.nan)


def side_figure(s: Side, name: str, idx: np.ndarray, cache: dict | None = None) -> np.ndarray:
    """The figure over each row of resampled request indices ``idx`` (shape: resamples x n)."""
    if name == "usd_per_1k_successful":
        return _ratio(s.cost[idx].sum(1), s.ok[idx].sum(1).astype(float), 1e3)
    if name == "usd_per_1m_tokens":
        return _ratio(s.cost[idx].sum(1), s.out_tokens[idx].sum(1), 1e6)
    if name == "slo_pass_rate":
        return s.good[idx].mean(1)
    if name == "error_rate":
        return 1.0 - s.ok[idx].mean(1)
    p, _, what = name.partition("_")
    return _pct(s.ttft_ms if what.startswith("ttft") else s.e2e_ms, idx, float(p[1:]), cache)


def agreement(a: list[RequestResult], b: list[RequestResult], embed: Callable[[list[str]], np.ndarray] | None
              ) -> dict[str, np.ndarray]:
    """Per request: exact match and cosine similarity of the two outputs (nan unless both ok)."""
    both = np.array([x.outcome == "ok" and y.outcome == "ok" for x, y in zip(a, b)], dtype=bool)
    ta = ["".join(x.text or ()) for x in a]
    tb = ["".join(y.text or ()) for y in b]
    exact = np.where(both, [float(x == y) for x, y in zip(ta, tb)], np.nan)
    sim = np.full(len(a), np.nan)
    if embed is not None and both.any():
        ids = np.flatnonzero(both)
        va = embed([ta[i] for i in ids])
        vb = embed([tb[i] for i in ids])
        sim[ids] = np.sum(va * vb, axis=1)
    return {"exact_match": exact, "embedding_similarity": sim}


def _mean_rows(v: np.ndarray, idx: np.ndarray) -> np.ndarray:
    m = v[idx]
    out = np.full(m.shape[0], np.nan)
    has = ~np.all(np.isnan(m), axis=1)
    if has.any():
        out[has] = np.nanmean(m[has], axis=1)
    return out


# -- the comparison -------------------------------------------------------------------------------

@dataclass
class Inputs:
    base: Side
    cand: Side
    noise: Side | None  # the baseline's second run in the baseline-vs-baseline pass
    noise_base: Side | None  # the baseline's first run in that pass
    agree: dict[str, np.ndarray]  # candidate vs baseline
    agree_noise: dict[str, np.ndarray] | None  # baseline vs baseline


ALPHA = 0.05  # the verdict's family-wise false-alarm level (``--alpha``)
TESTED = len(SIDE_FIGURES) + len(AGREEMENT)  # figures tested together
FAMILY_ALPHA = ALPHA / TESTED  # Bonferroni: each figure's level


def quantile_of(name: str) -> float | None:
    """The quantile a latency figure reports (``p99_e2e_ms``: 0.99), None for the other figures."""
    head = name.partition("_")[0]
    return float(head[1:]) / 100.0 if head[:1] == "p" and head[1:].isdigit() else None


def min_requests(p: float, alpha: float = FAMILY_ALPHA) -> int:
    """The fewest values whose order statistics bound the p-quantile at level 1 - alpha, distribution-free.

    With n values, all of them fall below the true p-quantile with probability p**n (above it: (1-p)**n);
    while that exceeds alpha/2, no interval drawn from the sample covers the quantile at that level, and
    a bootstrap interval (resampling the few values at the top) is overconfident.
    """
    return math.ceil(math.log(alpha / 2) / math.log(max(p, 1.0 - p)))


def _ci(x: np.ndarray, alpha: float = 0.05) -> tuple[float | None, float | None]:
    x = x[~np.isnan(x)]
    if len(x) == 0:
        return None, None
    return float(np.percentile(x, 100 * alpha / 2)), float(np.percentile(x, 100 * (1 - alpha / 2)))


def _f(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def compare(inp: Inputs, rows: np.ndarray, *, resamples: int = 1000, seed: int = 0, alpha: float = ALPHA
            ) -> dict[str, Any]:
    """Every figure's baseline, candidate, difference, 95% CI, noise floor and verdict over ``rows``.

    ``alpha``: the family-wise false-alarm level of the verdicts (Bonferroni over the figures).
    """
    fam = alpha / TESTED
    rng = np.random.default_rng(seed)
    n = len(rows)
    full = rows[None, :]
    boot = rows[rng.integers(0, n, size=(resamples, n))] if n else full
    out: dict[str, Any] = {"requests": int(n)}
    cache: dict = {}  # sorted latency matrices, shared by the p50/p95/p99 of one side
    for name in SIDE_FIGURES:
        b0 = side_figure(inp.base, name, full)[0]
        c0 = side_figure(inp.cand, name, full)[0]
        diff = side_figure(inp.cand, name, boot, cache) - side_figure(inp.base, name, boot, cache)
        floor = None
        if inp.noise is not None and inp.noise_base is not None:
            nd = side_figure(inp.noise, name, boot, cache) - side_figure(inp.noise_base, name, boot, cache)
            lo, hi = _ci(nd)
            floor = None if lo is None else max(abs(lo), abs(hi))
        p = quantile_of(name)
        need = None if p is None else min_requests(p, fam)
        if need is not None and min(int(inp.base.ok[rows].sum()), int(inp.cand.ok[rows].sum())) >= need:
            need = None  # enough successful requests on both sides: judged like any other figure
        out[name] = _entry(b0, c0, diff, floor, fam, need)
    for name in AGREEMENT:
        v = inp.agree[name]
        ab0 = _mean_rows(v, full)[0]
        if inp.agree_noise is not None:
            nv = inp.agree_noise[name]
            aa0 = _mean_rows(nv, full)[0]
            diff = _mean_rows(v, boot) - _mean_rows(nv, boot)
        else:
            aa0, diff = float("nan"), np.full(len(boot), np.nan)
        out[name] = _entry(aa0, ab0, diff, 0.0, fam)  # the noise pass IS the reference: no further floor
    return out


def _entry(base: float, cand: float, diff: np.ndarray, floor: float | None, fam: float = FAMILY_ALPHA,
           need: int | None = None) -> dict[str, Any]:
    """One figure's row; ``need``: the successful requests per side it lacked to be judged (never real then)."""
    lo, hi = _ci(diff)
    flo, fhi = _ci(diff, fam)
    d = None if _f(base) is None or _f(cand) is None else cand - base
    real = (need is None and flo is not None and d is not None and (flo > 0 or fhi < 0)
            and (floor is None or abs(d) > floor))
    return {"baseline": _f(base), "candidate": _f(cand), "diff": _f(d),
            "diff_pct": None if d is None or not base else d / abs(base) * 100.0,
            "ci95": [lo, hi], "noise_floor": floor, "real": bool(real), "judged": need is None,
            "min_requests": need}


def verdict(total: dict[str, Any]) -> str:
    real = [k for k in (*SIDE_FIGURES, *AGREEMENT) if total.get(k, {}).get("real")]
    unjudged = [f"{k} (needs {total[k]['min_requests']})" for k in SIDE_FIGURES
                if total.get(k, {}).get("judged") is False]
    tail = f"; not judged, too few successful requests: {', '.join(unjudged)}" if unjudged else ""
    if not real:
        return ("verdict: no difference (every difference is within its confidence interval or the noise floor)"
                + tail)
    parts = []
    for k in real:
        e = total[k]
        pct = "" if e["diff_pct"] is None else f" ({e['diff_pct']:+.1f}%)"
        parts.append(f"{k} {e['diff']:+.4g}{pct} [95% CI {e['ci95'][0]:+.4g}, {e['ci95'][1]:+.4g}]")
    return "verdict: real differences: " + "; ".join(parts) + tail


def _groups(specs: list[ReplaySpec], key: Callable[[ReplaySpec], str]) -> dict[str, np.ndarray]:
    out: dict[str, list[int]] = {}
    for i, s in enumerate(specs):
        out.setdefault(key(s), []).append(i)
    return {k: np.array(v) for k, v in sorted(out.items())}


def side_result(p_results: list[RequestResult], wall_start: float, workload: ReplayWorkload, t: Target,
                slo: SLOSpec, usd_per_hour: float, label: str) -> dict[str, Any]:
    """The side's loadtest figures (``results.run_result``), as a loadtest run would report them."""
    out = RunOutput(results=p_results, wall_start=wall_start,
                    wall_end=wall_start + max((r.end for r in p_results), default=0.0),
                    load=LoadSpec().describe(), workload=workload.describe(),
                    target={"base_url": t.base_url, "model": t.model})
    return run_result(out, slo=slo, usd_per_hour=usd_per_hour, label=label)


def _window(a: list[RequestResult], b: list[RequestResult]) -> float:
    """The pass's span (start to the last answer on either side): both fleets are priced over it."""
    return max((r.end for r in (*a, *b)), default=0.0)


def analyse(workload: ReplayWorkload, main: Pass, noise: Pass | None, *, slo: SLOSpec, usd_per_hour_a: float,
            usd_per_hour_b: float, embed: Callable[[list[str]], np.ndarray] | None, resamples: int = 1000,
            seed: int = 0, alpha: float = ALPHA) -> dict[str, Any]:
    n = len(main.a) if noise is None else min(len(main.a), len(noise.a))
    specs = workload.specs()[:n]
    a, b = main.a[:n], main.b[:n]
    w = _window(a, b)
    inp = Inputs(base=Side.of(a, slo, usd_per_hour_a, w), cand=Side.of(b, slo, usd_per_hour_b, w),
                 noise=None, noise_base=None, agree=agreement(a, b, embed), agree_noise=None)
    if noise is not None:
        wn = _window(noise.a[:n], noise.b[:n])
        inp.noise_base = Side.of(noise.a[:n], slo, usd_per_hour_a, wn)
        inp.noise = Side.of(noise.b[:n], slo, usd_per_hour_a, wn)
        inp.agree_noise = agreement(noise.a[:n], noise.b[:n], embed)
    total = compare(inp, np.arange(n), resamples=resamples, seed=seed, alpha=alpha)
    return {
        "total": total,
        "verdict": verdict(total),
        "by_tenant": {k: compare(inp, v, resamples=resamples, seed=seed, alpha=alpha)
                      for k, v in _groups(specs, lambda s: s.kind).items()},
        "by_route": {k: compare(inp, v, resamples=resamples, seed=seed, alpha=alpha)
                     for k, v in _groups(specs, lambda s: s.route).items()},
        "noise_pass": noise is not None,
        "resamples": resamples,
        "alpha": alpha,
    }


# -- live mirroring: the pairs come from two logs ------------------------------------------------

_OUTCOMES = {"ok": "ok", "shed": "shed", "timeout": "timeout", "client_cancelled": "client_cancelled"}


def _as_result(i: int, rec: dict[str, Any], t0: float) -> RequestResult:
    sent = rec["ts"] - t0
    e2e = (rec.get("e2e_ms") or 0.0) / 1000.0
    return RequestResult(index=i, kind=str(rec.get("tenant") or "default"), planned=sent, sent=sent, end=sent + e2e,
                         outcome=_OUTCOMES.get(rec.get("outcome"), "error"),  # type: ignore[arg-type]
                         status=int(rec.get("status") or 0), ttft=(rec.get("ttft_ms") or 0.0) / 1000.0,
                         prompt_tokens=int(rec.get("prompt_tokens") or 0),
                         output_tokens=int(rec.get("completion_tokens") or 0))


def pass_from_logs(primary: list[dict[str, Any]], shadow: list[dict[str, Any]]) -> tuple[ReplayWorkload, Pass]:
    """Join the mirror's shadow records to the recorded primaries (``shadow_of`` = id): one paired pass."""
    by_id = {r.get("id"): r for r in primary}
    pairs = sorted(((by_id[s["shadow_of"]], s) for s in shadow
                    if s.get("shadow_of") in by_id and s.get("op") in ("chat", "completions")),
                   key=lambda p: p[0]["ts"])
    if not pairs:
        from usefulwork.loadtest.replay import ReplayError  # noqa: PLC0415

        raise ReplayError("no shadow record joins a recorded request (shadow_of = id): record both with "
                          "filters [record, mirror]")
    t0 = pairs[0][0]["ts"]
    wl = ReplayWorkload(records=[p for p, _ in pairs], source="mirror")
    return wl, Pass(a=[_as_result(i, p, t0) for i, (p, _) in enumerate(pairs)],
                    b=[_as_result(i, s, t0) for i, (_, s) in enumerate(pairs)], wall_start=t0)
