"""The admission filter in-process with a fake ``next``: decisions, slot release on every path,
limits and budget, ledger fields, OTel metrics."""

from __future__ import annotations

import asyncio
import math

import orjson
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from tests.conftest import drop_redis_keys
from usefulwork.config import from_mapping
from usefulwork.gateway.admission.filter import AdmissionFilter, client_timeouts
from usefulwork.gateway.admission.queue import SDK_RETRY_AFTER_MAX_S
from usefulwork.gateway.context import NullAccountant, RequestContext
from usefulwork.gateway.pipeline import Call, Reply, Services
from usefulwork.gateway.tenants import hash_key
from usefulwork.upstream.fleet import Fleet
from usefulwork.upstream.pieces import PREFILL_CHUNK

MODEL = "m"


def make_cfg(admission: dict | None = None, tenants: dict | None = None, slo: dict | None = None,
             pools: list | None = None):
    tree = {
        "pools": pools or [{"name": "p", "models": [MODEL], "replicas": ["http://127.0.0.1:9"],
                            "prices": {"input_per_1m": 1000.0, "output_per_1m": 1000.0}}],
        "admission": admission or {},
        "tenants": tenants or {},
    }
    if slo:
        tree["slo"] = slo
    return from_mapping(tree, environ={})


def make_filter(cfg, meter=None, **kw) -> AdmissionFilter:
    fleet = Fleet(cfg)
    return AdmissionFilter(Services(cfg=cfg, fleet=fleet, accountant=NullAccountant(), meter=meter), **kw)


def make_call(f: AdmissionFilter, tenant: str = "default", priority: str | None = None, max_tokens: int = 16,
              model: str = MODEL, op: str = "chat") -> Call:
    body = {"model": model, "messages": [{"role": "user", "content": "hi " * 40}], "max_tokens": max_tokens}
    if op == "responses":  # (the Responses API's own fields)
        body = {"model": model, "input": "hi " * 40, "max_output_tokens": max_tokens}
    ctx = RequestContext(id="r", endpoint=op, model=model, stream=False, tenant=tenant)
    headers = [(b"content-type", b"application/json")]
    if priority is not None:
        headers.append((b"x-usefulwork-priority", priority.encode()))
    return Call(ctx=ctx, op=op, path=b"/v1/responses" if op == "responses" else b"/v1/chat/completions", body=body,
                raw=orjson.dumps(body), pool=f.services.fleet.pool_for_model(model), headers=headers)


def measured_fast(f: AdmissionFilter) -> None:
    """As if the pool had been measured to free a slot every 10 ms (so a second request queues)."""
    cap = f.queues["p"].capacity
    cap.service, cap.svc_ttft = 0.01, 0.001


class Backend:
    """A fake ``next``: answers 200 with usage, optionally held open until released."""

    def __init__(self, hold: bool = False, prompt_tokens: int = 100, completion_tokens: int = 16):
        self.hold = hold
        self.calls: list[Call] = []
        self.gates: list[asyncio.Event] = []
        self.usage = (prompt_tokens, completion_tokens)

    async def __call__(self, call: Call) -> Reply:
        self.calls.append(call)
        ctx = call.ctx
        import time

        ctx.t_forwarded = ctx.t_first_token = time.perf_counter()
        ctx.prompt_tokens, ctx.completion_tokens = self.usage
        ctx.usage_source = "backend"
        ctx.outcome = "ok"
        if self.hold:
            gate = asyncio.Event()
            self.gates.append(gate)
            await gate.wait()
        return Reply(200, body=b"{}")


def test_unknown_priority_is_400_and_nothing_forwarded():
    f = make_filter(make_cfg())
    be = Backend()
    reply = asyncio.run(f(make_call(f, priority="urgent!"), be))
    assert reply.status == 400 and be.calls == []
    err = orjson.loads(reply.body)["error"]
    assert err["code"] == "invalid_priority" and err["param"] == "x-usefulwork-priority"
    assert "interactive" in err["message"]


def test_a_tenant_may_not_ask_above_its_max_priority():
    f = make_filter(make_cfg(tenants={"bulk": {"priority": "batch", "max_priority": "batch"}}))
    be = Backend()

    async def go():
        reply = await f(make_call(f, tenant="bulk", priority="interactive"), be)
        assert reply.status == 403 and be.calls == []
        err = orjson.loads(reply.body)["error"]
        assert (err["code"], err["param"]) == ("priority_not_allowed", "x-usefulwork-priority")
        assert "'bulk' may not ask for priority 'interactive' (its highest: 'batch')" in err["message"]
        got = []
        for p in ("batch", "sheddable", None):  # its own class or lower, or none: its default
            call = make_call(f, tenant="bulk", priority=p)
            reply = await f(call, be)
            assert reply.status == 200
            await reply.aclose()
            got.append(call.ctx.priority)
        assert got == ["batch", "sheddable", "batch"] and len(be.calls) == 3
        reply = await f(make_call(f, priority="interactive"), be)  # a tenant without max_priority: any class
        assert reply.status == 200
        await reply.aclose()

    asyncio.run(go())


def test_admitted_request_releases_its_slot_on_close_and_records_decision():
    f = make_filter(make_cfg())

    async def go():
        call = make_call(f, priority="Batch")
        reply = await f(call, Backend())
        q = f.queues["p"]
        assert q.inflight == 1
        await reply.aclose()
        assert q.inflight == 0
        return call

    call = asyncio.run(go())
    assert (call.ctx.priority, call.ctx.admission, call.ctx.queue_ms) == ("batch", "admit", 0.0)
    assert f.stats()["decisions"]["admit"] == 1


def test_queued_request_waits_for_a_slot_then_runs():
    f = make_filter(make_cfg(admission={"initial_concurrency": 1, "max_concurrency": 1}))

    async def go():
        be = Backend(hold=True)
        first = asyncio.create_task(f(make_call(f), be))
        await asyncio.sleep(0.01)
        measured_fast(f)
        second_call = make_call(f)
        second = asyncio.create_task(f(second_call, Backend()))
        await asyncio.sleep(0.05)
        assert f.queues["p"].queued == 1 and not second.done()
        be.gates[0].set()
        r1 = await first
        await r1.aclose()  # the first reply is closed: its slot goes to the queued one
        r2 = await second
        await r2.aclose()
        return second_call

    call = asyncio.run(go())
    assert call.ctx.admission == "queued" and call.ctx.queue_ms >= 40


