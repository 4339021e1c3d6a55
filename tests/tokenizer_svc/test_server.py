"""TokenizerService over real loopback gRPC, against a small real DecodeService servicer."""
import asyncio
import contextlib
import gc

import grpc
import pytest

from kvwire_serving.server import GrpcServer, build_channel
from kvwire.tokenizer import ChatMessage
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pb_grpc
from tokenizer_svc.detokenizer import REPLACEMENT
from tokenizer_svc.server import SERVICE_NAME, TokenizerServicer
from tests.tokenizer_svc.scripted_decode import ScriptedDecode, served


FakeDecode = ScriptedDecode


@contextlib.asynccontextmanager
async def stack(tokenizer, decode: FakeDecode | None, tp=None):
    """tokenizer_svc -> decode on loopback; ``decode=None`` points at a port nobody listens on."""
    async with served(decode, tp) as decode_addr:
        decode_channel = build_channel(decode_addr, tracer_provider=tp)
        server = GrpcServer(tracer_provider=tp)
        servicer = TokenizerServicer(tokenizer, pb_grpc.DecodeServiceStub(decode_channel), "tiny")
        server.add_service(pb_grpc.add_TokenizerServiceServicer_to_server, servicer, SERVICE_NAME)
        port = await server.start("127.0.0.1:0")
        client_channel = build_channel(f"127.0.0.1:{port}", tracer_provider=tp)
        try:
            yield pb_grpc.TokenizerServiceStub(client_channel)
        finally:
            await client_channel.close()
            await server.stop(0)
            await decode_channel.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def collect(stub, request):
    return [m async for m in stub.GenerateText(request)]


def test_tokenize_detokenize_round_trip(tokenizer):
    text = "Hello 안녕하세요 👩‍👩‍👧 你好 café"

    async def main():
        async with stack(tokenizer, None) as stub:
            tok = await stub.Tokenize(pb.TokenizeRequest(text=text))
            assert list(tok.token_ids) == tokenizer.encode(text) and len(tok.tokens) == len(tok.token_ids)
            assert (await stub.Detokenize(pb.DetokenizeRequest(token_ids=tok.token_ids))).text == text
            chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
            tok = await stub.Tokenize(pb.TokenizeRequest(chat=chat))
            raw = await stub.Detokenize(pb.DetokenizeRequest(token_ids=tok.token_ids, skip_special_tokens=False))
            assert raw.text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Detokenize(pb.DetokenizeRequest(token_ids=[1, 10**6]))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "1000000" in e.value.details()
    run(main())


def test_generate_streams_deltas_with_their_token_ids(tokenizer):
    reply = tokenizer.encode("안녕하세요 👩‍👩‍👧 world, 你好!", add_special_tokens=False)
    decode = FakeDecode(reply)

    async def main():
        async with stack(tokenizer, decode) as stub:
            params = pb.SamplingParams(max_tokens=len(reply), temperature=0.5, seed=7)
            return await collect(stub, pb.GenerateTextRequest(text="Hi", sampling=params, request_id="r1"))
    msgs = run(main())
    assert all(REPLACEMENT not in m.text for m in msgs)
    assert "".join(m.text for m in msgs) == tokenizer.decode(reply)
    assert [t for m in msgs for t in m.token_ids] == reply
    assert sum(1 for m in msgs if m.text) > 3  # streamed, not buffered to the end
    last = msgs[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(tokenizer.encode("Hi")), len(reply))
    [req] = decode.requests
    assert req.request_id.startswith("r1.") and list(req.prompt_token_ids) == tokenizer.encode("Hi")
    assert (req.sampling.max_tokens, req.sampling.temperature, req.sampling.seed) == (len(reply), 0.5, 7)
    assert req.sampling.top_p == 1.0  # defaults are filled in explicitly


