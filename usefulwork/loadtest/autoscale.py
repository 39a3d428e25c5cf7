"""``usefulwork loadtest --experiment autoscale``: an autoscaling what-if on the simulator's virtual clock.

A bursty day (BurstGPT-like: gamma inter-arrivals, CV > 1, under a diurnal envelope whose peak is
several times the night's base) is served by a fleet of simulated vLLM replicas (Llama-3.1-8B on
A100-80G, one ``SimEngine`` per replica, all on one virtual clock: no HTTP, no wall time), scaled the
way Kubernetes would scale it: the HPA algorithm of usefulwork/loadtest/hpa.py every 15 s, a new pod
billed from its creation and serving only after ``cold_start_s``, a removed pod draining its requests
for up to ``grace_s``. Compared policies (``POLICIES``):

- ``fixed-peak``: a fixed fleet sized for the peak rate;
- ``fixed-mean``: a fixed fleet sized for the day's mean rate;
- ``hpa-vllm-queue``: the seed's HPA: vLLM's own queue (``vllm:num_requests_waiting``, average 50 per
  pod), 2..8 pods, the seed's windows (60 s up, 2 pods / 120 s; 300 s down);
- ``hpa-gateway-queue``: the gateway's admission filter on, and the same HPA bounds and windows on the
  gateway's view of the pool: ``usefulwork_admission_queue_depth`` (queued at the gateway) plus
  ``usefulwork_admission_shed_demand`` (shed within the last service time) plus the requests the pool
  is serving (``vllm:num_requests_running``), per pod; the query deploy/k8s/ uses.

With admission on, requests go through the admission filter's own queue and capacity objects
(usefulwork/gateway/admission/queue.py ``PoolQueue`` and capacity.py ``Capacity``, which take ``now``),
driven on the same virtual clock: admit / queue / shed at arrival, the per-replica in-flight limits
learnt from finished requests (times the serving replicas), deadlines, Retry-After reservations. Every
2 s each replica is scraped as the gateway scrapes vLLM's ``/metrics``, into the gateway's own replica
record (usefulwork/upstream/fleet.py ``Replica``): running, waiting, KV usage, and the inter-token
latency histogram that gives the live decode speed admission judges and prices waits at. Clients behave as the OpenAI SDK by default:
a 429 is retried after its Retry-After (``max_retries`` times); a request not finished ``timeout_s``
after it was sent is abandoned (the replica aborts it). Latency is measured from the FIRST send, so a
retried request's wait counts against its SLO.

The "day" is the 24 h shape compressed into ``day_s`` simulated seconds (default 1440: an hour per
minute; the step-level engine costs about 10 us of CPU per generated token: 30-40 s of CPU per
policy for the default day); the HPA's windows, sync period and cold start are NOT compressed, so
the ramps the autoscalers must follow are 60x steeper than a real day's, and the quiet night is 60x
shorter: a hard setting for autoscaling, on both its SLO and its savings.
"""

from __future__ import annotations

import heapq
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import numpy as np

from usefulwork.backends.sim.catalog import build_spec
from usefulwork.backends.sim.engine import SimEngine
from usefulwork.backends.sim.scheduler import SimRequest
from usefulwork.gateway.admission.capacity import Capacity, Sample
from usefulwork.gateway.admission.config import AdmissionCfg
from usefulwork.gateway.admission.queue import CLIENT_TIMEOUT_SHARE, SDK_RETRY_AFTER_MAX_S, PoolQueue, Ticket
from usefulwork.loadtest.metrics import SLOSpec
from usefulwork.loadtest.hpa import HPA, SEED_DOWN, SEED_UP, SYNC_PERIOD_S, Rules
from usefulwork.upstream.fleet import Replica as ReplicaView

# Per-pod target of the gateway policy's metric (queued at the gateway + being served): 75% of the
# requests one replica holds in flight at its SLO capacity under the day's bursty arrivals (Little's law:
# 10 req/s x 3.19 s mean E2E = 32; tests/loadtest/test_autoscale.py measures it). deploy/k8s/ uses the
# same number. (It was 16, from a figure of ~21 in flight taken under Poisson arrivals.)
GATEWAY_QUEUE_TARGET = 24.0
SEED_VLLM_QUEUE_TARGET = 50.0  # the seed's HPA: averageValue 50 on the vLLM queue
SCRAPE_S = 2.0  # the gateway's /metrics scrape of each replica (timeouts.health_interval_s default)
SLO = SLOSpec(ttft_ms=2000.0, tpot_ms=100.0, e2e_ms=5000.0, attainment=0.95)  # cost-a100's and admission's
# The day's envelope as (hour, multiple of the base rate); linear in between (peak set by the day).
# Night at the base; a morning ramp to 3x; an early-afternoon burst to the peak (6x with the defaults)
# for two hours; back to 3x, then down to the base in the evening.
ENVELOPE = ((0.0, 1.0), (6.0, 1.0), (9.0, 3.0), (12.0, 3.0), (13.0, None), (15.0, None), (16.0, 3.0),
            (19.0, 3.0), (22.0, 1.0), (24.0, 1.0))


