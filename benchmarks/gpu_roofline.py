"""The simulator's step-time roofline against a real GPU: Llama-3.1-8B-shaped engine steps, timed.

The simulator (usefulwork/backends/sim/timing.py) prices an engine step as
``overhead + max(memory, compute)`` (or the overlap below), with memory = weights / (HBM x hbm_efficiency) + KV read /
(HBM x hbm_efficiency x kv_efficiency) and compute = FLOPs / (peak x mfu). For the H100 and H200 the
three efficiencies in catalog.yaml were guesses. This script measures them.

``measure`` runs on a CUDA machine with PyTorch alone (no usefulwork, no vLLM, no hub): a Llama-3.1-8B
forward pass written out in PyTorch (bf16, random weights: timing does not depend on their values;
fused QKV and gate/up projections as vLLM has them; grouped-query attention through PyTorch's fused
scaled-dot-product kernels; logits for the last token of each sequence only) over the step shapes an
engine runs: decode batches at a context length, packed 512-token prefills, and mixed steps (decodes
plus prefills in one step, as vLLM's chunked prefill runs them). Each step is captured in a CUDA graph
and replayed, so kernel time is measured without Python or launch overhead: what is left is the
GPU-side cost of the step, the part the roofline models (vLLM's scheduler and sampler overheads are
the catalog's ``step_overhead_ms`` / ``per_seq_overhead_ms``, not measured here).

    python benchmarks/gpu_roofline.py measure --out roofline.json        # on the GPU machine
    python benchmarks/gpu_roofline.py fit roofline.json --gpu H200       # here: fit and compare

``fit`` fits hbm_efficiency, kv_efficiency, mfu and overlap_p (how memory and compute time combine:
``(memory^p + compute^p)^(1/p)``; max() overlaps them fully, which priced big decode batches and mixed
steps up to 15-23% fast) by least squares of the log error over every measured step, then predicts
each step with the simulator's own ``StepTimer`` and prints the error per step. ``--holdout RUN`` also
predicts another measure run of the same card with that fit: the check on steps the fit never saw.

    python benchmarks/gpu_roofline.py fit docs/bench/gpu-roofline-h200-raw.json --gpu H200 \
        --holdout docs/bench/gpu-roofline-h200-raw-2.json --json docs/bench/gpu-roofline-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

LLAMA_8B = dict(layers=32, hidden=4096, inter=14336, q_heads=32, kv_heads=8, head_dim=128, vocab=128256)
TINY = dict(layers=2, hidden=256, inter=512, q_heads=4, kv_heads=2, head_dim=64, vocab=1000)  # --tiny: a CPU check
PROMPT = 512  # the admission and burst experiments' prompt length

# (decode sequences, their context, packed prefills, each prefill's prompt tokens)
STEPS = ([(b, 640, 0, PROMPT) for b in (1, 8, 32, 128, 256)]
         + [(b, 2048, 0, PROMPT) for b in (1, 8, 32, 128, 256)]
         + [(0, 0, n, PROMPT) for n in (1, 4, 16)]
         + [(64, 640, 4, PROMPT), (256, 640, 4, PROMPT), (128, 640, 16, PROMPT)])
# --long: contexts and prompts the fit never saw (RAG and long-chat traffic), to check how it extrapolates
LONG_STEPS = ([(b, 8192, 0, PROMPT) for b in (1, 8, 32, 64)]
              + [(b, 32768, 0, PROMPT) for b in (1, 4, 16)]
              + [(0, 0, 1, t) for t in (2048, 8192, 32768)] + [(0, 0, 4, 2048)]
              + [(32, 8192, 1, 2048), (8, 32768, 1, 8192)])


# -- measure (GPU machine) --

def measure(args) -> int:
    import torch
    import torch.nn.functional as F

    dev, dt = args.device, torch.bfloat16
    d = TINY if args.tiny else LLAMA_8B
    cuda = dev == "cuda"
    H, I, hd = d["hidden"], d["inter"], d["head_dim"]
    qd, kvd = d["q_heads"] * hd, d["kv_heads"] * hd
    group = d["q_heads"] // d["kv_heads"]
    gen = torch.Generator(device=dev).manual_seed(0)

    def w(*shape):
        t = torch.empty(*shape, device=dev, dtype=dt)
        t.normal_(0.0, 0.02, generator=gen)
        return t

    layers = [dict(ln1=torch.ones(H, device=dev, dtype=dt), wqkv=w(qd + 2 * kvd, H), wo=w(H, qd),
                   ln2=torch.ones(H, device=dev, dtype=dt), wgu=w(2 * I, H), wd=w(H, I)) for _ in range(d["layers"])]
    emb, lm, norm = w(d["vocab"], H), w(d["vocab"], H), torch.ones(H, device=dev, dtype=dt)
    params = sum(t.numel() for L in layers for t in L.values()) + emb.numel() + lm.numel() + norm.numel()

    def attn_prefill(q, k, v):  # q [n, qh, T, hd]; k, v [n, kvh, T, hd]
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        except (TypeError, RuntimeError):
            return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                                  is_causal=True)

    def step(tok, kc, vc, b, ctx, n, prompt):
        """One engine step: ``b`` decodes at context ``ctx`` (KV caches kc/vc per layer) + ``n`` prefills of
        ``prompt`` tokens each."""
        h = F.embedding(tok, emb)  # [b + n*prompt, H]
        nd = b
        for li, L in enumerate(layers):
            a = F.rms_norm(h, (H,), L["ln1"], 1e-5)
            qkv = F.linear(a, L["wqkv"])
            outs = []
            if nd:
                q = qkv[:nd, :qd].view(nd, d["kv_heads"], group, hd)  # GQA decode: a kv head's q heads as rows
                k = qkv[:nd, qd:qd + kvd].view(nd, d["kv_heads"], 1, hd)
                v = qkv[:nd, qd + kvd:].view(nd, d["kv_heads"], 1, hd)
                kc[li][:, :, ctx:ctx + 1].copy_(k)
                vc[li][:, :, ctx:ctx + 1].copy_(v)
                o = F.scaled_dot_product_attention(q, kc[li], vc[li])  # [b, kvh, group, hd]
                outs.append(o.reshape(nd, qd))
            if n:
                p = qkv[nd:].view(n, prompt, -1)
                q = p[..., :qd].view(n, prompt, d["q_heads"], hd).transpose(1, 2)
                k = p[..., qd:qd + kvd].view(n, prompt, d["kv_heads"], hd).transpose(1, 2)
                v = p[..., qd + kvd:].view(n, prompt, d["kv_heads"], hd).transpose(1, 2)
                outs.append(attn_prefill(q, k, v).transpose(1, 2).reshape(n * prompt, qd))
            o = outs[0] if len(outs) == 1 else torch.cat(outs)
            h = h + F.linear(o, L["wo"])
            a = F.rms_norm(h, (H,), L["ln2"], 1e-5)
            g, u = F.linear(a, L["wgu"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(g) * u, L["wd"])
        last = h if not n else torch.cat([h[:nd], h[nd:].view(n, prompt, H)[:, -1]])
        return F.linear(F.rms_norm(last, (H,), norm, 1e-5), lm)

    def timed(fn, reps):
        if not cuda:
            fn()
            out = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            return sorted(out)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(reps):
            s.record()
            fn()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e) / 1e3)
        out.sort()
        return out

    # ceilings on this card, for reference
    side = 8192 if cuda else 256
    a = torch.randn(side, side, device=dev, dtype=dt)
    mm = timed(lambda: a @ a, 10)
    nbytes = 2 * 1024**3 if cuda else 2**20
    big = torch.empty(nbytes, device=dev, dtype=torch.uint8)
    big2 = torch.empty_like(big)
    cp = timed(lambda: big2.copy_(big), 10)
    del a, big, big2
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "params": params,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "matmul_8192_tflops": 2 * side**3 / mm[len(mm) // 2] / 1e12,
           "copy_tbps": 2 * nbytes / cp[len(cp) // 2] / 1e12, "steps": []}
    print(json.dumps({k: v for k, v in res.items() if k != "steps"}), flush=True)
    for b, ctx, n, prompt in STEPS + (LONG_STEPS if args.long else []):
        free = torch.cuda.mem_get_info()[0] if cuda else 1 << 40
        kv_bytes = 2 * d["layers"] * b * d["kv_heads"] * (ctx + 1) * hd * 2
        if kv_bytes + 6 * 1024**3 > free:
            print(f"skip b={b} ctx={ctx} n={n}x{prompt}: KV {kv_bytes / 1e9:.1f} GB > free {free / 1e9:.1f} GB",
                  flush=True)
            continue
        kc = [torch.zeros(b, d["kv_heads"], ctx + 1, hd, device=dev, dtype=dt) for _ in range(d["layers"])] if b else []
        vc = [torch.zeros_like(t) for t in kc]
        for t in kc + vc:
            t.normal_(0.0, 1.0, generator=gen)
        tok = torch.randint(0, d["vocab"], (b + n * prompt,), device=dev, generator=gen)
        with torch.no_grad():
            if cuda:
                warm = torch.cuda.Stream()
                warm.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(warm):
                    for _ in range(3):
                        step(tok, kc, vc, b, ctx, n, prompt)
                torch.cuda.current_stream().wait_stream(warm)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step(tok, kc, vc, b, ctx, n, prompt)
                ts = timed(graph.replay, args.reps)
            else:
                graph = None
                ts = timed(lambda: step(tok, kc, vc, b, ctx, n, prompt), 2)
        row = {"decode_seqs": b, "context": ctx, "prefills": n, "prompt": prompt, "prefill_tokens": n * prompt,
               "p50_ms": ts[len(ts) // 2] * 1e3, "min_ms": ts[0] * 1e3, "max_ms": ts[-1] * 1e3}
        res["steps"].append(row)
        print(json.dumps(row), flush=True)
        del graph, kc, vc, tok
        if cuda:
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


# -- fit (here) --

def _prompt(row: dict) -> int:
    return row.get("prompt", PROMPT)  # runs before --long timed 512-token prompts alone


def _plan(row: dict):
    from usefulwork.backends.sim.scheduler import ScheduledItem, StepPlan

    b, ctx, n, prompt = row["decode_seqs"], row["context"], row["prefills"], _prompt(row)
    items = [ScheduledItem(None, num_new_tokens=1, context_before=ctx) for _ in range(b)]
    items += [ScheduledItem(None, num_new_tokens=prompt, context_before=0) for _ in range(n)]
    return StepPlan(items=items, preempted=[], num_prefill_tokens=n * prompt, num_decode_tokens=b)


def _timer(gpu: str, cal: dict):
    """The simulator's step timer for ``gpu`` with calibration ``cal`` and no CPU-side overheads."""
    from usefulwork.backends.sim.catalog import build_spec, with_calibration
    from usefulwork.backends.sim.timing import StepTimer

    spec = with_calibration(build_spec(gpu=gpu, model="Llama-3.1-8B"), **cal, step_overhead_ms=0.0,
                            per_seq_overhead_ms=0.0)
    return StepTimer(spec), spec


