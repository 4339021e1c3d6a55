"""Where a request's prompt KV comes from: one protocol, two sources, and the per-request policy.

    LocalPrefill   the prompt's forward pass in this process, into the request's pages: in chunks of
                   the engine's steps (mixed with decoding) once bound to an AsyncEngine, else
                   one whole-prompt forward
    RemoteSource   any source that fills the pages from elsewhere, injected by the caller (as vLLM's
                   KV connectors are): decode_svc's RemotePrefill pulls them from prefill_svc over
                   gRPC; ``PageImport`` verifies every chunk such a source delivers before use

Both fill the pages the scheduler reserved and return the first generated token (sampled with
step index 0, so the tokens are the same either way); the engine does not know which one ran.
``run(fn, *args)`` runs ``fn`` on the runner's thread after everything already queued there, so a
request's pages are freed only after any import queued for it.

Policy (``KVSources.choose``), per request: a request may force LOCAL or REMOTE (REMOTE without a
prefill replica is UNAVAILABLE). Otherwise (AUTO) it prefills locally when this engine is idle
(``local_when_idle``: nothing decoding, and no prefill of this engine's running, here or remote:
there are no steps to hold up, and the pages need not travel), when its prompt has at most
``local_max_tokens`` tokens while fewer than ``local_max_decoding`` requests are decoding here
(a short prompt costs less to compute than to ship, unless the decode steps it would hold up are
many), when no prefill replica is configured or its channel is failing, or when
``remote_max_inflight`` remote pulls are already running (prefill overloaded); else remotely. An
AUTO request whose remote pull fails with UNAVAILABLE or RESOURCE_EXHAUSTED (prefill_svc down, or
its pool full) is prefilled locally instead, so decode_svc serves everything prefill_svc cannot.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry import trace

from kvwire import errors
from kvwire.engine.choices import sample_choices
from kvwire.engine.request import Request
from kvwire.engine.runner import ModelRunner
from kvwire.kv.wire import KVChunk, TransferTracker, decode_chunk
from kvwire.logprobs import token_logprobs
from kvwire.sampling_params import KVSourceChoice

tracer = trace.get_tracer("kvwire.engine")
Run = Callable[..., Awaitable[Any]]


class KVSource(Protocol):
    name: str  # "local" | "remote": on the trace

    async def fill(self, req: Request, run: Run, deadline: float | None = None) -> int:
        """Put ``req.prompt``'s KV into sequence ``req.seq``'s pages; return the first token.
        ``deadline``: the caller's, in ``time.monotonic()`` seconds (None: none)."""
        ...


class LocalPrefill:
    name = "local"

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.inflight = 0
        # The engine's chunked prefill (AsyncEngine binds it): queue the request's prompt for the
        # coming steps, resolve to its first token. Unbound: one whole-prompt forward via ``run``.
        self.chunked: Callable[[Request], Awaitable[int]] | None = None

    def _prefill(self, req: Request) -> int:
        if req.wants_prompt_logprobs:  # every row, no prefix reuse
            [rows] = self.runner.prefill_chunks([(req.seq, req.prompt, True)], full=(0,))  # [len(prompt), vocab]
            self.runner.remember_prefix(req.seq, req.prompt)
            req.prompt_logprobs = token_logprobs(rows, req.prompt[1:], req.params.prompt_logprobs)
            logits = rows[-1]
        else:
            req.cached_tokens = self.runner.reuse_prefix(req.seq, req.prompt)
            logits = self.runner.prefill(req.seq, req.prompt)  # [vocab]
        return sample_choices(logits, req)

    async def fill(self, req: Request, run: Run, deadline: float | None = None) -> int:
        self.inflight += 1
        try:
            with tracer.start_as_current_span("prefill.local") as span:
                span.set_attribute("gen_ai.usage.input_tokens", len(req.prompt))
                if self.chunked is not None:
                    return await self.chunked(req)
                return await run(self._prefill, req)
        finally:
            self.inflight -= 1


class RemoteSource(KVSource, Protocol):
    """A KV source outside this process. ``fill`` raises ``errors.Unavailable`` when the source
    cannot be reached (an AUTO request then prefills locally)."""

    inflight: int  # fills running now

    def reachable(self) -> bool:
        """False while the source is known to be down (its requests then prefill locally)."""
        ...


