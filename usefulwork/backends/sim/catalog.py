"""The simulator's catalog (catalog.yaml) and the resolved spec of one simulated server.

``build_spec(gpu=..., model=..., profile=..., overrides=...)`` turns catalog names plus vLLM-style
flag overrides into a frozen ``SimSpec``: everything the engine needs, including the KV cache size
vLLM would allocate (GPU memory x utilization minus weights and activations, in 16-token blocks).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import yaml

CATALOG_PATH = Path(__file__).with_name("catalog.yaml")
GIB = 1024**3


class SpecError(ValueError):
    """A simulated server that cannot exist (unknown name, model does not fit, bad flag)."""


@dataclass(frozen=True)
class Calibration:
    hbm_efficiency: float = 0.85  # share of peak HBM bandwidth a decode step achieves
    mfu: float = 0.5  # share of peak FLOP/s a prefill achieves
    kv_efficiency: float = 1.0  # paged-attention KV reads relative to hbm_efficiency (gathers are slower)
    step_overhead_ms: float = 1.0  # scheduler + launch + sampling cost of every step
    per_seq_overhead_ms: float = 0.0  # per scheduled sequence (sampling, detokenization, bookkeeping)
    request_overhead_ms: float = 10.0  # API front-end cost before a request reaches the scheduler
    reserved_gib: float = 1.0  # CUDA context, graphs, non-torch memory
    # How a step's memory and compute times combine: None = max(memory, compute) (they overlap fully);
    # p = (memory^p + compute^p)^(1/p), which adds the part that does not overlap where both are large
    # (a mixed step, a big decode batch). Fitted where a real card's steps were timed (gpu_roofline.py).
    overlap_p: float | None = None

    def __post_init__(self) -> None:
        if self.overlap_p is not None and not self.overlap_p >= 1.0:
            raise SpecError(f"calibration.overlap_p must be at least 1 (1 adds memory and compute time; larger "
                            f"overlaps them more; leave it out for max), got {self.overlap_p!r}")


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_gib: float
    hbm_gbps: float
    bf16_tflops: float
    usd_per_hour: float
    calibration: Calibration
    kv_cache_gib: float | None = None  # fixed KV space (the CPU backend); None: from memory
    vllm_defaults: tuple[tuple[str, Any], ...] = ()  # flags vLLM picks itself on this device


@dataclass(frozen=True)
class ModelSpec:
    name: str
    total_params_b: float
    active_params_b: float
    layers: int
    hidden: int
    intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_model_len: int
    experts: int = 0
    experts_per_token: int = 0

    def kv_bytes_per_token(self, kv_dtype_bytes: float = 2.0) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * kv_dtype_bytes


@dataclass(frozen=True)
class PrecisionSpec:
    name: str
    bytes_per_param: float
    compute_speedup: float = 1.0


# vLLM engine flags a profile or an override may set (vLLM's own names, with underscores).
ENGINE_FLAGS: dict[str, type] = {
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "enable_chunked_prefill": bool,
    "enable_prefix_caching": bool,
    "gpu_memory_utilization": float,
    "block_size": int,
    "max_model_len": int,
    "num_gpu_blocks_override": int,
    "long_prefill_token_threshold": int,
    "scheduler": str,
    "scheduling_policy": str,
    "max_logprobs": int,
}
SCHEDULERS = ("v1", "v0-prefill-first")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy


@dataclass(frozen=True)
class EngineFlags:
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = 8192
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's own
    num_gpu_blocks_override: int | None = None
    long_prefill_token_threshold: int = 0  # 0: off (vLLM's default)
    scheduler: str = "v1"
    scheduling_policy: str = "fcfs"  # "priority": waiting requests by (priority, arrival), as vLLM's --scheduling-policy
    max_logprobs: int = 20


@dataclass(frozen=True)
class SimSpec:
    """Everything one simulated server needs; build it with ``build_spec``."""

    gpu: GPUSpec
    model: ModelSpec
    precision: PrecisionSpec
    tp: int
    profile: str
    flags: EngineFlags
    max_model_len: int
    max_num_batched_tokens: int
    num_gpu_blocks: int
    kv_bytes_per_token: float
    weight_bytes: float
    # Natural output length when a request does not set ignore_eos: the "model" stops (EOS) after
    # a seeded draw from a log-normal with this median, capped by max_tokens.
    eos_median_tokens: int = 256

    @property
    def block_size(self) -> int:
        return self.flags.block_size

    @property
    def usd_per_hour(self) -> float:
        return self.gpu.usd_per_hour * self.tp

    def describe(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu.name,
            "model": self.model.name,
            "precision": self.precision.name,
            "tp": self.tp,
            "profile": self.profile,
            "flags": asdict(self.flags),
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "num_gpu_blocks": self.num_gpu_blocks,
            "kv_cache_tokens": self.num_gpu_blocks * self.block_size,
            "weight_gib": round(self.weight_bytes / GIB, 3),
            "usd_per_hour": self.usd_per_hour,
        }


def load_catalog() -> dict[str, Any]:
    """The catalog: catalog.yaml next to this module, or the file named by USEFULWORK_SIM_CATALOG."""
    return _load_catalog(os.environ.get("USEFULWORK_SIM_CATALOG") or str(CATALOG_PATH))


@lru_cache(maxsize=4)
def _load_catalog(path: str) -> dict[str, Any]:
    p = Path(path)
    tree = yaml.safe_load(p.read_text())
    for key in ("gpus", "models", "precisions", "profiles"):
        if not isinstance(tree.get(key), dict):
            raise SpecError(f"{p}: missing section {key!r}")
    return tree


def names(section: str) -> list[str]:
    return sorted(load_catalog()[section])


def _pick(section: str, name: str) -> dict[str, Any]:
    table = load_catalog()[section]
    if name in table:
        return dict(table[name])
    lowered = {k.lower(): k for k in table}
    if name.lower() in lowered:
        return dict(table[lowered[name.lower()]])
    raise SpecError(f"unknown {section[:-1]} {name!r}; known: {', '.join(sorted(table))}")


def gpu_spec(name: str) -> GPUSpec:
    raw = _pick("gpus", name)
    cal = Calibration(**(raw.pop("calibration", None) or {}))
    defaults = tuple(sorted(normalize_flags(raw.pop("vllm_defaults", None) or {}).items()))
    canonical = next(k for k in load_catalog()["gpus"] if k.lower() == name.lower())
    return GPUSpec(name=canonical, calibration=cal, vllm_defaults=defaults, **raw)


def model_spec(name: str) -> ModelSpec:
    canonical = next((k for k in load_catalog()["models"] if k.lower() == name.lower()), name)
    return ModelSpec(name=canonical, **_pick("models", name))


def precision_spec(name: str) -> PrecisionSpec:
    return PrecisionSpec(name=name.lower(), **_pick("precisions", name))


def normalize_flags(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Accept vLLM flag spellings (``max-num-seqs``, ``--max-num-seqs``) and coerce types."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        k = key.lstrip("-").replace("-", "_")
        if k not in ENGINE_FLAGS:
            raise SpecError(f"unknown engine flag {key!r}; known: {', '.join(sorted(ENGINE_FLAGS))}")
        typ = ENGINE_FLAGS[k]
        if value is None:
            out[k] = None
        elif typ is bool and isinstance(value, str):
            out[k] = value.lower() in ("1", "true", "yes", "on")
        else:
            out[k] = typ(value)
    return out


def activation_bytes(model: ModelSpec, tokens: int, tp: int) -> float:
    """Peak activation memory vLLM's profiling run sees for a batch of `tokens` (why KV gets less)."""
    per_token = 2.0 * (4 * model.hidden + 2 * model.intermediate / tp)
    return per_token * tokens


