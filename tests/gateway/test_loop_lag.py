"""LoopLag on a real event loop: a loop kept saturated by ready work (callbacks that each hold the CPU and
make themselves ready again, as many busy requests do) shows lag; a free loop does not; one long stall on
an otherwise free loop is ignored by the median."""

from __future__ import annotations

import asyncio
import time

from usefulwork.gateway.loop_lag import LoopLag


def saturate(loop: asyncio.AbstractEventLoop, chains: int, hold_s: float) -> list[bool]:
    """``chains`` callbacks, each holding the CPU for ``hold_s`` and scheduling itself again; set
    ``running[0] = False`` to stop them."""
    running = [True]

    def work() -> None:
        if running[0]:
            time.sleep(hold_s)
            loop.call_soon(work)

    for _ in range(chains):
        loop.call_soon(work)
    return running


async def _wait_for(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        await asyncio.sleep(0.05)


def test_a_saturated_loop_shows_lag_and_a_free_one_does_not():
    async def scenario():
        lag = LoopLag(interval_s=0.01, window=25)
        lag.start()
        lag.start()  # idempotent: still one timer
        await _wait_for(lambda: len(lag.recent) == 25)
        free = lag.lag_ms
        running = saturate(asyncio.get_running_loop(), chains=4, hold_s=0.002)  # ~8 ms of work per iteration
        await asyncio.sleep(0.6)
        saturated = lag.lag_ms
        running[0] = False
        await _wait_for(lambda: lag.lag_ms < 2.0)
        after = lag.lag_ms
        lag.stop()
        n = len(lag.recent)
        return free, saturated, after, n

    free, saturated, after, n = asyncio.run(scenario())
    assert saturated >= 4.0, saturated  # a probe waits for the chains' work queued ahead of it
    assert free < 2.0 and after < 2.0, (free, after)
    assert n == 25  # the window is bounded


def test_one_long_stall_on_a_free_loop_is_not_saturation():
    async def scenario():
        lag = LoopLag(interval_s=0.01, window=25)
        lag.start()
        await _wait_for(lambda: len(lag.recent) == 25)
        loop = asyncio.get_running_loop()
        loop.call_soon(time.sleep, 0.05)  # one 50 ms stall (say, a garbage collection)
        await asyncio.sleep(0.1)
        lag.stop()
        return lag.lag_ms

    assert asyncio.run(scenario()) < 2.0


def test_before_any_probe_the_lag_is_zero_and_busy_compares_to_a_threshold():
    lag = LoopLag()
    assert lag.lag_ms == 0.0 and lag.max_lag_ms == 0.0 and not lag.busy(0.5)
    lag.recent.extend([0.0002, 0.003, 0.004])
    assert lag.lag_ms == 3.0 and lag.max_lag_ms == 4.0 and lag.busy(1.0) and not lag.busy(3.0)
