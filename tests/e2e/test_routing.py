"""Cascade routing and prefix-aware replica choice through the real gateway (`usefulwork serve`),
two real simulated pools, and the real `openai` SDK: virtual models listed and routed, streaming
escalation invisible to the client, decisions in the ledger, the picker's self-check fed by the
servers' cached_tokens."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.conftest import free_port
from tests.e2e.conftest import start_gateway
from usefulwork.backends.sim.process import SimProcess

ESCALATE = {"min_mean_logprob": 0.0, "min_token_logprob": -5.0, "hold_tokens": 6}  # sim logprobs are < 0
KEEP = {"min_mean_logprob": -5.0, "min_token_logprob": -5.0, "hold_tokens": 6}


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routing")
    small = [SimProcess(gpu="A10G", model="Llama-3.1-8B", served_name="small-model", port=free_port(), time_scale=50,
                        seed=i, log_path=tmp / f"small{i}.log") for i in range(2)]
    large = SimProcess(gpu="H100-SXM", model="Llama-3.1-8B", served_name="large-model", port=free_port(),
                       time_scale=50, seed=9, log_path=tmp / "large.log")
    for s in (*small, large):
        s.start()
    try:
        for s in (*small, large):
            s.wait_ready(60)
        vm = {"small_pool": "small", "large_pool": "large"}
        cfg = {
            "pools": [{"name": "small", "models": ["small-model"], "replicas": [s.base_url for s in small],
                       "prices": {"input_per_1m": 1.0, "output_per_1m": 2.0}},
                      {"name": "large", "models": ["large-model"], "replicas": [large.base_url]}],
            "timeouts": {"health_interval_s": 0.5},
            "filters": ["router"],
            "ledger": {"jsonl_path": str(tmp / "ledger.jsonl"), "flush_interval_s": 0.1},
            "routing": {
                "virtual_models": [{"name": "auto", "router": "heuristic", **vm},
                                   {"name": "auto-gate", "router": "confidence-gated", "confidence": ESCALATE, **vm},
                                   {"name": "auto-keep", "router": "confidence-gated", "confidence": KEEP, **vm}],
                "pickers": {"small": {"kind": "prefix", "block_tokens": 16, "tokenizer": "sim"}},
            },
        }
        gw = start_gateway(tmp, cfg)
        try:
            yield gw, tmp / "ledger.jsonl"
        finally:
            gw.stop()
    finally:
        for s in (*small, large):
            s.stop()


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key="x", max_retries=0)


def test_models_lists_the_virtual_names(routed):
    gw, _ = routed
    ids = {m.id for m in client(gw).models.list().data}
    assert {"auto", "auto-gate", "auto-keep", "small-model", "large-model"} <= ids


def test_heuristic_routes_through_the_gateway(routed):
    gw, _ = routed
    c = client(gw)
    easy = c.chat.completions.create(model="auto", messages=[{"role": "user", "content": "Capital of Peru?"}],
                                     max_tokens=8, extra_body={"ignore_eos": True})
    hard = c.chat.completions.create(model="auto", messages=[{"role": "user", "content":
                                     "Write code for a B-tree and explain why it stays balanced, step by step."}],
                                     max_tokens=8, extra_body={"ignore_eos": True})
    assert easy.model == "small-model" and hard.model == "large-model"


def test_stream_escalation_is_invisible_to_the_openai_sdk(routed):
    gw, ledger = routed
    stream = client(gw).chat.completions.create(
        model="auto-gate", messages=[{"role": "user", "content": "Explain entropy."}], max_tokens=20, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert {ch.model for ch in chunks} == {"large-model"}  # no chunk of the discarded small answer
    assert all(choice.logprobs is None for ch in chunks for choice in ch.choices)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text and chunks[-1].usage.completion_tokens == 20
    kept = list(client(gw).chat.completions.create(
        model="auto-keep", messages=[{"role": "user", "content": "Say hi."}], max_tokens=20, stream=True,
        extra_body={"ignore_eos": True}))
    assert {ch.model for ch in kept} == {"small-model"}
    assert sum(1 for ch in kept if ch.choices and ch.choices[0].delta.content) == 20
    # the ledger has the decision, the reason and the discarded work
    deadline = time.monotonic() + 10
    rows: list[dict] = []
    while time.monotonic() < deadline:
        rows = [json.loads(line) for line in ledger.read_text().splitlines()] if ledger.exists() else []
        if any(r["model"] == "auto-keep" for r in rows):
            break
        time.sleep(0.2)
    gate = next(r for r in rows if r["model"] == "auto-gate")
    assert gate["route"] == "auto-gate:large" and gate["escalated"] and "mean logprob" in gate["route_reason"]
    # the tokens held when judged: at least hold_tokens (one upstream read may carry several events)
    assert gate["prompt_tokens"] + 6 <= gate["discarded_tokens"] < gate["prompt_tokens"] + 20
    assert gate["discarded_cost_usd"] > 0
    keep = next(r for r in rows if r["model"] == "auto-keep")
    assert keep["route"] == "auto-keep:small" and not keep["escalated"] and keep["pool"] == "small"


def test_prefix_picker_self_check_runs_in_the_gateway(routed):
    gw, _ = routed
    c = client(gw)
    system = "You are the billing assistant. " + " ".join(f"Policy {i} applies." for i in range(60))
    for i in range(6):
        c.chat.completions.create(model="small-model", max_tokens=2, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}])
    stats = httpx.get(gw.url + "/usefulwork/stats", timeout=5).json()
    picker = stats["filters"]["pickers"]["small"]
    assert picker["checked"] >= 6 and picker["cached_tokens"] > 0
    assert picker["accuracy"] >= 0.8, picker
    router = stats["filters"]["router"]["virtual_models"]
    assert router["auto-gate"]["escalations"] >= 1 and router["auto"]["requests"] >= 2
