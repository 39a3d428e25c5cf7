"""vllm-sim: a simulated vLLM server for GPU what-if planning and multi-replica tests.

- ``catalog.build_spec`` resolves hardware/model/precision/tp/profile (+ vLLM flag overrides).
- ``engine.SimEngine`` is the engine on a virtual clock (deterministic; tests and calibration).
- ``server.build_server`` gives the Starlette app (vLLM's OpenAI API, /health, /metrics).
- ``process.SimProcess`` runs ``usefulwork sim`` as a subprocess (fleets for load tests).
"""
