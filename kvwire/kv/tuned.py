"""Tuned constants of the KV cache code."""
from __future__ import annotations

# Above this many new tokens after context, one sequence's queries attend through dequantize + sdpa:
# the one-row-per-query kernel call gathers the sequence's pages once per query, the dequantized
# copy once for all of them. Chosen by reasoning, not measured: speculative verifications and short
# chunks stay on the exact paged path.
MAX_PAGED_QUERIES = 64

# Prompt attention takes the C flash kernel on CPU at head_dim 64 and below at any length; at
# head_dim 128 only up to this many keys, beyond which torch's sdpa is as fast
# (docs/decisions/061-prefill-attention.md).
PREFILL_KERNEL_MAX_KEYS_D128 = 1024
