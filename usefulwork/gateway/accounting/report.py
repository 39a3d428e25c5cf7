"""`usefulwork ledger report`: cost per useful work from the ledger, per tenant, model, pool, day, ...

The live windows (`/usefulwork/stats`) reach back an hour; chargeback and capacity reviews need a day,
a week, a month, per tenant. This reads the ledger the gateway wrote (JSONL files, or the Redis
Stream; ``--config`` takes the sinks of a gateway's config) and groups its records. Every figure is
computed as the live windows compute it (``stats.counters`` and ``stats.figures``): ok, good (ok and
the SLO met), SLO pass rate over judged requests (all but rejected), dropped (shed + error + timeout),
$ per 1K ok / good requests and per 1M generated tokens, for the price sheet and for GPU time.

GPU time here is what the ledger attributes to requests (``gpu_cost_usd``). The idle share of the
fleet's bill is not a request's, so it is not in the ledger: it is in `/usefulwork/stats` and the
``usefulwork.gpu.cost`` metric. A record written from a dead gateway's journal (``recovered``) has no
GPU cost; such records are counted (``gpu_unpriced``). A record seen twice (the same ``id``, as when
two JSONL files overlap) is counted once; a line that is not a ledger record is skipped and counted.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from usefulwork.gateway.accounting.stats import COLUMNS, counters, figures

KEYS = {  # --by: a record -> its group label
    "tenant": lambda r: r.get("tenant") or "default",
    "model": lambda r: r.get("model") or "",
    "pool": lambda r: r.get("pool") or "-",
    "route": lambda r: r.get("route") or "-",
    "priority": lambda r: r.get("priority") or "-",
    "endpoint": lambda r: r.get("endpoint") or "",
    "day": lambda r: _utc(r["ts"]).strftime("%Y-%m-%d"),
    "hour": lambda r: _utc(r["ts"]).strftime("%Y-%m-%dT%H:00Z"),
}
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([mhd])$")
_UNIT_S = {"m": 60, "h": 3600, "d": 86400}
REQUIRED = ("id", "ts", "outcome")


def _utc(ts: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(ts, tz=dt.timezone.utc)


def parse_time(text: str, now: float) -> float:
    """``2026-11-28``, ``2026-11-28T12:00`` (UTC unless it says otherwise), or ``30m`` / ``24h`` / ``7d`` ago."""
    m = _RELATIVE.match(text.strip())
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        t = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is not a time: use 2026-11-28, 2026-11-28T12:00 (UTC) or 30m / 24h / 7d") from None
    return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()


class Report:
    """Groups ledger records and sums what the figures need (fed record by record; memory: one entry per
    group and label set, plus the ids seen)."""

    def __init__(self, by: list[str], since: float | None = None, until: float | None = None,
                 tenant: str | None = None):
        unknown = [k for k in by if k not in KEYS]
        if unknown:
            raise ValueError(f"--by {','.join(unknown)}: group by one or more of {', '.join(KEYS)}")
        self.by, self.since, self.until, self.tenant = by, since, until, tenant
        # (group, outcome, slo_met, cache, estimated) -> [n, prompt, completion, cached, price, gpu, saved, unpriced, t0, t1]
        self._sums: dict[tuple, list[float]] = {}
        self._ids: set[str] = set()
        self.read = self.skipped = self.duplicates = self.outside = 0

    def add(self, rec: Any) -> None:
        self.read += 1
        if not isinstance(rec, dict) or any(k not in rec for k in REQUIRED) or not isinstance(rec["ts"], (int, float)):
            self.skipped += 1
            return
        ts = float(rec["ts"])
        if (self.since is not None and ts < self.since) or (self.until is not None and ts >= self.until) or (
                self.tenant is not None and (rec.get("tenant") or "default") != self.tenant):
            self.outside += 1
            return
        rid = str(rec["id"])
        if rid in self._ids:
            self.duplicates += 1
            return
        self._ids.add(rid)
        key = (tuple(KEYS[k](rec) for k in self.by), rec["outcome"], rec.get("slo_met"), rec.get("cache") or "",
               rec.get("usage_source") == "estimate")
        s = self._sums.get(key)
        if s is None:
            s = self._sums[key] = [0, 0, 0, 0, 0.0, 0.0, 0.0, 0, ts, ts]
        gpu = rec.get("gpu_cost_usd")
        s[0] += 1
        s[1] += rec.get("prompt_tokens") or 0
        s[2] += rec.get("completion_tokens") or 0
        s[3] += rec.get("cached_tokens") or 0
        s[4] += rec.get("cost_usd") or 0.0
        s[5] += gpu or 0.0
        s[6] += rec.get("saved_usd") or 0.0
        s[7] += bool(rec.get("recovered")) and gpu is None
        s[8], s[9] = min(s[8], ts), max(s[9], ts)

    def rows(self) -> list[dict[str, Any]]:
        """One entry per group (sorted), then the total: {"group": {key: label}, "figures": ..., extras}."""
        groups: dict[tuple, list] = {}
        for (group, outcome, slo_met, cache, estimated), s in self._sums.items():
            for g in (group, None):
                acc = groups.get(g)
                if acc is None:
                    acc = groups[g] = [np.zeros(len(COLUMNS)), 0.0, 0.0, 0, s[8], s[9]]
                acc[0] += counters(outcome, slo_met, cache, estimated, int(s[0]), s[1], s[2], s[3], s[4])
                acc[1] += s[5]
                acc[2] += s[6]
                acc[3] += int(s[7])
                acc[4], acc[5] = min(acc[4], s[8]), max(acc[5], s[9])
        out = []
        for g in sorted((g for g in groups if g is not None)) + ([None] if groups else []):
            v, gpu, saved, unpriced, t0, t1 = groups[g]
            f = figures(v, gpu, 0.0, t1 - t0)
            f["saved_usd"], f["gpu_unpriced"] = saved, unpriced
            f["first_ts"], f["last_ts"] = t0, t1
            out.append({"group": dict(zip(self.by, g)) if g is not None else {k: "TOTAL" for k in self.by}, "figures": f})
        return out


def read_jsonl(paths: Iterable[Path]) -> Iterator[Any]:
    for path in paths:
        with open(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    yield orjson.loads(line)
                except orjson.JSONDecodeError:
                    yield None  # (counted as skipped)


def read_stream(url: str, stream: str, since: float | None, chunk: int = 5000) -> Iterator[Any]:
    """The Redis Stream's records, oldest first (from an hour before ``since``: an entry is added when its
    request ends, which may be long after it started)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
    start = "-" if since is None else str(max(0, int((since - 3600) * 1000)))
    try:
        while True:
            entries = client.xrange(stream, min=start, max="+", count=chunk)
            for entry_id, fields in entries:
                raw = fields.get(b"record")
                try:
                    yield orjson.loads(raw) if raw is not None else None
                except orjson.JSONDecodeError:
                    yield None
            if len(entries) < chunk:
                return
            last = entries[-1][0].decode()
            ms, _, seq = last.partition("-")
            start = f"{ms}-{int(seq) + 1}"
    finally:
        client.close()


