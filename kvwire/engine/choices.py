"""n > 1 choices: each one's first token, sampled from the one prefill's last logits.

Choice i samples with ``params.for_choice(i)`` (n = 1, seed + i when seeded), so choice 0 is what
the same request with n = 1 gives, and seeded choices are reproducible and draw from streams of
their own. Greedy choices are all the same tokens (vLLM does the same).
"""
from __future__ import annotations

import torch

from kvwire.engine.request import Request
from kvwire.logprobs import token_logprobs
from kvwire.sampler import sample_first


def sample_choices(logits: torch.Tensor, req: Request) -> int:
    """Token 0 of every choice of ``req`` from its prompt's last logits [vocab]: choice 0's is
    returned (its logprobs in ``req.first_logprobs`` when asked), choices 1..n-1's go to
    ``req.choice_firsts``."""
    firsts = []
    for i in range(req.params.n):
        params = req.params.for_choice(i) if req.params.n > 1 else req.params
        token = sample_first(logits, params, req.prompt, req.stops, req.grammar)  # a grammar only where n = 1
        lp = None if params.logprobs is None else token_logprobs(logits[None], [token], params.logprobs)[0]
        firsts.append((token, lp))
    (first, req.first_logprobs), req.choice_firsts = firsts[0], firsts[1:]
    return first
