"""PrefillService: a thin async adapter over PrefillRunner.

One ``Prefill`` call is one server stream: header (spec + fingerprint), the KV pages of each
layer as soon as that layer is computed (chunks of at most 1 MiB), then the first token. The
request's pages live exactly as long as the stream: when it ends, fails or is cancelled they go
back to the pool (the forward is told to stop at its next layer).
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

from opentelemetry import trace

from kvwire.engine.prefix_cache import page_hashes, reusable_pages
from kvwire.errors import FailedPrecondition, InvalidRequest
from kvwire.kv.wire import KVChunk, encode_layer
from kvwire.logprobs import token_logprobs
from kvwire.sampler import sample_first
from kvwire.validation import RequestLimits, validate_request
from prefill_svc.runner import PrefillRunner
from protos import convert as conv
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc

tracer = trace.get_tracer("kvwire.prefill_svc")
_DONE = -1


class PrefillServicer(kvwire_pb2_grpc.PrefillServiceServicer):
    def __init__(self, runner: PrefillRunner, executor: ThreadPoolExecutor | None = None,
                 eos_ids: frozenset[int] | None = None):
        """``eos_ids``: what min_tokens holds back at token 0 beside stop_token_ids, unless ignore_eos
        (default: config.json's; decode_svc sends its whole stop set with ignore_eos, so its own
        set is the one used)."""
        self.runner = runner
        self.runtime = runner.runtime
        cfg = runner.runtime.model_config
        self.eos_ids = frozenset(cfg.eos_token_ids) if eos_ids is None else eos_ids
        self.limits = RequestLimits(vocab_size=cfg.vocab_size, max_context=cfg.max_position_embeddings)
        # the thread that computes (kvwire_serving.cores.compute_executor: the one the model was loaded on)
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill")
        self.active_streams = 0  # Prefill streams past validation and not yet ended

    def _check_expectations(self, request: pb.PrefillRequest) -> None:
        diffs = []
        if request.HasField("expected_spec"):
            diffs += conv.spec_from_pb(request.expected_spec).diff(self.runtime.spec)
        if request.HasField("expected_fingerprint"):
            diffs += conv.fingerprint_from_pb(request.expected_fingerprint).diff(self.runtime.fingerprint)
        if diffs:
            raise FailedPrecondition("prefill and decode run different models or KV layouts "
                                     "(decode's value != prefill's): " + "; ".join(diffs))

    def _check_cached_prefix(self, request: pb.PrefillRequest, tokens: list[int]) -> int:
        """The pages decode says it holds: at most the reusable ones, named as this replica names them."""
        n, bs = request.cached_pages, self.runtime.spec.block_size
        if n > reusable_pages(len(tokens), bs):
            raise InvalidRequest(f"cached_pages {n} exceeds the {reusable_pages(len(tokens), bs)} full pages "
                                 f"before the prompt's last token ({len(tokens)} tokens, {bs} a page)")
        if n and page_hashes(tokens[:n * bs], bs, self.runner.salt)[-1] != request.cached_prefix_hash:
            raise FailedPrecondition("cached_prefix_hash does not name these tokens' first cached_pages pages "
                                     "under this model and page layout; send cached_pages=0")
        return n
    async def Prefill(self, request: pb.PrefillRequest, context):
        tokens = list(request.token_ids)
        params = conv.sampling_from_pb(request.sampling)
        validate_request(tokens, params, self.limits, what="token_ids", new_tokens=0)  # KV of the prompt only
        self.runner.check_fits(len(tokens))
        self._check_expectations(request)
        skip = self._check_cached_prefix(request, tokens)  # pages decode holds: not sent
        spec = self.runtime.spec
        yield pb.PrefillResponse(header=pb.PrefillHeader(
            spec=conv.spec_to_pb(spec), fingerprint=conv.fingerprint_to_pb(self.runtime.fingerprint),
            num_tokens=len(tokens), num_pages=spec.pages_for(len(tokens)), first_page=skip))

        loop = asyncio.get_running_loop()
        layers: asyncio.Queue[list[KVChunk] | int] = asyncio.Queue()
        abort = threading.Event()
        seq = self.runner.new_sequence()

        def on_layer(layer: int) -> None:  # worker thread: the layer's pages are copied and encoded here,
            # between layers of the forward, so the event loop only builds and sends the messages
            chunks = [dataclasses.replace(c, first_page=c.first_page + skip)
                      for c in encode_layer(spec, layer, *self.runner.layer_pages(seq, layer, skip))]
            loop.call_soon_threadsafe(layers.put_nowait, chunks)

        self.active_streams += 1
        self.runner.expect()
        fut = loop.run_in_executor(self.executor, self.runner.forward, seq, tokens, on_layer, abort)
        fut.add_done_callback(lambda _: loop.call_soon_threadsafe(layers.put_nowait, _DONE))
        ended = False

        def end_stream(_=None) -> None:  # event loop; idempotent
            nonlocal ended
            if not ended:
                ended = True
                self.active_streams -= 1
                abort.set()
                fut.add_done_callback(lambda f: self._release_when_done(f, seq))

        # A cancelled call may leave this generator suspended (grpc does not close it), and its
        # finally would then wait for garbage collection: end the stream when the RPC ends too.
        context.add_done_callback(lambda _: loop.call_soon_threadsafe(end_stream))
        with tracer.start_as_current_span("prefill.forward") as span:
            span.set_attributes({"gen_ai.usage.input_tokens": len(tokens), "kvwire.request_id": request.request_id,
                                 "kvwire.quantization": self.runtime.fingerprint.quantization,
                                 "kvwire.kv_dtype": spec.dtype.value})
            try:
                sent_bytes = 0
                for _ in range(spec.num_layers):
                    chunks = await layers.get()
                    if chunks == _DONE:
                        break  # the forward failed before this layer; fut carries the error
                    for chunk in chunks:
                        sent_bytes += chunk.nbytes
                        yield pb.PrefillResponse(chunk=conv.chunk_to_pb(chunk))
                # Shielded: a cancel arriving here would otherwise cancel ``fut`` itself, which marks it
                # cancelled while the worker thread still finishes the forward, and its pages
                # (owned by this stream on success) would never be released.
                logits = await asyncio.shield(fut)
                stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
                first = await loop.run_in_executor(self.executor, sample_first, logits, params, tokens,
                                                   stops)  # tensor work: there
                done = pb.PrefillDone(first_token=first, prompt_tokens=len(tokens))
                # n > 1: choices 1..n-1's first tokens too, each from its own seed stream (seed + i)
                done.choice_first_tokens.extend([await loop.run_in_executor(
                    self.executor, sample_first, logits, params.for_choice(i), tokens, stops)
                    for i in range(1, params.n)])
                if params.logprobs is not None:
                    lps = [(await loop.run_in_executor(self.executor, token_logprobs, logits[None], [t],
                                                       params.logprobs))[0]
                           for t in [first, *done.choice_first_tokens]]  # one row each, as decode computes them
                    done.first_logprob.CopyFrom(conv.logprobs_to_pb(lps)[0])
                    done.choice_first_logprobs.extend(conv.logprobs_to_pb(lps[1:]))
                span.set_attributes({"kvwire.kv.bytes_sent": sent_bytes, "kvwire.first_token": first,
                                     "kvwire.kv.pages_skipped": skip})
                yield pb.PrefillResponse(done=done)
            finally:
                end_stream()

    def _release_when_done(self, fut, seq: int) -> None:
        # Runs once the forward is over, whatever the stream did: a successful forward's pages
        # belong to this stream, which has ended, so they go back now (a failed one freed its own).
        if not fut.cancelled() and fut.exception() is None:
            self.runner.release(seq)

    async def GetPrefillPoolStats(self, request: pb.GetPrefillPoolStatsRequest,
                                  context) -> pb.GetPrefillPoolStatsResponse:
        s, spec = self.runner.stats(), self.runtime.spec
        return pb.GetPrefillPoolStatsResponse(
            total_pages=s["num_pages"], free_pages=s["free"], used_pages=s["used"],
            active_streams=self.active_streams, spec=conv.spec_to_pb(spec),
            page_bytes=spec.page_bytes_per_layer * spec.num_layers, usage_fraction=s["used"] / s["num_pages"],
            cached_pages=s["cached_pages"])
