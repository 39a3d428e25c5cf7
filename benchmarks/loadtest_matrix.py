"""Benchmark: the cost-per-useful-work matrix, real (local vLLM on CPU) and simulated (A100-80G).

Runs the built-in experiments through `usefulwork loadtest`'s own code path (backends started and
stopped per profile, a gateway in front) and writes the figures as a markdown fragment::

    python benchmarks/loadtest_matrix.py                       # both: cost (real CPU) and cost-a100 (sim)
    python benchmarks/loadtest_matrix.py --only cost           # the real matrix only
    python benchmarks/loadtest_matrix.py --from-results cost=DIR cost-a100=DIR   # re-render the markdown

Results (results.json, report.html) go to loadtest-results/<experiment>/; the fragment to
docs/bench/loadtest.md. Every figure in the fragment comes from those results files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from usefulwork.loadtest.experiment import Options, load_experiment, run_experiment  # noqa: E402

SEED_STEADY_RATIO = 0.137976 / 0.019752  # the seed card's steady naive / optimized $ per 1K (6.99x)
SEED_ROWS = [
    ("steady-cost-efficiency", "naive-single", "413 / 2227", "60.31s", "$0.137976", "miss"),
    ("steady-cost-efficiency", "optimized-batched", "2670 / 0", "1.61s", "$0.019752", "pass"),
    ("burst-cost-efficiency", "naive-single", "227 / 2882", "120.00s", "$0.164137", "miss"),
    ("burst-cost-efficiency", "optimized-batched", "2570 / 677", "10.91s", "$0.012768", "miss"),
]


def _money(x: float | None) -> str:
    return "-" if x is None else f"${x:.6f}"


def matrix_md(data: dict) -> list[str]:
    lines = ["| shape | case | profile | successful / dropped | p95 latency | p95 TTFT | $ / 1K successful | "
             "$ / 1K good | $ / 1M tokens | SLO (pass rate) | gateway $ / 1K (diff) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in data["cells"]:
        r = c["result"]
        gw = (r.get("gateway") or {}).get("compare", {}).get("usd_per_1k_successful")
        gw_txt = "-"
        if gw and gw["diff_pct"] is not None:
            gw_txt = f"{_money(gw['gateway'])} ({gw['diff_pct']:+.2f}%)"
        lines.append(
            f"| {c['shape']} | {c['case']} | {c['profile']} | {r['completed']} / {r['dropped']} | "
            f"{r['p95_e2el_ms'] / 1000:.2f}s | {r['p95_ttft_ms'] / 1000:.2f}s | {_money(r['usd_per_1k_successful'])} | "
            f"{_money(r['usd_per_1k_good'])} | {_money(r['usd_per_1m_generated_tokens'])} | "
            f"{'pass' if r['slo_passed'] else 'miss'} ({r['slo_pass_rate']:.0%}) | {gw_txt} |")
    return lines


def ratios_md(data: dict, seed: bool = False) -> list[str]:
    lines = ["| shape | case | naive $ / 1K | optimized $ / 1K | optimized is cheaper by | target |",
             "|---|---|---|---|---|---|"]
    for q in data.get("ratios", []):
        target = "-" if q.get("target") is None else f">= {q['target']}x " + (
            "(met)" if q["ratio"] and q["ratio"] >= q["target"] else "(NOT met)")
        if seed and q["case"] == "steady-cost-efficiency":
            target = f"seed: {SEED_STEADY_RATIO:.2f}x"
        ratio = "-" if q["ratio"] is None else f"{q['ratio']:.2f}x"
        lines.append(f"| {q['shape']} | {q['case']} | {_money(q['naive'])} | {_money(q['optimized'])} | "
                     f"{ratio} | {target} |")
    return lines


def detail_md(data: dict) -> list[str]:
    lines = ["| cell | sent | outcomes | req/s | output tok/s | p50 / p95 TTFT | mean TPOT | max in flight | "
             "max schedule lag | wasted tokens | gateway ok / requests | window (ours / gateway) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in data["cells"]:
        r = c["result"]
        oc = ", ".join(f"{k} {v}" for k, v in r["outcome_counts"].items() if v)
        g = (r.get("gateway") or {}).get("figures") or {}
        w = (r.get("gateway") or {}).get("compare", {}).get("window_s") or {}
        lines.append(
            f"| {c['shape']} {c['case']} / {c['profile']} | {r['num_prompts']} | {oc} | {r['request_throughput']:.3f} | "
            f"{r['output_throughput']:.1f} | {r['median_ttft_ms'] / 1000:.2f}s / {r['p95_ttft_ms'] / 1000:.2f}s | "
            f"{r['mean_tpot_ms']:.1f} ms | {r['max_concurrent_requests']} | {r['max_schedule_lag_ms']:.0f} ms | "
            f"{r.get('wasted_output_tokens', '-')} | "
            f"{g.get('ok', '-')} / {g.get('requests', '-')} | "
            f"{w.get('loadtest', 0):.1f}s / {w.get('gateway') or 0:.1f}s |")
    return lines


def waste_note(data: dict) -> list[str]:
    """How much of the naive profile's capacity went to requests that timed out mid-answer.

    The naive server's closed-loop capacity comes from the simulator's own engine on its virtual
    clock (usefulwork.backends.sim.offline.closed_loop, one client, no HTTP): what it serves when
    nothing is abandoned. Comparing it with the useful throughput measured under load shows the
    waste, and the ratio the matrix would show without it.
    """
    from usefulwork.backends.sim.catalog import build_spec
    from usefulwork.backends.sim.offline import closed_loop

    b = data["experiment"]["backend"]
    raw = data["experiment"]["raw"]
    base = raw.get("compare", {}).get("baseline", "naive-single")
    cand = raw.get("compare", {}).get("candidate", "optimized-batched")
    prof = raw["profiles"][base].get("sim_profile", base)
    lines = []
    for shape in raw.get("shapes", []):
        spec = build_spec(gpu=b.get("gpu_name", "A100-80G"), model=b.get("model", "Llama-3.1-8B"),
                          precision=b.get("precision", "bf16"), tp=int(b.get("tp", 1)), profile=prof)
        lr = closed_loop(spec, concurrency=1, n_requests=20, prompt_len=shape["prompt_tokens"],
                         output_len=shape["output_tokens"])
        cap = len(lr.requests) / lr.duration
        by = {(c["case"], c["profile"]): c["result"] for c in data["cells"] if c["shape"] == shape["name"]}
        n = by.get(("steady-cost-efficiency", base))
        o = by.get(("steady-cost-efficiency", cand))
        if not n or not o or not o["completed"]:
            continue
        useful = n["request_throughput"]
        ratio_no_waste = (1 / cap) / (o["duration"] / o["completed"])
        lines.append(
            f"- {shape['name']}, steady: the naive server's closed-loop capacity (one client, simulated engine, "
            f"`usefulwork.backends.sim.offline.closed_loop`) is {cap:.2f} req/s; under the steady load it delivered "
            f"{useful:.2f} req/s of successful requests: {1 - useful / cap:.0%} of its capacity went to answers "
            f"abandoned mid-way (no admission control: the request at the head of the FIFO queue has usually "
            f"waited most of the client timeout before it starts). Had naive wasted nothing, optimized would be "
            f"{ratio_no_waste:.2f}x cheaper per 1K successful (the seed reports {SEED_STEADY_RATIO:.2f}x); "
            f"with the waste, the matrix shows the ratio above.")
    return lines


def section(name: str, data: dict, results_dir: Path) -> list[str]:
    m = data["meta"]
    t = data.get("timings", {})
    total = data.get("total_wall_s", 0.0)
    own = data.get("total_wall_without_lock_waits_s", total)
    out = [f"## `usefulwork loadtest --experiment {name}`", "",
           f"- Date: {m['date']}; command: `python benchmarks/loadtest_matrix.py --only {name}` "
           f"(same code path as `usefulwork loadtest --experiment {name} --cpu-lock /tmp/usefulwork-cpu.lock`).",
           f"- Serving: {m['serving hardware']}; model: {m['model']}; price: {m['price']}.",
           "- Load generator and gateway: the same 2-core x86-64 VM (24 GiB, no GPU).",
           f"- SLO: {data['experiment']['slo']}.",
           f"- Whole matrix: {own:.0f}s of its own (backend starts and stops included)"
           + (f", plus {total - own:.0f}s waiting for the shared CPU lock" if total - own > 1 else "") + "; per profile: "
           + "; ".join(f"{p}: backend+gateway ready in {v.get('start_s') or 0:.0f}s, profile total {v['total_s']:.0f}s"
                       for p, v in t.items()) + ".",
           f"- Raw results: `{results_dir}/results.json`, report `{results_dir}/report.html` (not committed).", "",
           "### Matrix", ""]
    out += matrix_md(data)
    out += ["", "### Optimized vs naive", ""]
    out += ratios_md(data, seed=data["experiment"]["backend"]["kind"] == "sim")
    if data["experiment"]["backend"]["kind"] == "sim":
        out += ["", *waste_note(data)]
    out += ["", "### Details (successful requests for latency figures)", ""]
    out += detail_md(data)
    out.append("")
    return out


def write_fragment(sections: dict[str, tuple[dict, Path]], path: Path) -> None:
    lines = ["# Benchmarks: loadtest (cost per useful work)", "",
             "Written by `benchmarks/loadtest_matrix.py` from the runs' results files; do not edit by hand.",
             "Cost = fleet $/hour x the run's window (run start to last answer). $ / 1K successful divides by "
             "ok requests, $ / 1K good by requests meeting the SLO. \"dropped\" = every request that did not "
             "end ok (timeout, error, shed, cancelled). Latency percentiles: linear interpolation over successful "
             "requests. The gateway column is the gateway's own ledger (GET /usefulwork/stats) over the same window.",
             ""]
    if "cost-a100" in sections:
        lines += ["### The seed's card (for comparison)", "",
                  "| case | profile | successful / dropped | p95 latency | $ / 1K successful | SLO |", "|---|---|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} | {e} | {f} |" for a, b, c, d, e, f in SEED_ROWS]
        lines += ["", f"Seed steady ratio: {SEED_STEADY_RATIO:.2f}x.", ""]
    for name, (data, d) in sections.items():
        lines += section(name, data, d)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", choices=["cost", "cost-a100"])
    ap.add_argument("--from-results", nargs="*", default=None, help="NAME=DIR pairs: only re-render the markdown")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "loadtest.md")
    ap.add_argument("--cpu-lock", default="/tmp/usefulwork-cpu.lock")
    args = ap.parse_args()
    sections: dict[str, tuple[dict, Path]] = {}
    if args.from_results is not None:
        for pair in args.from_results:
            name, d = pair.split("=", 1)
            sections[name] = (json.loads((Path(d) / "results.json").read_text()), Path(d))
    else:
        console = Console(stderr=True)
        for name in args.only or ["cost", "cost-a100"]:
            out_dir = ROOT / "loadtest-results" / name
            data = run_experiment(load_experiment(name), Options(out_dir=out_dir, cpu_lock=args.cpu_lock), console)
            from usefulwork.loadtest import report

            report.write_html(data, out_dir / "report.html")
            sections[name] = (data, out_dir.relative_to(ROOT))
    write_fragment(sections, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
