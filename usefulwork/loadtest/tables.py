"""Final tables on the terminal: one run's figures, and the experiment matrix like the seed's card."""

from __future__ import annotations

from typing import Any, Sequence

from rich.console import Console
from rich.table import Table


def money(x: float | None, digits: int = 6) -> str:
    return "-" if x is None else f"${x:.{digits}f}"


def secs(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000.0:.2f}s"


LATE_S = 0.1  # a send this long after its planned time is reported under the run's table


def late_sends(r: dict[str, Any]) -> list[float]:
    """Schedule lags (s) of the sends over ``LATE_S`` late."""
    return [s - p for p, s in zip(r.get("planned_times") or [], r.get("start_times") or []) if s - p > LATE_S]


def late_warning(r: dict[str, Any]) -> str | None:
    """What to say when the generator sent late: the load offered was less than planned, and why if known."""
    late = late_sends(r)
    if not late:
        return None
    msg = (f"{len(late)} of {r['num_prompts']} requests were sent over {LATE_S * 1000:.0f} ms after their planned "
           f"time (up to {max(late) * 1000:.0f} ms): the load offered was less than planned.")
    g = r.get("generator") or {}
    if g.get("max_stall_ms") is not None:
        msg += f" The generator's loop stalled for up to {g['max_stall_ms']:.0f} ms"
        if g.get("max_stall_on_cpu_ms") is not None:
            msg += (f" ({g['max_stall_on_cpu_ms']:.0f} ms of that interval on a CPU, "
                    f"{g['max_stall_runqueue_ms']:.0f} ms waiting for one; {g['runqueue_ms']:.0f} ms waiting in all)")
        msg += "."
    if g.get("runqueue_ms") and g["runqueue_ms"] >= LATE_S * 1000:
        msg += " The machine running the load is short of CPU: give the generator a core of its own."
    return msg


def print_run(r: dict[str, Any], console: Console) -> None:
    t = Table(title=f"loadtest {r.get('label') or ''}".strip(), show_header=False)
    t.add_column("figure")
    t.add_column("value", justify="right")
    o = r["outcome_counts"]
    rows = [
        ("requests sent", str(r["num_prompts"])),
        ("successful / dropped", f"{r['completed']} / {r['dropped']}"),
        ("outcomes", ", ".join(f"{k} {v}" for k, v in o.items() if v)),
        ("duration", f"{r['duration']:.1f}s"),
        ("request throughput", f"{r['request_throughput']:.3f} req/s"),
        ("output throughput", f"{r['output_throughput']:.1f} tok/s"),
        ("TTFT p50 / p95 / p99", f"{secs(r['median_ttft_ms'])} / {secs(r['p95_ttft_ms'])} / {secs(r['p99_ttft_ms'])}"),
        ("TPOT mean / p95", f"{r['mean_tpot_ms']:.1f} / {r['p95_tpot_ms']:.1f} ms"),
        ("ITL mean / p99", f"{r['mean_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} ms"),
        ("E2E p50 / p95 / p99", f"{secs(r['median_e2el_ms'])} / {secs(r['p95_e2el_ms'])} / {secs(r['p99_e2el_ms'])}"),
        ("good (meet SLO) / pass rate", f"{r['good']} / {r['slo_pass_rate']:.1%}"),
        ("SLO", ("[green]pass" if r["slo_passed"] else "[red]miss")
         + f" (ttft<={r['slo']['ttft_ms']:g}ms tpot<={r['slo']['tpot_ms']:g}ms e2e<={r['slo']['e2e_ms']:g}ms "
           f"for >={r['slo']['attainment']:.0%})"),
        ("fleet $/hour, run cost", f"{r['fleet_usd_per_hour']:g}, {money(r['cost_usd'])}"),
        ("$ per 1K successful / good", f"{money(r['usd_per_1k_successful'])} / {money(r['usd_per_1k_good'])}"),
        ("$ per 1M generated tokens", money(r["usd_per_1m_generated_tokens"], 4)),
        ("schedule lag mean / p99 / max", f"{r['mean_schedule_lag_ms']:.1f} / {r['p99_schedule_lag_ms']:.1f} / "
                                          f"{r['max_schedule_lag_ms']:.1f} ms"),
    ]
    g = r.get("generator") or {}
    if g.get("max_stall_ms") is not None:
        where = "" if g.get("max_stall_on_cpu_ms") is None else \
            f" ({g['max_stall_on_cpu_ms']:.0f} on a CPU, {g['max_stall_runqueue_ms']:.0f} waiting for one)"
        rows.append(("generator loop: longest stall", f"{g['max_stall_ms']:.1f} ms{where}"))
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    if warning := late_warning(r):
        console.print(f"[yellow]{warning}", highlight=False)
    gw = r.get("gateway")
    if gw:
        print_gateway_compare(gw, console)


def print_gateway_compare(gw: dict[str, Any], console: Console, title: str = "loadtest vs gateway ledger") -> None:
    if "error" in gw:
        console.print(f"[yellow]gateway ledger: {gw['error']}")
        return
    t = Table(title=title)
    for c in ("figure", "loadtest", "gateway", "difference"):
        t.add_column(c, justify="right")
    for k, v in gw["compare"].items():
        fmt = (lambda x: money(x)) if "usd" in k else (lambda x: "-" if x is None else f"{x:.6g}")
        d = v["diff_pct"]
        t.add_row(k, fmt(v["loadtest"]), fmt(v["gateway"]), "-" if d is None else f"{d:+.2f}%")
    console.print(t)


def print_matrix(cells: Sequence[dict[str, Any]], console: Console, title: str) -> None:
    """One row per cell: successful / dropped, p95 latency, $ per 1K successful, SLO pass or miss."""
    t = Table(title=title)
    for c in ("shape", "case", "profile", "successful / dropped", "p95 latency", "$ / 1K successful",
              "$ / 1K good", "$ / 1M tokens", "SLO", "gateway $ / 1K (diff)"):
        t.add_column(c, justify="right" if c not in ("case", "profile", "shape") else "left")
    for cell in cells:
        r = cell["result"]
        gw = (r.get("gateway") or {}).get("compare", {}).get("usd_per_1k_successful")
        gw_txt = "-"
        if gw:
            diff = "-" if gw["diff_pct"] is None else f"{gw['diff_pct']:+.1f}%"
            gw_txt = f"{money(gw['gateway'])} ({diff})"
        t.add_row(cell["shape"], cell["case"], cell["profile"], f"{r['completed']} / {r['dropped']}",
                  secs(r["p95_e2el_ms"]), money(r["usd_per_1k_successful"]), money(r["usd_per_1k_good"]),
                  money(r["usd_per_1m_generated_tokens"], 4),
                  "[green]pass" if r["slo_passed"] else "[red]miss", gw_txt)
    console.print(t)


def print_ratios(ratios: Sequence[dict[str, Any]], console: Console) -> None:
    if not ratios:
        return
    t = Table(title="optimized vs naive: cost per 1K successful")
    for c in ("shape", "case", "naive $/1K", "optimized $/1K", "ratio", "target"):
        t.add_column(c, justify="right")
    for q in ratios:
        ratio = "-" if q["ratio"] is None else f"{q['ratio']:.2f}x"
        target = "-" if q.get("target") is None else (
            ("[green]" if q["ratio"] is not None and q["ratio"] >= q["target"] else "[red]") + f">= {q['target']:g}x")
        t.add_row(q["shape"], q["case"], money(q["naive"]), money(q["optimized"]), ratio, target)
    console.print(t)
