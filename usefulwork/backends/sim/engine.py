"""SimEngine: the simulated vLLM engine core on a virtual clock (pure, deterministic, no I/O).

One ``step()`` = one vLLM engine step: the scheduler picks the batch, the roofline says how long
it takes, the clock advances, every request whose known tokens are all computed samples one
(synthetic) token. Tests drive it directly (``run_until_idle``); the server drives the same object
in real time (``realtime.RealtimeRunner``); calibration drives it with a closed-loop client
(``offline.closed_loop``).

Example::

    engine = SimEngine(build_spec(gpu="A100-80G", model="Llama-3.1-8B"), seed=0)
    r = engine.add_request(list(range(512)), max_tokens=128, ignore_eos=True)
    engine.run_until_idle()
    r.first_token_time - r.arrival_time   # TTFT in simulated seconds
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from usefulwork.backends.sim.catalog import SimSpec
from usefulwork.backends.sim.kvcache import KVCacheManager, extend_block_hashes
from usefulwork.backends.sim.scheduler import Scheduler, SimRequest, Status, StepPlan
from usefulwork.backends.sim.timing import StepTimer

# vLLM V1's default bucket boundaries (vllm/v1/metrics/buckets.py).
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# Ids the synthetic "model" emits when no tokenizer supplies a list (any ids work for the engine).
DEFAULT_OUTPUT_IDS = tuple(range(1000, 1512))


class OutputSink(Protocol):
    def on_tokens(self, req: SimRequest, token_ids: list[int], finished: bool) -> None: ...


@dataclass
class Histogram:
    """A Prometheus-style cumulative histogram kept as plain counts (cheap to observe)."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for le, c in zip([*map(str, self.buckets), "+Inf"], self.counts):
            acc += c
            out.append((le, acc))
        return out


