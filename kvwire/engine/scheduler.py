"""The scheduler: waiting and running queues, page reservations, preemption, and each step's work.

Plain Python over requests and ints (no tensors, no gRPC). Each engine step is

    admitted = scheduler.admit()     # FIFO while their pages fit: each gets a KV source (local or remote)
    plan = scheduler.plan()          # decode rows + local prompt chunks within the token budget; preemptions
    ...runner: free plan.preempted, one decode step over plan.decode, one forward over plan.chunks...
    outputs = scheduler.update(plan, tokens_per_request)

Pages are reserved as sequences grow (vLLM's way), not for their whole life: a request is
admitted when the pages of its prompt and first step fit beside every reservation plus one page
of growth per running request (the watermark: admission does not take the page a running request
needs next). Each step reserves what its tokens need (``BlockTables.max_pages``: the sliding
window and the speculative lookahead are computed there and nowhere else), so reservations always
cover the pages held and the runner never runs out mid-step. When the pool cannot give a running
request its next page, the youngest admitted requests are preempted (recompute): their pages are
freed, they go back to the front of the queue with their tokens, and once readmitted their prompt
is prefilled again in the same chunks, the tokens generated so far are fed again as decode steps
fed them (``replays``, up to ``MAX_PAGED_QUERIES`` a step, through the decode kernel: each row's
bytes are one-token decoding's), and decoding resumes from the same pending token: the pages hold
the bytes they held, so greedy and seeded requests produce the tokens they would have. Requests
whose KV a remote source is importing are never preempted. Admission is FIFO with no overtaking
(a big request is not starved by small ones). Refused at once (ResourceExhausted): a request that
could never fit the pool alone, or one arriving when ``max_waiting`` requests already wait.

Chunked prefill: a prompt computed here goes in chunks of ``prefill_chunk`` tokens, cut at fixed
places (multiples of the chunk size after any reused prefix). A step carries every decoding
request's rows (one each, plus their speculative lookahead), then the next chunks of the oldest
prompt being prefilled, then those of younger ones, in order, while the step stays within
``max_num_batched_tokens`` and, while requests decode, within the prompt tokens ``prompt_budget``
gives for their number (the engine prices them from measured step times, so a prompt delays the
running streams by a bounded factor) or a quarter of the prompt tokens still to compute, whichever
is more (so a backlog is worked off); the oldest prompt's next chunk always goes. The cuts are fixed
and several chunks of a prompt in one step give the bits of a step each (``PagedKVCache``), so a
prompt's KV and first token depend on the prompt alone, not on how its chunks were grouped into
steps or what ran beside them.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvwire.engine.request import Request, RequestOutput, RequestStatus
from kvwire.errors import ResourceExhausted, never_fits
from kvwire.kv.tuned import MAX_PAGED_QUERIES

# (prompt_len, total_len, lookahead) -> pages: BlockTables.max_pages of the engine's cache.
MaxPages = Callable[[int, int, int], int]
# decoding requests in the step -> prompt tokens the step may add beside them (None: no limit but the token budget)
PromptBudget = Callable[[int], int | None]
# A step may always take 1 / BACKLOG_STEPS of the prompt tokens still to compute, whatever the time
# budget says: when prompts arrive faster than the budget computes them, the steps grow with the
# backlog instead of the queue growing without end (a burst is worked off in a few steps).
BACKLOG_STEPS = 4


@dataclass(frozen=True)
class SchedulerConfig:
    total_pages: int
    max_running: int = 16  # requests admitted (prefilling + running) at once
    max_waiting: int = 1024  # queued requests before new ones are refused
    max_num_batched_tokens: int = 512  # tokens fed per step (decode rows + prompt chunks), beyond the first chunk
    prefill_chunk: int | None = 256  # the unit prompts are cut in (None: whole prompts)
    # while requests decode, a step's prompt chunks take at most this multiple of their step's time
    # (the engine's PromptBudget; None: only max_num_batched_tokens limits them)
    max_prefill_stall: float | None = None


@dataclass(frozen=True)
class Chunk:
    """``tokens[start:end]`` of ``req``'s local prefill (``tokens``: its ``prefill_tokens`` when
    planned, kept here because an abort may clear the request's while the step runs)."""
    req: Request
    tokens: list[int]
    start: int
    end: int


