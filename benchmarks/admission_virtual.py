"""Admission's decision rules on the simulated engine's virtual clock: deterministic, seconds of CPU.

The admission filter's own ``PoolQueue`` and ``Capacity`` (usefulwork/gateway/admission/) in front of
one simulated A100-80G serving Llama-3.1-8B (512 prompt / 128 output tokens; SLO TTFT 2 s, TPOT
100 ms, E2E 5 s), driven by the autoscale what-if's event loop (usefulwork/loadtest/autoscale.py) with a
fixed fleet of one replica, no HTTP and no wall clock: host noise cannot move these figures, so rules
can be compared here before the wall-clock experiment (`usefulwork loadtest --experiment admission`).

Workloads: the seed's burst (2 -> 25 req/s, 45 s period) at 20% and 40% duty, 90 s, two seeds each;
steady Poisson overload at 12, 14 and 24 req/s, 120 s. Per cell: goodput (SLO-meeting answers per
second), SLO attainment of the answers served, p95 E2E of served. Admission off is run once per
workload as the reference; capacity at the SLO is the best goodput of admission off among steady rates
that met the SLO (10-13 req/s).

    python benchmarks/admission_virtual.py                          # the shipped defaults
    python benchmarks/admission_virtual.py --rule tail:0.75 --rule tail:0.9 --rule mean:0.7
    python benchmarks/admission_virtual.py --classes --seeds 1-6    # the priority and fairness cells
    python benchmarks/admission_virtual.py --classes --probe docs/bench/admission-vllm-results-s43.json
    python benchmarks/admission_virtual.py --classes --pieces 64 --probe docs/bench/admission-vllm-results-s59b.json
    python benchmarks/admission_virtual.py --burst --probe docs/bench/admission-vllm-results-s48b.json --seeds 0 --margin 0
    python benchmarks/admission_virtual.py --retry --seeds 1-6      # the burst-retry cell
    python benchmarks/admission_virtual.py --retry --gateways 3     # ... behind three round-robin gateways
    python benchmarks/admission_virtual.py --retry --gateways 3 --no-lend  # ... lending each other no places
    python benchmarks/admission_virtual.py --retry --probe docs/bench/admission-vllm-results-s59.json --probe ...  # recorded hosts
    python benchmarks/admission_virtual.py --restart --seeds 1-6    # the same clients against a restarted gateway

``--classes`` runs the experiment's priority cell (24 req/s, one interactive request for three batch ones)
and fairness cell (four equal-weight tenants, one sending 30x) on the same clock
(usefulwork/loadtest/admission_clock.py), per seed, with the shipped settings and with the low-band
prefill gate off (``low_band_prefills: 0``): interactive TTFT p99 against the same interactive arrivals
alone, the engine's output tokens/s against admission off, each quiet tenant's TTFT p99 against its
arrivals alone, and the floor of that ratio (``admission_clock.floor_p99``: every quiet prompt admitted at
once and prefilled alone in the next step, waiting only for the API front-end and the step in progress,
cut to one prompt's prefill, on the same run's steps): where the floor is over 1.2x, no gateway that keeps
the engine as busy meets the target with whole-prompt steps. ``--pieces TOKENS`` adds a third variant,
low-band prompts prefilled in pieces through the prefix cache (``low_band_prefill_chunk``), which changes
the steps themselves: a top-band prompt then waits for one piece, not for a whole low-band prompt.

``--classes --probe RESULTS`` runs the same two cells on the real CPU vLLM of a recorded ``usefulwork
loadtest --experiment admission-vllm`` run instead (``admission_clock.probed_host``: the step times fitted
to that run's probe, each ``1 + speed_margin`` as long (``--margin`` to change it: a run's cells ran
10-15% slower than its probe, a busy host more), and the ``admission-vllm`` experiment's SLO and cells
at that run's rate scale): what its gateway could have done there, and the floor, with the host's own
step times. ``docs/bench/admission-vllm-results-*.json`` carry the calibrations of the recorded runs.

``--written-lengths`` (with ``--probe``) replays the cells as a run sizes them now, not as the recorded run
sent them: a server faster than the rates were sized for keeps each cell's written length
(``experiment.clock_for``); runs before 2026-12-04 squeezed them into 1/F of it.

``--retry --probe RESULTS`` runs the ``admission-vllm`` experiment's ``burst-retry`` cell on that replica
(``probed_retry_cell``), after the capacity-0.6 and burst cells admission on runs before it, with the
loadtest client's timeout (30 s from the first send; a Retry-After that would outlast it is not waited
for): first retries admitted, and the timeouts. With several ``--probe`` (``probed_retries``), a row per run
over all its seeds and the total: a Retry-After rule is judged over the recorded hosts, not on one.

``--burst --probe RESULTS [--probe ...]`` runs the ``admission-vllm`` experiment's ``burst`` cell on each
recorded run's replica (``probed_burst_cell``), admission off and on under each ``--rule``, after the cells
each profile runs before it, per seed (seed 0: the run's own arrivals) and step margin (``--margins``):
goodput, served, SLO attainment of the served and their p95 TPOT, and per rule the mean goodput and the
cells under 95%. It reproduced session 48's real cut (27 -> 20.7 per replica, 45 of 63 served) from that
run's probe; its admission off is harsher than the real one (73% of the burst within the SLO where the
real server gave 84%: the fitted steps are slower than the server at 39 sequences).

``--retry`` runs the experiment's ``burst-retry`` cell on the same clock, per seed: the capacity-13 cell's
40 s at 13 req/s from clients that never retry (as the wall-clock experiment warms the gateway), 20 s at
2 req/s, then the burst's first period (25 req/s for 9 s, 2 req/s after) from another tenant's clients,
which wait out Retry-After and retry up to 3 times: the share of first retries admitted (target >= 80%),
and the SLO attainment of the answers served, each attempt timed from its own send. ``--gateways N`` puts
N gateway processes (each its own queue and capacity estimate) behind a load balancer that sends each
attempt to the next one, so a client's retry reaches another gateway than the one that shed it.

``--restart`` sends the burst-retry clients' burst to a gateway started (cold) at that moment beside a
fleet kept full by 40 s at 13 req/s through the old gateway, which drains (its queued requests get
their 429, its admitted ones finish): a rolling update, a restarted worker. Until the new gateway has
timed a request of its own it prices a slot at the replica's own request time (vLLM's e2e histogram);
each cell also runs with that figure hidden (a slot priced at the E2E SLO, the rule before), at the
experiment's SLO (E2E 5 s) and at an E2E SLO of 30 s (the real CPU vLLM experiment's), per seed.

``mean:F`` judges the limit on the running means under F x SLO (the rule before 2026-11-22);
``tail:F`` on the p95 of the recent window under F x SLO (the shipped rule; F = target_fraction);
``tail:F:C`` the same with the TPOT that cuts the limit at C x the SLO (``tpot_cut_fraction``; C = F: no hold
band, the rule before 2026-12-03); ``fixed:N`` holds the SLO limit at N requests in flight, never cut (what
the best fixed limit would have done).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import usefulwork.loadtest.autoscale as autoscale  # noqa: E402
from usefulwork.loadtest import arrivals as arrivals_mod  # noqa: E402
from usefulwork.loadtest import calibrate  # noqa: E402
from usefulwork.loadtest import experiment as experiment_mod  # noqa: E402
from usefulwork.gateway.admission import capacity as capacity_mod  # noqa: E402
from usefulwork.gateway.admission.config import AdmissionCfg  # noqa: E402
from usefulwork.loadtest import admission_clock  # noqa: E402


@dataclass(frozen=True)
class Steady(autoscale.Day):
    def multiple(self, hour: float) -> float:
        return 1.0


@dataclass(frozen=True)
class Burst(autoscale.Day):
    duty: float = 0.2
    period_s: float = 45.0

    def rate_at(self, t: float) -> float:
        return self.peak_rate if (t % self.period_s) < self.period_s * self.duty else self.base_rate


def workloads() -> dict[str, autoscale.Day]:
    out: dict[str, autoscale.Day] = {}
    for duty in (0.2, 0.4):
        for seed in (1, 2):
            out[f"burst-{int(duty * 100)}%-s{seed}"] = Burst(day_s=90, base_rate=2.0, peak_rate=25.0, burstiness=1.0,
                                                              seed=seed, duty=duty)
    for rate in (10.0, 11.0, 12.0, 13.0, 14.0, 24.0):
        out[f"steady-{rate:g}"] = Steady(day_s=120, base_rate=rate, peak_rate=rate, burstiness=1.0, seed=1)
    return out


def run(day: autoscale.Day, cfg: AdmissionCfg | None) -> dict[str, Any]:
    policy = autoscale.Policy("one", "one replica", fixed=1, admission=cfg is not None)
    if cfg is not None:
        autoscale.AdmissionCfg = lambda: cfg  # the what-if builds its queue from AdmissionCfg()
    sim = autoscale.Simulation(policy, day, autoscale.Fleet(), autoscale.Client(max_retries=0), autoscale.SLO)
    r = sim.run()
    slo = autoscale.SLO
    good = sum(1 for x in sim.requests if x.outcome == "ok" and x.ttft <= slo.ttft_ms / 1e3 and x.e2e <= slo.e2e_ms / 1e3
               and (x.tpot or 0.0) <= slo.tpot_ms / 1e3)
    served = r["successful"]
    return {"sent": r["requests"], "served": served, "shed": r["sheds"], "goodput_per_s": good / day.day_s,
            "attainment_served": good / served if served else None, "p95_e2e_s": r["p95_e2e_s"]}


def with_rule(rule: str) -> AdmissionCfg:
    kind, _, fracs = rule.partition(":")
    if kind == "fixed":  # an SLO limit held at N, never cut (the prefill gate still learns)
        autoscale.Capacity = _Fixed
        capacity_mod.Capacity.tail = _TAIL
        return AdmissionCfg(initial_concurrency=int(fracs), max_concurrency=int(fracs))
    if kind not in ("mean", "tail"):
        raise SystemExit(f"--rule {rule!r}: use mean:F, tail:F, tail:F:C or fixed:N")
    # mean: no tail, so Capacity judges the running means (its behaviour under 10 samples)
    capacity_mod.Capacity.tail = _no_tail if kind == "mean" else _TAIL
    autoscale.Capacity = capacity_mod.Capacity
    frac, _, cut = fracs.partition(":")
    kw: dict[str, Any] = {"target_fraction": float(frac)} if frac else {}
    if cut:
        kw["tpot_cut_fraction"] = float(cut)
    return AdmissionCfg(**kw)


_TAIL = capacity_mod.Capacity.tail


class _Fixed(capacity_mod.Capacity):
    def _cut(self, new: float, now: float, why: str) -> None:
        pass


def _no_tail(self, xs):  # noqa: ANN001
    return None


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _x(x: float | None) -> str:
    return "-" if x is None or x == math.inf else f"{x:.2f}x"


def _seeds(spec: str) -> list[int]:
    lo, _, hi = spec.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def classes(seeds: list[int], host: admission_clock.Host = admission_clock.A100, pieces: int = 0,
            prefills: int | None = None) -> dict[str, Any]:
    """The priority and fairness cells per seed, shipped settings vs the low-band gate off (and, with
    ``pieces``, vs low-band prompts prefilled in pieces of that many tokens: ``low_band_prefill_chunk``,
    ``prefills`` of them per replica at a time where given: ``low_band_prefills``)."""
    variants = {"shipped": AdmissionCfg(), "gate-off": AdmissionCfg(low_band_prefills=0)}
    if pieces:
        name, kw = f"pieces-{pieces}", {"low_band_prefill_chunk": pieces}
        if prefills is not None:
            name, kw = f"{name}x{prefills}", {**kw, "low_band_prefills": prefills}
        variants[name] = AdmissionCfg(**kw)
    data: dict[str, Any] = {}
    for name, cfg in variants.items():
        data[name] = {seed: {"priority": admission_clock.priority_cell(seed, cfg, host),
                             "fairness": admission_clock.fairness_cell(seed, cfg, host)} for seed in seeds}
    print(f"host: {host.name}; the cells at {host.rate:.3g} req/s, SLO TTFT/TPOT/E2E {host.slo} s")
    print("| seed | variant | interactive TTFT p99 / alone (s) | ratio (floor) | tokens/s vs off | quiet TTFT p99 / alone (ratio) "
          "| worst quiet: floor | quiet shed | Jain (backlogged) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for seed in seeds:
        for name in variants:
            p, f = data[name][seed]["priority"], data[name][seed]["fairness"]
            quiet = ", ".join(f"{_s(v['p99_s'])} / {_s(v['alone_p99_s'])} ({_x(v['ratio'])})" for v in f["quiet"].values())
            shed = sum(n for c, n in f["shed"].items() if c != "heavy")
            jb = "-" if f["jain_backlogged"] is None else f"{f['jain_backlogged']:.2f}"
            print(f"| {seed} | {name} | {_s(p['interactive_p99_s'])} / {_s(p['alone_p99_s'])} | {_x(p['ratio'])} ({_x(p['floor_ratio'])}) | "
                  f"{p['tokens_per_s']:.0f} / {p['off_tokens_per_s']:.0f} ({p['throughput_ratio']:.3f}) | {quiet} | "
                  f"{_x(f['worst_floor_ratio'])} | {shed} | {jb} |")
    print("\nWhere the slowest first token went (shipped; ms: gateway queue + engine wait + own prefill step(s), "
          "the API front-end's fixed delay aside), loaded | alone:")
    print("| seed | client | loaded | alone |")
    print("|---|---|---|---|")
    for seed in seeds:
        p, f = data["shipped"][seed]["priority"], data["shipped"][seed]["fairness"]
        worst = max(f["quiet"], key=lambda k: f["quiet"][k]["ratio"] or math.inf)
        for client, row in (("interactive", p), (worst, f["quiet"][worst])):
            print(f"| {seed} | {client} | {_parts(row['slowest'])} | {_parts(row['alone_slowest'])} |")
    for name in variants:
        rows = list(data[name].values())
        met_p = sum(1 for r in rows if r["priority"]["ratio"] <= 1.2)
        can_p = sum(1 for r in rows if r["priority"]["floor_ratio"] <= 1.2)
        met_t = sum(1 for r in rows if r["priority"]["throughput_ratio"] >= 0.95)
        met_f = sum(1 for r in rows if r["fairness"]["worst_ratio"] <= 1.2)
        can_f = sum(1 for r in rows if r["fairness"]["worst_floor_ratio"] <= 1.2)
        met_j = sum(1 for r in rows if (r["fairness"]["jain_backlogged"] or 1.0) >= 0.95)
        print(f"{name}: interactive <= 1.2x in {met_p}/{len(rows)} seeds (by the floor: {can_p}/{len(rows)}), throughput >= 95% in {met_t}/{len(rows)}, "
              f"every quiet tenant <= 1.2x in {met_f}/{len(rows)} (possible at all, by the floor: {can_f}/{len(rows)}), "
              f"Jain >= 0.95 in {met_j}/{len(rows)}")
    return data


RETRY_WARM_S = 60.0  # the capacity-13 cell (40 s) and a quiet 20 s before the burst-retry cell
LEND_S = AdmissionCfg().lend_interval_s  # how often the gateways exchange places (``GatewaysSim._lend``)


@dataclass(frozen=True)
class RetryCell(autoscale.Day):
    def rate_at(self, t: float) -> float:
        if t < RETRY_WARM_S:
            return 13.0 if t < 40.0 else 2.0
        return self.peak_rate if t - RETRY_WARM_S < 9.0 else self.base_rate


class _OwnQueue:
    """Each request is answered by the gateway (queue) that admitted it: its answer releases that
    gateway's slot, its first token frees that gateway's prefill place. (Mixed into a Simulation.)"""

    def _with(self, queue: Any, fn: Any) -> None:
        """Run ``fn`` with ``queue`` as the gateway's queue."""
        mine, self.queue = self.queue, queue
        try:
            fn()
        finally:
            self.queue = mine

    def _own(self, req: Any, fn: Any) -> None:
        """Run ``fn`` with the queue that admitted ``req``."""
        self._with(getattr(req, "queue", None) or self.queue, fn)

    def _finish_attempt(self, req: Any, ok: bool) -> None:
        self._own(req, lambda: autoscale.Simulation._finish_attempt(self, req, ok))

    def _first_token(self, sim: Any) -> None:
        req = self.by_sim.get(id(sim))
        if req is not None:
            self._own(req, lambda: autoscale.Simulation._first_token(self, sim))


