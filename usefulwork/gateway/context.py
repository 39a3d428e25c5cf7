"""The per-request record that travels through the gateway's steps and ends up in the ledger.

Each step fills in its own fields; nothing else is shared between steps. When the request ends
(whatever the outcome) the gateway hands the finished context to the ``Accountant``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Outcome = Literal["ok", "shed", "error", "client_cancelled", "timeout", "rejected"]
UsageSource = Literal["backend", "estimate", "none"]


@dataclass(slots=True)
class RequestContext:
    id: str  # made by the gateway: unique, the ledger's key and the x-request-id the client gets back
    endpoint: str  # "chat" | "completions" | "responses" | "embeddings"
    model: str  # as the client asked
    stream: bool
    tenant: str = "default"
    include_usage: bool = False  # did the CLIENT ask for stream usage
    max_tokens: int | None = None
    client_request_id: str | None = None  # the client's own x-request-id (a correlation id; may repeat)

    # routing
    pool: str | None = None
    replica: str | None = None
    route: str | None = None
    route_reason: str | None = None
    escalated: bool = False  # a cascade discarded the small tier's answer and asked the large tier
    discarded_tokens: int = 0  # prompt + completion tokens of that discarded answer
    discarded_cost_usd: float = 0.0  # its price-sheet cost (0 when the small pool has no prices)
    predicted_cached_tokens: int | None = None  # a prefix picker's prediction, checked against cached_tokens
    attempts: int = 0

    # admission (gateway/admission): class, decision (admit | queued | shed | refused | degraded:...), queue wait
    priority: str | None = None
    admission: str | None = None
    queue_ms: float = 0.0
    shed_reason: str | None = None

    # cache
    cache: str = "miss"  # miss | hit-exact | hit-semantic | bypass
    saved_usd: float = 0.0  # a cache hit: price-sheet cost of the stored answer it served again

    # usage
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    usage_source: UsageSource = "none"

    # timing (monotonic seconds; wall clock start for records)
    wall_start: float = field(default_factory=time.time)
    t_start: float = field(default_factory=time.perf_counter)
    t_validated: float | None = None  # body read, parsed and validated
    t_forwarded: float | None = None  # first sent upstream (GPU work can start)
    t_first_token: float | None = None
    on_first_token: Any = None  # called once, with no argument, when a stream's first event is sent (admission)
    on_answer: Any = None  # called with no argument just before the response's last bytes, usage booked (a cascade's discarded tier)
    t_end: float | None = None
    chunks: int = 0  # content-bearing SSE events forwarded
    closing: bool = False  # the final response message is being sent: a disconnect now is not a cancel

    # result
    status_code: int = 200
    outcome: Outcome = "ok"
    error: str | None = None
    cost_usd: float = 0.0  # price-sheet cost, filled by accounting
    slo_met: bool | None = None
    recovered: bool = False  # rebuilt from the journal of a gateway that died (accounting/journal.py)
    journaled: tuple | None = None  # the fields its last journal row held (accounting/journal.py)

    # Raw SSE events already sent to the client. Kept only so that a stream cut before usage
    # arrived can be counted with a tokenizer afterwards (never parsed on the hot path).
    streamed_events: list[bytes] | None = None
    # Prompt payload (messages or prompt) for token estimation when the backend never answered.
    prompt_payload: Any = None

    # -- derived timings, in milliseconds --
    @property
    def intake_ms(self) -> float:
        """Reading, parsing and validating the request (not a queue: admission adds its own wait)."""
        return 0.0 if self.t_validated is None else (self.t_validated - self.t_start) * 1000.0

    @property
    def e2e_ms(self) -> float | None:
        return None if self.t_end is None else (self.t_end - self.t_start) * 1000.0

    @property
    def ttft_ms(self) -> float | None:
        return None if self.t_first_token is None else (self.t_first_token - self.t_start) * 1000.0

    @property
    def tpot_ms(self) -> float | None:
        """(E2E - TTFT) / (completion_tokens - 1), vLLM bench's definition."""
        if self.t_end is None or self.t_first_token is None or self.completion_tokens < 2:
            return None
        return (self.t_end - self.t_first_token) * 1000.0 / (self.completion_tokens - 1)


class Accountant(Protocol):
    """Sees every request start (``begin``), its last response bytes about to go (``answered``: zero or more
    times) and its end (``finish``); all run on the event loop, O(1)."""

    def begin(self, ctx: RequestContext) -> None: ...

    def answered(self, ctx: RequestContext) -> None: ...

    def finish(self, ctx: RequestContext) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class NullAccountant:
    def begin(self, ctx: RequestContext) -> None:
        return None

    def answered(self, ctx: RequestContext) -> None:
        return None

    def finish(self, ctx: RequestContext) -> None:
        return None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None
