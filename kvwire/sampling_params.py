"""What a request asks for: SamplingParams, and the enums a request or its result names.

Torch-free (the tokenizer service imports it); the sampler itself is ``kvwire.sampler``.
``validate()`` raises ``kvwire.errors.InvalidRequest`` with a message a user can act on.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from kvwire.errors import InvalidRequest

MAX_SPECULATIVE_TOKENS = 16
# Smallest non-zero temperature accepted. Below it logits / temperature overflows float32 (3e-38 gave
# inf logits and NaN probabilities mid-generation); 0 already means greedy, which is what such a
# temperature asks for. vLLM warns below the same value.
MIN_TEMPERATURE = 1e-2


class SpeculativeMode(str, enum.Enum):
    """How decode proposes tokens ahead of the target model (output is the same either way)."""

    NONE = "none"  # one target forward per token
    DRAFT = "draft"  # a small draft model proposes
    NGRAM = "ngram"  # prompt lookup: continue the latest earlier occurrence of the last tokens


class FinishReason(str, enum.Enum):
    """Why generation ended."""

    STOP = "stop"  # an end-of-sequence or stop token (or, in tokenizer_svc, a stop string)
    LENGTH = "length"  # max_tokens reached


class KVSourceChoice(str, enum.Enum):
    """Where decode gets a prompt's KV pages from (kvwire.engine.kv_source)."""

    AUTO = "auto"  # the engine's policy: local for short prompts or when prefill_svc is unreachable
    LOCAL = "local"  # prefill in the decode process
    REMOTE = "remote"  # pull the pages from prefill_svc


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Speculative decoding; None = the engine's default. A string is turned into the enum.
    speculative: SpeculativeMode | None = None
    # Tokens proposed per step (an upper bound when the engine adapts it); None = engine default.
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative, str) and not isinstance(self.speculative, SpeculativeMode):
            try:
                object.__setattr__(self, "speculative", SpeculativeMode(self.speculative))
            except ValueError:
                pass  # left as given for validate() to refuse by name
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def validate(self) -> None:
        """Raise InvalidRequest with a message a user can act on."""
        if self.max_tokens <= 0:
            raise InvalidRequest(f"max_tokens must be positive, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0 and finite (0 = greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise InvalidRequest(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, "
                                 f"got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:  # also refuses NaN
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeMode):
            raise InvalidRequest(f"speculative must be one of {', '.join(m.value for m in SpeculativeMode)} "
                                 f"(or unset for the service default), got {self.speculative!r}")
        n = self.num_speculative_tokens
        if n is not None and not 1 <= n <= MAX_SPECULATIVE_TOKENS:
            raise InvalidRequest(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}] (unset = the "
                                 f"service default; speculative=none turns speculation off), got {n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def batch_aware(self) -> bool:
        """Whether this request's tokens may depend on the batch it decodes in, so speculation may
        follow the batch (measured prices, no proposals in large batches): greedy (its tokens are
        plain greedy's whatever is proposed) or sampled without a seed (nothing to reproduce). A
        seeded sampled request decides from its own tokens only: the same output in any batch."""
        return self.greedy or self.seed is None