class GatewaysSim(_OwnQueue, autoscale.Simulation):
    """The what-if's fleet behind ``n`` gateway processes, each with its own queue and capacity estimate
    (as deployed: only limits and budgets go through Redis), and a load balancer that sends each attempt
    to the next gateway (Envoy's default round robin, per request): a client's retry reaches another
    gateway than the one that shed it, ``n - 1`` times in ``n``."""

    def __init__(self, *args: Any, gateways: int = 1, lend: bool = True, **kw: Any):
        super().__init__(*args, **kw)
        self.gateways = [self.queue, *(self.admission_queue() for _ in range(gateways - 1))]
        self._next = 0
        # The processes' exchange of places through Redis (``lending.PlaceLedger``, every lend_interval_s)
        self._next_lend = LEND_S if lend and gateways > 1 else math.inf

    def _lend(self) -> None:
        """Each gateway learns the others' next places and what they hold on loan from it (as the Redis
        exchange does, with no delay beyond its interval)."""
        held = [o.held_places(self.now) for o in self.gateways]
        took = [o.took_places(self.now) for o in self.gateways]
        for i, q in enumerate(self.gateways):
            others = [(j, o) for j, o in enumerate(self.gateways) if j != i]
            places = [(at, str(j)) for j, o in others if math.isfinite(at := o.next_place(self.now))]
            q.settle_places(places, sum(o.loans.count(str(i)) for _, o in others),
                            {k: (at, since, n, str(j)) for j, _ in others for k, at, since, n in held[j]},
                            [(k, at) for j, _ in others for k, at, holder in took[j] if holder == str(i)])
        self._pump()

    def _each(self, fn: Any) -> None:
        for q in self.gateways:
            self._with(q, fn)

    def _send(self, req: Any) -> None:
        self.queue = self.gateways[self._next % len(self.gateways)]
        self._next += 1
        super()._send(req)
        req.queue = self.queue

    def _queue_due(self) -> float:
        due = min(((q.next_deadline() or math.inf) for q in self.gateways if q is not None and q.queued), default=math.inf)
        return min(due, self._next_lend)

    def _expire_queue(self) -> None:
        if self.now >= self._next_lend:
            self._next_lend += LEND_S
            self._lend()
        self._each(lambda: autoscale.Simulation._expire_queue(self))

    def _pump(self) -> None:
        self._each(lambda: autoscale.Simulation._pump(self))


