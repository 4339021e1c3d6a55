"""Log-probabilities of generated tokens: log_softmax of the model's raw logits (before penalties,
logit_bias and temperature: vLLM's default ``raw_logprobs``), computed only for the rows of
requests that ask (``SamplingParams.logprobs``)."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvwire.sampling_params import TokenLogprobs


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprobs]:
    """logits [n, vocab] (row i: the distribution ``tokens[i]`` was chosen from; n >= len(tokens))
    -> each token's logprob and the ``k`` most likely tokens' (most likely first)."""
    rows = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)  # [len(tokens), vocab]
    chosen = rows.gather(1, torch.tensor(tokens, dtype=torch.int64)[:, None])[:, 0].tolist()  # [len(tokens)]
    if k:
        top = torch.topk(rows, k, dim=-1)  # values, indices: [len(tokens), k]
        tops = [tuple(zip(ids, vals)) for ids, vals in zip(top.indices.tolist(), top.values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprobs(t, lp, top) for t, lp, top in zip(tokens, chosen, tops)]
