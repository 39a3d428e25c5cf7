"""The mirror filter end to end: a real gateway in front of the simulator, mirroring every request to a
shadow pool that (a) works, (b) refuses connections, (c) accepts and never answers. Clients only see
the primary, the primary has zero errors, and the shadow's results are counted and logged."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import orjson
import pytest

from tests.conftest import free_port
from tests.e2e.conftest import start_gateway
from usefulwork.backends.sim.process import SimProcess
from usefulwork.cli import main as cli_main

MODEL = "Llama-3.1-8B"
SHADOW_MODEL = "llama-shadow"


@pytest.fixture(scope="module")
def sims(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mirror-sims")
    primary = SimProcess(port=free_port(), gpu="A100-80G", model=MODEL, time_scale=20.0, log_path=tmp / "p.log")
    shadow = SimProcess(port=free_port(), gpu="A100-80G", model=MODEL, served_name=SHADOW_MODEL, time_scale=20.0,
                        log_path=tmp / "s.log")
    for s in (primary, shadow):
        s.start()
    for s in (primary, shadow):
        s.wait_ready(120)
    yield primary, shadow
    primary.stop()
    shadow.stop()


class Staller:
    """An HTTP server that answers health probes (GET) and never answers a request (POST)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.conns: list[socket.socket] = []
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    @staticmethod
    def _serve(c: socket.socket) -> None:
        try:
            while True:
                data = c.recv(65536)
                if not data or data.startswith(b"POST"):
                    return  # hold the connection open, never answer
                c.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        except OSError:
            return

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def gateway(tmp_path, primary_url: str, shadow_url: str, ledger, filters=("mirror",), shadow=None, **over):
    cfg = {"pools": [{"name": "primary", "models": [MODEL], "replicas": [primary_url]},
                     {"name": "candidate", "models": [SHADOW_MODEL], "replicas": [shadow_url]}],
           "timeouts": {"health_interval_s": 0.5, "retry_after_down_s": 1.0},
           "filters": list(filters), "record": {"dir": str(tmp_path / "traffic"), "flush_interval_s": 0.05},
           # The gateway-busy tests (event-loop lag, process CPU) are off here: these tests count the other reasons
           # exactly, and a test machine's own noise (or a burst of requests) would trip them now and then; they
           # are tested in-process below.
           "shadow": {"pool": "candidate", "sample": 1.0, "timeout_s": 2.0, "max_inflight": 4,
                      "dir": str(tmp_path / "shadow"), "busy_loop_lag_ms": None, "busy_cpu_fraction": None,
                      **(shadow or {})},
           "ledger": {"jsonl_path": str(ledger), "flush_interval_s": 0.1}, **over}
    return start_gateway(tmp_path, cfg, wait_ready=False)


async def drive(url: str, n: int) -> list[tuple[int, float]]:
    async with httpx.AsyncClient(timeout=30) as c:
        async def one(i: int) -> tuple[int, float]:
            await asyncio.sleep(i * 0.05)
            t = time.perf_counter()
            r = await c.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": f"q {i}"}], "max_tokens": 8,
                "stream": i % 2 == 0})
            assert MODEL in r.text or r.status_code != 200
            return r.status_code, time.perf_counter() - t
        return await asyncio.gather(*(one(i) for i in range(n)))


def stats(gw, admin_key: str | None = None) -> dict:
    headers = {"authorization": f"Bearer {admin_key}"} if admin_key else None
    return httpx.get(gw.url + "/usefulwork/stats", headers=headers, timeout=5).json()["filters"]["mirror"]


def ledger_records(path) -> list[dict]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines() if x.strip()] if path.exists() else []