@dataclass(frozen=True)
class Day:
    day_s: float = 1440.0  # the 24 h shape, compressed into this many simulated seconds (an hour per minute)
    base_rate: float = 8.0  # requests/s at night
    peak_rate: float = 48.0  # requests/s on the day's plateau (6x the base)
    burstiness: float = 0.5  # gamma shape of the inter-arrival gaps (< 1: burstier than Poisson; CV 1.41)
    prompt_tokens: int = 512
    output_tokens: int = 128
    seed: int = 0

    def multiple(self, hour: float) -> float:
        pts = [(h, self.peak_rate / self.base_rate if m is None else m) for h, m in ENVELOPE]
        return float(np.interp(hour, [h for h, _ in pts], [m for _, m in pts]))

    def rate_at(self, t: float) -> float:
        return self.base_rate * self.multiple(24.0 * t / self.day_s)

    @property
    def mean_rate(self) -> float:
        grid = np.linspace(0.0, 24.0, 24 * 60 + 1)
        return self.base_rate * float(np.mean([self.multiple(h) for h in grid]))

    def arrivals(self) -> np.ndarray:
        """Gamma renewal process of unit rate in operational time, mapped through the envelope's
        cumulative rate: gaps keep their burstiness while the rate follows the day."""
        rng = np.random.default_rng(self.seed)
        grid = np.linspace(0.0, self.day_s, int(self.day_s) + 1)
        rates = np.array([self.rate_at(t) for t in grid])
        cum = np.concatenate([[0.0], np.cumsum((rates[1:] + rates[:-1]) / 2 * np.diff(grid))])
        n = int(cum[-1] * 1.2) + 100
        ops = np.cumsum(rng.gamma(shape=self.burstiness, scale=1.0 / self.burstiness, size=n))
        ops = ops[ops < cum[-1]]
        return np.interp(ops, cum, grid)


@dataclass(frozen=True)
class Fleet:
    gpu: str = "A100-80G"
    model: str = "Llama-3.1-8B"
    sim_profile: str = "optimized-batched"
    usd_per_hour: float = 3.50  # one A100-80G (as deploy/ and cost-a100)
    replica_capacity_rps: float = 10.0  # per replica at the SLO (admission experiment: 10 req/s meets it, 12 not)
    cold_start_s: float = 120.0  # pod created -> vLLM ready (image cached; model load, CUDA graphs)
    grace_s: float = 60.0  # a removed pod's in-flight requests may finish for this long (then aborted)
    min_replicas: int = 2  # the seed's HPA bounds
    max_replicas: int = 8


@dataclass(frozen=True)
class Client:
    timeout_s: float = 60.0
    max_retries: int = 2  # the OpenAI SDK's default; 429s are retried after their Retry-After
    # The SDK honours a Retry-After up to this; longer: it gives up (openai-python 3.x's MAX_RETRY_AFTER_DELAY;
    # before 3.x it ignored one over 60 s and retried on its own backoff)
    max_retry_after_s: float = SDK_RETRY_AFTER_MAX_S
    from_first_send: bool = False  # ``timeout_s`` counts from the first send, retries' waits included (the loadtest client's)


@dataclass(frozen=True)
class Policy:
    name: str
    description: str
    fixed: int | None = None  # a fixed fleet of this size (None: autoscaled)
    metric: str | None = None  # "vllm-queue" | "gateway-queue" | "gateway-queue-only"
    target: float = 0.0
    up: Rules = SEED_UP
    down: Rules = SEED_DOWN
    admission: bool = False


