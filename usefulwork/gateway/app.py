"""The Starlette application: the request path's assembly (filters from config, the chain, the forwarder,
one endpoint per OpenAI operation), the other routes, and the lifespan (fleet prober, accounting, filters)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import AsyncIterator

import httpx
import orjson
import prometheus_client
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from usefulwork.config import Config
from usefulwork.gateway import accounting
from usefulwork.gateway.access import Access
from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.errors import GatewayError, error_body, model_not_found
from usefulwork.gateway.filters import build_filters
from usefulwork.gateway.pipeline import Call, Services, chain
from usefulwork.gateway.proxy import OPERATIONS, Endpoint, Intake, new_request_id
from usefulwork.gateway.reload import Reloader
from usefulwork.gateway.stored import build_owners
from usefulwork.gateway.tenants import Tenants
from usefulwork.upstream.fleet import Fleet
from usefulwork.upstream.forwarder import Forwarder
from usefulwork.upstream.pickers import build_pickers

JSON = "application/json"
log = logging.getLogger("usefulwork.app")


def make_client(cfg: Config) -> httpx.AsyncClient:
    """The control-plane client (health probes, /metrics scrapes); the data path uses upstream.http1."""
    t = cfg.timeouts
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=t.connect_s, read=t.read_s, write=30.0, pool=t.connect_s),
        limits=httpx.Limits(max_connections=4096, max_keepalive_connections=1024, keepalive_expiry=60.0),
        # Never decompress or re-encode: SSE and JSON bytes go through as they came.
        headers={"accept-encoding": "identity"},
        trust_env=False,
    )


def fleet_metrics_text(fleet: Fleet) -> str:
    """Per-replica gauges in Prometheus text format (rendered directly: no global registry state)."""
    lines = []
    gauges = (
        ("usefulwork_replica_up", "Replica passed its last health probe (1) or not (0).", lambda r: 1.0 if r.healthy else 0.0),
        ("usefulwork_replica_inflight", "Requests this gateway has outstanding on the replica.", lambda r: r.inflight),
        ("usefulwork_replica_running", "vllm:num_requests_running scraped from the replica.", lambda r: r.running),
        ("usefulwork_replica_waiting", "vllm:num_requests_waiting scraped from the replica.", lambda r: r.waiting),
        ("usefulwork_replica_kv_cache_usage", "vllm:kv_cache_usage_perc scraped from the replica (0-1).", lambda r: r.kv_usage),
        ("usefulwork_replica_prefix_cache_hit_rate", "Prefix cache hits / queries since replica start.", lambda r: r.prefix_hit_rate),
    )
    for name, help_text, get in gauges:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} gauge")
        for r in fleet.replicas:
            lines.append(f'{name}{{pool="{r.pool}",replica="{r.url}"}} {float(get(r))}')
    pool_gauges = (
        ("usefulwork_pool_replicas", "Replicas in the pool (configured + found by discovery).", lambda p: len(p.replicas)),
        ("usefulwork_pool_healthy_replicas", "Replicas that passed their last health probe.",
         lambda p: len(p.healthy_replicas())),
        ("usefulwork_pool_discovery_failures", "Failed reads of the pool's discovery source in a row (its "
         "replicas last found are kept).", lambda p: p.discovery_errors),
    )
    for name, help_text, get in pool_gauges:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} gauge")
        for pname, p in fleet.pools.items():
            lines.append(f'{name}{{pool="{pname}"}} {float(get(p))}')
    return "\n".join(lines) + "\n"


def shed_queued(filters: list) -> int:
    """Shutdown: answer every request still waiting in an admission queue (429 with Retry-After).

    Called at the first SIGTERM/SIGINT (serve.py), before uvicorn's graceful wait: a queued request
    has not started, so it is told to retry (on another replica) rather than held until the graceful
    timeout cuts it. Running requests are not touched. Returns how many were shed.
    """
    n = 0
    for f in filters:
        for queue in getattr(f, "queues", {}).values():  # the admission filter's per-pool PoolQueue
            for t in queue.expire(float("inf")):
                t.shed_reason = "shutdown"
                if t.waiter is not None and not t.waiter.done():
                    t.waiter.set_result(False)
                n += 1
    if n:
        log.warning("shutting down: shed %d queued requests with Retry-After", n)
    return n


class HotPaths:
    """Dispatch the OpenAI POST endpoints straight to their ASGI handlers; all else goes to Starlette.

    Skips the router's regex matching and scope copying on the two paths that carry the traffic
    (measured in benchmarks/overhead.py). Lifespan and every other route are Starlette's.
    """

    def __init__(self, app: Starlette, hot: dict[str, object]):
        self.app = app
        self.hot = hot
        self.state = app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.hot.get(scope["path"])
            if handler is not None:
                await handler(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(cfg: Config, client: httpx.AsyncClient | None = None) -> HotPaths:
    client = client or make_client(cfg)
    fleet = Fleet(cfg, client)
    tenants = Tenants(cfg)  # the one table every part reads, replaced in place by a reload (SIGHUP)
    access = Access(tenants)
    bundle = accounting.build(cfg, fleet, access=access)
    services = Services(cfg=cfg, fleet=fleet, accountant=bundle.accountant, tenants=tenants,
                        meter=bundle.telemetry.fast_meter if bundle.telemetry is not None else None)
    reloader = Reloader(cfg, tenants.reload)
    if services.meter is not None:
        reloader.instrument(services.meter)
    filters = build_filters(cfg.filters, services)
    pickers = build_pickers(cfg, fleet, services.meter)
    forwarder = Forwarder(fleet, pickers, build_owners(cfg))
    handler = chain(filters, forwarder)
    intake = Intake(fleet, bundle.accountant, tenants, handler, max_body=cfg.limits.max_body_bytes,
                    body_timeout_s=cfg.limits.body_timeout_s, virtual_models=services.virtual_models)
    endpoints = {op.path: Endpoint(intake, op) for op in OPERATIONS}
    bundle.accountant.filter_stats = {f.name: f.stats for f in filters if hasattr(f, "stats")}
    bundle.accountant.tenant_limits = next((f.tenant_limits for f in filters if hasattr(f, "tenant_limits")), None)
    picker_stats = {name: p.stats for name, p in pickers.items() if hasattr(p, "stats")}  # prefix pickers' self-check
    if picker_stats:
        bundle.accountant.filter_stats["pickers"] = lambda: {name: st() for name, st in picker_stats.items()}
    started = time.time()

    listed = {m: {"id": m, "object": "model", "created": int(started), "owned_by": f"usefulwork:{p.name}"}
              for p in cfg.pools for m in p.models}
    listed.update({m: {"id": m, "object": "model", "created": int(started), "owned_by": "usefulwork:router"}
                   for m in sorted(services.virtual_models)})
    model_list = orjson.dumps({"object": "list", "data": list(listed.values())})

    async def models(request: Request) -> Response:
        if (denied := access.models(request)) is not None:
            return denied
        if (allowed := access.models_allowed(request)) is None:
            return Response(model_list, media_type=JSON)
        return Response(orjson.dumps({"object": "list", "data": [m for m in listed.values() if m["id"] in allowed]}),
                        media_type=JSON)

    async def model(request: Request) -> Response:  # the SDKs' models.retrieve
        if (denied := access.models(request)) is not None:
            return denied
        name = request.path_params["model"]
        if name not in listed or ((allowed := access.models_allowed(request)) is not None and name not in allowed):
            return Response(model_not_found(name).body(), status_code=404, media_type=JSON)
        return Response(orjson.dumps(listed[name]), media_type=JSON)

    async def retrieve_response(request: Request) -> Response:  # the SDKs' responses.retrieve
        """A stored response, from the replica that holds it, for its own tenant (usefulwork/gateway/stored.py)."""
        ctx = RequestContext(id=new_request_id(), endpoint="responses", model="", stream=False)
        try:
            ctx.tenant = tenants.identify(request.headers.get("authorization", "").encode("latin-1"))
            if request.query_params.get("stream", "false").lower() not in ("false", "0"):
                raise GatewayError(400, "streaming a stored response is for background responses, which this gateway "
                                   "does not serve", param="stream", code="unsupported_parameter")
            rid = request.path_params["response_id"]
            call = Call(ctx, "retrieve", f"/v1/responses/{rid}".encode(), {}, None, None, [])
            reply = await forwarder.retrieve(call, rid)
        except GatewayError as exc:
            return Response(exc.body(), status_code=exc.status, media_type=JSON,
                            headers={k.decode(): v.decode() for k, v in exc.headers})
        return Response(reply.body or b"", status_code=reply.status, media_type=JSON)

    async def healthz(request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type=JSON)

    async def readyz(request: Request) -> Response:
        pools = {
            name: {
                "healthy": len(p.healthy_replicas()),
                "replicas": [{"url": r.url, "healthy": r.healthy, "reason": r.down_reason} for r in p.replicas],
                **({"discovery": {"source": p.source.describe(), "failed_reads_in_a_row": p.discovery_errors,
                                  "last_read": p.discovered_at or None}} if p.source is not None else {}),
            }
            for name, p in fleet.pools.items()
        }
        return access.readyz(request, fleet.ready(), {"pools": pools, "config": reloader.status()})

    async def metrics(request: Request) -> Response:
        if (denied := access.metrics(request)) is not None:
            return denied
        body = prometheus_client.generate_latest(prometheus_client.REGISTRY) + fleet_metrics_text(fleet).encode()
        return Response(body, media_type=prometheus_client.CONTENT_TYPE_LATEST)

    async def not_found(request: Request, exc: Exception) -> Response:
        return Response(error_body(404, f"no route for {request.method} {request.url.path}", code="not_found"),
                        status_code=404, media_type=JSON)

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        return Response(error_body(405, f"{request.method} is not allowed on {request.url.path}"),
                        status_code=405, media_type=JSON)

    async def server_error(request: Request, exc: Exception) -> Response:
        return Response(error_body(500, "internal gateway error", code="internal_error"), status_code=500,
                        media_type=JSON)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await fleet.start()
        await bundle.accountant.start()
        for f in filters:
            if hasattr(f, "start"):
                await f.start()
        try:
            yield
        finally:
            for name, part in [*((f.name, f) for f in reversed(filters)), *pickers.items()]:
                if hasattr(part, "stop"):  # filters, and pickers with background work (KV-event subscribers)
                    try:
                        await part.stop()
                    except Exception:
                        log.exception("stopping %s", name)
            await forwarder.owners.stop()
            await bundle.accountant.stop()
            await fleet.stop()
            await client.aclose()

    routes = [
        *(Route(path, ep, methods=["POST"]) for path, ep in endpoints.items()),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        *bundle.routes,
        *(r for f in filters for r in getattr(f, "routes", ())),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: method_not_allowed, 500: server_error, Exception: server_error},
    )
    app.state.cfg = cfg
    app.state.fleet = fleet
    app.state.intake = intake
    app.state.filters = filters
    app.state.accounting = bundle
    app.state.drain = lambda: shed_queued(filters)
    app.state.reloader = reloader
    return HotPaths(app, endpoints)
