"""The cascade filter ("router"): virtual model names -> a router's choice of pool.

For a request naming a virtual model (``routing.virtual_models``, e.g. ``auto``) it asks that
model's router for a tier, sets ``call.pool`` (the forwarder then picks a replica in it), rewrites
the body's ``model`` to one the pool serves, and notes the decision in the ledger record
(``ctx.route`` = "<virtual>:<tier>", ``ctx.route_reason``). Requests naming a concrete model pass
through untouched.

With the ``confidence-gated`` router it asks the small tier first with logprobs and judges the
answer (``routers/confidence.py``): a whole answer for a non-streaming request; the first
``hold_tokens`` tokens of a stream, held back until judged, so a client never sees the first tokens
of an answer that is then escalated. An escalated request's discarded small-tier work is noted in
``ctx.discarded_tokens`` / ``ctx.discarded_cost_usd``. Logprobs the client did not ask for are
stripped from what it receives.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

import orjson

from usefulwork.gateway.pipeline import Call, Handler, Reply, Services
from usefulwork.gateway.validation import max_tokens_of, with_max_tokens
from usefulwork.routers import Router, build_router
from usefulwork.routers.confidence import client_asked_logprobs, strip_logprobs, token_logprobs, with_logprobs

if TYPE_CHECKING:
    from usefulwork.routers.config import VirtualModel
    from usefulwork.upstream.fleet import PoolState


@dataclass
class Cascade:
    vm: VirtualModel
    router: Router
    small: PoolState
    large: PoolState


class RouterFilter:
    name = "router"

    def __init__(self, services: Services):
        fleet = services.fleet
        self.cascades: dict[str, Cascade] = {}
        for i, vm in enumerate(services.cfg.routing.virtual_models):
            pools = {}
            for attr in ("small_pool", "large_pool"):
                pool = fleet.pools.get(getattr(vm, attr))
                if pool is None:
                    raise ValueError(f"routing.virtual_models.{i}.{attr}: no pool named {getattr(vm, attr)!r}")
                pools[attr] = pool
            self.cascades[vm.name] = Cascade(vm, build_router(vm), pools["small_pool"], pools["large_pool"])
            services.virtual_models.add(vm.name)
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.escalations: Counter[str] = Counter()
        self.discarded_tokens = 0
        self.discarded_cost_usd = 0.0
        self.decide_s = 0.0
        self._otel = _Instruments(services.meter) if services.meter is not None else None
        if any(vm.router == "classifier" for vm in services.cfg.routing.virtual_models):
            from usefulwork.embedding import configure_shared  # noqa: PLC0415 (only with a classifier)
            configure_shared(services.cfg.embedding)

    async def start(self) -> None:
        """Classifier routers start loading the embedder (in the background: they route by the
        heuristic until it has loaded, and readiness does not wait for it)."""
        for c in self.cascades.values():
            if hasattr(c.router, "embedder"):
                c.router.embedder.load_in_background()

    # -- the filter --
    async def __call__(self, call: Call, next: Handler) -> Reply:
        cascade = self.cascades.get(call.ctx.model)
        if cascade is None:
            return await next(call)
        t0 = time.perf_counter()
        decision = await cascade.router.decide(call)
        self.decide_s += time.perf_counter() - t0
        if getattr(cascade.router, "gated", False):
            return await self._gated(cascade, call, next)
        self._note(cascade, call, decision.tier, decision.reason)
        self._to_pool(call, cascade.large if decision.tier == "large" else cascade.small, call.body)
        return await next(call)

    # -- confidence gate --
    async def _gated(self, cascade: Cascade, call: Call, next: Handler) -> Reply:
        gate = cascade.router
        original = call.body
        if call.op not in ("chat", "completions"):
            # (the gate judges chat and completions logprobs; a Responses answer carries none it reads, so
            # the small tier's answer would always be thrown away: the large tier answers at once)
            self._note(cascade, call, "large", f"confidence-gated: {call.op} answers are not judged; large tier")
            self._to_pool(call, cascade.large, original)
            return await next(call)
        asked = client_asked_logprobs(original)
        small_body = with_logprobs(original, call.op)
        cap = cascade.vm.confidence.small_max_tokens
        if cap and not call.ctx.stream:
            small_body = with_max_tokens(small_body, call.op, min(cap, max_tokens_of(original) or cap))
        self._to_pool(call, cascade.small, small_body)
        reply = await next(call)
        if reply.status != 200:
            await reply.aclose()
            return await self._escalate(cascade, call, next, original, "confidence-gated: small tier answered "
                                        f"{reply.status}", None, 0)
        if not reply.streaming:
            obj = orjson.loads(reply.body or b"{}")
            choices = obj.get("choices") or [{}]
            ok, reason, _ = gate.judge(token_logprobs(choices[0]))
            if not ok:
                usage = obj.get("usage") or {}
                await reply.aclose()
                return await self._escalate(cascade, call, next, original, reason,
                                            usage.get("prompt_tokens"), int(usage.get("completion_tokens") or 0))
            self._note(cascade, call, "small", reason)
            if not asked:
                strip_logprobs(obj)
                reply.body = orjson.dumps(obj)
                reply.headers = [(k, v) for k, v in reply.headers if k != b"content-length"]
            return reply
        # stream: hold the first tokens back, judge, then release (or escalate)
        held: list[bytes] = []
        lps: list[float] = []
        upstream = reply.chunks
        ended = False
        try:
            while len(lps) < cascade.vm.confidence.hold_tokens:
                try:
                    item = await upstream.__anext__()
                except StopAsyncIteration:
                    ended = True
                    break
                held.append(item)
                for obj in _events(item):
                    if obj.get("choices"):
                        lps.extend(token_logprobs(obj["choices"][0]))
        except BaseException:
            await reply.aclose()
            raise
        ok, reason, _ = gate.judge(lps)
        if not ok:
            await reply.aclose()
            return await self._escalate(cascade, call, next, original, reason, None, len(lps))
        self._note(cascade, call, "small", reason + (" (whole answer)" if ended else ""))
        reply.chunks = _release(held, upstream, strip=not asked)
        return reply

    async def _escalate(self, cascade: Cascade, call: Call, next: Handler, original: dict[str, Any], reason: str,
                        prompt_tokens: int | None, completion_tokens: int) -> Reply:
        ctx = call.ctx
        ctx.escalated = True
        self.escalations[cascade.vm.name] += 1
        self._note(cascade, call, "large", reason)
        self._to_pool(call, cascade.large, original)
        reply = await next(call)
        prices = cascade.small.cfg.prices

        booked = False

        def account() -> None:
            # Just before the large answer's last bytes (ctx then holds its usage), so the journal's row
            # holds the discarded tier too; or when the reply closes, if no answer was sent (a client gone).
            nonlocal booked
            if booked or (prompt_tokens is None and not ctx.prompt_tokens):
                return  # (the large answer's prompt count is not known yet: booked at close, from ctx)
            booked = True
            pt = ctx.prompt_tokens if prompt_tokens is None else prompt_tokens  # a stream cut early: same prompt
            ctx.discarded_tokens = int(pt) + completion_tokens
            ctx.discarded_cost_usd = ((prices.input_per_1m or 0.0) * pt + (prices.output_per_1m or 0.0)
                                      * completion_tokens) / 1e6
            self.discarded_tokens += ctx.discarded_tokens
            self.discarded_cost_usd += ctx.discarded_cost_usd
            if self._otel:
                self._otel.discarded.add(ctx.discarded_cost_usd, {"virtual_model": cascade.vm.name})

        ctx.on_answer = account
        reply.on_close(account)
        return reply

    # -- helpers --
    def _to_pool(self, call: Call, pool: PoolState, body: dict[str, Any]) -> None:
        call.pool = pool
        call.ctx.pool = pool.name
        call.set_body({**body, "model": pool.cfg.models[0]})

    def _note(self, cascade: Cascade, call: Call, tier: str, reason: str) -> None:
        call.ctx.route = f"{cascade.vm.name}:{tier}"
        call.ctx.route_reason = reason
        self.decisions[(cascade.vm.name, tier)] += 1
        if self._otel:
            self._otel.decisions.add(1, {"virtual_model": cascade.vm.name, "tier": tier})

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        total = sum(self.decisions.values())
        for name in self.cascades:
            n = {t: self.decisions[(name, t)] for t in ("small", "large")}
            asked = n["small"] + n["large"]
            out[name] = {"requests": asked, "share": {t: (v / asked if asked else 0.0) for t, v in n.items()},
                         "escalations": self.escalations[name],
                         "escalation_rate": self.escalations[name] / asked if asked else 0.0}
        return {"virtual_models": out, "discarded_tokens": self.discarded_tokens,
                "discarded_cost_usd": round(self.discarded_cost_usd, 9),
                "mean_decide_ms": round(self.decide_s * 1000 / total, 4) if total else None}


class _Instruments:
    def __init__(self, meter: Any):
        self.decisions = meter.create_counter("usefulwork.router.decisions", unit="{request}",
                                              description="Cascade routing decisions by virtual model and tier")
        self.discarded = meter.create_counter("usefulwork.router.discarded_cost", unit="USD",
                                              description="Price-sheet cost of small-tier answers discarded on escalation")


def _events(item: bytes) -> list[dict[str, Any]]:
    out = []
    for ev in item.split(b"\n\n"):
        ev = ev.strip()
        if ev.startswith(b"data:"):
            data = ev[5:].strip()
            if data and data != b"[DONE]":
                try:
                    obj = orjson.loads(data)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(obj, dict):
                    out.append(obj)
    return out


def _strip_item(item: bytes) -> bytes:
    if b'"logprobs"' not in item:
        return item
    out = []
    for ev in item.split(b"\n\n"):
        s = ev.strip()
        if s.startswith(b"data:") and b'"logprobs"' in s:
            obj = orjson.loads(s[5:].strip())
            strip_logprobs(obj)
            ev = b"data: " + orjson.dumps(obj)
        if ev:
            out.append(ev)
    return b"\n\n".join(out) + b"\n\n"


async def _release(held: list[bytes], rest: AsyncIterator[bytes], strip: bool) -> AsyncIterator[bytes]:
    for item in held:
        yield _strip_item(item) if strip else item
    async for item in rest:
        yield _strip_item(item) if strip else item
