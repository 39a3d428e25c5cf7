"""Semantic cache quality on the project's labeled set (benchmarks/data/cache_pairs.yaml).

Every group's question is cached (tenant A, one partition: the worst case, all 60 answers compete);
then every paraphrase (a hit on its own question is right) and every hard negative (negation,
changed number, changed entity, same words reordered, same words another question: any hit is
wrong) is asked through the real ``CacheFilter`` (memory store, real all-MiniLM-L6-v2 embeddings,
the guard, the thresholds). A paraphrase answered by ANOTHER group's entry is a false hit too.
Every paraphrase is also asked as tenant B (must never hit: partitions are per tenant).

Calibration: groups are split in two halves (even/odd). On the calibration half, the threshold is
the lowest whose conformal false-hit share ((false hits + 1) / (probes + 1), guard on) is within
the error bound; the held-out half then
reports its paraphrase hit rate and false-hit share at that threshold.

    python benchmarks/cache_semantic.py [--bound 0.01] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from usefulwork.caches.config import CacheCfg, SemanticCfg  # noqa: E402
from usefulwork.caches.filter import CacheFilter  # noqa: E402
from usefulwork.caches.guard import refusal  # noqa: E402
from usefulwork.embedding import EmbeddingCfg, configure_shared, conversation_text  # noqa: E402
from tests.caches.helpers import FakeUpstream, drive, make_call  # noqa: E402

PAIRS = ROOT / "benchmarks" / "data" / "cache_pairs.yaml"


def load_probes():
    groups = yaml.safe_load(PAIRS.read_text())
    probes = []  # (group, kind, text); kind "para" means a hit on the own group is right
    for g, grp in enumerate(groups):
        probes += [(g, "para", p) for p in grp["para"]]
        probes += [(g, kind, text) for kind, text in grp["neg"]]
    return groups, probes


def text_of(q: str) -> str:
    return conversation_text({"messages": [{"role": "user", "content": q}]})


async def through_filter(groups, probes, vecs, threshold: float, guard: bool = True):
    """Ask every probe through a real CacheFilter; returns per-probe (hit group or None, score)."""
    # What would hit, not who is faster: the lookup runs before the (instant, fake) upstream, and
    # never backs off (semantic.parallel and min_hit_share are about latency, not quality).
    cfg = CacheCfg(semantic=SemanticCfg(threshold=threshold, guard=guard, parallel=False, min_hit_share=0.0))
    f = CacheFilter(cfg=cfg)
    up = FakeUpstream()
    for g, grp in enumerate(groups):
        up.answer = f"answer {g}"
        call = make_call(grp["q"], tenant="A")
        call.memo["embedding"] = vecs[grp["q"]]
        await drive(lambda c: f(c, up), call)
    await f.drain()
    out = []
    for tenant in ("A", "B"):
        for g, kind, text in probes:
            call = make_call(text, tenant=tenant, headers=[(b"cache-control", b"no-store")])
            call.memo["embedding"] = vecs[text]
            reply, body = await drive(lambda c: f(c, up), call)
            hit = None
            if call.ctx.cache.startswith("hit"):
                hit = int(json.loads(body)["choices"][0]["message"]["content"].split()[1])
            out.append((tenant, g, kind, hit))
    return out, f


def score(results, groups_subset=None):
    para = wrong = hardneg = paras = probes_b = hits_b = 0
    by_kind: dict[str, list[int]] = {}
    for tenant, g, kind, hit in results:
        if groups_subset is not None and g not in groups_subset:
            continue
        if tenant == "B":
            probes_b += 1
            hits_b += hit is not None
            continue
        if kind == "para":
            paras += 1
            para += hit == g
            wrong += hit is not None and hit != g
        else:
            hardneg += 1
            wrong += hit is not None
            k = by_kind.setdefault(kind, [0, 0])
            k[0] += hit is not None
            k[1] += 1
    total = paras + hardneg
    return {"paraphrase_hit_rate": round(para / paras, 4) if paras else 0.0,
            "false_hit_share": round(wrong / total, 4) if total else 0.0,
            "false_hits": wrong, "probes": total, "paraphrases": paras, "hard_negatives": hardneg,
            "false_hits_by_kind": {k: f"{v[0]}/{v[1]}" for k, v in sorted(by_kind.items())},
            "cross_tenant_hits": hits_b, "cross_tenant_probes": probes_b}


def offline_sweep(groups, probes, vecs, grid, subset, guard=True):
    """Same decision as the filter (top 4 candidates by cosine, threshold, guard), for a threshold grid."""
    qs = np.stack([vecs[g["q"]] for g in groups])
    rows = []
    for t in grid:
        res = []
        for g, kind, text in probes:
            if g not in subset:
                continue
            s = qs @ vecs[text]
            hit = None
            for c in np.argsort(-s)[:4]:
                if s[c] < t:
                    break
                if guard and refusal(text_of(text), text_of(groups[c]["q"])):
                    continue
                hit = int(c)
                break
            res.append(("A", g, kind, hit))
        rows.append((t, score(res)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bound", type=float, default=0.01)
    ap.add_argument("--json")
    ap.add_argument("--embedding-backend", choices=("onnx-int8", "onnx", "torch"), default="onnx-int8")
    args = ap.parse_args()
    groups, probes = load_probes()
    texts = sorted({g["q"] for g in groups} | {t for _, _, t in probes})
    emb = configure_shared(EmbeddingCfg(backend=args.embedding_backend))
    t0 = time.perf_counter()
    mat = emb.encode([text_of(t) for t in texts])
    print(f"embedded {len(texts)} texts in {time.perf_counter() - t0:.1f} s")
    vecs = dict(zip(texts, mat))
    default = CacheCfg().semantic.threshold
    report = {}
    for name, thr, guard in (("default", default, True), ("default, guard off", default, False),
                             ("GPTCache's 0.8, guard off", 0.8, False), ("0.8, guard on", 0.8, True)):
        results, f = asyncio.run(through_filter(groups, probes, vecs, thr, guard))
        report[name] = {"threshold": thr, "guard": guard, **score(results)}
        if name == "default":
            report[name]["guard_refusals"] = f.stats()["guard_refusals"]
        print(name, json.dumps(report[name]))
    grid = [round(x, 4) for x in np.arange(0.80, 0.99, 0.0025)]
    even = {g for g in range(len(groups)) if g % 2 == 0}
    odd = set(range(len(groups))) - even
    for cal, test, label in ((even, odd, "calibrate on even, test on odd"), (odd, even, "calibrate on odd, test on even")):
        rows = offline_sweep(groups, probes, vecs, grid, cal)
        # conformal-style: (false hits + 1) / (probes + 1) within the bound, so a lucky zero on a
        # small calibration half does not pick a threshold the held-out half then breaks
        ok = [t for t, s in rows if (s["false_hits"] + 1) / (s["probes"] + 1) <= args.bound]
        chosen = min(ok) if ok else max(grid)
        held = offline_sweep(groups, probes, vecs, [chosen], test)[0][1]
        report[label] = {"bound": args.bound, "chosen_threshold": chosen,
                         "calibration": dict(rows)[chosen], "held_out": held,
                         "bound_held": held["false_hit_share"] <= args.bound}
        print(label, json.dumps(report[label]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
