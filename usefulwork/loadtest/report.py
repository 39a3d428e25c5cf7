"""Offline HTML report: one self-contained file (plots embedded as PNG, no scripts, no CDN).

Plots (matplotlib, Agg backend): latency CDFs (E2E and TTFT of successful requests), throughput
and requests in flight over time per run, and the cost matrix ($ per 1K successful per cell,
coloured by SLO pass or miss).

Input: an experiment's results (``{"experiment": ..., "cells": [...]}``) or single runs
(``{"runs": [...]}``), exactly as written to results.json.
"""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path
from typing import Any

import numpy as np


def _runs(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    if "cells" in data:
        return [(f"{c['shape']} {c['case']} / {c['profile']}", c["result"]) for c in data["cells"]]
    runs = data.get("runs") or ([data] if "completed" in data else [])
    return [(r.get("label") or f"run {i + 1}", r) for i, r in enumerate(runs)]


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _ok(r: dict[str, Any], key: str) -> list[float]:
    return [v for v, o in zip(r.get(key, []), r.get("outcomes", [])) if o == "ok"]


def plot_cdfs(runs: list[tuple[str, dict[str, Any]]]) -> str:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for label, r in runs:
        for ax, key in zip(axes, ("latencies", "ttfts")):
            vals = np.sort(np.asarray(_ok(r, key)))
            if len(vals):
                ax.step(vals, np.arange(1, len(vals) + 1) / len(vals), where="post", label=label)
    for ax, name in zip(axes, ("end-to-end latency (s)", "time to first token (s)")):
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of successful requests")
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 1.02)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle("Latency CDFs (successful requests)")
    return _png(fig)


def plot_timelines(runs: list[tuple[str, dict[str, Any]]]) -> str:
    import matplotlib.pyplot as plt

    n = len(runs)
    cols = 2 if n > 1 else 1
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.0 * rows), squeeze=False)
    for ax, (label, r) in zip(axes.flat, runs):
        tl = r.get("timeline") or {}
        t = tl.get("t", [])
        # Only successful requests' tokens: work that timed out mid-answer is waste, not throughput.
        ax.plot(t, tl.get("output_tokens_per_s", []), color="tab:blue", lw=1, label="useful output tok/s")
        ax.set_ylabel("useful output tok/s", color="tab:blue")
        ax2 = ax.twinx()
        ax2.plot(t, tl.get("in_flight", []), color="tab:red", lw=1, label="requests in flight")
        ax2.set_ylabel("requests in flight", color="tab:red")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("seconds since start")
        ax.grid(alpha=0.3)
        if ax is axes.flat[0]:
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle("Throughput and requests in flight over time")
    fig.tight_layout()
    return _png(fig)


