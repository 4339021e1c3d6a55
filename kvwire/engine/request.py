"""A request's state inside the engine, and what the engine hands back after a step.

Plain Python (no tensors, no asyncio, no gRPC). A request moves WAITING -> PREFILLING (pages
reserved, its prompt's KV being filled by a KV source) -> RUNNING (decoded step by step) ->
FINISHED (done, failed or aborted; its pages go back to the pool).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvwire.sampling_params import FinishReason, KVSourceChoice, SamplingParams

if TYPE_CHECKING:
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

    @property
    def output_ids(self) -> list[int]:
        return self.context[len(self.prompt):]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish_reason_after(self, token: int) -> FinishReason | None:
        """Why generation ends after emitting ``token`` (counted in ``generated``), or None."""
        if token in self.stops:
            return FinishReason.STOP
        return FinishReason.LENGTH if self.generated >= self.params.max_tokens else None


@dataclass(frozen=True)
class RequestOutput:
    """New tokens of one request from one step (or its first token after the KV fill)."""

    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None  # set on the request's last output only

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
