"""The ``cache`` filter: answer repeated (exact) and reworded (semantic) requests from stored answers.

Per request::

    Cache-Control no-cache/no-store, or parameters that make reuse unsound  -> bypass
    exact key (tenant + endpoint + model + parameters + conversation) in the store -> hit-exact
    partition has vectors: embed the conversation, nearest entries in the partition,
      cosine >= threshold (per model, raised by feedback) and the guard agrees  -> hit-semantic
    else forward; a good answer is stored after its reply closed (off the request path)   -> miss

Every reply it passes carries ``x-usefulwork-cache: miss | hit-exact | hit-semantic;score=S |
bypass`` and the decision goes to ``ctx.cache``. A hit is rendered as the miss was (JSON or SSE
chunks), enters the ledger with zero GPU tokens, and ``ctx.saved_usd`` is what the stored answer
would have cost at the pool's price sheet. A store that fails (Redis down or slow) never fails a
request: the request bypasses the cache and ``store_errors`` counts it.

Routes: ``POST /usefulwork/cache/purge`` (admin: ``{"tenant": ...}`` and/or ``{"model": ...}``) and
``POST /usefulwork/cache/feedback`` (``{"request_id": ...}``: that semantic hit was wrong).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from usefulwork.caches.config import CacheCfg
from usefulwork.caches.guard import refusal
from usefulwork.caches.index import VectorIndex
from usefulwork.caches.keys import Keys, uncacheable
from usefulwork.caches.replies import answer_from_events, answer_from_json, hit_reply
from usefulwork.caches.store import Entry, MemoryStore, Store
from usefulwork.caches.thresholds import ThresholdPolicy
from usefulwork.embedding import configure_shared, conversation_text, shared_embedder
from usefulwork.gateway.errors import GatewayError, error_body
from usefulwork.gateway.pipeline import Call, Handler, Reply, Services
from usefulwork.gateway.tenants import Tenants, bearer

log = logging.getLogger("usefulwork.cache")

HEADER = b"x-usefulwork-cache"
PAYOFF_WINDOW = 200  # semantic lookups judged for ``semantic.min_hit_share``
PAYOFF_SAMPLE = 10  # while it does not pay: embed one request in this many
LOOKUP = "cache_lookup"  # call.memo: a semantic lookup the upstream's answer beat, still running
_DIRECTIVE = re.compile(r'^[A-Za-z][A-Za-z0-9\-]*(?:=(?:[A-Za-z0-9\-]+|"[^"]*"))?$')
CANDIDATES = 4  # nearest entries considered per semantic lookup


def parse_cache_control(raw: bytes | None) -> tuple[bool, bool, float | None]:
    """(no_cache, no_store, max_age_s) of a request's Cache-Control; 400 when it is malformed."""
    if not raw:
        return False, False, None
    no_cache = no_store = False
    max_age: float | None = None
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        text = None
    for part in (text.split(",") if text is not None else [None]):
        d = part.strip() if part is not None else None
        if d == "":
            continue
        if d is None or not _DIRECTIVE.match(d):
            raise GatewayError(400, f"malformed Cache-Control header {raw.decode('latin-1')!r}: expected "
                               "comma-separated directives such as no-cache, no-store, max-age=60",
                               param="cache-control", code="invalid_cache_control")
        name, _, value = d.partition("=")
        name = name.lower()
        if name == "no-cache":
            no_cache = True
        elif name == "no-store":
            no_store = True
        elif name == "max-age":
            if not value.isdigit():
                raise GatewayError(400, f"Cache-Control max-age must be a whole number of seconds, got {value!r}",
                                   param="cache-control", code="invalid_cache_control")
            max_age = float(value)
    return no_cache, no_store, max_age


def _with_first(reply: Reply, first: asyncio.Future) -> Reply:
    """The reply with its stream's first chunk (already being read by ``first``) put back in front."""
    rest = reply.chunks

    async def chunks():
        try:
            yield await first
        except StopAsyncIteration:
            return
        async for chunk in rest:
            yield chunk

    reply.chunks = chunks()
    return reply


def _saved_usd(call: Call, usage: dict[str, Any] | None) -> float:
    """What the cached answer would have cost again at the pool's price sheet (0 without one)."""
    if not usage or call.pool is None:
        return 0.0
    p = call.pool.cfg.prices
    return ((usage.get("prompt_tokens") or 0) * (p.input_per_1m or 0.0)
            + (usage.get("completion_tokens") or 0) * (p.output_per_1m or 0.0)) / 1e6


