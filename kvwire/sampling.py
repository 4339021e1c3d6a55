"""Sampling parameters: what a request asks for, validated with messages a user can act on.

Torch-free (the tokenizer service imports it); the sampler itself is ``kvwire.sampler``.
"""
from __future__ import annotations

from dataclasses import dataclass

SPECULATIVE_MODES = ("none", "draft", "ngram")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Speculative decoding (decode_svc): "none" | "draft" | "ngram"; None = the service's default.
    speculative: str | None = None
    # Tokens proposed per step (an upper bound when the service adapts it); None = service default.
    num_speculative_tokens: int | None = None

    def validate(self) -> None:
        """Raise ValueError with a message a user can act on."""
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.speculative is not None and self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)} (or unset for the "
                             f"service default), got {self.speculative!r}")
        n = self.num_speculative_tokens
        if n is not None and not 1 <= n <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}] (unset = the "
                             f"service default; speculative=none turns speculation off), got {n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
