"""The admission experiment's priority and fairness cells on the simulated engine's virtual clock.

The admission filter's own ``PoolQueue`` and ``Capacity`` in front of one ``SimEngine`` (a simulated
A100-80G serving Llama-3.1-8B, 512 prompt / 128 output tokens, vLLM's V1 scheduler), driven event by
event: no HTTP and no wall clock, so a slow or busy host cannot move these figures (the wall-clock
experiment, ``usefulwork loadtest --experiment admission``, relays every token through a real gateway
and needs a host that keeps up with it). ``benchmarks/admission_virtual.py --classes``
prints them; a test holds the low-band prefill gate to them.

A cell is a list of arrivals, each of a client (a tenant and a class). A baseline is the same arrivals
less the other clients' (the wall-clock experiment's ``traffic_of``). Before a cell, the queue is warmed
as the experiment's earlier cells warm it: 30 s of steady traffic under capacity from the cell's first
client's tenant (or another), then a 5 s pause, then the cells the experiment runs just before it on the
same gateway, each followed by its drain. The priority cell's unloaded baseline follows another tenant's
traffic (the experiment's retrying clients); the fairness cell's baseline follows the priority cell, and
the fairness cell its baseline (``fairness_cell``). (Until session 68 the fairness cells were warmed by
the steady traffic alone and the unloaded baseline by its own tenant's: the queue's learnt figures, the
quiet pace's decode speed among them, were not those the wall clock's cells meet. At fc1f5f0 the clock
put the quiet tenants within 1.2x in 23 of 36 seeds so, 8 of 36 warmed as the experiment is, and the
wall clock met the check in one of its six runs before; the interactive ratio, mean of 12 seeds, was
1.089 so and 1.254 with the baseline after another tenant, where the wall clock read 1.12-1.22x.)
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from usefulwork.backends.sim.catalog import build_spec
from usefulwork.backends.sim.engine import SimEngine
from usefulwork.gateway.admission.capacity import Capacity, Sample
from usefulwork.gateway.admission.config import AdmissionCfg
from usefulwork.gateway.admission.queue import PoolQueue, Ticket
from usefulwork.loadtest import calibrate
from usefulwork.loadtest.admission import jain
from usefulwork.loadtest.calibrate import StepModel
from usefulwork.loadtest.experiment import Experiment, load_experiment
from usefulwork.upstream.pieces import piece_tokens

SLO = (2.0, 0.1, 5.0)  # TTFT, TPOT, E2E seconds: the experiment's
PROMPT, OUTPUT = 512, 128
BATCH_DEADLINE_S = 60.0  # admission's default deadline for the batch class
WARM_S, PAUSE_S, WARM_RATE = 30.0, 5.0, 8.0
DRAIN_S = 15.0  # the experiment's drain after a cell (``drain_s``): the next cell's first arrival comes after it


@dataclass(frozen=True)
class Host:
    """The engine the cells run on, with the experiment's SLO and traffic for it."""

    name: str = "A100-80G"
    slo: tuple[float, float, float] = SLO  # TTFT, TPOT, E2E seconds
    rate: float = 24.0  # the priority and fairness cells' arrivals per second (2x the capacity)
    priority_s: float = 30.0  # the priority cell's length
    fairness_s: float = 30.0  # the fairness cell's length
    warm_rate: float = WARM_RATE  # the traffic that warms the queue before a cell (under capacity) ...
    warm_s: float = WARM_S  # ... and for how long
    step_model: StepModel | None = None  # None: the simulated A100-80G serving Llama-3.1-8B

    def engine(self, scheduling_policy: str, prefix_caching: bool = False) -> SimEngine:
        if self.step_model is None:  # (vLLM's default: the prefix cache on)
            return SimEngine(build_spec(gpu="A100-80G", model="Llama-3.1-8B", overrides={"scheduling_policy": scheduling_policy}))
        return calibrate.engine(self.step_model, PROMPT + OUTPUT, scheduling_policy=scheduling_policy,
                                prefix_caching=prefix_caching)