@pytest.mark.parametrize("service_s", [10.0, 300.0])
def test_a_shed_told_longer_than_the_sdks_wait_says_not_to_retry(service_s):
    """openai-python 3.x does not retry a 429 whose Retry-After is over two minutes; older versions ignored
    one over a minute and retried at once, into the same full pool. ``x-should-retry: false`` stops both."""
    f = make_filter(make_cfg(admission={"initial_concurrency": 1, "max_concurrency": 1}))

    async def go():
        be = Backend(hold=True)
        first = asyncio.create_task(f(make_call(f), be))
        await asyncio.sleep(0.01)
        cap = f.queues["p"].capacity
        cap.service, cap.svc_ttft = service_s, 0.1  # measured: one slot frees every service_s
        reply = await f(make_call(f), be)
        be.gates[0].set()
        await (await first).aclose()
        return reply

    reply = asyncio.run(go())
    assert reply.status == 429
    long = int(reply.header(b"retry-after-ms")) > SDK_RETRY_AFTER_MAX_S * 1000
    assert long == (service_s > SDK_RETRY_AFTER_MAX_S)
    assert (reply.header(b"x-should-retry") == b"false") == long


def test_shed_at_arrival_is_429_with_retry_after_and_reason():
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    f = make_filter(make_cfg(admission={"initial_concurrency": 1, "max_concurrency": 1}), meter=meter)

    async def go():
        be = Backend(hold=True)
        first = asyncio.create_task(f(make_call(f), be))
        await asyncio.sleep(0.01)
        cap = f.queues["p"].capacity
        cap.service, cap.svc_ttft = 10.0, 0.1  # measured: one slot frees every 10 s
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        call = make_call(f)
        reply = await f(call, be)
        shed_s = loop.time() - t0
        be.gates[0].set()
        await (await first).aclose()
        return call, reply, shed_s

    call, reply, shed_s = asyncio.run(go())
    assert reply.status == 429 and shed_s < 0.05  # answered at arrival, not at the deadline
    assert int(reply.header(b"retry-after")) >= 1 and int(reply.header(b"retry-after-ms")) > 1000
    assert reply.header(b"x-usefulwork-shed-reason") == b"predicted_wait"
    err = orjson.loads(reply.body)["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "predicted_wait"
    assert (call.ctx.admission, call.ctx.shed_reason) == ("shed", "predicted_wait")
    names = {m.name: m for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
             for m in sm.metrics}
    sheds = names["usefulwork.admission.sheds"].data.data_points
    assert [(p.attributes["reason"], p.value) for p in sheds] == [("predicted_wait", 1)]
    depth = {(p.attributes["pool"], p.attributes["priority"]) for p in names["usefulwork.admission.queue.depth"].data.data_points}
    assert ("p", "interactive") in depth
    assert "usefulwork.admission.queue.wait" in names and "usefulwork.admission.limit" in names
    # the shed request is demand an autoscaler should see (shed within the last service time, 10 s here)
    assert [(p.attributes["pool"], p.value) for p in names["usefulwork.admission.shed.demand"].data.data_points] == [("p", 1)]
    assert f.stats()["pools"]["p"]["shed_demand"] == 1  # and /usefulwork/stats shows it


def test_a_request_admitted_with_no_place_held_is_never_hashed_and_a_shed_ones_retry_finds_its_place(monkeypatch):
    """The retry key (a hash of tenant and body: ~30 us for a 100 KB body) is computed only where the queue
    needs it: a shed holds a place under it, and the retry with the same body takes that place back."""
    import usefulwork.gateway.admission.filter as filter_module

    hashed = []
    real = filter_module._retry_key

    def counted(tenant, raw, body):
        key_of = real(tenant, raw, body)
        return lambda: hashed.append(tenant) or key_of()

    monkeypatch.setattr(filter_module, "_retry_key", counted)
    f = make_filter(make_cfg(admission={"initial_concurrency": 1, "max_concurrency": 1}))

    async def go():
        be = Backend(hold=True)
        first = asyncio.create_task(f(make_call(f), be))
        await asyncio.sleep(0.01)
        assert hashed == []  # admitted, nothing held: no hash
        q = f.queues["p"]
        q.capacity.service, q.capacity.svc_ttft = 10.0, 0.1  # one slot frees every 10 s
        shed = await f(make_call(f), be)
        assert shed.status == 429 and hashed == ["default"] and len(q.reservations) == 1
        be.gates[0].set()
        await (await first).aclose()
        be.hold = False
        retry = await f(make_call(f), be)  # the same body: the place held for it
        assert retry.status == 200 and q.retries_honoured == 1 and len(q.reservations) == 0
        await retry.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("op", ["chat", "responses"])
def test_a_body_a_filter_changed_is_estimated_as_the_one_sent(op):
    """A filter before admission (the router: its pool's model) leaves no raw body: the estimate is the
    re-encoded body's, as the raw one's would be, for every endpoint (a Responses body's text is ``input``,
    which the old estimate did not read: 1 token)."""
    from usefulwork.gateway.admission.filter import expected_tokens

    f = make_filter(make_cfg())
    call = make_call(f, op=op)
    sent = expected_tokens(call)
    call.set_body(dict(call.body))  # (as the router does, with its pool's model)
    assert call.raw is None and expected_tokens(call) == sent and sent[0] > 30


def test_retries_are_exported_by_how_they_were_priced():
    """A shed request's retry takes its held place (held); a tenant's retry with no place left here is
    priced as holding one due now (due_now); a request numbered as a retry whose tenant was never shed
    here is priced as a first attempt (unproven). Driven on the pool's queue with a virtual clock."""
    from usefulwork.gateway.admission.queue import Ticket

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    f = make_filter(make_cfg(admission={"initial_concurrency": 1, "max_concurrency": 1}), meter=meter)
    q = f.queue_for(make_call(f))
    q.capacity.service, q.capacity.svc_ttft = 10.0, 0.1  # one slot frees every 10 s
    assert q.offer(Ticket("acme", 0, 100.0, 0.0, 2.0), 0.0).kind == "admit"
    assert q.offer(Ticket("acme", 0, 100.0, 0.1, 2.1, key=5, retried=0), 0.1).kind == "shed"
    assert q.offer(Ticket("acme", 0, 100.0, 0.2, 2.2, key=5, retried=1), 0.2).kind == "shed"  # held
    late = max(at for at, _ in q.reservations) + 3.0  # its places let go (past their grace); two held here lately
    q.offer(Ticket("acme", 0, 100.0, late, late + 2.0, key=6, retried=2), late)  # due_now
    q.offer(Ticket("zed", 0, 100.0, late, late + 2.0, key=7, retried=3), late)  # never shed here: unproven
    names = {m.name: m for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
             for m in sm.metrics}
    got = {p.attributes["place"]: p.value for p in names["usefulwork.admission.retries"].data.data_points}
    assert got == {"held": 1, "due_now": 1, "unproven": 1}
    assert f.stats()["pools"]["p"]["retries_unproven"] == 1


def queued_behind_one_that_never_ends(f: AdmissionFilter, call: Call) -> tuple[Reply, float]:
    """``call`` offered to a pool of one slot held by a request predicted to end at once that never does
    (it queues): its reply, and how long it took."""

    async def go():
        be = Backend(hold=True)
        first = asyncio.create_task(f(make_call(f), be))
        await asyncio.sleep(0.01)
        measured_fast(f)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        reply = await f(call, be)
        waited = loop.time() - t0
        be.gates[0].set()
        await (await first).aclose()
        return reply, waited

    return asyncio.run(go())


def test_deadline_passing_in_queue_is_a_429_at_the_deadline():
    f = make_filter(make_cfg(admission={"initial_concurrency": 1, "max_concurrency": 1}, slo={"ttft_ms": 200}))
    reply, waited = queued_behind_one_that_never_ends(f, make_call(f))  # it queues, then its deadline passes
    assert reply.status == 429 and reply.header(b"x-usefulwork-shed-reason") == b"deadline"
    assert 0.15 <= waited < 0.5


def test_a_queued_request_is_answered_429_before_the_timeout_its_client_declares():
    """The OpenAI SDKs send their read timeout (``x-stainless-read-timeout``, seconds), Envoy its route's
    (``x-envoy-expected-rq-timeout-ms``): a queued request whose client gives up at 2 s is answered 429
    with its Retry-After before then (at 95% of it, less the answer's expected time), not at the SLO's
    5 s deadline after its client left."""
    f = make_filter(make_cfg(admission={"initial_concurrency": 1, "max_concurrency": 1}, slo={"ttft_ms": 5000}))

    def declared(*headers: tuple[bytes, bytes]) -> tuple[float | None, float | None, float | None]:
        call = make_call(f)
        call.headers.extend(headers)
        return client_timeouts(call)

    assert declared() == (None, None, None)
    assert declared((b"x-stainless-read-timeout", b"600.0")) == (600.0, None, None)
    # (the SDK's read timeout bounds the first bytes; Envoy's route timeout the whole answer; the client's
    # deadline for all its attempts the whole answer too, and its retries)
    assert declared((b"x-stainless-read-timeout", b"30"), (b"x-envoy-expected-rq-timeout-ms", b"15000")) == (30.0, 15.0, None)
    assert declared((b"x-envoy-expected-rq-timeout-ms", b"15000"), (b"x-usefulwork-deadline-ms", b"20000")) == (None, 15.0, 20.0)
    assert declared((b"x-envoy-expected-rq-timeout-ms", b"15000"), (b"x-usefulwork-deadline-ms", b"9000")) == (None, 9.0, 9.0)
    for bad in (b"soon", b"-1", b"0", b"inf", b"nan"):  # (a hint: ignored, not a 400)
        assert declared((b"x-stainless-read-timeout", bad), (b"x-envoy-expected-rq-timeout-ms", bad),
                        (b"x-usefulwork-deadline-ms", bad)) == (None, None, None)

    call = make_call(f)
    call.headers.append((b"x-stainless-read-timeout", b"2.0"))
    reply, waited = queued_behind_one_that_never_ends(f, call)
    assert reply.status == 429 and reply.header(b"x-usefulwork-shed-reason") == b"client_timeout"
    assert "timeout its client declared" in orjson.loads(reply.body)["error"]["message"]
    assert int(reply.header(b"retry-after-ms")) > 0
    assert 1.5 <= waited < 2.0


def test_a_client_whose_deadline_for_all_attempts_a_retry_cannot_meet_is_told_not_to_retry():
    """A full pool whose one slot frees in about 10 s. A client declaring 5 s left for its answer, retries
    included (``x-usefulwork-deadline-ms``), is answered 429 ``client_timeout`` with ``x-should-retry:
    false`` (the OpenAI SDKs obey it) and a message that says why; no place is held for its retry. The same
    5 s as Envoy's per-attempt route timeout: a retry would get a fresh one, so it is told when to retry
    (a place held for it), and not told to stop."""
    f = make_filter(make_cfg(admission={"initial_concurrency": 1, "max_concurrency": 1}))

    async def go():
        be = Backend(hold=True)
        first = asyncio.create_task(f(make_call(f), be))
        await asyncio.sleep(0.01)
        q = f.queues["p"]
        q.capacity.service, q.capacity.svc_ttft = 10.0, 0.1
        q.capacity.prefill_each, q.capacity.tpot = 0.2, 0.01
        q.return_prior = 1.0
        replies = []
        for name in (b"x-usefulwork-deadline-ms", b"x-envoy-expected-rq-timeout-ms"):
            call = make_call(f, max_tokens=17 if name == b"x-usefulwork-deadline-ms" else 18)
            call.headers.append((name, b"5000"))
            replies.append(await f(call, be))
            replies.append(len(q._held))
        be.gates[0].set()
        await (await first).aclose()
        return replies

    told, held_after_told, envoy, held_after_envoy = asyncio.run(go())
    assert told.status == 429 and told.header(b"x-usefulwork-shed-reason") == b"client_timeout"
    assert told.header(b"x-should-retry") == b"false" and int(told.header(b"retry-after-ms")) > 5000
    assert "do not retry" in orjson.loads(told.body)["error"]["message"]
    assert held_after_told == 0
    assert envoy.status == 429 and envoy.header(b"x-should-retry") is None
    assert held_after_envoy == 1


@pytest.mark.parametrize("how", ["raises", "cancelled_while_running", "cancelled_while_queued"])
def test_slot_is_released_however_the_request_ends(how):
    f = make_filter(make_cfg(admission={"initial_concurrency": 1, "max_concurrency": 1}))

    async def boom(call):
        raise RuntimeError("upstream exploded")

    async def go():
        q = None
        if how == "raises":
            with pytest.raises(RuntimeError):
                await f(make_call(f), boom)
            q = f.queues["p"]
        else:
            be = Backend(hold=True)
            first = asyncio.create_task(f(make_call(f), be))
            await asyncio.sleep(0.01)
            q = f.queues["p"]
            if how == "cancelled_while_queued":
                measured_fast(f)
                second = asyncio.create_task(f(make_call(f), Backend()))
                await asyncio.sleep(0.01)
                assert q.queued == 1
                second.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await second
                assert q.queued == 0
                be.gates[0].set()
                await (await first).aclose()
            else:
                first.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await first
        assert q.inflight == 0 and q.queued == 0
        reply = await f(make_call(f), Backend())  # the pool is usable again
        assert reply.status == 200
        await reply.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("store", ["process", "redis", "redis-leased"])
def test_rpm_then_budget_enforced_with_429_and_clear_message(store, request):
    """The same verdicts, reasons and Retry-After with per-process limits, one Redis script per check
    and leased grants (admission.lease, the default with redis_url)."""
    tenants = {"acme": {"key_hashes": [hash_key("k1")], "rpm": 3},
               "spendy": {"key_hashes": [hash_key("k2")], "budget_usd_per_day": 0.2}}
    adm = {}
    if store != "process":
        import uuid

        adm = {"redis_url": request.getfixturevalue("redis_url"), "redis_prefix": f"uwtest:{uuid.uuid4().hex}",
               "lease": store == "redis-leased"}
    f = make_filter(make_cfg(admission=adm, tenants=tenants))
    assert type(getattr(f.limits, "shared", f.limits)).__name__ == \
        {"process": "LocalLimits", "redis": "RedisLimits", "redis-leased": "LeasedLimits"}[store]

    async def go():
        out = []
        for _ in range(4):
            r = await f(make_call(f, tenant="acme"), Backend())
            await r.aclose()
            out.append(r)
        spend = []
        for _ in range(3):  # each costs (100 + 16) tokens x $1000 / 1M = $0.116
            r = await f(make_call(f, tenant="spendy"), Backend())
            await r.aclose()
            spend.append(r)
        seen = await f.tenant_limits("spendy"), await f.tenant_limits("acme")  # (what their own stats show)
        if adm:
            await f.stop()  # (grants given back)
            drop_redis_keys(adm["redis_url"], adm["redis_prefix"])
        return out, spend, seen

    out, spend, (spendy, acme) = asyncio.run(go())
    assert spendy["spent_today_usd"] == pytest.approx(2 * 0.116) and spendy["budget_left_usd"] == 0.0
    assert spendy["budget_usd_per_day"] == 0.2 and 0 < spendy["budget_resets_in_s"] <= 86400
    assert acme == {"rpm": 3, "tpm": None, "budget_usd_per_day": None, "requests_remaining": 0}
    assert [r.status for r in out] == [200, 200, 200, 429]
    err = orjson.loads(out[3].body)["error"]
    # OpenAI's own answer to a request-rate limit (code and type), the wait in the message as OpenAI words it
    assert (err["code"], err["type"]) == ("rate_limit_exceeded", "requests")
    assert "requests-per-minute" in err["message"] and "'acme'" in err["message"]
    wait = float(out[3].header(b"retry-after-ms")) / 1000
    assert 15 <= wait <= 21  # one request's refill: 60 s / 3
    assert f"Please try again in {wait:.3g}s." in err["message"]
    assert [r.status for r in spend] == [200, 200, 429]
    assert orjson.loads(spend[2].body)["error"]["code"] == "insufficient_quota"
    assert out[3].header(b"x-usefulwork-shed-reason") == b"rpm"


def test_a_tenant_holds_at_most_its_requests_per_process_and_each_end_frees_one():
    """``max_inflight_per_process``: a third request while two of the tenant's are held (queued or being
    answered) gets 429 ``concurrency`` with a Retry-After, before its rpm is counted; another tenant is
    not held back; a request that ends (its reply closed) or fails frees its place."""
    tenants = {"capped": {"key_hashes": [hash_key("kc")], "max_inflight_per_process": 2, "rpm": 100},
               "other": {"key_hashes": [hash_key("ko")]}}
    f = make_filter(make_cfg(tenants=tenants))

    async def boom(call):
        raise RuntimeError("upstream exploded")

    async def go():
        be = Backend(hold=True)
        held = [asyncio.create_task(f(make_call(f, tenant="capped"), be)) for _ in range(2)]
        await asyncio.sleep(0.01)
        third = await f(make_call(f, tenant="capped"), Backend())
        other = await f(make_call(f, tenant="other"), Backend())
        seen = await f.tenant_limits("capped")  # (what its own key sees in /usefulwork/stats)
        assert (seen["max_inflight_per_process"], seen["in_flight_here"]) == (2, 2)
        be.gates[0].set()
        first = await held[0]
        still = await f(make_call(f, tenant="capped"), Backend())  # the first is answered but not closed yet
        await first.aclose()
        after = await f(make_call(f, tenant="capped"), Backend())
        await after.aclose()
        with pytest.raises(RuntimeError):
            await f(make_call(f, tenant="capped"), boom)
        again = await f(make_call(f, tenant="capped"), Backend())
        await again.aclose()
        be.gates[1].set()
        await (await held[1]).aclose()
        return third, other, still, after, again

    third, other, still, after, again = asyncio.run(go())
    assert third.status == 429 and third.header(b"x-usefulwork-shed-reason") == b"concurrency"
    err = orjson.loads(third.body)["error"]
    assert err["code"] == "concurrency" and "'capped'" in err["message"] and "2 requests" in err["message"]
    assert float(third.header(b"retry-after-ms")) > 0
    assert other.status == 200 and still.status == 429
    assert after.status == 200 and again.status == 200  # (closed and failed requests freed their places)
    assert f._holding == {}
    # the refused ones took nothing from the rpm bucket: 2 held + after + boom + again = 5 counted
    assert f.limits.headroom("capped", f.tenants.settings("capped"))[0] == pytest.approx(95, abs=1)


def test_tpm_counts_actual_tokens_and_refuses_oversized_request():
    tenants = {"t": {"key_hashes": [hash_key("k")], "tpm": 1000}}
    f = make_filter(make_cfg(tenants=tenants))

    async def go():
        big = await f(make_call(f, tenant="t", max_tokens=5000), Backend())
        statuses, refused = [], []
        for _ in range(12):
            r = await f(make_call(f, tenant="t", max_tokens=16), Backend(prompt_tokens=100, completion_tokens=16))
            await r.aclose()
            statuses.append(r.status)
            if r.status == 429:
                refused.append(orjson.loads(r.body)["error"])
        return big, statuses, refused

    big, statuses, refused = asyncio.run(go())
    assert all((e["code"], e["type"]) == ("rate_limit_exceeded", "tokens") and "Please try again in" in e["message"]
               for e in refused)
    err = orjson.loads(big.body)["error"]
    assert big.status == 429 and (err["code"], err["type"]) == ("rate_limit_exceeded", "tokens")  # (OpenAI's "Request too large")
    assert big.header(b"x-usefulwork-shed-reason") == b"tpm_too_large"
    assert big.header(b"x-should-retry") == b"false"  # (it never fits: the SDKs do not retry it)
    # 116 actual tokens each: 8 fit in 1000. The 9th is checked against its estimate (~80 tokens of
    # prompt + max_tokens) and the 72 left, corrected to actual at close: never more than one over.
    n = statuses.count(200)
    assert n in (8, 9) and statuses[:n] == [200] * n and statuses[n:] == [429] * (12 - n)


def test_answers_teach_the_pool_the_length_a_large_max_tokens_is_priced_at():
    f = make_filter(make_cfg())

    async def go():
        for _ in range(20):
            r = await f(make_call(f, max_tokens=4096), Backend(completion_tokens=37))
            await r.aclose()

    asyncio.run(go())
    cap = f.queues["p"].capacity
    assert len(cap.recent_out) == 20 and cap.est_output(4096) == 37  # the backend's count, not max_tokens


@pytest.mark.parametrize("op, by", [("chat", "slo"), ("responses", "slo"), ("chat", "client")])
def test_degrade_caps_max_tokens_instead_of_shedding(op, by):
    """The E2E SLO (3 s), or the timeout the client declares (3 s, under a 60 s SLO), leaves no time for a
    1000-token answer: the tenant's policy caps it at 8 tokens instead of a 429."""
    tenants = {"t": {"key_hashes": [hash_key("k")], "degrade": {"max_tokens": 8}}}
    f = make_filter(make_cfg(admission={"initial_concurrency": 1, "max_concurrency": 1}, tenants=tenants,
                             slo={"ttft_ms": 2000, "e2e_ms": 3000 if by == "slo" else 60000}))

    async def go():
        be = Backend(hold=True)
        first = asyncio.create_task(f(make_call(f, tenant="t"), be))
        await asyncio.sleep(0.01)
        cap = f.queues["p"].capacity
        cap.service, cap.svc_ttft, cap.tpot = 0.5, 0.1, 0.02  # a 1000-token answer needs 20 s; 8 tokens 0.24 s
        call = make_call(f, tenant="t", max_tokens=1000, op=op)
        if by == "client":
            call.headers.append((b"x-stainless-read-timeout", b"3"))
        task = asyncio.create_task(f(call, Backend()))
        await asyncio.sleep(0.01)
        be.gates[0].set()
        await (await first).aclose()
        reply = await task
        await reply.aclose()
        return call, reply

    call, reply = asyncio.run(go())
    assert reply.status == 200
    field = "max_output_tokens" if op == "responses" else "max_tokens"  # (the endpoint's own field, no other)
    assert call.body[field] == 8 and call.raw is None
    assert set(call.body) == {"model", field, "input" if op == "responses" else "messages"}
    assert call.ctx.admission == "degraded:max_tokens=8" and call.ctx.max_tokens == 8


def test_gateway_shows_admission_stats_to_the_admin_only():
    """Wired into the app: its stats reach /usefulwork/stats (fleet view) and the dashboard has a place."""
    from starlette.testclient import TestClient

    from usefulwork.gateway.app import build_app

    cfg = from_mapping({"pools": [{"name": "p", "models": [MODEL], "replicas": ["http://127.0.0.1:9"]}],
                        "filters": ["admission"], "tenants": {"t": {"key_hashes": [hash_key("tk")], "rpm": 6},
                                                              "b": {"key_hashes": [hash_key("bk")], "budget_usd_per_day": 2.5}},
                        "access": {"admin_key_hashes": [hash_key("ak")]}}, environ={})
    app = build_app(cfg)
    with TestClient(app.app) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1},
                   headers={"authorization": "Bearer tk"})
        assert r.status_code in (502, 503)  # nothing listens upstream; admission let it through and released it
        fleet = c.get("/usefulwork/stats", headers={"authorization": "Bearer ak"}).json()
        pool = fleet["filters"]["admission"]["pools"]["p"]
        assert pool["admitted"] == 1 and pool["inflight"] == 0
        mine = c.get("/usefulwork/stats", headers={"authorization": "Bearer tk"}).json()
        assert "filters" not in mine
        page = c.get("/usefulwork/dashboard", headers={"authorization": "Bearer ak"}).text
        assert 'id="admission-table"' in page
        # the admin endpoint: a tenant's status, admin key only, never the key hashes
        assert c.get("/usefulwork/admission/tenants/t", headers={"authorization": "Bearer tk"}).status_code == 401
        assert c.get("/usefulwork/admission/tenants/nobody", headers={"authorization": "Bearer ak"}).status_code == 404
        st = c.get("/usefulwork/admission/tenants/t", headers={"authorization": "Bearer ak"}).json()
        assert st["settings"]["priority"] == "interactive" and "key_hashes" not in st["settings"]
        assert st["fair_share_tokens"]["p"] > 0
        assert st["requests_remaining"] == 5 and st["tokens_remaining"] is None  # (one of its 6 a minute; 10 s to refill)
        # every tenant at once (who is near its budget), admin key only
        assert c.get("/usefulwork/admission/tenants", headers={"authorization": "Bearer tk"}).status_code == 401
        every = c.get("/usefulwork/admission/tenants", headers={"authorization": "Bearer ak"}).json()["tenants"]
        assert list(every) == ["b", "t"] and every["t"] == {k: v for k, v in st.items() if k != "tenant"}
        assert every["b"]["spent_today_usd"] == 0.0 and every["b"]["budget_left_usd"] == 2.5
        assert every["t"]["spent_today_usd"] is None and "key_hashes" not in str(every)
        mine = c.get("/usefulwork/stats", headers={"authorization": "Bearer bk"}).json()
        assert mine["limits"]["budget_left_usd"] == 2.5 and set(mine["tenants"]) <= {"b"}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_class_goes_to_vllm_as_priority_only_where_the_replicas_schedule_by_it(policy):
    pools = [{"name": "p", "models": [MODEL], "replicas": ["http://127.0.0.1:9"], "scheduling_policy": policy}]
    f = make_filter(make_cfg(pools=pools))

    async def go():
        be = Backend()
        calls = [make_call(f, priority=p) for p in ("interactive", "batch", "sheddable")]
        calls[1].set_body({**calls[1].body, "priority": -5})  # a client's own value
        for c in calls:
            await (await f(c, be)).aclose()
        return be.calls

    sent = asyncio.run(go())
    assert f.queues["p"].capacity.priority_scheduling is (policy == "priority")  # the fill limit's signal follows
    if policy == "priority":
        assert [c.body["priority"] for c in sent] == [0, 2, 4]  # 2 x the class replaces the client's -5
        assert all(c.raw is None for c in sent)  # re-encoded by the forwarder
    else:
        assert "priority" not in sent[0].body and sent[1].body["priority"] == -5 and sent[0].raw is not None


