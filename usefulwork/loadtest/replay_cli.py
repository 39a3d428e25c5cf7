"""`usefulwork replay`: re-send a recorded traffic log, or compare two setups on it.

Replay against one target at the recorded timing (``--speed 2``: twice as fast)::

    usefulwork replay traffic/ --target http://127.0.0.1:8080 --out replay.json --html replay.html

Paired comparison (each request to both, order randomized; a baseline-vs-baseline pass gives the
noise floor)::

    usefulwork replay traffic/ --baseline http://a:8080 --candidate http://b:8080 --out cmp.json --html cmp.html

Paired comparison of live mirroring (the record log joined with the mirror filter's shadow log; no
noise pass: live traffic cannot be re-sent)::

    usefulwork replay traffic/ --shadow-log traffic-shadow/ --out cmp.json --html cmp.html

Export the log as a Mooncake trace (vllm bench, GuideLLM, AIPerf, ``usefulwork loadtest --workload mooncake``)::

    usefulwork replay traffic/ --export-mooncake trace.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from usefulwork.loadtest.metrics import SLOSpec
from usefulwork.loadtest.replay import ReplayError


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n", 2)[2]
    p.add_argument("log", type=Path, help="a traffic log file or a directory of them (the record filter's dir)")
    p.add_argument("--target", help="replay against this URL")
    p.add_argument("--baseline", help="paired comparison: the baseline URL")
    p.add_argument("--candidate", help="paired comparison: the candidate URL")
    p.add_argument("--shadow-log", type=Path, help="paired comparison of live mirroring: the mirror's shadow log")
    p.add_argument("--export-mooncake", type=Path, metavar="FILE", help="write the log as a Mooncake trace and exit")
    p.add_argument("--speed", type=float, default=1.0, help="time scale: 2 replays twice as fast (default 1)")
    p.add_argument("--model", default="", help="send this model name instead of the recorded one")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (all sides)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, s")
    p.add_argument("--usd-per-hour", type=float, default=1.0, help="fleet $/hour of the target / baseline")
    p.add_argument("--candidate-usd-per-hour", type=float, default=None, help="the candidate's $/hour "
                   "(default: --usd-per-hour)")
    p.add_argument("--slo-ttft-ms", type=float, default=SLOSpec.ttft_ms)
    p.add_argument("--slo-tpot-ms", type=float, default=SLOSpec.tpot_ms)
    p.add_argument("--slo-e2e-ms", type=float, default=SLOSpec.e2e_ms)
    p.add_argument("--no-noise-pass", action="store_true", help="skip the baseline-vs-baseline pass (no noise floor)")
    p.add_argument("--no-embedding", action="store_true", help="compare outputs by exact match only (no model load)")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples (default 1000)")
    p.add_argument("--alpha", type=float, default=0.05, help="paired comparison: the family-wise false-alarm "
                   "level of the verdict (default 0.05; a smaller one needs more resamples, ~24/alpha)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the JSON results here")
    p.add_argument("--html", type=Path, help="write the offline HTML report here")


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        return _run(args, console)
    except ReplayError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return 2


def _slo(args: argparse.Namespace) -> SLOSpec:
    return SLOSpec(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms, e2e_ms=args.slo_e2e_ms)


def _run(args: argparse.Namespace, console: Console) -> int:
    from usefulwork.loadtest import replay as rp

    modes = [bool(args.target), bool(args.baseline or args.candidate), bool(args.export_mooncake),
             bool(args.shadow_log)]
    if sum(modes) != 1:
        raise ReplayError("choose one: --target URL, --baseline URL --candidate URL, --shadow-log LOG, "
                          "or --export-mooncake FILE")
    if modes[1] and not (args.baseline and args.candidate):
        raise ReplayError("a paired comparison needs both --baseline and --candidate")
    if not 0.0 < args.alpha < 1.0:
        raise ReplayError(f"--alpha must be between 0 and 1, got {args.alpha}")
    if args.shadow_log:
        return _mirrored(args, console)
    workload, log = rp.load_workload(args.log, args.speed)
    for problem in log.problems:
        console.print(f"[yellow]skipped[/yellow] {problem}")
    if args.export_mooncake:
        n = rp.write_mooncake(log.records, args.export_mooncake)
        console.print(f"wrote {n} Mooncake rows to {args.export_mooncake}")
        return 0
    if workload.skipped:
        console.print(f"[yellow]{workload.skipped} records of operations the replay does not send "
                      f"(responses, embeddings) skipped[/yellow]")
    if args.target:
        return _single(args, console, workload)
    return _paired(args, console, workload)


def _run_loop(coro):
    try:
        import uvloop  # noqa: PLC0415 (optional: a cheaper loop)

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def _single(args: argparse.Namespace, console: Console, workload) -> int:
    from usefulwork.loadtest import replay as rp
    from usefulwork.loadtest.report import write_html
    from usefulwork.loadtest.results import run_result, write_json
    from usefulwork.loadtest.runner import Target

    rp.check_target(args.target)
    target = Target(args.target, args.model, args.api_key)
    console.print(f"replaying {len(workload.records)} requests against {target.base_url} at speed {args.speed:g}")
    out, interrupted = _run_loop(rp.replay(workload, target, timeout_s=args.timeout))
    result = run_result(out, slo=_slo(args), usd_per_hour=args.usd_per_hour, label="replay")
    result["recorded"] = rp.compare_to_recorded(result, workload.records[:len(out.results)])
    result["interrupted"] = interrupted
    _print_single(console, result)
    result["meta"] = {"log": str(args.log), "speed": args.speed, "target": target.base_url}
    if args.out:
        write_json(args.out, result)  # shaped as one loadtest run (loadtest --report re-renders it)
    if args.html:
        write_html(result, args.html)
    return 130 if interrupted else 0


def _print_single(console: Console, r: dict[str, Any]) -> None:
    console.print(f"{r['completed']} ok / {r['num_prompts']} sent; outcomes {r['outcome_counts']}; "
                  f"schedule lag p99 {r['p99_schedule_lag_ms']:.2f} ms (max {r['max_schedule_lag_ms']:.2f} ms)")
    for k, v in r["recorded"].items():
        diff = "-" if v["diff_pct"] is None else f"{v['diff_pct']:+.1f}%"
        console.print(f"  {k}: recorded {v['recorded']:.1f}  replayed {v['replayed']:.1f}  ({diff})")
    if r.get("interrupted"):
        console.print("[yellow]interrupted: the figures cover what finished[/yellow]")


def _paired(args: argparse.Namespace, console: Console, workload) -> int:
    from usefulwork.loadtest import paired as pr
    from usefulwork.loadtest import replay as rp
    from usefulwork.loadtest.results import write_json
    from usefulwork.loadtest.runner import Target

    for url in (args.baseline, args.candidate):
        rp.check_target(url)
    base = Target(args.baseline, args.model, args.api_key)
    cand = Target(args.candidate, args.model, args.api_key)
    slo = _slo(args)
    usd_b = args.candidate_usd_per_hour if args.candidate_usd_per_hour is not None else args.usd_per_hour

    async def both() -> tuple[Any, Any]:
        main = await pr.paired_pass(workload, base, cand, timeout_s=args.timeout, seed=args.seed)
        if main.interrupted or args.no_noise_pass:
            return main, None
        console.print("baseline vs baseline pass (noise floor)")
        noise = await pr.paired_pass(workload, base, base, timeout_s=args.timeout, seed=args.seed + 1)
        return main, noise

    console.print(f"paired replay of {len(workload.records)} requests: {base.base_url} vs {cand.base_url}")
    main, noise = _run_loop(rp.run_interruptible(both()))[0] or (None, None)
    if main is None:
        console.print("[yellow]interrupted before any request finished[/yellow]")
        return 130
    embed = None if args.no_embedding else _embedder()
    data = build_paired(workload, main, noise, base, cand, slo=slo, usd_a=args.usd_per_hour, usd_b=usd_b,
                        embed=embed, resamples=args.resamples, seed=args.seed, alpha=args.alpha)
    data["meta"] = {"log": str(args.log), "speed": args.speed, "baseline": base.base_url,
                    "candidate": cand.base_url, "noise_pass": noise is not None}
    console.print(data["comparison"]["verdict"])
    if args.out:
        write_json(args.out, data)
    if args.html:
        from usefulwork.loadtest.paired_report import write_html

        write_html(data, args.html)
    return 130 if main.interrupted else 0


def _mirrored(args: argparse.Namespace, console: Console) -> int:
    from usefulwork.loadtest import paired as pr
    from usefulwork.loadtest import replay as rp
    from usefulwork.loadtest.results import write_json
    from usefulwork.loadtest.runner import Target

    primary, shadow = rp.read_log(args.log), rp.read_log(args.shadow_log)
    for problem in primary.problems + shadow.problems:
        console.print(f"[yellow]skipped[/yellow] {problem}")
    workload, main = pr.pass_from_logs(primary.records, shadow.records)
    usd_b = args.candidate_usd_per_hour if args.candidate_usd_per_hour is not None else args.usd_per_hour
    data = build_paired(workload, main, None, Target(str(args.log), ""), Target(str(args.shadow_log), ""),
                        slo=_slo(args), usd_a=args.usd_per_hour, usd_b=usd_b, embed=None,
                        resamples=args.resamples, seed=args.seed, alpha=args.alpha)
    data["meta"] = {"log": str(args.log), "shadow_log": str(args.shadow_log), "pairs": len(main.a),
                    "noise_pass": False}
    console.print(f"{len(main.a)} mirrored pairs; " + data["comparison"]["verdict"])
    if args.out:
        write_json(args.out, data)
    if args.html:
        from usefulwork.loadtest.paired_report import write_html

        write_html(data, args.html)
    return 0


def _embedder():
    try:
        from usefulwork.embedding import shared_embedder  # noqa: PLC0415

        emb = shared_embedder()
        emb.load()
        return emb.encode
    except Exception as exc:  # the 'semantic' extra is missing: exact match only
        print(f"embedding similarity unavailable ({type(exc).__name__}: {exc}); exact match only", file=sys.stderr)
        return None


def build_paired(workload, main, noise, base, cand, *, slo: SLOSpec, usd_a: float, usd_b: float, embed,
                 resamples: int = 1000, seed: int = 0, alpha: float = 0.05) -> dict[str, Any]:
    from usefulwork.loadtest import paired as pr

    return {
        "comparison": pr.analyse(workload, main, noise, slo=slo, usd_per_hour_a=usd_a, usd_per_hour_b=usd_b,
                                 embed=embed, resamples=resamples, seed=seed, alpha=alpha),
        "baseline": pr.side_result(main.a, main.wall_start, workload, base, slo, usd_a, "baseline"),
        "candidate": pr.side_result(main.b, main.wall_start, workload, cand, slo, usd_b, "candidate"),
        "interrupted": main.interrupted,
    }
