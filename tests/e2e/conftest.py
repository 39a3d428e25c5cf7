"""End-to-end harness: the gateway runs as a real `usefulwork serve --config` subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import free_port


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen
    log: Path
    config_path: Path

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, sig: int | None = None) -> int:
        if self.proc.poll() is None:
            if sig is None:
                self.proc.terminate()
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


_STARTED: list[tuple[float, Gateway]] = []  # (when, gateway): read by the failure report below
_TEST_START = [0.0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed e2e test's report ends with the log of every gateway it could have talked to (those
    started during the test, and those still running): a gateway's error is otherwise lost with its
    temporary directory, and a failure seen once in CI could not be diagnosed."""
    if call.when == "setup":
        _TEST_START[0] = call.start
    report = (yield).get_result()
    if report.failed:
        for started, gw in _STARTED:
            if started >= _TEST_START[0] or gw.proc.poll() is None:
                lines = gw.log_text().splitlines()[-80:]
                report.sections.append((f"gateway {gw.url} log (last {len(lines)} lines)", "\n".join(lines)))
    if call.when == "teardown":
        _STARTED[:] = [(t, gw) for t, gw in _STARTED if gw.proc.poll() is None]


def start_gateway(tmp_path: Path, cfg: dict, ready_timeout: float = 60.0, wait_ready: bool = True,
                  env: dict | None = None) -> Gateway:
    port = free_port()
    cfg_path = tmp_path / f"gateway-{port}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / f"gateway-{port}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "usefulwork.cli", "serve", "--config", str(cfg_path), "--port", str(port),
         "--log-level", "warning"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
    )
    gw = Gateway(f"http://127.0.0.1:{port}", proc, log, cfg_path)
    _STARTED.append((time.time(), gw))
    deadline = time.monotonic() + ready_timeout
    path = "/readyz" if wait_ready else "/healthz"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}:\n{gw.log_text()}")
        try:
            if httpx.get(gw.url + path, timeout=1).status_code == 200:
                return gw
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    gw.stop()
    raise TimeoutError(f"gateway not ready in {ready_timeout}s:\n{gw.log_text()}")


def pool_cfg(model: str, replicas: list[str], **extra) -> dict:
    cfg = {
        "pools": [{"name": "local", "models": [model], "replicas": replicas,
                   "gpu": {"type": "cpu", "count": 1, "usd_per_hour": 0.1}}],
        "timeouts": {"health_interval_s": 0.5, "retry_after_down_s": 1.0, "read_s": 120},
    }
    cfg.update(extra)
    return cfg


@pytest.fixture(scope="session")
def gateway(vllm_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    gw = start_gateway(tmp, pool_cfg(vllm_server.model, [vllm_server.base_url], limits={"max_body_bytes": 65536}))
    yield gw
    gw.stop()
