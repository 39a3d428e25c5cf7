"""Who is calling: the ``Authorization: Bearer`` key -> a tenant name (401 for a bad key).

With no keys configured every request is tenant ``default``.
"""

from __future__ import annotations

from usefulwork.config import Config
from usefulwork.gateway.errors import GatewayError


class Tenants:
    def __init__(self, cfg: Config):
        self._by_key = dict(cfg.auth.api_keys)

    def identify(self, authorization: bytes | None) -> str:
        if not self._by_key:
            return "default"
        auth = authorization or b""
        key = auth[7:].decode("latin-1").strip() if auth[:7].lower() == b"bearer " else ""
        tenant = self._by_key.get(key)
        if tenant is None:
            raise GatewayError(401, "invalid or missing API key", code="invalid_api_key")
        return tenant
