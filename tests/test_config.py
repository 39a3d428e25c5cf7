import pytest

from usefulwork.config import ConfigError, load, with_local_pool

GOOD = """
listen: {port: 9001}
slo: {ttft_ms: 500}
pools:
  - name: small
    models: [m-small]
    replicas: ["http://127.0.0.1:8000/v1/"]
    gpu: {type: A10G, count: 2, usd_per_hour: 1.5}
    prices: {input_per_1m: 0.1, output_per_1m: 0.4}
"""


def test_load_valid_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(GOOD)
    cfg = load(f, environ={})
    assert cfg.listen.port == 9001
    assert cfg.slo.ttft_ms == 500
    pool = cfg.pool_for_model("m-small")
    assert pool.replicas == ["http://127.0.0.1:8000"]  # trailing /v1/ normalised away
    assert pool.usd_per_hour == pytest.approx(3.0)
    assert cfg.source == str(f)


def test_env_overrides_nested_and_lists(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(GOOD)
    env = {"USEFULWORK__LISTEN__PORT": "9100", "USEFULWORK__POOLS__0__REPLICAS": '["http://h:1", "http://h:2"]',
           "OTHER": "x"}
    cfg = load(f, environ=env)
    assert cfg.listen.port == 9100
    assert cfg.pools[0].replicas == ["http://h:1", "http://h:2"]
    # a value that is not YAML is the string itself: a field that takes strings gets it, another names itself
    cfg = load(f, environ={"USEFULWORK__LEDGER__REDIS_URL": "redis://:p: [w@h:6379/0"})
    assert cfg.ledger.redis_url == "redis://:p: [w@h:6379/0"
    with pytest.raises(ConfigError, match=r"listen\.port: Input should be a valid integer"):
        load(f, environ={"USEFULWORK__LISTEN__PORT": "["})


@pytest.mark.parametrize("text, field", [
    ("listen: {port: 70000}", "listen.port"),
    ("pools: [{name: a, models: [], replicas: ['http://x']}]", "pools.0.models"),
    ("pools: [{name: a, models: [m], replicas: ['ftp://x']}]", "pools.0.replicas"),
    ("slo: {ttft_ms: -1}", "slo.ttft_ms"),
    ("bogus: 1", "bogus"),
])
def test_error_names_field_and_file(tmp_path, text, field):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(f, environ={})
    assert field in str(e.value)
    assert str(f) in str(e.value)


def test_duplicate_model_across_pools_rejected(tmp_path):
    f = tmp_path / "dup.yaml"
    f.write_text("pools: [{name: a, models: [m], replicas: ['http://x']}, {name: b, models: [m], replicas: ['http://y']}]")
    with pytest.raises(ConfigError, match="served by two pools"):
        load(f, environ={})


def test_unreadable_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.yaml", environ={})
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load(f, environ={})


def test_with_local_pool():
    cfg = with_local_pool(load(None, environ={}), "http://127.0.0.1:8123")
    assert cfg.model_names == ["smollm2-135m-instruct"]
    assert cfg.pools[0].replicas == ["http://127.0.0.1:8123"]


def test_shipped_example_configs_are_valid(repo_root):
    files = [repo_root / "deploy" / "gateway.yaml", *sorted((repo_root / "examples").glob("*.yaml"))]
    assert len(files) >= 2
    for f in files:
        assert load(f, environ={}).pools, f


def test_configuration_doc_reference_is_in_sync(repo_root):
    from usefulwork.config import reference_markdown

    doc = (repo_root / "docs" / "configuration.md").read_text()
    table = doc.split("<!-- reference:start -->\n", 1)[1].split("<!-- reference:end -->", 1)[0]
    assert table == reference_markdown(), "docs/configuration.md is stale: regenerate with python -m usefulwork.config"


def test_replica_url_with_credentials_is_refused_without_echoing_them(tmp_path):
    """Issue #9.14: user:password@ in a replica URL showed in /readyz, /metrics, 502 bodies and the
    upstream Host header. It is refused at load; the message names the field and hides the secret."""
    import subprocess
    import sys

    f = tmp_path / "gw.yaml"
    f.write_text("pools:\n  - name: a\n    models: [m]\n    replicas: ['http://admin:hunter2@10.0.0.5:8000']\n")
    with pytest.raises(ConfigError) as e:
        load(f, environ={})
    msg = str(e.value)
    assert "pools.0.replicas" in msg and "api_key" in msg and "hunter2" not in msg and "admin" not in msg
    with pytest.raises(ConfigError) as e:  # the environment path is checked the same way
        load(None, environ={"USEFULWORK__POOLS": '[{"name": "a", "models": ["m"], '
                                                 '"replicas": ["https://tok@h:1"]}]'})
    assert "tok" not in str(e.value)
    r = subprocess.run([sys.executable, "-m", "usefulwork.cli", "serve", "--config", str(f)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "hunter2" not in r.stderr and "credentials" in r.stderr
