"""`usefulwork loadtest`: one load run against an endpoint, or an experiment matrix.

One run (against a gateway or a vLLM server you already have)::

    usefulwork loadtest --url http://127.0.0.1:8080 --model smollm2-135m-instruct \\
        --prompt-tokens 512 --output-tokens 128 --arrival poisson --rate 0.5 --duration 60 \\
        --usd-per-hour 0.10 --out run.json --html run.html

The experiment matrix (starts and stops each profile's backends and a gateway itself)::

    usefulwork loadtest --experiment cost                 # real local vLLM (CPU), both shapes
    usefulwork loadtest --experiment cost-a100            # simulated Llama-3.1-8B on one A100-80G

Re-render a report from saved results::

    usefulwork loadtest --report results.json --html report.html
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from rich.console import Console

from usefulwork.loadtest.arrivals import PROCESSES, ArrivalError
from usefulwork.loadtest.workloads import WorkloadError
from usefulwork.tasks import raise_exit, take_pending_exit


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n", 2)[2]
    m = p.add_argument_group("mode")
    m.add_argument("--experiment", "-e", help="experiment name (built-in: cost, cost-a100, admission; autoscale: the virtual-clock "
                   "autoscaling what-if) or a YAML file path")
    m.add_argument("--report", type=Path, help="re-render the HTML report of a saved results JSON file")
    m.add_argument("--list", action="store_true", help="list built-in experiments and exit")

    e = p.add_argument_group("experiment options")
    e.add_argument("--case", action="append", help="run only this case (repeatable)")
    e.add_argument("--profile", action="append", help="run only this profile (repeatable)")
    e.add_argument("--shape", action="append", help="run only this shape, e.g. 512x128 (repeatable)")
    e.add_argument("--out-dir", type=Path, help="where results.json and report.html go (default: ./loadtest-results/NAME)")
    e.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every case's duration (and request counts) by this (quick trial runs)")
    e.add_argument("--rate-scale", type=float, default=None,
                   help="run every case's traffic at this pace: rates times F, durations and periods divided by F "
                        "(default: an experiment with a calibrate block probes its server first and sets F from the "
                        "server's capacity; others run as written)")
    e.add_argument("--no-gateway", action="store_true", help="drive the backends directly (no gateway in between)")
    e.add_argument("--port-base", type=int, default=None,
                   help="first TCP port for backends and the gateway (default: free ports chosen by the OS)")
    e.add_argument("--cpu-lock", help="hold this flock file while a profile's backends run (shared machines)")
    e.add_argument("--dry-run", action="store_true", help="print the plan (cells, rates, durations) and exit")

    t = p.add_argument_group("target (one run)")
    t.add_argument("--url", help="base URL of the gateway or vLLM server (with or without /v1)")
    t.add_argument("--model", default="smollm2-135m-instruct")
    t.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="synthetic",
                   choices=["synthetic", "realistic", "jsonl", "mooncake", "burstgpt", "azure"])
    w.add_argument("--prompt-tokens", type=int, default=512)
    w.add_argument("--output-tokens", type=int, default=128)
    w.add_argument("--prefix-groups", type=int, help="synthetic: number of shared-prefix groups")
    w.add_argument("--prefix-tokens", type=int, default=256, help="synthetic: tokens of each group's shared prefix")
    w.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    w.add_argument("--file", help="jsonl prompt file or trace file")
    w.add_argument("--speedup", type=float, default=1.0, help="traces: replay this many times faster")
    w.add_argument("--max-input-tokens", type=int, help="traces: clip prompt lengths")
    w.add_argument("--max-output-tokens", type=int, help="traces: clip output lengths")

    a = p.add_argument_group("load")
    a.add_argument("--arrival", choices=PROCESSES, help="open-loop arrival process (default poisson when --rate)")
    a.add_argument("--rate", type=float, help="requests per second")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson, < 1 burstier)")
    a.add_argument("--base-rate", type=float, help="onoff: rate between bursts")
    a.add_argument("--peak-rate", type=float, help="onoff: rate during bursts")
    a.add_argument("--period", type=float, help="onoff: period in seconds")
    a.add_argument("--duty", type=float, help="onoff: fraction of each period at the peak rate")
    a.add_argument("--concurrency", type=int, help="closed loop: keep this many requests in flight")
    a.add_argument("--duration", type=float, help="stop sending after this many seconds")
    a.add_argument("--num-requests", type=int, help="stop after this many requests")
    a.add_argument("--timeout", type=float, default=60.0, help="per-request timeout in seconds")
    a.add_argument("--drain", type=float, help="seconds to wait for in-flight requests after sending stops")
    a.add_argument("--seed", type=int, default=0)

    s = p.add_argument_group("SLO and cost")
    s.add_argument("--config", type=Path, help="gateway config: fleet $/hour (all pools) and SLO defaults")
    s.add_argument("--usd-per-hour", type=float, help="fleet price per hour (overrides --config)")
    s.add_argument("--slo-ttft-ms", type=float)
    s.add_argument("--slo-tpot-ms", type=float)
    s.add_argument("--slo-e2e-ms", type=float)
    s.add_argument("--slo-attainment", type=float, help="fraction of requests that must be good (default 0.95)")
    s.add_argument("--gateway-stats", action="store_true",
                   help="compare with the gateway's own ledger (GET /usefulwork/stats on --url)")

    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, help="write the results JSON here")
    o.add_argument("--html", type=Path, help="write the HTML report here")
    o.add_argument("--label", default="")
    o.add_argument("--quiet", "-q", action="store_true", help="no live progress")


def _fail(console: Console, msg: str) -> int:
    console.print(f"[bold red]error:[/] {msg}", highlight=False)
    return 2


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise_exit(128 + signum)


def run(args: argparse.Namespace) -> int:
    # SIGTERM (a CI timeout, `kill`, a container stop) unwinds like Ctrl-C, so the finally blocks stop the
    # vLLM servers, simulators and gateways this run started; the default action left them running.
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm) if threading.current_thread() is threading.main_thread() else None
    take_pending_exit()  # (none from an earlier run in this process)
    try:
        try:
            rc = _run(args)
        except SystemExit:
            raise
        except BaseException:
            # a SIGTERM that landed as a cell's event loop closed: the loop's shutdown failed with it, and
            # the run unwound through its finally blocks (servers stopped); exit as the signal says
            if (code := take_pending_exit()) is not None:
                raise SystemExit(code) from None
            raise
        if (code := take_pending_exit()) is not None:  # scheduled on a loop that closed before it ran
            raise SystemExit(code)
        return rc
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        if args.list:
            from usefulwork.loadtest.experiment import builtin_names

            for name in [*builtin_names(), "autoscale"]:
                print(name)
            return 0
        if args.report:
            return _rerender(args, console)
        if args.experiment:
            from usefulwork.loadtest.experiment import main as experiment_main

            return experiment_main(args, console)
        return _single(args, console)
    except (WorkloadError, ArrivalError, ValueError, FileNotFoundError) as exc:
        return _fail(console, str(exc))
    except (RuntimeError, TimeoutError) as exc:  # a backend or the gateway could not start
        _fail(console, str(exc))
        return 1


def _rerender(args: argparse.Namespace, console: Console) -> int:
    from usefulwork.loadtest import report
    from usefulwork.loadtest.results import read_json

    data = read_json(args.report)
    out = args.html or args.report.with_suffix(".html")
    report.write_html(data, out)
    console.print(f"report: {out}")
    return 0


def _workload_spec(args: argparse.Namespace) -> dict[str, Any]:
    if args.workload == "synthetic":
        spec: dict[str, Any] = {"type": "synthetic", "prompt_tokens": args.prompt_tokens,
                                "output_tokens": args.output_tokens, "endpoint": args.endpoint}
        if args.prefix_groups:
            spec["shared_prefix"] = {"groups": args.prefix_groups, "prefix_tokens": args.prefix_tokens}
        return spec
    if args.workload == "realistic":
        return {"type": "realistic"}
    if not args.file:
        raise ValueError(f"--workload {args.workload} needs --file")
    if args.workload == "jsonl":
        return {"type": "jsonl", "path": args.file, "max_tokens": args.output_tokens}
    spec = {"type": args.workload, "path": args.file, "speedup": args.speedup}
    if args.max_input_tokens:
        spec["max_input_tokens"] = args.max_input_tokens
    if args.max_output_tokens:
        spec["max_output_tokens"] = args.max_output_tokens
    return spec


def _arrival_spec(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.concurrency is not None:
        return None
    kind = args.arrival or ("onoff" if args.peak_rate is not None else "poisson")
    if kind == "onoff":
        return {"process": "onoff", "base_rate": args.base_rate or 0.0, "peak_rate": args.peak_rate,
                "period_s": args.period, "duty": args.duty}
    if args.rate is None:
        return None  # traces bring their own times; otherwise LoadSpec.validate explains
    spec: dict[str, Any] = {"process": kind, "rate": args.rate}
    if kind == "gamma":
        spec["burstiness"] = args.burstiness
    return spec


def _slo_and_price(args: argparse.Namespace):
    from usefulwork.loadtest.metrics import SLOSpec

    base = SLOSpec()
    usd = 0.0
    if args.config:
        from usefulwork.config import load

        cfg = load(args.config)
        base = SLOSpec(ttft_ms=cfg.slo.ttft_ms, tpot_ms=cfg.slo.tpot_ms, e2e_ms=cfg.slo.e2e_ms)
        usd = sum(p.usd_per_hour for p in cfg.pools)  # usd_per_hour is already the whole pool's
    overrides = {k: v for k, v in {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms,
                                   "e2e_ms": args.slo_e2e_ms, "attainment": args.slo_attainment}.items()
                 if v is not None}
    slo = SLOSpec.from_mapping(overrides, base)
    if args.usd_per_hour is not None:
        usd = args.usd_per_hour
    return slo, usd


def _single(args: argparse.Namespace, console: Console) -> int:
    from usefulwork.loadtest import arrivals, workloads
    from usefulwork.loadtest.gateway_stats import StatsWindow
    from usefulwork.loadtest.progress import LiveProgress
    from usefulwork.loadtest.results import run_result, write_json
    from usefulwork.loadtest.runner import LoadSpec, Target, run_sync
    from usefulwork.loadtest.tables import print_run

    if not args.url:
        return _fail(console, "give --url (one run), --experiment NAME (matrix) or --report FILE")
    workload = workloads.from_spec(_workload_spec(args))
    arr = _arrival_spec(args)
    load = LoadSpec(arrival=arrivals.from_spec(arr) if arr else None, concurrency=args.concurrency,
                    duration_s=args.duration, num_requests=args.num_requests, timeout_s=args.timeout,
                    drain_s=args.drain, seed=args.seed)
    load.validate(workload.timed)
    slo, usd = _slo_and_price(args)
    target = Target(args.url, args.model, args.api_key)
    window = StatsWindow(target.base_url) if args.gateway_stats else None
    if window:
        window.begin()
    with LiveProgress(args.label or "loadtest", console, planned_s=args.duration) as progress:
        out = run_sync(target, workload, load, None if args.quiet else progress)
    result = run_result(out, slo=slo, usd_per_hour=usd, label=args.label)
    if window:
        result["gateway"] = window.end(result)
    print_run(result, Console())
    if args.out:
        write_json(args.out, result)
        console.print(f"results: {args.out}")
    if args.html:
        from usefulwork.loadtest import report

        report.write_html({"runs": [result]}, args.html)
        console.print(f"report: {args.html}")
    return 0


if __name__ == "__main__":
    import argparse as _ap

    _p = _ap.ArgumentParser(prog="usefulwork loadtest")
    configure_parser(_p)
    sys.exit(run(_p.parse_args()))
