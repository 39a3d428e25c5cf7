"""How much work a pool can take now, measured online; no hand-set capacity number is needed.

Two limits, both per healthy replica (so the pool's limit follows the replica count at once: a pool
that just grew from 2 to 5 replicas admits 5/2 as much without relearning), multiplied by the number
of healthy replicas the fleet reports:

- ``limit``, the **SLO limit**: requests in flight at which admitted work still meets the SLO. Each
  admitted request that ends is a sample of the pool's service: TTFT (sent upstream -> first token),
  TPOT and E2E without the gateway's queue wait, kept as running means (and mean deviations, for the
  margin the queue's budget leaves), and TTFT and E2E also over a window of the last ``tail_window``
  successes. The limit is judged on the **tail** of that window (``tail_quantile``, the SLO's own
  percentile) and the mean TPOT against ``target_fraction`` of the SLO: while they stay under it and
  the replicas are not saturated, the limit grows: by one per tested sample (a request admitted with
  at least half the limit in flight) while under 80% of the target (about doubling per service
  time: a cold gateway finds the fleet's size in a few seconds), by one per limit's worth of samples
  near the target. Over target cuts it in proportion (at least 10%, at most half), at most once per
  service time. Why the tail, and 0.75 (``benchmarks/admission_virtual.py``, the engine on a virtual
  clock, docs/benchmarks.md section 7): judged on means under 0.7 of the SLO, the seed's burst left
  2-7% of admitted answers late (one seed in two under 95%); the p95 under 0.75 of the SLO kept every
  burst at 97.7-100% with the same goodput, and steady overload at 91-93% of capacity; 0.8 and up let
  bursts through late (88-97%). The TPOT has a hold band: no queue wait is part of it, so it cuts only
  over ``tpot_cut_fraction`` (``tpot_cut``; growth still needs it under ``target_fraction``). Cut at the
  growth target, the real CPU vLLM's burst was held at 20 in flight where its answers met the SLO at 28
  (``admission_virtual.py --burst``: goodput 1.13 req/s replayed on its probe, 1.24 with the band). It
  starts at ``initial_concurrency`` or at what the replicas already run (scraped
  ``vllm:num_requests_running`` + ``waiting``), whichever is larger. The replicas' live decode speed
  (vLLM's inter-token latency over the last few scrape intervals) is judged too, as each scrape arrives: a
  TPOT over target cuts the limit seconds into a burst instead of an E2E later (``judge_live``).
- ``batch_limit``, the **fill limit**: how many requests in flight keep the replicas busy without
  queueing inside vLLM. Batch work may use it (less the interactive reserve), interactive work may use
  the SLO limit on top of whatever batch runs, so batch fills idle capacity and yields first. It grows while the service TTFT stays within ``FILL_TTFT_FACTOR`` of the
  lowest seen and a replica's own queue stays empty
  (``vllm:num_requests_waiting`` at most 2 or 5% of its running requests) and its KV cache under
  ``kv_high``; it is cut by 10% (at most once per service time) when not, or when interactive answers
  take over ``INTERACTIVE_YIELD`` of the E2E target (``interactive_late``). It is never below ``limit``.

- ``prefill_limit``, the **prefill limit** (``prefill_gate``): prefills admitted but not yet answered (no first
  token seen) per replica. The slot limits count sequences, and decode slows with them; a prompt's TTFT
  is the prefill work ahead of it inside vLLM, which the slot limit does not see: on a CPU vLLM a
  512-token prefill takes 0.7 s, and 11 prompts admitted within 4 s of a burst waited 5-6 s for their
  first token against a 5 s SLO. Each stream's first token is a sample (``observe_first_token``):
  ``prefill_each``, the running mean of TTFT / (prefills pending ahead of it + 1), is what one pending
  prefill adds; the limit starts at ``ttft_target / prefill_each`` once 10 samples are in, a first token
  over ``ttft_target`` with others pending ahead cuts it to what would have met it ((ahead + 1) x
  target / TTFT; computed from the observation, so late answers of one burst do not compound), and it
  grows by one per tested sample under 80% of the target. Pending prefills drain at ``replicas /
  prefill_each`` per second (the queue's wait for a prefill place). First tokens come within a TTFT of
  admission, not a whole E2E later, so this limit reacts inside a burst.

Both are capped by the replicas' KV caches (``vllm:cache_config_info`` blocks x block size: the
sequences of the measured length that fit) and by ``max_concurrency``. The drain rate (requests that
leave per second when the pool is full) is Little's law on the same measurements: limit / mean
service time. The clock is a parameter: tests run it virtually.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from usefulwork.gateway.admission.config import AdmissionCfg

log = logging.getLogger("usefulwork.admission")

EWMA = 0.1  # weight of a new sample in the running means
LIVE_SCRAPES = 4  # scrape times kept: the live figures cover the last three intervals (fleet.ITL_WINDOW)
PREFILL_SHARE_MAX = 0.9  # the largest share of a replica's time ``_lifetime`` deems spent on prefills
FILL_TTFT_FACTOR = 3.0  # batch fills the pool while the service TTFT stays within this factor of the unloaded one
INTERACTIVE_YIELD = 0.9  # batch yields once interactive answers take this share of the E2E target
LOAD_EWMA = 0.2  # weight of a new sample in a load band's TPOT (``Capacity.tpot_at``)
LOAD_BAND_WEIGHT = 10  # the most samples a load band counts as in the line's fit
LOADS_KEPT = 100_000  # ``Capacity._loads``' bound where no scrape comes to prune it (a replica's metrics down)
CUT_KEEP_MAX = 0.9  # a cut keeps at most this share of a limit (cuts at least 10%)...
CUT_KEEP_MIN = 0.5  # ...and at least this share (at most halves it)


@dataclass(slots=True)
class Sample:
    """One finished request, as admission saw it (seconds; None where it produced no token)."""

    ttft: float | None  # sent upstream -> first token
    tpot: float | None
    service: float  # admitted -> finished (the slot's hold time)
    tokens: int  # prompt + completion
    ok: bool  # ended with a complete answer (an error or cancel is not a service sample)
    inflight_at_admit: int  # requests in flight when it was admitted (was the limit being tested?)
    cls: int = 0  # its priority class (0 interactive)
    inflight_at_end: int | None = None  # the others still in flight when it ended (set by the queue)
    completion: int | None = None  # its completion tokens (None: the backend did not count them)


def _capped(max_tokens: int | None, cap: int | None) -> int | None:
    return max_tokens if max_tokens is None or cap is None else min(max_tokens, cap)


def decode_time(tpot: float | None, cap: int | None, max_tokens: int | None) -> float | None:
    """Seconds from the first token to the last of a request that may produce ``max_tokens`` tokens, at
    ``tpot`` a token, its output capped at ``cap`` (``Capacity.decode_terms``); None where either is unknown."""
    out = _capped(max_tokens, cap)
    return tpot * max(0, out - 1) if tpot is not None and out else None


class Capacity:
    """The adaptive in-flight limits and the service-time estimates of one pool."""

    def __init__(self, cfg: AdmissionCfg, slo_ttft_s: float, slo_tpot_s: float, slo_e2e_s: float,
                 replicas: Callable[[], Iterable] = tuple, replica_count: Callable[[], int] | None = None,
                 priority_scheduling: bool = False):
        self.cfg = cfg
        # The replicas run vLLM's priority scheduling: batch work waiting inside vLLM does not delay
        # interactive work, so the fill limit's queueing signal is the interactive TTFT alone.
        self.priority_scheduling = priority_scheduling
        self.inter_ttft: float | None = None  # EWMA of interactive samples' service TTFT
        self.inter_service: float | None = None  # EWMA of interactive samples' service time (E2E without the queue)
        self.inter_floor: float | None = None
        self._inter_samples = 0
        self.replicas = replicas  # live replica state (running, waiting, kv_usage, num_gpu_blocks, block_size)
        self._count = replica_count
        self._pinned: list | None = None  # one look at the replicas for a whole decision (``pin``)
        self._pinned_n = 1
        f = cfg.target_fraction
        self.slo_e2e_s = slo_e2e_s
        self.ttft_target = slo_ttft_s * f
        self.tpot_target = slo_tpot_s * f
        self.tpot_cut = slo_tpot_s * max(f, cfg.tpot_cut_fraction)  # the TPOT that cuts (``tpot_cut_fraction``)
        self.e2e_target = slo_e2e_s * f
        self.limit = float(cfg.initial_concurrency)  # per replica (SLO limit)
        self.batch_limit = self.limit  # per replica (fill limit)
        self.seeded = False  # the start was raised to what the replicas already run
        self.last_decrease = -1e18
        self.last_batch_decrease = -1e18
        self.svc_ttft: float | None = None  # EWMA of service TTFT (s)
        self.ttft_dev: float = 0.0  # EWMA of |TTFT - mean|
        self.ttft_floor: float | None = None  # the lowest running mean of service TTFT seen: the unloaded TTFT
        self.tpot: float | None = None
        # EWMA of TPOT of requests that ran in a full pool: >= 90% of the limit in flight when they were
        # admitted and when they ended (``Sample.inflight_at_end``: those admitted as a burst ended ran
        # while the pool drained, quicker than a full pool holds a slot)
        self.tpot_full: float | None = None
        # TPOT by load: per band of requests in flight per replica (a quarter octave each), the EWMA of
        # (load, TPOT) and its sample count; the weighted line through them (``tpot_at``) and the load now
        self.load_bands: dict[int, tuple[float, float, int]] = {}
        self._load_line: tuple[float, float, float] | None = None  # (mean load, mean TPOT, slope)
        self.load_now = 0.0  # requests in flight per replica at the last ``judge_live``
        self.live_tpot: float | None = None  # the slowest replica's inter-token latency now (Replica.itl_live; see judge_live)
        self.slow_start_credit = 0.0  # slow-start growth earned by first tokens that came before any live decode speed
        self.slow_start_decode = math.inf  # the decode speed that credit needs (the tightest of its requests')
        # the replicas' mean of it, rescaled as it is (what one request, on one replica, decodes at)
        self.live_tpot_mean: float | None = None
        self._live_seen: dict[int, int] = {}  # id(replica) -> its scrape count when last judged
        self._scrape_times: deque[float] = deque(maxlen=LIVE_SCRAPES)  # when the last scrapes were judged
        self._admits: deque[float] = deque()  # when requests were admitted (their prompts sent), the last minute
        # (time, requests in flight until then) at each ``judge_live`` call since the oldest judged scrape:
        # what ran while the live figures were measured (``_window_load``)
        self._loads: deque[tuple[float, int]] = deque(maxlen=LOADS_KEPT)
        self.live_tpot_peak: float | None = None  # the slowest replica's live figure as read (before ``_lifetime``)
        self._turnover: tuple[float, float, float] | None = None  # ``_lifetime``'s last pricing: (judged, prefill, share)
        self.live_decreases = 0
        self.service_full: float | None = None  # EWMA of the hold time of those requests
        self.service: float | None = None  # EWMA of a slot's hold time (s)
        self.service_dev: float = 0.0
        self.tokens: float | None = None  # EWMA of tokens per request
        self.out_mean: float | None = None  # EWMA of completion tokens per answer (``_lifetime``)
        self.recent_ttft = Window(cfg.tail_window)  # the tail's window (successes)
        self.recent_e2e = Window(cfg.tail_window)
        self.recent_out = Window(cfg.tail_window)  # completion tokens of recent answers (``est_output``)
        self.samples = 0
        self.decreases = 0
        self.batch_decreases = 0
        self.prefill_each: float | None = None  # EWMA of TTFT / (prefills pending ahead + 1) (s)
        self.live_prefill: float | None = None  # the replicas' mean of vLLM's own prefill time now (``prefill_time``)
        self.live_service: float | None = None  # the replicas' mean of vLLM's own request time now (``slot_hold`` when cold)
        self.prefill_limit: float | None = None  # per replica (None: not learnt yet, no gate)
        self.prefill_samples = 0
        self.prefill_decreases = 0

    # -- reads --
    def pin(self) -> bool:
        """Look at the replicas once for a whole decision (an offer, a release): every read until ``unpin``
        sees that list and its healthy count. Nothing a decision does changes the replicas (their state
        comes from scrapes and health probes, between decisions), and an offer read them up to seven times,
        a list built each time. True where this call pinned them (the caller unpins); False where a
        decision already had."""
        if self._pinned is not None:
            return False
        reps = self._pinned = list(self.replicas())
        self._pinned_n = self._healthy_count(reps)
        return True

    def unpin(self) -> None:
        self._pinned = None

    def _reps(self) -> list:
        return self._pinned if self._pinned is not None else list(self.replicas())

    def _healthy_count(self, reps: Iterable) -> int:
        if self._count is not None:
            return max(1, self._count())
        return max(1, sum(1 for r in reps if getattr(r, "healthy", True)))

    def count(self, reps: Iterable | None = None) -> int:
        if self._pinned is not None and (reps is None or reps is self._pinned):
            return self._pinned_n
        return self._healthy_count(self.replicas() if reps is None else reps)

    def saturated(self) -> bool:
        """A replica queues a real share of its work inside vLLM, or its KV cache is nearly full.

        A few waiting requests at a scrape are normal under load (new arrivals wait one engine step
        for a chunked prefill), so they only stop growth when they exceed a quarter of the running."""
        return any(getattr(r, "waiting", 0.0) > max(1.0, 0.25 * getattr(r, "running", 0.0))
                   or getattr(r, "kv_usage", 0.0) > self.cfg.kv_high for r in self._reps())

    def queueing(self) -> bool:
        """The fill limit's signal: new requests wait inside vLLM. Seen directly in the service TTFT
        (its running mean over ``FILL_TTFT_FACTOR`` x the lowest seen: prefills queue behind others),
        or scraped: a replica holds more than a step's worth of arrivals in its own queue. Under vLLM's
        priority scheduling only interactive work's TTFT counts, and vLLM's own queue does not (batch
        waits there by design, behind interactive work; in the experiment, judging batch's TTFT cut
        the fill limit until the backend ran 80% of admission off's tokens); a full KV cache still does."""
        if self.priority_scheduling:
            if self.inter_floor is not None and self.inter_ttft is not None and self.inter_ttft > FILL_TTFT_FACTOR * self.inter_floor:
                return True
            return any(getattr(r, "kv_usage", 0.0) > self.cfg.kv_high for r in self._reps())
        if self.ttft_floor is not None and self.svc_ttft is not None and self.svc_ttft > FILL_TTFT_FACTOR * self.ttft_floor:
            return True
        return any(getattr(r, "waiting", 0.0) > max(2.0, 0.05 * getattr(r, "running", 0.0))
                   or getattr(r, "kv_usage", 0.0) > self.cfg.kv_high for r in self._reps())

    def kv_cap(self, reps: Iterable | None = None) -> float | None:
        """Sequences of the measured mean length that fit in the pool's KV caches (None: unknown)."""
        if not self.tokens:
            return None
        total = 0.0
        for r in (self._reps() if reps is None else reps):
            blocks = getattr(r, "num_gpu_blocks", 0.0)
            size = getattr(r, "block_size", 0.0)
            if not (blocks and size):
                return None
            total += blocks * size / self.tokens
        return total or None

    def _seed(self, reps: list) -> None:
        """Start from what the replicas already run (another gateway's load shows what they hold)."""
        if reps:
            self.seeded = True
            held = max((getattr(r, "running", 0.0) + getattr(r, "waiting", 0.0) for r in reps), default=0.0)
            self.limit = max(self.limit, held)
            self.batch_limit = max(self.batch_limit, self.limit)

    def _cap(self, lim: float, kv: float | None) -> int:
        if kv is not None:
            lim = min(lim, kv)
        if self.cfg.max_concurrency is not None:
            lim = min(lim, self.cfg.max_concurrency)
        return max(self.cfg.min_concurrency, int(lim))

    def limits(self) -> tuple[int, int]:
        """(SLO limit, fill limit) to apply now: per replica x healthy replicas, within the KV and
        configured caps (one look at the replicas for both: this runs on every request)."""
        reps = self._reps()
        if not self.seeded:
            self._seed(reps)
        n, kv = self.count(reps), self.kv_cap(reps)
        return self._cap(self.limit * n, kv), self._cap(max(self.limit, self.batch_limit) * n, kv)

    def current(self) -> int:
        """The SLO limit to apply now."""
        return self.limits()[0]

    def fill(self) -> int:
        """The fill limit to apply now (never below the SLO limit)."""
        return self.limits()[1]

    def prefill_places(self) -> int | None:
        """The prefill limit to apply now, for the pool (None: no gate yet, or ``prefill_gate`` off)."""
        if self.prefill_limit is None or not self.cfg.prefill_gate:
            return None
        return max(1, int(self.prefill_limit * self.count()))

    def prefill_time(self) -> float | None:
        """What one pending prefill takes: learnt from streams' first tokens (``prefill_each``), else the
        replicas' own figure (vLLM's ``request_prefill_time_seconds`` over the last scrapes, read with the
        decode speed in ``judge_live``). A pool that serves only unary requests sees no first token: without
        the replicas' figure a unary prompt's prefill place was held until its whole answer ended, so a
        low-band prompt behind a unary interactive one waited for that answer, and batch work went one
        prompt per replica at a time."""
        return self.prefill_each if self.prefill_each is not None else self.live_prefill

    def prefill_wait(self, position: int) -> float:
        """Seconds until ``position`` more pending prefills have been answered (pool-wide)."""
        return position * (self.prefill_time() or 0.0) / self.count()

    def drain_rate(self) -> float | None:
        """Requests per second that leave a full pool: the limit over the full pool's service time where
        measured (Little's law holds at the limit only: the overall mean, with the quick answers of quiet
        times in it, promised the real CPU vLLM's burst 0.96 slots a second where 0.6 came, and the
        Retry-After of shed requests brought them back into a pool still full). Before the first
        measurement, the cold hold (``slot_hold``)."""
        service = max(self.service or 0.0, self.service_full or 0.0) or self.slot_hold()
        return self.current() / service if service else None

    def slot_hold(self) -> float:
        """How long a slot taken now is held (with the margin): the full pool's service time where
        measured (slots are waited for only when the pool is full), else the overall one.

        Before this gateway has timed a request of its own (a cold start, a new worker, a restart beside
        a busy fleet), the replicas' own mean request time over the last scrapes (vLLM's
        ``e2e_request_latency_seconds``, ``Replica.e2e_live``: every client's requests, their wait inside
        vLLM included), else the whole E2E SLO (cautious: a cold gateway sheds early rather than late).
        With the SLO alone, a gateway started into a busy fleet priced every slot at the SLO: on the real
        CPU vLLM (E2E SLO 30 s, slots held ~10 s) it told shed clients to come back in 37-50 s."""
        if self.service is None:
            return self.live_service or self.slo_e2e_s or 0.0
        return max(self.service, self.service_full or 0.0) + 2.0 * self.service_dev

    def est_ttft(self) -> float:
        """Service TTFT that a request should budget for: the mean plus two mean deviations."""
        return (self.svc_ttft or 0.0) + 2.0 * self.ttft_dev

    def est_e2e(self, max_tokens: int | None) -> float:
        """Expected service time (with the same tail margin) of a request that may produce ``max_tokens``
        tokens **in a full pool**: the queue asks this only of requests that wait, and a waiting request
        starts when the pool is at its limit, where decoding is slowest. (The overall mean TPOT, after a
        quiet spell, promised a burst's first queued requests 1.6 s of service that took 3.8 s.) The live
        decode speed counted is the replicas' mean, not the slowest one's (which judges the limit): the
        request runs on one replica, and the least-loaded one at that. (With the slowest, the autoscale
        what-if's day, six replicas at its peak, made 2,166 shed decisions instead of 1,669 and failed 526
        requests instead of 396.)"""
        decode = self.est_decode(max_tokens)
        if decode is not None:
            return self.est_ttft() + decode
        return (self.service or 0.0) + 2.0 * self.service_dev

    def est_decode(self, max_tokens: int | None) -> float | None:
        """Seconds from the first token to the last of a request that may produce ``max_tokens`` tokens: the
        budgeted output (``est_output``) at the slowest of the decode speeds measured (overall, in a full
        pool, the replicas' live mean); None before any is measured."""
        return decode_time(*self.decode_terms(), max_tokens)

    def quick_decode(self, max_tokens: int | None, full: bool = False) -> float | None:
        """What ``est_decode`` prices at the decode speed of the load now (with ``full``, of at least a pool
        full to its SLO limit), not the slowest one measured: how soon a request started now (at a place that
        frees in a full pool) could end (``PoolQueue._quick_answer``); None before it is measured."""
        load = max(self.load_now, self.current() / max(1, self.count())) if full else self.load_now
        return decode_time(self.tpot_at(load) or self.live_tpot_mean or self.tpot, self._output_cap(), max_tokens)

    def decode_terms(self) -> tuple[float | None, int | None]:
        """What ``est_decode`` depends on: the decode speed it counts (None before any is measured) and the
        cap ``est_output`` puts on ``max_tokens`` (``_output_cap``)."""
        return max(self.tpot or 0.0, self.tpot_full or 0.0, self.live_tpot_mean or 0.0,
                   self.tpot_at(self.load_now) or 0.0) or None, self._output_cap()

    def tpot_at(self, load: float) -> float | None:
        """The decode speed at ``load`` requests in flight per replica, on the line fitted through the
        TPOT measured per load band (``_learn_load``); None before two bands are measured.

        The other decode speeds lag a burst's ramp: the overall mean is from the quiet spell before it,
        the replicas' live mean trails by its scrape window, and the full pool's TPOT is learnt only from
        answers admitted and ended at 90% of the limit in force, which a burst whose limit grows as it
        fills never gives. Read at the load now, the line priced the burst cell's first queued requests'
        decode at the 26-28 ms a token they ran at, not at 20 ms (virtual clock, burst 20%, seeds 1-8:
        SLO attainment of served 91.1-100%, two seeds under 95%, -> 99.1-100%; docs/benchmarks.md
        section 7, session 34). In a simulated A100 TPOT against load is close to a line (11.5 ms at
        0-5 in flight, 18.6 at 20, 26.1 at 40)."""
        line = self._load_line
        if line is None:
            return None
        mx, my, slope = line
        return my + slope * (load - mx)

    def _learn_load(self, s: Sample, n: int) -> None:
        """Add an answer's TPOT to its load band: the mean of the requests in flight per replica when it
        was admitted and when it ended. Each band is an EWMA (its first sample counted whole); the line is
        weighted by the bands' samples, at most ``LOAD_BAND_WEIGHT`` each, so a long quiet spell does not
        outweigh a burst."""
        start = s.inflight_at_admit + 1
        end = s.inflight_at_end + 1 if s.inflight_at_end is not None else start
        load = (start + end) / 2 / max(1, n)
        band = int(4 * math.log2(max(load, 1.0)))
        old = self.load_bands.get(band)
        if old is None:
            self.load_bands[band] = (load, s.tpot, 1)  # type: ignore[arg-type]
        else:
            x, y, k = old
            self.load_bands[band] = (x + LOAD_EWMA * (load - x), y + LOAD_EWMA * (s.tpot - y), k + 1)  # type: ignore[operator]
        if len(self.load_bands) < 2:
            return
        # (one pass: this runs as each answer ends; bands are a quarter octave apart, so sxx is not ~0)
        w = sx = sy = sxx = sxy = 0.0
        for x, y, k in self.load_bands.values():
            k = min(k, LOAD_BAND_WEIGHT)
            w += k
            sx += k * x
            sy += k * y
            sxx += k * x * x
            sxy += k * x * y
        mx, my = sx / w, sy / w
        self._load_line = (mx, my, (sxy - sx * my) / (sxx - sx * mx))

    def est_output(self, max_tokens: int | None) -> int | None:
        """Completion tokens a request that may produce ``max_tokens`` should budget for: ``max_tokens``, or
        the tail (``tail_quantile``, the 95th percentile) of the pool's recent answers (once there are 20)
        where that is less. Many clients send a large ``max_tokens`` they never use: priced at 4,096
        tokens, such a request could never queue under a 5 s E2E SLO and was shed whenever the pool was
        full, while its answers, like everyone's, took 200."""
        return _capped(max_tokens, self._output_cap())

    def _output_cap(self) -> int | None:
        """The tail of the pool's recent answers' completion tokens (None before 20 answers)."""
        return None if len(self.recent_out) < 20 else int(self.tail(self.recent_out))  # type: ignore[arg-type]

    # -- writes --
    def judge_live(self, now: float, inflight: int) -> None:
        """Judge the decode speed the replicas report now, before any request ends.

        Samples come when requests end, a whole E2E after they were admitted: on a server whose decode
        slows with every sequence it runs (a CPU vLLM: TPOT 40 ms at 4 sequences, 190 ms at 22), a burst
        was admitted up to a limit learned in quiet times and every answer then missed the TPOT SLO,
        20 s before the first one said so. vLLM's ``inter_token_latency_seconds`` histogram is observed
        per decoded token, so its mean over the last few scrape intervals (``Replica.itl_live``) is the
        TPOT of what runs now. Each new scrape is judged once: over ``tpot_cut`` it cuts the limit as a
        late tail would (in proportion, at least 10%, at most half, once per service time), from what ran while
        it was measured (``_window_load``) if that is under the limit; it also holds growth (``_load``) and prices the queue's waits
        (``est_e2e``). Under priority scheduling, with batch work holding slots beyond the SLO limit, the
        fill limit is cut instead (batch yields first; the SLO limit is what interactive work uses).
        Called by the queue on every arrival and release (cheap: a look at each replica's scrape counter)."""
        reps = self._reps()
        self.load_now = inflight / self.count(reps)
        self._loads.append((now, inflight))
        seen = {id(r): getattr(r, "scrapes", 0) for r in reps}
        if seen == self._live_seen:
            return
        self._live_seen = seen
        lives = _healthy_figures(reps, "itl_live")
        live = self.live_tpot_peak = max(lives, default=None)
        self._scrape_times.append(now)
        while len(self._loads) > 1 and self._loads[1][0] <= self._scrape_times[0]:
            self._loads.popleft()  # (the first kept one closes the span's first stretch)
        model = None
        if live is not None:
            live, model = self._lifetime(live, now)
        self.live_tpot = live
        self.live_tpot_mean = _mean(lives)
        if model is not None and self.live_tpot_mean is not None:
            # (rescaled as the peak was: the queue prices a waiting request's decode at it, ``est_decode``. Read
            # raw, a burst's 231 ms priced a batch request at 30.6 s against its client's 28.5 s, and it was
            # shed; those admitted beside it took 10-11 s: the real CPU vLLM's 2x cell, session 55)
            self.live_tpot_mean *= live / self.live_tpot_peak
        self.live_prefill = _mean(_healthy_figures(reps, "prefill_live"))
        self.live_service = _mean(_healthy_figures(reps, "e2e_live"))
        if self.slow_start_credit and live is not None:
            credit, self.slow_start_credit = self.slow_start_credit, 0.0
            bound, self.slow_start_decode = self.slow_start_decode, math.inf
            if not self.samples and live < bound and not self.saturated():
                self._grow(credit, self.count(reps))  # the slow start's growth, now that the decode speed is known
        # (no verdict before a round trip was measured: the cold limit is initial_concurrency, and the
        # once-per-service-time rule needs a service time; without it every scrape cut the limit to 1)
        if live is None or live <= self.tpot_cut or self.service is None:
            return
        n = self.count(reps)
        ran = max(inflight, self._window_load(now, inflight))
        if self.priority_scheduling and inflight / n > self.limit and self.batch_limit > self.limit:
            # Batch work beyond the SLO limit is what slows the decode: it yields first, as for late
            # interactive answers (``interactive_late``). Cutting the SLO limit instead left interactive
            # work one slot: on the real CPU vLLM's 2x cell the SLO limit went to 1.7 per replica in three
            # live cuts while the fill limit stayed at 24, and interactive requests queued 3.4 s and were shed.
            if now - self.last_batch_decrease >= self.service:
                self._cut_fill(min(self.batch_limit, ran / n) * _kept(self.tpot_cut / live), now,
                               self._live_why(live, inflight, ran))
                self.live_decreases += 1
            return
        if now - self.last_decrease < self.service:
            return
        new = self._cut_to(min(self.limit, ran / n), live / self.tpot_cut, n)
        if model is not None:
            # Judged at a full pool's turnover, the figure is ``decode + limit x per_slot``: the cut goes to
            # the limit at which that meets the target, if that leaves more than the proportional cut (and
            # still cuts at least 10%). (In proportion to what ran, a pool of 6 judged at its limit's
            # turnover (19.2 slots of others' prompts) was cut to 4.1, where its answers decoded at 94 ms
            # against the 112 ms target and the model itself put the target at 8: the real CPU vLLM's
            # burst-retry cell, docs/benchmarks.md section 7, session 43.)
            decode, per_slot = model
            new = max(new, min((self.tpot_cut - decode) / per_slot, CUT_KEEP_MAX * self.limit))
        if new < self.limit:
            self._cut(new, now, self._live_why(live, inflight, ran))
            self.live_decreases += 1

    def _window_load(self, now: float, inflight: int) -> float:
        """The requests in flight over the span the live figures cover (the last judged scrapes), a time-weighted
        mean; ``inflight`` where no span is known yet. A live cut scales the larger of this and what runs now:
        the figure was measured on what ran, and read as a burst drained, the figure of 15-22 in flight cut
        the SLO limit in proportion to the 6 left (15.7 -> 4.8 per replica); it held there for the ten
        answers a cut waits for, 50 s at that limit, and shed the next burst (the real CPU vLLM on an Intel
        AMX host, session 57). While a burst is admitted, what runs now is the larger (the rule before)."""
        if len(self._scrape_times) < 2:
            return float(inflight)
        start = self._scrape_times[0]
        area, prev = 0.0, start
        for t, k in self._loads:  # each call's count held from the call before it until the call
            if t > prev:
                area += k * (t - prev)
                prev = t
        return area / (now - start) if now > start else float(inflight)

    def note_admit(self, now: float) -> None:
        """A request was admitted: its prompt goes to a replica now (``_lifetime`` counts them)."""
        a = self._admits
        a.append(now)
        while a[0] < now - 60.0:
            a.popleft()

    def _lifetime(self, live: float, now: float) -> tuple[float, tuple[float, float] | None]:
        """The live decode speed as a request admitted now would see it over its life, and where it was
        rescaled, the model that rescaled it: (decode s a token, s a token per slot of the limit).

        A token's gap spans any prefill that ran in its step, so while a burst's prompts are prefilled the
        live figure is the peak's: on the real CPU vLLM (0.25 s a prompt, ~3 prompts a second) they
        stalled every running token most of the time. But once the pool is full no prompt comes faster
        than slots free, so over its life a request shares the engine with a full pool's turnover of
        prompts, not the burst's. With ``s`` the share of time spent on prefills, decode runs in the rest:
        the figure is rescaled from the window's share (this gateway's admissions over the span of the
        scrapes the live figure covers, x ``prefill_time``) to the full pool's, and only ever down (a
        window quieter than a full pool says nothing new about the decode at the limit).

        The full pool's share is what its own hold time gives: a request held in a full pool of ``limit``
        slots per replica sees one turnover of the others' prompts over its life (``limit`` prefills) and
        decodes its tokens (the mean answer's, ``out_mean``) at the step time the window shows without its
        prefills, ``live x (1 - s_window)``. So the figure judged is ``decode + limit x prefill / tokens``.
        (Priced with the hold time measured earlier instead, in the quiet before a burst, a full pool
        seemed to turn over twice as fast as it could, so no burst ever looked busier than one: on the real
        CPU vLLM a live cut took the SLO limit from 26 to 19.8 in a burst whose admitted answers decoded at
        77-98 ms against the 112 ms target, and admission on shed 20 of 63 requests that admission off
        served within the SLO; docs/benchmarks.md section 7, session 35.) Judged on the peak, two live cuts
        took the SLO limit from 27 to 14.6 in a burst (session 29). Needs a prefill time, a measured round
        trip and the answers' mean length. Where it rescales, a cut goes no lower than the limit at which the
        model meets the target (``judge_live``)."""
        pe, out = self.prefill_time(), self.out_mean
        self._turnover = None
        if pe is None or not out or not self.service or len(self._scrape_times) < 2:
            return live, None
        span = now - self._scrape_times[0]
        if span <= 0:
            return live, None
        recent = len(self._admits) - bisect.bisect_right(self._admits, now - span)
        s_now = min(PREFILL_SHARE_MAX, recent / self.count() * pe / span)
        decode = live * (1.0 - s_now)
        judged = decode + self.limit * pe / out
        self._turnover = (judged, pe, s_now)
        if judged >= live:
            return live, None
        return judged, (decode, pe / out)

    def _live_why(self, live: float, inflight: int, ran: float) -> str:
        peak = self.live_tpot_peak
        read = (f" (read {peak * 1e3:.0f} ms, a burst's prefills judged at a full pool's)"
                if peak and round(peak * 1e3) > round(live * 1e3) else "")
        if not read and self._turnover is not None:  # priced, not rescaled: the figures say why
            judged, pe, share = self._turnover
            read = (f" (a full pool's turnover prices {judged * 1e3:.0f} ms: {pe:.2f} s a prefill, "
                    f"{share:.0%} of the window's time on this gateway's prefills)")
        base = f" ({ran:.1f} over the figure's window)" if round(ran, 1) != inflight else ""
        return f"live decode {live * 1e3:.0f} ms a token{read} over the {self.tpot_cut * 1e3:.0f} ms cut mark, {inflight} in flight{base}"

    def observe_first_token(self, ttft: float, ahead: float, inflight_at_admit: int = 0,
                            max_tokens: int | None = None) -> None:
        """A stream's first token: ``ttft`` seconds after admission, with ``ahead`` prefills per replica
        pending ahead of it then (of the kind the gate counts: see ``PoolQueue.prefill_pending``) and
        ``inflight_at_admit`` requests in flight; the request may produce ``max_tokens`` tokens."""
        self._slow_start(ttft, inflight_at_admit, max_tokens)
        self.prefill_each = _ewma(self.prefill_each, ttft / (ahead + 1.0))
        self.prefill_samples += 1
        if self.prefill_limit is None:
            if self.prefill_samples >= 10 and self.prefill_each > 0:  # (first tokens timed at 0 s price nothing)
                self.prefill_limit = max(1.0, self.ttft_target / self.prefill_each)
            return
        if ttft > self.ttft_target:
            # (a slow first token with nothing pending ahead is not the prefill queue: nothing to cut)
            if ahead >= 1.0:
                new = max(1.0, (ahead + 1.0) * self.ttft_target / ttft)
                if new < self.prefill_limit:
                    self.prefill_limit = new
                    self.prefill_decreases += 1
        elif ttft < 0.8 * self.ttft_target and ahead + 2.0 >= self.prefill_limit:
            self.prefill_limit += 1.0 / self.count()

    def _slow_start(self, ttft: float, inflight_at_admit: int, max_tokens: int | None = None) -> None:
        """Until the pool's first answer ends, the SLO limit grows on leading signals: a first token under
        80% of the TTFT target, of a request admitted with at least half the limit in flight, while the
        replicas' live decode speed is fast enough for that request (``_slow_start_decode``: under 80% of
        the TPOT target, and of what its tokens may take within 80% of the E2E target) and they are not
        saturated: by one, as a fast sample would. A cold pool otherwise held ``initial_concurrency`` until
        its first answer: on the CPU vLLM 8 in flight and a first answer at 10.9 s shed 8 of a steady
        cell's 37 requests that admission off served within the SLO.

        The first tokens of the first requests come before the replicas have decoded enough for a live
        speed (``judge_live``: a few scrape intervals). Those that qualify otherwise are kept as credit
        and grown by once the live speed comes and is fast, before the first answer ends. (Judged only
        when the live speed was already known, the first 8 requests' first tokens, all within 1.5 s of a
        cold start, never counted, and no request was admitted after them until an answer ended: on an
        AMX host's CPU vLLM 8 of the 16 requests in a cell's first 10 s were shed, told 37-50 s.)"""
        if self.samples or ttft >= 0.8 * self.ttft_target or self.saturated():
            return
        n = self.count()
        if inflight_at_admit / n + 1 < 0.5 * self.limit:
            return
        decode = self._slow_start_decode(ttft, max_tokens)
        if self.live_tpot is None:
            self.slow_start_credit += 1.0 / n
            self.slow_start_decode = min(self.slow_start_decode, decode)
        elif self.live_tpot < decode:
            self._grow(1.0 / n, n)

    def _slow_start_decode(self, ttft: float, max_tokens: int | None) -> float:
        """The live decode speed under which a first token at ``ttft`` of a request that may produce
        ``max_tokens`` tokens lets the slow start grow: 80% of the TPOT target, and where the E2E target is
        the tighter bound, the speed at which its tokens end within 80% of it. (The TPOT bound alone was
        taken to bound E2E too; under the admission experiment's SLO, 128 tokens in 5 s, it does not: a
        gateway restarted beside a full simulated A100 grew its limit from 41 to 117 on first tokens in
        4 s at a decode speed of 26-35 ms, a 3.4-4.6 s E2E at 128 tokens against a 3.75 s target, and
        every answer of its first 4 s missed the SLO: docs/benchmarks.md section 7, session 28.)"""
        bound = 0.8 * self.tpot_target
        out = self.est_output(max_tokens)
        if out is not None and out > 1:
            bound = min(bound, (0.8 * self.e2e_target - ttft) / (out - 1))
        return bound

    def _cut_to(self, base: float, overshoot: float, n: int) -> float:
        """A cut limit: ``base`` in proportion to the overshoot (at least 10%, at most half), never under
        ``min_concurrency``."""
        return max(float(self.cfg.min_concurrency) / n, base * _kept(1.0 / overshoot))

    def _cut(self, new: float, now: float, why: str) -> None:
        log.info("admission: SLO limit %.2f -> %.2f per replica: %s", self.limit, new, why)
        self.limit = new
        self.last_decrease = now
        self.decreases += 1
        self.recent_e2e.clear()  # the window described the limit just cut
        self.recent_ttft.clear()

    def observe(self, s: Sample, now: float) -> None:
        if self.service is not None:
            self.service_dev = _ewma(self.service_dev, abs(s.service - self.service))
        self.service = _ewma(self.service, s.service)
        if s.tokens:
            self.tokens = _ewma(self.tokens, float(s.tokens))
        if not s.ok:
            return  # failures say nothing about the pool's speed
        self.samples += 1
        if s.completion:
            self.recent_out.append(float(s.completion))
            self.out_mean = _ewma(self.out_mean, float(s.completion))
        if s.ttft is not None:
            if self.svc_ttft is not None:
                self.ttft_dev = _ewma(self.ttft_dev, abs(s.ttft - self.svc_ttft))
            self.svc_ttft = _ewma(self.svc_ttft, s.ttft)
            if self.samples > 10:  # (a mean of a few samples is not a floor)
                self.ttft_floor = self.svc_ttft if self.ttft_floor is None else min(self.ttft_floor, self.svc_ttft)
            if s.cls == 0:
                self._inter_samples += 1
                self.inter_ttft = _ewma(self.inter_ttft, s.ttft)
                self.inter_service = _ewma(self.inter_service, s.service)
                if self._inter_samples > 10:
                    self.inter_floor = self.inter_ttft if self.inter_floor is None else min(self.inter_floor, self.inter_ttft)
        n = self.count()
        if s.tpot is not None:
            self.tpot = _ewma(self.tpot, s.tpot)
            self._learn_load(s, n)
            full = 0.9 * self.limit
            if ((s.inflight_at_admit + 1) / n >= full
                    and (s.inflight_at_end is None or (s.inflight_at_end + 1) / n >= full)):
                self.tpot_full = _ewma(self.tpot_full, s.tpot)
                self.service_full = _ewma(self.service_full, s.service)
        self._learn_fill(s, now, n)
        self._learn_slo(s, now, n)

    def tail(self, xs: Window) -> float | None:
        """The ``tail_quantile`` of a window (None under 10 samples): the k-th largest, k = the share above it."""
        n = len(xs)
        if n < 10:
            return None
        k = max(1, math.ceil((1.0 - self.cfg.tail_quantile) * n))
        return xs.largest(k)

    def _load(self) -> tuple[float, float]:
        """Service TTFT and E2E (their tail, else their means) and the mean TPOT as a fraction of their
        targets (the largest): (against the TPOT's cut mark, ``tpot_cut``; against its growth target)."""
        ttft = self.tail(self.recent_ttft)
        e2e = self.tail(self.recent_e2e)
        rest = max(((self.svc_ttft if ttft is None else ttft) or 0.0) / self.ttft_target,
                   ((self.service if e2e is None else e2e) or 0.0) / self.e2e_target)
        tpot = max(self.tpot or 0.0, self.live_tpot or 0.0)
        return max(rest, tpot / self.tpot_cut), max(rest, tpot / self.tpot_target)

    def _learn_slo(self, s: Sample, now: float, n: int) -> None:
        per_replica = s.inflight_at_admit / n
        # Judged on the running means, not one sample: a single slow answer (a host hiccup) must not
        # cut the limit that many good ones built. Samples admitted beyond the SLO limit (batch work
        # filling the pool) say nothing about it: the fill limit answers for them.
        if per_replica + 1 > self.limit + 1e-9 and self.batch_limit > self.limit:
            return
        # (so are they kept out of the tail's window: batch work queued inside vLLM behind interactive
        # work, with priority scheduling, held slots 10 s and cut the SLO limit from 32 to 1)
        if now - s.service < self.last_decrease:
            # Admitted before the last cut: it shows the limit that was cut, not the one in force. One
            # cut per round trip (TCP's rule): judging those late answers again cut the limit from 70
            # to 35 per replica within 33 s of a ramp while the pool met its SLO at 60.
            return
        self.recent_e2e.append(s.service)
        if s.ttft is not None:
            self.recent_ttft.append(s.ttft)
        if self.decreases and len(self.recent_e2e) < 10:
            return  # since the last cut: wait for ten answers admitted under the new limit
        load, growth = self._load()
        if load > 1.0:
            if now - self.last_decrease >= (self.service or 0.0):
                # In proportion to the overshoot (at most halved, at least 10%): a limit that grew past
                # what the pool serves in time comes back within a service time or two.
                self._cut(self._cut_to(self.limit, load, n), now,
                          f"recent answers at {load:.2f}x their TTFT, TPOT or E2E target")
            return
        if growth > 1.0:
            return  # between the TPOT's growth target and its cut mark: hold
        if self.saturated():  # the replicas say "full" before the SLO does: hold, do not grow
            return
        # Only a limit that was used has been tested: far under the targets, half of it (fast growth);
        # near them, all of it.
        fast = growth < 0.8
        # (tested against the slots the limit gives, a whole number: near the target the limit grows by
        # fractions of a slot, and a pool that holds int(limit) requests never tested 36.03: it stuck there)
        if s.inflight_at_admit + 1 >= (0.5 if fast else 1.0) * math.floor(self.limit * n + 1e-9):
            self._grow((1.0 if fast else 1.0 / (self.limit * n)) / n, n)

    def _grow(self, step: float, n: int) -> None:
        """Raise the SLO limit by ``step`` per replica, within ``max_concurrency``; the fill limit follows."""
        self.limit += step
        if self.cfg.max_concurrency is not None:
            self.limit = min(self.limit, self.cfg.max_concurrency / n)
        self.batch_limit = max(self.batch_limit, self.limit)

    def interactive_late(self) -> bool:
        """Interactive answers (their running mean service time) past ``INTERACTIVE_YIELD`` of the E2E
        target: the decode load of the work beside them slows every token. Batch work yields first: the
        fill limit is cut before the SLO limit would be. (Grown on interactive TTFT alone under priority
        scheduling, batch work took the pool from 33 to 86 sequences, interactive answers took 3.8-4 s
        against the 3.75 s target, the SLO limit was cut, and interactive requests queued for up to
        0.65 s and were shed, 3-26 per cell: the admission experiment's priority cell on the engine's
        virtual clock. At 1.0 instead of 0.9 the engine kept 97-100% of admission off's tokens and the
        interactive TTFT p99 was 1.23-2.0x alone on seeds 1-3; at 0.9, 95-96% and 1.05-1.18x.)"""
        return self.inter_service is not None and self.inter_service > INTERACTIVE_YIELD * self.e2e_target

    def _cut_fill(self, new: float, now: float, why: str) -> None:
        """Cut the fill limit to ``new`` per replica (never below the SLO limit): batch work yields."""
        log.info("admission: fill limit %.2f -> %.2f per replica: %s", self.batch_limit, max(self.limit, new), why)
        self.batch_limit = max(self.limit, new)
        self.last_batch_decrease = now
        self.batch_decreases += 1

    def _learn_fill(self, s: Sample, now: float, n: int) -> None:
        if self.queueing() or self.interactive_late():
            if now - self.last_batch_decrease >= (self.service or 0.0) and self.batch_limit > self.limit:
                self._cut_fill(self.batch_limit * 0.9, now, "requests waiting inside vLLM" if self.queueing()
                               else "interactive answers near the E2E target")
            return
        # tested: admitted near the fill limit less the interactive reserve (all batch work may use)
        if (s.inflight_at_admit + 1) / n >= 0.9 * (self.batch_limit - self.cfg.reserve_fraction * self.limit - 1.0):
            self.batch_limit += 1.0 / n

    def stats(self) -> dict:
        return {"limit": self.current(), "fill_limit": self.fill(), "replicas": self.count(),
                "limit_per_replica": round(self.limit, 2), "fill_per_replica": round(self.batch_limit, 2),
                "service_s": self.service, "service_ttft_s": self.svc_ttft, "interactive_service_s": self.inter_service, "tpot_s": self.tpot, "tpot_full_s": self.tpot_full,
                "live_tpot_s": self.live_tpot, "tpot_at_load_s": self.tpot_at(self.load_now), "load_now": self.load_now, "live_tpot_mean_s": self.live_tpot_mean, "live_decreases": self.live_decreases,
                "service_tail_s": self.tail(self.recent_e2e), "service_ttft_tail_s": self.tail(self.recent_ttft),
                "drain_per_s": self.drain_rate(), "kv_cap": self.kv_cap(), "saturated": self.saturated(),
                "samples": self.samples, "decreases": self.decreases, "fill_decreases": self.batch_decreases,
                "prefill_limit": self.prefill_places(), "prefill_per_replica": None if self.prefill_limit is None else round(self.prefill_limit, 2),
                "prefill_each_s": self.prefill_each, "live_tpot_peak_s": self.live_tpot_peak, "live_prefill_s": self.live_prefill, "live_service_s": self.live_service,
                "prefill_decreases": self.prefill_decreases}


def _healthy_figures(reps: list, attr: str) -> list[float]:
    """The healthy replicas' live figure ``attr`` (``Replica.itl_live``, ``prefill_live``, ``e2e_live``), where they have one."""
    return [v for r in reps if getattr(r, "healthy", True) and (v := getattr(r, attr, None)) is not None]


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


class Window:
    """The last ``size`` values, also kept sorted: its k-th largest is one index, where ``heapq.nlargest``
    over the window on every finished request was 7% of the gateway's CPU with admission on
    (``benchmarks/overhead.py``, docs/benchmarks.md section 13)."""

    __slots__ = ("_order", "_sorted")

    def __init__(self, size: int):
        self._order: deque[float] = deque(maxlen=size)
        self._sorted: list[float] = []

    def append(self, x: float) -> None:
        order = self._order
        if len(order) == order.maxlen:
            s = self._sorted
            del s[bisect.bisect_left(s, order[0])]
        order.append(x)
        bisect.insort(self._sorted, x)

    def clear(self) -> None:
        self._order.clear()
        self._sorted.clear()

    def largest(self, k: int) -> float:
        """The ``k``-th largest value (1: the largest)."""
        return self._sorted[-k]

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self):
        return iter(self._order)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + EWMA * (new - old)


def _kept(share: float) -> float:
    """The share of a limit a cut keeps: ``share`` (the target over what was measured), cutting at least
    10% and at most half."""
    return max(CUT_KEEP_MIN, min(CUT_KEEP_MAX, share))
