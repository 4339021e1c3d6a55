"""EngineCore: one engine step's pieces, shared by the in-process LLM and the async server engine.

    add_request -> schedule() -> [KV sources fill batch.admitted] -> start(req, first token)
                -> execute(batch) (the runner's thread) -> update(batch, results) -> release

No asyncio and no gRPC here: ``LLM`` drives it synchronously, ``AsyncEngine`` from an event loop
with the runner's work in one worker thread.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable

from kvwire.engine.request import Request, RequestOutput
from kvwire.engine.runner import ModelRunner
from kvwire.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from kvwire.errors import FailedPrecondition, InvalidRequest
from kvwire.sampling_params import KVSourceChoice, SamplingParams, SpeculativeMode
from kvwire.spec import DraftProposer, Proposers, SpecConfig, decode_step
from kvwire.spec.state import new_state, observe, record
from kvwire.validation import RequestLimits, validate_request


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler_cfg: SchedulerConfig | None = None,
                 spec_cfg: SpecConfig = SpecConfig(), eos_ids: Iterable[int] = (),
                 draft: DraftProposer | None = None):
        """``draft``: the draft model's or head's proposer, attached to ``runner`` (``kvwire.spec.attach_draft``)."""
        self.runner, self.spec_cfg, self.draft = runner, spec_cfg, draft
        self.proposers = Proposers(draft=draft)
        cache = runner.cache
        self.scheduler = Scheduler(scheduler_cfg or SchedulerConfig(total_pages=cache.pool.num_pages),
                                   cache.tables.max_pages)
        self.eos_ids = frozenset(eos_ids)
        cfg = runner.runtime.model_config
        self.limits = RequestLimits(vocab_size=cfg.vocab_size, max_context=cfg.max_position_embeddings)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.total_steps = 0

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                    kv_source: KVSourceChoice = KVSourceChoice.AUTO) -> Request:
        """Validate and queue; raises InvalidRequest / FailedPrecondition / ResourceExhausted."""
        validate_request(prompt, params, self.limits)
        mode = params.speculative or self.spec_cfg.mode
        if mode is SpeculativeMode.DRAFT and self.draft is None:
            raise FailedPrecondition("speculative=draft: this engine has no draft model loaded (decode_svc: "
                                     "--draft-model-dir DIR); use speculative=ngram or none")
        if request_id in self.requests:
            raise InvalidRequest(f"request_id {request_id!r} is already running")
        k = 0 if mode is SpeculativeMode.NONE else params.num_speculative_tokens or self.spec_cfg.num_tokens
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        by_confidence = mode is SpeculativeMode.DRAFT and self.draft.by_confidence
        req = Request(request_id, next(self._seq_ids), list(prompt), params, stops,
                      new_state(mode, k, self.spec_cfg, by_confidence), kv_source=KVSourceChoice(kv_source))
        self.scheduler.add(req)
        self.requests[request_id] = req
        return req

    def schedule(self) -> ScheduledBatch:
        return self.scheduler.schedule()

    def start(self, req: Request, first_token: int) -> RequestOutput:
        """The KV of ``req`` is filled and ``first_token`` sampled: it joins the next decode step."""
        return self.scheduler.start(req, first_token)

    def execute(self, batch: ScheduledBatch) -> list[tuple[list[int], int]]:
        """One decode step over ``batch.decode`` (call on the runner's thread)."""
        return decode_step(self.runner, self.proposers, batch.decode, self.spec_cfg)

    def update(self, batch: ScheduledBatch, results: list[tuple[list[int], int]]) -> list[RequestOutput]:
        self.total_steps += 1
        for req, (tokens, proposed) in zip(batch.decode, results):
            if proposed and not req.finished:
                record(req, proposed, len(tokens) - 1, self.spec_cfg)
        outputs = self.scheduler.update(batch, [tokens for tokens, _ in results])
        if self.spec_cfg.auto_off:
            for req in batch.decode:
                observe(req, self.spec_cfg)
        return outputs

    def release(self, req: Request) -> None:
        """Forget ``req`` in the scheduler (its reservation goes back). Its pages are freed by
        ``runner.free(req.seq)``, which the caller runs on the runner's thread."""
        self.requests.pop(req.request_id, None)
        self.scheduler.finish(req)

    def stats(self) -> dict[str, int]:
        return {**self.runner.stats(), **self.scheduler.stats()}
