"""Admission and continuous batching, in plain Python over ints (no tensors, no gRPC).

A request is admitted only when the pages it can ever need (prompt + max_tokens, capped by the
sliding window) fit beside what running requests have reserved, so a running request never
waits for a page and nothing is ever preempted. Requests that do not fit wait in a bounded FIFO
queue; past its bound, or when a request could never fit the pool, admission fails at once.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass


class AdmissionError(Exception):
    """The request cannot be queued (RESOURCE_EXHAUSTED); the message says why."""


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"  # pages allocated, KV being pulled from prefill_svc
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass
class SeqState:
    request_id: str
    prompt_len: int
    max_tokens: int
    reserved_pages: int
    phase: Phase = Phase.WAITING
    generated: int = 0


@dataclass(frozen=True)
class SchedulerConfig:
    total_pages: int
    block_size: int
    max_waiting: int = 64
    max_running: int = 16
    sliding_window: int | None = None


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.waiting: deque[SeqState] = deque()
        self.running: dict[str, SeqState] = {}
        self.reserved = 0

    def pages_needed(self, prompt_len: int, max_tokens: int) -> int:
        tokens = prompt_len + max_tokens
        pages = -(-tokens // self.cfg.block_size)
        if self.cfg.sliding_window is not None:
            # Past the window, pages behind it go back to the pool: at most window + one block
            # of tokens (plus the page being filled) are held at once.
            pages = min(pages, -(-self.cfg.sliding_window // self.cfg.block_size) + 2)
        return pages

    def submit(self, request_id: str, prompt_len: int, max_tokens: int) -> SeqState:
        need = self.pages_needed(prompt_len, max_tokens)
        if need > self.cfg.total_pages:
            raise AdmissionError(
                f"request needs {need} KV pages ({prompt_len} prompt + {max_tokens} max tokens, "
                f"{self.cfg.block_size} tokens a page) but the pool has {self.cfg.total_pages}; "
                "lower max_tokens or shorten the prompt")
        if len(self.waiting) >= self.cfg.max_waiting:
            raise AdmissionError(f"the queue is full ({self.cfg.max_waiting} requests waiting); retry later")
        seq = SeqState(request_id, prompt_len, max_tokens, need)
        self.waiting.append(seq)
        return seq

    def admit(self) -> list[SeqState]:
        """Move waiting requests (FIFO, no overtaking) into the running set while their pages fit."""
        admitted = []
        while self.waiting and len(self.running) < self.cfg.max_running:
            seq = self.waiting[0]
            if self.reserved + seq.reserved_pages > self.cfg.total_pages:
                break
            self.waiting.popleft()
            self.reserved += seq.reserved_pages
            seq.phase = Phase.PREFILLING
            self.running[seq.request_id] = seq
            admitted.append(seq)
        return admitted

    def decoding(self) -> list[SeqState]:
        return [s for s in self.running.values() if s.phase is Phase.DECODING]

    def finish(self, request_id: str) -> None:
        """Forget a request wherever it is (finished, cancelled or failed); idempotent."""
        seq = self.running.pop(request_id, None)
        if seq is not None:
            self.reserved -= seq.reserved_pages
            seq.phase = Phase.FINISHED
            return
        for s in self.waiting:
            if s.request_id == request_id:
                self.waiting.remove(s)
                s.phase = Phase.FINISHED
                return

    def stats(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "running": len(self.running), "reserved_pages": self.reserved,
                "total_pages": self.cfg.total_pages}
