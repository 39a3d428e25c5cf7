"""The replay's sender: recorded requests fired at their scheduled times, with as little CPU as possible.

Why not the loadtest runner and client (httpx): profiled under ``benchmarks/replay_drift.py`` at
100 req/s, an httpx streaming request costs ~2-3 ms of CPU in httpcore/h11/anyio (connection-pool
scans, per-line decoding), so on a loaded 2-core machine the one asyncio loop fell behind its
schedule by seconds. Here:

- every request is encoded before the clock starts (``Prepared``: the request line, headers with its
  own ``x-request-id`` and the JSON body as one ``bytes``): the send path only writes it;
- one timer loop walks the pre-computed schedule, sleeping to the next due time measured from the
  run's start (no drift accumulates), and launches every request already due in the same tick;
- requests go through the gateway's own lean HTTP/1.1 client (``usefulwork.upstream.http1``: keep-alive
  pool, httptools/llhttp parsing in C); a response stream is split into SSE lines with bytes
  operations and only ``data:`` payloads are JSON-decoded (orjson);
- ``RequestResult.sent`` is stamped immediately before the request bytes are written, so the schedule
  lag is actual send time minus scheduled time, and TTFT/E2E count from that instant.

Outcomes and fields are the loadtest client's (``usefulwork.loadtest.client``): ``ok``, ``shed`` (429),
``error``, ``timeout``, ``client_cancelled``.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import orjson

from usefulwork.loadtest.client import RequestResult, StreamError, finish_stream, note_event
from usefulwork.loadtest.runner import Target
from usefulwork.upstream.http1 import UpstreamError, UpstreamPool

EARLY_S = 0.0003  # launch this close to the due time: the task's first step takes about as long
PATHS = {"chat": b"/v1/chat/completions", "completions": b"/v1/completions"}


@dataclass(slots=True)
class Prepared:
    """One request to one target, encoded ahead of time."""

    spec: Any  # ReplaySpec (index, kind, at, input_tokens)
    path: bytes
    headers: bytes  # raw header lines, each ending in CRLF
    body: bytes
    request_id: str


class Sender:
    """Sends prepared requests to one target over a lean keep-alive pool."""

    def __init__(self, target: Target, *, timeout_s: float, connect_timeout_s: float = 10.0,
                 keep_text: bool = False):
        self.target = target
        self.timeout_s = timeout_s
        self.keep_text = keep_text
        self.pool = UpstreamPool(target.base_url, connect_timeout=connect_timeout_s, read_timeout=timeout_s + 1.0,
                                 header_timeout=timeout_s + 1.0, max_idle=4096, max_body_bytes=1 << 20)
        auth = f"authorization: Bearer {target.api_key}\r\n".encode() if target.api_key else b""
        self._fixed = b"content-type: application/json\r\naccept: text/event-stream\r\n" + auth

    def prepare(self, spec: Any) -> Prepared:
        rid = os.urandom(8).hex()
        return Prepared(spec=spec, path=PATHS[spec.endpoint], headers=self._fixed + b"x-request-id: "
                        + rid.encode() + b"\r\n", body=orjson.dumps(spec.body(self.target.model)), request_id=rid)

    async def send(self, p: Prepared, clock0: float) -> RequestResult:
        """One streaming request; never raises (every failure becomes an outcome)."""
        spec = p.spec
        res = RequestResult(index=spec.index, kind=spec.kind, planned=spec.at, planned_input_tokens=spec.input_tokens,
                            request_id=p.request_id, text=[] if self.keep_text else None)
        resp = None
        t_send = time.perf_counter()
        res.sent = t_send - clock0
        try:
            async with asyncio.timeout(self.timeout_s):
                resp = await self.pool.request(b"POST", p.path, p.body, p.headers)
                res.status = resp.status
                if resp.status != 200:
                    _http_error(res, resp, (await resp.read())[:300], time.perf_counter() - t_send)
                else:
                    await _read_sse(resp, res, t_send)
        except TimeoutError:
            res.outcome, res.error = "timeout", f"no complete answer within {self.timeout_s:g}s"
        except asyncio.CancelledError:  # the drain deadline passed, or Ctrl-C
            res.outcome, res.error = "client_cancelled", "cancelled by the replay (drain deadline or interrupt)"
        except StreamError as exc:
            res.outcome, res.error = "error", str(exc)
        except UpstreamError as exc:
            res.outcome, res.error = "error", f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - a malformed answer must not kill the replay: it is an error outcome
            res.outcome, res.error = "error", f"{type(exc).__name__}: {exc}"
        finally:
            if resp is not None:
                resp.close()  # back to the pool when complete, else aborted (the server sees the disconnect)
        res.end = time.perf_counter() - clock0
        if res.outcome != "ok" and not res.chunks:
            res.ttft = 0.0
        return res

    def close(self) -> None:
        self.pool.close()


def _http_error(res: RequestResult, resp, detail: bytes, after_s: float) -> None:
    res.outcome = "shed" if resp.status == 429 else "error"
    res.error = f"HTTP {resp.status}: {detail.decode(errors='replace')}"
    if resp.status == 429:
        res.shed_s = after_s
        res.shed_reason = (resp.header(b"x-usefulwork-shed-reason") or b"").decode(errors="replace")
        ra = resp.header(b"retry-after")
        try:
            res.retry_after_s = res.wait_s = max(0.0, float(ra)) if ra else 0.0
        except ValueError:
            pass


async def _read_sse(resp, res: RequestResult, t_send: float) -> None:
    buf = b""
    last = t_send
    done = False
    while (chunk := await resp.read_chunk()) is not None:
        now = time.perf_counter()
        buf = buf + chunk if buf else chunk
        if b"\n" not in buf:
            continue
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True  # read on to the end of the body: closing early looks like a disconnect
                continue
            last = note_event(res, payload, now, t_send, last)
    finish_stream(res, done)


async def fire_on_schedule(items: Iterable[Any], due: Callable[[Any], float], launch: Callable[[Any], None],
                           clock0: float) -> None:
    """Call ``launch(item)`` at ``clock0 + due(item)`` for each item (in due order), from one timer loop.

    Each wait is computed from the run's start, so lateness never accumulates; every item already due
    when the loop wakes is launched in the same tick. uvloop's timers have millisecond granularity and
    may fire a few hundred microseconds early: the loop then yields (``sleep(0)``, other work runs) until
    at most ``EARLY_S`` is left, which is about the time a launched task takes to reach its write.
    """
    perf = time.perf_counter
    for item in items:
        at = clock0 + due(item)
        while (delay := at - perf()) > EARLY_S:
            await asyncio.sleep(delay if delay > 0.001 else 0)
        launch(item)
