"""Workloads: what each request asks for (prompt, output length), independent of *when* it is sent.

- ``synthetic``: prompt and output lengths from a distribution (fixed, uniform, normal), prompts
  made of words that are one token each for the SmolLM2/GPT-2 style tokenizers, so a 512-token
  target gives a 512-token prompt; optional shared-prefix groups (prefix caching experiments).
- ``realistic``: the project's built-in prompt set (``data/realistic_prompts.jsonl``): a mix of
  simple questions and complex, multi-part requests, sent as chat, with natural stops.
- ``jsonl``: a user's prompt file, one JSON object per line (``prompt`` or ``messages``, optional
  ``max_tokens``). Errors name the line.
- trace workloads (Mooncake, BurstGPT, Azure) live in ``traces.py``; they also fix the send times.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Protocol

import numpy as np

Endpoint = Literal["completions", "chat"]


class WorkloadError(ValueError):
    """A bad workload spec or input file; the message names the field or the file and line."""


@dataclass(slots=True)
class RequestSpec:
    index: int
    endpoint: Endpoint
    max_tokens: int
    input_tokens: int  # planned prompt length (the server's usage count is what gets reported)
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    ignore_eos: bool = True  # vLLM extension: generate exactly max_tokens (as `vllm bench` does)
    at: float | None = None  # planned send offset in seconds (trace workloads only)
    kind: str = ""  # label for breakdowns: "simple", "complex", "prefix-3", ...
    temperature: float | None = None  # sent when set (cacheable Q&A workloads ask for 0)

    def body(self, model: str) -> dict[str, Any]:
        """The OpenAI request body (always streaming, always asking for usage)."""
        body: dict[str, Any] = {
            "model": model,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = self.messages if self.messages is not None else [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return body


class Workload(Protocol):
    name: str
    timed: bool  # True when specs carry their own send offsets (traces)

    def requests(self, rng: np.random.Generator) -> Iterator[RequestSpec]: ...

    def describe(self) -> dict[str, Any]: ...


# ---------------------------------------------------------------------------------------------
# prompt text


@lru_cache(maxsize=1)
def words() -> tuple[str, ...]:
    """Lower-case words that the SmolLM2 tokenizer encodes as ONE token each when space-prefixed."""
    text = resources.files("usefulwork.loadtest").joinpath("data/words.json").read_text()
    out = tuple(w for w in json.loads(text) if w)
    if len(out) < 100:
        raise WorkloadError("usefulwork/loadtest/data/words.json is missing or too short")
    return out


def random_text(rng: np.random.Generator, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of random words (random: no accidental prefix-cache hits)."""
    if n_tokens <= 0:
        return ""
    vocab = words()
    idx = rng.integers(0, len(vocab), size=n_tokens)
    return " " + " ".join(vocab[i] for i in idx)


# ---------------------------------------------------------------------------------------------
# length distributions


@dataclass(frozen=True)
class Lengths:
    """A token-length distribution: fixed, uniform [min, max], or normal(mean, std) clipped to >= 1."""

    dist: str = "fixed"
    value: int = 0
    low: int = 0
    high: int = 0
    mean: float = 0.0
    std: float = 0.0

    @classmethod
    def parse(cls, spec: Any, field_name: str) -> "Lengths":
        if isinstance(spec, bool):
            raise WorkloadError(f"{field_name} must be a number or a distribution mapping, got {spec!r}")
        if isinstance(spec, (int, float)):
            if spec < 1:
                raise WorkloadError(f"{field_name} must be >= 1, got {spec!r}")
            return cls(dist="fixed", value=int(spec))
        if not isinstance(spec, Mapping):
            raise WorkloadError(f"{field_name} must be a number or a distribution mapping, got {spec!r}")
        dist = spec.get("dist", "fixed")
        try:
            if dist == "fixed":
                return cls.parse(spec["value"], field_name)
            if dist == "uniform":
                low, high = int(spec["min"]), int(spec["max"])
                if not 1 <= low <= high:
                    raise WorkloadError(f"{field_name}: need 1 <= min <= max, got min={low} max={high}")
                return cls(dist="uniform", low=low, high=high)
            if dist == "normal":
                mean, std = float(spec["mean"]), float(spec["std"])
                if mean < 1 or std < 0:
                    raise WorkloadError(f"{field_name}: need mean >= 1 and std >= 0")
                return cls(dist="normal", mean=mean, std=std)
        except KeyError as exc:
            raise WorkloadError(f"{field_name}: distribution {dist!r} needs {exc.args[0]!r}") from None
        raise WorkloadError(f"{field_name}: unknown distribution {dist!r} (fixed, uniform, normal)")

    def sample(self, rng: np.random.Generator) -> int:
        if self.dist == "uniform":
            return int(rng.integers(self.low, self.high + 1))
        if self.dist == "normal":
            return max(1, int(round(rng.normal(self.mean, self.std))))
        return self.value

    @property
    def expected(self) -> float:
        if self.dist == "uniform":
            return (self.low + self.high) / 2
        if self.dist == "normal":
            return self.mean
        return float(self.value)

    def describe(self) -> Any:
        if self.dist == "fixed":
            return self.value
        if self.dist == "uniform":
            return {"dist": "uniform", "min": self.low, "max": self.high}
        return {"dist": "normal", "mean": self.mean, "std": self.std}


