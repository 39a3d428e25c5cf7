"""Shared fixtures: the real local vLLM server (once per test session) and real Redis.

Set ``USEFULWORK_TEST_VLLM_URL`` to reuse a vLLM server that is already running (development), and
``USEFULWORK_TEST_VLLM_KV_EVENTS`` to the ZMQ endpoint of its KV-cache events if it publishes them;
otherwise the session starts one itself (CI), publishing its KV-cache events on an ipc socket. A real component that cannot start FAILS the tests
that need it: it is never skipped into a pass.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
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
    kv_events: str | None = None  # ZMQ endpoint of its KV-cache event publisher

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


def drop_redis_keys(redis_url: str, prefix: str) -> None:
    """Delete a test's Redis keys (those starting with ``prefix``)."""
    import redis

    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=prefix + "*", count=1000))  # (SCAN: a shared Redis is not blocked)
    if keys:
        r.delete(*keys)


def child_pids(pid: int) -> list[int]:
    """The live child processes of ``pid`` (pgrep -P), sorted."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return sorted(int(x) for x in out)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class EmbeddedFleet:
    """`usefulwork serve` with no config: the main job (local vLLM + gateway) as a real process."""

    proc: subprocess.Popen
    gateway_url: str
    vllm_url: str
    log: Path
    kv_events: str

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _start_embedded(tmp: Path) -> EmbeddedFleet:
    gw_port, vllm_port = free_port(), free_port()
    log = tmp / "serve.log"
    kv_events = f"ipc://{tmp / 'kv-events.sock'}"  # vLLM binds ipc endpoints (tcp only on a wildcard host)
    kv_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events}
    # (VLLM_ENABLE_RESPONSES_API_STORE: the real vLLM keeps stored Responses, for tests/e2e/test_stored_responses.py)
    env = {**os.environ, "VLLM_ENABLE_RESPONSES_API_STORE": "1", "USEFULWORK__LOCAL_FLEET__PORT": str(vllm_port),
           "USEFULWORK__LOCAL_FLEET__EXTRA_ARGS": json.dumps(["--kv-events-config", json.dumps(kv_cfg)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "usefulwork.cli", "serve", "--port", str(gw_port), "--vllm-log", str(tmp / "vllm.log")],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
    )
    fleet = EmbeddedFleet(proc, f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{vllm_port}", log, kv_events)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"`usefulwork serve` exited with {proc.returncode}:\n{fleet.log_text()[-4000:]}")
        try:
            if httpx.get(fleet.gateway_url + "/readyz", timeout=2).status_code == 200:
                return fleet
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    pytest.fail(f"`usefulwork serve` not ready in 900 s:\n{fleet.log_text()[-4000:]}")


@pytest.fixture(scope="session")
def embedded_fleet(tmp_path_factory):
    """The embedded default fleet, started once; stopped with SIGINT (Ctrl-C) at the end of the session."""
    fleet = _start_embedded(tmp_path_factory.mktemp("embedded"))
    yield fleet
    if fleet.proc.poll() is None:
        fleet.proc.send_signal(signal.SIGINT)
        try:
            fleet.proc.wait(60)
        except subprocess.TimeoutExpired:
            fleet.proc.kill()
            pytest.fail("`usefulwork serve` did not stop within 60 s of Ctrl-C")
        if fleet.proc.returncode != 0:
            pytest.fail(f"`usefulwork serve` exited {fleet.proc.returncode} on Ctrl-C:\n{fleet.log_text()[-2000:]}")
        if _answers(fleet.vllm_url):
            pytest.fail("the embedded vLLM still answers after Ctrl-C stopped `usefulwork serve`")


@pytest.fixture(scope="session")
def vllm_server(request) -> VLLMServer:
    """Real vLLM: USEFULWORK_TEST_VLLM_URL if set (development), else the embedded fleet's own vLLM."""
    url = os.environ.get("USEFULWORK_TEST_VLLM_URL")
    if url:
        url = url.rstrip("/").removesuffix("/v1")
        if not _answers(url):
            pytest.fail(f"USEFULWORK_TEST_VLLM_URL={url} does not answer /v1/models")
        return VLLMServer(url, MODEL_NAME, os.environ.get("USEFULWORK_TEST_VLLM_KV_EVENTS"))
    fleet = request.getfixturevalue("embedded_fleet")
    if not _answers(fleet.vllm_url):
        pytest.fail(f"the embedded fleet's vLLM at {fleet.vllm_url} does not answer")
    return VLLMServer(fleet.vllm_url, MODEL_NAME, fleet.kv_events)


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


# -- garbage-collector pauses ------------------------------------------------------------------------------
# A test that times something in this process (a load generator's send schedule, a deadline) fails when the
# collector stops the process for long; the summary names every pause over 100 ms and the test it fell in.
_GC_PAUSE_S = 0.1
_gc_pauses: list[tuple[float, int, int, str]] = []
_gc_started = [0.0]


def _gc_watch(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
        return
    took = time.perf_counter() - _gc_started[0]
    if took > _GC_PAUSE_S:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
        _gc_pauses.append((took, info.get("generation", -1), info.get("collected", 0), test))


gc.callbacks.append(_gc_watch)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _gc_pauses:
        return
    terminalreporter.section(f"garbage-collector pauses over {_GC_PAUSE_S * 1000:.0f} ms")
    for took, gen, collected, test in _gc_pauses:
        terminalreporter.write_line(f"{took * 1000:8.0f} ms  generation {gen}  collected {collected:>8}  {test}")
