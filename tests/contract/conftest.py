"""The API contract suite runs every test against the simulator AND the real local vLLM.

`server` is parametrized: "sim" is a real `usefulwork sim` subprocess with the `cpu` profile (the
simulated twin of the local vLLM: same model name, tokenizer, max_model_len, block size); "vllm" is
the session's real vLLM server (tests/conftest.py). A server that cannot start FAILS the tests.
"""

from __future__ import annotations


import pytest

from tests.conftest import MODEL_NAME, VLLMServer, free_port



@pytest.fixture(scope="session")
def sim_server(tmp_path_factory) -> VLLMServer:
    from usefulwork.backends.model import ensure_model
    from usefulwork.backends.sim.process import SimProcess

    ensure_model()  # the sim counts tokens with the converted SmolLM2 tokenizer, like the real server
    log = tmp_path_factory.mktemp("sim") / "sim.log"
    sim = SimProcess(gpu=None, model=None, profile="cpu", served_name=MODEL_NAME, port=free_port(),
                     time_scale=20.0, seed=0, log_path=log)
    sim.start()
    try:
        sim.wait_ready(timeout_s=60)
    except Exception as exc:  # a component that cannot run is a failure, not a skip
        sim.stop()
        pytest.fail(f"usefulwork sim could not start: {exc}")
    yield VLLMServer(sim.base_url, MODEL_NAME)
    sim.stop()


@pytest.fixture(params=["sim", "vllm"])
def server(request) -> VLLMServer:
    return request.getfixturevalue("sim_server" if request.param == "sim" else "vllm_server")
