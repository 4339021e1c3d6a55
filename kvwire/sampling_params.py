"""What a request asks for: SamplingParams, and the enums a request or its result names.

Torch-free (the tokenizer service imports it); the sampler itself is ``kvwire.sampler``.
``validate()`` raises ``kvwire.errors.InvalidRequest`` with a message a user can act on.
"""
from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, replace

from kvwire.errors import InvalidRequest

MAX_SPECULATIVE_TOKENS = 16
# Smallest non-zero temperature accepted. Below it logits / temperature overflows float32 (3e-38 gave
# inf logits and NaN probabilities mid-generation); 0 already means greedy, which is what such a
# temperature asks for. vLLM warns below the same value.
MIN_TEMPERATURE = 1e-2
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100] (clamped, as OpenAI does)
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_CHOICES = 16  # n: choices of one request (they share the prompt's KV pages)
MAX_STRUCTURED_CHARS = 64 << 10  # a schema, regex or grammar longer than this is refused (compile cost)
MAX_STRUCTURED_CHOICES = 256  # choices of a structured output's choice list


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
class TokenLogprobs:
    """One generated token's log-probability and the most likely tokens' at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


class StructuredKind(str, enum.Enum):
    """What constrains a request's output (kvwire.grammar compiles it to a token mask per step)."""

    JSON_SCHEMA = "json_schema"  # a JSON document valid against ``spec`` (a JSON Schema, as JSON text)
    JSON_OBJECT = "json_object"  # any JSON object (OpenAI's response_format json_object)
    REGEX = "regex"  # text matching ``spec`` in full
    CHOICE = "choice"  # exactly one of ``choices``
    GRAMMAR = "grammar"  # text of the EBNF grammar ``spec`` (xgrammar's / GBNF dialect, root rule ``root``)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the generated text; hashable (compiled grammars are cached per value)."""

    kind: StructuredKind
    spec: str = ""  # the schema / regex / grammar text; empty for json_object and choice
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.kind, str) and not isinstance(self.kind, StructuredKind):
            try:
                object.__setattr__(self, "kind", StructuredKind(self.kind))
            except ValueError:
                pass  # refused by name in validate()
        object.__setattr__(self, "choices", tuple(self.choices))

    def validate(self) -> None:
        """The checks that need no grammar engine; kvwire.grammar's compile finds the rest."""
        if not isinstance(self.kind, StructuredKind):
            raise InvalidRequest(f"structured output kind must be one of "
                                 f"{', '.join(k.value for k in StructuredKind)}, got {self.kind!r}")
        size = len(self.spec) + sum(len(c) for c in self.choices)
        if size > MAX_STRUCTURED_CHARS:
            raise InvalidRequest(f"structured output {self.kind.value} is {size} characters; at most "
                                 f"{MAX_STRUCTURED_CHARS} are accepted")
        if self.kind is StructuredKind.CHOICE:
            if not self.choices or len(self.choices) > MAX_STRUCTURED_CHOICES or not all(self.choices):
                raise InvalidRequest(f"structured output choice needs 1..{MAX_STRUCTURED_CHOICES} non-empty strings, "
                                     f"got {len(self.choices)}")
        elif self.kind in (StructuredKind.JSON_SCHEMA, StructuredKind.REGEX, StructuredKind.GRAMMAR) \
                and not self.spec.strip():
            raise InvalidRequest(f"structured output {self.kind.value} is empty")
        if self.kind is StructuredKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.spec)
            except ValueError as e:
                raise InvalidRequest(f"structured output json_schema is not valid JSON: {e}") from e
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest("structured output json_schema must be a JSON Schema object")


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
    # Logits processing (kvwire.logits_process), vLLM's and OpenAI's semantics. Penalties over the
    # generated tokens: logit -= frequency_penalty * count + presence_penalty * (count > 0).
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    # Over prompt + generated tokens, HF's rule: a positive logit is divided by it, a negative one multiplied.
    repetition_penalty: float = 1.0  # > 0; 1 = off
    min_p: float = 0.0  # [0, 1]: drop tokens below min_p x the most likely one's probability (after temperature)
    # token id -> added to its logit; values clamped to [-100, 100]. A dict is turned into sorted pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # stop tokens (stop_token_ids and EOS unless ignore_eos) are masked before this many
    # Log-probabilities: None = none; k >= 0 = the sampled token's and the k most likely ones' (k <= 20),
    # log_softmax of the model's raw logits (before penalties, bias and temperature, as vLLM's default).
    logprobs: int | None = None
    # The prompt's: None = none; k >= 0 = each prompt token's after the first, and the k most likely
    # at its position (k <= 20). Computed where the prompt is prefilled in decode, whole (no prefix reuse).
    prompt_logprobs: int | None = None
    # Choices: the prompt is prefilled once, then forked into n sequences sharing its KV pages;
    # choice i samples with ``for_choice(i)`` (seed + i when seeded: vLLM's rule).
    n: int = 1
    # The output must match this (kvwire.grammar: a token mask per step); None = unconstrained.
    # Constrained requests decode without speculation, and their prompt is prefilled by decode.
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative, str) and not isinstance(self.speculative, SpeculativeMode):
            try:
                object.__setattr__(self, "speculative", SpeculativeMode(self.speculative))
            except ValueError:
                pass  # left as given for validate() to refuse by name
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))

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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2.0 <= v <= 2.0):
                raise InvalidRequest(f"{name} must be in [-2, 2], got {v}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequest(f"repetition_penalty must be > 0 and finite (1 = off), got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:  # also refuses NaN
            raise InvalidRequest(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if any(not math.isfinite(b) for _, b in self.logit_bias):
            raise InvalidRequest("logit_bias values must be finite numbers")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidRequest("logit_bias names a token id twice")
        if self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequest(f"n must be in [1, {MAX_CHOICES}] (choices returned), got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise InvalidRequest(f"{name} must be in [0, {MAX_TOP_LOGPROBS}] (top log-probabilities per token), "
                                     f"got {k}")
        if self.structured is not None:
            self.structured.validate()
            if self.min_tokens:  # the grammar may allow nothing but a stop token, which min_tokens masks
                raise InvalidRequest("min_tokens cannot be combined with structured output (the grammar "
                                     "decides where the output ends)")
            if self.n != 1:  # one matcher per request; forked choices would share it
                raise InvalidRequest(f"n must be 1 with structured output, got {self.n}")

    def for_choice(self, i: int) -> SamplingParams:
        """Choice ``i``'s own params: n = 1, and its own seed stream, ``seed + i`` (vLLM's rule:
        choice 0 is what n = 1 gives with the same seed); unseeded choices draw independently."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + i)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processed(self) -> bool:
        """Whether the logits go through kvwire.logits_process before sampling (penalties, bias,
        min_tokens); requests without any of them skip it entirely."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def batch_aware(self) -> bool:
        """Whether this request's tokens may depend on the batch it decodes in, so speculation may
        follow the batch (measured prices, no proposals in large batches): greedy (its tokens are
        plain greedy's whatever is proposed) or sampled without a seed (nothing to reproduce). A
        seeded sampled request decides from its own tokens only: the same output in any batch."""
        return self.greedy or self.seed is None