@pytest.mark.parametrize("policy,chunk", [("priority", 64), ("priority", 0), ("fcfs", 64)])
def test_low_band_prompts_go_in_pieces_only_while_top_band_work_is_about(policy, chunk):
    """``low_band_prefill_chunk``: a batch or sheddable request is marked for the Forwarder to prefill in pieces
    (``Call.memo``) once interactive work has been offered, on replicas that schedule by priority (where the
    low-band gate works); an interactive one never is, nor a Responses call (its prompt is not tokenized on
    the replica), nor anything where the setting is 0."""
    pools = [{"name": "p", "models": [MODEL], "replicas": ["http://127.0.0.1:9"], "scheduling_policy": policy}]
    f = make_filter(make_cfg(pools=pools, admission={"low_band_prefill_chunk": chunk}))

    async def go():
        be = Backend()
        for p, op in (("batch", "chat"), ("interactive", "chat"), ("batch", "chat"), ("sheddable", "chat"),
                      ("interactive", "chat"), ("batch", "responses")):
            await (await f(make_call(f, priority=p, op=op), be)).aclose()
        return be.calls

    marked = [c.memo.get(PREFILL_CHUNK) for c in asyncio.run(go())]
    if policy == "priority" and chunk:
        assert marked == [None, None, 64, 64, None, None]
        assert f.stats()["prefilled_in_pieces"] == 2
    else:
        assert marked == [None] * 6
        assert f.stats().get("prefilled_in_pieces", 0) == 0


