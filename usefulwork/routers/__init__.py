"""Cascade routing between model tiers: one ``Router`` interface, small implementations.

A router looks at a request and says which tier should answer it: ``decide(call) -> Decision``
(tier ``"small"`` or ``"large"``, a human-readable reason, the score it compared). Routers:

- ``heuristic`` (``routers/heuristic.py``): length and keyword signals, weights configurable;
- ``classifier`` (``routers/classifier.py``): the request's all-MiniLM-L6-v2 vector (shared with the
  semantic cache) through a trained logistic head, threshold calibrated to a large-tier share;
- ``confidence-gated`` (``routers/confidence.py``): always the small tier first; the cascade filter
  then judges the answer's token logprobs and escalates an unsure answer to the large tier.

The cascade filter (``usefulwork/gateway/filters/router.py``) maps virtual model names to a router
and two pools. Configuration: ``usefulwork/routers/config.py``; guide: docs/routing.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from usefulwork.gateway.pipeline import Call
    from usefulwork.routers.config import VirtualModel

Tier = Literal["small", "large"]


@dataclass(frozen=True, slots=True)
class Decision:
    tier: Tier
    reason: str  # short, for the ledger and the dashboard: "heuristic score 1.40 >= 1.00 (write code, length)"
    score: float | None = None


class Router(Protocol):
    name: str

    async def decide(self, call: Call) -> Decision: ...


def build_router(vm: VirtualModel) -> Router:
    """The router a virtual model names (imports only the one it uses)."""
    if vm.router == "heuristic":
        from usefulwork.routers.heuristic import HeuristicRouter  # noqa: PLC0415
        return HeuristicRouter(vm.heuristic)
    if vm.router == "classifier":
        from usefulwork.routers.classifier import ClassifierRouter  # noqa: PLC0415
        from usefulwork.routers.heuristic import HeuristicRouter  # noqa: PLC0415
        return ClassifierRouter.from_cfg(vm.classifier, fallback=HeuristicRouter(vm.heuristic))
    if vm.router == "confidence-gated":
        from usefulwork.routers.confidence import ConfidenceGate  # noqa: PLC0415
        return ConfidenceGate(vm.confidence)
    raise ValueError(f"router: unknown router {vm.router!r}")