def retry_cell(seed: int, gateways: int = 1, lend: bool = True) -> dict[str, Any]:
    """The burst-retry cell on the virtual clock, with the shipped settings (see the module's docstring),
    behind ``gateways`` gateway processes (``lend``: which lend each other places, as with Redis)."""
    day = RetryCell(day_s=RETRY_WARM_S + 45.0, base_rate=2.0, peak_rate=25.0, burstiness=1.0, seed=seed)
    sim = GatewaysSim(autoscale.Policy("one", "one replica", fixed=1, admission=True), day,
                      autoscale.Fleet(), autoscale.Client(max_retries=3), autoscale.SLO, gateways=gateways, lend=lend)
    sim.clients = lambda t0: ("default", 0) if t0 < RETRY_WARM_S else ("retrying", None)
    sim.run()
    return _retrying_figures([r for r in sim.requests if r.t0 >= RETRY_WARM_S], autoscale.SLO)


class ProbedSim(GatewaysSim):
    """``GatewaysSim`` whose replica is a recorded real CPU vLLM's (``admission_clock.probed_host``)."""

    def __init__(self, *args: Any, step_model: calibrate.StepModel, **kw: Any):
        self.step_model = step_model  # (before the fleet is built)
        super().__init__(*args, **kw)

    def _add_replica(self, ready_at: float) -> None:
        eng = calibrate.engine(self.step_model, self.day.prompt_tokens + self.day.output_tokens, seed=self._next_id)
        self.replicas.append(autoscale.Replica(self._next_id, eng, self.now, ready_at))
        self._next_id += 1


