"""The decode engine: admission, KV pull from prefill_svc, and the continuous-batching loop.

One asyncio task runs the loop: every iteration takes all decoding requests, runs one batched
step in the worker thread and hands each request its tokens; requests join (after their KV
arrived) and leave (finished, failed or cancelled) between steps. With speculative decoding a
request's step first gets proposals (n-gram lookup, or the draft model batched over the requests
that use it), then one target forward verifies every request's proposals at once, and the
acceptance rule (decode_svc.speculative) decides how many tokens each request emits (1..k + 1);
requests with and without speculation, and with different k, share that forward. Every runner call goes through
one single-thread executor in submission order, so a request's pages are freed only after any
step or import already queued for it: cancellation at any moment never leaks or reuses a page.
"""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from opentelemetry import trace
from prometheus_client import Counter, Histogram

from kvwire.errors import DataLoss, FailedPrecondition, InvalidArgument, ResourceExhausted
from kvwire.kv.wire import TransferTracker, WireError, decode_chunk
from kvwire.sampler import sample
from kvwire.sampling import SamplingParams
from decode_svc import speculative as spec
from decode_svc.runner import DecodeRunner
from decode_svc.scheduler import AdmissionError, Phase, Scheduler, SeqState
from protos import convert as conv
from protos import kvwire_pb2 as pb

tracer = trace.get_tracer("kvwire.decode_svc")

# Named after vLLM's vllm:spec_decode_* metrics; label "method" is draft | ngram.
SPEC_DRAFTS = Counter("kvwire:spec_decode_num_drafts", "Verification steps that checked proposals", ["method"])
SPEC_DRAFT_TOKENS = Counter("kvwire:spec_decode_num_draft_tokens", "Proposed (draft) tokens verified", ["method"])
SPEC_ACCEPTED_TOKENS = Counter("kvwire:spec_decode_num_accepted_tokens", "Proposed tokens accepted", ["method"])
SPEC_EMITTED_TOKENS = Counter("kvwire:spec_decode_num_emitted_tokens",
                              "Tokens emitted by verification steps (accepted + correction/bonus)", ["method"])
SPEC_REQ_ACCEPTANCE = Histogram("kvwire:spec_decode_request_acceptance_rate",
                                "Per finished request: accepted / proposed tokens", ["method"],
                                buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0))
SPEC_REQ_ACCEPTED_PER_STEP = Histogram("kvwire:spec_decode_request_mean_accepted_tokens_per_step",
                                       "Per finished request: accepted tokens per verification step", ["method"],
                                       buckets=(0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16))


@dataclass
class _Request:
    id: str
    seq: int
    prompt: list[int]
    params: SamplingParams
    stops: frozenset[int]
    state: SeqState
    admitted: asyncio.Event = field(default_factory=asyncio.Event)
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    context: list[int] = field(default_factory=list)  # prompt + generated; the last one not yet fed
    generated: int = 0
    steps: int = 0
    done: bool = False
    mode: str = "none"  # speculative decoding: none | draft | ngram
    k_max: int = 0  # proposals per step at most (the request's or the service's k)
    k: int = 0  # proposals next step (adapted to acceptance)
    spec_steps: int = 0  # steps that verified at least one proposal
    drafted: int = 0
    accepted: int = 0


@dataclass(frozen=True)
class Output:
    tokens: list[int]
    finish_reason: str | None  # "stop" | "length" on the last output


