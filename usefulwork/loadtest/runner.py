"""The load runner: one asyncio loop sends requests open-loop (at planned times) or closed-loop
(a fixed number of requests always in flight) and collects per-request results.

Stopping: issuing stops at ``duration_s`` or after ``num_requests`` (whichever first); requests in
flight then get up to ``drain_s`` (default: the per-request timeout) to finish; the rest are
cancelled and counted as ``client_cancelled``.

The generator must stay light (the machine it runs on may be the one serving): no per-request
logging, a pre-encoded body per request, the live display redrawn at 2 Hz from counters only.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from usefulwork.loadtest import client as client_mod
from usefulwork.loadtest.arrivals import ArrivalProcess
from usefulwork.loadtest.client import RequestResult
from usefulwork.loadtest.loopwatch import LoopWatch, frozen_heap
from usefulwork.loadtest.workloads import RequestSpec, Workload


class LoadError(ValueError):
    """A load specification that cannot run."""


@dataclass
class LoadSpec:
    arrival: ArrivalProcess | None = None  # None: closed loop at ``concurrency``
    concurrency: int | None = None
    duration_s: float | None = None
    num_requests: int | None = None
    timeout_s: float = 60.0
    drain_s: float | None = None  # None: the per-request timeout
    seed: int = 0
    # A client mix: each request is sent as one entry, drawn by ``weight`` (tenants by API key,
    # priority classes by the x-usefulwork-priority header). None: one client (the target's key).
    clients: list[dict[str, Any]] | None = None
    honor_retry_after: bool = False  # wait out a 429's Retry-After and retry (client.send)
    # The arrivals and client draws come from this seed (None: ``seed``), and only requests drawn for
    # ``only_clients`` are sent: the same traffic as a run of the whole mix with that seed, less the
    # other clients' requests, while the prompts still come from ``seed`` (a backend's prefix cache
    # holds nothing of the other run's prompts).
    schedule_seed: int | None = None
    only_clients: list[str] | None = None

    def validate(self, timed_workload: bool) -> None:
        if self.arrival is None and self.concurrency is None and not timed_workload:
            raise LoadError("choose an arrival process (open loop) or a concurrency (closed loop)")
        if self.arrival is not None and self.concurrency is not None:
            raise LoadError("an arrival process and a fixed concurrency exclude each other")
        if self.concurrency is not None and self.concurrency < 1:
            raise LoadError("concurrency must be >= 1")
        if self.duration_s is None and self.num_requests is None and not timed_workload:
            raise LoadError("stop by duration or by request count: give duration_s or num_requests")
        if self.timeout_s <= 0:
            raise LoadError("timeout must be > 0")
        if self.only_clients is not None and (self.arrival is None or not self.clients):
            raise LoadError("only_clients needs an open-loop arrival process and a client mix")

    @property
    def traffic_seed(self) -> int:
        return self.seed if self.schedule_seed is None else self.schedule_seed

    def describe(self) -> dict[str, Any]:
        return {
            "mode": "closed" if self.concurrency is not None else "open",
            "arrival": self.arrival.describe() if self.arrival else None,
            "concurrency": self.concurrency,
            "duration_s": self.duration_s,
            "num_requests": self.num_requests,
            "timeout_s": self.timeout_s,
            "drain_s": self.drain_s if self.drain_s is not None else self.timeout_s,
            "seed": self.seed,
            "clients": [{k: v for k, v in c.items() if k != "api_key"} for c in self.clients] if self.clients else None,
            "honor_retry_after": self.honor_retry_after,
            **({"schedule_seed": self.schedule_seed} if self.schedule_seed is not None else {}),
            **({"only_clients": self.only_clients} if self.only_clients is not None else {}),
        }


@dataclass
class Target:
    base_url: str  # without /v1
    model: str
    api_key: str | None = None

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/").removesuffix("/v1")


@dataclass
class Counters:
    """What the live display shows; updated in O(1) per event."""

    sent: int = 0
    ok: int = 0
    dropped: int = 0
    in_flight: int = 0
    output_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    recent_sends: deque = field(default_factory=lambda: deque(maxlen=4096))
    recent_oks: deque = field(default_factory=lambda: deque(maxlen=4096))

    def rate(self, window_s: float = 10.0) -> tuple[float, float]:
        """(sent/s, ok/s) over the last window."""
        now = time.perf_counter()
        cut = now - window_s
        span = min(window_s, max(now - self.started, 1e-6))
        return (sum(1 for t in self.recent_sends if t >= cut) / span,
                sum(1 for t in self.recent_oks if t >= cut) / span)


@dataclass
class RunOutput:
    results: list[RequestResult]
    wall_start: float  # epoch seconds at offset 0
    wall_end: float
    load: dict[str, Any]
    workload: dict[str, Any]
    target: dict[str, Any]
    generator: dict[str, Any] = field(default_factory=dict)  # the generator's own loop: LoopStats.describe()


Observer = Callable[[Counters], None]


def _plan(workload: Workload, load: LoadSpec, rng: np.random.Generator) -> Iterator[tuple[RequestSpec, float]]:
    """(spec, planned offset) pairs for an open-loop run, already cut at duration/count."""
    specs = workload.requests(rng)
    if workload.timed:
        pairs: Iterator[tuple[RequestSpec, float]] = ((s, float(s.at or 0.0)) for s in specs)
    else:
        assert load.arrival is not None
        arrival_rng = np.random.default_rng(load.traffic_seed + 7919)  # arrivals independent of prompt draws
        pairs = zip(specs, load.arrival.offsets(arrival_rng))
    for i, (spec, t) in enumerate(pairs):
        if load.num_requests is not None and i >= load.num_requests:
            return
        if load.duration_s is not None and t >= load.duration_s:
            return
        yield spec, t


class Runner:
    def __init__(self, target: Target, workload: Workload, load: LoadSpec, observer: Observer | None = None) -> None:
        load.validate(workload.timed)
        self.target = target
        self.workload = workload
        self.load = load
        self.observer = observer
        self.counters = Counters()
        self.results: list[RequestResult] = []
        self._tasks: set[asyncio.Task] = set()
        self._mix_rng = np.random.default_rng(load.traffic_seed + 104729)  # client draws independent of the rest
        if load.clients:
            w = np.array([float(c.get("weight", 1.0)) for c in load.clients])
            self._mix_p = w / w.sum()

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():  # cancelled before it started running: the send never happened
            self.counters.in_flight -= 1
            return
        res: RequestResult = task.result()
        self.results.append(res)
        c = self.counters
        c.in_flight -= 1
        if res.outcome == "ok":
            c.ok += 1
            c.output_tokens += res.output_tokens
            c.recent_oks.append(time.perf_counter())
        else:
            c.dropped += 1

    def _draw_client(self) -> dict[str, Any] | None:
        if not self.load.clients:
            return None
        return self.load.clients[int(self._mix_rng.choice(len(self.load.clients), p=self._mix_p))]

    def _launch(self, http, spec: RequestSpec, planned: float, clock0: float,
                client: dict[str, Any] | None = None) -> asyncio.Task:
        c = self.counters
        c.sent += 1
        c.in_flight += 1
        c.recent_sends.append(time.perf_counter())
        api_key, headers, group = self.target.api_key, None, ""
        if self.load.clients:
            c = client or self._draw_client()
            api_key = c.get("api_key", api_key)
            group = c.get("name", "")
            headers = {"x-usefulwork-priority": c["priority"]} if c.get("priority") else None
        task = asyncio.create_task(client_mod.send(http, self.target.base_url, spec, self.target.model,
                                                   timeout_s=self.load.timeout_s, clock0=clock0, planned=planned,
                                                   api_key=api_key, headers=headers, group=group,
                                                   honor_retry_after=self.load.honor_retry_after))
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    async def _open_loop(self, http, clock0: float) -> None:
        rng = np.random.default_rng(self.load.seed)
        only = self.load.only_clients
        for spec, planned in _plan(self.workload, self.load, rng):
            client = self._draw_client()  # drawn in arrival order, sent or not: the same draws as the whole mix
            if only is not None and client.get("name") not in only:
                continue
            delay = clock0 + planned - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            self._launch(http, spec, planned, clock0, client)

    async def _closed_loop(self, http, clock0: float) -> None:
        rng = np.random.default_rng(self.load.seed)
        specs = self.workload.requests(rng)
        issued = itertools.count()
        deadline = None if self.load.duration_s is None else clock0 + self.load.duration_s

        async def worker() -> None:
            while True:
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                n = next(issued)
                if self.load.num_requests is not None and n >= self.load.num_requests:
                    return
                spec = next(specs, None)
                if spec is None:
                    return
                # Planned = now: a closed loop sends as soon as a slot frees, so lag is the
                # generator's own delay between a completion and the next send.
                planned = time.perf_counter() - clock0
                task = self._launch(http, spec, planned, clock0)
                await asyncio.wait({task})

        await asyncio.gather(*(worker() for _ in range(self.load.concurrency or 1)))

    async def _drain(self) -> None:
        if not self._tasks:
            return
        drain = self.load.drain_s if self.load.drain_s is not None else self.load.timeout_s
        _, pending = await asyncio.wait(set(self._tasks), timeout=drain + 1.0)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)

    async def _observe(self, stop: asyncio.Event) -> None:
        assert self.observer is not None
        while not stop.is_set():
            self.observer(self.counters)
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass
        self.observer(self.counters)

    async def run(self) -> RunOutput:
        with frozen_heap():
            return await self._run()

    async def _run(self) -> RunOutput:
        stop = asyncio.Event()
        obs = asyncio.create_task(self._observe(stop)) if self.observer else None
        watch = LoopWatch()
        watching = asyncio.create_task(watch.run(stop))
        http = client_mod.make_client()
        wall0 = time.time()
        clock0 = time.perf_counter()
        self.counters.started = clock0
        try:
            if self.load.concurrency is not None:
                await self._closed_loop(http, clock0)
            else:
                await self._open_loop(http, clock0)
            await self._drain()
        finally:
            for t in list(self._tasks):
                t.cancel()
            await http.aclose()
            stop.set()
            if obs:
                await obs
            await watching
        self.results.sort(key=lambda r: (r.planned, r.index))
        wall_end = wall0 + max((r.end for r in self.results), default=0.0)
        return RunOutput(results=self.results, wall_start=wall0, wall_end=wall_end, load=self.load.describe(),
                         workload=self.workload.describe(),
                         target={"base_url": self.target.base_url, "model": self.target.model},
                         generator=watch.stats.describe())


def run_sync(target: Target, workload: Workload, load: LoadSpec, observer: Observer | None = None) -> RunOutput:
    try:
        import uvloop  # optional: a cheaper event loop where installed

        return uvloop.run(Runner(target, workload, load, observer).run())
    except ImportError:
        return asyncio.run(Runner(target, workload, load, observer).run())
