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


def gateway(tmp_path, primary_url: str, shadow_url: str, ledger, filters=("mirror",)):
    cfg = {"pools": [{"name": "primary", "models": [MODEL], "replicas": [primary_url]},
                     {"name": "candidate", "models": [SHADOW_MODEL], "replicas": [shadow_url]}],
           "timeouts": {"health_interval_s": 0.5, "retry_after_down_s": 1.0},
           "filters": list(filters), "record": {"dir": str(tmp_path / "traffic"), "flush_interval_s": 0.05},
           "shadow": {"pool": "candidate", "sample": 1.0, "timeout_s": 2.0, "max_inflight": 4,
                      "dir": str(tmp_path / "shadow")},
           "ledger": {"jsonl_path": str(ledger), "flush_interval_s": 0.1}}
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


def stats(gw) -> dict:
    return httpx.get(gw.url + "/usefulwork/stats", timeout=5).json()["filters"]["mirror"]


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
        if staller:  # sent, stalled, cut at the timeout; more than max_inflight at once were not mirrored
            assert st["mirrored"] >= 4 and st["failed"] == st["mirrored"] and st["dropped_busy"] > 0
    finally:
        gw.stop()
        if staller:
            staller.close()
    assert [r["outcome"] for r in ledger_records(ledger)] == ["ok"] * 20