async def _marked_hold(f):
    """A filter on one priority pool with 64-token pieces: the hold it handed a batch call's forwarder, and
    the pool's queue (an interactive call went first, so top-band work is about)."""
    from usefulwork.upstream.pieces import PIECE_HOLD

    be = Backend()
    for p in ("interactive", "batch"):
        await (await f(make_call(f, priority=p), be)).aclose()
    q = f.queues["p"]
    q.capacity.prefill_each = 0.2  # (as if learnt from first tokens)
    return be.calls[1].memo[PIECE_HOLD], q


def _pieced_filter():
    pools = [{"name": "p", "models": [MODEL], "replicas": ["http://127.0.0.1:9"], "scheduling_policy": "priority"}]
    return make_filter(make_cfg(pools=pools, admission={"low_band_prefill_chunk": 64}))


def test_a_marked_calls_pieces_wait_for_the_top_bands_pending_prompt_and_no_longer_than_two_prefills():
    """The hold the filter hands the forwarder with a marked call (``Call.memo[PIECE_HOLD]``): it returns at
    once when no top-band prompt is pending, when the pending one's first token comes, and at the latest
    after two prefill times."""
    import time

    from usefulwork.gateway.admission.queue import Ticket

    f = _pieced_filter()

    async def go():
        hold, q = await _marked_hold(f)
        t0 = time.perf_counter()
        await asyncio.wait_for(hold(), 1.0)  # nothing pending: at once
        at_once = time.perf_counter() - t0
        top = Ticket("default", 0, 100.0, 0.0, 10.0)
        assert q.offer(top, f.clock()).kind == "admit" and q.top_band_pending()
        waiting = asyncio.create_task(hold())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        q.first_token(top, f.clock())
        await asyncio.wait_for(waiting, 0.1)  # its first token: the piece goes
        top2 = Ticket("default", 0, 100.0, f.clock(), f.clock() + 10.0)
        assert q.offer(top2, f.clock()).kind == "admit"
        t0 = time.perf_counter()
        await asyncio.wait_for(hold(), 2.0)  # never answered: two prefill times
        assert q._on_top_clear == []  # (the given-up wait took its callback back)
        return at_once, time.perf_counter() - t0

    at_once, bounded = asyncio.run(go())
    assert at_once < 0.05 and 0.35 <= bounded < 0.8, (at_once, bounded)


