"""Start and stop a simulated vLLM server as a subprocess (same shape as backends.local.LocalVLLM).

    with SimProcess(gpu="A100-80G", model="Llama-3.1-8B", profile="optimized-batched",
                    served_name="llama", port=18001, time_scale=20) as sim:
        httpx.get(f"{sim.base_url}/v1/models")

Each process is one asyncio loop (uvicorn + the engine task): light enough to run several on a
2-core machine. It runs in its own process group so stop() never leaves strays.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from usefulwork.backends.process import ManagedProcess


@dataclass
class SimProcess(ManagedProcess):
    name = "usefulwork sim"
    ready_path = "/health"
    poll_s = 0.1
    stop_timeout_s = 10.0

    gpu: str | None = None  # None: the profile's (cpu) or A100-80G
    model: str | None = None  # None: the profile's (cpu) or Llama-3.1-8B
    precision: str = "bf16"
    tp: int = 1
    profile: str = "optimized-batched"
    served_name: str | None = None  # default: the catalog model name
    port: int = 18000
    host: str = "127.0.0.1"
    time_scale: float = 1.0
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # vLLM flag overrides, e.g. {"max_num_seqs": 64}
    eos_median_tokens: int | None = None
    tokenizer: str | None = None
    log_path: Path | None = None
    proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "usefulwork.cli", "sim",
            "--precision", self.precision, "--tp", str(self.tp), "--profile", self.profile,
            "--host", self.host, "--port", str(self.port),
            "--time-scale", repr(float(self.time_scale)), "--seed", str(self.seed),
        ]
        if self.gpu:
            cmd += ["--gpu", self.gpu]
        if self.model:
            cmd += ["--model", self.model]
        if self.served_name:
            cmd += ["--served-model-name", self.served_name]
        if self.eos_median_tokens:
            cmd += ["--eos-median-tokens", str(self.eos_median_tokens)]
        if self.tokenizer:
            cmd += ["--tokenizer", self.tokenizer]
        for key, value in self.extra.items():
            flag = "--" + key.lstrip("-").replace("_", "-")
            if isinstance(value, bool):
                cmd.append(flag if value else "--no-" + flag[2:])
            else:
                cmd += [flag, str(value)]
        return cmd

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        return env
