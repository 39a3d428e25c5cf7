"""The autoscaling what-if (usefulwork/loadtest/autoscale.py) on a short virtual day: every request
accounted for, fleets billed as they ran, the HPA within its bounds, admission shedding instead of
timing out; and the CLI's exact experiment name. Real simulator engines, no mocks; seconds of CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from usefulwork.loadtest.autoscale import Client, Day, Fleet, policies, run

DAY = Day(day_s=150.0, base_rate=8.0, peak_rate=24.0)  # 3x the base from "9 h" to "19 h": ~60 s of 24 req/s
FLEET = Fleet(cold_start_s=30.0)


@pytest.fixture(scope="module")
def short_day():
    return run(DAY, FLEET, Client(timeout_s=20.0), workers=1)


def test_every_policy_serves_the_same_requests_and_accounts_for_each(short_day):
    results = {r["policy"]: r for r in short_day["policies"]}
    assert set(results) == {p.name for p in policies(DAY, FLEET)}
    n = len(DAY.arrivals())
    assert n > 500
    for r in results.values():
        assert r["requests"] == n
        assert r["successful"] + r["timeouts"] + r["sheds"] + r["errors"] + r["aborted_by_scale_down"] == n
        assert r["failed"] == n - r["successful"]
        assert r["slo_good"] <= r["successful"]
        assert r["slo_attainment"] == pytest.approx(r["slo_good"] / n)
        if r["slo_good"]:
            assert r["usd_per_1k_slo_good"] == pytest.approx(r["cost_usd"] / r["slo_good"] * 1e3)
        assert r["cost_usd"] == pytest.approx(r["replica_hours"] * FLEET.usd_per_hour)


def test_fixed_fleets_are_billed_for_every_replica_all_run(short_day):
    for r in short_day["policies"]:
        if r["policy"].startswith("fixed-"):
            size = next(p.fixed for p in policies(DAY, FLEET) if p.name == r["policy"])
            assert r["replica_hours"] == pytest.approx(size * r["duration_s"] / 3600.0)
            assert r["sheds"] == 0  # no admission in front of them
    peak = next(r for r in short_day["policies"] if r["policy"] == "fixed-peak")
    assert peak["slo_attainment"] >= 0.95 and peak["timeouts"] == 0


def test_autoscaled_fleets_stay_within_the_hpa_bounds_and_admission_sheds_rather_than_times_out(short_day):
    by = {r["policy"]: r for r in short_day["policies"]}
    for name in ("hpa-vllm-queue", "hpa-gateway-queue"):
        assert by[name]["replicas_min"] >= FLEET.min_replicas and by[name]["replicas_max"] <= FLEET.max_replicas
    g = by["hpa-gateway-queue"]
    assert g["timeouts"] == 0
    assert g["replicas_max"] > FLEET.min_replicas  # the day's rise scaled it out
    assert by["hpa-vllm-queue"]["sheds"] == 0
    v = short_day["verdict"]
    assert v["checked"] and set(v["checks"]) == {"slo_attainment >= target", "zero timeouts",
                                                 "replica-hours <= 60% of fixed-peak", "failed <= seed HPA's / 10"}


def test_admission_reads_each_replicas_live_decode_speed_as_the_gateway_scrapes_it(short_day):
    # The replicas' vllm:inter_token_latency_seconds, read through the gateway's own Replica record
    # (Replica.itl_live): admission prices a queued request's service at it. Without it the what-if
    # judged a gateway blind to the decode speed now, which the real one is not (the day: 364 failed
    # blind, 526 for the gateway that priced at the slowest replica, 396 at the replicas' mean).
    g = next(r for r in short_day["policies"] if r["policy"] == "hpa-gateway-queue")
    live = [p["live_tpot_s"] for p in g["timeline"] if p["live_tpot_s"] is not None]
    assert len(live) >= len(g["timeline"]) // 2
    assert all(0.005 < x < 0.1 for x in live)  # an A100's 8B decode: tens of ms per token
    assert all(p["live_tpot_s"] is None for r in short_day["policies"] if r["policy"] != "hpa-gateway-queue"
               for p in r["timeline"])


@pytest.mark.slow
def test_cli_runs_the_autoscale_experiment_by_name(tmp_path):
    out = tmp_path / "as"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-m", "usefulwork.cli", "loadtest", "--experiment", "autoscale",
                           "--time-scale", "0.02", "--out-dir", str(out)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((out / "results.json").read_text())
    assert [p["policy"] for p in data["policies"]] == ["fixed-peak", "fixed-mean", "hpa-vllm-queue", "hpa-gateway-queue"]
    assert data["day"]["day_s"] == pytest.approx(Day().day_s * 0.02)
    assert "hpa-gateway-queue" in proc.stdout + proc.stderr


def test_replica_hour_bound_grows_with_compression():
    from usefulwork.loadtest.autoscale import replica_hour_bound

    real = replica_hour_bound(Day(day_s=86400.0), Fleet(), 5)
    compressed = replica_hour_bound(Day(day_s=1440.0), Fleet(), 5)
    assert 0.0 < real["needed"] <= real["with_windows"] <= 1.0
    assert real["needed"] == pytest.approx(compressed["needed"], abs=0.01)  # the same day's shape
    assert real["with_windows"] - real["needed"] < 0.02  # 300 s windows are nothing in a real day
    assert compressed["with_windows"] > real["with_windows"] + 0.1  # ... and a lot in a 24-minute one


def test_the_gateway_policy_target_is_three_quarters_of_what_a_replica_holds_at_its_slo_capacity(monkeypatch):
    # One replica at its SLO capacity (10 req/s, the fleet's replica_capacity_rps) under the day's
    # bursty arrivals: it meets the SLO, and by Little's law holds rate x mean E2E requests in flight.
    # The HPA's per-pod target (and deploy/k8s/'s) is 75% of that: a model or engine change that moves
    # it is caught here.
    from usefulwork.loadtest import autoscale

    monkeypatch.setattr(autoscale, "ENVELOPE", ((0.0, 1.0), (24.0, 1.0)))  # a flat day
    fleet = Fleet()
    day = Day(day_s=600.0, base_rate=fleet.replica_capacity_rps, peak_rate=fleet.replica_capacity_rps)
    sim = autoscale.Simulation(autoscale.Policy("one", "one replica", fixed=1), day, fleet, Client(), autoscale.SLO)
    res = sim.run()
    assert res["slo_attainment"] >= 0.95 and res["timeouts"] == 0
    e2e = [r.e2e for r in sim.requests if r.e2e is not None]
    in_flight = fleet.replica_capacity_rps * sum(e2e) / len(e2e)
    assert 0.65 <= autoscale.GATEWAY_QUEUE_TARGET / in_flight <= 0.85, in_flight


def test_clients_set_each_requests_tenant_and_retries_and_the_first_retry_is_recorded():
    """The burst-retry cell of benchmarks/admission_virtual.py: clients of one tenant never retry, another
    tenant's clients wait out Retry-After; every first retry ends admitted or shed, and only the
    retrying tenant's places are learnt as taken back."""
    from usefulwork.loadtest.autoscale import SLO, Policy, Simulation

    day = Day(day_s=30.0, base_rate=24.0, peak_rate=24.0, seed=1)  # 2x one replica's capacity, 6x from 9 "h" (11 s)
    sim = Simulation(Policy("one", "one replica", fixed=1, admission=True), day, FLEET, Client(max_retries=3), SLO)
    sim.clients = lambda t0: ("gone", 0) if t0 < 10.0 else ("back", None)
    r = sim.run()
    assert r["sheds"] > 0
    gone = [q for q in sim.requests if q.t0 < 10.0]
    back = [q for q in sim.requests if q.t0 >= 10.0]
    assert all(q.tenant == "gone" and q.attempts == 1 and not q.first_retry for q in gone)
    retried = [q for q in back if q.attempts > 1]
    assert len(retried) > 20 and all(q.first_retry in ("admitted", "shed") for q in retried)
    assert all(q.first_retry == "" for q in back if q.attempts == 1)
    assert {q.first_retry for q in retried} == {"admitted", "shed"}  # (this much overload sheds some again)
    assert sim.queue.returns["back"][0] > 1.0 and sim.queue.returns["gone"][0] == 0.0  # taken back (decayed count)
    assert sim.queue.retries_honoured == sum(q.attempts - 1 for q in retried)  # every retry found its place
    # (clients that retry number their attempts, as the OpenAI SDKs do; the load generator's that never
    # retry do not, as the loadtest's client that does not honour Retry-After sends no number)
    assert sim.queue.numbered == {"gone": 0.0, "back": 1.0}


