"""Rates scaled to the server: the probe against a real simulated server, the capacity model, the runner."""

import pytest
from rich.console import Console

from usefulwork.loadtest import calibrate
from usefulwork.loadtest.calibrate import CalibrationError, Probe
from usefulwork.loadtest.experiment import ExperimentError, Options, load_experiment, plan, run_experiment

CALIBRATED = """
name: calibrated
backend:
  kind: sim
  gpu_name: {gpu}
  model: Llama-3.1-8B
  served_name: llama
  time_scale: 1
  gpu: {{type: {gpu}, count: 1, usd_per_hour: 3.5}}
slo: {{ttft_ms: 2000, tpot_ms: 100, e2e_ms: 5000, attainment: 0.95}}
calibrate: {{sized_for_rps: 11, concurrency: 16}}
profiles:
  optimized-batched: {{sim_profile: optimized-batched}}
cases:
  steady:
    arrival: {{process: poisson, rate: 5.5}}
    num_requests: 6
    timeout_s: 10
  burst:
    arrival: {{process: onoff, base_rate: 2, peak_rate: 22, period_s: 10, duty: 0.5}}
    num_requests: 6
    timeout_s: 10
shapes:
  - {{name: 512x128, prompt_tokens: 512, output_tokens: 128, cases: {{steady: {{arrival: {{process: poisson, rate: 4}}}}}}}}
"""


def _run(tmp_path, gpu, **opts):
    f = tmp_path / f"{gpu}.yaml"
    f.write_text(CALIBRATED.format(gpu=gpu))
    exp = load_experiment(str(f))
    data = run_experiment(exp, Options(out_dir=tmp_path / gpu, quiet=True, use_gateway=False, **opts), Console(quiet=True))
    return exp, data


def test_the_probe_estimates_the_simulated_servers_capacity_and_scales_every_rate(tmp_path):
    exp, data = _run(tmp_path, "A100-80G")
    cal = data["calibration"]
    p = cal["probe"]
    # a simulated A100 with Llama-3.1-8B: a 512-token prefill in tens of ms, a decode step of ~10 ms
    assert 0.02 < p["prefill_s"] < 0.2 and 0.005 < p["decode_1_s"] < 0.03 and p["decode_n_s"] >= p["decode_1_s"]
    # the admission experiment measures this server's capacity at this SLO: 11.13 req/s (docs/benchmarks.md)
    assert 7.0 < cal["estimated_capacity_rps"] < 16.0
    s = cal["rate_scale"]
    assert s == pytest.approx(cal["estimated_capacity_rps"] / 11)
    # every rate the cells ran at and the verdicts read, the shape's override too
    burst = exp.cases["burst"]["arrival"]
    assert (burst["base_rate"], burst["peak_rate"], burst["period_s"]) == (pytest.approx(2 * s), pytest.approx(22 * s),
                                                                          pytest.approx(10 / s))
    assert exp.cases["steady"]["arrival"]["rate"] == pytest.approx(5.5 * s)
    assert exp.cases["steady"]["num_requests"] == 6  # the same requests, at the server's pace
    assert exp.shapes[0]["cases"]["steady"]["arrival"]["rate"] == pytest.approx(4 * s)
    assert [c["result"]["num_prompts"] for c in data["cells"]] == [6, 6]
    assert "calibrated" in data["meta"]["rates"]
    # a faster GPU: a higher capacity, so higher rates
    _, h100 = _run(tmp_path, "H100-SXM")
    assert h100["calibration"]["estimated_capacity_rps"] > 1.3 * cal["estimated_capacity_rps"]


def test_a_given_rate_scale_skips_the_probe(tmp_path):
    exp, data = _run(tmp_path, "A100-80G", rate_scale=0.5)
    assert data["calibration"] == {"rate_scale": 0.5, "given": True}
    assert exp.cases["steady"]["arrival"]["rate"] == pytest.approx(2.75)
    # as written: nothing scaled, nothing probed
    exp, data = _run(tmp_path, "A100-80G", rate_scale=1.0)
    assert data["calibration"] == {"rate_scale": 1.0, "given": True} and exp.cases["steady"]["arrival"]["rate"] == 5.5


