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
