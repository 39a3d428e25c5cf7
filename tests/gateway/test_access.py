"""Who may read /usefulwork/stats, the dashboard, /metrics and /readyz (issue 9, item 13)."""

from __future__ import annotations

import base64
import time

import pytest
from starlette.testclient import TestClient

from usefulwork.config import from_mapping
from usefulwork.gateway.app import build_app
from usefulwork.gateway.context import RequestContext
from usefulwork.gateway.tenants import hash_key

POOL = {"name": "p", "models": ["m"], "replicas": ["http://127.0.0.1:9"]}
KEYS = {
    "tenants": {"acme": {"key_hashes": [hash_key("acme-key")]}, "bravo": {"key_hashes": [hash_key("bravo-key")]}},
    "access": {"admin_key_hashes": [hash_key("admin-key")], "metrics_token_hash": hash_key("scrape-token")},
}


def bearer(k: str) -> dict[str, str]:
    return {"authorization": f"Bearer {k}"}


def finished(tenant: str) -> RequestContext:
    ctx = RequestContext(id=f"r-{tenant}", endpoint="chat", model="m", stream=False, tenant=tenant, pool="p")
    ctx.prompt_tokens, ctx.completion_tokens, ctx.usage_source = 10, 5, "backend"
    ctx.t_first_token = ctx.t_start + 0.01
    ctx.t_end = ctx.t_start + 0.02
    return ctx


@pytest.fixture
def secured():
    app = build_app(from_mapping({"pools": [POOL], **KEYS}, environ={}))
    with TestClient(app.app) as c:
        ledger = app.state.accounting.accountant
        ledger.finish(finished("acme"))
        ledger.finish(finished("bravo"))
        deadline = time.monotonic() + 5
        admin = bearer("admin-key")
        while len(c.get("/usefulwork/stats", headers=admin).json()["tenants"]) < 2:
            assert time.monotonic() < deadline, "the ledger never showed both tenants"
            time.sleep(0.05)
        yield c


def test_no_keys_configured_everything_open_as_before():
    app = build_app(from_mapping({"pools": [POOL]}, environ={}))
    with TestClient(app.app) as c:
        assert c.get("/usefulwork/stats").status_code == 200
        assert c.get("/usefulwork/dashboard").status_code == 200
        assert c.get("/metrics").status_code == 200
        assert "pools" in c.get("/readyz").json()


def test_healthz_open_readyz_says_only_ready_without_admin(secured):
    assert secured.get("/healthz").status_code == 200
    r = secured.get("/readyz")
    assert r.status_code == 503 and r.json() == {"ready": False}  # no replica URL, no reason
    assert "127.0.0.1:9" not in r.text
    r = secured.get("/readyz", headers=bearer("acme-key"))
    assert r.json() == {"ready": False}
    r = secured.get("/readyz", headers=bearer("admin-key"))
    assert r.json()["pools"]["p"]["healthy"] == 0


def test_metrics_needs_admin_or_scrape_token(secured):
    r = secured.get("/metrics")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert secured.get("/metrics", headers=bearer("acme-key")).status_code == 403
    assert secured.get("/metrics", headers=bearer("wrong")).status_code == 401
    for k in ("scrape-token", "admin-key"):
        r = secured.get("/metrics", headers=bearer(k))
        assert r.status_code == 200 and "usefulwork_replica_up" in r.text


def test_stats_fleet_for_admin_own_tenant_only_for_a_tenant_key(secured):
    assert secured.get("/usefulwork/stats").status_code == 401
    assert secured.get("/usefulwork/stats", headers=bearer("nope")).status_code == 401
    fleet = secured.get("/usefulwork/stats", headers=bearer("admin-key")).json()
    assert set(fleet["tenants"]) == {"acme", "bravo"}
    for tenant, other in (("acme", "bravo"), ("bravo", "acme")):
        r = secured.get("/usefulwork/stats?series=1", headers=bearer(f"{tenant}-key"))
        assert r.status_code == 200
        body = r.json()
        assert body["tenant"] == tenant and set(body["tenants"]) == {tenant}
        assert other not in r.text and "pools" not in body and "ledger" not in body
        assert body["tenants"][tenant]["windows"]