def policies(day: Day, fleet: Fleet) -> list[Policy]:
    peak = math.ceil(day.peak_rate / fleet.replica_capacity_rps)
    mean = math.ceil(day.mean_rate / fleet.replica_capacity_rps)
    return [
        Policy("fixed-peak", f"{peak} replicas all day (peak {day.peak_rate:g} req/s / {fleet.replica_capacity_rps:g} "
               "per replica)", fixed=peak),
        Policy("fixed-mean", f"{mean} replicas all day (mean {day.mean_rate:.1f} req/s)", fixed=mean),
        Policy("hpa-vllm-queue", f"the seed's HPA: vllm:num_requests_waiting, averageValue "
               f"{SEED_VLLM_QUEUE_TARGET:g}, {fleet.min_replicas}..{fleet.max_replicas}", metric="vllm-queue",
               target=SEED_VLLM_QUEUE_TARGET),
        Policy("hpa-gateway-queue", f"admission on; HPA on the gateway's queue + shed demand + running per pool, averageValue "
               f"{GATEWAY_QUEUE_TARGET:g}, same bounds and windows", metric="gateway-queue",
               target=GATEWAY_QUEUE_TARGET, admission=True),
    ]


# ---------------------------------------------------------------------------------------------
# the simulation


@dataclass(eq=False)
class Replica:
    id: int
    engine: SimEngine
    created: float
    ready_at: float
    removed_at: float | None = None  # scale-down: no new work from then on
    gone_at: float | None = None  # drained (or grace over): billing stops
    plan: Any = None
    plan_end: float = math.inf
    inflight: int = 0
    # What the gateway last scraped (every timeouts.health_interval_s): the gateway's own replica record,
    # fed the same metrics, so admission.Capacity reads the same fields it reads in the gateway, the
    # live decode speed (``itl_live``, from vLLM's inter-token latency histogram) and request time
    # (``e2e_live``) computed the same way.
    scraped: ReplicaView = field(init=False)

    def __post_init__(self) -> None:
        spec = self.engine.spec
        self.scraped = ReplicaView(url="sim", pool="sim", healthy=True, num_gpu_blocks=float(spec.num_gpu_blocks),
                                   block_size=float(spec.block_size))

    def scrape(self) -> None:
        itl, e2e = self.engine.stats.itl, self.engine.stats.e2e
        self.scraped.take_metrics({"waiting": float(len(self.engine.scheduler.waiting)),
                                   "running": float(self.engine.num_running), "kv_usage": self.engine.kv.usage,
                                   "itl_sum": itl.total, "itl_count": float(itl.n),
                                   "e2e_sum": e2e.total, "e2e_count": float(e2e.n)})

    def serving(self, now: float) -> bool:
        return self.removed_at is None and self.ready_at <= now


@dataclass(eq=False)
class Req:
    """One logical request (a client call, with its retries)."""

    id: int
    t0: float
    attempts: int = 0
    tenant: str = "default"
    max_retries: int | None = None  # None: the client's
    first_retry: str = ""  # its first retry: "admitted" (dispatched), "shed" ("" when none)
    first_retry_reason: str = ""  # why its first retry was shed
    outcome: str | None = None  # ok | timeout | shed | error
    ttft: float | None = None
    e2e: float | None = None
    tpot: float | None = None
    # the current attempt
    sent: float = 0.0
    ticket: Ticket | None = None
    sim: SimRequest | None = None
    replica: Replica | None = None


