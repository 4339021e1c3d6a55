"""The engine: scheduler, model runner, KV sources, speculative decoding; ``LLM`` in process,
``AsyncEngine`` under a server's event loop."""
from kvwire.engine.llm import LLM
from kvwire.engine.request import Completion, RequestOutput

__all__ = ["LLM", "Completion", "RequestOutput"]
