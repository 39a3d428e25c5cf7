"""The generator's loop watch: where a stall's time went, and the heap kept out of collections during a run."""

import asyncio
import gc
import time
import weakref

from usefulwork.loadtest.loopwatch import LoopWatch, frozen_heap


def _watch_while(block) -> dict:
    async def main() -> dict:
        stop = asyncio.Event()
        watch = LoopWatch(period_s=0.005)
        task = asyncio.create_task(watch.run(stop))
        await asyncio.sleep(0.05)
        block()
        await asyncio.sleep(0.05)
        stop.set()
        await task
        return watch.stats.describe()

    return asyncio.run(main())


def test_a_stall_spent_asleep_is_measured_and_not_counted_on_a_cpu():
    g = _watch_while(lambda: time.sleep(0.3))
    assert g["ticks"] > 10
    assert 280 <= g["max_stall_ms"] <= 1000
    assert g["max_stall_on_cpu_ms"] < 100  # the thread slept (as it would waiting for the GIL)
    assert g["runqueue_ms"] is not None and g["runqueue_ms"] >= 0


def test_a_stall_spent_computing_is_counted_on_a_cpu():
    def spin():
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            pass

    g = _watch_while(spin)
    assert g["max_stall_ms"] >= 280
    # the thread's own CPU time in the gap: at least the 0.3 s it spun; the rest of the gap, if any, in the run queue
    assert g["max_stall_on_cpu_ms"] >= 280
    assert g["max_stall_on_cpu_ms"] + g["max_stall_runqueue_ms"] <= g["max_stall_ms"] + 20


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_frozen_heap_keeps_what_was_alive_out_of_collections_until_the_outer_block_ends():
    gc.collect()
    freed: list[int] = []
    before = _Cycle()
    weakref.finalize(before, freed.append, 1)
    with frozen_heap():  # collects what is garbage already, then freezes the rest: `before` is alive
        assert gc.get_freeze_count() > 0
        del before  # garbage now, but only a collection finds it (a reference cycle)
        with frozen_heap():  # a run inside a run
            pass
        assert gc.get_freeze_count() > 0, "the inner block must not unfreeze the outer one's heap"
        gc.collect()
        assert freed == []  # a full collection during the block did not scan it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert freed == [1]


def test_a_heap_frozen_by_someone_else_stays_frozen():
    gc.freeze()  # as `usefulwork serve` does once started, in a process that also runs a load
    try:
        owned = gc.get_freeze_count()
        with frozen_heap():
            pass
        assert gc.get_freeze_count() >= owned > 0
    finally:
        gc.unfreeze()


def test_without_schedstat_only_the_gaps_are_measured(monkeypatch):
    from usefulwork.loadtest import loopwatch

    monkeypatch.setattr(loopwatch, "_schedstat_reader", lambda: (None, None))  # not Linux, or no schedstat
    g = _watch_while(lambda: time.sleep(0.2))
    assert g["max_stall_ms"] >= 180 and g["ticks"] > 10
    assert g["max_stall_on_cpu_ms"] is None and g["max_stall_runqueue_ms"] is None and g["runqueue_ms"] is None
