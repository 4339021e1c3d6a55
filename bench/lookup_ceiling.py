"""How fast prompt lookup could be on these prompts at this machine's row prices: an upper bound.

``bench speculative`` measures what n-gram speculation gets; this says what it could get at best,
so a shortfall can be told apart from a policy that proposes badly. Replayed over plain greedy
outputs (what speculation must reproduce), with an oracle that knows the future: at each step it
proposes exactly the tokens of the lookup's continuation that greedy decoding will emit next (at
most ``k``), so no row is ever wasted on a rejected proposal, and pays the measured price of those
rows. Two lookups:

* ``latest``: the engine's (``kvwire.spec.ngram.ngram_match``: the longest suffix match, its
  latest occurrence), so the bound for any policy that sizes those proposals;
* ``any_match``: the best continuation among every earlier occurrence of the context's last token
  (as if every candidate could be verified at the price of one), a bound for smarter candidate choice.

speedup = tokens emitted / sum over steps of (1 + extra[proposals]) plain steps, the unit the
engine's own StepCost prices rows in; the first token (prefill) is not counted, as in the bench.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvwire.spec.ngram import ngram_match


def _agree(cont: Sequence[int], truth: Sequence[int]) -> int:
    n = 0
    while n < len(cont) and n < len(truth) and cont[n] == truth[n]:
        n += 1
    return n


def _best_any(ctx: np.ndarray, truth: Sequence[int], k: int) -> int:
    """The longest agreement with ``truth`` of the k tokens after any earlier occurrence of ctx[-1]."""
    best = 0
    for end in np.flatnonzero(ctx[:-1] == ctx[-1]):
        best = max(best, _agree(ctx[end + 1:end + 1 + k].tolist(), truth))
    return best


def ceiling(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], extra: Sequence[float], k: int,
            max_n: int = 16, min_n: int = 1, lookup: str = "latest") -> float:
    """pairs: (prompt, plain greedy output incl. its first token); extra[i]: what i proposals add
    to a plain step (extra[0] = 0, at least k + 1 entries) -> the oracle's speedup over plain decoding."""
    if len(extra) <= k:
        raise ValueError(f"extra needs {k + 1} prices, got {len(extra)}")
    if lookup not in ("latest", "any_match"):
        raise ValueError(f"lookup must be 'latest' or 'any_match', got {lookup!r}")
    tokens, cost = 0, 0.0
    for prompt, out in pairs:
        g = 1  # tokens of the output already there: the first came with the prompt
        while g < len(out):
            ctx = list(prompt) + list(out[:g])  # ends with the token about to be fed
            truth = out[g:len(out) - 1]  # the step's last token is the correction / bonus, never proposed
            if lookup == "latest":
                n, start = ngram_match(ctx, max_n, min_n)
                m = _agree(ctx[start:start + k], truth) if n else 0
            else:
                m = _best_any(np.asarray(ctx), truth, k)
            tokens += m + 1
            cost += 1.0 + extra[m]
            g += m + 1
    return tokens / cost if cost else 1.0
