"""SpecConfig: the engine's speculative decoding defaults, as a user sets them (decode_svc's flags,
``LLM``'s keywords). The policy it drives is in ``kvwire.spec.state``; its tuned constants in
``kvwire.spec.tuned``."""
from __future__ import annotations

from dataclasses import dataclass

from kvwire.sampling_params import SpeculativeMode
from kvwire.spec.tuned import Tuned


@dataclass(frozen=True)
class SpecConfig:
    mode: SpeculativeMode = SpeculativeMode.NONE  # what a request's speculative=None means
    num_tokens: int = 4  # k when a request does not set num_speculative_tokens
    adaptive: bool = True  # n-gram: lookup_length per step; draft model: adapt_k; head: best_length
    auto_off: bool = True  # a request stops speculating while it does not pay (kvwire.spec.state.record)
    # batch-aware requests (greedy, unseeded sampled) speculate only in steps of at most this many requests
    # (0: any); seeded sampled ones keep a batch-independent policy: see docs/decisions/024-greedy-max-batch.md
    greedy_max_batch: int = 2
    ngram_max: int = 16  # n-gram lookup tries suffixes of ngram_max .. ngram_min tokens
    ngram_min: int = 1
    tuned: Tuned = Tuned()

    def break_even(self, mode: SpeculativeMode) -> float:
        """Plain steps one proposed token of ``mode`` adds, at the configured price."""
        return self.tuned.draft_cost if mode is SpeculativeMode.DRAFT else self.tuned.ngram_cost
