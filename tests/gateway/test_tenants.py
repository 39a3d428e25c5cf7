"""Tenants: hashed keys, identify (401 / 403), the hash-key CLI, and config errors naming the field."""

from __future__ import annotations

import base64
import subprocess
import sys

import pytest

from usefulwork.config import ConfigError, from_mapping
from usefulwork.gateway.errors import GatewayError
from usefulwork.gateway.tenants import Tenants, bearer, hash_key

POOL = {"name": "p", "models": ["m"], "replicas": ["http://127.0.0.1:9"]}


def cfg(**tree):
    return from_mapping({"pools": [POOL], **tree}, source="test.yaml", environ={})


def test_identify_by_hashed_key_and_errors():
    t = Tenants(cfg(tenants={"acme": {"key_hashes": [hash_key("secret-1")]},
                             "gone": {"key_hashes": [hash_key("secret-2")], "enabled": False}}))
    assert t.identify(b"Bearer secret-1") == "acme"
    assert t.identify(b"bearer   secret-1 ") == "acme"
    for bad in (None, b"", b"Bearer", b"Bearer nope", b"Token secret-1", b"Bearer \xff\xfe", b"secret-1"):
        with pytest.raises(GatewayError) as e:
            t.identify(bad)
        assert e.value.status == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(GatewayError) as e:
        t.identify(b"Bearer secret-2")
    assert e.value.status == 403 and e.value.code == "tenant_disabled" and "gone" in e.value.message


def test_no_keys_means_default_tenant_and_legacy_plain_keys_still_work():
    assert Tenants(cfg()).identify(None) == "default"
    t = Tenants(cfg(auth={"api_keys": {"plain": "old"}}))
    assert t.identify(b"Bearer plain") == "old"


def test_basic_auth_password_is_a_key_for_browsers():
    assert bearer(b"Basic " + base64.b64encode(b"admin:the-key")) == "the-key"
    assert bearer(b"Basic !!notbase64") is None


def test_hash_key_cli_prints_a_new_key_and_its_hash():
    out = subprocess.run([sys.executable, "-m", "usefulwork.cli", "tenants", "hash-key"], capture_output=True,
                         text=True, check=True).stdout
    key = out.split("key:")[1].split()[0]
    assert f"hash: {hash_key(key)}" in out
    out = subprocess.run([sys.executable, "-m", "usefulwork.cli", "tenants", "hash-key", "abc"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == f"hash: {hash_key('abc')}"


@pytest.mark.parametrize("tenant, field, needle", [
    ({"budget_usd_per_day": "50 EUR"}, "tenants.acme.budget_usd_per_day", "plain number of US dollars"),
    ({"budget_usd_per_day": "$5"}, "tenants.acme.budget_usd_per_day", "plain number"),
    ({"budget_usd_per_day": -1}, "tenants.acme.budget_usd_per_day", "greater than or equal"),
    ({"budget_cents_per_day": 500}, "tenants.acme.budget_cents_per_day", "Extra inputs"),
    ({"budget_usd_per_month": 5}, "tenants.acme.budget_usd_per_month", "Extra inputs"),
    ({"key_hashes": ["my-plain-key"]}, "tenants.acme.key_hashes", "sha256:"),
    ({"priority": "urgent"}, "tenants.acme.priority", "interactive"),
    ({"max_priority": "vip"}, "tenants.acme.max_priority", "interactive"),
    ({"max_priority": "batch"}, "tenants.acme", "priority 'interactive' is above max_priority 'batch'"),
    ({"weight": 0}, "tenants.acme.weight", "greater than 0"),
    ({"rpm": 0}, "tenants.acme.rpm", "greater than or equal to 1"),
])
def test_bad_tenant_config_names_the_field(tenant, field, needle):
    with pytest.raises(ConfigError) as e:
        cfg(tenants={"acme": tenant})
    msg = str(e.value)
    assert f"test.yaml: {field}" in msg and needle in msg


def test_a_model_list_names_served_or_virtual_models_only():
    with pytest.raises(ConfigError, match=r"tenants\.acme\.models: 'gpt-4' is neither a model a pool serves"):
        cfg(tenants={"acme": {"models": ["gpt-4"]}})
    t = Tenants(cfg(tenants={"acme": {"key_hashes": [hash_key("k")], "models": ["m"]}, "bravo": {}}))
    assert t.models_of("acme") == {"m"} and t.models_of("bravo") is None and t.models_of(None) is None
    assert Tenants(cfg(tenants={"bravo": {}})).models_of("bravo") is None


def test_bad_access_and_admission_config_names_the_field():
    with pytest.raises(ConfigError, match=r"access\.metrics_token_hash: .*sha256:"):
        cfg(access={"metrics_token_hash": "prom-token"})
    with pytest.raises(ConfigError, match=r"admission\.on_redis_down"):
        cfg(admission={"on_redis_down": "maybe"})
    with pytest.raises(ConfigError, match=r"admission\.deadline_ms\.urgent"):
        cfg(admission={"deadline_ms": {"urgent": 100}})


def test_which_says_whose_a_key_is_without_printing_it(tmp_path):
    """`usefulwork tenants which`: a client's 401 or 403 explained from the config; the key comes on stdin."""
    f = tmp_path / "gw.yaml"
    f.write_text(f"pools: [{{name: p, models: [m], replicas: ['http://127.0.0.1:9']}}]\n"
                 f"tenants:\n  acme: {{key_hashes: ['{hash_key('k-acme')}'], rpm: 60, models: [m], priority: batch, "
                 f"max_priority: batch, max_inflight_per_process: 8}}\n"
                 f"  old: {{key_hashes: ['{hash_key('k-old')}'], enabled: false}}\n"
                 f"auth: {{api_keys: {{k-plain: acme}}}}\n"
                 f"access: {{admin_key_hashes: ['{hash_key('k-admin')}'], metrics_token_hash: '{hash_key('k-prom')}'}}\n")

    def which(key: str, config=f) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "usefulwork.cli", "tenants", "which", "-c", str(config)],
                              input=key + "\n", capture_output=True, text=True, timeout=60)

    r = which("k-acme")
    assert r.returncode == 0 and r.stdout.strip() == "tenant 'acme': batch (at most batch), weight 1, rpm 60, in flight per gateway process 8; models: m"
    r = which("k-plain")
    assert r.returncode == 0 and "tenant 'acme' (auth.api_keys, in plain text" in r.stdout
    r = which("k-old")
    assert r.returncode == 1 and "disabled, its requests get 403" in r.stdout
    assert which("k-admin").stdout.startswith("the admin key") and which("k-prom").stdout.startswith("the metrics")
    r = which("nobody")
    assert r.returncode == 1 and "401" in r.stdout
    for out in (which(k) for k in ("k-acme", "nobody")):
        assert "k-acme" not in out.stdout + out.stderr and "sha256" not in out.stdout + out.stderr
    assert which("").returncode == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("tenants: {a: {rpm: 0}}\n")
    r = which("x", bad)
    assert r.returncode == 2 and "tenants.a.rpm" in r.stderr and "Traceback" not in r.stderr
