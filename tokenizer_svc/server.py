"""TokenizerService: the thin async front door (text in, text out).

Tokenizes (chat template included), validates, calls ``DecodeService.Generate`` and streams text
deltas back as tokens arrive. Stop strings are a text-level notion, so they are handled here: text
that might begin a stop string is held back, and on a match the text is cut before it and the
decode call is cancelled. Errors are raised as ``kvwire.errors`` and mapped by ``kvwire.serving``.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from functools import partial
from typing import Sequence

import jinja2
from opentelemetry import trace

from kvwire import errors
from kvwire.serving import DEFAULT_MAX_MESSAGE_BYTES
from kvwire.tokenizer import ChatMessage, ModelTokenizer
from protos import kvwire_pb2 as pb
from protos import kvwire_pb2_grpc as pb_grpc
from protos import convert as conv
from tokenizer_svc.detokenizer import IncrementalDetokenizer, StopStringMatcher

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TokenizerService"].full_name
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256

tracer = trace.get_tracer("kvwire.tokenizer_svc")


@dataclass(frozen=True)
class TokenizerServiceConfig:
    model_dir: str
    listen: str = "127.0.0.1:50051"
    decode_addr: str = "127.0.0.1:50052"
    model_name: str = ""  # reported as gen_ai.request.model; defaults to the model dir's name
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = 30.0
    drain_delay_s: float = 0.0
    metrics_port: int | None = None


def validate_stops(stops: Sequence[str]) -> tuple[str, ...]:
    if len(stops) > MAX_STOP_STRINGS:
        raise errors.InvalidArgument(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    for i, s in enumerate(stops):
        if not s:
            raise errors.InvalidArgument(f"stop[{i}] is empty; remove it or give it text")
        if len(s) > MAX_STOP_CHARS:
            raise errors.InvalidArgument(
                f"stop[{i}] has {len(s)} characters; at most {MAX_STOP_CHARS} are allowed")
    return tuple(stops)


class TokenizerServicer(pb_grpc.TokenizerServiceServicer):
    def __init__(self, tokenizer: ModelTokenizer, decode: pb_grpc.DecodeServiceStub, model_name: str):
        self.tok = tokenizer
        self.decode = decode
        self.model_name = model_name
        self._detok_decode = partial(tokenizer.decode, skip_special_tokens=True)

    # -- helpers ------------------------------------------------------------------------------

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        bad = next((i for i in ids if i >= self.tok.vocab_size), None)
        if bad is not None:
            raise errors.InvalidArgument(
                f"{what} contains token id {bad}, outside the vocabulary (size {self.tok.vocab_size})")

    def _encode_chat(self, chat: pb.ChatMessages) -> list[int]:
        if not chat.messages:
            raise errors.InvalidArgument("chat has no messages; add at least one {role, content}")
        if not self.tok.chat_template:
            raise errors.FailedPrecondition("this model has no chat template; send a text prompt")
        try:
            return self.tok.encode_chat([ChatMessage(m.role, m.content) for m in chat.messages])
        except jinja2.TemplateError as e:
            raise errors.InvalidArgument(f"the chat template rejected the messages: {e}") from e

    def _encode(self, kind: str | None, text: str, chat: pb.ChatMessages, add_special: bool) -> list[int]:
        if kind == "chat":
            return self._encode_chat(chat)
        if not text:
            raise errors.InvalidArgument("the prompt is empty: set text (non-empty) or chat")
        return self.tok.encode(text, add_special_tokens=add_special)

    # -- RPCs ---------------------------------------------------------------------------------

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = self._encode(request.WhichOneof("input"), request.text, request.chat, add_special)
        return pb.TokenizeResponse(token_ids=ids, tokens=[self.tok.tok.id_to_token(i) for i in ids])

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        self._check_ids(request.token_ids, "token_ids")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return pb.DetokenizeResponse(text=self.tok.decode(list(request.token_ids), skip_special_tokens=skip))

    async def Generate(self, request: pb.GenerateTextRequest, context):
        request_id = request.request_id or uuid.uuid4().hex
        params = conv.sampling_from_pb(request.sampling)  # unset message -> all defaults
        params.validate()
        self._check_ids(params.stop_token_ids, "sampling.stop_token_ids")
        stops = validate_stops(request.stop)
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
            prompt_ids = self._encode(kind, request.text, request.chat, add_special=True)
            tok_span.set_attribute("gen_ai.usage.input_tokens", len(prompt_ids))
        if not prompt_ids:
            raise errors.InvalidArgument("the prompt tokenizes to no tokens; send some text")
        span.set_attribute("gen_ai.usage.input_tokens", len(prompt_ids))

        # Created outside the detokenize span so the decode call's span is a sibling of it.
        call = self.decode.Generate(
            pb.GenerateTokensRequest(request_id=request_id, prompt_token_ids=prompt_ids,
                                     sampling=conv.sampling_to_pb(params)),
            timeout=context.time_remaining())
        detok = IncrementalDetokenizer(self._detok_decode, context_ids=prompt_ids)
        matcher = StopStringMatcher(stops)
        completion, done = 0, False
        try:
            with tracer.start_as_current_span("detokenize"):
                async for msg in call:
                    ids = list(msg.token_ids)
                    completion += len(ids)
                    finished = msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                    text = detok.add(ids) + (detok.flush() if finished else "")
                    safe, matched = matcher.feed(text)
                    if matched is not None:
                        call.cancel()  # the rest of the generation is not wanted
                        yield self._last(span, safe, ids, pb.FINISH_REASON_STOP,
                                         pb.Usage(prompt_tokens=len(prompt_ids), completion_tokens=completion),
                                         matched)
                        return
                    if finished:
                        usage = msg.usage if msg.HasField("usage") else pb.Usage(
                            prompt_tokens=len(prompt_ids), completion_tokens=completion)
                        yield self._last(span, safe + matcher.flush(), ids, msg.finish_reason, usage)
                        done = True
                        continue  # read on to the stream's end, so the call (and its span) completes
                    if safe or ids:
                        yield pb.GenerateTextResponse(text=safe, token_ids=ids)
            if not done:
                raise errors.Unavailable("the decode service ended the stream without a finish reason")
        finally:
            call.cancel()  # no-op after a normal end; cancels decode when our caller went away

    @staticmethod
    def _last(span, text: str, ids: list[int], reason: int, usage: pb.Usage,
              stop_string: str = "") -> pb.GenerateTextResponse:
        span.set_attributes({
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "gen_ai.response.finish_reasons": [pb.FinishReason.Name(reason).removeprefix(
                "FINISH_REASON_").lower()],
        })
        return pb.GenerateTextResponse(text=text, token_ids=ids, finish_reason=reason, usage=usage,
                                       stop_string=stop_string)

