"""One pool's admission queue: priority classes, deadlines, fair sharing, and the decision per request.

Classes are served in strict order (``interactive``, ``batch``, ``sheddable``). Interactive work may
hold up to the SLO limit of requests in flight (``Capacity.current``) on top of whatever batch work
runs; lower classes may use the fill limit (``Capacity.fill``: what keeps the replicas busy without
queueing inside vLLM) less a reserve (``reserve_fraction`` of the SLO limit), so batch work fills
idle capacity, yields when interactive work slows the replicas (the fill limit is cut), and an
interactive request finds a free slot.
Within a class, tenants share by the Virtual Token Counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024): each tenant's counter grows by the tokens it is served (prompt +
output, divided by its weight) and the backlogged tenant with the smallest counter goes next; a
tenant that returns from idle is lifted to the smallest backlogged counter, so idling earns no credit.

Decision at arrival (``offer``):

- **admit** when a slot is free and nobody is queued ahead;
- **queue** when the predicted wait fits the request's budget (its deadline minus the expected
  service TTFT with a tail margin, and, for a class whose deadline is within the E2E SLO, the E2E SLO
  minus the expected service time); a queued request is dispatched at once if slots are free (the
  queue is pumped on every arrival, release and expiry, not only when a slot is released);
- **shed** otherwise, at once, with the time after which a retry fits (``retry_after_s``).

**Retry-After is a reservation.** A shed request is told to come back when the work ahead of it,
including the retries already promised a time, has drained; its tenant holds that place until then
(plus ``RESERVATION_GRACE_S``), found again by ``Ticket.key`` (a hash of tenant and body: a retry
sends the same body). New arrivals count the reservations that fall due within their own budget as
work ahead, each weighted by the share of its tenant's places that were taken back lately
(``return_rate(tenant)``): a held place of a client that honours Retry-After is kept free for it, while
clients that never come back (most load generators, many batch jobs) do not block capacity with places
nobody will use. The rate is taken back over ended places, the older ones fading (``RETURN_EWMA`` per
ended place), with the prior counted as one ended place. It is kept per tenant because clients of one tenant (one application, one SDK
and its retry settings) behave alike and tenants differ: one pool-wide rate let a tenant whose clients
never return teach the gateway to give another tenant's returning clients one and the same
Retry-After, so they came back together into room for one or two. A tenant not seen yet starts at
``return_prior`` (0.5: no evidence either way; 1.0 spread a retrying tenant's first wave best but held
places for clients that never return: 99 more requests failed in the autoscale what-if's day). A tenant
whose clients number their attempts (``Ticket.retried``: the OpenAI SDKs' ``x-stainless-retry-count``;
they retry a 429 by default) starts at ``return_prior_numbered`` (1.0) instead (a tenant with both kinds of
client, in proportion to the share of its shed requests whose clients numbered them, older sheds
fading at ``RETURN_EWMA`` each: the prior followed its last shed and flipped with it): where a slot is held
longer than a burst lasts (10-20 s on the real CPU vLLM), no held place ends before the whole first wave
is told its Retry-After, and priced at half it was promised twice the places there were (first retries
admitted on four recorded real runs' replicas 57-72% -> 81-98%; docs/benchmarks.md section 7, session 45).
Within a tenant the rate is also learnt per shed count (``return_rate(tenant, sheds)``, the tenant's
rate as its prior): an SDK retries a set number of times, so the place held after a request's last
allowed retry is a ghost while the earlier ones are taken back. Learnt per tenant only, those ghosts
kept the rate near 1 and stacked every later Retry-After on places nobody would take (in the autoscale
what-if's day, Retry-After grew to 75 s and SLO attainment fell to 71-85% on four of eight seeds). And
a returning retry does not count places more than ``RESERVATION_LATE_S`` past their time as ahead of
it: clients told a Retry-After come back within that, so such a place's client is not coming (the
place is still kept for its grace, and learnt as not taken back when that ends).
The drain is a fluid, but where even the first place a request could take frees later than its
budget can wait (a pool full of requests that started together), the drain starts from that place;
and no place is promised before the slot model frees the place behind every promised one, less the
share of the TTFT budget a returning retry may queue for: a pool refilled in a clump frees nothing for
a whole service time. Nor more than ``RETRY_MARGIN_MAX_S`` after that place: where a clump frees its
slots within seconds, the fluid's spacing, a dispatch interval per promised place, told retries to come
back after the clump, and new requests took its slots. (The slot model: a stream whose first token was
sent ends its decode after it, any other request a slot's hold after its start, and a slot taken again
is held for another.)
A retry that takes its place back queues by when the place was promised (``Ticket.since``): behind
the tickets that asked before (its Retry-After counted them), ahead of its tenant's newer work (which
counted its place as work ahead).

The predicted wait is (work ahead of it in dispatch order, less free slots) / drain rate. When new
interactive work overtakes queued lower-class work, those whose predicted wait no longer fits their
budget are shed at once (``Decision.woken``); a queued request still waiting at its latest start (its
deadline less the expected service TTFT) is shed by ``expire`` then, not at the deadline. Everything here is synchronous and takes ``now``: the filter drives it with the event
loop's clock, the tests with a virtual one.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import logging
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from usefulwork.gateway.admission.capacity import Capacity, Sample, decode_time
from usefulwork.gateway.admission.config import AdmissionCfg
from usefulwork.gateway.tenants import PRIORITIES

log = logging.getLogger("usefulwork.admission")

DecisionKind = Literal["admit", "queue", "shed"]
RESERVATION_GRACE_S = 2.0  # how long past its Retry-After a shed request's place is kept
RESERVATION_LATE_S = 0.25  # a place this far past its time no longer counts ahead of a returning retry
HELD_AHEAD_S = 2.0  # places held for retries due this soon are published to the other processes (``held_places``)
TOOK_KEEP_S = 3.0  # how long the places taken from other processes are published (``lending.STALE_S``)
TAKEN_MATCH_S = 0.25  # a place another process says it took is this one if their times agree this closely
RETURN_EWMA = 0.05  # weight of one ended reservation in the return rate
MAX_SHED_COUNT = 8  # return rates are learnt per shed count up to this (later sheds share the last)
PLACELESS_PER_SHED = 2.0  # place-less retries priced as due now, per place this replica held for the tenant lately
PLACELESS_TAU_S = 30.0  # time constant over which that allowance fades
OVERSHOOT = 1.1  # a queued ticket at its latest start may exceed the limit by this factor (one cut's worth)
# The longest Retry-After a client numbering its attempts (``x-stainless-retry-count``: the OpenAI SDKs) waits out:
# openai-python 3.x does not retry a 429 told longer (``MAX_RETRY_AFTER_DELAY``, two minutes); older versions
# ignored a Retry-After over 60 s and retried after their own backoff. Either way it is not back at that time.
SDK_RETRY_AFTER_MAX_S = 120.0
# Of the timeout a client declares (``Ticket.gone_at``, ``done_by``) the gateway budgets for this share: the
# client's clock started before ours.
CLIENT_TIMEOUT_SHARE = 0.95
# A Retry-After carries a margin of this many dispatch intervals past the place it promises (slots end later
# than priced as often as sooner), in seconds at most ``RETRY_MARGIN_MAX_S``: four intervals were 80 ms on a
# simulated A100's pool and 10 s on a 2-core CPU vLLM's, where the slots freed before the retry came back.
RETRY_MARGIN_PLACES = 4
RETRY_MARGIN_MAX_S = 2.0
# A tenant over its share is held to the low band's prefill places while another tenant sent work this recently
# (or has some in flight): about a quiet tenant's gap between two requests; longer held the heavy tenant's own
# burst for up to the fair share's whole horizon after the others had gone (``low_band_free``).
OTHERS_RECENT_S = 5.0
# ... or has work in flight and sent its last within this many of its own gaps between offers (their running mean,
# weight GAP_EWMA a gap): a burst that ended, its answers draining, is not about (``_about``).
RETURN_GAPS = 10.0
GAP_EWMA = 0.2
# While no other tenant is about, the tenant holding the most (or a tenant alone) sends its next top-band prompt
# this far (in prefill times) after the one before it: by then that one is in its engine step, and the next lands
# in vLLM's queue for the step after (``turn_free``).
TURN_PACE_PREFILLS = 0.8
# ... and has at most this many top-band prompts pending per replica (one in its step, the next in vLLM's queue): a
# step longer than the pace (a growing decode batch, or a tenant over its share that keeps its turn: ``turn_free``)
# otherwise lets them pile up in vLLM's queue and go two or three to a step.
TURN_PENDING = 2
# While another tenant is about, a tenant holding strictly more work in the pool than any other (per unit of
# weight), and at least this many requests per replica, sends every interactive prompt in the low band, within its
# share too (``_fills_pool``).
FILLS_POOL_PER_REPLICA = 3
# ... and at least this share of its fair share of the SLO limit (``fair_slots``): three requests alone bound a
# quiet tenant of the simulated A100's, whose prompts then went in pieces beside two other quiet tenants.
FILLS_POOL_SHARE = 0.5
# A tenant alone is paced so too, while its top-band prompts come at under PACE_SPARSE per replica in the turn's
# pace, their rate over the last TURN_RATE_TAU_S: offered faster, the pace would hold the engine's prefills back
# (a burst's peak, many short prompts), and it is off.
TURN_RATE_TAU_S = 5.0
# While another tenant is about, a top-band prompt sent this many decode steps (the pool's TPOT) after the last
# one of a tenant not holding the most (a quiet tenant's) waits in the gateway until then: two prompts that come
# together then take two engine steps, one after the other, as on an idle engine, instead of sharing one of twice
# the length (``pace_free``).
PACE_STEPS = 2.0
# ... only while the top-band prompts come sparsely: fewer than PACE_SPARSE per replica in a pace, at their rate
# over the last PACE_RATE_TAU_S (held to one per pace, they could not be sent at more than twice their rate).
PACE_SPARSE = 0.5
PACE_RATE_TAU_S = 1.0
# Low-band prompts' pieces (``low_band_prefill_chunk``) go at most one per replica in this many decode steps (the
# decode speed at light load, ``Capacity.tpot_at(1)``): pieces answered in one step and sent again at once all
# wait in vLLM for the same next step, and a top-band prompt that reaches the replica then shares its step with all
# of them; spaced, one piece rides in each decode step (``piece_wait``).
PIECE_GAP_STEPS = 1.0
QUEUE_SAFETY = 0.75  # queue only when the predicted wait leaves a quarter of the budget spare (slots free in clumps)
State = Literal["new", "queued", "admitted", "released", "shed", "cancelled"]


def _one_look(decide: Callable[..., Any]) -> Callable[..., Any]:
    """A queue decision (``PoolQueue.offer``, ``release``) with the replicas pinned for all of it
    (``Capacity.pin``): one look at them, never kept past its end, an exception included."""
    @functools.wraps(decide)
    def pinned(self: PoolQueue, *args: Any, **kwargs: Any) -> Any:
        took = self.capacity.pin()
        try:
            return decide(self, *args, **kwargs)
        finally:
            if took:
                self.capacity.unpin()
    return pinned


@dataclass(slots=True, eq=False)
class Ticket:
    """One request's place in a pool's queue."""

    tenant: str
    cls: int  # index into PRIORITIES
    tokens: float  # expected tokens (prompt + max_tokens): the fair-share charge at dispatch
    arrival: float
    deadline: float  # latest dispatch time that can still meet the SLO
    max_tokens: int | None = None
    key: int = 0  # identifies a retry of the same request (tenant + body): its reserved place
    since: float | None = None  # a retry that took back its place: when that place was promised (it queues by this)
    sheds: int = 0  # a retry that took back its place: how many times in a row this request was shed before
    # The client numbers its attempts (``x-stainless-retry-count``): its retry number, place held here or
    # not (0: a first attempt, never a retry whatever its body); None: it does not say (found by its body).
    retried: int | None = None
    state: State = "new"
    admitted_at: float | None = None
    inflight_at_admit: int = 0
    charged: float = 0.0  # weighted tokens charged to the tenant's counter so far
    # its tenant held its fair share of the SLO limit when it was admitted while another tenant was about
    # (``PoolQueue._over_share_about``), or had its turn of the top band's prefills already (``_turn_taken``)
    over_share: bool = False
    waiter: Any = None  # the filter's future, resolved when the ticket is admitted or shed
    shed_reason: str | None = None
    retry_after_s: float | None = None  # shed: when its retry fits (its place is held); set by the queue
    stream: bool = True  # its first token is seen (``first_token``); a unary answer's is not
    prefilling: bool = False  # admitted, first token not seen yet: holds a prefill place
    first_token_at: float | None = None  # a stream's first token was sent then (None: not yet, or unary)
    prefill_ahead: float = 0.0  # prefills pending per replica ahead of it when admitted
    low_band: bool = False  # admitted below the top band (a lower class, or its tenant over its share)
    # The client gives up then (the timeouts it declares: filter.CLIENT_TIMEOUT_HEADERS). ``gone_at``: a read
    # timeout (a stream's first token, a unary answer's whole body must come before); ``done_by``: a deadline
    # for the whole answer, a stream's last token included (Envoy's route timeout). None: it declares none.
    gone_at: float | None = None
    done_by: float | None = None
    # The client gives up on the request then, its retries included (``x-usefulwork-deadline-ms``): a shed
    # whose retry could not be answered by then is told not to retry (``final``) and no place is held for it.
    give_up_at: float | None = None
    final: bool = False
    # A retry whose place another gateway process holds (``PoolQueue._take_fleet_place``): (that process, the
    # place's time); it borrows that place where this process has no slot in time.
    place_of: tuple[str, float] | None = None
    queued_wait_s: float | None = None  # queued: the wait predicted then (a drop's DEBUG line reports it)
    # Computes ``key`` where it is 0, the first time the queue needs it (places are held here, or the ticket
    # is shed): hashing a 100 KB body cost ~30 us, and most requests are admitted with no place held.
    key_of: Callable[[], int] | None = None

    @property
    def priority(self) -> str:
        return PRIORITIES[self.cls]

    def retry_key(self) -> int:
        """``key``, computed by ``key_of`` on first use (0: no key)."""
        if not self.key and self.key_of is not None:
            self.key, self.key_of = self.key_of() or 1, None
        return self.key

    @property
    def engine_priority(self) -> int:
        """vLLM's ``priority`` (lower first): by class, and within a class a tenant under its fair share
        before one over it (vLLM's queue then shares like the gateway's)."""
        return 2 * self.cls + self.over_share


@dataclass(slots=True)
class Decision:
    kind: DecisionKind
    reason: str = ""
    predicted_wait_s: float = 0.0
    retry_after_s: float = 0.0
    woken: list[Ticket] = field(default_factory=list)  # other tickets admitted or shed by this offer


@dataclass
class PoolQueue:
    name: str
    capacity: Capacity
    weight_of: Callable[[str], float] = lambda tenant: 1.0
    reserve_fraction: float = 0.1
    max_queue: int = 4096
    e2e_slo_s: float | None = None
    tenant_headroom: float = 0.0  # share of the SLO limit a tenant over its fair share leaves free (0: off)
    tenant_active_s: float = 30.0  # a tenant counts toward the fair shares this long after its last request
    low_band_prefills: int = 0  # per replica, under priority scheduling while top-band work is about (0: off)
    inflight: int = 0
    inflight_cls: list[int] = field(default_factory=lambda: [0 for _ in PRIORITIES])
    running: set[Ticket] = field(default_factory=set)  # admitted, not yet released
    counters: dict[str, float] = field(default_factory=dict)  # VTC: weighted tokens served per tenant
    # queues[cls][tenant] -> FIFO of tickets
    queues: list[dict[str, deque[Ticket]]] = field(default_factory=lambda: [{} for _ in PRIORITIES])
    queued: int = 0
    admitted_total: int = 0
    shed_total: dict[str, int] = field(default_factory=dict)
    reservations: list[tuple[float, int]] = field(default_factory=list)  # (retry time, ticket key), sorted
    _held: dict[int, tuple[float, str, float, int]] = field(default_factory=dict)  # ticket key -> (its time, tenant, promised at, shed count)
    _held_by: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # (tenant, shed count) -> its places' times, sorted
    _promised_at: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # the same -> when they were promised, sorted
    retries_honoured: int = 0
    retries_placeless: int = 0  # retries (by their client's count) that found no place held here for their tenant
    retries_unproven: int = 0  # of those, priced as first attempts: their tenant held too few places here lately
    _placeless_allowed: dict[str, tuple[float, float]] = field(default_factory=dict)  # tenant -> (allowance, at)
    shared_returns: bool = False  # returns are settled with other replicas (``take_returns``, ``settle_returns``)
    _placeless: Counter[tuple[str, int]] = field(default_factory=Counter)  # (tenant, shed count) -> retries with no place here
    _unclaimed: Counter[tuple[str, int]] = field(default_factory=Counter)  # the same -> places let go, not learnt yet
    return_prior: float = 0.5  # return rate of a tenant with no ended reservation yet
    return_prior_numbered: float = 1.0  # the same, for a tenant whose clients number their attempts
    numbered: dict[str, float] = field(default_factory=dict)  # tenant -> share of its shed requests whose clients numbered their attempts (decayed)
    return_prior_weight: float = 1.0  # how many ended reservations the prior counts as (one: the first outcomes decide)
    returns: dict[str, tuple[float, float]] = field(default_factory=dict)  # tenant -> (taken back, ended), decayed
    returns_by_count: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)  # (tenant, shed count) -> the same
    inflight_tenant: dict[str, int] = field(default_factory=dict)
    inflight_top: dict[str, int] = field(default_factory=dict)  # the same, interactive only (``_left_to_drain``)
    last_seen: dict[str, float] = field(default_factory=dict)  # tenant -> its last request's arrival
    gap: dict[str, float] = field(default_factory=dict)  # tenant -> its offers' mean gap (``_about``)
    pending: int = 0  # prefills admitted and not yet answered (first token not seen), all classes
    pending_inter: int = 0  # of those, interactive
    pending_low: int = 0  # of those, low band (``Ticket.low_band``)
    # the others (top band), per tenant: when each was admitted, in that order (``_turn_taken``, ``turn_free``)
    pending_top_at: dict[str, list[float]] = field(default_factory=dict)
    _top_ver: int = 0  # bumped when ``pending_top_at`` changes (``_paced_since``'s cache)
    _top_rate: float = 0.0  # top-band prompts offered per second, as of ``_top_seen`` (``_dense``)
    _top_rate_slow: float = 0.0  # ... over a longer time (``_turn_dense``)
    _paced: tuple[Any, list[float]] = (None, [])  # (key, ``_paced_since``'s answer) cache
    _step_end_seen: float = -math.inf  # the last first token seen: an engine step's end (``_prefill_place_in``)
    _frees: tuple[Any, list[float]] = (None, [])  # (key, when the pending prompts free their places) cache
    _piece_at: float = -math.inf  # when the last low-band piece went, or its place is taken for (``piece_wait``)
    _top_seen: float = -math.inf  # the last offer of top-band work (interactive, its tenant within its share)
    _on_top_clear: list[Callable[[], None]] = field(default_factory=list)  # ``when_top_band_clear``'s callbacks
    _prefill_due: list = field(default_factory=list)  # heap of (when a unary prefill is deemed done, seq, ticket)
    _seq: Any = field(default_factory=itertools.count)
    _now: float = 0.0  # the time of the call in progress (every entry point takes ``now``)
    _active: tuple[float, float] = (math.nan, 0.0)  # (time, total weight of the active tenants) cache
    _run_ver: int = 0  # bumped when ``running`` or a running ticket's first token changes (``_slot_free_in``'s cache)
    _ends: tuple[Any, list[float]] = (None, [])  # (key, the sorted expected ends of what runs) cache
    _shed_at: deque[float] = field(default_factory=deque)  # when requests were shed the first time (``shed_demand``)
    # Places lent between gateway processes (``lending.PlaceLedger``; ``_borrow``):
    fleet_places: list[tuple[float, str]] = field(default_factory=list)  # the others' next places (time, process), soonest first
    owed: int = 0  # slots this process leaves idle: lent to other processes' retries, not given back yet
    loans: deque[str] = field(default_factory=deque)  # slots this process runs on loan, per lender, oldest first
    borrowed_total: int = 0
    # The places the others hold for retries, due soon: key -> (time, promised at, shed count, process)
    fleet_held: dict[int, tuple[float, float, int, str]] = field(default_factory=dict)
    took: deque[tuple[int, float, str, float]] = field(default_factory=deque)  # (key, time, holder, when) taken lately
    claimed_total: int = 0  # retries that came here for a place another process held (``_take_fleet_place``)
    claimed_elsewhere: int = 0  # places held here whose retries went to another process, which took them
    # Slots new requests took while no more were free than places held for retries (``_took_early``): each lets
    # one retry that comes back to its place here and finds no slot run one over the limit (``_owed_slot``).
    taken_early: int = 0
    retries_over_limit: int = 0

    @classmethod
    def from_cfg(cls, name: str, capacity: Capacity, cfg: AdmissionCfg, e2e_slo_s: float, **kw: Any) -> PoolQueue:
        """A pool's queue with the admission settings in ``cfg``: how the filter builds it, and so how the
        virtual-clock benchmarks and the what-if fleet must (``kw``: the tenants' weights, shared returns)."""
        return cls(name, capacity, reserve_fraction=cfg.reserve_fraction, tenant_headroom=cfg.tenant_headroom,
                   tenant_active_s=cfg.tenant_active_s, low_band_prefills=cfg.low_band_prefills,
                   max_queue=cfg.max_queue, e2e_slo_s=e2e_slo_s, return_prior=cfg.retry_return_prior,
                   return_prior_numbered=cfg.retry_return_prior_numbered, **kw)

    # -- the decision --
    def free(self, cls: int, tenant: str | None = None, look: dict | None = None) -> int:
        """Places a ticket of class ``cls`` (of ``tenant``) may take now: a slot, and a prefill place
        where the prefill gate counts its class. ``look``: a memo for one look at many tenants in a state that
        does not change meanwhile (``_may_go``)."""
        n = self.slot_free(cls, tenant, look)
        for gate in (self.prefill_free, self.low_band_free, self.turn_free, self.pace_free):
            if n <= 0:
                return n  # (none free: what a caller reads, none of them counting below 0)
            if (m := gate(cls, tenant)) is not None:
                n = min(n, m)
        return n

    def low_band(self, cls: int, tenant: str | None) -> bool:
        """Below the top band: a lower class, or a tenant already holding its fair share while another tenant is
        about (``_over_share_about``), or one whose turn of the top band's prefills is taken (``_turn_taken``)."""
        return cls > 0 or (tenant is not None and bool(self.tenant_headroom)
                           and (self._over_share_about(tenant) or self._turn_taken(tenant)))

    def _over_share_about(self, tenant: str) -> bool:
        """``tenant`` holds its fair share (``over_share``) and another tenant is about (``_others_in_pool``): only
        then does its share put it below the top band (after the others in vLLM's queue, gated, prefilled in
        pieces). With the others merely active in the shares' horizon (``tenant_active_s``) and none about, the
        low band slowed it for nobody: in the real CPU vLLM experiment's retry cell, its clients alone for 30 s
        after the burst's tenant, 28 of 48 prompts went in pieces, first token 3.3 s against 0.5 s whole (the
        pieces of a dozen prompts take their places in the pool's spacing one after another, ``piece_wait``),
        their slots held that much longer; the priority cell's interactive arrivals alone after another
        tenant's traffic (virtual clock, six seeds), TTFT p99 mean 0.256 -> 0.184 s on the simulated A100 and
        1.103 -> 0.574 s on session 62's probed CPU host. A tenant so over its share is paced by its turn
        instead (``turn_free``). (The cost: the simulated A100's fairness cell, where the quiet tenants come
        back after the 15 s drain, met the heavy tenant's whole prompts for longer at its start: quiet tenants
        within 1.2x in 26 -> 23 of seeds 1-36. docs/benchmarks.md section 7, session 67.)"""
        return self.over_share(tenant, self.capacity.current()) and self._others_in_pool(tenant)

    def _turn_taken(self, tenant: str, admitted: bool = False) -> bool:
        """While another tenant is about (``_others_in_pool``), ``tenant``, holding the most work in the pool
        (``_holds_most``), already has a top-band prompt pending per replica: its next interactive prompt goes
        in the low band (after the others' top-band prompts in vLLM's queue, gated, prefilled in pieces where
        ``low_band_prefill_chunk`` says so), so a tenant within its share of the slots still takes one
        prompt's turn of the prefills at a time. (Virtual clock, the
        simulated A100's fairness cell: a heavy tenant back under its share after a few answers put three to
        five whole prompts in one step, and a quiet prompt that came then waited for that step and shared the
        next. Counted while other tenants were merely active, the shares' 30 s horizon, it also took a lone
        tenant's own concurrent prompts out of the top band for half a minute after another had gone: the
        simulated A100's unloaded interactive baseline, after the retrying clients' cell, went from 0.19 to
        0.46 s, its prompts pieced for nobody. docs/benchmarks.md section 7, session 61.) A tenant that fills the
        pool (``_fills_pool``) has no turn: its every interactive prompt goes in the low band."""
        if not self._others_in_pool(tenant):
            return False
        return ((len(self.pending_top_at.get(tenant, ())) >= self.capacity.count() and self._holds_most(tenant, admitted))
                or self._fills_pool(tenant, admitted))

    def _fills_pool(self, tenant: str, admitted: bool = False) -> bool:
        """``tenant`` holds strictly more work in the pool than any other tenant (per unit of weight), and at
        least ``FILLS_POOL_PER_REPLICA`` requests per replica: while another tenant is about, its interactive
        prompts go in the low band (``_turn_taken``), prefilled in pieces, within its share too. Whole, the
        prompts it sent one per first token (its turn) kept a whole prompt in nearly every engine step: the heavy
        tenant of the fairness cell hovers at its share, under it each time an answer of its ends, and a quiet
        prompt that came then waited for the rest of that step and shared the next with the heavy tenant's next
        prompt, two prefills long. (Virtual clock, the simulated A100's fairness cell warmed as the experiment's
        is: quiet tenants within 1.2x of alone in 5 -> 12 of seeds 1-12 and 10 -> 14 of seeds 13-36, the heavy
        tenant's served requests -2.3%; holding the most by 1, 2, 5 or 8 requests instead: 10, 10, 10 and 9 of
        seeds 1-12; twice any other's: 11. docs/benchmarks.md section 7, session 69.) Two tenants alike are not
        bound (neither holds strictly more), nor a tenant whose few requests lead by one, nor one holding under
        ``FILLS_POOL_SHARE`` of its fair share of the SLO limit (``fair_slots``): bound at three requests, a
        quiet tenant beside two other quiet ones (the fairness cell's baseline) sent its prompts in pieces for
        nobody, their TTFT p99 alone 0.117 -> 0.151 s on average over seeds 13-36 (0.248 s in seed 15) and on
        the wall clock 0.126 -> 0.28 s for one of them (session 70)."""
        held = self.inflight_tenant.get(tenant, 0) - admitted
        if held < FILLS_POOL_PER_REPLICA * self.capacity.count():
            return False
        if not self._holds_most(tenant, admitted, strictly=True):
            return False  # (one tenant at most passes this: the share is priced for it alone)
        share = self.fair_slots(tenant, self.capacity.current())
        return share is not None and held >= FILLS_POOL_SHARE * share

    def _holds_most(self, tenant: str, admitted: bool = False, strictly: bool = False) -> bool:
        """No other tenant has more work in the pool than ``tenant`` (per unit of weight): the turn binds the
        tenant that fills the steps, not a quiet one whose own second prompt came while its first was
        pending (held back for its first token, that prompt waited a prefill and a round trip more than
        beside it in one step). ``admitted``: the ticket asking is already counted in the pool (its
        admission must find what its offer found). ``strictly``: more than every other tenant."""
        mine = (self.inflight_tenant.get(tenant, 0) - admitted) / self.weight_of(tenant)
        if strictly:
            return all(n < mine * self.weight_of(u) for u, n in self.inflight_tenant.items() if u != tenant)
        return all(n <= mine * self.weight_of(u) for u, n in self.inflight_tenant.items() if u != tenant)

    def turn_free(self, cls: int, tenant: str | None = None) -> int | None:
        """Top-band prompts ``tenant`` may send now (None: not paced). Where no other tenant is about
        (``_others_in_pool``; when one is, the turn puts the prompt in the low band: ``_turn_taken``), the
        tenant holding the most work in the pool (a tenant alone: only while its prompts come sparsely,
        ``_turn_dense``)
        sends one top-band prompt per replica every ``TURN_PACE_PREFILLS`` prefill times, with at most
        ``TURN_PENDING`` per replica pending, whether under its share or over it (``_over_share_about``): its
        prompt pending since less than that holds its place, the next waits in the gateway. So a tenant that
        starts a burst while the others are between requests puts about one prompt in each engine step instead
        of three or four, and a quiet prompt that comes then shares its step with one at most. (Virtual clock, the
        simulated A100's fairness cell, 12 seeds: the cell's start, where the quiet tenants have sent nothing
        for the 15 s drain, worst quiet tenant 2.22 / 2.30 / 2.90 / 2.67x -> 1.65 / 1.19 / 1.25 / 1.47x in
        seeds 1 / 7 / 9 / 12. Released at the pending prompt's first token instead, as the turn does, it cost
        a lone tenant whose neighbour had gone the round trip between a first token and the next prompt. The
        priority cell's interactive arrivals alone after another tenant's traffic, TTFT p99 over six seeds:
        0.166 / 0.211 / 0.352 / 0.158 / 0.292 / 0.308 s unpaced, 0.157 / 0.195 / 0.306 / 0.146 / 0.284 /
        0.300 s paced so (two prompts in one step finish together; paced, the first is answered sooner), up
        to 0.38 s released at first tokens; a pace of 0.45 prefill times gained little at the start (2.22 /
        2.83 / 2.06x in seeds 1 / 9 / 12), 1.0 as much as 0.8 but slower alone in two seeds. docs/benchmarks.md
        section 7, session 62.)

        A tenant alone is paced the same way (two of its prompts that come together are answered one after the
        other, the first sooner, rather than both late from one step of twice the length), unless its top-band
        prompts come at ``PACE_SPARSE`` per replica in the pace or more over the last ``TURN_RATE_TAU_S``
        (``_turn_dense``): then the pace would hold the engine's prefills back. Paced only after another tenant's
        traffic, the experiment's unloaded interactive baseline (which follows the retrying clients' cell) was
        paced and its loaded 2x cell (a tenant alone) was not: virtual clock, simulated A100, seeds 1-12,
        interactive TTFT p99 under load 0.218 -> 0.188 s (mean), against a baseline after another tenant's
        traffic 1.254x -> 1.101x (8 -> 0 seeds over 1.2x), the engine's tokens/s unchanged; the fairness cell
        warmed by the priority cell, as the experiment's is, quiet tenants within 1.2x in 8 -> 15 of 36 seeds
        (docs/benchmarks.md section 7, session 68)."""
        if (cls != 0 or tenant is None or not self.tenant_headroom or not self.low_band_prefills
                or not self.capacity.priority_scheduling):
            return None
        at = self.pending_top_at.get(tenant)
        if not at:
            return None
        pace = TURN_PACE_PREFILLS * (self.capacity.prefill_time() or 0.0)
        if self.share_state(tenant, self.capacity.current()) == 0 and self._turn_dense(pace):
            return None  # (alone, its top-band prompts offered faster than the pace could keep up with)
        if self._others_in_pool(tenant) or not self._holds_most(tenant):
            return None
        since = self._now - pace
        n = self.capacity.count()
        return min(n - sum(1 for a in at if a > since), TURN_PENDING * n - len(at))

    def pace_free(self, cls: int, tenant: str | None = None) -> int | None:
        """Top-band prompts ``tenant`` may send now under the pool's pace (None: not paced). While another tenant
        is about (``_others_in_pool``), at most one top-band prompt per replica goes in each ``PACE_STEPS``
        decode steps (the TPOT the queue prices, ``Capacity.decode_terms``: on the simulated A100 two make
        ~48 ms, about one 512-token prompt's prefill step) after one of a tenant not holding the most
        (``_holds_most``: the quiet tenants' prompts, its own included); the next waits in the gateway until
        then, or until that prompt's first token if sooner. A busy engine starts a step as soon as the one in
        progress ends and takes every prompt that reached it meanwhile: two quiet tenants' prompts that came a
        few milliseconds apart shared one step of twice a prompt's prefill, where on an idle engine (the
        tenants alone) the first was prefilled at once and the second in the next step. Paced so, the first
        keeps its own step and the second lands in the one after, about as soon as beside it. The tenant
        holding the most (whose prompts are paced by its turn, ``turn_free``, or go in the low band) does not
        hold the others back: held behind its whole prompt a quiet one waits a prefill as beside it.

        Only while top-band prompts come sparsely (``_dense``: offered at under ``PACE_SPARSE`` per replica in
        a pace over the last ``PACE_RATE_TAU_S``): paced always, many tenants' interactive prompts would be
        held to one per replica a pace (25 a second at the simulated A100's 20 ms TPOT) however short, and a
        busy engine's steps take many prompts at once by design. (``benchmarks/admission_tenants.py
        --priority``, where 50-200 tenants offer a prompt a millisecond: paced always, an offer cost 1.0-10 ms
        as the queue grew; with this bound 64-69 us, 62-67 before the pace.)

        (Virtual clock, the simulated A100's fairness cell: quiet tenants within 1.2x of alone in 3 -> 6 of
        seeds 1-12 and 11 -> 16 of seeds 13-36; per quiet request, loaded over alone, mean 1.158 -> 1.144;
        the priority cell unchanged. One decode step: 5 of 12; 1.5, 2.5 and 3: 5, 5 and 1 of 12, the second
        prompt landing a step late; paced by the heaviest tenant's prompts too, or by other tenants' only: 4
        of 12; the offer rate over 0.5 s: 6 of 12 and 14 of 24; off while two or more prompts per replica came
        in the last 1.5 or 4 paces (a count, not a rate): 4 and 3 of 12, the clusters of three going together
        again; 2.5 x the plain or the load's TPOT, not the highest estimate: 6 of 12, 14 and 15 of 24.
        docs/benchmarks.md section 7, session 65.)"""
        if (cls != 0 or tenant is None or not self.tenant_headroom or not self.low_band_prefills
                or not self.capacity.priority_scheduling or not self.pending_top_at):
            return None
        pace = self._pace_s()
        if pace is None or self._dense(pace) or not (recent := len(self._paced_since(self._now - pace))):
            return None  # (nothing paces it: the sends in this instant are counted as each one goes)
        if self.low_band(0, tenant) or not self._others_in_pool(tenant):
            return None
        return self.capacity.count() - recent

    def _turn_dense(self, pace: float) -> bool:
        """Top-band prompts are offered at ``PACE_SPARSE`` per replica in the turn's ``pace`` or more, at their
        rate over the last ``TURN_RATE_TAU_S``: a lone tenant's turn is off (``turn_free``)."""
        return self._rate_now(self._top_rate_slow, TURN_RATE_TAU_S) * pace >= PACE_SPARSE * self.capacity.count()

    def _dense(self, pace: float) -> bool:
        """Top-band prompts are offered at ``PACE_SPARSE`` per replica in a pace or more (``pace_free`` is off)."""
        return self._rate_now(self._top_rate, PACE_RATE_TAU_S) * pace >= PACE_SPARSE * self.capacity.count()

    def _rate_now(self, rate: float, tau: float) -> float:
        """A rate of top-band offers as of ``_top_seen`` (``_top_rate``, ``_top_rate_slow``), decayed to now."""
        return rate * math.exp((self._top_seen - self._now) / tau)

    def _pace_s(self) -> float | None:
        """``PACE_STEPS`` decode steps of the pool (None before a decode speed is measured)."""
        tpot = self.capacity.decode_terms()[0]
        return PACE_STEPS * tpot if tpot else None

    def _paced_since(self, since: float) -> list[float]:
        """When each top-band prompt still pending and sent after ``since`` by a tenant not holding the most was
        sent (``pace_free``)."""
        key = (since, self._run_ver, self._top_ver)
        if self._paced[0] == key:
            return self._paced[1]
        recent = [(u, at) for u, at in self.pending_top_at.items() if at[-1] > since]
        out = []
        if recent:  # (``_holds_most`` for each: its work per unit of weight under the most any tenant holds)
            weight = self.weight_of
            most = max((n / weight(u) for u, n in self.inflight_tenant.items()), default=0.0)
            out = [a for u, at in recent if self.inflight_tenant.get(u, 0) / weight(u) < most for a in at if a > since]
        self._paced = (key, out)
        return out

    def next_turn_due(self) -> float | None:
        """When a tenant with interactive work queued may next send a top-band prompt (``turn_free``,
        ``pace_free``), if later than the last call's time: the filter's waiters look again then (no event of
        the pool's says so)."""
        each = self.capacity.prefill_time()
        if not each or not self.pending_top_at or not self.queues[0]:
            return None
        n = self.capacity.count()  # (the gate opens when the n-th latest of its pending prompts is old enough)
        pace = TURN_PACE_PREFILLS * each
        due = [d for u, at in self.pending_top_at.items() if len(at) >= n and self.queues[0].get(u)
               if (d := at[-n] + pace) > self._now]
        if (steps := self._pace_s()) is not None and not self._dense(steps):
            due += [a + steps for a in self._paced_since(self._now - steps)]
        return min(due, default=None)

    def low_band_free(self, cls: int, tenant: str | None = None) -> int | None:
        """Prefill places free for low-band work (None: not gated). Under vLLM's priority scheduling a waiting
        interactive prompt overtakes waiting batch prompts, but not the ones already in the step it waits for,
        nor those that share its own step's token budget (2,048 tokens: four 512-token prompts make a
        ~190 ms step on the simulated A100 where one makes ~55 ms). So while top-band work has been offered
        in the last ``tenant_active_s``, low-band work keeps at most ``low_band_prefills`` prompts per replica
        pending in vLLM; the rest waits in the gateway's queue, where it does not delay anyone. Decode slots
        are not limited by this: batch work still fills the pool.

        A tenant over its share is gated only while another tenant has work in the pool or sent some in the
        last ``OTHERS_RECENT_S`` (``_others_in_pool``): the share counts a tenant for ``tenant_active_s`` after
        its last request, and gating on that alone held a tenant's own burst to one prompt at a time for up
        to half a minute after the other tenant had gone (its own earlier, top-band requests kept the gate
        open against it). In the real CPU vLLM experiment the retrying clients' burst follows another
        tenant's: 54% of them were admitted on a first retry with that rule, 91% before the gate existed.
        Counting work in flight alone let the heavy tenant of the simulated A100's fairness cell put six or
        more prompts in vLLM whenever the quiet tenants had none, and their next prompt shared its step
        with them.

        Not gated before a prefill time is known (from streams' first tokens or the replicas' own figure,
        ``Capacity.prefill_time``): a unary prompt's place is then held until its answer ends, so the gate
        would send low-band work one answer at a time, and a top-band unary prompt would hold it back for
        whole answers instead of prefills. (The arrival path priced the closed gate's wait at 0 then and
        admitted past it, while ``pump`` held queued low-band work behind it.)"""
        if not self.low_band_prefills or not self.capacity.priority_scheduling or self.capacity.prefill_time() is None:
            return None
        if cls > 0:
            if not self.top_band_about(self._now):
                return None
        elif tenant is None or not self.low_band(0, tenant):
            return None  # (an interactive prompt is in the low band only while another tenant is about)
        if self.pending > self.pending_low:
            # A top-band prompt is pending: a low-band one sent now would wait in vLLM beside it and share
            # its step (the step's budget fits both), doubling its prefill; it goes when that first token
            # comes. (Virtual clock, six seeds: the priority cell's worst interactive TTFT p99 went from
            # 1.80x to 1.28x of its arrivals alone, the engine's tokens/s unchanged: docs/benchmarks.md
            # section 7, session 23.)
            return 0
        return self.low_band_prefills * self.capacity.count() - self.pending_low

    def top_band_about(self, now: float) -> bool:
        """Whether top-band work was offered in the last ``tenant_active_s`` (seen only where ``low_band_prefills``
        is on and the replicas schedule by priority): then low-band prompts are gated (``low_band_free``), and
        prefilled in pieces where ``low_band_prefill_chunk`` says so (usefulwork/upstream/pieces.py)."""
        return now - self._top_seen < self.tenant_active_s

    def _others_in_pool(self, tenant: str) -> bool:
        """Another tenant is about (``_about``)."""
        return any(self._about(u) for u in itertools.chain(self.last_seen, self.inflight_tenant) if u != tenant)

    def _about(self, u: str) -> bool:
        """Tenant ``u`` sent work in the last ``OTHERS_RECENT_S``, or has some in the pool and sent its last within
        ``RETURN_GAPS`` of its gaps between offers (``gap``): a quiet tenant between two requests is still about
        (counting only what it sent lately let the heavy tenant fill the steps whenever the quiet ones had
        none, and their next prompt met several of its prompts; on a CPU vLLM, where a quiet tenant's requests
        come tens of seconds apart, its work in flight is what keeps it about). A tenant whose offers stopped,
        its work only draining, is not: nobody is left to protect. Counted about while any of its work was
        in flight, the retrying clients' answers draining into the priority cell's unloaded baseline bound
        the interactive tenant there as one filling the pool (``_fills_pool``), and its prompt went in pieces
        for nobody (virtual clock, session 70's probed CPU host, seeds 4 / 9: unloaded interactive TTFT p99
        1.124 / 1.635 s, 0.497 / 0.528 s so, seeds 1-24 mean 0.566 -> 0.493 s; the fairness cell alike to the
        digit there and on the simulated A100; three gaps instead of ten: the probed fairness cell's quiet
        tenants worse in two seeds, better in two. docs/benchmarks.md section 7, session 71)."""
        seen = self.last_seen.get(u)
        if seen is not None and self._now - seen < OTHERS_RECENT_S:
            return True
        if not self.inflight_tenant.get(u):
            return False
        return seen is None or self._now - seen < RETURN_GAPS * self.gap.get(u, math.inf)

    def top_band_pending(self) -> bool:
        """A top-band prompt is admitted and its first token not seen yet (under priority scheduling)."""
        return self.pending > self.pending_low

    def when_top_band_clear(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (once) when no top-band prompt is pending any more: at once if none is. Returns
        what takes it back (a wait given up: under steady interactive load the top band may not clear for a
        long time, and each given-up wait would leave its callback here until it did)."""
        if not self.top_band_pending():
            callback()
            return _nothing
        self._on_top_clear.append(callback)
        return lambda: callback in self._on_top_clear and self._on_top_clear.remove(callback)

    def piece_gap(self) -> float | None:
        """The pool's spacing of low-band pieces (``piece_wait``; None before a decode speed at load is fitted): the
        line's TPOT at one request in flight, at most the mean TPOT measured (a line fitted from a few noisy
        load bands may lean the wrong way; spaced wider than the engine's real step, the pieces set their own
        pace and the engine loses tokens/s)."""
        tpot = self.capacity.tpot_at(1.0)
        if tpot is not None and self.capacity.tpot:
            tpot = min(tpot, self.capacity.tpot)
        return PIECE_GAP_STEPS * tpot / self.capacity.count() if tpot and tpot > 0 else None

    def piece_wait(self, now: float) -> float:
        """Seconds until a low-band prompt's next piece may go (0: now), its place taken: at most one piece per
        replica each ``PIECE_GAP_STEPS`` decode steps at light load (``piece_gap``). The forwarder sends a piece
        when the one before it is answered, at the end of an engine step, so the pieces of several prompts
        answered in one step were all sent at once and waited in vLLM for the same next step; a top-band prompt
        that reached the replica meanwhile shared its step with all of them (three 64-token pieces made the
        simulated A100's 53 ms prompt step 71 ms), and steps carrying several pieces alternated with bare
        decode steps. Spaced, the pieces fall out of step with each other: each rides in a decode step, which
        the memory bound leaves time for (one 64-token piece costs a simulated A100 step nothing), and a
        top-band prompt meets one at most. (Virtual clock, the simulated A100's fairness cell, 64-token pieces
        three at a time: quiet tenants within 1.2x of alone in 6 -> 9 of seeds 1-12 and 15 -> 17 of seeds
        13-36, per quiet request against alone over 1.2x 241 -> 95 of 779; the engine's tokens/s +4.6%; the
        priority cell's interactive ratio and throughput unchanged. docs/benchmarks.md section 7, session 66.)"""
        gap = self.piece_gap()
        if gap is None:
            return 0.0
        at = max(now, self._piece_at + gap)
        self._piece_at = at
        return at - now

    def prefill_pending(self, cls: int, tenant: str | None = None) -> int | None:
        """Pending prefills that delay a first token of class ``cls`` (of ``tenant``; None: not gated).
        Under vLLM's priority scheduling an interactive prefill overtakes waiting lower-class ones, and one
        of a tenant within its share (vLLM priority 0) those of a tenant over it (1): so top-band prompts
        count only each other, an over-share tenant's interactive ones count every interactive prompt,
        and lower classes are not gated here (they wait inside vLLM by design; ``low_band_free`` keeps
        them from filling the steps). Under first-come-first-served every pending prefill delays every
        later one. (Counting the heavy tenant's prompts against a quiet tenant's held the quiet one in the
        gateway's queue for up to 0.4 s at 2x overload on the virtual clock.)"""
        if not self.capacity.priority_scheduling:
            return self.pending
        if cls != 0:
            return None
        return self.pending_inter if tenant is not None and self.low_band(0, tenant) else self.pending - self.pending_low

    def prefill_gate(self, cls: int, tenant: str | None = None) -> tuple[int, int] | None:
        """(pending prefills, prefill places) that gate class ``cls`` (of ``tenant``) now (None: no gate for it)."""
        pending = self.prefill_pending(cls, tenant)
        if pending is None:
            return None
        places = self.capacity.prefill_places()
        return None if places is None else (pending, places)

    def prefill_free(self, cls: int, tenant: str | None = None) -> int | None:
        """Prefill places free for class ``cls`` (of ``tenant``; None: no gate for it)."""
        gate = self.prefill_gate(cls, tenant)
        return None if gate is None else gate[1] - gate[0]

    def slot_free(self, cls: int, tenant: str | None = None, look: dict | None = None) -> int:
        """Slots a ticket of class ``cls`` (of ``tenant``) may take now (interactive: its own SLO limit,
        within the fill limit; lower classes: the fill limit less the interactive reserve). A tenant
        already holding its fair share leaves ``tenant_headroom`` of the SLO limit free for the others."""
        slo, fill = self.capacity.limits()
        headroom = state = h = 0
        if tenant is not None and self.tenant_headroom:
            state = self.share_state(tenant, slo)
            if state:
                # over its share: leave the headroom free; under it (among several): it may use the
                # headroom beyond the limit too, so a full pool does not make it wait for the heavy
                # tenant's work to drain
                h = self._headroom_slots(slo)
                headroom = state * h
        if cls == 0:
            free = slo - headroom - self.inflight_cls[0] - self.owed
            return free if state != -1 else free + self._left_to_drain(tenant, slo, slo, slo - h, self.inflight_top, look)
        reserve = max(1, math.ceil(slo * self.reserve_fraction)) if self.reserve_fraction else 0
        free = max(1, fill - reserve - headroom) - self.inflight - self.owed
        return free if state != -1 else free + self._left_to_drain(
            tenant, slo, max(1, fill - reserve), max(1, fill - reserve - h), self.inflight_tenant, look)

    def _headroom_slots(self, slo: int) -> int:
        """Slots of the SLO limit ``slo`` that a tenant holding its fair share leaves free (``tenant_headroom``)."""
        return max(1, math.ceil(slo * self.tenant_headroom)) if self.tenant_headroom else 0

    def _left_to_drain(self, tenant: str | None, slo: int, limit: int, allowed: int, counts: dict[str, int],
                       look: dict | None = None) -> int:
        """The work (``counts``: in flight per tenant) of tenants over their share beyond what they may
        hold now: what a limit just cut, or other tenants' demand, leaves them to drain. A tenant under its
        share does not wait for it. What they may hold is the more of ``allowed`` (``limit`` less the
        headroom) and their max-min shares of ``limit`` given what every tenant asks for now
        (``maxmin_shares``, ``tenant`` asking one more). (On the real CPU vLLM a live cut took the SLO
        limit from 26.1 to 20.7 with 23 in flight, and a quiet tenant's request queued 0.75 s in the
        gateway while the heavy tenant's work drained: 4.8x its first token alone; docs/benchmarks.md
        section 7, session 35. In a small pool, the limit of 7 a slow CPU vLLM holds among four tenants,
        the heavy one held 6 while a quiet one held 2 and asked for a third: within the limit less the
        headroom, so the quiet request waited for the heavy tenant's answers to end, where its max-min
        share was 3 and the heavy one's 4.) Once the heavy tenant is back within its bound this is 0, and
        the headroom beyond the limit is what bounds the quiet tenants.

        In one ``look`` (``_may_go``: the pool unchanged while it lasts) the tenants over their share are found
        once, and the answer depends on ``tenant`` only through its demand and weight (its own entry in the
        max-min shares; it is under its share, so not among those over it), so tenants alike share one pricing:
        a release whose pump looked at 200 tenants with work queued, under priority scheduling with another
        tenant decoding, cost ~24 ms pricing each (docs/benchmarks.md section 7, session 69)."""
        if look is not None:
            key: tuple = (id(counts), slo)
            if (over_all := look.get(key)) is None:
                over_all = look[key] = {u for u in counts if self.share_state(u, slo) == 1}
            mine = tenant in over_all
            if len(over_all) == mine:
                return 0
            demand = counts.get(tenant, 0) + sum(len(c.get(tenant, ())) for c in self.queues) if tenant else None
            key = (id(counts), slo, limit, allowed, demand, self.weight_of(tenant) if tenant else None, mine)
            if (left := look.get(key)) is None:
                left = look[key] = self._left_to_drain(tenant, slo, limit, allowed, counts)
            return left
        over = [(u, n) for u, n in counts.items() if u != tenant and self.share_state(u, slo) == 1]
        if not over:
            return 0
        shares = self.maxmin_shares(tenant, limit, counts)
        by_share = sum(max(0, n - math.floor(shares.get(u, 0.0))) for u, n in over)
        return max(0, sum(n for _, n in over) - allowed, by_share)

    def maxmin_shares(self, asking: str | None, limit: int, counts: dict[str, int]) -> dict[str, float]:
        """Weighted max-min shares of ``limit`` places among the tenants with work in the pool or queued
        (their demand: ``counts`` in flight plus queued, ``asking`` one more): each gets its demand where
        that is under the common level, the rest the level times its weight (water-filling)."""
        demand = dict(counts)
        for cls_q in self.queues:
            for u, q in cls_q.items():
                demand[u] = demand.get(u, 0) + len(q)
        if asking is not None:
            demand[asking] = demand.get(asking, 0) + 1
        weighted = [(n, self.weight_of(u), u) for u, n in demand.items() if n > 0]
        order = sorted((n / w, u, n, w) for n, w, u in weighted)
        left, weights = float(limit), sum(w for _, w, _ in weighted)
        shares: dict[str, float] = {}
        for i, (per_weight, u, n, w) in enumerate(order):
            if per_weight * weights <= left:
                shares[u] = float(n)
                left -= n
                weights -= w
                continue
            level = left / weights
            for _, v, _, wv in order[i:]:
                shares[v] = level * wv
            break
        return shares

    def over_share(self, tenant: str, slo: int) -> bool:
        """``tenant`` holds at least its weighted share of the SLO limit among the tenants active in the
        last ``tenant_active_s`` (a lone tenant never does: its share is the whole pool)."""
        return self.share_state(tenant, slo) == 1

    def share_state(self, tenant: str, slo: int) -> int:
        """1: ``tenant`` holds at least its weighted share of the SLO limit among the tenants active in
        the last ``tenant_active_s``; -1: it holds less, and others are active; 0: it is alone."""
        share = self.fair_slots(tenant, slo)
        if share is None:
            return 0
        return 1 if self.inflight_tenant.get(tenant, 0) >= share else -1

    def fair_slots(self, tenant: str, slo: int) -> float | None:
        """``tenant``'s weighted share of the SLO limit ``slo`` among the tenants active in the last
        ``tenant_active_s`` (None: it is alone)."""
        now = self._now
        if not now - self._active[0] < 1.0:  # recomputed at most once a second (and when a tenant appears)
            horizon = now - self.tenant_active_s
            stale = [u for u, seen in self.last_seen.items() if seen < horizon and not self.inflight_tenant.get(u)]
            for u in stale:
                del self.last_seen[u]
                self.gap.pop(u, None)
            self._active = (now, sum(self.weight_of(u) for u in self.last_seen))
        total = self._active[1]
        w = self.weight_of(tenant)
        if tenant not in self.last_seen:
            total += w
        if total <= w:
            return None
        return slo * w / total

    def drain_rate(self, cls: int) -> float | None:
        rate = self.capacity.drain_rate()
        if rate is None or cls == 0:
            return rate
        return rate * self.capacity.fill() / max(1, self.capacity.current())

    def ahead_of(self, t: Ticket, own: int | None = None) -> int:
        """Tickets dispatched before ``t`` would be if it queued now (or, already queued, with ``own``
        of its tenant's tickets before it): higher classes, then a round-robin share of its own class
        (the VTC order for tenants of equal weight).

        With tenant headroom, a tenant under its fair share is not behind the queued work of tenants
        over theirs: those wait for a place within the limit less the headroom (``slot_free``), and when
        one frees, the tenant under its share may take it too and goes first (``_pop_next``: the
        least-served tenant). Counted ahead, that work made a quiet tenant's request with a place free
        look as if it waited for the heavy tenant's next answer to end, and it was shed where queueing
        it would have admitted it at once (the real CPU vLLM's replica on the virtual clock, a limit of
        6-7: 7 of 9 quiet requests shed in the fairness cell's seeds 3-5)."""
        n = sum(sum(len(q) for q in self.queues[c].values()) for c in range(t.cls))
        if own is None:
            mine = self.queues[t.cls].get(t.tenant)
            own = (len(mine) if t.since is None else _asked_before(mine, t.since)) if mine else 0
        n += own
        others = [(u, q) for u, q in self.queues[t.cls].items() if u != t.tenant]
        if others and self.tenant_headroom:
            slo = self.capacity.current()
            if self.share_state(t.tenant, slo) == -1:
                others = [(u, q) for u, q in others if self.share_state(u, slo) != 1]
        for _, q in others:
            n += min(len(q), own + 1)
        return n

    def predict_wait(self, t: Ticket, now: float, reserved: int = 0, own: int | None = None) -> float | None:
        """Seconds until ``t`` would be dispatched (0: now; None: no measurement yet): the later of a
        free slot and a free prefill place."""
        return self._place_wait(self.ahead_of(t, own) + reserved + 1, t, now)

    def _place_wait(self, ahead: int, t: Ticket, now: float) -> float | None:
        """Seconds until the ``ahead``-th place (its own included) a ticket like ``t`` could take frees."""
        prefill = self.prefill_free(t.cls, t.tenant)
        wait = 0.0 if prefill is None or ahead <= prefill else self._prefill_place_in(ahead - prefill, t, now)
        low = self.low_band_free(t.cls, t.tenant)
        if low is not None and ahead > low:  # low-band prompts go one after another: each a prefill's time
            wait = max(wait, self.capacity.prefill_wait((ahead - low) / self.low_band_prefills))
        turn = self.turn_free(t.cls, t.tenant)
        if turn is not None and ahead > turn:  # one every TURN_PACE_PREFILLS prefill times, per replica
            wait = max(wait, TURN_PACE_PREFILLS * self.capacity.prefill_wait(ahead - turn))
        pace = self.pace_free(t.cls, t.tenant)
        if pace is not None and ahead > pace:  # the first when the oldest paced prompt ages, then one a pace each
            steps = self._pace_s() or 0.0
            first = min((a + steps - now for a in self._paced_since(now - steps)), default=0.0)
            wait = max(wait, first + steps * (ahead - pace - 1) / self.capacity.count())
        free = max(0, self.slot_free(t.cls, t.tenant))
        position = ahead - free
        if position <= 0:
            return wait
        if self.running:
            return max(wait, self._slot_free_in(position, now, free))
        rate = self.drain_rate(t.cls)
        # One dispatch interval of headroom: slots free one at a time, not as a fluid.
        return None if not rate else max(wait, (position + 1) / rate)

    def _prefill_place_in(self, position: int, t: Ticket, now: float) -> float:
        """Seconds until the ``position``-th prefill place beyond the free ones frees for a ticket like ``t``: the
        pending prompts the gate counts for it (``prefill_pending``) are answered in the engine's steps, each step
        prefilling every prompt that waited at its start, as long as their prefills together (a compute-bound
        prefill: the prefill time per prompt, over the replicas). The step in progress started at the last first
        token seen (a step's end) and carries the prompts admitted before it; the next one starts at its end with
        those admitted since, and so on; places free in clumps, at the steps' ends. Priced one prefill time apart
        (``Capacity.prefill_wait``), a request that came with a slot free and the gate full (four prompts pending
        on the real CPU vLLM, 0.78 s each) was queued on a wait of 0.79 s where the engine had put three of them in
        one step: no place freed for 2.05 s, and it was dropped at its latest start, its 429 1.85 s after it came
        (the sheds' p99 missed by one request: docs/benchmarks.md section 7, session 69). Places still to come
        after the pending prompts' steps free one prefill time apart."""
        each = self.capacity.prefill_time()
        if not each:
            return 0.0
        each /= self.capacity.count()
        kind = 0 if not self.capacity.priority_scheduling else 1 if self.low_band(t.cls, t.tenant) else 2
        key = (self._run_ver, self.pending, kind, each)  # (the pending set changes with one of the first two)
        if self._frees[0] == key:
            frees = self._frees[1]
        else:
            frees = self._pending_frees(kind, each)
            self._frees = (key, frees)
        if position <= len(frees):
            return max(0.0, frees[position - 1] - now)
        return max(0.0, (frees[-1] if frees else now) - now) + (position - len(frees)) * each

    def _pending_frees(self, kind: int, each: float) -> list[float]:
        """When each pending prompt of ``kind`` (``_prefill_place_in``) frees its prefill place, sorted: a stream's
        at the end of its step; a unary prompt's when it is deemed done (``_prefill_due``: its first token is not
        seen, so that is when the gate opens for it)."""
        def counted(u: Ticket) -> bool:  # (what the gate counts for that kind: ``prefill_pending``)
            return u.prefilling and (kind == 0 or (kind == 1 and u.cls == 0) or (kind == 2 and not u.low_band))
        pending = sorted(((u.admitted_at, u.stream) for u in self.running if counted(u)), key=lambda p: p[0])
        at = [a for a, _ in pending]
        frees = [due for due, _, u in self._prefill_due if counted(u)]
        i, start = 0, max(self._step_end_seen, at[0]) if at else 0.0
        while i < len(at):
            j = bisect.bisect_right(at, start, lo=i)
            if j == i:  # (nothing waited at that step's start: the next prompt starts its own)
                start = at[i]
                continue
            end = start + (j - i) * each
            frees += [end for _, stream in pending[i:j] if stream]
            i, start = j, end
        frees.sort()
        return frees

    def _slot_free_in(self, position: int, now: float, free: int = 0) -> float:
        """When the ``position``-th slot beyond the ``free`` ones frees: each request in flight ends when
        expected (``_expected_ends``), a free slot is taken now, and a slot taken again is held for another
        service time (plus two mean deviations of margin). Continuous batching releases in clumps
        (requests admitted together finish together): a fluid drain rate would promise slots that come
        later. (Cycling only the slots running now, a place deep in a queue of promised retries cost a
        whole slot hold per place when few ran: the real CPU vLLM, limit 2 with one running while the
        prefill gate held the other, told 35 s more per shed.)"""
        service = self.capacity.slot_hold()
        tpot, out = self.capacity.decode_terms()
        key = (self._run_ver, service, tpot, out)
        if self._ends[0] == key:  # nothing started, ended or sent its first token; no estimate moved
            ends = self._ends[1]
        else:
            ends = self._expected_ends(service, tpot, out)
            self._ends = (key, ends)
        rounds, i = divmod(position - 1, len(ends) + free)
        end = ends[i] if i < len(ends) else now + service
        return max(1e-3, end + service * rounds - now)  # overdue: any moment (not "now": no slot is free)

    def _expected_ends(self, service: float, tpot: float | None, out: int | None) -> list[float]:
        """When each request in flight is expected to end, sorted (``_slot_free_in``; ``tpot`` and ``out``
        as ``Capacity.decode_terms`` gives them).

        A stream whose first token was sent ends its decode after it; anything else a slot's hold
        (``service``, which carries a margin for the unknown prefill) after its start. In a burst vLLM runs
        the new prompts' prefills before the running sequences' next tokens, so requests admitted over a
        second and a half ended within 0.2 s of each other, the last ones 2.4 s after they started where
        the first took 3.6 s. Priced from their starts, ends came 0.87 s sooner than priced on average
        (2.4 s at the 90th percentile; from the first token 0.59 s and 1.95 s; virtual clock, burst-retry
        cell, seed 1, half a second ahead): a returning retry's wait was priced past what its budget allows
        and it was shed again while places were about to free.

        (Cached by the caller until a request starts, ends or sends its first token, or an estimate moves:
        in a full pool nothing starts between sheds, and each shed asked this three times, each time
        looping over every request in flight, 103 us with 500 of them.)"""
        decode: dict[int | None, float | None] = {}  # per ``max_tokens``
        ends = []
        for x in self.running:
            if x.first_token_at is not None and tpot is not None:
                m = x.max_tokens
                d = decode[m] if m in decode else decode.setdefault(m, decode_time(tpot, out, m))
                if d is not None:
                    ends.append(x.first_token_at + d)
                    continue
            ends.append(x.admitted_at + service)  # type: ignore[operator]
        ends.sort()
        return ends

    def ttft_budget(self, t: Ticket, now: float) -> float:
        """How long ``t`` may wait and still meet its TTFT deadline (the E2E SLO aside)."""
        return t.deadline - now - self.est_ttft(t.cls, t.tenant)

    def budget(self, t: Ticket, now: float) -> float:
        """How long ``t`` may wait and still meet its TTFT deadline and the E2E SLO (and be answered before
        its client gives up, where it says when): until its ``latest_start``."""
        return self.latest_start(t) - now

    def _first_bytes(self, t: Ticket) -> float:
        """Service time until ``t``'s client sees its first bytes: a stream's first token, a unary answer."""
        return self.est_ttft(t.cls, t.tenant) if t.stream else self.capacity.est_e2e(t.max_tokens)

    def est_ttft(self, cls: int, tenant: str | None = None) -> float:
        """Service TTFT a ticket of class ``cls`` dispatched now should budget for: the measured one
        (``Capacity.est_ttft``), or, where the prefill gate counts its class, the prefills it would
        find pending (at most the gate's places less its own) plus its own, if that is longer. (The
        measured TTFT comes with answers that end; a burst fills the pending prefills seconds sooner.)"""
        est = self.capacity.est_ttft()
        gate = self.prefill_gate(cls, tenant)
        if gate is None:
            return est
        pending, places = gate
        return max(est, self.capacity.prefill_wait(min(pending, places - 1) + 1))

    @_one_look
    def offer(self, t: Ticket, now: float) -> Decision:
        """Admit, queue or shed a new ticket. Admitted and queued ones hold a place until released."""
        self._now = now
        self._prefills_due(now)
        self.capacity.judge_live(now, self.inflight)
        if (prev := self.last_seen.get(t.tenant)) is None:
            self._active = (math.nan, 0.0)  # a new active tenant: the shares change
        else:
            g = self.gap.get(t.tenant)
            self.gap[t.tenant] = now - prev if g is None else g + GAP_EWMA * (now - prev - g)
        self.last_seen[t.tenant] = now
        if t.cls == 0 and self.low_band_prefills and self.capacity.priority_scheduling and not self.low_band(0, t.tenant):
            self._top_rate = self._rate_now(self._top_rate, PACE_RATE_TAU_S) + 1.0 / PACE_RATE_TAU_S
            self._top_rate_slow = self._rate_now(self._top_rate_slow, TURN_RATE_TAU_S) + 1.0 / TURN_RATE_TAU_S
            self._top_seen = now
        # (A first attempt the client numbered is not a retry: an identical request of the same tenant in
        # flight, or shed, must not give it the place held for that one's retry.)
        key = t.retry_key() if t.retried != 0 and (self._held or (t.retried and self.fleet_held)) else 0
        held = self._take_reservation(key, now)
        if held is None and t.retried and key:
            held = self._take_fleet_place(t, key, now)
        if held is None and t.retried:
            held = self._take_reservation(0, now, t.tenant)
        own_place = held is not None and t.place_of is None  # (a place held here: not another process's)
        if held is None and t.retried:
            # A retry with no place here at all: the gateway replica that shed it holds its place (this one
            # holds none left for its tenant), or its place was let go while it waited. Its client waited
            # the Retry-After it was told, so it is priced as holding a place due now, not as a first
            # attempt behind every place held here. (Behind three real gateways on the wall clock, where
            # each learns its own limit and the one that sheds least runs out of places for the retries it
            # receives: first retries admitted 68.5% -> 76.3% over seeds 1-3, all served within the SLO;
            # docs/benchmarks.md section 7, session 37.)
            self.retries_placeless += 1
            sheds = min(int(t.retried), MAX_SHED_COUNT)  # (each attempt before it was shed, as 429s are retried)
            if self._placeless_allow(t.tenant, now):
                held = (now, now, sheds)
                if self.shared_returns:  # its place, held elsewhere, goes unclaimed there: it did come back
                    self._placeless[(t.tenant, sheds)] += 1
            else:
                self.retries_unproven += 1
        if held is not None:
            t.since, t.sheds = held[1], held[2]
        # (its budget matters for the places held for retries, and for a shed: nothing else reads it, so a
        # pool that holds no place for a retry admits without computing it)
        budget = self.budget(t, now) if held is not None or self._held_by else None
        # A returning request is behind only the places promised before its own; a new one is behind
        # every place that falls due within its budget. A tenant under its fair share (others active) is
        # behind only its own: it may use the headroom the others leave, and the heavy tenant's promised
        # retries held the quiet tenants' requests in the queue for up to 0.6 s at 2x overload.
        mine = (t.tenant if self.reservations and self.tenant_headroom
                and self.share_state(t.tenant, self.capacity.current()) == -1 else None)
        # A returning retry does not count places already RESERVATION_LATE_S past their time: their clients
        # (told the same kind of Retry-After) did not come, most often because they had used their last retry.
        reserved = round(self._reserved_until(held[0], mine, now - RESERVATION_LATE_S) if held is not None
                         else self._reserved_until(now + max(0.0, budget), mine) if budget is not None else 0)
        ahead = self.ahead_of(t)
        wait = self._place_wait(ahead + reserved + 1, t, now)  # (``predict_wait``, ``ahead`` counted once)
        if wait == 0.0 and ahead == 0:
            if _declares_timeout(t) and self._gone_before_answer(t, now):
                if log.isEnabledFor(logging.DEBUG):
                    info = self.explain(t, now, ahead, reserved, wait, self.budget(t, now))
                    info.update(quick_answer_s=[round(x, 3) for x in self._quick_answer(t)],
                                gone_in_s=None if t.gone_at is None else round(t.gone_at - now, 3),
                                done_in_s=None if t.done_by is None else round(t.done_by - now, 3))
                    log.debug("admission: shed at a free slot: %s", info)
                return self._shed(t, "client_timeout", 0.0, now)
            if held is None and self._held:
                self._took_early(t)
            self._admit(t, now)
            return Decision("admit")
        if budget is None:
            budget = self.budget(t, now)
        if self.queued >= self.max_queue:
            return self._shed(t, "queue_full", wait or 0.0, now)
        if t.cls == 2:  # sheddable: only ever fills a free slot
            return self._shed(t, "sheddable", wait or 0.0, now)
        if wait is not None and wait > QUEUE_SAFETY * budget:
            if self._borrow(t, now, budget):
                return Decision("admit")
            if own_place and budget > 0 and self._owed_slot(t):
                self._admit(t, now)
                return Decision("admit")
            # (where the SLO alone would have let it wait, its client's own timeout is why: it may allow more)
            slo_ok = _declares_timeout(t) and wait <= QUEUE_SAFETY * (self._slo_latest(t) - now)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("admission: shed at arrival: %s", self.explain(t, now, ahead, reserved, wait, budget))
            return self._shed(t, "client_timeout" if slo_ok else "predicted_wait", wait, now)
        t.queued_wait_s = wait
        self._enqueue(t)
        woken = self.pump(now)  # slots may be free (the prediction counted held places as work ahead)
        if t.state == "admitted":
            woken.remove(t)
            return Decision("admit", woken=woken)
        if t.cls == 0 and self.queued > sum(len(q) for q in self.queues[0].values()):
            woken.extend(self._overtaken(now))
        return Decision("queue", predicted_wait_s=wait or 0.0, woken=woken)

    def _took_early(self, t: Ticket) -> None:
        """New request ``t`` takes a free slot while places are held here for retries: where no more slots are
        free than the places held (weighted by their clients' return rates), the slot it takes is one a held
        place was priced on, freed before that place fell due (its budget does not reach the place). The
        retry then comes back at its time to a full pool: the slot is owed to it (``_owed_slot``)."""
        if max(0, self.slot_free(t.cls, t.tenant)) <= self._reserved_until(math.inf):
            self.taken_early = min(self.taken_early + 1, len(self._held))

    def _owed_slot(self, t: Ticket) -> bool:
        """Whether a retry that came back to its place here, found no slot within its budget and can still start
        now (its budget > 0), takes a slot a new request took early (``_took_early``): one over the limit, one
        such retry at a time, within the prefill gate.

        The slot model prices a place where it expects a slot to free, from the full pool's measured figures,
        which carry a margin (the slowest decode measured, the service time plus two mean deviations) and, after
        a cut, describe the higher limit they were learnt at. On the real CPU vLLM's burst-retry cell (a Zen 4
        host, session 59) 5 of 13 first retries came back to a full pool and were shed for their clients'
        timeouts. On the virtual clock's replica of that run (the burst before had cut the limit to 5 per
        replica; the figures were learnt at 8) slots priced to free 12-25 s after a shed freed after 5-6 s, and
        new requests took them before the places fell due (seeds 1-6: 41 of 69 first retries admitted; 46 of 70
        with this; the 25 recorded runs' replicas 76.4% -> 79.5%, the simulated A100 91.4% -> 92.0%, the
        autoscale what-if's day unchanged). Pricing the places on quicker figures instead brought retries back
        before their slots freed on other hosts and cost that day 50-243 failed requests (docs/benchmarks.md
        section 7, session 59)."""
        if self.taken_early <= 0:
            return False
        cap = self.capacity
        gate = self.prefill_gate(t.cls, t.tenant)
        if gate is not None and gate[0] >= gate[1]:
            return False
        if t.cls == 0 and self.inflight_cls[0] >= int(cap.current()) + 1:
            return False
        if self.inflight >= int(cap.fill()) + 1:
            return False
        self.taken_early -= 1
        self.retries_over_limit += 1
        return True

    # -- places lent between gateway processes --
    def _borrow(self, t: Ticket, now: float, budget: float) -> bool:
        """Admit a client's retry that finds no slot here within its budget on a place another gateway process
        expects to free within it (``fleet_places``, as ``next_place`` there said at the last exchange); that
        process leaves a slot idle until this one's next request ends (``release`` gives the loan back).

        Behind a load balancer that sends each attempt to the next gateway process, a retry reaches
        another process than the one whose slots priced its Retry-After, n - 1 times in n, and the
        processes' slots free at different times: one that refilled its slots from its queue in one clump
        has none free for seconds while another's frees within the retry's budget. Behind three real
        gateways (wall clock, seed 1) 29 of the 49 first retries shed had another process's first end
        within their budget (docs/benchmarks.md section 7, session 53). Only a retry its client numbers
        (``x-stainless-retry-count``) borrows: it was promised a place by the fleet. A retry that claimed the
        place held for it at another process (``_take_fleet_place``) borrows that one first."""
        if not t.retried:
            return False
        if t.place_of is not None and t.place_of[1] - now <= QUEUE_SAFETY * budget:
            lender = t.place_of[0]  # its own place, held by the process that shed it (``_take_fleet_place``)
        elif self.fleet_places and self.fleet_places[0][0] - now <= QUEUE_SAFETY * budget:
            lender = self.fleet_places.pop(0)[1]  # (one retry per place: a place published once is lent once here)
        else:
            return False
        t.place_of = None
        self.loans.append(lender)
        self.borrowed_total += 1
        self._admit(t, now)
        return True

    def next_place(self, now: float) -> float:
        """When a slot here frees with nobody here to take it (what this process publishes for other processes'
        retries to borrow): behind the tickets queued here and the places held here for retries due by then.
        The tenant headroom is not lent: it is kept free for a tenant under its share (``slot_free``)."""
        free = max(0, self.slot_free(0) - self._headroom_slots(self.capacity.current()))
        position = self.queued + 1 - free
        if position <= 0 or not self.running:
            return now if position <= 0 else math.inf
        at = now + self._slot_free_in(position, now, free)
        held = round(self._reserved_until(at, after=now - RESERVATION_LATE_S))
        return at if not held else now + self._slot_free_in(position + held, now, free)

    def settle_places(self, places: list[tuple[float, str]], owed: int,
                      held: dict[int, tuple[float, float, int, str]] | None = None,
                      taken: list[tuple[int, float]] = ()) -> None:  # type: ignore[assignment]
        """The last exchange of places (``lending.PlaceLedger``): the other processes' next places, how many
        slots other processes run on loan from this one (it leaves as many idle), the places they hold for
        retries due soon (``held``), and those of this one's held places they took (``taken``: key, time):
        their retries came to them, so they are let go here (learnt as taken back)."""
        self.fleet_places = sorted(places)
        self.owed = max(0, owed)
        mine = {k for k, *_ in self.took}  # (taken here since the holder published: not offered twice)
        self.fleet_held = {k: v for k, v in (held or {}).items() if k not in mine}
        for key, at in taken:
            h = self._held.get(key)
            if h is not None and abs(h[0] - at) <= TAKEN_MATCH_S:
                self._let_go(key)
                self._learn_return(h[1], h[3], True)
                self.claimed_elsewhere += 1

    def held_places(self, now: float) -> list[tuple[int, float, float, int]]:
        """The places held here for retries due by ``HELD_AHEAD_S`` from now and not let go yet: (key, time,
        promised at, shed count), what this process publishes for a retry that reaches another one."""
        r = self.reservations
        out = []
        for i in range(bisect.bisect_left(r, (now - RESERVATION_GRACE_S,)), len(r)):
            at, key = r[i]
            if at > now + HELD_AHEAD_S:
                break
            _, _, since, sheds = self._held[key]
            out.append((key, at, since, sheds))
        return out

    def took_places(self, now: float) -> list[tuple[int, float, str]]:
        """The other processes' places taken here within ``TOOK_KEEP_S``: (key, time, holder)."""
        while self.took and self.took[0][3] < now - TOOK_KEEP_S:
            self.took.popleft()
        return [(k, at, holder) for k, at, holder, _ in self.took]

    def explain(self, t: Ticket, now: float, ahead: int, reserved: int, wait: float | None, budget: float) -> dict:
        """What a decision on ``t`` read: the gateway's DEBUG line for each shed at arrival or at a free slot,
        and each drop from the queue (the loadtest's ``USEFULWORK_GATEWAY_LOG_LEVEL=debug``). The decode
        speed is the largest of its terms (overall, full pool, the replicas' live mean, the load line at the
        load now)."""
        cap = self.capacity
        tpot, out = cap.decode_terms()
        hold = cap.slot_hold()
        r3 = lambda x: None if x is None else round(x, 3)  # noqa: E731
        return {"cls": t.cls, "tenant": t.tenant, "retried": t.retried, "sheds": t.sheds, "limits": cap.limits(), "inflight": self.inflight,
                "inflight_by_class": list(self.inflight_cls), "queued": self.queued, "ahead": ahead,
                "reserved": reserved, "slot_free": self.slot_free(t.cls, t.tenant),
                "prefill_gate": self.prefill_gate(t.cls, t.tenant), "wait_s": r3(wait), "budget_s": r3(budget),
                "ttft_budget_s": r3(self.ttft_budget(t, now)), "est_ttft_s": r3(self.est_ttft(t.cls, t.tenant)),
                "est_e2e_s": r3(cap.est_e2e(t.max_tokens)), "slot_hold_s": r3(hold), "tpot_s": r3(tpot),
                "tpot_terms": [r3(cap.tpot), r3(cap.tpot_full), r3(cap.live_tpot_mean),
                               r3(cap.tpot_at(cap.load_now)), r3(cap.load_now)],
                "output_cap": out, "prefill_s": r3(cap.prefill_time()), "lent": self.owed, "on_loan": len(self.loans),
                "place_of": t.place_of and (t.place_of[0], round(t.place_of[1] - now, 2)),
                "fleet_places_in_s": [round(at - now, 2) for at, _ in self.fleet_places[:4]],
                "first_ends_in_s": [round(e - now, 2) for e in self._expected_ends(hold, tpot, out)[:8]]}

    def _overtaken(self, now: float) -> list[Ticket]:
        """Queued lower-class tickets that new interactive work pushed past their budget: shed now."""
        out = []
        for cls in range(1, len(self.queues)):
            for tenant in list(self.queues[cls]):
                doomed = [t for i, t in enumerate(self.queues[cls][tenant])
                          if (w := self.predict_wait(t, now, own=i)) is not None and w > self.budget(t, now)]
                for t in doomed:
                    self._drop(t, "overtaken", now)
                out.extend(doomed)
        return out

    def _shed(self, t: Ticket, reason: str, wait: float, now: float) -> Decision:
        self._mark_shed(t, reason, now)
        return Decision("shed", t.shed_reason, predicted_wait_s=wait, retry_after_s=t.retry_after_s)

    def _mark_shed(self, t: Ticket, reason: str, now: float) -> None:
        """Shed ``t`` (at arrival, or from the queue): count it, note its demand, tell it when to come back."""
        t.state = "shed"
        t.shed_reason = reason
        self.shed_total[reason] = self.shed_total.get(reason, 0) + 1
        # (a retry shed again is the same demand; so is one whose place another gateway process held, or
        # that came back after its place here was let go: its client's own retry count says so)
        if not t.sheds and not t.retried:
            self._shed_at.append(now)
            self.shed_demand(now)  # (pruned here too: nothing may read it)
        if t.retry_key():  # (how many of its clients number their attempts: its return prior, ``return_rate``)
            was = self.numbered.get(t.tenant)
            now_numbered = float(t.retried is not None)
            self.numbered[t.tenant] = now_numbered if was is None else was + RETURN_EWMA * (now_numbered - was)
        t.retry_after_s = self._retry_after(t, now)
        if t.final and reason != "client_timeout":  # (why it may not retry: its client's deadline)
            _count_down(self.shed_total, reason)
            self.shed_total["client_timeout"] = self.shed_total.get("client_timeout", 0) + 1
            t.shed_reason = "client_timeout"

    def _retry_after(self, t: Ticket, now: float) -> float:
        """When the retry of shed ``t`` fits; its place is held for it then (a reservation).

        Come back when everything ahead, promised retries included, has drained to what a fresh
        request's budget allows; hold that place for this tenant."""
        rate = self.drain_rate(t.cls)
        full_budget = max(0.0, self.ttft_budget(t, t.arrival))
        # How far past what its budget can wait the first place it could take frees (> 0 in a pool
        # full of requests that started together: they end together, so slots free in clumps).
        budget = self.budget(t, t.arrival)
        first = (self._place_wait(1, t, now) or 0.0) - QUEUE_SAFETY * budget
        if rate:
            # + 4 dispatch intervals of margin, at most ``RETRY_MARGIN_MAX_S``: a retry told the exact boundary
            # would miss half the time. (Against the E2E-bound ``budget`` instead of the TTFT one, retries come
            # back later: in the autoscale what-if, whose SLO counts from the first send, attainment fell from
            # 98.5% to 87.9%.)
            margin = min(RETRY_MARGIN_PLACES / rate, RETRY_MARGIN_MAX_S)
            promised = round(self._promised_before(t.since))
            ahead = self.ahead_of(t)
            behind_all = ahead + promised - max(0, self.free(t.cls, t.tenant))
            retry = max(0.0, behind_all / rate + margin - QUEUE_SAFETY * full_budget)
            if first > 0:
                # The fluid drain starts only when that first place frees: from a burst's first seconds
                # it said "now" where the first slot was 3.8 s away, and each shed client spent its three
                # retries in 0.15 s against the same full pool.
                retry = max(retry, first + promised / rate + margin)
            if self.running:
                # Nor before the slot model frees the place behind every promised one (less the same share
                # of the TTFT budget a returning retry may queue for): continuous batching releases in
                # clumps, and a pool refilled in one (a burst, or the retries of one) frees nothing for a
                # whole service time, where the fluid drain frees a slot every 1/rate. (Virtual clock,
                # burst-retry cell, 24 seeds: 69.2% -> 75.3% of first retries admitted; the what-if day's
                # attainment unchanged. Tried in session 24, when ghost places still stacked every
                # Retry-After, it cost the day: docs/benchmarks.md section 7, session 31.)
                # And no later than the margin past that place: where slots free in a clump, the fluid
                # spaced the promised places a dispatch interval apart past its end, and the slots it freed
                # went to new requests, which count only the places due within their own budget (recorded
                # real runs' replicas, a 2-core CPU vLLM with 7-8 slots held ~17 s, a slot every 2.4 s:
                # retries told 5-14 s past a clump of slots that freed within 3 s; the retrying clients
                # served 1,276 -> 1,425 over nine hosts x six seeds; docs/benchmarks.md section 7, session 56).
                behind = self._place_wait(ahead + promised + 1, t, now)
                if behind is not None:
                    retry = max(retry, behind - QUEUE_SAFETY * full_budget)
                    # (the later of the two budgets' places, as ``first`` may be)
                    retry = min(retry, behind - QUEUE_SAFETY * min(full_budget, budget) + RETRY_MARGIN_MAX_S)
        else:
            retry = 1.0
        retry = max(retry, first, 0.05)
        # A client whose deadline spans its retries, and whose retry could not be answered by then even
        # quickly, is told not to retry: no place is held for it, where another shed client could use it.
        t.final = t.give_up_at is not None and now + retry + self._quick_answer(t, full=True)[1] > t.give_up_at
        # (A client numbering its attempts, told more than its SDK honours, gives up: no place is held for
        # it, where it would sit free in a full pool until its time and count ahead of every later shed.)
        if (t.cls < 2 and not t.final and t.retry_key()
                and not (t.retried is not None and retry > SDK_RETRY_AFTER_MAX_S)):
            self._reserve(now + retry, t.key, t.tenant, now, t.sheds + 1)
        return retry

    # -- retry reservations --
    def return_rate(self, tenant: str, sheds: int | None = None) -> float:
        """Share of ``tenant``'s held places its clients took back lately: taken back over ended, with the
        prior counted as ``return_prior_weight`` ended places (``return_prior`` before any ended). With
        ``sheds``, of the places held after a request's ``sheds``-th shed in a row, with the tenant's rate
        as the prior: an SDK retries a set number of times, so the place after its last retry is a ghost."""
        back, ended = self.returns.get(tenant, (0.0, 0.0))
        w = self.return_prior_weight
        prior = self.return_prior + self.numbered.get(tenant, 0.0) * (self.return_prior_numbered - self.return_prior)
        rate = (back + prior * w) / (ended + w)
        if sheds is None:
            return rate
        back, ended = self.returns_by_count.get((tenant, min(sheds, MAX_SHED_COUNT)), (0.0, 0.0))
        return (back + rate * w) / (ended + w)

    def take_returns(self) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], int]]:
        """(retries that found no place for their tenant here, places let go here with nobody back for
        them) since the last call, per (tenant, shed count): what a replica sends to the fleet's ledger of
        returns (``shared_returns``). Behind several gateway replicas a client's retry reaches another
        replica than the one that held its place n - 1 times in n; a replica that sheds more than the
        others holds more places than retries reach it, and learnt its returning clients as not coming
        back (the retrying tenant's return rate 0.57-0.98 per replica behind three, 0.94-0.97 with each
        client's attempts kept on one), so its Retry-After counted too few places ahead. Settled through
        Redis, first retries admitted behind three real gateways 71.8% -> 79.4% (seeds 1-3; sticky 81.5%:
        docs/benchmarks.md section 7, session 37)."""
        out = self._placeless, self._unclaimed
        self._placeless, self._unclaimed = Counter(), Counter()
        return out

    def settle_returns(self, unclaimed: dict[tuple[str, int], int], came_back: dict[tuple[str, int], int]) -> None:
        """Learn the places of ``unclaimed`` (from ``take_returns``): ``came_back[k]`` of them as taken back
        (their clients' retries reached other replicas, which found no place for them), the rest not."""
        for (tenant, sheds), n in unclaimed.items():
            back = min(n, came_back.get((tenant, sheds), 0))
            for i in range(n):
                self._learn_return(tenant, sheds, i < back)

    def _placeless_grant(self, tenant: str, now: float, n: float) -> float:
        """Add ``n`` to ``tenant``'s allowance of place-less retries priced as due now (fading with time
        constant ``PLACELESS_TAU_S``); returns it."""
        left, at = self._placeless_allowed.get(tenant, (0.0, now))
        left = left * math.exp(-max(0.0, now - at) / PLACELESS_TAU_S) + n
        self._placeless_allowed[tenant] = (left, max(at, now))
        return left

    def _placeless_allow(self, tenant: str, now: float) -> bool:
        """Whether a retry of ``tenant`` with no place here is priced as holding a place due now: while the
        tenant's place-less retries here are at most ``PLACELESS_PER_SHED`` per place this replica held for
        it lately. The retry count is the client's to send: a client that numbered every request as a
        retry was priced ahead of every place held here for other tenants' retries within its budget, and
        took the slots promised to them. Behind N replicas that each shed a tenant's requests in
        proportion, each receives about as many of its retries as it held places for it; the one that
        sheds least runs short by a few in ten (session 36: 79 places held against ~98 retries
        received), well within the allowance."""
        if self._placeless_grant(tenant, now, 0.0) <= 0.0:
            return False
        self._placeless_grant(tenant, now, -1.0)
        return True

    def _learn_return(self, tenant: str, sheds: int, returned: bool) -> None:
        keep = 1.0 - RETURN_EWMA  # older outcomes fade: a tenant's clients may change
        for table, k in ((self.returns, tenant), (self.returns_by_count, (tenant, min(sheds, MAX_SHED_COUNT)))):
            back, ended = table.get(k, (0.0, 0.0))
            table[k] = (back * keep + returned, ended * keep + 1.0)

    def _unhold(self, key: int) -> tuple[float, str, float, int] | None:
        held = self._held.pop(key, None)
        if held is not None:
            k = (held[1], held[3])
            for table, x in ((self._held_by, held[0]), (self._promised_at, held[2])):
                times = table[k]
                if len(times) > 1:
                    del times[bisect.bisect_left(times, x)]
                else:
                    del table[k]
        return held

    def _let_go(self, key: int) -> tuple[float, str, float, int] | None:
        """Unhold ``key``'s place and take it off the reservations (``_prune`` lets expired ones go in bulk)."""
        held = self._unhold(key)
        if held is not None:
            self.reservations.remove((held[0], key))
        return held

    def _prune(self, now: float) -> None:
        r = self.reservations
        i = 0
        while i < len(r) and r[i][0] + RESERVATION_GRACE_S < now:
            held = self._unhold(r[i][1])
            if held is not None and self.shared_returns:  # its client may have come back elsewhere: settled later
                self._unclaimed[(held[1], min(held[3], MAX_SHED_COUNT))] += 1
            elif held is not None:
                self._learn_return(held[1], held[3], False)  # expired: nobody came back for it
            i += 1
        if i:
            del r[:i]
            self.taken_early = min(self.taken_early, len(self._held))  # (owed to places no longer held: void)

    def _reserve(self, at: float, key: int, tenant: str, since: float, sheds: int = 1) -> None:
        """Hold a place at ``at`` for the retry of ``key``, promised at ``since`` after its ``sheds``-th shed."""
        self._placeless_grant(tenant, since, PLACELESS_PER_SHED)
        self._let_go(key)
        self._held[key] = (at, tenant, since, sheds)
        bisect.insort(self._held_by.setdefault((tenant, sheds), []), at)
        bisect.insort(self._promised_at.setdefault((tenant, sheds), []), since)
        bisect.insort(self.reservations, (at, key))

    def _take_reservation(self, key: int, now: float, tenant: str | None = None) -> tuple[float, float, int] | None:
        """The retry of a shed request takes back its place; returns (the place's time, when it was promised,
        how many times in a row the request was shed).

        ``tenant``: the client says this is a retry (``Ticket.retried``). With no place held here for it, it
        takes the place held longest for its tenant. Behind a load balancer a client's retry reaches
        another gateway process than the one that shed it (n - 1 times in n, balanced per request), and
        each process holds places for the clients it shed; they come back elsewhere, and the others'
        come here. Found on the virtual clock's burst-retry cell behind three gateways, each attempt to
        the next: 41.9% of first retries admitted (84.2% behind one, 83.2% behind three with each
        client's attempts kept on one gateway; docs/benchmarks.md section 7, session 36)."""
        self._prune(now)
        held = self._let_go(key) if key else None
        if held is None and tenant is not None:
            key = self._oldest_place(tenant)
            held = self._let_go(key) if key else None
        if held is None:
            return None
        at, tenant, since, sheds = held
        self.retries_honoured += 1
        self._learn_return(tenant, sheds, True)
        return at, since, sheds

    def _take_fleet_place(self, t: Ticket, key: int, now: float) -> tuple[float, float, int] | None:
        """A numbered retry with no place here whose place another gateway process holds (published at the last
        exchange: ``fleet_held``) claims it: it is priced here as that place (its time, its turn), the holder
        lets it go at the next exchange (``took``), and, where this process has no slot within its budget, the
        holder lends it (``_borrow``). Its client was promised that place by the process that shed it; behind
        a load balancer that sends each attempt to the next process it comes back elsewhere n - 1 times in n,
        and took another client's place there (``_take_reservation``), due at another time."""
        place = self.fleet_held.pop(key, None)
        if place is None:
            return None
        at, since, sheds, holder = place
        self.took.append((key, at, holder, now))
        t.place_of = (holder, at)
        self.claimed_total += 1
        return at, since, sheds

    def _oldest_place(self, tenant: str) -> int:
        """The key of the place held for ``tenant`` that falls due first (0: none). Looked up through the
        per-tenant due times and a bisection, not a scan: in a long burst thousands of places are held,
        and behind several gateways most retries come here."""
        at = min((times[0] for (holder, _), times in self._held_by.items() if holder == tenant), default=None)
        if at is None:
            return 0
        r = self.reservations
        i = bisect.bisect_left(r, (at,))
        while self._held[r[i][1]][1] != tenant:  # (another tenant's place due at the same time)
            i += 1
        return r[i][1]

    def _promised_before(self, since: float | None) -> float:
        """Places held for retries, each weighted by the return rate of its tenant at its shed count: all of
        them, or (``since``: a returning retry, shed again) only those promised before its own place was.

        A request shed again keeps its turn: told to wait behind every place promised since its own (the
        places of requests that were shed after it), it went to the back of a line it had already waited
        in, and in an overload that outlasts a burst the line grew with each round. On the autoscale
        what-if's day (seed 1, the pool at its limit for minutes while new replicas started) Retry-After
        grew from 1.6 to 11 s and ~1,600 requests were served more than 5 s after their first send:
        attainment 93.55%, 98.29% with their turn kept (seeds 0-7: 97.96% -> 98.58%; the burst-retry
        cell's first retries admitted 86.8% -> 85.9%, as a retry shed again now comes back before some
        first retries: docs/benchmarks.md section 7, session 33)."""
        return sum(self.return_rate(u, sheds) * (len(at) if since is None else bisect.bisect_left(at, since))
                   for (u, sheds), at in self._promised_at.items())

    def _reserved_until(self, until: float, tenant: str | None = None, after: float = -math.inf) -> float:
        """Places held for retries due in [``after``, ``until``) (only ``tenant``'s, if given), each weighted
        by the return rate of its tenant at its shed count. (Counted per tenant and shed count, two bisections
        each: a new request asks this on arrival, and in a long burst thousands of places are held.)"""
        n = 0.0
        for (holder, sheds), times in self._held_by.items():
            if tenant is None or holder == tenant:
                k = bisect.bisect_left(times, until) - (bisect.bisect_left(times, after) if after > -math.inf else 0)
                if k > 0:
                    n += self.return_rate(holder, sheds) * k
        return n

    # -- queue mechanics --
    def _enqueue(self, t: Ticket) -> None:
        cls_q = self.queues[t.cls]
        q = cls_q.get(t.tenant)
        if q is None:
            q = cls_q[t.tenant] = deque()
        if not q and not self._backlogged(t.tenant):
            # VTC lift: a tenant back from idle starts level with the least-served backlogged one.
            floor = min((self.counters.get(u, 0.0) for c in self.queues for u, uq in c.items() if uq), default=None)
            if floor is not None:
                self.counters[t.tenant] = max(self.counters.get(t.tenant, 0.0), floor)
        if t.since is None:
            q.append(t)
        else:
            # A returning retry's place was promised when it was shed: it queues behind the tickets that
            # asked before that (its Retry-After counted them) and ahead of the tenant's newer work (which
            # counted its place as work ahead). Queued at the back, it found the newer work ahead of it
            # and was shed again.
            q.insert(_asked_before(q, t.since), t)
        t.state = "queued"
        self.queued += 1

    def _backlogged(self, tenant: str) -> bool:
        return any(c.get(tenant) for c in self.queues)

    def _admit(self, t: Ticket, now: float) -> None:
        if self.tenant_headroom:
            t.over_share = self._over_share_about(t.tenant)
        t.state = "admitted"
        t.admitted_at = now
        self.capacity.note_admit(now)
        t.inflight_at_admit = self.inflight
        self.inflight += 1
        self.inflight_cls[t.cls] += 1
        self.inflight_tenant[t.tenant] = self.inflight_tenant.get(t.tenant, 0) + 1
        if t.cls == 0:
            self.inflight_top[t.tenant] = self.inflight_top.get(t.tenant, 0) + 1
        self.running.add(t)
        self._run_ver += 1
        self.admitted_total += 1
        self._start_prefill(t, now)
        w = self.weight_of(t.tenant)
        t.charged = t.tokens / w
        self.counters[t.tenant] = self.counters.get(t.tenant, 0.0) + t.charged

    def _pop_next(self) -> Ticket | None:
        for cls, cls_q in enumerate(self.queues):
            # (with tenant headroom, a tenant under its share may go beyond the limit: look per tenant)
            if not cls_q or (not self.tenant_headroom and self.free(cls) <= 0):
                continue
            # The least-served tenant goes next; on a tie (a tenant just lifted level with the backlog),
            # the shorter backlog: a quiet tenant does not wait behind a heavy one's queue. A tenant over
            # its fair share waits while only the headroom kept for the others is free. (Taken in that
            # order, the first that may go: the tenant a scan of all of them picks, ties included.)
            counters = self.counters
            order = sorted((u for u, q in cls_q.items() if q), key=lambda u: (counters.get(u, 0.0), len(cls_q[u])))
            may_go = self._may_go(cls) if self.tenant_headroom else None
            best = next((u for u in order if may_go is None or may_go(u)), None)
            if best is not None:
                q = cls_q[best]
                t = q.popleft()
                if not q:
                    del cls_q[best]
                self.queued -= 1
                return t
        return None

    def _may_go(self, cls: int) -> Callable[[str], bool]:
        """Whether a tenant's queued ticket of class ``cls`` may take a place now (``free(cls, tenant) > 0``),
        for a look at every tenant with work queued. What a tenant within or over its share may take
        depends on the tenant only through its share state and whether another tenant has work in the
        pool or sent some lately (``_others_in_pool``), so it is priced once per pair; a tenant under its
        share is priced on its own (its turn of the top band's prefills, ``_turn_taken``; the heavy
        tenants' work beyond its max-min share), and so is one over its share with nobody else about (its
        turn, ``turn_free``). Priced per tenant, a release whose pump found no tenant
        that could go cost 600-650 us at 200 tenants with work queued; priced so, 280-300 us
        (``benchmarks/admission_tenants.py``). A tenant under its share shares the look's pricing of the heavy
        tenants' work it does not wait for with the tenants of its demand and weight (``_left_to_drain``), and
        ``free`` stops at the first gate that leaves no place: under priority scheduling with the heavy tenant
        decoding, a release at 200 tenants cost ~24 ms with each priced on its own, 1.9 ms so (``--priority``;
        docs/benchmarks.md section 7, session 69)."""
        slo = self.capacity.current()
        about = {u for u in self.last_seen.keys() | self.inflight_tenant.keys() if self._about(u)}  # (each tenant once)
        memo: dict[tuple[int, bool], bool] = {}
        look: dict = {}  # (the heavy tenants' work a tenant under its share does not wait for: ``_left_to_drain``)

        def may_go(tenant: str) -> bool:
            state = self.share_state(tenant, slo)
            if state == -1:
                return self.free(cls, tenant, look) > 0
            others = len(about) - (tenant in about) > 0
            if state == 1 and not others:  # (its turn, ``turn_free``, is its own)
                return self.free(cls, tenant) > 0
            key = (state, others)
            if key not in memo:
                memo[key] = self.free(cls, tenant) > 0
            return memo[key]
        return may_go

    def pump(self, now: float) -> list[Ticket]:
        """Dispatch queued tickets into free slots; returns those admitted now."""
        self._now = now
        self._prefills_due(now)
        out = []
        while (t := self._pop_next()) is not None:
            self._admit(t, now)
            out.append(t)
        return out

    def latest_start(self, t: Ticket) -> float:
        """The last dispatch time at which ``t`` still expects to meet its deadline and, for a class
        whose deadline is within the E2E SLO, the E2E SLO with the full pool's service time (a start
        that makes the TTFT deadline can still finish late: those were most of a burst's late answers)."""
        latest = self._slo_latest(t)
        if t.gone_at is not None:
            latest = min(latest, t.gone_at - self._first_bytes(t))
        if t.done_by is not None:
            latest = min(latest, t.done_by - self.capacity.est_e2e(t.max_tokens))
        return latest

    def _quick_answer(self, t: Ticket, full: bool = False) -> tuple[float, float]:
        """How soon ``t`` could be answered at best, (its first bytes, its whole answer), in seconds from its
        start: its prompt's prefill alone, and its decode at the speed of the load now (not the slowest
        measured), or with ``full`` at least a full pool's (where a place frees)."""
        prefill = self.capacity.prefill_time() or 0.0
        whole = prefill + (self.capacity.quick_decode(t.max_tokens, full) or 0.0)
        return (prefill if t.stream else whole), whole

    def _gone_before_answer(self, t: Ticket, now: float) -> bool:
        """Whether ``t``'s client gives up (the timeouts it declares) before even a quick answer could come."""
        first, whole = self._quick_answer(t)
        return ((t.gone_at is not None and now + first > t.gone_at)
                or (t.done_by is not None and now + whole > t.done_by))

    def _slo_latest(self, t: Ticket) -> float:
        latest = t.deadline - self.est_ttft(t.cls, t.tenant)
        if self.e2e_slo_s is not None and t.deadline - t.arrival <= self.e2e_slo_s:
            latest = min(latest, t.arrival + self.e2e_slo_s - self.capacity.est_e2e(t.max_tokens))
        return latest

    def expire(self, now: float) -> list[Ticket]:
        """Queued tickets at their latest start: admitted when the limit allows it with ``OVERSHOOT``
        (the queue promised them a start: a limit cut since must not turn that into a late 429), shed
        otherwise. Returns them (look at ``state``)."""
        self._now = now
        out = [t for cls_q in self.queues for q in cls_q.values() for t in q if self.latest_start(t) <= now]
        for t in out:
            if self._overshoot_ok(t):
                self._remove(t)
                self._admit(t, now)
            else:
                self._drop(t, "client_timeout" if _declares_timeout(t) and self._slo_latest(t) > now else "deadline", now)
        return out

    def _overshoot_ok(self, t: Ticket) -> bool:
        cap = self.capacity
        gate = self.prefill_gate(t.cls, t.tenant)
        if gate is not None and gate[0] >= int(gate[1] * OVERSHOOT):
            return False
        low = self.low_band_free(t.cls, t.tenant)
        if low is not None and low <= 0:  # (admitted past it, an over-share tenant's prompts filled the steps again)
            return False
        fill = int(cap.fill() * OVERSHOOT)
        if t.cls == 0:
            return self.inflight_cls[0] < int(cap.current() * OVERSHOOT) and self.inflight < fill
        return self.inflight < fill

    def _remove(self, t: Ticket) -> bool:
        q = self.queues[t.cls].get(t.tenant)
        if q is None:
            return False
        try:
            q.remove(t)
        except ValueError:
            return False
        self.queued -= 1
        if not q:
            del self.queues[t.cls][t.tenant]
        return True

    def _drop(self, t: Ticket, reason: str, now: float) -> None:
        """Shed a queued ticket (at its latest start, or overtaken), with a Retry-After and a held place
        as a shed at arrival gets. (With the queue's length over the drain rate and no place held, the
        burst-retry cell's 12 clients dropped at their latest start were told 0.59 s, came back into the
        same full pool, and every one was shed again on its first retry.)"""
        if log.isEnabledFor(logging.DEBUG):  # (what it read now, and the wait it was promised when it queued)
            info = self.explain(t, now, self.ahead_of(t), 0, self.predict_wait(t, now), self.budget(t, now))
            info.update(reason=reason, queued_s=round(now - t.arrival, 3),
                        queued_wait_s=None if t.queued_wait_s is None else round(t.queued_wait_s, 3))
            log.debug("admission: dropped from the queue: %s", info)
        self._remove(t)
        self._mark_shed(t, reason, now)

    def retries_by_place(self) -> dict[str, int]:
        """The retries of shed requests by how they were priced: taking a place held here (``held``), with
        none left here, as holding one due now (``due_now``), or as a first attempt (``unproven``)."""
        return {"held": self.retries_honoured, "due_now": self.retries_placeless - self.retries_unproven,
                "unproven": self.retries_unproven}

    def shed_demand(self, now: float, prune: bool = True) -> int:
        """The demand admission turned away, as requests in flight: the requests shed for the first time
        within the last service time (Little's law: each would have held a slot that long). An autoscaler
        that counts only what is queued and running sees less demand the more admission sheds: in the
        autoscale what-if's day (seed 2, with the decode speed by load) the pool shed where it had queued,
        the HPA on queue + running added its fourth replica two minutes later, and for 100 s every new
        request was shed behind a pile of promised retries (attainment 74.9%; 98.9% with this counted:
        docs/benchmarks.md section 7, session 34). Exported as ``usefulwork.admission.shed.demand``."""
        since = now - (self.capacity.service or self.e2e_slo_s or 1.0)
        d = self._shed_at
        if not prune:  # (another thread's read, an exporter's: a copy, as the event loop may be appending)
            times = list(d)
            return len(times) - bisect.bisect_left(times, since)
        while d and d[0] < since:
            d.popleft()
        return len(d)

    def cancel(self, t: Ticket) -> None:
        """The client left while ``t`` was queued."""
        if t.state != "queued":
            return
        self._remove(t)
        t.state = "cancelled"

    @_one_look
    def release(self, t: Ticket, now: float, sample: Sample | None = None, actual_tokens: int | None = None) -> list[Ticket]:
        """An admitted request ended (however): free its slot, correct its charge, learn, dispatch."""
        if t.state != "admitted":
            return []
        t.state = "released"
        self._now = now
        self.inflight -= 1
        self.inflight_cls[t.cls] -= 1
        _count_down(self.inflight_tenant, t.tenant)
        if t.cls == 0:
            _count_down(self.inflight_top, t.tenant)
        self.running.discard(t)
        self._run_ver += 1
        if self.loans:  # the slot it held goes back to the process that lent one (its idle slot is free again)
            self.loans.popleft()
        if t.prefilling:
            self._end_prefill(t)
        if actual_tokens is not None:
            w = self.weight_of(t.tenant)
            delta = actual_tokens / w - t.charged
            self.counters[t.tenant] = self.counters.get(t.tenant, 0.0) + delta
            t.charged += delta
        if sample is not None:
            sample.inflight_at_end = self.inflight
            self.capacity.observe(sample, now)
        self.capacity.judge_live(now, self.inflight + 1)  # (what ran until now)
        return self.pump(now)

    # -- prefill places --
    def _start_prefill(self, t: Ticket, now: float) -> None:
        if t.cls == 0 and not t.over_share and self.tenant_headroom and self._turn_taken(t.tenant, admitted=True):
            t.over_share = True
        t.low_band = t.cls > 0 or t.over_share
        if not t.low_band:
            self.pending_top_at.setdefault(t.tenant, []).append(t.admitted_at)  # (``_end_prefill`` removes it)
            self._top_ver += 1
        # the prompts it waits behind (``prefill_pending``): the prefill limit learns per prompt ahead
        if not self.capacity.priority_scheduling:
            ahead = self.pending
        else:
            ahead = self.pending_inter if t.low_band else self.pending - self.pending_low
        t.prefill_ahead = ahead / self.capacity.count()
        t.prefilling = True
        self.pending += 1
        if t.cls == 0:
            self.pending_inter += 1
        if t.low_band:
            self.pending_low += 1
        if not t.stream:
            # A unary answer's first token is not seen: its place is deemed free once the prefills ahead
            # and its own should have been answered (or when it ends, if sooner).
            each = self.capacity.prefill_time()
            if each is not None:
                heapq.heappush(self._prefill_due, (now + (t.prefill_ahead + 1.0) * each, next(self._seq), t))

    def _end_prefill(self, t: Ticket) -> None:
        t.prefilling = False
        self.pending -= 1
        if t.cls == 0:
            self.pending_inter -= 1
        if t.low_band:
            self.pending_low -= 1
        else:
            at = self.pending_top_at[t.tenant]
            at.remove(t.admitted_at)
            self._top_ver += 1
            if not at:
                del self.pending_top_at[t.tenant]
        if self._on_top_clear and not self.top_band_pending():
            waiting, self._on_top_clear = self._on_top_clear, []
            for callback in waiting:
                callback()

    def _prefills_due(self, now: float) -> None:
        due = self._prefill_due
        while due and due[0][0] <= now:
            t = heapq.heappop(due)[2]
            if t.prefilling:
                self._end_prefill(t)

    def next_prefill_due(self) -> float | None:
        """When a unary prefill place is next deemed free (the filter pumps the queue then)."""
        return self._prefill_due[0][0] if self._prefill_due else None

    def first_token(self, t: Ticket, now: float) -> list[Ticket]:
        """``t``'s first token was sent: its prefill place frees, the prefill limit learns, and queued
        tickets may be dispatched into the place (returned, as ``pump`` returns them)."""
        if not t.prefilling or t.state != "admitted":
            return []
        t.first_token_at = now
        self._step_end_seen = max(self._step_end_seen, now)
        self._run_ver += 1
        self._end_prefill(t)
        if self.prefill_pending(t.cls, t.tenant) is not None:  # (a class the gate counts)
            self.capacity.observe_first_token(now - t.admitted_at, t.prefill_ahead, t.inflight_at_admit, t.max_tokens)
        return self.pump(now) if self.queued else []

    def next_deadline(self) -> float | None:
        """When ``expire`` next has work: the earliest latest start of a queued ticket."""
        return min((self.latest_start(t) for c in self.queues for q in c.values() for t in q), default=None)

    def depth(self) -> dict[str, int]:
        return {p: sum(len(q) for q in self.queues[i].values()) for i, p in enumerate(PRIORITIES)}

    def stats(self, now: float) -> dict[str, Any]:
        return {"inflight": self.inflight, "inflight_by_class": dict(zip(PRIORITIES, self.inflight_cls)), "queued": self.depth(), "admitted": self.admitted_total,
                "prefill_pending": self.pending, "prefill_pending_low_band": self.pending_low,
                "piece_gap_s": self.piece_gap(),
                "retry_reservations": len(self.reservations), "retries_honoured": self.retries_honoured,
                "retries_placeless": self.retries_placeless,
                "places_borrowed": self.borrowed_total, "places_on_loan": len(self.loans), "places_lent": self.owed,
                "places_claimed": self.claimed_total, "places_claimed_elsewhere": self.claimed_elsewhere,
                "places_taken_early": self.taken_early, "retries_over_limit": self.retries_over_limit,
                "retries_unproven": self.retries_unproven, "retries_by_place": self.retries_by_place(),
                "retry_return_rate": {k: round(self.return_rate(k), 3) for k in self.returns},
                "retry_return_rate_by_shed": {
                    k: {str(n): round(self.return_rate(k, n), 3) for (u, n) in sorted(self.returns_by_count) if u == k}
                    for k in self.returns},
                "retry_clients_numbered": {k: round(v, 3) for k, v in self.numbered.items()},  # (its return prior)
                "shed": dict(self.shed_total), "shed_demand": self.shed_demand(now, prune=False),
                "capacity": self.capacity.stats(),
                "fair_share_tokens": {k: round(v, 1) for k, v in self.counters.items()}}


def _nothing() -> None:
    pass


def _count_down(counts: dict[str, int], key: str) -> None:
    n = counts.get(key, 0) - 1
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


def _declares_timeout(t: Ticket) -> bool:
    return t.gone_at is not None or t.done_by is not None


def _asked(t: Ticket) -> float:
    """When ``t`` asked for its place: its arrival, or for a returning retry when its place was promised."""
    return t.arrival if t.since is None else t.since


def _asked_before(q: deque[Ticket], when: float) -> int:
    """How many of ``q`` (in the order they asked) asked for their place at or before ``when``."""
    n = 0
    for t in q:
        if _asked(t) > when:
            break
        n += 1
    return n


def retry_after_header(seconds: float) -> list[tuple[bytes, bytes]]:
    """``retry-after`` (whole seconds, as HTTP defines it) and ``retry-after-ms`` (the OpenAI SDKs read it first)."""
    return [(b"retry-after", str(max(1, math.ceil(seconds))).encode()),
            (b"retry-after-ms", str(max(1, math.ceil(seconds * 1000))).encode())]
