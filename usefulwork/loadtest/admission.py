"""The admission experiment's figures and verdicts (``usefulwork loadtest --experiment admission``).

``per_request`` adds the columns admission needs to a cell's results (client group, status, retries,
how early a 429 came, its Retry-After and reason). ``verdicts`` reads the cells named in the
experiment's ``compare.admission`` section and checks the targets of issue 10:

- burst, admission on: p95 E2E of served requests within the SLO, SLO attainment of served requests
  >= 95%, zero timeouts, every unserved request a 429 with Retry-After, sheds answered within 50 ms
  p99 (gateway wall time), goodput in the overload windows >= 90% of the steady-state capacity at
  the SLO and higher than admission off;
- steady-state capacity at the SLO: the highest goodput among the steady cells that met the SLO;
- Retry-After honoured: >= 80% of retried requests admitted on their first retry;
- priorities at 2x overload: interactive TTFT p99 <= 1.2x its unloaded value, backend throughput
  (output tokens/s while the overload is offered) within 5% of admission off;
- fairness, 4 tenants, one sending 30x: each quiet tenant's TTFT p99 <= 1.2x its value alone;
  Jain's index over served tokens >= 0.95 (of the backlogged tenants, and normalised by demand).

All durations are simulated seconds (the runner rescales), except ``shed_s`` which is gateway wall
time (admission runs at wall speed whatever the simulator's time scale).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from usefulwork.loadtest.client import RequestResult
from usefulwork.loadtest.metrics import SLOSpec, is_good


def per_request(results: Sequence[RequestResult], slo: SLOSpec, time_scale: float) -> dict[str, list[Any]]:
    return {
        "group": [r.group for r in results],
        "status": [r.status for r in results],
        "good": [is_good(r, slo) for r in results],
        "retries": [r.retries for r in results],
        "first_retry": [r.first_retry for r in results],
        "first_retry_reason": [r.first_retry_reason for r in results],
        "retry_after_s": [r.retry_after_s for r in results],
        "shed_wall_s": [r.shed_s / time_scale for r in results],
        "shed_reason": [r.shed_reason for r in results],
        # (shed at once with x-should-retry: false for its declared deadline, not a spent budget)
        "told_not_to_retry": [r.final and r.retries == 0 and r.outcome == "shed" and r.shed_reason == "client_timeout"
                              for r in results],
        "wasted_chunks": [r.chunks if r.outcome != "ok" else 0 for r in results],
    }


def _p(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


def jain(xs: Sequence[float]) -> float | None:
    xs = [float(x) for x in xs]
    if not xs or not any(xs):
        return None
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def _cell(cells: list[dict[str, Any]], case: str, profile: str) -> dict[str, Any] | None:
    for c in cells:
        if c["case"] == case and c["profile"] == profile:
            return c["result"]
    return None


def _rows(r: dict[str, Any]) -> list[dict[str, Any]]:
    pr = r.get("per_request") or {}
    n = len(r.get("outcomes", []))
    keys = ("outcomes", "ttfts", "latencies", "start_times", "output_lens", "input_lens")
    out = []
    for i in range(n):
        row = {k: r[k][i] for k in keys}
        row.update({k: v[i] for k, v in pr.items()})
        out.append(row)
    return out


def _peak_windows(arrival: dict[str, Any] | None, duration: float) -> list[tuple[float, float]]:
    if not arrival or arrival.get("process") != "onoff":
        return [(0.0, duration)]
    period, on = arrival["period_s"], arrival["period_s"] * arrival["duty"]
    out, t = [], 0.0
    while t < duration:
        out.append((t, min(t + on, duration)))
        t += period
    return out


def burst_figures(r: dict[str, Any], slo: SLOSpec, arrival: dict[str, Any] | None) -> dict[str, Any]:
    rows = _rows(r)
    served = [x for x in rows if x["outcomes"] == "ok"]
    unserved = [x for x in rows if x["outcomes"] != "ok"]
    windows = _peak_windows(arrival, r["duration"])
    peak_s = sum(b - a for a, b in windows)
    in_peak = [x for x in rows if any(a <= x["start_times"] < b for a, b in windows)]
    sheds = [x["shed_wall_s"] for x in rows if x["status"] == 429 or x.get("retries")]
    return {
        "sent": len(rows),
        "served": len(served),
        "shed": sum(1 for x in rows if x["outcomes"] == "shed"),
        "timeouts": sum(1 for x in rows if x["outcomes"] in ("timeout", "client_cancelled")),
        "errors": sum(1 for x in rows if x["outcomes"] == "error"),
        "p95_e2e_served_s": _p([x["latencies"] for x in served], 95),
        "p95_ttft_served_s": _p([x["ttfts"] for x in served], 95),
        "attainment_served": (sum(x["good"] for x in served) / len(served)) if served else None,
        "attainment_all": sum(x["good"] for x in rows) / len(rows) if rows else None,
        "unserved_all_429_with_retry_after": all(x["status"] == 429 and x["retry_after_s"] > 0 for x in unserved),
        "unserved_not_429": sum(1 for x in unserved if x["status"] != 429),
        "shed_answer_p99_wall_ms": None if not sheds else _p(sheds, 99) * 1000.0,
        "goodput_per_s": sum(x["good"] for x in rows) / r["duration"] if r["duration"] else 0.0,  # whole run
        "goodput_in_peaks_per_s": sum(x["good"] for x in in_peak) / peak_s if peak_s else 0.0,
        "offered_in_peaks_per_s": len(in_peak) / peak_s if peak_s else 0.0,
        "shed_reasons": {k: sum(1 for x in rows if x["shed_reason"] == k) for k in
                         sorted({x["shed_reason"] for x in rows if x["shed_reason"]})},
    }


def _throughput(r: dict[str, Any]) -> float:
    """Output tokens/s the backend generated over the whole cell (its drain included): served answers
    plus the chunks of abandoned ones."""
    pr = r.get("per_request") or {}
    return (r["total_output_tokens"] + sum(pr.get("wasted_chunks", []))) / r["duration"] if r["duration"] else 0.0


def _throughput_until(r: dict[str, Any], end_s: float) -> float:
    """Output tokens/s the backend generated from the cell's start until ``end_s`` (its arrivals' end:
    the overload), served and abandoned answers alike, from each stream's chunk times (first token,
    then the gaps between chunks). After the arrivals stop, admission off's engine decodes the backlog
    it took in at once, hundreds of sequences a step and no prompt left to prefill; admission on still
    prefills the work it queued. Over the whole cell that drain decided the ratio (the engine on a virtual
    clock: 0.95-0.96 during the arrivals, 0.73-0.85 with the 15 s drain; docs/benchmarks.md section 7)."""
    if end_s <= 0:
        return 0.0
    tokens = 0.0
    for sent, ttft, itl, n in zip(r["start_times"], r["ttfts"], r["itls"], r["output_lens"]):
        if not ttft:
            continue
        per_chunk = n / (len(itl) + 1) if n else 1.0  # (an abandoned stream's usage never came: a chunk a token)
        t = sent + ttft
        k = 0
        if t <= end_s:
            k = 1
            for gap in itl:
                t += gap
                if t > end_s:
                    break
                k += 1
        tokens += k * per_chunk
    return tokens / end_s


def _ttft_p99_of(r: dict[str, Any], groups: Sequence[str]) -> tuple[float | None, int]:
    """The TTFT p99 of ``groups``' served requests and how many first tokens it is of."""
    ttfts = [x["ttfts"] for x in _rows(r) if x["outcomes"] == "ok" and x["group"] in groups]
    return _p(ttfts, 99), len(ttfts)


