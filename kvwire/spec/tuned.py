"""The speculative policy's tuned constants, in one place. Each was fitted or measured on one
machine; the measurement is in the decision doc named beside it, not here."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tuned:
    # the first verification of an adaptive draft model's request (adapt_k grows it):
    # see docs/decisions/020-speculative-policy.md
    first_k: int = 2
    # lookup_length: after an n-token match each next token is right with probability ~ 1 - ngram_miss / n:
    # see docs/decisions/021-ngram-sizing.md
    ngram_miss: float = 1.0
    # auto-off: verifications (real or shadow) before deciding to turn off or on: see docs/decisions/020-speculative-policy.md
    probe_steps: int = 8
    # weight of the newest verification in the running means of tokens and cost: docs/decisions/020-speculative-policy.md
    ema: float = 0.125
    # shadow tokens over cost needed to turn n-gram speculation back on (hysteresis): docs/decisions/020-speculative-policy.md
    on_gain: float = 1.1
    # plain steps before a draft request probes again (0: never): see docs/decisions/020-speculative-policy.md
    off_steps: int = 32
    # plain steps added per proposed token, n-gram (verification rows only): docs/decisions/022-row-costs.md
    ngram_cost: float = 0.3
    # plain steps added per proposed token, draft model (rows + drafting): see docs/decisions/022-row-costs.md
    draft_cost: float = 0.6
    # a draft head's proposal on top of its row, until measured: see docs/decisions/023-draft-head.md
    head_cost: float = 0.025
    # a draft head's request whose context ends with an earlier match this long quotes it instead of
    # drafting: see docs/decisions/023-draft-head.md
    head_skip_match: int = 4
    # batch-aware n-gram requests price rows from the runner's timings (StepCost): docs/decisions/022-row-costs.md
    measure_cost: bool = True
