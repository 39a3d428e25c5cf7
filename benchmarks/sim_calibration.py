"""Calibration of vllm-sim: predicted vs measured TTFT, ITL and throughput, with error %.

Two reference sets:
1. The published llmperf points (vLLM 0.4.3, Llama-3-8B-Instruct, 1x A10G, ~550 in / 150 out,
   concurrency 1 / 16 / 64), predicted with the `vllm-0.4` profile on `A10G` and llmperf's own
   metric definitions (ITL = end-to-end latency / output tokens; throughput = output tokens of
   the run / run duration).
2. The real vLLM CPU server on this machine (SmolLM2-135M, concurrency 1 / 8 / 32, 64 output
   tokens, ignore_eos), MEASURED IN THIS RUN under the shared CPU lock, predicted with the `cpu`
   profile. ITL here = (e2e - TTFT) / (output tokens - 1), as vLLM's benchmark reports TPOT.

Target: within 15% on throughput and ITL at every point (TTFT is reported, not targeted).

    .venv/bin/python benchmarks/sim_calibration.py [--vllm-url http://127.0.0.1:8000] [--skip-cpu]
        [--requests-per-client 4] [--json out.json]

Without --vllm-url (or USEFULWORK_TEST_VLLM_URL) it starts its own vLLM on a port in 18000-18999.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from usefulwork.backends.sim.catalog import build_spec  # noqa: E402
from usefulwork.backends.sim.offline import closed_loop  # noqa: E402

LOCK_PATH = "/tmp/usefulwork-cpu.lock"
MODEL_NAME = "smollm2-135m-instruct"

# Published: ray-project/llmperf benchmarks/results/a10g/vllm-meta-llama_Meta-Llama-3-8B-Instruct.csv
# (vLLM 0.4.3 container, Llama-3-8B-Instruct, g5.2xlarge = 1x A10G, 550 in / 150 out), all rows.
# qpm = completed requests per minute. The brief's three target points are concurrency 1, 16, 64.
A10G_POINTS = [
    {"concurrency": 1, "ttft_ms": 137.29, "itl_ms": 30.65, "tok_s": 31.92, "qpm": 10.80, "target": True},
    {"concurrency": 2, "ttft_ms": 150.65, "itl_ms": 32.75, "tok_s": 59.17, "qpm": 20.09, "target": False},
    {"concurrency": 4, "ttft_ms": 171.40, "itl_ms": 33.89, "tok_s": 110.95, "qpm": 37.60, "target": False},
    {"concurrency": 8, "ttft_ms": 249.27, "itl_ms": 36.70, "tok_s": 191.84, "qpm": 65.24, "target": False},
    {"concurrency": 16, "ttft_ms": 302.75, "itl_ms": 42.67, "tok_s": 289.87, "qpm": 98.21, "target": True},
    {"concurrency": 32, "ttft_ms": 319.68, "itl_ms": 50.15, "tok_s": 363.99, "qpm": 123.17, "target": False},
    {"concurrency": 64, "ttft_ms": 1080.42, "itl_ms": 61.73, "tok_s": 301.19, "qpm": 102.66, "target": True},
]
# llmperf counts tokens by re-tokenizing the streamed text with a Llama-2 tokenizer: the CSV's
# mean_output_token_length is ~177 for requests capped at max_tokens ~ N(150, 10) Llama-3 tokens.
LLMPERF_COUNTED_OUTPUT = 177.0
LLMPERF_TOKEN_RATIO = LLMPERF_COUNTED_OUTPUT / 150.0
# 550 Llama-2-counted prompt tokens ~ 466 Llama-3 tokens, plus ~15 chat-template tokens.
A10G_PROMPT_TOKENS = round(550 / LLMPERF_TOKEN_RATIO) + 15
# (concurrency, prompt words, output tokens, role): the brief's three points (64 output tokens,
# short prompts), a point in the cost experiment's shape (~490-token prompts, 128 output tokens;
# used to fit the CPU's KV-read factor) and a held-out shape no factor was fitted to.
CPU_POINTS = [
    (1, 50, 64, "target"),
    (8, 50, 64, "target"),
    (32, 50, 64, "target"),
    (4, 400, 128, "fit"),
    (16, 200, 96, "held-out"),
]


@dataclass
class Point:
    reference: str
    concurrency: int
    measured_ttft_ms: float | None
    predicted_ttft_ms: float
    measured_itl_ms: float
    predicted_itl_ms: float
    measured_tok_s: float | None
    predicted_tok_s: float
    n: int = 0  # requests in the measured run (CPU points)
    prompt_tokens: float = 0.0
    output_tokens: int = 0

    def errors(self) -> dict[str, float | None]:
        def err(pred: float, meas: float | None) -> float | None:
            return None if not meas else 100.0 * (pred - meas) / meas

        return {
            "ttft": err(self.predicted_ttft_ms, self.measured_ttft_ms),
            "itl": err(self.predicted_itl_ms, self.measured_itl_ms),
            "tok_s": err(self.predicted_tok_s, self.measured_tok_s),
        }

    def within_target(self, pct: float = 15.0) -> bool:
        e = self.errors()
        return all(v is None or abs(v) <= pct for k, v in e.items() if k != "ttft")


# ---------------------------------------------------------------------------------------------
# A10G (published)
# ---------------------------------------------------------------------------------------------
def effective_concurrency(ref: dict) -> int:
    """Requests the server really had in flight, by Little's law on the published numbers.

    llmperf of that time launched requests in waves (ray-project/llmperf issues #43/#56, fixed by
    PR #59 in July 2024): a wave of N had to finish before the next started, so the server saw
    fewer than N requests at a time. L = throughput (req/s) x latency (s), where llmperf's latency
    per request = its ITL x its counted output tokens.
    """
    e2e_s = ref["itl_ms"] / 1e3 * LLMPERF_COUNTED_OUTPUT
    return max(1, round(ref["qpm"] / 60.0 * e2e_s))


def predict_a10g(concurrency: int, n_requests: int, seed: int = 0) -> tuple[float, float, float]:
    """llmperf-style metrics from the simulator: (TTFT ms, ITL ms, output tok/s), llmperf-counted tokens."""
    spec = build_spec("A10G", "Llama-3.1-8B", "bf16", 1, "vllm-0.4")
    res = closed_loop(spec, concurrency, n_requests, A10G_PROMPT_TOKENS, 150, seed=seed, output_stddev=10)
    ttft = sum(r.ttft for r in res.requests) / len(res.requests)
    # llmperf: ITL = e2e / counted output tokens; throughput = counted output tokens / duration.
    itl = sum(r.e2e / (r.output_tokens * LLMPERF_TOKEN_RATIO) for r in res.requests) / len(res.requests)
    return ttft * 1e3, itl * 1e3, res.throughput * LLMPERF_TOKEN_RATIO


# ---------------------------------------------------------------------------------------------
# Real CPU vLLM (measured now)
# ---------------------------------------------------------------------------------------------
RUN_NONCE = f"{time.time_ns() % 10**12:x}"  # new every run: the server's prefix cache never hits


def cpu_prompt(i: int, rng: random.Random, n_words: int) -> str:
    # Distinct prompts: the run nonce and request index come FIRST, so no KV block is shared
    # between requests or with an earlier run (the real server keeps its prefix cache).
    words = ["alpha", "river", "stone", "cloud", "maple", "orbit", "delta", "ember", "frost", "grove"]
    return f"Run {RUN_NONCE} request {i}: " + " ".join(rng.choice(words) for _ in range(n_words)) + ". Continue."


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[float, float, int, int]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    usage = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") and ttft is None:
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    e2e = time.perf_counter() - t0
    return ttft or e2e, e2e, usage["completion_tokens"], usage["prompt_tokens"]


def server_generation_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def server_busy(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))


def measure_cpu_clean(url: str, concurrency: int, n_requests: int, n_words: int, max_tokens: int,
                      attempts: int = 3) -> dict[str, float]:
    """Measure when nobody else uses the server: wait for it to be idle, and redo the point if the
    server generated more tokens than we asked for (another client shared it meanwhile)."""
    for attempt in range(attempts):
        deadline = time.monotonic() + 60
        while server_busy(url) > 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        before = server_generation_tokens(url)
        result = asyncio.run(measure_cpu(url, concurrency, n_requests, n_words, max_tokens))
        extra = server_generation_tokens(url) - before - (n_requests * max_tokens + 4)
        result["load_avg_1m"] = os.getloadavg()[0]
        if extra <= 0:
            return result
        print(f"# c={concurrency}: another client generated {extra:.0f} tokens meanwhile; measuring again",
              file=sys.stderr)
    result["shared"] = True
    return result


async def measure_cpu(url: str, concurrency: int, n_requests: int, n_words: int, max_tokens: int,
                      seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed + concurrency)
    prompts = [cpu_prompt(i, rng, n_words) for i in range(n_requests)]
    results: list[tuple[float, float, int, int]] = []
    queue = list(prompts)

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            p = queue.pop()
            results.append(await one_request(client, url, p, max_tokens))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, "warm up", 4)  # first-request effects out of the numbers
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        duration = time.perf_counter() - t0
    out_tokens = sum(r[2] for r in results)
    return {
        "ttft_ms": 1e3 * sum(r[0] for r in results) / len(results),
        "itl_ms": 1e3 * sum((r[1] - r[0]) / (r[2] - 1) for r in results) / len(results),
        "tok_s": out_tokens / duration,
        "prompt_tokens": sum(r[3] for r in results) / len(results),
        "n": len(results),
    }


async def measure_open_loop(url: str, arrivals: list[float], n_words: int, max_tokens: int,
                            timeout_s: float) -> dict[str, float]:
    """Requests at the given times; a request not done within timeout_s is dropped (disconnect)."""
    rng = random.Random(len(arrivals))
    ok: list[tuple[float, float, int, int]] = []
    dropped = 0
    limits = httpx.Limits(max_connections=len(arrivals) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one_request(client, url, "warm up", 4)
        t0 = time.perf_counter()

        async def send(i: int, at: float) -> None:
            nonlocal dropped
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            try:
                ok.append(await asyncio.wait_for(
                    one_request(client, url, cpu_prompt(i, rng, n_words), max_tokens), timeout_s))
            except asyncio.TimeoutError:
                dropped += 1

        await asyncio.gather(*(send(i, at) for i, at in enumerate(arrivals)))
    e2e = sorted(r[1] for r in ok)
    return {
        "ok": len(ok), "dropped": dropped,
        "p50_s": e2e[int(0.5 * (len(e2e) - 1) + 0.5)] if e2e else float("nan"),
        "p95_s": e2e[int(0.95 * (len(e2e) - 1) + 0.5)] if e2e else float("nan"),
        "itl_ms": 1e3 * sum((r[1] - r[0]) / (r[2] - 1) for r in ok) / len(ok) if ok else float("nan"),
        "prompt_tokens": sum(r[3] for r in ok) / len(ok) if ok else 0.0,
    }


def predict_cpu(concurrency: int, n_requests: int, prompt_tokens: int, max_tokens: int) -> tuple[float, float, float]:
    spec = build_spec(profile="cpu")
    res = closed_loop(spec, concurrency, n_requests, prompt_tokens, max_tokens)
    return res.mean_ttft * 1e3, res.mean_itl * 1e3, res.throughput


@contextlib.contextmanager
def cpu_lock():
    with open(LOCK_PATH, "w") as f:
        t0 = time.monotonic()
        fcntl.flock(f, fcntl.LOCK_EX)
        print(f"# holding {LOCK_PATH} (waited {time.monotonic() - t0:.0f}s)", file=sys.stderr)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def vllm_server(url: str | None):
    if url:
        yield url.rstrip("/").removesuffix("/v1")
        return
    from usefulwork.backends.local import LocalVLLM
    from usefulwork.backends.model import ensure_model

    server = LocalVLLM(model_dir=ensure_model(), served_name=MODEL_NAME, port=18990,
                       log_path=Path("/tmp/usefulwork-sim-calibration-vllm.log"))
    server.start()
    try:
        server.wait_ready(timeout_s=900, progress=lambda m: print("#", m, file=sys.stderr))
        yield server.base_url
    finally:
        server.stop()


OPEN_LOOP_RATES = (0.4, 0.6)


def open_loop_table(vllm_url: str | None) -> str:
    from usefulwork.backends.sim.offline import open_loop, poisson_arrivals

    rows = ["| rate req/s | ok meas / pred | dropped meas / pred | p50 e2e s meas / pred | p95 e2e s meas / pred "
            "| ITL ms meas / pred |", "|---|---|---|---|---|---|"]
    with cpu_lock(), vllm_server(vllm_url) as url:
        for rate in OPEN_LOOP_RATES:
            arrivals = poisson_arrivals(rate, 60.0, seed=1)
            deadline = time.monotonic() + 60
            while server_busy(url) > 0 and time.monotonic() < deadline:
                time.sleep(0.5)
            m = asyncio.run(measure_open_loop(url, arrivals, 385, 128, 30.0))
            print(f"# open loop {rate}: {m}", file=sys.stderr)
            p = open_loop(build_spec(profile="cpu"), arrivals, round(m["prompt_tokens"]) or 480, 128, 30.0)
            itl = sum(r.itl for r in p.ok) / len(p.ok) * 1e3 if p.ok else float("nan")
            rows.append(f"| {rate} | {m['ok']} / {len(p.ok)} | {m['dropped']} / {p.dropped} "
                        f"| {m['p50_s']:.1f} / {p.percentile_e2e(0.5):.1f} | {m['p95_s']:.1f} / {p.percentile_e2e(0.95):.1f} "
                        f"| {m['itl_ms']:.1f} / {itl:.1f} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------
# Host cost of the simulator itself (how far --time-scale can go on this machine)
# ---------------------------------------------------------------------------------------------
def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive_streams(url: str, concurrency: int, seconds: float) -> int:
    tokens = 0
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def worker(i: int) -> None:
            nonlocal tokens
            while time.monotonic() < deadline:
                body = {"model": "sim", "prompt": f"client {i}", "max_tokens": 128, "ignore_eos": True, "stream": True}
                async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass
                tokens += 128

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return tokens


def host_cost(scales: list[float], concurrency: int, seconds: float) -> str:
    """Stream through a real `usefulwork sim` process (A100-80G, Llama-3.1-8B); report its CPU and lag."""
    from usefulwork.backends.sim.process import SimProcess

    rows = ["| time scale | streams | tokens/s (wall) | sim CPU % of one core | CPU us per token | clock lag % |",
            "|---|---|---|---|---|---|"]
    for scale in scales:
        with cpu_lock(), SimProcess(served_name="sim", port=18991, time_scale=scale) as sim:
            cpu0, t0 = _proc_cpu_s(sim.proc.pid), time.monotonic()
            tokens = asyncio.run(_drive_streams(sim.base_url, concurrency, seconds))
            wall, cpu = time.monotonic() - t0, _proc_cpu_s(sim.proc.pid) - cpu0
            info = httpx.get(f"{sim.base_url}/sim/info", timeout=5).json()
        rows.append(f"| {scale:g} | {concurrency} | {tokens / wall:.0f} | {100 * cpu / wall:.0f} | "
                    f"{1e6 * cpu / tokens:.0f} | {100 * info['lag_s'] / max(info['sim_now'], 1e-9):.1f} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------
def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def table(points: list[Point]) -> str:
    head = ("| reference | conc | TTFT ms meas / pred (err) | ITL ms meas / pred (err) | tok/s meas / pred (err) "
            "| within 15% |\n|---|---|---|---|---|---|")
    rows = []
    for p in points:
        e = p.errors()
        rows.append(
            f"| {p.reference} | {p.concurrency} "
            f"| {fmt(p.measured_ttft_ms, '.0f')} / {p.predicted_ttft_ms:.0f} ({fmt(e['ttft'], '+.0f')}%) "
            f"| {p.measured_itl_ms:.1f} / {p.predicted_itl_ms:.1f} ({fmt(e['itl'], '+.1f')}%) "
            f"| {fmt(p.measured_tok_s, '.0f')} / {p.predicted_tok_s:.0f} ({fmt(e['tok_s'], '+.1f')}%) "
            f"| {'yes' if p.within_target() else 'NO'} |"
        )
    return head + "\n" + "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-url", default=os.environ.get("USEFULWORK_TEST_VLLM_URL"))
    ap.add_argument("--skip-cpu", action="store_true", help="only the published A10G points (no measurement)")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--all-a10g", action="store_true", help="also the published points at 2, 4, 8, 32")
    ap.add_argument("--nominal", action="store_true",
                    help="also predict at llmperf's nominal concurrency (what a client without the wave bug sees)")
    ap.add_argument("--a10g-requests", type=int, default=0, help="requests per A10G point (default: max(150, 8 x conc))")
    ap.add_argument("--open-loop", action="store_true",
                    help="also the cost experiment's shape: Poisson 0.4/0.6 req/s for 60 s, 480 in / 128 out, "
                         "30 s client timeout, naive (max_num_seqs 1) at 0.1 req/s (real vs simulated)")
    ap.add_argument("--host-cost", action="store_true",
                    help="also measure the simulator's own CPU cost per streamed token and clock lag")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--reuse-measured", type=Path, default=None,
                    help="take the CPU measurements from an earlier --json file instead of measuring "
                         "(for iterating on the model; the table then says so)")
    args = ap.parse_args()

    points: list[Point] = []
    for ref in A10G_POINTS:
        if not (ref["target"] or args.all_a10g):
            continue
        c = effective_concurrency(ref)
        n = args.a10g_requests or max(150, 8 * c)
        ttft, itl, tput = predict_a10g(c, n)
        points.append(Point(f"A10G llmperf (published), effective conc {c}", ref["concurrency"], ref["ttft_ms"], ttft,
                            ref["itl_ms"], itl, ref["tok_s"], tput))
        if args.nominal:
            ttft, itl, tput = predict_a10g(ref["concurrency"], max(150, 8 * ref["concurrency"]))
            points.append(Point("A10G llmperf (published), NOMINAL conc (info)", ref["concurrency"], ref["ttft_ms"],
                                ttft, ref["itl_ms"], itl, ref["tok_s"], tput))

    measured: dict[tuple, dict] = {}
    if args.reuse_measured:
        old = json.loads(args.reuse_measured.read_text())
        for p in old:
            if p["reference"].startswith("CPU"):
                measured[(p["concurrency"], p["output_tokens"])] = {
                    "ttft_ms": p["measured_ttft_ms"], "itl_ms": p["measured_itl_ms"], "tok_s": p["measured_tok_s"],
                    "n": p["n"], "prompt_tokens": p["prompt_tokens"]}
        print(f"# CPU measurements REUSED from {args.reuse_measured}, not measured in this run")
    elif not args.skip_cpu:
        with cpu_lock(), vllm_server(args.vllm_url) as url:
            for c, words, out, _role in CPU_POINTS:
                n = max(8, args.requests_per_client * c)
                measured[(c, out)] = measure_cpu_clean(url, c, n, words, out)
                print(f"# measured c={c} out={out}: {measured[(c, out)]}", file=sys.stderr)
    for c, _words, out, role in CPU_POINTS:
        m = measured.get((c, out))
        if m is None:
            continue
        ttft, itl, tput = predict_cpu(c, m["n"], round(m["prompt_tokens"]), out)
        points.append(Point(f"CPU vLLM SmolLM2-135M (measured) {round(m['prompt_tokens'])} in/{out} out, {role}", c,
                            m["ttft_ms"], ttft, m["itl_ms"], itl, m["tok_s"], tput, n=m["n"],
                            prompt_tokens=m["prompt_tokens"], output_tokens=out))

    print(f"# machine: {platform.machine()} {os.cpu_count()} cores, {platform.python_version()}, "
          f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(table(points))
    ok = all(p.within_target() for p in points if "(info)" not in p.reference)
    print(f"\ntarget (throughput and ITL within 15% at every point): {'MET' if ok else 'MISSED'}")
    if args.open_loop:
        print("\n# open loop (Poisson), 480-token prompts, 128 output tokens, 30 s client timeout, 60 s of arrivals")
        print(open_loop_table(args.vllm_url))
    if args.host_cost:
        print("\n# simulator host cost (client and sim on the same 2 cores; the client is Python httpx)")
        print(host_cost([1.0, 10.0, 50.0], 64, 8.0))
    if args.json:
        args.json.write_text(json.dumps([{**asdict(p), "errors_pct": p.errors()} for p in points], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
