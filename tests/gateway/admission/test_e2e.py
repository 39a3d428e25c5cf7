"""Admission end to end: real gateway processes (`usefulwork serve --config`) in front of the
simulator, the real openai SDK, the real Redis shared by two gateways, a Redis that dies mid-run.

Needs the request pipeline (the endpoint runs ``cfg.filters``)."""

from __future__ import annotations

import asyncio
import shutil
import time
import uuid

import httpx
import openai
import pytest

from tests.conftest import free_port
from tests.gateway.admission.test_limits import _start_redis
from usefulwork.backends.sim.process import SimProcess
from usefulwork.gateway.tenants import hash_key
from usefulwork.loadtest.client import send
from usefulwork.loadtest.experiment import Gateway
from usefulwork.loadtest.workloads import RequestSpec

pytestmark = pytest.mark.slow
MODEL = "llama"


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    p = SimProcess(gpu="A100-80G", model="Llama-3.1-8B", served_name=MODEL, port=free_port(), time_scale=1.0,
                   log_path=tmp_path_factory.mktemp("sim") / "sim.log")
    p.start()
    try:
        p.wait_ready(timeout_s=60)
        yield p
    finally:
        p.stop()


def gateway(sim, tmp_path, **over) -> Gateway:
    cfg = {"listen": {"host": "127.0.0.1", "port": free_port()},
           "pools": [{"name": "a100", "models": [MODEL], "replicas": [sim.base_url],
                      "prices": {"input_per_1m": 10000.0, "output_per_1m": 10000.0}}],
           "filters": ["admission"], **over}
    return Gateway(cfg, tmp_path).start()


def body(max_tokens: int = 4) -> dict:
    return {"model": MODEL, "prompt": "hello " * 50, "max_tokens": max_tokens, "ignore_eos": True}


def test_openai_sdk_sees_rate_limit_error_with_retry_after_and_can_honour_it(sim, tmp_path):
    gw = gateway(sim, tmp_path, slo={"ttft_ms": 300, "e2e_ms": 30000},
                 admission={"initial_concurrency": 1, "max_concurrency": 1},
                 tenants={"t": {"key_hashes": [hash_key("sdk-key")], "rpm": 1000, "tpm": 1_000_000}})
    try:
        c0 = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="sdk-key", max_retries=0)
        raw = c0.completions.with_raw_response.create(model=MODEL, prompt="warm " * 50, max_tokens=64,
                                                      extra_body={"ignore_eos": True})
        assert raw.parse().usage.completion_tokens == 64
        h = raw.headers  # OpenAI's rate-limit headers: this request's share taken
        assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("1000", "999")
        assert h["x-ratelimit-reset-requests"].endswith("ms")  # one request refills in 60 ms
        assert h["x-ratelimit-limit-tokens"] == "1000000"
        assert 1_000_000 - 500 < int(h["x-ratelimit-remaining-tokens"]) < 1_000_000 - 64

        async def run():
            long = asyncio.to_thread(c0.completions.create, model=MODEL, prompt="a " * 50, max_tokens=400,
                                     extra_body={"ignore_eos": True})
            task = asyncio.ensure_future(long)
            await asyncio.sleep(0.3)
            try:
                await asyncio.to_thread(c0.completions.create, model=MODEL, prompt="b " * 50, max_tokens=400,
                                        extra_body={"ignore_eos": True})
            except openai.RateLimitError as exc:
                err = exc
            else:
                err = None
            honoured_t0 = time.monotonic()
            c2 = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="sdk-key", max_retries=4)
            r = await asyncio.to_thread(c2.completions.create, model=MODEL, prompt="c " * 50, max_tokens=8,
                                        extra_body={"ignore_eos": True})
            await task
            return err, r, time.monotonic() - honoured_t0

        err, r, took = asyncio.run(run())
        assert isinstance(err, openai.RateLimitError)
        h = err.response.headers
        assert float(h["retry-after-ms"]) > 0 and int(h["retry-after"]) >= 1
        assert h["x-usefulwork-shed-reason"] == "predicted_wait"
        assert err.body["code"] == "predicted_wait"
        assert int(h["x-ratelimit-remaining-requests"]) >= 997  # (a shed carries them too)
        assert r.usage.completion_tokens == 8  # the SDK waited as told and got in
    finally:
        gw.stop()


