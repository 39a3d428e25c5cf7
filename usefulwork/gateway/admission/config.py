"""The ``admission:`` config section (the admission filter's settings; tenants are ``tenants:``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from usefulwork.gateway.tenants import Priority


class AdmissionCfg(BaseModel):
    """Admission control: per-pool queues with priorities, deadlines, fair sharing; tenant limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    deadline_ms: dict[Priority, float] = Field(
        default_factory=lambda: {"batch": 60000.0},
        description="Queueing deadline (time to first token) per priority class; a class not named uses slo.ttft_ms.")
    initial_concurrency: int = Field(8, ge=1, description="Requests in flight per healthy replica before any measurement "
                                     "(or what the replicas already run, if more); the learnt limits are per replica too.")
    max_concurrency: int | None = Field(None, ge=1, description="Optional cap on requests in flight per pool (None: measured only).")
    min_concurrency: int = Field(1, ge=1, description="The adaptive limit never goes below this per pool.")
    target_fraction: float = Field(0.75, gt=0, le=1, description="The limit grows while the tail (tail_quantile) of "
                                   "admitted requests' service TTFT and E2E and the mean TPOT stay under this fraction "
                                   "of the SLO, and shrinks when the TTFT or E2E tail does not (the rest of the SLO is for "
                                   "the queue's wait; the TPOT's cut is tpot_cut_fraction).")
    tpot_cut_fraction: float = Field(0.86, gt=0, le=1, description="The limit is cut when the mean TPOT (of admitted "
                                     "answers, or the replicas' live decode speed) exceeds this fraction of the SLO; between "
                                     "it and target_fraction's the limit holds (no queue wait is part of a TPOT: cut at "
                                     "target_fraction's, a replay of the real CPU vLLM's burst on its probe served 45 of 63 "
                                     "where the band serves 52, all within the SLO). Never below target_fraction (then no band).")
    tail_quantile: float = Field(0.95, gt=0.5, lt=1, description="Quantile of the recent service TTFT and E2E that "
                                 "the limit is judged on (the SLO's own percentile: 0.95 for attainment 95%).")
    tail_window: int = Field(100, ge=20, description="Recent successful requests the tail is taken over (fewer than "
                             "10: the running means are used).")
    prefill_gate: bool = Field(True, description="Also limit the prefills admitted but not yet answered (first token "
                               "not seen) per replica, learnt from each stream's first token against the TTFT target, so "
                               "a burst of long prompts waits (or is shed at arrival) in the gateway instead of queueing "
                               "inside vLLM past its deadline.")
    kv_high: float = Field(0.95, gt=0, le=1, description="KV-cache usage above which a pool is saturated (no growth).")
    reserve_fraction: float = Field(0.1, ge=0, lt=1, description="Share of the SLO limit that batch work leaves free of "
                                    "its fill limit (interactive work also runs on top of batch, within its own SLO limit).")
    tenant_headroom: float = Field(0.1, ge=0, lt=1, description="Share of the SLO limit that a tenant already holding "
                                   "its weighted fair share of it leaves free for the other active tenants, so a quiet "
                                   "tenant finds a slot at once while a heavy one keeps the pool full (0: off).")
    tenant_active_s: float = Field(30.0, gt=0, description="A tenant counts toward the fair shares for this long after "
                                   "its last request.")
    low_band_prefills: int = Field(1, ge=0, description="On a pool whose replicas schedule by priority: while top-band "
                                   "work (interactive, of a tenant within its fair share) was offered in the last "
                                   "tenant_active_s, low-band work (batch and sheddable, or a tenant over its fair share) "
                                   "keeps at most this many prompts per replica pending in vLLM (sent, no first token "
                                   "yet; a tenant over its share only while another tenant has work in the pool or sent some in the last "
                                   "5 s), and none while a top-band prompt is "
                                   "pending, so an interactive prompt does not share its engine step with theirs (0: off).")
    low_band_prefill_chunk: int = Field(0, ge=0, description="With low_band_prefills, on replicas with vLLM's prefix "
                                        "cache (V1's default): while top-band work is about, a low-band chat or "
                                        "completions prompt longer than two pieces is first prefilled in pieces of this "
                                        "many tokens (rounded up to the replica's KV block size): the gateway tokenizes it "
                                        "on the replica (/tokenize) and sends each growing prefix as a one-token completion "
                                        "before the request itself, which then finds them in the prefix cache. An engine "
                                        "step is not preempted: a top-band prompt that arrives during a low-band prefill "
                                        "waits for one piece instead of the whole prompt. A piece waits while a top-band "
                                        "prompt is pending (up to two prefill times), so it does not share that prompt's "
                                        "step. Pieces are cheap where an engine step's fixed cost is small against a "
                                        "prompt's prefill; several pieced prompts per replica (low_band_prefills) keep the "
                                        "batch work's pace (0: off).")
    max_queue: int = Field(4096, ge=0, description="Queued requests per pool beyond which new ones are shed.")
    retry_return_prior: float = Field(0.5, ge=0, le=1, description="Share of a tenant's shed requests assumed to come "
                                      "back at their Retry-After before any of its held places has ended (counted as one "
                                      "ended place; then it is learnt per tenant). Higher spreads a retrying tenant's "
                                      "first wave better and holds more places for a tenant whose clients never return.")
    retry_return_prior_numbered: float = Field(1.0, ge=0, le=1, description="The same, for a tenant whose shed clients "
                                               "number their attempts (`x-stainless-retry-count`, as the OpenAI SDKs do: "
                                               "they retry a 429 after its Retry-After unless told not to); a tenant "
                                               "with both kinds of client starts between the two, in proportion.")
    redis_url: str | None = Field(None, description="Redis shared by all gateway processes for rate limits and budgets "
                                  "(None: per-process limits).")
    redis_prefix: str = Field("usefulwork:admission", description="Prefix of the Redis keys.")
    on_redis_down: Literal["open", "closed"] = Field("open", description="Redis unreachable: 'open' keeps serving with "
                                                     "per-process limits; 'closed' answers 503.")
    redis_timeout_s: float = Field(1.0, gt=0, description="Per-command Redis timeout; slower counts as down.")
    redis_retry_s: float = Field(2.0, gt=0, description="How often to try Redis again after it failed.")
    lease: bool = Field(True, description="With redis_url: each process takes rpm / tpm grants from the shared "
                        "buckets in batches (debited up front, so the fleet never admits more than the buckets allow) "
                        "and admits from them locally, refilling in the background; token corrections are sent in batches. "
                        "False: one Redis script per request (and per settle).")
    lease_horizon_s: float = Field(0.2, gt=0, description="A grant covers this long of the process's recent traffic "
                                   "for the tenant (at least one request).")
    lease_max_fraction: float = Field(0.01, gt=0, le=1, description="A grant is at most this share of the tenant's "
                                      "rpm limit, of its tpm limit, and of the budget left today.")
    lease_idle_s: float = Field(0.5, gt=0, description="A grant unused this long (no request of that tenant in the "
                                "process) is given back to the shared buckets.")
    lend_places: bool = Field(True, description="With redis_url: a client's retry that reaches another gateway "
                              "process than the one that holds its place claims that place (each publishes the places "
                              "it holds for retries due soon, and lets a claimed one go); where the process it reached "
                              "has no slot free within its budget, the holder lends it, or another process lends a "
                              "place it expects to free within that budget (each publishes its next place), and the "
                              "lender leaves the slot idle until the borrower's next request ends (behind a load "
                              "balancer that sends each attempt to the next process, the processes' slots free at "
                              "different times).")
    lend_interval_s: float = Field(0.2, gt=0, description="With lend_places: how often each process publishes its next "
                                   "place, its loans, the places it holds and those it took, and reads the others'.")
    settle_flush_s: float = Field(0.1, gt=0, description="With lease: how often the pending token corrections "
                                  "(and spend that Redis did not take) and idle grants are sent to Redis; also on "
                                  "shutdown.")
