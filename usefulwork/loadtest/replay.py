"""Replaying a recorded traffic log (``usefulwork.gateway.recording``) against a target.

- ``read_log``: the records of a log file, or of every ``*.jsonl`` in a log directory in name order
  (rotation order). A truncated or malformed line is reported as ``file:line: what is wrong`` and skipped.
- ``ReplayWorkload``: a timed workload (the recorded offsets divided by ``speed``). A recorded body is sent as it was (forced to stream, asking for usage,
  model replaced when ``--model`` is given); a redacted record is sent as synthetic text of its recorded
  token length whose blocks follow its prefix-block hashes (``traces.TraceWorkload``: equal hash ids give
  equal text, so shared prefixes stay shared). Only chat and completions are replayed (what the loadtest
  client measures); other operations are counted as skipped.
- ``replay``: one run at the recorded times through the lean sender (``replay_send``: pre-encoded
  requests, one timer loop, the gateway's HTTP/1.1 client); Ctrl-C stops sending and keeps what finished.
- ``to_mooncake``: the log as a Mooncake trace (``timestamp`` ms, ``input_length``, ``output_length``,
  ``hash_ids`` renumbered 0, 1, ... in order of first use), readable by ``traces.parse_mooncake``,
  vllm bench, GuideLLM and AIPerf.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from usefulwork.loadtest.metrics import percentile
from usefulwork.loadtest.client import RequestResult
from usefulwork.loadtest.loopwatch import freeze_heap
from usefulwork.loadtest.runner import Counters, LoadSpec, RunOutput, Target
from usefulwork.loadtest.traces import TraceRow, TraceWorkload
from usefulwork.loadtest.workloads import WorkloadError

REPLAYABLE = {"chat": "chat", "completions": "completions"}


class ReplayError(WorkloadError):
    """A log or target that cannot be replayed (the message says which and why)."""


@dataclass
class Log:
    records: list[dict[str, Any]]
    problems: list[str]  # "file:line: reason" for each skipped line
    sources: list[str]


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise ReplayError(f"{path}: no *.jsonl traffic log files in this directory")
        return files
    if not path.exists():
        raise ReplayError(f"{path}: no such traffic log")
    return [path]


def read_log(path: str | Path) -> Log:
    records: list[dict[str, Any]] = []
    problems: list[str] = []
    files = _files(Path(path))
    for f in files:
        try:
            data = f.read_bytes()
        except OSError as exc:
            raise ReplayError(f"{f}: cannot read: {exc.strerror}") from None
        for lineno, raw in enumerate(data.split(b"\n"), 1):
            if not raw.strip():
                continue
            where = f"{f}:{lineno}"
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                problems.append(f"{where}: not valid JSON (truncated?): {exc}")
                continue
            if not isinstance(rec, dict):
                problems.append(f"{where}: expected a JSON object")
                continue
            bad = _check(rec)
            if bad:
                problems.append(f"{where}: {bad}")
                continue
            rec["_line"] = where
            records.append(rec)
    records.sort(key=lambda r: r["ts"])
    return Log(records=records, problems=problems, sources=[str(f) for f in files])


def _check(rec: dict[str, Any]) -> str | None:
    ts = rec.get("ts")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return "missing or non-numeric 'ts'"
    if not isinstance(rec.get("op"), str):
        return "missing 'op'"
    if rec.get("body") is None:
        if not isinstance(rec.get("hash_ids"), list) or not all(isinstance(h, int) for h in rec["hash_ids"]):
            return "a redacted record needs 'hash_ids' (a list of integers)"
        if not isinstance(rec.get("prompt_tokens"), int) or rec["prompt_tokens"] < 1:
            return "a redacted record needs 'prompt_tokens' >= 1"
    elif not isinstance(rec["body"], dict):
        return "'body' must be a JSON object"
    return None


@dataclass(slots=True)
class ReplaySpec:
    """One recorded request, shaped as the loadtest client's ``RequestSpec`` (duck-typed)."""

    index: int
    endpoint: str
    at: float
    kind: str  # the tenant: breakdowns by tenant
    route: str
    input_tokens: int
    recorded: dict[str, Any]
    payload: dict[str, Any]  # the body to send, before the model and streaming options are applied

    def body(self, model: str) -> dict[str, Any]:
        body = dict(self.payload)
        if model:
            body["model"] = model
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        return body