A100 = Host()


def probed_experiment(results: dict[str, Any]) -> tuple[Experiment, dict[str, Any]]:
    """The ``admission-vllm`` experiment at a recorded run's rate scale, and its (one) shape."""
    exp = load_experiment("admission-vllm")
    cal = results["calibration"]
    # (a run recorded before 2026-12-04 squeezed its cells in time as much as it scaled their rates)
    exp.scale_rates(cal["rate_scale"], cal.get("time_scale", cal["rate_scale"]))
    return exp, exp.shapes[0]


def probed_host(results: dict[str, Any], name: str = "probed", margin: float | None = None) -> Host:
    """The real CPU vLLM of a recorded ``admission-vllm`` run on the virtual clock: the step times fitted
    to that run's probe (its results.json ``calibration``) and the experiment's cells at that run's scale
    (``rate_scale``, F): its SLO, the priority and fairness cells' rate and lengths, and the first cell
    (``capacity-0.6``) as the warm-up. The run's cells shared the host's two cores with the gateway and the
    load generator, so they ran slower than the probe: every step is ``1 + margin`` times as long as
    probed (None: the run's own ``speed_margin``, the margin its capacity estimate took)."""
    cal = results["calibration"]
    margin = cal.get("speed_margin", 0.0) if margin is None else margin
    # (runs before the step model was recorded carry the probe it is fitted to)
    model = StepModel(**cal["step_model"]) if cal.get("step_model") else StepModel.fit(calibrate.Probe(**cal["probe"]))
    exp, shape = probed_experiment(results)
    prio, fair, warm = (exp.case_for(shape, c) for c in ("priority-2x", "fairness-4", "capacity-0.6"))
    if prio.arrival["rate"] != fair.arrival["rate"]:
        raise ValueError("admission-vllm: the priority and fairness cells are expected at one rate")
    slo = exp.slo
    return Host(name, (slo.ttft_ms / 1e3, slo.tpot_ms / 1e3, slo.e2e_ms / 1e3), prio.arrival["rate"], prio.duration_s,
                fair.duration_s, warm.arrival["rate"], warm.duration_s, model.slower(margin))


@dataclass(frozen=True)
class Client:
    name: str
    tenant: str
    cls: int  # 0 interactive, 1 batch
    weight: float = 1.0


PRIORITY_MIX = (Client("interactive", "default", 0, 1.0), Client("batch", "default", 1, 3.0))
FAIRNESS_MIX = (Client("heavy", "heavy", 0, 30.0), Client("q1", "q1", 0, 1.0), Client("q2", "q2", 0, 1.0),
                Client("q3", "q3", 0, 1.0))
QUIET = frozenset({"q1", "q2", "q3"})


def arrivals(mix: tuple[Client, ...], rate: float, duration_s: float, seed: int) -> list[tuple[float, Client]]:
    """Poisson arrivals, each drawn to a client by weight."""
    rng = random.Random(seed)
    weights = [c.weight for c in mix]
    out, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < duration_s:
        out.append((t, rng.choices(mix, weights=weights)[0]))
    return out


def only(cell: list[tuple[float, Client]], names: set[str]) -> list[tuple[float, Client]]:
    return [(t, c) for t, c in cell if c.name in names]


