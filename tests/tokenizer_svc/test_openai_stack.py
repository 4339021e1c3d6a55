"""The OpenAI-compatible HTTP door on the three real services (separate processes, embedded model),
driven by the official ``openai`` SDK: same text as the gRPC door, exact usage, stop strings,
errors, cancellation that frees decode's pages, and one trace from HTTP down to prefill.
"""
from __future__ import annotations

import asyncio

import grpc
import openai
import pytest
import torch
import transformers

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
    # bf16 KV pages: logprobs are compared with transformers (FP8 pages move them by up to 0.22 here)
    s = Stack(decode_pages=256, prefill_pages=256, kv_dtype="bf16", env=env, log_dir=tmp_path_factory.mktemp("logs"),
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
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stream=True, temperature=0,
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
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, stream=True, temperature=0)
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
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=stop, stream=stream, temperature=0)
    if stream:
        chunks = list(r)
        got, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        got, reason = r.choices[0].text, r.choices[0].finish_reason
    assert (got, reason) == (text[:text.index(stop)], "stop")


def test_logprobs_are_transformers_log_softmax_on_both_doors(stack, client, tok):
    """gRPC and HTTP give the same logprobs: transformers' log_softmax of the embedded model (fp32
    weights) to the KV pages' rounding (bf16 here: measured 1.1e-2 at most over 24 tokens; FP8 pages
    0.22; tests/engine/test_logprobs.py holds a bf16 checkpoint to 1e-3). Row i scores token i: an
    off-by-one would be off by whole nats. Penalties change the tokens, not how they are scored."""
    request = pb.GenerateTextRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=12, logprobs=3))
    ids, lps = [], []

    async def grpc_run():
        async with grpc.aio.insecure_channel(stack.addr("tokenizer_svc")) as ch:
            async for msg in pbg.TokenizerServiceStub(ch).GenerateText(request):
                assert len(msg.logprobs) == len(msg.token_ids)
                ids.extend(msg.token_ids)
                lps.extend(msg.logprobs)
    asyncio.run(grpc_run())
    prompt = tok.encode(PROMPT)
    model = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        every = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0], -1)  # row r scores token r + 1
    want = every[len(prompt) - 1:-1]
    for i, (t, lp) in enumerate(zip(ids, lps)):
        assert lp.token_id == t and abs(lp.logprob - float(want[i, t])) < 2e-2, i
        assert [x.token_id for x in lp.top_logprobs][0] == t  # greedy: the most likely one
        assert [x.logprob for x in lp.top_logprobs] == pytest.approx(want[i].topk(3).values.tolist(), abs=2e-2)
    http = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    assert http.choices[0].logprobs.token_logprobs == pytest.approx([lp.logprob for lp in lps], abs=1e-6)
    penalised = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
                                          presence_penalty=2, frequency_penalty=2, extra_body={"min_tokens": 12})
    assert penalised.choices[0].text != http.choices[0].text
    assert penalised.usage.completion_tokens == 12
    echo = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3, echo=True)
    assert echo.choices[0].text == PROMPT + http.choices[0].text
    got = echo.choices[0].logprobs.token_logprobs
    assert got[0] is None and len(got) == len(prompt) + 12
    assert got[1:len(prompt)] == pytest.approx([float(every[i, t]) for i, t in enumerate(prompt[1:])], abs=2e-2)
    assert got[len(prompt):] == pytest.approx([lp.logprob for lp in lps], abs=1e-6)


