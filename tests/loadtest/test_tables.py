"""The run's table on the terminal: a generator that sent late says so, and why."""

from rich.console import Console

from usefulwork.loadtest.client import RequestResult
from usefulwork.loadtest.metrics import SLOSpec
from usefulwork.loadtest.results import run_result
from usefulwork.loadtest.runner import RunOutput
from usefulwork.loadtest.tables import late_warning, print_run


def _result(lags: list[float], generator: dict) -> dict:
    results = [RequestResult(index=i, kind="", planned=i * 0.5, sent=i * 0.5 + lag, end=i * 0.5 + lag + 1.0,
                             ttft=0.2, itl=[0.05] * 3, output_tokens=4, prompt_tokens=8, chunks=4, usage_seen=True)
               for i, lag in enumerate(lags)]
    out = RunOutput(results=results, wall_start=1.8e9, wall_end=1.8e9 + 10, load={"arrival": {"rate": 2.0}},
                    workload={"type": "synthetic"}, target={"base_url": "http://x", "model": "m"}, generator=generator)
    return run_result(out, slo=SLOSpec(), usd_per_hour=1.0)


def test_an_on_time_run_has_no_warning_and_shows_its_longest_stall():
    r = _result([0.001, 0.002, 0.0], {"ticks": 900, "max_stall_ms": 3.5, "max_stall_at_s": 1.0,
                                      "max_stall_on_cpu_ms": 1.0, "max_stall_runqueue_ms": 2.0, "runqueue_ms": 9.0})
    assert late_warning(r) is None
    console = Console(record=True, width=160)
    print_run(r, console)
    text = console.export_text()
    assert "generator loop: longest stall" in text and "3.5 ms (1 on a CPU, 2 waiting for one)" in text
    assert "late" not in text


def test_late_sends_are_counted_and_a_starved_generator_is_named():
    r = _result([0.0, 0.35, 2.9, 0.05], {"ticks": 700, "max_stall_ms": 2900.0, "max_stall_at_s": 4.5,
                                         "max_stall_on_cpu_ms": 12.0, "max_stall_runqueue_ms": 2880.0,
                                         "runqueue_ms": 3100.0})
    w = late_warning(r)
    assert w.startswith("2 of 4 requests were sent over 100 ms after their planned time (up to 2900 ms)")
    assert "2880 ms waiting for one" in w and "short of CPU" in w
    console = Console(record=True, width=400)
    print_run(r, console)
    assert "2 of 4 requests were sent over 100 ms" in console.export_text()


def test_a_generator_busy_on_its_own_cpu_is_not_called_starved():
    r = _result([0.0, 0.4], {"ticks": 10, "max_stall_ms": 400.0, "max_stall_at_s": 0.9,
                             "max_stall_on_cpu_ms": 405.0, "max_stall_runqueue_ms": 1.0, "runqueue_ms": 3.0})
    w = late_warning(r)
    assert "1 of 2 requests" in w and "405 ms of that interval on a CPU" in w and "short of CPU" not in w
