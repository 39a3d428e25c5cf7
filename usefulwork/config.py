"""Typed configuration: a YAML file plus environment overrides, validated once at start.

An error names the bad field and the file it came from (``ConfigError``).

Environment overrides use the prefix ``USEFULWORK__`` and ``__`` between path parts; values are
parsed as YAML so numbers, booleans and lists work::

    USEFULWORK__LISTEN__PORT=9000
    USEFULWORK__SLO__TTFT_MS=800
    USEFULWORK__POOLS__0__REPLICAS='["http://10.0.0.5:8000"]'
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from usefulwork.caches.config import CacheCfg
from usefulwork.embedding import EmbeddingCfg
from usefulwork.routers.config import RoutingCfg
from usefulwork.gateway.admission.config import AdmissionCfg
from usefulwork.gateway.mirror import ShadowCfg
from usefulwork.gateway.tenants import AccessCfg, TenantCfg
from usefulwork.gateway.recording import RecordCfg

ENV_PREFIX = "USEFULWORK__"


class ConfigError(ValueError):
    """Raised for a config that cannot be used; the message names the field and the source."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Listen(_Strict):
    """Where the gateway listens."""

    host: str = Field("127.0.0.1", description="Listen address (0.0.0.0 for all interfaces).")
    port: int = Field(8080, ge=0, le=65535, description="Listen port.")
    workers: int = Field(1, ge=1, description="Gateway processes sharing the port (`usefulwork serve --workers`): "
                         "one SO_REUSEPORT socket each, a dead worker restarted; with `scale_out.redis_url` they "
                         "behave as one gateway (docs/architecture.md, Scale-out).")


class Reload(_Strict):
    """Reloading tenants, keys and access from the config file without a restart (SIGHUP always does)."""

    watch_interval_s: float | None = Field(None, gt=0, description="Also reload when the file changes, looked at "
                                           "this often (its modification time, size and inode: a Kubernetes "
                                           "ConfigMap update is seen); None: on SIGHUP only.")


class Limits(_Strict):
    """Request limits."""

    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, description="Larger request bodies get 413.")
    body_timeout_s: float = Field(30.0, gt=0, description="A request body still incomplete after this long gets 408.")
    max_header_bytes: int = Field(32 * 1024, ge=1024, description="Request line plus headers; larger gets 431 "
                                  "(414 when the URL alone is too long), counted in usefulwork_http_rejected_total.")
    max_upstream_body_bytes: int = Field(64 * 1024 * 1024, gt=0, description="A larger non-streaming upstream "
                                         "answer fails that request with 502 (nothing more is read).")
    max_sse_event_bytes: int = Field(1024 * 1024, gt=0, description="A larger single SSE event from upstream "
                                     "ends that stream with an SSE error event (502).")


class Timeouts(_Strict):
    """Upstream and client timeouts, and health probing."""

    connect_s: float = Field(5.0, gt=0, description="TCP connect to a replica.")
    first_byte_s: float = Field(600.0, gt=0, description="Wait for the upstream's response headers (for a "
                                "non-streaming request: the whole answer).")
    read_s: float = Field(600.0, gt=0, description="Gap allowed between two upstream body chunks.")
    health_interval_s: float = Field(2.0, gt=0, description="Health check and /metrics scrape period.")
    retry_after_down_s: float = Field(5.0, gt=0, description="How long a failed replica stays down before re-probing.")
    client_header_s: float = Field(10.0, gt=0, description="A client must send a request's line and headers within "
                                   "this time of connecting (on a kept-alive connection: of the head's first byte); "
                                   "else 408 and close (slowloris).")
    client_keep_alive_s: float = Field(75.0, gt=0, description="An idle kept-alive client connection is closed after "
                                       "this long. Keep it above the clients' own idle expiry (httpx and the OpenAI "
                                       "SDKs 5 s, aiohttp 15 s): a client that sends on a connection the gateway is "
                                       "closing gets a connection error instead of an answer.")


class SLO(_Strict):
    """Latency objectives a request must meet to count as good (useful) work."""

    ttft_ms: float = Field(2000.0, gt=0, description="Time to first token.")
    tpot_ms: float = Field(200.0, gt=0, description="Time per output token after the first.")
    e2e_ms: float = Field(30000.0, gt=0, description="End-to-end request time.")


