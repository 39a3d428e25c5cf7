"""The ledger: one record per client request, whatever its outcome, written off the hot path.

``Ledger.finish(ctx)`` only appends the context to a deque (O(1), no I/O, no lock). A background
task wakes every ``ledger.flush_interval_s`` (or as soon as ``batch_size`` requests are waiting)
and, per batch:

1. estimates tokens for requests whose upstream never reported usage (tokenizer, worker thread);
2. judges the SLO, prices the request (price sheet) and books its GPU work (``costing``);
3. updates the live windows (``stats``) and OpenTelemetry (``telemetry``);
4. settles GPU-time intervals no running request can still touch, which completes the records'
   ``gpu_cost_usd``; completed records go to the sinks (JSONL, Redis Stream) in one write each.

A record therefore reaches the sinks once its GPU-time share is final: shortly after the request
ends, and never later than ``ledger.max_hold_s`` (+ one interval + one flush) however long other
requests keep running: past that hold, work a still-running request did before the frontier is
booked after it instead (totals stay conserved). Requests not yet forwarded upstream (a client
still sending its body) hold nothing back. With a sink, ``answered`` (called just before the
response's last bytes are written) and ``finish`` also append the request to the write-ahead journal
(``journal.py``), acknowledged once every sink has its record, so a gateway that dies loses none: a
gateway sharing the journal directory writes them (docs/reliability.md).

``stop()`` lets the pass in progress finish (a slow token estimate included), accounts whatever is
still queued, settles everything up to now and flushes every sink, so a clean stop loses nothing a
sink accepts; a sink that does not answer is given up on after ``ledger.shutdown_timeout_s`` and the
log says how many records it did not confirm.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from typing import Any, Awaitable, Callable

import orjson

from usefulwork.upstream.fleet import Fleet
from usefulwork.config import SLO, Config
from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.accounting import journal as journal_mod
from usefulwork.gateway.accounting.costing import PoolMeter, Settled, Share, price_sheet_cost, request_spans, work_units
from usefulwork.gateway.accounting.shared import SharedBooks, publish_loop
from usefulwork.gateway.accounting.sinks import Sink
from usefulwork.gateway.accounting.stats import FinishedRow, MergedStats, Stats
from usefulwork.gateway.accounting.telemetry import Telemetry
from usefulwork.gateway.accounting.tokens import TokenEstimator

log = logging.getLogger("usefulwork.ledger")

MAX_BACKLOG = 200_000  # records kept per failing sink before the oldest are dropped (and counted)
YIELD_EVERY_S = 0.0005  # longest stretch the background pass holds the event loop


def judge_slo(slo: SLO, ctx: RequestContext) -> bool | None:
    """True when an ok request met every latency objective; None for rejected (bad input) requests."""
    if ctx.outcome == "rejected":
        return None
    if ctx.outcome != "ok":
        return False
    e2e, ttft, tpot = ctx.e2e_ms, ctx.ttft_ms, ctx.tpot_ms
    if e2e is not None and e2e > slo.e2e_ms:
        return False
    if ttft is not None and ttft > slo.ttft_ms:
        return False
    if tpot is not None and tpot > slo.tpot_ms:
        return False
    return True


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def timings(ctx: RequestContext) -> tuple[float | None, float | None, float | None, float | None]:
    """(intake_ms, ttft_ms, tpot_ms, e2e_ms) as the record carries them (rounded to the microsecond)."""
    return _r(ctx.intake_ms), _r(ctx.ttft_ms), _r(ctx.tpot_ms), _r(ctx.e2e_ms)


def to_record(ctx: RequestContext, work: float, times: tuple) -> dict:
    """The ledger record of a finished request (field reference: docs/accounting.md); ``times``: its
    ``timings``."""
    intake_ms, ttft_ms, tpot_ms, e2e_ms = times
    return {
        "id": ctx.id,
        "client_request_id": ctx.client_request_id,
        "ts": round(ctx.wall_start, 6),
        "tenant": ctx.tenant,
        "endpoint": ctx.endpoint,
        "model": ctx.model,
        "stream": ctx.stream,
        "pool": ctx.pool,
        "replica": ctx.replica,
        "route": ctx.route,
        "route_reason": ctx.route_reason,
        "escalated": ctx.escalated,
        "discarded_tokens": ctx.discarded_tokens,
        "discarded_cost_usd": ctx.discarded_cost_usd,
        "attempts": ctx.attempts,
        "cache": ctx.cache,
        "saved_usd": ctx.saved_usd,
        "priority": ctx.priority,
        "admission": ctx.admission,
        "queue_ms": _r(ctx.queue_ms),
        "shed_reason": ctx.shed_reason,
        "prompt_tokens": ctx.prompt_tokens,
        "completion_tokens": ctx.completion_tokens,
        "cached_tokens": ctx.cached_tokens,
        "usage_source": ctx.usage_source,
        "intake_ms": intake_ms,
        "ttft_ms": ttft_ms,
        "tpot_ms": tpot_ms,
        "e2e_ms": e2e_ms,
        "status_code": ctx.status_code,
        "outcome": ctx.outcome,
        "error": ctx.error,
        "slo_met": ctx.slo_met,
        "cost_usd": ctx.cost_usd,
        "gpu_cost_usd": None,
        "work": work,
        "recovered": ctx.recovered,
    }


LEAVE_STEP_S = 3.0  # each step of leaving the fleet at stop (see Ledger._leave_fleet)


async def _bounded(aw: Any, what: str, seconds: float = LEAVE_STEP_S) -> None:
    """Await ``aw`` for at most ``seconds``, then cancel it without waiting for it to unwind (asyncio.wait,
    not wait_for); failures are logged, never raised."""
    task = aw if isinstance(aw, asyncio.Future) else asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        log.warning("ledger stop: %s took over %.0f s; going on without it", what, seconds)
    elif not task.cancelled() and task.exception() is not None:
        log.warning("ledger stop: %s failed: %r", what, task.exception())


class Ledger:
    """Receives every finished request (see the module doc)."""

    def __init__(self, cfg: Config, fleet: Fleet, sinks: list[Sink], *, telemetry: Telemetry | None = None,
                 estimator: TokenEstimator | None = None, meters: dict[str, PoolMeter] | None = None,
                 clock: Callable[[], float] = time.time, settle_hold_s: float | None = None,
                 journal_dir: str | os.PathLike[str] | None = None):
        self.cfg = cfg
        self.fleet = fleet
        self.sinks = sinks
        self.clock = clock
        # how long settlement may wait for running requests (the bound on a record's delay)
        self.settle_hold_s = cfg.ledger.max_hold_s if settle_hold_s is None else settle_hold_s
        self.meters = meters if meters is not None else {
            name: PoolMeter(name, ps.cfg.usd_per_hour_for(len(ps.replicas)), ps.started_at, cfg.cost.interval_s)
            for name, ps in fleet.pools.items()}
        fleet.on_change(self._replicas_changed)
        self.stats = Stats(self.meters)
        self.telemetry = telemetry
        self.estimator = estimator or TokenEstimator()
        self._pools = {p.name: p for p in cfg.pools}
        self._queue: deque[RequestContext] = deque()
        self._inflight: dict[int, RequestContext] = {}  # id(ctx): client-given request ids may repeat
        self._tracks_starts = False
        self._held: dict[int, tuple[Share, dict]] = {}
        self._standing: dict[tuple[str, str], Share] = {}  # (pool, tenant) -> where record-less work is booked
        self._backlog: dict[str, list[bytes]] = {s.name: [] for s in sinks}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopped = False
        self._deadline: float | None = None  # monotonic; set by stop(): sink writes give up by then
        self.written: dict[str, int] = {s.name: 0 for s in sinks}
        self._last_error: dict[str, str] = {}
        self.records_dropped = 0
        self.finished = 0
        self.filter_stats: dict[str, Callable[[], dict]] = {}  # name -> the filter's stats() (set by the app)
        # tenant -> its limits and budget left, added to a tenant's own stats view (the admission filter's;
        # set by the app)
        self.tenant_limits: Callable[[str], Awaitable[dict]] | None = None
        self.shared: SharedBooks | None = None  # several gateways as one (scale_out.redis_url; accounting/shared.py)
        self._publisher: asyncio.Task | None = None
        # the write-ahead journal (accounting/journal.py): opened at start when a sink and a directory are given
        self.journal_dir = journal_dir if sinks else None
        self.journal: journal_mod.Journal | None = None
        self._to_ack: list[str] = []  # ids of records handed to the sinks, acknowledged once every sink has them
        self._next_adopt = 0.0
        self.recovered = 0

    def _replicas_changed(self, pool: Any, added: list, removed: list) -> None:
        """gpu.per_replica: the pool's bill follows its replicas from now on (a replica costs from the moment
        the gateway sees it until discovery drops it, healthy or not: a starting pod is billed too)."""
        meter = self.meters.get(pool.name)
        if meter is not None:
            meter.set_rate(self.clock(), pool.cfg.usd_per_hour_for(len(pool.replicas)))

    # -- the hot path: O(1), never blocks --

    def begin(self, ctx: RequestContext) -> None:
        """Optional: a request started. Lets settlement wait exactly for the oldest running request."""
        self._tracks_starts = True
        self._inflight[id(ctx)] = ctx

    def answered(self, ctx: RequestContext) -> None:
        """The request's last response bytes are about to be written: journal it now, so that a gateway
        killed once the client has its answer still leaves the record (``finish`` follows)."""
        if self.journal is not None:
            self.journal.append(ctx)

    def finish(self, ctx: RequestContext) -> None:
        self._inflight.pop(id(ctx), None)
        if self.journal is not None:
            self.journal.append(ctx)
        self._queue.append(ctx)
        self.finished += 1
        if len(self._queue) >= self.cfg.ledger.batch_size:
            self._wake.set()

    # -- lifecycle --
    async def start(self) -> None:
        if self.journal_dir is not None and self.journal is None:
            try:
                self.journal = journal_mod.Journal(self.journal_dir)
            except OSError as exc:  # a read-only disk must not keep the gateway from serving: said once, loudly
                log.error("ledger journal off: cannot write %s (%s); set ledger.journal_dir to a writable "
                          "directory, or a gateway that dies loses the records it still holds", self.journal_dir, exc)
                self.journal_dir = None
            else:
                self._adopt()  # a restarted gateway writes what it had not confirmed when it died
        if self.shared is not None and self._task is None:
            await self.shared.join(self.meters)  # the fleet's interval alignment, before any booking
            self.stats.started_at = min((m.started_at for m in self.meters.values()), default=self.stats.started_at)
            self._publisher = asyncio.create_task(publish_loop(
                self.shared, self.raw, self.cfg.scale_out.publish_interval_s))
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="usefulwork-ledger")

    async def stop(self) -> None:
        """Account for everything still queued, settle all GPU time up to now, flush every sink.

        The pass in progress is never cancelled (it may hold a batch it took off the queue); it
        finishes, then a final pass runs. Sink writes give up at ``ledger.shutdown_timeout_s``.
        """
        if self._stopped:
            return
        self._stopped = True
        try:
            if self._task is not None:
                self._wake.set()
                await self._task  # ends after its current pass
            await self._process(final=True, write=False)
            if self._held:  # never lose a record at shutdown, even if settlement left a share open
                log.error("ledger: %d records still held after the final settlement; written with the GPU $ "
                          "settled for them so far", len(self._held))
                self._enqueue([{**rec, "gpu_cost_usd": share.usd} for share, rec in self._held.values()])
                self._held.clear()
            self._deadline = time.monotonic() + self.cfg.ledger.shutdown_timeout_s
            await self._write_sinks()
            while any(self._backlog.values()) and time.monotonic() < self._deadline:
                await asyncio.sleep(0.2)  # a sink that hiccups at shutdown gets more chances, within the bound
                await self._write_sinks()
            for name, backlog in self._backlog.items():
                if backlog:
                    log.error("ledger sink %s: %d records not confirmed at shutdown (last error: %s); "
                              "a write that timed out may still have landed (records carry an idempotency key)",
                              name, len(backlog), self._last_error.get(name, "none"))
        finally:
            if self.journal is not None:
                self.journal.close()  # keeps what a sink did not confirm, for the next gateway to write
            if self.shared is not None:
                await self._leave_fleet()
            for sink in self.sinks:
                try:
                    await sink.close()
                except Exception:
                    log.exception("closing ledger sink %s", sink.name)
            if self.telemetry is not None:
                await asyncio.to_thread(self.telemetry.shutdown)

    async def _loop(self) -> None:
        interval = self.cfg.ledger.flush_interval_s
        while not self._stopped:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if self._stopped:
                return  # stop() runs the final pass
            try:
                if self.journal is not None and time.monotonic() >= self._next_adopt:
                    self._adopt()
                await self._process()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the accountant die: the next pass retries
                log.exception("ledger pass failed")

    # -- the background work --
    async def _process(self, final: bool = False, write: bool = True) -> None:
        batch: list[RequestContext] = []
        while self._queue:
            batch.append(self._queue.popleft())
        if batch:
            need = [c for c in batch if c.usage_source == "none" and not c.cache.startswith("hit")
                    and (c.replica is not None or c.streamed_events) and not c.recovered]
            if need:
                try:
                    await asyncio.to_thread(self._estimate, need)
                except BaseException:  # cancelled (loop teardown): the batch goes back, never lost
                    self._queue.extendleft(reversed(batch))
                    raise
            ready: list[dict] = []
            rows: list[FinishedRow] = []  # the live windows take a slice's rows at once (Stats.add_many)
            clock = time.perf_counter
            slice_end = clock() + YIELD_EVERY_S
            done = 0
            try:
                for ctx in batch:
                    self._account(ctx, ready, rows)
                    done += 1
                    if clock() >= slice_end:
                        self.stats.add_many(rows)
                        rows = []
                        # Let requests run: a request waits behind at most one short slice at each of
                        # its await points (a 256-record slice was a 20+ ms p99 spike; benchmarks/overhead.py).
                        await asyncio.sleep(0)
                        slice_end = clock() + YIELD_EVERY_S
            finally:
                self.stats.add_many(rows)
                self._queue.extendleft(reversed(batch[done:]))  # non-empty only when cancelled
                self._enqueue(ready)
        if self.shared is not None:
            await self._settle_shared(final)
        else:
            self._settle(final)
        if write:
            await self._write_sinks()

    def _estimate(self, ctxs: list[RequestContext]) -> None:
        for ctx in ctxs:
            try:
                ctx.prompt_tokens = ctx.prompt_tokens or self.estimator.count_prompt(ctx.prompt_payload)
                ctx.completion_tokens = ctx.completion_tokens or self.estimator.count_completion(ctx.streamed_events)
                ctx.usage_source = "estimate"
            except Exception:
                log.exception("token estimate failed for %s", ctx.id)

    def _account(self, ctx: RequestContext, ready: list[dict], rows: list[FinishedRow]) -> None:
        if ctx.t_end is None:
            ctx.t_end = time.perf_counter()  # the gateway should set it; never leave a record open
        ctx.slo_met = judge_slo(self.cfg.slo, ctx)
        pool = self._pools.get(ctx.pool) if ctx.pool else None
        ctx.cost_usd = price_sheet_cost(pool, ctx)
        prefill, decode = work_units(self.cfg.cost, ctx)
        times = timings(ctx)
        # The record is built for its readers only: the sinks, and a span when spans are exported.
        telemetry = self.telemetry
        rec = to_record(ctx, prefill + decode, times) if self.sinks or (
            telemetry is not None and telemetry.spans) else None
        rows.append(FinishedRow(
            t_end=ctx.wall_start + (ctx.t_end - ctx.t_start), tenant=ctx.tenant, pool=ctx.pool,
            outcome=ctx.outcome, slo_met=ctx.slo_met, cache=ctx.cache, prompt_tokens=ctx.prompt_tokens,
            completion_tokens=ctx.completion_tokens, cached_tokens=ctx.cached_tokens,
            estimated=ctx.usage_source == "estimate", price_usd=ctx.cost_usd))
        if telemetry is not None:
            try:
                telemetry.record(ctx, times, rec)
            except Exception:
                log.exception("telemetry record failed for %s", ctx.id)
        if ctx.recovered:  # its GPU-time books died with its gateway: no share to settle here
            if rec is not None:
                ready.append(rec)
            return
        meter = self.meters.get(ctx.pool) if ctx.pool else None
        if meter is None or prefill + decode <= 0:
            if rec is not None:
                rec["gpu_cost_usd"] = 0.0
                ready.append(rec)
            return
        if rec is None:
            # No record waits for this request's GPU $ (no sink, no exported span): its work is booked on its
            # tenant's standing share in the pool. An interval is split by work, so each tenant gets the same $
            # as from a share per request, but an interval holds one entry per tenant instead of one per
            # request (settling those was ~2.5% of the gateway's CPU at c=16; docs/benchmarks.md section 11).
            key = (ctx.pool, ctx.tenant)
            share = self._standing.get(key)
            if share is None:
                share = self._standing[key] = Share(key=key, tenant=ctx.tenant)
            meter.book(share, request_spans(ctx, prefill, decode))
            return
        share = Share(key=ctx.id, tenant=ctx.tenant)
        meter.book(share, request_spans(ctx, prefill, decode))
        if share.pending == 0:  # meter closed (shutdown): nothing more can be attributed
            rec["gpu_cost_usd"] = share.usd
            ready.append(rec)
        else:
            self._held[id(share)] = (share, rec)

    def frontier(self, now: float) -> float:
        """Settle up to here: no running or not-yet-accounted request can still book work before it."""
        grace = 2 * self.cfg.cost.interval_s  # clock skew between perf_counter and wall clock spans
        hold = max(self.settle_hold_s, grace)  # never hold a record longer than this for a running request
        # finished but still queued (they finished during this pass's awaits): not booked yet
        queued = min((c.wall_start for c in self._queue), default=now)
        if not self._tracks_starts:
            # Without start reports: nothing on any replica means nothing running can still book
            # work (the gateway counts a request on its replica from before it is sent until after
            # its response ended), so settle up to now; otherwise hold back settle_hold_s.
            busy = self.fleet.any_inflight()
            return max(min(now - (hold if busy else grace), queued), now - hold)
        # GPU work starts when a request is forwarded: one still sending its body holds nothing back
        oldest = min((c.wall_start + (c.t_forwarded - c.t_start) for c in self._inflight.values()
                      if c.t_forwarded is not None), default=now)
        return max(min(now - grace, oldest, queued), now - hold)

    def _settle(self, final: bool) -> None:
        now = self.clock()
        settled: list[Settled] = []
        for meter in self.meters.values():
            settled.extend(meter.settle_all(now) if final else meter.settle(self.frontier(now)))
        self._release(settled)

    async def _settle_shared(self, final: bool) -> None:
        """Shared books (several gateways): push work, publish the frontier, settle what the fleet settled."""
        now = self.clock()
        settled: list[Settled] = []
        try:
            if final:
                settled = await self.shared.leave(self.meters, now)
            else:
                frontier = self.frontier(now)
                for meter in self.meters.values():
                    settled += await self.shared.sync(meter, frontier, now=now)
        except Exception as exc:  # noqa: BLE001 - Redis down: records wait (bounded by the sinks' backlog)
            log.warning("shared GPU books: sync failed (%r)%s", exc, "; settling alone" if final else "")
            if final:  # never lose a record at shutdown: this gateway's shares by its own work only
                for meter in self.meters.values():
                    entries, _ = meter.take_pending()
                    meter.pending = None
                    meter.fold(entries, meter.settled_k)
                    settled += meter.settle_all(now)
        self._release(settled)

    async def _leave_fleet(self) -> None:
        """Stop publishing, withdraw the live windows, close the Redis client: each step bounded.

        A worker's stop hung here about once in fifteen runs of test_workers under CPU load (the parent
        killed it after 60 s; CI flake): its log showed the stop entering this method and nothing after,
        i.e. one of these three redis-py awaits never returned (which one, and why inside redis-py, was
        not found). The shares are settled and the records written by now; what is left is courtesy
        (the windows expire after gateway_ttl_s anyway), so each step gets LEAVE_STEP_S and the stop
        goes on.
        """
        if self._publisher is not None:
            self._publisher.cancel()
            await _bounded(self._publisher, "stopping the live-window publisher")
        await _bounded(self.shared.withdraw(), "withdrawing this gateway's live windows (they expire)")
        await _bounded(self.shared.close(), "closing the shared books' Redis client")

    def _release(self, settled: list[Settled]) -> None:
        if settled:
            self.stats.add_settled(settled)
            if self.telemetry is not None:
                self.telemetry.record_settled(settled)
        done = [k for k, (share, _) in self._held.items() if share.pending <= 0]
        ready = []
        for k in done:
            share, rec = self._held.pop(k)
            rec["gpu_cost_usd"] = share.usd
            ready.append(rec)
        self._enqueue(ready)

    def _adopt(self) -> None:
        """Write the records a dead gateway sharing the journal directory had not confirmed."""
        self._next_adopt = time.monotonic() + journal_mod.ADOPT_EVERY_S
        try:
            ctxs = self.journal.adopt_orphans()
        except Exception:  # noqa: BLE001 - never let recovery stop the ledger; the next look retries
            log.exception("ledger journal: recovery failed")
            return
        if ctxs:
            self.recovered += len(ctxs)
            self._queue.extend(ctxs)
            self._wake.set()

    def _enqueue(self, records: list[dict]) -> None:
        if not records or not self.sinks:
            return
        if self.journal is not None:
            self._to_ack.extend(r["id"] for r in records)
        encoded = [orjson.dumps(r) for r in records]
        dropped = 0
        for name, backlog in self._backlog.items():
            backlog.extend(encoded)
            if len(backlog) > MAX_BACKLOG:
                drop = len(backlog) - MAX_BACKLOG
                del backlog[:drop]
                dropped = max(dropped, drop)
                self.records_dropped += drop
                log.error("ledger sink %s is failing: dropped %d oldest records", name, drop)
        if dropped and self.journal is not None:
            # the same oldest ones (_to_ack holds what was enqueued since every backlog was last empty, in
            # order): never acknowledged, so the journal keeps them for the next gateway to write
            del self._to_ack[:dropped]

    async def _write_sinks(self) -> None:
        for sink in self.sinks:
            backlog = self._backlog[sink.name]
            if not backlog:
                continue
            batch = backlog[:]
            timeout = self.cfg.ledger.shutdown_timeout_s
            if self._deadline is not None:
                timeout = max(min(timeout, self._deadline - time.monotonic()), 0.0)
            try:
                await asyncio.wait_for(sink.write(batch), timeout)
            except Exception as exc:
                why = f"no answer within {timeout:.1f}s" if isinstance(exc, asyncio.TimeoutError) else repr(exc)
                self._last_error[sink.name] = why
                log.warning("ledger sink %s: %d records not confirmed (%s); will retry", sink.name, len(batch), why)
                continue
            del backlog[:len(batch)]
            self.written[sink.name] += len(batch)
        if self.journal is not None and not any(self._backlog.values()):
            ids, self._to_ack = self._to_ack, []
            self.journal.ack(ids)  # every sink has every record handed to it so far

    # -- reads (event loop) --
    def _counters(self) -> dict:
        return {
            "finished": self.finished,
            "queued": len(self._queue),
            "held_for_settlement": len(self._held),
            "records_written": dict(self.written),
            "records_dropped": self.records_dropped,
            "journal_pending": 0 if self.journal is None else self.journal.pending,
            "recovered": self.recovered,
        }

    def raw(self) -> dict:
        return {**self.stats.raw(self.clock()), "ledger": self._counters()}

    def snapshot(self, with_series: bool = False, raws: list[dict] | None = None) -> dict:
        """This process's figures, or (``raws``: the gateways' published ones) the fleet's."""
        if raws is None:
            out = self.stats.snapshot(self.clock(), with_series)
            out["ledger"] = self._counters()
            out["scope"] = "replica" if self.shared is not None else "process"
        else:
            out = MergedStats(self.meters, raws).snapshot(self.clock(), with_series)
            led: dict = {"finished": 0, "queued": 0, "held_for_settlement": 0, "records_written": {},
                         "records_dropped": 0}
            for r in raws:
                for k, v in r["ledger"].items():
                    if isinstance(v, dict):
                        for sink, n in v.items():
                            led[k][sink] = led[k].get(sink, 0) + n
                    else:
                        led[k] = led.get(k, 0) + v  # .get: a counter a gateway of another version lacks
            out["ledger"] = led
            out["scope"] = "fleet"
            out["gateways"] = len(raws)
        out["ledger"]["sinks"] = [s.name for s in self.sinks]
        out["ledger"]["token_estimator"] = self.estimator.method
        if self.filter_stats:
            out["filters"] = {name: stats() for name, stats in self.filter_stats.items()}
        out["slo"] = self.cfg.slo.model_dump()
        out["cost_model"] = self.cfg.cost.model_dump()
        return out
