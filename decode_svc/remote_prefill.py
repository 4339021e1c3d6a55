"""RemotePrefill: the engine's KV source that pulls a prompt's pages from prefill_svc over gRPC.

Header (spec + fingerprint checked), KV chunks (sizes, place, CRC-32 and finite numbers checked by
``PageImport``, every page exactly once), then the first token (in the vocabulary), all within the
caller's deadline capped at a transfer timeout; anything wrong is DATA_LOSS for that request alone,
before its pages are used or a token reaches the client. UNAVAILABLE becomes ``errors.Unavailable``
and RESOURCE_EXHAUSTED (prefill's pool full) ``errors.ResourceExhausted``, which the engine's
policy answers with a local prefill (AUTO requests).
"""
from __future__ import annotations

import dataclasses
import time

import grpc
from opentelemetry import trace

from kvwire import errors, metrics
from kvwire.engine.kv_source import PageImport, Run
from kvwire.engine.request import Request
from kvwire.engine.runner import ModelRunner
from kvwire.kv.wire import TransferTracker, WireError
from kvwire.sampling_params import SamplingParams
from protos import convert as conv
from protos.kvwire.v1 import kvwire_pb2 as pb

tracer = trace.get_tracer("kvwire.engine")
DEFAULT_TRANSFER_TIMEOUT_S = 30.0
IMPORT_BATCH_BYTES = 8 << 20  # verified KV held before it is copied into the pages


def first_token_params(req: Request) -> SamplingParams:
    """The params prefill_svc samples token 0 with: the request's, but where min_tokens holds stop
    tokens back, this engine's whole stop set (EOS included) as stop_token_ids with ignore_eos,
    so prefill masks exactly the tokens decode would (its own EOS set may differ)."""
    if not req.params.min_tokens:
        return req.params
    return dataclasses.replace(req.params, stop_token_ids=tuple(sorted(req.stops)), ignore_eos=True)


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
            if e.code() == grpc.StatusCode.UNAVAILABLE:  # the engine answers with a local prefill (AUTO)
                raise errors.Unavailable(f"prefill_svc is unavailable: {e.details()}") from e
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # its pool is full: local prefill too (AUTO)
                raise errors.ResourceExhausted(f"prefill_svc is full: {e.details()}") from e
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            raise errors.DeadlineExceeded(f"the KV transfer from the prefill service did not finish within "
                                          f"{timeout:.1f} s") from e
        finally:
            self.inflight -= 1

    async def _pull(self, req: Request, run: Run, timeout: float) -> int:
        runtime, spec = self.runner.runtime, self.runner.runtime.spec
        # Pages this decode replica already holds (prefix cache) are neither computed nor sent.
        if self.runner.prefix is not None:  # without a prefix cache there is nothing to look up
            req.cached_tokens = await run(self.runner.reuse_prefix, req.seq, req.prompt)
        cached_pages = req.cached_tokens // spec.block_size
        name = self.runner.prefix.names(req.prompt[:req.cached_tokens])[-1] if cached_pages else b""
        call = self.stub.Prefill(pb.PrefillRequest(
            request_id=req.request_id, token_ids=req.prompt, sampling=conv.sampling_to_pb(first_token_params(req)),
            expected_spec=conv.spec_to_pb(spec), expected_fingerprint=conv.fingerprint_to_pb(runtime.fingerprint),
            cached_pages=cached_pages, cached_prefix_hash=name), timeout=timeout)
        started = time.perf_counter()
        # Pages are allocated at the header; chunks wait here and are verified and copied in one
        # runner call at the end (more only past import_batch_bytes): each runner call queues behind
        # the decode step in progress, so a call per chunk would make the prompt wait a decode step
        # per layer while others decode; and tensor work stays on the runner's thread.
        imports = PageImport(self.runner, req.seq, len(req.prompt), cached_pages)
        with tracer.start_as_current_span("kv_transfer") as span:
            first = None
            try:
                async for msg in call:
                    kind = msg.WhichOneof("kind")
                    if kind == "header":
                        self._check_header(msg.header, len(req.prompt), cached_pages)
                        await run(imports.begin)  # while prefill computes its first layer
                        imports.tracker = TransferTracker(spec, imports.num_pages)
                    elif kind == "chunk":
                        if imports.tracker is None:
                            raise errors.DataLoss("prefill sent a KV chunk before its header")
                        if imports.add(conv.chunk_from_pb(msg.chunk)) >= self.import_batch_bytes:
                            await self._verified(run, imports.copy, imports.take())
                    elif kind == "done":
                        first = msg.done.first_token
                        if req.params.logprobs is not None:
                            [req.first_logprobs] = conv.logprobs_from_pb([msg.done.first_logprob])
                        req.choice_firsts = self._choice_firsts(req, msg.done)
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
            if req.first_logprobs is not None and req.first_logprobs.token_id != first:
                raise errors.DataLoss(f"prefill sent logprobs for token {req.first_logprobs.token_id}, "
                                      f"not for its first token {first}")
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

    def _choice_firsts(self, req: Request, done: pb.PrefillDone) -> list:
        """n > 1: choices 1..n-1's first tokens (and logprobs when asked), checked like token 0's."""
        tokens, vocab = list(done.choice_first_tokens), self.runner.runtime.model_config.vocab_size
        if len(tokens) != req.params.n - 1:
            raise errors.DataLoss(f"prefill sent {len(tokens)} choices' first tokens for n={req.params.n} "
                                  f"(expected {req.params.n - 1}: an older prefill_svc?)")
        if any(not 0 <= t < vocab for t in tokens):
            raise errors.DataLoss(f"prefill sent a choice's first token outside the vocabulary [0, {vocab})")
        if req.params.logprobs is None:
            return [(t, None) for t in tokens]
        lps = conv.logprobs_from_pb(done.choice_first_logprobs)
        if [lp.token_id for lp in lps] != tokens:
            raise errors.DataLoss("prefill sent choices' logprobs for other tokens than their first tokens")
        return list(zip(tokens, lps))

    @staticmethod
    async def _verified(run: Run, fn, *args) -> None:
        try:
            await run(fn, *args)
        except WireError as e:
            raise errors.DataLoss(f"KV page refused: {e}") from e

    def _check_header(self, header, num_tokens: int, cached_pages: int) -> None:
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