class Simulation:
    def __init__(self, policy: Policy, day: Day, fleet: Fleet, client: Client, slo: SLOSpec):
        self.policy, self.day, self.fleet, self.client, self.slo = policy, day, fleet, client, slo
        self.spec = build_spec(gpu=fleet.gpu, model=fleet.model, profile=fleet.sim_profile)
        # (tenant, max retries or None for the client's) of a request first sent at t0; None: all "default"
        self.clients: Callable[[float], tuple[str, int | None]] | None = None
        self.now = 0.0
        self.replicas: list[Replica] = []
        self._next_id = 0
        self.tail = list(range(1001, 1000 + day.prompt_tokens))  # prompts differ in their first token
        n0 = policy.fixed if policy.fixed is not None else fleet.min_replicas
        for _ in range(n0):
            self._add_replica(ready_at=0.0)
        self.hpa = None if policy.fixed is not None else HPA(fleet.min_replicas, fleet.max_replicas, policy.target,
                                                             up=policy.up, down=policy.down)
        self.queue: PoolQueue | None = None
        if policy.admission:
            self.queue = self.admission_queue()
            self.deadline_s = slo.ttft_ms / 1e3  # interactive class: the TTFT SLO (admission's default)
        self.sends: list[tuple[float, int, Req]] = []  # (time, seq, request): first sends and retries
        self.timeouts: list[tuple[float, int, Req, int]] = []  # (deadline, seq, request, attempt)
        self.by_sim: dict[int, Req] = {}
        self._seq = 0
        self.requests: list[Req] = []
        self.timeline: list[dict[str, float]] = []
        self.hpa_log: list[tuple[float, int, float]] = []
        self.peak_replicas = n0

    def admission_queue(self, view: Callable[[ReplicaView], Any] = lambda v: v) -> PoolQueue:
        """A fresh gateway's admission queue (nothing learnt) in front of the serving replicas, which it sees
        through ``view`` of what it scraped from each."""
        cfg, slo = AdmissionCfg(), self.slo
        cap = Capacity(cfg, slo.ttft_ms / 1e3, slo.tpot_ms / 1e3, slo.e2e_ms / 1e3,
                       replicas=lambda: [view(r.scraped) for r in self._serving()],
                       replica_count=lambda: len(self._serving()))
        return PoolQueue.from_cfg("llama-8b", cap, cfg, slo.e2e_ms / 1e3)

    # -- fleet --
    def _serving(self) -> list[Replica]:
        return [r for r in self.replicas if r.serving(self.now)]

    def _add_replica(self, ready_at: float) -> None:
        self.replicas.append(Replica(self._next_id, SimEngine(self.spec, seed=self._next_id), self.now, ready_at))
        self._next_id += 1

    def _scale_to(self, n: int) -> None:
        self.peak_replicas = max(self.peak_replicas, n)
        live = [r for r in self.replicas if r.removed_at is None]
        for _ in range(n - len(live)):
            self._add_replica(self.now + self.fleet.cold_start_s)
        if n < len(live):
            # the ReplicaSet deletes not-ready pods first, then (here) the least loaded
            order = sorted(live, key=lambda r: (r.ready_at <= self.now, r.inflight, -r.created))
            for r in order[:len(live) - n]:
                r.removed_at = self.now
                if r.inflight == 0:
                    r.gone_at = self.now

    def _metric(self) -> float:
        m = self.policy.metric
        if m == "vllm-queue":
            return float(sum(r.engine.num_waiting for r in self.replicas if r.gone_at is None and r.ready_at <= self.now))
        assert self.queue is not None
        queued = float(self.queue.queued)
        if m == "gateway-queue-only":
            return queued
        # (+ the demand admission shed, as requests in flight: docs/deploy.md)
        return queued + self.queue.shed_demand(self.now) + sum(r.engine.num_running + r.engine.num_waiting
                                                               for r in self.replicas
                                                               if r.gone_at is None and r.ready_at <= self.now)

    def _autoscale(self) -> None:
        live = sum(1 for r in self.replicas if r.removed_at is None)
        metric = self._metric()
        n = self.hpa.sync(self.now, live, metric)
        self.hpa_log.append((self.now, n, metric))
        if n != live:
            self._scale_to(n)

    # -- requests --
    def _push_send(self, t: float, req: Req) -> None:
        self._seq += 1
        heapq.heappush(self.sends, (t, self._seq, req))

    def _send(self, req: Req) -> None:
        req.attempts += 1
        req.sent = self.now
        if self.queue is None:
            self._dispatch(req)
            return
        t = Ticket(req.tenant, 0, float(self.day.prompt_tokens + self.day.output_tokens), self.now,
                   self.now + self.deadline_s, max_tokens=self.day.output_tokens, key=req.id + 1,
                   retried=req.attempts - 1 if self._retries(req) else None)
        # (the OpenAI SDK numbers its attempts: x-stainless-retry-count; a client that never retries, as the
        # loadtest's that does not honour Retry-After, does not)
        if self.client.from_first_send:  # (the loadtest's client declares the time it has left on every attempt)
            t.done_by = t.give_up_at = self.now + CLIENT_TIMEOUT_SHARE * (req.t0 + self.client.timeout_s - self.now)
        t.waiter = req
        req.ticket = t
        d = self.queue.offer(t, self.now)
        if d.kind == "admit":
            self._dispatch(req)
        elif d.kind == "shed":
            self._shed(req, d.retry_after_s)
        self._wake(d.woken)

    def _wake(self, tickets: list[Ticket]) -> None:
        """As the filter does: admitted tickets go upstream, shed ones get their 429."""
        for nxt in tickets:
            if nxt.state == "admitted":
                self._dispatch(nxt.waiter)
            else:
                self._shed(nxt.waiter, nxt.retry_after_s)  # (set by the queue when it dropped the ticket)

    def _pump(self) -> None:
        self._wake(self.queue.pump(self.now))

    def _retries(self, req: Req) -> int:
        return self.client.max_retries if req.max_retries is None else req.max_retries

    def _shed(self, req: Req, retry_after_s: float) -> None:
        if req.attempts == 2 and not req.first_retry:
            req.first_retry = "shed"
            req.first_retry_reason = (req.ticket.shed_reason if req.ticket is not None else None) or ""
        retries = self._retries(req)
        # (x-should-retry: false, which the SDKs obey. A client counting its timeout from its first send
        # declares it, ``Ticket.give_up_at``: a Retry-After past it is always such, never slept into.)
        final = req.ticket is not None and req.ticket.final
        if req.attempts <= retries and retry_after_s <= self.client.max_retry_after_s and not final:
            self._push_send(self.now + retry_after_s, req)
        else:
            self._end(req, "shed")

    def _dispatch(self, req: Req) -> None:
        if req.attempts == 2 and not req.first_retry:
            req.first_retry = "admitted"
        serving = self._serving()
        if not serving:
            self._end(req, "error")
            return
        rep = min(serving, key=lambda r: (r.inflight, r.id))  # the gateway's least-loaded picker
        rep.inflight += 1
        req.replica = rep
        req.sim = rep.engine.add_request([1000 + req.id % 120000, *self.tail], self.day.output_tokens,
                                         ignore_eos=True, arrival_time=self.now)
        self.by_sim[id(req.sim)] = req
        self._seq += 1
        start = req.t0 if self.client.from_first_send else req.sent
        heapq.heappush(self.timeouts, (start + self.client.timeout_s, self._seq, req, req.attempts))
        if rep.plan is None:
            rep.plan_end = min(rep.plan_end, rep.engine.next_ready_time() or self.now)

    def _finish_attempt(self, req: Req, ok: bool) -> None:
        """The attempt left its replica (finished or aborted): free the slot, learn, dispatch."""
        rep, sim = req.replica, req.sim
        rep.inflight -= 1
        self.by_sim.pop(id(sim), None)
        if rep.removed_at is not None and rep.inflight == 0 and rep.gone_at is None:
            rep.gone_at = self.now
        if self.queue is not None and req.ticket is not None:
            t = req.ticket
            ttft = None if sim.first_token_time is None else sim.first_token_time - t.admitted_at
            n = sim.num_output_tokens
            tpot = (sim.finish_time - sim.first_token_time) / (n - 1) if ok and n > 1 else None
            sample = Sample(ttft=ttft, tpot=tpot, service=self.now - t.admitted_at,
                            tokens=sim.num_prompt_tokens + n, ok=ok, inflight_at_admit=t.inflight_at_admit,
                            completion=n)  # (as the filter passes vLLM's usage count)
            for nxt in self.queue.release(t, self.now, sample, sim.num_prompt_tokens + n):
                self._dispatch(nxt.waiter)
        req.sim = req.replica = None

    def _end(self, req: Req, outcome: str) -> None:
        req.outcome = outcome

    def _on_finished(self, sim: SimRequest) -> None:
        req = self.by_sim.get(id(sim))
        if req is None:
            return
        req.ttft = sim.first_token_time - req.t0
        req.e2e = sim.finish_time - req.t0
        n = sim.num_output_tokens
        req.tpot = (sim.finish_time - sim.first_token_time) / (n - 1) if n > 1 else None
        self._finish_attempt(req, ok=True)
        self._end(req, "ok")

    def _first_token(self, sim: SimRequest) -> None:
        """A first token came out of this step: the proxy's first-token hook (the prefill limit learns)."""
        req = self.by_sim.get(id(sim))
        if req is not None and req.ticket is not None:
            self._wake(self.queue.first_token(req.ticket, self.now))

    def _on_timeout(self, req: Req, outcome: str = "timeout") -> None:
        rep, sim = req.replica, req.sim
        rep.engine.abort(sim)
        self._finish_attempt(req, ok=False)
        self._end(req, outcome)

    def _queue_due(self) -> float:
        """When the admission queue next has a queued ticket at its latest start (inf: none)."""
        return (self.queue.next_deadline() or math.inf) if self.queue is not None and self.queue.queued else math.inf

    def _expire_queue(self) -> None:
        self._wake(self.queue.expire(self.now))
        self._pump()

    def _step_replica(self, rep: Replica) -> None:
        eng = rep.engine
        if rep.plan is not None:
            plan, rep.plan = rep.plan, None
            eng.complete_step(plan, self.now)
            for it in plan.items:
                if self.queue is not None and it.req.num_output_tokens == 1:
                    self._first_token(it.req)
                if it.req.finish_time is not None and it.req.finish_reason in ("stop", "length"):
                    self._on_finished(it.req)
        else:
            eng.now = max(eng.now, self.now)
        planned = eng.plan_step()
        if planned is not None:
            rep.plan, secs = planned
            rep.plan_end = self.now + secs
        else:
            nxt = eng.next_ready_time()
            rep.plan_end = nxt if nxt is not None else math.inf
        if rep.removed_at is not None and rep.gone_at is None and self.now >= rep.removed_at + self.fleet.grace_s:
            self._drain_abort(rep)

    def _drain_abort(self, rep: Replica) -> None:
        for req in [r for r in self.by_sim.values() if r.replica is rep]:
            self._on_timeout(req, "aborted")  # its pod was deleted before it finished
        rep.gone_at = self.now
        rep.plan, rep.plan_end = None, math.inf

    # -- the loop --
    def run(self) -> dict[str, Any]:
        cpu0 = time.process_time()
        for i, t in enumerate(self.day.arrivals()):
            req = Req(i, float(t))
            if self.clients is not None:
                req.tenant, req.max_retries = self.clients(req.t0)
            self.requests.append(req)
            self._push_send(float(t), req)
        next_sync = SYNC_PERIOD_S if self.hpa is not None else math.inf
        next_sample = 0.0
        next_scrape = 0.0
        end_of_day = self.day.day_s
        while True:
            t_send = self.sends[0][0] if self.sends else math.inf
            while self.timeouts and (self.timeouts[0][2].attempts != self.timeouts[0][3]
                                     or self.timeouts[0][2].sim is None):
                heapq.heappop(self.timeouts)  # that attempt already ended
            t_timeout = self.timeouts[0][0] if self.timeouts else math.inf
            t_queue = self._queue_due()
            rep = min((r for r in self.replicas if r.gone_at is None), key=lambda r: r.plan_end, default=None)
            t_rep = rep.plan_end if rep is not None else math.inf
            t_drain = min((r.removed_at + self.fleet.grace_s for r in self.replicas
                           if r.removed_at is not None and r.gone_at is None), default=math.inf)
            busy = t_send < math.inf or t_timeout < math.inf or t_rep < math.inf
            if not busy and self.now >= end_of_day:
                break
            t = min(t_send, t_timeout, t_queue, t_rep, t_drain, next_sync, next_sample, next_scrape)
            if t == math.inf:
                break
            self.now = max(self.now, t)
            if t == next_scrape:
                for r in self.replicas:
                    if r.gone_at is None:
                        r.scrape()
                next_scrape += SCRAPE_S
                if self.queue is not None:
                    self._pump()  # the limit follows the serving replicas: a new one frees slots
            elif t == next_sample:
                self._sample()
                next_sample += 60.0
                if self.now >= end_of_day and not busy:
                    break
            elif t == next_sync:
                if self.now < end_of_day or busy:
                    self._autoscale()
                next_sync += SYNC_PERIOD_S
            elif t == t_timeout:
                _, _, req, _ = heapq.heappop(self.timeouts)
                self._on_timeout(req)
            elif t == t_queue:
                self._expire_queue()
            elif t == t_drain:
                for r in self.replicas:
                    if r.removed_at is not None and r.gone_at is None and r.removed_at + self.fleet.grace_s <= self.now:
                        self._drain_abort(r)
            elif t == t_send:
                _, _, req = heapq.heappop(self.sends)
                self._send(req)
            else:
                self._step_replica(rep)
        end = max(self.now, end_of_day)
        for r in self.replicas:
            if r.gone_at is None:
                r.gone_at = end
        return self._result(time.process_time() - cpu0, end)

    def _sample(self) -> None:
        live = [r for r in self.replicas if r.removed_at is None]
        self.timeline.append({
            "t": self.now, "rate": self.day.rate_at(min(self.now, self.day.day_s)), "replicas": len(live),
            "ready": sum(1 for r in live if r.ready_at <= self.now),
            "running": sum(r.engine.num_running for r in live), "vllm_waiting": sum(r.engine.num_waiting for r in live),
            "gateway_queued": self.queue.queued if self.queue is not None else 0,
            "admission_limit": self.queue.capacity.current() if self.queue is not None else None,
            "live_tpot_s": self.queue.capacity.live_tpot_mean if self.queue is not None else None})

    # -- figures --
    def _result(self, cpu_s: float, end: float) -> dict[str, Any]:
        reqs = self.requests
        slo = self.slo
        ok = [r for r in reqs if r.outcome == "ok"]
        good = [r for r in ok if r.ttft * 1e3 <= slo.ttft_ms and r.e2e * 1e3 <= slo.e2e_ms
                and (r.tpot is None or r.tpot * 1e3 <= slo.tpot_ms)]
        counts = {k: sum(1 for r in reqs if r.outcome == k) for k in ("ok", "timeout", "shed", "error", "aborted")}
        replica_s = sum(r.gone_at - r.created for r in self.replicas)
        cost = replica_s / 3600.0 * self.fleet.usd_per_hour
        attainment = len(good) / len(reqs) if reqs else 0.0
        failed = counts["timeout"] + counts["shed"] + counts["error"] + counts["aborted"]

        def pct(xs: list[float], q: float) -> float | None:
            return float(np.percentile(xs, q)) if xs else None

        return {
            "policy": self.policy.name, "description": self.policy.description,
            "requests": len(reqs), "successful": len(ok), "slo_good": len(good),
            "timeouts": counts["timeout"], "sheds": counts["shed"], "errors": counts["error"],
            "aborted_by_scale_down": counts["aborted"],
            "failed": failed, "retried": sum(1 for r in reqs if r.attempts > 1),
            "slo_attainment": attainment, "slo_met": attainment >= slo.attainment and counts["timeout"] == 0,
            "replica_hours": replica_s / 3600.0, "cost_usd": cost,
            "usd_per_1k_successful": cost / len(ok) * 1e3 if ok else None,
            "usd_per_1k_slo_good": cost / len(good) * 1e3 if good else None,
            "replicas_max": self.peak_replicas,
            "replicas_min": min((n for _, n, _ in self.hpa_log), default=self.peak_replicas),
            "replicas_mean": replica_s / end,
            "p95_ttft_s": pct([r.ttft for r in ok], 95), "p95_e2e_s": pct([r.e2e for r in ok], 95),
            "duration_s": end, "cpu_s": cpu_s,
            "timeline": self.timeline,
        }


