"""The OpenAI-compatible HTTP door, driven by the official ``openai`` SDK over real loopback HTTP.

The door runs on the real TokenizerServicer, which calls a real gRPC DecodeService that streams a
scripted reply (so the expected text, usage and cancellation are known exactly). The same door
against the three real services is tested in test_openai_stack.py.
"""
import asyncio
import contextlib
import json

import aiohttp
import grpc
import openai
import pytest

from kvwire import errors
from kvwire_serving.server import build_channel
from kvwire.tokenizer import ChatMessage
from protos.kvwire.v1 import kvwire_pb2_grpc as pb_grpc
from tokenizer_svc.openai_http import OpenAIHttpServer, split_host_port
from tokenizer_svc.server import TokenizerServicer
from tests.tokenizer_svc.scripted_decode import ScriptedDecode, served

MODEL = "tiny"


@contextlib.asynccontextmanager
async def door(tokenizer, decode: ScriptedDecode | None, tp=None, **http_kw):
    """HTTP door -> TokenizerServicer -> decode on loopback; yields (AsyncOpenAI, base url).
    ``http_kw``: more OpenAIHttpServer options (cors_origins, tokens)."""
    async with served(decode, tp) as decode_addr:
        channel = build_channel(decode_addr, tracer_provider=tp)
        http = OpenAIHttpServer(TokenizerServicer(tokenizer, pb_grpc.DecodeServiceStub(channel), MODEL),
                                MODEL, max_body_bytes=1 << 16, grace_s=1, tracer_provider=tp, **http_kw)
        port = await http.start("127.0.0.1:0")
        base = f"http://127.0.0.1:{port}/v1"
        client = openai.AsyncOpenAI(base_url=base, api_key="unused", max_retries=0, timeout=20)
        try:
            yield client, base
        finally:
            await client.close()
            await http.stop()
            await channel.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def chat_ids(tokenizer):
    return tokenizer.encode_chat([ChatMessage(m["role"], m["content"]) for m in CHAT])


def test_chat_completion_whole(tokenizer):
    reply = tokenizer.encode("안녕하세요 👩‍👩‍👧 world", add_special_tokens=False)
    decode = ScriptedDecode(reply)

    async def main():
        async with door(tokenizer, decode) as (client, _):
            return await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_completion_tokens=len(reply), temperature=0.5, top_p=0.9, seed=7,
                extra_body={"ignore_eos": True})
    r = run(main())
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    [choice] = r.choices
    assert choice.message.role == "assistant" and choice.message.content == tokenizer.decode(reply)
    assert choice.finish_reason == "length"
    prompt = len(chat_ids(tokenizer))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (prompt, len(reply), prompt + len(reply))
    [req] = decode.requests
    assert list(req.prompt_token_ids) == chat_ids(tokenizer)  # the chat template was applied
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.ignore_eos) == (len(reply), 0.5, 0.9, 7, True)


def test_chat_completion_streams_chunks_and_usage(tokenizer):
    reply = tokenizer.encode("Hello world! 你好 😀 café", add_special_tokens=False)

    async def main():
        async with door(tokenizer, ScriptedDecode(reply)) as (client, _):
            stream = await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=len(reply), stream=True,
                stream_options={"include_usage": True})
            return [c async for c in stream]
    chunks = run(main())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 3  # streamed piece by piece, not buffered
    assert all("\ufffd" not in t for t in content)
    assert "".join(content) == tokenizer.decode(reply)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == len(reply)
    assert usage.usage.prompt_tokens == len(chat_ids(tokenizer))
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_whole_and_streamed_with_openai_default_max_tokens(tokenizer):
    reply = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    decode = ScriptedDecode(reply)

    async def main():
        async with door(tokenizer, decode) as (client, _):
            whole = await client.completions.create(model=MODEL, prompt="Hello")
            stream = await client.completions.create(model=MODEL, prompt=["Hello"], stream=True)
            return whole, [c async for c in stream]
    whole, chunks = run(main())
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    assert whole.choices[0].text == tokenizer.decode(reply) and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(tokenizer.encode("Hello"))
    assert "".join(c.choices[0].text for c in chunks) == tokenizer.decode(reply)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert [r.sampling.max_tokens for r in decode.requests] == [16, 16]  # OpenAI's completions default
    assert decode.requests[0].sampling.temperature == 1.0  # omitted: OpenAI's (no generation_config value)


