"""Sampling parameters and the token sampler (greedy, temperature, top-k, top-p, seeded).

Reproducible across processes: the randomness for the i-th generated token of a request comes from
a generator seeded by (seed, i), so prefill_svc can sample token 0 and decode_svc tokens 1.. and the
result equals in-process generation with the same seed, with no generator state on the wire.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step) over the seed space
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


def step_generator(seed: int | None, step: int) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed((seed * _SEED_MIX + step) % (1 << 63))
    return g


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [vocab] -> the sampling distribution [vocab] after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it included).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """logits [vocab] -> one token id; ``step`` is the index of the token among generated ones."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = probabilities(logits, params)
    return int(torch.multinomial(probs, 1, generator=step_generator(params.seed, step)))
