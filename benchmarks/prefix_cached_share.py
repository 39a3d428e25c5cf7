"""Approximate vs precise prefix routing: share of prompt tokens served from the prefix cache.

    python benchmarks/prefix_cached_share.py [--replicas 2] [--json FILE]

The issue asks for this on two real local vLLM replicas (CPU). The development machine has two
shared cores and one shared vLLM, so two more real servers cannot run here; this script uses two
simulated servers of the `cpu` profile (SmolLM2-135M as vLLM runs it on this CPU: block size 128,
the real tokenizer and chat template) with their KV caches cut so that the workload's prefixes
about fill the two caches together. The simulators publish vLLM's KV-cache events, so the precise
picker runs for real. Each picker routes the same seeded request sequence (shared-prefix groups,
chat, a common system prompt per group), one request at a time per client, 4 clients; every
request's ``cached_tokens`` is what the server reported. The offline oracle computed from the
requests: each group's first request misses, every later one finds its whole prefix (block-rounded),
i.e. an ideal router with enough cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import httpx

from usefulwork.backends.sim.process import SimProcess
from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.pipeline import Call
from usefulwork.routers.config import PickerCfg
from usefulwork.upstream.fleet import Replica
from usefulwork.upstream.pickers import LeastLoaded, PrefixPicker, RoundRobin, load_tokenizer


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(groups: int, per_group: int, prefix_words: int, seed: int = 0) -> list[tuple[int, dict]]:
    rng = random.Random(seed)
    vocab = "service cache order policy refund shipping account billing invoice region latency replica".split()
    systems = [f"Team {g} handbook. " + " ".join(rng.choice(vocab) for _ in range(prefix_words)) for g in range(groups)]
    order = [g for g in range(groups) for _ in range(per_group)]
    rng.shuffle(order)
    out = []
    for i, g in enumerate(order):
        out.append((g, {"model": "smollm2", "max_tokens": 4, "messages": [
            {"role": "system", "content": systems[g]}, {"role": "user", "content": f"Question {i}: " + rng.choice(vocab)}]}))
    return out


async def run_cell(picker, replicas: list[Replica], reqs: list[tuple[int, dict]], clients: int) -> dict:
    queue = list(reversed(reqs))
    prompt = cached = 0
    async with httpx.AsyncClient(timeout=120) as http:
        async def client() -> None:
            nonlocal prompt, cached
            while queue:
                _, body = queue.pop()
                c = Call(RequestContext(id="b", endpoint="chat", model="smollm2", stream=False), "chat",
                         b"/v1/chat/completions", body, None, None, [])
                r = picker.pick(c, replicas)[0]
                r.inflight += 1
                try:
                    usage = (await http.post(f"{r.url}/v1/chat/completions", json=body)).json()["usage"]
                finally:
                    r.inflight -= 1
                c.ctx.usage_source = "backend"
                c.ctx.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                if hasattr(picker, "feedback"):
                    picker.feedback(c, r)
                prompt += usage["prompt_tokens"]
                cached += c.ctx.cached_tokens
        await asyncio.gather(*(client() for _ in range(clients)))
    out = {"prompt_tokens": prompt, "cached_tokens": cached, "cached_share": round(cached / prompt, 4)}
    if hasattr(picker, "stats"):
        st = picker.stats()
        out["self_check_accuracy"] = st["accuracy"]
    return out


def oracle(reqs: list[tuple[int, dict]], tok, block: int) -> float:
    seen: set[int] = set()
    prompt = cached = 0
    prefix_tokens = {}
    for g, body in reqs:
        ids = tok.encode_chat(body["messages"])
        prompt += len(ids)
        if g not in prefix_tokens:
            prefix_tokens[g] = len(tok.encode_chat(body["messages"][:1], add_generation_prompt=False))
        if g in seen:
            cached += min(prefix_tokens[g], len(ids) - 1) // block * block
        seen.add(g)
    return cached / prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--groups", type=int, default=40)
    ap.add_argument("--per-group", type=int, default=6)
    ap.add_argument("--prefix-words", type=int, default=1400)
    ap.add_argument("--blocks", type=int, default=256, help="KV blocks per simulated server (128 tokens each)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    reqs = workload(args.groups, args.per_group, args.prefix_words)
    tok = load_tokenizer("sim")
    logs = Path(tempfile.mkdtemp(prefix="prefix-share-"))
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "replicas": args.replicas,
                     "requests": len(reqs), "groups": args.groups,
                     "kv_tokens_per_replica": args.blocks * 128,
                     "prefix_demand_tokens": args.groups * len(tok.encode_chat(reqs[0][1]["messages"][:1], add_generation_prompt=False)),
                     "oracle_cached_share": round(oracle(reqs, tok, 128), 4), "cells": {}}
    makers = {
        "round-robin": lambda eps: RoundRobin(),
        "least-loaded": lambda eps: LeastLoaded(),
        "approximate-chars": lambda eps: PrefixPicker(PickerCfg(kind="prefix", block_tokens=128)),
        "approximate-tokens": lambda eps: PrefixPicker(PickerCfg(kind="prefix", block_tokens=128), tokenizer=tok),
        "precise": lambda eps: __import__("usefulwork.upstream.kv_events", fromlist=["x"]).PrecisePrefixPicker(
            PickerCfg(kind="precise-prefix", block_tokens=128, kv_events_endpoints=eps), tokenizer=tok),
    }
    for name, make in makers.items():
        sims, eps = [], {}
        for i in range(args.replicas):
            zport = free_port()
            sim = SimProcess(profile="cpu", served_name="smollm2", port=free_port(), time_scale=args.time_scale, seed=i,
                             extra={"num_gpu_blocks_override": args.blocks, "kv_events_config": json.dumps(
                                 {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{zport}"})},
                             log_path=logs / f"{name}-{i}.log")
            sims.append(sim)
            eps[sim.base_url] = f"tcp://127.0.0.1:{zport}"
        for s in sims:
            s.start()
        try:
            for s in sims:
                s.wait_ready(120)
            picker = make(eps)

            async def cell() -> dict:
                if hasattr(picker, "start"):
                    picker.start()
                    await asyncio.sleep(0.3)
                res = await run_cell(picker, [Replica(s.base_url, "p", healthy=True) for s in sims], reqs, args.clients)
                if hasattr(picker, "stop"):
                    await picker.stop()
                return res

            results["cells"][name] = asyncio.run(cell())
            print(name, results["cells"][name], flush=True)
        finally:
            for s in sims:
                s.stop()
    pc = results["cells"]["precise"]["cached_share"]
    for k in ("approximate-chars", "approximate-tokens"):
        results[f"{k}_vs_precise"] = round(results["cells"][k]["cached_share"] / pc, 4) if pc else None
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
