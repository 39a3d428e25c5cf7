"""Live mirroring: the ``mirror`` filter sends a sample of live requests to a shadow pool in the background.

Config::

    pools: [..., {name: candidate, models: [llama-candidate], replicas: [...]}]
    filters: [mirror]
    shadow: {pool: candidate, sample: 0.1}

The client only ever sees the primary's answer: the filter starts the shadow request as a separate
task and calls ``next`` at once; nothing the shadow does (refuse, stall, fail, overload) reaches the
primary's reply. The shadow copy carries the shadow pool's first model name, goes through its own
``Forwarder`` (picker, leases, replica health of the shadow pool only), has its own context that is
never handed to the accountant (never billed to a tenant, never counted against limits) and is cut at
``shadow.timeout_s``. Shadow work is dropped first: when ``shadow.max_inflight`` shadow requests are
already running, or no shadow replica is usable, the request is simply not mirrored (counted).
Each shadow request's result is written as a traffic-log record (``usefulwork.gateway.recording``) to
``shadow.dir`` with ``shadow_of`` = the primary's request id, so it joins the primary's record
(redacted when ``record.redact`` is on); ``usefulwork replay LOG --shadow-log DIR`` compares the two.
Counts: ``stats()`` and the OTel counter ``usefulwork.shadow.requests`` (attribute ``result``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.errors import GatewayError
from usefulwork.gateway.pipeline import Call, Handler, Reply, Services, classify

log = logging.getLogger("usefulwork.mirror")


class ShadowCfg(BaseModel):
    """Live mirroring (the ``mirror`` filter): a sample of live requests also sent to a shadow pool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pool: str = Field(..., description="Name of the shadow pool (one of ``pools``); it gets its first model's name.")
    sample: float = Field(0.1, ge=0.0, le=1.0, description="Fraction of live requests mirrored.")
    max_inflight: int = Field(8, gt=0, description="Shadow requests running at once; beyond this, not mirrored.")
    timeout_s: float = Field(60.0, gt=0, description="A shadow request still running after this long is cut.")
    dir: str = Field("traffic-shadow", description="Directory of the shadow requests' traffic log.")


class MirrorFilter:
    name = "mirror"

    def __init__(self, services: Services):
        from usefulwork.gateway.recording import RecordCfg, TrafficLog  # noqa: PLC0415
        from usefulwork.upstream.forwarder import Forwarder  # noqa: PLC0415
        from usefulwork.upstream.pickers import build_pickers  # noqa: PLC0415

        cfg: ShadowCfg | None = services.cfg.shadow
        if cfg is None:
            raise ValueError("the 'mirror' filter needs a 'shadow' section (shadow.pool)")
        pool = services.fleet.pools.get(cfg.pool)
        if pool is None:
            raise ValueError(f"shadow.pool {cfg.pool!r} is not one of the pools ({', '.join(services.fleet.pools)})")
        self.cfg = cfg
        self.pool = pool
        self.model = pool.cfg.models[0]
        self.forward = Forwarder(services.fleet, build_pickers(services.cfg, services.fleet))
        self.tasks: set[asyncio.Task] = set()
        self.counts = {"mirrored": 0, "ok": 0, "failed": 0, "dropped_busy": 0, "dropped_down": 0}
        self._counter = None if services.meter is None else services.meter.create_counter(
            "usefulwork.shadow.requests", unit="{request}",
            description="Mirrored requests by result: ok, failed, dropped_busy, dropped_down.")
        self.log = TrafficLog(RecordCfg(dir=cfg.dir, redact=services.cfg.record.redact))
        self._rand = random.random

    def _count(self, result: str) -> None:
        self.counts[result] += 1
        if self._counter is not None:
            self._counter.add(1, {"result": result})

    async def __call__(self, call: Call, next: Handler) -> Reply:
        if self._rand() < self.cfg.sample:
            try:
                self._mirror(call)
            except Exception:  # the primary never pays for the shadow
                log.exception("mirroring failed")
        return await next(call)

    def _mirror(self, call: Call) -> None:
        if len(self.tasks) >= self.cfg.max_inflight:
            self._count("dropped_busy")
            return
        if not self.pool.healthy_replicas():
            self._count("dropped_down")
            return
        body = dict(call.body)
        body["model"] = self.model
        src = call.ctx
        ctx = RequestContext(id=src.id + "-shadow", endpoint=src.endpoint, model=self.model, stream=src.stream,
                             tenant=src.tenant, include_usage=True, max_tokens=src.max_tokens)
        shadow = Call(ctx=ctx, op=call.op, path=call.path, body=body, raw=None, pool=self.pool, headers=[])
        task = asyncio.create_task(self._run(shadow, src.id))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self._count("mirrored")

    async def _run(self, call: Call, primary_id: str) -> None:
        from usefulwork.gateway.proxy import book_usage  # noqa: PLC0415 (proxy imports the filters' registry)
        from usefulwork.gateway.recording import snapshot  # noqa: PLC0415

        ctx = call.ctx
        reply: Reply | None = None
        exc: BaseException | None = None
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                reply = await self.forward(call)
                ctx.status_code = reply.status
                if reply.chunks is not None:
                    async for _ in reply.chunks:
                        if ctx.t_first_token is None:
                            ctx.t_first_token = time.perf_counter()
                elif ctx.t_first_token is None:
                    ctx.t_first_token = time.perf_counter()
        except GatewayError as err:
            ctx.status_code = err.status
        except (Exception, asyncio.CancelledError) as e:  # noqa: BLE001 - a shadow failure is only counted
            exc = e
        finally:
            if reply is not None:
                book_usage(ctx, reply.usage)
                try:
                    await reply.aclose()
                except Exception:
                    pass
        ctx.outcome = classify(ctx.status_code, exc)
        ctx.t_end = time.perf_counter()
        self._count("ok" if ctx.outcome == "ok" else "failed")
        rec = snapshot(call, {})
        rec["shadow_of"] = primary_id
        self.log.offer(rec)

    async def start(self) -> None:
        self.log.start()

    async def stop(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=5.0)
        await asyncio.to_thread(self.log.close)

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "inflight": len(self.tasks), "pool": self.cfg.pool, "sample": self.cfg.sample,
                "written": self.log.written, "dropped_write": self.log.dropped_write + self.log.dropped_queue}
