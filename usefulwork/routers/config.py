"""Routing configuration: virtual models (cascades over pools, one router each) and replica pickers.

``Config.routing`` holds a ``RoutingCfg``. Every threshold and weight is range-checked here, so a
bad value fails at load time with the field named (``routing.virtual_models.0.heuristic.threshold``).
Pool names are checked against ``Config.pools`` by ``RoutingCfg.check_pools`` (the config's own
validator calls it), so a cascade naming a missing pool fails at load time too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from usefulwork.config import Config


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HeuristicCfg(_Strict):
    """The keyword-and-length router: score = sum of the weights of the signals a prompt shows."""

    threshold: float = Field(0.5, ge=0, le=100, description="Score at or above which the large tier is chosen.")
    long_prompt_chars: int = Field(600, ge=1, description="A prompt this long (characters) adds the full "
                                   "`length` weight; shorter ones a proportional share.")
    weights: dict[str, float] = Field(
        default_factory=lambda: {"length": 1.0, "several questions": 0.6, "analyze": 0.6, "compare": 0.6,
                                 "explain why": 0.6, "step by step": 0.8, "write code": 1.0, "explain": 0.4,
                                 "design": 0.5, "write a": 0.4, "implement": 0.6, "refactor": 0.6, "debug": 0.6,
                                 "plan": 0.4, "prove": 0.8, "why": 0.3, "trade-off": 0.4},
        description="Signal -> weight. Signals: `length`, `several questions` (two or more '?'), and any "
                    "other key is a phrase looked for in the last user message (case-insensitive).")

    @model_validator(mode="after")
    def _weights(self) -> "HeuristicCfg":
        for k, w in self.weights.items():
            if not (0.0 <= w <= 100.0):
                raise ValueError(f"weights.{k}: weight {w} out of range [0, 100]")
        return self


class ClassifierCfg(_Strict):
    """The embedding classifier: all-MiniLM-L6-v2 vector -> logistic head -> P(needs the large tier)."""

    head_path: str | None = Field(None, description="Trained head (JSON from `usefulwork router train`); "
                                  "None: the head that ships with the package.")
    threshold: float | None = Field(None, ge=0, le=1, description="P(large) at or above which the large tier "
                                    "is chosen; None: the head's calibrated threshold.")
    max_tokens: int | None = Field(None, ge=8, le=256, description="Tokens of the conversation embedded for "
                                   "the decision; None: what the head was trained with (its `max_tokens`), "
                                   "else the model's limit (256). Fewer is faster; a conversation no longer "
                                   "than this shares its vector with the semantic cache.")
    head_tokens: int | None = Field(None, ge=1, le=256, description="Of those, how many come from the "
                                    "conversation's start (the rest are its last tokens); None: what the head "
                                    "was trained with (its `head_tokens`), else all from the start.")


class ConfidenceCfg(_Strict):
    """Ask the small tier first with logprobs; escalate to the large tier when its answer looks unsure."""

    min_mean_logprob: float = Field(-1.0, le=0, description="Escalate when the mean token logprob is below this.")
    min_token_logprob: float = Field(-6.0, le=0, description="Escalate when any token's logprob is below this.")
    hold_tokens: int = Field(16, ge=1, le=4096, description="Streams: tokens held back and judged before any "
                             "is released (after release, no escalation).")
    small_max_tokens: int | None = Field(None, ge=1, description="Cap on the small tier's answer length "
                                         "(non-streaming); None: the client's max_tokens.")


class VirtualModel(_Strict):
    """A model name clients may send that no pool serves: a cascade over two pools, picked per request."""

    name: str = Field(..., min_length=1, description="The model name clients send (e.g. `auto`).")
    small_pool: str = Field(..., min_length=1, description="Pool of the small (cheap) tier.")
    large_pool: str = Field(..., min_length=1, description="Pool of the large tier.")
    router: Literal["heuristic", "classifier", "confidence-gated"] = Field("heuristic", description="The router.")
    heuristic: HeuristicCfg = HeuristicCfg()
    classifier: ClassifierCfg = ClassifierCfg()
    confidence: ConfidenceCfg = ConfidenceCfg()


class PickerCfg(_Strict):
    """How a replica is chosen inside a pool."""

    kind: Literal["least-loaded", "round-robin", "prefix", "precise-prefix"] = Field("least-loaded",
                                                                                     description="The picker.")
    block_tokens: int = Field(16, ge=1, le=4096, description="prefix: tokens per hashed block (vLLM's block size).")
    chars_per_token: float = Field(4.0, gt=0, le=64, description="prefix: characters per token when the pool's "
                                   "tokenizer is not available (about 4 for English BPE vocabularies).")
    tokenizer: str | None = Field(None, description="prefix: the pool's model folder (tokenizer.json and chat "
                                  "template) to hash tokens as vLLM does; \"sim\": the simulator's tokenizer; None: characters.")
    index_blocks: int = Field(50_000, ge=1, description="prefix: blocks remembered per replica (LRU).")
    cache_weight: float = Field(1.0, ge=0, le=1000, description="prefix: score per expected cached prefix share.")
    load_weight: float = Field(0.5, ge=0, le=1000, description="prefix: score cost per outstanding request "
                               "relative to the pool's mean.")
    kv_weight: float = Field(0.5, ge=0, le=1000, description="prefix: score cost per unit of KV-cache usage.")
    balance_rel: float = Field(1.5, ge=1, le=100, description="prefix: a replica whose load exceeds balance_rel "
                               "x the pool's least load + balance_abs gets no prefix bonus (the hot-prefix spiral guard).")
    balance_abs: float = Field(4.0, ge=0, le=10_000, description="prefix: see balance_rel (outstanding requests, "
                               "and requests picked within balance_window_s).")
    balance_window_s: float = Field(10.0, ge=0, le=3600, description="prefix: the guard also compares the requests "
                                    "picked per replica over about this many seconds (a decayed count) with the same "
                                    "balance_rel/balance_abs: at a low rate few requests are outstanding and only "
                                    "the pick count shows a hot prefix held by some replicas. 0: outstanding only.")
    min_prefix_blocks: int = Field(1, ge=1, description="prefix: shorter predicted matches count as none.")
    session_header: str | None = Field(None, description="prefix: request header whose value pins a session "
                                       "to the replica it was last sent to (while that replica is a candidate).")
    kv_events_endpoints: dict[str, str] = Field(default_factory=dict, description="precise-prefix: replica URL "
                                                "-> ZMQ endpoint of its KV-cache event publisher. vLLM binds only a "
                                                "wildcard or ipc endpoint (its --kv-events-config endpoint "
                                                "tcp://*:5557 is reached here as tcp://HOST:5557). block_tokens "
                                                "follows the block size the events carry.")
    kv_events_port: int | None = Field(None, ge=1, le=65535, description="precise-prefix for replicas found by "
                                       "`discovery` (or not listed in kv_events_endpoints): subscribe to "
                                       "tcp://REPLICA_HOST:kv_events_port (vLLM --kv-events-config endpoint tcp://*:PORT).")


class RoutingCfg(_Strict):
    """Cascades between pools (virtual models) and replica choice inside each pool."""

    virtual_models: list[VirtualModel] = Field(default_factory=list)
    pickers: dict[str, PickerCfg] = Field(default_factory=dict, description="Pool name -> its replica picker "
                                          "(pools not named use `default_picker`).")
    default_picker: PickerCfg = PickerCfg()

    def check_pools(self, cfg: Config) -> None:
        """Raise ValueError naming the field when a cascade or picker names a pool the config lacks."""
        pools = {p.name for p in cfg.pools}
        models = set(cfg.model_names)
        names: set[str] = set()
        for i, vm in enumerate(self.virtual_models):
            where = f"routing.virtual_models.{i}"
            for attr in ("small_pool", "large_pool"):
                if pools and getattr(vm, attr) not in pools:
                    raise ValueError(f"{where}.{attr}: no pool named {getattr(vm, attr)!r} "
                                     f"(pools: {', '.join(sorted(pools))})")
            if vm.name in models:
                raise ValueError(f"{where}.name: {vm.name!r} is already a model a pool serves")
            if vm.name in names:
                raise ValueError(f"{where}.name: {vm.name!r} appears twice")
            names.add(vm.name)
        for pool in self.pickers:
            if pools and pool not in pools:
                raise ValueError(f"routing.pickers.{pool}: no pool named {pool!r}")

    def picker_for(self, pool: str) -> PickerCfg:
        return self.pickers.get(pool, self.default_picker)