def request_latency_buckets_tokens(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to max_model_len, for the per-request token-count histograms."""
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_model_len:
                return tuple(out)
            out.append(float(v))
        exp += 1


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    steps: int = 0
    busy_seconds: float = 0.0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    inference: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    prefill: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    decode: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKENS_BUCKETS))
    request_prompt_tokens: Histogram | None = None
    request_generation_tokens: Histogram | None = None


class SimEngine:
    def __init__(self, spec: SimSpec, seed: int = 0, output_token_ids: Sequence[int] | None = None,
                 kv_events: Any = None, timer: Any = None, request_overhead_s: float | None = None):
        self.spec = spec
        self.seed = seed
        self.now = 0.0  # simulated seconds
        # kv_events: a publisher (sim/kv_events.py) of the KV cache's vLLM-shaped events, after each step
        self.kv_events = kv_events
        self.kv = KVCacheManager(spec.num_gpu_blocks, spec.block_size, spec.flags.enable_prefix_caching,
                                 events=kv_events is not None)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=spec.flags.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            enable_chunked_prefill=spec.flags.enable_chunked_prefill,
            long_prefill_token_threshold=spec.flags.long_prefill_token_threshold,
            policy=spec.flags.scheduler,
            scheduling_policy=spec.flags.scheduling_policy,
        )
        # timer: a step's seconds (``seconds(plan)``), the spec's roofline unless given (a model fitted to a
        # measured server: loadtest/calibrate.py); request_overhead_s: the API front-end's delay, the spec's unless given
        self.timer = timer or StepTimer(spec)
        self.stats = EngineStats()
        token_buckets = request_latency_buckets_tokens(spec.max_model_len)
        self.stats.request_prompt_tokens = Histogram(token_buckets)
        self.stats.request_generation_tokens = Histogram(token_buckets)
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._output_ids = tuple(output_token_ids or DEFAULT_OUTPUT_IDS)
        self._pending: list[SimRequest] = []  # accepted, still in the API front-end (ready_time ahead)
        self._request_overhead = (spec.gpu.calibration.request_overhead_ms / 1e3 if request_overhead_s is None
                                  else request_overhead_s)

    # -- requests --
    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        ignore_eos: bool = False,
        arrival_time: float | None = None,
        request_id: str | None = None,
        seed: int | None = None,
        sink: OutputSink | None = None,
        priority: int = 0,
    ) -> SimRequest:
        """Accept a request (already validated: prompt + max_tokens <= max_model_len)."""
        arrival = self.now if arrival_time is None else arrival_time
        rng_seed = self._rng.getrandbits(32) if seed is None else seed
        target = max_tokens if ignore_eos else min(max_tokens, self._natural_length(rng_seed))
        req = SimRequest(
            request_id=request_id or f"sim-{next(self._ids)}",
            prompt_token_ids=list(prompt_token_ids),
            max_tokens=max_tokens,
            output_target=max(1, target),
            arrival_time=arrival,
            ready_time=arrival + self._request_overhead,
            rng_seed=rng_seed,
            priority=priority,
            sink=sink,
        )
        # Arrivals come in time order almost always; keep the list sorted anyway.
        if self._pending and self._pending[-1].ready_time > req.ready_time:
            bisect.insort(self._pending, req, key=lambda r: r.ready_time)
        else:
            self._pending.append(req)
        return req

    def _natural_length(self, rng_seed: int) -> int:
        # Where the synthetic model would emit EOS: log-normal around the configured median.
        r = random.Random(rng_seed ^ 0x5EED)
        return max(1, int(math.exp(r.gauss(math.log(self.spec.eos_median_tokens), 0.6))))

    def abort(self, req: SimRequest) -> None:
        if req.status == Status.FINISHED:
            return
        if req in self._pending:
            self._pending.remove(req)
            req.status = Status.FINISHED
        else:
            self.scheduler.remove(req)
        req.finish_reason = "abort"
        req.finish_time = self.now
        self.stats.finished["abort"] += 1

    def next_token_id(self, req: SimRequest, index: int) -> int:
        return self._output_ids[hash((req.rng_seed, index)) % len(self._output_ids)]

    # -- state --
    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_work()

    @property
    def request_overhead_s(self) -> float:
        """The API front-end's fixed delay before an accepted request reaches the scheduler's queue."""
        return self._request_overhead

    def next_ready_time(self) -> float | None:
        return self._pending[0].ready_time if self._pending else None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._pending)

    # -- stepping --
    def _admit_ready(self) -> None:
        while self._pending and self._pending[0].ready_time <= self.now + 1e-12:
            self.scheduler.add(self._pending.pop(0))

    def plan_step(self) -> tuple[StepPlan, float] | None:
        """Schedule the next step at self.now; None when nothing can run now."""
        self._admit_ready()
        if not self.scheduler.has_work():
            return None
        plan = self.scheduler.schedule()
        while not plan.items and plan.preempted and self.scheduler.running:
            # (by priority, the first running request can be the victim: vLLM schedules nothing in that
            # step and goes on with the rest; here the rest is scheduled at once)
            plan = self.scheduler.schedule()
        if not plan.items:
            return None
        return plan, self.timer.seconds(plan)

    def complete_step(self, plan: StepPlan, end_time: float) -> None:
        """Apply a planned step that finished at end_time: progress, sampled tokens, finishes."""
        start = self.now
        self.now = max(self.now, end_time)
        now = self.now
        st = self.stats
        st.steps += 1
        st.busy_seconds += now - start
        st.iteration_tokens.observe(plan.total_tokens)
        for it in plan.items:
            req = it.req
            if req.status != Status.RUNNING:  # aborted while the step ran
                continue
            if req.first_scheduled_time is None:
                req.first_scheduled_time = start
            req.num_computed_tokens += it.num_new_tokens
            self.kv.cache_full_blocks(req, req.num_computed_tokens)
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk: no token yet
            tok = self.next_token_id(req, req.num_output_tokens)
            req.token_ids.append(tok)
            extend_block_hashes(req, self.kv.block_size)
            st.generation_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
                st.prompt_tokens += req.num_prompt_tokens
                st.ttft.observe(now - req.arrival_time)
                st.queue.observe(req.first_scheduled_time - req.arrival_time)
                st.prefill.observe(now - req.first_scheduled_time)
            else:
                st.itl.observe(now - req.last_token_time)
            req.last_token_time = now
            finished = (
                req.num_output_tokens >= req.output_target
                or req.num_tokens >= self.spec.max_model_len
            )
            if finished:
                self._finish(req, now)
            if req.sink is not None:
                req.sink.on_tokens(req, [tok], finished)
        if self.kv_events is not None and self.kv.events:
            self.kv_events.publish(self.kv.take_events(), now)

    def _finish(self, req: SimRequest, now: float) -> None:
        req.finish_reason = "length" if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.spec.max_model_len else "stop"
        req.finish_time = now
        self.scheduler.remove(req)
        st = self.stats
        st.finished[req.finish_reason] += 1
        st.e2e.observe(now - req.arrival_time)
        st.inference.observe(now - req.first_scheduled_time)
        st.decode.observe(now - req.first_token_time)
        if req.num_output_tokens > 1:
            st.tpot.observe((now - req.first_token_time) / (req.num_output_tokens - 1))
        st.request_prompt_tokens.observe(req.num_prompt_tokens)
        st.request_generation_tokens.observe(req.num_output_tokens)

    def step(self) -> StepPlan | None:
        """Virtual clock: run one step (jumping the clock to the next arrival if idle)."""
        planned = self.plan_step()
        if planned is None:
            nxt = self.next_ready_time()
            if nxt is None:
                return None
            self.now = max(self.now, nxt)
            planned = self.plan_step()
            if planned is None:
                return None
        plan, seconds = planned
        self.complete_step(plan, self.now + seconds)
        return plan

    def run_until_idle(self, max_steps: int = 10_000_000) -> int:
        steps = 0
        while steps < max_steps and self.step() is not None:
            steps += 1
        return steps

    def run_until(self, t: float) -> None:
        """Step while steps start before t (arrivals after t are left pending)."""
        while True:
            nxt = self.next_ready_time()
            if not self.scheduler.has_work() and (nxt is None or nxt > t):
                self.now = max(self.now, t)
                return
            if self.now >= t:
                return
            if self.step() is None:
                self.now = max(self.now, t)
                return