def test_a_marked_calls_pieces_take_their_places_in_the_pools_spacing():
    """The same hold, once the pool's decode line is fitted (``PoolQueue.piece_wait``): three pieces that ask at
    once (answered in one engine step) go a decode step apart, the first at once; a top-band prompt admitted
    while one waits for its place holds it until its first token."""
    import time

    from usefulwork.gateway.admission.capacity import Sample
    from usefulwork.gateway.admission.queue import Ticket

    f = _pieced_filter()

    async def go():
        hold, q = await _marked_hold(f)
        for load, n in ((0, 30), (18, 3)):  # 100 ms a token at any load: a 100 ms gap
            for _ in range(n):
                q.capacity.observe(Sample(ttft=0.1, tpot=0.1, service=1.7, tokens=640, ok=True,
                                          inflight_at_admit=load, inflight_at_end=load), f.clock())
        assert q.piece_gap() == pytest.approx(0.1, abs=0.01)
        t0 = time.perf_counter()
        done: list[float] = []

        async def piece():
            await hold()
            done.append(time.perf_counter() - t0)
        await asyncio.wait_for(asyncio.gather(piece(), piece(), piece()), 2.0)
        spaced = sorted(done)
        await asyncio.sleep(0.15)  # (the last place passed)
        t0 = time.perf_counter()
        first = asyncio.create_task(hold())  # at once
        waiting = asyncio.create_task(hold())  # its place is a gap away
        await asyncio.sleep(0.02)
        top = Ticket("default", 0, 100.0, f.clock(), f.clock() + 10.0)
        assert first.done() and q.offer(top, f.clock()).kind == "admit" and q.top_band_pending()
        await asyncio.sleep(0.2)
        assert not waiting.done()  # its place came, the top band's prompt is pending
        q.first_token(top, f.clock())
        await asyncio.wait_for(waiting, 0.1)
        return spaced

    spaced = asyncio.run(go())
    assert spaced[0] < 0.05 and 0.07 <= spaced[1] - spaced[0] < 0.2 and 0.07 <= spaced[2] - spaced[1] < 0.2, spaced


