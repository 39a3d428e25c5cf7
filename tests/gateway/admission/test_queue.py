"""The queue and its decisions on a virtual clock (no event loop, no sleeping: deterministic)."""

from __future__ import annotations

import heapq

import pytest

from usefulwork.gateway.admission.capacity import Capacity, Sample
from usefulwork.gateway.admission.config import AdmissionCfg
from usefulwork.gateway.admission.queue import PoolQueue, Ticket, retry_after_header

SLO = (2.0, 0.1, 5.0)  # ttft, tpot, e2e (s)


def make_queue(limit: int = 4, service_s: float | None = 1.0, **cfg) -> PoolQueue:
    c = AdmissionCfg(initial_concurrency=limit, **cfg)
    cap = Capacity(c, *SLO, replica_count=lambda: 1)
    if service_s is not None:
        cap.service = service_s  # as if measured: drain rate = limit / service
        cap.svc_ttft = 0.1
    return PoolQueue("p", cap, reserve_fraction=c.reserve_fraction, max_queue=c.max_queue, e2e_slo_s=SLO[2])


def ticket(now: float, tenant: str = "a", cls: int = 0, deadline_s: float = 2.0, tokens: float = 640) -> Ticket:
    return Ticket(tenant, cls, tokens, now, now + deadline_s, max_tokens=None)


def test_admit_queue_then_shed_at_arrival_with_retry_after():
    q = make_queue(limit=4, service_s=1.0)  # drains 4 requests/s
    decisions = [q.offer(ticket(0.0), 0.0).kind for _ in range(4)]
    assert decisions == ["admit"] * 4
    # Budget = 2 s deadline - 0.1 s expected TTFT (and e2e 5 s - 1 s service): 1.9 s. The k-th queued
    # request is predicted to start after (k + 1) / 4 s (one dispatch interval of headroom): 6 fit.
    q.return_rate = 1.0  # as if shed clients had been coming back for their places
    tickets = [ticket(0.0) for _ in range(12)]
    for i, t in enumerate(tickets):
        t.key = i + 1
    kinds = [q.offer(t, 0.0) for t in tickets]
    queued = [d for d in kinds if d.kind == "queue"]
    shed = [d for d in kinds if d.kind == "shed"]
    assert len(queued) == 6 and len(shed) == 6
    assert all(d.predicted_wait_s <= 1.9 for d in queued)
    assert all(d.reason == "predicted_wait" and d.predicted_wait_s > 1.9 for d in shed)
    # Retry-After: when the 6 queued + the places already promised + 2 dispatch intervals of margin
    # have drained to a fresh budget: (6 + 0 + 4) / 4 - 1.9 = 0.6 s; each later shed one place later.
    assert [d.retry_after_s for d in shed] == pytest.approx([0.6 + 0.25 * i for i in range(6)])
    assert len(q.reservations) == 6
    assert q.shed_total == {"predicted_wait": 6}


def test_release_dispatches_in_priority_order_and_reserve_keeps_batch_out():
    q = make_queue(limit=10, service_s=1.0, reserve_fraction=0.2)
    batch = [ticket(0.0, cls=1, deadline_s=60) for _ in range(10)]
    kinds = [q.offer(t, 0.0).kind for t in batch]
    assert kinds.count("admit") == 8  # batch may use 80% of the limit
    inter = ticket(0.1)
    assert q.offer(inter, 0.1).kind == "admit"  # an interactive request finds a reserved slot
    admitted_batch = [t for t in batch if t.state == "admitted"]
    waiting_inter = ticket(0.2)
    waiting_inter2 = ticket(0.2)
    q.offer(waiting_inter, 0.2)
    assert q.offer(waiting_inter2, 0.2).kind == "queue"
    woken = q.release(admitted_batch[0], 0.5)
    assert woken == [waiting_inter2]  # interactive before the batch tickets queued earlier


def test_vtc_serves_quiet_tenant_before_the_heavy_backlog():
    q = make_queue(limit=1, service_s=0.01)
    first = ticket(0.0, "heavy")
    assert q.offer(first, 0.0).kind == "admit"
    heavy = [ticket(0.0, "heavy", deadline_s=100) for _ in range(30)]
    for t in heavy:
        assert q.offer(t, 0.0).kind == "queue"
    quiet = ticket(0.001, "quiet", deadline_s=100)
    assert q.offer(quiet, 0.001).kind == "queue"
    # Lifted level with the heavy tenant's counter, the quiet tenant goes second, not 31st.
    (second,) = q.release(first, 0.01, actual_tokens=640)
    assert q.release(second, 0.02, actual_tokens=640) == [quiet]


