"""`usefulwork ledger report`: the ledger a real gateway wrote gives the figures its live windows gave, per
tenant; the same from the Redis Stream (real Redis); ranges, duplicates, lines that are not records."""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
import redis
import yaml

from tests.conftest import drop_redis_keys
from tests.gateway.accounting.test_shared import MODEL, chat, gateway_config, sim, start_gateway, stop, wait_ready  # noqa: F401
from usefulwork.gateway.accounting.report import CSV_COLUMNS, Report, parse_time, read_stream, run


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "usefulwork.cli", "ledger", "report", *args],
                          capture_output=True, text=True, timeout=60)


def _by_tenant(out: str) -> dict[str, dict]:
    return {r["group"]["tenant"]: r["figures"] for r in json.loads(out)["rows"]}


SAME = ("requests", "ok", "good", "shed", "error", "rejected", "dropped", "slo_pass_rate", "prompt_tokens",
        "completion_tokens", "generated_tokens_ok")


def test_the_ledger_of_a_real_gateway_gives_its_live_figures_per_tenant(sim, redis_url, tmp_path):  # noqa: F811
    pools = [{"name": "sim", "models": [MODEL], "replicas": [sim.base_url],
              "gpu": {"type": "A100-80G", "count": 1, "usd_per_hour": 3.6},
              "prices": {"input_per_1m": 0.2, "output_per_1m": 0.6}}]
    path = gateway_config(sim.base_url, tmp_path, "r", None, "usefulwork:test-report", {"pools": pools})
    gw = start_gateway(path, tmp_path, "r")
    try:
        wait_ready(gw)
        with ThreadPoolExecutor(6) as ex:
            list(ex.map(lambda i: chat(gw, ("alice-key", "bob-key")[i % 3 == 0], i), range(30)))
        bad = httpx.post(f"{gw.url}/v1/chat/completions", headers={"authorization": "Bearer alice-key"},
                         json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
        assert bad.status_code == 404
        deadline = time.monotonic() + 15
        while (s := gw.stats())["fleet"]["all"]["requests"] < 31:
            assert time.monotonic() < deadline, s["fleet"]["all"]
            time.sleep(0.2)
        live = {t: v["windows"]["all"] for t, v in s["tenants"].items()}
    finally:
        assert stop(gw) == 0  # the ledger is flushed
    r = _report(str(gw.jsonl), "--json")
    assert r.returncode == 0, r.stderr
    got = _by_tenant(r.stdout)
    assert set(got) == {"alice", "bob", "TOTAL"} and got["TOTAL"]["requests"] == 31
    for tenant in ("alice", "bob"):
        for k in SAME:
            assert got[tenant][k] == live[tenant][k], (tenant, k)
        assert got[tenant]["price_sheet"]["cost_usd"] == pytest.approx(live[tenant]["price_sheet"]["cost_usd"], rel=1e-9)
        assert got[tenant]["price_sheet"]["usd_per_1m_generated"] == pytest.approx(
            live[tenant]["price_sheet"]["usd_per_1m_generated"], rel=1e-9)
    assert got["alice"]["rejected"] == 1 and got["bob"]["requests"] == 10
    paid = sum(rec["gpu_cost_usd"] or 0.0 for rec in gw.ledger())
    assert paid > 0 and got["TOTAL"]["gpu"]["cost_usd"] == pytest.approx(paid, rel=1e-12)
    assert got["TOTAL"]["gpu"]["usd_per_1k_ok"] == pytest.approx(paid * 1e3 / got["TOTAL"]["ok"], rel=1e-12)
    # the table a person reads, and --config finds the same file
    text = _report("--config", str(path))
    assert text.returncode == 0 and text.stdout.splitlines()[0].startswith("| tenant | requests | ok |")
    assert any(line.startswith("| alice | 21 |") for line in text.stdout.splitlines()), text.stdout
    assert "31 records read" in text.stderr
    # the same records from the Redis Stream (as ledger.redis_url writes them), read in small pages
    key = f"usefulwork:test-report:{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    try:
        for line in gw.jsonl.read_bytes().splitlines():
            client.xadd(key, {"record": line})
        assert len(list(read_stream(redis_url, key, None, chunk=4))) == 31
        r2 = _report("--redis", redis_url, "--stream", key, "--json")
        assert r2.returncode == 0 and json.loads(r2.stdout)["rows"] == json.loads(r.stdout)["rows"]
    finally:
        drop_redis_keys(redis_url, key)


def _rec(i: int, ts: float, tenant: str = "a", outcome: str = "ok", **kw) -> dict:
    return {"id": f"r{i}", "ts": ts, "tenant": tenant, "model": "m", "pool": "p", "outcome": outcome,
            "slo_met": outcome == "ok", "cache": "miss", "prompt_tokens": 10, "completion_tokens": 5,
            "cached_tokens": 0, "usage_source": "backend", "cost_usd": 0.001, "gpu_cost_usd": 0.002, **kw}


def test_ranges_groups_duplicates_and_lines_that_are_not_records(tmp_path):
    day = parse_time("2026-11-28", 0)
    recs = [_rec(0, day - 10), _rec(1, day + 10), _rec(2, day + 3600 * 30, tenant="b"),
            _rec(3, day + 20, outcome="shed", completion_tokens=0, gpu_cost_usd=0.0),
            _rec(4, day + 30, gpu_cost_usd=None, recovered=True)]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in recs[:3]) + b"not json\n" + b'{"id": "x"}\n')
    b.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in recs[1:]))  # overlaps a.jsonl by two records
    r = _report(str(a), str(b), "--by", "tenant,day", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["read"], out["skipped"], out["duplicates"]) == (9, 2, 2)
    rows = {(x["group"]["tenant"], x["group"]["day"]): x["figures"] for x in out["rows"]}
    assert set(rows) == {("a", "2026-11-27"), ("a", "2026-11-28"), ("b", "2026-11-29"), ("TOTAL", "TOTAL")}
    mine = rows[("a", "2026-11-28")]
    assert (mine["requests"], mine["ok"], mine["shed"], mine["dropped"], mine["gpu_unpriced"]) == (3, 2, 1, 1, 1)
    assert mine["slo_pass_rate"] == pytest.approx(2 / 3) and mine["gpu"]["cost_usd"] == pytest.approx(0.002)
    assert mine["price_sheet"]["usd_per_1k_ok"] == pytest.approx(0.003 * 1e3 / 2)
    # --csv: the same figures at full precision, one row per group and the total last (a billing import)
    r = _report(str(a), str(b), "--by", "tenant,day", "--csv")
    assert r.returncode == 0 and "9 records read" in r.stderr, r.stderr
    table = list(csv.DictReader(io.StringIO(r.stdout)))
    assert [(x["tenant"], x["day"]) for x in table] == [("a", "2026-11-27"), ("a", "2026-11-28"),
                                                        ("b", "2026-11-29"), ("TOTAL", "TOTAL")]
    row = table[1]
    assert (row["requests"], row["ok"], row["dropped"], row["gpu_unpriced"]) == ("3", "2", "1", "1")
    assert float(row["slo_pass_rate"]) == mine["slo_pass_rate"] and float(row["gpu_usd"]) == mine["gpu"]["cost_usd"]
    assert float(row["price_usd_per_1k_ok"]) == mine["price_sheet"]["usd_per_1k_ok"]
    assert _report(str(a), "--csv", "--json").returncode == 2  # one format at a time
    r = _report(str(a), "--since", "2030-01-01", "--csv")
    assert r.returncode == 0 and r.stdout.splitlines() == ["tenant," + ",".join(CSV_COLUMNS)]  # (nothing in range)
    # --since / --until are [since, until); --tenant keeps one tenant's records
    r = _report(str(a), str(b), "--since", "2026-11-28", "--until", "2026-11-29T00:00", "--json")
    assert [x["figures"]["requests"] for x in json.loads(r.stdout)["rows"]] == [3, 3]
    r = _report(str(a), str(b), "--tenant", "b", "--json")
    assert [x["group"]["tenant"] for x in json.loads(r.stdout)["rows"]] == ["b", "TOTAL"]
    args = argparse.Namespace(files=[a], config=None, redis=None, stream=None, by="tenant", since="1h", until=None,
                              tenant=None, json=True)
    assert run(args, now=day + 3600 * 30 + 60) == 0  # relative: the last hour holds tenant b's record only
    # bad input: said on stderr, exit 2, never a traceback
    for bad in (["--since", "yesterday"], ["--by", "colour"], []):
        r = _report(*([str(a)] if bad else []), *bad)
        assert r.returncode == 2 and r.stderr.startswith("usefulwork ledger: ") and "Traceback" not in r.stderr
    r = _report(str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "cannot read" in r.stderr and "Traceback" not in r.stderr
    r = _report("--redis", "redis://127.0.0.1:1/0")
    assert r.returncode == 2 and "cannot read the Redis Stream" in r.stderr and "Traceback" not in r.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"pools": [{"name": "p", "models": ["m"], "replicas": ["http://127.0.0.1:9"]}]}))
    r = _report("--config", str(cfg))
    assert r.returncode == 2 and "no ledger to read" in r.stderr
    assert Report(["tenant"]).rows() == []
