"""`usefulwork router train | eval`: fit a classifier head, and measure a router on a labeled set.

    usefulwork router train labeled.jsonl --out head.json --target-large-share 0.3
    usefulwork router eval labeled.jsonl [--router classifier|heuristic] [--head head.json]

``eval`` prints the share sent to each tier, the blended cost per 1K requests (tokens estimated at
``--chars-per-token`` characters per token plus ``--output-tokens`` generated, priced per tier) next
to sending everything to the large tier, and the routing accuracy over the rows that have labels.
The labeled format is described in ``usefulwork/routers/labeled.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from usefulwork.routers.labeled import Example, LabeledError, read_labeled

# the router reads 48 tokens of a conversation, its first 12 and its last 36 (docs/benchmarks.md section 6)
DEFAULT_MAX_TOKENS = 48
DEFAULT_HEAD_TOKENS = 12


def configure_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    t = sub.add_parser("train", help="train a classifier head on a labeled JSONL file")
    t.add_argument("labeled", help="labeled JSONL: {\"prompt\"|\"messages\", \"label\": small|large} per line")
    t.add_argument("--out", default="router-head.json", help="where to write the head (JSON)")
    t.add_argument("--target-large-share", type=float, default=0.5,
                   help="share of held-out requests the calibrated threshold sends to the large tier")
    t.add_argument("--seed", type=int, default=0, help="seed of the train/calibration/test split")
    t.add_argument("--c", type=float, default=1.0, help="inverse regularisation strength of the logistic head")
    t.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="tokens of each conversation embedded; stored in the head, which the router then "
                        "embeds the same way")
    t.add_argument("--head-tokens", type=int, default=DEFAULT_HEAD_TOKENS,
                   help="of those, how many from the conversation's start (the rest are its last tokens)")
    e = sub.add_parser("eval", help="evaluate a router on a labeled JSONL file")
    e.add_argument("labeled", help="JSONL in the train format (rows without a label count for shares only)")
    e.add_argument("--router", choices=("classifier", "heuristic"), default="classifier")
    e.add_argument("--head", default=None, help="classifier head JSON (default: the packaged head)")
    e.add_argument("--threshold", type=float, default=None, help="override the router's threshold")
    e.add_argument("--small-usd-per-1m", type=float, default=0.10, help="small tier $ per 1M tokens")
    e.add_argument("--large-usd-per-1m", type=float, default=1.00, help="large tier $ per 1M tokens")
    e.add_argument("--chars-per-token", type=float, default=4.0)
    e.add_argument("--output-tokens", type=int, default=256, help="generated tokens assumed per request")
    e.add_argument("--json", action="store_true", help="print the report as JSON")
    for p in (t, e):
        p.add_argument("--embedding-backend", choices=("onnx-int8", "onnx", "torch"), default="onnx-int8",
                       help="the embedder's backend (config: embedding.backend)")


def embed(examples: list[Example], max_tokens: int | None = None, head_tokens: int | None = None) -> np.ndarray:
    from usefulwork.embedding import shared_embedder  # noqa: PLC0415
    return shared_embedder().encode([e.text for e in examples], max_tokens=max_tokens, head_tokens=head_tokens)


def run_train(args: argparse.Namespace) -> int:
    from usefulwork.routers.classifier import train  # noqa: PLC0415
    examples = read_labeled(args.labeled)
    if not 8 <= args.max_tokens <= 256:
        raise ValueError(f"--max-tokens: {args.max_tokens} out of range [8, 256]")
    if not 1 <= args.head_tokens <= args.max_tokens:
        raise ValueError(f"--head-tokens: {args.head_tokens} out of range [1, --max-tokens]")
    vecs = embed(examples, args.max_tokens, args.head_tokens)
    head = train(examples, vecs, args.target_large_share, seed=args.seed, c=args.c)
    head.meta["trained_on"] = str(args.labeled)
    head.meta["max_tokens"] = args.max_tokens
    head.meta["head_tokens"] = args.head_tokens
    head.meta["embedding_backend"] = _backend()
    with open(args.out, "w") as fh:
        fh.write(head.to_json())
    print(json.dumps({"out": args.out, "threshold": round(head.threshold, 6), **head.meta}, indent=1))
    return 0


def evaluate(examples: list[Example], tiers: list[str], small_usd_per_1m: float, large_usd_per_1m: float,
             chars_per_token: float = 4.0, output_tokens: int = 256) -> dict[str, Any]:
    """Shares, blended cost per 1K requests vs all-large, and accuracy where labels exist."""
    n = len(examples)
    tokens = [len(e.text) / chars_per_token + output_tokens for e in examples]
    price = {"small": small_usd_per_1m, "large": large_usd_per_1m}
    cost = sum(t * price[tier] for t, tier in zip(tokens, tiers)) / 1e6
    all_large = sum(tokens) * large_usd_per_1m / 1e6
    labeled = [(e.label, tier) for e, tier in zip(examples, tiers) if e.label is not None]
    out: dict[str, Any] = {
        "requests": n,
        "share": {k: round(tiers.count(k) / n, 4) for k in ("small", "large")},
        "usd_per_1k_requests": round(cost * 1000 / n, 6),
        "all_large_usd_per_1k_requests": round(all_large * 1000 / n, 6),
        "cost_vs_all_large": round(cost / all_large, 4) if all_large else None,
        "labeled": len(labeled),
    }
    if labeled:
        out["accuracy"] = round(sum(lab == tier for lab, tier in labeled) / len(labeled), 4)
        large_rows = [tier for lab, tier in labeled if lab == "large"]
        out["large_recall"] = round(large_rows.count("large") / len(large_rows), 4) if large_rows else None
    return out


def run_eval(args: argparse.Namespace) -> int:
    examples = read_labeled(args.labeled, require_label=False)
    if args.router == "classifier":
        from usefulwork.routers.classifier import ClassifierRouter, Head  # noqa: PLC0415
        router = ClassifierRouter(Head.load(args.head), args.threshold)
        vecs = embed(examples, router.max_tokens, router.head_tokens)
        tiers = [router.decide_vec(v).tier for v in vecs]
        auroc = _auroc(examples, router.head.probs(vecs))
    else:
        from usefulwork.routers.config import HeuristicCfg  # noqa: PLC0415
        from usefulwork.routers.heuristic import HeuristicRouter  # noqa: PLC0415
        cfg = HeuristicCfg() if args.threshold is None else HeuristicCfg(threshold=args.threshold)
        router = HeuristicRouter(cfg)
        tiers = [router.decide_body(e.body).tier for e in examples]
        auroc = _auroc(examples, np.array([router.score(e.body)[0] for e in examples]))
    report = {"router": args.router, **evaluate(examples, tiers, args.small_usd_per_1m, args.large_usd_per_1m,
                                                args.chars_per_token, args.output_tokens)}
    if auroc is not None:
        report["auroc"] = auroc
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for k, v in report.items():
            print(f"{k:32s} {v}")
    return 0


def _auroc(examples: list[Example], scores: np.ndarray) -> float | None:
    """How well the router's score separates large from small rows (None without both labels)."""
    y = [(e.label == "large", s) for e, s in zip(examples, scores) if e.label is not None]
    pos = [s for lab, s in y if lab]
    neg = [s for lab, s in y if not lab]
    if not pos or not neg:
        return None
    p, n = np.asarray(pos)[:, None], np.asarray(neg)[None, :]
    return round(float((p > n).mean() + 0.5 * (p == n).mean()), 4)


def _backend() -> str:
    from usefulwork.embedding import shared_embedder  # noqa: PLC0415
    return shared_embedder().backend


def run(args: argparse.Namespace) -> int:
    from usefulwork.embedding import EmbeddingCfg, configure_shared  # noqa: PLC0415
    configure_shared(EmbeddingCfg(backend=args.embedding_backend))
    try:
        return run_train(args) if args.action == "train" else run_eval(args)
    except (LabeledError, ValueError) as exc:
        print(f"usefulwork router: {exc}", file=sys.stderr)
        return 2
