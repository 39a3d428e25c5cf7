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
