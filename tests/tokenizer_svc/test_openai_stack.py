"""The OpenAI-compatible HTTP door on the three real services (separate processes, embedded model),
driven by the official ``openai`` SDK: same text as the gRPC door, exact usage, stop strings,
errors, cancellation that frees decode's pages, and one trace from HTTP down to prefill.
"""
from __future__ import annotations

import asyncio

import grpc
import openai
import pytest

from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.tokenizer import ChatMessage, ModelTokenizer
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tools.stack import Stack, free_port

MODEL = "kvwire-tiny"  # tokenizer_svc's default model id: the model dir's name
PROMPT = "The for statement"


@pytest.fixture(scope="module")
def stack(otlp_env, tmp_path_factory):
    env = otlp_env
    http_port = free_port()
    s = Stack(decode_pages=256, prefill_pages=256, env=env, log_dir=tmp_path_factory.mktemp("logs"),
              extra={"tokenizer_svc": ["--http-listen", f"127.0.0.1:{http_port}"],
                     # the trace test needs prefill_svc to compute a long prompt, which an idle decode_svc
                     # would prefill itself
                     "decode_svc": ["--no-local-prefill-when-idle"]})
    with s:
        s.http_base = f"http://127.0.0.1:{http_port}/v1"
        yield s


@pytest.fixture(scope="module")
def tok():
    return ModelTokenizer(DEFAULT_MODEL_DIR)


@pytest.fixture
def client(stack):
    with openai.OpenAI(base_url=stack.http_base, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def grpc_generate(stack, request: pb.GenerateTextRequest) -> tuple[str, list[int]]:
    async def run():
        async with grpc.aio.insecure_channel(stack.addr("tokenizer_svc")) as ch:
            text, ids = "", []
            async for msg in pbg.TokenizerServiceStub(ch).GenerateText(request):
                text, ids = text + msg.text, ids + list(msg.token_ids)
            return text, ids
    return asyncio.run(run())


def test_completions_match_the_grpc_door_with_exact_usage(stack, client, tok):
    text, ids = grpc_generate(stack, pb.GenerateTextRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=24)))
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True}))
    assert whole.choices[0].text == text and text
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    finish = "length" if len(ids) == 24 else "stop"
    assert whole.choices[0].finish_reason == finish
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]
    expected = (len(tok.encode(PROMPT)), len(ids), len(tok.encode(PROMPT)) + len(ids))
    for usage in (whole.usage, chunks[-1].usage):
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == expected


def test_chat_streamed_and_whole_agree(stack, client, tok):
    messages = [{"role": "user", "content": "What is a for loop?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert whole.choices[0].message.content == streamed and streamed
    prompt_ids = tok.encode_chat([ChatMessage("user", "What is a for loop?")])
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert 0 < whole.usage.completion_tokens <= 20


def test_seeded_sampling_is_reproducible(stack, client):
    def once():
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95,
                                         seed=1234).choices[0].text
    assert once() == once()


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_on_the_real_model(stack, client, stream):
    text, _ = grpc_generate(stack, pb.GenerateTextRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=24)))
    words = text.split()
    assert len(words) > 3
    stop = words[2]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=stop, stream=stream)
    if stream:
        chunks = list(r)
        got, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        got, reason = r.choices[0].text, r.choices[0].finish_reason
    assert (got, reason) == (text[:text.index(stop)], "stop")