def test_a_working_shadow_gets_a_copy_and_is_never_billed(sims, tmp_path):
    primary, shadow = sims
    ledger = tmp_path / "ledger.jsonl"
    gw = gateway(tmp_path, primary.base_url, shadow.base_url, ledger, filters=("record", "mirror"))
    try:
        time.sleep(1.0)  # the prober marks the shadow healthy
        res = asyncio.run(drive(gw.url, 20))
        assert all(s == 200 for s, _ in res)
        time.sleep(1.0)
        st = stats(gw)
        assert st["mirrored"] + st["dropped_busy"] == 20 and st["ok"] == st["mirrored"] > 0 and st["failed"] == 0
    finally:
        gw.stop()
    recs = ledger_records(ledger)
    assert len(recs) == 20 and {r["pool"] for r in recs} == {"primary"}  # shadow work is not in the ledger
    shadow_recs = [json.loads(x) for p in (tmp_path / "shadow").glob("*.jsonl") for x in p.read_text().splitlines()]
    ids = {r["id"] for r in recs}
    assert len(shadow_recs) == st["mirrored"] and all(r["shadow_of"] in ids for r in shadow_recs)
    assert all(r["outcome"] == "ok" and r["model"] == SHADOW_MODEL and r["completion_tokens"] == 8
               for r in shadow_recs)
    # the paired report straight from the two logs
    out = tmp_path / "cmp.json"
    assert cli_main(["replay", str(tmp_path / "traffic"), "--shadow-log", str(tmp_path / "shadow"),
                     "--resamples", "200", "--out", str(out), "--html", str(tmp_path / "cmp.html")]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["pairs"] == len(shadow_recs) and data["comparison"]["total"]["error_rate"]["diff"] == 0
    assert data["comparison"]["verdict"].startswith("verdict:")


@pytest.mark.parametrize("kind", ["refuses", "stalls"])
def test_the_primary_has_zero_errors_when_the_shadow_refuses_or_stalls(sims, tmp_path, kind):
    primary, _ = sims
    staller = Staller() if kind == "stalls" else None
    shadow_url = staller.url if staller else f"http://127.0.0.1:{free_port()}"
    ledger = tmp_path / "ledger.jsonl"
    gw = gateway(tmp_path, primary.base_url, shadow_url, ledger)
    try:
        if staller:
            time.sleep(1.0)  # the prober finds the staller healthy: the shadow requests are really sent
        res = asyncio.run(drive(gw.url, 20))
        assert [s for s, _ in res] == [200] * 20
        assert max(t for _, t in res) < 2.0  # never waited for the shadow (its timeout is 2 s)
        time.sleep(2.5)  # the stalled shadow requests reach their timeout
        st = stats(gw)
        assert st["ok"] == 0 and st["mirrored"] + st["dropped_busy"] + st["dropped_down"] == 20
        assert st["dropped_primary_busy"] == st["dropped_primary_saturated"] == 0
        if staller:  # sent, stalled, cut at the timeout; more than max_inflight at once were not mirrored
            assert st["mirrored"] >= 4 and st["failed"] == st["mirrored"] and st["dropped_busy"] > 0
    finally:
        gw.stop()
        if staller:
            staller.close()
    assert [r["outcome"] for r in ledger_records(ledger)] == ["ok"] * 20


async def post(c: httpx.AsyncClient, url: str, max_tokens: int, key: str | None = None) -> int:
    r = await c.post(url + "/v1/completions", json={"model": MODEL, "prompt": "q", "max_tokens": max_tokens,
                                                     "ignore_eos": True},
                     headers={"authorization": f"Bearer {key}"} if key else None)
    return r.status_code


def test_a_busy_primary_makes_the_mirror_drop_and_a_quiet_one_mirrors(sims, tmp_path):
    """The primary's own load signal (the gateway's leases on it) decides: past two in flight per replica,
    shadow work is dropped first; one request at a time is always mirrored."""
    primary, shadow = sims
    gw = gateway(tmp_path, primary.base_url, shadow.base_url, tmp_path / "ledger.jsonl",
                 shadow={"busy_inflight_per_replica": 2, "max_inflight": 64, "timeout_s": 30.0})

    async def quiet_then_busy():
        async with httpx.AsyncClient(timeout=30) as c:
            quiet = [await post(c, gw.url, 8) for _ in range(6)]
            await asyncio.sleep(1.0)
            st = stats(gw)
            busy = await asyncio.gather(*(post(c, gw.url, 256) for _ in range(12)))
            return quiet, st, busy

    try:
        time.sleep(1.0)  # the prober marks the shadow healthy
        quiet, st_quiet, busy = asyncio.run(quiet_then_busy())
        time.sleep(1.0)
        st = stats(gw)
    finally:
        gw.stop()
    assert quiet == [200] * 6 and busy == [200] * 12
    assert st_quiet["mirrored"] == 6 and st_quiet["dropped_primary_busy"] == 0
    busy_mirrored = st["mirrored"] - 6
    assert st["dropped_primary_busy"] >= 6 and busy_mirrored + st["dropped_primary_busy"] == 12, st
    assert st["dropped_busy"] == st["dropped_down"] == st["dropped_primary_saturated"] == 0


def test_a_saturated_primary_replica_makes_the_mirror_drop(tmp_path):
    """The replica's own report (vLLM's waiting queue, as scraped) marks the primary busy: a one-sequence
    primary flooded with requests queues them and the next request is not mirrored; once the queue has
    drained and been scraped again, requests are mirrored."""
    primary = SimProcess(port=free_port(), gpu="A100-80G", model=MODEL, time_scale=5.0, extra={"max_num_seqs": 1},
                         log_path=tmp_path / "p.log")
    shadow = SimProcess(port=free_port(), gpu="A100-80G", model=MODEL, served_name=SHADOW_MODEL, time_scale=20.0,
                        log_path=tmp_path / "s.log")
    for s in (primary, shadow):
        s.start()
    gw = None
    try:
        for s in (primary, shadow):
            s.wait_ready(120)
        gw = gateway(tmp_path, primary.base_url, shadow.base_url, tmp_path / "ledger.jsonl",
                     shadow={"max_inflight": 64, "timeout_s": 30.0})
        time.sleep(1.0)  # the prober marks both healthy

        async def flood_then_probe():
            async with httpx.AsyncClient(timeout=60) as c:
                flood = [asyncio.create_task(post(c, gw.url, 256)) for _ in range(6)]
                await asyncio.sleep(1.5)  # queued inside the sim (one runs at a time) and scraped every 0.5 s
                saturated = await post(c, gw.url, 1)
                st_saturated = stats(gw)
                statuses = await asyncio.gather(*flood)
                await asyncio.sleep(1.5)  # drained, scraped again
                quiet = await post(c, gw.url, 1)
                return saturated, st_saturated, statuses, quiet, stats(gw)

        saturated, st_sat, flood, quiet, st = asyncio.run(flood_then_probe())
    finally:
        if gw:
            gw.stop()
        primary.stop()
        shadow.stop()
    assert saturated == quiet == 200 and flood == [200] * 6
    assert st_sat["mirrored"] == 6 and st_sat["dropped_primary_saturated"] == 1, st_sat  # the probe was dropped
    assert st["mirrored"] == 7 and st["dropped_primary_saturated"] == 1, st  # the quiet one was mirrored


def test_shadow_work_is_never_counted_against_tenant_limits(sims, tmp_path):
    """Every request mirrored (the mirror even runs before admission), yet the tenant's rpm counts each
    request once: 6 pass, the 7th is shed for rpm; the ledger books the tenant's 7 requests only."""
    from usefulwork.gateway.tenants import hash_key

    primary, shadow = sims
    ledger = tmp_path / "ledger.jsonl"
    gw = gateway(tmp_path, primary.base_url, shadow.base_url, ledger, filters=("mirror", "admission"),
                 shadow={"max_inflight": 64, "timeout_s": 30.0},
                 tenants={"acme": {"key_hashes": [hash_key("k-acme")], "rpm": 6}},
                 access={"admin_key_hashes": [hash_key("k-admin")]})

    async def seven():
        async with httpx.AsyncClient(timeout=30) as c:
            return [await post(c, gw.url, 8, key="k-acme") for _ in range(7)]

    try:
        time.sleep(1.0)
        statuses = asyncio.run(seven())
        time.sleep(1.0)
        st = stats(gw, "k-admin")
    finally:
        gw.stop()
    assert statuses == [200] * 6 + [429]
    assert st["mirrored"] == 7 and st["ok"] >= 6  # the shadow copies were really made and answered
    recs = ledger_records(ledger)
    assert len(recs) == 7 and {r["tenant"] for r in recs} == {"acme"}
    assert sorted(r["outcome"] for r in recs) == ["ok"] * 6 + ["shed"]
    assert {r["pool"] for r in recs if r["outcome"] == "ok"} == {"primary"}  # no shadow (candidate) work booked


# signal: the shadow settings that test it alone, how the loop is kept busy (test_loop_lag.saturate), the
# reading, its threshold, and the drop reason
GATEWAY_BUSY = {
    # ready work queued ahead of every callback (sleeping holds: lag without CPU)
    "loop_lag": ({"busy_loop_lag_ms": 2.0, "busy_cpu_fraction": None}, {"chains": 4, "hold_s": 0.002},
                 lambda lag: lag.lag_ms, 2.0, "dropped_gateway_busy"),
    # one chain computing in short slices, as streams do: little lag, a whole core used
    "cpu": ({"busy_loop_lag_ms": None, "busy_cpu_fraction": 0.5}, {"chains": 1, "hold_s": 0.0005, "spin": True},
            lambda lag: lag.cpu_fraction, 0.5, "dropped_gateway_cpu"),
}


@pytest.mark.parametrize("signal", list(GATEWAY_BUSY))
def test_a_saturated_gateway_makes_the_mirror_drop_and_a_free_one_mirrors(sims, tmp_path, signal):
    """In-process, on a real event loop: while the gateway's own core is saturated (``loop_lag``: ready work
    queued ahead of every callback, as a gateway core serving more than it can makes; ``cpu``: the process
    using the whole core), the request is not mirrored (``dropped_gateway_busy`` / ``dropped_gateway_cpu``);
    once the loop is free again, the next request is mirrored to the real shadow simulator and answered there."""
    from tests.gateway.test_loop_lag import saturate  # noqa: PLC0415
    from usefulwork import config  # noqa: PLC0415
    from usefulwork.gateway.context import NullAccountant, RequestContext  # noqa: PLC0415
    from usefulwork.gateway.filters import build_filters  # noqa: PLC0415
    from usefulwork.gateway.pipeline import Call, Reply, Services  # noqa: PLC0415
    from usefulwork.upstream.fleet import Fleet  # noqa: PLC0415

    shadow_over, load, reading, threshold, reason = GATEWAY_BUSY[signal]
    primary, shadow = sims
    cfg = config.from_mapping({
        "pools": [{"name": "primary", "models": [MODEL], "replicas": [primary.base_url]},
                  {"name": "candidate", "models": [SHADOW_MODEL], "replicas": [shadow.base_url]}],
        "filters": ["mirror"], "timeouts": {"health_interval_s": 0.2},
        "shadow": {"pool": "candidate", "sample": 1.0, "drop_when_saturated": False, "dir": str(tmp_path / "shadow"),
                   **shadow_over}}, environ={})

    async def answer(call: Call) -> Reply:
        return Reply(status=200, headers=[], body=b"{}")

    def call_for(i: int) -> Call:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"q {i}"}], "max_tokens": 4}
        ctx = RequestContext(id=f"r{i}", endpoint="chat", model=MODEL, stream=False)
        return Call(ctx, "chat", b"/v1/chat/completions", body, orjson.dumps(body), None, [])

    async def until(cond, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while not cond() and time.monotonic() < end:
            await asyncio.sleep(0.05)

    async def scenario():
        fleet = Fleet(cfg)
        await fleet.start()
        [mirror] = build_filters(cfg.filters, Services(cfg, fleet, NullAccountant()))
        await mirror.start()
        try:
            await until(lambda: bool(fleet.pools["candidate"].healthy_replicas()))  # the prober marks it up
            running = saturate(asyncio.get_running_loop(), **load)
            await until(lambda: reading(mirror.lag) > threshold)
            busy_then = reading(mirror.lag)
            assert (await mirror(call_for(1), answer)).status == 200
            after_busy = dict(mirror.counts)
            running[0] = False
            await until(lambda: reading(mirror.lag) < threshold)  # free again (a noisy host may take a moment)
            free_then = reading(mirror.lag)
            assert (await mirror(call_for(2), answer)).status == 200
            await asyncio.wait(list(mirror.tasks), timeout=10)
            return busy_then, after_busy, free_then, dict(mirror.counts)
        finally:
            await mirror.stop()
            await fleet.stop()

    busy_then, after_busy, free_then, final = asyncio.run(scenario())
    assert busy_then > threshold, busy_then
    assert after_busy[reason] == 1 and after_busy["mirrored"] == 0, after_busy
    assert free_then < threshold, free_then
    assert final["mirrored"] == 1 and final["ok"] == 1 and final[reason] == 1, final
    assert sum(v for k, v in final.items() if k.startswith("dropped_")) == 1, final  # by this signal alone
