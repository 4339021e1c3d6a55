"""Logits processing before sampling: min_tokens, logit_bias, then repetition, frequency and presence
penalties (vLLM's order and semantics), batched over the rows of a step.

Each row names what it depends on (``RowContext``: the request's params, prompt, the tokens
generated before the row's token, the stop ids): the same row gives the same logits whether token 0
is sampled by prefill_svc or by decode, in any batch, after a preemption's replay, or as row i of a
speculative verification (its history then ends with the first i proposals), so greedy stays exact
and sampled output keeps its distribution. Rows whose params need nothing
(``SamplingParams.processed`` false) are neither copied nor touched; the processed ones are
gathered into one [n, vocab] block and changed with a few tensor ops over per-row tensors, touching
only the entries their histories and biases name (the Python loops run over requests and their
token histories, never over the vocabulary).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvwire.sampling_params import MAX_LOGIT_BIAS, SamplingParams


@dataclass(frozen=True)
class RowContext:
    """What one logits row's processing reads."""

    params: SamplingParams
    prompt: Sequence[int]
    output: Sequence[int]  # the generated tokens before the one this row samples
    stops: frozenset[int] = frozenset()  # ids min_tokens holds back (stop_token_ids, plus EOS unless ignore_eos)


def _index(histories: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs of every token of every history: two [total] int64 tensors."""
    rows = torch.repeat_interleave(torch.arange(len(histories)), torch.tensor([len(h) for h in histories]))
    cols = torch.tensor([t for h in histories for t in h], dtype=torch.int64)
    return rows, cols


def apply(logits: torch.Tensor, ctx: Sequence[RowContext]) -> torch.Tensor:
    """logits [n, vocab] -> the processed logits [n, vocab] (float32, a new tensor), every row processed.
    Work is proportional to the rows' histories and biases, not to the vocabulary: each step reads and
    writes only the (row, token) entries a history or a bias names."""
    out = logits.float().clone()  # [n, vocab]
    vocab = out.shape[1]
    # min_tokens: stop tokens cannot come before the min_tokens-th generated token
    held = [sorted(c.stops) if len(c.output) < c.params.min_tokens else [] for c in ctx]
    if any(held):
        out[_index(held)] = float("-inf")
    bias = [c.params.logit_bias for c in ctx]
    if any(bias):
        rows, cols = _index([[t for t, _ in b] for b in bias])
        values = torch.tensor([v for b in bias for _, v in b], dtype=torch.float32)
        out.index_put_((rows, cols), values.clamp(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS), accumulate=True)
    rep = [c.params.repetition_penalty for c in ctx]
    if any(r != 1.0 for r in rep):  # HF's rule on every (row, token) seen; a repeated token gets the same value
        rows, cols = _index([[*c.prompt, *c.output] if r != 1.0 else [] for c, r in zip(ctx, rep)])
        seen, penalty = out[rows, cols], torch.tensor(rep, dtype=torch.float32)[rows]  # [total] each
        out[rows, cols] = torch.where(seen > 0, seen / penalty, seen * penalty)
    freq = torch.tensor([c.params.frequency_penalty for c in ctx], dtype=torch.float32)  # [n]
    pres = torch.tensor([c.params.presence_penalty for c in ctx], dtype=torch.float32)  # [n]
    if bool(freq.any() or pres.any()):
        rows, cols = _index([c.output for c in ctx])
        if bool(freq.any()):  # once per occurrence: count x frequency_penalty
            out.index_put_((rows, cols), -freq[rows], accumulate=True)
        if bool(pres.any()):  # once per distinct token
            distinct = torch.unique(rows * vocab + cols)
            out.index_put_((distinct // vocab, distinct % vocab), -pres[distinct // vocab], accumulate=True)
    return out


def process(logits: torch.Tensor, ctx: Sequence[RowContext]) -> torch.Tensor:
    """logits [rows, vocab] -> the logits to sample from [rows, vocab]: ``logits`` itself when no
    row needs processing, else a float32 copy whose processed rows are replaced."""
    idx = [i for i, c in enumerate(ctx) if c.params.processed]
    if not idx:
        return logits
    out = logits.float().clone() if len(idx) < len(ctx) else None
    done = apply(logits[idx], [ctx[i] for i in idx])  # [len(idx), vocab]
    if out is None:
        return done
    out[idx] = done
    return out
