"""Replica choice inside a pool: ``pick(call, replicas) -> replicas, best first``.

The forwarder tries the returned replicas in order (the next one only when the previous failed
before anything reached the client). ``replicas`` are the pool's candidates (healthy ones, or,
when none is known healthy, those whose back-off expired); a picker orders them and may drop some,
never add. Scoring pickers (prefix affinity, load) implement the same one method.

A picker may also have ``feedback(call, replica)``: the forwarder registers it to run when the
reply is closed, when ``call.ctx`` holds the final usage (``cached_tokens`` included), so a prefix
picker can check its prediction against what vLLM reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from usefulwork.config import Config
    from usefulwork.gateway.pipeline import Call
    from usefulwork.upstream.fleet import Fleet, Replica


class Picker(Protocol):
    def pick(self, call: Call, replicas: list[Replica]) -> list[Replica]: ...


class LeastLoaded:
    """Fewest outstanding requests first (this gateway's in-flight count, or the server's own queue)."""

    name = "least-loaded"

    def pick(self, call: Call, replicas: list[Replica]) -> list[Replica]:
        if len(replicas) < 2:
            return replicas
        return sorted(replicas, key=_load)


def _load(r: Replica) -> float:
    return r.load


def build_pickers(cfg: Config, fleet: Fleet) -> dict[str, Picker]:
    """One picker per pool (the forwarder asks ``pickers[pool.name]``)."""
    return {name: LeastLoaded() for name in fleet.pools}