def test_a_paced_tenants_queued_prompt_goes_when_its_pace_comes_with_no_event_to_wake_it():
    """``PoolQueue.turn_free`` paces the tenant holding the most while another was active lately but is not
    about: its queued prompt's waiter looks again when the pace allows it (``next_turn_due``), not at its
    latest start or when the pending prompt is deemed done. A unary prompt's first token is never seen:
    with a 1 s prefill, the pace (0.8 s) comes before the pending prompt is deemed done (1 s)."""
    import time

    from usefulwork.gateway.admission.queue import TURN_PACE_PREFILLS

    pools = [{"name": "p", "models": [MODEL], "replicas": ["http://127.0.0.1:9"], "scheduling_policy": "priority"}]
    f = make_filter(make_cfg(pools=pools, slo={"ttft_ms": 10000, "e2e_ms": 60000}))

    async def go():
        await (await f(make_call(f, tenant="b"), Backend())).aclose()  # b was active ...
        q = f.queues["p"]
        q.last_seen["b"] -= 10.0  # ... 10 s ago: within the shares' horizon, not about
        q.capacity.prefill_each = 1.0  # (as if learnt from first tokens)
        q.capacity.service, q.capacity.svc_ttft = 8.0, 1.0
        be = Backend(hold=True)
        first = asyncio.create_task(f(make_call(f, tenant="a"), be))
        await asyncio.sleep(0.01)
        assert q.turn_free(0, "a") == 0
        t0 = time.perf_counter()
        second_call = make_call(f, tenant="a")
        second = asyncio.create_task(f(second_call, Backend()))
        await asyncio.sleep(0.02)
        assert q.queued == 1
        await (await second).aclose()
        waited = time.perf_counter() - t0
        be.gates[0].set()
        await (await first).aclose()
        return waited, second_call

    waited, call = asyncio.run(go())
    pace = TURN_PACE_PREFILLS * 1.0
    assert call.ctx.admission == "queued" and pace - 0.03 <= waited < pace + 0.12, waited