@dataclass(frozen=True)
class Planned(autoscale.Day):
    times: tuple[float, ...] = ()

    def arrivals(self) -> np.ndarray:
        return np.array(self.times)


PROBED_RETRY_CELLS = ("capacity-0.6", "burst", "burst-retry")  # admission-on's cells up to the retry cell


def _planned_cells(exp: Any, shape: dict[str, Any], cells: tuple[str, ...], seed: int,
                   own: bool = False) -> tuple[Planned, float, float]:
    """The arrivals of the experiment's ``cells`` one after another, each followed by its drain, drawn as the
    loadtest draws them (``arrivals.from_spec``) from ``seed``, or with ``own`` the loadtest's own draw per
    cell (``runner._plan``: the arrivals the recorded run had): the day, when the last cell starts, and its
    clients' timeout."""
    rng = np.random.default_rng(seed)
    times, t0, last_t0, timeout = [], 0.0, 0.0, 30.0
    for name in cells:
        case = exp.case_for(shape, name)
        last_t0, timeout = t0, case.timeout_s
        if own:
            rng = np.random.default_rng(experiment_mod.cell_seed(exp.seed, shape["name"], name) + 7919)
        times += [t0 + o for o in arrivals_mod.planned_offsets(arrivals_mod.from_spec(case.arrival), rng,
                                                                duration_s=case.duration_s)]
        t0 += case.duration_s + (case.drain_s or 0.0)
    return Planned(day_s=t0, base_rate=1.0, peak_rate=1.0, seed=seed, times=tuple(times)), last_t0, timeout