class GPU(_Strict):
    """The hardware a pool runs on and what it costs."""

    type: str = Field("cpu", description="GPU type (free text; the simulator catalog names A10G, L4, A100-80G, ...).")
    count: int = Field(1, ge=1, description="Total GPUs behind this pool, all replicas together (pool cost = count x "
                       "usd_per_hour). Ignored when per_replica is set.")
    usd_per_hour: float = Field(0.0, ge=0, description="Price of ONE GPU per hour.")
    per_replica: int | None = Field(None, ge=1, description="GPUs per replica: the pool's bill follows the replicas "
                                    "it has at each moment (per_replica x usd_per_hour x replicas), as an autoscaled pool "
                                    "with `discovery` pays; unset: a fixed bill of count GPUs.")


class Discovery(_Strict):
    """Replicas found at run time (docs/deploy.md, per-pod routing): one source, polled every interval_s."""

    dns: str | None = Field(None, description="Host name whose addresses are the replicas, each reached as "
                            "scheme://ADDRESS:port: a Kubernetes headless Service (clusterIP: None) answers with "
                            "one address per pod. A failed lookup keeps the replicas last found.")
    file: str | None = Field(None, description="A file of replica base URLs, one per line (# comments), re-read "
                             "every interval_s (a mounted ConfigMap, or one a deploy tool writes). A missing or "
                             "unreadable file keeps the replicas last found; an empty one means none.")
    port: int = Field(8000, ge=1, le=65535, description="dns: the replicas' port.")
    scheme: Literal["http", "https"] = Field("http", description="dns: the replicas' scheme.")
    family: Literal["any", "ipv4", "ipv6"] = Field("any", description="dns: which addresses count. A dual-stack "
                                                   "Service answers with an IPv4 and an IPv6 address per pod: pick "
                                                   "one family there, or each pod counts twice (and is billed twice).")
    interval_s: float = Field(5.0, gt=0, description="How often the source is read again.")

    @model_validator(mode="after")
    def _one_source(self) -> "Discovery":
        if (self.dns is None) == (self.file is None):
            raise ValueError("give exactly one of dns or file")
        return self


class Prices(_Strict):
    """Optional price sheet ($ per 1M tokens); None means: cost from GPU time only."""

    input_per_1m: float | None = Field(None, ge=0, description="$ per 1M prompt tokens.")
    output_per_1m: float | None = Field(None, ge=0, description="$ per 1M generated tokens.")
    cached_input_per_1m: float | None = Field(None, ge=0, description="$ per 1M prompt tokens served from the prefix cache.")


class Pool(_Strict):
    name: str = Field(..., min_length=1, description="Pool name (labels metrics, ledger, costs).")
    models: list[str] = Field(..., min_length=1, description="Model names this pool serves (as clients send them).")
    replicas: list[str] = Field(default_factory=list, description="Base URLs of vLLM OpenAI servers, e.g. "
                                "http://h:8000 (static; `discovery` adds the ones found at run time).")
    discovery: Discovery | None = Field(None, description="Find the replicas at run time (a headless Service's DNS "
                                        "name, or a file): per-pod routing behind Kubernetes.")
    gpu: GPU = GPU()
    prices: Prices = Prices()
    api_key: str | None = Field(None, description="Bearer key the replicas expect (vLLM --api-key).")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="The replicas' vLLM --scheduling-policy. 'priority': the admission filter sends each "
        "request's class as vLLM's `priority` (interactive 0, batch 1, sheddable 2), so interactive prefills also go "
        "first inside vLLM; the replicas must run with --scheduling-policy priority (vLLM rejects a non-zero "
        "priority otherwise).")

    @field_validator("replicas")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        return [replica_url(url) for url in v]

    @model_validator(mode="after")
    def _some_replicas(self) -> "Pool":
        if not self.replicas and self.discovery is None:
            raise ValueError(f"pool {self.name!r}: give replicas, discovery, or both")
        return self

    @property
    def usd_per_hour(self) -> float:
        """The pool's bill per hour as configured (per_replica: for its static replicas)."""
        return self.usd_per_hour_for(len(self.replicas))

    def usd_per_hour_for(self, replicas: int) -> float:
        """The bill per hour with ``replicas`` replicas (the same for any count unless gpu.per_replica is set)."""
        if self.gpu.per_replica is not None:
            return self.gpu.per_replica * self.gpu.usd_per_hour * replicas
        return self.gpu.count * self.gpu.usd_per_hour


