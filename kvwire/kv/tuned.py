"""Tuned constants of the KV cache code."""
from __future__ import annotations

# Above this many new tokens after context, one sequence's queries attend through dequantize + sdpa:
# the one-row-per-query kernel call gathers the sequence's pages once per query, the dequantized
# copy once for all of them. Chosen by reasoning, not measured: speculative verifications and short
# chunks stay on the exact paged path.
MAX_PAGED_QUERIES = 64