@dataclass
class Result:
    ttft: dict[str, list[float]] = field(default_factory=dict)  # client -> TTFT from arrival of each served request
    waited: dict[str, list[float]] = field(default_factory=dict)  # client -> of that, the wait in the gateway's queue
    # client -> per served request: (gateway queue wait, wait in the engine until first scheduled, first
    # scheduled -> first token); their sum is its TTFT less the API front-end's delay
    parts: dict[str, list[tuple[float, float, float]]] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)
    late: dict[str, int] = field(default_factory=dict)  # client -> of the served, those over the SLO (TTFT, TPOT or E2E)
    shed: dict[str, int] = field(default_factory=dict)
    tokens_per_s: float = 0.0  # output tokens the engine generated per second, from 5 s into the cell to its end
    arrived: dict[str, list[float]] = field(default_factory=dict)  # client -> when each measured request arrived
    steps: list[tuple[float, float]] = field(default_factory=list)  # the engine's steps: (start, end), in order
    front_end_s: float = 0.0  # the API front-end's fixed delay before a request reaches the engine's queue
    pieces: int = 0  # one-token requests sent to prefill low-band prompts in pieces (``low_band_prefill_chunk``)

    def p99(self, client: str) -> float | None:
        xs = self.ttft.get(client)
        return float(np.percentile(xs, 99)) if xs else None

    def slowest(self, client: str) -> dict[str, float] | None:
        """Where the client's slowest first token spent its time (with ~20 requests a tenant's p99 is
        nearly its slowest): the gateway's queue, the engine's (the step in progress when it arrived,
        and waiting prompts ahead), and its own prefill step(s), whose length grows with the work
        scheduled beside it."""
        xs = self.ttft.get(client)
        if not xs:
            return None
        i = max(range(len(xs)), key=xs.__getitem__)
        queue, engine, prefill = self.parts[client][i]
        return {"ttft_s": xs[i], "gateway_queue_s": queue, "engine_wait_s": engine, "prefill_s": prefill}