def verdicts(exp, cells: list[dict[str, Any]]) -> dict[str, Any]:
    spec = exp.compare["admission"]
    off, on = spec["profile_off"], spec["profile_on"]
    slo = exp.slo
    out: dict[str, Any] = {"definitions": __doc__.split("\n\n")[1].strip()}

    # steady-state capacity at the SLO (admission off: what the fleet itself can do)
    steady = []
    for case in spec.get("capacity_cases", []):
        r = _cell(cells, case, off)
        if r is not None:
            spec_c = exp.cases[case]
            # Per second of arrivals (as the burst's goodput below): the drain tail is not idle capacity.
            steady.append({"case": case, "rate": (spec_c.get("arrival") or {}).get("rate"),
                           "goodput_per_s": r["good"] / float(spec_c["duration_s"]),
                           "attainment": r["slo_pass_rate"], "met_slo": r["slo_pass_rate"] >= slo.attainment})
    passing = [s["goodput_per_s"] for s in steady if s["met_slo"]]
    capacity = max(passing) if passing else None
    out["capacity"] = {"cells": steady, "capacity_at_slo_per_s": capacity}

    case = spec.get("burst_case")
    burst = {}
    for prof in (off, on):
        r = _cell(cells, case, prof)
        if r is not None:
            arrival = next((c.get("arrival") for name, c in exp.cases.items() if name == case), None)
            burst[prof] = burst_figures(r, slo, arrival)
    out["burst"] = burst
    b_on, b_off = burst.get(on), burst.get(off)
    checks: dict[str, Any] = {}
    if b_on:
        checks["p95_e2e_served_within_slo"] = (b_on["p95_e2e_served_s"] or 0) <= slo.e2e_ms / 1000.0
        checks["attainment_served_ge_95"] = (b_on["attainment_served"] or 0) >= 0.95
        checks["zero_timeouts"] = b_on["timeouts"] == 0
        checks["every_unserved_429_with_retry_after"] = b_on["unserved_all_429_with_retry_after"]
        checks["sheds_p99_within_50ms"] = b_on["shed_answer_p99_wall_ms"] is not None and b_on["shed_answer_p99_wall_ms"] <= 50.0
        if capacity:
            b_on["goodput_in_peaks_vs_capacity"] = b_on["goodput_in_peaks_per_s"] / capacity
            checks["goodput_ge_90pct_capacity"] = b_on["goodput_in_peaks_vs_capacity"] >= 0.90
        if b_off:
            checks["goodput_higher_than_off"] = b_on["goodput_per_s"] > b_off["goodput_per_s"]

    r = _cell(cells, spec.get("retry_case"), on) if spec.get("retry_case") else None
    if r is not None:
        rows = _rows(r)
        retried = [x for x in rows if x["retries"] >= 1]
        admitted = sum(1 for x in retried if x["first_retry"] == "admitted")
        out["retry"] = {"retried": len(retried), "admitted_on_first_retry": admitted,
                        "fraction": admitted / len(retried) if retried else None,
                        # admitted on the first retry, then past the client's timeout (from the first send)
                        "admitted_then_timed_out": sum(1 for x in retried if x["first_retry"] == "admitted"
                                                       and x["outcomes"] == "timeout"),
                        # shed on the first retry because its client's declared deadline (the time it had left)
                        # could not be met: no admission could have answered it in time
                        "shed_for_client_timeout": (timed := sum(1 for x in retried
                                                                  if x.get("first_retry_reason") == "client_timeout")),
                        # the share of the first retries that could still be answered in time that were admitted
                        "fraction_answerable": admitted / (len(retried) - timed) if len(retried) > timed else None,
                        "good_of_retried": sum(1 for x in retried if x["good"]),
                        # shed on the first attempt with x-should-retry: false (no retry could end within the
                        # deadline its client declared for all attempts): not retried, so not counted above
                        "told_not_to_retry": sum(1 for x in rows if x.get("told_not_to_retry")),
                        "final": {o: sum(1 for x in rows if x["outcomes"] == o) for o in ("ok", "shed", "timeout", "error")}}
        checks["retry_first_ge_80pct"] = bool(retried) and admitted / len(retried) >= 0.80

    pri = spec.get("priority")
    if pri:
        loaded, base = _cell(cells, pri["case"], on), _cell(cells, pri["unloaded_case"], on)
        loaded_off = _cell(cells, pri["case"], off)
        if loaded and base:
            (p_loaded, n_loaded), (p_base, n_base) = (_ttft_p99_of(loaded, [pri["interactive"]]),
                                                      _ttft_p99_of(base, [pri["interactive"]]))
            out["priority"] = {"interactive_ttft_p99_s": p_loaded, "unloaded_ttft_p99_s": p_base,
                               "ratio": p_loaded / p_base if p_loaded and p_base else None,
                               "interactive_ttft_p99_off_s": _ttft_p99_of(loaded_off, [pri["interactive"]])[0] if loaded_off else None,
                               # (how many first tokens each p99 is of: with a few dozen, it is nearly the slowest)
                               "requests": n_loaded, "unloaded_requests": n_base}
            checks["interactive_ttft_p99_le_1_2x"] = bool(out["priority"]["ratio"]) and out["priority"]["ratio"] <= 1.2
            if loaded_off:
                # "at 2x overload": the backend's output while the overload is offered (the arrivals), and
                # over the whole cell beside it
                end = float(exp.cases[pri["case"]]["duration_s"])
                t_on, t_off = _throughput_until(loaded, end), _throughput_until(loaded_off, end)
                w_on, w_off = _throughput(loaded), _throughput(loaded_off)
                out["priority"].update({"backend_tokens_per_s_on": t_on, "backend_tokens_per_s_off": t_off,
                                        "throughput_ratio": t_on / t_off if t_off else None,
                                        "throughput_window_s": end,
                                        "backend_tokens_per_s_on_with_drain": w_on, "backend_tokens_per_s_off_with_drain": w_off,
                                        "throughput_ratio_with_drain": w_on / w_off if w_off else None})
                checks["throughput_within_5pct"] = bool(t_off) and t_on >= 0.95 * t_off

    fair = spec.get("fairness")
    if fair:
        loaded, alone = _cell(cells, fair["case"], on), _cell(cells, fair["alone_case"], on)
        loaded_off = _cell(cells, fair["case"], off)
        if loaded and alone:
            quiet = {}
            for q in fair["quiet"]:
                (p_loaded, n_loaded), (p_alone, n_alone) = _ttft_p99_of(loaded, [q]), _ttft_p99_of(alone, [q])
                quiet[q] = {"ttft_p99_s": p_loaded, "alone_ttft_p99_s": p_alone,
                            "off_ttft_p99_s": _ttft_p99_of(loaded_off, [q])[0] if loaded_off else None,
                            "requests": n_loaded, "alone_requests": n_alone}
            for v in quiet.values():
                v["ratio"] = v["ttft_p99_s"] / v["alone_ttft_p99_s"] if v["ttft_p99_s"] and v["alone_ttft_p99_s"] else None
            rows = _rows(loaded)
            tenants = [fair["heavy"], *fair["quiet"]]
            served = {t: sum(x["input_lens"] + x["output_lens"] for x in rows if x["group"] == t and x["outcomes"] == "ok")
                      for t in tenants}
            demand = {t: sum(x["input_lens"] + x["output_lens"] for x in rows if x["group"] == t) for t in tenants}
            backlogged = [t for t in tenants if any(x["group"] == t and x["outcomes"] == "shed" for x in rows)]
            total = sum(served.values())
            # Max-min fair share of what was served, given each tenant's demand (water-filling).
            share, left, need = {}, float(total), dict(demand)
            while need:
                each = left / len(need)
                small = {t: d for t, d in need.items() if d <= each}
                if not small:
                    share.update({t: each for t in need})
                    break
                for t, d in small.items():
                    share[t] = d
                    left -= d
                    del need[t]
            out["fairness"] = {
                "quiet": quiet, "served_tokens": served, "demand_tokens": demand, "backlogged": backlogged,
                "jain_backlogged": jain([served[t] for t in backlogged]) if len(backlogged) > 1 else None,
                "jain_vs_max_min_share": jain([served[t] / share[t] for t in tenants if share.get(t)]),
            }
            checks["quiet_ttft_p99_le_1_2x"] = all(v["ratio"] is not None and v["ratio"] <= 1.2 for v in quiet.values())
            jb = out["fairness"]["jain_backlogged"]
            checks["jain_ge_0_95"] = (jb if jb is not None else out["fairness"]["jain_vs_max_min_share"] or 0) >= 0.95
    out["checks"] = checks
    return out