def test_chat_without_max_tokens_leaves_the_service_default(tokenizer):
    decode = ScriptedDecode(tokenizer.encode("ok", add_special_tokens=False))

    async def main():
        async with door(tokenizer, decode) as (client, _):
            await client.chat.completions.create(model=MODEL, messages=CHAT)
    run(main())
    assert decode.requests[0].sampling.max_tokens == 128  # protos.convert.DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text_and_cancels_decode(tokenizer, stream):
    decode = ScriptedDecode(tokenizer.encode("Hello world! The quick brown fox", add_special_tokens=False),
                            delay=0.01, endless=True)

    async def main():
        async with door(tokenizer, decode) as (client, _):
            r = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=500, stop=["quick", "zzz"],
                                                stream=stream)
            if stream:
                chunks = [c async for c in r]
                text = "".join(c.choices[0].text for c in chunks)
                reason = chunks[-1].choices[0].finish_reason
            else:
                text, reason = r.choices[0].text, r.choices[0].finish_reason
            await asyncio.wait_for(decode.cancelled.wait(), 5)
            return text, reason
    assert run(main()) == ("Hello world! The ", "stop")


def test_models_list_and_retrieve(tokenizer):
    async def main():
        async with door(tokenizer, None) as (client, _):
            listed = [m async for m in client.models.list()]
            one = await client.models.retrieve(MODEL)
            with pytest.raises(openai.NotFoundError) as e:
                await client.models.retrieve("gpt-4o")
            return listed, one, e.value
    listed, one, err = run(main())
    assert [m.id for m in listed] == [MODEL] and listed[0].object == "model"
    assert one.id == MODEL and one.owned_by == "kvwire"
    assert err.status_code == 404 and err.code == "model_not_found"


@pytest.mark.parametrize("kwargs, exc, param", [
    (dict(temperature=-1.0), openai.BadRequestError, "temperature"),
    (dict(temperature="hot"), openai.BadRequestError, "temperature"),
    (dict(top_p=0.0), openai.BadRequestError, "top_p"),
    (dict(max_tokens=0), openai.BadRequestError, "max_tokens"),
    (dict(max_completion_tokens=-3), openai.BadRequestError, "max_completion_tokens"),
    (dict(seed=-1), openai.BadRequestError, "seed"),
    (dict(extra_body={"ignore_eos": "yes"}), openai.BadRequestError, "ignore_eos"),
    (dict(n=17), openai.BadRequestError, "n"),
    (dict(n=2, extra_body={"best_of": 3}), openai.BadRequestError, "best_of"),
    (dict(top_logprobs=3), openai.BadRequestError, "top_logprobs"),  # without logprobs: true
    (dict(logprobs=True, top_logprobs=21), openai.BadRequestError, "top_logprobs"),
    (dict(presence_penalty=2.5), openai.BadRequestError, "presence_penalty"),
    (dict(logit_bias={"x": 1}), openai.BadRequestError, "logit_bias"),
    (dict(extra_body={"min_tokens": 50}, max_tokens=10), openai.BadRequestError, None),  # together: no one param
    (dict(extra_body={"repetition_penalty": 0}), openai.BadRequestError, "repetition_penalty"),
    (dict(response_format={"type": "xml"}), openai.BadRequestError, "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": '{"type": "object"'}}),
     openai.BadRequestError, "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}), openai.BadRequestError,
     "guided_regex"),
    (dict(functions=[{"name": "f"}]), openai.BadRequestError, "functions"),
    (dict(reasoning_effort="low"), openai.BadRequestError, "reasoning_effort"),
    (dict(extra_body={"guided_json": "{not json"}), openai.BadRequestError, "guided_json"),
    (dict(extra_body={"guided_choice": "yes"}), openai.BadRequestError, "guided_choice"),
    (dict(extra_body={"structured_outputs": {"regex": "a+"}}), openai.BadRequestError, "structured_outputs"),
    (dict(extra_body={"echo": True}), openai.BadRequestError, "echo"),
    (dict(stop=[""]), openai.BadRequestError, "stop"),
    (dict(stop=["x"] * 17), openai.BadRequestError, "stop"),
    (dict(messages=[]), openai.BadRequestError, "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     openai.BadRequestError, "messages[0].content[0]"),
    (dict(model="gpt-4o"), openai.NotFoundError, "model"),
])
def test_bad_requests_get_openai_errors_naming_the_param(tokenizer, kwargs, exc, param):
    decode = ScriptedDecode(tokenizer.encode("ok", add_special_tokens=False))

    async def main():
        async with door(tokenizer, decode) as (client, _):
            with pytest.raises(exc) as e:
                await client.chat.completions.create(**{"model": MODEL, "messages": CHAT, **kwargs})
            return e.value
    err = run(main())
    assert err.body["param"] == param and err.body["message"] and err.body["type"] == "invalid_request_error"
    assert not decode.requests  # refused before any work


