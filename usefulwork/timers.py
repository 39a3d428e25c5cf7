"""A deadline that moves often, on one event-loop timer."""

from __future__ import annotations

import asyncio
from typing import Callable


class MovingDeadline:
    """One timer for a deadline that each use moves (a connection's head deadline, keep-alive timeout,
    upstream read timeout): scheduling and cancelling a loop timer per request cost ~1-2% of the gateway's
    CPU each (docs/benchmarks.md section 11).

    ``arm(seconds)`` moves the deadline; a timer is scheduled only when none is, or when the new deadline
    is earlier than the scheduled one. ``disarm()`` clears it. A timer that fires early (the deadline
    moved on since) schedules itself again for the current deadline; one that fires disarmed does
    nothing. ``callback`` runs once the armed deadline has passed (disarmed by then)."""

    __slots__ = ("loop", "callback", "deadline", "timer", "_at")

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]):
        self.loop = loop
        self.callback = callback
        self.deadline: float | None = None  # loop time
        self.timer: asyncio.TimerHandle | None = None
        self._at = 0.0  # when the scheduled timer fires

    def arm(self, seconds: float) -> None:
        deadline = self.deadline = self.loop.time() + seconds
        timer = self.timer
        if timer is not None and self._at > deadline:  # sooner than the scheduled one: reschedule
            timer.cancel()
            timer = None
        if timer is None:
            self._at = deadline
            self.timer = self.loop.call_at(deadline, self._fire)

    def disarm(self) -> None:
        self.deadline = None

    def cancel(self) -> None:
        """Disarm and drop the timer (the owner is closing)."""
        self.deadline = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _fire(self) -> None:
        self.timer = None
        deadline = self.deadline
        if deadline is None:
            return
        if self.loop.time() < deadline:
            self._at = deadline
            self.timer = self.loop.call_at(deadline, self._fire)
            return
        self.deadline = None
        self.callback()
