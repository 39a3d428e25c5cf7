"""The response cache's configuration (``Config.cache``): what may be reused, where entries live, how close is close."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SemanticCfg(_Strict):
    """The semantic cache: a hit for a differently worded request that means the same."""

    enabled: bool = Field(True, description="Look up by meaning (embedding of the whole conversation) after an exact miss.")
    threshold: float = Field(0.91, gt=0.0, le=1.0, description="Cosine similarity a cached conversation must reach "
                             "to answer (default for every model; set on the labeled set, docs/caching.md).")
    thresholds: dict[str, float] = Field(default_factory=dict, description="Per-model threshold (model name -> cosine "
                                         "in (0, 1]), overriding `threshold`.")
    guard: bool = Field(True, description="Refuse a hit when numbers, negations, named entities or word order differ "
                        "between the request and the cached one.")
    error_bound: float = Field(0.01, gt=0.0, lt=1.0, description="Target share of bad semantic hits. Feedback "
                               "(POST /usefulwork/cache/feedback) raises the threshold of the entry and of the "
                               "model until the observed rate's upper bound is within it.")
    max_threshold: float = Field(0.995, gt=0.0, le=1.0, description="Feedback never raises a threshold above this.")
    parallel: bool = Field(True, description="Start the upstream request while the semantic lookup runs (a miss "
                           "waits for no embedding; a hit cancels the upstream request, wasting part of one prefill).")
    min_hit_share: float = Field(0.01, ge=0.0, lt=1.0, description="Below this share of hits among the last 200 "
                                 "semantic lookups, only every 10th request is embedded (lookup and stored vector): "
                                 "a semantic cache that does not pay stops costing. 0: always embed.")
    index_min_entries: int = Field(2048, ge=1, description="Partitions with fewer entries are searched exactly "
                                   "(numpy); larger ones through a faiss HNSW index.")

    @field_validator("thresholds")
    @classmethod
    def _in_range(cls, v: dict[str, float]) -> dict[str, float]:
        for model, t in v.items():
            if not 0.0 < t <= 1.0:
                raise ValueError(f"threshold for model {model!r} must be in (0, 1], got {t!r}")
        return v

    def threshold_for(self, model: str) -> float:
        return self.thresholds.get(model, self.threshold)


class CacheCfg(_Strict):
    """Exact and semantic response caches (the ``cache`` filter; docs/caching.md)."""

    redis_url: str | None = Field(None, description="Redis shared by gateway replicas, e.g. redis://127.0.0.1:6379/0; "
                                  "None: in-process memory.")
    namespace: str = Field("uw:cache", min_length=1, description="Prefix of every Redis key the cache writes.")
    ttl_s: float = Field(3600.0, gt=0, description="Lifetime of an entry.")
    max_entries_per_partition: int = Field(10000, ge=1, description="Entries kept per partition (tenant + model + "
                                           "system prompt + parameters); the least recently used go first.")
    max_temperature: float = Field(0.0, ge=0.0, le=2.0, description="Requests sampled hotter than this are not "
                                   "cached unless they fix a `seed` (an absent temperature counts as 1.0).")
    cache_tools: bool = Field(False, description="Cache requests that offer tools.")
    redis_timeout_s: float = Field(0.1, gt=0, description="A Redis call slower than this bypasses the cache for the request.")
    semantic: SemanticCfg = SemanticCfg()
