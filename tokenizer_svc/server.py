"""TokenizerService: the thin async front door (text in, text out).

Tokenizes (chat template included), validates, calls ``DecodeService.GenerateTokens`` and streams text
deltas back as tokens arrive. Stop strings are a text-level notion, so they are handled here: text
that might begin a stop string is held back, and on a match the text is cut before it and the
decode call is cancelled. Errors are raised as ``kvwire.errors`` and mapped by ``kvwire_serving.server``.

The front door is bounded: a prompt over ``max_prompt_bytes`` is refused before any tokenizing;
tokenizing runs on a small thread pool (at most ``tokenize_workers`` at once, the rest wait), never
on the event loop, so health checks and short requests are not held up by a large prompt; a prompt
over ``max_prompt_tokens`` is refused after. The request id decode sees is this door's own (the
client's id plus a random suffix), so one caller can neither collide with nor probe another's.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Sequence

import jinja2
from opentelemetry import trace

from kvwire import errors, metrics
from kvwire_serving.security import ClientSecurity, ServerSecurity
from kvwire_serving.server import DEFAULT_MAX_MESSAGE_BYTES, close_when_rpc_ends
from kvwire.sampling_params import FinishReason
from kvwire.tokenizer import ChatMessage, ModelTokenizer
from kvwire.validation import RequestLimits, check_token_ids, validate_request
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pb_grpc
from protos import convert as conv
from tokenizer_svc import memory
from tokenizer_svc.detokenizer import IncrementalDetokenizer, StopStringMatcher
from tokenizer_svc.routing import PrefixRouter, RoundRobinRouter, RoutingConfig

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TokenizerService"].full_name
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
DEFAULT_MAX_PROMPT_BYTES = 1 << 20  # 1 MiB of UTF-8: far above any supported context, far below the message limit
DEFAULT_MAX_PROMPT_TOKENS = 131_072
DEFAULT_TOKENIZE_WORKERS = 2
# The front door's gRPC message limit: a larger request is refused by gRPC itself (RESOURCE_EXHAUSTED,
# "message larger than max") before Python parses it, so a flood of huge requests cannot hold the GIL.
DEFAULT_FRONT_DOOR_MESSAGE_BYTES = 2 << 20
_PROMPT_FIELD = {pb.GenerateTextRequest: "prompt", pb.TokenizeRequest: "input"}

tracer = trace.get_tracer("kvwire.tokenizer_svc")


@dataclass(frozen=True)
class TokenizerServiceConfig:
    model_dir: str
    listen: str = "127.0.0.1:50051"
    decode_addr: str = "127.0.0.1:50052"
    model_name: str = ""  # reported as gen_ai.request.model; defaults to the model dir's name
    max_message_bytes: int = DEFAULT_FRONT_DOOR_MESSAGE_BYTES
    grace_s: float = 30.0
    drain_delay_s: float = 0.0
    metrics_port: int | None = None
    metrics_host: str | None = None  # None: --listen's host
    http_listen: str | None = None  # host:port of the OpenAI-compatible HTTP door; off if None
    cors_allowed_origins: tuple[str, ...] = ()  # the HTTP door's CORS origins ("*": any); none: CORS off
    http_metrics: bool = False  # /metrics on the HTTP door's port too
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    tokenize_workers: int = DEFAULT_TOKENIZE_WORKERS
    reflection: bool = True
    security: ServerSecurity = field(default_factory=ServerSecurity)
    decode_security: ClientSecurity = field(default_factory=ClientSecurity)
    routing: RoutingConfig = field(default_factory=RoutingConfig)  # which decode replica (routing.py)


@dataclass(frozen=True)
class PromptLimits:
    max_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    max_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    workers: int = DEFAULT_TOKENIZE_WORKERS


def validate_stops(stops: Sequence[str]) -> tuple[str, ...]:
    if len(stops) > MAX_STOP_STRINGS:
        raise errors.InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    for i, s in enumerate(stops):
        if not s:
            raise errors.InvalidRequest(f"stops[{i}] is empty; remove it or give it text")
        if len(s) > MAX_STOP_CHARS:
            raise errors.InvalidRequest(
                f"stops[{i}] has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed")
    return tuple(stops)


def json_list(text: str, what: str) -> list[dict] | None:
    """A ``*_json`` field of ChatMessages: a JSON list of objects, or None when empty."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise errors.InvalidRequest(f"{what} is not valid JSON: {e}") from e
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise errors.InvalidRequest(f"{what} must be a JSON list of objects")
    return value


