"""How long ready work waits on the gateway's event loop, and how much of a core the process uses: the
gateway's own CPU saturation signals.

A gateway process serves every request on one event loop. When its core is saturated, ready callbacks
queue behind each other and a new one waits for the work ahead of it; when the core has headroom it
runs at once. ``LoopLag`` measures exactly that wait: every ``interval_s`` (50 times a second by
default, a few microseconds of CPU each) a timer makes a probe callback ready and the probe records how
long it waited to run (``time.perf_counter``: the loop's own clock is millisecond-grained on uvloop).
Its figure is the **median** of the last ``window`` probes (half a second): a saturated loop delays
most probes, while one slow iteration (a garbage collection, a ledger pass) on a loop with headroom
delays one, and the median ignores it.

The same probe also reads the process's CPU clock (``time.process_time``, about 0.6 us: 30 us of CPU a
second at 50 probes a second) and ``cpu_fraction`` is the share of one core the process used over the
same window (CPU seconds / wall seconds between the oldest and the newest probe). It sees what the
lag misses: streams keep a core busy in short slices, each callback quick, so a probe rarely waits long
while the core has no idle time left. With several worker processes each has its own loop and its
own figure, which is the right one: a worker saturates its own core.

Work that is optional (the ``mirror`` filter's shadow copies) asks ``busy(threshold_ms)`` and
``cpu_busy(fraction)`` before it adds CPU to a saturated process: extra work there shows up as queueing
in every primary request's latency, whatever the fleet behind the gateway is doing.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque


class LoopLag:
    def __init__(self, interval_s: float = 0.02, window: int = 25):
        self.interval_s = interval_s
        self.recent: deque[float] = deque(maxlen=window)
        self.clocks: deque[tuple[float, float]] = deque(maxlen=window + 1)  # (wall, process CPU) at each probe
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Arm the first timer on the running loop (idempotent)."""
        if self._handle is None:
            self._loop = asyncio.get_running_loop()
            self._handle = self._loop.call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        self._loop.call_soon(self._probe, time.perf_counter())
        self._handle = self._loop.call_later(self.interval_s, self._tick)

    def _probe(self, t_ready: float) -> None:
        now = time.perf_counter()
        self.recent.append(now - t_ready)
        self.clocks.append((now, time.process_time()))

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    @property
    def lag_ms(self) -> float:
        """The median wait of the recent probes, in ms (0 before the first probe ran)."""
        if not self.recent:
            return 0.0
        return 1000.0 * sorted(self.recent)[len(self.recent) // 2]

    @property
    def max_lag_ms(self) -> float:
        """The longest wait of the recent probes, in ms."""
        return 1000.0 * max(self.recent, default=0.0)

    @property
    def cpu_fraction(self) -> float:
        """The share of one core this process used between the oldest and the newest recent probe (0 before
        the second probe; above 1 only if its threads ran on several cores at once)."""
        if len(self.clocks) < 2:
            return 0.0
        (wall0, cpu0), (wall1, cpu1) = self.clocks[0], self.clocks[-1]
        return (cpu1 - cpu0) / (wall1 - wall0) if wall1 > wall0 else 0.0

    def busy(self, threshold_ms: float) -> bool:
        return self.lag_ms > threshold_ms

    def cpu_busy(self, fraction: float) -> bool:
        return self.cpu_fraction > fraction
