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
prefill replica is UNAVAILABLE). Otherwise (AUTO) it prefills locally when its prompt has at most
``local_max_tokens`` tokens (short prompts cost less to compute than to ship), when no prefill
replica is configured or its channel is failing, or when ``remote_max_inflight`` remote pulls are
already running (prefill overloaded); else remotely. An AUTO request whose remote pull fails with
UNAVAILABLE is retried locally, so decode_svc serves everything when prefill_svc is down.
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
from kvwire.kv.wire import TransferTracker, WireError, decode_chunk
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

    def _prefill(self, req: Request) -> int:
        req.cached_tokens = self.runner.reuse_prefix(req.seq, req.prompt)
        return sample(self.runner.prefill(req.seq, req.prompt), req.params, 0)

    async def fill(self, req: Request, run: Run, deadline: float | None = None) -> int:
        with tracer.start_as_current_span("prefill.local") as span:
            span.set_attribute("gen_ai.usage.input_tokens", len(req.prompt))
            return await run(self._prefill, req)


DEFAULT_TRANSFER_TIMEOUT_S = 30.0


class RemotePrefill:
    """The pull from prefill_svc. Every pull has a deadline: the caller's, capped at
    ``transfer_timeout_s`` (a stalled prefill ends the request DEADLINE_EXCEEDED, its pages freed).
    ``healthy`` is set by a health watch (decode_svc's ``PrefillWatch``); while False, AUTO requests
    prefill locally."""
    name = "remote"

    def __init__(self, runner: ModelRunner, stub, channel: grpc.aio.Channel | None = None,
                 transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S):
        self.runner, self.stub, self.channel = runner, stub, channel
        self.transfer_timeout_s = transfer_timeout_s
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
        req.cached_tokens = await run(self.runner.reuse_prefix, req.seq, req.prompt)
        cached_pages = req.cached_tokens // spec.block_size
        name = self.runner.prefix.names(req.prompt[:req.cached_tokens])[-1] if cached_pages else b""
        call = self.stub.Prefill(pb.PrefillRequest(
            request_id=req.request_id, token_ids=req.prompt, sampling=conv.sampling_to_pb(req.params),
            expected_spec=conv.spec_to_pb(spec), expected_fingerprint=conv.fingerprint_to_pb(runtime.fingerprint),
            cached_pages=cached_pages, cached_prefix_hash=name), timeout=timeout)
        started = time.perf_counter()
        with tracer.start_as_current_span("kv_transfer") as span:
            tracker, pages, first = None, [], None
            try:
                async for msg in call:
                    kind = msg.WhichOneof("kind")
                    if kind == "header":
                        self._check_header(conv, msg.header, len(req.prompt), cached_pages)
                        pages = await run(self.runner.import_begin, req.seq, len(req.prompt))
                        tracker = TransferTracker(spec, len(pages))
                    elif kind == "chunk":
                        if tracker is None:
                            raise errors.DataLoss("prefill sent a KV chunk before its header")
                        chunk = conv.chunk_from_pb(msg.chunk)
                        try:
                            decoded = decode_chunk(spec, chunk, len(pages))
                            tracker.record(chunk)
                        except WireError as e:
                            raise errors.DataLoss(f"KV page refused: {e}") from e
                        await run(self.runner.import_chunk, pages, decoded)
                    elif kind == "done":
                        first = msg.done.first_token
            finally:
                call.cancel()  # no-op when the stream ended normally
            if tracker is None or first is None:
                raise errors.DataLoss("the prefill stream ended early (truncated): no header or no final message")
            missing = [(layer, p) for layer, p in tracker.missing() if p >= cached_pages]
            if missing:
                raise errors.DataLoss(f"the prefill stream is missing {len(missing)} (layer, page) KV pages, "
                                      f"first {missing[0]}")
            vocab = runtime.model_config.vocab_size
            if not 0 <= first < vocab:  # checked before anything reaches the client or a decode step
                raise errors.DataLoss(f"prefill sent first token {first}, outside the vocabulary [0, {vocab})")
            await run(self.runner.remember_prefix, req.seq, req.prompt)
            sent_pages = len(pages) - cached_pages
            bf16_bytes = sent_pages * spec.num_layers * 2 * spec.values_per_page * 2
            span.set_attributes({
                "kvwire.kv.pages": sent_pages * spec.num_layers, "kvwire.kv.bytes": tracker.bytes,
                "kvwire.kv.cached_tokens": req.cached_tokens,
                "kvwire.kv.chunks": tracker.chunks, "kvwire.kv.dtype": spec.dtype.value,
                "kvwire.kv.compression_vs_bf16": round(bf16_bytes / tracker.bytes, 3) if tracker.bytes else 0.0,
                "kvwire.kv.checksums_verified": tracker.chunks, "kvwire.kv.checksum_failures": 0})
            metrics.KV_TRANSFER_BYTES.inc(tracker.bytes)
            metrics.KV_TRANSFER_SECONDS.observe(time.perf_counter() - started)
            return first

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
    local_max_tokens: int = 0  # AUTO prompts of at most this many tokens prefill locally (0: none)
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

    def choose(self, req: Request) -> KVSource:
        if req.kv_source is KVSourceChoice.LOCAL:
            return self.local
        if req.kv_source is KVSourceChoice.REMOTE:
            if self.remote is None:
                raise errors.Unavailable("kv_source=remote, but this decode service has no prefill replica "
                                         "(start it with --prefill-addr); use local or unset")
            return self.remote
        if self.remote is None or len(req.prompt) <= self.policy.local_max_tokens or \
                self.remote.inflight >= self.policy.remote_max_inflight or not self.remote.reachable():
            return self.local
        return self.remote

    async def fill(self, req: Request, run: Run, deadline: float | None = None) -> int:
        """Fill ``req``'s KV from the source the policy picks; an AUTO request falls back to local
        prefill when the remote one is unavailable (its partial pages are freed first)."""
        source = self.choose(req)
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