def test_chat_prompt_uses_the_chat_template(tokenizer):
    decode = FakeDecode(tokenizer.encode("ok", add_special_tokens=False))

    async def main():
        async with stack(tokenizer, decode) as stub:
            chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="안녕")])
            return await collect(stub, pb.GenerateTextRequest(chat=chat))
    assert "".join(m.text for m in run(main())) == "ok"
    assert list(decode.requests[0].prompt_token_ids) == tokenizer.encode_chat([ChatMessage("user", "안녕")])


def test_stop_string_truncates_and_cancels_decode(tokenizer):
    decode = FakeDecode(tokenizer.encode("Hello world! STOP here and much more text", add_special_tokens=False),
                        delay=0.01)

    async def main():
        async with stack(tokenizer, decode) as stub:
            msgs = await collect(stub, pb.GenerateTextRequest(text="x", stops=["never", "STOP"]))
            await asyncio.wait_for(decode.cancelled.wait(), 5)
            return msgs
    msgs = run(main())
    assert "".join(m.text for m in msgs) == "Hello world! "
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP and msgs[-1].stop_string == "STOP"
    assert decode.sent < len(decode.reply)


@pytest.mark.parametrize("request_kwargs, words", [
    ({"text": ""}, "prompt is empty"),
    ({}, "prompt is empty"),
    ({"chat": pb.ChatMessages()}, "no messages"),
    ({"text": "x", "sampling": pb.SamplingParams(max_tokens=0)}, "max_tokens"),
    ({"text": "x", "sampling": pb.SamplingParams(temperature=-1)}, "temperature"),
    ({"text": "x", "sampling": pb.SamplingParams(top_p=0)}, "top_p"),
    ({"text": "x", "sampling": pb.SamplingParams(top_p=1.5)}, "top_p"),
    ({"text": "x", "sampling": pb.SamplingParams(top_k=-2)}, "top_k"),
    ({"text": "x", "sampling": pb.SamplingParams(stop_token_ids=[10**6])}, "stop_token_ids"),
    ({"text": "x", "stops": ["s"] * 17}, "at most 16"),
    ({"text": "x", "stops": ["s" * 257]}, "at most 256"),
    ({"text": "x", "stops": [""]}, "stops[0] is empty"),
])
def test_invalid_requests_are_refused_before_decode(tokenizer, request_kwargs, words):
    decode = FakeDecode([1])

    async def main():
        async with stack(tokenizer, decode) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(stub, pb.GenerateTextRequest(**request_kwargs))
            return e.value
    err = run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.details()
    assert decode.requests == []


def test_client_cancel_cancels_the_decode_call(tokenizer):
    decode = FakeDecode(tokenizer.encode("tick ", add_special_tokens=False), delay=0.02, endless=True)

    async def main():
        async with stack(tokenizer, decode) as stub:
            call = stub.GenerateText(pb.GenerateTextRequest(text="go"))
            got = [await call.read(), await call.read()]
            call.cancel()
            await asyncio.wait_for(decode.cancelled.wait(), 5)
            return got
    assert all(m.token_ids for m in run(main()))


def test_decode_down_is_unavailable(tokenizer):
    async def main():
        async with stack(tokenizer, None) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(stub, pb.GenerateTextRequest(text="x"))
            return e.value.code()
    assert run(main()) == grpc.StatusCode.UNAVAILABLE


def test_one_trace_across_the_hop_with_genai_attributes(tokenizer):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    decode = FakeDecode(tokenizer.encode("fine", add_special_tokens=False))

    async def main():
        async with stack(tokenizer, decode, tp) as stub:
            await collect(stub, pb.GenerateTextRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=9)))
    run(main())
    spans = {(s.name, s.kind.name): s for s in exporter.get_finished_spans()}
    front = spans[("/kvwire.v1.TokenizerService/GenerateText", "SERVER")]
    to_decode = spans[("/kvwire.v1.DecodeService/GenerateTokens", "CLIENT")]
    at_decode = spans[("/kvwire.v1.DecodeService/GenerateTokens", "SERVER")]
    assert len({front.context.trace_id, to_decode.context.trace_id, at_decode.context.trace_id}) == 1
    assert to_decode.parent.span_id == front.context.span_id
    assert at_decode.parent.span_id == to_decode.context.span_id
    assert front.attributes["gen_ai.request.max_tokens"] == 9
    assert front.attributes["gen_ai.usage.input_tokens"] == len(tokenizer.encode("Hi"))
    assert front.attributes["gen_ai.usage.output_tokens"] == len(decode.reply)
    assert list(front.attributes["gen_ai.response.finish_reasons"]) == ["length"]


