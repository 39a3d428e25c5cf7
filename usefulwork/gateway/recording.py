"""Traffic recording: the ``record`` filter writes a replayable log of the requests it sees.

One JSON object per line (``RECORD_VERSION``), in files ``<dir>/traffic-<UTC time>-<n>.jsonl``
rotated by size (``record.rotate_bytes``) and age (``record.rotate_s``). A record holds the arrival
time, tenant, operation, model, pool and route, cache result, outcome and status, tokens
(prompt/completion/cached, as the ledger books them), TTFT and end-to-end latency, the price-sheet
cost, the prompt's length and prefix-block hashes, and the request body (left out with
``record.redact``: then only lengths and hashes identify the prompt).

The request path never waits for the log: the filter only appends the finished call to a bounded
in-memory queue (``record.queue_size``; when it is full the record is dropped and counted). A loop
task turns finished calls into small dicts every ``record.flush_interval_s`` (a call is finished when
the endpoint has set ``t_end``: by then its usage is booked and its outcome classified) and hands them
to one writer thread through a second bounded queue; a slow or full disk drops records there and
counts them, never stalls a request. Counts: ``stats()`` and the OTel counter
``usefulwork.record.records`` (attribute ``result``: written | dropped_queue | dropped_write).

Prefix-block hashes: the prompt text (``embedding.conversation_text``) is cut into blocks of
``BLOCK_CHARS`` characters (about 512 tokens, Mooncake's block size) and each block's hash covers
everything before it, so equal ids mean an equal prefix. ``usefulwork replay --export-mooncake``
turns a log into a Mooncake trace from these.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import queue
import random
import threading
import time
from collections import deque
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from usefulwork.gateway.pipeline import Call, Handler, Reply, Services
from usefulwork.tasks import cancel_and_wait

log = logging.getLogger("usefulwork.record")

RECORD_VERSION = 1
BLOCK_CHARS = 2048  # ~512 tokens at ~4 characters per token (Mooncake's 512-token blocks)


class RecordCfg(BaseModel):
    """Traffic recording (the ``record`` filter): a replayable JSONL log of live requests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: str = Field("traffic", description="Directory of the log files (traffic-<UTC time>-<n>.jsonl).")
    sample: float = Field(1.0, ge=0.0, le=1.0, description="Fraction of requests recorded (drawn at random).")
    redact: bool = Field(False, description="Leave the request body out: keep only lengths and prefix-block hashes.")
    rotate_bytes: int = Field(64 * 1024 * 1024, gt=0, description="Start a new file past this size.")
    rotate_s: float = Field(3600.0, gt=0, description="Start a new file after this many seconds.")
    queue_size: int = Field(10_000, gt=0, description="Records waiting to be written; beyond this they are "
                            "dropped and counted (the request never waits).")
    flush_interval_s: float = Field(0.2, gt=0, description="How often finished requests are handed to the writer.")


def prompt_text(body: dict[str, Any]) -> str:
    from usefulwork.embedding import conversation_text  # noqa: PLC0415 (light: no model is loaded)

    try:
        return conversation_text(body)
    except Exception:  # an odd body shape must not cost the record
        return ""


def block_hashes(text: str, block_chars: int = BLOCK_CHARS) -> list[int]:
    """Chained 56-bit hashes of ``text``'s blocks: id i identifies blocks 0..i (a shared prefix)."""
    out: list[int] = []
    prev = b""
    data = text.encode("utf-8", "surrogatepass")
    for i in range(0, len(data), block_chars):
        prev = hashlib.blake2b(prev + data[i:i + block_chars], digest_size=7).digest()
        out.append(int.from_bytes(prev, "big"))
    return out


