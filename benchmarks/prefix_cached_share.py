"""Approximate vs precise prefix routing: share of prompt tokens served from the prefix cache.

    python benchmarks/prefix_cached_share.py [--backend sim|vllm] [--replicas 2] [--json FILE]

The issue asks for this on two real local vLLM replicas (CPU). ``--backend vllm`` starts them: the
CPU build serving SmolLM2-135M, each publishing its KV-cache events on an ipc socket, its KV cache
cut to ``--blocks`` blocks of 128 tokens, started once; between cells each server's prefix cache is
emptied through vLLM's ``POST /reset_prefix_cache`` (dev mode), so every picker starts cold.
``--backend sim`` (the default, seconds instead of minutes) uses simulated servers of the `cpu`
profile (SmolLM2-135M as vLLM runs it on this CPU: block size 128, the real tokenizer and chat
template), which publish the same events. Either way the workload's prefixes about fill the two
caches together and the precise picker runs for real. Each picker routes the same seeded request
sequence (shared-prefix groups, chat, a common system prompt per group), one request at a time per
client, 4 clients; every request's ``cached_tokens`` is what the server reported. The offline oracle
computed from the requests: each group's first request misses, every later one finds its whole
prefix (block-rounded), i.e. an ideal router with enough cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path

import httpx

from usefulwork.backends.local import LocalVLLM
from usefulwork.backends.model import ensure_model
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


async def run_cell(picker, replicas: list[Replica], reqs: list[tuple[int, dict]], clients: int,
                   timeout_s: float = 120) -> dict:
    queue = list(reversed(reqs))
    prompt = cached = 0
    per_replica: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        async def client() -> None:
            nonlocal prompt, cached
            while queue:
                _, body = queue.pop()
                c = Call(RequestContext(id="b", endpoint="chat", model="smollm2", stream=False), "chat",
                         b"/v1/chat/completions", body, None, None, [])
                r = picker.pick(c, replicas)[0]
                per_replica[r.url] = per_replica.get(r.url, 0) + 1
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
    out = {"prompt_tokens": prompt, "cached_tokens": cached, "cached_share": round(cached / prompt, 4),
           "requests_per_replica": sorted(per_replica.values(), reverse=True)}
    if hasattr(picker, "stats"):
        st = picker.stats()
        out["self_check_accuracy"] = st["accuracy"]
        out["self_check"] = {k: st[k] for k in ("checked", "over", "under", "predicted_tokens", "cached_tokens")
                             if k in st}
    return out


async def warm(servers: list) -> None:
    """One short request per server, so a cell does not pay a cold server's first-request costs."""
    async with httpx.AsyncClient(timeout=300) as http:
        for srv in servers:
            r = await http.post(f"{srv.base_url}/v1/chat/completions", json={
                "model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "warm up"}]})
            r.raise_for_status()


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
    ap.add_argument("--backend", choices=("sim", "vllm"), default="sim",
                    help="sim: simulated cpu-profile servers; vllm: real CPU vLLM servers (minutes to start)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--groups", type=int, default=40)
    ap.add_argument("--per-group", type=int, default=6)
    ap.add_argument("--prefix-words", type=int, default=1400)
    ap.add_argument("--blocks", type=int, default=256, help="KV blocks per server (128 tokens each)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=20)
    ap.add_argument("--cells", default=None, help="comma-separated pickers to run (default: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    wait_s = 900 if args.backend == "vllm" else 120  # a real CPU vLLM: minutes to start, long prefill steps
    reqs = workload(args.groups, args.per_group, args.prefix_words)
    tok = load_tokenizer("sim")
    logs = Path(tempfile.mkdtemp(prefix="prefix-share-"))
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "backend": args.backend,
                     "replicas": args.replicas,
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
    def start_servers(tag: str) -> tuple[list, dict[str, str]]:
        servers, eps = [], {}
        for i in range(args.replicas):
            if args.backend == "vllm":
                sock = f"ipc://{logs / f'kv-{i}.sock'}"  # vLLM binds ipc endpoints (tcp only on a wildcard host)
                srv = LocalVLLM(model_dir=model_dir, served_name="smollm2", port=free_port(),
                                extra_args=["--num-gpu-blocks-override", str(args.blocks),
                                            "--kv-events-config", json.dumps(
                                                {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": sock})],
                                log_path=logs / f"vllm-{i}.log")
                eps[srv.base_url] = sock
            else:
                zport = free_port()
                srv = SimProcess(profile="cpu", served_name="smollm2", port=free_port(), time_scale=args.time_scale, seed=i,
                                 extra={"num_gpu_blocks_override": args.blocks, "kv_events_config": json.dumps(
                                     {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{zport}"})},
                                 log_path=logs / f"{tag}-{i}.log")
                eps[srv.base_url] = f"tcp://127.0.0.1:{zport}"
            servers.append(srv)
        for srv in servers:
            srv.start()
        try:
            for srv in servers:
                srv.wait_ready(wait_s)
        except BaseException:
            for srv in servers:
                srv.stop()
            raise
        return servers, eps

    def reset(servers: list) -> None:
        """Empty each server's prefix cache; vLLM answers success=false while blocks are still held."""
        for srv in servers:
            for _ in range(30):
                r = httpx.post(srv.base_url + "/reset_prefix_cache", timeout=60)
                r.raise_for_status()
                if r.json().get("success", True):
                    break
                time.sleep(1.0)
            else:
                raise RuntimeError(f"{srv.base_url}: the prefix cache could not be reset")

    if args.cells:
        wanted = set(args.cells.split(","))
        if wanted - set(makers):
            ap.error(f"--cells: unknown {sorted(wanted - set(makers))}; choose from {sorted(makers)}")
        makers = {k: v for k, v in makers.items() if k in wanted}
    shared = None
    if args.backend == "vllm":
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # exposes POST /reset_prefix_cache
        model_dir = ensure_model()
        shared = start_servers("vllm")
        t0 = time.monotonic()
        asyncio.run(warm(shared[0]))
        results["warm_s"] = round(time.monotonic() - t0, 1)
    try:
        for name, make in makers.items():
            servers, eps = shared if shared else start_servers(name)
            try:
                if shared:
                    reset(servers)
                picker = make(eps)

                async def cell() -> dict:
                    if hasattr(picker, "start"):
                        picker.start()
                        await asyncio.sleep(0.3)
                    t = time.monotonic()
                    res = await run_cell(picker, [Replica(s.base_url, "p", healthy=True) for s in servers], reqs,
                                         args.clients, wait_s)
                    res["wall_s"] = round(time.monotonic() - t, 1)
                    if hasattr(picker, "stop"):
                        await picker.stop()
                    return res

                results["cells"][name] = asyncio.run(cell())
                print(name, results["cells"][name], flush=True)
            finally:
                if not shared:
                    for s in servers:
                        s.stop()
    finally:
        if shared:
            for s in shared[0]:
                s.stop()
    pc = results["cells"].get("precise", {}).get("cached_share")
    for k in ("approximate-chars", "approximate-tokens"):
        if k in results["cells"] and pc:
            results[f"{k}_vs_precise"] = round(results["cells"][k]["cached_share"] / pc, 4)
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
