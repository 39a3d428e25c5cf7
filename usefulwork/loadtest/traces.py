"""Trace workloads: replay recorded arrival times and token lengths.

Formats (every error names the file and the line):

- ``mooncake``: JSONL, one object per line: ``timestamp`` (ms from the trace start),
  ``input_length``, ``output_length``, ``hash_ids`` (ids of 512-token prompt blocks; equal ids
  mean an equal prefix, so the replayed prompts share text exactly where the trace's did).
- ``burstgpt``: CSV with the header ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``
  (timestamp in seconds). Rows with 0 response tokens (failed in the original trace) are skipped.
- ``azure``: the Azure LLM inference trace CSV, header ``TIMESTAMP,ContextTokens,GeneratedTokens``,
  timestamps as date-times (``2023-11-16 18:15:46.6805900``).

Time scaling: send offsets are ``(t - t_first) / speedup`` (speedup 2 replays twice as fast).
``max_input_tokens`` / ``max_output_tokens`` clip lengths to what the serving model accepts.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from usefulwork.loadtest.workloads import RequestSpec, WorkloadError, json_lines, random_text, words

MOONCAKE_BLOCK_TOKENS = 512


class TraceError(WorkloadError):
    """A malformed trace file; the message is ``file:line: what is wrong``."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    t: float  # seconds, as in the file (not yet shifted or scaled)
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()
    line: int = 0


def _int_field(value: Any, name: str, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool):
        raise TraceError(f"{where}: {name} must be an integer, got {value!r}")
    try:
        n = int(value) if not isinstance(value, str) else int(value.strip())
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {name} must be an integer, got {value!r}") from None
    if isinstance(value, float) and value != n:
        raise TraceError(f"{where}: {name} must be an integer, got {value!r}")
    if n < minimum:
        raise TraceError(f"{where}: {name} must be >= {minimum}, got {n}")
    return n


