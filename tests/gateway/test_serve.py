"""`usefulwork serve` start-up errors: a clear message naming the field and the file, exit code 2."""

import subprocess
import sys


def _serve(*args):
    return subprocess.run([sys.executable, "-m", "usefulwork.cli", "serve", *args], capture_output=True, text=True,
                          timeout=60)


def test_bad_config_names_field_and_file(tmp_path):
    f = tmp_path / "gw.yaml"
    f.write_text("pools:\n  - name: a\n    models: [m]\n    replicas: ['ftp://nowhere']\n")
    r = _serve("--config", str(f))
    assert r.returncode == 2
    assert str(f) in r.stderr and "pools.0.replicas" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_config_file(tmp_path):
    r = _serve("--config", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "cannot read config file" in r.stderr


def test_config_without_pools_is_an_error(tmp_path):
    f = tmp_path / "empty.yaml"
    f.write_text("listen: {port: 9999}\n")
    r = _serve("--config", str(f))
    assert r.returncode == 2 and "no pools configured" in r.stderr


def test_cli_help_and_version():
    r = subprocess.run([sys.executable, "-m", "usefulwork.cli", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "0.1.0"
    r = subprocess.run([sys.executable, "-m", "usefulwork.cli"], capture_output=True, text=True)
    assert r.returncode == 2 and "serve" in r.stdout


def test_gc_is_tuned_once_the_app_has_started():
    code = ("import gc; from usefulwork.gateway.serve import GC_GEN0, _tune_gc; _tune_gc(); "
            "assert gc.get_threshold()[0] == GC_GEN0 and gc.get_freeze_count() > 1000; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


async def test_forwarded_headers_reach_the_routes_and_the_hot_paths_skip_them():
    from usefulwork.config import from_mapping
    from usefulwork.gateway.app import build_app
    from usefulwork.gateway.serve import proxy_headers_for_routes

    app = build_app(from_mapping({"pools": [{"name": "p", "models": ["m"], "replicas": ["http://127.0.0.1:9"]}]},
                                 environ={}))
    proxy_headers_for_routes(app, "127.0.0.1")
    seen = []

    async def record(scope, receive, send):
        seen.append(scope["client"])

    app.app.app = record  # the Starlette app behind the middleware
    app.hot["/v1/chat/completions"] = record
    headers = [(b"x-forwarded-for", b"203.0.113.7")]
    for method, path in (("GET", "/healthz"), ("POST", "/v1/chat/completions")):
        await app({"type": "http", "method": method, "path": path, "headers": headers, "client": ("127.0.0.1", 5000),
                   "scheme": "http"}, None, None)
    assert seen == [("203.0.113.7", 0), ("127.0.0.1", 5000)]


def test_check_validates_a_config_and_says_what_it_sets_up_without_serving(tmp_path):
    """`serve --check`: what a deploy pipeline runs on a config before rolling it out. A valid config prints
    its parts (never a key hash) and exits 0 without binding its port; an invalid one exits 2 naming the
    field. A shared Redis that does not answer from where it is checked is a warning (a pipeline outside the
    cluster cannot reach an in-cluster Redis); serving the same config is an error."""
    import socket

    from usefulwork.gateway.tenants import hash_key

    digest = hash_key("sk-check-test")
    with socket.socket() as busy:  # the config's port is taken: --check must not try to bind it
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        f = tmp_path / "gw.yaml"
        f.write_text(
            f"listen: {{port: {port}}}\n"
            "pools:\n  - name: small\n    models: [m1, m2]\n    replicas: ['http://10.0.0.1:8000', 'http://10.0.0.2:8000']\n"
            "    scheduling_policy: priority\n"
            "filters: [admission]\n"
            f"tenants:\n  acme: {{key_hashes: ['{digest}'], rpm: 60}}\n  old: {{enabled: false}}\n")
        r = _serve("--config", str(f), "--check")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"config: {f}" in out and f"listen: 127.0.0.1:{port}, 1 worker(s)" in out
    assert "pool small: models m1, m2; 2 static replica(s); scheduling priority" in out
    assert "reload of tenants, keys and access: on SIGHUP\n" in out
    assert "filters: admission" in out and "tenants: 2 (1 key hash(es)); with limits or a budget: acme; disabled: old" in out
    assert "shared state: none (per process)" in out and out.rstrip().endswith("config OK")
    assert digest not in out and digest.split(":")[1] not in out

    f.write_text(f.read_text().replace("rpm: 60", "budget_usd_per_day: '50 EUR'"))
    r = _serve("--config", str(f), "--check")
    assert r.returncode == 2 and "tenants.acme.budget_usd_per_day" in r.stderr and "Traceback" not in r.stderr
    assert "config OK" not in r.stdout

    f.write_text(f.read_text().replace("budget_usd_per_day: '50 EUR'", "rpm: 60")
                 + "scale_out: {redis_url: 'redis://:hunter2@127.0.0.1:1/0'}\n")  # nothing listens on port 1
    r = _serve("--config", str(f), "--check")  # valid: that Redis does not answer from here is said, not failed
    assert r.returncode == 0 and "shared state: stats and GPU time via Redis" in r.stdout
    assert "warning: scale_out.redis_url: Redis at redis://:***@127.0.0.1:1/0 cannot be reached" in r.stdout
    assert "hunter2" not in r.stderr + r.stdout and r.stdout.rstrip().endswith("config OK")
    r = _serve("--config", str(f))  # serving it is an error
    assert r.returncode == 2 and "redis://:***@127.0.0.1:1/0 cannot be reached" in r.stderr and "hunter2" not in r.stderr


def test_check_without_a_config_describes_the_embedded_fleet_and_starts_nothing():
    r = _serve("--check")
    assert r.returncode == 0, r.stderr
    assert "embedded local fleet: one vLLM serving smollm2-135m-instruct" in r.stdout and "config OK" in r.stdout
    assert "step 1/3" not in r.stderr  # the embedded fleet's start-up never began


def test_files_and_directories_a_valid_config_refers_to_are_checked_before_serving(tmp_path):
    """A config can validate and still not start: a classifier head that is not there, a tokenizer folder
    without tokenizer.json (the prefix picker would hash characters instead, silently), a ledger or
    recording directory that cannot be made. `serve` exits 2 naming each field, with no traceback (a
    traceback from the app's assembly before); `--check` says them as warnings (they depend on where it runs)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "tok").mkdir()
    f = tmp_path / "gw.yaml"
    f.write_text(
        "pools:\n  - {name: small, models: [m1], replicas: ['http://127.0.0.1:9']}\n"
        "  - {name: large, models: [m2], replicas: ['http://127.0.0.1:9']}\n"
        "filters: [router, record]\n"
        f"record: {{dir: '{blocker}/traffic'}}\n"
        f"ledger: {{jsonl_path: '{blocker}/ledger.jsonl', journal_dir: '{tmp_path}/journal'}}\n"
        "routing:\n  virtual_models:\n"
        f"    - {{name: auto, small_pool: small, large_pool: large, router: classifier, classifier: {{head_path: '{tmp_path}/none.json'}}}}\n"
        f"  pickers:\n    small: {{kind: prefix, tokenizer: '{tmp_path}/tok'}}\n")
    r = _serve("--config", str(f), "--port", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "listening" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith(f"usefulwork: {f}: routing.virtual_models.0.classifier.head_path: ")
    assert "cannot read classifier head" in lines[0]
    assert lines[1] == f"usefulwork: {f}: routing.pickers.small.tokenizer: {tmp_path}/tok has no tokenizer.json (a model folder, or \"sim\")"
    assert lines[2].startswith(f"usefulwork: {f}: ledger.jsonl_path: cannot create {blocker}")
    assert lines[3].startswith(f"usefulwork: {f}: record.dir: cannot create {blocker}/traffic") and len(lines) == 4
    assert (tmp_path / "journal").is_dir()  # (what can be made, serving makes)
    r = _serve("--config", str(f), "--check")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("config OK")
    warned = [x for x in r.stdout.splitlines() if x.startswith("warning: ")]
    assert len(warned) == 4 and "ledger.jsonl_path" in warned[2] and "is not a directory" in warned[2]
    # the same config with every reference mended starts
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    text = f.read_text().replace(f"{blocker}/", f"{tmp_path}/ok/").replace(", router: classifier", "")
    f.write_text(text)
    r = _serve("--config", str(f), "--check")
    assert r.returncode == 0 and "warning" not in r.stdout, r.stdout


def test_port_0_says_the_port_it_listens_on(tmp_path):
    import re
    import signal
    import time

    import httpx

    f = tmp_path / "gw.yaml"
    f.write_text("pools:\n  - {name: p, models: [m], replicas: ['http://127.0.0.1:9']}\n")
    proc = subprocess.Popen([sys.executable, "-m", "usefulwork.cli", "serve", "--config", str(f), "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)/v1", line)
        assert m and int(m.group(1)) > 0, line
        deadline = time.monotonic() + 30
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{m.group(1)}/healthz", timeout=2).status_code == 200
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_each_redis_that_fails_open_is_named_at_start_not_at_first_use(tmp_path, redis_url):
    """admission's, the ledger's and the cache's Redis fail open by design (limits per process, records
    held, lookups missed): `--check` says per field whether it answers from here, and `serve` starts
    and says at once which does not, naming the field and what it does meanwhile; never the password."""
    import re
    import signal

    import httpx

    f = tmp_path / "gw.yaml"
    f.write_text("pools:\n  - {name: p, models: [m], replicas: ['http://127.0.0.1:9']}\n"
                 "filters: [admission]\n"
                 "admission: {redis_url: 'redis://:hunter2@127.0.0.1:1/0'}\n"  # nothing listens on port 1
                 f"ledger: {{redis_url: '{redis_url}', jsonl_path: '{tmp_path}/ledger.jsonl'}}\n")
    r = _serve("--config", str(f), "--check")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("config OK"), r.stderr
    assert ("warning: admission.redis_url: Redis at redis://:***@127.0.0.1:1/0 cannot be reached" in r.stdout
            and "(here; `serve` starts, and tenant limits are per process until it answers)" in r.stdout)
    assert "ledger.redis_url: reachable from here" in r.stdout and "hunter2" not in r.stdout + r.stderr
    proc = subprocess.Popen([sys.executable, "-m", "usefulwork.cli", "serve", "--config", str(f), "--port", "0"],
                            stderr=subprocess.PIPE, text=True)
    try:
        said = [proc.stderr.readline() for _ in range(2)]
        assert said[0].startswith("[usefulwork] warning: admission.redis_url: Redis at redis://:***@127.0.0.1:1/0 "
                                  "cannot be reached") and "serving, and tenant limits are per process" in said[0]
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)/v1", said[1])
        assert m, said
        r = httpx.get(f"http://127.0.0.1:{m.group(1)}/healthz", timeout=10)
        assert r.status_code == 200 and "hunter2" not in "".join(said)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