def build_spec(
    gpu: str | None = None,
    model: str | None = None,
    precision: str = "bf16",
    tp: int = 1,
    profile: str = "optimized-batched",
    overrides: Mapping[str, Any] | None = None,
    eos_median_tokens: int = 256,
) -> SimSpec:
    prof = _pick("profiles", profile)
    gpu_name = gpu or prof.pop("gpu", None) or "A100-80G"
    model_name = model or prof.pop("model", None) or "Llama-3.1-8B"
    prof.pop("gpu", None)
    prof.pop("model", None)
    g, m, p = gpu_spec(gpu_name), model_spec(model_name), precision_spec(precision)
    # Precedence: explicit overrides > the profile's non-null values > vLLM's device defaults.
    settings = {k: v for k, v in normalize_flags(prof).items() if v is not None}
    settings.update({k: v for k, v in normalize_flags(overrides or {}).items() if v is not None})
    v0 = settings.get("scheduler") == "v0-prefill-first"
    for k, v in g.vllm_defaults:
        if k == "max_num_batched_tokens" and v0:
            continue  # V0 without chunked prefill: max(max_model_len, 2048), resolved below
        settings.setdefault(k, v)
    if not v0:
        settings.setdefault("max_num_batched_tokens", 2048)
    else:
        settings.setdefault("max_num_batched_tokens", None)
    flags = EngineFlags(**settings)
    if flags.scheduler not in SCHEDULERS:
        raise SpecError(f"scheduler must be one of {SCHEDULERS}, got {flags.scheduler!r}")
    if flags.scheduling_policy not in SCHEDULING_POLICIES:
        raise SpecError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {flags.scheduling_policy!r}")
    if tp < 1:
        raise SpecError("tp must be >= 1")
    if flags.max_num_seqs < 1:
        raise SpecError("max_num_seqs must be >= 1")
    if m.q_heads % tp or m.kv_heads % tp and tp % m.kv_heads:
        raise SpecError(f"tensor parallel degree {tp} does not divide {m.name}'s attention heads")

    explicit_len = flags.max_model_len
    if explicit_len and explicit_len > m.max_model_len:
        raise SpecError(f"max_model_len {explicit_len} exceeds {m.name}'s {m.max_model_len}")
    batched = flags.max_num_batched_tokens
    if batched is None:  # vLLM V0 without chunked prefill: the whole longest prompt fits one step
        batched = max(explicit_len or min(m.max_model_len, 32768), 2048)

    weight_bytes = m.total_params_b * 1e9 * p.bytes_per_param
    kv_per_token = m.kv_bytes_per_token()
    block_bytes_per_gpu = flags.block_size * kv_per_token / tp
    if flags.num_gpu_blocks_override:
        blocks = flags.num_gpu_blocks_override
    elif g.kv_cache_gib is not None:
        blocks = int(g.kv_cache_gib * GIB // block_bytes_per_gpu)
    else:
        budget = g.memory_gib * GIB * flags.gpu_memory_utilization
        used = weight_bytes / tp + activation_bytes(m, batched, tp) + g.calibration.reserved_gib * GIB
        free = budget - used
        if free <= 0:
            raise SpecError(
                f"{m.name} {p.name} does not fit on {tp}x {g.name}: weights {weight_bytes / tp / GIB:.1f} GiB per GPU "
                f"+ activations/reserved leave no KV cache within {budget / GIB:.1f} GiB "
                f"(gpu_memory_utilization {flags.gpu_memory_utilization}); raise tp or lower the precision"
            )
        blocks = int(free // block_bytes_per_gpu)
    kv_tokens = blocks * flags.block_size
    if explicit_len:
        max_model_len = explicit_len
        if kv_tokens < max_model_len:
            # vLLM refuses to start when one max-length sequence cannot fit the cache.
            raise SpecError(
                f"KV cache holds only {kv_tokens} tokens, fewer than max_model_len {max_model_len}: "
                "lower max_model_len, raise gpu_memory_utilization or tp"
            )
    else:
        # Not given: the model's own limit, capped to what the KV cache holds (as if the operator had
        # passed a fitting --max-model-len; vLLM itself would refuse to start).
        max_model_len = min(m.max_model_len, kv_tokens)
        if max_model_len < 256:
            raise SpecError(f"KV cache holds only {kv_tokens} tokens on {tp}x {g.name}: raise tp or lower the precision")
    if not flags.enable_chunked_prefill and batched < max_model_len:
        raise SpecError(
            f"max_num_batched_tokens ({batched}) is smaller than max_model_len ({max_model_len}) "
            "without chunked prefill: long prompts could never be scheduled (vLLM refuses this too)"
        )
    return SimSpec(
        gpu=g,
        model=m,
        precision=p,
        tp=tp,
        profile=profile,
        flags=flags,
        max_model_len=max_model_len,
        max_num_batched_tokens=batched,
        num_gpu_blocks=blocks,
        kv_bytes_per_token=kv_per_token,
        weight_bytes=weight_bytes,
        eos_median_tokens=eos_median_tokens,
    )


def with_calibration(spec: SimSpec, **changes: float) -> SimSpec:
    """The same spec with some calibration factors changed (used by the calibration benchmark)."""
    return replace(spec, gpu=replace(spec.gpu, calibration=replace(spec.gpu.calibration, **changes)))


__all__ = [
    "Calibration", "EngineFlags", "GPUSpec", "ModelSpec", "PrecisionSpec", "SimSpec", "SpecError",
    "build_spec", "load_catalog", "names", "normalize_flags", "with_calibration",
]
