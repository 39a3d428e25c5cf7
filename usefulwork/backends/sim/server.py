"""Assemble a simulated server in-process: spec -> engine + tokenizer -> Starlette app.

Tests use it with ``httpx.ASGITransport`` or uvicorn; the CLI serves the same app.
"""

from __future__ import annotations

from starlette.applications import Starlette

from usefulwork.backends.sim.api import SimServer, build_app
from usefulwork.backends.sim.catalog import SimSpec
from usefulwork.backends.sim.engine import SimEngine
from usefulwork.backends.sim.kv_events import build_publisher
from usefulwork.backends.sim.tokens import load_tokenizer


def build_server(spec: SimSpec, served_model_name: str, time_scale: float = 1.0, seed: int = 0,
                 tokenizer: str | None = None, kv_events_config: str | None = None) -> Starlette:
    tok = load_tokenizer(tokenizer)
    engine = SimEngine(spec, seed=seed, output_token_ids=tok.vocab_ids, kv_events=build_publisher(kv_events_config))
    app = build_app(SimServer(engine, tok, served_model_name, time_scale))
    return app