def test_vtc_shares_tokens_by_weight_and_lifts_returning_tenant():
    q = make_queue(limit=1, service_s=0.01)
    q.weight_of = lambda t: 2.0 if t == "big" else 1.0
    now = 0.0
    running = ticket(now, "x", deadline_s=1e9)
    q.offer(running, now)
    for _ in range(60):
        q.offer(ticket(now, "big", deadline_s=1e9), now)
        q.offer(ticket(now, "small", deadline_s=1e9), now)
    served = {"big": 0, "small": 0}
    for _ in range(60):
        now += 0.01
        (nxt,) = q.release(running, now, actual_tokens=640)
        served[nxt.tenant] += 1
        running = nxt
    assert served["big"] == pytest.approx(2 * served["small"], abs=2)
    # A tenant idle until now starts level with the least-served backlogged tenant, not at 0.
    late = ticket(now, "late", deadline_s=1e9)
    q.offer(late, now)
    assert q.counters["late"] == pytest.approx(min(q.counters["big"], q.counters["small"]))


def test_deadline_expiry_sheds_queued_ticket_at_its_deadline():
    q = make_queue(limit=1, service_s=0.01)  # predicted to start within 20 ms ...
    q.offer(ticket(0.0), 0.0)
    late = ticket(0.0, deadline_s=2.0)
    assert q.offer(late, 0.0).kind == "queue"  # ... but the running request never ends
    assert q.expire(1.99) == []
    assert q.expire(2.0) == [late] and late.shed_reason == "deadline" and q.queued == 0


def test_sheddable_only_takes_a_free_slot_and_queue_full_sheds():
    q = make_queue(limit=1, service_s=1.0, max_queue=1)
    assert q.offer(ticket(0.0, cls=2), 0.0).kind == "admit"
    d = q.offer(ticket(0.0, cls=2), 0.0)
    assert (d.kind, d.reason) == ("shed", "sheddable")
    assert q.offer(ticket(0.0, cls=1, deadline_s=60), 0.0).kind == "queue"
    d = q.offer(ticket(0.0, cls=1, deadline_s=60), 0.0)
    assert (d.kind, d.reason) == ("shed", "queue_full") and d.retry_after_s > 0


def test_cancel_frees_the_place():
    q = make_queue(limit=1)
    a = ticket(0.0)
    q.offer(a, 0.0)
    b = ticket(0.0, deadline_s=10)
    assert q.offer(b, 0.0).kind == "queue"
    q.cancel(b)
    assert q.queued == 0 and b.state == "cancelled" and q.release(a, 0.5) == []


def test_capacity_slow_start_then_backs_off_on_slow_service():
    cfg = AdmissionCfg(initial_concurrency=4, target_fraction=0.8)  # targets: TTFT 1.6 s, E2E 4 s
    cap = Capacity(cfg, *SLO, replica_count=lambda: 1)
    for i in range(4):  # each admitted at the limit: the limit was tested and held
        cap.observe(Sample(ttft=0.2, tpot=0.02, service=2.0, tokens=640, ok=True,
                           inflight_at_admit=cap.current() - 1), float(i))
    assert cap.current() == 8 and cap.slow_start
    cap.observe(Sample(ttft=0.2, tpot=0.02, service=9.0, tokens=640, ok=True, inflight_at_admit=7), 5.0)
    assert cap.current() == 9  # one slow answer moves the mean (2.7 s), not the verdict
    t = 6.0
    while cap.decreases == 0:  # the mean service time climbs over 4 s: back off by 10%
        cap.observe(Sample(ttft=0.2, tpot=0.02, service=9.0, tokens=640, ok=True, inflight_at_admit=0), t)
        t += 0.1
    assert cap.limit == pytest.approx(9 * 0.9) and not cap.slow_start
    cap.observe(Sample(ttft=0.2, tpot=0.02, service=9.0, tokens=640, ok=True, inflight_at_admit=8), t)
    assert cap.decreases == 1  # at most one cut per service time
    cap.observe(Sample(ttft=0.2, tpot=0.02, service=9.0, tokens=640, ok=True, inflight_at_admit=8), t + 10)
    assert cap.decreases == 2
    assert cap.drain_rate() == pytest.approx(cap.current() / cap.service)


def test_capacity_grows_only_when_the_limit_was_reached():
    cap = Capacity(AdmissionCfg(initial_concurrency=8), *SLO, replica_count=lambda: 1)
    cap.slow_start = False
    cap.observe(Sample(0.2, 0.02, 2.0, 640, True, inflight_at_admit=1), 0.0)
    assert cap.limit == 8.0
    cap.observe(Sample(0.2, 0.02, 2.0, 640, True, inflight_at_admit=7), 0.0)
    assert cap.limit == pytest.approx(8.125)


def test_capacity_kv_cap_and_saturation_from_replica_metrics():
    class R:
        healthy = True
        waiting = 0.0
        kv_usage = 0.5
        num_gpu_blocks = 100.0
        block_size = 16.0

    r = R()
    cap = Capacity(AdmissionCfg(initial_concurrency=64), *SLO, replicas=lambda: [r])
    cap.tokens = 640.0
    assert cap.current() == 2  # 1600 token slots / 640 tokens per sequence
    assert not cap.saturated()
    r.running, r.waiting = 40.0, 3.0  # a few waiting for the next engine step: normal under load
    assert not cap.saturated()
    r.waiting = 12.0
    assert cap.saturated()
    cap.limit, cap.slow_start = 2.0, True
    cap.observe(Sample(0.1, 0.01, 1.0, 640, True, inflight_at_admit=1), 0.0)
    assert cap.limit == 2.0  # saturated: held, neither grown nor cut