def behind_one_held_slot(sim, tmp_path, during):
    """A gateway with one slot and a 20 s TTFT SLO, measured once on a 256-token answer (a slot is then held
    for the seconds such an answer takes); ``during(gw)``, a coroutine function, runs 0.3 s after another such
    answer took the slot. Its result."""
    gw = gateway(sim, tmp_path, slo={"ttft_ms": 20000, "e2e_ms": 60000},
                 admission={"initial_concurrency": 1, "max_concurrency": 1})
    try:
        patient = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="k", max_retries=0)
        long = dict(model=MODEL, prompt="a " * 50, max_tokens=256, extra_body={"ignore_eos": True})
        patient.completions.create(**long)

        async def run():
            task = asyncio.ensure_future(asyncio.to_thread(patient.completions.create, **long))
            await asyncio.sleep(0.3)
            out = await during(gw)
            await task
            return out

        return asyncio.run(run())
    finally:
        gw.stop()


def test_an_sdk_client_that_gives_up_sooner_than_the_slo_gets_a_rate_limit_error_not_a_timeout(sim, tmp_path):
    """The openai SDK sends its read timeout on every request (``x-stainless-read-timeout``). With a slot
    held for seconds and a 20 s TTFT SLO, a request whose client waits 1 s is shed at once with 429 +
    Retry-After (``RateLimitError``); the same request with that header removed queues for the SLO's
    deadline and its client times out (``APITimeoutError``): what the header changes."""

    async def during(gw):
        hasty = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="k", max_retries=0, timeout=1.0)
        out = []
        for headers in ({}, {"X-Stainless-Read-Timeout": openai.Omit()}):
            t0 = time.monotonic()
            try:
                await asyncio.to_thread(hasty.completions.create, model=MODEL, prompt="b " * 50, max_tokens=8,
                                        extra_body={"ignore_eos": True}, extra_headers=headers)
            except (openai.RateLimitError, openai.APITimeoutError) as exc:
                out.append((exc, time.monotonic() - t0))
            else:
                out.append((None, time.monotonic() - t0))
        return out

    (shed, shed_s), (timed_out, _) = behind_one_held_slot(sim, tmp_path, during)
    assert isinstance(shed, openai.RateLimitError) and shed_s < 0.5
    assert shed.response.headers["x-usefulwork-shed-reason"] == shed.body["code"] == "client_timeout"
    assert float(shed.response.headers["retry-after-ms"]) > 0
    assert isinstance(timed_out, openai.APITimeoutError)


def test_an_sdk_client_declaring_its_deadline_for_all_attempts_is_told_not_to_retry_and_does_not(sim, tmp_path):
    """The openai SDK with its default 2 retries, its application declaring 1.5 s for the whole call,
    retries included (``x-usefulwork-deadline-ms``), against a slot held for seconds: the 429 says
    ``x-should-retry: false`` (no retry could end in time), and the SDK raises ``RateLimitError`` after
    one attempt, at once, instead of sleeping out the Retry-After to retry into the same full pool. The
    same 1.5 s as Envoy's per-attempt route timeout: the 429 does not say so (a retry gets a fresh 1.5 s)."""
    sent: list[str] = []

    async def during(gw):
        counted = httpx.Client(event_hooks={"request": [lambda r: sent.append(r.headers.get("x-stainless-retry-count"))]})
        sdk = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="k", max_retries=2, http_client=counted)
        out = []
        for header in ("x-usefulwork-deadline-ms", "x-envoy-expected-rq-timeout-ms"):
            t0 = time.monotonic()
            try:
                await asyncio.to_thread(sdk.with_options(max_retries=2 if header.startswith("x-use") else 0)
                                        .completions.create, model=MODEL, prompt="b " * 50, max_tokens=8,
                                        extra_body={"ignore_eos": True}, extra_headers={header: "1500"})
            except openai.RateLimitError as exc:
                out.append((exc, time.monotonic() - t0, len(sent)))
        return out

    (told, told_s, attempts), (envoy, _, _) = behind_one_held_slot(sim, tmp_path, during)
    assert told.response.headers["x-should-retry"] == "false" and told.body["code"] == "client_timeout"
    assert attempts == 1 and sent[0] == "0" and told_s < 1.0  # (one attempt, the first)
    assert float(told.response.headers["retry-after-ms"]) > 0
    assert "x-should-retry" not in envoy.response.headers and envoy.body["code"] == "client_timeout"