def test_the_model_follows_the_server():
    # the AVX-512 CPU vLLM the admission-vllm rates were first sized on: TPOT 40 ms at 4 sequences and
    # 190 ms at 22; it met the SLO at 0.6 req/s and collapsed at 0.8
    slow = Probe(prefill_s=0.4, decode_1_s=0.015, concurrency=22, decode_n_s=0.19, output_tokens=128, base_s=0.05)
    c = calibrate.capacity(slow, 5.0, 0.15, 30.0)
    assert 0.55 < c < 0.75
    mean, p95 = calibrate.operating_point(slow, c), calibrate.at_p95(slow, c)
    assert mean["inflight"] == pytest.approx(c * mean["e2e_s"])  # Little's law closes the model
    assert p95["inflight"] == pytest.approx(mean["inflight"] + 1.645 * mean["inflight"] ** 0.5)
    assert p95["tpot_s"] == pytest.approx(0.15) and mean["tpot_s"] < 0.15  # the TPOT SLO binds at the 95th percentile
    assert calibrate.operating_point(slow, 1 / 0.35) is None  # prefills alone fill the engine
    # twice as fast a decode: more capacity; a slower prefill: less
    fast = Probe(prefill_s=0.4, decode_1_s=0.0075, concurrency=22, decode_n_s=0.095, output_tokens=128, base_s=0.05)
    assert calibrate.capacity(fast, 5.0, 0.15, 30.0) > 1.5 * c
    assert calibrate.capacity(Probe(1.2, 0.015, 22, 0.19, 128, 0.05), 5.0, 0.15, 30.0) < c
    # few requests in flight swing more: the 95th percentile halves a slow server's mean-value figure
    # (this AVX2 host: a 2.2 s prefill, 58 ms a token alone, 128 with 8)
    avx2 = Probe(prefill_s=2.215, decode_1_s=0.058, concurrency=8, decode_n_s=0.128, output_tokens=128, base_s=0.064)
    assert calibrate.capacity(avx2, 5.0, 0.15, 30.0) < 0.6 * calibrate.capacity(avx2, 5.0, 0.15, 30.0, z=0.0)
    # a server that misses the SLO even alone has no capacity; a nonsense scale is refused
    assert calibrate.capacity(Probe(0.4, 0.2, 8, 0.4, 128), 5.0, 0.15, 30.0) == 0.0
    with pytest.raises(CalibrationError, match="outside"):
        calibrate.scale_for(Probe(0.4, 0.2, 8, 0.4, 128), 0.7, type("S", (), {"ttft_ms": 5e3, "tpot_ms": 150, "e2e_ms": 3e4})())


def test_bad_calibrate_blocks_name_the_field(tmp_path):
    for bad in ("{sized_for_rps: 0}", "{sized_for_rps: fast}", "{sized_for_rps: 1, concurrency: 1}", "{rps: 1}", "7"):
        f = tmp_path / "bad.yaml"
        f.write_text(CALIBRATED.format(gpu="A100-80G").replace("{sized_for_rps: 11, concurrency: 16}", bad))
        with pytest.raises(ExperimentError, match="calibrate takes sized_for_rps"):
            load_experiment(str(f))


def test_the_admission_vllm_experiment_is_calibrated():
    exp = load_experiment("admission-vllm")
    assert exp.calibrate["sized_for_rps"] > 0
    cells = {c.name: c for _, _, c in plan(exp, Options())}
    exp.scale_rates(2.0)
    scaled = {c.name: c for _, _, c in plan(exp, Options())}
    # the same traffic at twice the pace: rates doubled, durations and periods halved, timeouts kept
    b, b2 = cells["burst"], scaled["burst"]
    assert (b2.arrival["peak_rate"], b2.arrival["base_rate"]) == (2 * b.arrival["peak_rate"], 2 * b.arrival["base_rate"])
    assert (b2.arrival["period_s"], b2.duration_s, b2.timeout_s) == (b.arrival["period_s"] / 2, b.duration_s / 2, b.timeout_s)
    # traffic_of: the scaled case's arrivals and duration
    assert (scaled["priority-unloaded"].arrival, scaled["priority-unloaded"].duration_s) == \
        (scaled["priority-2x"].arrival, scaled["priority-2x"].duration_s)
    # the verdicts read the scaled cases: a burst's peaks and the capacity cells' goodput per second
    assert exp.cases["capacity-0.6"]["duration_s"] == 30 and exp.cases["capacity-0.6"]["arrival"]["rate"] == 1.2
