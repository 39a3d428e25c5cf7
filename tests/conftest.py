"""Shared fixtures: the real local vLLM server (once per test session) and real Redis.

Set ``USEFULWORK_TEST_VLLM_URL`` to reuse a vLLM server that is already running (development);
otherwise the session starts one itself (CI). A real component that cannot start FAILS the tests
that need it: it is never skipped into a pass.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

MODEL_NAME = "smollm2-135m-instruct"


@dataclass(frozen=True)
class VLLMServer:
    base_url: str  # without /v1
    model: str

    def metric(self, name: str) -> float:
        """Sum of a Prometheus metric's samples from the server's /metrics (e.g. vllm:num_requests_running)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory) -> VLLMServer:
    url = os.environ.get("USEFULWORK_TEST_VLLM_URL")
    if url:
        url = url.rstrip("/").removesuffix("/v1")
        if not _answers(url):
            pytest.fail(f"USEFULWORK_TEST_VLLM_URL={url} does not answer /v1/models")
        yield VLLMServer(url, MODEL_NAME)
        return
    from usefulwork.backends.local import LocalVLLM
    from usefulwork.backends.model import ensure_model

    model_dir = ensure_model()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    server = LocalVLLM(model_dir=model_dir, served_name=MODEL_NAME, port=free_port(), log_path=log)
    server.start()
    try:
        server.wait_ready(timeout_s=900)
    except Exception as exc:  # a real component that cannot run is a failure, not a skip
        server.stop()
        pytest.fail(f"real vLLM could not start: {exc}")
    yield VLLMServer(server.base_url, MODEL_NAME)
    server.stop()


@pytest.fixture(scope="session")
def redis_url() -> str:
    url = os.environ.get("USEFULWORK_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    import redis

    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 5
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError as exc:
            if time.monotonic() > deadline:
                pytest.fail(f"real Redis is not reachable at {url}: {exc}")
            time.sleep(0.2)
    return url


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
