"""Offline HTML report of a paired comparison (one file, plots as PNG; loadtest's report helpers)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from usefulwork.loadtest.paired import AGREEMENT, SIDE_FIGURES
from usefulwork.loadtest.report import CSS, _fmt, _table, plot_cdfs, write_page


def _figure_rows(block: dict[str, Any]) -> list[list[str]]:
    rows = []
    for k in (*SIDE_FIGURES, *AGREEMENT):
        e = block.get(k)
        if not e:
            continue
        lo, hi = e["ci95"]
        ci = "-" if lo is None else f"[{lo:+.4g}, {hi:+.4g}]"
        real = '<span class="miss">real</span>' if e["real"] else '<span class="pass">within noise</span>'
        if e.get("judged") is False:
            real = f'too few requests (needs {e["min_requests"]})'
        rows.append([html.escape(k), _fmt(e["baseline"]), _fmt(e["candidate"]),
                     "-" if e["diff"] is None else f"{e['diff']:+.4g}",
                     "-" if e["diff_pct"] is None else f"{e['diff_pct']:+.1f}%", ci, _fmt(e["noise_floor"]), real])
    return rows


HEAD = ["figure", "baseline", "candidate", "difference", "relative", "95% CI", "noise floor", "verdict"]


def render_html(data: dict[str, Any]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    cmp = data["comparison"]
    title = "usefulwork replay: paired comparison"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{CSS}</style>"
             f"</head><body><h1>{title}</h1>",
             _table(["", ""], [[html.escape(k), html.escape(str(v))] for k, v in data.get("meta", {}).items()]),
             f"<p><b>{html.escape(cmp['verdict'])}</b></p>", "<h2>Total</h2>",
             _table(HEAD, _figure_rows(cmp["total"]))]
    for group in ("by_tenant", "by_route"):
        for name, block in cmp[group].items():
            parts.append(f"<h3>{group.replace('by_', '')}: {html.escape(name)} ({block['requests']} requests)</h3>")
            parts.append(_table(HEAD, _figure_rows(block)))
    runs = [("baseline", data["baseline"]), ("candidate", data["candidate"])]
    parts.append(f"<h2>Latency</h2><img alt='latency CDFs' src='data:image/png;base64,{plot_cdfs(runs)}'>")
    parts.append("<p>Differences are candidate - baseline over the same requests; 95% intervals from a paired "
                 "bootstrap; the noise floor is the largest difference a baseline-vs-baseline pass admits; a "
                 "latency quantile is judged only over enough successful requests per side. "
                 "Agreement rows: baseline = baseline-vs-baseline agreement, candidate = candidate-vs-baseline.</p>")
    parts.append("</body></html>")
    return "".join(parts)


def write_html(data: dict[str, Any], path: str | Path) -> Path:
    return write_page(render_html(data), path)
