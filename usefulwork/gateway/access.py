"""Who may read what outside the OpenAI endpoints (the fleet view is private once keys exist).

With no key configured anywhere (the embedded default) everything is open, as before. As soon as
tenant keys or admin keys are configured:

| path | who | what |
|---|---|---|
| ``/healthz`` | anyone | the process is up |
| ``/v1/models``, ``/v1/models/{id}`` | whoever may call the OpenAI endpoints (any enabled tenant's key once tenant keys exist), and the admin | the models served (a tenant with a ``models`` list: those only) |
| ``/readyz`` | anyone | ``{"ready": bool}`` (200 / 503) only; an admin key adds per-pool detail and the config's reload status |
| ``/metrics`` | admin key, or the Prometheus scrape token (``access.metrics_token_hash``) | everything |
| ``/usefulwork/stats`` | admin key: the fleet view; a tenant key: its own tenant's windows only (and, with admission, its limits and budget left) | |
| ``/usefulwork/dashboard`` | admin key (browsers: HTTP Basic, any user name, the key as password) | |

Keys come as ``Authorization: Bearer <key>`` (or Basic, for browsers). A missing or wrong key gets
401 with an OpenAI-style body; a key that is valid but not allowed here (a tenant key on
``/metrics``) gets 403. Figures of other tenants never reach a tenant key.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from usefulwork.gateway.errors import GatewayError, error_body
from usefulwork.gateway.tenants import Tenants, bearer

FLEET = "fleet"  # the stats scope of an admin (or of anyone when no auth is configured)


def _deny(status: int, message: str, basic: bool = False, code: str | None = None) -> Response:
    headers = {"WWW-Authenticate": 'Basic realm="usefulwork"' if basic else 'Bearer realm="usefulwork"'}
    code = code or ("invalid_api_key" if status == 401 else "forbidden")
    return Response(error_body(status, message, code=code),
                    status_code=status, media_type="application/json",
                    headers=headers if status == 401 else None)


class Access:
    def __init__(self, tenants: Tenants):
        self.tenants = tenants  # the gateway's one instance: a reload (SIGHUP) reaches the fleet view too

    @property
    def open(self) -> bool:
        return not self.tenants.auth_enabled

    def _key(self, request: Request) -> str | None:
        return bearer(request.headers.get("authorization", "").encode("latin-1"))

    def is_admin(self, request: Request) -> bool:
        return self.open or self.tenants.is_admin(self._key(request))

    def metrics(self, request: Request) -> Response | None:
        """None when the caller may scrape /metrics, else the refusal to send."""
        if self.open:
            return None
        key = self._key(request)
        if self.tenants.is_admin(key) or self.tenants.is_metrics_token(key):
            return None
        if key and self.tenants.tenant_of_key(key) is not None:
            return _deny(403, "/metrics needs the admin key or the metrics scrape token")
        return _deny(401, "/metrics needs the admin key or the metrics scrape token")

    def models(self, request: Request) -> Response | None:
        """None when the caller may list models: whoever may call the OpenAI endpoints, and the admin."""
        if self.is_admin(request):
            return None
        try:
            self.tenants.identify(request.headers.get("authorization", "").encode("latin-1"))
        except GatewayError as exc:  # the OpenAI endpoints' refusal (401 invalid_api_key, 403 tenant_disabled)
            return _deny(exc.status, exc.message, code=exc.code)
        return None

    def models_allowed(self, request: Request) -> frozenset[str] | None:
        """The models the caller's tenant may call (None: every one; the admin, or no list)."""
        return self.tenants.models_of(self.tenants.tenant_of_key(self._key(request)))

    def dashboard(self, request: Request) -> Response | None:
        if self.is_admin(request):
            return None
        return _deny(401, "the dashboard needs the admin key (HTTP Basic: any user name, the key as password)",
                     basic=True)

    def stats_scope(self, request: Request) -> str | Response:
        """``FLEET`` for an admin, the tenant's name for a tenant key, else the refusal to send."""
        if self.is_admin(request):
            return FLEET
        key = self._key(request)
        tenant = self.tenants.tenant_of_key(key)
        if tenant is None:
            return _deny(401, "/usefulwork/stats needs an API key (a tenant sees its own figures; the admin key all)")
        return tenant

    @staticmethod
    def tenant_view(snapshot: dict[str, Any], tenant: str) -> dict[str, Any]:
        """Only this tenant's figures out of the fleet snapshot (nothing about pools or other tenants)."""
        mine = (snapshot.get("tenants") or {}).get(tenant) or {"windows": {}}
        return {"tenant": tenant, "tenants": {tenant: mine}, "slo": snapshot.get("slo")}

    def readyz(self, request: Request, ready: bool, detail: dict[str, Any]) -> Response:
        body = {"ready": ready, **detail} if self.is_admin(request) else {"ready": ready}
        return Response(orjson.dumps(body), status_code=200 if ready else 503, media_type="application/json")