def test_dashboard_needs_admin_key_browsers_use_basic(secured):
    r = secured.get("/usefulwork/dashboard")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
    basic = {"authorization": "Basic " + base64.b64encode(b"me:admin-key").decode()}
    assert secured.get("/usefulwork/dashboard", headers=basic).status_code == 200
    assert secured.get("/usefulwork/stats", headers=basic).status_code == 200  # what the page's fetch sends
    assert secured.get("/usefulwork/dashboard", headers=bearer("acme-key")).status_code == 401


def test_models_need_a_key_the_openai_endpoints_would_take(secured):
    r = secured.get("/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert secured.get("/v1/models/m", headers=bearer("wrong")).status_code == 401
    for k in ("acme-key", "admin-key"):
        assert [m["id"] for m in secured.get("/v1/models", headers=bearer(k)).json()["data"]] == ["m"]
        assert secured.get("/v1/models/m", headers=bearer(k)).json()["owned_by"] == "usefulwork:p"


def test_a_disabled_tenant_cannot_list_models():
    keys = {**KEYS, "tenants": {"acme": {"key_hashes": [hash_key("acme-key")], "enabled": False}}}
    app = build_app(from_mapping({"pools": [POOL], **keys}, environ={}))
    with TestClient(app.app) as c:
        r = c.get("/v1/models", headers=bearer("acme-key"))
        assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_disabled"


def test_one_model_by_id_and_an_unknown_one_without_keys():
    pools = [POOL, {"name": "q", "models": ["org/big-model"], "replicas": ["http://127.0.0.1:9"]}]
    app = build_app(from_mapping({"pools": pools}, environ={}))
    with TestClient(app.app) as c:
        listed = c.get("/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["m", "org/big-model"]
        one = c.get("/v1/models/org/big-model")  # ids may hold a slash (Hugging Face names)
        assert one.status_code == 200 and one.json() == listed[1]
        r = c.get("/v1/models/nope")
        assert r.status_code == 404
        assert r.json()["error"] == {"message": "The model 'nope' does not exist or you do not have access to it",
                                     "type": "not_found_error", "param": "model", "code": "model_not_found"}


def test_a_tenant_with_a_model_list_sees_and_calls_those_only_and_cannot_tell_the_others_exist():
    pools = [POOL, {"name": "q", "models": ["big"], "replicas": ["http://127.0.0.1:9"]}]
    keys = {**KEYS, "tenants": {**KEYS["tenants"], "acme": {"key_hashes": [hash_key("acme-key")], "models": ["m"]}}}
    app = build_app(from_mapping({"pools": pools, **keys}, environ={}))
    with TestClient(app.app) as c:
        assert [m["id"] for m in c.get("/v1/models", headers=bearer("acme-key")).json()["data"]] == ["m"]
        assert [m["id"] for m in c.get("/v1/models", headers=bearer("bravo-key")).json()["data"]] == ["m", "big"]
        assert [m["id"] for m in c.get("/v1/models", headers=bearer("admin-key")).json()["data"]] == ["m", "big"]
        hidden, unknown = (c.get(f"/v1/models/{name}", headers=bearer("acme-key")) for name in ("big", "nope"))
        assert hidden.status_code == unknown.status_code == 404
        assert hidden.json()["error"]["message"].replace("big", "X") == unknown.json()["error"]["message"].replace("nope", "X")
        assert c.get("/v1/models/big", headers=bearer("bravo-key")).status_code == 200

        def chat(key: str, model: str):
            return c.post("/v1/chat/completions", headers=bearer(key),
                          json={"model": model, "messages": [{"role": "user", "content": "hi"}]})

        refused, unknown = chat("acme-key", "big"), chat("acme-key", "nope")
        assert refused.status_code == unknown.status_code == 404  # not forwarded: its replica does not answer
        assert refused.json()["error"]["code"] == "model_not_found" and refused.json()["error"]["param"] == "model"
        assert refused.json()["error"]["message"].replace("big", "X") == unknown.json()["error"]["message"].replace("nope", "X")
        assert chat("acme-key", "m").status_code >= 500 and chat("bravo-key", "big").status_code >= 500  # forwarded