class DecodeEngine:
    def __init__(self, runner: DecodeRunner, scheduler: Scheduler, prefill_stub, eos_ids=frozenset(),
                 spec_config: spec.SpecConfig = spec.SpecConfig()):
        self.runner, self.scheduler, self.prefill = runner, scheduler, prefill_stub
        self.spec = spec_config
        self.engine = runner.engine
        self.eos_ids = frozenset(eos_ids)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")
        self.requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.total_steps = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="decode-loop")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # ---- one request ----------------------------------------------------------------------------

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        cfg = self.engine.model_config
        if not prompt:
            raise InvalidArgument("prompt_token_ids is empty: send at least one token")
        params.validate()
        bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
        if bad:
            raise InvalidArgument(f"token ids {bad[:5]} are outside the vocabulary [0, {cfg.vocab_size})")
        if len(prompt) + params.max_tokens > cfg.max_position_embeddings:
            raise InvalidArgument(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {cfg.max_position_embeddings} tokens; lower max_tokens or shorten the prompt")
        if self.spec_mode(params) == "draft" and self.runner.draft is None:
            raise FailedPrecondition("speculative=draft: this decode_svc has no draft model loaded (start it "
                                     "with --draft-model-dir DIR); use speculative=ngram or none")

    def spec_mode(self, params: SamplingParams) -> str:
        return params.speculative or self.spec.mode

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams) -> AsyncIterator[Output]:
        self.validate(prompt, params)
        if request_id in self.requests:
            raise InvalidArgument(f"request_id {request_id!r} is already running")
        try:
            state = self.scheduler.submit(request_id, len(prompt), params.max_tokens)
        except AdmissionError as e:
            raise ResourceExhausted(str(e)) from e
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        req = _Request(request_id, next(self._seq_ids), prompt, params, stops, state)
        self.requests[request_id] = req
        decode_span = None
        try:
            self._admit()
            await req.admitted.wait()
            first = await self._pull_kv(req)
            req.generated = 1
            finish = self._finish_reason(req, first)
            yield Output([first], finish)
            if finish:
                return
            decode_span = tracer.start_span("decode")
            req.mode = self.spec_mode(params)
            req.k = req.k_max = 0 if req.mode == "none" else params.num_speculative_tokens or self.spec.num_tokens
            req.context, req.state.phase = [*prompt, first], Phase.DECODING
            self._work.set()
            while True:
                item = await req.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason:
                    return
        finally:
            req.done = True
            self.requests.pop(request_id, None)
            self.scheduler.finish(request_id)
            self.executor.submit(self.runner.free, req.seq)  # after anything queued for it
            if decode_span is not None:
                decode_span.set_attributes({"gen_ai.usage.output_tokens": req.generated,
                                            "kvwire.decode.steps": req.steps, **self._spec_report(req)})
                decode_span.end()
            self._admit()

    def _finish_reason(self, req: _Request, token: int) -> str | None:
        if token in req.stops:
            return "stop"
        return "length" if req.generated >= req.params.max_tokens else None

    def _admit(self) -> None:
        for state in self.scheduler.admit():
            self.requests[state.request_id].admitted.set()

    async def _pull_kv(self, req: _Request) -> int:
        """Stream the prompt's KV from prefill_svc into this request's pages; returns the first token."""
        spec = self.engine.spec
        call = self.prefill.Prefill(pb.PrefillRequest(
            request_id=req.id, token_ids=req.prompt, sampling=conv.sampling_to_pb(req.params),
            expected_spec=conv.spec_to_pb(spec), expected_fingerprint=conv.fingerprint_to_pb(self.engine.fingerprint)))
        with tracer.start_as_current_span("kv_transfer") as span:
            tracker, pages, first = None, [], None
            try:
                async for msg in call:
                    kind = msg.WhichOneof("kind")
                    if kind == "header":
                        self._check_header(msg.header, len(req.prompt))
                        pages = await self._run(self.runner.import_begin, req.seq, len(req.prompt))
                        tracker = TransferTracker(spec, len(pages))
                    elif kind == "chunk":
                        if tracker is None:
                            raise DataLoss("prefill sent a KV chunk before its header")
                        chunk = conv.chunk_from_pb(msg.chunk)
                        try:
                            decoded = decode_chunk(spec, chunk, len(pages))
                            tracker.record(chunk)
                        except WireError as e:
                            raise DataLoss(f"KV page refused: {e}") from e
                        await self._run(self.runner.import_chunk, pages, decoded)
                    elif kind == "done":
                        first = msg.done.first_token
            finally:
                call.cancel()  # no-op when the stream ended normally
            if tracker is None or first is None:
                raise DataLoss("the prefill stream ended early (truncated): no header or no final message")
            missing = tracker.missing()
            if missing:
                raise DataLoss(f"the prefill stream is missing {len(missing)} (layer, page) KV pages, "
                               f"first {missing[0]}")
            bf16_bytes = len(pages) * spec.num_layers * 2 * spec.values_per_page * 2
            span.set_attributes({
                "kvwire.kv.pages": len(pages) * spec.num_layers, "kvwire.kv.bytes": tracker.bytes,
                "kvwire.kv.chunks": tracker.chunks, "kvwire.kv.dtype": spec.dtype.value,
                "kvwire.kv.compression_vs_bf16": round(bf16_bytes / tracker.bytes, 3) if tracker.bytes else 0.0,
                "kvwire.kv.checksums_verified": tracker.chunks, "kvwire.kv.checksum_failures": 0})
            return first

    def _check_header(self, header: pb.PrefillHeader, num_tokens: int) -> None:
        diffs = self.engine.spec.diff(conv.spec_from_pb(header.spec))
        diffs += self.engine.fingerprint.diff(conv.fingerprint_from_pb(header.fingerprint))
        if diffs:
            raise FailedPrecondition("prefill_svc runs a different model or KV layout "
                                     "(decode's value != prefill's): " + "; ".join(diffs))
        if header.num_tokens != num_tokens:
            raise DataLoss(f"prefill announced {header.num_tokens} tokens for a {num_tokens}-token prompt")

    # ---- the batching loop ----------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            batch = [r for r in self.requests.values() if r.state.phase is Phase.DECODING and not r.done]
            if not batch:
                self._work.clear()
                await self._work.wait()
                continue
            try:
                results = await self._run(self._step, batch)
            except Exception as e:  # noqa: BLE001 - the requests in the step fail, the loop goes on
                for r in batch:
                    r.state.phase = Phase.FINISHED
                    r.out.put_nowait(e)
                continue
            self.total_steps += 1
            for r, (tokens, proposed) in zip(batch, results):
                if r.done:
                    continue
                r.steps += 1
                if proposed:
                    self._record_spec(r, proposed, len(tokens) - 1)
                emitted, finish = [], None
                for token in tokens:  # a stop token or max_tokens may cut a step's tokens short
                    r.generated += 1
                    r.context.append(token)
                    emitted.append(token)
                    finish = self._finish_reason(r, token)
                    if finish:
                        r.state.phase = Phase.FINISHED
                        break
                r.out.put_nowait(Output(emitted, finish))

    def _step(self, batch: list[_Request]) -> list[tuple[list[int], int]]:
        """One decode iteration, in the worker thread: proposals, one batched target forward that
        verifies them, acceptance, rollback. Returns (tokens to emit, number proposed) per request."""
        ks = [self._num_proposals(r) for r in batch]
        props: list[list[int]] = [[] for _ in batch]
        qs: list = [None] * len(batch)
        for i, r in enumerate(batch):
            if r.mode == "ngram" and ks[i]:
                props[i] = spec.ngram_propose(r.context, ks[i], self.spec.ngram_max, self.spec.ngram_min)
        drafting = [i for i, r in enumerate(batch) if r.mode == "draft" and ks[i]]
        if drafting:
            drafts = self.runner.propose([batch[i].seq for i in drafting], [batch[i].context for i in drafting],
                                         [ks[i] for i in drafting], [batch[i].params for i in drafting],
                                         [batch[i].generated for i in drafting])
            for i, (tokens, q) in zip(drafting, drafts):
                props[i], qs[i] = tokens, q
        logits = self.runner.step([r.seq for r in batch], [[r.context[-1], *p] for r, p in zip(batch, props)])
        results = []
        for r, p, q, rows in zip(batch, props, qs, logits):
            if not p:
                tokens = [sample(rows[-1], r.params, r.generated)]
            elif r.params.greedy:
                tokens = spec.accept_greedy(rows, p)
            else:
                tokens = spec.accept_sampled(rows, p, q, r.params, r.generated)
            if p:
                self.runner.keep(r.seq, len(tokens))  # the fed token + the accepted proposals
            if r.mode == "draft":
                self.runner.draft_truncate(r.seq, len(r.context) + len(tokens) - 1)
            results.append((tokens, len(p)))
        return results

    def _num_proposals(self, r: _Request) -> int:
        # Never propose past max_tokens: the step's last token (correction or bonus) is the last allowed.
        k = min(r.k, r.params.max_tokens - r.generated - 1)
        if r.mode == "draft" and len(r.context) + k > self.runner.draft.model_config.max_position_embeddings:
            return 0
        return max(0, k)

    def _record_spec(self, r: _Request, proposed: int, accepted: int) -> None:
        r.spec_steps += 1
        r.drafted += proposed
        r.accepted += accepted
        if self.spec.adaptive:
            r.k = spec.adapt_k(r.k, proposed, accepted, r.k_max)
        SPEC_DRAFTS.labels(r.mode).inc()
        SPEC_DRAFT_TOKENS.labels(r.mode).inc(proposed)
        SPEC_ACCEPTED_TOKENS.labels(r.mode).inc(accepted)
        SPEC_EMITTED_TOKENS.labels(r.mode).inc(accepted + 1)

    def _spec_report(self, r: _Request) -> dict:
        """The decode span's speculative attributes (and the per-request histograms)."""
        attrs = {"kvwire.spec.mode": r.mode}
        if r.mode == "none":
            return attrs
        rate = r.accepted / r.drafted if r.drafted else 0.0
        per_step = r.accepted / r.spec_steps if r.spec_steps else 0.0
        if r.drafted:
            SPEC_REQ_ACCEPTANCE.labels(r.mode).observe(rate)
            SPEC_REQ_ACCEPTED_PER_STEP.labels(r.mode).observe(per_step)
        return {**attrs, "kvwire.spec.num_speculative_tokens": r.k_max, "kvwire.spec.steps": r.spec_steps,
                "kvwire.spec.num_draft_tokens": r.drafted, "kvwire.spec.num_accepted_tokens": r.accepted,
                "kvwire.spec.acceptance_rate": round(rate, 4),
                "kvwire.spec.mean_accepted_tokens_per_step": round(per_step, 4),
                "kvwire.spec.mean_tokens_per_step": round((r.generated - 1) / r.steps, 4) if r.steps else 0.0}

    def pool_stats(self) -> dict[str, int]:
        return {**self.runner.stats(), **self.scheduler.stats()}

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=False)
