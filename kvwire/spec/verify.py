"""Verification: which of a step's proposals come out, given the target's logits over them.

The target scores [t, d_1 .. d_k] in one forward pass: row i of its logits is p_i, the target's
distribution for the token after d_i (row 0: after t). For i = 1..k in order:

  greedy:   accept d_i while d_i == argmax p_{i-1}; at the first mismatch emit argmax p_{i-1} and
            stop. Every emitted token is the target's argmax given exactly the tokens before it,
            so the output equals non-speculative greedy decoding token for token.
  sampling: draw u ~ U[0, 1); accept d_i if u < min(1, p_{i-1}(d_i) / q_{i-1}(d_i)), q the
            distribution d_i was drawn from. On rejection emit a sample from the residual
            max(0, p_{i-1} - q_{i-1}) normalised, and stop (Leviathan et al. 2023, Chen et al.
            2023: the emitted token is then distributed exactly as p_{i-1}). For n-gram proposals
            q is a point mass on d_i: accept with probability p_{i-1}(d_i); the residual is
            p_{i-1} without d_i, renormalised.
  all k accepted: a bonus token from p_k (argmax when greedy).

p and q are the *processed* distributions (temperature, top-k, top-p: ``kvwire.sampler.probabilities``).
Every random draw derives from (seed, index of the generated token), as in ``kvwire.sampler``, so
a seeded request gives the same tokens whatever it was batched with.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvwire.sampler import argmax, draw, probabilities, sample, sample_rows, step_generator
from kvwire.sampling_params import SamplingParams

_DRAFT_SALT = 0x5EC0_D4AF_7000  # separates the draft's proposal draws from the target's draws


def draft_generator(seed: int | None, step: int) -> torch.Generator:
    """The generator the draft samples its proposal for generated token ``step`` with."""
    return step_generator(None if seed is None else seed ^ _DRAFT_SALT, step)


def accept_greedy(target_logits: torch.Tensor, proposed: Sequence[int]) -> list[int]:
    """target_logits: [k + 1, vocab] for [t, d_1..d_k] -> the emitted tokens (1..k + 1)."""
    out = []
    for d, best in zip([*proposed, None], argmax(target_logits)):  # the very argmax plain decoding takes
        out.append(best)
        if best != d:
            return out
    return out


def accept_sampled(target_logits: torch.Tensor, proposed: Sequence[int], draft_probs: torch.Tensor | None,
                   params: SamplingParams, first_step: int) -> list[int]:
    """target_logits: [k + 1, vocab]; draft_probs: [k, vocab] (the q each d_i was drawn from) or
    None for point-mass (n-gram) proposals; ``first_step``: the generated-token index of d_1.
    Returns the emitted tokens (1..k + 1)."""
    out = []
    for i, d in enumerate(proposed):
        p = probabilities(target_logits[i], params)  # [vocab]
        g = step_generator(params.seed, first_step + i)
        u = float(torch.rand((), generator=g))
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if u * q_d < float(p[d]):  # u < p/q without dividing; q_d > 0 since d was drawn from q
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        total = float(residual.sum())
        # Rejection has probability sum(residual); a zero residual means rounding rejected a sure
        # acceptance, and p itself is then the right distribution.
        residual = residual / total if total > 0 else p
        out.append(draw(residual, g))
        return out
    out.append(sample(target_logits[len(proposed)], params, first_step + len(proposed)))
    return out


def verify(target_logits: torch.Tensor, proposed: Sequence[int], q: torch.Tensor | None,
           params: SamplingParams, first_step: int) -> list[int]:
    """The tokens a step emits for one request: target_logits [k + 1, vocab] over [t, *proposed]."""
    if not proposed:
        return [sample(target_logits[-1], params, first_step)]
    if params.greedy:
        return accept_greedy(target_logits, proposed)
    return accept_sampled(target_logits, proposed, q, params, first_step)


def verify_batch(target_logits: Sequence[torch.Tensor], proposed: Sequence[Sequence[int]],
                 qs: Sequence[torch.Tensor | None], params: Sequence[SamplingParams],
                 first_steps: Sequence[int]) -> list[list[int]]:
    """``verify`` for every request of a step; the requests that proposed nothing draw their one
    token together (``sample_rows``: one kernel call for the rows at a plain temperature)."""
    alone = [i for i, p in enumerate(proposed) if not p]
    drawn = dict(zip(alone, sample_rows([target_logits[i][-1] for i in alone], [params[i] for i in alone],
                                        [first_steps[i] for i in alone])))
    return [[drawn[i]] if i in drawn else verify(target_logits[i], proposed[i], qs[i], params[i], first_steps[i])
            for i in range(len(proposed))]


def draft_sample(draft_logits: torch.Tensor, params: SamplingParams, step: int,
                 support: torch.Tensor | None = None, vocab: int = 0) -> tuple[int, torch.Tensor | None]:
    """The draft's proposal for generated token ``step`` and the distribution q it came from
    (None when greedy: verification then checks argmax equality). ``support``: the token ids of
    ``draft_logits``'s entries when the draft scores part of the vocabulary (a draft head's):
    temperature, top-k, top-p and the draw run over that part, and q is returned over the whole
    ``vocab``, zero outside it (what verification reads)."""
    if params.greedy:
        best = argmax(draft_logits)
        return (best if support is None else int(support[best])), None
    q = probabilities(draft_logits, params)  # [len(draft_logits)]
    i = draw(q, draft_generator(params.seed, step))
    if support is None:
        return i, q
    full = torch.zeros(vocab, dtype=q.dtype, device=q.device)
    full[support] = q
    return int(support[i]), full
