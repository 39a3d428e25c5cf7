"""The live dashboard in real headless Chromium (Debian `chromium`), under real traffic through a real
gateway and real vLLM: the numbers it shows must be the numbers /usefulwork/stats gives.

Set USEFULWORK_UPDATE_SCREENSHOT=1 to refresh docs/img/dashboard.png (else it goes to tmp)."""

from __future__ import annotations

import os
import random
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway.accounting.test_accounting import serve_gateway

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


def _traffic(url: str, model: str, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=60) as c:
        while not stop.is_set():
            roll = rng.random()
            if roll < 0.1:
                c.post("/v1/chat/completions", json={"model": model, "messages": "bad"})  # rejected
                continue
            body = {"model": model, "max_tokens": rng.choice([4, 8, 16]), "stream": roll < 0.5,
                    "messages": [{"role": "user", "content": f"Give me {rng.randint(2, 9)} words about tea."}]}
            if body["stream"]:
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    for _ in r.iter_bytes():
                        pass
            else:
                c.post("/v1/chat/completions", json=body)


def _shown(page, scope: str, window: str, field: str) -> str:
    return page.locator(f'[data-scope="{scope}"][data-window="{window}"][data-field="{field}"]').first.inner_text()


def _money(text: str) -> float:
    assert text.startswith("$"), text
    return float(text[1:])


def _open(pw, gateway_url: str):
    """Chromium on the gateway's live page: (browser, page)."""
    browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.goto(f"{gateway_url}/usefulwork/dashboard")
    return browser, page


def _wait_render(page, after: int, timeout_s: float = 15) -> int:
    page.wait_for_function(f"Number(document.body.dataset.renders || 0) > {after}", timeout=timeout_s * 1000)
    return int(page.evaluate("document.body.dataset.renders"))


def test_dashboard_shows_the_stats_under_traffic(vllm_server, tmp_path, repo_root: Path):
    if not Path(CHROMIUM).exists():
        pytest.fail("Debian chromium is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with serve_gateway(vllm_server.base_url, vllm_server.model, tmp_path) as gw, sync_playwright() as pw:
        stop = threading.Event()
        workers = [threading.Thread(target=_traffic, args=(gw.url, vllm_server.model, stop, i)) for i in range(2)]
        for w in workers:
            w.start()
        browser, page = _open(pw, gw.url)
        try:
            # under traffic: the page keeps up with a growing request count
            deadline = time.monotonic() + 60
            renders = 0
            while True:
                renders = _wait_render(page, renders)
                shown = _shown(page, "fleet", "all", "requests")
                if shown != "-" and int(shown) >= 8:
                    break
                assert time.monotonic() < deadline, "dashboard never showed traffic"
            assert page.locator("#live.ok").count() == 1
            time.sleep(8)  # a few more seconds of traffic for the charts
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=60)
        try:
            # traffic over: wait for the ledger to account for everything, then for a fresh render
            deadline = time.monotonic() + 20
            while True:
                s = gw.stats()
                if s["ledger"]["queued"] == 0 and s["fleet"]["all"]["requests"] == s["ledger"]["finished"]:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.2)
            before = gw.stats()
            renders = _wait_render(page, _wait_render(page, renders))
            after = gw.stats()

            f_before, f_after = before["fleet"]["all"], after["fleet"]["all"]
            for field in ("requests", "ok", "good", "dropped", "generated_tokens_ok"):
                assert f_before[field] == f_after[field]  # nothing moved: counts must match exactly
                assert _shown(page, "fleet", "all", field) == str(f_after[field]), field
            rate = f_after["slo_pass_rate"]
            assert _shown(page, "fleet", "all", "slo_pass_rate") == f"{100 * rate:.1f}%"
            assert f_after["rejected"] > 0 and f_after["ok"] > 0
            # money grows with wall-clock time (idle GPU costs too): the shown value lies between
            # the two snapshots taken around the render, to the 6 decimals shown
            for field in ("gpu.cost_usd", "gpu.usd_per_1k_ok", "gpu.usd_per_1m_generated"):
                key = field.split(".")[1]
                lo, hi = f_before["gpu"][key], f_after["gpu"][key]
                shown = _money(_shown(page, "fleet", "all", field))
                assert lo - 5e-7 <= shown <= hi + 5e-7, (field, lo, shown, hi)
            pool = after["pools"]["local"]["windows"]["all"]
            assert _shown(page, "pool:local", "all", "requests") == str(pool["requests"])
            tenant = after["tenants"]["default"]["windows"]["all"]
            assert _shown(page, "tenant:default", "all", "ok") == str(tenant["ok"])
            # the charts drew lines
            assert page.locator("#c-cost path").count() == 2
            assert page.locator("#c-slo path").first.get_attribute("d")

            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 20_000
            if os.environ.get("USEFULWORK_UPDATE_SCREENSHOT") == "1":
                dest = repo_root / "docs" / "img" / "dashboard.png"
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(shot, dest)
        finally:
            browser.close()