def test_errors_through_the_stack(stack, client):
    with pytest.raises(openai.BadRequestError) as e:  # refused by decode_svc: does not fit the context
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5000)
    assert "context" in e.value.body["message"] and e.value.body["code"] == "invalid_argument"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=17)
    assert e.value.body["param"] == "n"
    assert [m.id for m in client.models.list()] == [MODEL]


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_on_both_endpoints(stack, client, tok, stream):
    """n=3: indices 0..2, each choice its own finish reason; seeded choices differ and choice i is
    n=1 with seed + i; greedy choices are n=1's text; usage counts the prompt once."""
    def choices(create, **kw):
        r = create(model=MODEL, max_tokens=12, stream=stream, **({"stream_options": {"include_usage": True}}
                                                                  if stream else {}), **kw)
        if not stream:
            return {c.index: (c.text if hasattr(c, "text") else c.message.content, c.finish_reason)
                    for c in r.choices}, r.usage
        texts, reasons, usage = {}, {}, None
        for chunk in r:
            usage = chunk.usage or usage
            for c in chunk.choices:
                assert c.index not in reasons  # nothing after a choice's finish
                piece = c.text if hasattr(c, "text") else c.delta.content
                texts[c.index] = texts.get(c.index, "") + (piece or "")
                if c.finish_reason:
                    reasons[c.index] = c.finish_reason
        return {i: (texts[i], reasons.get(i)) for i in texts}, usage

    def text_of(create, **kw):
        return choices(create, **kw)[0][0][0]

    for create, prompt in ((client.completions.create, {"prompt": PROMPT}),
                           (client.chat.completions.create, {"messages": [{"role": "user", "content": "Hi"}]})):
        sampled, usage = choices(create, n=3, temperature=1.0, seed=99, extra_body={"ignore_eos": True}, **prompt)
        assert sorted(sampled) == [0, 1, 2] and all(r == "length" for _, r in sampled.values())
        assert len({t for t, _ in sampled.values()}) == 3  # different choices differ
        assert sampled == choices(create, n=3, temperature=1.0, seed=99, extra_body={"ignore_eos": True},
                                  **prompt)[0]  # reproducible
        assert sampled[2][0] == text_of(create, temperature=1.0, seed=101, extra_body={"ignore_eos": True}, **prompt)
        prompt_tokens = usage.prompt_tokens
        assert (usage.completion_tokens, usage.total_tokens) == (36, prompt_tokens + 36)
        greedy, _ = choices(create, n=2, temperature=0, **prompt)
        assert greedy[0] == greedy[1] and greedy[0][0] == text_of(create, temperature=0, **prompt)


def test_best_of_returns_the_n_most_likely_of_its_candidates(stack, client):
    """best_of=4, n=2 generates what n=4 with the same seed does and returns the two of highest
    cumulative logprob, best first; usage counts the returned choices, as vLLM's."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=77, extra_body={"ignore_eos": True})
    every = client.completions.create(n=4, logprobs=0, **kw).choices
    ranked = sorted(every, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == 16
    for bad in (dict(n=2, best_of=1), dict(n=1, best_of=2, stream=True), dict(best_of=17)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{**kw, **bad})
        assert e.value.body["param"] == "best_of"


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_only_its_choice(stack, client, stream):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=31, n=2,
              extra_body={"ignore_eos": True})
    free = {c.index: c.text for c in client.completions.create(**kw).choices}
    stop = next(w for w in free[0].split()[1:] if w not in free[1])  # in choice 0's text only
    r = client.completions.create(stop=stop, stream=stream, **kw)
    got, reasons = {0: "", 1: ""}, {}
    for c in (c for chunk in r for c in chunk.choices) if stream else r.choices:
        got[c.index] += c.text
        if c.finish_reason:
            reasons[c.index] = c.finish_reason
    assert got == {0: free[0][:free[0].index(stop)], 1: free[1]} and reasons == {0: "stop", 1: "length"}


def test_n_choices_on_the_grpc_door_with_logprobs(stack):
    async def run():
        async with grpc.aio.insecure_channel(stack.addr("tokenizer_svc")) as ch:
            texts, ids, lps, last = {}, {}, {}, {}
            async for m in pbg.TokenizerServiceStub(ch).GenerateText(pb.GenerateTextRequest(
                    text=PROMPT, sampling=pb.SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=3, logprobs=1,
                                                            ignore_eos=True))):
                texts[m.index] = texts.get(m.index, "") + m.text
                ids.setdefault(m.index, []).extend(m.token_ids)
                lps.setdefault(m.index, []).extend(lp.token_id for lp in m.logprobs)
                if m.finish_reason:
                    last[m.index] = (m.finish_reason, m.usage.completion_tokens)
            return texts, ids, lps, last
    texts, ids, lps, last = asyncio.run(run())
    assert sorted(texts) == [0, 1, 2] and all(lps[i] == ids[i] and len(ids[i]) == 10 for i in ids)
    assert last == {i: (pb.FINISH_REASON_LENGTH, 10) for i in range(3)}
    alone = grpc_generate(stack, pb.GenerateTextRequest(text=PROMPT, sampling=pb.SamplingParams(
        max_tokens=10, temperature=1.0, seed=6, ignore_eos=True)))
    assert (texts[1], ids[1]) == alone


@pytest.mark.parametrize("stream, n", [(False, 1), (True, 1), (True, 4)])
def test_client_disconnect_returns_decode_pages_to_baseline(stack, stream, n):
    async def pool(stub):
        return await stub.GetPoolStats(pb.GetPoolStatsRequest())

    async def run():
        async with grpc.aio.insecure_channel(stack.addr("decode_svc")) as dch:
            decode = pbg.DecodeServiceStub(dch)
            baseline = (await pool(decode)).free_pages
            client = openai.AsyncOpenAI(base_url=stack.http_base, api_key="unused", max_retries=0)
            body = dict(model=MODEL, prompt=PROMPT + " " + PROMPT * 20, max_tokens=1000 // n, stream=stream, n=n)
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
