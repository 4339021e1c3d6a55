"""Where a request's prompt KV comes from: one protocol, two sources, and the per-request policy.

    LocalPrefill   the prompt's forward pass in this process, into the request's pages
    RemotePrefill  the gRPC pull from prefill_svc: header (spec + fingerprint checked), KV chunks
                   (sizes, place, CRC-32 and finite numbers checked, every page exactly once), then
                   the first token (in the vocabulary), all within the caller's deadline capped at
                   a transfer timeout; anything wrong is DATA_LOSS for that request alone, before
                   its pages are used or a token reaches the client

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
AUTO request whose remote pull fails with UNAVAILABLE is retried locally, so decode_svc serves
everything when prefill_svc is down.
"""
from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from opentelemetry import trace

from kvwire import errors, metrics
from kvwire.engine.request import Request
from kvwire.engine.runner import ModelRunner
from kvwire.kv.wire import KVChunk, TransferTracker, WireError, decode_chunk
from kvwire.sampler import sample
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

    def _prefill(self, req: Request) -> int:
        req.cached_tokens = self.runner.reuse_prefix(req.seq, req.prompt)
        return sample(self.runner.prefill(req.seq, req.prompt), req.params, 0)

    async def fill(self, req: Request, run: Run, deadline: float | None = None) -> int:
        self.inflight += 1
        try:
            with tracer.start_as_current_span("prefill.local") as span:
                span.set_attribute("gen_ai.usage.input_tokens", len(req.prompt))
                return await run(self._prefill, req)
        finally:
            self.inflight -= 1


DEFAULT_TRANSFER_TIMEOUT_S = 30.0
IMPORT_BATCH_BYTES = 8 << 20  # verified KV held before it is copied into the pages


class _Imports:
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