def _kernel_s(timer, row) -> float:
    return timer.cost(_plan(row)).seconds


CAL_KEYS = ("hbm_efficiency", "kv_efficiency", "mfu", "overlap_p")


def _parts(gpu: str, steps: list[dict]) -> list[tuple[float, float, float]]:
    """Per measured step, its (weight read s, KV read s, compute s) at efficiencies of 1: the calibration
    then scales them, so the fit needs no step timer per trial."""
    tm, _ = _timer(gpu, {"hbm_efficiency": 1.0, "kv_efficiency": 1.0, "mfu": 1.0})
    out = []
    for r in steps:
        c = tm.cost(_plan(r))
        weights = tm.weight_bytes_read(r["decode_seqs"] + r["prefills"] * _prompt(r)) / tm._bw
        out.append((weights, c.memory_s - weights, c.compute_s))
    return out


def _predict(cal: list[float], parts) -> "np.ndarray":
    import numpy as np

    from usefulwork.backends.sim.timing import combine

    hbm, kv, mfu, p = cal
    return np.array([combine(w / hbm + k / (hbm * kv), c / mfu, p) for w, k, c in parts])


def _fit_all(gpu: str, steps: list[dict]) -> dict[str, float]:
    """hbm, kv, mfu and overlap_p minimising the squared log error over every measured step (Nelder-Mead,
    scipy, which sentence-transformers already brings)."""
    import numpy as np
    from scipy.optimize import minimize

    parts = _parts(gpu, steps)
    measured = np.array([r["p50_ms"] / 1e3 for r in steps])

    def loss(x) -> float:
        if min(x[:3]) <= 0 or x[3] < 1.0:
            return 1e9
        return float(np.sum(np.log(_predict(list(x), parts) / measured) ** 2))

    best = minimize(loss, [0.7, 1.1, 0.65, 4.0], method="Nelder-Mead",
                    options={"maxiter": 10000, "xatol": 1e-6, "fatol": 1e-12})
    return {k: round(float(v), 3) for k, v in zip(CAL_KEYS, best.x)}