def probed_retry_cell(seed: int, results: dict[str, Any], gateways: int = 1, margin: float | None = None) -> dict[str, Any]:
    """The ``admission-vllm`` experiment's ``burst-retry`` cell on a recorded real run's CPU vLLM replica
    (``admission_clock.probed_host``), after the cells admission on runs before it (its capacity-0.6 and
    burst cells, each followed by its drain), at the run's rate scale: arrivals drawn as the loadtest
    draws them (``arrivals.from_spec``), the clients' timeout counted from the first send and a
    Retry-After that would outlast it not waited for, as the loadtest client does."""
    host = admission_clock.probed_host(results, margin=margin)
    exp, shape = admission_clock.probed_experiment(results)
    day, retry_t0, timeout = _planned_cells(exp, shape, PROBED_RETRY_CELLS, seed)
    slo = exp.slo  # (the SLO ``host`` carries in seconds)
    client = autoscale.Client(timeout_s=timeout, max_retries=3, max_retry_after_s=math.inf, from_first_send=True)
    sim = ProbedSim(autoscale.Policy("one", "one replica", fixed=1, admission=True), day, autoscale.Fleet(), client, slo,
                    gateways=gateways, step_model=host.step_model)
    sim.clients = lambda t: ("default", 0) if t < retry_t0 else ("retrying", None)
    sim.run()
    reqs = [r for r in sim.requests if r.t0 >= retry_t0]
    out = _retrying_figures(reqs, slo)
    out["timeouts"] = sum(1 for r in reqs if r.outcome == "timeout")
    out["admitted_then_timed_out"] = sum(1 for r in reqs if r.first_retry == "admitted" and r.outcome == "timeout")
    return out


PROBED_BURST_CELLS = {"admission-off": ("capacity-0.6", "capacity-0.8", "burst"),
                      "admission-on": ("capacity-0.6", "burst")}  # each profile's cells up to the burst, in order


def probed_burst_cell(seed: int, results: dict[str, Any], cfg: AdmissionCfg | None,
                      margin: float | None = None) -> dict[str, Any]:
    """The ``admission-vllm`` experiment's ``burst`` cell on a recorded real run's CPU vLLM replica, after the
    cells its profile runs before it (admission off: capacity-0.6 and capacity-0.8; on: capacity-0.6), each
    followed by its drain, at the run's rate scale, with admission ``cfg`` (None: off). Seed 0 draws the
    arrivals the run itself had (the loadtest's own draw per cell); others draw new ones. The clients never
    retry and give up 30 s after their send, as the loadtest client does. Figures as the experiment's
    (``usefulwork.loadtest.admission``): goodput is the SLO-meeting answers over the cell's span (its start
    to its last answer), and the p95 TPOT of the served."""
    host = admission_clock.probed_host(results, margin=margin)
    exp, shape = admission_clock.probed_experiment(results)
    cells = PROBED_BURST_CELLS["admission-off" if cfg is None else "admission-on"]
    day, burst_t0, timeout = _planned_cells(exp, shape, cells, seed, own=not seed)
    slo = exp.slo
    if cfg is not None:
        autoscale.AdmissionCfg = lambda: cfg  # the what-if builds its queue from AdmissionCfg()
    client = autoscale.Client(timeout_s=timeout, max_retries=0, from_first_send=True)
    sim = ProbedSim(autoscale.Policy("one", "one replica", fixed=1, admission=cfg is not None), day, autoscale.Fleet(),
                    client, slo, step_model=host.step_model)
    sim.run()
    reqs = [r for r in sim.requests if r.t0 >= burst_t0]
    served = [r for r in reqs if r.outcome == "ok"]
    good = [r for r in served if r.ttft * 1e3 <= slo.ttft_ms and r.e2e * 1e3 <= slo.e2e_ms
            and (r.tpot or 0.0) * 1e3 <= slo.tpot_ms]
    span = max((r.t0 + r.e2e for r in served), default=burst_t0) - burst_t0
    return {"sent": len(reqs), "served": len(served), "shed": sum(1 for r in reqs if r.outcome == "shed"),
            "timeouts": sum(1 for r in reqs if r.outcome == "timeout"), "good": len(good),
            "goodput_per_s": len(good) / span if span > 0 else 0.0,
            "attainment_served": len(good) / len(served) if served else None,
            "p95_e2e_served_s": float(np.percentile([r.e2e for r in served], 95)) if served else None,
            "p95_tpot_served_s": float(np.percentile([r.tpot for r in served if r.tpot], 95)) if served else None}


def probed_bursts(seeds: list[int], probes: dict[str, dict[str, Any]], rules: list[str],
                  margins: list[float | None]) -> dict[str, Any]:
    """``probed_burst_cell`` per recorded run (``probes``, by name), margin and seed, admission off and on
    under each of ``rules`` (``with_rule``). One run and margin: a row per seed; else one per rule: its mean
    goodput, the cells whose served answers met the SLO under 95% and the lowest attainment."""
    cells = [(name, m, seed) for name in probes for m in margins for seed in seeds]
    data: dict[str, Any] = {"off": [probed_burst_cell(seed, probes[name], None, m) for name, m, seed in cells]}
    for rule in rules:
        cfg = with_rule(rule)
        data[rule] = [probed_burst_cell(seed, probes[name], cfg, m) for name, m, seed in cells]
    print("the burst cell on a recorded real CPU vLLM's replica: goodput req/s / served of sent / SLO attainment of "
          "served / p95 TPOT of served (ms)")
    if len(probes) == 1 and len(margins) == 1:
        print("| seed | " + " | ".join(data) + " |")
        print("|---|" + "---|" * len(data))
        for i, seed in enumerate(seeds):
            row = []
            for key in data:
                v = data[key][i]
                att = "-" if v["attainment_served"] is None else f"{v['attainment_served']:.1%}"
                tp = "-" if v["p95_tpot_served_s"] is None else f"{v['p95_tpot_served_s'] * 1e3:.0f}"
                row.append(f"{v['goodput_per_s']:.3f} / {v['served']} of {v['sent']} / {att} / {tp}")
            print(f"| {seed} | " + " | ".join(row) + " |")
    print(f"{len(cells)} cell(s): {', '.join(probes)} x margins {margins} x seeds {seeds[0]}-{seeds[-1]}")
    print("| admission | mean goodput (req/s) | served | cells under 95% of served within the SLO | lowest |")
    print("|---|---|---|---|---|")
    for key, rows in data.items():
        att = [v["attainment_served"] or 0.0 for v in rows]
        print(f"| {key} | {sum(v['goodput_per_s'] for v in rows) / len(rows):.3f} | {sum(v['served'] for v in rows)} | "
              f"{sum(1 for a in att if a < 0.95)} | {min(att):.1%} |")
    return {"cells": cells, **data}


