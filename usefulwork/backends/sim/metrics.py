"""Prometheus text for /metrics with vLLM V1's metric names, labels and bucket boundaries.

Rendered at scrape time from the engine's plain counters (no prometheus_client registry: several
simulated servers can live in one test process, and observing a histogram is a list increment).
Times are SIMULATED seconds (wall seconds x time_scale), i.e. what the simulated GPU would show.
"""

from __future__ import annotations

from dataclasses import asdict

from usefulwork.backends.sim.engine import Histogram, SimEngine


def _labels(**kv: str) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in kv.items()) + "}"


def _esc(v: object) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(engine: SimEngine, model_name: str) -> str:
    base = {"engine": "0", "model_name": model_name}
    lab = _labels(**base)
    st, sched, spec = engine.stats, engine.scheduler.stats, engine.spec
    out: list[str] = []

    def gauge(name: str, help_: str, value: float) -> None:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} gauge\n{name}{lab} {float(value)}")

    def counter(name: str, help_: str, value: float) -> None:
        out.append(f"# HELP {name}_total {help_}\n# TYPE {name}_total counter\n{name}_total{lab} {float(value)}")

    def histogram(name: str, help_: str, h: Histogram) -> None:
        lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        for le, c in h.cumulative():
            lines.append(f"{name}_bucket{_labels(**base, le=le)} {float(c)}")
        lines.append(f"{name}_count{lab} {float(h.n)}")
        lines.append(f"{name}_sum{lab} {h.total}")
        out.append("\n".join(lines))

    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", engine.num_running)
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine.num_waiting)
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.kv.usage)
    counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
            sched.prefix_cache_queries)
    counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", sched.prefix_cache_hits)
    counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", sched.num_preemptions)
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", st.prompt_tokens)
    counter("vllm:generation_tokens", "Number of generation tokens processed.", st.generation_tokens)
    lines = ["# HELP vllm:request_success_total Count of successfully processed requests.",
             "# TYPE vllm:request_success_total counter"]
    for reason in ("stop", "length", "abort"):
        lines.append(f"vllm:request_success_total{_labels(**base, finished_reason=reason)} {float(st.finished[reason])}")
    out.append("\n".join(lines))
    histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", st.request_prompt_tokens)
    histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", st.request_generation_tokens)
    histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", st.iteration_tokens)
    histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", st.ttft)
    histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", st.itl)
    histogram("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
              st.tpot)
    histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", st.e2e)
    histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", st.queue)
    histogram("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
              st.inference)
    histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", st.prefill)
    histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", st.decode)
    info = {
        "block_size": str(spec.block_size),
        "cache_dtype": "auto",
        "enable_prefix_caching": str(spec.flags.enable_prefix_caching),
        "gpu_memory_utilization": str(spec.flags.gpu_memory_utilization),
        "num_gpu_blocks": str(spec.num_gpu_blocks),
        "num_cpu_blocks": "None",
        "engine": "0",
    }
    out.append(
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f"vllm:cache_config_info{_labels(**info)} 1.0"
    )
    # Simulator-only facts, under their own prefix so nobody mistakes them for vLLM's.
    sim = {k: str(v) for k, v in asdict(spec.flags).items() if v is not None}
    out.append(
        "# HELP usefulwork_sim_info The simulated hardware, model and serving profile\n"
        "# TYPE usefulwork_sim_info gauge\n"
        f"usefulwork_sim_info{_labels(gpu=spec.gpu.name, model=spec.model.name, precision=spec.precision.name, tp=str(spec.tp), profile=spec.profile, usd_per_hour=str(spec.usd_per_hour), **{k: v for k, v in sim.items() if k in ('max_num_seqs', 'max_num_batched_tokens', 'enable_chunked_prefill', 'scheduler')})} 1.0"
    )
    out.append(
        "# HELP usefulwork_sim_busy_seconds_total Simulated seconds the engine spent running steps\n"
        "# TYPE usefulwork_sim_busy_seconds_total counter\n"
        f"usefulwork_sim_busy_seconds_total {st.busy_seconds}"
    )
    return "\n".join(out) + "\n"
