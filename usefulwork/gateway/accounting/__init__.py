"""Per-request accounting wired for the gateway: the ledger's accountant and the stats/dashboard routes.

``build(cfg, fleet)`` returns an :class:`AccountingBundle`: the gateway calls
``bundle.accountant.start()`` at start-up, ``bundle.accountant.answered(ctx)`` just before a response's
last bytes (the journal's row), ``bundle.accountant.finish(ctx)`` once per finished request,
``await bundle.accountant.stop()`` at shutdown, and mounts ``bundle.routes``:

- ``GET /usefulwork/stats``: the live useful-work windows as JSON (``?series=1`` adds the dashboard's
  time series); with ``scale_out.redis_url`` the whole fleet's (``?scope=replica``: this process's);
  fields in docs/accounting.md.
- ``GET /usefulwork/dashboard``: a self-contained live page (no front-end build, no CDN).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import orjson
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Route

from usefulwork.upstream.fleet import Fleet
from usefulwork.config import Config
from usefulwork.gateway.access import FLEET, Access
from usefulwork.gateway.accounting.journal import journal_dir_for
from usefulwork.gateway.accounting.ledger import Ledger
from usefulwork.gateway.accounting.sinks import Sink, from_config
from usefulwork.gateway.accounting.telemetry import Telemetry
from usefulwork.gateway.tenants import Tenants

DASHBOARD = Path(__file__).parent.parent / "static" / "dashboard.html"


@dataclass
class AccountingBundle:
    accountant: Ledger
    routes: list[BaseRoute] = field(default_factory=list)
    telemetry: Telemetry | None = None


def _routes(accountant: Ledger, access: Access) -> list[BaseRoute]:
    page = DASHBOARD.read_bytes()

    async def stats(request: Request) -> Response:
        scope = access.stats_scope(request)  # admin: the fleet; a tenant key: its own figures only
        if isinstance(scope, Response):
            return scope
        with_series = request.query_params.get("series") in ("1", "true", "yes")
        raws = None
        if accountant.shared is not None and request.query_params.get("scope", "fleet") != "replica":
            try:
                raws = await accountant.shared.fleet_raws(accountant.raw())  # the whole fleet, this process fresh
            except Exception:  # noqa: BLE001 - Redis down: this replica's figures, marked as such
                raws = None
        snap = accountant.snapshot(with_series, raws)
        if scope != FLEET:
            snap = access.tenant_view(snap, scope)
            if accountant.tenant_limits is not None:  # (the admission filter's: its limits and budget left)
                snap["limits"] = await accountant.tenant_limits(scope)
        body = orjson.dumps(snap, option=orjson.OPT_SERIALIZE_NUMPY)
        return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})

    async def dashboard(request: Request) -> Response:
        if (denied := access.dashboard(request)) is not None:
            return denied
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    return [
        Route("/usefulwork/stats", stats, methods=["GET"]),
        Route("/usefulwork/dashboard", dashboard, methods=["GET"]),
    ]


def build(cfg: Config, fleet: Fleet, *, sinks: list[Sink] | None = None,
          telemetry: Telemetry | None = None, access: Access | None = None) -> AccountingBundle:
    """Sinks and telemetry come from cfg unless given (tests pass in-memory ones); ``access``: who may read
    the stats and the dashboard (the gateway's, whose tenants a reload replaces; else from cfg)."""
    journal_dir = None
    if sinks is None:
        sinks = from_config(cfg.ledger.jsonl_path, cfg.ledger.redis_url, cfg.ledger.redis_stream)
        journal_dir = journal_dir_for(cfg.ledger)
    accountant = Ledger(cfg, fleet, sinks, journal_dir=journal_dir)
    if cfg.scale_out.redis_url is not None:
        from usefulwork.gateway.accounting.shared import SharedBooks

        accountant.shared = SharedBooks(cfg.scale_out, cfg.cost.interval_s)
    if telemetry is None:
        telemetry = Telemetry(cfg, accountant.meters)
    accountant.telemetry = telemetry
    return AccountingBundle(accountant=accountant, routes=_routes(accountant, access or Access(Tenants(cfg))), telemetry=telemetry)
