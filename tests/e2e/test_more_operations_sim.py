"""Responses API and embeddings through the gateway, end to end, against the simulator (which, unlike the
small real model, serves both), with the ledger booking each request's usage."""

from __future__ import annotations

import signal

import httpx
import openai
import orjson
import pytest

from tests.conftest import free_port
from tests.e2e.conftest import pool_cfg, start_gateway
from usefulwork.backends.sim.process import SimProcess


@pytest.fixture(scope="module")
def sim_gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sim-ops")
    sim = SimProcess(port=free_port(), profile="optimized-batched", gpu="A100-80G", model="Llama-3.1-8B",
                     time_scale=20.0, log_path=tmp / "sim.log")
    sim.start()
    sim.wait_ready(120)
    ledger = tmp / "ledger.jsonl"
    gw = start_gateway(tmp, pool_cfg("Llama-3.1-8B", [sim.base_url], ledger={"jsonl_path": str(ledger),
                                                                            "flush_interval_s": 0.1}))
    try:
        yield gw, ledger
    finally:
        gw.stop()
        sim.stop()


def _records(ledger) -> list[dict]:
    return [orjson.loads(line) for line in ledger.read_bytes().splitlines() if line.strip()]


def test_responses_and_embeddings_through_the_gateway(sim_gateway):
    gw, ledger = sim_gateway
    c = openai.OpenAI(base_url=gw.v1, api_key="unused", max_retries=0, timeout=60)
    r = c.responses.create(model="Llama-3.1-8B", input="What is a KV cache?", max_output_tokens=12)
    assert r.output_text and r.usage.output_tokens == 12
    with c.responses.stream(model="Llama-3.1-8B", input="Explain batching.", max_output_tokens=10) as s:
        final = s.get_final_response()
    assert final.usage.output_tokens == 10
    e = c.embeddings.create(model="Llama-3.1-8B", input=["one text", "another text"])
    assert len(e.data) == 2 and len(e.data[0].embedding) == 384 and e.usage.prompt_tokens > 0
    again = c.embeddings.create(model="Llama-3.1-8B", input="one text")
    assert again.data[0].embedding == e.data[0].embedding  # deterministic per input
    gw.stop()  # a clean stop flushes the ledger
    recs = {(r["endpoint"], r["stream"]): r for r in _records(ledger)}
    assert recs[("responses", False)]["completion_tokens"] == 12 and recs[("responses", False)]["outcome"] == "ok"
    assert recs[("responses", True)]["completion_tokens"] == 10 and recs[("responses", True)]["usage_source"] == "backend"
    assert recs[("embeddings", False)]["prompt_tokens"] > 0 and recs[("embeddings", False)]["completion_tokens"] == 0


def test_a_streams_first_token_is_booked_after_the_prefill_on_every_operation(tmp_path):
    """vLLM sends a chat stream's role chunk with the first output, and a Responses stream's
    ``response.created`` / ``response.in_progress`` before the prefill: the gateway's TTFT (ledger,
    admission) must count the prefill on all three operations. A 4,000-word prompt's prefill on the
    simulated A100 at time scale 1 takes ~0.4 s; the sim's tokenizing of it ~0.05 s."""
    sim = SimProcess(port=free_port(), profile="optimized-batched", gpu="A100-80G", model="Llama-3.1-8B",
                     time_scale=1.0, log_path=tmp_path / "sim.log")
    sim.start()
    sim.wait_ready(120)
    ledger = tmp_path / "ledger.jsonl"
    gw = start_gateway(tmp_path, pool_cfg("Llama-3.1-8B", [sim.base_url], ledger={"jsonl_path": str(ledger)}))
    try:
        def words(w: str) -> str:  # a prompt of its own per request: no prefix-cache hit shortens a prefill
            return f"{w} " * 4000
        bodies = {"chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": words("cat")}]}),
                  "completions": ("/v1/completions", {"prompt": words("dog")}),
                  "responses": ("/v1/responses", {"input": words("fox")})}
        ids = {}
        for op, (path, b) in bodies.items():
            extra = {"max_output_tokens": 2} if op == "responses" else {"max_tokens": 2}
            with httpx.stream("POST", gw.url + path, json={"model": "Llama-3.1-8B", "stream": True, **b, **extra},
                              timeout=60) as r:
                assert r.status_code == 200
                ids[op] = r.headers["x-request-id"]
                r.read()
        gw.stop()
    finally:
        gw.stop()
        sim.stop()
    recs = {r["id"]: r for r in _records(ledger)}
    ttft = {op: recs[rid]["ttft_ms"] for op, rid in ids.items()}
    assert all(t > 300 for t in ttft.values()), ttft


def test_stream_still_running_after_the_shutdown_grace_is_told_and_not_booked_ok(tmp_path):
    """A real SIGTERM: uvicorn waits its 10 s grace for the stream, then cuts it (issue 9, item 2).
    The client must get an error event and [DONE] before the cut, and the ledger must not say ok."""
    sim = SimProcess(port=free_port(), profile="optimized-batched", gpu="A100-80G", model="Llama-3.1-8B",
                     time_scale=0.05, log_path=tmp_path / "sim.log")  # 20x slower than an A100: a long stream
    sim.start()
    sim.wait_ready(120)
    ledger = tmp_path / "ledger.jsonl"
    gw = start_gateway(tmp_path, pool_cfg("Llama-3.1-8B", [sim.base_url], ledger={"jsonl_path": str(ledger)}))
    try:
        events: list[bytes] = []
        with httpx.stream("POST", gw.v1 + "/chat/completions", timeout=60, json={
                "model": "Llama-3.1-8B", "stream": True, "max_tokens": 4000, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Tell a very long story."}]}) as resp:
            lines = resp.iter_lines()
            for line in lines:  # the stream is running: now stop the gateway
                if line.startswith("data: {"):
                    break
            gw.proc.send_signal(signal.SIGTERM)
            events = [line.encode() for line in lines if line]
        assert resp.status_code == 200
        assert b'"error"' in events[-2] and events[-1] == b"data: [DONE]", events[-3:]
        assert gw.proc.wait(30) == 0
        (rec,) = _records(ledger)
        assert rec["outcome"] == "error" and "shut down" in rec["error"] and rec["slo_met"] is False
    finally:
        gw.stop()
        sim.stop()