@pytest.mark.parametrize("abort, exc, status", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, openai.RateLimitError, 429),
    (grpc.StatusCode.INVALID_ARGUMENT, openai.BadRequestError, 400),
    (grpc.StatusCode.UNAVAILABLE, openai.InternalServerError, 503),
    (grpc.StatusCode.FAILED_PRECONDITION, openai.InternalServerError, 503),  # prefill/decode mismatch
])
def test_decode_statuses_map_to_http_statuses(tokenizer, abort, exc, status):
    async def main():
        async with door(tokenizer, ScriptedDecode(abort=abort)) as (client, _):
            for stream in (False, True):  # errors before the first token come before the status line
                with pytest.raises(exc) as e:
                    await client.completions.create(model=MODEL, prompt="Hi", stream=stream)
                assert e.value.status_code == status and e.value.body["code"] == abort.name.lower()
    run(main())


def test_error_after_the_stream_started_arrives_in_band(tokenizer):
    reply = tokenizer.encode("Hello world, the quick brown fox", add_special_tokens=False)

    async def main():
        async with door(tokenizer, ScriptedDecode(reply, abort=grpc.StatusCode.DATA_LOSS, abort_after=4)) as (c, b):
            stream = await c.completions.create(model=MODEL, prompt="Hi", max_tokens=50, stream=True)
            got = []
            with pytest.raises(openai.APIError) as e:
                async for chunk in stream:
                    got.append(chunk.choices[0].text)
            async with aiohttp.ClientSession() as s:  # the raw events: the error, then [DONE]
                async with s.post(b + "/completions", json={"model": MODEL, "prompt": "Hi", "stream": True}) as r:
                    events = [line.strip() async for line in r.content if line.strip()]
            return got, e.value, events
    got, err, events = run(main())
    assert got and "".join(got) in tokenizer.decode(reply)
    assert "scripted failure" in err.message and err.body["code"] == "data_loss"
    assert json.loads(events[-2].removeprefix(b"data: "))["error"]["type"] == "server_error"
    assert events[-1] == b"data: [DONE]"


