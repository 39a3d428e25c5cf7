"""How close is close enough: a cosine threshold per model, raised per entry and per model by feedback.

Inspired by vCache (Schroeder et al., 2025: per-embedding thresholds learned under a user-set error
bound), simplified to what a gateway observes: every semantic hit is recorded with its score, and a
client may report a hit as bad (``POST /usefulwork/cache/feedback``). Then

- the entry that answered badly needs more than that score from now on (its own threshold rises
  just above it), so one reported mistake is never repeated by that entry;
- the model's threshold rises to the lowest value at which the share of reported hits among the
  recorded ones (last ``WINDOW`` hits) is within ``error_bound``: the bound holds on what was served.

The configured threshold is the floor; ``max_threshold`` the ceiling. State is per gateway process.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from usefulwork.caches.config import SemanticCfg

WINDOW = 10_000  # recent semantic hits per model that feedback is judged on
RECENT_HITS = 50_000  # hits a client may still report (by request id)
STEP = 1e-3  # how far above a bad hit's score the entry's threshold goes


class ThresholdPolicy:
    def __init__(self, cfg: SemanticCfg):
        self.cfg = cfg
        self._model: dict[str, float] = {}  # raised model thresholds
        self._entry: dict[str, float] = {}  # raised entry thresholds (exact key -> cosine)
        self._scores: dict[str, deque[list]] = {}  # model -> [score, bad] of recent hits
        self._hits: OrderedDict[str, tuple[str, str, str, list]] = OrderedDict()  # request id -> (tenant, model, key, record)
        self.reports = 0

    def threshold(self, model: str, key: str | None = None) -> float:
        t = self._model.get(model) or self.cfg.threshold_for(model)
        if key is not None:
            t = max(t, self._entry.get(key, 0.0))
        return t

    def floor(self, model: str) -> float:
        """The lowest threshold any entry of this model may answer at (gates the index search)."""
        return self._model.get(model) or self.cfg.threshold_for(model)

    def record_hit(self, request_id: str, tenant: str, model: str, key: str, score: float) -> None:
        rec = [score, False]
        self._scores.setdefault(model, deque(maxlen=WINDOW)).append(rec)
        self._hits[request_id] = (tenant, model, key, rec)
        if len(self._hits) > RECENT_HITS:
            self._hits.popitem(last=False)

    def report_bad(self, request_id: str, tenant: str) -> dict | None:
        """A client says the semantic hit answering ``request_id`` was wrong; None if no such hit of theirs."""
        hit = self._hits.get(request_id)
        if hit is None or hit[0] != tenant:
            return None
        _, model, key, rec = hit
        if not rec[1]:
            rec[1] = True
            self.reports += 1
            self._entry[key] = min(self.cfg.max_threshold, max(self._entry.get(key, 0.0), rec[0] + STEP))
            self._model[model] = self._fit(model)
        return {"model": model, "entry_threshold": self._entry[key], "model_threshold": self.threshold(model)}

    def _fit(self, model: str) -> float:
        """Lowest threshold >= the configured one whose served hits are within the error bound.

        With recorded hits sorted by score (best first), a threshold just above the n-th score serves
        exactly the first n; the answer is the largest n whose bad share is within the bound.
        """
        recs = sorted(self._scores.get(model, ()), key=lambda r: r[0], reverse=True)
        base = self.cfg.threshold_for(model)
        served, bad = 0, 0
        for n, (_, is_bad) in enumerate(recs, 1):
            bad += is_bad
            if bad <= self.cfg.error_bound * n:
                served = n
        t = base if served == len(recs) else recs[served][0] + STEP
        return min(self.cfg.max_threshold, max(base, t))

    def stats(self) -> dict:
        return {"bad_hit_reports": self.reports, "raised_entries": len(self._entry),
                "model_thresholds": {m: round(self.threshold(m), 4) for m in self._scores}}
