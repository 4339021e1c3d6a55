"""EngineCore: one engine step's pieces, shared by the in-process LLM and the async server engine.

    add_request -> admit() -> [each admitted: prefill_locally(req), or a remote KV source fills it]
                -> plan() -> execute(plan) (the runner's thread) -> update(plan, result)
                -> start(req, first token) for each prompt completed -> ... -> release

No asyncio and no gRPC here: ``LLM`` drives it synchronously, ``AsyncEngine`` from an event loop
with the runner's work in one worker thread.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvwire.engine.choices import sample_choices
from kvwire.engine.request import Request, RequestOutput, RequestStatus
from kvwire.engine.runner import ModelRunner
from kvwire.engine.scheduler import Chunk, Scheduler, SchedulerConfig, StepPlan
from kvwire.errors import FailedPrecondition, InvalidRequest
from kvwire.grammar import Grammars
from kvwire.logprobs import token_logprobs
from kvwire.sampling_params import KVSourceChoice, SamplingParams, SpeculativeMode, TokenLogprobs
from kvwire.spec import DraftProposer, Proposers, SpecConfig, decode_step
from kvwire.spec.state import new_state, observe, record
from kvwire.validation import RequestLimits, validate_request


@dataclass(frozen=True)
class StepResult:
    # per plan.decode: (tokens to emit, number proposed, their logprobs when the request asked)
    decode: list[tuple[list[int], int, list[TokenLogprobs] | None]]
    chunks: list[tuple[int, int | None]]  # per plan.chunks: (tokens now in pages, first token if the prompt is done)


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler_cfg: SchedulerConfig | None = None,
                 spec_cfg: SpecConfig = SpecConfig(), eos_ids: Iterable[int] = (),
                 draft: DraftProposer | None = None, grammars: Grammars | None = None):
        """``draft``: the draft model's or head's proposer, attached to ``runner`` (``kvwire.spec.attach_draft``);
        ``grammars``: the compiler of structured-output constraints (None: such requests are refused)."""
        self.runner, self.spec_cfg, self.draft, self.grammars = runner, spec_cfg, draft, grammars
        self.proposers = Proposers(draft=draft)
        cache = runner.cache
        scheduler_cfg = scheduler_cfg or SchedulerConfig(total_pages=cache.pool.num_pages)
        self.scheduler = Scheduler(scheduler_cfg, cache.tables.max_pages,
                                   self._prompt_budget if scheduler_cfg.max_prefill_stall else None)
        self.eos_ids = frozenset(eos_ids)
        cfg = runner.runtime.model_config
        self.limits = RequestLimits(vocab_size=cfg.vocab_size, max_context=cfg.max_position_embeddings)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.total_steps = 0

    def _prompt_budget(self, batch: int) -> int | None:
        """Prompt tokens a step beside ``batch`` decoding requests may compute: ``max_prefill_stall``
        times such a step's time, at the measured seconds per prompt token (None until both are measured)."""
        cost = self.runner.step_cost
        step, token = cost.step(batch), cost.prefill_token()
        if step is None or token is None:
            return None
        return int(self.scheduler.cfg.max_prefill_stall * step / token)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams,
                    kv_source: KVSourceChoice = KVSourceChoice.AUTO) -> Request:
        """Validate and queue; raises InvalidRequest / FailedPrecondition / ResourceExhausted."""
        validate_request(prompt, params, self.limits)
        # constrained requests decode without speculation (each token is masked before it is sampled)
        mode = SpeculativeMode.NONE if params.structured is not None else params.speculative or self.spec_cfg.mode
        if mode is SpeculativeMode.DRAFT and self.draft is None:
            raise FailedPrecondition("speculative=draft: this engine has no draft model loaded (decode_svc: "
                                     "--draft-model-dir DIR); use speculative=ngram or none")
        if request_id in self.requests:
            raise InvalidRequest(f"request_id {request_id!r} is already running")
        if mode is SpeculativeMode.DRAFT and params.n > 1:
            mode = SpeculativeMode.NONE  # a draft's own KV is not forked: choices decode plainly (same output)
        k = 0 if mode is SpeculativeMode.NONE else params.num_speculative_tokens or self.spec_cfg.num_tokens
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        by_confidence = mode is SpeculativeMode.DRAFT and self.draft.by_confidence
        grammar = None
        if params.structured is not None:
            if self.grammars is None:
                raise FailedPrecondition("structured output: this engine has no grammar compiler (no tokenizer)")
            grammar = self.grammars.matcher(params.structured, stops)  # compiled once per constraint (cached)
        req = Request(request_id, next(self._seq_ids), list(prompt), params, stops,
                      new_state(mode, k, self.spec_cfg, by_confidence), kv_source=KVSourceChoice(kv_source),
                      grammar=grammar)
        self.scheduler.add(req)
        self.requests[request_id] = req
        return req

    def admit(self) -> list[Request]:
        """Admit what fits; the returned requests need a KV source (``prefill_locally`` or a remote one)."""
        return self.scheduler.admit()

    def prefill_locally(self, req: Request) -> None:
        """``req``'s prompt KV is computed here, in chunks of the coming steps (``update`` returns
        its first token)."""
        self.scheduler.prefill_locally(req)

    def plan(self) -> StepPlan:
        return self.scheduler.plan()

    def start(self, req: Request, first_token: int) -> RequestOutput:
        """The KV of ``req`` is filled and ``first_token`` sampled: it joins the next decode step."""
        return self.scheduler.start(req, first_token)

    def fork(self, req: Request) -> list[Request]:
        """``req`` (n > 1, its prompt KV complete, its choices' first tokens sampled) becomes choice 0;
        returns choices 1..n-1, new requests on new sequences, not yet scheduled. Their pages come
        from ``runner.fork(req.seq, [c.seq for c in children])`` (the runner's thread), then
        ``start`` (req) and ``start_children`` make them run."""
        n, params = req.params.n, req.params
        taken = [f"{req.request_id}#{i}" for i in range(1, n) if f"{req.request_id}#{i}" in self.requests]
        if taken:  # a choice's id is its request's + "#i": another request holds one
            raise InvalidRequest(f"request_id {taken[0]!r} is already running: choices of {req.request_id!r} "
                                 "cannot take their ids")
        req.children = [Request(f"{req.request_id}#{i}", next(self._seq_ids), req.prompt, params.for_choice(i),
                                req.stops, None if req.spec is None else new_state(req.spec.mode, req.spec.k_max,
                                                                                   self.spec_cfg, req.spec.by_confidence),
                                kv_source=req.kv_source, status=RequestStatus.PREFILLING, choice=i,
                                kv_source_used=req.kv_source_used, cached_tokens=req.cached_tokens,
                                first_logprobs=lp)
                        for i, (_, lp) in zip(range(1, n), req.choice_firsts)]
        req.params = params.for_choice(0)
        for child in req.children:  # their ids are taken from now on (``release`` frees them)
            self.requests[child.request_id] = child
        return req.children

    def start_children(self, req: Request) -> list[RequestOutput]:
        """After ``fork`` and ``runner.fork``: each child's first output; a child that did not end
        with its first token joins the next decode step (its share of ``req``'s reservation with it)."""
        firsts = [first for first, _ in req.choice_firsts]
        outputs = [self.scheduler.start(child, first) for child, first in zip(req.children, firsts)]
        self.scheduler.adopt(req, req.children)
        return outputs

    def start_forked(self, req: Request, first_token: int) -> list[RequestOutput]:
        """``start`` for any request, on the runner's thread (the in-process LLM): an n > 1 one is
        forked first; returns every choice's first output."""
        if req.params.n == 1:
            return [self.start(req, first_token)]
        children = self.fork(req)
        self.runner.fork(req.seq, [c.seq for c in children])
        return [self.start(req, first_token), *self.start_children(req)]

    def execute(self, plan: StepPlan) -> StepResult:
        """One step (call on the runner's thread): free the preempted requests' pages, feed the
        replays, then one decode step over ``plan.decode`` with ``plan.chunks`` in the same forward
        where the kernels' rows are independent (else, or with prompt logprobs, a forward of their own)."""
        for req in plan.preempted:
            self.runner.free(req.seq)
        if plan.replays:
            self.runner.replay([(c.req.seq, c.tokens[c.start:c.end], c.end == len(c.tokens) - 1)
                                for c in plan.replays])
        spans = self._spans(plan.chunks)
        run = [i for i, (a, b) in enumerate(spans) if b > a]  # a chunk the prefix covered computes nothing
        items = [(plan.chunks[i].req.seq, plan.chunks[i].tokens[spans[i][0]:spans[i][1]],
                  spans[i][1] == len(plan.chunks[i].tokens)) for i in run]
        full = [j for j, i in enumerate(run) if plan.chunks[i].req.wants_prompt_logprobs]
        ride = bool(plan.decode and items and not full and self.runner.rows_independent)
        decode = decode_step(self.runner, self.proposers, plan.decode, self.spec_cfg,
                             items if ride else ()) if plan.decode else []
        computed = self.runner.chunk_logits if ride else self.runner.prefill_chunks(items, full) if items else []
        logits: list[torch.Tensor | None] = [None] * len(plan.chunks)
        for i, row in zip(run, computed):
            logits[i] = row
        return StepResult(decode, self._prompts_done(plan.chunks, spans, logits, [run[j] for j in full]))

    def _spans(self, chunks: tuple[Chunk, ...]) -> list[tuple[int, int]]:
        """Each chunk's [start, end) in its tokens: a prompt's first chunk first attaches its longest
        cached prefix, then the chunk starts after it (the same number of tokens, further on, so later
        chunks are cut at the same places after a given prefix), and the prompt's later chunks of this
        step move as far."""
        spans, shift = [], {}  # shift: request -> the prefix its first chunk attached in this step
        for c in chunks:
            if c.start == 0:
                cached = 0 if c.req.wants_prompt_logprobs else self.runner.reuse_prefix(c.req.seq, c.tokens)
                if not c.req.resuming:
                    c.req.cached_tokens = cached
                shift[c.req.request_id] = cached
            s = shift.get(c.req.request_id, 0)
            spans.append((min(len(c.tokens), c.start + s), min(len(c.tokens), c.end + s)))
        return spans

    def _prompts_done(self, chunks: tuple[Chunk, ...], spans: list[tuple[int, int]],
                      logits: list[torch.Tensor | None], full: list[int]) -> list[tuple[int, int | None]]:
        """Per chunk: (its end, the first token where it completed its prompt): a completed prompt's
        full pages become reusable, chunks in ``full`` give their prompt logprobs."""
        out = []
        for i, (c, (start, end), row) in enumerate(zip(chunks, spans, logits)):
            if i in full:  # rows [len, vocab]: row r scores token r + 1; the prompt's last row samples token 0
                lps = token_logprobs(row, c.tokens[start + 1:end + 1], c.req.params.prompt_logprobs)
                # from 0 again when a preemption made the prompt start over
                c.req.prompt_logprobs = (c.req.prompt_logprobs if start else []) + lps
                row = row[-1] if end == len(c.tokens) else None
            first = None
            if row is not None:
                self.runner.remember_prefix(c.req.seq, c.req.prompt)
                if not c.req.resuming:
                    first = sample_choices(row, c.req)
            out.append((end, first))
        return out

    def update(self, plan: StepPlan, result: StepResult) -> tuple[list[RequestOutput], list[tuple[Request, int]]]:
        """Apply a step: the decoding requests' outputs, and the requests whose prompt is now
        complete with their first token (give it to ``start``)."""
        self.total_steps += 1
        for req, (tokens, proposed, _) in zip(plan.decode, result.decode):
            if proposed and not req.finished:
                record(req, proposed, len(tokens) - 1, self.spec_cfg)
        outputs = self.scheduler.update(plan, [tokens for tokens, _, _ in result.decode])
        logprobs = {req.request_id: lps for req, (_, _, lps) in zip(plan.decode, result.decode) if lps is not None}
        if logprobs:  # cut like the tokens (a stop token or max_tokens may end a step's tokens early)
            outputs = [dataclasses.replace(o, logprobs=logprobs[o.request_id][:len(o.token_ids)])
                       if o.request_id in logprobs else o for o in outputs]
        if self.spec_cfg.auto_off:
            for req in plan.decode:
                observe(req, self.spec_cfg)
        for replay in plan.replays:
            self.scheduler.replay_done(replay)
        firsts = []
        for chunk, (computed, first) in zip(plan.chunks, result.chunks):
            if self.scheduler.chunk_done(chunk, computed) and first is not None:
                firsts.append((chunk.req, first))
        return outputs, firsts

    def release(self, req: Request) -> None:
        """Forget ``req`` in the scheduler (its reservation goes back). Its pages are freed by
        ``runner.free(req.seq)``, which the caller runs on the runner's thread."""
        self.requests.pop(req.request_id, None)
        self.scheduler.finish(req)

    def stats(self) -> dict[str, int]:
        return {**self.runner.stats(), **self.scheduler.stats()}
