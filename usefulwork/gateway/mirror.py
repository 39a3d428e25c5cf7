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
``shadow.timeout_s``. Shadow work is dropped first: a request is simply not mirrored (counted by reason)
when the primary pool is busy, judged from the primary's own load signal at the moment the request
arrives: ``dropped_primary_busy`` when the gateway's in-flight leases on the primary pool reach
``shadow.busy_inflight_per_replica`` per healthy replica, ``dropped_primary_saturated`` when a primary
replica reports saturation as last scraped (the admission filter's test: vLLM's waiting queue above a
quarter of its running requests, or KV-cache usage above ``admission.kv_high``); ``dropped_busy`` when
``shadow.max_inflight`` shadow requests are already running; ``dropped_down`` when no shadow replica is
usable; and two tests of the gateway process itself being saturated (``usefulwork.gateway.loop_lag``, one
probe 50 times a second, figures over its last half second): ``dropped_gateway_busy`` when ready work on
its event loop waits more than ``shadow.busy_loop_lag_ms`` to run (the median probe wait),
``dropped_gateway_cpu`` when the process used more than ``shadow.busy_cpu_fraction`` of one core. The
second catches streams: they keep the core busy in short slices, each callback quick, so the loop lag
stays under 1 ms on a core with no idle time left.
A shadow copy costs the gateway a second forward; on a saturated core that CPU would queue every primary
request behind it, so it is the first work to go.
Each shadow request's result is written as a traffic-log record (``usefulwork.gateway.recording``) to
``shadow.dir`` with ``shadow_of`` = the primary's request id, so it joins the primary's record
(redacted when ``record.redact`` is on); ``usefulwork replay LOG --shadow-log DIR`` compares the two.
Counts: ``stats()`` and the OTel counter ``usefulwork.shadow.requests`` (attribute ``result``: ``mirrored``,
``ok``, ``failed`` or the drop reason).
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
from usefulwork.gateway.loop_lag import LoopLag
from usefulwork.gateway.pipeline import Call, Handler, Reply, Services, classify
from usefulwork.gateway.sse import first_token_in

log = logging.getLogger("usefulwork.mirror")


class ShadowCfg(BaseModel):
    """Live mirroring (the ``mirror`` filter): a sample of live requests also sent to a shadow pool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pool: str = Field(..., description="Name of the shadow pool (one of ``pools``); it gets its first model's name.")
    sample: float = Field(0.1, ge=0.0, le=1.0, description="Fraction of live requests mirrored.")
    max_inflight: int = Field(8, gt=0, description="Shadow requests running at once; beyond this, not mirrored.")
    timeout_s: float = Field(60.0, gt=0, description="A shadow request still running after this long is cut.")
    dir: str = Field("traffic-shadow", description="Directory of the shadow requests' traffic log.")
    busy_inflight_per_replica: float | None = Field(
        None, gt=0, description="Not mirrored while the gateway has this many requests in flight per healthy "
        "replica of the primary pool (its leases, the request itself not counted); None: no such limit.")
    busy_loop_lag_ms: float | None = Field(
        1.0, gt=0, description="Not mirrored while ready work on the gateway's event loop waits longer than this "
        "to run (ms, the median of the last 0.5 s of probes): the gateway's own core is saturated. None: no such test.")
    busy_cpu_fraction: float | None = Field(
        0.9, gt=0, le=1, description="Not mirrored while the gateway process used more than this fraction of one "
        "core over the last 0.5 s (its CPU clock, read by the same probe; per worker process). None: no such test.")
    drop_when_saturated: bool = Field(
        True, description="Not mirrored while a primary replica reports saturation as last scraped (the "
        "admission filter's test: waiting > max(1, running/4), or KV-cache usage > admission.kv_high).")


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
        self.fleet = services.fleet
        self.kv_high = services.cfg.admission.kv_high
        self.counts = {"mirrored": 0, "ok": 0, "failed": 0, "dropped_primary_busy": 0,
                       "dropped_primary_saturated": 0, "dropped_gateway_busy": 0, "dropped_gateway_cpu": 0,
                       "dropped_busy": 0, "dropped_down": 0}
        self.lag = LoopLag()
        self._counter = None if services.meter is None else services.meter.create_counter(
            "usefulwork.shadow.requests", unit="{request}",
            description="Mirrored requests by result: mirrored, ok, failed, or why one was not mirrored "
                        "(dropped_primary_busy, dropped_primary_saturated, dropped_gateway_busy, dropped_gateway_cpu, "
                        "dropped_busy, dropped_down).")
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

    def _primary_busy(self, call: Call) -> str | None:
        """Why the primary pool is too busy to spare work for the shadow now (None: it is not)."""
        pool = call.pool or self.fleet.pool_for_model(call.ctx.model)
        if pool is None or pool is self.pool:
            return None
        replicas = pool.healthy_replicas()
        limit = self.cfg.busy_inflight_per_replica
        if limit is not None and sum(r.inflight for r in replicas) >= limit * max(1, len(replicas)):
            return "dropped_primary_busy"
        if self.cfg.drop_when_saturated and any(
                r.waiting > max(1.0, 0.25 * r.running) or r.kv_usage > self.kv_high for r in replicas):
            return "dropped_primary_saturated"
        return None

    def _gateway_busy(self) -> str | None:
        """Why the gateway process's own core is too busy for a second forward now (None: it is not)."""
        if self.cfg.busy_loop_lag_ms is not None and self.lag.busy(self.cfg.busy_loop_lag_ms):
            return "dropped_gateway_busy"
        if self.cfg.busy_cpu_fraction is not None and self.lag.cpu_busy(self.cfg.busy_cpu_fraction):
            return "dropped_gateway_cpu"
        return None

    def _mirror(self, call: Call) -> None:
        busy = self._primary_busy(call) or self._gateway_busy()
        if busy is not None:
            self._count(busy)
            return
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
                    async for out in reply.chunks:
                        if ctx.t_first_token is None and first_token_in(call.op, out):
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
        if self.cfg.busy_loop_lag_ms is not None or self.cfg.busy_cpu_fraction is not None:
            self.lag.start()

    async def stop(self) -> None:
        self.lag.stop()
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=5.0)
        await asyncio.to_thread(self.log.close)

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "inflight": len(self.tasks), "loop_lag_ms": round(self.lag.lag_ms, 3),
                "loop_lag_max_ms": round(self.lag.max_lag_ms, 3), "cpu_fraction": round(self.lag.cpu_fraction, 3),
                "pool": self.cfg.pool, "sample": self.cfg.sample,
                "written": self.log.written, "dropped_write": self.log.dropped_write + self.log.dropped_queue}