def test_the_loadtest_client_declares_the_time_it_has_left_and_is_shed_not_timed_out(sim, tmp_path):
    """The loadtest client declares, on every attempt, the time it has left for the whole answer, its
    retries included (``x-usefulwork-deadline-ms``). One slot held for seconds, a 20 s TTFT SLO: its request
    with 1.5 s left is shed at once (``client_timeout``, with a Retry-After) and told not to retry
    (``x-should-retry: false``: no retry could end in its 1.5 s), so the client, which honours Retry-After,
    stops there; the same request without the header queues past the client's 1.5 s (it would have been
    served after its client left)."""
    spec = RequestSpec(index=0, endpoint="completions", max_tokens=8, input_tokens=50, prompt="b " * 50)

    async def during(gw):
        async with httpx.AsyncClient(timeout=None) as c:
            res = await send(c, gw.base_url, spec, MODEL, timeout_s=1.5, clock0=time.perf_counter(), planned=0.0,
                             honor_retry_after=True)
            t0 = time.monotonic()
            try:
                await c.post(gw.base_url + "/v1/completions", json=spec.body(MODEL), timeout=1.5)
                undeclared = "answered"
            except httpx.ReadTimeout:
                undeclared = "timed out"
            return res, undeclared, time.monotonic() - t0

    res, undeclared, waited = behind_one_held_slot(sim, tmp_path, during)
    assert (res.outcome, res.status, res.shed_reason) == ("shed", 429, "client_timeout")
    assert res.shed_s < 0.5 and res.retry_after_s > 0
    assert res.final and res.retries == 0 and res.end - res.sent < 0.5  # (told not to retry: it did not)
    assert undeclared == "timed out" and waited >= 1.4


class RoundRobin(httpx.HTTPTransport):
    """A load balancer in front of several gateway processes (a Kubernetes Service): each attempt goes to
    the next one."""

    def __init__(self, ports: list[int]):
        super().__init__()
        self.ports, self.sent = ports, []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        port = self.ports[len(self.sent) % len(self.ports)]
        request.url = request.url.copy_with(port=port)
        self.sent.append((port, request.headers.get("x-stainless-retry-count")))
        return super().handle_request(request)


def test_a_retry_reaching_another_gateway_is_not_counted_as_new_shed_demand(sim, tmp_path):
    """The openai SDK's retry of a 429 lands on the other gateway process (round robin), which is full too
    and sheds it: its shed demand (the autoscaler's metric) does not count it again, since the SDK numbers
    the attempt. A first attempt shed there is counted."""
    gws = [gateway(sim, tmp_path, slo={"ttft_ms": 300, "e2e_ms": 60000},
                   admission={"initial_concurrency": 1, "max_concurrency": 1}) for _ in range(2)]
    try:
        for g in gws:  # a measured round trip: a request is shed at arrival when the slot frees too late
            httpx.post(g.base_url + "/v1/completions", json=body(64), timeout=60).raise_for_status()

        def pool(g) -> dict:
            return httpx.get(g.base_url + "/usefulwork/stats").json()["filters"]["admission"]["pools"]["a100"]

        async def run():
            # each gateway's one slot taken: the first's frees in ~4 s, the second's much later
            holds = [asyncio.ensure_future(asyncio.to_thread(
                httpx.post, g.base_url + "/v1/completions", json=body(n), timeout=120)) for g, n in zip(gws, (400, 1000))]
            await asyncio.sleep(0.3)
            lb = RoundRobin([int(g.base_url.rsplit(":", 1)[1]) for g in gws])
            c = openai.OpenAI(base_url=gws[0].base_url + "/v1", api_key="k", max_retries=1,
                              http_client=httpx.Client(transport=lb, timeout=120))
            try:
                await asyncio.to_thread(c.completions.create, model=MODEL, prompt="retry me " * 40, max_tokens=8)
            except openai.RateLimitError as exc:
                err = exc
            else:
                err = None
            second = pool(gws[1])
            # the control: a first attempt (no retry count) shed by the same full gateway is new demand
            r = await asyncio.to_thread(httpx.post, gws[1].base_url + "/v1/completions", json=body(8), timeout=60)
            control = pool(gws[1])
            for h in holds:
                (await h).raise_for_status()
            return err, lb.sent, second, r.status_code, control

        err, sent, second, control_status, control = asyncio.run(run())
        ports = [int(g.base_url.rsplit(":", 1)[1]) for g in gws]
        assert sent == [(ports[0], "0"), (ports[1], "1")]  # the SDK waited out Retry-After, then its retry went on
        assert isinstance(err, openai.RateLimitError)  # shed by the second gateway too
        assert second["shed"] == {"predicted_wait": 1} and second["shed_demand"] == 0
        assert control_status == 429 and control["shed_demand"] == 1
    finally:
        for g in gws:
            g.stop()


