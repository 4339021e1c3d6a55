"""One validation of a generation request, shared by every service and the in-process engine.

tokenizer_svc checks what it knows (vocabulary, sampling) before calling decode; decode and
prefill check the model's limits too. Same rule, same message, wherever a request enters.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvwire.errors import InvalidRequest, never_fits
from kvwire.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_context: int | None = None  # the model's max_position_embeddings; None = not checked here


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"{what} has token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")


def validate_request(prompt: Sequence[int], params: SamplingParams | None, limits: RequestLimits,
                     what: str = "prompt_token_ids", new_tokens: int | None = None) -> None:
    """Raise InvalidRequest unless ``prompt`` + ``params`` can run under ``limits``.

    ``new_tokens``: positions the request may add after the prompt (default params.max_tokens;
    prefill adds none)."""
    if not prompt:
        raise InvalidRequest(f"{what} is empty: send at least one token")
    if params is not None:
        params.validate()
        check_token_ids(params.stop_token_ids, limits.vocab_size, "sampling.stop_token_ids")
        check_token_ids([t for t, _ in params.logit_bias], limits.vocab_size, "sampling.logit_bias")
    check_token_ids(prompt, limits.vocab_size, what)
    if limits.max_context is not None:
        extra = new_tokens if new_tokens is not None else (params.max_tokens if params is not None else 0)
        if len(prompt) + extra > limits.max_context:
            raise never_fits(f"prompt ({len(prompt)} tokens) + max_tokens ({extra}) exceeds the model's "
                             f"context of {limits.max_context} tokens")