# ---------------------------------------------------------------------------------------------
# synthetic


@dataclass(frozen=True)
class SharedPrefix:
    groups: int
    prefix_tokens: int
    hot_share: float = 0.0  # share of requests that use group 0 (one very popular prefix); the rest uniform


@dataclass
class Synthetic:
    prompt_tokens: Lengths
    output_tokens: Lengths
    shared_prefix: SharedPrefix | None = None
    endpoint: Endpoint = "completions"
    ignore_eos: bool = True
    name: str = "synthetic"
    timed: bool = False

    def requests(self, rng: np.random.Generator) -> Iterator[RequestSpec]:
        prefixes: list[str] = []
        if self.shared_prefix:
            # Group prefixes come from their own stream so they do not depend on request order.
            prefix_rng = np.random.default_rng(int(rng.integers(0, 2**63)))
            prefixes = [f" [group {g}]" + random_text(prefix_rng, self.shared_prefix.prefix_tokens - 3)
                        for g in range(self.shared_prefix.groups)]
        i = 0
        while True:
            n_in = self.prompt_tokens.sample(rng)
            n_out = self.output_tokens.sample(rng)
            kind = ""
            if prefixes:
                hot = self.shared_prefix.hot_share  # type: ignore[union-attr]
                g = 0 if hot and rng.random() < hot else int(rng.integers(0, len(prefixes)))
                body = prefixes[g] + random_text(rng, max(1, n_in - self.shared_prefix.prefix_tokens))  # type: ignore[union-attr]
                kind = f"prefix-{g}"
            else:
                body = random_text(rng, n_in)
            yield RequestSpec(index=i, endpoint=self.endpoint, max_tokens=n_out, input_tokens=n_in,
                              prompt=body, ignore_eos=self.ignore_eos, kind=kind)
            i += 1

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": "synthetic", "prompt_tokens": self.prompt_tokens.describe(),
                             "output_tokens": self.output_tokens.describe(), "endpoint": self.endpoint,
                             "ignore_eos": self.ignore_eos}
        if self.shared_prefix:
            d["shared_prefix"] = {"groups": self.shared_prefix.groups, "prefix_tokens": self.shared_prefix.prefix_tokens,
                                  "hot_share": self.shared_prefix.hot_share}
        return d


# ---------------------------------------------------------------------------------------------
# prompt lists (built-in realistic set, user JSONL files)


@dataclass
class PromptList:
    """Cycles through a fixed list of prompts in a seeded random order."""

    items: list[RequestSpec]
    name: str
    source: str
    timed: bool = False

    def requests(self, rng: np.random.Generator) -> Iterator[RequestSpec]:
        i = 0
        while True:
            for j in rng.permutation(len(self.items)):
                src = self.items[int(j)]
                yield RequestSpec(index=i, endpoint=src.endpoint, max_tokens=src.max_tokens,
                                  input_tokens=src.input_tokens, prompt=src.prompt, messages=src.messages,
                                  ignore_eos=src.ignore_eos, kind=src.kind, temperature=src.temperature)
                i += 1

    def describe(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for it in self.items:
            kinds[it.kind or "-"] = kinds.get(it.kind or "-", 0) + 1
        return {"type": self.name, "source": self.source, "prompts": len(self.items), "kinds": kinds}


def _approx_tokens(text: str) -> int:
    # Planning estimate only (the server's usage is what gets reported): ~4 characters per token.
    return max(1, math.ceil(len(text) / 4))


def parse_prompt_line(obj: Any, where: str, default_max_tokens: int) -> RequestSpec:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    max_tokens = obj.get("max_tokens", obj.get("output_tokens", default_max_tokens))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise WorkloadError(f"{where}: max_tokens must be a positive integer, got {max_tokens!r}")
    kind = str(obj.get("kind", ""))
    temperature = obj.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or not 0 <= temperature <= 2):
        raise WorkloadError(f"{where}: temperature must be a number in [0, 2], got {temperature!r}")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        ):
            raise WorkloadError(f"{where}: messages must be a non-empty list of {{role, content}} objects")
        n = sum(_approx_tokens(m["content"]) for m in msgs)
        return RequestSpec(index=0, endpoint="chat", max_tokens=max_tokens, input_tokens=n, messages=msgs,
                           ignore_eos=bool(obj.get("ignore_eos", False)), kind=kind, temperature=temperature)
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise WorkloadError(f"{where}: prompt must be a non-empty string")
        endpoint = obj.get("endpoint", "chat")
        if endpoint not in ("chat", "completions"):
            raise WorkloadError(f"{where}: endpoint must be 'chat' or 'completions', got {endpoint!r}")
        return RequestSpec(index=0, endpoint=endpoint, max_tokens=max_tokens, input_tokens=_approx_tokens(prompt),
                           prompt=prompt, ignore_eos=bool(obj.get("ignore_eos", False)), kind=kind,
                           temperature=temperature)
    raise WorkloadError(f"{where}: each line needs a 'prompt' string or a 'messages' list")


