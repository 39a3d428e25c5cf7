"""Who is calling: the ``Authorization: Bearer`` key -> a tenant, and what that tenant may do.

Keys are stored hashed: config holds ``sha256:<hex>`` of each key (``usefulwork tenants hash-key``
prints the hash of a new key), never the key. API keys are random, high-entropy secrets, so one
SHA-256 is enough (a password KDF would only slow every request down). A tenant has rpm / tpm
limits, a $ budget per UTC day, a default priority class, a fair-share weight, a degrade policy and
optionally the models it may call (intake answers any other as a model that does not exist);
the admission filter enforces the rest (usefulwork/gateway/admission). ``access`` holds the admin keys
and the Prometheus scrape token (usefulwork/gateway/access.py).

With no keys configured at all every request is tenant ``default`` (the embedded default).
Errors: 401 for a missing, malformed or unknown key; 403 for a disabled tenant.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import secrets
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from usefulwork.gateway.errors import GatewayError

if TYPE_CHECKING:
    from usefulwork.config import Config

Priority = Literal["interactive", "batch", "sheddable"]
PRIORITIES: tuple[Priority, ...] = ("interactive", "batch", "sheddable")  # served in this order
HASH_PREFIX = "sha256:"


def hash_key(key: str) -> str:
    """The form a key is stored in config: ``sha256:<64 hex>``."""
    return HASH_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()


def _check_hash(v: str) -> str:
    hexpart = v[len(HASH_PREFIX):] if v.startswith(HASH_PREFIX) else ""
    if len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise ValueError("must be 'sha256:' followed by 64 lower-case hex digits "
                         "(`usefulwork tenants hash-key` prints one); never the key itself")
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Degrade(_Strict):
    """What admission may do instead of shedding this tenant's request (recorded in the ledger)."""

    max_tokens: int | None = Field(None, ge=1, description="Cap max_tokens to this (a shorter answer meets the SLO sooner).")
    pool: str | None = Field(None, description="Send to this (cheaper) pool when the model's own pool is full.")