def replayable(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    keep = [r for r in records if r["op"] in REPLAYABLE]
    return keep, len(records) - len(keep)


def _output_tokens(rec: dict[str, Any]) -> int:
    return max(1, int(rec.get("completion_tokens") or rec.get("max_tokens") or 16))


@dataclass
class ReplayWorkload:
    records: list[dict[str, Any]]  # replayable records, by arrival time
    speed: float = 1.0
    source: str = ""
    skipped: int = 0
    name: str = "replay"
    timed: bool = True
    _specs: list[ReplaySpec] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self.records:
            raise ReplayError(f"{self.source or 'the log'}: no replayable (chat or completions) records")
        if self.speed <= 0:
            raise ReplayError(f"speed must be > 0, got {self.speed}")
        self._specs = list(self._build())  # built before the clock starts: no text work while sending

    def specs(self) -> list[ReplaySpec]:
        return self._specs

    def _build(self) -> Iterator[ReplaySpec]:
        t0 = self.records[0]["ts"]
        redacted = [r for r in self.records if r.get("body") is None]
        synthetic: dict[int, str] = {}
        if redacted:  # synthetic text of the recorded lengths, following the prefix-block hashes
            rows = [TraceRow(t=r["ts"], input_tokens=r["prompt_tokens"], output_tokens=_output_tokens(r),
                             hash_ids=tuple(r["hash_ids"])) for r in redacted]
            tw = TraceWorkload(rows=rows, fmt="replay", source=self.source)
            for r, spec in zip(redacted, tw.requests(np.random.default_rng(0))):
                synthetic[id(r)] = spec.prompt or ""
        for i, r in enumerate(self.records):
            if r.get("body") is not None:
                payload = {k: v for k, v in r["body"].items() if k not in ("stream", "stream_options")}
            else:
                text = synthetic[id(r)]
                payload = {"model": r.get("model") or "", "max_tokens": _output_tokens(r), "ignore_eos": True}
                if r["op"] == "chat":
                    payload["messages"] = [{"role": "user", "content": text}]
                else:
                    payload["prompt"] = text
            yield ReplaySpec(index=i, endpoint=REPLAYABLE[r["op"]], at=(r["ts"] - t0) / self.speed,
                             kind=str(r.get("tenant") or "default"), route=str(r.get("route") or r.get("pool") or "-"),
                             input_tokens=int(r.get("prompt_tokens") or 0), recorded=r, payload=payload)

    def requests(self, rng: np.random.Generator) -> Iterator[ReplaySpec]:
        return iter(self.specs())

    def describe(self) -> dict[str, Any]:
        span = self.records[-1]["ts"] - self.records[0]["ts"]
        return {"type": "replay", "source": self.source, "requests": len(self.records), "skipped": self.skipped,
                "speed": self.speed, "log_span_s": span, "replay_span_s": span / self.speed,
                "redacted": sum(1 for r in self.records if r.get("body") is None)}


def load_workload(path: str | Path, speed: float = 1.0) -> tuple[ReplayWorkload, Log]:
    log = read_log(path)
    keep, skipped = replayable(log.records)
    return ReplayWorkload(records=keep, speed=speed, source=str(path), skipped=skipped), log


def check_target(url: str, timeout_s: float = 5.0) -> None:
    """Fail early and clearly when nothing answers at ``url``."""
    import httpx

    base = url.rstrip("/").removesuffix("/v1")
    try:
        httpx.get(base + "/v1/models", timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ReplayError(f"target {url} is unreachable: {type(exc).__name__}: {exc}") from None


async def run_interruptible(coro) -> tuple[Any, bool]:
    """Run ``coro``; Ctrl-C (SIGINT) cancels it instead of killing the process. (result, interrupted)."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coro)
    interrupted = False

    def on_sigint() -> None:
        nonlocal interrupted
        interrupted = True
        task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError):  # not the main thread: no handler
        pass
    try:
        return await task, False
    except asyncio.CancelledError:
        if not interrupted:
            raise
        return None, True
    finally:
        try:
            loop.remove_signal_handler(signal.SIGINT)
        except (NotImplementedError, RuntimeError):
            pass


async def replay(workload: ReplayWorkload, target: Target, *, timeout_s: float = 120.0,
                 observer=None) -> tuple[RunOutput, bool]:
    """One replay at the recorded (scaled) times; (output, interrupted). Interrupted: what finished is kept.

    Requests in flight after the last send get up to ``timeout_s`` to finish (each has its own
    ``timeout_s`` deadline anyway); ``observer`` (the loadtest's live display) gets the counters at 2 Hz.
    """
    from usefulwork.loadtest import replay_send as rs  # noqa: PLC0415

    sender = rs.Sender(target, timeout_s=timeout_s)
    prepared = [sender.prepare(s) for s in workload.specs()]  # all encoding done before the clock starts
    counters = Counters()
    results: list[RequestResult] = []
    tasks: set[asyncio.Task] = set()
    clock0 = 0.0  # set when the clock starts, below

    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        counters.in_flight -= 1
        if not task.cancelled():
            res = task.result()
            results.append(res)
            if res.outcome == "ok":
                counters.ok += 1
                counters.output_tokens += res.output_tokens
            else:
                counters.dropped += 1

    def launch(p) -> None:
        counters.sent += 1
        counters.in_flight += 1
        task = asyncio.create_task(sender.send(p, clock0))
        tasks.add(task)
        task.add_done_callback(done)

    async def run() -> None:
        await rs.fire_on_schedule(prepared, _due, launch, clock0)
        if tasks:
            await asyncio.wait(set(tasks), timeout=timeout_s + 1.0)

    observe = asyncio.create_task(_observe(observer, counters)) if observer else None
    unfreeze = freeze_heap()  # the prepared requests out of the collector's scans while sending
    wall0 = time.time()
    clock0 = time.perf_counter()
    counters.started = clock0
    try:
        _, interrupted = await run_interruptible(run())
    finally:
        unfreeze()
        for t in list(tasks):
            t.cancel()
        if tasks:
            await asyncio.wait(set(tasks), timeout=5.0)
        sender.close()
        if observe:
            observe.cancel()
            observer(counters)
    results.sort(key=lambda r: (r.planned, r.index))
    load = LoadSpec(timeout_s=timeout_s, drain_s=timeout_s)
    out = RunOutput(results=results, wall_start=wall0, wall_end=wall0 + max((r.end for r in results), default=0.0),
                    load=load.describe(), workload=workload.describe(),
                    target={"base_url": target.base_url, "model": target.model})
    return out, interrupted


def _due(p) -> float:
    return p.spec.at


async def _observe(observer, counters: Counters) -> None:
    while True:
        observer(counters)
        await asyncio.sleep(0.5)


def recorded_figures(records: list[dict[str, Any]]) -> dict[str, float]:
    """TTFT/E2E percentiles (ms) of the recorded successful requests, for comparison with a replay."""
    ok = [r for r in records if r.get("outcome") == "ok"]
    out: dict[str, float] = {}
    for key, name in (("ttft_ms", "ttft"), ("e2e_ms", "e2el")):
        vals = [float(r[key]) for r in ok if isinstance(r.get(key), (int, float))]
        for p in (50, 90, 95, 99):
            out[f"p{p}_{name}_ms"] = percentile(vals, p)
    return out


def compare_to_recorded(result: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    rec = recorded_figures(records)
    out = {}
    for k, v in rec.items():
        got = result.get(k)
        out[k] = {"recorded": v, "replayed": got,
                  "diff_pct": None if not v or got is None else (got - v) / v * 100.0}
    return out


def to_mooncake(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mooncake trace rows: ms from the first record, token lengths, renumbered prefix-block ids."""
    if not records:
        return []
    ids: dict[int, int] = {}
    t0 = records[0]["ts"]
    rows = []
    for r in records:
        if r.get("outcome") not in (None, "ok") and not r.get("completion_tokens"):
            continue  # nothing was generated: no output length to replay
        rows.append({"timestamp": int(round((r["ts"] - t0) * 1000.0)),
                     "input_length": max(1, int(r.get("prompt_tokens") or 1)),
                     "output_length": _output_tokens(r),
                     "hash_ids": [ids.setdefault(h, len(ids)) for h in r.get("hash_ids") or []]})
    return rows


def write_mooncake(records: list[dict[str, Any]], path: str | Path) -> int:
    rows = to_mooncake(records)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)
