"""A request's state inside the engine, and what the engine hands back after a step.

Plain Python (no tensors, no asyncio, no gRPC). A request moves WAITING -> PREFILLING (pages
reserved, its prompt's KV being filled by a KV source) -> RUNNING (decoded step by step) ->
FINISHED (done, failed or aborted; its pages go back to the pool). A RUNNING request may be
preempted back to WAITING (its pages freed, its tokens kept): readmitted, it computes the KV of
its prompt again in the same chunks, then feeds its generated tokens again through decode's own
kernel (PREFILLING, locally) -- the same bytes as before, FP8 too -- and runs on from its pending token.

A request with ``params.n > 1`` is prefilled once; once its prompt KV is complete it is forked
into n choices (``EngineCore.fork``): itself (choice 0) and n - 1 children, each a request of its
own from then on (own sequence, pages shared with the others but for its copy of the partial
last page, own seed stream ``params.for_choice(i)``), preempted and finished on its own.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvwire.sampling_params import FinishReason, KVSourceChoice, SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from kvwire.grammar import Matcher
    from kvwire.spec.state import SpecState


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; no pages reserved yet
    PREFILLING = "prefilling"  # pages reserved; the prompt's KV is being filled (local or remote)
    RUNNING = "running"  # KV in place; takes part in every decode step
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    seq: int  # the KV cache's sequence id
    prompt: list[int]
    params: SamplingParams
    stops: frozenset[int]  # token ids that end it (stop_token_ids, plus EOS unless ignore_eos)
    spec: SpecState | None = None  # speculative decoding's state and counters (None: plain decoding)
    kv_source: KVSourceChoice = KVSourceChoice.AUTO
    reserved_pages: int = 0  # set by the scheduler (the block tables' max_pages)
    status: RequestStatus = RequestStatus.WAITING
    context: list[int] = field(default_factory=list)  # prompt + generated; the last one not yet fed
    generated: int = 0
    steps: int = 0  # decode steps taken
    finish_reason: FinishReason | None = None
    kv_source_used: str = ""  # "local" | "remote", once filled (for traces and tests)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not computed, not sent)
    # Local prefill in chunks (the scheduler's step budget): the tokens whose KV is computed here
    # (the prompt; after a preemption, prompt + generated but the pending one), and how many are done.
    prefill_tokens: list[int] | None = None
    computed: int = 0
    # After a preemption, once its prompt is computed again: the next generated token to feed again
    # (as decode steps did: ``ModelRunner.replay``), until the pending one.
    replay_from: int | None = None
    preemptions: int = 0
    first_logprobs: TokenLogprobs | None = None  # token 0's, set where it is sampled (params.logprobs set)
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1..'s, as prefill computes them
    choice: int = 0  # its index among the choices of an n > 1 request (0: the request itself)
    # n > 1, set where token 0 is sampled: choices 1..n-1's first tokens (and logprobs when asked)
    choice_firsts: list[tuple[int, TokenLogprobs | None]] = field(default_factory=list)
    children: list[Request] = field(default_factory=list)  # choices 1..n-1, once forked
    # params.structured's matcher: masks each sampled row, advanced by every sampled token (kvwire.grammar)
    grammar: Matcher | None = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are still to be computed (locally, whole: no prefix reuse)."""
        return self.params.prompt_logprobs is not None and not self.resuming

    @property
    def resuming(self) -> bool:
        """Recomputing after a preemption: its first token was sampled long ago."""
        return bool(self.context)

    @property
    def output_ids(self) -> list[int]:
        return self.context[len(self.prompt):]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish_reason_after(self, token: int) -> FinishReason | None:
        """Why generation ends after emitting ``token`` (counted in ``generated``), or None."""
        if token in self.stops or (self.grammar is not None and self.grammar.terminated):
            return FinishReason.STOP
        return FinishReason.LENGTH if self.generated >= self.params.max_tokens else None


@dataclass(frozen=True)
class RequestOutput:
    """New tokens of one request from one step (or its first token after the KV fill)."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None  # set on the request's last output only
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when the request asked (params.logprobs)
    prompt_logprobs: list[TokenLogprobs] | None = None  # first output only: prompt tokens 1..'s, when asked
    index: int = 0  # the choice (n > 1 requests; request_id is the choice's own)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Completion:
    """A whole generation, as ``LLM.generate`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: FinishReason
    text: str | None = None  # when the LLM has a tokenizer
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when asked (params.logprobs)
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1..'s, when asked (params.prompt_logprobs)
    index: int = 0  # the choice, for n > 1 (``LLM.generate`` returns n in a row per prompt)