def replica_url(url: str) -> str:
    """A replica's base URL, checked (http/https, no credentials) and normalized (no trailing / or /v1)."""
    scheme, sep, rest = url.partition("://")
    netloc = rest.split("/", 1)[0]
    if "@" in netloc:  # never echo the secret: not here, not in /readyz, /metrics or logs
        shown = f"{scheme}{sep}***@{netloc.rsplit('@', 1)[1]}"
        raise ValueError(f"replica URL {shown!r} carries credentials (user:password@); they would show "
                         "wherever replicas are listed. Remove them and give vLLM's key as the pool's "
                         "api_key (sent as Authorization: Bearer)")
    if not (url.startswith("http://") or url.startswith("https://")):
        raise ValueError(f"replica URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/").removesuffix("/v1")


class LocalFleet(_Strict):
    """The embedded default fleet: one local vLLM server started by `usefulwork serve`."""

    model_name: str = Field("smollm2-135m-instruct", description="Served model name clients use.")
    port: int = Field(8000, ge=1, le=65535, description="Local vLLM port (a free one is picked if taken).")
    kv_cache_gib: int = Field(2, ge=1, description="VLLM_CPU_KVCACHE_SPACE for the CPU build.")
    max_model_len: int = Field(2048, ge=64, description="vLLM --max-model-len.")
    extra_args: list[str] = Field(default_factory=list, description="Extra vLLM server flags.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="vLLM --dtype. auto: float32 on a CPU without native bfloat16 (no avx512_bf16/amx_bf16; "
        "emulated bfloat16 made prefill 5-6x slower there), vLLM's own choice elsewhere. A --dtype in extra_args wins.")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="vLLM --scheduling-policy of the local server (and its pool's scheduling_policy).")
    gpu: GPU = GPU(type="cpu-2core", count=1, usd_per_hour=0.10)


class LedgerCfg(_Strict):
    """Where per-request ledger records go (both optional)."""

    jsonl_path: str | None = Field(None, description="Append-only JSONL file of request records.")
    redis_url: str | None = Field(None, description="Redis URL for the ledger stream, e.g. redis://127.0.0.1:6379/0")
    redis_stream: str = Field("usefulwork:ledger", description="Redis Stream key.")
    flush_interval_s: float = Field(0.5, gt=0, description="Sinks are written at least this often.")
    batch_size: int = Field(256, ge=1, description="Records per sink write (a full batch is written at once).")
    max_hold_s: float = Field(5.0, gt=0, description="Longest a finished request's record waits for GPU-time "
                              "settlement while other requests still run; a record reaches the sinks within "
                              "max(max_hold_s, 2 x cost.interval_s) + cost.interval_s + flush_interval_s "
                              "(what the write-ahead journal covers when a gateway dies; docs/reliability.md).")
    shutdown_timeout_s: float = Field(5.0, gt=0, description="Longest a clean stop waits for a sink that does "
                                      "not answer (e.g. a hung Redis) before giving up on it.")
    journal: bool = Field(True, description="With a sink: journal each request just before its response's last "
                          "bytes are written, so a gateway that dies (SIGKILL, OOM) loses no record; another gateway sharing `journal_dir` "
                          "(or this one, restarted) writes them, marked `recovered` (docs/reliability.md).")
    journal_dir: str | None = Field(None, description="Where the journal lives; default: one directory per set of "
                                    "sinks (`.usefulwork-journal/<digest>` beside `jsonl_path`, else under the cache "
                                    "dir), shared by the gateways that write the same ledger. Gateways with ledgers "
                                    "of their own that should write each other's records set one directory.")


class CostCfg(_Strict):
    """How GPU time is attributed to requests."""

    prefill_weight: float = Field(1.0, ge=0, description="GPU-time share weight of one prompt token.")
    decode_weight: float = Field(1.0, ge=0, description="GPU-time share weight of one generated token.")
    interval_s: float = Field(1.0, gt=0, description="Attribution interval for GPU-time cost.")


class TelemetryCfg(_Strict):
    """OpenTelemetry export."""

    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP endpoint, e.g. http://collector:4318")
    service_name: str = Field("usefulwork", description="OTel resource service.name.")
    export_interval_s: float = Field(10.0, gt=0, description="OTLP metric export period.")
    record_prompts: bool = Field(False, description="Put prompt text on spans (off: privacy by default).")


