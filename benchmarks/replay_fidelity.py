"""Replay fidelity: a loadtest run recorded by the gateway, replayed against the same setup.

Starts the simulator (``--gpu``/``--model``/``--time-scale``) behind a gateway with the ``record``
filter, runs ``usefulwork loadtest`` through it (Poisson arrivals), then ``usefulwork replay`` of the
recorded log at speed 1 against a fresh instance of the same setup (a new simulator: the first one's
prefix cache already holds every prompt, which would make the replay faster), and compares TTFT and
end-to-end percentiles:
loadtest (client) vs replay (client), and the gateway's recorded figures vs the replay.
Target (issue #13): within 10% when the target is the same setup.

    python benchmarks/replay_fidelity.py --rate 4 --duration 60
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from usefulwork.backends.sim.process import SimProcess
from usefulwork.cli import main as cli_main
from usefulwork.loadtest.experiment import Gateway

from benchmarks.replay_drift import free_port

KEYS = ("p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "p50_e2el_ms", "p90_e2el_ms", "p99_e2el_ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--gpu", default="A100-80G")
    ap.add_argument("--model", default="Llama-3.1-8B")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)

        def setup(name: str) -> tuple[SimProcess, Gateway, str]:
            sim = SimProcess(port=free_port(), gpu=args.gpu, model=args.model, time_scale=args.time_scale,
                             log_path=tmp / f"sim-{name}.log")
            sim.start()
            sim.wait_ready(120)
            cfg = {"listen": {"host": "127.0.0.1", "port": free_port()},
                   "pools": [{"name": "sim", "models": [args.model], "replicas": [sim.base_url]}],
                   "filters": ["record"], "record": {"dir": str(tmp / f"traffic-{name}")}}
            return sim, Gateway(cfg, tmp).start(), f"http://127.0.0.1:{cfg['listen']['port']}"

        sim, gw, url = setup("recorded")
        try:
            assert cli_main(["loadtest", "--url", url, "--model", args.model, "--prompt-tokens", str(args.prompt_tokens),
                             "--output-tokens", str(args.output_tokens), "--arrival", "poisson", "--rate",
                             str(args.rate), "--duration", str(args.duration), "--out", str(tmp / "lt.json")]) == 0
            time.sleep(1.0)
        finally:
            gw.stop()
            sim.stop()
        sim, gw, url = setup("replayed")
        try:
            assert cli_main(["replay", str(tmp / "traffic-recorded"), "--target", url, "--out",
                             str(tmp / "rep.json")]) == 0
        finally:
            gw.stop()
            sim.stop()
        lt = json.loads((tmp / "lt.json").read_text())
        rep = json.loads((tmp / "rep.json").read_text())
    worst = 0.0
    print(f"replay fidelity: {rep['num_prompts']} requests, sim {args.gpu} {args.model} time-scale {args.time_scale:g}, "
          f"{args.rate:g} req/s for {args.duration:g} s; replay schedule lag p99 {rep['p99_schedule_lag_ms']:.1f} ms")
    print(f"{'figure':14} {'loadtest':>10} {'replay':>10} {'diff':>8}   {'gw recorded':>11} {'diff':>8}")
    for k in KEYS:
        a, b = lt[k], rep[k]
        g = rep["recorded"][k]["recorded"]
        d1 = (b - a) / a * 100.0 if a else 0.0
        d2 = (b - g) / g * 100.0 if g else 0.0
        worst = max(worst, abs(d1))
        print(f"{k:14} {a:10.1f} {b:10.1f} {d1:+7.1f}%   {g:11.1f} {d2:+7.1f}%")
    print(f"worst loadtest-vs-replay difference {worst:.1f}% (target <= 10%: {'met' if worst <= 10 else 'MISSED'})")
    return 0 if worst <= 10 else 1


if __name__ == "__main__":
    sys.exit(main())