def run(cell: list[tuple[float, Client]], admission: AdmissionCfg | None, duration_s: float,
        scheduling_policy: str = "priority", host: Host = A100, warm_tenant: str | None = None,
        before: list[tuple[float, Client]] | None = None, before_s: float = 0.0) -> Result:
    """Serve ``cell`` (offsets from its start) behind admission (None: every request forwarded at once).
    The queue is warmed first by ``warm_tenant``'s steady traffic (None: the first client's tenant), then
    serves ``before`` (offsets from its start, not measured: an earlier cell) for ``before_s`` seconds.
    With ``admission.low_band_prefill_chunk``, a low-band prompt admitted while top-band work is about is
    prefilled in pieces first, as the Forwarder does (usefulwork/upstream/pieces.py): each whole-block prefix
    a one-token request, sent when the one before it ends, no top-band prompt is pending (the filter's
    hold, here without its bound: a top-band first token always comes) and its place in the pool's spacing
    has come (``PoolQueue.piece_wait``), then the request itself, on an
    engine with its prefix cache on."""
    chunk = admission.low_band_prefill_chunk if admission is not None else 0
    eng = host.engine(scheduling_policy, prefix_caching=bool(chunk))
    q = None
    if admission is not None:
        cap = Capacity(admission, *host.slo, replica_count=lambda: 1, priority_scheduling=scheduling_policy == "priority")
        q = PoolQueue.from_cfg("p", cap, admission, host.slo[2])
    t0 = 0.0
    timeline: list[tuple[float, Client, bool]] = []  # (time, client, measured)
    if q is not None and cell:
        warm = Client("warm", warm_tenant or cell[0][1].tenant, 0)
        timeline += [(t, warm, False) for t, _ in arrivals((warm,), host.warm_rate, host.warm_s, seed=7)]
        t0 = host.warm_s + PAUSE_S
        if before:
            timeline += [(t0 + t, c, False) for t, c in before]
            t0 += before_s
    timeline += [(t0 + t, c, True) for t, c in cell]
    res = Result()
    of: dict[Any, tuple[Ticket, Client, bool]] = {}  # engine request -> its ticket, client, measured
    ids = itertools.count()  # every prompt starts with a token of its own: no prefix-cache hits
    now, plan, plan_end, i, tokens = 0.0, None, math.inf, 0, 0
    step = piece_tokens(chunk, eng.kv.block_size) if chunk else 0
    pieces: dict[Any, tuple[Ticket, list[int], int]] = {}  # a piece in the engine -> its ticket, prompt, length
    held: list[tuple[Ticket, list[int], int, bool]] = []  # next pieces waiting for the top band's pending prompts
    spaced: deque[tuple[float, Ticket, list[int], int]] = deque()  # next pieces waiting for their places (when), in order

    def send(tk: Ticket, prompt: list[int], upto: int, placed: bool = False) -> None:
        """The next piece of ``tk``'s prompt (``upto`` tokens), or the request itself once none is left. A
        piece waits while a top-band prompt is pending, then for its place in the pool's spacing (unless
        ``placed``: it had it), then while a top-band prompt is pending again (the filter's ``_piece_turn``)."""
        if upto < len(prompt):
            if q.top_band_pending():
                held.append((tk, prompt, upto, placed))
                return
            if not placed and (wait := q.piece_wait(now)) > 0:
                spaced.append((now + wait, tk, prompt, upto))
                return
            pieces[eng.add_request(prompt[:upto], 1, ignore_eos=True, arrival_time=now,
                                   priority=tk.engine_priority)] = (tk, prompt, upto)
            res.pieces += 1
            return
        r = eng.add_request(prompt, OUTPUT, ignore_eos=True, arrival_time=now, priority=tk.engine_priority)
        of[r] = (tk, *tk.waiter)
    while True:
        t_arrive = timeline[i][0] if i < len(timeline) else math.inf
        t_queue = (q.next_deadline() or math.inf) if q is not None and q.queued else math.inf
        # (a paced tenant's next top-band prompt may go then: the filter's waiters look again, ``turn_free``)
        t_turn = (q.next_turn_due() or math.inf) if q is not None and q.queued else math.inf
        if t_turn <= now:
            t_turn = math.inf  # (due already: nothing else may go before an event)
        t_piece = spaced[0][0] if spaced else math.inf
        now = min(t_arrive, plan_end, t_queue, t_turn, t_piece)
        if now == math.inf:
            break
        woken: list[Ticket] = []
        if now == t_piece:
            _, *piece = spaced.popleft()
            send(*piece, placed=True)
        elif now == t_arrive:
            _, client, measured = timeline[i]
            i += 1
            deadline = host.slo[0] if client.cls == 0 else BATCH_DEADLINE_S
            if measured:
                res.arrived.setdefault(client.name, []).append(now)
            tk = Ticket(client.tenant, client.cls, float(PROMPT + OUTPUT), now, now + deadline, max_tokens=OUTPUT)
            tk.waiter = (client, measured)
            if q is None:
                tk.state, tk.admitted_at = "admitted", now
                woken = [tk]
            else:
                d = q.offer(tk, now)
                woken = ([tk] if d.kind == "admit" else []) + d.woken
                if d.kind == "shed" and measured:
                    res.shed[client.name] = res.shed.get(client.name, 0) + 1
        elif now == t_queue:
            woken = q.expire(now)
        elif now == t_turn:
            woken = q.pump(now)
        elif plan is None:  # a request left the API front-end: plan below
            plan_end = math.inf
        else:
            done, plan, plan_end = plan, None, math.inf
            eng.complete_step(done, now)
            for it in done.items:
                r = it.req
                if r in pieces:
                    if r.finish_time is not None:
                        tk, prompt, upto = pieces.pop(r)
                        send(tk, prompt, upto + step)
                    continue
                tk, client, measured = of[r]
                tokens += t0 + 5.0 <= now <= t0 + duration_s
                if r.num_output_tokens == 1:
                    if measured:
                        res.ttft.setdefault(client.name, []).append(now - tk.arrival)
                        res.waited.setdefault(client.name, []).append(tk.admitted_at - tk.arrival)
                        res.parts.setdefault(client.name, []).append(
                            (tk.admitted_at - tk.arrival, r.first_scheduled_time - r.ready_time, now - r.first_scheduled_time))
                    if q is not None:
                        woken += q.first_token(tk, now)
                if r.finish_time is not None:
                    del of[r]
                    n = r.num_output_tokens
                    tpot = (r.finish_time - r.first_token_time) / (n - 1) if n > 1 else None
                    if measured:
                        res.served[client.name] = res.served.get(client.name, 0) + 1
                        if (r.first_token_time - tk.arrival > host.slo[0] or (tpot or 0.0) > host.slo[1]
                                or r.finish_time - tk.arrival > host.slo[2]):
                            res.late[client.name] = res.late.get(client.name, 0) + 1
                    if q is not None:
                        s = Sample(ttft=r.first_token_time - tk.admitted_at, tpot=tpot,
                                   service=now - tk.admitted_at, tokens=PROMPT + n, ok=True,
                                   inflight_at_admit=tk.inflight_at_admit, cls=tk.cls, completion=n)
                        woken += q.release(tk, now, s, PROMPT + n)
        for tk in woken:
            if tk.state == "admitted":
                prompt = [1000 + next(ids), *range(1001, 1000 + PROMPT)]
                pieced = step and tk.low_band and q.top_band_about(now) and len(prompt) >= 2 * step
                send(tk, prompt, step if pieced else len(prompt))
            elif tk.state == "shed":  # at its latest start, or overtaken
                client, measured = tk.waiter
                if measured:
                    res.shed[client.name] = res.shed.get(client.name, 0) + 1
        if held and not q.top_band_pending():
            waiting = held.copy()
            held.clear()  # (``send`` appends to this list)
            for h in waiting:
                send(*h)
        if plan is None:
            eng.now = max(eng.now, now)
            planned = eng.plan_step()
            if planned is not None:
                plan, secs = planned
                plan_end = now + secs
                res.steps.append((now, plan_end))
            else:  # requests still in the API front-end: the engine looks again when the first is ready
                plan_end = eng.next_ready_time() or math.inf
    res.tokens_per_s = tokens / max(1e-9, duration_s - 5.0)
    res.front_end_s = eng.request_overhead_s
    return res