def _retrying_figures(reqs: list[Any], slo: Any) -> dict[str, Any]:
    """The retrying clients' requests: sent, served, first retries and how many were admitted, and the SLO
    attainment of the served, each attempt timed from its own send."""
    retried = [r for r in reqs if r.first_retry]
    served = [r for r in reqs if r.outcome == "ok"]
    ok = sum(1 for r in served if r.ttft - (r.sent - r.t0) <= slo.ttft_ms / 1e3 and r.e2e - (r.sent - r.t0) <= slo.e2e_ms / 1e3)
    return {"sent": len(reqs), "served": len(served), "first_retries": len(retried),
            "admitted_on_first_retry": sum(1 for r in retried if r.first_retry == "admitted"),
            # (shed because its client's declared deadline, the time it had left, could not be met)
            "first_retry_client_timeout": sum(1 for r in retried if r.first_retry_reason == "client_timeout"),
            # (shed on the first attempt and told not to retry: no retry could end within its client's deadline)
            "told_not_to_retry": sum(1 for r in reqs if r.outcome == "shed" and r.attempts == 1
                                     and r.ticket is not None and r.ticket.final),
            "attainment_served": ok / len(served) if served else None}


def retries(seeds: list[int], gateways: int = 1, probe: dict[str, Any] | None = None,
            margin: float | None = None, lend: bool = True) -> dict[str, Any]:
    if probe is None:
        data = {seed: retry_cell(seed, gateways, lend) for seed in seeds}
    else:
        data = {seed: probed_retry_cell(seed, probe, gateways, margin) for seed in seeds}
    print(f"{gateways} gateway process(es), each attempt to the next" + (" (a recorded real CPU vLLM's replica):" if probe else ":"))
    print("| seed | sent | served | first retries | admitted on the first retry | attainment of served (per attempt) | timeouts |")
    print("|---|---|---|---|---|---|---|")
    for seed, r in data.items():
        att = "-" if r["attainment_served"] is None else f"{r['attainment_served']:.1%}"
        print(f"| {seed} | {r['sent']} | {r['served']} | {r['first_retries']} | {r['admitted_on_first_retry']} "
              f"({r['admitted_on_first_retry'] / max(1, r['first_retries']):.1%}) | {att} | {r.get('timeouts', '-')} |")
    n = sum(r["first_retries"] for r in data.values())
    a = sum(r["admitted_on_first_retry"] for r in data.values())
    print(f"all seeds: {a} of {n} first retries admitted ({a / max(1, n):.1%})")
    return data


def probed_retries(seeds: list[int], probes: dict[str, dict[str, Any]], gateways: int = 1,
                   margin: float | None = None) -> dict[str, Any]:
    """The ``burst-retry`` cell on each recorded run's replica (``probed_retry_cell``), every seed: one row per run
    (its seeds together) and the total. A rule for the Retry-After is judged over the hosts: one host's six seeds
    moved 59% -> 75% with a change that moved another's 85% -> 62% (docs/benchmarks.md section 7, session 59)."""
    keys = ("sent", "served", "first_retries", "admitted_on_first_retry", "first_retry_client_timeout", "timeouts")
    data: dict[str, Any] = {}
    print(f"{gateways} gateway process(es), each attempt to the next; the recorded real CPU vLLMs' replicas, seeds "
          f"{seeds[0]}-{seeds[-1]}:")
    print("| run | sent | served | first retries | admitted on the first retry | shed for their client's timeout "
          "| lowest attainment of served | timeouts |")
    print("|---|---|---|---|---|---|---|---|")
    total = dict.fromkeys(keys, 0)
    lowest: list[float] = []
    for name, probe in probes.items():
        cells = {seed: probed_retry_cell(seed, probe, gateways, margin) for seed in seeds}
        row = {k: sum(c[k] for c in cells.values()) for k in keys}
        att = [c["attainment_served"] for c in cells.values() if c["attainment_served"] is not None]
        data[name] = {"seeds": cells, **row}
        for k in keys:
            total[k] += row[k]
        lowest.extend(att)
        n, a = row["first_retries"], row["admitted_on_first_retry"]
        admitted, low = (f"{a} ({a / max(1, n):.1%})", f"{min(att):.1%}") if att else (str(a), "-")
        print(f"| {name} | {row['sent']} | {row['served']} | {n} | {admitted} | {row['first_retry_client_timeout']} "
              f"| {low} | {row['timeouts']} |")
    n, a = total["first_retries"], total["admitted_on_first_retry"]
    print(f"all runs: {a} of {n} first retries admitted ({a / max(1, n):.1%}), {total['served']} served, "
          f"{total['timeouts']} timeouts, {sum(1 for x in lowest if x < 0.95)} of {len(lowest)} cells under 95% of the "
          "served within the SLO")
    data["total"] = total
    return data


