"""The loadtest client honouring Retry-After (a fault-injecting transport) and the admission verdicts."""

from __future__ import annotations

import asyncio
import re
import time

import httpx

from usefulwork.loadtest.admission import _throughput, _throughput_until, burst_figures, jain, per_request
from usefulwork.loadtest.client import DEADLINE_HEADER, send
from usefulwork.loadtest.metrics import SLOSpec
from usefulwork.loadtest.workloads import RequestSpec

SSE = (b'data: {"choices":[{"index":0,"text":"hi"}]}\n\n'
       b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\ndata: [DONE]\n\n')


def run_send(responses: list[httpx.Response], honor: bool, declared: list[int] | None = None):
    seen: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(time.perf_counter())
        if declared is not None:
            declared.append(int(request.headers[DEADLINE_HEADER]))
        return responses[min(len(seen) - 1, len(responses) - 1)]

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            spec = RequestSpec(index=0, endpoint="completions", max_tokens=1, input_tokens=3, prompt="x")
            return await send(c, "http://gw", spec, "m", timeout_s=5, clock0=time.perf_counter(), planned=0.0,
                              honor_retry_after=honor, headers={"x-usefulwork-priority": "batch"}, group="g")

    return asyncio.run(go()), seen


def shed(ms: int) -> httpx.Response:
    return httpx.Response(429, headers={"retry-after": "1", "retry-after-ms": str(ms),
                                        "x-usefulwork-shed-reason": "predicted_wait"}, json={"error": {}})


def test_client_waits_retry_after_ms_then_is_admitted():
    res, seen = run_send([shed(150), httpx.Response(200, content=SSE)], honor=True)
    assert res.outcome == "ok" and res.retries == 1 and res.first_retry == "admitted"
    assert res.retry_after_s == 0.15 and res.shed_reason == "predicted_wait" and res.group == "g"
    assert seen[1] - seen[0] >= 0.15
    assert res.ttft >= 0.15  # counted from the first send, as the user waits


def test_client_declares_on_each_attempt_the_time_it_has_left_for_the_whole_answer():
    """Its timeout (5 s) counts from the first send: the retry, 0.4 s later, has 0.4 s less."""
    declared: list[int] = []
    res, seen = run_send([shed(400), httpx.Response(200, content=SSE)], honor=True, declared=declared)
    assert res.outcome == "ok" and len(declared) == 2
    assert 4900 <= declared[0] <= 5000
    assert declared[1] <= declared[0] - 400 and declared[1] >= declared[0] - 1000


def test_client_without_honouring_stops_at_the_429_and_gives_up_after_max_retries():
    res, seen = run_send([shed(10)], honor=False)
    assert (res.outcome, res.retries, len(seen), res.status) == ("shed", 0, 1, 429)
    res, seen = run_send([shed(10)], honor=True)
    assert (res.outcome, res.retries, res.first_retry, len(seen)) == ("shed", 3, "shed", 4)


def test_client_does_not_wait_out_a_429_that_says_not_to_retry():
    """A spent budget: Retry-After is midnight and x-should-retry is false; the SDKs give up at once, so
    does the load generator (it used to sleep into its timeout and count a timeout)."""
    budget = httpx.Response(429, headers={"retry-after": "40000", "retry-after-ms": "40000000",
                                          "x-should-retry": "false", "x-usefulwork-shed-reason": "budget"},
                            json={"error": {}})
    res, seen = run_send([budget, httpx.Response(200, content=SSE)], honor=True)
    assert (res.outcome, res.retries, len(seen), res.shed_reason) == ("shed", 0, 1, "budget")
    slo = SLOSpec.from_mapping({"ttft_ms": 2000, "tpot_ms": 100, "e2e_ms": 5000, "attainment": 0.95})
    assert per_request([res], slo, 1.0)["told_not_to_retry"] == [False]  # (a spent budget: not for its deadline)
    futile = httpx.Response(429, headers={"retry-after-ms": "20000", "x-should-retry": "false",
                                          "x-usefulwork-shed-reason": "client_timeout"}, json={"error": {}})
    res, seen = run_send([futile, httpx.Response(200, content=SSE)], honor=True)
    assert (res.outcome, res.retries, len(seen)) == ("shed", 0, 1)
    assert per_request([res], slo, 1.0)["told_not_to_retry"] == [True]  # (results count it apart)
    res, _ = run_send([shed(10), httpx.Response(200, content=SSE)], honor=True)
    assert per_request([res], slo, 1.0)["told_not_to_retry"] == [False]


def test_burst_figures_and_jain():
    slo = SLOSpec.from_mapping({"ttft_ms": 2000, "tpot_ms": 100, "e2e_ms": 5000, "attainment": 0.95})
    from usefulwork.loadtest.client import RequestResult

    ok = RequestResult(index=0, kind="", planned=1.0, sent=1.0, end=3.0, ttft=0.5, output_tokens=100, status=200)
    late = RequestResult(index=1, kind="", planned=20.0, sent=20.0, end=26.0, ttft=0.5, output_tokens=100, status=200)
    sh = RequestResult(index=2, kind="", planned=2.0, sent=2.0, end=2.01, outcome="shed", status=429,
                       retry_after_s=1.0, shed_s=0.01)
    results = [ok, late, sh]
    r = {"outcomes": [x.outcome for x in results], "ttfts": [x.ttft for x in results],
         "latencies": [x.e2el for x in results], "start_times": [x.sent for x in results],
         "output_lens": [10, 10, 0], "input_lens": [5, 5, 5], "duration": 45.0,
         "per_request": per_request(results, slo, 0.5)}
    f = burst_figures(r, slo, {"process": "onoff", "period_s": 45, "duty": 0.2, "base_rate": 1, "peak_rate": 2})
    assert (f["served"], f["shed"], f["timeouts"]) == (2, 1, 0)
    assert f["attainment_served"] == 0.5 and f["unserved_all_429_with_retry_after"]
    assert abs(f["shed_answer_p99_wall_ms"] - 20.0) < 1e-9  # 0.01 simulated s at time scale 0.5
    assert f["goodput_in_peaks_per_s"] == 1 / 9.0  # one good request in the single 9 s peak
    assert jain([1, 1, 1, 1]) == 1.0 and abs(jain([1, 0, 0, 0]) - 0.25) < 1e-12


def test_backend_throughput_counts_the_tokens_made_while_the_overload_is_offered():
    # three streams: one ends inside the 10 s of arrivals; one starts inside and ends in the drain (two
    # tokens a chunk); one abandoned in the drain (its usage never came: a chunk a token); one shed
    r = {"start_times": [1.0, 8.0, 9.0, 9.5], "ttfts": [1.0, 1.0, 0.5, 0.0],
         "itls": [[1.0] * 4, [1.0] * 4, [2.0] * 3, []], "output_lens": [5, 10, 0, 0],
         "total_output_tokens": 15, "duration": 20.0, "per_request": {"wasted_chunks": [0, 0, 4, 0]}}
    # by 10 s: all 5 of the first, chunks at 9 and 10 s of the second (4 tokens), the third's first chunk at 9.5 s
    assert _throughput_until(r, 10.0) == (5 + 4 + 1) / 10.0
    assert _throughput_until(r, 100.0) == (5 + 10 + 4) / 100.0  # every token, once
    assert _throughput(r) == (15 + 4) / 20.0  # the whole cell, drain included
    assert _throughput_until(r, 0.0) == 0.0


def test_admission_experiment_is_valid_and_plans_its_cells():
    from usefulwork.loadtest.experiment import Options, gateway_config, load_experiment, plan

    exp = load_experiment("admission")
    cells = [(p.name, c.name) for p, _, c in plan(exp, Options())]
    assert ("optimized-batched-admission-off", "burst") in cells and ("optimized-batched-admission-on", "burst") in cells
    assert ("optimized-batched-admission-on", "capacity-10") not in cells  # per-case profile selection
    on = next(p for p in exp.profiles if p.name.endswith("admission-on"))
    cfg = gateway_config(exp, on, "http://127.0.0.1:1", 1)
    # the filter's defaults but the prefill pieces (off by default: 64-token pieces, three per replica at a time,
    # the setting docs/admission.md gives for this engine); its workload times in wall seconds as the SLO
    # (time scale 0.5)
    assert cfg["filters"] == ["admission"] and cfg["slo"]["ttft_ms"] == 4000.0
    assert cfg["admission"] == {"deadline_ms": {"batch": 120000.0}, "tenant_active_s": 60.0,
                                "low_band_prefill_chunk": 64, "low_band_prefills": 3}
    from usefulwork.config import from_mapping

    loaded = from_mapping(cfg, environ={})
    assert loaded.tenants["heavy"].key_hashes and loaded.admission.deadline_ms["batch"] == 120000.0
    # admission on: the simulated replica schedules by priority and the gateway's pool knows it; off: neither
    assert on.sim_overrides["scheduling_policy"] == "priority" and cfg["pools"][0]["scheduling_policy"] == "priority"
    off = next(p for p in exp.profiles if p.name.endswith("admission-off"))
    assert "scheduling_policy" not in gateway_config(exp, off, "http://127.0.0.1:1", 1)["pools"][0]


def _launched(load):
    """(client, planned offset, prompt) of every request an open-loop run sends (the send itself replaced)."""
    from usefulwork.loadtest import workloads
    from usefulwork.loadtest.runner import Runner, Target

    wl = workloads.from_spec({"type": "synthetic", "prompt_tokens": 8, "output_tokens": 2})
    r = Runner(Target("http://gw", "m"), wl, load)
    out = []
    r._launch = lambda http, spec, planned, clock0, client=None: out.append((client["name"], planned, spec.prompt))
    asyncio.run(r._open_loop(None, time.perf_counter()))
    return out


def test_only_clients_sends_those_clients_requests_at_the_times_they_have_in_the_whole_mix():
    """A baseline cell (``traffic_of``) is the loaded cell's own traffic less the other clients: the same
    arrival times for the clients it keeps, and prompts of its own (no prefix cache carries over)."""
    from usefulwork.loadtest import arrivals
    from usefulwork.loadtest.runner import LoadSpec

    mix = [{"name": "interactive", "weight": 1}, {"name": "batch", "weight": 3}]
    full = _launched(LoadSpec(arrival=arrivals.Poisson(400.0), duration_s=0.2, clients=mix, seed=5))
    alone = _launched(LoadSpec(arrival=arrivals.Poisson(400.0), duration_s=0.2, clients=mix, seed=9, schedule_seed=5,
                               only_clients=["interactive"]))
    kept = [(c, t) for c, t, _ in full if c == "interactive"]
    assert len(kept) >= 10 and len(full) > 2 * len(kept)
    assert [(c, t) for c, t, _ in alone] == kept
    assert not {p for *_, p in alone} & {p for *_, p in full}
    # without a schedule seed, another seed is other traffic
    other = _launched(LoadSpec(arrival=arrivals.Poisson(400.0), duration_s=0.2, clients=mix, seed=9,
                               only_clients=["interactive"]))
    assert [(c, t) for c, t, _ in other] != kept


def test_traffic_of_takes_the_other_cases_traffic_and_rejects_what_would_contradict_it(tmp_path):
    import pytest
    import yaml

    from usefulwork.loadtest.experiment import ExperimentError, load_experiment

    exp = load_experiment("admission")
    shape = exp.shapes[0]
    for base, loaded, keep in (("priority-unloaded", "priority-2x", ["interactive"]),
                               ("fairness-alone", "fairness-4", ["q1", "q2", "q3"])):
        c, src = exp.case_for(shape, base), exp.case_for(shape, loaded)
        assert (c.schedule_case, c.only_clients) == (loaded, keep)
        assert (c.arrival, c.clients, c.duration_s) == (src.arrival, src.clients, src.duration_s)
    raw = yaml.safe_load(open(exp.source))
    bad = [({"case": "nope", "clients": ["interactive"]}, "no case 'nope'"),
           ({"case": "priority-2x", "clients": ["q9"]}, "no client(s) q9"),
           ({"case": "priority-2x"}, "exactly 'case'"),
           ({"case": "y", "clients": ["default"]}, "needs an arrival process and clients")]
    y = {"concurrency": 2, "duration_s": 5, "clients": [{"name": "default"}]}  # closed loop: no arrivals to share
    for ref, msg in bad:
        r = dict(raw, cases=dict(raw["cases"], x={"traffic_of": ref, "timeout_s": 60}, y=y))
        p = tmp_path / "e.yaml"
        p.write_text(yaml.safe_dump(r))
        with pytest.raises(ExperimentError, match=re.escape(msg)):
            load_experiment(str(p)).case_for(shape, "x")
    r = dict(raw, cases=dict(raw["cases"], x={"traffic_of": {"case": "priority-2x", "clients": ["interactive"]},
                                               "arrival": {"process": "poisson", "rate": 2.0}}))
    p.write_text(yaml.safe_dump(r))
    with pytest.raises(ExperimentError, match="arrival comes from traffic_of"):
        load_experiment(str(p)).case_for(shape, "x")


def test_the_fairness_verdict_says_how_many_first_tokens_each_quiet_tenants_p99_is_of():
    """A quiet tenant sends a few dozen requests in the fairness cell: its p99 is nearly its slowest, and the
    verdict says of how many (served) first tokens, loaded and alone; a shed request has no first token."""
    from usefulwork.loadtest.admission import verdicts
    from usefulwork.loadtest.experiment import load_experiment

    exp = load_experiment("admission")
    on = exp.compare["admission"]["profile_on"]

    def cell(case, rows):
        keys = ("outcomes", "ttfts", "latencies", "start_times", "output_lens", "input_lens")
        res = {k: [r[i] for r in rows] for i, k in enumerate(keys)} | {"per_request": {"group": [r[-1] for r in rows]}}
        return {"case": case, "profile": on, "result": res}

    loaded = [("ok", 0.1 + i / 100, 1.0, i, 128, 512, q) for q in ("q1", "q2", "q3") for i in range(20)]
    loaded += [("shed", None, None, 0, 0, 512, "q1"), ("ok", 0.3, 2.0, 0, 128, 512, "heavy")]
    alone = [("ok", 0.1, 1.0, i, 128, 512, q) for q in ("q1", "q2", "q3") for i in range(18)]
    v = verdicts(exp, [cell("fairness-4", loaded), cell("fairness-alone", alone)])
    q1 = v["fairness"]["quiet"]["q1"]
    assert (q1["requests"], q1["alone_requests"]) == (20, 18)
    assert abs(q1["ttft_p99_s"] - (0.1 + 18.81 / 100)) < 1e-9 and abs(q1["ratio"] - q1["ttft_p99_s"] / 0.1) < 1e-9
    assert v["checks"]["quiet_ttft_p99_le_1_2x"] is False
