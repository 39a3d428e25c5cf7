"""Decision time of the cascade routers and the prefix picker (issue 11 targets).

    python benchmarks/routing_decisions.py [--json FILE]

- heuristic: ``HeuristicRouter.decide_body`` on the project's labeled prompts (target p99 <= 50 us);
- classifier: a 200-token prompt embedded with all-MiniLM-L6-v2 (one request at a time, through the
  async batched embedder as the request path does) plus the head (target p99 <= 15 ms); wall time,
  and the process's CPU time per decision (all threads);
- prefix picker: ``PrefixPicker.pick`` over 16 replicas whose indexes hold many long prefixes
  (target p99 <= 100 us for scoring); prompt hashing is reported separately (characters mode and
  tokens mode) because it is per request, not per replica.

Times are wall-clock per call on this machine; it is shared, so p99 carries other tenants' noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import time
from importlib import resources

import numpy as np

from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.pipeline import Call
from usefulwork.routers.config import HeuristicCfg, PickerCfg
from usefulwork.routers.heuristic import HeuristicRouter
from usefulwork.routers.labeled import read_labeled
from usefulwork.upstream.fleet import Replica
from usefulwork.upstream.pickers import PrefixPicker

LABELED = str(resources.files("usefulwork.routers").joinpath("data/labeled_prompts.jsonl"))


def pct(samples_ns: list[int]) -> dict[str, float]:
    a = np.asarray(samples_ns, dtype=np.float64) / 1000.0
    return {"n": len(a), "p50_us": round(float(np.percentile(a, 50)), 2), "p99_us": round(float(np.percentile(a, 99)), 2),
            "max_us": round(float(a.max()), 2)}


def bench_heuristic(n: int = 20000) -> dict:
    r = HeuristicRouter(HeuristicCfg())
    bodies = [e.body for e in read_labeled(LABELED)]
    out = []
    for i in range(n):
        b = bodies[i % len(bodies)]
        t = time.perf_counter_ns()
        r.decide_body(b)
        out.append(time.perf_counter_ns() - t)
    return pct(out[1000:])


def prompt_200_tokens(rng: random.Random) -> str:
    words = "the service returns an error when the cache is cold and the request carries a large payload".split()
    return " ".join(rng.choice(words) for _ in range(185)) + " Explain why and propose a fix?"


CLASSIFIER_VARIANTS = ("onnx-int8:48:12", "onnx-int8:128", "onnx-int8:256", "torch:256")


def bench_classifier(n: int = 300, variants: tuple[str, ...] = CLASSIFIER_VARIANTS) -> dict:
    """Each variant (backend:max_tokens[:head_tokens]; the shipped one is onnx-int8:48:12, the first
    12 and last 36 tokens; before it onnx-int8:128, the first 128; the original torch:256) decides
    the same prompts, interleaved, so machine noise falls on all alike."""
    from usefulwork.embedding import Embedder
    from usefulwork.routers.classifier import ClassifierRouter, Head

    routers = {}
    for v in variants:
        backend, max_tokens, *head = v.split(":")
        routers[v] = ClassifierRouter(Head.load(), embedder=Embedder(backend=backend, threads=1).load(),
                                      max_tokens=int(max_tokens), head_tokens=int(head[0]) if head else None)
    rng = random.Random(0)
    n_tokens = next(iter(routers.values())).embedder.tokenize([prompt_200_tokens(rng)])[2][0]
    wall: dict[str, list[int]] = {v: [] for v in variants}
    cpu: dict[str, list[int]] = {v: [] for v in variants}

    async def run() -> None:
        for _ in range(n + 20):
            body = {"messages": [{"role": "user", "content": prompt_200_tokens(rng)}]}
            for v, router in routers.items():
                c = Call(RequestContext(id="b", endpoint="chat", model="auto", stream=False), "chat", b"", body, None,
                         None, [])
                t, tc = time.perf_counter_ns(), time.process_time_ns()
                await router.decide(c)
                wall[v].append(time.perf_counter_ns() - t)
                cpu[v].append(time.process_time_ns() - tc)

    asyncio.run(run())
    # CPU time of the whole process per decision (all threads): robust to other tenants of the
    # machine, where wall time is not
    return {v: {**pct(wall[v][20:]), "cpu": pct(cpu[v][20:]), "prompt_tokens": n_tokens} for v in variants}


def bench_prefix(n: int = 20000, replicas: int = 16) -> dict:
    rng = random.Random(0)
    rs = [Replica(f"http://r{i}", "p", healthy=True, running=rng.randint(0, 30), waiting=rng.randint(0, 5),
                  kv_usage=rng.random()) for i in range(replicas)]
    p = PrefixPicker(PickerCfg(kind="prefix"))
    groups = [f"System prompt of group {g}. " + " ".join(f"instruction {g}-{k}" for k in range(300)) for g in range(200)]

    def call(i: int) -> Call:
        g = groups[i % len(groups)]
        body = {"messages": [{"role": "system", "content": g}, {"role": "user", "content": f"question {i}"}]}
        return Call(RequestContext(id="b", endpoint="chat", model="m", stream=False), "chat", b"", body, None, None, [])

    for i in range(4000):  # warm the indexes: every replica holds many prefixes
        p.pick(call(i), rs)
    hash_ns, score_ns, pick_ns = [], [], []
    calls = [call(i) for i in range(n)]
    for c in calls:
        t = time.perf_counter_ns()
        h = p.hashes(c)
        hash_ns.append(time.perf_counter_ns() - t)
        t = time.perf_counter_ns()
        p.scores(h, rs)
        score_ns.append(time.perf_counter_ns() - t)
        t = time.perf_counter_ns()
        p.pick(c, rs)
        pick_ns.append(time.perf_counter_ns() - t)
    from usefulwork.backends.sim.tokens import load_tokenizer
    tp = PrefixPicker(PickerCfg(kind="prefix"), tokenizer=load_tokenizer(None))
    tok_ns = []
    for c in [call(i) for i in range(300)]:
        t = time.perf_counter_ns()
        tp.hashes(c)
        tok_ns.append(time.perf_counter_ns() - t)
    blocks = len(p.hashes(calls[0]))
    return {"replicas": replicas, "prompt_chars": len(groups[0]), "blocks": blocks,
            "score_16_replicas": pct(score_ns), "pick_incl_index_update": pct(pick_ns),
            "hash_chars_mode": pct(hash_ns), "hash_tokens_mode": pct(tok_ns)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", choices=("heuristic", "prefix", "classifier"), default=None)
    ap.add_argument("--n", type=int, default=300, help="classifier decisions per variant")
    ap.add_argument("--variants", nargs="+", default=list(CLASSIFIER_VARIANTS), help="classifier backend:max_tokens")
    args = ap.parse_args()
    res = {"machine": f"{platform.machine()} {platform.processor() or ''} (shared 2-core VM)".strip(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_average": os.getloadavg()}
    benches = {"heuristic": bench_heuristic, "prefix": bench_prefix,
               "classifier": lambda: bench_classifier(args.n, tuple(args.variants))}
    for name, fn in benches.items():
        if args.only in (None, name):
            res[name] = fn()
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
