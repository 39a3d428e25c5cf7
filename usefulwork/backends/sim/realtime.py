"""Drive a SimEngine in (scaled) real time on the asyncio loop: the simulated server's heartbeat.

Simulated time = wall time x time_scale since start. Each step is planned at its start, the loop
sleeps until the step's simulated end, then applies it (tokens reach the waiting streams). If the
host falls behind (a busy CPU), the next step starts late: the lateness shows as a slower server,
exactly as a slow engine would. One task, no threads: cheap with many concurrent streams.
"""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

from usefulwork.backends.sim.engine import OutputSink, SimEngine
from usefulwork.backends.sim.scheduler import SimRequest
from usefulwork.tasks import cancel_and_wait

# Event-loop timers are ~1 ms coarse: sleeping for every sub-millisecond step (a GPU step at a
# high time scale) would add ~1 ms per step. Steps run ahead by up to this much wall time instead.
MIN_SLEEP_S = 0.002


class RealtimeRunner:
    def __init__(self, engine: SimEngine, time_scale: float = 1.0):
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.engine = engine
        self.time_scale = time_scale
        self._wall0 = time.monotonic()
        self._sim0 = engine.now
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.lag_s = 0.0  # total simulated time the loop started steps late (host too slow)

    def sim_now(self) -> float:
        return self._sim0 + (time.monotonic() - self._wall0) * self.time_scale

    def wall_delay(self, sim_seconds: float) -> float:
        return sim_seconds / self.time_scale

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        ignore_eos: bool = False,
        seed: int | None = None,
        sink: OutputSink | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> SimRequest:
        req = self.engine.add_request(
            prompt_token_ids, max_tokens, ignore_eos=ignore_eos, arrival_time=self.sim_now(),
            seed=seed, sink=sink, request_id=request_id, priority=priority,
        )
        self._wake.set()
        return req

    def abort(self, req: SimRequest) -> None:
        self.engine.abort(req)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="sim-engine")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _sleep_until(self, sim_t: float) -> None:
        delay = (sim_t - self.sim_now()) / self.time_scale
        if delay > MIN_SLEEP_S:
            await asyncio.sleep(delay)
        else:
            # Shorter than the loop's timer resolution: run the next step now (at most MIN_SLEEP_S
            # ahead of the clock) instead of oversleeping every step, just let other tasks run.
            await asyncio.sleep(0)

    async def _wait_wake(self, timeout: float | None) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def run(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_work():
                await self._wait_wake(None)
                continue
            now = self.sim_now()
            if now > engine.now:
                engine.now = now
            planned = engine.plan_step()
            if planned is None:
                nxt = engine.next_ready_time()
                await self._wait_wake(None if nxt is None else max(0.0, (nxt - now) / self.time_scale))
                continue
            plan, seconds = planned
            end = engine.now + seconds
            await self._sleep_until(end)
            late = self.sim_now() - end - MIN_SLEEP_S * self.time_scale
            if late > 0:
                self.lag_s += late
            engine.complete_step(plan, end)
