"""Reference generation: one sequence, prefill the prompt, then decode one token at a time.

The oracle the engine and the services are checked against (``kvwire.LLM`` is the engine). Works with any
cache that has ``prepare(ids, num_new) -> positions`` and the model's ``KVCache.attend`` (the
contiguous ``DenseKVCache`` or the paged FP8 cache).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from kvwire.kv.dense import DenseKVCache
from kvwire.model.model import Transformer
from kvwire.logits_process import RowContext, process
from kvwire.sampler import sample
from kvwire.errors import InvalidRequest
from kvwire.sampling_params import FinishReason, SamplingParams


@dataclass(frozen=True)
class Generated:
    token: int
    finish_reason: FinishReason | None  # None while going on; STOP (eos / stop token) or LENGTH at the end


def generate_stream(model: Transformer, prompt: list[int], params: SamplingParams,
                    eos_ids: Iterable[int] = (), cache=None, seq: int = 0) -> Iterator[Generated]:
    """Yield generated tokens one by one; the last one carries the finish reason."""
    params.validate()
    if not prompt:
        raise InvalidRequest("the prompt is empty")
    if cache is None:
        cache = DenseKVCache(model.cfg, num_slots=1, max_len=len(prompt) + params.max_tokens)
    stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_ids))
    output: list[int] = []
    tokens = torch.tensor(prompt, dtype=torch.int64)
    positions = cache.prepare([seq], [len(prompt)])
    logits = model(tokens, positions, cache, logits_rows=torch.tensor([len(prompt) - 1]))
    for step in range(params.max_tokens):
        row = process(logits[:1], [RowContext(params, prompt, output, stops)])[0]  # [vocab]
        tok = sample(row, params, step)
        output.append(tok)
        if tok in stops:
            yield Generated(tok, FinishReason.STOP)
            return
        if step == params.max_tokens - 1:
            yield Generated(tok, FinishReason.LENGTH)
            return
        yield Generated(tok, None)
        positions = cache.prepare([seq], [1])
        logits = model(torch.tensor([tok]), positions, cache)


def generate(model: Transformer, prompt: list[int], params: SamplingParams,
             eos_ids: Iterable[int] = (), cache=None) -> list[int]:
    return [g.token for g in generate_stream(model, prompt, params, eos_ids, cache)]
