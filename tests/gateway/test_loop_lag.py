"""LoopLag on a real event loop: a loop kept saturated by ready work (callbacks that each hold the CPU and
make themselves ready again, as many busy requests do) shows lag; a free loop does not; one long stall on
an otherwise free loop is ignored by the median. The same probe's CPU figure: about one core while the
loop computes, about none while it idles."""

from __future__ import annotations

import asyncio
import time

from usefulwork.gateway.loop_lag import LoopLag


def saturate(loop: asyncio.AbstractEventLoop, chains: int, hold_s: float, spin: bool = False) -> list[bool]:
    """``chains`` callbacks, each holding the loop for ``hold_s`` (sleeping, or with ``spin`` computing: using
    the CPU) and scheduling itself again; set ``running[0] = False`` to stop them."""
    running = [True]

    def work() -> None:
        if running[0]:
            if spin:
                end = time.perf_counter() + hold_s
                while time.perf_counter() < end:
                    pass
            else:
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


def test_the_cpu_fraction_is_about_one_core_while_the_loop_computes_and_about_none_while_it_idles():
    async def scenario():
        lag = LoopLag(interval_s=0.01, window=25)
        lag.start()
        await _wait_for(lambda: len(lag.clocks) == 26)
        idle = lag.cpu_fraction
        running = saturate(asyncio.get_running_loop(), chains=2, hold_s=0.002, spin=True)
        await asyncio.sleep(0.6)  # a whole window of computing
        burning = lag.cpu_fraction
        running[0] = False
        await _wait_for(lambda: lag.cpu_fraction < 0.3)
        after = lag.cpu_fraction
        lag.stop()
        return idle, burning, after, len(lag.clocks)

    idle, burning, after, n = asyncio.run(scenario())
    # generous bounds: a shared test host may take part of the core away, or wake the idle loop now and then
    assert burning > 0.6, burning
    assert idle < 0.3 and after < 0.3, (idle, after)
    assert n == 26  # the window: 25 intervals between the oldest and the newest probe


def test_the_cpu_fraction_is_cpu_seconds_over_wall_seconds_of_the_window():
    lag = LoopLag()
    assert lag.cpu_fraction == 0.0 and not lag.cpu_busy(0.5)
    lag.clocks.append((10.0, 3.0))
    assert lag.cpu_fraction == 0.0  # one probe: no interval yet
    lag.clocks.extend([(10.25, 3.1), (10.5, 3.4)])
    assert abs(lag.cpu_fraction - 0.8) < 1e-9 and lag.cpu_busy(0.7) and not lag.cpu_busy(0.9)