class TenantCfg(_Strict):
    """One tenant: its keys (hashed), limits, budget, default priority, fair-share weight."""

    key_hashes: list[str] = Field(default_factory=list, description="sha256:<hex> of each API key of this tenant.")
    enabled: bool = Field(True, description="A disabled tenant gets 403 for every request.")
    rpm: int | None = Field(None, ge=1, description="Requests per minute (token bucket; None: unlimited).")
    tpm: int | None = Field(None, ge=1, description="Tokens (prompt + max_tokens, corrected to actual) per minute.")
    budget_usd_per_day: float | None = Field(None, ge=0, description="US dollars per UTC day (price-sheet cost); a plain number.")
    priority: Priority = Field("interactive", description="Default priority class (the x-usefulwork-priority header overrides).")
    max_priority: Priority | None = Field(None, description="The highest class this tenant may ask for in "
                                          "x-usefulwork-priority (a higher one gets 403 priority_not_allowed, "
                                          "nothing forwarded); at or above its default priority. None: any.")
    weight: float = Field(1.0, gt=0, description="Fair-share weight: served tokens are divided by it.")
    max_inflight_per_process: int | None = Field(
        None, ge=1, description="Requests of this tenant one gateway process holds at once (queued or being "
        "answered, streams until their last event); more get 429 concurrency with a Retry-After. Counted per "
        "process, not shared: behind N gateway processes the tenant may hold N times as many. None: no cap.")
    degrade: Degrade | None = Field(None, description="Allowed degradations instead of a shed (None: never degrade).")
    models: list[str] | None = Field(None, description="The models (served or virtual, e.g. 'auto') this tenant may "
                                     "call and sees in /v1/models; any other gets the unknown model's 404. None: all.")

    @field_validator("key_hashes")
    @classmethod
    def _hashes(cls, v: list[str]) -> list[str]:
        return [_check_hash(h) for h in v]

    @property
    def limited(self) -> bool:
        """It has an rpm, a tpm or a budget: something to count (shared through Redis across gateways)."""
        return self.rpm is not None or self.tpm is not None or self.budget_usd_per_day is not None

    @property
    def settles(self) -> bool:
        """It has a tpm or a budget: an answer's actual tokens and cost are sent to its limits when it ends."""
        return self.tpm is not None or self.budget_usd_per_day is not None

    @model_validator(mode="after")
    def _default_within_max(self) -> TenantCfg:
        if self.max_priority is not None and PRIORITIES.index(self.priority) < PRIORITIES.index(self.max_priority):
            raise ValueError(f"priority {self.priority!r} is above max_priority {self.max_priority!r}: the default "
                             "class must be one the tenant may ask for")
        return self

    def allows(self, priority: Priority) -> bool:
        """Whether this tenant may ask for ``priority`` (its ``max_priority`` or a lower class)."""
        return self.max_priority is None or PRIORITIES.index(priority) >= PRIORITIES.index(self.max_priority)

    @field_validator("budget_usd_per_day", mode="before")
    @classmethod
    def _dollars(cls, v: Any) -> Any:
        # "50 EUR", "$5", "500 cents", "5/day": the unit is fixed by the field's name.
        if isinstance(v, str) or isinstance(v, bool):
            raise ValueError(f"must be a plain number of US dollars per UTC day (e.g. 25.0), got {v!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"must be a finite number of US dollars per day, got {v!r}")
        return v


class AccessCfg(_Strict):
    """Who may read the fleet view (/usefulwork/stats, dashboard, /metrics, /readyz detail)."""

    admin_key_hashes: list[str] = Field(default_factory=list, description="sha256:<hex> of admin keys (fleet view, admin endpoints).")
    metrics_token_hash: str | None = Field(None, description="sha256:<hex> of the bearer token Prometheus sends to scrape /metrics.")

    @field_validator("admin_key_hashes")
    @classmethod
    def _hashes(cls, v: list[str]) -> list[str]:
        return [_check_hash(h) for h in v]

    @field_validator("metrics_token_hash")
    @classmethod
    def _token(cls, v: str | None) -> str | None:
        return None if v is None else _check_hash(v)


def bearer(authorization: bytes | None) -> str | None:
    """The key in ``Bearer <key>`` (or the password of ``Basic``, which browsers send to the dashboard)."""
    if not authorization:
        return None
    scheme, _, rest = authorization.partition(b" ")
    scheme = scheme.lower()
    try:
        if scheme == b"bearer":
            key = rest.decode("ascii").strip()
        elif scheme == b"basic":
            import base64  # noqa: PLC0415 (dashboard only)

            key = base64.b64decode(rest.strip(), validate=True).decode("utf-8").partition(":")[2]
        else:
            return None
    except (UnicodeDecodeError, ValueError):
        return None
    return key or None


class Tenants:
    """Key -> tenant lookup and each tenant's settings (one instance per gateway process)."""

    def __init__(self, cfg: Config):
        self.reload(cfg)

    def reload(self, cfg: Config) -> None:
        """Take the tenants, keys and access of ``cfg`` (``usefulwork/gateway/reload.py``: on SIGHUP). One
        synchronous swap: a request identified before it sees the old tables, one after it the new ones."""
        by_name = dict(cfg.tenants)
        self._by_hash = {h: name for name, t in by_name.items() for h in t.key_hashes}
        self.by_name: dict[str, TenantCfg] = by_name
        self._plain = dict(cfg.auth.api_keys)  # legacy: plaintext key -> tenant
        self._models = {name: frozenset(t.models) for name, t in by_name.items() if t.models is not None}
        self.admin_hashes = frozenset(cfg.access.admin_key_hashes)
        self.metrics_hash = cfg.access.metrics_token_hash

    @property
    def auth_enabled(self) -> bool:
        return bool(self._by_hash or self._plain or self.admin_hashes)

    def settings(self, tenant: str) -> TenantCfg:
        return self.by_name.get(tenant) or _DEFAULT

    def models_of(self, tenant: str | None) -> frozenset[str] | None:
        """The models ``tenant`` may call (None: every one)."""
        return self._models.get(tenant) if self._models and tenant is not None else None

    def tenant_of_key(self, key: str | None) -> str | None:
        if not key:
            return None
        name = self._by_hash.get(hash_key(key))
        return name if name is not None else self._plain.get(key)

    def is_admin(self, key: str | None) -> bool:
        return bool(key) and hash_key(key) in self.admin_hashes

    def is_metrics_token(self, key: str | None) -> bool:
        return bool(key) and self.metrics_hash is not None and secrets.compare_digest(hash_key(key), self.metrics_hash)

    def identify(self, authorization: bytes | None) -> str:
        if not (self._by_hash or self._plain):
            return "default"
        tenant = self.tenant_of_key(bearer(authorization))
        if tenant is None:
            raise GatewayError(401, "invalid or missing API key", code="invalid_api_key")
        if not self.settings(tenant).enabled:
            raise GatewayError(403, f"tenant {tenant!r} is disabled", code="tenant_disabled")
        return tenant


_DEFAULT = TenantCfg()


# -- `usefulwork tenants` -------------------------------------------------------------------------


def configure_parser(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    h = sub.add_parser("hash-key", help="print a new API key (or the given one) and the hash config stores")
    h.add_argument("key", nargs="?", help="an existing key to hash (default: generate a new random key)")
    w = sub.add_parser("which", help="whose is this key in a config (a client's 401 or 403, explained); the key "
                       "is read from stdin, so it stays out of the shell's history and the process list")
    w.add_argument("--config", "-c", required=True, help="the gateway's config file")


def describe_key(tenants: Tenants, key: str) -> tuple[bool, str]:
    """(the gateway takes it, what it is) for ``key`` under ``tenants``; never prints a key or a hash."""
    if tenants.is_admin(key):
        return True, "the admin key (fleet view, admin endpoints)"
    if tenants.is_metrics_token(key):
        return True, "the metrics scrape token (/metrics only)"
    name = tenants.tenant_of_key(key)
    if name is None:
        if not tenants.auth_enabled:
            return True, "no keys are configured: every request is tenant 'default'"
        return False, "no tenant, admin key or scrape token has this key: its requests get 401"
    t = tenants.settings(name)
    legacy = " (auth.api_keys, in plain text: move it to key_hashes)" if hash_key(key) not in tenants._by_hash else ""
    if not t.enabled:
        return False, f"tenant {name!r}{legacy}: disabled, its requests get 403"
    limits = ", ".join(f"{k} {v}" for k, v in (("rpm", t.rpm), ("tpm", t.tpm), ("budget $/day", t.budget_usd_per_day),
                                               ("in flight per gateway process", t.max_inflight_per_process))
                       if v is not None) or "no limits"
    models = ", ".join(t.models) if t.models is not None else "all"
    cls = t.priority if t.max_priority is None else f"{t.priority} (at most {t.max_priority})"
    return True, f"tenant {name!r}{legacy}: {cls}, weight {t.weight:g}, {limits}; models: {models}"


def run(args: argparse.Namespace) -> int:
    if args.action == "which":
        import sys

        from usefulwork.config import ConfigError, load

        try:
            cfg = load(args.config)
        except ConfigError as exc:
            print(f"usefulwork tenants: {exc}", file=sys.stderr)
            return 2
        key = sys.stdin.readline().strip()
        if not key:
            print("usefulwork tenants: give the key on stdin (echo \"$KEY\" | usefulwork tenants which -c FILE)",
                  file=sys.stderr)
            return 2
        taken, what = describe_key(Tenants(cfg), key)
        print(what)
        return 0 if taken else 1
    key = args.key or "uw-" + secrets.token_urlsafe(32)
    if not args.key:
        print(f"key:  {key}   (give this to the client; it is not stored anywhere)")
    print(f"hash: {hash_key(key)}")
    return 0
