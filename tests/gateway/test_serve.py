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