def test_two_replicas_settle_a_retrys_return_through_redis(redis_url):
    """Replica A sheds a request and holds its place; the client's retry reaches replica B, which holds no
    place for the tenant. When A lets the place go, its syncs with B (through the real Redis) learn it as
    taken back; a place whose client never came back is learnt as not."""
    import uuid

    from usefulwork.gateway.admission.queue import RESERVATION_GRACE_S, Ticket

    adm = {"redis_url": redis_url, "redis_prefix": f"uwtest:{uuid.uuid4().hex}"}
    cfg = make_cfg(admission=adm)
    fa, fb = make_filter(cfg), make_filter(cfg)
    qa, qb = fa.queue_for(make_call(fa)), fb.queue_for(make_call(fb))
    assert qa.shared_returns and qb.shared_returns and fa.fair_sync is not None

    async def go():
        try:
            qa._reserve(1.0, 5, "acme", 0.0)  # A shed acme's request: its place, due at 1 s
            qa._reserve(1.0, 6, "acme", 0.0)  # and another's, whose client never comes back
            qb._reserve(0.5, 7, "acme", 0.0)  # B shed acme's requests too (round robin)
            qb._unhold(7)  # and that place was taken back on A
            retry = Ticket("acme", 0, 100.0, 1.0, 3.0, key=5, retried=1)
            qb.offer(retry, 1.0)  # the retry reaches B, which holds no place for acme
            assert qb.retries_placeless == 1
            await fb.sync_once()
            qa.offer(Ticket("zed", 0, 100.0, 1.0 + RESERVATION_GRACE_S + 0.5, 9.0, key=9),
                     1.0 + RESERVATION_GRACE_S + 0.5)  # A lets both places go
            assert "acme" not in qa.returns
            await fa.sync_once()
            # one of the two came back, on B (taken back, then not: the older outcome weighs 0.95)
            assert qa.returns["acme"] == pytest.approx((0.95, 1.95))
        finally:
            await fa.stop()
            await fb.stop()
            drop_redis_keys(redis_url, adm["redis_prefix"])

    asyncio.run(go())