def replica_hour_bound(day: Day, fleet: Fleet, peak_fleet: int, down_window_s: float = SEED_DOWN.window_s,
                       lead_s: float | None = None) -> dict[str, float]:
    """What any autoscaler could at best spend, as a fraction of a fixed ``peak_fleet``: the replicas the
    rate needs (``needed``: capacity per replica, never below min_replicas); and the same held for the
    scale-down window after and provisioned a lead time (cold start + one sync + the scale-up window)
    before each need (``with_windows``)."""
    lead = fleet.cold_start_s + SYNC_PERIOD_S + SEED_UP.window_s if lead_s is None else lead_s
    t = np.arange(0.0, day.day_s, 1.0)
    need = np.array([max(fleet.min_replicas, math.ceil(day.rate_at(x) / fleet.replica_capacity_rps)) for x in t])
    back, ahead = int(down_window_s), int(lead)
    held = np.array([need[max(0, i - back):i + ahead + 1].max() for i in range(len(t))])
    return {"needed": float(need.mean() / peak_fleet), "with_windows": float(held.mean() / peak_fleet)}


# ---------------------------------------------------------------------------------------------
# the experiment


def _run_one(args: tuple[Policy, Day, Fleet, Client, SLOSpec]) -> dict[str, Any]:
    return Simulation(*args).run()


