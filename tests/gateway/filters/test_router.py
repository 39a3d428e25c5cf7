"""The cascade filter against two real simulated vLLM servers (a small and a large pool).

``next`` is a minimal forwarder (the gateway's own Forwarder lives in gateway/proxy.py): it sends
``call.body`` to the first replica of ``call.pool`` and returns the real answer as a Reply.
"""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.conftest import free_port
from usefulwork import config
from usefulwork.backends.sim.process import SimProcess
from usefulwork.gateway.context import NullAccountant, RequestContext
from usefulwork.gateway.filters import build_filters
from usefulwork.gateway.pipeline import Call, Reply, Services
from usefulwork.upstream.fleet import Fleet


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    logs = tmp_path_factory.mktemp("sims")
    small = SimProcess(gpu="A10G", model="Llama-3.1-8B", served_name="small-model", port=free_port(),
                       time_scale=50, seed=1, log_path=logs / "small.log")
    large = SimProcess(gpu="H100-SXM", model="Llama-3.1-8B", served_name="large-model", port=free_port(),
                       time_scale=50, seed=2, log_path=logs / "large.log")
    with small, large:
        yield small, large


def make(sims, vm: dict):
    small, large = sims
    cfg = config.from_mapping({
        "pools": [{"name": "small", "models": ["small-model"], "replicas": [small.base_url],
                   "prices": {"input_per_1m": 1.0, "output_per_1m": 2.0}},
                  {"name": "large", "models": ["large-model"], "replicas": [large.base_url]}],
        "filters": ["router"],
        "routing": {"virtual_models": [{"name": "auto", "small_pool": "small", "large_pool": "large", **vm}]},
    }, environ={})
    fleet = Fleet(cfg)
    services = Services(cfg, fleet, NullAccountant())
    [f] = build_filters(cfg.filters, services)
    return f, services, fleet


def call_for(model: str, text: str, stream: bool = False, **extra) -> Call:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 24, "stream": stream,
            "ignore_eos": True, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    ctx = RequestContext(id="r", endpoint="chat", model=model, stream=stream)
    return Call(ctx, "chat", b"/v1/chat/completions", body, orjson.dumps(body), None, [])


sent: list[tuple[str, dict]] = []  # (replica url, body) of every upstream request, in order


async def forward(call: Call) -> Reply:
    """The last handler: send to the pool's first replica. As the gateway's contract says, ctx holds
    the final usage before the reply's closers run (here: as soon as the usage is seen)."""
    url = call.pool.replicas[0].url
    sent.append((url, call.body))
    client = httpx.AsyncClient(timeout=30)
    req = client.build_request("POST", url + call.path.decode(), json=call.body)
    resp = await client.send(req, stream=True)

    def close_usage(usage: dict) -> None:
        call.ctx.prompt_tokens = usage.get("prompt_tokens", 0)
        call.ctx.completion_tokens = usage.get("completion_tokens", 0)

    if not call.body.get("stream"):
        body = await resp.aread()
        await client.aclose()
        reply = Reply(resp.status_code, [(b"content-type", b"application/json")], body=body)
        close_usage(orjson.loads(body).get("usage") or {})
        return reply
    async def chunks():
        buf = b""
        async for part in resp.aiter_raw():
            buf += part
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                if b'"usage"' in ev and b"[DONE]" not in ev:
                    u = orjson.loads(ev[5:]).get("usage")
                    if u:
                        close_usage(u)
                yield ev + b"\n\n"

    async def close():
        await resp.aclose()
        await client.aclose()

    reply = Reply(resp.status_code, [(b"content-type", b"text/event-stream")], chunks=chunks())
    reply.on_close(close)
    return reply


def events(items: list[bytes]) -> list[dict]:
    out = []
    for item in items:
        for ev in item.split(b"\n\n"):
            ev = ev.strip()
            if ev.startswith(b"data:") and ev[5:].strip() != b"[DONE]":
                out.append(orjson.loads(ev[5:]))
    return out