def test_decode_down_is_503_not_500(tokenizer):
    async def main():
        async with door(tokenizer, None) as (client, _):
            with pytest.raises(openai.InternalServerError) as e:
                await client.chat.completions.create(model=MODEL, messages=CHAT)
            return e.value
    err = run(main())
    assert err.status_code == 503 and err.body["type"] == "server_error"


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/chat/completions", b"{not json", 400),
    ("POST", "/chat/completions", b'{"model": "tiny", "messages": [], "temperature": NaN}', 400),
    ("POST", "/chat/completions", b"[1, 2]", 400),
    ("POST", "/completions", json.dumps({"model": MODEL, "prompt": [1, 2, 3]}).encode(), 400),
    ("POST", "/completions", json.dumps({"model": MODEL, "prompt": "x" * (1 << 17)}).encode(), 413),
    ("GET", "/chat/completions", b"", 405),
    ("GET", "/nothing/here", b"", 404),
])
def test_raw_http_errors_keep_the_openai_shape(tokenizer, method, path, body, status):
    async def main():
        async with door(tokenizer, None) as (_, base):
            async with aiohttp.ClientSession() as s:
                async with s.request(method, base + path, data=body,
                                     headers={"Content-Type": "application/json"}) as r:
                    return r.status, await r.json()
    got, payload = run(main())
    assert got == status
    assert set(payload["error"]) == {"message", "type", "param", "code"} and payload["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_the_decode_call(tokenizer, stream):
    decode = ScriptedDecode(tokenizer.encode("Hello world", add_special_tokens=False), delay=0.01, endless=True)

    async def main():
        async with door(tokenizer, decode) as (_, base):
            async with aiohttp.ClientSession() as s:
                body = {"model": MODEL, "prompt": "Hi", "max_tokens": 100000, "stream": stream}
                request = asyncio.ensure_future(s.post(base + "/completions", json=body))
                while decode.sent < 5:
                    await asyncio.sleep(0.01)
                if stream:
                    r = await request
                    assert r.status == 200 and (await r.content.readline()).startswith(b"data: ")
                    r.close()  # drop the connection mid-stream
                else:
                    request.cancel()  # drop the connection while the whole answer is still being made
                await asyncio.wait_for(decode.cancelled.wait(), 5)
                return decode.sent
    sent = run(main())
    assert sent < 1000  # stopped long before the 100000 asked for


def test_http_span_parents_the_decode_call(tokenizer):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))

    async def main():
        async with door(tokenizer, ScriptedDecode(tokenizer.encode("fine", add_special_tokens=False)), tp) as (c, _):
            await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    run(main())
    spans = {(s.name, s.kind.name): s for s in exporter.get_finished_spans()}
    http = spans[("POST /v1/chat/completions", "SERVER")]
    to_decode = spans[("/kvwire.v1.DecodeService/GenerateTokens", "CLIENT")]
    at_decode = spans[("/kvwire.v1.DecodeService/GenerateTokens", "SERVER")]
    assert http.parent is None
    assert to_decode.parent.span_id == http.context.span_id
    assert at_decode.parent.span_id == to_decode.context.span_id
    a = http.attributes
    assert (a["http.request.method"], a["http.route"], a["http.response.status_code"]) == \
        ("POST", "/v1/chat/completions", 200)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.max_tokens"] == 4
    assert a["gen_ai.usage.output_tokens"] == len(tokenizer.encode("fine", add_special_tokens=False))


def test_split_host_port():
    assert split_host_port("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert split_host_port("[::1]:0") == ("::1", 0)
    with pytest.raises(ValueError, match="host:port"):
        split_host_port("8000")


def test_a_taken_port_is_one_clear_error(tokenizer):
    async def main():
        async with door(tokenizer, None) as (_, base):
            taken = base.removeprefix("http://").removesuffix("/v1")
            other = OpenAIHttpServer(TokenizerServicer(tokenizer, None, MODEL), MODEL)
            with pytest.raises(errors.Unavailable, match=f"could not bind --http-listen {taken}"):
                await other.start(taken)
    run(main())


def test_chat_on_a_model_without_a_chat_template_is_400(model_dir, tmp_path):
    import shutil

    from kvwire.tokenizer import ModelTokenizer

    shutil.copy(model_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    decode = ScriptedDecode()

    async def main():
        async with door(ModelTokenizer(tmp_path), decode) as (client, _):
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model=MODEL, messages=CHAT)
            return e.value
    err = run(main())
    assert err.body["param"] == "messages" and "/v1/completions" in err.body["message"]
    assert not decode.requests


@pytest.mark.parametrize("path, body, param", [
    ("/completions", b'{"model": "tiny", "prompt": "\xff\xfeThe \xc3\x28"}', "prompt"),
    ("/completions", b'{"model": "tiny", "prompt": ["\\ud800"]}', "prompt[0]"),
    ("/completions", b'{"model": "tiny", "prompt": "Hi", "stop": ["a", "\xc3"]}', "stop[1]"),
    ("/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "ok\xed\xa0\x80"}]}',
     "messages[0].content"),
    ("/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                          b'"text": "\\udc00"}]}]}', "messages[0].content[0].text"),
])
def test_text_that_is_not_utf8_is_400_naming_the_param(tokenizer, path, body, param):
    """Undecodable bytes or a lone surrogate escape in any JSON string: 400 naming where, before any work."""
    decode = ScriptedDecode(tokenizer.encode("ok", add_special_tokens=False))

    async def main():
        async with door(tokenizer, decode) as (_, base):
            async with aiohttp.ClientSession() as s:
                async with s.post(base + path, data=body, headers={"Content-Type": "application/json"}) as r:
                    return r.status, await r.json()
    status, payload = run(main())
    assert status == 400, payload
    assert payload["error"]["param"] == param and "UTF-8" in payload["error"]["message"], payload
    assert not decode.requests
