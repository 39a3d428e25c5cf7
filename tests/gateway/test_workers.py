"""`usefulwork serve --workers N`: real worker processes on one port, real signals, real Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml

from tests.conftest import child_pids, drop_redis_keys, free_port
from tests.gateway.accounting.test_shared import MODEL, chat, gateway_config, sim, start_gateway, stop, wait_ready  # noqa: F401

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _serve_error(tmp_path, cfg: dict, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "usefulwork.cli", "serve", "-c", str(path), "--port", "0", *args],
                          capture_output=True, text=True, timeout=60)


POOLS = [{"name": "p", "models": ["m"], "replicas": ["http://127.0.0.1:9"]}]


def test_conflicting_worker_settings_name_the_field(tmp_path):
    r = _serve_error(tmp_path, {"pools": POOLS}, "--workers", "0")
    assert r.returncode == 2 and "listen.workers" in r.stderr
    limited = {"pools": POOLS, "filters": ["admission"],
               "tenants": {"t": {"key_hashes": ["sha256:" + "0" * 64], "rpm": 10}}}
    r = _serve_error(tmp_path, limited, "--workers", "2")
    assert r.returncode == 2 and "admission.redis_url" in r.stderr
    r = _serve_error(tmp_path, {"pools": POOLS, "scale_out": {"redis_url": f"redis://127.0.0.1:{free_port()}/0"}})
    assert r.returncode == 2 and "scale_out.redis_url" in r.stderr and "cannot be reached" in r.stderr


def test_workers_share_the_port_restart_and_drain_on_sigterm(sim, redis_url, tmp_path):
    prefix = f"usefulwork:test14w:{os.getpid()}:{time.time_ns()}"
    gw = start_gateway(gateway_config(sim.base_url, tmp_path, "w", redis_url, prefix, {"tenants": {}, "access": {}}), tmp_path, "w",
                       "--workers", "2")
    try:
        wait_ready(gw)
        workers = child_pids(gw.proc.pid)
        assert len(workers) == 2
        with httpx.Client(timeout=30) as c:  # one connection per request: the kernel spreads them
            codes = [c.post(f"{gw.url}/v1/chat/completions", json=BODY, headers={"connection": "close"}).status_code
                     for _ in range(40)]
        assert codes == [200] * 40
        deadline = time.monotonic() + 10
        while (s := gw.stats(headers={}))["fleet"]["all"]["requests"] < 40 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert s["gateways"] == 2 and s["fleet"]["all"]["requests"] == 40  # both workers served, one view
        while len(gw.ledger()) < 40:  # written (a SIGKILL loses what is still held: docs/reliability.md)
            assert time.monotonic() < deadline + 10
            time.sleep(0.2)
        # a worker that dies is restarted on its socket; the port keeps answering meanwhile
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (now := child_pids(gw.proc.pid)) == workers or len(now) < 2:
            assert time.monotonic() < deadline, now
            time.sleep(0.2)
        assert workers[1] in now
        wait_ready(gw)
        with httpx.Client(timeout=30) as c:
            assert all(c.post(f"{gw.url}/v1/chat/completions", json=BODY, headers={"connection": "close"}).status_code
                       == 200 for _ in range(10))
        # SIGTERM to the parent: a running stream finishes, every worker drains and exits, the parent exits 0
        with ThreadPoolExecutor(2) as ex:
            long = ex.submit(lambda: httpx.post(f"{gw.url}/v1/chat/completions", timeout=60,
                                                json={**BODY, "max_tokens": 600, "ignore_eos": True}))
            time.sleep(0.3)
            assert stop(gw) == 0
            assert long.result().status_code == 200 and long.result().json()["usage"]["completion_tokens"] == 600
        assert all(subprocess.run(["kill", "-0", str(p)], capture_output=True).returncode != 0 for p in now)
        records = gw.ledger()
        # delivery is at least once (accounting/journal.py): a kill between a sink's write and the journal's
        # note of it writes those records again, marked recovered; none is lost, no other is doubled
        once = {r["id"] for r in records if not r["recovered"]}
        assert len(once) == len([r for r in records if not r["recovered"]]) == 40 + 10 + 1
        assert {r["id"] for r in records} == once and {r["outcome"] for r in records} == {"ok"}
    finally:
        stop(gw)
        drop_redis_keys(redis_url, f"{prefix}:")


def test_sigterm_sheds_queued_requests_with_retry_after(sim, tmp_path):
    """Queued (not started) requests are answered 429 + Retry-After at SIGTERM, not held until the cut."""
    extra = {"filters": ["admission"], "tenants": {}, "access": {},
             "admission": {"max_concurrency": 1, "initial_concurrency": 1, "deadline_ms": {"interactive": 120000}},
             "slo": {"ttft_ms": 120000, "e2e_ms": 600000, "tpot_ms": 10000}}
    cfg = gateway_config(sim.base_url, tmp_path, "q", None, "unused", extra)
    gw = start_gateway(cfg, tmp_path, "q")
    try:
        wait_ready(gw)
        with ThreadPoolExecutor(5) as ex:
            def send(max_tokens):
                t0 = time.monotonic()
                r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=120, json={**BODY, "max_tokens": max_tokens, "ignore_eos": True})
                return r.status_code, r.headers.get("retry-after"), time.monotonic() - t0
            for _ in range(3):  # a measured service time: the queue then predicts short waits and queues
                assert send(4)[0] == 200
            running = ex.submit(send, 12000)  # about 6 s on the 20x simulator
            time.sleep(0.3)
            queued = [ex.submit(send, 4) for _ in range(4)]
            deadline = time.monotonic() + 5
            while gw.stats(headers={})["filters"]["admission"]["pools"]["sim"]["queued"]["interactive"] < 4:
                assert time.monotonic() < deadline and not running.done()
                time.sleep(0.05)
            t_sig = time.monotonic()
            gw.proc.send_signal(signal.SIGTERM)
            answers = [f.result() for f in queued]
            shed_after = time.monotonic() - t_sig
            assert running.result()[0] == 200
        assert [a[0] for a in answers] == [429] * 4 and all(a[1] and float(a[1]) > 0 for a in answers), answers
        assert shed_after < 2.0  # answered at the signal, not after the running request
        assert gw.proc.wait(timeout=60) == 0
        records = gw.ledger()
        assert sorted(r["outcome"] for r in records) == ["ok"] * 4 + ["shed"] * 4
        assert all(r["shed_reason"] == "shutdown" for r in records if r["outcome"] == "shed")
    finally:
        stop(gw)
