"""Prompt lookup (n-gram) proposals: the longest earlier match of the context's suffix, and how
many of the tokens that followed it are worth verifying.

The context is the whole sequence, prompt + generated, so text the model repeats from its own
output is found as well as quoted text. No model and no state beyond the request's lookup cache.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvwire.spec.proposer import Proposal

if TYPE_CHECKING:
    from kvwire.engine.request import Request
    from kvwire.spec.config import SpecConfig


def ngram_match(tokens: Sequence[int], max_n: int, min_n: int = 1) -> tuple[int, int]:
    """(n, start): the longest suffix of ``tokens`` (at most ``max_n`` tokens) that occurred
    earlier with at least one token after it, at its latest such place; ``start`` indexes the
    token that followed it. (0, 0) when no suffix of ``min_n`` tokens or more occurred earlier."""
    if max_n < 1 or len(tokens) < 2:
        return 0, 0
    arr = np.asarray(tokens, dtype=np.int64)
    ends = np.flatnonzero(arr[:-1] == arr[-1])  # earlier occurrences of the last token, followed by one
    if ends.size == 0:
        return (0, 0)
    n = 1
    while n < max_n:  # keep the ends whose match grows one token further back
        longer = ends[ends >= n]
        longer = longer[arr[longer - n] == arr[-1 - n]]
        if longer.size == 0:
            break
        ends, n = longer, n + 1
    return (n, int(ends[-1]) + 1) if n >= min_n else (0, 0)


def ngram_propose(tokens: Sequence[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Prompt lookup: the up to ``k`` tokens that followed the latest earlier occurrence of the
    longest suffix (``max_n`` down to ``min_n`` tokens) of ``tokens`` (ending with the token about
    to be fed); [] if none."""
    if k <= 0:
        return []
    n, start = ngram_match(tokens, max_n, min_n)
    return list(tokens[start:start + k]) if n else []


def best_length(accept: Sequence[float], extra: Sequence[float]) -> tuple[int, float]:
    """The i in 0..len(accept) that makes the most tokens per unit of time, and that rate:
    (1 + p_1 + p_1 p_2 + .. + p_1 .. p_i) / (1 + ``extra[i]``), with ``accept[j - 1]`` = p_j the
    chance proposal j is accepted once those before it were, ``extra[i]`` what i proposals add to a
    plain step (``extra[0]`` = 0; i is cut at len(extra) - 1)."""
    best, best_rate, expected, p = 0, 1.0, 1.0, 1.0
    for i, a in enumerate(accept[:len(extra) - 1], 1):
        p *= a
        expected += p  # tokens a step emits, on average, with i proposals
        rate = expected / (1.0 + extra[i])
        if rate > best_rate:
            best, best_rate = i, rate
    return best, best_rate


def lookup_length(n: int, extra: Sequence[float], miss: float) -> int:
    """How many of the tokens after a suffix match of ``n`` tokens to propose: ``best_length``
    with every proposal accepted with chance s = 1 - ``miss`` / n (a longer match predicts its
    continuation better: see docs/decisions/021-ngram-sizing.md). ``extra``: what 0..k proposals
    add to a plain step. So nothing after a short match, more after a longer one or cheaper rows."""
    k = len(extra) - 1
    if n <= 0 or k <= 0:
        return 0
    return best_length([1.0 - miss / n] * k, extra)[0]


def lookup(req: Request, cfg: SpecConfig) -> tuple[int, int]:
    """``ngram_match`` over ``req``'s context, computed once per context (its length: the context
    only grows) however often a step asks (a draft head's request: up to three times)."""
    s = req.spec
    key = (len(req.context), cfg.ngram_max, cfg.ngram_min)
    if s.lookup is None or s.lookup[0] != key:
        s.lookup = (key, ngram_match(req.context, cfg.ngram_max, cfg.ngram_min))
    return s.lookup[1]


def ngram_proposal(req: Request, k: int, cfg: SpecConfig) -> list[int]:
    """The lookup's proposal for ``req``: at most ``k`` tokens, as many as pay (adaptive)."""
    n, start = lookup(req, cfg)
    if cfg.adaptive:
        k = lookup_length(n, req.spec.costs[:k + 1], cfg.tuned.ngram_miss)
    return req.context[start:start + k] if n and k > 0 else []


class NgramProposer:
    """Prompt lookup as a ``Proposer``: reads token ids only, keeps nothing per sequence."""

    max_positions = 1 << 62

    def propose(self, reqs: Sequence[Request], ks: Sequence[int], cfg: SpecConfig) -> list[Proposal]:
        return [Proposal(ngram_proposal(r, k, cfg)) for r, k in zip(reqs, ks)]

    def cost(self, batch: int) -> float | None:
        return None

    def verified(self, req: Request, emitted: int) -> None:
        pass

    def free(self, seq: int) -> None:
        pass
