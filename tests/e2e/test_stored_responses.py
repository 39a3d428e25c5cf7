"""Stored Responses through the gateway: a response the Responses API stored lives in the memory of the one
server that made it (vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1; the simulator keeps the same store), so a
retrieval or a continuation (``previous_response_id``) must reach that replica, and only its own tenant may
name it. Two simulated replicas behind the gateway, the real ``openai`` SDK; a second gateway sharing the
owners through real Redis."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from tests.conftest import drop_redis_keys, free_port
from tests.e2e.conftest import pool_cfg, start_gateway
from usefulwork.backends.sim.process import SimProcess

MODEL = "Llama-3.1-8B"
KEYS = {"k-alice": "alice", "k-bob": "bob"}


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stored-sims")
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")  # as vLLM: the store is off unless this is set
    out = []
    try:
        for i in range(2):
            sim = SimProcess(port=free_port(), profile="optimized-batched", gpu="A100-80G", model=MODEL,
                             time_scale=20.0, log_path=tmp / f"sim{i}.log")
            sim.start()
            out.append(sim)
        for sim in out:
            sim.wait_ready(120)
        mp.undo()
        yield out
    finally:
        mp.undo()
        for sim in out:
            sim.stop()


def _client(gw, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.v1, api_key=key, max_retries=0, timeout=60)


def _holders(sims, rid: str) -> list[int]:
    return [i for i, s in enumerate(sims) if httpx.get(f"{s.base_url}/v1/responses/{rid}", timeout=10).status_code == 200]


def test_a_stored_response_is_found_on_its_replica_by_its_tenant_alone(sims, tmp_path):
    gw = start_gateway(tmp_path, pool_cfg(MODEL, [s.base_url for s in sims], auth={"api_keys": KEYS},
                                          routing={"pickers": {"local": {"kind": "round-robin"}}}))
    try:
        alice, bob = _client(gw, "k-alice"), _client(gw, "k-bob")
        first = alice.responses.create(model=MODEL, input="Remember the word kiwi.", max_output_tokens=8)
        with alice.responses.stream(model=MODEL, input="Remember the word fig.", max_output_tokens=8) as s:
            streamed = s.get_final_response()
        for r in (first, streamed):
            assert len(_holders(sims, r.id)) == 1  # one server holds it; round robin alternates between two
            for _ in range(4):  # without affinity, every other call would reach the replica that does not hold it
                assert alice.responses.retrieve(r.id).id == r.id
        turns = [first.id]
        for i in range(4):  # a conversation continued turn by turn: each turn held where its previous one was
            nxt = alice.responses.create(model=MODEL, input=f"And turn {i}?", previous_response_id=turns[-1],
                                         max_output_tokens=4)
            assert nxt.usage.input_tokens > first.usage.input_tokens  # the stored conversation was prepended
            turns.append(nxt.id)
        assert {h for t in turns for h in _holders(sims, t)} == set(_holders(sims, first.id))

        # Another tenant: the same 404 as for an id that never existed, and nothing forwarded
        missing = "resp_" + uuid.uuid4().hex
        for rid in (first.id, missing):
            with pytest.raises(openai.NotFoundError) as e:
                bob.responses.retrieve(rid)
            assert e.value.body["message"] == f"Response with id '{rid}' not found."
            with pytest.raises(openai.NotFoundError) as e:
                bob.responses.create(model=MODEL, input="Go on.", previous_response_id=rid, max_output_tokens=4)
            assert e.value.body["param"] == "previous_response_id"

        # store=False: nothing kept, nothing to find
        unstored = alice.responses.create(model=MODEL, input="Forget this.", store=False, max_output_tokens=4)
        assert _holders(sims, unstored.id) == []
        with pytest.raises(openai.NotFoundError):
            alice.responses.retrieve(unstored.id)
        # background work would run outside admission and the ledger: refused with the field named
        with pytest.raises(openai.BadRequestError) as e:
            alice.responses.create(model=MODEL, input="Later.", background=True, max_output_tokens=4)
        assert e.value.body["param"] == "background"
        with pytest.raises(openai.AuthenticationError):
            _client(gw, "k-nobody").responses.retrieve(first.id)
        r = httpx.get(f"{gw.v1}/responses/{first.id}?stream=true", headers={"authorization": "Bearer k-alice"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        assert "Traceback" not in gw.log_text()
    finally:
        gw.stop()


@pytest.mark.vllm
def test_the_real_vllm_store_through_the_gateway(vllm_server, tmp_path):
    """One real CPU vLLM (the embedded fleet's, run with VLLM_ENABLE_RESPONSES_API_STORE=1): ids read from
    its answers and its stream, its stored conversation continued, and the tenant check in front of it."""
    gw = start_gateway(tmp_path, pool_cfg(vllm_server.model, [vllm_server.base_url], auth={"api_keys": KEYS}))
    try:
        alice, bob = _client(gw, "k-alice"), _client(gw, "k-bob")
        made = alice.responses.create(model=vllm_server.model, input="Say hello.", max_output_tokens=6)
        with alice.responses.stream(model=vllm_server.model, input="Count to three.", max_output_tokens=6) as s:
            streamed = s.get_final_response()
        for r in (made, streamed):
            got = alice.responses.retrieve(r.id)
            assert got.id == r.id and got.output_text == r.output_text
            with pytest.raises(openai.NotFoundError):
                bob.responses.retrieve(r.id)
        nxt = alice.responses.create(model=vllm_server.model, input="Again.", previous_response_id=made.id,
                                     max_output_tokens=4)
        assert nxt.usage.input_tokens > made.usage.input_tokens  # vLLM prepended the stored conversation
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model=vllm_server.model, input="Again.", previous_response_id=made.id,
                                 max_output_tokens=4)
    finally:
        gw.stop()


def test_gateways_sharing_redis_find_each_others_stored_responses(sims, tmp_path, redis_url):
    prefix = f"uw-test-stored-{uuid.uuid4().hex[:8]}"
    cfg = pool_cfg(MODEL, [s.base_url for s in sims], auth={"api_keys": KEYS},
                   scale_out={"redis_url": redis_url, "prefix": prefix})
    gw1 = start_gateway(tmp_path, cfg)
    gw2 = start_gateway(tmp_path, cfg)
    try:
        made = _client(gw1, "k-alice").responses.create(model=MODEL, input="Remember plum.", max_output_tokens=6)
        for _ in range(4):
            assert _client(gw2, "k-alice").responses.retrieve(made.id).id == made.id
        nxt = _client(gw2, "k-alice").responses.create(model=MODEL, input="Which fruit?", previous_response_id=made.id,
                                                        max_output_tokens=4)
        assert _holders(sims, nxt.id) == _holders(sims, made.id)
        with pytest.raises(openai.NotFoundError):
            _client(gw2, "k-bob").responses.retrieve(made.id)
    finally:
        gw1.stop()
        gw2.stop()
        drop_redis_keys(redis_url, f"{prefix}:")