def run(day: Day = Day(), fleet: Fleet = Fleet(), client: Client = Client(), slo: SLOSpec = SLO,
        only: list[str] | None = None, workers: int | None = None) -> dict[str, Any]:
    """Every policy on the same day (same arrivals); the verdict on the issue's target."""
    pols = [p for p in policies(day, fleet) if not only or p.name in only]
    jobs = [(p, day, fleet, client, slo) for p in pols]
    workers = workers if workers is not None else len(jobs)  # one process per policy (the OS shares the cores)
    t0 = time.monotonic()
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(workers) as ex:
            results = list(ex.map(_run_one, jobs))
    else:
        results = [_run_one(j) for j in jobs]
    by = {r["policy"]: r for r in results}
    peak = next((p.fixed for p in pols if p.name == "fixed-peak"), None) or math.ceil(day.peak_rate / fleet.replica_capacity_rps)
    return {"day": asdict(day), "fleet": asdict(fleet), "client": asdict(client), "slo": asdict(slo),
            "policies": results, "verdict": verdict(by, slo),
            "replica_hours_bound_vs_peak": replica_hour_bound(day, fleet, peak), "wall_s": time.monotonic() - t0}


def verdict(by: dict[str, dict[str, Any]], slo: SLOSpec, candidate: str = "hpa-gateway-queue") -> dict[str, Any]:
    """The issue's target: gateway-queue + admission meets the SLO (>= 95%, zero timeouts) with at most
    60% of the peak-sized fleet's replica-hours and at least 10x fewer failed requests than the seed's HPA."""
    g, peak, seed = by.get(candidate), by.get("fixed-peak"), by.get("hpa-vllm-queue")
    if not (g and peak and seed):
        return {"checked": False}
    hours_ratio = g["replica_hours"] / peak["replica_hours"]
    fewer = (seed["failed"] / g["failed"]) if g["failed"] else math.inf
    checks = {
        "slo_attainment >= target": g["slo_attainment"] >= slo.attainment,
        "zero timeouts": g["timeouts"] == 0,
        "replica-hours <= 60% of fixed-peak": hours_ratio <= 0.60,
        "failed <= seed HPA's / 10": g["failed"] * 10 <= seed["failed"] and seed["failed"] > 0,
    }
    return {"checked": True, "policy": candidate, "replica_hours_vs_peak": hours_ratio, "failed_fewer_than_seed_x": fewer,
            "checks": checks, "met": all(checks.values())}


