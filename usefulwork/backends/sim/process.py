"""Start and stop a simulated vLLM server as a subprocess (same shape as backends.local.LocalVLLM).

    with SimProcess(gpu="A100-80G", model="Llama-3.1-8B", profile="optimized-batched",
                    served_name="llama", port=18001, time_scale=20) as sim:
        httpx.get(f"{sim.base_url}/v1/models")

Each process is one asyncio loop (uvicorn + the engine task): light enough to run several on a
2-core machine. It runs in its own process group so stop() never leaves strays.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx


@dataclass
class SimProcess:
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

    def start(self) -> "SimProcess":
        if self.proc is not None and self.proc.poll() is None:
            return self
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        self.proc = subprocess.Popen(self.command(), env=env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until /health answers 200; raise with the log tail if the process exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"usefulwork sim exited with code {self.proc.returncode}\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"usefulwork sim did not become ready in {timeout_s:.0f}s\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return "(no log)"
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout_s: float = 10.0) -> None:
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
            self.proc.wait(5)

    def __enter__(self) -> "SimProcess":
        self.start()
        try:
            self.wait_ready()
        except Exception:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
