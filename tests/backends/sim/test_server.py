"""The simulated server as a real subprocess: launcher, CLI flags, time scale, streams, aborts."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.conftest import free_port
from usefulwork.backends.sim.catalog import build_spec
from usefulwork.backends.sim.offline import closed_loop
from usefulwork.backends.sim.process import SimProcess
from usefulwork.backends.sim.tokens import SimTokenizer


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def a100(tmp_path_factory):
    sim = SimProcess(gpu="A100-80G", model="Llama-3.1-8B", profile="optimized-batched", served_name="llama",
                     port=free_port(), time_scale=2.0, seed=0,
                     log_path=tmp_path_factory.mktemp("sim") / "a100.log")
    with sim:
        yield sim


def test_launcher_serves_the_resolved_spec(a100):
    info = httpx.get(f"{a100.base_url}/sim/info", timeout=5).json()
    assert info["gpu"] == "A100-80G" and info["model"] == "Llama-3.1-8B" and info["time_scale"] == 2.0
    assert info["flags"]["max_num_seqs"] == 256 and info["num_gpu_blocks"] > 20_000
    assert [m["id"] for m in httpx.get(f"{a100.base_url}/v1/models", timeout=5).json()["data"]] == ["llama"]
    assert a100.command()[:4] == [sys.executable, "-m", "usefulwork.cli", "sim"]


def test_time_scale_paces_tokens_like_the_simulated_gpu(a100):
    # The offline engine predicts the simulated latency; at time_scale 2 the wall time is half of
    # it (never less: the server cannot run ahead of its clock).
    predicted = closed_loop(build_spec("A100-80G", "Llama-3.1-8B"), 1, 1, 20, 100).mean_e2e
    c = openai.OpenAI(base_url=f"{a100.base_url}/v1", api_key="x", max_retries=0)
    t0 = time.perf_counter()
    r = c.completions.create(model="llama", prompt="one two three four five six", max_tokens=100,
                             extra_body={"ignore_eos": True})
    wall = time.perf_counter() - t0
    assert r.usage.completion_tokens == 100
    assert wall >= 0.9 * predicted / 2.0
    assert wall < predicted / 2.0 + 2.0


def test_many_concurrent_streams_are_batched(a100):
    async def run() -> list[int]:
        c = openai.AsyncOpenAI(base_url=f"{a100.base_url}/v1", api_key="x", max_retries=0)

        async def one(i: int) -> int:
            stream = await c.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": f"request {i}"}], max_tokens=40, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            return usage.completion_tokens

        return await asyncio.gather(*(one(i) for i in range(48)))

    # Count the engine's steps rather than sample the running gauge: a few samples a second on a slow
    # host could miss a burst that lasts half a second and read "one at a time" (it did once in CI).
    gen0 = metric(a100.base_url, "vllm:generation_tokens_total")
    steps0 = metric(a100.base_url, "vllm:iteration_tokens_total_count")
    counts = asyncio.run(run())
    assert counts == [40] * 48
    assert metric(a100.base_url, "vllm:generation_tokens_total") - gen0 == 48 * 40
    steps = metric(a100.base_url, "vllm:iteration_tokens_total_count") - steps0
    # Continuous batching: one request at a time takes 48 x 40 steps; a batch takes little more than 40.
    assert steps < 48 * 40 / 8, steps


def test_client_disconnect_aborts_the_request(a100):
    aborted0 = sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(f"{a100.base_url}/metrics", timeout=5).text.splitlines()
        if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line
    )
    body = {"model": "llama", "prompt": "tell me a long story", "max_tokens": 5000, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{a100.base_url}/v1/completions", json=body, timeout=10) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # first token arrived; hang up
    deadline = time.monotonic() + 5
    while metric(a100.base_url, "vllm:num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(a100.base_url, "vllm:num_requests_running") == 0
    text = httpx.get(f"{a100.base_url}/metrics", timeout=5).text
    aborted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line)
    assert aborted == aborted0 + 1
    assert metric(a100.base_url, "vllm:kv_cache_usage_perc") == 0.0


def test_seeded_requests_are_reproducible(a100):
    c = openai.OpenAI(base_url=f"{a100.base_url}/v1", api_key="x", max_retries=0)
    a, b, other = (c.completions.create(model="llama", prompt="hi", max_tokens=12, seed=s, logprobs=2,
                                        extra_body={"ignore_eos": True}) for s in (5, 5, 6))
    assert a.choices[0].text == b.choices[0].text != other.choices[0].text
    assert a.choices[0].logprobs.token_logprobs == b.choices[0].logprobs.token_logprobs


def test_eos_without_ignore_eos_stops_early_with_stop(a100):
    async def run() -> list:
        c = openai.AsyncOpenAI(base_url=f"{a100.base_url}/v1", api_key="x", max_retries=0)
        return await asyncio.gather(*(c.completions.create(model="llama", prompt=f"q{i}", max_tokens=400, seed=i)
                                      for i in range(8)))

    results = asyncio.run(run())
    stopped = [r for r in results if r.choices[0].finish_reason == "stop"]
    assert stopped and all(r.usage.completion_tokens < 400 for r in stopped)
    assert all(r.choices[0].finish_reason == "length" for r in results if r.usage.completion_tokens == 400)


def test_flag_overrides_reach_the_engine(tmp_path):
    port = free_port()
    with SimProcess(gpu="H100-SXM", model="Llama-3.1-8B", profile="naive-single", port=port, time_scale=50,
                    extra={"max_num_batched_tokens": 1024, "enable_prefix_caching": False},
                    log_path=tmp_path / "h100.log") as sim:
        info = httpx.get(f"{sim.base_url}/sim/info", timeout=5).json()
    assert info["flags"]["max_num_seqs"] == 1
    assert info["max_num_batched_tokens"] == 1024 and info["flags"]["enable_prefix_caching"] is False
    assert sim.proc.poll() is not None  # stopped on exit


def test_cli_print_spec_and_refusal():
    out = subprocess.run([sys.executable, "-m", "usefulwork.cli", "sim", "--gpu", "H200", "--model", "Llama-3.1-70B",
                          "--precision", "int8", "--print-spec"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    spec = json.loads(out.stdout)
    assert spec["gpu"] == "H200" and spec["precision"] == "int8" and spec["usd_per_hour"] > 0
    bad = subprocess.run([sys.executable, "-m", "usefulwork.cli", "sim", "--gpu", "A100-80G", "--model",
                          "Llama-3.1-70B", "--print-spec"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "does not fit" in bad.stderr


def test_approximate_tokenizer_without_a_model_folder():
    tok = SimTokenizer(None)
    assert not tok.exact
    assert len(tok.encode("x" * 400)) == 100  # ~4 bytes per token
    assert tok.encode("same prefix here")[:2] == tok.encode("same prefix here, different end")[:2]
    assert len(tok.vocab) > 100


def test_real_tokenizer_output_words_are_single_tokens():
    from usefulwork.backends.model import ensure_model

    tok = SimTokenizer(ensure_model())
    assert tok.exact
    text = "".join(t.text for t in tok.vocab[:50])
    assert len(tok.encode(text, add_special_tokens=False)) == 50


def test_non_streamed_request_is_aborted_when_the_client_leaves(a100):
    before = httpx.get(f"{a100.base_url}/metrics", timeout=5).text
    aborted0 = sum(float(line.rsplit(" ", 1)[1]) for line in before.splitlines()
                   if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line)
    body = {"model": "llama", "prompt": "a very long answer please", "max_tokens": 5000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{a100.base_url}/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 5
    while metric(a100.base_url, "vllm:num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    text = httpx.get(f"{a100.base_url}/metrics", timeout=5).text
    aborted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line)
    assert aborted == aborted0 + 1 and metric(a100.base_url, "vllm:num_requests_running") == 0


def test_cli_config_file_with_command_line_precedence(tmp_path):
    cfg = tmp_path / "sim.yaml"
    cfg.write_text("gpu: H100-SXM\nmodel: Llama-3.1-70B\nprecision: int8\ntp: 2\nmax-num-seqs: 64\n"
                   "enable_chunked_prefill: false\nmax_num_batched_tokens: 16384\nmax_model_len: 16384\n")
    out = subprocess.run([sys.executable, "-m", "usefulwork.cli", "sim", "--config", str(cfg), "--tp", "4",
                          "--print-spec"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    spec = json.loads(out.stdout)
    assert (spec["gpu"], spec["model"], spec["precision"], spec["tp"]) == ("H100-SXM", "Llama-3.1-70B", "int8", 4)
    assert spec["flags"]["max_num_seqs"] == 64 and spec["flags"]["enable_chunked_prefill"] is False
    cfg.write_text("max_num_sequences: 3\n")
    bad = subprocess.run([sys.executable, "-m", "usefulwork.cli", "sim", "--config", str(cfg), "--print-spec"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown setting" in bad.stderr


def test_a_priority_is_refused_unless_the_server_schedules_by_priority(a100):
    client = openai.OpenAI(base_url=f"{a100.base_url}/v1", api_key="x")
    with pytest.raises(openai.BadRequestError, match="Priority scheduling is not enabled"):
        client.completions.create(model="llama", prompt="hi", max_tokens=2, extra_body={"priority": 3})
    ok = client.completions.create(model="llama", prompt="hi", max_tokens=2, extra_body={"priority": 0})
    assert ok.usage.completion_tokens >= 1


def test_priority_scheduling_serves_the_lower_value_first(tmp_path):
    # One sequence at a time: a long request holds the engine while two wait; the later one, with
    # priority 0, starts before the earlier one with priority 1.
    with SimProcess(gpu="A100-80G", model="Llama-3.1-8B", profile="naive-single", port=free_port(), time_scale=1.0,
                    extra={"scheduling_policy": "priority"}, log_path=tmp_path / "prio.log") as sim:
        async def go():
            async with httpx.AsyncClient(base_url=sim.base_url, timeout=30) as c:
                def send(priority: int, tokens: int):
                    return c.post("/v1/completions", json={"model": "Llama-3.1-8B", "prompt": "a b c", "max_tokens": tokens,
                                                           "ignore_eos": True, "priority": priority})
                done = []

                async def tracked(name, priority, tokens):
                    await send(priority, tokens)
                    done.append(name)

                hold = asyncio.create_task(tracked("hold", 5, 200))
                await asyncio.sleep(0.2)
                low = asyncio.create_task(tracked("low", 1, 5))
                await asyncio.sleep(0.05)
                high = asyncio.create_task(tracked("high", 0, 5))
                await asyncio.gather(hold, low, high)
                return done

        assert asyncio.run(go()) == ["hold", "high", "low"]
        assert httpx.get(f"{sim.base_url}/sim/info", timeout=5).json()["flags"]["scheduling_policy"] == "priority"


def test_a_chat_stream_sends_its_role_chunk_with_the_first_token_as_vllm_does(a100):
    # vLLM's chat stream sends {"role": "assistant"} on its result generator's first output, i.e.
    # after the prefill: a gateway that times the first token from the first chunk must see the prefill.
    body = {"model": "llama", "messages": [{"role": "user", "content": "word " * 6000}], "max_tokens": 2, "stream": True}
    t0 = time.perf_counter()
    times, chunks = [], []
    with httpx.stream("POST", f"{a100.base_url}/v1/chat/completions", json=body, timeout=30) as r:
        t_head = time.perf_counter() - t0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter() - t0)
                chunks.append(json.loads(line[6:]))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"]["content"]
    prefill = times[1] - t_head  # a 6,000-token prefill on the simulated A100 at time scale 2: ~0.2 s
    assert prefill > 0.1 and times[0] - t_head > 0.8 * prefill and times[1] - times[0] < 0.2 * prefill


def test_steps_the_host_starts_late_are_counted_as_lag():
    """The wall-clock simulator idles its GPU while its event loop is busy elsewhere: ``lag_s`` (GET
    /sim/info, and per cell in the loadtest's results) counts that time, so a run on a busy host says
    it ran on a slower GPU than the one named. A request decoding on a loop blocked for 0.3 s (a real
    ``time.sleep`` on the loop, not a fake clock) shows ~0.3 s x time_scale of lag; the same request on
    a free loop shows next to none."""
    from usefulwork.backends.sim.engine import SimEngine
    from usefulwork.backends.sim.realtime import RealtimeRunner

    async def run(block_s: float) -> float:
        runner = RealtimeRunner(SimEngine(build_spec("A100-80G", "Llama-3.1-8B")), time_scale=2.0)
        runner.start()
        try:
            req = runner.submit(list(range(1000, 1064)), 200, ignore_eos=True)
            await asyncio.sleep(0.1)  # decoding: a step every ~10 ms of wall time
            time.sleep(block_s)  # the host busy with something else: no step starts meanwhile
            while req.finish_time is None:
                await asyncio.sleep(0.01)
            return runner.lag_s
        finally:
            await runner.stop()

    free, blocked = asyncio.run(run(0.0)), asyncio.run(run(0.3))
    assert free < 0.2  # (a busy CI host delays a few steps by a few ms)
    assert 0.55 <= blocked <= 0.9  # 0.3 s of wall time at time_scale 2 (0.6 s simulated), plus such delays