class CacheFilter:
    name = "cache"

    def __init__(self, services: Services | None = None, *, cfg: CacheCfg | None = None, store: Store | None = None,
                 embedder=None):
        gw = services.cfg if services is not None else None
        self.cfg = cfg or (gw.cache if gw is not None else CacheCfg())
        self.store = store if store is not None else self._build_store()
        self.index = VectorIndex(self.cfg.semantic.index_min_entries)
        self.store.listener = self.index
        if embedder is None and self.cfg.semantic.enabled:
            embedder = configure_shared(gw.embedding) if gw is not None else shared_embedder()
        self.embedder = embedder
        self.policy = ThresholdPolicy(self.cfg.semantic)
        # Who calls the admin and feedback routes: the gateway's own tenants and admin keys.
        self._tenants = Tenants(gw) if gw is not None else None
        self._known_tenants = ({"default"} | set(self._tenants.by_name) | set(gw.auth.api_keys.values())
                               if gw is not None else {"default"})
        self._known_models = set(gw.model_names) if gw is not None else set()
        self._tasks: set[asyncio.Task] = set()
        self.counts = {"miss": 0, "hit-exact": 0, "hit-semantic": 0, "bypass": 0}
        self.bypass_reasons: dict[str, int] = {}
        self.guard_refusals: dict[str, int] = {}
        self.store_errors = 0
        self.stored = 0
        self.saved_usd = 0.0
        self.embed_s = 0.0  # wall time of embeddings this filter waited for
        self.cpu_s = 0.0  # event-loop CPU spent in the filter (keys, lookups, guard, hit rendering)
        self.embeddings = 0
        self.semantic_skipped = 0  # lookups or vectors skipped because the embedder was backlogged
        self.semantic_skipped_loading = 0  # ... because the embedder had not loaded yet (a miss; exact works)
        self.semantic_skipped_unpaid = 0  # ... because recent lookups rarely hit (semantic.min_hit_share)
        self.semantic_late = 0  # semantic lookups the upstream's first token beat (finished in the background)
        self.semantic_late_hits = 0  # ... of which found a hit: answers the race cost
        self._lookups: deque[bool] = deque(maxlen=PAYOFF_WINDOW)  # recent semantic lookups: hit or not
        self._unpaid = 0
        self._instruments(services.meter if services is not None else None)
        self.routes = [Route("/usefulwork/cache/purge", self._purge_route, methods=["POST"]),
                       Route("/usefulwork/cache/feedback", self._feedback_route, methods=["POST"])]

    def _build_store(self) -> Store:
        if self.cfg.redis_url:
            from usefulwork.caches.redis_store import RedisStore  # noqa: PLC0415 (only when configured)
            return RedisStore(self.cfg)
        return MemoryStore(self.cfg.ttl_s, self.cfg.max_entries_per_partition)

    def _instruments(self, meter) -> None:
        self._m_requests = self._m_saved = self._m_cpu = None
        if meter is None:
            return
        self._m_requests = meter.create_counter("usefulwork.cache.requests", unit="{request}",
                                                description="Requests seen by the cache, by result")
        self._m_saved = meter.create_counter("usefulwork.cache.saved", unit="USD",
                                             description="Price-sheet cost of the answers served from cache")
        self._m_cpu = meter.create_counter("usefulwork.cache.cpu", unit="s",
                                           description="CPU the cache spent (lookups and embeddings)")

    # -- the request path --
    async def __call__(self, call: Call, next: Handler) -> Reply:
        t0 = time.thread_time()
        ctx = call.ctx
        no_cache, no_store, max_age = parse_cache_control(call.header(b"cache-control"))
        reason = uncacheable(call.body, call.op, self.cfg)
        if reason is None and no_cache and no_store:
            reason = "cache-control"
        if reason is not None:
            return await self._bypass(call, next, reason, t0)
        keys = Keys.of(ctx.tenant, call.op, call.body)
        fresh_after = time.time() - max_age if max_age is not None else 0.0
        reply = None
        if not no_cache:
            try:
                entry = await self.store.get(keys.partition, keys.exact)
                if entry is not None and entry.created >= fresh_after:
                    reply = self._hit(call, entry, None)
                elif (self.embedder is not None and self.index.size(keys.partition) and self._embedder_ready()
                      and self._semantic_pays() and not self._embedder_busy()):
                    self._spent(t0)
                    reply = await self._semantic_or_next(call, next, keys, fresh_after)
                    t0 = time.thread_time()
            except GatewayError:
                raise
            except Exception as exc:  # the store failed: never the request
                self.store_errors += 1
                log.debug("cache lookup failed: %r", exc)
                return await self._bypass(call, next, "store_error", t0)
        if reply is not None and ctx.cache.startswith("hit"):
            self._spent(t0)
            return reply
        if reply is None:
            self._spent(t0)
            reply = await next(call)
            t0 = time.thread_time()
        ctx.cache = "miss"
        self.counts["miss"] += 1
        self._count("miss")
        reply.headers.append((HEADER, b"miss"))
        if not no_store and reply.status == 200:
            self._fill(call, keys, reply)
        self._spent(t0)
        return reply

    async def _bypass(self, call: Call, next: Handler, reason: str, t0: float) -> Reply:
        call.ctx.cache = "bypass"
        self.counts["bypass"] += 1
        self.bypass_reasons[reason] = self.bypass_reasons.get(reason, 0) + 1
        self._count("bypass")
        self._spent(t0)
        reply = await next(call)
        reply.headers.append((HEADER, b"bypass"))
        return reply

    async def _semantic_or_next(self, call: Call, next: Handler, keys: Keys, fresh_after: float) -> Reply:
        """The semantic lookup; with ``semantic.parallel`` it races the upstream's answer.

        The upstream request starts at once. A semantic hit is served only if it is found before the
        upstream's first token (a stream's first chunk, or a whole JSON answer): a miss then costs no
        latency, and a hit is only taken when it is faster. The upstream reply a hit beats is closed
        (vLLM aborts the sequence: part of one prefill is the price). Returns the hit's reply, or the
        upstream's (the caller marks it a miss).
        """
        if not self.cfg.semantic.parallel:
            hit = await self._semantic(call, keys, fresh_after)
            return self._hit(call, *hit) if hit is not None else await next(call)
        look = asyncio.ensure_future(self._semantic(call, keys, fresh_after))
        up = asyncio.ensure_future(next(call))
        first: asyncio.Future | None = None
        try:
            await asyncio.wait((look, up), return_when=asyncio.FIRST_COMPLETED)
            if up.done() and (up.exception() is not None or not up.result().streaming):
                if not look.done():  # a whole answer (or an error) came first
                    self._late(call, look)
                    return await up
            elif up.done():  # a stream's headers: race its first chunk against the lookup
                reply = up.result()
                first = asyncio.ensure_future(reply.chunks.__anext__())
                await asyncio.wait((look, first), return_when=asyncio.FIRST_COMPLETED)
                if first.done() and not look.done():
                    self._late(call, look)
                    return _with_first(reply, first)
            hit = None
            try:
                hit = await look
            except Exception as exc:  # the lookup failed: the upstream answers
                self._lookup_failed(exc)
            if hit is None:
                reply = await up
                return _with_first(reply, first) if first is not None else reply
            if first is not None:
                first.cancel()
            up.cancel()
            try:
                reply = await up
            except BaseException:  # cancelled before it answered, or it failed: nothing to close
                pass
            else:
                await reply.aclose()
            call.ctx.replica = call.ctx.pool = None
            call.ctx.attempts = 0
            return self._hit(call, *hit)
        finally:
            for t in (look, up):
                if not t.done() and call.memo.get(LOOKUP) is not t:
                    t.cancel()

    def _late(self, call: Call, look: asyncio.Future) -> None:
        """The upstream answered before the lookup: it finishes in the background (its embedding is the
        vector the answer is stored with: computed once, not cancelled and computed again) and counts as
        a lookup that did not pay, whatever it finds."""
        self.semantic_late += 1
        call.memo[LOOKUP] = look
        self._tasks.add(look)
        look.add_done_callback(self._late_done)

    def _late_done(self, look: asyncio.Future) -> None:
        self._tasks.discard(look)
        if not look.cancelled() and look.exception() is not None:
            self._lookup_failed(look.exception())

    def _lookup_failed(self, exc: BaseException) -> None:
        self.store_errors += 1
        log.debug("semantic lookup failed: %r", exc)

    async def _semantic(self, call: Call, keys: Keys, fresh_after: float) -> tuple[Entry, float] | None:
        t = time.perf_counter()
        vec = await self.embedder.embed_call(call)
        self.embed_s += time.perf_counter() - t
        self.embeddings += 1
        floor = self.policy.floor(keys.model)
        text = None
        for key, score in self.index.search(keys.partition, vec, CANDIDATES):
            if score < floor:
                break
            if score < self.policy.threshold(keys.model, key):
                continue
            entry = await self.store.get(keys.partition, key)
            if entry is None:
                await self.store.forget(keys.partition, key)
                continue
            if entry.created < fresh_after or entry.tenant != keys.tenant:
                continue
            if self.cfg.semantic.guard:
                text = text if text is not None else conversation_text(call.body)
                why = refusal(text, entry.text)
                if why is not None:
                    self.guard_refusals[why] = self.guard_refusals.get(why, 0) + 1
                    continue
            late = LOOKUP in call.memo
            self._lookups.append(not late)
            self.semantic_late_hits += late
            return entry, score
        self._lookups.append(False)
        return None

    def _hit(self, call: Call, entry: Entry, score: float | None) -> Reply:
        ctx = call.ctx
        if score is None:
            result, header = "hit-exact", b"hit-exact"
        else:
            result, header = "hit-semantic", f"hit-semantic;score={score:.4f}".encode()
            self.policy.record_hit(ctx.id, ctx.tenant, entry.model, entry.key, score)
        ctx.cache = result
        ctx.saved_usd = _saved_usd(call, entry.usage)
        ctx.usage_source = "none"
        self.counts[result] += 1
        self.saved_usd += ctx.saved_usd
        self._count(result)
        if self._m_saved is not None and ctx.saved_usd:
            self._m_saved.add(ctx.saved_usd, {"model": entry.model})
        return hit_reply(call.op, str(call.body.get("model", entry.model)), entry.choice, entry.usage,
                         stream=bool(call.body.get("stream")), include_usage=ctx.include_usage,
                         headers=[(HEADER, header)])

    def _count(self, result: str) -> None:
        if self._m_requests is not None:
            self._m_requests.add(1, {"result": result})

    def _spent(self, t0: float) -> None:
        dt = time.thread_time() - t0
        self.cpu_s += dt
        if self._m_cpu is not None:
            self._m_cpu.add(dt)

    # -- filling (after the reply closed, off the request path) --
    def _fill(self, call: Call, keys: Keys, reply: Reply) -> None:
        if reply.chunks is None:
            body = reply.body
            reply.on_close(lambda: self._store_later(call, keys, lambda: answer_from_json(call.op, body or b"")))
            return
        events: list[bytes] = []
        inner = reply.chunks

        async def tee():
            async for chunk in inner:
                events.append(chunk)
                yield chunk

        reply.chunks = tee()
        reply.on_close(lambda: self._store_later(call, keys, lambda: answer_from_events(call.op, events, reply.usage)))

    def _store_later(self, call: Call, keys: Keys, answer) -> None:
        if call.ctx.status_code != 200:  # a stream that failed after it began (the answer parse checks the rest)
            return
        task = asyncio.get_running_loop().create_task(self._store(call, keys, answer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _store(self, call: Call, keys: Keys, answer) -> None:
        t0 = time.thread_time()
        got = answer()
        if got is None:
            self._spent(t0)
            return
        choice, usage = got
        text = conversation_text(call.body)
        self._spent(t0)
        vec = None
        try:
            if self.embedder is not None:
                look = call.memo.get(LOOKUP)
                if look is not None and not look.done():  # its vector is on the way
                    await asyncio.wait((look,))
                vec = call.memo.get("embedding")
                if vec is None and (not self._embedder_ready() or self._embedder_busy() or not self._semantic_pays()):
                    pass  # filed for exact hits only: embedding it now would delay lookups that can hit
                elif vec is None:
                    t = time.perf_counter()
                    vec = await self.embedder.embed(text)
                    self.embed_s += time.perf_counter() - t
                    self.embeddings += 1
            await self.store.put(Entry(keys.exact, keys.partition, keys.tenant, keys.model, call.op, text,
                                       choice, usage, vec))
            self.stored += 1
        except Exception as exc:
            self.store_errors += 1
            log.debug("cache store failed: %r", exc)

    async def drain(self) -> None:
        """Wait for pending stores (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _semantic_pays(self) -> bool:
        """False (but for one request in ``PAYOFF_SAMPLE``) while recent semantic lookups rarely hit."""
        recent = self._lookups
        if len(recent) < PAYOFF_WINDOW or sum(recent) >= self.cfg.semantic.min_hit_share * len(recent):
            return True
        self._unpaid += 1
        if self._unpaid % PAYOFF_SAMPLE == 0:
            return True
        self.semantic_skipped_unpaid += 1
        return False

    def _embedder_ready(self) -> bool:
        """The model has loaded (it loads in the background from ``start``); until then no vectors."""
        if self.embedder.loaded:
            return True
        self.embedder.load_in_background()  # a filter that was never started loads on first need
        self.semantic_skipped_loading += 1
        return False

    def _embedder_busy(self) -> bool:
        """The embedder has a full batch waiting: skip optional embeddings rather than queue behind it."""
        if self.embedder.backlog >= self.embedder.max_batch:
            self.semantic_skipped += 1
            return True
        return False

    # -- lifecycle and figures --
    async def start(self) -> None:
        await self.store.start()
        if self.embedder is not None:  # load now, in the background: readiness does not wait for it
            self.embedder.load_in_background()

    async def stop(self) -> None:
        await self.drain()
        await self.store.stop()

    def stats(self) -> dict[str, Any]:
        seen = sum(self.counts.values())
        hits = self.counts["hit-exact"] + self.counts["hit-semantic"]
        return {
            "requests": dict(self.counts),
            "hit_share": round(hits / seen, 4) if seen else 0.0,
            "saved_usd": round(self.saved_usd, 6),
            "cpu_s": round(self.cpu_s, 4),
            "embed_s": round(self.embed_s, 4),
            "embeddings": self.embeddings,
            "semantic_skipped_busy": self.semantic_skipped,
            "semantic_skipped_unpaid": self.semantic_skipped_unpaid,
            "semantic_skipped_loading": self.semantic_skipped_loading,
            "semantic_late": self.semantic_late,
            "semantic_late_hits": self.semantic_late_hits,
            "embedder_loaded": self.embedder.loaded if self.embedder is not None else None,
            "bypass_reasons": dict(self.bypass_reasons),
            "guard_refusals": dict(self.guard_refusals),
            "store_errors": self.store_errors,
            "stored": self.stored,
            "vectors": len(self.index),
            **self.policy.stats(),
        }

    # -- routes --
    async def _json(self, request: Request) -> dict[str, Any]:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            raise GatewayError(400, "request body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "request body must be a JSON object", code="invalid_json")
        return body

    async def _purge_route(self, request: Request) -> Response:
        try:
            key = bearer(request.headers.get("authorization", "").encode("latin-1"))
            if self._tenants is None or not self._tenants.is_admin(key):  # an open gateway has no admin
                raise GatewayError(403, "purging the cache needs an admin key (access.admin_key_hashes)",
                                   code="forbidden")
            body = await self._json(request)
            tenant, model = body.get("tenant"), body.get("model")
            if tenant is None and model is None:
                raise GatewayError(422, "give 'tenant' and/or 'model' to purge", param="tenant", code="missing_field")
            if tenant is not None and tenant not in self._known_tenants:
                raise GatewayError(404, f"unknown tenant {tenant!r}", param="tenant", code="unknown_tenant")
            if model is not None and self._known_models and model not in self._known_models:
                raise GatewayError(404, f"unknown model {model!r}", param="model", code="model_not_found")
            partitions = await self.store.purge(tenant=tenant, model=model)
        except GatewayError as err:
            return Response(err.body(), err.status, media_type="application/json")
        except Exception as exc:
            self.store_errors += 1
            return Response(error_body(503, f"cache store unavailable: {exc.__class__.__name__}", code="store_error"),
                            503, media_type="application/json")
        return Response(orjson.dumps({"purged_partitions": partitions, "tenant": tenant, "model": model}),
                        media_type="application/json")

    async def _feedback_route(self, request: Request) -> Response:
        try:
            auth = request.headers.get("authorization", "").encode("latin-1")
            tenant = self._tenants.identify(auth) if self._tenants is not None else "default"
            body = await self._json(request)
            rid = body.get("request_id")
            if not isinstance(rid, str):
                raise GatewayError(422, "'request_id' (the x-request-id of the bad hit) is required",
                                   param="request_id", code="missing_field")
            result = self.policy.report_bad(rid, tenant)
            if result is None:
                raise GatewayError(404, f"no semantic cache hit {rid!r} of yours to report",
                                   param="request_id", code="unknown_hit")
        except GatewayError as err:
            return Response(err.body(), err.status, media_type="application/json")
        return Response(orjson.dumps({"request_id": rid, **result}), media_type="application/json")