def table(data: dict[str, Any]) -> list[list[str]]:
    rows = [["policy", "replica-h", "max", "$/1K ok", "$/1K good", "SLO att.", "ok", "timeouts", "sheds", "failed",
             "p95 TTFT s", "CPU s"]]

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for r in data["policies"]:
        rows.append([r["policy"], f(r["replica_hours"], ".2f"), str(r["replicas_max"]),
                     f(r["usd_per_1k_successful"], ".3f"), f(r["usd_per_1k_slo_good"], ".3f"),
                     f(100 * r["slo_attainment"], ".1f") + "%", str(r["successful"]), str(r["timeouts"]),
                     str(r["sheds"]), str(r["failed"]), f(r["p95_ttft_s"], ".2f"), f(r["cpu_s"], ".0f")])
    return rows


def main(args: Any, console: Any) -> int:
    """``usefulwork loadtest --experiment autoscale`` (options: --time-scale shortens the day, --out-dir)."""
    from datetime import datetime, timezone
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from usefulwork.loadtest.results import write_json

    day = Day()
    scale = getattr(args, "time_scale", 1.0) or 1.0
    if scale != 1.0:
        day = replace(day, day_s=day.day_s * scale)
    data = run(day)
    data["meta"] = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    "command": "usefulwork loadtest --experiment autoscale" + (f" --time-scale {scale:g}" if scale != 1 else ""),
                    "serving hardware": f"simulated {Fleet().gpu} per replica (usefulwork sim, virtual clock)",
                    "model": f"{Fleet().model} bf16", "host": f"{os.cpu_count()} cores (shared)"}
    out_dir = getattr(args, "out_dir", None) or Path("loadtest-results") / "autoscale"
    path = write_json(Path(out_dir) / "results.json", data)
    rows = table(data)
    console = Console(width=160)  # the table is wider than a terminal's default
    t = Table(title=f"autoscale what-if: {day.day_s:g} s day, {data['policies'][0]['requests']} requests")
    for h in rows[0]:
        t.add_column(h)
    for row in rows[1:]:
        t.add_row(*row)
    console.print(t)
    for v in (data["verdict"],):
        if v.get("checked"):
            console.print(f"{v['policy']}: {100 * v['replica_hours_vs_peak']:.0f}% of fixed-peak's replica-hours, "
                          f"{v['failed_fewer_than_seed_x']:.1f}x fewer failed than the seed's HPA; "
                          + ", ".join(f"{k}: {'yes' if ok else 'NO'}" for k, ok in v["checks"].items()), highlight=False)
    console.print(f"results: {path} ({data['wall_s']:.0f} s wall)")
    return 0