def _float_field(value: Any, name: str, where: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {name} must be a number, got {value!r}") from None
    if x != x or x < 0:
        raise TraceError(f"{where}: {name} must be a non-negative number, got {value!r}")
    return x


def parse_mooncake(text: str, source: str) -> list[TraceRow]:
    rows: list[TraceRow] = []
    for lineno, where, obj in json_lines(text, source, TraceError):
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object")
        for key in ("timestamp", "input_length", "output_length"):
            if key not in obj:
                raise TraceError(f"{where}: missing field {key!r}")
        hash_ids = obj.get("hash_ids", [])
        if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
            raise TraceError(f"{where}: hash_ids must be a list of integers")
        rows.append(TraceRow(t=_float_field(obj["timestamp"], "timestamp", where) / 1000.0,
                             input_tokens=_int_field(obj["input_length"], "input_length", where, 1),
                             output_tokens=_int_field(obj["output_length"], "output_length", where, 1),
                             hash_ids=tuple(hash_ids), line=lineno))
    return rows


def _csv_rows(text: str, source: str, required: dict[str, str]) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield (line number, {canonical name: value}); header names match case-insensitively."""
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        raise TraceError(f"{source}:1: empty file (expected a CSV header)") from None
    names = {h.strip().lower(): i for i, h in enumerate(header)}
    cols: dict[str, int] = {}
    for canon, wanted in required.items():
        if wanted.lower() not in names:
            raise TraceError(f"{source}:1: CSV header lacks column {wanted!r} (found: {', '.join(header)})")
        cols[canon] = names[wanted.lower()]
    for row in reader:
        lineno = reader.line_num
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) < len(header):
            raise TraceError(f"{source}:{lineno}: expected {len(header)} columns, got {len(row)}")
        yield lineno, {canon: row[i] for canon, i in cols.items()}


def parse_burstgpt(text: str, source: str) -> list[TraceRow]:
    required = {"t": "Timestamp", "in": "Request tokens", "out": "Response tokens"}
    rows = []
    for lineno, r in _csv_rows(text, source, required):
        where = f"{source}:{lineno}"
        out = _int_field(r["out"], "Response tokens", where, 0)
        if out == 0:
            continue  # a failed request in the original trace: nothing to replay
        rows.append(TraceRow(t=_float_field(r["t"], "Timestamp", where),
                             input_tokens=_int_field(r["in"], "Request tokens", where, 1),
                             output_tokens=out, line=lineno))
    return rows


def parse_azure(text: str, source: str) -> list[TraceRow]:
    required = {"t": "TIMESTAMP", "in": "ContextTokens", "out": "GeneratedTokens"}
    rows = []
    for lineno, r in _csv_rows(text, source, required):
        where = f"{source}:{lineno}"
        try:
            t = datetime.fromisoformat(r["t"].strip()).timestamp()
        except ValueError:
            raise TraceError(f"{where}: TIMESTAMP is not a date-time: {r['t']!r}") from None
        rows.append(TraceRow(t=t, input_tokens=_int_field(r["in"], "ContextTokens", where, 1),
                             output_tokens=_int_field(r["out"], "GeneratedTokens", where, 1), line=lineno))
    return rows


PARSERS = {"mooncake": parse_mooncake, "burstgpt": parse_burstgpt, "azure": parse_azure}


def parse(fmt: str, text: str, source: str) -> list[TraceRow]:
    if fmt not in PARSERS:
        raise TraceError(f"unknown trace format {fmt!r} ({', '.join(PARSERS)})")
    rows = PARSERS[fmt](text, source)
    if not rows:
        raise TraceError(f"{source}: the trace has no requests")
    for prev, cur in zip(rows, rows[1:]):
        if cur.t < prev.t:
            raise TraceError(f"{source}:{cur.line}: timestamp goes backwards ({cur.t} after {prev.t})")
    return rows


def _block_text(hash_id: int, n_tokens: int) -> str:
    # The same hash id always gives the same words: shared blocks become shared prompt prefixes.
    return random_text(np.random.default_rng(hash_id + 1_000_003), n_tokens)


@dataclass
class TraceWorkload:
    rows: list[TraceRow]
    fmt: str
    source: str
    speedup: float = 1.0
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    endpoint: str = "completions"
    timed: bool = True

    @property
    def name(self) -> str:
        return self.fmt

    def requests(self, rng: np.random.Generator) -> Iterator[RequestSpec]:
        t0 = self.rows[0].t
        words()  # fail early if the word list is missing
        for i, row in enumerate(self.rows):
            n_in = min(row.input_tokens, self.max_input_tokens or row.input_tokens)
            n_out = min(row.output_tokens, self.max_output_tokens or row.output_tokens)
            if row.hash_ids:
                parts, left = [], n_in
                for h in row.hash_ids:
                    if left <= 0:
                        break
                    take = min(MOONCAKE_BLOCK_TOKENS, left)
                    parts.append(_block_text(h, take))
                    left -= take
                if left > 0:
                    parts.append(random_text(rng, left))
                prompt = "".join(parts)
            else:
                prompt = random_text(rng, n_in)
            yield RequestSpec(index=i, endpoint=self.endpoint, max_tokens=n_out, input_tokens=n_in,  # type: ignore[arg-type]
                              prompt=prompt, ignore_eos=True, at=(row.t - t0) / self.speedup,
                              kind=self.fmt)

    def describe(self) -> dict[str, Any]:
        span = self.rows[-1].t - self.rows[0].t
        return {"type": self.fmt, "source": self.source, "requests": len(self.rows), "speedup": self.speedup,
                "trace_span_s": span, "replay_span_s": span / self.speedup,
                "max_input_tokens": self.max_input_tokens, "max_output_tokens": self.max_output_tokens}


def load(fmt: str, path: str | Path, *, speedup: float = 1.0, max_input_tokens: int | None = None,
         max_output_tokens: int | None = None) -> TraceWorkload:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise TraceError(f"{p}: cannot read trace file: {exc.strerror}") from None
    if speedup <= 0:
        raise TraceError(f"speedup must be > 0, got {speedup}")
    return TraceWorkload(rows=parse(fmt, text, str(p)), fmt=fmt, source=str(p), speedup=speedup,
                         max_input_tokens=max_input_tokens, max_output_tokens=max_output_tokens)


def from_spec(spec: Mapping[str, Any], base_dir: Path | None = None) -> TraceWorkload:
    known = {"type", "path", "speedup", "max_input_tokens", "max_output_tokens"}
    extra = set(spec) - known
    if extra:
        raise WorkloadError(f"workload type {spec['type']!r} does not take {', '.join(sorted(extra))}")
    if "path" not in spec:
        raise WorkloadError(f"workload type {spec['type']!r} needs a path")
    p = Path(spec["path"])
    if not p.is_absolute() and base_dir is not None:
        p = base_dir / p
    return load(spec["type"], p, speedup=float(spec.get("speedup", 1.0)),
                max_input_tokens=spec.get("max_input_tokens"), max_output_tokens=spec.get("max_output_tokens"))