def test_errors_through_the_stack(stack, client):
    with pytest.raises(openai.BadRequestError) as e:  # refused by decode_svc: does not fit the context
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5000)
    assert "context" in e.value.body["message"] and e.value.body["code"] == "invalid_argument"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    assert e.value.body["param"] == "n"
    assert [m.id for m in client.models.list()] == [MODEL]


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_returns_decode_pages_to_baseline(stack, stream):
    async def pool(stub):
        return await stub.GetPoolStats(pb.GetPoolStatsRequest())

    async def run():
        async with grpc.aio.insecure_channel(stack.addr("decode_svc")) as dch:
            decode = pbg.DecodeServiceStub(dch)
            baseline = (await pool(decode)).free_pages
            client = openai.AsyncOpenAI(base_url=stack.http_base, api_key="unused", max_retries=0)
            body = dict(model=MODEL, prompt=PROMPT + " " + PROMPT * 20, max_tokens=1000, stream=stream)
            task = asyncio.ensure_future(client.completions.create(**body))
            if stream:
                chunks = await task
                async for _ in chunks:
                    break
            for _ in range(200):  # wait until decode holds the request's pages
                if (await pool(decode)).free_pages < baseline:
                    break
                await asyncio.sleep(0.05)
            assert (await pool(decode)).free_pages < baseline
            if stream:
                await chunks.close()
            else:
                task.cancel()
            await client.close()
            for _ in range(100):
                stats = await pool(decode)
                if stats.free_pages == baseline and stats.running == 0 and stats.waiting == 0:
                    return True
                await asyncio.sleep(0.1)
            return False
    assert asyncio.run(run())


def test_one_trace_from_http_to_prefill(stack, client, receiver):
    receiver.clear()
    # Long enough (> decode_svc's --local-prefill-max-tokens, 256) that prefill_svc computes the KV
    # (the stack runs decode_svc with --no-local-prefill-when-idle).
    long_question = "The for statement iterates over the items of a sequence. " * 40
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_question}], max_tokens=6)

    def complete(ss):  # spans export as they end: wait for the HTTP span's trace with every parent
        roots = [s for s in ss if s.name == "POST /v1/chat/completions"]
        ss = [s for s in ss if roots and s.trace_id == roots[0].trace_id]  # earlier tests' stragglers aside
        ids = {s.span_id for s in ss}
        return any(s.name.endswith("PrefillService/Prefill") and s.kind == 2 for s in ss) and \
            all(not s.parent_span_id or s.parent_span_id in ids for s in ss)
    spans = receiver.wait_for(complete, timeout=20)
    [http] = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert http.kind == 2 and not http.parent_span_id  # SERVER, the trace's root
    in_trace = {s.span_id: s for s in spans if s.trace_id == http.trace_id}

    def parent(s):
        return in_trace[s.parent_span_id]
    def server_span(suffix):
        return next(s for s in in_trace.values() if s.name.endswith(suffix) and s.kind == 2)
    decode_server = server_span("DecodeService/GenerateTokens")
    prefill_server = server_span("PrefillService/Prefill")
    assert parent(parent(decode_server)) is http  # HTTP server -> gRPC client -> decode server
    assert parent(prefill_server).service_name == decode_server.service_name
    assert len({http.service_name, decode_server.service_name, prefill_server.service_name}) == 3
    tokenize = next(s for s in in_trace.values() if s.name == "tokenize")
    assert parent(tokenize) is http
    assert http.attributes["http.response.status_code"] == 200
    assert http.attributes["http.route"] == "/v1/chat/completions"
    assert http.attributes["gen_ai.request.model"] == MODEL
    assert http.attributes["gen_ai.usage.output_tokens"] >= 1


def test_sigterm_lets_an_http_stream_finish_then_exits_cleanly(stack):
    """Runs last: it stops the module's stack. A stream in flight at SIGTERM completes."""
    import json
    import signal

    import aiohttp

    async def run():
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "stream": True,
                "stream_options": {"include_usage": True}}
        async with aiohttp.ClientSession() as s, s.post(stack.http_base + "/completions", json=body) as r:
            events = [await r.content.readline()]
            stack.procs["tokenizer_svc"].send_signal(signal.SIGTERM)
            async for line in r.content:
                events.append(line)
        return [e.decode().strip() for e in events if e.strip()]
    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["usage"]["completion_tokens"] > 1
    assert stack.procs["tokenizer_svc"].wait(timeout=20) == 0  # drained, then exited by itself
    assert stack.stop() == {"prefill_svc": 0, "decode_svc": 0, "tokenizer_svc": 0}
