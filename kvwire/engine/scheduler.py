"""The scheduler: waiting and running queues, page reservation, and the batch of each step.

Plain Python over requests and ints (no tensors, no gRPC). Each engine step is

    batch = scheduler.schedule()      # admit what fits; the step's work, typed
    ...fill KV of batch.admitted (a KV source), run one decode step over batch.decode...
    outputs = scheduler.update(batch, tokens_per_request)

Reservation, not preemption: a request is admitted (WAITING -> PREFILLING) only when the most
pages it can ever hold (``BlockTables.max_pages``: prompt + max_tokens, the sliding window and
the speculative lookahead, computed there and nowhere else) fit beside what admitted requests
have reserved. So a running request never waits for a page and nothing is ever preempted or
recomputed; when the pool runs out, requests wait. Admission is FIFO with no overtaking (a big
request is not starved by small ones). A request that could never fit the pool, or one that
arrives when ``max_waiting`` requests already wait, is refused at once (ResourceExhausted).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvwire.engine.request import Request, RequestOutput, RequestStatus
from kvwire.errors import ResourceExhausted, never_fits

# (prompt_len, total_len, lookahead) -> pages: BlockTables.max_pages of the engine's cache.
MaxPages = Callable[[int, int, int], int]


@dataclass(frozen=True)
class SchedulerConfig:
    total_pages: int
    max_running: int = 16  # requests admitted (prefilling + running) at once
    max_waiting: int = 64  # queued requests before new ones are refused


@dataclass(frozen=True)
class ScheduledBatch:
    admitted: tuple[Request, ...]  # admitted this step: their prompt's KV must be filled next
    decode: tuple[Request, ...]  # running: one decode (or speculative verification) step each


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, max_pages: MaxPages):
        self.cfg, self.max_pages = cfg, max_pages
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}  # admitted: PREFILLING or RUNNING
        self.reserved = 0

    def reservation(self, prompt_len: int, max_tokens: int, lookahead: int = 0) -> int:
        return self.max_pages(prompt_len, prompt_len + max_tokens, lookahead)

    def add(self, req: Request) -> None:
        """Queue a request, or raise ResourceExhausted saying why it cannot be queued."""
        lookahead = req.spec.k_max if req.spec is not None else 0  # a verification's proposals
        need = self.reservation(len(req.prompt), req.params.max_tokens, lookahead)
        if need > self.cfg.total_pages:
            raise never_fits(f"request needs {need} KV pages ({len(req.prompt)} prompt + {req.params.max_tokens} "
                             f"max tokens) but the decode pool has {self.cfg.total_pages}")
        if len(self.waiting) >= self.cfg.max_waiting:
            raise ResourceExhausted(f"the queue is full ({self.cfg.max_waiting} requests waiting); retry later")
        req.reserved_pages, req.status = need, RequestStatus.WAITING
        self.waiting.append(req)

    def schedule(self) -> ScheduledBatch:
        """Admit waiting requests (FIFO) while their pages fit; return this step's work."""
        admitted = []
        while self.waiting and len(self.running) < self.cfg.max_running:
            req = self.waiting[0]
            if self.reserved + req.reserved_pages > self.cfg.total_pages:
                break
            self.waiting.popleft()
            self.reserved += req.reserved_pages
            req.status = RequestStatus.PREFILLING
            self.running[req.request_id] = req
            admitted.append(req)
        decode = tuple(r for r in self.running.values() if r.status is RequestStatus.RUNNING)
        return ScheduledBatch(tuple(admitted), decode)

    def start(self, req: Request, first_token: int) -> RequestOutput:
        """The request's KV is in place and ``first_token`` was sampled from its prompt: it runs."""
        req.context = [*req.prompt, first_token]
        req.generated = 1
        req.finish_reason = req.finish_reason_after(first_token)
        if req.finish_reason is None and req.status is RequestStatus.PREFILLING:
            req.status = RequestStatus.RUNNING
        return RequestOutput(req.request_id, [first_token], req.finish_reason)

    def update(self, batch: ScheduledBatch, tokens: Sequence[list[int]]) -> list[RequestOutput]:
        """Apply one step's tokens (``tokens[i]`` for ``batch.decode[i]``); a stop token or
        max_tokens may cut a step's tokens short. Requests finished meanwhile are skipped."""
        outputs = []
        for req, toks in zip(batch.decode, tokens):
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
            outputs.append(RequestOutput(req.request_id, emitted, req.finish_reason))
        return outputs

    def finish(self, req: Request) -> None:
        """Forget a request wherever it is (finished, failed or aborted); idempotent."""
        if self.running.get(req.request_id) is req:
            del self.running[req.request_id]
            self.reserved -= req.reserved_pages
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED

    def stats(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "running": len(self.running), "reserved_pages": self.reserved,
                "total_pages": self.cfg.total_pages}
