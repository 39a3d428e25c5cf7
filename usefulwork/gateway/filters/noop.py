"""A filter that does nothing: measures what the chain itself costs (benchmarks/overhead.py)."""

from __future__ import annotations

from usefulwork.gateway.pipeline import Call, Handler, Reply, Services


class NoopFilter:
    name = "noop"

    def __init__(self, services: Services | None = None):
        pass

    async def __call__(self, call: Call, next: Handler) -> Reply:
        return await next(call)
