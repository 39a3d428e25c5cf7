"""`usefulwork serve` with no config (the README's main job): local vLLM + gateway on a real process."""

import openai
import pytest

pytestmark = pytest.mark.vllm


def test_embedded_fleet_serves_openai_clients(embedded_fleet):
    client = openai.OpenAI(base_url=embedded_fleet.gateway_url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
    r = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=5,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert r.usage.completion_tokens > 0
    log = embedded_fleet.log_text()
    assert "step 1/3" in log and "step 2/3" in log and "step 3/3" in log, "set-up progress must be shown"


def test_sigterm_during_vllm_start_stops_everything(tmp_path):
    """SIGTERM (as systemd or Kubernetes send it) mid start-up: exit 0, and no vLLM left behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import free_port

    port = free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "usefulwork.cli", "serve", "--port", str(free_port()),
                             "--vllm-log", str(tmp_path / "vllm.log")], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env={**os.environ, "USEFULWORK__LOCAL_FLEET__PORT": str(port)})
    deadline = time.monotonic() + 120
    while "step 2/3" not in log.read_text() and time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        time.sleep(0.2)
    time.sleep(2)  # vLLM's processes are up and loading
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log.read_text()
    time.sleep(1)
    leftovers = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"vLLM processes left running after SIGTERM: {leftovers}"
