"""Is the load generator itself on time? A watch on its event loop, and the collector kept off the old heap.

A request sent late by the generator (schedule lag) is the generator's fault only if its loop could run.
``LoopWatch`` ticks every ``period_s`` on the generator's loop and keeps, for the run, the longest gap
between ticks beyond the period (a *stall*: nothing on the loop ran, no request was sent) and where that
time went, from the loop thread's ``/proc/self/task/<tid>/schedstat`` (Linux):

- ``on_cpu``: the thread ran (its own work, or the garbage collector) and the loop did not get back;
- ``runqueue``: the thread was runnable but the kernel ran something else (a starved generator);
- the rest: the thread slept outside the loop's poll (waiting for the GIL held by another thread, a page
  fault from disk).

The total run-queue wait over the run is kept as well. Where ``/proc`` has no schedstat, only the gaps are
measured.

``freeze_heap`` (``frozen_heap`` as a block) moves every object alive before a run to the collector's permanent generation for the
run's length (``gc.freeze``): a full collection during the run then scans only what the run made. In a
process that has grown a large heap (an experiment running many cells, a test session) a full collection
of that heap stops the loop for hundreds of milliseconds (0.3-0.4 s measured in the test session on a
2-core host), every request planned in that time is sent late.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator


@dataclass
class LoopStats:
    ticks: int = 0
    max_stall_s: float = 0.0  # longest gap between ticks beyond the period
    max_stall_at_s: float = 0.0  # when it ended, seconds from the watch's start
    # where the time of the tick interval that held it went (the stall plus the period): on a CPU, waiting for one
    max_stall_on_cpu_s: float | None = None
    max_stall_runqueue_s: float | None = None
    runqueue_s: float | None = None  # the loop thread's run-queue wait over the whole run

    def describe(self) -> dict[str, float | int | None]:
        ms = (lambda v: None if v is None else round(v * 1000.0, 3))
        return {"ticks": self.ticks, "max_stall_ms": ms(self.max_stall_s), "max_stall_at_s": round(self.max_stall_at_s, 3),
                "max_stall_on_cpu_ms": ms(self.max_stall_on_cpu_s),
                "max_stall_runqueue_ms": ms(self.max_stall_runqueue_s), "runqueue_ms": ms(self.runqueue_s)}


def _schedstat_reader():
    """(read, file): ``read()`` gives the calling thread's (on-CPU s, run-queue wait s) from its schedstat;
    (None, None) where that file cannot be read or parsed (not Linux, no CONFIG_SCHED_INFO)."""
    path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115 - kept open for the watch's life, closed by it
    except OSError:
        return None, None

    def read() -> tuple[float, float]:
        f.seek(0)
        on_cpu, runqueue = f.read().split()[:2]
        return int(on_cpu) / 1e9, int(runqueue) / 1e9

    try:
        read()
    except (OSError, ValueError):
        f.close()
        return None, None
    return read, f


class LoopWatch:
    def __init__(self, period_s: float = 0.01) -> None:
        self.period_s = period_s
        self.stats = LoopStats()

    async def run(self, stop: asyncio.Event) -> None:
        """Tick until ``stop`` is set (a task on the loop being watched)."""
        read, f = _schedstat_reader()
        st = self.stats
        try:
            t0 = last = time.perf_counter()
            cpu = wait = wait0 = 0.0
            if read:
                cpu, wait = read()
                wait0 = wait
            while not stop.is_set():
                await asyncio.sleep(self.period_s)
                now = time.perf_counter()
                st.ticks += 1
                gap = now - last - self.period_s
                if read:
                    c, w = read()
                    if gap > st.max_stall_s:
                        st.max_stall_on_cpu_s, st.max_stall_runqueue_s = c - cpu, w - wait
                    cpu, wait = c, w
                if gap > st.max_stall_s:
                    st.max_stall_s, st.max_stall_at_s = gap, now - t0
                last = now
            if read:
                st.runqueue_s = wait - wait0
        finally:
            if f is not None:
                f.close()


_frozen = [0]  # nesting depth: a run inside a run (an experiment's cell) unfreezes only at the outer end
_kept = [False]  # the heap was frozen already by someone else (a gateway in this process): never unfreeze it


def freeze_heap() -> Callable[[], None]:
    """Collect once, then leave every object alive now out of collections until the returned undo is called.

    Nested calls unfreeze only at the outermost undo, and a heap another part of the process had frozen
    already (``usefulwork serve`` freezes its own once started) stays frozen: ``gc.unfreeze`` cannot undo
    one freeze without the other. The collection comes first so that garbage is not frozen with the rest;
    call this before the run's clock starts."""
    if _frozen[0] == 0:
        _kept[0] = gc.get_freeze_count() > 0  # gc.unfreeze is all or nothing: it would undo their freeze too
        gc.collect()
        gc.freeze()
    _frozen[0] += 1
    done = [False]

    def undo() -> None:
        if done[0]:
            return
        done[0] = True
        _frozen[0] -= 1
        if _frozen[0] == 0 and not _kept[0]:
            gc.unfreeze()

    return undo


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """``freeze_heap`` for the length of a block."""
    undo = freeze_heap()
    try:
        yield
    finally:
        undo()
