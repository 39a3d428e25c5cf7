"""The simulated scheduler: vLLM V1's unified token-budget scheduler, plus vLLM 0.4's prefill-first.

V1 (``scheduler: v1``), one call to ``schedule`` = one engine step:
1. RUNNING requests first, in order: each gets min(tokens it still needs, remaining token budget)
   (a prefill chunk or one decode token). If the KV cache cannot hold them, the LAST running
   request is preempted (recompute: blocks freed, progress reset, put at the FRONT of waiting);
   if the victim is the request itself, scheduling of running requests stops.
2. If nothing was preempted, WAITING requests in FCFS order while the batch has fewer than
   ``max_num_seqs`` requests and token budget is left: prefix-cache lookup, then the prompt
   (chunked to the budget when chunked prefill is on; without it, a prompt that does not fit
   the remaining budget waits). A waiting request whose blocks do not fit stops admission.
   ``long_prefill_token_threshold`` caps every request's prefill chunk, running and waiting alike,
   except in a step with one request running or waiting (vLLM 0.32: nobody to starve). A running
   request's next chunk always comes before a waiting request, whatever their priorities: a
   smaller chunk cannot let an urgent prompt past a prompt already being prefilled, only share its steps.

V0 prefill-first (``scheduler: v0-prefill-first``, vLLM <= 0.5 default without chunked prefill):
if any waiting request can be admitted (whole prompt within the token budget, blocks free),
the step runs ONLY prefills; otherwise it runs one decode token for every running request.
Decodes stall while prompts are prefilled, which is what the published vLLM 0.4.3 numbers show.

Scheduling policy (vLLM's ``--scheduling-policy``): ``fcfs`` keeps the waiting queue in arrival order
(a preempted request goes back to its front); ``priority`` keeps it ordered by (``priority``, arrival
time), lower values first, and preempts the running request with the highest (priority, arrival)
instead of the last one, as vLLM V1's scheduler does (``max(self.running, key=(priority, arrival))``).
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from dataclasses import dataclass, field

from usefulwork.backends.sim.kvcache import KVCacheManager, extend_block_hashes


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    output_target: int  # tokens this request will produce (max_tokens, or an earlier "EOS")
    arrival_time: float = 0.0  # when the client sent it (simulated seconds)
    ready_time: float = 0.0  # when it reaches the scheduler (after the API front-end)
    rng_seed: int = 0
    priority: int = 0  # vLLM's request priority (lower first); used by the "priority" scheduling policy
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit tokens at first scheduling (usage.cached_tokens)
    status: Status = Status.WAITING
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    sink: object | None = None  # receives outputs (see engine.OutputSink)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_prefilling(self) -> bool:
        # Prompt (or, after preemption, prompt + earlier output) not yet fully in the KV cache.
        return self.num_tokens - self.num_computed_tokens > 1 or self.num_output_tokens == 0


@dataclass(slots=True)
class ScheduledItem:
    req: SimRequest
    num_new_tokens: int
    context_before: int  # tokens already in the KV cache when this step starts


@dataclass(slots=True)
class StepPlan:
    items: list[ScheduledItem]
    preempted: list[SimRequest]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass(slots=True)
class SchedulerStats:
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prefill tokens computed (vllm:prompt_tokens counts new prompt tokens)
    generation_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        policy: str = "v1",
        scheduling_policy: str = "fcfs",
    ):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.long_prefill_threshold = long_prefill_token_threshold
        self.policy = policy
        self.by_priority = scheduling_policy == "priority"
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stats = SchedulerStats()

    # -- queue management --
    def add(self, req: SimRequest) -> None:
        extend_block_hashes(req, self.kv.block_size)
        req.status = Status.WAITING
        self._enqueue(req)

    def _enqueue(self, req: SimRequest, front: bool = False) -> None:
        """Into the waiting queue: FCFS at the back (a preempted request at the front); by priority
        at its (priority, arrival) place."""
        if self.by_priority:
            key = (req.priority, req.arrival_time)
            i = bisect.bisect_right([(r.priority, r.arrival_time) for r in self.waiting], key)
            self.waiting.insert(i, req)
        elif front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def remove(self, req: SimRequest) -> None:
        """Drop a request (finished or aborted) and free its blocks."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status in (Status.WAITING, Status.PREEMPTED):
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free_request(req)
        req.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- scheduling --
    def schedule(self) -> StepPlan:
        if self.policy == "v0-prefill-first":
            return self._schedule_v0()
        return self._schedule_v1()

    def _chunk(self, wanted: int, budget: int, threshold: int) -> int:
        n = min(wanted, budget)
        if threshold and wanted > 1:
            n = min(n, threshold)
        return n

    def _allocate_or_preempt(self, req, num_tokens: int, preempted: list) -> bool:
        """Grow req's KV blocks to num_tokens, preempting from the back of the running queue until
        they fit (vLLM's recompute preemption). False when req itself had to be preempted."""
        while not self.kv.allocate(req, num_tokens):
            victim = self._preempt_last()
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt_last(self) -> SimRequest:
        if self.by_priority:
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
            self.running.remove(victim)
        else:
            victim = self.running.pop()
        self.kv.free_request(victim)
        victim.num_computed_tokens = 0
        victim.status = Status.PREEMPTED
        victim.num_preemptions += 1
        self.stats.num_preemptions += 1
        self._enqueue(victim, front=True)
        return victim

    def _admit_prefix(self, req: SimRequest) -> list[int]:
        """Prefix-cache lookup for a request about to (re)start; counts query/hit tokens."""
        hits = self.kv.find_prefix(req)
        req.num_computed_tokens = len(hits) * self.kv.block_size
        if self.kv.enable_prefix_caching:
            self.stats.prefix_cache_queries += req.num_tokens
            self.stats.prefix_cache_hits += req.num_computed_tokens
        return hits

    def _schedule_v1(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        # (vLLM V1 drops the long-prefill cap for a step with one request running or waiting: nobody to starve)
        threshold = self.long_prefill_threshold if len(self.running) + len(self.waiting) > 1 else 0
        items: list[ScheduledItem] = []
        preempted: list[SimRequest] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req.num_tokens - req.num_computed_tokens, budget, threshold)
            before = len(preempted)
            ok = self._allocate_or_preempt(req, req.num_computed_tokens + n, preempted)
            for victim in preempted[before:]:  # by priority, a victim may be one scheduled earlier this step
                for j, it in enumerate(items):
                    if it.req is victim:
                        budget += it.num_new_tokens
                        del items[j]
                        i -= 1
                        break
            if not ok:
                break
            items.append(ScheduledItem(req, n, req.num_computed_tokens))
            budget -= n
            i += 1

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                hits = self._admit_prefix(req)
                wanted = req.num_tokens - req.num_computed_tokens
                if not self.chunked and wanted > budget:
                    self._undo_lookup(req, hits)
                    break
                n = self._chunk(wanted, budget, threshold)
                if not self.kv.allocate(req, req.num_computed_tokens + n, hits):
                    self._undo_lookup(req, hits)
                    break
                self.waiting.popleft()
                self._start_running(req)
                items.append(ScheduledItem(req, n, req.num_computed_tokens))
                budget -= n
        return self._finish_plan(items, preempted)

    def _schedule_v0(self) -> StepPlan:
        # Prefill-first: admit waiting prompts whole (no chunking) while they fit.
        budget = self.max_num_batched_tokens
        items: list[ScheduledItem] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits = self._admit_prefix(req)
            wanted = req.num_tokens - req.num_computed_tokens
            if wanted > budget:
                self._undo_lookup(req, hits)
                break
            # vLLM V0 keeps a 1% watermark of free blocks so that decodes do not preempt at once.
            watermark = max(1, self.kv.num_blocks // 100)
            need = self.kv.blocks_needed(req, req.num_tokens) - len(hits)
            if self.kv.num_free_blocks - need < watermark or not self.kv.allocate(req, req.num_tokens, hits):
                self._undo_lookup(req, hits)
                break
            self.waiting.popleft()
            self._start_running(req)
            items.append(ScheduledItem(req, wanted, req.num_computed_tokens))
            budget -= wanted
        if items:
            return self._finish_plan(items, [])
        # Decode step: one token for every running request, preempting from the tail when full.
        preempted: list[SimRequest] = []
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if not self._allocate_or_preempt(req, req.num_computed_tokens + 1, preempted):
                break
            items.append(ScheduledItem(req, 1, req.num_computed_tokens))
            i += 1
        return self._finish_plan(items, preempted)

    def _undo_lookup(self, req: SimRequest, hits: list[int]) -> None:
        # The lookup was counted but the request did not start: vLLM counts it again next step
        # too (queries are per scheduling attempt of a request that gets blocks); we only count
        # successful admissions, so take it back.
        if self.kv.enable_prefix_caching:
            self.stats.prefix_cache_queries -= req.num_tokens
            self.stats.prefix_cache_hits -= req.num_computed_tokens
        req.num_computed_tokens = 0

    def _start_running(self, req: SimRequest) -> None:
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = req.num_computed_tokens
        req.status = Status.RUNNING
        self.running.append(req)

    def _finish_plan(self, items: list[ScheduledItem], preempted: list[SimRequest]) -> StepPlan:
        plan = StepPlan(items, preempted)
        for it in items:
            # A chunk that ends before the last known token is prefill; the last token is "decode"
            # for a request that already has output (its first token after the prompt is prefill).
            if it.req.num_tokens - it.context_before == 1 and it.req.num_output_tokens > 0:
                plan.num_decode_tokens += 1
            else:
                plan.num_prefill_tokens += it.num_new_tokens
        return plan