class ScaleOut(_Strict):
    """Several gateway processes or replicas as one gateway: fleet-wide live stats and GPU-time books."""

    redis_url: str | None = Field(None, description="Redis shared by every gateway process/replica for the "
                                  "fleet-wide /usefulwork/stats and the shared GPU-time attribution (None: each "
                                  "process keeps its own figures and attributes a replica's time alone).")
    prefix: str = Field("usefulwork:fleet", description="Prefix of the Redis keys.")
    publish_interval_s: float = Field(1.0, gt=0, description="How often a gateway publishes its live windows.")
    gateway_ttl_s: float = Field(10.0, gt=0, description="A gateway silent this long is taken for dead: its "
                                 "figures leave the fleet view and its settlement frontier stops holding the "
                                 "fleet's back.")


class ResponsesCfg(_Strict):
    """The Responses API's stored responses (docs/routing.md): which replica holds each, and whose it is."""

    max_ids: int = Field(100_000, ge=1, description="Stored responses each gateway process remembers (the most "
                         "recently made or used); an older id is unknown to it, and a request naming it goes "
                         "where the picker sends it.")
    ttl_s: float = Field(7 * 86400.0, gt=0, description="With `scale_out.redis_url`: how long Redis keeps an id's "
                         "owner for every gateway process and replica.")


class Auth(_Strict):
    """Client API keys. Empty: no auth, every request is tenant "default"."""

    api_keys: dict[str, str] = Field(default_factory=dict, description="API key -> tenant name.")


class Config(_Strict):
    listen: Listen = Listen()
    reload: Reload = Reload()
    auth: Auth = Auth()
    limits: Limits = Limits()
    timeouts: Timeouts = Timeouts()
    slo: SLO = SLO()
    pools: list[Pool] = Field(default_factory=list)
    local_fleet: LocalFleet | None = None
    ledger: LedgerCfg = LedgerCfg()
    cost: CostCfg = CostCfg()
    telemetry: TelemetryCfg = TelemetryCfg()
    scale_out: ScaleOut = ScaleOut()
    responses: ResponsesCfg = ResponsesCfg()
    cache: CacheCfg = Field(CacheCfg(), description="Exact and semantic response caches (the `cache` filter).")
    embedding: EmbeddingCfg = Field(EmbeddingCfg(), description="The sentence embedder shared by the semantic "
                                    "cache and the classifier router.")
    tenants: dict[str, TenantCfg] = Field(default_factory=dict, description="Tenant name -> hashed keys, limits, budget, priority, weight (docs/admission.md).")
    access: AccessCfg = AccessCfg()
    admission: AdmissionCfg = AdmissionCfg()
    record: RecordCfg = RecordCfg()
    shadow: ShadowCfg | None = Field(None, description="Live mirroring (the mirror filter): shadow pool and sample.")
    filters: list[str] = Field(default_factory=list, description="Request filters, in the order they run "
                               "(names: usefulwork/gateway/filters/__init__.py; docs/architecture.md).")
    routing: RoutingCfg = Field(RoutingCfg(), description="Virtual models (cascades between pools) and replica pickers (docs/routing.md).")
    source: str = Field("<defaults>", description="Where this config came from (set by the loader).")

    @field_validator("filters")
    @classmethod
    def _known_filters(cls, v: list[str]) -> list[str]:
        from usefulwork.gateway.filters import FILTERS  # noqa: PLC0415 (the names only; no filter is imported)
        for name in v:
            if name not in FILTERS:
                raise ValueError(f"unknown filter {name!r}; known: {', '.join(sorted(FILTERS))}")
        return v

    @model_validator(mode="after")
    def _unique(self) -> "Config":
        seen_pools: set[str] = set()
        seen_models: dict[str, str] = {}
        for pool in self.pools:
            if pool.name in seen_pools:
                raise ValueError(f"pool name {pool.name!r} appears twice")
            seen_pools.add(pool.name)
            for m in pool.models:
                if m in seen_models:
                    raise ValueError(f"model {m!r} is served by two pools ({seen_models[m]!r} and {pool.name!r})")
                seen_models[m] = pool.name
        self.routing.check_pools(self)
        callable_ = set(seen_models or [(self.local_fleet or LocalFleet()).model_name])
        callable_.update(vm.name for vm in self.routing.virtual_models)
        for name, tenant in self.tenants.items():
            for m in tenant.models or ():
                if m not in callable_:
                    raise ValueError(f"tenants.{name}.models: {m!r} is neither a model a pool serves nor a virtual "
                                     f"model (known: {', '.join(sorted(callable_))})")
        return self

    def pool_for_model(self, model: str) -> Pool | None:
        for pool in self.pools:
            if model in pool.models:
                return pool
        return None

    @property
    def model_names(self) -> list[str]:
        return [m for p in self.pools for m in p.models]


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node: Any = tree
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            idx = int(part)
            while len(node) <= idx:
                node.append({})
            if last:
                node[idx] = value
            else:
                node = node[idx]
            continue
        if last:
            node[part] = value
        else:
            nxt = node.get(part)
            if nxt is None:
                nxt = [] if path[i + 1].isdigit() else {}
                node[part] = nxt
            node = nxt


