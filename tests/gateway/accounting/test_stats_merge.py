"""The fleet view merged from published windows equals one process that saw every request."""

from __future__ import annotations

import random
import time

import orjson

from usefulwork.gateway.accounting.costing import PoolMeter
from usefulwork.gateway.accounting.stats import FinishedRow, MergedStats, Stats

OUTCOMES = ["ok", "ok", "ok", "shed", "error", "timeout", "client_cancelled", "rejected"]


def _rows(rng: random.Random, now: float, n: int) -> list[FinishedRow]:
    return [FinishedRow(t_end=now - rng.uniform(0, 900), tenant=rng.choice("abc"), pool=rng.choice(["p", "q"]),
                        outcome=(o := rng.choice(OUTCOMES)), slo_met=None if o == "rejected" else rng.random() < 0.7,
                        cache=rng.choice(["miss", "hit-exact", "bypass"]), prompt_tokens=rng.randint(1, 500),
                        completion_tokens=rng.randint(0, 300), cached_tokens=rng.randint(0, 5), estimated=rng.random() < 0.1,
                        price_usd=rng.uniform(0, 0.01)) for _ in range(n)]


def test_merged_windows_equal_a_single_process_view():
    rng = random.Random(3)
    now = time.time()
    meters = {p: PoolMeter(p, 3.6, now - 1000, 1.0) for p in "pq"}
    parts = [Stats(meters) for _ in range(3)]
    whole = Stats(meters)
    for part in parts:
        for row in _rows(rng, now, 400):
            part.add(row)
            whole.add(row)
    raws = [orjson.loads(orjson.dumps(p.raw(now))) for p in parts]  # as they travel through Redis
    merged = MergedStats(meters, raws).snapshot(now, with_series=True)
    alone = whole.snapshot(now, with_series=True)
    for key in ("fleet", "pools", "tenants", "series"):
        assert _close(merged[key], alone[key]), key
    assert merged["fleet"]["all"]["requests"] == 1200


def _close(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))
    return a == b


def test_a_batch_adds_the_same_as_its_rows_one_by_one():
    rng = random.Random(5)
    now = time.time()
    meters = {p: PoolMeter(p, 3.6, now - 1000, 1.0) for p in "pq"}
    rows = _rows(rng, now, 600)
    one_by_one, batched = Stats(meters), Stats(meters)
    for row in rows:
        one_by_one.add(row)
    batched.add_many(rows[:300])  # the ledger's pass: a slice at a time
    batched.add_many(rows[300:])
    assert batched.started_at == one_by_one.started_at
    assert _close(batched.snapshot(now, with_series=True), one_by_one.snapshot(now, with_series=True))
    no_meters = Stats({})
    no_meters.add_many(rows)
    assert no_meters.started_at == rows[0].t_end  # the first request, as add() sets it