def test_dashboard_shows_each_pools_admission(tmp_path):
    """The admission table in Chromium against /usefulwork/stats: a real gateway with the admission filter
    in front of the simulator, one slot, one long answer in it and three requests shed (no round trip
    measured yet: a shed is demand for the E2E SLO's span), then four retries numbered by their client as
    the OpenAI SDKs number them (the three shed requests', and one more): each is priced one way (a place
    held for it, none left but due now, or as a first attempt), and none is demand again."""
    if not Path(CHROMIUM).exists():
        pytest.fail("Debian chromium is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    from tests.conftest import free_port
    from usefulwork.backends.sim.process import SimProcess

    sim = SimProcess(gpu="A100-80G", model="Llama-3.1-8B", served_name="llama", port=free_port(), time_scale=1.0,
                     log_path=tmp_path / "sim.log")
    sim.start()
    extra = {"filters": ["admission"], "slo": {"ttft_ms": 300, "e2e_ms": 60000},
             "admission": {"initial_concurrency": 1, "max_concurrency": 1}}
    try:
        sim.wait_ready(timeout_s=60)
        with serve_gateway(sim.base_url, "llama", tmp_path, extra=extra) as gw, sync_playwright() as pw:
            url, body = f"{gw.url}/v1/completions", {"model": "llama", "prompt": "tea " * 50, "ignore_eos": True}
            long = threading.Thread(target=httpx.post, args=(url,), kwargs={"json": {**body, "max_tokens": 1500}, "timeout": 120})
            long.start()
            deadline = time.monotonic() + 10
            while gw.stats()["filters"]["admission"]["pools"].get("local", {}).get("inflight") != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            shed = [threading.Thread(target=httpx.post, args=(url,), kwargs={
                "json": {**body, "prompt": f"{i} " + body["prompt"], "max_tokens": 8}, "timeout": 60}) for i in range(3)]
            for t in shed:
                t.start()
            for t in shed:
                t.join()
            retried = [httpx.post(url, json={**body, "prompt": f"{i} " + body["prompt"], "max_tokens": 8}, timeout=60,
                                  headers={"x-stainless-retry-count": "1"}) for i in range(4)]
            assert [r.status_code for r in retried] == [429] * 4  # the one slot is still taken
            browser, page = _open(pw, gw.url)
            try:
                before = gw.stats()["filters"]["admission"]["pools"]["local"]
                _wait_render(page, _wait_render(page, 0))
                after = gw.stats()["filters"]["admission"]["pools"]["local"]
                assert before["inflight"] == after["inflight"] == 1 and sum(after["shed"].values()) == 7
                assert before["shed_demand"] == after["shed_demand"] == 3
                assert after["retries_honoured"] + after["retries_placeless"] == 4, after
                row = page.locator("#admission-table tbody tr").first.locator("td").all_inner_texts()
                header = page.locator("#admission-table thead th").all_inner_texts()
                shown = dict(zip(header, row))
                assert shown["pool"] == "local" and shown["limit"] == "1" and shown["in flight"] == "1"
                assert shown["queued interactive / batch / sheddable"] == "0 / 0 / 0"
                assert shown["admitted"] == str(after["admitted"])
                assert shown["shed by reason"] == ", ".join(f"{k} {v}" for k, v in after["shed"].items())
                assert shown["shed demand"] == "3"
                assert shown["retries held / due now / unproven"] == (
                    f"{after['retries_honoured']} / {after['retries_placeless'] - after['retries_unproven']} / "
                    f"{after['retries_unproven']}"), (shown, after)
            finally:
                browser.close()
            long.join()
    finally:
        sim.stop()