def run_two_replicas(redis_url: str, adm: dict, body) -> None:
    """Two admission filters (gateway replicas) sharing the real Redis under a fresh key prefix, each pool's
    slot held 3 s (first token 0.1 s): runs ``await body(fa, fb, qa, qb)``, then stops both and drops the keys."""
    import uuid

    adm = {"redis_url": redis_url, "redis_prefix": f"uwtest:{uuid.uuid4().hex}", **adm}
    fa, fb = make_filter(make_cfg(admission=adm)), make_filter(make_cfg(admission=adm))
    qa, qb = fa.queue_for(make_call(fa)), fb.queue_for(make_call(fb))
    for q in (qa, qb):
        q.capacity.service, q.capacity.svc_ttft = 3.0, 0.1

    async def go():
        try:
            await body(fa, fb, qa, qb)
        finally:
            await fa.stop()
            await fb.stop()
            drop_redis_keys(redis_url, adm["redis_prefix"])

    asyncio.run(go())


def test_two_replicas_lend_a_place_through_redis(redis_url):
    """Replica A's slots are all young; replica B has a slot free beyond its tenant headroom (which is never
    lent). Through their exchanges (the real Redis) A learns B's place, a client's retry reaching A takes
    it, and B then leaves that slot idle until A's next request ends and gives it back. Without
    ``lend_places`` nothing is lent."""
    from usefulwork.gateway.admission.queue import Ticket

    adm = {"redis_url": redis_url, "initial_concurrency": 2}
    assert make_filter(make_cfg(admission={**adm, "lend_places": False})).ledger is None

    async def body(fa, fb, qa, qb):
        assert fa.ledger is not None
        now = fa.clock()
        first = [Ticket("acme", 0, 100.0, now, now + 2.0) for _ in range(2)]
        assert [qa.offer(t, now).kind for t in first] == ["admit", "admit"]  # A is full for ~3 s
        assert qb.next_place(now) == now  # B: two slots free, one of them its headroom
        await fb.lend_once()  # B publishes its place
        await fa.lend_once()
        assert [p for _, p in qa.fleet_places] == [fb.ledger.me]
        now = fa.clock()
        assert qa.offer(Ticket("acme", 0, 100.0, now, now + 0.6, retried=0), now).kind == "shed"
        assert qa.offer(Ticket("acme", 0, 100.0, now, now + 0.6, retried=1), now).kind == "admit"
        await fa.lend_once()
        await fb.lend_once()
        assert qb.owed == 1 and qb.slot_free(0) == 1  # B's lendable slot is A's retry's now
        assert qb.next_place(fb.clock()) == math.inf  # (nothing more to lend: only the headroom is free)
        qa.release(first[0], fa.clock())  # A's next end gives it back
        await fa.lend_once()
        await fb.lend_once()
        assert qb.owed == 0 and qb.slot_free(0) == 2
        assert fa.stats()["pools"]["p"]["places_borrowed"] == 1

    run_two_replicas(redis_url, adm, body)


def test_a_retry_reaching_another_replica_claims_the_place_held_for_it_through_redis(redis_url, monkeypatch):
    """Replica A sheds a numbered first attempt and holds its place; the retry reaches replica B, full for
    longer than the retry may wait. Through their exchanges (the real Redis) B knows A's held place by the
    request's key, the retry claims it and runs on it as A's loan, and A lets the place go (learnt as taken
    back) and leaves one slot idle until B's next request ends."""
    from usefulwork.gateway.admission import filter as filter_module, queue as queue_module
    from usefulwork.gateway.admission.queue import Ticket

    monkeypatch.setattr(queue_module, "HELD_AHEAD_S", 60.0)  # (publish the place now, not 2 s before it is due)
    key_of = filter_module._retry_key("acme", b'{"model": "m", "messages": []}', {})

    async def body(fa, fb, qa, qb):
        now = fa.clock()
        assert qa.offer(Ticket("acme", 0, 100.0, now, now + 2.0), now).kind == "admit"  # A is full for ~3 s
        shed = Ticket("acme", 0, 100.0, now, now + 0.6, retried=0, key_of=key_of)
        assert qa.offer(shed, now).kind == "shed"
        at = now + shed.retry_after_s
        assert qb.offer(Ticket("acme", 0, 100.0, at - 0.5, at + 2.0), at - 0.5).kind == "admit"  # B: ~at + 2.5
        await fa.lend_once()
        await fb.lend_once()
        assert list(qb.fleet_held) == [key_of()]
        retry = Ticket("acme", 0, 100.0, at, at + 0.6, retried=1, key_of=key_of)
        assert qb.offer(retry, at).kind == "admit" and list(qb.loans) == [fa.ledger.me]
        await fb.lend_once()
        await fa.lend_once()
        assert qa.held_places(fa.clock()) == [] and qa.owed == 1 and qa.slot_free(0) == -1
        pa = fa.stats()["pools"]["p"]
        assert pa["places_claimed_elsewhere"] == 1 and pa["retry_reservations"] == 0
        assert fb.stats()["pools"]["p"]["places_claimed"] == 1

    run_two_replicas(redis_url, {"initial_concurrency": 1, "tenant_headroom": 0.0}, body)


def test_a_requests_retry_key_is_the_same_in_every_gateway_process():
    """Another process holds a retry's place under the key its process computed (Python's ``hash`` is salted
    per process: ``PYTHONHASHSEED``)."""
    import os
    import subprocess
    import sys

    code = ("from usefulwork.gateway.admission.filter import _retry_key; "
            "print(_retry_key('acme', b'{\"model\": \"m\"}', {})(), _retry_key('acme', None, {'model': 'm'})(), "
            "_retry_key('other', b'{\"model\": \"m\"}', {})())")
    keys = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.split() for seed in ("1", "2")]
    assert keys[0] == keys[1] and len(set(keys[0])) == 3 and all(0 < int(k) < 2**63 for k in keys[0])


def test_the_in_process_cost_benchmark_runs_the_filter_on_every_path_it_times():
    """``benchmarks/admission_cpu.py`` (docs/benchmarks.md section 13) times the real filter: a short run
    of each of its modes admits its requests and reports a cost."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    for mode in ([], ["--tenant"], ["--stream"]):
        out = subprocess.run([sys.executable, str(root / "benchmarks" / "admission_cpu.py"), "--requests", "300",
                              "--repeats", "1", *mode], capture_output=True, text=True, timeout=120, check=True).stdout
        m = re.search(r"the filter costs (-?[\d.]+) us .*'admit': (\d+)", out)
        assert m is not None, out
        assert float(m.group(1)) > 0 and int(m.group(2)) >= 0.9 * (2000 + 300)  # (warm-up and timed: a few queue)
