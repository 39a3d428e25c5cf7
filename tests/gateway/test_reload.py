"""SIGHUP reloads tenants, keys and access from the config file: a real gateway process in front of the
real vLLM, the real `openai` SDK, real signals; and `serve --workers 2`, where the parent passes it on."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest
import yaml

from tests.conftest import child_pids
from tests.gateway.accounting.test_shared import ADMIN, MODEL, Gw, sim, start_gateway, stop, wait_ready  # noqa: F401
from usefulwork.config import load
from usefulwork.gateway.reload import Reloader
from usefulwork.gateway.tenants import Tenants, hash_key


def _config(tmp_path, pools: list[dict], tenants: dict, **extra) -> dict:
    return {"pools": pools, "ledger": {"jsonl_path": str(tmp_path / "ledger.jsonl"), "flush_interval_s": 0.2},
            "timeouts": {"health_interval_s": 1.0}, "tenants": tenants,
            "access": {"admin_key_hashes": [hash_key("admin-key")]}, **extra}


def _write(path, cfg: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(cfg))
    os.replace(tmp, path)  # as a ConfigMap update: the reader sees the old file or the new one


POOLS = [{"name": "p", "models": ["m"], "replicas": ["http://127.0.0.1:9"]}]


def _alice_only(tmp_path):
    """A config file with one tenant and an admin key, loaded, its tenants table and its Reloader."""
    path = tmp_path / "c.yaml"
    _write(path, _config(tmp_path, POOLS, {"alice": {"key_hashes": [hash_key("alice-key")]}}))
    cfg = load(path)
    tenants = Tenants(cfg)
    return path, POOLS, cfg, tenants, Reloader(cfg, tenants.reload)


def test_reload_applies_the_live_sections_and_keeps_the_tables_when_the_file_does_not_load(tmp_path):
    path, pools, cfg, tenants, r = _alice_only(tmp_path)
    assert r.reload().summary() == "tenants, keys and access unchanged"
    _write(path, _config(tmp_path, [{**pools[0], "replicas": ["http://127.0.0.1:10"]}],
                         {"bob": {"key_hashes": [hash_key("bob-key")], "rpm": 5}}))
    done = r.reload()
    assert done.live == ["tenants"] and done.restart == ["pools"]
    assert "restart to apply: pools" in done.summary()
    assert tenants.tenant_of_key("bob-key") == "bob" and tenants.tenant_of_key("alice-key") is None
    assert tenants.settings("bob").rpm == 5
    again = r.reload()  # the pools still differ from what runs: said again; the tenants now match
    assert again.live == [] and again.restart == ["pools"]
    # a field that does not validate: nothing changes, the error names the field
    text = path.read_text().replace("rpm: 5", "rpm: five")
    path.write_text(text)
    assert r.reload() is None
    assert tenants.settings("bob").rpm == 5 and r.counts == {"ok": 3, "error": 1}
    assert not r.last_ok and "tenants.bob.rpm" in r.last_error
    path.write_text("tenants: [")
    assert r.reload() is None and "not valid YAML" in r.last_error and tenants.tenant_of_key("bob-key") == "bob"
    # several workers with per-process limits would each grant the whole limit: refused as at start
    workers = Reloader(cfg.model_copy(update={"listen": cfg.listen.model_copy(update={"workers": 2}),
                                              "filters": ["admission"]}), tenants.reload)
    _write(path, {**_config(tmp_path, pools, {"bob": {"key_hashes": [hash_key("bob-key")], "rpm": 7}}),
                  "filters": ["admission"]})
    assert workers.reload() is None and "admission.redis_url" in workers.last_error
    assert tenants.settings("bob").rpm == 5


def test_a_reload_never_turns_key_checks_off_and_a_watched_file_is_read_once_it_settles(tmp_path):
    path, pools, cfg, tenants, r = _alice_only(tmp_path)
    # an editor that truncates before it writes leaves an empty file for a moment: every caller would be let in
    for text in ("", yaml.safe_dump({"pools": pools})):
        path.write_text(text)
        assert r.reload() is None and "no key left" in r.last_error
        assert tenants.auth_enabled and tenants.tenant_of_key("alice-key") == "alice"
    unkeyed = tmp_path / "open.yaml"
    _write(unkeyed, {"pools": pools})
    open_cfg = load(unkeyed)
    unkeyed.write_text(yaml.safe_dump({"pools": pools, "slo": {"ttft_ms": 900}}))
    assert Reloader(open_cfg, Tenants(open_cfg).reload).reload().restart == ["slo"]  # (no keys before: none after)
    # the watch: a change is read at the second look that finds it unchanged; another write starts over
    _write(path, _config(tmp_path, pools, {"alice": {"key_hashes": [hash_key("alice-key")]}}))
    r = Reloader(cfg, tenants.reload)
    assert not r.changed_on_disk()
    path.write_text(path.read_text() + "\n# half")
    assert not r.changed_on_disk()  # (first seen: it may still be being written)
    path.write_text(path.read_text() + "\n# written")
    assert not r.changed_on_disk()  # (changed again since)
    assert r.changed_on_disk()  # (held still for one look)
    assert r.reload() is not None and not r.changed_on_disk()


def _ready_config(gw: Gw) -> dict:
    return httpx.get(f"{gw.url}/readyz", headers=ADMIN, timeout=10).json()["config"]


def _wait_reloads(gw: Gw, ok: int = 0, error: int = 0, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while (c := _ready_config(gw))["reloads"] != {"ok": ok, "error": error}:
        assert time.monotonic() < deadline, c
        time.sleep(0.1)
    return c


def test_sighup_rotates_keys_adds_a_limited_tenant_and_survives_a_bad_file(vllm_server, tmp_path):
    path = tmp_path / "gw.yaml"
    pools = [{"name": "local", "models": [vllm_server.model], "replicas": [vllm_server.base_url]}]
    cfg = _config(tmp_path, pools, {"alice": {"key_hashes": [hash_key("alice-key")]}}, filters=["router", "admission"],
                  routing={"virtual_models": [{"name": "auto", "small_pool": "local", "large_pool": "local"}]})
    _write(path, cfg)
    gw = start_gateway(path, tmp_path, "gw")
    try:
        wait_ready(gw)

        def sdk(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=60)

        def chat(key: str, model: str = vllm_server.model) -> str:
            r = sdk(key).chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            return r.choices[0].finish_reason

        assert chat("alice-key")
        with pytest.raises(openai.AuthenticationError):
            chat("bob-key")
        # rotate alice's key, add bob with 1 request a minute, then SIGHUP: no restart
        pid = gw.proc.pid
        _write(path, {**cfg, "tenants": {"alice": {"key_hashes": [hash_key("alice-key-2")]},
                                         "bob": {"key_hashes": [hash_key("bob-key")], "rpm": 1}}})
        gw.proc.send_signal(signal.SIGHUP)
        c = _wait_reloads(gw, ok=1)
        assert c["last_reload_successful"] and c["source"] == str(path)
        assert gw.proc.poll() is None and gw.proc.pid == pid
        assert chat("alice-key-2") and chat("bob-key")
        with pytest.raises(openai.AuthenticationError):
            chat("alice-key")
        with pytest.raises(openai.RateLimitError) as limited:  # the new tenant's rpm holds from its first request
            chat("bob-key")
        assert int(limited.value.response.headers["retry-after"]) >= 1
        # a budget in the wrong unit: refused, logged naming the field; the gateway serves the tables it has
        _write(path, {**cfg, "tenants": {"alice": {"key_hashes": [hash_key("alice-key-2")],
                                                   "budget_usd_per_day": "5 EUR"}}})
        gw.proc.send_signal(signal.SIGHUP)
        c = _wait_reloads(gw, ok=1, error=1)
        assert not c["last_reload_successful"] and "tenants.alice.budget_usd_per_day" in c["last_error"]
        assert chat("alice-key-2")
        with pytest.raises(openai.RateLimitError):
            chat("bob-key")  # still known, still limited: its bucket was kept
        # a section read only at start: the live ones apply (alice may now call the cascade only), the rest is said
        _write(path, {**cfg, "timeouts": {"health_interval_s": 2.0},
                      "tenants": {"alice": {"key_hashes": [hash_key("alice-key")], "models": ["auto"]}}})
        gw.proc.send_signal(signal.SIGHUP)
        _wait_reloads(gw, ok=2, error=1)
        with pytest.raises(openai.AuthenticationError):
            chat("alice-key-2")
        assert chat("alice-key", "auto")
        with pytest.raises(openai.NotFoundError) as hidden:  # as a model that does not exist
            chat("alice-key")
        assert hidden.value.code == "model_not_found"
        assert [m.id for m in sdk("alice-key").models.list()] == ["auto"]
        assert {m.id for m in sdk("admin-key").models.list()} == {"auto", vllm_server.model}
        log = gw.log.read_text()
        assert "config reload failed" in log and "tenants.alice.budget_usd_per_day" in log
        assert "restart to apply: timeouts" in log and "Traceback" not in log
        metrics = httpx.get(f"{gw.url}/metrics", headers=ADMIN, timeout=10).text
        assert 'usefulwork_config_reloads_total{result="ok"} 2.0' in metrics
        assert "usefulwork_config_last_reload_successful 1.0" in metrics
    finally:
        assert stop(gw) == 0


def _all_accept(gw: Gw, key: str, n: int = 20) -> bool:
    with httpx.Client(timeout=30) as c:  # one connection per request: the kernel spreads them over the workers
        codes = [c.post(f"{gw.url}/v1/chat/completions", headers={"authorization": f"Bearer {key}", "connection": "close"},
                        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code
                 for _ in range(n)]
    assert set(codes) <= {200, 401}, codes
    return codes == [200] * n


def test_sighup_to_the_parent_reaches_every_worker_and_the_ones_started_later(sim, tmp_path):  # noqa: F811
    path = tmp_path / "w.yaml"
    pools = [{"name": "sim", "models": [MODEL], "replicas": [sim.base_url]}]
    cfg = _config(tmp_path, pools, {"alice": {"key_hashes": [hash_key("alice-key")]}})
    _write(path, cfg)
    gw = start_gateway(path, tmp_path, "w", "--workers", "2")
    try:
        deadline = time.monotonic() + 30
        while "gateway listening" not in gw.log.read_text():  # the parent's handlers are installed by then
            assert time.monotonic() < deadline and gw.proc.poll() is None
            time.sleep(0.05)
        gw.proc.send_signal(signal.SIGHUP)  # workers still starting die of it and are started again, not a crash
        wait_ready(gw)
        assert _all_accept(gw, "alice-key")
        workers = child_pids(gw.proc.pid)
        assert len(workers) == 2
        _write(path, {**cfg, "tenants": {"bob": {"key_hashes": [hash_key("bob-key")]}}})
        gw.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while not _all_accept(gw, "bob-key"):
            assert time.monotonic() < deadline, gw.log.read_text()[-2000:]
            time.sleep(0.2)
        assert not any(_all_accept(gw, "alice-key", 1) for _ in range(10))
        assert "passed to 2 workers" in gw.log.read_text()
        # a worker started after the reload (this one restarted after a crash) serves the reloaded tenants
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (now := child_pids(gw.proc.pid)) == workers or len(now) < 2:
            assert time.monotonic() < deadline, now
            time.sleep(0.2)
        wait_ready(gw)
        time.sleep(2.0)  # the restarted worker has started accepting on its socket
        assert _all_accept(gw, "bob-key", 30)
        assert gw.proc.poll() is None and "times within" not in gw.log.read_text()
    finally:
        assert stop(gw) == 0


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_watched_file_is_reloaded_when_it_changes_without_a_signal(sim, tmp_path, workers):  # noqa: F811
    path = tmp_path / "watched.yaml"
    pools = [{"name": "sim", "models": [MODEL], "replicas": [sim.base_url]}]
    cfg = _config(tmp_path, pools, {"alice": {"key_hashes": [hash_key("alice-key")]}}, reload={"watch_interval_s": 0.3})
    _write(path, cfg)
    gw = start_gateway(path, tmp_path, "watched", "--workers", workers)
    try:
        wait_ready(gw)
        time.sleep(1.0)  # (a worker still starting would be started again by the reload; tested above)
        assert _all_accept(gw, "alice-key") and not _all_accept(gw, "bob-key", 1)
        _write(path, {**cfg, "tenants": {"bob": {"key_hashes": [hash_key("bob-key")]}}})  # no signal
        deadline = time.monotonic() + 20
        while not _all_accept(gw, "bob-key"):
            assert time.monotonic() < deadline, gw.log.read_text()[-2000:]
            time.sleep(0.2)
        assert not _all_accept(gw, "alice-key", 1)
        path.write_text("tenants: [")  # a half-written file: refused once, the tables kept
        deadline = time.monotonic() + 20
        while "config reload failed" not in gw.log.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(1.0)
        assert gw.log.read_text().count("config reload failed") == 1  # not again every look: the file has not changed
        assert _all_accept(gw, "bob-key")
    finally:
        assert stop(gw) == 0