@dataclass(frozen=True)
class StepPlan:
    decode: tuple[Request, ...]  # running: one decode (or speculative verification) step each
    chunks: tuple[Chunk, ...] = ()  # prompt chunks computed locally in this step
    preempted: tuple[Request, ...] = ()  # their pages are freed before the step
    replays: tuple[Chunk, ...] = ()  # generated tokens fed again after a preemption (tokens: the context)

    def __bool__(self) -> bool:
        return bool(self.decode or self.chunks or self.preempted or self.replays)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, max_pages: MaxPages, prompt_budget: PromptBudget | None = None):
        self.cfg, self.max_pages, self.prompt_budget = cfg, max_pages, prompt_budget
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}  # admitted: PREFILLING or RUNNING, in admission order
        self.reserved = 0
        self.num_preemptions = 0

    @staticmethod
    def lookahead(req: Request) -> int:
        return req.spec.k_max if req.spec is not None else 0  # a verification's proposals

    def need(self, req: Request) -> int:
        """Pages ``req`` holds at most through its next decode step (its prompt and first token
        before it started; its whole context plus the step's lookahead after). An n > 1 request
        not yet forked reserves for every choice as if none shared a page (the reservation never
        falls short whoever finishes first; the pool itself shows the sharing)."""
        la, prompt = self.lookahead(req), len(req.prompt)
        tokens = max(len(req.context), prompt + 1) + la  # the step's proposals, never past max_tokens
        return self.max_pages(prompt, min(tokens, prompt + req.params.max_tokens), la) * req.params.n

    def add(self, req: Request) -> None:
        """Queue a request, or raise ResourceExhausted saying why it cannot be queued."""
        most = self.max_pages(len(req.prompt), len(req.prompt) + req.params.max_tokens, self.lookahead(req))
        if most * req.params.n > self.cfg.total_pages:
            choices = f" for each of n={req.params.n} choices" if req.params.n > 1 else ""
            raise never_fits(f"request needs {most} KV pages{choices} ({len(req.prompt)} prompt + "
                             f"{req.params.max_tokens} max tokens) but the decode pool has {self.cfg.total_pages}")
        if len(self.waiting) >= self.cfg.max_waiting:
            raise ResourceExhausted(f"the queue is full ({self.cfg.max_waiting} requests waiting); retry later")
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def admit(self) -> list[Request]:
        """Admit waiting requests (FIFO) while their pages fit. Returns the new ones (their KV
        source is chosen next: ``prefill_locally`` or a remote import); preempted requests
        readmitted here prefill locally without being returned."""
        admitted = []
        while self.waiting and len(self.running) < self.cfg.max_running:
            req = self.waiting[0]
            need = self.need(req)
            watermark = sum(r.status is RequestStatus.RUNNING for r in self.running.values())
            if self.running and self.reserved + need + watermark > self.cfg.total_pages:
                break
            self.waiting.popleft()
            self.reserved += need
            req.reserved_pages, req.status = need, RequestStatus.PREFILLING
            self.running[req.request_id] = req
            if req.preemptions:  # admitted before, so its KV was being computed here: recompute it
                self.prefill_locally(req)
            else:
                admitted.append(req)
        return admitted

    def prefill_locally(self, req: Request) -> None:
        """``req``'s KV is computed here, in chunks of the next steps: its prompt (after a preemption,
        then its generated tokens but the pending one: ``replays``)."""
        req.prefill_tokens, req.replay_from = req.prompt, None
        req.computed, req.kv_source_used = 0, "local"

    def plan(self) -> StepPlan:
        """This step's work: reserve every running request's next pages (preempting the youngest
        where the pool is short), then fill the token budget with prompt chunks."""
        preempted: list[Request] = []
        for req in list(self.running.values()):
            if req.status is not RequestStatus.RUNNING or req.request_id not in self.running:
                continue
            grow = self.need(req) - req.reserved_pages
            while grow > self.cfg.total_pages - self.reserved:
                victim = self._youngest_preemptable()
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING and grow <= self.cfg.total_pages - self.reserved:
                req.reserved_pages += max(grow, 0)
                self.reserved += max(grow, 0)
        decode = tuple(r for r in self.running.values() if r.status is RequestStatus.RUNNING)
        chunks, replays = self._chunks(decode)
        return StepPlan(decode, chunks, tuple(preempted), replays)

    def _chunks(self, decode: Sequence[Request]) -> tuple[tuple[Chunk, ...], tuple[Chunk, ...]]:
        """Prompt chunks and replays, oldest request first, while the budget lasts (the first always)."""
        size = self.cfg.prefill_chunk
        left = self.cfg.max_num_batched_tokens - sum(1 + self.lookahead(r) for r in decode)
        budget = self.prompt_budget(len(decode)) if decode and self.prompt_budget is not None else None
        if budget is not None:
            backlog = sum(len(r.prefill_tokens) - r.computed for r in self.running.values()
                          if r.status is RequestStatus.PREFILLING and r.prefill_tokens is not None)
            left = min(left, max(budget, -(-backlog // BACKLOG_STEPS)))
        chunks, replays = [], []
        for req in self.running.values():
            if req.status is not RequestStatus.PREFILLING:
                continue
            if req.prefill_tokens is not None:  # its next chunks, in order, while they fit
                tokens, start = req.prefill_tokens, req.computed
                while start < len(tokens):
                    end = len(tokens) if size is None else min(len(tokens), start + size)
                    if (chunks or replays) and end - start > left:
                        return tuple(chunks), tuple(replays)
                    chunks.append(Chunk(req, tokens, start, end))
                    left -= end - start
                    start = end
                continue
            if req.replay_from is None:
                continue
            tokens, start = req.context, req.replay_from
            end = min(len(tokens) - 1, start + MAX_PAGED_QUERIES)
            if (chunks or replays) and end - start > left:
                break
            replays.append(Chunk(req, tokens, start, end))
            left -= end - start
        return tuple(chunks), tuple(replays)

    def _youngest_preemptable(self) -> Request | None:
        """The most recently admitted request running or prefilling locally (a remote import
        in flight is not taken back)."""
        for req in reversed(self.running.values()):
            if req.status is RequestStatus.RUNNING or req.prefill_tokens is not None or req.replay_from is not None:
                return req
        return None

    def _preempt(self, req: Request) -> None:
        del self.running[req.request_id]
        self.reserved -= req.reserved_pages
        req.reserved_pages, req.status = 0, RequestStatus.WAITING
        req.prefill_tokens, req.computed, req.replay_from = None, 0, None
        req.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)  # first in line again: it was admitted before anything waiting

    def chunk_done(self, chunk: Chunk, computed: int) -> bool:
        """``chunk`` ran (``computed``: the request's tokens in pages now, beyond the chunk's end
        when a cached prefix was reused); True when its prompt is complete."""
        req = chunk.req
        if req.status is not RequestStatus.PREFILLING or req.prefill_tokens is None:
            return False  # aborted meanwhile
        req.computed = max(req.computed, computed)
        if req.computed < len(req.prefill_tokens):
            return False
        req.prefill_tokens = None
        if req.resuming:
            self._replayed(req, len(req.prompt))
        return True

    def replay_done(self, replay: Chunk) -> None:
        """``replay`` ran: the request's tokens up to its end are in the pages again."""
        req = replay.req
        if req.status is RequestStatus.PREFILLING and req.replay_from == replay.start:
            self._replayed(req, replay.end)

    @staticmethod
    def _replayed(req: Request, upto: int) -> None:
        if upto < len(req.context) - 1:
            req.replay_from = upto
        else:  # every token but the pending one is in the pages: decoding goes on from it
            req.replay_from, req.status = None, RequestStatus.RUNNING

    def start(self, req: Request, first_token: int) -> RequestOutput:
        """The request's KV is in place and ``first_token`` was sampled from its prompt: it runs."""
        req.context = [*req.prompt, first_token]
        req.generated = 1
        req.finish_reason = req.finish_reason_after(first_token)
        if req.finish_reason is None and req.status is RequestStatus.PREFILLING:
            req.status = RequestStatus.RUNNING
        return RequestOutput(req.request_id, [first_token], req.finish_reason,
                             None if req.first_logprobs is None else [req.first_logprobs], req.prompt_logprobs,
                             req.choice)

    def adopt(self, parent: Request, children: Sequence[Request]) -> None:
        """``parent`` was forked into ``children`` (started, their first tokens given): each child
        still running takes one choice's share of ``parent``'s reservation and runs after the
        requests admitted before it; a finished one's share goes back."""
        if self.running.get(parent.request_id) is not parent:
            return  # aborted meanwhile: nothing reserved
        share = parent.reserved_pages // (len(children) + 1)
        parent.reserved_pages -= share * len(children)
        for child in children:
            if child.finish_reason is not None:  # ended with its first token
                self.reserved -= share
                continue
            child.reserved_pages = share
            self.running[child.request_id] = child

    def update(self, plan: StepPlan, tokens: Sequence[list[int]]) -> list[RequestOutput]:
        """Apply one step's tokens (``tokens[i]`` for ``plan.decode[i]``); a stop token or
        max_tokens may cut a step's tokens short. Requests finished meanwhile are skipped."""
        outputs = []
        for req, toks in zip(plan.decode, tokens):
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.steps += 1
            emitted = []
            for token in toks:
                req.generated += 1
                req.context.append(token)
                emitted.append(token)
                req.finish_reason = req.finish_reason_after(token)
                if req.finish_reason is not None:
                    req.status = RequestStatus.FINISHED
                    break
            outputs.append(RequestOutput(req.request_id, emitted, req.finish_reason, index=req.choice))
        return outputs

    def finish(self, req: Request) -> None:
        """Forget a request wherever it is (finished, failed or aborted); idempotent."""
        if self.running.get(req.request_id) is req:
            del self.running[req.request_id]
            self.reserved -= req.reserved_pages
        elif req in self.waiting:
            self.waiting.remove(req)
        req.reserved_pages, req.prefill_tokens, req.replay_from = 0, None, None
        req.status = RequestStatus.FINISHED

    def stats(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "running": len(self.running), "reserved_pages": self.reserved,
                "total_pages": self.cfg.total_pages, "num_preemptions": self.num_preemptions}