def floor_p99(loaded: Result, alone: Result, client: str) -> float | None:
    """An estimate of the best TTFT p99 a gateway that keeps the engine this busy could give ``client``'s
    requests in the ``loaded`` run: each admitted at once and prefilled alone in the very next step, so it
    waits only for the API front-end and the rest of the step in progress when it reaches the engine,
    that step cut to at most one prompt's prefill (an engine step is not preempted, and one prompt's step
    is the shortest that still prefills the other tenants' work). The steps are this run's: how often a
    prompt lands in a prefill step is set by how much work the engine does, not by which gateway sent it.
    A prompt's step is the client's quickest first-token step alone. Each request's own TTFT in
    ``loaded`` is at least its estimate here, so neither is its p99."""
    times, parts = loaded.arrived.get(client), [p[2] for p in alone.parts.get(client, [])]
    if not times or not parts:
        return None
    one = min(parts)  # one prompt's prefill step
    starts = [s for s, _ in loaded.steps]
    floors = []
    for t in times:
        ready = t + loaded.front_end_s
        i = bisect.bisect_left(starts, ready) - 1  # (a step that starts as it gets there may take it)
        rest = loaded.steps[i][1] - ready if i >= 0 and loaded.steps[i][1] > ready else 0.0
        floors.append(loaded.front_end_s + min(rest, one) + one)
    return float(np.percentile(floors, 99))