def plot_cost_matrix(runs: list[tuple[str, dict[str, Any]]]) -> str:
    import matplotlib.pyplot as plt

    labels = [lab for lab, _ in runs]
    vals = [r.get("usd_per_1k_successful") or 0.0 for _, r in runs]
    colors = ["tab:green" if r.get("slo_passed") else "tab:red" for _, r in runs]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(runs)), 4.2))
    bars = ax.bar(range(len(runs)), vals, color=colors)
    for b, (_, r) in zip(bars, runs):
        v = r.get("usd_per_1k_successful")
        ax.annotate("no success" if v is None else f"${v:.4g}\n{r['completed']}/{r['dropped']}",
                    (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(runs)), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("$ per 1K successful requests")
    pos = [v for v in vals if v > 0]
    if pos and max(pos) / min(pos) > 20:  # naive vs optimized can differ by orders of magnitude
        ax.set_yscale("log")
    ax.set_title("Cost per useful work (green: SLO pass, red: SLO miss; label: successful/dropped)")
    ax.grid(alpha=0.3, axis="y")
    return _png(fig)


def _fmt(x: Any, kind: str = "") -> str:
    if x is None:
        return "-"
    if kind == "usd":
        return f"${x:.6f}"
    if kind == "s":
        return f"{x / 1000.0:.2f}s"
    if isinstance(x, float):
        return f"{x:.4g}"
    return html.escape(str(x))


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _matrix_rows(runs: list[tuple[str, dict[str, Any]]]) -> list[list[str]]:
    rows = []
    for label, r in runs:
        slo = '<span class="pass">pass</span>' if r.get("slo_passed") else '<span class="miss">miss</span>'
        gw = (r.get("gateway") or {}).get("compare", {}).get("usd_per_1k_successful")
        gw_txt = "-" if not gw else f"{_fmt(gw['gateway'], 'usd')} ({'-' if gw['diff_pct'] is None else format(gw['diff_pct'], '+.2f') + '%'})"
        rows.append([html.escape(label), f"{r['completed']} / {r['dropped']}", _fmt(r.get("p95_e2el_ms"), "s"),
                     _fmt(r.get("p95_ttft_ms"), "s"), f"{r.get('mean_tpot_ms', 0):.1f} ms",
                     _fmt(r.get("usd_per_1k_successful"), "usd"), _fmt(r.get("usd_per_1k_good"), "usd"),
                     _fmt(r.get("usd_per_1m_generated_tokens"), "usd"), f"{r.get('slo_pass_rate', 0):.1%}", slo,
                     f"{r.get('max_schedule_lag_ms', 0):.0f} ms", gw_txt])
    return rows


CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1300px}
table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3}td:first-child{text-align:left}.pass{color:#1a7f37;font-weight:bold}.miss{color:#c62828;font-weight:bold}
img{max-width:100%;border:1px solid #eee;margin:0.5em 0}code{background:#f5f5f5;padding:1px 4px}"""


def render_html(data: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    runs = _runs(data)
    exp = data.get("experiment") or {}
    title = f"usefulwork loadtest: {exp.get('name', 'runs')}"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>"]
    meta = data.get("meta") or {}
    if exp.get("description"):
        parts.append(f"<p>{html.escape(exp['description'])}</p>")
    if meta:
        parts.append(_table(["", ""], [[html.escape(k), html.escape(str(v))] for k, v in meta.items()]))
    parts.append("<h2>Cost per useful work</h2>")
    parts.append(_table(["run", "successful / dropped", "p95 latency", "p95 TTFT", "mean TPOT", "$ / 1K successful",
                         "$ / 1K good", "$ / 1M tokens", "SLO pass rate", "SLO", "max schedule lag",
                         "gateway $ / 1K (diff)"], _matrix_rows(runs)))
    if data.get("ratios"):
        parts.append("<h3>Optimized vs naive</h3>")
        parts.append(_table(["shape", "case", "naive $/1K", "optimized $/1K", "ratio", "target"], [
            [html.escape(q["shape"]), html.escape(q["case"]), _fmt(q["naive"], "usd"), _fmt(q["optimized"], "usd"),
             "-" if q["ratio"] is None else f"{q['ratio']:.2f}x", "-" if q.get("target") is None else f">= {q['target']}x"]
            for q in data["ratios"]]))
    if runs:
        parts.append(f"<img alt='cost matrix' src='data:image/png;base64,{plot_cost_matrix(runs)}'>")
        parts.append("<h2>Latency</h2>")
        parts.append(f"<img alt='latency CDFs' src='data:image/png;base64,{plot_cdfs(runs)}'>")
        parts.append("<h2>Throughput and in flight over time</h2>")
        parts.append(f"<img alt='timelines' src='data:image/png;base64,{plot_timelines(runs)}'>")
    gws = [(label, r["gateway"]) for label, r in runs if r.get("gateway") and "compare" in r["gateway"]]
    if gws:
        parts.append("<h2>Load generator vs gateway ledger (same window)</h2>")
        for label, gw in gws:
            rows = [[html.escape(k), _fmt(v["loadtest"], "usd" if "usd" in k else ""),
                     _fmt(v["gateway"], "usd" if "usd" in k else ""),
                     "-" if v["diff_pct"] is None else f"{v['diff_pct']:+.2f}%"] for k, v in gw["compare"].items()]
            parts.append(f"<h3>{html.escape(label)}</h3>" + _table(["figure", "loadtest", "gateway", "difference"], rows))
    parts.append("<h2>Run settings</h2>")
    rows = []
    for label, r in runs:
        rows.append([html.escape(label), html.escape(str(r.get("workload"))), html.escape(str(r.get("load"))),
                     html.escape(str(r.get("outcome_counts")))])
    parts.append(_table(["run", "workload", "load", "outcomes"], rows))
    parts.append("<p>Costs cover the serving fleet's GPU (or CPU) time only: fleet $/hour x the run's window "
                 "(run start to last answer). Percentiles: linear interpolation over successful requests.</p>")
    parts.append("</body></html>")
    return "".join(parts)


def write_page(page: str, path: str | Path) -> Path:
    """Write a rendered report page, creating its folder."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(page)
    return p


def write_html(data: dict[str, Any], path: str | Path) -> Path:
    return write_page(render_html(data), path)