def test_bad_input_nothing_forwarded(sim, tmp_path):
    gw = gateway(sim, tmp_path, tenants={"ok": {"key_hashes": [hash_key("good")]},
                                         "off": {"key_hashes": [hash_key("disabled")], "enabled": False},
                                         "bulk": {"key_hashes": [hash_key("bulk")], "priority": "batch",
                                                  "max_priority": "batch"}})
    try:
        before = httpx.get(sim.base_url + "/metrics").text.count("\n")
        url = gw.base_url + "/v1/completions"
        r = httpx.post(url, json=body(), headers={"authorization": "Bearer good", "x-usefulwork-priority": "vip"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_priority"
        r = httpx.post(url, json=body(), headers={"authorization": "Bearer bulk", "x-usefulwork-priority": "interactive"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "priority_not_allowed"
        for auth, status in (("Bearer wrong", 401), ("Basic ???", 401), ("Bearer disabled", 403), ("", 401)):
            r = httpx.post(url, json=body(), headers={"authorization": auth} if auth else {})
            assert r.status_code == status and "error" in r.json()
        assert before == httpx.get(sim.base_url + "/metrics").text.count("\n")
        stats = httpx.get(gw.base_url + "/usefulwork/stats", headers={"authorization": "Bearer good"}).json()
        assert set(stats["tenants"]) <= {"ok"}  # nothing of another tenant shown
    finally:
        gw.stop()


def _redis_keys(url: str, prefix: str) -> list[bytes]:
    import redis

    return redis.Redis.from_url(url).keys(prefix + "*")


def test_two_gateways_share_rpm_and_budget_through_redis(sim, tmp_path, redis_url):
    prefix = f"uwtest:{uuid.uuid4().hex}"
    tenants = {"burst": {"key_hashes": [hash_key("kb")], "rpm": 100},
               "spend": {"key_hashes": [hash_key("ks")], "budget_usd_per_day": 3.0}}
    adm = {"redis_url": redis_url, "redis_prefix": prefix, "initial_concurrency": 256}  # only the limits bind
    gws = [gateway(sim, tmp_path, tenants=tenants, admission=adm) for _ in range(2)]
    try:
        async def burst():
            async with httpx.AsyncClient(timeout=60) as c:
                rs = await asyncio.gather(*(c.post(gws[i % 2].base_url + "/v1/completions", json=body(1),
                                                   headers={"authorization": "Bearer kb"}) for i in range(160)))
            return [r.status_code for r in rs], [r.headers.get("x-usefulwork-shed-reason") for r in rs], \
                [r.headers for r in rs]

        t0 = time.monotonic()
        statuses, reasons, headers = asyncio.run(burst())
        elapsed = time.monotonic() - t0
        ok = statuses.count(200)
        assert ok >= 100 and ok <= (100 + 100 / 60 * elapsed) * 1.01, (ok, elapsed)
        assert all(s == 429 and why == "rpm" for s, why in zip(statuses, reasons) if s != 200)
        # OpenAI's rate-limit headers on every answer: the fleet's bucket as each gateway last saw it
        assert all(h["x-ratelimit-limit-requests"] == "100" and "x-ratelimit-limit-tokens" not in h for h in headers)
        left = [int(h["x-ratelimit-remaining-requests"]) for h in headers]
        assert all(0 <= n <= 99 for n in left) and min(left) == 0
        assert all(n <= 1 for n, s in zip(left, statuses) if s == 429)  # (under one: refilling since)
        assert all(h["x-ratelimit-reset-requests"] for h in headers)

        # Each request: ~60 prompt + 4 output tokens at $10,000 / 1M = ~$0.64; budget $3 across both.
        served = 0
        for i in range(12):
            r = httpx.post(gws[i % 2].base_url + "/v1/completions", json=body(4),
                           headers={"authorization": "Bearer ks"}, timeout=60)
            if r.status_code == 200:
                served += 1
            else:
                assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
        assert 3 <= served <= 6
        for g in gws:  # both gateways refuse now, and the tenant's own stats say why on either
            r = httpx.post(g.base_url + "/v1/completions", json=body(4), headers={"authorization": "Bearer ks"})
            assert r.status_code == 429 and r.headers["x-usefulwork-shed-reason"] == "budget"
            assert r.headers["x-should-retry"] == "false"  # (the SDKs do not retry what only midnight changes)
            assert not any(k.startswith("x-ratelimit-") for k in r.headers)  # (a budget alone: no rpm / tpm)
            mine = httpx.get(g.base_url + "/usefulwork/stats", headers={"authorization": "Bearer ks"}).json()
            assert mine["limits"]["budget_usd_per_day"] == 3.0 and mine["limits"]["spent_today_usd"] >= 3.0
            assert mine["limits"]["budget_left_usd"] == 0.0 and set(mine["tenants"]) == {"spend"}
        sent = []
        sdk = openai.OpenAI(base_url=gws[0].base_url + "/v1", api_key="ks", max_retries=3,
                            http_client=httpx.Client(event_hooks={"request": [sent.append]}))
        with pytest.raises(openai.RateLimitError) as exc:
            sdk.completions.create(model=MODEL, prompt="hello", max_tokens=4)
        assert exc.value.body["code"] == exc.value.body["type"] == "insufficient_quota" and len(sent) == 1  # one attempt, not four
        assert all(h.get("x-should-retry") is None for h in headers)  # (an rpm 429 is worth retrying)
        limits = httpx.get(gws[0].base_url + "/usefulwork/stats", headers={"authorization": "Bearer kb"}).json()["limits"]
        left = limits.pop("requests_remaining")  # (as its x-ratelimit-remaining-requests would say now)
        assert limits == {"rpm": 100, "tpm": None, "budget_usd_per_day": None}  # (no other tenant's figures)
        assert 0 <= left <= 100
    finally:
        for g in gws:
            g.stop()
        import redis

        keys = _redis_keys(redis_url, prefix)
        if keys:
            redis.Redis.from_url(redis_url).delete(*keys)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed (make test installs it)")
def test_gateway_keeps_serving_when_redis_dies_and_recovers(sim, tmp_path):
    port = free_port()
    server = _start_redis(port, tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    gw = gateway(sim, tmp_path, tenants={"t": {"key_hashes": [hash_key("k")], "rpm": 10000}},
                 admission={"redis_url": url, "redis_prefix": "uw", "redis_retry_s": 0.5})
    try:
        post = lambda: httpx.post(gw.base_url + "/v1/completions", json=body(1), headers={"authorization": "Bearer k"},
                                  timeout=30).status_code
        assert post() == 200 and _redis_keys(url, "uw")
        server.kill()
        server.wait()
        assert [post() for _ in range(20)] == [200] * 20  # fail-open: per-process limits
        restarted = _start_redis(port, tmp_path)
        try:
            time.sleep(0.6)
            assert post() == 200 and _redis_keys(url, "uw")  # shared again
        finally:
            restarted.kill()
            restarted.wait()
        log = gw.log_path.read_text()
        assert log.count("Redis unreachable") == 1 and "Redis is back" in log
    finally:
        gw.stop()
        if server.poll() is None:
            server.kill()


def test_each_streams_first_token_frees_its_prefill_place_and_teaches_the_prefill_limit(sim, tmp_path):
    """Through the real gateway with the openai SDK: a stream's first event frees its prefill place (the
    proxy's first-token hook) and is a sample of the prefill limit; after ten, the gate is in force.
    Unary answers hold their place until their expected prefill passes or they end."""
    gw = gateway(sim, tmp_path)
    try:
        c = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="k", max_retries=0)
        for i in range(12):
            s = c.completions.create(model=MODEL, prompt=f"{i} " + "x " * 200, max_tokens=8, stream=True,
                                     extra_body={"ignore_eos": True})
            assert sum(1 for _ in s) >= 8
        c.completions.create(model=MODEL, prompt="unary " * 100, max_tokens=8, extra_body={"ignore_eos": True})
        pool = httpx.get(gw.base_url + "/usefulwork/stats").json()["filters"]["admission"]["pools"]["a100"]
        cap = pool["capacity"]
        assert pool["prefill_pending"] == 0 and pool["admitted"] == 13
        assert 0 < cap["prefill_each_s"] < 1.0  # the simulated A100's TTFT for a 200-token prompt: tens of ms
        assert cap["prefill_limit"] >= 1  # ttft target / prefill_each: in force after ten first tokens
    finally:
        gw.stop()


def test_a_unary_only_pool_reads_its_prefill_time_from_the_replicas_metrics(sim, tmp_path):
    """No stream, no first token: the prefill time a unary prompt's place is held for comes from vLLM's
    own ``request_prefill_time_seconds`` on the replica's /metrics, scraped by the gateway."""
    gw = gateway(sim, tmp_path)
    try:
        c = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="k", max_retries=0)
        cap: dict = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # (the figure needs a few scrape intervals with prefills in them)
            c.completions.create(model=MODEL, prompt="unary " * 200, max_tokens=4, extra_body={"ignore_eos": True})
            cap = httpx.get(gw.base_url + "/usefulwork/stats").json()["filters"]["admission"]["pools"]["a100"]["capacity"]
            if cap["live_prefill_s"] is not None:
                break
            time.sleep(0.2)
        assert cap["prefill_each_s"] is None  # nothing learnt from first tokens
        assert 0 < cap["live_prefill_s"] < 1.0  # the simulated A100's prefill of a 200-token prompt: tens of ms
    finally:
        gw.stop()


def test_a_tenants_per_process_cap_refuses_a_third_stream_until_one_ends(sim, tmp_path):
    """``max_inflight_per_process: 2`` through the real gateway on the simulator with the openai SDK: while
    two of the tenant's streams are open, a third gets ``RateLimitError`` (code and reason ``concurrency``,
    a Retry-After); once one stream has ended the next is served; another tenant is never held back."""
    gw = gateway(sim, tmp_path, tenants={"capped": {"key_hashes": [hash_key("kc")], "max_inflight_per_process": 2},
                                         "other": {"key_hashes": [hash_key("ko")]}})
    try:
        capped = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="kc", max_retries=0)
        other = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="ko", max_retries=0)
        streams = [capped.completions.create(model=MODEL, prompt=f"{i} " + "x " * 50, max_tokens=200, stream=True,
                                             extra_body={"ignore_eos": True}) for i in range(2)]
        firsts = [next(iter(s)) for s in streams]  # both are being answered
        assert all(f.choices for f in firsts)
        with pytest.raises(openai.RateLimitError) as exc:
            capped.completions.create(model=MODEL, prompt="third " * 20, max_tokens=4)
        assert exc.value.body["code"] == "concurrency"
        h = exc.value.response.headers
        assert h["x-usefulwork-shed-reason"] == "concurrency" and float(h["retry-after-ms"]) > 0
        assert other.completions.create(model=MODEL, prompt="o " * 20, max_tokens=4).usage.completion_tokens == 4
        assert sum(1 for _ in streams[0]) >= 100  # read to its end: its place is freed when its reply closes
        # (the gateway closes the reply just after its last write: a client as quick as this one may arrive
        # first, and then waits the Retry-After it is told, as the SDK does)
        waits = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="kc", max_retries=2)
        assert waits.completions.create(model=MODEL, prompt="fourth " * 20, max_tokens=4,
                                        extra_body={"ignore_eos": True}).usage.completion_tokens == 4
        streams[1].close()
    finally:
        gw.stop()