def apply_env(tree: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    for key in sorted(environ):
        if not key.startswith(ENV_PREFIX):
            continue
        path = [p.lower() for p in key[len(ENV_PREFIX):].split("__") if p]
        if path:
            try:
                value = yaml.safe_load(environ[key])
            except yaml.YAMLError:  # not YAML ('[', a password with ': '): the string itself, which the
                value = environ[key]  # field then takes or refuses, naming itself (a traceback before)
            _set_path(tree, path, value)
    return tree


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "<root>"
        lines.append(f"{source}: {field}: {e['msg']}")
    return "invalid configuration\n  " + "\n  ".join(lines)


def from_mapping(tree: Mapping[str, Any], source: str = "<mapping>", environ: Mapping[str, str] | None = None) -> Config:
    data = apply_env(dict(tree), os.environ if environ is None else environ)
    data["source"] = source
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def load(path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Load and validate a config file (None: defaults plus environment)."""
    if path is None:
        return from_mapping({}, "<defaults>", environ)
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config file: {exc.strerror}") from None
    try:
        tree = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(tree).__name__}")
    return from_mapping(tree, str(p), environ)


def with_local_pool(cfg: Config, base_url: str) -> Config:
    """Return cfg with a pool for the embedded local fleet (used by `usefulwork serve` without --config)."""
    lf = cfg.local_fleet or LocalFleet()
    pool = Pool(name="local", models=[lf.model_name], replicas=[base_url], gpu=lf.gpu,
                scheduling_policy=lf.scheduling_policy)
    return cfg.model_copy(update={"pools": [pool], "local_fleet": lf})


def reference_rows(model: type[BaseModel] = Config, prefix: str = "", defaults: BaseModel | None = None
                   ) -> list[tuple[str, str, str, str]]:
    """(field path, type, default, description) for every config field, for docs/configuration.md."""
    rows = []
    for name, f in model.model_fields.items():
        if name == "source":
            continue
        path = f"{prefix}{name}"
        ann = f.annotation
        args = getattr(ann, "__args__", ())
        sub = next((a for a in (args or (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        default = getattr(defaults, name) if defaults is not None else f.get_default(call_default_factory=True)
        if sub is not None and getattr(ann, "__origin__", None) is None:
            doc = (f.description or sub.__doc__ or "").strip()
            rows.append((path, sub.__name__, "" if default is not None else "None", doc.splitlines()[0] if doc else ""))
            rows.extend(reference_rows(sub, path + ".", default if isinstance(default, BaseModel) else None))
            continue
        if getattr(ann, "__origin__", None) is dict and isinstance(args[1], type) and issubclass(args[1], BaseModel):
            rows.append((path, f"map of name to {args[1].__name__}", "{}", f.description or ""))
            rows.extend(reference_rows(args[1], path + ".<name>."))
            continue
        if args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            rows.append((path, f"list of {args[0].__name__}", "[]", f.description or ""))
            rows.extend(reference_rows(args[0], path + "[]."))
            continue
        shown = "required" if f.is_required() and defaults is None else repr(default)
        tname = ann.__name__ if isinstance(ann, type) else str(ann).replace("typing.", "").replace(" | ", " or ")
        rows.append((path, tname, shown, f.description or ""))
    return rows


def reference_markdown() -> str:
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for path, t, d, desc in reference_rows():
        lines.append(f"| `{path}` | {t} | {d.replace('|', '/')} | {desc} |")
    return "\n".join(lines) + "\n"


def write_reference(doc: Path) -> None:
    """Replace the generated table between the reference markers of docs/configuration.md."""
    text = doc.read_text()
    head, rest = text.split("<!-- reference:start -->\n", 1)
    tail = rest.split("<!-- reference:end -->", 1)[1] if "<!-- reference:end -->" in rest else "\n"  # the table ends the doc
    doc.write_text(f"{head}<!-- reference:start -->\n{reference_markdown()}<!-- reference:end -->{tail}")


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--write"]:  # python -m usefulwork.config --write docs/configuration.md
        write_reference(Path(sys.argv[2]))
    else:
        print(reference_markdown())
