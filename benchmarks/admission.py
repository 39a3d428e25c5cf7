"""Benchmark: admission control off vs on (issue 10's targets), from one run of the experiment.

    python benchmarks/admission.py                      # runs `usefulwork loadtest --experiment admission`
    python benchmarks/admission.py --from-results DIR   # re-render the markdown from DIR/results.json

Prints the markdown fragment for docs/benchmarks.md; every figure comes from results.json (the
verdicts are computed by usefulwork/loadtest/admission.py during the run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from usefulwork.loadtest.admission import verdicts  # noqa: E402
from usefulwork.loadtest.experiment import Options, load_experiment, run_experiment  # noqa: E402


def _f(v, nd=2, unit=""):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return f"{v:.{nd}f}{unit}"


def markdown(data: dict) -> str:
    exp = load_experiment(data["experiment"]["source"])
    a = verdicts(exp, data["cells"])  # recomputed from the stored cells (same code as the run)
    m = data["meta"]
    off, on = exp.compare["admission"]["profile_off"], exp.compare["admission"]["profile_on"]
    out = [f"- Date: {m['date']}; command: `{m['command'] or 'usefulwork loadtest --experiment admission'}`.",
           f"- Serving: {m['serving hardware']}; model: {m['model']}; {m.get('time scale', '')}.",
           "- Load generator, gateway and simulator: the same 2-core VM, shared with other sessions' work while "
           "this ran (its load average is given beside the run): wall-clock figures are noisy.",
           f"- SLO: TTFT {exp.slo.ttft_ms:.0f} ms, TPOT {exp.slo.tpot_ms:.0f} ms, E2E {exp.slo.e2e_ms:.0f} ms, "
           f"attainment {exp.slo.attainment:.0%}.", ""]
    cap = a["capacity"]
    out += ["Steady-state capacity at the SLO (admission off, Poisson, goodput per second of arrivals):", "",
            "| rate (req/s) | goodput (req/s) | SLO attainment | meets SLO |", "|---|---|---|---|"]
    out += [f"| {c['rate']} | {_f(c['goodput_per_s'])} | {_f(c['attainment'] * 100, 1, '%')} | {_f(c['met_slo'])} |"
            for c in cap["cells"]]
    out += ["", f"Capacity at the SLO: **{_f(cap['capacity_at_slo_per_s'])} req/s**.", "",
            "The seed's burst case (2 -> 25 req/s, 45 s period, 20% duty, 90 s):", "",
            "| figure | admission off | admission on |", "|---|---|---|"]
    b = a["burst"]
    rows = [("sent", "sent", 0), ("served (200)", "served", 0), ("shed (429)", "shed", 0),
            ("timeouts", "timeouts", 0), ("errors", "errors", 0), ("p95 E2E of served (s)", "p95_e2e_served_s", 2),
            ("p95 TTFT of served (s)", "p95_ttft_served_s", 2), ("SLO attainment of served", "attainment_served", 3),
            ("SLO attainment of all sent", "attainment_all", 3),
            ("every unserved request got 429 + Retry-After", "unserved_all_429_with_retry_after", 0),
            ("p99 time to a 429 (gateway wall ms)", "shed_answer_p99_wall_ms", 1),
            ("goodput, whole run (req/s)", "goodput_per_s", 2), ("goodput in the peaks (req/s)", "goodput_in_peaks_per_s", 2),
            ("offered in the peaks (req/s)", "offered_in_peaks_per_s", 2),
            ("goodput in the peaks / capacity", "goodput_in_peaks_vs_capacity", 3)]
    for label, key, nd in rows:
        vals = [(b.get(p) or {}).get(key) for p in (off, on)]
        out.append(f"| {label} | " + " | ".join(_f(v, nd) if not isinstance(v, int) or isinstance(v, bool) else str(v)
                                             for v in vals) + " |")
    if on in b:
        out.append(f"| shed reasons | - | {', '.join(f'{k} {v}' for k, v in b[on]['shed_reasons'].items()) or '-'} |")
    r = a.get("retry")
    if r:
        out += ["", f"Retry-After honoured (burst's first period, clients retry up to 3 times): {r['retried']} requests "
                f"were retried, {r['admitted_on_first_retry']} admitted on their first retry "
                f"(**{_f((r['fraction'] or 0) * 100, 1, '%')}**); final outcomes {r['final']}."]
    p = a.get("priority")
    if p:
        rate = (exp.cases[exp.compare["admission"]["priority"]["case"]].get("arrival") or {}).get("rate")
        out += ["", f"Priorities at 2x overload ({rate:g} req/s; 1 interactive : 3 batch):", "",
                f"- interactive TTFT p99: {_f(p['interactive_ttft_p99_s'], 3)} s with admission, "
                f"{_f(p['unloaded_ttft_p99_s'], 3)} s unloaded (**{_f(p['ratio'])}x**); "
                f"{_f(p.get('interactive_ttft_p99_off_s'), 3)} s with admission off.",
                f"- backend output tokens/s: {_f(p.get('backend_tokens_per_s_on'), 0)} on vs "
                f"{_f(p.get('backend_tokens_per_s_off'), 0)} off (**{_f((p.get('throughput_ratio') or 0) * 100, 1, '%')}**)."]
    fa = a.get("fairness")
    if fa:
        out += ["", "Fairness, four equal-weight tenants at 2x overload, `heavy` sending 30x each quiet one:", "",
                "| tenant | TTFT p99 (s) | alone (s) | ratio | served tokens | demand tokens |", "|---|---|---|---|---|---|"]
        for t, v in fa["quiet"].items():
            out.append(f"| {t} | {_f(v['ttft_p99_s'], 3)} | {_f(v['alone_ttft_p99_s'], 3)} | {_f(v['ratio'])} | "
                       f"{fa['served_tokens'][t]} | {fa['demand_tokens'][t]} |")
        h = exp.compare["admission"]["fairness"]["heavy"]
        out.append(f"| {h} | - | - | - | {fa['served_tokens'][h]} | {fa['demand_tokens'][h]} |")
        out += ["", f"Backlogged tenants (had sheds): {', '.join(fa['backlogged']) or 'none'}; Jain's index over their "
                f"served tokens: {_f(fa['jain_backlogged'], 3)}; Jain's index of served / max-min fair share over all "
                f"four: **{_f(fa['jain_vs_max_min_share'], 3)}**."]
    out += ["", "Targets:", "", "| check | met |", "|---|---|"]
    out += [f"| {k} | {'yes' if v else '**no**'} |" for k, v in a["checks"].items()]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from-results", type=Path, help="a directory holding results.json of an earlier run")
    ap.add_argument("--cpu-lock", default="/tmp/usefulwork-cpu.lock")
    args = ap.parse_args()
    if args.from_results:
        data = json.loads((args.from_results / "results.json").read_text())
    else:
        exp = load_experiment("admission")
        data = run_experiment(exp, Options(cpu_lock=args.cpu_lock, quiet=True), Console(stderr=True))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
