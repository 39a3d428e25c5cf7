"""How late the gateway's event loop runs its timers: the gateway's own CPU saturation signal.

A gateway process serves every request on one event loop. When its core is saturated, ready callbacks
queue behind each other and a timer fires late by about one loop iteration's worth of work; when the
core has headroom it fires within tens of microseconds. ``LoopLag`` arms one timer every
``interval_s`` (50 per second by default: a few microseconds of CPU each) and keeps the largest lateness
seen over the last ``window`` timers, so one slow iteration is remembered for ``window x interval_s``.

Work that is optional (the ``mirror`` filter's shadow copies) asks ``busy(threshold_ms)`` before it
adds CPU to a saturated process: extra work there shows up as queueing in every primary request's
latency, whatever the fleet behind the gateway is doing.
"""

from __future__ import annotations

import asyncio
from collections import deque


class LoopLag:
    def __init__(self, interval_s: float = 0.02, window: int = 10):
        self.interval_s = interval_s
        self.recent: deque[float] = deque(maxlen=window)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Arm the first timer on the running loop (idempotent)."""
        if self._handle is None:
            self._loop = asyncio.get_running_loop()
            self._arm()

    def _arm(self) -> None:
        assert self._loop is not None
        self._due = self._loop.time() + self.interval_s
        self._handle = self._loop.call_at(self._due, self._fire)

    def _fire(self) -> None:
        assert self._loop is not None
        self.recent.append(max(0.0, self._loop.time() - self._due))
        self._arm()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    @property
    def lag_ms(self) -> float:
        """The largest lateness over the recent window, in ms (0 before the first timer fired)."""
        return 1000.0 * max(self.recent, default=0.0)

    def busy(self, threshold_ms: float) -> bool:
        return self.lag_ms > threshold_ms