class PageImport:
    """The KV chunks of one pull on their way into the sequence's pages, in as few runner calls as
    possible: ``add`` and ``take`` on the event loop (no tensor work there), ``begin``, ``copy``
    and ``finish`` on the runner's thread, where each chunk is verified whole (place, sizes,
    CRC-32, finite numbers; ``WireError`` otherwise) before any of the call's chunks is imported."""

    def __init__(self, runner: ModelRunner, seq: int, num_tokens: int, cached_pages: int):
        self.runner, self.seq, self.num_tokens, self.cached_pages = runner, seq, num_tokens, cached_pages
        self.spec = runner.runtime.spec
        self.num_pages = self.spec.pages_for(num_tokens)
        self.tracker: TransferTracker | None = None  # set at the header
        self.pending: list[KVChunk] = []
        self.pending_bytes, self.calls = 0, 0
        self.pages: list[int] = []

    def add(self, chunk: KVChunk) -> int:
        """Hold ``chunk``; returns the bytes now held."""
        self.pending.append(chunk)
        self.pending_bytes += chunk.nbytes
        return self.pending_bytes

    def take(self) -> list[KVChunk]:
        chunks, self.pending, self.pending_bytes = self.pending, [], 0
        self.calls += 1
        return chunks

    def begin(self) -> None:
        """Allocate the pages the scheduler reserved for the rest of the prompt."""
        self.pages = self.runner.import_begin(self.seq, self.num_tokens)

    def copy(self, chunks: list[KVChunk]) -> None:
        decoded = []
        for chunk in chunks:
            decoded.append(decode_chunk(self.spec, chunk, self.num_pages))
            self.tracker.record(chunk)
        for d in decoded:
            self.runner.import_chunk(self.pages, d)

    def finish(self, chunks: list[KVChunk], prompt: list[int]) -> None:
        """The last chunks; then, if every page arrived, the prompt's full pages become reusable."""
        self.copy(chunks)
        if self.runner.prefix is not None and not self.missing():
            self.runner.remember_prefix(self.seq, prompt)

    def missing(self) -> list[tuple[int, int]]:
        """(layer, page) pairs that should have arrived and did not."""
        return [(layer, p) for layer, p in self.tracker.missing() if p >= self.cached_pages]


@dataclass(frozen=True)
class KVSourcePolicy:
    local_when_idle: bool = False  # AUTO prompts of any length prefill locally while the engine is idle
    local_max_tokens: int = 0  # AUTO prompts of at most this many tokens prefill locally (0: none) ..
    local_max_decoding: int = 8  # .. while fewer than this many requests decode here
    remote_max_inflight: int = 8  # AUTO requests prefill locally while this many remote pulls run


class KVSources:
    """The sources an engine may use and the policy that picks one per request."""

    def __init__(self, local: LocalPrefill, remote: RemoteSource | None = None,
                 policy: KVSourcePolicy = KVSourcePolicy()):
        self.local, self.remote, self.policy = local, remote, policy

    def choose(self, req: Request, decoding: int = 0) -> KVSource:
        """``decoding``: requests decoding in this engine now."""
        if req.kv_source is KVSourceChoice.LOCAL:
            return self.local
        if req.params.prompt_logprobs is not None:  # computed here, where every prompt row's logits are
            if req.kv_source is KVSourceChoice.REMOTE:
                raise errors.InvalidRequest("prompt_logprobs are computed by decode's own prefill: use kv_source "
                                            "local or leave it unset")
            return self.local
        if req.grammar is not None:  # its first token is masked where it is sampled: here
            if req.kv_source is KVSourceChoice.REMOTE:
                raise errors.InvalidRequest("structured output samples its first token in decode's own prefill: "
                                            "use kv_source local or leave it unset")
            return self.local
        if req.kv_source is KVSourceChoice.REMOTE:
            if self.remote is None:
                raise errors.Unavailable("kv_source=remote, but this decode service has no prefill replica "
                                         "(start it with --prefill-addr); use local or unset")
            return self.remote
        short = len(req.prompt) <= self.policy.local_max_tokens and decoding < self.policy.local_max_decoding
        idle = self.policy.local_when_idle and decoding == 0 and self.local.inflight == 0 and \
            (self.remote is None or self.remote.inflight == 0)
        if self.remote is None or short or idle or \
                self.remote.inflight >= self.policy.remote_max_inflight or not self.remote.reachable():
            return self.local
        return self.remote

    async def fill(self, req: Request, run: Run, deadline: float | None = None, decoding: int = 0) -> int:
        """Fill ``req``'s KV from the source the policy picks (``decoding``: requests decoding here
        now); an AUTO request falls back to local prefill when the remote one is unavailable or
        full (its partial pages are freed first)."""
        source = self.choose(req, decoding)
        try:
            first = await source.fill(req, run, deadline)
        except Exception as e:
            retry_here = isinstance(e, (errors.Unavailable, errors.ResourceExhausted)) and \
                not isinstance(e, errors.NeverFits)
            if source is self.local or req.kv_source is not KVSourceChoice.AUTO or not retry_here:
                raise
            trace.get_current_span().add_event("kvwire.kv.remote_unavailable",
                                               {"error": str(e)[:200], "kvwire.error": type(e).__name__})
            await run(self.runner_free, req.seq)
            source = self.local
            first = await source.fill(req, run)
        req.kv_source_used = source.name
        trace.get_current_span().set_attribute("kvwire.kv.source", source.name)
        return first

    def runner_free(self, seq: int) -> None:
        self.local.runner.free(seq)