def json_lines(text: str, source: str, error: type[WorkloadError] = WorkloadError
               ) -> Iterator[tuple[int, str, Any]]:
    """Yield (line number, "file:line", parsed object) per non-blank line; a bad line raises ``error`` naming it."""
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        yield lineno, where, obj


def load_jsonl_prompts(text: str, source: str, default_max_tokens: int = 128) -> list[RequestSpec]:
    items: list[RequestSpec] = []
    for _, where, obj in json_lines(text, source):
        items.append(parse_prompt_line(obj, where, default_max_tokens))
    if not items:
        raise WorkloadError(f"{source}: no prompts in file")
    return items


def jsonl_file(path: str | Path, default_max_tokens: int = 128) -> PromptList:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise WorkloadError(f"{p}: cannot read prompt file: {exc.strerror}") from None
    return PromptList(items=load_jsonl_prompts(text, str(p), default_max_tokens), name="jsonl", source=str(p))


def realistic() -> PromptList:
    res = resources.files("usefulwork.loadtest").joinpath("data/realistic_prompts.jsonl")
    items = load_jsonl_prompts(res.read_text(), "usefulwork/loadtest/data/realistic_prompts.jsonl")
    return PromptList(items=items, name="realistic", source="built-in")


# ---------------------------------------------------------------------------------------------
# spec -> workload


def from_spec(spec: Mapping[str, Any], base_dir: Path | None = None) -> Workload:
    """Build a workload from a mapping (experiment YAML or CLI flags)."""
    kind = spec.get("type", "synthetic")
    if kind == "synthetic":
        known = {"type", "prompt_tokens", "output_tokens", "shared_prefix", "endpoint", "ignore_eos"}
        _no_extra(spec, known, kind)
        sp = spec.get("shared_prefix")
        shared = None
        if sp is not None:
            if not isinstance(sp, Mapping) or "groups" not in sp or "prefix_tokens" not in sp:
                raise WorkloadError("shared_prefix needs groups and prefix_tokens")
            shared = SharedPrefix(groups=int(sp["groups"]), prefix_tokens=int(sp["prefix_tokens"]),
                                  hot_share=float(sp.get("hot_share", 0.0)))
            if shared.groups < 1 or shared.prefix_tokens < 4:
                raise WorkloadError("shared_prefix: groups >= 1 and prefix_tokens >= 4")
            if not 0.0 <= shared.hot_share <= 1.0:
                raise WorkloadError(f"shared_prefix.hot_share: {shared.hot_share} out of range [0, 1]")
        endpoint = spec.get("endpoint", "completions")
        if endpoint not in ("completions", "chat"):
            raise WorkloadError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
        return Synthetic(prompt_tokens=Lengths.parse(spec.get("prompt_tokens", 512), "prompt_tokens"),
                         output_tokens=Lengths.parse(spec.get("output_tokens", 128), "output_tokens"),
                         shared_prefix=shared, endpoint=endpoint, ignore_eos=bool(spec.get("ignore_eos", True)))
    if kind == "realistic":
        _no_extra(spec, {"type"}, kind)
        return realistic()
    if kind == "jsonl":
        _no_extra(spec, {"type", "path", "max_tokens"}, kind)
        if "path" not in spec:
            raise WorkloadError("workload type 'jsonl' needs a path")
        return jsonl_file(_resolve(spec["path"], base_dir), int(spec.get("max_tokens", 128)))
    if kind in ("mooncake", "burstgpt", "azure"):
        from usefulwork.loadtest import traces

        return traces.from_spec(spec, base_dir)
    raise WorkloadError(f"unknown workload type {kind!r} (synthetic, realistic, jsonl, mooncake, burstgpt, azure)")


def _resolve(path: str, base_dir: Path | None) -> Path:
    p = Path(path)
    return p if p.is_absolute() or base_dir is None else base_dir / p


def _no_extra(spec: Mapping[str, Any], known: set[str], kind: str) -> None:
    extra = set(spec) - known
    if extra:
        raise WorkloadError(f"workload type {kind!r} does not take {', '.join(sorted(extra))}")