def _usd(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(rows: list[dict[str, Any]], by: list[str]) -> str:
    head = [*by, "requests", "ok", "good", "SLO pass", "dropped", "gen tokens (ok)", "price $", "$/1K ok",
            "$/1M gen", "GPU $", "GPU $/1K ok", "GPU $/1M gen", "cache hits", "saved $"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        f, p, g = r["figures"], r["figures"]["price_sheet"], r["figures"]["gpu"]
        rate = f["slo_pass_rate"]
        hits = f["cache"]["hit_exact"] + f["cache"]["hit_semantic"]
        cells = [*(str(r["group"][k]) for k in by), str(f["requests"]), str(f["ok"]), str(f["good"]),
                 "-" if rate is None else f"{rate:.1%}", str(f["dropped"]), str(f["generated_tokens_ok"]),
                 _usd(p["cost_usd"]), _usd(p["usd_per_1k_ok"]), _usd(p["usd_per_1m_generated"], 2),
                 _usd(g["cost_usd"]), _usd(g["usd_per_1k_ok"]), _usd(g["usd_per_1m_generated"], 2),
                 str(hits), _usd(f["saved_usd"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


CSV_COLUMNS = ("requests", "ok", "good", "slo_pass_rate", "dropped", "generated_tokens_ok", "price_usd",
               "price_usd_per_1k_ok", "price_usd_per_1m_generated", "gpu_usd", "gpu_usd_per_1k_ok",
               "gpu_usd_per_1m_generated", "cache_hits", "saved_usd", "gpu_unpriced", "first_ts", "last_ts")


def csv_text(rows: list[dict[str, Any]], by: list[str]) -> str:
    """The table's figures as CSV for a spreadsheet or a billing import: one row per group (the total
    last), full precision, an empty cell where a figure does not exist (no ok request, nothing judged)."""
    import csv  # noqa: PLC0415
    import io  # noqa: PLC0415

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([*by, *CSV_COLUMNS])
    for r in rows:
        f, p, g = r["figures"], r["figures"]["price_sheet"], r["figures"]["gpu"]
        vals = (f["requests"], f["ok"], f["good"], f["slo_pass_rate"], f["dropped"], f["generated_tokens_ok"],
                p["cost_usd"], p["usd_per_1k_ok"], p["usd_per_1m_generated"], g["cost_usd"], g["usd_per_1k_ok"],
                g["usd_per_1m_generated"], f["cache"]["hit_exact"] + f["cache"]["hit_semantic"], f["saved_usd"],
                f["gpu_unpriced"], f["first_ts"], f["last_ts"])
        w.writerow([*(r["group"][k] for k in by), *("" if v is None else repr(float(v)) if isinstance(v, float)
                                                     else v for v in vals)])
    return buf.getvalue()


# -- `usefulwork ledger` --------------------------------------------------------------------------


def configure_parser(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    r = sub.add_parser("report", help="cost per useful work from the ledger, grouped (default: per tenant)")
    r.add_argument("files", nargs="*", type=Path, help="ledger JSONL files (ledger.jsonl_path)")
    r.add_argument("--config", "-c", type=Path, help="read the ledger this gateway config writes (its JSONL file, "
                   "else its Redis Stream)")
    r.add_argument("--redis", help="read the Redis Stream at this URL (ledger.redis_url)")
    r.add_argument("--stream", default=None, help="the stream's key (default: usefulwork:ledger)")
    r.add_argument("--by", default="tenant", help=f"group by, comma-separated: {', '.join(KEYS)} (default: tenant)")
    r.add_argument("--since", help="records from this time: 2026-11-28, 2026-11-28T12:00 (UTC), or 24h / 7d ago")
    r.add_argument("--until", help="records before this time (same forms)")
    r.add_argument("--tenant", help="this tenant's records only")
    fmt = r.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print JSON (every figure of /usefulwork/stats' windows)")
    fmt.add_argument("--csv", action="store_true", help="print CSV (the table's figures at full precision, for a "
                     "spreadsheet or a billing import)")


def _fail(msg: str) -> int:
    print(f"usefulwork ledger: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace, now: float | None = None) -> int:
    import time

    now = time.time() if now is None else now
    try:
        since = parse_time(args.since, now) if args.since else None
        until = parse_time(args.until, now) if args.until else None
        report = Report([k.strip() for k in args.by.split(",") if k.strip()], since, until, args.tenant)
    except ValueError as exc:
        return _fail(str(exc))
    files, url, stream = list(args.files), args.redis, args.stream
    if args.config is not None:
        from usefulwork.config import ConfigError, load

        try:
            cfg = load(args.config)
        except ConfigError as exc:
            return _fail(str(exc))
        if not files and url is None:
            if cfg.ledger.jsonl_path:
                files = [Path(cfg.ledger.jsonl_path)]
            elif cfg.ledger.redis_url:
                url = cfg.ledger.redis_url
        stream = stream or cfg.ledger.redis_stream
    if not files and url is None:
        return _fail("no ledger to read: name JSONL files, --redis URL, or --config with a ledger sink")
    try:
        for rec in read_jsonl(files) if files else read_stream(url, stream or "usefulwork:ledger", since):
            report.add(rec)
    except OSError as exc:
        return _fail(f"cannot read {exc.filename or 'the ledger'}: {exc.strerror or exc}")
    except Exception as exc:  # Redis unreachable, a key that is not a stream: said, never a traceback
        if not type(exc).__module__.startswith("redis"):
            raise
        return _fail(f"cannot read the Redis Stream {stream or 'usefulwork:ledger'}: {exc}")
    rows = report.rows()
    if args.json:
        print(orjson.dumps({"by": report.by, "since": since, "until": until, "read": report.read,
                            "skipped": report.skipped, "duplicates": report.duplicates, "outside": report.outside,
                            "rows": rows}, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode())
        return 0
    if getattr(args, "csv", False):
        sys.stdout.write(csv_text(rows, report.by))  # (a header alone when no record is in range)
    else:
        print(table(rows, report.by) if rows else "no records in range")
    notes = [f"{report.read} records read"]
    if report.outside:
        notes.append(f"{report.outside} outside the range or tenant")
    if report.duplicates:
        notes.append(f"{report.duplicates} duplicate ids counted once")
    if report.skipped:
        notes.append(f"{report.skipped} lines that are not ledger records skipped")
    unpriced = rows[-1]["figures"]["gpu_unpriced"] if rows else 0
    if unpriced:
        notes.append(f"{unpriced} requests without GPU cost (recovered from a dead gateway's journal)")
    print("; ".join(notes) + ". GPU $ is the time attributed to requests; the fleet's idle time is in "
          "/usefulwork/stats.", file=sys.stderr)
    return 0
