"""The token sampler (greedy, temperature, min-p, top-k, top-p, seeded).

Penalties, logit bias and min_tokens change the logits before they get here (kvwire.logits_process).

Reproducible across processes: the randomness for the i-th generated token of a request comes from
a generator seeded by (seed, i), so prefill_svc can sample token 0 and decode_svc tokens 1.. and the
result equals in-process generation with the same seed, with no generator state on the wire.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvwire.logits_process import RowContext, process
from kvwire.sampling_params import SamplingParams
from kvwire_kernels import cpu as cpu_kernels

if TYPE_CHECKING:
    from kvwire.grammar import Matcher

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) over the seed space
# Tuned: the most likely tokens searched first for the top-p nucleus (then 4x as many), against a
# full sort of the vocabulary; see docs/decisions/045-sampler-cpu-paths.md.
NUCLEUS_FIRST_K = 64


def step_generator(seed: int | None, step: int) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed((seed * _SEED_MIX + step) % (1 << 63))
    return g


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [vocab] -> the sampling distribution [vocab] after temperature, min-p, top-k and
    top-p, in vLLM's order (min-p reads the tempered distribution before top-k and top-p cut it)."""
    logits = logits.float() / params.temperature
    if params.min_p > 0.0:
        logits = min_p_filter(logits, params.min_p)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = nucleus(probs, params.top_p)
    return probs


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """logits [..., vocab] -> the same with -inf where a token's probability is below ``min_p``
    times the most likely token's (HF's MinPLogitsWarper, vLLM's min_p). Compared in log space:
    logit - max < log(min_p), so no softmax is needed; the most likely token always stays."""
    top = logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill(logits - top < math.log(min_p), float("-inf"))


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [vocab] -> the top-p nucleus, renormalised: the smallest prefix of the tokens in
    descending probability whose mass reaches ``top_p`` (the token that crosses it included), zero
    elsewhere. Searched among the ``NUCLEUS_FIRST_K`` most likely tokens, then 4x as many, before
    all of them: a nucleus found within the top k is the one a full sort finds (the cumulative mass
    only grows, so every token after the first dropped one is dropped too)."""
    n, k = probs.shape[-1], min(NUCLEUS_FIRST_K, probs.shape[-1])
    while True:
        top, order = torch.topk(probs, k)  # [k], descending
        drop = (top.cumsum(-1) - top) >= top_p  # the mass before a token already reaches top_p
        if k == n or bool(drop[-1]):
            break
        k = min(n, 4 * k)
    out = torch.zeros_like(probs).scatter_(-1, order, top.masked_fill(drop, 0.0))
    return out / out.sum()


def argmax(logits: torch.Tensor) -> list[int] | int:
    """The greedy choice: the index of the largest logit (the first one on ties), per row of
    ``logits`` [..., vocab]. fp32 CPU rows go through numpy, whose argmax is vectorized (see
    docs/decisions/045-sampler-cpu-paths.md). Both take the first maximum, so the choice is the
    same either way."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        out = logits.numpy().argmax(-1)
    else:
        out = torch.argmax(logits, dim=-1).cpu().numpy()
    return out.tolist()


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One index of ``probs`` [n] (non-negative weights, any positive total) with probability
    proportional to its weight, from a single uniform of ``generator``: the inverse of the
    cumulative distribution, summed in float64, where ``torch.multinomial`` draws one exponential
    per entry (see docs/decisions/045-sampler-cpu-paths.md). A zero weight is never drawn."""
    cdf = probs.detach().to("cpu", torch.float64).cumsum(0)  # [n]
    total = float(cdf[-1])
    if not math.isfinite(total) or total <= 0.0:
        raise ValueError(f"cannot sample from weights that sum to {total} (NaN, inf or all zero)")
    u = uniform(generator) * total
    i = int(torch.searchsorted(cdf, u, right=True))  # the first index whose cumulative weight exceeds u
    return i if i < cdf.shape[0] else int(torch.searchsorted(cdf, total))  # u rounded up to the total


def uniform(generator: torch.Generator) -> float:
    """The one float64 uniform in [0, 1) a draw takes (``draw`` and the C kernel alike)."""
    return float(torch.rand((), dtype=torch.float64, generator=generator))


def plain_temperature(logits: torch.Tensor, params: SamplingParams) -> bool:
    """Whether ``sample`` draws this row with the C kernel: temperature alone (no top-k, top-p or
    min-p; the OpenAI API's default), fp32 [vocab] logits on the CPU, the kernels built."""
    return (not params.greedy and params.min_p == 0.0 and params.top_p >= 1.0
            and not (params.top_k and params.top_k < logits.shape[-1]) and logits.device.type == "cpu"
            and logits.dtype == torch.float32 and logits.dim() == 1 and logits.is_contiguous()
            and cpu_kernels.available())


def sample(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """logits [vocab] -> one token id; ``step`` is the index of the token among generated ones."""
    return sample_rows([logits], [params], [step])[0]


def sample_rows(rows: Sequence[torch.Tensor], params: Sequence[SamplingParams], steps: Sequence[int]) -> list[int]:
    """``sample`` for each row [vocab] (a decode step's requests): greedy rows by argmax; rows at a
    plain temperature in one call of the C kernel (``kvwire_kernels.cpu.sample_rows``: the weights
    exp((x - max) / T) summed in double without a float64 copy and cumulative sum of the vocabulary;
    4x faster a row, the rows split over the threads; docs/decisions/045-sampler-cpu-paths.md); the
    rest through ``probabilities`` and ``draw``. Every draw takes the same uniform (``uniform``), so a
    row's token does not depend on the path beyond float rounding at a boundary of the distribution."""
    out: list[int | None] = [None] * len(rows)
    plain = []
    for i, (row, p, step) in enumerate(zip(rows, params, steps)):
        if p.greedy:
            out[i] = argmax(row)
        elif plain_temperature(row, p):
            plain.append(i)
        else:
            out[i] = draw(probabilities(row, p), step_generator(p.seed, step))
    if plain:
        got = cpu_kernels.sample_rows([rows[i] for i in plain], [params[i].temperature for i in plain],
                                      [uniform(step_generator(params[i].seed, steps[i])) for i in plain])
        for i, token in zip(plain, got):
            out[i] = token
    return out  # type: ignore[return-value]


def sample_first(logits: torch.Tensor, params: SamplingParams, prompt: list[int], stops: frozenset[int],
                 grammar: Matcher | None = None) -> int:
    """Token 0 of a request from its prompt's last logits [vocab]: processed first (the repetition
    penalty sees the prompt; min_tokens holds ``stops`` back), wherever it is sampled; then masked
    by ``grammar`` (params.structured's matcher), which accepts the token."""
    if params.processed:
        logits = process(logits[None], [RowContext(params, prompt, (), stops)])[0]  # [vocab]
    if grammar is None:
        return sample(logits, params, 0)
    token = sample(grammar.mask(logits), params, 0)
    grammar.accept(token)
    return token
