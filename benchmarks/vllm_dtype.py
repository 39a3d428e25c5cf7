"""Streamed-completion throughput and TTFT of one running vLLM server, at concurrency 1 and 8.

Used to compare the local CPU server's weights types (docs/benchmarks.md section 3, "CPU vLLM:
float32 vs bfloat16"): start the server once per ``--dtype``, run this against each, same hour.

    python benchmarks/vllm_dtype.py --url http://127.0.0.1:8000 --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time

import httpx


async def one(client: httpx.AsyncClient, url: str, model: str, i: int, out_tokens: int) -> float:
    body = {"model": model, "prompt": f"request {i} {random.random()} " + "tell me a long story about the sea " * 16,
            "max_tokens": out_tokens, "ignore_eos": True, "stream": True}
    t = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data:"):
                first = time.perf_counter() - t
    return first if first is not None else float("nan")


async def run(url: str, model: str, conc: int, n: int, out_tokens: int) -> dict:
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(timeout=900) as client:
        async def bounded(i: int) -> float:
            async with sem:
                return await one(client, url, model, i, out_tokens)
        t = time.perf_counter()
        ttfts = sorted(await asyncio.gather(*(bounded(i) for i in range(n))))
        wall = time.perf_counter() - t
    return {"concurrency": conc, "requests": n, "output_tok_s": round(n * out_tokens / wall, 1),
            "wall_s": round(wall, 1), "ttft_p50_s": round(ttfts[len(ttfts) // 2], 2), "ttft_max_s": round(ttfts[-1], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--output-tokens", type=int, default=64)
    args = ap.parse_args()
    results = [asyncio.run(run(args.url, args.model, c, n, args.output_tokens)) for c, n in ((1, 4), (8, 24))]
    print(json.dumps({"url": args.url, "load_average": os.getloadavg()[0], "results": results}, indent=1))


if __name__ == "__main__":
    main()
