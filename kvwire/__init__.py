"""kvwire, the library: ``from kvwire import LLM, SamplingParams`` for in-process generation;
config, model, KV pages, sampling, engine, serving, telemetry underneath.

``LLM`` loads lazily, so torch-free users (the tokenizer service) never import torch.
"""
from kvwire.sampling_params import FinishReason, KVSourceChoice, SamplingParams, SpeculativeMode

__all__ = ["LLM", "SamplingParams", "SpeculativeMode", "FinishReason", "KVSourceChoice"]


def __getattr__(name: str):
    if name == "LLM":
        from kvwire.engine.llm import LLM
        return LLM
    raise AttributeError(f"module 'kvwire' has no attribute {name!r}")
