"""Replay fidelity: a loadtest run recorded by the gateway, replayed against the same setup.

Starts the simulator (``--gpu``/``--model``/``--time-scale``) behind a gateway with the ``record``
filter, runs ``usefulwork loadtest`` through it (Poisson arrivals), then ``usefulwork replay`` of the
recorded log at speed 1 against a fresh instance of the same setup (a new simulator: the first one's
prefix cache already holds every prompt, which would make the replay faster), and compares TTFT and
end-to-end percentiles in three ways:

- loadtest (client) vs replay (client): the two runs as their senders saw them;
- the recorded log's figures (the gateway's, issue #13's "recorded ones") vs replay (client);
- the recorded log's figures vs the replay run's own gateway log: both measured by the same gateway code
  at the same point, so client tools drop out and only the traffic and the setup's answer remain.

Target (issue #13): within 10% when the target is the same setup; the verdict takes the worst of the
first two. With ``--url`` the backend is an existing server (the shared real vLLM): its prefix cache
cannot be reset, so an unrecorded warm-up loadtest with the same prompts runs first and both the recorded
run and the replay meet a cache that already holds them.

    python benchmarks/replay_fidelity.py --rate 4 --duration 60
    python benchmarks/replay_fidelity.py --url http://127.0.0.1:8000 --model smollm2-135m-instruct \
        --rate 0.5 --duration 60 --prompt-tokens 128 --output-tokens 32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: `python benchmarks/replay_fidelity.py`

from benchmarks.replay_drift import free_port  # noqa: E402
from usefulwork.backends.sim.process import SimProcess  # noqa: E402
from usefulwork.cli import main as cli_main  # noqa: E402
from usefulwork.loadtest.experiment import Gateway  # noqa: E402
from usefulwork.loadtest.replay import read_log, recorded_figures  # noqa: E402

KEYS = ("p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p50_e2el_ms", "p90_e2el_ms", "p99_e2el_ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--url", help="an existing backend (e.g. the real vLLM) instead of a fresh simulator per run")
    ap.add_argument("--gpu", default="A100-80G")
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=128)
    args = ap.parse_args()
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)

        @contextlib.contextmanager
        def setup(name: str):
            sim = None
            if args.url:
                backend = args.url
            else:
                sim = SimProcess(port=free_port(), gpu=args.gpu, model=args.model, time_scale=args.time_scale,
                                 log_path=tmp / f"sim-{name}.log")
                sim.start()
                sim.wait_ready(120)
                backend = sim.base_url
            cfg = {"listen": {"host": "127.0.0.1", "port": free_port()},
                   "pools": [{"name": "sim", "models": [args.model], "replicas": [backend]}],
                   "filters": ["record"], "record": {"dir": str(tmp / f"traffic-{name}")}}
            gw = Gateway(cfg, tmp).start()
            try:
                yield f"http://127.0.0.1:{cfg['listen']['port']}"
            finally:
                time.sleep(1.0)  # the last records reach the log
                gw.stop()
                if sim:
                    sim.stop()

        def loadtest(url: str, out: str) -> None:
            assert cli_main(["loadtest", "--url", url, "--model", args.model, "--prompt-tokens",
                             str(args.prompt_tokens), "--output-tokens", str(args.output_tokens), "--arrival",
                             "poisson", "--rate", str(args.rate), "--duration", str(args.duration),
                             "--out", str(tmp / out)]) == 0

        if args.url:
            with setup("warm") as url:  # same seed, same prompts: the shared server's cache holds them after this
                loadtest(url, "warm.json")
        with setup("recorded") as url:
            loadtest(url, "lt.json")
        load.append(os.getloadavg()[0])
        with setup("replayed") as url:
            assert cli_main(["replay", str(tmp / "traffic-recorded"), "--target", url, "--out",
                             str(tmp / "rep.json")]) == 0
        load.append(os.getloadavg()[0])
        lt = json.loads((tmp / "lt.json").read_text())
        rep = json.loads((tmp / "rep.json").read_text())
        gw_rep = recorded_figures(read_log(tmp / "traffic-replayed").records)
    return report(args, lt, rep, gw_rep, load)


def report(args, lt: dict, rep: dict, gw_rep: dict, load: list[float]) -> int:
    worst = 0.0
    where = f"backend {args.url}" if args.url else f"sim {args.gpu} time-scale {args.time_scale:g}"
    print(f"replay fidelity: {rep['num_prompts']} requests, {where}, {args.model}, {args.prompt_tokens}x"
          f"{args.output_tokens}, {args.rate:g} req/s for {args.duration:g} s; replay schedule lag "
          f"p99 {rep['p99_schedule_lag_ms']:.1f} ms, max {rep['max_schedule_lag_ms']:.1f} ms")
    print(f"{'figure':12} {'loadtest':>9} {'replay':>9} {'diff':>7}  {'recorded':>9} {'diff':>7}  "
          f"{'gw replay':>9} {'diff':>7}")
    for k in KEYS:
        a, b, g, h = lt[k], rep[k], rep["recorded"][k]["recorded"], gw_rep[k]
        d1, d2, d3 = (pct(b, a), pct(b, g), pct(h, g))
        worst = max(worst, abs(d1), abs(d2))
        print(f"{k:12} {a:9.1f} {b:9.1f} {d1:+6.1f}%  {g:9.1f} {d2:+6.1f}%  {h:9.1f} {d3:+6.1f}%")
    print(f"tokens in/out: loadtest {lt['total_input_tokens']}/{lt['total_output_tokens']}, "
          f"replay {rep['total_input_tokens']}/{rep['total_output_tokens']}; load average "
          f"{' -> '.join(f'{x:.1f}' for x in load)} (start, after the recorded run, after the replay) "
          f"on {os.cpu_count()} cores")
    # Percentiles of runs where (almost) nothing was served compare nothing: such a run has no verdict.
    served = {"loadtest": (lt.get("completed", 0), lt.get("num_prompts", 0)),
              "replay": (rep.get("completed", 0), rep.get("num_prompts", 0))}
    short = [f"{name} {ok}/{sent} ok" for name, (ok, sent) in served.items() if not sent or ok < 0.9 * sent]
    if short:
        print(f"NO VERDICT: too few requests served ({', '.join(short)}; at least 90% needed): the backend "
              "did not keep up, so these percentiles say nothing about replay fidelity")
        return 2
    print(f"worst difference of the replay from the loadtest and from the recorded figures {worst:.1f}% "
          f"(target <= 10%: {'met' if worst <= 10 else 'MISSED'})")
    return 0 if worst <= 10 else 1


def pct(x: float, ref: float) -> float:
    return (x - ref) / ref * 100.0 if ref else 0.0


if __name__ == "__main__":
    sys.exit(main())