RESTART_AT_S = 40.0  # the new gateway starts (and the retrying clients' burst with it)


@dataclass(frozen=True)
class RestartCell(autoscale.Day):
    def rate_at(self, t: float) -> float:
        if t < RESTART_AT_S:
            return 13.0  # the capacity-13 cell's load: the fleet is full when the new gateway starts
        return self.peak_rate if t - RESTART_AT_S < 9.0 else self.base_rate


class _NoServerFigure:
    """A replica view without the server's own request time (``e2e_live``): the cold hold before it."""

    def __init__(self, view: Any):
        self._view = view

    def __getattr__(self, name: str) -> Any:
        return None if name == "e2e_live" else getattr(self._view, name)


class RestartSim(_OwnQueue, autoscale.Simulation):
    """The what-if's one-replica fleet, whose gateway is replaced at ``RESTART_AT_S`` by a cold one (a rolling
    update, a restarted worker): the old gateway drains (its queued requests get their 429 and Retry-After,
    its admitted ones finish and release its slots), the new one takes every request from then on and has
    timed none of its own. ``server_figure``: the new gateway reads the replica's own request time."""

    def __init__(self, *args: Any, server_figure: bool = True, restart: bool = True, **kw: Any):
        super().__init__(*args, **kw)
        self.server_figure = server_figure
        self.restarted = not restart  # (False: the same gateway serves on, warm: the reference)
        self.told: list[tuple[float, float]] = []  # (when, Retry-After) told by the new gateway in its first 10 s

    def _restart(self) -> None:
        old = self.queue
        self.queue = self.admission_queue() if self.server_figure else self.admission_queue(_NoServerFigure)
        self.restarted = True
        for t in [t for qs in old.queues for q in qs.values() for t in q]:
            old._drop(t, "draining", self.now)
            self._shed(t.waiter, t.retry_after_s)

    def _send(self, req: Any) -> None:
        if not self.restarted and self.now >= RESTART_AT_S:
            self._restart()
        super()._send(req)
        req.queue = self.queue

    def _shed(self, req: Any, retry_after_s: float) -> None:
        if RESTART_AT_S <= self.now < RESTART_AT_S + 10.0 and getattr(req, "queue", None) is self.queue:
            self.told.append((self.now, retry_after_s))
        super()._shed(req, retry_after_s)


RESTART_SLOS = {"experiment": autoscale.SLO,  # TTFT 2 s, TPOT 100 ms, E2E 5 s
                "e2e-30s": autoscale.SLOSpec(ttft_ms=2000.0, tpot_ms=100.0, e2e_ms=30000.0, attainment=0.95)}