def test_cold_pool_assumes_a_slot_is_held_for_the_whole_e2e_slo():
    q = make_queue(limit=2, service_s=None)
    assert q.capacity.drain_rate() == pytest.approx(2 / 5.0)
    for _ in range(2):
        q.offer(ticket(0.0), 0.0)
    d = q.offer(ticket(0.0), 0.0)  # (0 + 1 + 1) / 0.4 = 5 s > 2 s: told at once, not at the deadline
    assert (d.kind, d.reason) == ("shed", "predicted_wait")


def test_retry_after_headers():
    assert retry_after_header(0.2) == [(b"retry-after", b"1"), (b"retry-after-ms", b"200")]
    assert retry_after_header(2.5)[0] == (b"retry-after", b"3")


def test_simulated_burst_every_admitted_request_meets_its_deadline():
    """A server of 8 slots, 1 s service, fed a 3x burst on the virtual clock: whoever is admitted
    starts within its budget; whoever cannot is told at arrival (no deadline expiries)."""
    q = make_queue(limit=8, service_s=1.0)

    def service(i: int) -> float:  # 0.7 .. 1.3 s, mean 1 s (identical times would release in clumps)
        return 0.7 + 0.6 * ((i * 7) % 11) / 10

    events: list[tuple[float, int, str, Ticket | None]] = []
    seq = 0
    for i in range(240):  # 24 req/s for 10 s
        heapq.heappush(events, (i / 24.0, seq, "arrive", None))
        seq += 1
    starts: list[tuple[Ticket, float]] = []
    shed_at: list[float] = []
    expired: list[Ticket] = []
    while events:
        now, _, kind, t = heapq.heappop(events)
        if kind == "arrive":
            t = ticket(now)
            t.key = seq + 1  # every shed one holds a place, and none comes back for it
            d = q.offer(t, now)
            if d.kind == "admit":
                starts.append((t, now))
                heapq.heappush(events, (now + service(seq), seq, "done", t))
            elif d.kind == "shed":
                shed_at.append(now - t.arrival)
        else:
            for nt in q.release(t, now):
                starts.append((nt, now))
                heapq.heappush(events, (now + service(seq), seq, "done", nt))
        seq += 1
        expired.extend(q.expire(now))
    # Sheds are decided at arrival; the prediction's error leaves at most a few to the deadline.
    assert len(shed_at) > 100 and all(x == 0.0 for x in shed_at)
    assert len(expired) <= 0.02 * 240
    waits = sorted(start - t.arrival for t, start in starts)
    assert waits[-1] <= 2.0  # dispatched before its deadline (the queue never let one pass)
    assert waits[int(len(waits) * 0.95)] <= 1.9  # and almost all within the budget the prediction allowed
    assert len(starts) + len(shed_at) + len(expired) == 240
    assert len(starts) >= 8 * 10  # the server was kept full: at least its capacity was served
    assert q.return_rate < 0.05  # places nobody took back stopped counting


def test_retry_after_is_a_reserved_place_a_returning_client_finds():
    """Clients that wait out Retry-After and send the same request again, during a 3x burst and
    after it: most first retries are admitted (their place was held), on the virtual clock."""
    q = make_queue(limit=8, service_s=1.0)

    def service(i: int) -> float:
        return 0.7 + 0.6 * ((i * 7) % 11) / 10

    events: list = []
    seq = 0
    for i in range(240):  # 24 req/s for 10 s, then 4 req/s for 25 s
        heapq.heappush(events, (i / 24.0, seq, "arrive", None, 0))
        seq += 1
    for i in range(100):
        heapq.heappush(events, (10 + i / 4.0, seq, "arrive", None, 0))
        seq += 1
    first_retries, admitted_first = 0, 0
    while events:
        now, _, kind, t, tries = heapq.heappop(events)
        if kind == "arrive":
            key = t if t is not None else seq + 1
            nt = ticket(now)
            nt.key = key
            d = q.offer(nt, now)
            if tries == 1:
                first_retries += 1
                admitted_first += d.kind != "shed"
            if d.kind == "admit":
                heapq.heappush(events, (now + service(seq), seq, "done", nt, 0))
            elif d.kind == "shed" and tries < 3:
                heapq.heappush(events, (now + d.retry_after_s, seq, "arrive", key, tries + 1))
        else:
            for nt in q.release(t, now):
                heapq.heappush(events, (now + service(seq), seq, "done", nt, 0))
        seq += 1
        q.expire(now)
    assert first_retries > 100
    assert admitted_first / first_retries >= 0.9
    assert q.retries_honoured >= first_retries and not q.reservations  # every place taken back or expired