def priority_cell(seed: int, cfg: AdmissionCfg, host: Host = A100) -> dict[str, Any]:
    """Interactive TTFT p99 at 2x overload against the same interactive arrivals alone (and its floor,
    ``floor_p99``), and the engine's output tokens/s against admission off (FCFS, every request
    forwarded: the off profile)."""
    duration_s = host.priority_s
    cell = arrivals(PRIORITY_MIX, host.rate, duration_s, seed)
    loaded = run(cell, cfg, duration_s, host=host)
    # (the experiment's unloaded cell follows the retrying clients' cell: another tenant's traffic)
    alone = run(only(cell, {"interactive"}), cfg, duration_s, host=host, warm_tenant="retrying")
    off = run(cell, None, duration_s, scheduling_policy="fcfs", host=host)
    p, b, f = loaded.p99("interactive"), alone.p99("interactive"), floor_p99(loaded, alone, "interactive")
    return {"interactive_p99_s": p, "alone_p99_s": b, "ratio": p / b if p and b else None,
            "floor_p99_s": f, "floor_ratio": f / b if f and b else None,
            "slowest": loaded.slowest("interactive"), "alone_slowest": alone.slowest("interactive"),
            "tokens_per_s": loaded.tokens_per_s, "off_tokens_per_s": off.tokens_per_s,
            "throughput_ratio": loaded.tokens_per_s / off.tokens_per_s if off.tokens_per_s else None,
            "shed": loaded.shed}


def fairness_alone(seed: int, cfg: AdmissionCfg, host: Host = A100) -> Result:
    """The fairness cell's baseline: its quiet tenants' arrivals alone, after the priority cell (another
    tenant's traffic at 2x overload, then its drain) on the same gateway, as the experiment runs them."""
    baseline = only(arrivals(FAIRNESS_MIX, host.rate, host.fairness_s, seed), QUIET)
    prio = arrivals(PRIORITY_MIX, host.rate, host.priority_s, seed)
    return run(baseline, cfg, host.fairness_s, host=host, warm_tenant="default", before=prio,
               before_s=host.priority_s + DRAIN_S)


def fairness_cell(seed: int, cfg: AdmissionCfg, host: Host = A100) -> dict[str, Any]:
    """Each quiet tenant's TTFT p99 with the heavy one sending 30x, against the same arrivals alone, and
    Jain's index over the served tokens of the tenants that had a request shed (the experiment's
    ``jain_backlogged``; with one such tenant or none, the check reads 1). As in the experiment, the
    baseline runs after the priority cell (another tenant's traffic at 2x overload, then its drain) and the
    4-tenant cell after the baseline and its drain, on the same gateway: the quiet tenants are known to it
    when the heavy one starts."""
    duration_s = host.fairness_s
    cell = arrivals(FAIRNESS_MIX, host.rate, duration_s, seed)
    baseline = only(cell, QUIET)
    prio, prio_s = arrivals(PRIORITY_MIX, host.rate, host.priority_s, seed), host.priority_s + DRAIN_S
    loaded = run(cell, cfg, duration_s, host=host, warm_tenant="default",
                 before=prio + [(prio_s + t, c) for t, c in baseline], before_s=prio_s + duration_s + DRAIN_S)
    alone = fairness_alone(seed, cfg, host)
    backlogged = sorted(c for c, n in loaded.shed.items() if n)
    jain_b = jain([loaded.served.get(c, 0) for c in backlogged]) if len(backlogged) > 1 else None
    out = {}
    for q in sorted(QUIET):
        p, b, f = loaded.p99(q), alone.p99(q), floor_p99(loaded, alone, q)
        out[q] = {"p99_s": p, "alone_p99_s": b, "ratio": p / b if p and b else None,
                  "floor_p99_s": f, "floor_ratio": f / b if f and b else None,
                  "slowest": loaded.slowest(q), "alone_slowest": alone.slowest(q)}
    return {"quiet": out, "worst_ratio": max((v["ratio"] or math.inf) for v in out.values()),
            "worst_floor_ratio": max((v["floor_ratio"] or math.inf) for v in out.values()), "shed": loaded.shed,
            "served": loaded.served, "late": loaded.late, "backlogged": backlogged, "jain_backlogged": jain_b}