class _EndableContext:
    """What GenerateText uses of a grpc context; ``end()`` ends the RPC as a cancel does, and (as grpc
    may) nothing resumes or closes the handler afterwards."""

    def __init__(self):
        self.callbacks = []

    def add_done_callback(self, cb) -> None:
        self.callbacks.append(cb)

    def time_remaining(self):
        return None

    def end(self) -> None:
        for cb in self.callbacks:
            cb(self)


def test_rpc_end_cancels_decode_even_if_grpc_leaves_the_handler_suspended(tokenizer):
    decode = FakeDecode(tokenizer.encode("tick ", add_special_tokens=False), delay=0.02, endless=True)

    async def main():
        async with served(decode) as addr:
            async with build_channel(addr) as ch:
                servicer = TokenizerServicer(tokenizer, pb_grpc.DecodeServiceStub(ch), "tiny")
                ctx = _EndableContext()
                handler = servicer.GenerateText(pb.GenerateTextRequest(text="go"), ctx)
                gc.disable()  # nothing may depend on the collector
                try:
                    await handler.__anext__()
                    await handler.__anext__()  # the handler now sits at its yield, decode streaming
                    ctx.end()
                    await asyncio.wait_for(decode.cancelled.wait(), 5)
                finally:
                    gc.enable()
                return handler is not None
    assert run(main())


@pytest.mark.parametrize("text", ["한국어로 말해요", "emoji 👩‍👩‍👧 end", "你好世界"])
def test_generation_stopped_mid_character_never_sends_half_of_it(tokenizer, text):
    """Decode stops (max_tokens) inside a multi-byte character: no delta ends in U+FFFD, the
    incomplete tail is dropped and the last message says so; a complete reply says nothing."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    cuts = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith(REPLACEMENT)]
    assert cuts  # the premise: this text is split inside characters by this tokenizer

    async def main(reply):
        async with stack(tokenizer, FakeDecode(reply)) as stub:
            return await collect(stub, pb.GenerateTextRequest(
                text="Hi", sampling=pb.SamplingParams(max_tokens=len(reply))))
    for k in cuts:
        msgs = run(main(ids[:k]))
        assert not any(m.text.endswith(REPLACEMENT) for m in msgs), [m.text for m in msgs]
        assert "".join(m.text for m in msgs) == tokenizer.decode(ids[:k]).rstrip(REPLACEMENT)
        assert [t for m in msgs for t in m.token_ids] == ids[:k]  # the dropped bytes' tokens are still listed
        assert msgs[-1].partial_character_dropped and msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    msgs = run(main(ids))
    assert "".join(m.text for m in msgs) == text and not msgs[-1].partial_character_dropped


def test_detokenizer_finish_drops_only_an_incomplete_tail(tokenizer):
    from tokenizer_svc.detokenizer import IncrementalDetokenizer
    ids = tokenizer.encode("한국어", add_special_tokens=False)
    k = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith(REPLACEMENT))
    detok = IncrementalDetokenizer(tokenizer.decode)
    pieces = [detok.add([i]) for i in ids[:k]]
    tail, dropped = detok.finish()
    assert dropped and not tail.endswith(REPLACEMENT)
    assert "".join(pieces) + tail == tokenizer.decode(ids[:k]).rstrip(REPLACEMENT)
    detok = IncrementalDetokenizer(tokenizer.decode)
    assert "".join(detok.add([i]) for i in ids) + detok.finish()[0] == "한국어"
    assert detok.finish() == ("", False)