def _rows(gpu: str, steps: list[dict], label: str, cal: dict) -> list[dict]:
    tm, _ = _timer(gpu, cal)
    out = []
    for r in steps:
        model = _kernel_s(tm, r)
        out.append({"calibration": label, **{k: r[k] for k in ("decode_seqs", "context", "prefills")},
                    "prompt": _prompt(r), "measured_ms": round(r["p50_ms"], 2), "model_ms": round(model * 1e3, 2),
                    "error": round(model / (r["p50_ms"] / 1e3) - 1, 3)})
    return out


def fit(args) -> int:
    res = json.loads(Path(args.results).read_text())
    steps = res["steps"]
    _, spec = _timer(args.gpu, {})
    c = spec.gpu.calibration
    cal0 = {"hbm_efficiency": c.hbm_efficiency, "kv_efficiency": c.kv_efficiency, "mfu": c.mfu,
            "overlap_p": c.overlap_p}
    fitted = _fit_all(args.gpu, steps)
    rows = _rows(args.gpu, steps, "catalog", cal0) + _rows(args.gpu, steps, "fitted", fitted)
    held = []
    for path in args.holdout or []:
        other = json.loads(Path(path).read_text())["steps"]
        held += _rows(args.gpu, other, f"held-out {Path(path).name}", fitted)
    out = {"gpu": args.gpu, "device": res["device"], "date": res["date"], "torch": res["torch"],
           "matmul_8192_tflops": round(res["matmul_8192_tflops"], 1), "copy_tbps": round(res["copy_tbps"], 2),
           "catalog": cal0, "fitted": fitted, "fitted_from": "every step (least squares of the log error)",
           "rows": rows, "held_out": held}
    print(f"{res['device']}: matmul {out['matmul_8192_tflops']} TFLOP/s, copy {out['copy_tbps']} TB/s")
    print(f"catalog {cal0}\nfitted  {fitted}")
    print(f"{'calibration':<32} {'decode':>6} {'ctx':>5} {'prefills':>10} {'measured ms':>11} {'model ms':>9} {'error':>7}")
    for r in rows + held:
        pre = f"{r['prefills']}x{r['prompt']}" if r["prefills"] else "0"
        print(f"{r['calibration']:<32} {r['decode_seqs']:>6} {r['context']:>5} {pre:>10} "
              f"{r['measured_ms']:>11.2f} {r['model_ms']:>9.2f} {r['error']:>+7.1%}")
    for label in dict.fromkeys(r["calibration"] for r in rows + held):
        errs = [abs(r["error"]) for r in rows + held if r["calibration"] == label]
        print(f"{label}: {sum(e <= 0.10 for e in errs)} of {len(errs)} within 10%, mean |error| "
              f"{sum(errs) / len(errs):.1%}, worst {max(errs):.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="time the steps on this machine's GPU (PyTorch only)")
    m.add_argument("--out", default="roofline.json")
    m.add_argument("--reps", type=int, default=20)
    m.add_argument("--device", default="cuda")
    m.add_argument("--tiny", action="store_true", help="a 2-layer toy model (with --device cpu: checks the code)")
    m.add_argument("--long", action="store_true", help="also time contexts to 32K and prompts to 32K tokens "
                   "(held out of the shipped fit)")
    f = sub.add_parser("fit", help="fit the catalog's efficiencies to a measure run and compare")
    f.add_argument("results")
    f.add_argument("--gpu", default="H200", help="catalog GPU whose bandwidth and peak the fit uses")
    f.add_argument("--json", help="write the fit and the comparison here")
    f.add_argument("--holdout", action="append", help="another measure run of the same card, predicted with the fit")
    args = ap.parse_args(argv)
    return measure(args) if args.cmd == "measure" else fit(args)


if __name__ == "__main__":
    sys.exit(main())