def test_most_first_retries_of_the_burst_retry_cell_are_admitted():
    """benchmarks/admission_virtual.py --retry, the admission experiment's burst-retry cell on the simulated
    engine's virtual clock (25 req/s for 9 s against ~11.8 of capacity, clients that wait out Retry-After):
    at least 85% of first retries admitted over seeds 1-4 (the target is 80%). The simulated vLLM runs a
    burst's prefills first, so requests admitted over a second and a half end together: with each slot
    priced from its request's start, 75.4% were (521 of 691; 72 / 83 / 79 / 64% per seed); from each
    stream's first token plus its decode, 90.9% (738 of 812; 86 / 90 / 95 / 91%)."""
    from benchmarks import admission_virtual as av

    cells = [av.retry_cell(seed) for seed in (1, 2, 3, 4)]
    first = sum(c["first_retries"] for c in cells)
    admitted = sum(c["admitted_on_first_retry"] for c in cells)
    assert first > 500 and admitted / first >= 0.85, (admitted, first)
    assert all(c["attainment_served"] >= 0.95 for c in cells)


def test_a_recorded_real_burst_replays_its_live_cut_and_the_tpot_hold_band_serves_more_of_it_within_the_slo(monkeypatch):
    """benchmarks/admission_virtual.py --burst: session 48's real CPU vLLM burst (F = 1.65) on its probe's
    fitted steps, with the run's own arrivals (seed 0). Judged against 0.75 of the TPOT SLO, the live cut took
    the SLO limit from 27 to 20.7 per replica at 23 in flight, as it did on the real server, and 45 of 63 were
    served (45 there); with the hold band (cut only over 0.86 of the SLO), 52, every one within the SLO. A
    pool held at 28 served 53 within the SLO: the band's limit is near the best fixed one."""
    import json
    from pathlib import Path

    from benchmarks import admission_virtual as av
    from usefulwork.gateway.admission import capacity
    from usefulwork.loadtest import autoscale

    for owner, name in ((autoscale, "AdmissionCfg"), (autoscale, "Capacity"), (capacity.Capacity, "tail")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # (``with_rule`` patches them: restored after)
    run = json.loads((Path(__file__).resolve().parents[2] / "docs/bench/admission-vllm-results-s48b.json").read_text())
    before = av.probed_burst_cell(0, run, av.with_rule("tail:0.75:0.75"), margin=0.0)
    band = av.probed_burst_cell(0, run, av.with_rule("tail:0.75"), margin=0.0)
    assert before["sent"] == band["sent"] == 63 and before["timeouts"] == band["timeouts"] == 0
    assert abs(before["served"] - 45) <= 2 and before["attainment_served"] == 1.0
    assert band["served"] >= before["served"] + 5 and band["attainment_served"] == 1.0
    assert band["goodput_per_s"] > 1.05 * before["goodput_per_s"]


def test_a_fast_hosts_burst_at_its_written_length_is_the_overload_it_was_sized_to_be(monkeypatch):
    """Session 51's AMX host (F = 2.32) on its probe's fitted steps, the run's own arrivals (seed 0) and a
    fresh draw. Squeezed into 1/F of its length, as that run sent it, the burst left admission off a
    backlog it drained within the 30 s SLO (all 63 served within it, there and here), so "goodput above
    admission off" could not be met. At its written length (experiment.clock_for: rates x F over the same
    seconds) admission off lets most of its answers miss the SLO, and admission on serves what it admits
    within it, at several times off's goodput."""
    import json
    from pathlib import Path

    from benchmarks import admission_virtual as av
    from usefulwork.gateway.admission import capacity
    from usefulwork.loadtest import autoscale
    from usefulwork.loadtest.experiment import clock_for

    for owner, name in ((autoscale, "AdmissionCfg"), (autoscale, "Capacity"), (capacity.Capacity, "tail")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # (``with_rule`` patches them: restored after)
    run = json.loads((Path(__file__).resolve().parents[2] / "docs/bench/admission-vllm-results-s51.json").read_text())
    squeezed = av.probed_burst_cell(0, run, None, margin=0.0)
    assert squeezed["sent"] == 63 and squeezed["attainment_served"] == 1.0  # as the real run: no overload
    run["calibration"]["time_scale"] = clock_for(run["calibration"]["rate_scale"])
    for seed in (0, 1):
        off = av.probed_burst_cell(seed, run, None, margin=0.0)
        on = av.probed_burst_cell(seed, run, av.with_rule("tail:0.75"), margin=0.0)
        assert off["sent"] > 2 * squeezed["sent"] and off["attainment_served"] < 0.5, off
        assert on["attainment_served"] == 1.0 and on["timeouts"] == 0, on
        assert on["goodput_per_s"] > 4 * off["goodput_per_s"], (on, off)


def test_first_retries_are_admitted_behind_gateways_that_do_not_share_their_held_places():
    """The same cell behind three gateway processes and a round-robin load balancer (each attempt to the
    next): a client's retry reaches another gateway than the one that shed it, which holds no place for
    it. Priced there as a first attempt, 41.9% of first retries were admitted over seeds 1-24; taking
    the place held there longest for its tenant (its SDK says it is a retry), 82.9% (85% or more over
    seeds 1-4)."""
    from benchmarks import admission_virtual as av

    cells = [av.retry_cell(seed, gateways=3, lend=False) for seed in (1, 2, 3, 4)]
    first = sum(c["first_retries"] for c in cells)
    admitted = sum(c["admitted_on_first_retry"] for c in cells)
    assert first > 500 and admitted / first >= 0.85, (admitted, first)
    assert all(c["attainment_served"] >= 0.95 for c in cells)


def test_gateways_that_lend_each_other_places_admit_more_first_retries():
    """The same three gateway processes exchanging places (admission.lend_places, the default with Redis;
    lending.PlaceLedger): a retry claims the place held for it by the process that shed it (that process lets
    it go, or lends it where the retry finds no slot near where it arrives), or takes a place another process
    frees within its budget, and the lender leaves the slot idle until the loan is given back. Over seeds
    1-4: 91.0% -> 96.1% of first retries admitted (94.3% with next places lent alone, session 53); since session
    59 a process owes a retry the slot a new request took early whether or not it lends (``PoolQueue._owed_slot``),
    and the processes that lend nothing admit 92.9%, those that lend 96.5%. The places
    let go at once are filled, so the replica runs fuller: 5 of seed 1's 269 answers ended 0.06-0.18 s past
    the 5 s E2E SLO (98.1%; the issue's bar is 95%). On the wall clock, seeds 1-5: docs/benchmarks.md
    section 7, sessions 53 and 54."""
    from benchmarks import admission_virtual as av

    def share(lend: bool) -> tuple[float, list]:
        cells = [av.retry_cell(seed, gateways=3, lend=lend) for seed in (1, 2, 3, 4)]
        return sum(c["admitted_on_first_retry"] for c in cells) / sum(c["first_retries"] for c in cells), cells

    (alone, _), (lent, cells) = share(False), share(True)
    assert lent >= 0.95 and lent > alone + 0.03, (alone, lent)
    assert all(c["attainment_served"] >= 0.98 for c in cells)


def test_the_burst_retry_cell_on_a_recorded_cpu_vllm_keeps_the_loadtest_clients_timeout():
    """benchmarks/admission_virtual.py --retry --probe: the admission-vllm experiment's capacity-0.6, burst
    and burst-retry cells on a recorded real run's CPU vLLM replica, at its scale. The loadtest client's
    30 s count from the first send: no attempt ends later, and a shed whose Retry-After would outlast them
    is told not to retry (``x-should-retry: false``: the clients declare their deadline for all attempts),
    and is not (until session 55 it slept into its timeout); no request times out, every retrying request
    ends served or shed; the gateway learns the answers' length from each answer's completion
    tokens, as the filter does from vLLM's usage, so a live cut judged at a full pool's turnover is
    rescaled (without them every live cut went in proportion, to 5.9 per replica in seed 1)."""
    from benchmarks import admission_virtual as av
    from tests.loadtest.test_admission_clock import S43
    from usefulwork.gateway.admission import queue as queue_mod

    told: list[tuple[float, float, float]] = []  # (t0, shed at, Retry-After) of the retrying tenant's first sheds
    offer = queue_mod.PoolQueue.offer

    def spy(self, t, now):  # noqa: ANN001, ANN202
        d = offer(self, t, now)
        if t.tenant == "retrying" and d.kind == "shed" and t.retried == 0:
            told.append((t.arrival, now, d.retry_after_s))
        return d

    queue_mod.PoolQueue.offer = spy
    caps: list = []
    add = av.ProbedSim._add_replica

    def keep(self, ready_at):  # noqa: ANN001, ANN202
        add(self, ready_at)
        caps.append(self)

    av.ProbedSim._add_replica = keep
    try:
        cell = av.probed_retry_cell(1, S43)
    finally:
        queue_mod.PoolQueue.offer = offer
        av.ProbedSim._add_replica = add
    sim = caps[0]
    reqs = [r for r in sim.requests if r.tenant == "retrying"]
    assert len(reqs) == cell["sent"] > 20 and cell["first_retries"] > 5 and cell["timeouts"] == 0
    assert all(r.outcome in ("ok", "shed") for r in reqs)
    assert all(r.e2e <= 30.0 + 1e-9 for r in reqs if r.outcome == "ok")  # (counted from the first send)
    for t0, at, ra in told:
        (r,) = [r for r in reqs if abs(r.t0 - t0) < 1e-9]
        if at + ra >= t0 + 30.0:
            assert r.attempts == 1 and r.outcome == "shed" and r.ticket.final
    assert sim.queue.capacity.out_mean == 128.0
    assert cell["admitted_on_first_retry"] <= cell["first_retries"]


def test_first_retries_are_admitted_on_the_recorded_cpu_vllm_replicas():
    """The burst-retry cell on four recorded real runs' CPU vLLM replicas (sessions 27, 29, 35 and 43's
    hosts), seeds 1-6 each: a slot is held 10-20 s there, so no held place ends before the whole first
    wave of sheds is told its Retry-After, priced on the return prior alone. The retrying clients number
    their attempts (an SDK that retries by default): their places count in full, and at least 80% of the
    first retries that could still be answered in time are admitted on every host. At half (the prior for
    clients that do not say), 57-72%.

    The clients declare the time they have left, their retries included (their 30 s counts from the first
    send: ``x-usefulwork-deadline-ms``). A retry that comes back with too little of it left for even a
    quick answer (its prefill, and its decode at the load now) is shed with ``client_timeout``, at a free
    slot too, and not counted here: no admission could answer it in time. Until session 54 they were
    admitted, and answered after their clients had left: 57 of the 75 first retries admitted on s43's
    replica. Since session 55 a shed whose retry could not end in that time, even quickly from the place
    its Retry-After names, is told not to retry (``x-should-retry: false``) and no place is held for it:
    where those clients slept out their Retry-After into their own timeout (78-97 timeouts a host, seeds
    1-6), none times out, and of the first retries made, 24 of 24, 30 of 31, 35 of 35 and 30 of 43 are
    admitted (s43: 21 of 88 before); served 124 / 124 / 133 / 114 -> 121 / 128 / 137 / 122. With the live
    decode's mean rescaled as its peak is (``Capacity.judge_live``): 40 of 40, 38 of 39, 36 of 37 and 27
    of 47; served 132 / 137 / 139 / 118."""
    import json
    from pathlib import Path

    from benchmarks import admission_virtual as av

    bench = Path(__file__).resolve().parents[2] / "docs" / "bench"
    for host in ("s27", "s29", "s35d", "s43"):
        results = {"calibration": json.loads((bench / f"admission-vllm-results-{host}.json").read_text())["calibration"]}
        cells = [av.probed_retry_cell(seed, results) for seed in range(1, 7)]
        first = sum(c["first_retries"] - c["first_retry_client_timeout"] for c in cells)
        admitted = sum(c["admitted_on_first_retry"] for c in cells)
        assert first > 20 and admitted / first >= 0.8, (host, admitted, first)
        assert sum(c["admitted_then_timed_out"] for c in cells) == 0
        assert sum(c["timeouts"] for c in cells) == 0 and sum(c["told_not_to_retry"] for c in cells) > 20


def test_a_gateway_restarted_beside_a_full_replica_prices_its_slots_at_what_requests_take_now():
    """benchmarks/admission_virtual.py --restart: a gateway replaced by a cold one while the replica is full
    and a burst of retrying clients arrives. The cold gateway has timed no request of its own. It prices a
    slot of a stream whose first token it saw from that token plus the decode at the replica's live speed,
    and any other slot at the replica's own request time (vllm:e2e_request_latency_seconds, read through
    the gateway's own Replica record). Priced at the 30 s E2E SLO instead (the rule before both), shed
    clients were told to come back in 45 s and took 11.8 s from their first send where 7.4 s would do.
    Without the replica's request time (``server_figure=False``) the first tokens alone now price the
    slots: told 7.8 s, 7.2 s from the first send (with it: 8.1 s and 6.8 s). (Since the TPOT hold band,
    ``tpot_cut_fraction``, the blind gateway sheds nobody in seed 1's first 10 s: seed 7's is judged, whose
    clients take 10.5 s from their first send, 10.3 s before the band.)"""
    from benchmarks import admission_virtual as av

    slo = av.RESTART_SLOS["e2e-30s"]
    seen = av.restart_cell(1, slo, server_figure=True)
    blind = av.restart_cell(7, slo, server_figure=False)
    for r in (seen, blind):
        assert r["told"] and r["told_max_s"] < 10.0  # at what the replica's requests take (~4 s), not the SLO
        assert r["served"] >= 0.95 * r["sent"] and r["timeouts"] == 0
    assert seen["mean_e2e_from_first_send_s"] < 9.0


def test_a_gateway_restarted_beside_a_full_replica_keeps_the_slo_of_what_it_admits():
    """The same restart at the admission experiment's SLO (E2E 5 s for 128 tokens): the cold gateway's slow
    start grew its limit from 41 to 117 on first tokens at a decode speed fast for the TPOT target and too
    slow for the E2E one, and 75-85% of what it served met the SLO (a warm gateway: 100%)."""
    from benchmarks import admission_virtual as av

    r = av.restart_cell(1, av.RESTART_SLOS["experiment"], server_figure=True)
    assert r["timeouts"] == 0 and r["served"] >= 0.95 * r["sent"]
    assert r["attainment_served"] >= 0.95


def test_the_what_if_client_waits_out_the_retry_afters_the_installed_openai_sdk_honours():
    """The what-if's clients are OpenAI SDK clients: they wait out a 429's Retry-After up to the installed
    SDK's own limit (openai-python 3.x: two minutes, ``MAX_RETRY_AFTER_DELAY``) and give up past it, the
    figure the gateway holds no place beyond (``SDK_RETRY_AFTER_MAX_S``). (The client gave up past 60 s,
    the older SDKs' figure, where 3.x waits.)"""
    from openai._constants import MAX_RETRY_AFTER_DELAY

    from usefulwork.gateway.admission.queue import SDK_RETRY_AFTER_MAX_S
    from usefulwork.loadtest.autoscale import SLO, Policy, Req, Simulation

    assert SDK_RETRY_AFTER_MAX_S == MAX_RETRY_AFTER_DELAY
    sim = Simulation(Policy("one", "one replica", fixed=1, admission=True), DAY, FLEET, Client(), SLO)
    for told, retried in ((90.0, True), (MAX_RETRY_AFTER_DELAY, True), (MAX_RETRY_AFTER_DELAY + 1.0, False)):
        sim.sends.clear()
        req = Req(id=1, t0=sim.now, attempts=1)
        sim._shed(req, told)
        assert (req.outcome, [(t, r) for t, _, r in sim.sends]) == (
            (None, [(sim.now + told, req)]) if retried else ("shed", []))