def _ms(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((b - a) * 1000.0, 3)


def snapshot(call: Call, pools: dict[str, Any]) -> dict[str, Any]:
    """The record of a finished call (on the loop: reads the context, no I/O, no text work)."""
    from usefulwork.gateway.accounting.costing import price_sheet_cost  # noqa: PLC0415 (config imports this module)

    ctx = call.ctx
    pool = pools.get(ctx.pool) if ctx.pool else None
    return {
        "v": RECORD_VERSION, "id": ctx.id, "ts": ctx.wall_start, "tenant": ctx.tenant, "op": call.op,
        "model": ctx.model, "stream": ctx.stream, "pool": ctx.pool, "route": ctx.route, "cache": ctx.cache,
        "outcome": ctx.outcome, "status": ctx.status_code, "prompt_tokens": ctx.prompt_tokens,
        "completion_tokens": ctx.completion_tokens, "cached_tokens": ctx.cached_tokens,
        "usage_source": ctx.usage_source, "max_tokens": ctx.max_tokens,
        "ttft_ms": _ms(ctx.t_start, ctx.t_first_token), "e2e_ms": _ms(ctx.t_start, ctx.t_end),
        "cost_usd": price_sheet_cost(pool, ctx), "body": call.body,
    }


class TrafficLog:
    """The writer thread and its rotating files; ``offer`` never blocks."""

    def __init__(self, cfg: RecordCfg, on_result=None):
        self.cfg = cfg
        self.dir = Path(cfg.dir)
        self.q: queue.Queue = queue.Queue(maxsize=cfg.queue_size)
        self.written = 0
        self.dropped_write = 0
        self.dropped_queue = 0
        self.files = 0
        self.path: Path | None = None
        self._fh = None
        self._opened = 0.0
        self._size = 0
        self._on_result = on_result or (lambda result, n: None)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="usefulwork-record", daemon=True)
        self._thread.start()

    def offer(self, rec: dict[str, Any]) -> None:
        try:
            self.q.put_nowait(rec)
        except queue.Full:
            self.drop()

    def drop(self) -> None:
        """Count one record that never reached the writer (a queue was full)."""
        self.dropped_queue += 1
        self._on_result("dropped_queue", 1)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._thread is None:
            return
        try:
            self.q.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self._thread = None

    # -- the writer thread --
    def _run(self) -> None:
        try:
            while True:
                rec = self.q.get()
                if rec is None:
                    return
                batch = [rec]
                while len(batch) < 256:  # one write per burst
                    try:
                        nxt = self.q.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        self._write(batch)
                        return
                    batch.append(nxt)
                self._write(batch)
        finally:
            if self._fh is not None:
                try:
                    self._fh.close()
                except OSError:
                    pass

    def _line(self, rec: dict[str, Any]) -> bytes:
        body = rec.get("body")
        text = prompt_text(body) if isinstance(body, dict) else ""
        rec["prompt_chars"] = len(text)
        rec["hash_ids"] = block_hashes(text)
        rec["redacted"] = self.cfg.redact
        if self.cfg.redact:
            rec.pop("body", None)
        return orjson.dumps(rec, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"

    def _write(self, batch: list[dict[str, Any]]) -> None:
        lines = []
        for rec in batch:
            try:
                lines.append(self._line(rec))
            except Exception:  # an unserialisable body: that record is lost, the others are not
                log.exception("record %s could not be serialised", rec.get("id"))
                self.dropped_write += 1
                self._on_result("dropped_write", 1)
        if not lines:
            return
        data = b"".join(lines)
        try:
            fh = self._file(len(data))
            fh.write(data)
            fh.flush()
            self._size += len(data)
            self.written += len(lines)
            self._on_result("written", len(lines))
        except OSError as exc:  # full disk, permissions: drop and count, keep going
            self.dropped_write += len(lines)
            self._on_result("dropped_write", len(lines))
            log.warning("traffic log write failed (%d records dropped): %s", len(lines), exc)
            if self._fh is not None:
                try:
                    self._fh.close()
                except OSError:
                    pass
                self._fh = None  # try a fresh file next time

    def _file(self, incoming: int):
        now = time.monotonic()
        if self._fh is not None and (self._size + incoming > self.cfg.rotate_bytes and self._size > 0
                                     or now - self._opened >= self.cfg.rotate_s):
            self._fh.close()
            self._fh = None
        if self._fh is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.files += 1
            stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
            self.path = self.dir / f"traffic-{stamp}-{self.files:04d}.jsonl"
            self._fh = open(self.path, "ab")
            self._opened = now
            self._size = 0
        return self._fh


class RecordFilter:
    """Samples requests and queues each finished one for the traffic log (O(1) on the request path)."""

    name = "record"

    def __init__(self, services: Services):
        cfg: RecordCfg = services.cfg.record
        self.cfg = cfg
        self.pools = {p.name: p for p in services.cfg.pools}
        self._finished: deque[Call] = deque()
        self.sampled_out = 0
        counter = None
        if services.meter is not None:
            counter = services.meter.create_counter(
                "usefulwork.record.records", unit="{record}",
                description="Traffic-log records by result: written, dropped_queue, dropped_write.")

        def on_result(result: str, n: int) -> None:
            if counter is not None:
                counter.add(n, {"result": result})

        self.log = TrafficLog(cfg, on_result)
        self._task: asyncio.Task | None = None
        self._rand = random.random

    async def __call__(self, call: Call, next: Handler) -> Reply:
        if self.cfg.sample < 1.0 and self._rand() >= self.cfg.sample:
            self.sampled_out += 1
            return await next(call)
        if len(self._finished) >= self.cfg.queue_size:
            self.log.drop()  # the writer is far behind: this request goes unrecorded, counted
            return await next(call)
        try:
            reply = await next(call)
        except BaseException:
            self._finished.append(call)  # the endpoint still classifies it (an error answer)
            raise
        reply.on_close(lambda: self._finished.append(call))
        return reply

    def drain(self, final: bool = False) -> None:
        """Hand finished calls to the writer; a call whose endpoint has not ended it yet waits."""
        waiting = []
        while self._finished:
            call = self._finished.popleft()
            if call.ctx.t_end is None and not final:
                waiting.append(call)
                continue
            self.log.offer(snapshot(call, self.pools))
        self._finished.extend(waiting)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.flush_interval_s)
            try:
                self.drain()
            except Exception:
                log.exception("traffic log drain failed")

    async def start(self) -> None:
        self.log.start()
        self._task = asyncio.create_task(self._loop(), name="usefulwork-record-drain")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        self.drain(final=True)
        await asyncio.to_thread(self.log.close)

    def stats(self) -> dict[str, Any]:
        lg = self.log
        return {"written": lg.written, "dropped_queue": lg.dropped_queue, "dropped_write": lg.dropped_write,
                "sampled_out": self.sampled_out, "waiting": len(self._finished) + lg.q.qsize(),
                "files": lg.files, "file": str(lg.path) if lg.path else None, "sample": self.cfg.sample,
                "redact": self.cfg.redact}
