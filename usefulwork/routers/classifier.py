"""The classifier router: the request's all-MiniLM-L6-v2 vector through a trained logistic head.

The vector comes from ``shared_embedder().embed_call(call, max_tokens, head_tokens)``: computed once
per request. The router reads a window of the conversation (the packaged head: its first 12 and last
36 tokens, 48 in all); the vector is shared with the semantic cache when the conversation fits in that
window (then it is the whole conversation's vector); a longer one is embedded again, whole, by the cache. The head is ``P(large) = sigmoid(w . x + b)`` (384 weights, one bias),
stored as JSON; the large tier is chosen when ``P(large) >= threshold``.

Training (``usefulwork router train``) fits the head with scikit-learn's logistic regression on one
part of a labeled set and calibrates the threshold on a held-out part, as RouteLLM does: the
threshold is the score quantile that sends ``target_large_share`` of the held-out requests to the
large tier. A third, untouched part measures accuracy and the share that threshold really gives.
The default head (``routers/data/default_head.json``) is trained this way on the project's labeled
set (``routers/data/labeled_prompts.jsonl``, written by ``scripts/labeled_prompts.py``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from usefulwork.routers import Decision

if TYPE_CHECKING:
    from usefulwork.gateway.pipeline import Call
    from usefulwork.routers.config import ClassifierCfg
    from usefulwork.routers.labeled import Example

DEFAULT_HEAD = "data/default_head.json"


@dataclass
class Head:
    weights: np.ndarray  # (384,) float32
    bias: float
    threshold: float
    meta: dict[str, Any] = field(default_factory=dict)  # training report: sizes, target share, held-out figures

    def prob(self, vec: np.ndarray) -> float:
        z = float(np.dot(self.weights, vec)) + self.bias
        return 1.0 / (1.0 + math.exp(-z)) if z > -60 else 0.0

    def probs(self, vecs: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-(vecs @ self.weights + self.bias)))

    def to_json(self) -> str:
        return json.dumps({"weights": [round(float(w), 6) for w in self.weights], "bias": self.bias,
                           "threshold": self.threshold, "meta": self.meta}, indent=1)

    @classmethod
    def load(cls, path: str | Path | None = None) -> Head:
        if path is None:
            text = resources.files("usefulwork.routers").joinpath(DEFAULT_HEAD).read_text()
            where = f"usefulwork/routers/{DEFAULT_HEAD}"
        else:
            where = str(path)
            try:
                text = Path(path).read_text()
            except OSError as exc:
                raise ValueError(f"{where}: cannot read classifier head: {exc.strerror}") from None
        try:
            d = json.loads(text)
            w = np.asarray(d["weights"], dtype=np.float32)
            head = cls(w, float(d["bias"]), float(d["threshold"]), dict(d.get("meta") or {}))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{where}: not a classifier head ({type(exc).__name__}: {exc})") from None
        if w.shape != (384,):
            raise ValueError(f"{where}: weights: expected 384 values (all-MiniLM-L6-v2), got {w.shape[0]}")
        return head


def calibrate(scores: np.ndarray, target_large_share: float) -> float:
    """The threshold that sends ``target_large_share`` of these scores to the large tier."""
    if not 0.0 <= target_large_share <= 1.0:
        raise ValueError(f"target_large_share: {target_large_share} out of range [0, 1]")
    if target_large_share <= 0.0:
        return float(np.nextafter(scores.max(), np.inf))
    if target_large_share >= 1.0:
        return float(scores.min())
    s = np.sort(scores)[::-1]
    k = int(round(target_large_share * len(s)))
    k = min(max(k, 1), len(s))
    # between the k-th and (k+1)-th highest score: exactly k of these go large
    return float(s[k - 1] if k == len(s) else (s[k - 1] + s[k]) / 2.0)


def split(n: int, fractions: tuple[float, float], seed: int, labels: list[str]) -> tuple[list[int], list[int], list[int]]:
    """Stratified train / calibration / test index lists (fractions of train and calibration)."""
    rng = np.random.default_rng(seed)
    parts: tuple[list[int], list[int], list[int]] = ([], [], [])
    for lab in sorted(set(labels)):
        idx = [i for i in range(n) if labels[i] == lab]
        rng.shuffle(idx)
        a = int(round(fractions[0] * len(idx)))
        b = a + int(round(fractions[1] * len(idx)))
        parts[0].extend(idx[:a])
        parts[1].extend(idx[a:b])
        parts[2].extend(idx[b:])
    return parts


def train(examples: list[Example], vecs: np.ndarray, target_large_share: float, seed: int = 0,
          fractions: tuple[float, float] = (0.6, 0.2), c: float = 1.0) -> Head:
    """Fit on the train part, calibrate on the calibration part, measure on the test part."""
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415 (training only; not on the request path)

    labels = [e.label or "" for e in examples]
    tr, cal, te = split(len(examples), fractions, seed, labels)
    if not tr or not cal:
        raise ValueError(f"need more examples to split into train/calibration/test (have {len(examples)})")
    y = np.array([lab == "large" for lab in labels], dtype=np.int32)
    if len(set(y[tr])) < 2:
        raise ValueError("the training part needs both labels (small and large)")
    model = LogisticRegression(C=c, max_iter=2000).fit(vecs[tr], y[tr])
    head = Head(model.coef_[0].astype(np.float32), float(model.intercept_[0]), 0.5)
    head.threshold = calibrate(head.probs(vecs[cal]), target_large_share)
    meta: dict[str, Any] = {"model": "all-MiniLM-L6-v2", "target_large_share": target_large_share, "seed": seed,
                            "n_train": len(tr), "n_calibration": len(cal), "n_test": len(te), "C": c}
    for name, idx in (("calibration", cal), ("test", te)):
        if idx:
            large = head.probs(vecs[idx]) >= head.threshold
            meta[f"{name}_large_share"] = round(float(large.mean()), 4)
            meta[f"{name}_accuracy"] = round(float((large == y[idx].astype(bool)).mean()), 4)
    head.meta = meta
    return head


class ClassifierRouter:
    """The head over the request's embedding; the heuristic router answers until the embedder has loaded."""

    name = "classifier"

    def __init__(self, head: Head, threshold: float | None = None, embedder: Any = None,
                 max_tokens: int | None = None, fallback: Any = None, head_tokens: int | None = None):
        self.head = head
        self.threshold = head.threshold if threshold is None else threshold
        # the tokens embedded: as the head was trained (its meta), unless configured
        self.max_tokens = max_tokens if max_tokens is not None else head.meta.get("max_tokens")
        self.head_tokens = head_tokens if head_tokens is not None else head.meta.get("head_tokens")
        self._embedder = embedder
        self.fallback = fallback  # a HeuristicRouter, used while the embedder loads
        self.fallbacks = 0

    @classmethod
    def from_cfg(cls, cfg: ClassifierCfg, fallback: Any = None) -> ClassifierRouter:
        return cls(Head.load(cfg.head_path), cfg.threshold, max_tokens=cfg.max_tokens, fallback=fallback,
                   head_tokens=cfg.head_tokens)

    @property
    def embedder(self) -> Any:
        if self._embedder is None:
            from usefulwork.embedding import shared_embedder  # noqa: PLC0415
            self._embedder = shared_embedder()
        return self._embedder

    def decide_vec(self, vec: np.ndarray) -> Decision:
        p = self.head.prob(vec)
        large = p >= self.threshold
        op = ">=" if large else "<"
        return Decision("large" if large else "small", f"classifier P(large) {p:.3f} {op} {self.threshold:.3f}", p)

    async def decide(self, call: Call) -> Decision:
        emb = self.embedder
        if not emb.loaded and self.fallback is not None:  # never wait for the model: it loads meanwhile
            emb.load_in_background()
            self.fallbacks += 1
            d = self.fallback.decide_body(call.body)
            return Decision(d.tier, f"classifier not loaded yet: {d.reason}", d.score)
        return self.decide_vec(await emb.embed_call(call, self.max_tokens, self.head_tokens))