class RemotePrefill:
    """The pull from prefill_svc. Every pull has a deadline: the caller's, capped at
    ``transfer_timeout_s`` (a stalled prefill ends the request DEADLINE_EXCEEDED, its pages freed).
    ``healthy`` is set by a health watch (decode_svc's ``PrefillWatch``); while False, AUTO requests
    prefill locally."""
    name = "remote"

    def __init__(self, runner: ModelRunner, stub, channel: grpc.aio.Channel | None = None,
                 transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
                 import_batch_bytes: int = IMPORT_BATCH_BYTES):
        self.runner, self.stub, self.channel = runner, stub, channel
        self.transfer_timeout_s, self.import_batch_bytes = transfer_timeout_s, import_batch_bytes
        self.inflight = 0
        self.healthy = True

    def reachable(self) -> bool:
        if not self.healthy:
            return False
        if self.channel is None:
            return True
        state = self.channel.get_state(try_to_connect=True)
        return state not in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)

    def timeout_s(self, deadline: float | None) -> float:
        """Seconds this pull may take: the caller's remaining time, at most the transfer timeout."""
        if deadline is None:
            return self.transfer_timeout_s
        return max(0.0, min(self.transfer_timeout_s, deadline - time.monotonic()))

    async def fill(self, req: Request, run: Run, deadline: float | None = None) -> int:
        self.inflight += 1
        timeout = self.timeout_s(deadline)
        try:
            return await self._pull(req, run, timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            raise errors.DeadlineExceeded(f"the KV transfer from the prefill service did not finish within "
                                          f"{timeout:.1f} s") from e
        finally:
            self.inflight -= 1

    async def _pull(self, req: Request, run: Run, timeout: float) -> int:
        from protos import convert as conv  # the wire edge; the in-process LLM never imports it
        from protos.kvwire.v1 import kvwire_pb2 as pb

        runtime, spec = self.runner.runtime, self.runner.runtime.spec
        # Pages this decode replica already holds (prefix cache) are neither computed nor sent.
        if self.runner.prefix is not None:  # without a prefix cache there is nothing to look up
            req.cached_tokens = await run(self.runner.reuse_prefix, req.seq, req.prompt)
        cached_pages = req.cached_tokens // spec.block_size
        name = self.runner.prefix.names(req.prompt[:req.cached_tokens])[-1] if cached_pages else b""
        call = self.stub.Prefill(pb.PrefillRequest(
            request_id=req.request_id, token_ids=req.prompt, sampling=conv.sampling_to_pb(req.params),
            expected_spec=conv.spec_to_pb(spec), expected_fingerprint=conv.fingerprint_to_pb(runtime.fingerprint),
            cached_pages=cached_pages, cached_prefix_hash=name), timeout=timeout)
        started = time.perf_counter()
        # Pages are allocated at the header; chunks wait here and are verified and copied in one
        # runner call at the end (more only past import_batch_bytes): each runner call queues behind
        # the decode step in progress, so a call per chunk would make the prompt wait a decode step
        # per layer while others decode; and tensor work stays on the runner's thread.
        imports = _Imports(self.runner, req.seq, len(req.prompt), cached_pages)
        with tracer.start_as_current_span("kv_transfer") as span:
            first = None
            try:
                async for msg in call:
                    kind = msg.WhichOneof("kind")
                    if kind == "header":
                        self._check_header(conv, msg.header, len(req.prompt), cached_pages)
                        await run(imports.begin)  # while prefill computes its first layer
                        imports.tracker = TransferTracker(spec, imports.num_pages)
                    elif kind == "chunk":
                        if imports.tracker is None:
                            raise errors.DataLoss("prefill sent a KV chunk before its header")
                        if imports.add(conv.chunk_from_pb(msg.chunk)) >= self.import_batch_bytes:
                            await self._verified(run, imports.copy, imports.take())
                    elif kind == "done":
                        first = msg.done.first_token
            finally:
                call.cancel()  # no-op when the stream ended normally
            if imports.tracker is None or first is None:
                raise errors.DataLoss("the prefill stream ended early (truncated): no header or no final message")
            await self._verified(run, imports.finish, imports.take(), req.prompt)
            tracker, missing = imports.tracker, imports.missing()
            if missing:
                raise errors.DataLoss(f"the prefill stream is missing {len(missing)} (layer, page) KV pages, "
                                      f"first {missing[0]}")
            vocab = runtime.model_config.vocab_size
            if not 0 <= first < vocab:  # checked before anything reaches the client or a decode step
                raise errors.DataLoss(f"prefill sent first token {first}, outside the vocabulary [0, {vocab})")
            sent_pages = imports.num_pages - cached_pages
            bf16_bytes = sent_pages * spec.num_layers * 2 * spec.values_per_page * 2
            span.set_attributes({
                "kvwire.kv.pages": sent_pages * spec.num_layers, "kvwire.kv.bytes": tracker.bytes,
                "kvwire.kv.cached_tokens": req.cached_tokens, "kvwire.kv.import_calls": imports.calls,
                "kvwire.kv.chunks": tracker.chunks, "kvwire.kv.dtype": spec.dtype.value,
                "kvwire.kv.compression_vs_bf16": round(bf16_bytes / tracker.bytes, 3) if tracker.bytes else 0.0,
                "kvwire.kv.checksums_verified": tracker.chunks, "kvwire.kv.checksum_failures": 0})
            metrics.KV_TRANSFER_BYTES.inc(tracker.bytes)
            metrics.KV_TRANSFER_SECONDS.observe(time.perf_counter() - started)
            return first

    @staticmethod
    async def _verified(run: Run, fn, *args) -> None:
        try:
            await run(fn, *args)
        except WireError as e:
            raise errors.DataLoss(f"KV page refused: {e}") from e

    def _check_header(self, conv, header, num_tokens: int, cached_pages: int) -> None:
        runtime = self.runner.runtime
        diffs = runtime.spec.diff(conv.spec_from_pb(header.spec))
        diffs += runtime.fingerprint.diff(conv.fingerprint_from_pb(header.fingerprint))
        if diffs:
            raise errors.FailedPrecondition("prefill_svc runs a different model or KV layout "
                                            "(decode's value != prefill's): " + "; ".join(diffs))
        if header.num_tokens != num_tokens:
            raise errors.DataLoss(f"prefill announced {header.num_tokens} tokens for a {num_tokens}-token prompt")
        if header.first_page != cached_pages:
            raise errors.DataLoss(f"prefill starts at page {header.first_page}; decode holds {cached_pages} pages")


@dataclass(frozen=True)
class KVSourcePolicy:
    local_when_idle: bool = False  # AUTO prompts of any length prefill locally while the engine is idle
    local_max_tokens: int = 0  # AUTO prompts of at most this many tokens prefill locally (0: none) ..
    local_max_decoding: int = 8  # .. while fewer than this many requests decode here
    remote_max_inflight: int = 8  # AUTO requests prefill locally while this many remote pulls run


def _unavailable(e: BaseException) -> bool:
    if isinstance(e, errors.Unavailable):
        return True
    return isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE


class KVSources:
    """The sources an engine may use and the policy that picks one per request."""

    def __init__(self, local: LocalPrefill, remote: RemotePrefill | None = None,
                 policy: KVSourcePolicy = KVSourcePolicy()):
        self.local, self.remote, self.policy = local, remote, policy

    def choose(self, req: Request, decoding: int = 0) -> KVSource:
        """``decoding``: requests decoding in this engine now."""
        if req.kv_source is KVSourceChoice.LOCAL:
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
        now); an AUTO request falls back to local prefill when the remote one is unavailable (its
        partial pages are freed first)."""
        source = self.choose(req, decoding)
        try:
            first = await source.fill(req, run, deadline)
        except Exception as e:
            if source is self.local or req.kv_source is not KVSourceChoice.AUTO or not _unavailable(e):
                raise
            trace.get_current_span().add_event("kvwire.kv.remote_unavailable", {"error": str(e)[:200]})
            await run(self.runner_free, req.seq)
            source = self.local
            first = await source.fill(req, run)
        req.kv_source_used = source.name
        trace.get_current_span().set_attribute("kvwire.kv.source", source.name)
        return first

    def runner_free(self, seq: int) -> None:
        self.local.runner.free(seq)