def restart_cell(seed: int, slo: Any, server_figure: bool, restart: bool = True) -> dict[str, Any]:
    day = RestartCell(day_s=RESTART_AT_S + 45.0, base_rate=2.0, peak_rate=25.0, burstiness=1.0, seed=seed)
    sim = RestartSim(autoscale.Policy("one", "one replica", fixed=1, admission=True), day, autoscale.Fleet(),
                     autoscale.Client(max_retries=3), slo, server_figure=server_figure, restart=restart)
    sim.clients = lambda t0: ("default", 0) if t0 < RESTART_AT_S else ("retrying", None)
    sim.run()
    reqs = [r for r in sim.requests if r.t0 >= RESTART_AT_S]
    served = [r for r in reqs if r.outcome == "ok"]
    told = sorted(x for _, x in sim.told)
    return {**_retrying_figures(reqs, slo), "shed": sum(1 for r in reqs if r.outcome == "shed"),
            "timeouts": sum(1 for r in reqs if r.outcome == "timeout"),
            "mean_e2e_from_first_send_s": sum(r.e2e for r in served) / len(served) if served else None,
            "told": len(told), "told_median_s": told[len(told) // 2] if told else None,
            "told_max_s": told[-1] if told else None}


def restarts(seeds: list[int]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    print("| SLO | cold hold | seed | sent | served | shed | timeouts | first retry admitted | attainment of served "
          "(per attempt) | mean E2E from first send (s) | Retry-After told in the first 10 s: n / median / max (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for slo_name, slo in RESTART_SLOS.items():
        for variant, figure, restart in (("no restart (warm)", True, False), ("E2E SLO", False, True),
                                         ("replicas' figure", True, True)):
            rows = data.setdefault(slo_name, {}).setdefault(variant, {})
            for seed in seeds:
                r = rows[seed] = restart_cell(seed, slo, figure, restart)
                att = "-" if r["attainment_served"] is None else f"{r['attainment_served']:.1%}"
                e2e = "-" if r["mean_e2e_from_first_send_s"] is None else f"{r['mean_e2e_from_first_send_s']:.2f}"
                told = "-" if not r["told"] else f"{r['told']} / {r['told_median_s']:.2f} / {r['told_max_s']:.2f}"
                print(f"| {slo_name} | {variant} | {seed} | {r['sent']} | {r['served']} | {r['shed']} | {r['timeouts']} | "
                      f"{r['admitted_on_first_retry']} of {r['first_retries']} | {att} | {e2e} | {told} |")
            n = sum(r["first_retries"] for r in rows.values())
            a = sum(r["admitted_on_first_retry"] for r in rows.values())
            print(f"{slo_name}, {variant}: {a} of {n} first retries admitted ({a / max(1, n):.1%}), "
                  f"served {sum(r['served'] for r in rows.values())} of {sum(r['sent'] for r in rows.values())}")
    return data


def _parts(x: dict[str, float] | None) -> str:
    if not x:
        return "-"
    return (f"{x['ttft_s'] * 1e3:.0f} = {x['gateway_queue_s'] * 1e3:.0f} + {x['engine_wait_s'] * 1e3:.0f} + "
            f"{x['prefill_s'] * 1e3:.0f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rule", action="append", default=None, help="mean:F or tail:F (default: the shipped tail rule)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--classes", action="store_true", help="the priority and fairness cells instead of bursts and steady load")
    ap.add_argument("--retry", action="store_true", help="the burst-retry cell instead of bursts and steady load")
    ap.add_argument("--burst", action="store_true",
                    help="with --probe: the admission-vllm experiment's burst cell, admission off and on (each --rule)")
    ap.add_argument("--restart", action="store_true",
                    help="the burst-retry clients against a gateway restarted beside a full fleet (cold hold: SLO vs replicas' figure)")
    ap.add_argument("--seeds", default="1-6", help="with --classes or --retry: seeds, e.g. 1-6")
    ap.add_argument("--probe", type=Path, action="append", default=None,
                    help="with --classes, --retry or --burst: the real CPU vLLM of a recorded admission-vllm run (its results.json: "
                         "the step times fitted to its probe, its rate scale) instead of the simulated A100 (--burst, "
                         "--retry: several, each run; --retry then a row per run and the total)")
    ap.add_argument("--margin", type=float, default=None,
                    help="with --probe: every step this much longer than probed (default: the run's speed_margin)")
    ap.add_argument("--margins", default=None, help="with --burst: several margins, e.g. 0,0.1,0.15 (each run)")
    ap.add_argument("--written-lengths", action="store_true",
                    help="with --probe: the cells as a run sizes them now (experiment.clock_for: a server faster than "
                         "the rates were sized for keeps each cell's written length), not as the recorded run did")
    ap.add_argument("--gateways", type=int, default=1,
                    help="with --retry: gateway processes behind a round-robin load balancer (each attempt to the next)")
    ap.add_argument("--pieces", type=int, default=0, metavar="TOKENS",
                    help="with --classes: a third variant, low-band prompts prefilled in pieces of TOKENS "
                         "(admission.low_band_prefill_chunk)")
    ap.add_argument("--prefills", type=int, default=None, metavar="N",
                    help="with --pieces: that many pieced prompts per replica at a time (admission.low_band_prefills; "
                         "the admission experiment's admission-on profile takes 64-token pieces, three at a time)")
    ap.add_argument("--no-lend", action="store_true",
                    help="with --gateways N: the processes lend each other no places (admission.lend_places: false)")
    args = ap.parse_args()

    def load(path: Path) -> dict[str, Any]:
        results = json.loads(path.read_text())
        if args.written_lengths:
            cal = results["calibration"]
            cal["time_scale"] = experiment_mod.clock_for(cal["rate_scale"])
        return results

    if args.restart:
        data = restarts(_seeds(args.seeds))
        if args.json:
            args.json.write_text(json.dumps(data, indent=1))
        return 0
    if args.burst:
        if not args.probe:
            raise SystemExit("--burst needs --probe RESULTS")
        rules = args.rule or [f"tail:{AdmissionCfg().target_fraction:g}"]
        probes = {p.name: load(p) for p in args.probe}
        margins = [float(m) for m in args.margins.split(",")] if args.margins else [args.margin]
        data = probed_bursts(_seeds(args.seeds), probes, rules, margins)
        if args.json:
            args.json.write_text(json.dumps(data, indent=1))
        return 0
    if args.retry and args.probe and len(args.probe) > 1:
        data = probed_retries(_seeds(args.seeds), {p.name: load(p) for p in args.probe}, args.gateways, args.margin)
        if args.json:
            args.json.write_text(json.dumps(data, indent=1))
        return 0
    if args.retry:
        probe = load(args.probe[0]) if args.probe else None
        data = retries(_seeds(args.seeds), args.gateways, probe, args.margin, not args.no_lend)
        if args.json:
            args.json.write_text(json.dumps(data, indent=1))
        return 0
    if args.classes:
        host = admission_clock.A100
        if args.probe:
            host = admission_clock.probed_host(load(args.probe[0]), args.probe[0].name, args.margin)
        data = classes(_seeds(args.seeds), host, args.pieces, args.prefills)
        if args.json:
            args.json.write_text(json.dumps(data, indent=1))
        return 0
    rules = args.rule or [f"tail:{AdmissionCfg().target_fraction:g}"]
    days = workloads()
    data: dict[str, Any] = {"off": {name: run(day, None) for name, day in days.items()}}
    steady_ok = [v["goodput_per_s"] for k, v in data["off"].items() if k.startswith("steady") and v["attainment_served"]
                 and v["attainment_served"] >= 0.95 and v["p95_e2e_s"] <= autoscale.SLO.e2e_ms / 1e3]
    data["capacity_at_slo_per_s"] = max(steady_ok) if steady_ok else None
    for rule in rules:
        cfg = with_rule(rule)
        data[rule] = {name: run(day, cfg) for name, day in days.items()}
    cap = data["capacity_at_slo_per_s"]
    print(f"capacity at the SLO (admission off, steady): {cap:.2f} req/s" if cap else "capacity: none met the SLO")
    print("| workload | " + " | ".join(["off", *rules]) + " |")
    print("|---|" + "---|" * (len(rules) + 1))
    for name in days:
        cells = []
        for key in ["off", *rules]:
            v = data[key][name]
            att = "-" if v["attainment_served"] is None else f"{v['attainment_served']:.1%}"
            cells.append(f"{v['goodput_per_s']:.2f} / {att} / {v['p95_e2e_s']:.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("(goodput req/s / SLO attainment of served / p95 E2E of served, s)")
    if args.json:
        args.json.write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
