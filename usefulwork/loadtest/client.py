"""The streaming client: one request, timed chunk by chunk.

Per request it records TTFT (send -> first chunk carrying generated text), every inter-chunk gap
(ITL), E2EL, prompt and output tokens (from the server's usage, asked for with
``stream_options.include_usage``), and the outcome:

- ``ok``: a complete stream (``[DONE]`` or a final usage chunk) with status 200;
- ``shed``: HTTP 429 (the gateway's admission control said no);
- ``error``: any other non-200 status, an error event inside the stream, or a broken stream;
- ``timeout``: the per-request timeout passed first;
- ``client_cancelled``: the runner gave up on it (the drain deadline of a run passed).

Times are ``time.perf_counter`` seconds; the runner turns them into offsets from the run start.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import orjson

from usefulwork.loadtest.workloads import RequestSpec

ClientOutcome = Literal["ok", "shed", "error", "timeout", "client_cancelled"]
OUTCOMES: tuple[ClientOutcome, ...] = ("ok", "shed", "error", "timeout", "client_cancelled")


@dataclass(slots=True)
class RequestResult:
    index: int
    kind: str
    planned: float  # planned send offset (s from run start)
    sent: float = 0.0  # actual send offset
    end: float = 0.0  # offset when the request finished (any outcome)
    outcome: ClientOutcome = "ok"
    status: int = 0
    ttft: float = 0.0  # s; 0 when no token arrived
    itl: list[float] = field(default_factory=list)  # s, gaps between content chunks
    prompt_tokens: int = 0
    output_tokens: int = 0
    planned_input_tokens: int = 0
    chunks: int = 0
    usage_seen: bool = False
    error: str = ""
    request_id: str = ""  # sent as x-request-id: joins this result with the gateway's ledger record
    group: str = ""  # the client mix entry that sent it (tenant / priority), "" for a single client
    retries: int = 0  # 429s it waited out (honouring Retry-After) before its last attempt
    first_retry: str = ""  # outcome of the first retry: "admitted" or "shed" ("" when none)
    first_retry_reason: str = ""  # x-usefulwork-shed-reason of the first retry, where it was shed
    retry_after_s: float = 0.0  # Retry-After of the first 429
    shed_s: float = 0.0  # send -> the first 429's answer (how early admission said no)
    shed_reason: str = ""  # x-usefulwork-shed-reason of the first 429
    wait_s: float = 0.0  # Retry-After of the latest 429
    final: bool = False  # the latest 429 said x-should-retry: false (a spent budget): not retried, as the SDKs do
    text: list[str] | None = None  # the generated text, kept only when asked (paired replay compares outputs)

    @property
    def schedule_lag(self) -> float:
        """How late the request went out versus its plan (the load generator's own queueing)."""
        return max(0.0, self.sent - self.planned)

    @property
    def e2el(self) -> float:
        return self.end - self.sent

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (n - 1), the `vllm bench` definition; None below 2 output tokens."""
        if self.outcome != "ok" or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def make_client(max_connections: int = 4096, connect_timeout_s: float = 10.0) -> httpx.AsyncClient:
    # No overall httpx timeout: the per-request deadline is enforced by the caller as a whole.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=connect_timeout_s),
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=256),
        http1=True,
    )


def _has_text(choice: dict[str, Any]) -> bool:
    text = choice.get("text")
    if text:
        return True
    delta = choice.get("delta")
    return bool(delta and (delta.get("content") or delta.get("reasoning_content")))


class _StreamError(Exception):
    pass


StreamError = _StreamError  # a malformed or failed stream (the replay's sender raises it too)


async def _stream(client: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str],
                  res: RequestResult, t_send: float, clock0: float) -> None:
    async with client.stream("POST", url, content=body, headers=headers) as resp:
        res.status = resp.status_code
        if res.retries == 1 and not res.first_retry:
            # Decided when the gateway answers: a retry admitted here whose answer then runs past the
            # client's timeout (counted from the first send) was still admitted on its first retry.
            res.first_retry = "shed" if resp.status_code == 429 else "admitted"
            if resp.status_code == 429:
                res.first_retry_reason = resp.headers.get("x-usefulwork-shed-reason", "")
        if resp.status_code != 200:
            detail = (await resp.aread())[:300].decode(errors="replace")
            res.outcome = "shed" if resp.status_code == 429 else "error"
            res.error = f"HTTP {resp.status_code}: {detail}"
            if resp.status_code == 429:
                _note_shed(res, resp.headers, time.perf_counter() - t_send)
            return
        last = t_send
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                # Keep reading to the end of the body: closing early would look like a client
                # disconnect to the server (and to a gateway's ledger).
                done = True
                continue
            last = note_event(res, payload, time.perf_counter(), t_send, last)
        finish_stream(res, done)


def note_event(res: RequestResult, payload: str | bytes, now: float, t_send: float, last: float) -> float:
    """Account one SSE ``data:`` payload (not ``[DONE]``) arrived at ``now``; returns the new last-token time."""
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        raise _StreamError(f"unparseable SSE data: {payload[:120]!r}") from None
    if "error" in obj:
        err = obj["error"]
        raise _StreamError(f"error event: {err.get('message', err) if isinstance(err, dict) else err}")
    choices = obj.get("choices")
    if choices and _has_text(choices[0]):
        if res.text is not None:
            c = choices[0]
            res.text.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
        if res.chunks == 0:
            res.ttft = now - t_send
        else:
            res.itl.append(now - last)
        last = now
        res.chunks += 1
    usage = obj.get("usage")
    if usage:
        res.usage_seen = True
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        res.output_tokens = int(usage.get("completion_tokens") or 0)
    return last


def finish_stream(res: RequestResult, done: bool) -> None:
    if not done and not res.usage_seen:
        raise _StreamError("stream ended before [DONE]")
    if not res.usage_seen:
        res.output_tokens = res.chunks  # best effort: one token per chunk


# The time left for the whole answer, its retries included, in milliseconds, on every attempt (the gateway's
# admission reads it: filter.CLIENT_TIMEOUT_HEADERS; a shed whose retry could not be answered in it is told
# ``x-should-retry: false``, and the client stops there instead of retrying into its own timeout).
DEADLINE_HEADER = "x-usefulwork-deadline-ms"


def retry_after(headers: httpx.Headers) -> float | None:
    """Seconds to wait from ``retry-after-ms`` (what the OpenAI SDKs read first) or ``retry-after``."""
    for name, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        v = headers.get(name)
        if v is not None:
            try:
                return max(0.0, float(v) / scale)
            except ValueError:
                continue
    return None


def _note_shed(res: RequestResult, headers: httpx.Headers, after_s: float) -> None:
    res.wait_s = retry_after(headers) or 0.0
    res.final = headers.get("x-should-retry") == "false"
    if res.retries == 0 and not res.shed_s:
        res.shed_s = after_s
        res.retry_after_s = retry_after(headers) or 0.0
        res.shed_reason = headers.get("x-usefulwork-shed-reason", "")


async def send(client: httpx.AsyncClient, base_url: str, spec: RequestSpec, model: str, *, timeout_s: float,
               clock0: float, planned: float, api_key: str | None = None, headers: dict[str, str] | None = None,
               group: str = "", honor_retry_after: bool = False, max_retries: int = 3,
               keep_text: bool = False) -> RequestResult:
    """Send one streaming request; never raises (every failure becomes an outcome).

    With ``honor_retry_after`` a 429 that carries Retry-After is waited out and retried (up to
    ``max_retries`` times, within the same overall timeout), unless it says ``x-should-retry: false``
    (as the OpenAI SDKs obey it: a spent budget is not waited out until midnight); TTFT and E2EL then
    count from the first send, as the user lives them.

    Every attempt declares the time the client has left for the whole answer, its retries included
    (``DEADLINE_HEADER``: its timeout less the time since its first send): a gateway that reads it sheds an
    attempt that cannot end in time instead of serving an answer nobody waits for, and says when a retry
    could not end in time either (``x-should-retry: false``).
    """
    res = RequestResult(index=spec.index, kind=spec.kind, planned=planned, planned_input_tokens=spec.input_tokens,
                        group=group, text=[] if keep_text else None)
    path = "/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions"
    res.request_id = os.urandom(8).hex()
    hdrs = {"content-type": "application/json", "x-request-id": res.request_id, **(headers or {})}
    if api_key:
        hdrs["authorization"] = f"Bearer {api_key}"
    if honor_retry_after:
        hdrs["x-stainless-retry-count"] = "0"  # as the OpenAI SDKs number their attempts (0: the first)
    body = orjson.dumps(spec.body(model))
    t_send = time.perf_counter()
    res.sent = t_send - clock0

    def time_left() -> None:
        hdrs[DEADLINE_HEADER] = str(max(1, int(1000.0 * (timeout_s - (time.perf_counter() - t_send)))))

    try:
        async with asyncio.timeout(timeout_s):
            time_left()
            await _stream(client, base_url + path, body, hdrs, res, t_send, clock0)
            while (honor_retry_after and res.outcome == "shed" and res.retries < max_retries and res.retry_after_s
                   and not res.final):
                await asyncio.sleep(res.wait_s or 1.0)
                res.retries += 1
                res.outcome, res.error, res.status = "ok", "", 0
                hdrs["x-stainless-retry-count"] = str(res.retries)
                time_left()
                await _stream(client, base_url + path, body, hdrs, res, t_send, clock0)
    except TimeoutError:
        res.outcome, res.error = "timeout", f"no complete answer within {timeout_s:g}s"
    except asyncio.CancelledError:
        # The runner cancels at its drain deadline; the task ends here with the outcome recorded.
        res.outcome, res.error = "client_cancelled", "cancelled by the load generator at the drain deadline"
    except _StreamError as exc:
        res.outcome, res.error = "error", str(exc)
    except httpx.HTTPError as exc:
        res.outcome, res.error = "error", f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a malformed answer must not kill the run: it is an error outcome
        res.outcome, res.error = "error", f"{type(exc).__name__}: {exc}"
    res.end = time.perf_counter() - clock0
    if res.outcome != "ok":
        res.ttft = res.ttft if res.chunks else 0.0
    return res
