"""The ``admission`` filter: tenant limits, then the pool's queue, then ``next`` once a slot is ours.

Per request: read the priority (``x-usefulwork-priority``, else the tenant's default; 400 for an
unknown one, 403 for one above the tenant's ``max_priority``), check the tenant's requests held by this
process (``max_inflight_per_process``: 429 ``concurrency``) and its rpm / tpm / budget (429), then offer it to its pool's queue (usefulwork/gateway/admission/queue.py), with the timeout its
client declares where it does (``CLIENT_TIMEOUT_HEADERS``: answered within it or shed). Admitted: call
``next`` (with the class, and whether the tenant is over its fair share, as vLLM's ``priority`` when
the pool's replicas run ``--scheduling-policy priority``). Queued: wait until a slot frees or the deadline passes. Shed: answer 429 with an OpenAI-style body, ``retry-after`` / ``retry-after-ms``
and ``x-usefulwork-shed-reason``, at arrival whenever the prediction already says the deadline
cannot be met. A tenant whose policy allows it is degraded (``max_tokens`` capped, or sent to a
cheaper pool) instead of shed. Every answer to a tenant with an rpm or a tpm carries OpenAI's
``x-ratelimit-*`` headers (``limits.ratelimit_headers``: what it has left, as this process knows it).

The slot is released however the request ends: by the reply's ``on_close`` once the answer was
sent (with the final usage in ``call.ctx``, which also settles the tenant's tokens and spend), or
in ``finally`` when ``next`` raised or the client left while queued. Decisions go into the ledger
record (``ctx.priority``, ``ctx.admission``, ``ctx.queue_ms``, ``ctx.shed_reason``) and into OTel:
``usefulwork.admission.queue.depth`` (pool, priority), ``usefulwork.admission.queue.wait``,
``usefulwork.admission.sheds`` (pool, priority, reason), ``usefulwork.admission.limit`` (pool),
``usefulwork.admission.shed.demand`` (pool: the requests shed within the last service time, which an
autoscaler adds to the queued and running ones), ``usefulwork.admission.retries`` (pool, place: how the
retries of shed requests were priced).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections import Counter

import orjson
import time
from typing import TYPE_CHECKING, Any, Callable

from usefulwork.gateway.admission.capacity import Capacity, Sample
from usefulwork.gateway.admission.config import AdmissionCfg
from usefulwork.gateway.admission.lease import LeasedLimits
from usefulwork.gateway.admission.lending import Exchange, PlaceLedger
from usefulwork.gateway.admission.limits import (FailoverLimits, FairShareSync, Limits, LocalLimits, RedisLimits,
                                                StoreDown, ratelimit_headers, seconds_to_midnight, whole_left)
from usefulwork.gateway.admission.queue import (CLIENT_TIMEOUT_SHARE, SDK_RETRY_AFTER_MAX_S, PoolQueue, Ticket,
                                                retry_after_header)
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from usefulwork.gateway.errors import JSON_HEADERS, error_body
from usefulwork.gateway.pipeline import Call, Handler, Reply
from usefulwork.gateway.tenants import PRIORITIES, TenantCfg
from usefulwork.gateway.validation import max_tokens_of, with_max_tokens
from usefulwork.tasks import cancel_and_wait
from usefulwork.upstream.pieces import PIECE_HOLD, PIECED_OPS, PREFILL_CHUNK

if TYPE_CHECKING:
    from usefulwork.gateway.pipeline import Services

log = logging.getLogger("usefulwork.admission")

PRIORITY_HEADER = b"x-usefulwork-priority"
# A low-band prompt's next prefill piece waits at most this many prefill times for the pending top-band prompts'
# first tokens (``_top_band_clear``): a stream's comes with its first token, a unary one's is only deemed.
PIECE_HOLD_PREFILLS = 2.0
REASON_HEADER = b"x-usefulwork-shed-reason"
# Refusals a quick retry cannot change (the day's budget is spent; the request needs more tokens than the
# tenant's tpm holds): the OpenAI SDKs (Python, Node) obey ``x-should-retry: false`` and do not retry
# them, where they would retry any other 429 at once (older versions ignore a Retry-After over a minute).
# A shed told more than ``SDK_RETRY_AFTER_MAX_S`` says so too.
NO_RETRY_NOW = frozenset(("budget", "tpm_too_large"))
# Refusals OpenAI's API also makes are answered with its code and type, (code, type) by reason: a spent
# budget as an exhausted quota (clients written for OpenAI tell it from a rate limit by that code and stop
# instead of backing off), a tenant's rpm or tpm as OpenAI's own limits (``rate_limit_exceeded``, of type
# ``requests`` or ``tokens``; a request larger than the whole tpm too, as OpenAI's "Request too large").
# The reason header still says ``budget``, ``rpm``, ...; every other refusal's code is its reason.
OPENAI_CODES = {"budget": ("insufficient_quota", "insufficient_quota"), "rpm": ("rate_limit_exceeded", "requests"),
                "tpm": ("rate_limit_exceeded", "tokens"), "tpm_too_large": ("rate_limit_exceeded", "tokens")}
NO_RETRY = (b"x-should-retry", b"false")
# The OpenAI SDKs (Python, Node) number each attempt: 0 first, then the retries (a 429's included).
RETRY_COUNT_HEADER = b"x-stainless-retry-count"
# How long the client waits for its answer, (header, its unit in seconds, what it bounds: 0 its first bytes,
# 1 its whole answer, 2 its whole answer across its retries): the OpenAI SDKs send their read timeout in
# seconds on every request (it bounds the wait for the first bytes: a stream's first token), Envoy its
# route's timeout in milliseconds to the upstream (it covers the whole response, a stream's last token
# included). Both start again on each attempt. ``x-usefulwork-deadline-ms`` is the time the client has left
# for the whole answer with its retries included, as a gRPC deadline spans the call's retries (the loadtest
# client declares it on every attempt). A request that cannot be answered within any of them is shed with
# its Retry-After at once, not left to the client's timeout in the queue; a shed whose retry could not be
# answered within the last is told not to retry (``x-should-retry: false``, reason ``client_timeout``), and
# no place is held for it.
CLIENT_TIMEOUT_HEADERS = ((b"x-stainless-read-timeout", 1.0, 0), (b"x-envoy-expected-rq-timeout-ms", 1e-3, 1),
                          (b"x-usefulwork-deadline-ms", 1e-3, 2))
_FINAL = ("the {pool} pool is at capacity: neither this request nor a retry of it can be answered within the "
          "deadline its client declared for all its attempts (x-usefulwork-deadline-ms); do not retry it")
_MESSAGES = {
    "predicted_wait": "the {pool} pool is at capacity: this request cannot start within its deadline; retry after the given time",
    "deadline": "the {pool} pool is at capacity: this request's deadline passed while it was queued",
    "client_timeout": "the {pool} pool is at capacity: this request cannot be answered within the timeout its client "
                      "declared; retry after the given time, or allow a longer timeout",
    "overtaken": "the {pool} pool is at capacity: higher-priority work overtook this request and it can no longer start within its deadline",
    "queue_full": "the {pool} pool's queue is full",
    "sheddable": "the {pool} pool is busy and the request is sheddable",
    "rpm": "tenant {tenant!r} is over its requests-per-minute limit",
    "tpm": "tenant {tenant!r} is over its tokens-per-minute limit",
    "tpm_too_large": "this request needs more tokens than tenant {tenant!r}'s tokens-per-minute limit allows",
    "budget": "tenant {tenant!r} has spent its budget for today (UTC)",
    "concurrency": "tenant {tenant!r} already has {n} requests in flight at this gateway process, its limit; retry "
                   "after the given time",
}


def client_timeouts(call: Call) -> tuple[float | None, float | None, float | None]:
    """The shortest waits the client declares (``CLIENT_TIMEOUT_HEADERS``), in seconds: (for its first bytes,
    for its whole answer, for its whole answer across its retries); None where it declares none. A whole
    answer's is the shorter of the last two. A malformed, non-positive or non-finite value is ignored: a
    hint, not part of the API."""
    out: list[float | None] = [None, None, None]
    for name, scale, bounds in CLIENT_TIMEOUT_HEADERS:
        raw = call.header(name)
        if raw is None:
            continue
        try:
            v = float(raw) * scale
        except ValueError:
            continue
        if not 0.0 < v < math.inf:
            continue
        if out[bounds] is None or v < out[bounds]:  # type: ignore[operator]
            out[bounds] = v
        if bounds == 2 and (out[1] is None or v < out[1]):  # type: ignore[operator]
            out[1] = v  # (a deadline for all attempts bounds this one's whole answer too)
    return out[0], out[1], out[2]


def _retried(raw: bytes | None) -> int | None:
    """The client's SDK numbers this attempt: its retry number (0: its first attempt); None: it does not
    say (no count, or a malformed one), and a retry is found by its body."""
    try:
        return None if raw is None else max(0, int(raw))
    except ValueError:
        return None


def _retry_key(tenant: str, raw: bytes | None, body: dict) -> Callable[[], int]:
    """A request's retry key, computed when the queue first needs it (``Ticket.key_of``): a 63-bit hash of its
    tenant and body (a retry sends the same body, so it finds the place held for it), the same in every
    gateway process (a retry finds its place held by another: ``lending``; Python's ``hash`` is salted per
    process). The body as the client sent it, or, where a filter before this one changed it, re-encoded
    with sorted keys. (BLAKE2b: ~1 us a KB, paid only where places are held or a request is shed.)"""
    def key() -> int:
        h = hashlib.blake2b(tenant.encode(), digest_size=8)
        h.update(b"\0")
        h.update(raw if raw is not None else orjson.dumps(body, option=orjson.OPT_SORT_KEYS))
        return int.from_bytes(h.digest(), "big") >> 1
    return key


def _error(status: int, message: str, code: str, headers: list[tuple[bytes, bytes]] | None = None,
           param: str | None = None, type_: str | None = None) -> Reply:
    body = error_body(status, message, code=code, param=param, type_=type_)
    return Reply(status, [*JSON_HEADERS, (b"content-length", str(len(body)).encode()), *(headers or [])], body=body)


def _with(reply: Reply, headers: list[tuple[bytes, bytes]] | None) -> Reply:
    if headers:
        reply.headers = [*reply.headers, *headers]
    return reply


def cap_max_tokens(call: Call, n: int) -> None:
    """Make ``n`` the request's output limit, in its endpoint's own field."""
    call.set_body(with_max_tokens(call.body, call.op, n))
    call.ctx.max_tokens = n


def expected_tokens(call: Call) -> tuple[int, int | None]:
    """(prompt tokens, max_tokens) expected before the backend counts: ~4 bytes of JSON per token, of the
    body as sent, or re-encoded where a filter before this one changed it (the router: its pool's model).
    (That case read the Python repr of ``messages`` or ``prompt`` only: 245 us for a 100 KB conversation,
    and a Responses or embeddings body, whose text is ``input``, counted as 1 token.)"""
    raw = call.raw
    size = len(raw) if raw is not None else len(orjson.dumps(call.body))
    return max(1, size // 4), max_tokens_of(call.body)


class AdmissionFilter:
    name = "admission"

    def __init__(self, services: Services, *, clock: Callable[[], float] = time.perf_counter,
                 limits: Limits | None = None):
        self.services = services
        cfg = services.cfg
        self.cfg: AdmissionCfg = cfg.admission
        self.clock = clock
        self.tenants = services.tenants
        self.slo = cfg.slo
        self.deadline_s = [self.cfg.deadline_ms.get(p, cfg.slo.ttft_ms) / 1000.0 for p in PRIORITIES]
        if limits is None:
            local = LocalLimits()
            if self.cfg.redis_url:
                c = self.cfg
                shared = LeasedLimits(c.redis_url, c.redis_prefix, c.redis_timeout_s, horizon_s=c.lease_horizon_s,
                                      max_fraction=c.lease_max_fraction, idle_s=c.lease_idle_s,
                                      flush_s=c.settle_flush_s) if c.lease else \
                    RedisLimits(c.redis_url, c.redis_prefix, c.redis_timeout_s)
                limits = FailoverLimits(shared, local, fail_closed=c.on_redis_down == "closed", retry_s=c.redis_retry_s)
            else:
                limits = local
        self.limits = limits
        shared = getattr(limits, "shared", None)
        self.fair_sync = FairShareSync(shared.r, self.cfg.redis_prefix) if isinstance(shared, RedisLimits) else None
        self._sync_task: asyncio.Task | None = None
        self.ledger = (PlaceLedger(shared.r, self.cfg.redis_prefix, self.cfg.lend_interval_s)
                       if self.fair_sync is not None and self.cfg.lend_places else None)
        self._lend_task: asyncio.Task | None = None
        self.queues: dict[str, PoolQueue] = {}
        self.decisions: dict[str, int] = {"admit": 0, "queued": 0, "shed": 0, "degraded": 0, "limited": 0}
        # low-band requests marked to be prefilled in pieces (``low_band_prefill_chunk``; one whose prompt is
        # shorter than two pieces, or whose replica cannot tokenize it, then goes whole)
        self.pieced = 0
        self._holding: dict[str, int] = {}  # tenant -> its requests this process holds (``max_inflight_per_process``)
        self._tasks: set[asyncio.Task] = set()
        self._instruments(services.meter)
        self.routes = [Route("/usefulwork/admission/tenants", self._tenants_status, methods=["GET"]),
                       Route("/usefulwork/admission/tenants/{name}", self._tenant_status, methods=["GET"])]

    # -- setup --
    def _instruments(self, meter: Any) -> None:
        self._wait_hist = self._sheds = None
        if meter is None:
            return
        from opentelemetry.metrics import Observation  # noqa: PLC0415

        def depth(_options):
            return [Observation(n, {"pool": name, "priority": p})
                    for name, q in self.queues.items() for p, n in q.depth().items()]

        def shed_demand(_options):
            now = self.clock()
            return [Observation(q.shed_demand(now, prune=False), {"pool": name}) for name, q in self.queues.items()]

        def limit(_options):
            return [Observation(q.capacity.current(), {"pool": name}) for name, q in self.queues.items()]

        meter.create_observable_gauge("usefulwork.admission.queue.depth", [depth], unit="{request}",
                                      description="Requests waiting in the gateway's admission queue.")
        meter.create_observable_gauge("usefulwork.admission.shed.demand", [shed_demand], unit="{request}",
                                      description="Requests shed for the first time within the last service time: "
                                                  "the demand admission turned away, as requests in flight.")
        meter.create_observable_gauge("usefulwork.admission.limit", [limit], unit="{request}",
                                      description="The adaptive in-flight limit of each pool.")

        def retries(_options):
            return [Observation(n, {"pool": name, "place": place}) for name, q in self.queues.items()
                    for place, n in q.retries_by_place().items()]

        meter.create_observable_counter("usefulwork.admission.retries", [retries], unit="{request}",
                                        description="Retries of shed requests by how they were priced: taking a place "
                                                    "held here (held), with none left here, as holding one due now "
                                                    "(due_now), or as a first attempt (unproven: more numbered retries "
                                                    "than their tenant was held places for lately).")
        self._wait_hist = meter.create_histogram("usefulwork.admission.queue.wait", unit="s",
                                                 description="Time admitted requests spent in the admission queue.")
        self._sheds = meter.create_counter("usefulwork.admission.sheds", unit="{request}",
                                           description="Requests answered 429 by admission, by reason.")

    def queue_for(self, call: Call) -> PoolQueue:
        pool = call.pool
        name = pool.name if pool is not None else f"model:{call.ctx.model}"
        q = self.queues.get(name)
        if q is None:
            replicas = (lambda: pool.healthy_replicas() or pool.replicas) if pool is not None else tuple
            cap = Capacity(self.cfg, self.slo.ttft_ms / 1000.0, self.slo.tpot_ms / 1000.0, self.slo.e2e_ms / 1000.0,
                           replicas=replicas,
                           priority_scheduling=pool is not None and pool.cfg.scheduling_policy == "priority")
            q = self.queues[name] = PoolQueue.from_cfg(name, cap, self.cfg, self.slo.e2e_ms / 1000.0,
                                                       weight_of=lambda t: self.tenants.settings(t).weight,
                                                       shared_returns=self.fair_sync is not None)
        return q

    # -- the filter --
    async def __call__(self, call: Call, next: Handler) -> Reply:
        ctx = call.ctx
        tenant_cfg = self.tenants.settings(ctx.tenant)
        raw_priority = call.header(PRIORITY_HEADER)
        if raw_priority is not None:
            p = raw_priority.decode("latin-1").strip().lower()
            if p not in PRIORITIES:
                ctx.error = "unknown priority"
                return _error(400, f"unknown priority {raw_priority.decode('latin-1')[:40]!r} in "
                              f"x-usefulwork-priority; use one of: {', '.join(PRIORITIES)}", "invalid_priority",
                              param="x-usefulwork-priority")
            if not tenant_cfg.allows(p):
                ctx.error = "priority not allowed"
                return _error(403, f"tenant {ctx.tenant!r} may not ask for priority {p!r} (its highest: "
                              f"{tenant_cfg.max_priority!r})", "priority_not_allowed", param="x-usefulwork-priority")
        else:
            p = tenant_cfg.priority
        ctx.priority = p
        cap = tenant_cfg.max_inflight_per_process
        if cap is None:
            return await self._admission(call, next, tenant_cfg, p)
        # (before the rpm / tpm check: a refused request takes nothing from the tenant's buckets)
        tenant = ctx.tenant
        held = self._holding.get(tenant, 0)
        if held >= cap:
            self.decisions["limited"] += 1
            # One of its requests frees every slot hold / cap on average (they end one after another).
            wait = max(0.05, self.queue_for(call).capacity.slot_hold() / cap)
            return self._refuse(call, 429, _MESSAGES["concurrency"].format(tenant=tenant, n=held), "concurrency",
                                None, wait)
        self._holding[tenant] = held + 1
        try:
            reply = await self._admission(call, next, tenant_cfg, p)
        except BaseException:
            self._let_go(tenant)
            raise
        reply.on_close(lambda: self._let_go(tenant))
        return reply

    def _let_go(self, tenant: str) -> None:
        n = self._holding.get(tenant, 0) - 1
        if n > 0:
            self._holding[tenant] = n
        else:
            self._holding.pop(tenant, None)

    async def _admission(self, call: Call, next: Handler, tenant_cfg: TenantCfg, p: str) -> Reply:
        """The limits, then the queue's decision, then the request: admitted, queued or shed."""
        ctx = call.ctx
        prompt, max_tokens = expected_tokens(call)
        tokens = prompt + (max_tokens or 256)
        try:
            verdict = await self.limits.check(ctx.tenant, tenant_cfg, tokens)
        except StoreDown:
            return self._refuse(call, 503, "rate-limit store unavailable (on_redis_down: closed)", "limits_unavailable",
                                None, 5.0)
        # (OpenAI's x-ratelimit-* headers on every answer to a tenant with an rpm or tpm: what it has left)
        rl = None if tenant_cfg.rpm is None and tenant_cfg.tpm is None else \
            ratelimit_headers(tenant_cfg, self.limits.headroom(ctx.tenant, tenant_cfg))
        if not verdict.ok:
            self.decisions["limited"] += 1
            msg = _MESSAGES[verdict.reason].format(tenant=ctx.tenant, pool="")
            if verdict.reason in ("rpm", "tpm"):  # (as OpenAI words it: some clients read the wait from the message)
                msg += f". Please try again in {verdict.retry_after_s:.3g}s."
            return _with(self._refuse(call, 429, msg, verdict.reason, None, verdict.retry_after_s), rl)
        queue = self.queue_for(call)
        now = self.clock()
        cls = PRIORITIES.index(p)
        t = Ticket(ctx.tenant, cls, float(tokens), now, now + self.deadline_s[cls], max_tokens=max_tokens,
                   key_of=_retry_key(ctx.tenant, call.raw, call.body),
                   stream=ctx.stream, retried=_retried(call.header(RETRY_COUNT_HEADER)))
        read_s, whole_s, all_s = client_timeouts(call)
        if read_s is not None:
            t.gone_at = now + CLIENT_TIMEOUT_SHARE * read_s
        if whole_s is not None:
            t.done_by = now + CLIENT_TIMEOUT_SHARE * whole_s
        if all_s is not None:
            t.give_up_at = now + CLIENT_TIMEOUT_SHARE * all_s
        decision = queue.offer(t, now)
        if decision.kind == "shed" and tenant_cfg.degrade is not None:
            queue, decision = self._degrade(call, queue, t, decision, tenant_cfg.degrade, now)
        if decision.woken:
            self._dispatch(queue, decision.woken)
        settled = False
        try:
            if decision.kind == "shed":
                await self._settle(ctx.tenant, tenant_cfg, -tokens, 0.0)  # not served: give the tokens back
                settled = True
                return _with(self._shed(call, queue, t, decision.reason, decision.retry_after_s), rl)
            if decision.kind == "queue":
                self.decisions["queued"] += 1
                ctx.admission = ctx.admission or "queued"
                admitted = await self._wait(queue, t)
                if not admitted:
                    await self._settle(ctx.tenant, tenant_cfg, -tokens, 0.0)
                    settled = True
                    # (shed from the queue: ``PoolQueue._drop`` gave it its Retry-After and held its place)
                    return _with(self._shed(call, queue, t, t.shed_reason or "deadline", t.retry_after_s), rl)
            else:
                self.decisions["admit"] += 1
                ctx.admission = ctx.admission or "admit"
            ctx.queue_ms = (t.admitted_at - t.arrival) * 1000.0
            if call.pool is not None and call.pool.cfg.scheduling_policy == "priority":
                # The class goes into vLLM's own queue too, with tenants under their fair share first within
                # it (the gateway owns the value: a client's is replaced).
                call.set_body({**call.body, "priority": t.engine_priority})
            if (self.cfg.low_band_prefill_chunk and t.low_band and call.op in PIECED_OPS
                    and queue.top_band_about(self.clock())):
                # (the Forwarder prefills it in pieces on the replica it picks: usefulwork/upstream/pieces.py)
                call.memo[PREFILL_CHUNK] = self.cfg.low_band_prefill_chunk
                call.memo[PIECE_HOLD] = lambda: self._piece_turn(queue)
                self.pieced += 1
            if self._wait_hist is not None:
                self._wait_hist.record(t.admitted_at - t.arrival, {"pool": queue.name, "priority": p})
            if t.stream:
                ctx.on_first_token = lambda: self._dispatch(queue, queue.first_token(t, self.clock()))
            reply = await next(call)
        except BaseException:
            if t.state == "queued":
                queue.cancel(t)
                self._dispatch(queue, queue.pump(self.clock()))
            if t.state == "admitted":
                self._release(queue, t, call, ok=False)
            if not settled and t.state in ("released", "cancelled"):
                self._spawn(self._settle(ctx.tenant, tenant_cfg, -tokens, 0.0))
            raise
        reply.on_close(lambda: self._finish(queue, t, call, tenant_cfg, tokens))
        return _with(reply, rl)

    # -- decisions --
    def _degrade(self, call: Call, queue: PoolQueue, t: Ticket, decision, policy, now: float):
        """Try the tenant's allowed degradations in order: cap max_tokens, then a cheaper pool."""
        if policy.max_tokens is not None and decision.reason in ("predicted_wait", "client_timeout") and \
                (t.max_tokens is None or t.max_tokens > policy.max_tokens):
            queue.shed_total[decision.reason] -= 1
            t.max_tokens = policy.max_tokens
            again = queue.offer(t, now)
            if again.kind != "shed":
                cap_max_tokens(call, policy.max_tokens)
                call.ctx.admission = f"degraded:max_tokens={policy.max_tokens}"
                self.decisions["degraded"] += 1
                return queue, again
            decision = again
        fleet = self.services.fleet
        alt = fleet.pools.get(policy.pool) if (policy.pool and fleet is not None) else None
        if alt is not None and alt is not call.pool:
            queue.shed_total[decision.reason] -= 1
            old_pool, call.pool = call.pool, alt
            alt_q = self.queue_for(call)
            t.state = "new"
            again = alt_q.offer(t, now)
            if again.kind != "shed":
                call.set_body({**call.body, "model": alt.cfg.models[0]})
                call.ctx.pool = alt.name
                call.ctx.admission = f"degraded:pool={alt.name}"
                self.decisions["degraded"] += 1
                return alt_q, again
            call.pool = old_pool
            return alt_q, again
        return queue, decision

    def _refuse(self, call: Call, status: int, message: str, reason: str, queue: PoolQueue | None,
                retry_after_s: float, final: bool = False) -> Reply:
        ctx = call.ctx
        ctx.admission = "shed" if status == 429 else "refused"
        ctx.shed_reason = reason
        ctx.error = message
        if self._sheds is not None:
            self._sheds.add(1, {"pool": queue.name if queue else (call.pool.name if call.pool else ""),
                                "priority": ctx.priority or "", "reason": reason})
        headers = [*retry_after_header(retry_after_s), (REASON_HEADER, reason.encode())]
        if final or reason in NO_RETRY_NOW or retry_after_s > SDK_RETRY_AFTER_MAX_S:
            # (told longer than an SDK waits: 3.x gives up anyway, older ones would retry at once into a full pool;
            # ``final``: its retry could not be answered within the deadline its client declared for all attempts)
            headers.append(NO_RETRY)
        code, type_ = OPENAI_CODES.get(reason, (reason, None))
        return _error(status, message, code, headers, type_=type_)

    def _shed(self, call: Call, queue: PoolQueue, t: Ticket, reason: str, retry_after_s: float) -> Reply:
        self.decisions["shed"] += 1
        msg = (_FINAL if t.final else _MESSAGES.get(reason, "shed: {pool}")).format(pool=queue.name, tenant=t.tenant)
        return self._refuse(call, 429, msg, reason, queue, retry_after_s, final=t.final)

    # -- waiting and dispatching --
    @staticmethod
    async def _top_band_clear(queue: PoolQueue) -> None:
        """Until no top-band prompt is pending in ``queue``, at most ``PIECE_HOLD_PREFILLS`` of its prefill
        times: the forwarder awaits it before each piece of a low-band prompt (usefulwork/upstream/pieces.py),
        which would otherwise share that prompt's step. (Virtual clock, the simulated A100's priority cell
        with 64-token pieces, three per replica, six seeds: interactive TTFT p99 1.03-1.30x -> 1.04-1.11x its
        arrivals alone, the engine's tokens/s 100-108% -> 97-100% of admission off: docs/benchmarks.md
        section 7, session 61.)"""
        each = queue.capacity.prefill_time()
        if each is None or not queue.top_band_pending():
            return
        clear = asyncio.get_running_loop().create_future()
        forget = queue.when_top_band_clear(lambda: clear.done() or clear.set_result(None))
        try:
            await asyncio.wait_for(clear, PIECE_HOLD_PREFILLS * each)
        except TimeoutError:
            forget()

    async def _piece_turn(self, queue: PoolQueue) -> None:
        """What the forwarder awaits before each piece of a low-band prompt: the top band clear
        (``_top_band_clear``), then the piece's place in the pool's spacing (``PoolQueue.piece_wait``), then
        the top band clear again if a top-band prompt came meanwhile."""
        await self._top_band_clear(queue)
        wait = queue.piece_wait(self.clock())
        if wait > 0:
            await asyncio.sleep(wait)
            await self._top_band_clear(queue)

    async def _wait(self, queue: PoolQueue, t: Ticket) -> bool:
        loop = asyncio.get_running_loop()
        t.waiter = loop.create_future()
        handles: list[asyncio.TimerHandle] = []

        def arm(delay: float) -> None:
            handles.append(loop.call_later(delay, self._expire, queue, t, arm))

        arm(max(0.0, self._next_look(queue, t, queue.latest_start(t)) - self.clock()))
        try:
            return await t.waiter
        finally:
            for h in handles:
                h.cancel()

    def _expire(self, queue: PoolQueue, t: Ticket, arm: Callable[[float], None]) -> None:
        """``t``'s latest start came: shed whoever is past theirs, fill free slots; if ``t`` still
        waits (the estimate moved), look again at its new latest start (or its deadline)."""
        now = self.clock()
        self._dispatch(queue, queue.expire(now))
        self._dispatch(queue, queue.pump(now))
        if t.state == "queued":
            arm(max(0.001, self._next_look(queue, t, min(queue.latest_start(t), t.deadline)) - now))

    @staticmethod
    def _next_look(queue: PoolQueue, t: Ticket, at: float) -> float:
        """When a queued ticket's waiter looks again: at ``at``, or sooner when a unary request's prefill
        place is deemed free (no first token says so), or a paced tenant may send its next prompt
        (``PoolQueue.turn_free``)."""
        for due in (queue.next_prefill_due(), queue.next_turn_due()):
            if due is not None:
                at = min(at, due)
        return at

    @staticmethod
    def _dispatch(queue: PoolQueue, tickets: list[Ticket]) -> None:
        """Wake the waiters of tickets that were admitted (True) or shed (False)."""
        for t in tickets:
            if t.waiter is not None and not t.waiter.done():
                t.waiter.set_result(t.state == "admitted")

    def _release(self, queue: PoolQueue, t: Ticket, call: Call, ok: bool) -> None:
        ctx = call.ctx
        now = self.clock()
        sample = None
        counted = ctx.usage_source != "none"  # (the backend counted the tokens)
        if t.admitted_at is not None:
            # (a unary answer's first byte is its last: its TTFT is its E2E, as the client sees it; its TPOT
            # is unknown, not zero)
            ttft = None if ctx.t_first_token is None else max(0.0, ctx.t_first_token - t.admitted_at)
            # (ctx.t_end is set after the closers run: TPOT from now)
            n = ctx.completion_tokens
            tpot = (now - ctx.t_first_token) / (n - 1) if ttft is not None and t.stream and n > 1 else None
            sample = Sample(ttft=ttft, tpot=tpot, service=now - t.admitted_at,
                            # (the endpoint classifies the outcome after closing: read the status)
                            tokens=ctx.prompt_tokens + ctx.completion_tokens,
                            ok=ok and ctx.status_code < 400 and ctx.t_first_token is not None,
                            inflight_at_admit=t.inflight_at_admit, cls=t.cls,
                            completion=ctx.completion_tokens if counted else None)
        actual = ctx.prompt_tokens + ctx.completion_tokens if counted else None
        self._dispatch(queue, queue.release(t, now, sample, actual))

    def _finish(self, queue: PoolQueue, t: Ticket, call: Call, tenant_cfg, tokens: int):
        self._release(queue, t, call, ok=True)
        ctx = call.ctx
        if ctx.usage_source == "none" or not tenant_cfg.settles:
            return None  # (nothing to settle)
        from usefulwork.gateway.accounting.costing import price_sheet_cost  # noqa: PLC0415

        usd = price_sheet_cost(call.pool.cfg if call.pool is not None else None, ctx)
        return self._settle(ctx.tenant, tenant_cfg, ctx.prompt_tokens + ctx.completion_tokens - tokens, usd)

    async def _settle(self, tenant: str, cfg, token_delta: int, usd: float) -> None:
        if not cfg.settles:
            return
        try:
            await self.limits.settle(tenant, cfg, token_delta, usd)
        except Exception:  # noqa: BLE001 - settling must never break a finished request
            log.exception("admission: settling tenant %s failed", tenant)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- admin endpoint --
    def _admin_only(self, request: Request) -> Response | None:
        from usefulwork.gateway.access import Access  # noqa: PLC0415

        if Access(self.tenants).is_admin(request):
            return None
        return Response(error_body(401, "tenant status needs the admin key", code="invalid_api_key"),
                        status_code=401, media_type="application/json")

    async def _status_of(self, name: str) -> dict[str, Any]:
        """A tenant's settings (never its key hashes), today's spend and budget left, what its rpm / tpm
        buckets hold now (as this process sees them), and its place in the fair share (the counter and what
        it has queued, per pool)."""
        lim = await self.tenant_limits(name)
        return {"settings": self.tenants.settings(name).model_dump(exclude={"key_hashes"}),
                "spent_today_usd": lim.get("spent_today_usd"), "budget_left_usd": lim.get("budget_left_usd"),
                "requests_remaining": lim.get("requests_remaining"), "tokens_remaining": lim.get("tokens_remaining"),
                "fair_share_tokens": {p: q.counters.get(name, 0.0) for p, q in self.queues.items()},
                "queued": {p: sum(len(c.get(name, ())) for c in q.queues) for p, q in self.queues.items()}}

    async def _tenant_status(self, request: Request) -> Response:
        """One tenant's status; admin key only (``access.admin_key_hashes``; open when no key is configured
        anywhere)."""
        if (denied := self._admin_only(request)) is not None:
            return denied
        name = request.path_params["name"]
        if name not in self.tenants.by_name:
            return Response(error_body(404, f"no tenant {name!r}", code="not_found"), status_code=404,
                            media_type="application/json")
        return Response(orjson.dumps({"tenant": name, **await self._status_of(name)}), media_type="application/json")

    async def _tenants_status(self, request: Request) -> Response:
        """Every configured tenant's status (who is near its budget, who is queued); admin key only."""
        if (denied := self._admin_only(request)) is not None:
            return denied
        names = sorted(self.tenants.by_name)
        rows = await asyncio.gather(*(self._status_of(n) for n in names))
        return Response(orjson.dumps({"tenants": dict(zip(names, rows))}), media_type="application/json")

    async def tenant_limits(self, name: str) -> dict[str, Any]:
        """A tenant's limits and, with a budget, today's spend against it: what its own key sees in
        `/usefulwork/stats` (so a client can slow down before its budget runs out), and the admin's tenant
        status. Spend is the fleet's (Redis) where limits are shared; None while Redis does not answer."""
        cfg = self.tenants.settings(name)
        out: dict[str, Any] = {"rpm": cfg.rpm, "tpm": cfg.tpm, "budget_usd_per_day": cfg.budget_usd_per_day}
        # (what x-ratelimit-remaining-* would say now: this process's view, None before it has seen any)
        for key, cap, left in zip(("requests_remaining", "tokens_remaining"), (cfg.rpm, cfg.tpm),
                                  self.limits.headroom(name, cfg)):
            if cap is not None:
                out[key] = None if left is None else whole_left(left, cap)
        if cfg.max_inflight_per_process is not None:
            out["max_inflight_per_process"] = cfg.max_inflight_per_process
            out["in_flight_here"] = self._holding.get(name, 0)  # (this process's: the cap is per process)
        if cfg.budget_usd_per_day is not None:
            try:
                spent = await self.limits.spent_today(name)
            except Exception:  # noqa: BLE001 - the store did not answer: not known now
                spent = None
            out["spent_today_usd"] = spent
            out["budget_left_usd"] = None if spent is None else max(0.0, cfg.budget_usd_per_day - spent)
            out["budget_resets_in_s"] = round(seconds_to_midnight(), 3)
        return out

    # -- lifecycle and figures --
    async def start(self) -> None:
        if self.fair_sync is not None:
            self._sync_task = asyncio.create_task(self._sync_loop(), name="admission-fair-share-sync")
        if self.ledger is not None:
            self._lend_task = asyncio.create_task(self._lend_loop(), name="admission-place-lending")

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.fair_sync.interval_s)
            await self.sync_once()

    async def sync_once(self) -> None:
        """Share the fair-share counters and settle the retries' returns with the other replicas."""
        down = False
        for name, q in list(self.queues.items()):
            placeless, unclaimed = q.take_returns()
            came_back: dict = {}
            if not down:
                try:
                    await self.fair_sync.sync(name, q.counters)
                    came_back = await self.fair_sync.returns(name, placeless, unclaimed)
                except Exception:  # noqa: BLE001 - Redis down: local counters until it is back (limits log it)
                    down = True  # (and the places let go here are learnt from this replica alone)
            q.settle_returns(unclaimed, came_back)

    async def _lend_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ledger.interval_s)
            await self.lend_once()

    async def lend_once(self) -> None:
        """Exchange places and loans with the other processes (``lending.PlaceLedger``), then dispatch what
        slots given back let start."""
        for name, q in list(self.queues.items()):
            now = self.clock()
            shift = now - time.time()  # (wall seconds, as the processes publish them -> this process's clock)
            at = q.next_place(now)
            held = [(k, a - shift, since - shift, n) for k, a, since, n in q.held_places(now)]
            took = [(k, a - shift, holder) for k, a, holder in q.took_places(now)]
            try:
                x = await self.ledger.exchange(name, at - shift if math.isfinite(at) else None, Counter(q.loans),
                                               now - shift, held, took)
            except Exception:  # noqa: BLE001 - Redis down: each process on its own slots (limits log it)
                x = Exchange([], 0, {}, [])
            q.settle_places([(a + shift, p) for a, p in x.places], x.owed,
                            {k: (a + shift, since + shift, n, p) for k, (a, since, n, p) in x.held.items()},
                            [(k, a + shift) for k, a in x.taken])
            self._dispatch(q, q.pump(self.clock()))

    async def stop(self) -> None:
        await cancel_and_wait(self._lend_task)
        await cancel_and_wait(self._sync_task)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.limits.close()

    def stats(self) -> dict[str, Any]:
        down = getattr(self.limits, "down", False)
        shared = getattr(self.limits, "shared", None)
        now = self.clock()
        out = {"decisions": dict(self.decisions), "pools": {n: q.stats(now) for n, q in self.queues.items()},
               "limits_store": "redis" if isinstance(self.limits, FailoverLimits) else "process",
               "redis_down": down}
        if self.cfg.low_band_prefill_chunk:
            out["prefilled_in_pieces"] = self.pieced
        if isinstance(shared, LeasedLimits):
            out["limits_lease_calls"] = dict(shared.calls)
        return out
