"""LoopLag on a real event loop: a real stall (a blocking call on the loop) is seen, and forgotten once the
window has passed."""

from __future__ import annotations

import asyncio
import time

from usefulwork.gateway.loop_lag import LoopLag


def test_a_blocked_loop_shows_lag_and_the_lag_is_forgotten_after_the_window():
    async def scenario():
        lag = LoopLag(interval_s=0.01, window=10)
        lag.start()
        lag.start()  # idempotent: still one timer
        await asyncio.sleep(0.05)
        time.sleep(0.08)  # the loop cannot run anything for 80 ms
        await asyncio.sleep(0.001)  # the late timer fires now
        stalled = lag.lag_ms
        await asyncio.sleep(0.3)  # 30 timers: the stall has left the 10-timer window
        after = lag.lag_ms
        fired = len(lag.recent)
        lag.stop()
        n = len(lag.recent)
        await asyncio.sleep(0.05)
        return stalled, after, fired, n, len(lag.recent)

    stalled, after, fired, n_at_stop, n_later = asyncio.run(scenario())
    assert stalled >= 60.0  # the timer due during the stall ran ~70-80 ms late
    assert after < 60.0  # the window no longer holds the stall
    assert fired == 10 and n_at_stop == n_later  # the window is bounded; stop() stops the timer


def test_before_any_timer_the_lag_is_zero_and_busy_compares_to_a_threshold():
    lag = LoopLag()
    assert lag.lag_ms == 0.0 and not lag.busy(0.5)
    lag.recent.extend([0.0002, 0.003])
    assert lag.lag_ms == 3.0 and lag.busy(1.0) and not lag.busy(3.0)