def chat_messages(chat: pb.ChatMessages) -> list[ChatMessage]:
    out = []
    for i, m in enumerate(chat.messages):
        calls = json_list(m.tool_calls_json, f"messages[{i}].tool_calls_json") or []
        if not all(isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str) for c in calls):
            raise errors.InvalidRequest(f"messages[{i}].tool_calls_json: each call needs function.name")
        out.append(ChatMessage(m.role, m.content, tuple(calls), m.tool_call_id, m.name))
    return out


def prompt_bytes(kind: str | None, text: str, chat: pb.ChatMessages) -> int:
    if kind == "chat":
        return sum(len(m.role.encode()) + len(m.content.encode()) + len(m.tool_calls_json.encode())
                   for m in chat.messages) + len(chat.tools_json.encode())
    return len(text.encode())


class TokenizerServicer(pb_grpc.TokenizerServiceServicer):
    def __init__(self, tokenizer: ModelTokenizer, decode: pb_grpc.DecodeServiceStub | PrefixRouter,
                 model_name: str, limits: PromptLimits = PromptLimits()):
        self.tok = tokenizer
        # A stub: gRPC's round_robin picks the decode replica; a router picks it per prompt.
        self.router = decode if isinstance(decode, PrefixRouter) else RoundRobinRouter(decode)
        self.model_name = model_name
        self.limits = limits
        self._detok_decode = partial(tokenizer.decode, skip_special_tokens=True)
        memory.return_freed_memory()  # this process's malloc policy (tokenizer_svc/memory.py)
        self.reclaimer = memory.Reclaimer()
        self._pool = ThreadPoolExecutor(max_workers=limits.workers, thread_name_prefix="tokenize")
        self._slots: asyncio.Semaphore | None = None  # made in the serving loop, on first use

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- helpers ------------------------------------------------------------------------------

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        check_token_ids(ids, self.tok.vocab_size, what)

    def _encode_chat(self, chat: pb.ChatMessages) -> list[int]:
        if not chat.messages:
            raise errors.InvalidRequest("chat has no messages; add at least one {role, content}")
        if not self.tok.chat_template:
            raise errors.FailedPrecondition("this model has no chat template; send a text prompt")
        try:
            text = self.tok.apply_chat_template(chat_messages(chat), tools=json_list(chat.tools_json, "tools_json"))
        except jinja2.TemplateError as e:
            raise errors.InvalidRequest(f"the chat template rejected the messages: {e}") from e
        return self._encode_text(text, add_special=False)  # the template places the special tokens

    def _encode_text(self, text: str, add_special: bool) -> list[int]:
        # encode_batch, not encode: the Rust tokenizer releases the GIL only there, so the event
        # loop (health, other requests) keeps running while a long prompt is tokenized. The token
        # cap is checked on the Rust encoding, before its ids become a (GIL-bound) Python list.
        [encoding] = self.tok.tok.encode_batch([text], add_special_tokens=add_special)
        n = len(encoding)
        if n > self.limits.max_tokens:
            del encoding
            raise errors.InvalidRequest(f"the prompt is {n} tokens; at most {self.limits.max_tokens} "
                                        "are accepted (--max-prompt-tokens)")
        return encoding.ids

    def _encode_sync(self, kind: str | None, text: str, chat: pb.ChatMessages, add_special: bool,
                     size: int = 0) -> list[int]:
        try:
            if kind == "chat":
                return self._encode_chat(chat)
            if not text:
                raise errors.InvalidRequest("the prompt is empty: set text (non-empty) or chat")
            return self._encode_text(text, add_special)
        finally:  # the tokenizer's buffers are free by now: a large prompt's go back to the kernel
            memory.after_prompt(size)

    def _check_size(self, request) -> None:
        """Refuse an oversized text prompt from its length in characters (each is >= 1 byte),
        before it is encoded to count bytes; chat is measured in ``_encode``."""
        if request.WhichOneof(_PROMPT_FIELD[type(request)]) != "text":
            return
        if (n := len(request.text)) > self.limits.max_bytes:
            raise errors.InvalidRequest(f"the prompt is at least {n} bytes; at most {self.limits.max_bytes} are "
                                        "accepted (--max-prompt-bytes)")

    async def _encode(self, kind: str | None, text: str, chat: pb.ChatMessages, add_special: bool) -> list[int]:
        """Size-checked, then tokenized on the bounded pool (never on the event loop)."""
        size = prompt_bytes(kind, text, chat)
        if size > self.limits.max_bytes:
            raise errors.InvalidRequest(f"the prompt is {size} bytes; at most {self.limits.max_bytes} are "
                                        "accepted (--max-prompt-bytes)")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limits.workers)
        async with self._slots:  # waiting here costs a coroutine, not a thread or the loop
            ids = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._encode_sync, kind, text, chat, add_special, size)
        return ids

    def reclaim_after(self, request) -> None:
        """A large request's memory goes back to the kernel once its call has ended (memory.py)."""
        if request.ByteSize() >= memory.LARGE_PROMPT_BYTES:
            self.reclaimer.soon()

    # -- RPCs ---------------------------------------------------------------------------------

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        try:
            self._check_size(request)
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await self._encode(request.WhichOneof("input"), request.text, request.chat, add_special)
            return pb.TokenizeResponse(token_ids=ids, tokens=[self.tok.tok.id_to_token(i) for i in ids])
        finally:
            self.reclaim_after(request)

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        self._check_ids(request.token_ids, "token_ids")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(text=self.tok.decode(list(request.token_ids), skip_special_tokens=skip))

    async def GenerateText(self, request: pb.GenerateTextRequest, context):
        responses = self.generate_text(request, context.time_remaining())
        close_when_rpc_ends(context, responses)  # a cancelled caller cancels decode now, not at GC time
        try:
            async with contextlib.aclosing(responses):
                async for response in responses:
                    yield response
        finally:
            self.reclaim_after(request)

    async def generate_text(self, request: pb.GenerateTextRequest, timeout: float | None):
        """The text pipeline without the transport (gRPC above; the OpenAI HTTP door in
        openai_http.py): yields GenerateTextResponse messages; closing it cancels the decode call."""
        self._check_size(request)
        # Decode sees this door's id, never the caller's alone: ids cannot collide across callers.
        request_id = f"{request.request_id}.{uuid.uuid4().hex[:16]}" if request.request_id else uuid.uuid4().hex
        timer = metrics.RequestTimer(self.model_name)  # TTFT / ITL / e2e as the client sees them
        params = conv.sampling_from_pb(request.sampling)  # unset message -> all defaults
        params.validate()  # before tokenizing: a bad request costs nothing
        stops = validate_stops(request.stops)
        kv_source = conv.kv_source_from_pb(request.kv_source)
        kind = request.WhichOneof("prompt")
        span = trace.get_current_span()
        span.set_attributes({
            "kvwire.request_id": request_id,
            "gen_ai.operation.name": "chat" if kind == "chat" else "text_completion",
            "gen_ai.request.model": self.model_name,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.top_k": params.top_k,
        })
        if stops:
            span.set_attribute("gen_ai.request.stop_sequences", list(stops))
        with tracer.start_as_current_span("tokenize") as tok_span:
            prompt_ids = await self._encode(kind, request.text, request.chat, add_special=True)
            tok_span.set_attribute("gen_ai.usage.input_tokens", len(prompt_ids))
        # The shared rule (decode applies it too, with the model's context limit).
        validate_request(prompt_ids, params, RequestLimits(vocab_size=self.tok.vocab_size), what="the prompt")
        span.set_attribute("gen_ai.usage.input_tokens", len(prompt_ids))
        timer.prompt(len(prompt_ids))

        # Created outside the detokenize span so the decode call's span is a sibling of it.
        decode = self.router.lease(prompt_ids)
        call = decode.stub.GenerateTokens(
            pb.GenerateTokensRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                     sampling=conv.sampling_to_pb(params), kv_source=conv.kv_source_to_pb(kv_source)),
            timeout=timeout)
        n = params.n
        # per choice: its detokenizer and stop-string matcher, its completion tokens, ended here or not
        detoks = [IncrementalDetokenizer(self._detok_decode, context_ids=prompt_ids) for _ in range(n)]
        matchers = [StopStringMatcher(stops) for _ in range(n)]
        completion, ended, reasons = [0] * n, [False] * n, [""] * n
        first: dict = {}  # what the first message to our caller carries beside its tokens
        started = False
        try:
            with tracer.start_as_current_span("detokenize"):
                async for msg in call:
                    i = msg.index
                    if not 0 <= i < n:
                        raise errors.Unavailable(f"the decode service sent choice {i} of a request for n={n}")
                    if ended[i]:
                        continue  # ended here by a stop string: the rest of this choice is not wanted
                    ids, logprobs = list(msg.token_ids), list(msg.logprobs)
                    if params.prompt_logprobs is not None and not started:
                        first = {"prompt_token_ids": prompt_ids, "prompt_logprobs": list(msg.prompt_logprobs)}
                    started = True
                    completion[i] += len(ids)
                    timer.tokens(len(ids))
                    finished = msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                    text, dropped = detoks[i].add(ids), False
                    if finished:  # an incomplete last character is dropped, never sent as U+FFFD
                        tail, dropped = detoks[i].finish()
                        text += tail
                    safe, matched = matchers[i].feed(text)
                    usage = pb.Usage(prompt_tokens=len(prompt_ids), completion_tokens=completion[i])
                    if matched is not None:
                        ended[i], reasons[i] = True, FinishReason.STOP.value
                        if all(ended):
                            call.cancel()  # the rest of the generation is not wanted
                            self._finish(span, timer, reasons, completion)
                        yield self._last(safe, ids, pb.FINISH_REASON_STOP, usage, i, matched, logprobs=logprobs,
                                         **first)
                        first = {}
                        if all(ended):
                            return
                        continue
                    if finished:
                        if msg.HasField("usage"):
                            usage = msg.usage
                        ended[i], reasons[i] = True, conv.finish_from_pb(msg.finish_reason).value
                        if all(ended):
                            self._finish(span, timer, reasons, completion)
                        yield self._last(safe + matchers[i].flush(), ids, msg.finish_reason, usage, i,
                                         partial_dropped=dropped, logprobs=logprobs, **first)
                        first = {}
                        continue  # read on to the stream's end, so the call (and its span) completes
                    if safe or ids:
                        yield pb.GenerateTextResponse(text=safe, token_ids=ids, logprobs=logprobs, index=i, **first)
                        first = {}
            if not all(ended):
                raise errors.Unavailable("the decode service ended the stream without a finish reason")
        finally:
            call.cancel()  # no-op after a normal end; cancels decode when our caller went away
            decode.release()

    @staticmethod
    def _finish(span, timer: metrics.RequestTimer, reasons: list[str], completion: list[int]) -> None:
        """Every choice has ended: the request's metrics and span attributes."""
        timer.finish(reasons[0])  # one request: counted under choice 0's reason
        span.set_attributes({"gen_ai.usage.output_tokens": sum(completion),
                             "gen_ai.response.finish_reasons": reasons})

    @staticmethod
    def _last(text: str, ids: list[int], reason: int, usage: pb.Usage, index: int,
              stop_string: str = "", partial_dropped: bool = False,
              logprobs: Sequence[pb.TokenLogprob] = (), **first) -> pb.GenerateTextResponse:
        return pb.GenerateTextResponse(text=text, token_ids=ids, finish_reason=reason, usage=usage,
                                       stop_string=stop_string, partial_character_dropped=partial_dropped,
                                       logprobs=logprobs, index=index, **first)