async def test_heuristic_cascade_sets_the_pool_and_rewrites_the_model(sims):
    f, services, fleet = make(sims, {"router": "heuristic"})
    assert services.virtual_models == {"auto"}
    easy = call_for("auto", "What is the capital of Peru?")
    reply = await f(easy, forward)
    await reply.aclose()
    assert easy.pool is fleet.pools["small"] and easy.ctx.pool == "small"
    assert easy.body["model"] == "small-model" and easy.raw is None
    assert orjson.loads(reply.body)["model"] == "small-model"
    assert easy.ctx.route == "auto:small" and easy.ctx.route_reason == "heuristic 0.05 < 0.5 (no signal)"  # 28 of 600 chars
    hard = call_for("auto", "Write code for a rate limiter and explain why it is correct, step by step.")
    reply = await f(hard, forward)
    await reply.aclose()
    assert hard.pool is fleet.pools["large"] and orjson.loads(reply.body)["model"] == "large-model"
    assert hard.ctx.route == "auto:large" and "write code" in hard.ctx.route_reason
    st = f.stats()["virtual_models"]["auto"]
    assert st["requests"] == 2 and st["share"] == {"small": 0.5, "large": 0.5}


async def test_a_concrete_model_passes_through_untouched(sims):
    f, _, fleet = make(sims, {"router": "heuristic"})
    c = call_for("large-model", "Write code, step by step, explain why.")
    c.pool = fleet.pools["large"]
    raw, body = c.raw, c.body
    reply = await f(c, forward)
    await reply.aclose()
    assert c.raw is raw and c.body is body and c.ctx.route is None
    assert f.stats()["virtual_models"]["auto"]["requests"] == 0


KEEP = {"min_mean_logprob": -5.0, "min_token_logprob": -5.0}  # sim logprobs lie in [-1.05, -0.05]
ESCALATE = {"min_mean_logprob": 0.0, "min_token_logprob": -5.0}


async def test_gate_keeps_a_confident_answer_and_strips_logprobs_nobody_asked_for(sims):
    f, _, _ = make(sims, {"router": "confidence-gated", "confidence": KEEP})
    c = call_for("auto", "What is 2+2?")
    reply = await f(c, forward)
    await reply.aclose()
    obj = orjson.loads(reply.body)
    assert obj["model"] == "small-model" and obj["choices"][0]["logprobs"] is None
    assert sent[-1][1]["logprobs"] is True  # the gate asked upstream
    assert c.ctx.route == "auto:small" and c.ctx.route_reason.startswith("confidence-gated: kept small")
    assert not c.ctx.escalated and c.ctx.discarded_tokens == 0
    asked = call_for("auto", "What is 2+2?", logprobs=True, top_logprobs=2)
    reply = await f(asked, forward)
    await reply.aclose()
    lp = orjson.loads(reply.body)["choices"][0]["logprobs"]["content"]
    assert len(lp) == 24 and len(lp[0]["top_logprobs"]) == 2  # the client's own request is kept as asked


async def test_the_small_tiers_cap_replaces_whichever_output_limit_the_client_set(sims):
    """``confidence.small_max_tokens`` caps the small tier's answer also when the client sent
    max_completion_tokens, which vLLM reads before max_tokens (before, the cap went into max_tokens and
    was not read)."""
    f, _, _ = make(sims, {"router": "confidence-gated", "confidence": {**KEEP, "small_max_tokens": 8}})
    c = call_for("auto", "What is 2+2?", max_completion_tokens=30)
    reply = await f(c, forward)
    await reply.aclose()
    body = sent[-1][1]
    assert body["model"] == "small-model" and body["max_tokens"] == 8 and "max_completion_tokens" not in body
    assert orjson.loads(reply.body)["usage"]["completion_tokens"] == 8 and c.ctx.route == "auto:small"


