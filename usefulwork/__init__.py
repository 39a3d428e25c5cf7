"""usefulwork: an OpenAI-compatible, cost-aware LLM gateway for vLLM fleets."""

__version__ = "0.1.0"