async def test_the_gate_sends_a_responses_request_to_the_large_tier_at_once(sims):
    """A Responses answer carries no logprobs the gate reads: asking the small tier first would throw its
    answer away every time (both tiers paid), so the large tier answers at once, and the reason says why."""
    f, _, _ = make(sims, {"router": "confidence-gated", "confidence": KEEP})
    body = {"model": "auto", "input": "What is 2+2?", "max_output_tokens": 8}
    c = Call(RequestContext(id="r", endpoint="responses", model="auto", stream=False), "responses",
             b"/v1/responses", body, orjson.dumps(body), None, [])
    n = len(sent)
    reply = await f(c, forward)
    await reply.aclose()
    assert reply.status == 200 and orjson.loads(reply.body)["model"] == "large-model"
    assert len(sent) == n + 1 and sent[-1][1]["model"] == "large-model" and "logprobs" not in sent[-1][1]
    assert c.ctx.route == "auto:large" and "responses answers are not judged" in c.ctx.route_reason
    assert not c.ctx.escalated and c.ctx.discarded_tokens == 0


async def test_gate_escalates_an_unsure_answer_and_accounts_the_discarded_work(sims):
    f, _, _ = make(sims, {"router": "confidence-gated", "confidence": ESCALATE})
    c = call_for("auto", "Prove Fermat's last theorem.")
    reply = await f(c, forward)
    obj = orjson.loads(reply.body)
    c.ctx.on_answer()  # (as the endpoint calls it just before the last bytes: the journal's row holds them)
    assert c.ctx.discarded_tokens > 0
    await reply.aclose()  # (booked once: the closer finds them booked)
    assert obj["model"] == "large-model" and obj["choices"][0]["logprobs"] is None
    assert sent[-1][1].get("logprobs") is None and sent[-2][1]["model"] == "small-model"
    assert c.ctx.escalated and c.ctx.route == "auto:large" and "mean logprob" in c.ctx.route_reason
    small_usage = obj["usage"]  # same prompt on both pools (same simulated tokenizer)
    assert c.ctx.discarded_tokens == small_usage["prompt_tokens"] + 24
    assert c.ctx.discarded_cost_usd == pytest.approx((small_usage["prompt_tokens"] * 1.0 + 24 * 2.0) / 1e6)
    st = f.stats()
    assert st["virtual_models"]["auto"]["escalations"] == 1 and st["discarded_tokens"] == c.ctx.discarded_tokens


async def test_stream_escalation_is_invisible_to_the_client(sims):
    f, _, _ = make(sims, {"router": "confidence-gated", "confidence": {**ESCALATE, "hold_tokens": 8}})
    c = call_for("auto", "Explain quantum gravity.", stream=True)
    reply = await f(c, forward)
    items = [i async for i in reply.chunks]
    await reply.aclose()
    evs = events(items)
    assert evs and {e["model"] for e in evs} == {"large-model"}  # not one event of the small answer
    assert not any(ch.get("logprobs") for e in evs for ch in e.get("choices", []))
    assert sum(1 for e in evs for ch in e["choices"] if ch["delta"].get("content")) == 24
    assert c.ctx.escalated and c.ctx.discarded_tokens == c.ctx.prompt_tokens + 8


async def test_stream_kept_releases_held_tokens_then_the_rest(sims):
    f, _, _ = make(sims, {"router": "confidence-gated", "confidence": {**KEEP, "hold_tokens": 8}})
    c = call_for("auto", "Say hi.", stream=True)
    reply = await f(c, forward)
    evs = events([i async for i in reply.chunks])
    await reply.aclose()
    assert {e["model"] for e in evs} == {"small-model"} and not c.ctx.escalated
    assert sum(1 for e in evs for ch in e["choices"] if ch["delta"].get("content")) == 24
    assert not any(ch.get("logprobs") for e in evs for ch in e.get("choices", []))
    assert evs[-1]["usage"]["completion_tokens"] == 24


async def test_gate_escalates_when_the_small_tier_fails(sims):
    f, _, _ = make(sims, {"router": "confidence-gated", "confidence": KEEP})
    c = call_for("auto", "hi", max_tokens=10**7)  # the small server rejects it (400): the large one gets the chance
    reply = await f(c, forward)
    await reply.aclose()
    assert c.ctx.escalated and "small tier answered 400" in c.ctx.route_reason
